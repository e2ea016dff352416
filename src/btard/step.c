/* The verified step over the runtime: commitments, the step's MPRNG seed,
 * the aggregators' checks, the members' reports and the verdict (see
 * apiary/btard.h and docs/btard.md). */
#include "apiary/log.h"
#include "btard/step_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_PHASE_US 5000000u
#define PEND_PER_PEER    8
#define PEND_MAX         256

static const uint8_t zero_hash[H];

static void sign_cb(void *arg, const uint8_t *msg, size_t len, uint8_t sig[AP_ED25519_SIG_LEN])
{
    ap_rt_sign(arg, msg, len, sig);
}

static void call_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    (void)rt, (void)arg, (void)status, (void)resp, (void)len, (void)errmsg;
}

/* To members lo..hi-1 but this node and skip. */
static void send_range(step_t *s, const uint8_t *b, size_t len, const ap_peer_id_t *skip, size_t lo,
                       size_t hi)
{
    ap_rpc_opts_t o = {.timeout_us = s->cfg.phase_timeout_us, .max_resp = 16};
    for (size_t i = lo; i < hi && i < s->n; i++) {
        if (i == s->self || (skip && ap_peer_id_eq(skip, &s->peers[i]))) continue;
        (void)ap_rt_rpc_call(s->svc->rt, &s->peers[i], AP_BTARD_STEP_PROTO, b, len, &o, call_done,
                             NULL);
    }
}

static void send_all(step_t *s, const uint8_t *b, size_t len, const ap_peer_id_t *skip)
{
    send_range(s, b, len, skip, 0, s->n);
}

static size_t index_of(const step_t *s, const ap_peer_id_t *p)
{
    for (size_t i = 0; i < s->n; i++)
        if (ap_peer_id_eq(&s->peers[i], p)) return i;
    return s->n;
}

static void step_free(step_t *s)
{
    for (size_t i = 0; s->commit && i < s->n; i++) free(s->commit[i]);
    for (size_t i = 0; s->check && i < s->n; i++) free(s->check[i]);
    for (size_t i = 0; s->check_raw && i < s->n; i++) free(s->check_raw[i]);
    for (size_t i = 0; s->commit_raw && i < s->n; i++) free(s->commit_raw[i]);
    for (size_t i = 0; s->eq_raw && i < s->n; i++) free(s->eq_raw[i]);
    free(s->commit_raw);
    free(s->commit_len);
    free(s->eq_raw);
    free(s->eq_len);
    free(s->eq_first);
    free(s->eq_first_len);
    free(s->commit);
    free(s->check);
    free(s->check_raw);
    for (size_t i = 0; s->report && i < s->n; i++) free(s->report[i]);
    for (size_t i = 0; s->mev && i < s->n; i++) free(s->mev[i]);
    free(s->report);
    free(s->disputed_by);
    free(s->mfault);
    free(s->mev);
    free(s->mev_a);
    free(s->mev_b);
    free(s->grad);
    free(s->check_len);
    free(s->reported);
    free(s->disputes);
    free(s->mine);
    free(s->z);
    free(s->peers);
    free(s->counts);
    free(s->off);
    free(s);
}

static void unlink_step(step_t *s)
{
    for (step_t **pp = &s->svc->steps; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            return;
        }
}

static bool entry_has(const ap__agg_check_t *k, const uint8_t hash[H], double w)
{
    for (uint32_t e = 0; e < k->n; e++)
        if (!memcmp(k->e[e].hash, hash, H) && k->e[e].weight == w) return true;
    return false;
}

bool ap__btard_same_state(const step_t *s, size_t i)
{
    if (!s->has_state || i == s->self) return true;
    const ap__step_commit_t *c = i < s->n ? s->commit[i] : NULL;
    return c && c->has_state && !memcmp(c->state, s->state, H);
}

/* The group's state: the one most commitments in hand name (ties: the
 * smallest hash); the members that committed it into sync. */
static void group_state(const step_t *s, ap_btard_verdict_t *v, ap_peer_id_t *sync)
{
    const uint8_t *best = NULL;
    size_t nbest = 0;
    for (size_t i = 0; i < s->n; i++) {
        const uint8_t *st = i == s->self                              ? s->state
                            : s->commit[i] && s->commit[i]->has_state ? s->commit[i]->state
                                                                      : NULL;
        if (!st) continue;
        size_t k = 0;
        for (size_t q = 0; q < s->n; q++) {
            const uint8_t *o = q == s->self                              ? s->state
                               : s->commit[q] && s->commit[q]->has_state ? s->commit[q]->state
                                                                         : NULL;
            if (o && !memcmp(o, st, H)) k++;
        }
        if (k > nbest || (k == nbest && memcmp(st, best, H) < 0)) {
            best = st;
            nbest = k;
        }
    }
    for (size_t i = 0; best && i < s->n; i++) {
        const uint8_t *st = i == s->self                              ? s->state
                            : s->commit[i] && s->commit[i]->has_state ? s->commit[i]->state
                                                                      : NULL;
        if (st && !memcmp(st, best, H)) sync[v->nin_sync++] = s->peers[i];
    }
    v->in_sync = sync;
    v->out_of_sync = best && memcmp(best, s->state, H) != 0;
    if (v->out_of_sync)
        ap_log(AP_LOG_WARN, "btard",
               "step %llu: this node's state is not the group's (%zu of %zu members committed "
               "another one)",
               (unsigned long long)s->cfg.step, nbest, s->n);
}

/* The verdict from the messages in hand; calls done and frees s. */
static void conclude(step_t *s, int status)
{
    ap_btard_verdict_t v = {.status = status};
    if (s->have_seed) memcpy(v.seed, s->seed, H);
    ap_btard_ban_t *bans = calloc(s->n, sizeof *bans);
    char sh[AP_PEER_SHORT_LEN];
    for (size_t j = 0; status == 0 && j < s->n; j++) {
        if (!s->counts[j]) continue;
        const ap__step_commit_t *c = s->commit[j];
        const ap__agg_check_t *k = s->check[j];
        const char *why = NULL;
        if (!c || !c->has_agg)
            why = "no commitment from its aggregator";
        else if (!k)
            why = "no check from its aggregator";
        else if (memcmp(k->seed, s->seed, H) != 0 || k->tau != s->cfg.tau)
            why = "check on another seed or tau";
        else if (ap_btard_agg_fails(k->e, k->n, k->tau)) {
            why = "projections do not sum to 0";
            if (bans)
                ap__btard_convict(s, bans, &v.nconvicted, j, AP_BTARD_FAULT_BAD_AGGREGATE, 0,
                                  s->check_raw[j], s->check_len[j], NULL, 0);
        } else if (memcmp(k->agg, c->agg, H) != 0)
            why = "check names another aggregate than committed";
        for (size_t i = 0; !why && i < s->n; i++) {
            const ap__step_commit_t *ci = s->commit[i];
            if (!ci) continue;
            if (memcmp(ci->recv[j], k->agg, H) != 0)
                why = "a member received another aggregate";
            else if (memcmp(ci->part[j], zero_hash, H) != 0 &&
                     !entry_has(k, ci->part[j], ci->weight))
                why = "a committed input is missing from the check";
            else if (memcmp(ci->part[j], zero_hash, H) != 0 && !ap__btard_same_state(s, i))
                why = "an input was computed on another state";
        }
        if (!why && s->disputes[j]) {
            why = "disputed";
            v.disputes++;
        }
        if (why) {
            v.parts_failed++;
            ap_log(AP_LOG_INFO, "btard", "step %llu: part of %s failed: %s",
                   (unsigned long long)s->cfg.step, ap_peer_id_short(&s->peers[j], sh), why);
        } else
            v.parts_ok++;
    }
    ap_peer_id_t *excl = calloc(s->n, sizeof *excl);
    if (status == 0 && bans) {
        for (size_t i = 0; i < s->n; i++) {
            ap_btard_fault_t f = (ap_btard_fault_t)s->mfault[i];
            /* only a fault its own signed messages prove convicts; a missed
             * deadline may be a slow or departing honest peer: it was left
             * out of the round, nothing more */
            if (f == AP_BTARD_FAULT_BAD_REVEAL || f == AP_BTARD_FAULT_EQUIVOCATION)
                ap__btard_convict(s, bans, &v.nconvicted, i, f, 1, s->mev[i], s->mev_a[i],
                                  s->mev[i] ? s->mev[i] + s->mev_a[i] : NULL, s->mev_b[i]);
            else if ((f == AP_BTARD_FAULT_NO_COMMIT || f == AP_BTARD_FAULT_NO_REVEAL) && excl) {
                excl[v.nexcluded++] = s->peers[i];
                ap_log(AP_LOG_INFO, "btard", "step %llu: %s excluded (%s), not convicted",
                       (unsigned long long)s->cfg.step, ap_peer_id_short(&s->peers[i], sh),
                       ap_btard_fault_name(f));
            }
        }
        for (size_t i = 0; i < s->n; i++)
            if (s->eq_raw[i])
                ap__btard_convict(s, bans, &v.nconvicted, i, AP_BTARD_FAULT_STEP_EQUIVOCATION, 0,
                                  s->eq_first[i], s->eq_first_len[i], s->eq_raw[i], s->eq_len[i]);
        ap__btard_grad_judge(s, bans, &v.nconvicted, &v.accusations);
    }
    v.excluded = excl;
    ap_peer_id_t *sync = s->has_state ? calloc(s->n, sizeof *sync) : NULL;
    if (sync) group_state(s, &v, sync);
    v.apply = status == 0 && v.parts_failed == 0 && v.nconvicted == 0 && !v.out_of_sync;
    v.bans = bans;
    if (!bans) v.nconvicted = 0;
    for (size_t i = 0; i < v.nconvicted; i++)
        ap_log(AP_LOG_WARN, "btard", "step %llu: %s convicted (%s)",
               (unsigned long long)s->cfg.step, ap_peer_id_short(&bans[i].peer, sh),
               ap_btard_fault_name(bans[i].fault));
    s->cfg.done(s->cfg.arg, &v);
    free(bans);
    free(excl);
    free(sync);
    step_free(s);
}

static void finish(step_t *s, int status)
{
    if (s->finished) return;
    s->finished = true;
    ap_rt_timer_stop(s->svc->rt, s->timer);
    s->timer = 0;
    unlink_step(s);
    conclude(s, status);
}

static void broadcast_own(step_t *s, ap__step_msg_t *m);
static int accept(step_t *s, const ap__step_msg_t *m, const uint8_t *raw, size_t len);

/* AP_BTARD_STEP_EQUIVOCATE: the commitment m (naming the aggregate v) to the
 * first half of the group, one naming v + 0.5 to the second half. */
static void equivocate(step_t *s, ap__step_msg_t *m, const ap_btard_vclip_t *vc)
{
    m->sender = s->peers[s->self];
    uint8_t *b = malloc(AP_BTARD_STEP_MSG_MAX);
    float *w = malloc(vc->d * sizeof *w);
    size_t len = b && w ? ap__step_msg_encode(m, sign_cb, s->svc->rt, b, AP_BTARD_STEP_MSG_MAX) : 0;
    if (len && accept(s, m, b, len) == 1) send_range(s, b, len, NULL, 0, s->n / 2);
    if (len) {
        for (size_t k = 0; k < vc->d; k++) w[k] = vc->out[k] + 0.5f;
        ap_btard_hash_floats(w, vc->d, m->u.commit.agg);
        len = ap__step_msg_encode(m, sign_cb, s->svc->rt, b, AP_BTARD_STEP_MSG_MAX);
        if (len) send_range(s, b, len, NULL, s->n / 2, s->n);
    }
    free(w);
    free(b);
}

static void send_check(step_t *s)
{
    s->sent_check = true;
    const ap_btard_vclip_t *vc = s->cfg.vclip;
    if (!vc || !vc->have || !s->counts[s->self] || vc->d != s->counts[s->self]) return;
    if (!vc->fixed && vc->shift == 0) {
        ap_log(AP_LOG_WARN, "btard", "step %llu: aggregate not at a fixed point; no check sent",
               (unsigned long long)s->cfg.step);
        return;
    }
    ap__step_msg_t *m = calloc(1, sizeof *m);
    if (!m) return;
    m->kind = AP__BTARD_AGG_CHECK;
    ap__agg_check_t *k = &m->u.check;
    memcpy(k->ctx, s->ctx, H);
    k->part = (uint32_t)s->self;
    memcpy(k->seed, s->seed, H);
    ap_btard_hash_floats(vc->out, vc->d, k->agg);
    k->tau = s->cfg.tau;
    ap_btard_direction(s->seed, (uint32_t)s->self, vc->d, s->z);
    k->n = (uint32_t)(vc->n < AP_BTARD_STEP_MAX_PEERS ? vc->n : AP_BTARD_STEP_MAX_PEERS);
    for (uint32_t i = 0; i < k->n; i++) {
        const float *x = vc->copies + (size_t)i * vc->d;
        ap_btard_hash_floats(x, vc->d, k->e[i].hash);
        k->e[i].weight = vc->w[i];
        ap_btard_clip_proj(x, vc->out, s->z, vc->d, s->cfg.tau, &k->e[i].dist, &k->e[i].proj);
    }
    broadcast_own(s, m);
    free(m);
}

/* This node's report: the parts whose check misstates its own input. */
static void send_report(step_t *s)
{
    s->sent_report = true;
    ap__step_msg_t *m = calloc(1, sizeof *m);
    if (!m) return;
    m->kind = AP__BTARD_STEP_REPORT;
    ap__step_report_t *r = &m->u.report;
    memcpy(r->ctx, s->ctx, H);
    for (size_t j = 0; s->cfg.sent && j < s->n; j++) {
        if (j == s->self || !s->counts[j]) continue;
        const ap__agg_check_t *k = s->check[j];
        bool bad = s->cfg.attack == AP_BTARD_STEP_FALSE_DISPUTE;
        if (k && !bad) {
            const float *x = s->cfg.sent + s->off[j], *v = s->cfg.result + s->off[j];
            size_t d = (size_t)s->counts[j];
            const ap_btard_agg_entry_t *e = NULL;
            for (uint32_t q = 0; q < k->n && !e; q++)
                if (!memcmp(k->e[q].hash, s->mine[j], H) && k->e[q].weight == s->cfg.weight)
                    e = &k->e[q];
            if (!e)
                bad = true;
            else {
                double dist, proj;
                ap_btard_direction(s->seed, (uint32_t)j, d, s->z);
                ap_btard_clip_proj(x, v, s->z, d, s->cfg.tau, &dist, &proj);
                /* slack for another CPU's rounding */
                bad = !(fabs(dist - e->dist) <= 1e-9 + 1e-6 * dist) ||
                      !(fabs(proj - e->proj) <= 1e-9 * s->cfg.tau + 1e-6 * fabs(proj));
            }
        }
        if (bad) r->disputed[r->n++] = (uint32_t)j;
    }
    ap__btard_grad_accuse(s, r);
    broadcast_own(s, m);
    free(m);
}

static void on_timer(ap_rt_t *rt, void *arg);

static void arm(step_t *s)
{
    ap_rt_timer_stop(s->svc->rt, s->timer);
    s->timer = ap_rt_timer_start(s->svc->rt, s->cfg.phase_timeout_us, 0, on_timer, s);
}

static bool checks_in(const step_t *s)
{
    for (size_t j = 0; j < s->n; j++)
        if (s->counts[j] && !s->check[j]) return false;
    return true;
}

static bool reports_in(const step_t *s)
{
    for (size_t i = 0; i < s->n; i++)
        if (!s->reported[i]) return false;
    return true;
}

/* Moves the step on as far as the messages in hand allow. */
static void advance(step_t *s)
{
    if (s->finished || !s->have_seed) return;
    if (!s->sent_check) send_check(s);
    if (s->finished) return;
    if (!s->sent_report && checks_in(s)) {
        send_report(s);
        if (s->stage < 2) {
            s->stage = 2;
            arm(s);
        }
    }
    if (s->sent_report && reports_in(s)) finish(s, 0);
}

static void on_timer(ap_rt_t *rt, void *arg)
{
    (void)rt;
    step_t *s = arg;
    s->timer = 0;
    if (s->finished) return;
    if (s->stage == 1) { /* checks overdue: report on what came */
        send_report(s);
        s->stage = 2;
        arm(s);
        advance(s);
        return;
    }
    if (s->stage == 2) finish(s, 0);
}

/* The first signed message of a kind from a member: returns a copy of its
 * decoded form (msg, size bytes) and keeps a copy of its bytes in *raw_slot;
 * NULL (nothing kept) if out of memory. */
static void *keep_first(const void *msg, size_t size, uint8_t **raw_slot, size_t *len_slot,
                        const uint8_t *raw, size_t len)
{
    void *d = malloc(size);
    uint8_t *r = malloc(len);
    if (!d || !r) {
        free(d);
        free(r);
        return NULL;
    }
    memcpy(d, msg, size);
    memcpy(r, raw, len);
    *raw_slot = r;
    *len_slot = len;
    return d;
}

/* A second signed message of a kind member i signed once already (first):
 * 0 if it is the same one (a relayed copy); else, the first time, it is kept
 * as the evidence of a step_equivocation and 1 is returned (relay it, so
 * every member holds both). */
static int second(step_t *s, size_t i, const uint8_t *first, size_t flen, const uint8_t *raw,
                  size_t len)
{
    if (flen == len && !memcmp(first, raw, len)) return 0;
    if (s->eq_raw[i]) return 0;
    s->eq_raw[i] = malloc(len);
    if (!s->eq_raw[i]) return AP_ENOMEM;
    memcpy(s->eq_raw[i], raw, len);
    s->eq_len[i] = len;
    s->eq_first[i] = first;
    s->eq_first_len[i] = flen;
    char sh[AP_PEER_SHORT_LEN];
    ap_log(AP_LOG_WARN, "btard", "step %llu: %s signed two different messages of one kind",
           (unsigned long long)s->cfg.step, ap_peer_id_short(&s->peers[i], sh));
    return 1;
}

/* Takes a decoded message (from = its transport sender, NULL for our own).
 * Returns 1 if it was new (relay it). */
static int accept(step_t *s, const ap__step_msg_t *m, const uint8_t *raw, size_t len)
{
    size_t i = index_of(s, &m->sender);
    if (i == s->n) return AP_EPERM;
    if (m->kind == AP__BTARD_STEP_COMMIT) {
        if (memcmp(m->u.commit.ctx, s->ctx, H) != 0) return AP_EPROTO;
        if (m->u.commit.n != s->n) return AP_EPROTO;
        if (s->commit[i]) return second(s, i, s->commit_raw[i], s->commit_len[i], raw, len);
        s->commit[i] = keep_first(&m->u.commit, sizeof m->u.commit, &s->commit_raw[i],
                                  &s->commit_len[i], raw, len);
        return s->commit[i] ? 1 : AP_ENOMEM;
    }
    if (m->kind == AP__BTARD_AGG_CHECK) {
        if (memcmp(m->u.check.ctx, s->ctx, H) != 0) return AP_EPROTO;
        if (m->u.check.part != i || !s->counts[i]) return AP_EPROTO;
        if (s->check[i]) return second(s, i, s->check_raw[i], s->check_len[i], raw, len);
        s->check[i] = keep_first(&m->u.check, sizeof m->u.check, &s->check_raw[i], &s->check_len[i],
                                 raw, len);
        return s->check[i] ? 1 : AP_ENOMEM;
    }
    if (memcmp(m->u.report.ctx, s->ctx, H) != 0) return AP_EPROTO;
    if (s->reported[i]) return 0;
    s->report[i] = malloc(sizeof **s->report);
    if (!s->report[i]) return AP_ENOMEM;
    *s->report[i] = m->u.report;
    s->reported[i] = true;
    for (uint32_t q = 0; q < m->u.report.n; q++) {
        uint32_t j = m->u.report.disputed[q];
        if (j < s->n && !(s->disputed_by[j] >> i & 1)) {
            s->disputes[j]++;
            s->disputed_by[j] |= 1ull << i;
        }
    }
    return 1;
}

static void broadcast_own(step_t *s, ap__step_msg_t *m)
{
    m->sender = s->peers[s->self];
    uint8_t *b = malloc(AP_BTARD_STEP_MSG_MAX);
    if (!b) return;
    size_t len = ap__step_msg_encode(m, sign_cb, s->svc->rt, b, AP_BTARD_STEP_MSG_MAX);
    if (len && accept(s, m, b, len) == 1) send_all(s, b, len, NULL);
    free(b);
}

static void feed(step_t *s, const ap_peer_id_t *from, const ap__step_msg_t *m, const uint8_t *b,
                 size_t len)
{
    if (s->finished) return;
    int rc = accept(s, m, b, len);
    if (rc < 0) {
        char sh[AP_PEER_SHORT_LEN];
        ap_log(AP_LOG_WARN, "btard", "step: message from %s refused: %s",
               ap_peer_id_short(from, sh), ap_err_name(rc));
        return;
    }
    if (rc == 1) send_all(s, b, len, from);
    advance(s);
}

static void mprng_done(void *arg, int status, const uint8_t seed[AP_BTARD_HASH_LEN],
                       const ap_btard_mprng_t *m)
{
    step_t *s = arg;
    s->mprng_running = false;
    for (size_t i = 0; m && !s->finished && i < s->n; i++) {
        s->mfault[i] = (uint8_t)ap_btard_mprng_fault(m, i);
        const uint8_t *a, *b;
        size_t al, bl;
        if (!s->mfault[i] || ap_btard_mprng_evidence(m, i, &a, &al, &b, &bl) != 0) continue;
        s->mev[i] = malloc(al + bl + 1);
        if (!s->mev[i]) continue;
        memcpy(s->mev[i], a, al);
        memcpy(s->mev[i] + al, b, bl);
        s->mev_a[i] = al;
        s->mev_b[i] = bl;
    }
    if (s->finished) {
        if (!s->cfg.done) step_free(s); /* its service went first */
        return;
    }
    if (status) {
        finish(s, status);
        return;
    }
    memcpy(s->seed, seed, H);
    s->have_seed = true;
    s->stage = 1;
    arm(s);
    advance(s);
}

static step_t *find_step(ap_btard_step_svc_t *svc, const uint8_t ctx[H])
{
    for (step_t *s = svc->steps; s; s = s->next)
        if (!memcmp(s->ctx, ctx, H)) return s;
    return NULL;
}

static const uint8_t *msg_ctx(const ap__step_msg_t *m)
{
    return m->kind == AP__BTARD_STEP_COMMIT ? m->u.commit.ctx
           : m->kind == AP__BTARD_AGG_CHECK ? m->u.check.ctx
                                            : m->u.report.ctx;
}

static void pend_add(ap_btard_step_svc_t *svc, const ap_peer_id_t *from, const uint8_t ctx[H],
                     const uint8_t *b, size_t len)
{
    size_t mine = 0;
    for (spend_t *p = svc->pend; p; p = p->next) mine += ap_peer_id_eq(&p->from, from);
    if (mine >= PEND_PER_PEER) return;
    if (svc->npend >= PEND_MAX) {
        spend_t *old = svc->pend;
        svc->pend = old->next;
        free(old->b);
        free(old);
        svc->npend--;
    }
    spend_t *p = malloc(sizeof *p);
    uint8_t *c = malloc(len ? len : 1);
    if (!p || !c) {
        free(p);
        free(c);
        return;
    }
    p->next = NULL;
    p->from = *from;
    memcpy(p->ctx, ctx, H);
    memcpy(c, b, len);
    p->b = c;
    p->len = len;
    spend_t **pp = &svc->pend;
    while (*pp) pp = &(*pp)->next;
    *pp = p;
    svc->npend++;
}

static void on_rpc(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    ap_btard_step_svc_t *svc = arg;
    size_t len;
    const uint8_t *b = ap_rpc_req_data(req, &len);
    ap_peer_id_t from = *ap_rpc_req_peer(req);
    ap__step_msg_t *m = malloc(sizeof *m);
    if (!m) {
        ap_rpc_respond_error(req, AP_ENOMEM, "no memory");
        return;
    }
    int rc = ap__step_msg_decode(b, len, m);
    if (rc) {
        char sh[AP_PEER_SHORT_LEN];
        ap_log(AP_LOG_WARN, "btard", "step: bad message from %s: %s", ap_peer_id_short(&from, sh),
               ap_err_name(rc));
        ap_rpc_respond_error(req, rc, "bad message");
        free(m);
        return;
    }
    step_t *s = find_step(svc, msg_ctx(m));
    if (s)
        feed(s, &from, m, b, len);
    else
        pend_add(svc, &from, msg_ctx(m), b, len);
    free(m);
    ap_rpc_respond(req, NULL, 0);
}

int ap_btard_step_svc_new(ap_rt_t *rt, ap_btard_svc_t *mprng, ap_btard_step_svc_t **out)
{
    if (!rt || !mprng || !out) return AP_EINVAL;
    ap_btard_step_svc_t *svc = calloc(1, sizeof *svc);
    if (!svc) return AP_ENOMEM;
    svc->rt = rt;
    svc->mprng = mprng;
    int rc = ap_rt_rpc_register(rt, AP_BTARD_STEP_PROTO, AP_BTARD_STEP_MSG_MAX, on_rpc, svc);
    if (rc) {
        free(svc);
        return rc;
    }
    *out = svc;
    return 0;
}

void ap_btard_step_svc_free(ap_btard_step_svc_t *svc)
{
    if (!svc) return;
    ap_rt_rpc_unregister(svc->rt, AP_BTARD_STEP_PROTO);
    while (svc->steps) {
        step_t *s = svc->steps;
        s->finished = true;
        ap_rt_timer_stop(svc->rt, s->timer);
        svc->steps = s->next;
        if (s->mprng_running) {
            /* its MPRNG round still holds s: mprng_done frees it */
            s->cfg.done(s->cfg.arg, &(ap_btard_verdict_t){.status = AP_ECANCELED});
            s->cfg.done = NULL;
            continue;
        }
        conclude(s, AP_ECANCELED);
    }
    while (svc->pend) {
        spend_t *p = svc->pend;
        svc->pend = p->next;
        free(p->b);
        free(p);
    }
    free(svc);
}

int ap_btard_step_start(ap_btard_step_svc_t *svc, const ap_btard_step_cfg_t *cfg)
{
    if (!svc || !cfg || !cfg->peers || !cfg->counts || !cfg->result || !cfg->done || cfg->n < 2 ||
        cfg->n > AP_BTARD_STEP_MAX_PEERS || !isfinite(cfg->tau) || !(cfg->tau > 0) ||
        !isfinite(cfg->weight) || cfg->weight < 0)
        return AP_EINVAL;
    uint8_t ctx[H];
    ap_btard_round_ctx(cfg->run, cfg->step, 0, ctx);
    if (find_step(svc, ctx)) return AP_EEXIST;
    size_t self = cfg->n;
    for (size_t i = 0; i < cfg->n; i++)
        if (ap_peer_id_eq(&cfg->peers[i], ap_rt_self(svc->rt))) self = i;
    if (self == cfg->n) return AP_EINVAL;
    step_t *s = calloc(1, sizeof *s);
    if (!s) return AP_ENOMEM;
    size_t n = cfg->n;
    s->svc = svc;
    s->cfg = *cfg;
    s->cfg.state = NULL;
    s->has_state = cfg->state != NULL;
    if (cfg->state) memcpy(s->state, cfg->state, H);
    if (!s->cfg.phase_timeout_us) s->cfg.phase_timeout_us = DEFAULT_PHASE_US;
    s->n = n;
    s->self = self;
    memcpy(s->ctx, ctx, H);
    ap_btard_round_ctx(cfg->run, cfg->step, 1, s->mprng_ctx);
    s->peers = malloc(n * sizeof *s->peers);
    s->counts = malloc(n * sizeof *s->counts);
    s->off = malloc(n * sizeof *s->off);
    s->commit = calloc(n, sizeof *s->commit);
    s->check = calloc(n, sizeof *s->check);
    s->check_raw = calloc(n, sizeof *s->check_raw);
    s->check_len = calloc(n, sizeof *s->check_len);
    s->commit_raw = calloc(n, sizeof *s->commit_raw);
    s->commit_len = calloc(n, sizeof *s->commit_len);
    s->eq_raw = calloc(n, sizeof *s->eq_raw);
    s->eq_len = calloc(n, sizeof *s->eq_len);
    s->eq_first = calloc(n, sizeof *s->eq_first);
    s->eq_first_len = calloc(n, sizeof *s->eq_first_len);
    s->reported = calloc(n, sizeof *s->reported);
    s->disputes = calloc(n, sizeof *s->disputes);
    s->mine = calloc(n, sizeof *s->mine);
    s->report = calloc(n, sizeof *s->report);
    s->disputed_by = calloc(n, sizeof *s->disputed_by);
    s->mfault = calloc(n, sizeof *s->mfault);
    s->mev = calloc(n, sizeof *s->mev);
    s->mev_a = calloc(n, sizeof *s->mev_a);
    s->mev_b = calloc(n, sizeof *s->mev_b);
    uint64_t maxc = 1, tot = 0;
    for (size_t i = 0; i < n; i++) {
        if (cfg->counts[i] > maxc) maxc = cfg->counts[i];
        tot += cfg->counts[i];
    }
    s->z = maxc <= SIZE_MAX / sizeof(float) ? malloc((size_t)maxc * sizeof(float)) : NULL;
    if (!s->peers || !s->counts || !s->off || !s->commit || !s->check || !s->check_raw ||
        !s->check_len || !s->reported || !s->disputes || !s->mine || !s->z || !s->report ||
        !s->disputed_by || !s->mfault || !s->mev || !s->mev_a || !s->mev_b || !s->commit_raw ||
        !s->commit_len || !s->eq_raw || !s->eq_len || !s->eq_first || !s->eq_first_len) {
        step_free(s);
        return AP_ENOMEM;
    }
    s->total = tot <= SIZE_MAX / sizeof(float) ? (size_t)tot : 0;
    s->grad_for = n;
    if (cfg->grad && cfg->validators) {
        s->grad = s->total ? malloc(s->total * sizeof(float)) : NULL;
        if (!s->grad) {
            step_free(s);
            return AP_ENOMEM;
        }
    }
    memcpy(s->peers, cfg->peers, n * sizeof *s->peers);
    memcpy(s->counts, cfg->counts, n * sizeof *s->counts);
    s->cfg.peers = s->peers;
    s->cfg.counts = s->counts;
    for (size_t i = 0; i < n; i++) s->off[i] = i ? s->off[i - 1] + s->counts[i - 1] : 0;

    ap_btard_round_cfg_t rc = {.peers = s->peers,
                               .n = n,
                               .phase_timeout_us = s->cfg.phase_timeout_us,
                               .attack = cfg->attack == AP_BTARD_STEP_WITHHOLD_REVEAL
                                             ? AP_BTARD_MPRNG_WITHHOLD_REVEAL
                                             : AP_BTARD_MPRNG_HONEST,
                               .done = mprng_done,
                               .arg = s};
    memcpy(rc.ctx, s->mprng_ctx, H);
    int r = ap_btard_round_start(svc->mprng, &rc);
    if (r) {
        step_free(s);
        return r;
    }
    s->mprng_running = true;
    s->next = svc->steps;
    svc->steps = s;

    ap__step_msg_t *m = calloc(1, sizeof *m);
    if (m) {
        m->kind = AP__BTARD_STEP_COMMIT;
        ap__step_commit_t *c = &m->u.commit;
        memcpy(c->ctx, s->ctx, H);
        c->weight = cfg->weight;
        c->n = (uint32_t)n;
        for (size_t j = 0; j < n; j++) {
            if (!s->counts[j]) continue;
            if (cfg->sent) {
                ap_btard_hash_floats(cfg->sent + s->off[j], (size_t)s->counts[j], c->part[j]);
                memcpy(s->mine[j], c->part[j], H);
            }
            ap_btard_hash_floats(cfg->result + s->off[j], (size_t)s->counts[j], c->recv[j]);
        }
        const ap_btard_vclip_t *vc = cfg->vclip;
        if (vc && vc->have && s->counts[self] && vc->d == s->counts[self]) {
            c->has_agg = true;
            ap_btard_hash_floats(vc->out, vc->d, c->agg);
        }
        c->has_state = s->has_state;
        memcpy(c->state, s->state, H);
        if (cfg->attack == AP_BTARD_STEP_EQUIVOCATE && c->has_agg)
            equivocate(s, m, vc);
        else
            broadcast_own(s, m);
        free(m);
    }
    /* messages that came before this step started */
    for (spend_t **pp = &svc->pend; *pp && !s->finished;) {
        spend_t *p = *pp;
        if (memcmp(p->ctx, s->ctx, H) != 0) {
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        svc->npend--;
        ap__step_msg_t *pm = malloc(sizeof *pm);
        if (pm && ap__step_msg_decode(p->b, p->len, pm) == 0) feed(s, &p->from, pm, p->b, p->len);
        free(pm);
        free(p->b);
        free(p);
    }
    return 0;
}
