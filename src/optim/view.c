/* The view of the run: our progress record, the others' records read from
 * the DHT, the estimate of the epoch's progress and the adaptive refresh.
 * Sans-I/O: runtime.h and the DHT only. */
#include "collab_impl.h"

#include "apiary/log.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

bool ap__collab_is_self(const ap_collab_t *c, const ap_peer_id_t *p)
{
    return ap_peer_id_eq(p, ap_rt_self(c->rt));
}

bool ap__collab_fresh(const ap_collab_t *c, size_t i, int64_t now_ms)
{
    return c->view[i].time_ms >= now_ms - c->cfg.stale_ms && !c->view_silent[i];
}

static int cmp_seen(const void *a, const void *b)
{
    return ap_peer_id_cmp(&((const view_seen_t *)a)->peer, &((const view_seen_t *)b)->peer);
}

/* Our wall clock when p's record (as read now) first appeared: the previous
 * view's if the record has not changed since; now if it has; for a peer not
 * seen before, its report time corrected for the worst tolerated skew. */
static int64_t first_seen(const ap_collab_t *c, size_t nprev, const ap_progress_t *p, int64_t now)
{
    view_seen_t key = {.peer = p->peer};
    const view_seen_t *o = nprev ? bsearch(&key, c->seen_prev, nprev, sizeof key, cmp_seen) : NULL;
    if (o) return p->time_ms <= o->time_ms ? o->seen_ms : now;
    int64_t t = p->time_ms + c->cfg.max_skew_ms;
    return t < now ? t : now;
}

/* A record unchanged for AP__REPORT_MISSED of its report intervals (plus the
 * slack): its peer is gone. A record without an interval (older peers) is
 * judged by stale_ms alone. */
static bool silent(const ap_progress_t *p, int64_t seen_ms, int64_t now)
{
    return p->report_ms > 0 &&
           now - seen_ms > AP__REPORT_MISSED * (int64_t)p->report_ms + AP__REPORT_SLACK_MS;
}

void ap__collab_estimate(ap_collab_t *c, ap__estimate_t *e)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    memset(e, 0, sizeof *e);
    e->global = (double)c->local_samples;
    e->reported = c->local_samples;
    e->sps = c->sps;
    e->sps_all = c->cfg.role == AP_AVG_AUX ? 0 : c->sps;
    e->max_epoch = c->epoch;
    e->peers = 1;
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (ap__collab_is_self(c, &p->peer) || !ap__collab_fresh(c, i, now)) continue;
        e->peers++;
        if (p->epoch > e->max_epoch && p->role != AP_AVG_AUX) e->max_epoch = p->epoch;
        if (p->role == AP_AVG_AUX) continue;
        e->sps_all += p->samples_per_s;
        double sps = p->samples_per_s > 0 ? p->samples_per_s : c->sps; /* unknown: like mine */
        if (p->epoch + 1 == c->epoch) {
            e->sps += sps; /* finishing the previous round: joins this epoch soon */
            continue;
        }
        if (p->epoch != c->epoch) continue;
        double ahead = (double)(now > p->time_ms ? now - p->time_ms : 0) / 1000.0;
        e->global += (double)p->samples + p->samples_per_s * ahead;
        e->reported += (uint64_t)p->samples;
        e->sps += sps;
    }
    double left = (double)c->cfg.target_batch_size - e->global;
    e->eta_s = left <= 0 ? 0 : e->sps > 0 ? left / e->sps : INFINITY;
}

void ap__collab_update_stats(ap_collab_t *c)
{
    ap__estimate_t e;
    ap__collab_estimate(c, &e);
    c->st.epoch = c->epoch;
    c->st.local_samples = c->local_samples;
    c->st.global_samples = e.global;
    c->st.global_sps = e.sps_all;
    c->st.eta_s = e.eta_s;
    c->st.peers = e.peers;
}

static void my_record(ap_collab_t *c, ap_progress_t *p)
{
    memset(p, 0, sizeof *p);
    p->peer = *ap_rt_self(c->rt);
    p->epoch = c->epoch;
    p->samples = (int64_t)c->local_samples;
    p->samples_per_s = c->sps;
    p->time_ms = ap_rt_wall_ms(c->rt);
    p->epoch_start_ms = c->epoch_start_ms < p->time_ms ? c->epoch_start_ms : p->time_ms;
    p->role = c->cfg.role;
    p->up = c->cfg.up;
    p->down = c->cfg.down;
    p->donor = c->cfg.role == AP_AVG_NORMAL && c->started;
    p->ready_ms = c->ready_ms;
    p->refused = c->refused;
    p->loss = c->st.last_loss;
    p->has_loss = c->has_loss;
    p->bytes_sent = c->st.bytes_sent;
    p->bytes_received = c->st.bytes_received;
    p->rounds = c->st.rounds;
    p->rounds_failed = c->st.epochs_failed;
    p->last_group = c->st.last_group_size;
    p->last_round_ms = c->st.last_round_ms;
    p->last_fraction = (float)c->st.last_averaged_fraction;
    p->report_ms = (uint32_t)c->report_ms;
    p->has_config = true;
    p->config = c->runcfg;
    p->has_token = c->has_token;
    if (c->has_token) p->token = c->token;
    for (size_t i = 0; i < c->nshun; i++)
        if (c->shun[i].until > c->epoch) p->left_out[p->nleft_out++] = c->shun[i].peer;
    if (p->ready_ms && p->ready_ms < p->epoch_start_ms) p->ready_ms = p->epoch_start_ms;
    if (p->ready_ms > p->time_ms) p->ready_ms = p->time_ms;
    /* Readers refuse more samples than 2·speed·(epoch time + 1 s) + 1
     * (ap_progress_decode). The speed is a moving average over submits, so
     * after a burst (a large batch, then small or slow ones) it can fall
     * below half the epoch's mean rate though every sample is real: report
     * at least that bound, the epoch's mean halved. */
    double el = (double)(p->time_ms - p->epoch_start_ms) / 1000.0 + 1.0;
    double floor_sps = (double)p->samples / (2.0 * el);
    if (p->samples_per_s < floor_sps) p->samples_per_s = floor_sps;
    if (p->samples_per_s > AP_PROGRESS_MAX_SPS) p->samples_per_s = AP_PROGRESS_MAX_SPS;
}

/* Keeps our own entry of the view current (the DHT read may lag our store). */
static void view_put_self(ap_collab_t *c)
{
    ap_progress_t me;
    my_record(c, &me);
    size_t i = 0;
    while (i < c->nview && !ap__collab_is_self(c, &c->view[i].peer)) i++;
    if (i == AP__VIEW_MAX) return;
    if (i == c->nview) c->nview++;
    c->view[i] = me;
    c->view_seen[i] = me.time_ms;
    c->view_silent[i] = false;
}

typedef struct op_ctx {
    ap_collab_t *c;
    ap__step_fn next;
} op_ctx_t;

static void store_done(ap_dht_t *dht, void *arg, int status, int nstored)
{
    op_ctx_t *o = arg;
    ap_collab_t *c = o->c;
    ap__step_fn next = o->next;
    free(o);
    if (!c->dead) {
        if (status) ap_debug(OPT_MOD, "progress store failed: %s", ap_strerror(status));
        if (next) next(c);
    }
    ap__collab_unref(c);
}

/* Stores our progress record; next (may be NULL) runs when the store ends. */
void ap__collab_report(ap_collab_t *c, ap__step_fn next)
{
    ap_progress_t me;
    uint8_t val[AP__PROGRESS_MAX];
    my_record(c, &me);
    view_put_self(c);
    int len = ap_progress_encode(&me, val, sizeof val);
    int64_t exp = me.time_ms + c->cfg.progress_ttl_ms;
    if (exp <= c->last_exp_ms) exp = c->last_exp_ms + 1;
    c->last_exp_ms = exp;
    c->last_report_us = ap_rt_now_us(c->rt);
    ap_dht_record_t rec = {.key = (const uint8_t *)c->key,
                           .key_len = c->key_len,
                           .subkey = (const uint8_t *)c->subkey,
                           .subkey_len = c->subkey_len,
                           .value = val,
                           .value_len = (size_t)(len > 0 ? len : 0),
                           .expiration_ms = exp};
    op_ctx_t *o = malloc(sizeof *o);
    int rc = o ? ap_dht_store(c->dht, &rec, store_done, o) : AP_ENOMEM;
    if (rc) {
        free(o);
        ap_debug(OPT_MOD, "progress store refused: %s", ap_strerror(rc));
        if (next) next(c);
        return;
    }
    o->c = c;
    o->next = next;
    c->refs++;
}

/* A peer of another configuration: refused, logged once per (peer,
 * configuration) with the first differing field and both values. */
static void refuse_peer(ap_collab_t *c, const ap_progress_t *p, char *why, size_t cap)
{
    char sh[AP_PEER_SHORT_LEN], at[AP_PEER_SHORT_LEN + 8];
    ap_peer_id_short(&p->peer, sh);
    snprintf(at, sizeof at, "at %s", sh);
    if (!p->has_config)
        snprintf(why, cap, "configuration: announced here, none at %s", sh);
    else
        ap_run_config_diff(&c->runcfg, "here", &p->config, at, why, cap);
    for (int i = 0; i < c->nrefused_log; i++)
        if (ap_peer_id_eq(&c->refused_log[i].id, &p->peer) &&
            memcmp(c->refused_log[i].digest, p->config_digest, AP_RUN_CONFIG_DIGEST_LEN) == 0)
            return; /* logged already */
    int k =
        c->nrefused_log < AP__REFUSED_LOG ? c->nrefused_log++ : c->refused_next++ % AP__REFUSED_LOG;
    c->refused_log[k].id = p->peer;
    memcpy(c->refused_log[k].digest, p->config_digest, AP_RUN_CONFIG_DIGEST_LEN);
    c->st.peers_refused++;
    ap_warn(OPT_MOD,
            "refusing peer %s: its run configuration differs (%s); it takes no part in "
            "this peer's rounds, estimates or downloads",
            sh, why);
}

static void absorb(ap_collab_t *c, const ap_dht_result_t *res)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    /* when each record of the previous view last changed, by peer */
    size_t nprev = 0;
    for (size_t i = 0; i < c->nview; i++)
        c->seen_prev[nprev++] = (view_seen_t){
            .peer = c->view[i].peer, .time_ms = c->view[i].time_ms, .seen_ms = c->view_seen[i]};
    qsort(c->seen_prev, nprev, sizeof *c->seen_prev, cmp_seen);
    size_t m = 0;
    int n_match = 0, n_diff = 0, n_ahead = 0;
    char why[AP_RUN_CONFIG_MSG_MAX], first_why[AP_RUN_CONFIG_MSG_MAX] = "";
    for (size_t i = 0; res && res->found && res->is_dict && i < res->nrecords && m < AP__VIEW_MAX;
         i++) {
        const ap_dht_record_t *r = &res->records[i];
        /* subkey "[owner:<id>]" (the DHT checked the owner's signature) */
        char idtxt[AP_PEER_ID_STR_MAX];
        if (r->subkey_len < 9 || r->subkey_len - 8 >= sizeof idtxt ||
            memcmp(r->subkey, "[owner:", 7) != 0 || r->subkey[r->subkey_len - 1] != ']')
            continue;
        memcpy(idtxt, r->subkey + 7, r->subkey_len - 8);
        idtxt[r->subkey_len - 8] = 0;
        ap_progress_t p;
        if (ap_peer_id_parse(&p.peer, idtxt) != 0) continue;
        ap_peer_id_t who = p.peer;
        int rc = ap_progress_decode(r->value, r->value_len, now, c->cfg.max_skew_ms, &p);
        if (rc) {
            char sh[AP_PEER_SHORT_LEN];
            c->st.records_refused++;
            ap_warn(OPT_MOD, "refused progress record of %s: %s (impossible progress)",
                    ap_peer_id_short(&who, sh), ap_strerror(rc));
            continue;
        }
        p.peer = who;
        /* a banned peer (byzantine-tolerant) is not part of the run: its
         * epoch, samples and state count for nothing (it trains alone and
         * races ahead; downloading its state would undo the ban) */
        if (ap__btard_banned(c, &who)) continue;
        int no = ap__closed_check(c, &who, p.has_token ? &p.token : NULL);
        if (no && !ap__collab_is_self(c, &who)) {
            /* closed run: no valid token, or revoked: not part of this run */
            c->st.unauthorized_records++;
            ap__closed_note(c, &who, no, "the progress record");
            continue;
        }
        if (!ap__collab_is_self(c, &p.peer)) {
            bool same = p.has_config &&
                        memcmp(p.config_digest, c->cfg_digest, AP_RUN_CONFIG_DIGEST_LEN) == 0;
            bool live = p.time_ms >= now - c->cfg.stale_ms && !p.refused;
            if (!same) {
                refuse_peer(c, &p, why, sizeof why);
                if (live && !n_diff++) memcpy(first_why, why, sizeof why);
                if (live && p.epoch > c->epoch) n_ahead++;
                continue;
            }
            if (p.refused) continue; /* stopped: counts for nothing */
            n_match += live;
        }
        c->view_seen[m] = first_seen(c, nprev, &p, now);
        c->view_silent[m] = silent(&p, c->view_seen[m], now);
        c->view[m++] = p;
    }
    /* alone against the run: no live peer agrees with this one, and it is
     * joining (not started yet) or some peer that differs is ahead of it
     * (the run was there first) */
    if (!c->refused && !c->shut_out && n_diff > 0 && n_match == 0 && (!c->started || n_ahead > 0)) {
        c->refused = true;
        snprintf(c->refusal, sizeof c->refusal,
                 "run configuration differs from the run's (%d peer(s) differ, %d agree): %s",
                 n_diff, n_match, first_why);
        ap_error(OPT_MOD, "refused by the run: %s; this peer stops", c->refusal);
    }
    c->nview = m;
    c->view_at_us = ap_rt_now_us(c->rt);
    bool others = false;
    for (size_t i = 0; i < m && !others; i++)
        others = !ap__collab_is_self(c, &c->view[i].peer) && ap__collab_fresh(c, i, now);
    if (others) {
        c->others_seen_us = c->view_at_us;
    } else if (c->others_seen_us) {
        c->alone_since_us = c->others_seen_us; /* the last view that had one */
        c->others_seen_us = 0;
    }
    view_put_self(c);
    ap__collab_update_stats(c);
}

static void get_done(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res)
{
    op_ctx_t *o = arg;
    ap_collab_t *c = o->c;
    ap__step_fn next = o->next;
    free(o);
    if (!c->dead) {
        c->fetching = false;
        if (status == 0)
            absorb(c, res);
        else
            ap_debug(OPT_MOD, "progress fetch failed: %s", ap_strerror(status));
        if (next) next(c);
    }
    ap__collab_unref(c);
}

/* A closed run reads the owner's revocations with the records. */
static void get_many_done(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res,
                          size_t n)
{
    op_ctx_t *o = arg;
    if (!o->c->dead && status == 0 && n == 2) ap__closed_absorb_revoked(o->c, &res[1]);
    get_done(dht, arg, status, n >= 1 ? &res[0] : NULL);
}

void ap__collab_fetch(ap_collab_t *c, ap__step_fn next)
{
    op_ctx_t *o = malloc(sizeof *o);
    const uint8_t *keys[2] = {(const uint8_t *)c->key, (const uint8_t *)c->revoked_key};
    size_t lens[2] = {c->key_len, c->revoked_key_len};
    int rc = !o ? AP_ENOMEM
             : c->closed
                 ? ap_dht_get_many(c->dht, keys, lens, 2, true, get_many_done, o)
                 : ap_dht_get(c->dht, (const uint8_t *)c->key, c->key_len, true, get_done, o);
    if (rc) {
        free(o);
        if (next) next(c);
        return;
    }
    o->c = c;
    o->next = next;
    c->fetching = true;
    c->refs++;
}

/* The first READY time among the records of this epoch (0 = none). */
int64_t ap__collab_first_ready(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt), first = 0;
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (p->epoch != c->epoch || p->ready_ms <= 0 || !ap__collab_fresh(c, i, now)) continue;
        if (!first || p->ready_ms < first) first = p->ready_ms;
    }
    return first;
}

/* Someone of this epoch is READY and the group is still open. */
bool ap__collab_gathering(ap_collab_t *c)
{
    int64_t first = ap__collab_first_ready(c);
    return first && ap_rt_wall_ms(c->rt) <= first + (int64_t)(c->cfg.matchmaking_window_us / 1000);
}

/* ---- adaptive refresh ---------------------------------------------------------- */

void ap__collab_aux_check(ap_collab_t *c)
{
    /* An auxiliary peer follows the others' epoch and joins every round. */
    if (c->phase != PH_IDLE || c->refused || c->shut_out) return;
    ap__estimate_t e;
    ap__collab_estimate(c, &e);
    if (e.max_epoch > c->epoch) {
        ap__collab_enter_epoch(c, AP__EPOCH_FOLLOWED, e.max_epoch, 0);
        ap__collab_report(c, NULL);
        return;
    }
    if (e.reported >= c->cfg.target_batch_size || ap__collab_gathering(c)) {
        c->aux_in_round = true;
        ap__collab_begin_averaging(c);
    }
}

static void refresh_fetched(ap_collab_t *c)
{
    if (c->cfg.role == AP_AVG_AUX) ap__collab_aux_check(c);
    ap__collab_schedule_refresh(c);
}

/* How often the view is read: a third of the ETA, within the configured
 * bounds. */
static uint64_t view_period(const ap_collab_t *c)
{
    double eta = c->st.eta_s;
    /* no speed known yet: look again soon */
    uint64_t p = isfinite(eta) ? (uint64_t)(eta * 1e6 / 3) : c->cfg.min_refresh_us;
    if (p < c->cfg.min_refresh_us) p = c->cfg.min_refresh_us;
    if (p > c->cfg.max_refresh_us) p = c->cfg.max_refresh_us;
    return p;
}

/* The timer's period: the view's, and at most half our report interval, so
 * that our record never goes longer than report_ms without a new one (in
 * every phase: also during rounds, waits and downloads). */
static uint64_t tick_period(const ap_collab_t *c)
{
    uint64_t p = view_period(c), r = (uint64_t)c->report_ms * 1000 / 2;
    return p < r ? p : r;
}

static void refresh_tick(ap_rt_t *rt, void *arg)
{
    ap_collab_t *c = arg;
    c->refresh_timer = 0;
    uint64_t now = ap_rt_now_us(rt), tick = tick_period(c);
    if (now - c->last_report_us >= (uint64_t)c->report_ms * 1000 / 2) ap__collab_report(c, NULL);
    /* a submit may have read the view recently: no second read then */
    if (!c->fetching && c->phase == PH_IDLE && now - c->view_at_us + tick / 2 >= view_period(c))
        ap__collab_fetch(c, refresh_fetched);
    else
        ap__collab_schedule_refresh(c);
}

void ap__collab_schedule_refresh(ap_collab_t *c)
{
    if (c->dead || c->refresh_timer) return;
    c->refresh_timer = ap_rt_timer_start(c->rt, tick_period(c), 0, refresh_tick, c);
}
