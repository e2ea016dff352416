/* State sharing: donors serve parts of [params | optimizer state] over
 * streams; a newcomer downloads parts from several donors at once into a
 * buffer of the caller and re-requests what a failed donor did not deliver
 * from another one. A failed donor is dropped for the rest of the download
 * and left out of later downloads for a back-off that doubles per failure.
 * The download writes nothing of the optimizer: it reports (status, epoch,
 * optimizer step) and the caller applies the epoch change (epoch.c). */
#include "collab_impl.h"

#include "apiary/log.h"

#include "optim.pb-c.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HELLO_MAX 1024 /* a StateRequest: 32-byte hash, 4 varints, a RunConfig (< 512) */

/* ---- donor side ------------------------------------------------------------------ */

static void serve_pump(serve_ctx_t *sc)
{
    while (sc->sent < sc->count) {
        uint64_t k = sc->count - sc->sent;
        if (k > AP__STATE_CHUNK) k = AP__STATE_CHUNK;
        int rc = ap_stream_send(sc->s, (const uint8_t *)(sc->snap + sc->sent), k * sizeof(float));
        if (rc == AP_EAGAIN) return;
        if (rc) {
            ap_stream_reset(sc->s, rc);
            return;
        }
        sc->sent += k;
        if (sc->c) sc->c->st.bytes_served += k * sizeof(float);
    }
    if (!sc->hash_sent) {
        if (ap_stream_send(sc->s, sc->hash, sizeof sc->hash) == AP_EAGAIN) return;
        sc->hash_sent = true;
        ap_stream_close(sc->s);
    }
}

static void serve_writable(ap_stream_t *s, void *arg)
{
    serve_pump(arg);
}

static void serve_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t len)
{
    ap_stream_reset(s, AP_EPROTO); /* the requester sends nothing after its hello */
}

static void serve_close(ap_stream_t *s, void *arg, int status)
{
    serve_ctx_t *sc = arg;
    ap_collab_t *c = sc->c;
    if (c) {
        for (int i = 0; i < AP__MAX_SERVING; i++)
            if (c->serving[i] == sc) c->serving[i] = NULL;
    }
    free(sc->snap);
    free(sc);
    if (c) ap__collab_unref(c);
}

static const ap_stream_cbs_t serve_cbs = {
    .on_msg = serve_msg, .on_writable = serve_writable, .on_close = serve_close};

/* A state request must carry the requester's run configuration, equal to
 * this peer's (the same check as for progress records: a peer of another
 * configuration gets no state). Names the first differing field in why. */
static int config_check(ap_collab_t *c, const Apiary__Optim__RunConfig *m, const char *sh,
                        char *why, size_t cap)
{
    if (!m) {
        snprintf(why, cap, "configuration: announced here, none at %s", sh);
        return AP_ECONFIG;
    }
    ap_run_config_t theirs;
    int rc = ap__run_config_from_pb(m, &theirs);
    if (rc) {
        snprintf(why, cap, "configuration: undecodable from %s (%s)", sh, ap_strerror(rc));
        return AP_ECONFIG;
    }
    uint8_t d[AP_RUN_CONFIG_DIGEST_LEN];
    ap_run_config_digest(&theirs, d);
    if (memcmp(d, c->cfg_digest, AP_RUN_CONFIG_DIGEST_LEN) == 0) return 0;
    char at[AP_PEER_SHORT_LEN + 8];
    snprintf(at, sizeof at, "at %s", sh);
    ap_run_config_diff(&c->runcfg, "here", &theirs, at, why, cap);
    return AP_ECONFIG;
}

static int serve_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                        const uint8_t *hello, size_t len)
{
    ap_collab_t *c = arg;
    char sh[AP_PEER_SHORT_LEN];
    ap_peer_id_short(peer, sh);
    if (!c->started || c->dead) return AP_ESTATE;
    Apiary__Optim__StateRequest *rq = apiary__optim__state_request__unpack(NULL, len, hello);
    if (!rq) {
        ap_warn(OPT_MOD, "state request from %s: undecodable", sh);
        return AP_EPROTO;
    }
    int rc = 0;
    char why[256] = "";
    if (c->closed) {
        /* closed run: the requester's own token (the stream's peer is
         * authenticated by the transport) */
        ap_run_token_t t;
        bool has = rq->token.len && ap_run_token_unpack(rq->token.data, rq->token.len, &t) == 0;
        int no = ap__closed_check(c, peer, has ? &t : NULL);
        if (no) {
            apiary__optim__state_request__free_unpacked(rq, NULL);
            c->st.unauthorized_requests++;
            ap__closed_note(c, peer, no, "the state request");
            return AP_EPERM;
        }
    }
    if (rq->run_hash.len != 32 || memcmp(rq->run_hash.data, c->run_hash, 32) != 0)
        rc = AP_ENOTFOUND;
    else if ((rc = config_check(c, rq->config, sh, why, sizeof why)) != 0)
        ;
    else if (rq->n_params != c->n || rq->state_count != c->opt->state_count)
        rc = AP_EINVAL;
    else if (rq->count == 0 || rq->offset > c->total || rq->count > c->total - rq->offset)
        rc = AP_ERANGE;
    uint64_t off = rq->offset, cnt = rq->count;
    apiary__optim__state_request__free_unpacked(rq, NULL);
    if (rc == AP_ECONFIG) {
        ap_warn(OPT_MOD, "state request from %s refused: its run configuration differs (%s)", sh,
                why);
        return rc;
    }
    if (rc) {
        ap_warn(OPT_MOD, "state request from %s refused: %s", sh, ap_strerror(rc));
        return rc;
    }
    int slot = -1;
    for (int i = 0; i < AP__MAX_SERVING; i++)
        if (!c->serving[i]) {
            slot = i;
            break;
        }
    if (slot < 0) return AP_EBUSY;
    serve_ctx_t *sc = calloc(1, sizeof *sc);
    float *snap = malloc(cnt * sizeof(float));
    if (!sc || !snap) {
        free(sc);
        free(snap);
        return AP_ENOMEM;
    }
    /* snapshot now: params and state only change on this thread */
    uint64_t from_params = off < c->n ? (c->n - off < cnt ? c->n - off : cnt) : 0;
    if (from_params) memcpy(snap, ap__collab_cur_params(c) + off, from_params * sizeof(float));
    if (cnt > from_params)
        memcpy(snap + from_params, c->opt->state + (off + from_params - c->n),
               (cnt - from_params) * sizeof(float));
    crypto_generichash(sc->hash, 32, (const uint8_t *)snap, cnt * sizeof(float), NULL, 0);
    sc->c = c;
    sc->s = s;
    sc->snap = snap;
    sc->count = cnt;
    c->serving[slot] = sc;
    c->refs++;
    ap_stream_set_cbs(s, &serve_cbs, sc);

    Apiary__Optim__StateHeader h = APIARY__OPTIM__STATE_HEADER__INIT;
    h.epoch = c->epoch;
    h.n_params = c->n;
    h.state_count = c->opt->state_count;
    h.optim_step = c->opt->step;
    h.optim_kind = (uint32_t)c->opt->cfg.kind;
    h.offset = off;
    h.count = cnt;
    uint8_t hb[128];
    size_t hl = apiary__optim__state_header__pack(&h, hb);
    ap_stream_send(s, hb, hl);
    ap_debug(OPT_MOD, "serving state part [%llu, +%llu) of epoch %llu to %s",
             (unsigned long long)off, (unsigned long long)cnt, (unsigned long long)c->epoch, sh);
    serve_pump(sc);
    return 0;
}

int ap__state_listen(ap_collab_t *c)
{
    ap_stream_opts_t o = {0};
    o.max_msg = HELLO_MAX;
    o.window = 1u << 20;
    return ap_rt_stream_listen(c->rt, AP_COLLAB_STATE_PROTO, &o, serve_accept, c);
}

void ap__state_unlisten(ap_collab_t *c)
{
    ap_rt_stream_unlisten(c->rt, AP_COLLAB_STATE_PROTO);
}

void ap__state_abort_serving(ap_collab_t *c)
{
    for (int i = 0; i < AP__MAX_SERVING; i++) {
        serve_ctx_t *sc = c->serving[i];
        if (!sc) continue;
        c->serving[i] = NULL;
        ap_stream_reset(sc->s, AP_ECANCELED); /* on_close frees sc (now or later) */
    }
}

/* ---- newcomer side ------------------------------------------------------------------ */

typedef struct range_ref {
    ap_collab_t *c;
    int r;
} range_ref_t;

static void dl_finish(ap_collab_t *c, int status);
static void dl_pump(ap_collab_t *c);

static int donors_left(const ap_collab_t *c)
{
    int k = 0;
    for (int i = 0; i < c->dl.ndonors; i++) k += !c->dl.donor_bad[i];
    return k;
}

static donor_memo_t *memo_find(ap_collab_t *c, const ap_peer_id_t *id)
{
    for (int i = 0; i < c->nmemo; i++)
        if (ap_peer_id_eq(&c->memo[i].id, id)) return &c->memo[i];
    return NULL;
}

/* A donor failed: back off from it (the oldest entry makes room). */
static void memo_fail(ap_collab_t *c, const ap_peer_id_t *id, const char *why)
{
    uint64_t now = ap_rt_now_us(c->rt);
    donor_memo_t *m = memo_find(c, id);
    if (!m) {
        if (c->nmemo < AP__DONOR_MEMO) {
            m = &c->memo[c->nmemo++];
        } else {
            m = &c->memo[0];
            for (int i = 1; i < c->nmemo; i++)
                if (c->memo[i].until_us < m->until_us) m = &c->memo[i];
        }
        memset(m, 0, sizeof *m);
        m->id = *id;
    }
    if (m->fails < 32) m->fails++;
    uint64_t wait = AP__BACKOFF_MIN_US << (m->fails - 1 < 8 ? m->fails - 1 : 8);
    if (wait > AP__BACKOFF_MAX_US) wait = AP__BACKOFF_MAX_US;
    m->until_us = now + wait;
    snprintf(m->why, sizeof m->why, "%s", why);
    c->st.state_donor_failures++;
}

static void memo_ok(ap_collab_t *c, const ap_peer_id_t *id)
{
    donor_memo_t *m = memo_find(c, id);
    if (m) *m = c->memo[--c->nmemo];
}

static bool backed_off(ap_collab_t *c, const ap_peer_id_t *id)
{
    donor_memo_t *m = memo_find(c, id);
    return m && m->until_us > ap_rt_now_us(c->rt);
}

static void range_fail(ap_collab_t *c, dl_range_t *r, const char *why)
{
    if (r->donor >= 0) {
        char sh[AP_PEER_SHORT_LEN];
        const ap_peer_id_t *d = &c->dl.donors[r->donor];
        bool first = !c->dl.donor_bad[r->donor];
        c->dl.donor_bad[r->donor] = true;
        if (first) memo_fail(c, d, why);
        ap_warn(OPT_MOD,
                "state part [%llu, +%llu) from %s failed: %s; dropping that donor for this "
                "download (%d of %d left)",
                (unsigned long long)r->offset, (unsigned long long)r->count,
                ap_peer_id_short(d, sh), why, donors_left(c), c->dl.ndonors);
    }
    /* the rest becomes a new request */
    r->offset += r->received;
    r->count -= r->received;
    r->received = 0;
    r->donor = -1;
    r->hdr = r->hashed = false;
}

static void refuse_part(ap_collab_t *c, dl_range_t *r, int err, const char *why)
{
    c->st.state_parts_refused++;
    range_fail(c, r, why);
    /* data of a refused part is not trusted: drop what it delivered */
    if (r->s) {
        ap_stream_t *s = r->s;
        r->s = NULL;
        ap_stream_reset(s, err);
    }
}

static void dl_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t len)
{
    range_ref_t *rr = arg;
    ap_collab_t *c = rr->c;
    if (!c || !c->dl.active) return;
    dl_range_t *r = &c->dl.ranges[rr->r];
    if (r->s != s) return;
    if (!r->hdr) {
        Apiary__Optim__StateHeader *h = apiary__optim__state_header__unpack(NULL, len, d);
        if (!h) {
            refuse_part(c, r, AP_EPROTO, "undecodable header");
            return;
        }
        const char *bad = NULL;
        if (h->n_params != c->n || h->state_count != c->opt->state_count)
            bad = "wrong-shaped state";
        else if (h->optim_kind != (uint32_t)c->opt->cfg.kind)
            bad = "other optimizer";
        else if (h->offset != r->offset || h->count != r->count)
            bad = "other part than requested";
        else if (h->epoch < c->dl.min_epoch)
            bad = "older epoch than needed";
        else if (c->dl.have_epoch && h->epoch != c->dl.epoch)
            bad = "other epoch than the other donors";
        if (!bad && !c->dl.have_epoch) {
            c->dl.have_epoch = true;
            c->dl.epoch = h->epoch;
            c->dl.optim_step = h->optim_step;
        }
        apiary__optim__state_header__free_unpacked(h, NULL);
        if (bad) {
            refuse_part(c, r, AP_EINVAL, bad);
            return;
        }
        r->hdr = true;
        crypto_generichash_init(&r->hs, NULL, 0, 32);
        return;
    }
    if (r->received == r->count) {
        uint8_t want[32];
        crypto_generichash_final(&r->hs, want, 32);
        if (len != 32 || sodium_memcmp(want, d, 32) != 0) {
            r->received = 0; /* nothing of it is trusted */
            refuse_part(c, r, AP_ECORRUPT, "checksum mismatch (corrupt part)");
            return;
        }
        r->hashed = true;
        return;
    }
    uint64_t k = len / sizeof(float);
    if (len % sizeof(float) || k == 0 || len > AP__STATE_CHUNK * sizeof(float) ||
        k > r->count - r->received) {
        r->received = 0;
        refuse_part(c, r, AP_EPROTO, "bad chunk size");
        return;
    }
    float *dst = c->dl.dst + r->offset + r->received;
    memcpy(dst, d, len);
    for (uint64_t i = 0; i < k; i++)
        if (!isfinite(dst[i])) {
            r->received = 0;
            refuse_part(c, r, AP_ENONFINITE, "non-finite values");
            return;
        }
    crypto_generichash_update(&r->hs, d, len);
    r->received += k;
}

static void dl_close(ap_stream_t *s, void *arg, int status)
{
    range_ref_t *rr = arg;
    ap_collab_t *c = rr->c;
    int ri = rr->r;
    free(rr);
    if (!c) return;
    c->dl.open_streams--;
    if (c->dl.active) {
        dl_range_t *r = &c->dl.ranges[ri];
        if (r->s == s) {
            r->s = NULL;
            if (r->hashed && r->received == r->count) {
                r->done = true;
                if (r->donor >= 0) memo_ok(c, &c->dl.donors[r->donor]);
            } else {
                /* keep what arrived (the channel is authenticated) and
                 * ask another donor for the rest */
                range_fail(c, r, status ? ap_strerror(status) : "closed early");
            }
        }
        dl_pump(c);
    }
    ap__collab_unref(c);
}

static void dl_end(ap_stream_t *s, void *arg)
{
    ap_stream_close(s); /* the donor is done: end our side too */
}

static const ap_stream_cbs_t dl_cbs = {.on_msg = dl_msg, .on_end = dl_end, .on_close = dl_close};

static int pick_donor(ap_collab_t *c, int hint)
{
    for (int k = 0; k < c->dl.ndonors; k++) {
        int d = (hint + k) % c->dl.ndonors;
        if (!c->dl.donor_bad[d]) return d;
    }
    return -1;
}

static int open_range(ap_collab_t *c, int ri)
{
    dl_range_t *r = &c->dl.ranges[ri];
    int d = pick_donor(c, ri);
    if (d < 0) return AP_EUNREACH;
    Apiary__Optim__StateRequest rq = APIARY__OPTIM__STATE_REQUEST__INIT;
    rq.run_hash.data = c->run_hash;
    rq.run_hash.len = 32;
    rq.offset = r->offset;
    rq.count = r->count;
    rq.n_params = c->n;
    rq.state_count = c->opt->state_count;
    Apiary__Optim__RunConfig cfg;
    ap__run_config_to_pb(&c->runcfg, &cfg);
    rq.config = &cfg;
    uint8_t tok[AP_RUN_TOKEN_MAX];
    if (c->has_token) {
        int tl = ap_run_token_pack(&c->token, tok, sizeof tok);
        if (tl < 0) return tl;
        rq.token.data = tok;
        rq.token.len = (size_t)tl;
    }
    if (apiary__optim__state_request__get_packed_size(&rq) > HELLO_MAX) return AP_EMSGSIZE;
    uint8_t hello[HELLO_MAX];
    size_t hl = apiary__optim__state_request__pack(&rq, hello);
    range_ref_t *rr = malloc(sizeof *rr);
    if (!rr) return AP_ENOMEM;
    rr->c = c;
    rr->r = ri;
    ap_stream_opts_t o = {0};
    o.max_msg = AP__STATE_CHUNK * sizeof(float) + 64;
    o.window = 4u << 20;
    o.open_timeout_us = 10000000;
    r->donor = d;
    r->hdr = r->hashed = false;
    ap_stream_t *s = NULL;
    c->refs++;
    c->dl.open_streams++;
    int rc = ap_rt_stream_open(c->rt, &c->dl.donors[d], AP_COLLAB_STATE_PROTO, hello, hl, &o,
                               &dl_cbs, rr, &s);
    if (rc) {
        c->dl.open_streams--;
        c->refs--;
        free(rr);
        char sh[AP_PEER_SHORT_LEN];
        ap_warn(OPT_MOD, "state download: cannot open a stream to %s: %s; dropping that donor",
                ap_peer_id_short(&c->dl.donors[d], sh), ap_strerror(rc));
        c->dl.donor_bad[d] = true;
        memo_fail(c, &c->dl.donors[d], ap_strerror(rc));
        r->donor = -1;
        return rc;
    }
    r->s = s;
    return 0;
}

static void dl_pump(ap_collab_t *c)
{
    if (!c->dl.active) return;
    bool all_done = true;
    for (int i = 0; i < c->dl.nranges; i++) {
        dl_range_t *r = &c->dl.ranges[i];
        if (r->done) continue;
        all_done = false;
        if (r->s || r->count == 0) {
            if (r->count == 0) r->done = true;
            continue;
        }
        while (open_range(c, i) != 0) {
            if (pick_donor(c, i) < 0) {
                dl_finish(c, AP_EUNREACH);
                return;
            }
        }
    }
    if (all_done) dl_finish(c, 0);
}

static void dl_timeout(ap_rt_t *rt, void *arg)
{
    ap_collab_t *c = arg;
    c->dl.timer = 0;
    dl_finish(c, AP_ETIMEDOUT);
}

static void dl_finish(ap_collab_t *c, int status)
{
    if (!c->dl.active) return;
    c->dl.active = false;
    if (c->dl.timer) ap_rt_timer_stop(c->rt, c->dl.timer);
    c->dl.timer = 0;
    for (int i = 0; i < c->dl.nranges; i++)
        if (c->dl.ranges[i].s) {
            ap_stream_t *s = c->dl.ranges[i].s;
            c->dl.ranges[i].s = NULL;
            ap_stream_reset(s, AP_ECANCELED);
        }
    if (status) {
        /* why it could not finish: each donor's last failure */
        char why[256] = "";
        size_t off = 0;
        for (int i = 0; i < c->dl.ndonors && off < sizeof why; i++) {
            donor_memo_t *m = memo_find(c, &c->dl.donors[i]);
            char sh[AP_PEER_SHORT_LEN];
            int k = snprintf(why + off, sizeof why - off, "%s%s: %s", off ? "; " : "",
                             ap_peer_id_short(&c->dl.donors[i], sh),
                             m                    ? m->why
                             : c->dl.donor_bad[i] ? "failed"
                                                  : "unfinished");
            if (k > 0) off += (size_t)k;
        }
        if (status != AP_ECANCELED)
            ap_warn(OPT_MOD, "state download of epoch %llu did not finish (%s): %s",
                    (unsigned long long)c->dl.epoch, ap_strerror(status),
                    c->dl.ndonors ? why : "no donor");
    }
    ap__dl_fn done = c->dl.done;
    c->dl.done = NULL;
    if (done && !c->dead) done(c, status, c->dl.epoch, c->dl.optim_step);
}

void ap__state_download_abort(ap_collab_t *c, int err)
{
    c->dl.done = NULL;
    dl_finish(c, err);
}

static bool usable(ap_collab_t *c, size_t i, int64_t now, uint64_t min_epoch)
{
    const ap_progress_t *p = &c->view[i];
    if (!p->donor || p->epoch < min_epoch || ap_peer_id_eq(&p->peer, ap_rt_self(c->rt)) ||
        !ap__collab_fresh(c, i, now))
        return false;
    if (!c->resync) return true;
    /* out of sync (btard_step.c): only the members found in sync */
    for (size_t k = 0; k < c->nresync; k++)
        if (ap_peer_id_eq(&p->peer, &c->resync_from[k])) return true;
    return false;
}

/* The highest epoch among the usable donors not in back-off; false if none. */
static bool best_epoch(ap_collab_t *c, uint64_t min_epoch, uint64_t *best, int *ndonors,
                       int *nbacked)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    bool any = false;
    *ndonors = *nbacked = 0;
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (!usable(c, i, now, min_epoch)) continue;
        if (backed_off(c, &p->peer)) {
            (*nbacked)++;
            continue;
        }
        if (!any || p->epoch > *best) *best = p->epoch;
        any = true;
    }
    if (any) {
        for (size_t i = 0; i < c->nview; i++)
            if (usable(c, i, now, min_epoch) && c->view[i].epoch == *best &&
                !backed_off(c, &c->view[i].peer))
                (*ndonors)++;
    }
    return any;
}

int ap__state_donors(ap_collab_t *c, uint64_t min_epoch)
{
    uint64_t best = 0;
    int nd, nb;
    if (best_epoch(c, min_epoch, &best, &nd, &nb)) return nd;
    if (!nb) return 0;
    uint64_t now = ap_rt_now_us(c->rt);
    for (int i = 0; i < c->nmemo; i++) {
        donor_memo_t *m = &c->memo[i];
        if (m->until_us <= now) continue;
        char sh[AP_PEER_SHORT_LEN];
        ap_info(OPT_MOD,
                "state download: donor %s failed %u time(s) (last: %s); next try in %.1f s",
                ap_peer_id_short(&m->id, sh), m->fails, m->why, (double)(m->until_us - now) / 1e6);
    }
    return AP_EAGAIN;
}

int ap__state_download(ap_collab_t *c, float *dst, uint64_t min_epoch, ap__dl_fn done)
{
    if (c->dl.active) return AP_EBUSY;
    int64_t now = ap_rt_wall_ms(c->rt);
    uint64_t best = 0;
    int nd, nb;
    if (!best_epoch(c, min_epoch, &best, &nd, &nb)) return nb ? AP_EAGAIN : AP_ENOTFOUND;
    memset(&c->dl, 0, sizeof c->dl);
    c->dl.dst = dst;
    c->dl.min_epoch = min_epoch;
    c->dl.epoch = best; /* what the donors' records say (their headers must agree) */
    /* donors at the highest epoch, in a random order (spread the load) */
    for (size_t i = 0; i < c->nview && c->dl.ndonors < AP_COLLAB_MAX_DONORS; i++) {
        const ap_progress_t *p = &c->view[i];
        if (!usable(c, i, now, min_epoch) || p->epoch != best || backed_off(c, &p->peer)) continue;
        c->dl.donors[c->dl.ndonors++] = p->peer;
    }
    for (int i = c->dl.ndonors - 1; i > 0; i--) {
        int j = (int)ap_rt_rand_below(c->rt, (uint64_t)i + 1);
        ap_peer_id_t t = c->dl.donors[i];
        c->dl.donors[i] = c->dl.donors[j];
        c->dl.donors[j] = t;
    }
    int parts = c->dl.ndonors < c->cfg.max_donors ? c->dl.ndonors : c->cfg.max_donors;
    if ((uint64_t)parts > c->total) parts = (int)c->total;
    c->dl.nranges = parts;
    for (int i = 0; i < parts; i++) {
        dl_range_t *r = &c->dl.ranges[i];
        r->offset = c->total * (uint64_t)i / (uint64_t)parts;
        r->count = c->total * (uint64_t)(i + 1) / (uint64_t)parts - r->offset;
        r->donor = -1;
    }
    c->dl.active = true;
    c->dl.done = done;
    c->dl.timer = ap_rt_timer_start(c->rt, c->cfg.download_timeout_us, 0, dl_timeout, c);
    ap_info(OPT_MOD, "downloading state of epoch %llu from %d donors", (unsigned long long)best,
            parts);
    dl_pump(c);
    return 0;
}
