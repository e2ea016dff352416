/* The collaborative optimizer: progress tracking over the DHT, the epoch
 * decision, gradient and state averaging, and the optimizer step.
 * Sans-I/O: runtime.h, the DHT and the averaging service only. */
#include "collab_impl.h"

#include "apiary/log.h"
#include "base/arena.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *role_name(ap_avg_role_t r)
{
    return r == AP_AVG_CLIENT ? "client" : r == AP_AVG_AUX ? "aux" : "normal";
}

void ap_collab_config_default(ap_collab_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->role = AP_AVG_NORMAL;
    cfg->optim = ap_nn_optim_defaults(AP_NN_ADAM);
    cfg->lr.kind = AP_NN_LR_CONSTANT;
    cfg->lr.base = 1e-3f;
    cfg->lr.min = 1e-3f;
    cfg->average_state_every = 5;
    cfg->load_state_on_start = true;
}

static void fill_defaults(ap_collab_config_t *c)
{
    if (!c->averaging_timeout_us) c->averaging_timeout_us = 30000000;
    if (!c->matchmaking_window_us) c->matchmaking_window_us = 1000000;
    if (!c->progress_ttl_ms) c->progress_ttl_ms = 60000;
    if (!c->stale_ms) c->stale_ms = 20000;
    if (!c->max_skew_ms) c->max_skew_ms = 5000;
    if (!c->min_refresh_us) c->min_refresh_us = 500000;
    if (!c->max_refresh_us) c->max_refresh_us = 10000000;
    if (c->max_refresh_us < c->min_refresh_us) c->max_refresh_us = c->min_refresh_us;
    if (c->max_donors <= 0) c->max_donors = 3;
    if (c->max_donors > AP_OPTIM_MAX_DONORS) c->max_donors = AP_OPTIM_MAX_DONORS;
    if (!c->download_timeout_us) c->download_timeout_us = 120000000;
}

/* ---- lifetime ---------------------------------------------------------------- */

static void collab_release(ap_collab_t *c)
{
    ap_nn_optim_free(c->opt);
    if (c->acc) ap__big_free(c->acc, c->acc_bytes);
    if (c->buf) ap__big_free(c->buf, c->buf_bytes);
    if (c->acc_next) ap__big_free(c->acc_next, c->acc_bytes);
    if (c->shadow) ap__big_free(c->shadow, c->acc_bytes);
    free(c->view);
    free(c);
}

void ap__collab_unref(ap_collab_t *c)
{
    if (--c->refs == 0 && c->dead) collab_release(c);
}

/* Runs the pending callback (if any) without touching the phase. */
static void release_user(ap_collab_t *c, int status)
{
    ap_collab_fn cb = c->cb;
    void *arg = c->cb_arg;
    c->cb = NULL;
    /* the caller computes from now on: the speed (samples per second of the
     * next submit) excludes the time it waited here (rounds, a cap), so a
     * peer that waited long does not under-report its speed and have its
     * next records refused as impossible progress */
    if (cb && !c->dead) c->last_submit_us = ap_rt_now_us(c->rt);
    if (cb) cb(c->rt, arg, status);
}

/* Delayed updates: the background round ended. With a step (next_epoch ran:
 * the accumulators were already swapped) the update waits in shadow for the
 * caller; without one (missed group, no group) the batches computed
 * meanwhile stay in this epoch. */
static void end_background(ap_collab_t *c)
{
    if (!c->bg) return;
    c->bg = false;
    if (c->bg_stepped) {
        c->adopt = true;
    } else {
        for (size_t i = 0; i < c->n; i++) c->acc[i] += c->acc_next[i];
        c->local_samples += c->next_samples;
        memset(c->acc_next, 0, c->acc_bytes);
        c->next_samples = 0;
    }
    c->bg_stepped = false;
}

static bool at_local_cap(const ap_collab_t *c)
{
    return c->cfg.max_local_samples && c->local_samples >= c->cfg.max_local_samples;
}

static void report(ap_collab_t *c, void (*next)(ap_collab_t *c));
static void fetch_decide(ap_collab_t *c);

static void finish_user(ap_collab_t *c, int status)
{
    end_background(c);
    c->phase = PH_IDLE;
    if (status == 0 && c->cb && !c->dead && at_local_cap(c)) {
        /* max_local_samples: the batches held during a background round
         * (or a round that formed no group) already fill this epoch's
         * quota: the submit keeps waiting, for this epoch's round now */
        c->phase = PH_REPORTING;
        report(c, fetch_decide);
        return;
    }
    release_user(c, status);
}

const float *ap__collab_cur_params(const ap_collab_t *c)
{
    return c->shadow && (c->bg || c->adopt) ? c->shadow : c->params;
}

int ap_collab_new(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc, const ap_collab_config_t *cfg,
                  float *params, size_t n, const ap_nn_view_t *views, size_t nviews,
                  ap_collab_t **out)
{
    if (!rt || !dht || !svc || !cfg || !out || (!params && cfg->role != AP_AVG_AUX))
        return AP_EINVAL;
    size_t rl = cfg->run_id ? strlen(cfg->run_id) : 0;
    if (rl == 0 || rl > AP_OPTIM_RUN_ID_MAX || cfg->target_batch_size == 0 || n == 0 ||
        cfg->role > AP_AVG_AUX || !(cfg->up >= 0) || !(cfg->down >= 0)) {
        ap_warn(OPT_MOD, "collab: bad configuration (run id, target batch size, role or size)");
        return AP_EINVAL;
    }
    ap_collab_t *c = calloc(1, sizeof *c);
    if (!c) return AP_ENOMEM;
    c->rt = rt;
    c->dht = dht;
    c->svc = svc;
    c->cfg = *cfg;
    fill_defaults(&c->cfg);
    memcpy(c->run_id, cfg->run_id, rl);
    c->cfg.run_id = c->run_id;
    crypto_generichash(c->run_hash, 32, (const uint8_t *)c->run_id, rl, NULL, 0);
    c->key_len = (size_t)snprintf(c->key, sizeof c->key, "%s_progress", c->run_id);
    char pid[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(ap_rt_self(rt), pid);
    c->subkey_len = (size_t)snprintf(c->subkey, sizeof c->subkey, "[owner:%s]", pid);
    c->params = params;
    c->n = n;
    int rc = ap_nn_optim_new(&c->cfg.optim, n, views, nviews, &c->opt);
    if (rc) {
        free(c);
        return rc;
    }
    c->total = n + c->opt->state_count;
    c->acc_bytes = n * sizeof(float);
    c->buf_bytes = c->total * sizeof(float);
    c->acc = ap__big_alloc(c->acc_bytes);
    c->buf = ap__big_alloc(c->buf_bytes);
    c->view = calloc(AP__VIEW_MAX, sizeof *c->view);
    if (!c->acc || !c->buf || !c->view) {
        collab_release(c);
        return AP_ENOMEM;
    }
    if (c->cfg.delayed_updates && c->cfg.role != AP_AVG_AUX) {
        c->acc_next = ap__big_alloc(c->acc_bytes);
        c->shadow = ap__big_alloc(c->acc_bytes);
        if (!c->acc_next || !c->shadow) {
            collab_release(c);
            return AP_ENOMEM;
        }
        memset(c->acc_next, 0, c->acc_bytes);
    }
    memset(c->acc, 0, c->acc_bytes);
    c->epoch_start_ms = ap_rt_wall_ms(rt);
    c->st.last_averaged_fraction = 1.0;
    if (c->cfg.role == AP_AVG_NORMAL) {
        rc = ap__state_listen(c);
        if (rc) {
            collab_release(c);
            return rc;
        }
    }
    if (c->cfg.dht_matchmaking) {
        rc = ap_avg_matchmaker_new(svc, dht, &c->mm);
        if (rc) {
            if (c->cfg.role == AP_AVG_NORMAL) ap__state_unlisten(c);
            collab_release(c);
            return rc;
        }
    }
    *out = c;
    return 0;
}

void ap_collab_free(ap_collab_t *c)
{
    if (!c) return;
    c->dead = true;
    c->refs++; /* synchronous on_close callbacks below must not free c under us */
    if (c->refresh_timer) ap_rt_timer_stop(c->rt, c->refresh_timer);
    c->refresh_timer = 0;
    if (c->mm_timer) ap_rt_timer_stop(c->rt, c->mm_timer);
    c->mm_timer = 0;
    if (c->wait_timer) ap_rt_timer_stop(c->rt, c->wait_timer);
    c->wait_timer = 0;
    if (c->cfg.role == AP_AVG_NORMAL) ap__state_unlisten(c);
    ap__state_abort_serving(c);
    ap__state_download_abort(c, AP_ECANCELED);
    if (c->ar) ap_allreduce_cancel(c->ar);
    if (c->search) {
        ap_avg_search_t *s = c->search;
        c->search = NULL;
        ap_avg_match_cancel(s); /* its callback sees dead */
    }
    if (c->mm) ap_avg_matchmaker_free(c->mm);
    c->mm = NULL;
    if (c->cb) finish_user(c, AP_ECANCELED);
    ap__collab_unref(c);
}

/* ---- the view of the run ------------------------------------------------------ */

static bool is_self(const ap_collab_t *c, const ap_peer_id_t *p)
{
    return ap_peer_id_eq(p, ap_rt_self(c->rt));
}

static bool fresh(const ap_collab_t *c, const ap_progress_t *p, int64_t now_ms)
{
    return p->time_ms >= now_ms - c->cfg.stale_ms;
}

typedef struct estimate {
    double global, sps, eta_s;
    uint64_t reported; /* samples reported (not extrapolated) in my epoch, me included */
    uint64_t max_epoch;
    uint32_t peers;
} estimate_t;

static void estimate(ap_collab_t *c, estimate_t *e)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    memset(e, 0, sizeof *e);
    e->global = (double)c->local_samples;
    e->reported = c->local_samples;
    e->sps = c->sps;
    e->max_epoch = c->epoch;
    e->peers = 1;
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (is_self(c, &p->peer) || !fresh(c, p, now)) continue;
        e->peers++;
        if (p->epoch > e->max_epoch && p->role != AP_AVG_AUX) e->max_epoch = p->epoch;
        if (p->role == AP_AVG_AUX) continue;
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

static void update_stats(ap_collab_t *c)
{
    estimate_t e;
    estimate(c, &e);
    c->st.epoch = c->epoch;
    c->st.local_samples = c->local_samples;
    c->st.global_samples = e.global;
    c->st.global_sps = e.sps;
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
    if (p->ready_ms && p->ready_ms < p->epoch_start_ms) p->ready_ms = p->epoch_start_ms;
    if (p->ready_ms > p->time_ms) p->ready_ms = p->time_ms;
}

/* Keeps our own entry of the view current (the DHT read may lag our store). */
static void view_put_self(ap_collab_t *c)
{
    ap_progress_t me;
    my_record(c, &me);
    for (size_t i = 0; i < c->nview; i++)
        if (is_self(c, &c->view[i].peer)) {
            c->view[i] = me;
            return;
        }
    if (c->nview < AP__VIEW_MAX) c->view[c->nview++] = me;
}

typedef void (*step_fn)(ap_collab_t *c);

typedef struct op_ctx {
    ap_collab_t *c;
    step_fn next;
} op_ctx_t;

static void store_done(ap_dht_t *dht, void *arg, int status, int nstored)
{
    op_ctx_t *o = arg;
    ap_collab_t *c = o->c;
    step_fn next = o->next;
    free(o);
    if (!c->dead) {
        if (status) ap_debug(OPT_MOD, "progress store failed: %s", ap_strerror(status));
        if (next) next(c);
    }
    ap__collab_unref(c);
}

/* Stores our progress record; next (may be NULL) runs when the store ends. */
static void report(ap_collab_t *c, step_fn next)
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

static void absorb(ap_collab_t *c, const ap_dht_result_t *res)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    size_t m = 0;
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
        c->view[m++] = p;
    }
    c->nview = m;
    c->view_at_us = ap_rt_now_us(c->rt);
    view_put_self(c);
    update_stats(c);
}

static void get_done(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res)
{
    op_ctx_t *o = arg;
    ap_collab_t *c = o->c;
    step_fn next = o->next;
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

static void fetch(ap_collab_t *c, step_fn next)
{
    op_ctx_t *o = malloc(sizeof *o);
    int rc =
        o ? ap_dht_get(c->dht, (const uint8_t *)c->key, c->key_len, true, get_done, o) : AP_ENOMEM;
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

/* ---- averaging and the step --------------------------------------------------- */

static int cmp_member(const void *a, const void *b)
{
    return ap_peer_id_cmp(&((const ap_avg_member_t *)a)->id, &((const ap_avg_member_t *)b)->id);
}

/* The group of this epoch: fresh records in this epoch, ordered by PeerID. */
static void form_group(ap_collab_t *c, ap_avg_group_t *g, const char *what, bool collect)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    uint64_t samples = 0;
    if (collect) c->nmembers = 0;
    for (size_t i = 0; collect && i < c->nview && c->nmembers < AP_AVG_MAX_PEERS; i++) {
        const ap_progress_t *p = &c->view[i];
        if (p->epoch != c->epoch || !fresh(c, p, now)) continue;
        if (p->ready_ms <= 0 || p->ready_ms > c->cutoff_ms) continue; /* not in this round */
        ap_avg_member_t *m = &c->members[c->nmembers++];
        m->id = p->peer;
        m->role = p->role;
        m->up = p->up > 0 ? p->up : 1e6;
        m->down = p->down > 0 ? p->down : 1e6;
        if (p->role != AP_AVG_AUX) samples += (uint64_t)p->samples;
    }
    if (collect) {
        qsort(c->members, c->nmembers, sizeof *c->members, cmp_member);
        c->round_samples = samples;
    }
    crypto_generichash_state hs;
    crypto_generichash_init(&hs, NULL, 0, AP_AVG_GROUP_ID_LEN);
    crypto_generichash_update(&hs, c->run_hash, 32);
    uint8_t e8[8];
    for (int i = 0; i < 8; i++) e8[i] = (uint8_t)(c->epoch >> (8 * i));
    crypto_generichash_update(&hs, e8, 8);
    crypto_generichash_update(&hs, (const uint8_t *)what, strlen(what));
    for (size_t i = 0; i < c->nmembers; i++) {
        crypto_generichash_update(&hs, c->members[i].id.b, AP_PEER_ID_LEN);
        uint8_t r = (uint8_t)c->members[i].role;
        crypto_generichash_update(&hs, &r, 1);
    }
    crypto_generichash_final(&hs, g->id, AP_AVG_GROUP_ID_LEN);
    g->members = c->members;
    g->n = c->nmembers;
}

static void schedule_refresh(ap_collab_t *c);
static void after_epoch(ap_collab_t *c);

static void round_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res);

static int start_round(ap_collab_t *c, const char *what, float *data, double weight)
{
    ap_avg_group_t g;
    form_group(c, &g, what, false);
    ap_allreduce_opts_t o = {0};
    o.chunk_elems = c->cfg.chunk_elems;
    o.codec = strcmp(what, "grad") == 0 ? c->cfg.codec : (uint8_t)AP_AVG_CODEC_F32;
    o.deadline_at_us = ap_rt_now_us(c->rt) + c->cfg.averaging_timeout_us;
    uint64_t elems = strcmp(what, "grad") == 0 ? c->n : c->total;
    int rc = ap_allreduce_start(c->svc, &g, data, elems, weight, &o, round_done, c, &c->ar);
    if (rc == 0) c->refs++;
    return rc;
}

static void apply_step(ap_collab_t *c, float *grad)
{
    if (c->cfg.max_grad_norm > 0) {
        double norm = ap_nn_clip_grad_norm(grad, c->n, c->cfg.max_grad_norm);
        if (!isfinite(norm)) {
            ap_warn(OPT_MOD, "epoch %llu: averaged gradient is not finite; step skipped",
                    (unsigned long long)c->epoch);
            return;
        }
    }
    float lr = ap_nn_lr_at(&c->cfg.lr, c->epoch);
    /* delayed updates: the caller computes on params meanwhile */
    int rc = ap_nn_optim_step(c->opt, c->bg ? c->shadow : c->params, grad, lr);
    if (rc)
        ap_warn(OPT_MOD, "epoch %llu: optimizer step failed: %s", (unsigned long long)c->epoch,
                ap_strerror(rc));
}

static void next_epoch(ap_collab_t *c)
{
    c->st.last_epoch_samples = c->round_samples;
    c->epoch++;
    c->local_samples = 0;
    memset(c->acc, 0, c->acc_bytes);
    if (c->bg) {
        /* the batches computed during the round open the new epoch */
        float *t = c->acc;
        c->acc = c->acc_next;
        c->acc_next = t;
        c->local_samples = c->next_samples;
        c->next_samples = 0;
        c->bg_stepped = true;
    }
    /* delayed updates: the new epoch's samples were computed since the
     * round began (readers check samples against speed × epoch time) */
    c->epoch_start_ms = c->bg ? c->bg_start_ms : ap_rt_wall_ms(c->rt);
    c->ready_ms = 0;
    c->st.epoch = c->epoch;
}

/* Late peer: the round of this epoch is over without our gradients (we
 * missed its group, or the others are in a later epoch). Gradients of an old
 * epoch are discarded (DeDLOC / hivemind semantics), with a log line. */
static void drop_epoch_samples(ap_collab_t *c, const char *why)
{
    if (c->local_samples == 0) return;
    ap_info(OPT_MOD,
            "epoch %llu: dropping %llu local samples (%s): gradients of an old epoch "
            "are discarded",
            (unsigned long long)c->epoch, (unsigned long long)c->local_samples, why);
    c->st.samples_dropped += c->local_samples;
    c->local_samples = 0;
    memset(c->acc, 0, c->acc_bytes);
}

static void begin_state_round(ap_collab_t *c)
{
    c->phase = PH_STATE_AVG;
    float *data = NULL;
    double w = 0;
    if (c->cfg.role != AP_AVG_AUX) {
        memcpy(c->buf, c->bg ? c->shadow : c->params, c->n * sizeof(float));
        if (c->opt->state_count)
            memcpy(c->buf + c->n, c->opt->state, c->opt->state_count * sizeof(float));
        data = c->buf;
        w = 1.0;
    }
    int rc = start_round(c, "state", data, w);
    if (rc) {
        ap_warn(OPT_MOD, "epoch %llu: state averaging could not start: %s",
                (unsigned long long)c->epoch, ap_strerror(rc));
        after_epoch(c);
    }
}

static void round_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    ap_collab_t *c = arg;
    c->ar = NULL;
    if (c->dead) {
        ap__collab_unref(c);
        return;
    }
    ap__collab_unref(c);
    if (c->phase == PH_AVERAGING) {
        double frac = c->cfg.role == AP_AVG_AUX ? 1.0 : res->averaged_fraction;
        c->st.last_group_size = (uint32_t)c->nmembers;
        c->st.last_averaged_fraction = frac;
        if (res->status != 0 || frac < 1.0) {
            c->st.epochs_failed++;
            ap_warn(OPT_MOD,
                    "epoch %llu: averaging with %zu peers incomplete (%s, %.0f%% averaged): "
                    "stepping on local gradients for the rest",
                    (unsigned long long)c->epoch, c->nmembers,
                    res->status ? ap_strerror(res->status) : "parts failed", 100.0 * frac);
        }
        if (c->cfg.role != AP_AVG_AUX) apply_step(c, c->buf);
        next_epoch(c);
        ap_info(OPT_MOD, "epoch %llu reached (%zu peers, %llu samples)",
                (unsigned long long)c->epoch, c->nmembers,
                (unsigned long long)c->st.last_epoch_samples);
        if (c->cfg.average_state_every && c->epoch % c->cfg.average_state_every == 0 &&
            c->nmembers > 1) {
            begin_state_round(c); /* same members, new group id */
            return;
        }
        after_epoch(c);
        return;
    }
    if (c->phase == PH_STATE_AVG) {
        if (res->status == 0 && res->averaged_fraction >= 1.0)
            c->st.state_rounds++;
        else
            ap_warn(OPT_MOD, "epoch %llu: state averaging incomplete (%s, %.0f%%)",
                    (unsigned long long)c->epoch,
                    res->status ? ap_strerror(res->status) : "parts failed",
                    100.0 * res->averaged_fraction);
        if (c->cfg.role != AP_AVG_AUX && res->elems_averaged > 0) {
            memcpy(c->bg ? c->shadow : c->params, c->buf, c->n * sizeof(float));
            if (c->opt->state_count)
                memcpy(c->opt->state, c->buf + c->n, c->opt->state_count * sizeof(float));
        }
        after_epoch(c);
    }
}

static void after_epoch(ap_collab_t *c)
{
    c->aux_in_round = false;
    report(c, NULL);
    update_stats(c);
    schedule_refresh(c);
    finish_user(c, 0);
}

/* Whether other (non-aux) peers with fresh records are in this epoch or later. */
static bool others_active(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (!is_self(c, &p->peer) && p->role != AP_AVG_AUX && fresh(c, p, now) &&
            p->epoch >= c->epoch)
            return true;
    }
    return false;
}

/* The gradient round with the members found (c->members, round_samples). */
static void round_with_members(ap_collab_t *c)
{
    c->phase = PH_AVERAGING;
    float *data = NULL;
    double w = 0;
    if (c->cfg.role != AP_AVG_AUX) {
        double inv = c->local_samples ? 1.0 / (double)c->local_samples : 0.0;
        for (size_t i = 0; i < c->n; i++) c->buf[i] = (float)(c->acc[i] * inv);
        data = c->buf;
        w = (double)c->local_samples;
    }
    if (c->nmembers <= 1 && others_active(c)) {
        /* others train in this run but none gathered with us: stepping
         * alone would fork the model. Wait for their next epoch and load
         * their state instead. */
        ap_info(OPT_MOD, "epoch %llu: no group formed with the other peers; waiting to load state",
                (unsigned long long)c->epoch);
        c->ready_ms = 0;
        report(c, NULL);
        schedule_refresh(c);
        finish_user(c, 0);
        return;
    }
    if (c->nmembers <= 1) {
        /* alone in the run: the local gradient is the global one */
        c->st.last_group_size = 1;
        c->st.last_averaged_fraction = 1.0;
        if (c->cfg.role != AP_AVG_AUX) apply_step(c, c->buf);
        next_epoch(c);
        after_epoch(c);
        return;
    }
    int rc = start_round(c, "grad", data, w);
    if (rc) {
        c->st.epochs_failed++;
        ap_warn(OPT_MOD, "epoch %llu: averaging could not start (%s): stepping on local gradients",
                (unsigned long long)c->epoch, ap_strerror(rc));
        if (c->cfg.role != AP_AVG_AUX) apply_step(c, c->buf);
        next_epoch(c);
        after_epoch(c);
    }
}

static void run_round(ap_collab_t *c)
{
    ap_avg_group_t g;
    form_group(c, &g, "grad", true);
    round_with_members(c);
}

/* dht_matchmaking: the samples of the members' records (READY records: what
 * each averages), for stats.last_epoch_samples. */
static void member_samples(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    uint64_t samples = 0;
    for (size_t k = 0; k < c->nmembers; k++) {
        if (c->members[k].role == AP_AVG_AUX) continue;
        if (is_self(c, &c->members[k].id)) {
            samples += c->local_samples;
            continue;
        }
        for (size_t i = 0; i < c->nview; i++) {
            const ap_progress_t *p = &c->view[i];
            if (ap_peer_id_eq(&p->peer, &c->members[k].id) && p->epoch == c->epoch &&
                fresh(c, p, now)) {
                samples += (uint64_t)p->samples;
                break;
            }
        }
    }
    c->round_samples = samples;
}

static void matched_fetched(ap_collab_t *c)
{
    member_samples(c);
    round_with_members(c);
}

static void matched(ap_rt_t *rt, void *arg, int status, const ap_avg_group_t *g)
{
    ap_collab_t *c = arg;
    c->search = NULL;
    if (c->dead) {
        ap__collab_unref(c);
        return;
    }
    ap__collab_unref(c);
    if (status == 0 && g && g->n > 1) {
        size_t n = g->n < AP_AVG_MAX_PEERS ? g->n : AP_AVG_MAX_PEERS;
        memcpy(c->members, g->members, n * sizeof *c->members);
        c->nmembers = n;
        fetch(c, matched_fetched); /* the members' READY records, for the stats */
        return;
    }
    if (status && status != AP_ETIMEDOUT)
        ap_info(OPT_MOD, "epoch %llu: matchmaking failed: %s", (unsigned long long)c->epoch,
                ap_strerror(status));
    /* no group: alone in the run (step alone) or others elsewhere (load) */
    c->nmembers = 1;
    c->members[0].id = *ap_rt_self(c->rt);
    c->members[0].role = c->cfg.role;
    c->round_samples = c->cfg.role == AP_AVG_AUX ? 0 : c->local_samples;
    round_with_members(c);
}

/* The first READY time among the records of this epoch (0 = none). */
static int64_t first_ready(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt), first = 0;
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (p->epoch != c->epoch || p->ready_ms <= 0 || !fresh(c, p, now)) continue;
        if (!first || p->ready_ms < first) first = p->ready_ms;
    }
    return first;
}

/* Became ready after this epoch's group closed: the others step without
 * us; we load their state once they report the next epoch. */
static void missed_group(ap_collab_t *c)
{
    ap_info(OPT_MOD, "epoch %llu: missed the averaging group (ready %lld ms after it closed)",
            (unsigned long long)c->epoch, (long long)(c->ready_ms - c->cutoff_ms));
    drop_epoch_samples(c, "missed the round");
    c->ready_ms = 0;
    report(c, NULL);
    schedule_refresh(c);
    finish_user(c, 0);
}

static void mm_decide(ap_collab_t *c)
{
    int64_t first = first_ready(c);
    int64_t win = (int64_t)(c->cfg.matchmaking_window_us / 1000);
    if (!first || first > c->ready_ms) first = c->ready_ms;
    c->cutoff_ms = first + win;
    if (c->ready_ms > c->cutoff_ms) {
        missed_group(c);
        return;
    }
    run_round(c);
}

/* dht_matchmaking: look for this epoch's group with the averaging module's
 * matchmaker. Returns false if the peer is late (handled). */
static void start_search(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    uint32_t want = 0;
    for (size_t i = 0; i < c->nview; i++)
        if (c->view[i].epoch == c->epoch && fresh(c, &c->view[i], now)) want++;
    if (want < 2) want = 2;
    if (want > AP_AVG_MAX_PEERS) want = AP_AVG_MAX_PEERS;
    int kl = snprintf(c->mm_key, sizeof c->mm_key, "%s_grad_%llu", c->run_id,
                      (unsigned long long)c->epoch);
    ap_avg_match_t m = {.key = (const uint8_t *)c->mm_key,
                        .key_len = (size_t)kl,
                        .target_group_size = want,
                        .min_group_size = 2,
                        .deadline_at_us = ap_rt_now_us(c->rt) + c->cfg.matchmaking_window_us};
    ap_avg_member_t me = {.id = *ap_rt_self(c->rt),
                          .role = c->cfg.role,
                          .up = c->cfg.up > 0 ? c->cfg.up : 1e6,
                          .down = c->cfg.down > 0 ? c->cfg.down : 1e6};
    c->refs++;
    int rc = ap_avg_match_start(c->mm, &m, &me, matched, c, &c->search);
    if (rc) {
        c->search = NULL;
        ap_warn(OPT_MOD, "epoch %llu: matchmaking could not start: %s",
                (unsigned long long)c->epoch, ap_strerror(rc));
        matched(c->rt, c, rc, NULL); /* drops the reference */
    }
}

static void mm_tick(ap_rt_t *rt, void *arg)
{
    ap_collab_t *c = arg;
    c->mm_timer = 0;
    fetch(c, mm_decide);
}

/* The epoch is due (or others are gathering): mark READY and wait the
 * matchmaking window (plus half of it for the others' stores to land). */
static void begin_averaging(ap_collab_t *c)
{
    c->phase = PH_AVERAGING;
    int64_t now = ap_rt_wall_ms(c->rt);
    c->ready_ms = now > c->epoch_start_ms ? now : c->epoch_start_ms;
    c->ready_sps = c->sps; /* as in the READY record (the background cap's share) */
    report(c, NULL);
    int64_t first = first_ready(c);
    int64_t win = (int64_t)(c->cfg.matchmaking_window_us / 1000);
    if (c->mm) {
        /* the epoch's window (from the first READY record) closed before
         * we were ready: late, as in the READY-window scheme */
        c->cutoff_ms = (first && first < c->ready_ms ? first : c->ready_ms) + win;
        bool bg = c->shadow && c->cb;
        if (bg) {
            memcpy(c->shadow, c->params, c->acc_bytes);
            c->bg = true;
            c->bg_start_ms = now;
            c->bg_stepped = false;
        }
        if (c->ready_ms > c->cutoff_ms) {
            missed_group(c);
            return;
        }
        start_search(c);
        if (bg && c->cb && c->phase == PH_AVERAGING) release_user(c, 0);
        return;
    }
    uint64_t wait = c->cfg.matchmaking_window_us + c->cfg.matchmaking_window_us / 2;
    if (first && first < c->ready_ms) {
        int64_t left = first + win - c->ready_ms; /* the group closes at first + window */
        wait = (uint64_t)(left > 0 ? left : 0) * 1000 + c->cfg.matchmaking_window_us / 2;
    }
    c->mm_timer = ap_rt_timer_start(c->rt, wait, 0, mm_tick, c);
    if (c->shadow && c->cb) {
        /* delayed updates: the caller computes the next batches while the
         * group gathers and averages; the step goes to shadow */
        memcpy(c->shadow, c->params, c->acc_bytes);
        c->bg = true;
        c->bg_start_ms = now;
        c->bg_stepped = false;
        release_user(c, 0);
    }
}

/* Someone of this epoch is READY and the group is still open. */
static bool gathering(ap_collab_t *c)
{
    int64_t first = first_ready(c);
    return first && ap_rt_wall_ms(c->rt) <= first + (int64_t)(c->cfg.matchmaking_window_us / 1000);
}

static void load_done(ap_rt_t *rt, void *arg, int status)
{
    ap_collab_t *c = arg;
    if (status == 0) {
        ap_info(OPT_MOD, "caught up: epoch %llu loaded from peers", (unsigned long long)c->epoch);
    } else {
        ap_warn(OPT_MOD, "state download failed (%s); training on from epoch %llu",
                ap_strerror(status), (unsigned long long)c->epoch);
    }
    report(c, NULL);
    update_stats(c);
    schedule_refresh(c);
    finish_user(c, 0);
}

static void wait_tick(ap_rt_t *rt, void *arg);

/* Delayed updates: the most this peer accumulates for the next epoch while a
 * background round runs: its share of the target by speed, among the records
 * of this epoch and the next (frozen during the round: READY records), and
 * at most max_local_samples. */
static uint64_t bg_cap(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    double mine = c->ready_sps > 0 ? c->ready_sps : c->sps > 0 ? c->sps : 1.0, sum = mine;
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (is_self(c, &p->peer) || !fresh(c, p, now) || p->role == AP_AVG_AUX) continue;
        if (p->epoch != c->epoch && p->epoch != c->epoch + 1) continue;
        sum += p->samples_per_s > 0 ? p->samples_per_s : mine;
    }
    double share = ceil((double)c->cfg.target_batch_size * mine / sum);
    uint64_t cap = share < 1 ? 1 : (uint64_t)share;
    if (c->cfg.max_local_samples && c->cfg.max_local_samples < cap) cap = c->cfg.max_local_samples;
    return cap;
}

/* After a fresh view: behind -> download; due -> average; else go on. */
static void decide(ap_collab_t *c)
{
    estimate_t e;
    estimate(c, &e);
    update_stats(c);
    if (e.max_epoch > c->epoch) {
        ap_info(OPT_MOD, "behind: epoch %llu, peers at %llu; downloading state",
                (unsigned long long)c->epoch, (unsigned long long)e.max_epoch);
        drop_epoch_samples(c, "the others are in a later epoch");
        c->phase = PH_DOWNLOADING;
        if (ap__state_download(c, load_done) != 0) {
            /* no donor: adopt the epoch, keep the parameters */
            ap_warn(OPT_MOD, "behind but no donor answers; jumping to epoch %llu with local state",
                    (unsigned long long)e.max_epoch);
            c->epoch = e.max_epoch;
            c->local_samples = 0;
            memset(c->acc, 0, c->acc_bytes);
            c->epoch_start_ms = ap_rt_wall_ms(c->rt);
            load_done(c->rt, c, AP_ENOTFOUND);
        }
        return;
    }
    if (e.reported >= c->cfg.target_batch_size || gathering(c)) {
        begin_averaging(c);
        return;
    }
    if (at_local_cap(c)) {
        /* max_local_samples: wait (callback held) until the epoch is due */
        if (c->phase != PH_WAITING) c->st.submits_held++;
        c->phase = PH_WAITING;
        uint64_t p = c->cfg.matchmaking_window_us / 4;
        if (p > c->cfg.min_refresh_us) p = c->cfg.min_refresh_us;
        if (p < 10000) p = 10000;
        c->wait_timer = ap_rt_timer_start(c->rt, p, 0, wait_tick, c);
        return;
    }
    finish_user(c, 0);
}

static void fetch_decide(ap_collab_t *c)
{
    fetch(c, decide);
}

static void wait_tick(ap_rt_t *rt, void *arg)
{
    ap_collab_t *c = arg;
    c->wait_timer = 0;
    if (c->phase != PH_WAITING) return;
    /* keep our record fresh while we wait */
    if (ap_rt_now_us(rt) - c->last_report_us > (uint64_t)c->cfg.stale_ms * 1000 / 3)
        report(c, NULL);
    fetch(c, decide);
}

/* ---- adaptive refresh ---------------------------------------------------------- */

static void aux_check(ap_collab_t *c)
{
    /* An auxiliary peer follows the others' epoch and joins every round. */
    if (c->phase != PH_IDLE) return;
    estimate_t e;
    estimate(c, &e);
    if (e.max_epoch > c->epoch) {
        c->epoch = e.max_epoch;
        report(c, NULL);
        return;
    }
    if (e.reported >= c->cfg.target_batch_size || gathering(c)) {
        c->aux_in_round = true;
        begin_averaging(c);
    }
}

static void refresh_fetched(ap_collab_t *c)
{
    if (c->cfg.role == AP_AVG_AUX) aux_check(c);
    schedule_refresh(c);
}

static void refresh_tick(ap_rt_t *rt, void *arg)
{
    ap_collab_t *c = arg;
    c->refresh_timer = 0;
    uint64_t now = ap_rt_now_us(rt);
    if (c->phase == PH_IDLE && now - c->last_report_us > (uint64_t)c->cfg.stale_ms * 1000 / 3)
        report(c, NULL);
    /* a submit may have read the view recently: no second read then */
    if (!c->fetching && c->phase == PH_IDLE && now - c->view_at_us >= c->cfg.min_refresh_us)
        fetch(c, refresh_fetched);
    else
        schedule_refresh(c);
}

static void schedule_refresh(ap_collab_t *c)
{
    if (c->dead || c->refresh_timer) return;
    double eta = c->st.eta_s;
    /* no speed known yet: look again soon */
    uint64_t p = isfinite(eta) ? (uint64_t)(eta * 1e6 / 3) : c->cfg.min_refresh_us;
    if (p < c->cfg.min_refresh_us) p = c->cfg.min_refresh_us;
    if (p > c->cfg.max_refresh_us) p = c->cfg.max_refresh_us;
    c->refresh_timer = ap_rt_timer_start(c->rt, p, 0, refresh_tick, c);
}

/* ---- start and submit ------------------------------------------------------------ */

static void start_ready(ap_rt_t *rt, void *arg, int status)
{
    ap_collab_t *c = arg;
    if (status && status != AP_ENOTFOUND)
        ap_warn(OPT_MOD, "state download at start failed (%s): starting from local parameters",
                ap_strerror(status));
    c->started = true;
    c->started_us = ap_rt_now_us(rt);
    c->last_submit_us = c->started_us;
    c->epoch_start_ms = ap_rt_wall_ms(rt);
    report(c, NULL);
    update_stats(c);
    schedule_refresh(c);
    finish_user(c, status == AP_ENOTFOUND ? 0 : status);
}

static void start_fetched(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    bool donors = false;
    uint64_t maxe = 0;
    for (size_t i = 0; i < c->nview; i++)
        if (!is_self(c, &c->view[i].peer) && fresh(c, &c->view[i], now)) {
            if (c->view[i].donor) donors = true;
            if (c->view[i].role != AP_AVG_AUX && c->view[i].epoch > maxe) maxe = c->view[i].epoch;
        }
    if (c->cfg.role == AP_AVG_AUX) {
        c->epoch = maxe;
        start_ready(c->rt, c, 0);
        return;
    }
    if (donors && c->cfg.load_state_on_start) {
        c->phase = PH_DOWNLOADING;
        if (ap__state_download(c, start_ready) == 0) return;
    }
    start_ready(c->rt, c, 0);
}

int ap_collab_start(ap_collab_t *c, ap_collab_fn cb, void *arg)
{
    if (c->phase != PH_IDLE || c->cb || c->started) return AP_EBUSY;
    c->phase = PH_STARTING;
    c->cb = cb;
    c->cb_arg = arg;
    fetch(c, start_fetched);
    return 0;
}

int ap_collab_submit(ap_collab_t *c, const float *grad, uint32_t samples, float loss,
                     ap_collab_fn cb, void *arg)
{
    if (c->cfg.role == AP_AVG_AUX || !c->started) return AP_ESTATE;
    if (c->cb || (c->phase != PH_IDLE && !c->bg)) return AP_EBUSY;
    if (!grad || samples == 0) return AP_EINVAL;
    uint64_t now = ap_rt_now_us(c->rt);
    const float s = (float)samples;
    /* delayed updates: during a background round the batch belongs to the
     * next epoch; after it, the finished step is copied in first (the caller
     * is not computing now) */
    float *acc = c->bg ? c->acc_next : c->acc;
    for (size_t i = 0; i < c->n; i++) acc[i] += grad[i] * s;
    if (c->bg) {
        c->next_samples += samples;
        c->st.samples_during_rounds += samples;
    } else {
        c->local_samples += samples;
    }
    double dt = (double)(now - c->last_submit_us) / 1e6;
    if (dt > 0) {
        double inst = samples / dt;
        c->sps = c->sps > 0 ? 0.7 * c->sps + 0.3 * inst : inst;
    }
    c->last_submit_us = now;
    c->st.last_loss = loss;
    c->cb = cb;
    c->cb_arg = arg;
    if (c->bg) {
        /* the next epoch's cap: a further batch would pass this peer's
         * share, so wait (callback held) until the round is over */
        if (c->next_samples + samples > bg_cap(c)) {
            c->st.submits_held++;
            return 0;
        }
        release_user(c, 0);
        return 0;
    }
    ap_collab_apply_update(c);

    estimate_t e;
    estimate(c, &e);
    update_stats(c);
    /* Close to the end of the epoch (or behind): report and read a fresh view
     * before deciding. Otherwise report in the background and go on. */
    bool near = e.global >= (double)c->cfg.target_batch_size || e.eta_s <= 2.0 * dt ||
                e.max_epoch > c->epoch || at_local_cap(c);
    if (near) {
        c->phase = PH_REPORTING;
        report(c, fetch_decide); /* read after our own store landed */
        return 0;
    }
    if (now - c->last_report_us >= c->cfg.min_refresh_us) report(c, NULL);
    finish_user(c, 0);
    return 0;
}

/* ---- accessors ----------------------------------------------------------------------- */

void ap_collab_get_stats(const ap_collab_t *c, ap_collab_stats_t *out)
{
    *out = c->st;
    out->epoch = c->epoch;
    out->local_samples = c->local_samples;
}

int ap_collab_apply_update(ap_collab_t *c)
{
    if (c->bg) return AP_EBUSY;
    if (!c->adopt) return 0;
    memcpy(c->params, c->shadow, c->acc_bytes);
    c->adopt = false;
    c->st.delayed_steps++;
    return 1;
}

const float *ap_collab_current_params(const ap_collab_t *c)
{
    return ap__collab_cur_params(c);
}

bool ap_collab_update_pending(const ap_collab_t *c)
{
    return c->bg || c->adopt;
}

int ap_collab_checkpoint_encode(const ap_collab_t *c, ap_nn_model_t *m, uint8_t **buf, size_t *len,
                                uint64_t *epoch)
{
    *buf = NULL;
    *len = 0;
    if (c->cfg.role == AP_AVG_AUX) return AP_ESTATE;
    if (!m || ap_nn_model_params(m)->count != c->n) return AP_EINVAL;
    /* on the loop thread the parameters, the optimizer state and the epoch
     * always change together (step + next epoch, state round, download) */
    int rc = ap_nn_checkpoint_encode_flat(m, ap__collab_cur_params(c), c->opt, c->epoch, buf, len);
    if (rc == 0 && epoch) *epoch = c->epoch;
    return rc;
}

uint64_t ap_collab_epoch(const ap_collab_t *c)
{
    return c->epoch;
}

const ap_nn_optim_t *ap_collab_optim(const ap_collab_t *c)
{
    return c->opt;
}

ap_nn_optim_t *ap_collab_optim_mut(ap_collab_t *c)
{
    return c->opt;
}

void ap_collab_set_epoch(ap_collab_t *c, uint64_t epoch)
{
    c->epoch = epoch;
    c->st.epoch = epoch;
}

const char *ap__collab_role_name(ap_avg_role_t r);
const char *ap__collab_role_name(ap_avg_role_t r)
{
    return role_name(r);
}
