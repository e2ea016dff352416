/* The collaborative optimizer's entry points: configuration, lifetime,
 * start, submit and accessors. The view of the run is in view.c, rounds in
 * round.c, the epoch change in epoch.c, state sharing in state.c.
 * Sans-I/O: runtime.h, the DHT and the averaging service only. */
#include "collab_impl.h"

#include "apiary/log.h"
#include "averaging/avg_codec.h"
#include "base/arena.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void ap_collab_config_default(ap_collab_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->role = AP_AVG_NORMAL;
    cfg->solver = ap_nn_solver_defaults(AP_NN_ADAM);
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
    if (c->max_donors > AP_COLLAB_MAX_DONORS) c->max_donors = AP_COLLAB_MAX_DONORS;
    if (!c->download_timeout_us) c->download_timeout_us = 120000000;
    if (!(c->btard_tau > 0)) c->btard_tau = 1.0;
    if (!c->btard_max_iter) c->btard_max_iter = 100;
}

/* ---- lifetime ---------------------------------------------------------------- */

static void collab_release(ap_collab_t *c)
{
    ap_nn_solver_free(c->opt);
    ap__btard_collab_release(c);
    if (c->acc) ap__big_free(c->acc, c->acc_bytes);
    if (c->buf) ap__big_free(c->buf, c->buf_bytes);
    if (c->acc_next) ap__big_free(c->acc_next, c->acc_bytes);
    if (c->shadow) ap__big_free(c->shadow, c->acc_bytes);
    free(c->view);
    free(c->view_seen);
    free(c->view_silent);
    free(c->seen_prev);
    ap__closed_free(c);
    free(c);
}

void ap__collab_unref(ap_collab_t *c)
{
    if (--c->refs == 0 && c->dead) collab_release(c);
}

/* Runs the pending callback (if any) without touching the phase. */
void ap__collab_release_user(ap_collab_t *c, int status)
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

bool ap__collab_at_local_cap(const ap_collab_t *c)
{
    return c->cfg.max_local_samples && c->local_samples >= c->cfg.max_local_samples;
}

void ap__collab_finish_user(ap_collab_t *c, int status)
{
    end_background(c);
    c->phase = PH_IDLE;
    if (status == 0 && c->cb && !c->dead && ap__collab_at_local_cap(c)) {
        /* max_local_samples: the batches held during a background round
         * (or a round that formed no group) already fill this epoch's
         * quota: the submit keeps waiting, for this epoch's round now */
        c->phase = PH_REPORTING;
        ap__collab_report(c, ap__collab_fetch_decide);
        return;
    }
    ap__collab_release_user(c, status);
}

const float *ap__collab_cur_params(const ap_collab_t *c)
{
    return c->shadow && (c->bg || c->adopt) ? c->shadow : c->params;
}

int ap_collab_new(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc, const ap_collab_config_t *cfg,
                  float *params, size_t n, const ap_nn_view_t *views, size_t nviews,
                  ap_collab_t **out)
{
    return ap__collab_create(rt, dht, svc, cfg, params, n, views, nviews, SIZE_MAX, out);
}

int ap__collab_create(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                      const ap_collab_config_t *cfg, float *params, size_t n,
                      const ap_nn_view_t *views, size_t nviews, size_t state_count,
                      ap_collab_t **out)
{
    if (!rt || !dht || !svc || !cfg || !out || (!params && cfg->role != AP_AVG_AUX))
        return AP_EINVAL;
    size_t rl = cfg->run_id ? strlen(cfg->run_id) : 0;
    if (rl == 0 || rl > AP_COLLAB_RUN_ID_MAX || cfg->target_batch_size == 0 || n == 0 ||
        cfg->role > AP_AVG_AUX || !(cfg->up >= 0) || !(cfg->down >= 0)) {
        ap_warn(OPT_MOD, "collab: bad configuration (run id, target batch size, role or size)");
        return AP_EINVAL;
    }
    if (!ap__avg_codec_get(cfg->codec) || !ap__avg_codec_get(cfg->state_codec)) {
        ap_warn(OPT_MOD, "collab: unknown codec %u (gradients) or %u (state)", cfg->codec,
                cfg->state_codec);
        return AP_EINVAL;
    }
    size_t ml = cfg->model_desc ? strlen(cfg->model_desc) : 0;
    bool printable = ml < AP_RUN_CONFIG_MODEL_MAX;
    for (size_t i = 0; printable && i < ml; i++)
        printable = cfg->model_desc[i] >= 0x20 && cfg->model_desc[i] <= 0x7e;
    if (!printable || !isfinite(cfg->lr.base) || !isfinite(cfg->lr.min) ||
        !isfinite(cfg->solver.weight_decay) || !isfinite(cfg->max_grad_norm) ||
        !(cfg->btard_tau >= 0) || cfg->btard_max_iter > AP_BTARD_CLIP_MAX_ITER) {
        ap_warn(OPT_MOD,
                "collab: bad configuration (model description longer than %d bytes or "
                "not printable, a non-finite learning rate, weight decay or clip, or a bad "
                "CenteredClip tau or step cap)",
                AP_RUN_CONFIG_MODEL_MAX - 1);
        return AP_EINVAL;
    }
    if (cfg->btard_validators &&
        (!cfg->byzantine_tolerant || !cfg->btard_grad || cfg->delayed_updates ||
         cfg->average_state_every || cfg->btard_validators > AP_BTARD_STEP_MAX_PEERS)) {
        ap_warn(OPT_MOD,
                "collab: btard_validators %u needs byzantine_tolerant and btard_grad, at most %d, "
                "no delayed_updates and average_state_every 0",
                cfg->btard_validators, AP_BTARD_STEP_MAX_PEERS);
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
    int rc = ap__closed_init(c);
    c->cfg.run_owner = c->cfg.token = NULL; /* borrowed: read into c */
    if (rc == 0) rc = ap_nn_solver_new(&c->cfg.solver, n, views, nviews, &c->opt);
    if (rc) {
        ap__closed_free(c);
        free(c);
        return rc;
    }
    if (state_count != SIZE_MAX && state_count != c->opt->state_count) {
        /* a caller's optimizer keeps its own state layout in this buffer */
        ap__big_free(c->opt->state, c->opt->state_count * sizeof(float));
        c->opt->state_count = state_count;
        c->opt->state = state_count ? ap__big_alloc(state_count * sizeof(float)) : NULL;
        if (state_count && !c->opt->state) {
            collab_release(c);
            return AP_ENOMEM;
        }
    }
    c->total = n + c->opt->state_count;
    ap__collab_make_run_config(c, &c->runcfg);
    c->cfg.model_desc = c->runcfg.model;
    ap_run_config_digest(&c->runcfg, c->cfg_digest);
    for (int i = 0; i < 8; i++) snprintf(c->cfg_hex + 2 * i, 3, "%02x", c->cfg_digest[i]);
    c->acc_bytes = n * sizeof(float);
    c->buf_bytes = c->total * sizeof(float);
    c->acc = ap__big_alloc(c->acc_bytes);
    c->buf = ap__big_alloc(c->buf_bytes);
    c->view = calloc(AP__VIEW_MAX, sizeof *c->view);
    c->view_seen = calloc(AP__VIEW_MAX, sizeof *c->view_seen);
    c->view_silent = calloc(AP__VIEW_MAX, sizeof *c->view_silent);
    c->seen_prev = calloc(AP__VIEW_MAX, sizeof *c->seen_prev);
    c->report_ms =
        c->cfg.stale_ms / 4 < AP__REPORT_MAX_MS ? c->cfg.stale_ms / 4 : AP__REPORT_MAX_MS;
    if (c->report_ms < 1) c->report_ms = 1;
    if (!c->acc || !c->buf || !c->view || !c->view_seen || !c->view_silent || !c->seen_prev) {
        collab_release(c);
        return AP_ENOMEM;
    }
    rc = ap__btard_collab_init(c); /* byzantine_tolerant: the check services */
    if (rc) {
        ap__btard_collab_stop(c);
        collab_release(c);
        return rc;
    }
    if (c->cfg.delayed_updates && c->cfg.role != AP_AVG_AUX) {
        c->acc_next = ap__big_alloc(c->acc_bytes);
        c->shadow = ap__big_alloc(c->acc_bytes);
        if (!c->acc_next || !c->shadow) {
            ap__btard_collab_stop(c);
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
            ap__btard_collab_stop(c);
            collab_release(c);
            return rc;
        }
    }
    if (c->cfg.dht_matchmaking) {
        rc = ap_avg_matchmaker_new(svc, dht, &c->mm);
        if (rc) {
            if (c->cfg.role == AP_AVG_NORMAL) ap__state_unlisten(c);
            ap__btard_collab_stop(c);
            collab_release(c);
            return rc;
        }
    }
    *out = c;
    return 0;
}

int ap_collab_set_client(ap_collab_t *c, bool client)
{
    if (!c || c->dead) return AP_EINVAL;
    if (c->cfg.role == AP_AVG_AUX) return AP_ESTATE;
    ap_avg_role_t want = client ? AP_AVG_CLIENT : AP_AVG_NORMAL;
    if (c->cfg.role == want) return 0;
    if (want == AP_AVG_NORMAL) {
        int rc = ap__state_listen(c);
        if (rc) return rc;
    } else {
        ap__state_unlisten(c);
    }
    c->cfg.role = want; /* the next progress record and the next round use it */
    ap_info(OPT_MOD, "collab: now %s", client ? "client-only" : "a normal peer");
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
    ap__btard_collab_stop(c); /* a running check ends: its callback sees dead */
    if (c->search) {
        ap_avg_search_t *s = c->search;
        c->search = NULL;
        ap_avg_match_cancel(s); /* its callback sees dead */
    }
    if (c->mm) ap_avg_matchmaker_free(c->mm);
    c->mm = NULL;
    if (c->cb) ap__collab_finish_user(c, AP_ECANCELED);
    ap__collab_unref(c);
}

/* ---- start and submit ------------------------------------------------------------ */

static void start_ready(ap_collab_t *c, int status)
{
    ap_rt_t *rt = c->rt;
    if (status && status != AP_ENOTFOUND)
        ap_warn(OPT_MOD, "state download at start failed (%s): starting from local parameters",
                ap_strerror(status));
    c->started = true;
    c->started_us = ap_rt_now_us(rt);
    c->last_submit_us = c->started_us;
    c->epoch_start_ms = ap_rt_wall_ms(rt);
    ap__collab_report(c, NULL);
    ap__collab_update_stats(c);
    ap__collab_schedule_refresh(c);
    ap__collab_finish_user(c, status == AP_ENOTFOUND ? 0 : status);
}

static void start_loaded(ap_collab_t *c, int status, uint64_t epoch, uint64_t optim_step)
{
    if (status == 0) ap__collab_enter_epoch(c, AP__EPOCH_LOADED, epoch, optim_step);
    start_ready(c, status);
}

static void refused_stored(ap_collab_t *c)
{
    ap__collab_finish_user(c, AP_ECONFIG); /* not started: the peer must not train */
}

static void start_fetched(ap_collab_t *c)
{
    if (c->shut_out) { /* revoked: the owner's record was in this first read */
        ap__collab_finish_user(c, AP_EPERM);
        return;
    }
    if (c->refused) {
        /* One record (marked refused), stored before the start fails, lets
         * the others name the difference in their logs too. */
        ap__collab_report(c, refused_stored);
        return;
    }
    int64_t now = ap_rt_wall_ms(c->rt);
    bool donors = false;
    uint64_t maxe = 0;
    for (size_t i = 0; i < c->nview; i++)
        if (!ap__collab_is_self(c, &c->view[i].peer) && ap__collab_fresh(c, i, now)) {
            if (c->view[i].donor) donors = true;
            if (c->view[i].role != AP_AVG_AUX && c->view[i].epoch > maxe) maxe = c->view[i].epoch;
        }
    if (c->cfg.role == AP_AVG_AUX) {
        ap__collab_enter_epoch(c, AP__EPOCH_FOLLOWED, maxe, 0);
        start_ready(c, 0);
        return;
    }
    if (donors && c->cfg.load_state_on_start) {
        c->phase = PH_DOWNLOADING;
        if (ap__state_download(c, c->buf, 0, start_loaded) == 0) return;
    }
    start_ready(c, 0);
}

int ap_collab_start(ap_collab_t *c, ap_collab_fn cb, void *arg)
{
    if (c->phase != PH_IDLE || c->cb || c->started) return AP_EBUSY;
    int rc = ap__closed_self_check(c); /* no valid token of its own: it must not join */
    if (rc) return rc;
    c->phase = PH_STARTING;
    c->cb = cb;
    c->cb_arg = arg;
    ap__collab_fetch(c, start_fetched);
    return 0;
}

void ap_collab_release(ap_collab_t *c)
{
    if (c && c->cb) ap__collab_release_user(c, AP_ECANCELED);
}

int ap_collab_submit(ap_collab_t *c, const float *grad, uint32_t samples, float loss,
                     ap_collab_fn cb, void *arg)
{
    if (c->refused) return AP_ECONFIG;
    if (c->shut_out) return AP_EPERM;
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
    c->has_loss = true;
    c->cb = cb;
    c->cb_arg = arg;
    if (c->bg) {
        /* the next epoch's cap: a further batch would pass this peer's
         * share, so wait (callback held) until the round is over */
        if (c->next_samples + samples > ap__collab_bg_cap(c)) {
            c->st.submits_held++;
            return 0;
        }
        ap__collab_release_user(c, 0);
        return 0;
    }
    ap_collab_apply_update(c);

    ap__estimate_t e;
    ap__collab_estimate(c, &e);
    ap__collab_update_stats(c);
    /* Close to the end of the epoch (or behind): report and read a fresh view
     * before deciding. Otherwise report in the background and go on. */
    bool near = e.global >= (double)c->cfg.target_batch_size || e.eta_s <= 2.0 * dt ||
                e.max_epoch > c->epoch || ap__collab_at_local_cap(c);
    if (near) {
        c->phase = PH_REPORTING;
        ap__collab_report(c, ap__collab_fetch_decide); /* read after our own store landed */
        return 0;
    }
    if (now - c->last_report_us >= c->cfg.min_refresh_us) ap__collab_report(c, NULL);
    ap__collab_finish_user(c, 0);
    return 0;
}

/* ---- accessors ----------------------------------------------------------------------- */

void ap_collab_get_stats(const ap_collab_t *c, ap_collab_stats_t *out)
{
    *out = c->st;
    out->epoch = c->epoch;
    out->local_samples = c->local_samples;
    out->refused = c->refused;
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

const ap_nn_solver_t *ap_collab_solver(const ap_collab_t *c)
{
    return c->opt;
}

ap_nn_solver_t *ap_collab_solver_mut(ap_collab_t *c)
{
    return c->opt;
}

void ap_collab_set_epoch(ap_collab_t *c, uint64_t epoch)
{
    ap__collab_enter_epoch(c, AP__EPOCH_RESUMED, epoch, 0);
}
