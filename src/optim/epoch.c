/* The optimizer step and the epoch change: every change of a peer's epoch
 * (a step after a round, a download, a jump without state, an auxiliary
 * peer following the run, a resume from a checkpoint) goes through
 * ap__collab_enter_epoch, so what an epoch change resets is in one place.
 * Sans-I/O: runtime.h only. */
#include "collab_impl.h"

#include "apiary/log.h"

#include <math.h>
#include <string.h>

void ap__collab_apply_step(ap_collab_t *c, float *grad)
{
    if (c->cfg.max_grad_norm > 0) {
        double norm = ap_nn_clip_grad_norm(grad, c->n, c->cfg.max_grad_norm);
        if (!isfinite(norm)) {
            ap_warn(OPT_MOD, "epoch %llu: averaged gradient is not finite; step skipped",
                    (unsigned long long)c->epoch);
            return;
        }
    }
    /* delayed updates: the caller computes on params meanwhile */
    float *dst = c->bg ? c->shadow : c->params;
    int rc;
    if (c->step_fn) {
        rc = c->step_fn(c->step_arg, dst, grad, c->epoch, c->opt->step);
        if (rc == 0) c->opt->step++;
    } else {
        rc = ap_nn_solver_step(c->opt, dst, grad, ap_nn_lr_at(&c->cfg.lr, c->epoch));
    }
    if (rc)
        ap_warn(OPT_MOD, "epoch %llu: optimizer step failed: %s", (unsigned long long)c->epoch,
                ap_strerror(rc));
}

void ap__collab_enter_epoch(ap_collab_t *c, ap__epoch_how_t how, uint64_t epoch,
                            uint64_t optim_step)
{
    if (how == AP__EPOCH_STEPPED) {
        /* the round of this epoch stepped: on to the next one */
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
        return;
    }
    if (how == AP__EPOCH_LOADED) {
        /* a finished download: c->buf holds [params | optimizer state] */
        memcpy(c->params, c->buf, c->n * sizeof(float));
        if (c->opt->state_count)
            memcpy(c->opt->state, c->buf + c->n, c->opt->state_count * sizeof(float));
        c->opt->step = optim_step;
        c->st.state_loads++;
    }
    /* LOADED, JUMPED, FOLLOWED, RESUMED: a new epoch without a step here;
     * what was accumulated belongs to an old epoch */
    c->epoch = epoch;
    c->local_samples = 0;
    memset(c->acc, 0, c->acc_bytes);
    c->epoch_start_ms = ap_rt_wall_ms(c->rt);
    c->ready_ms = 0;
    c->st.epoch = epoch;
}

/* Late peer: the round of this epoch is over without our gradients (we
 * missed its group, or the others are in a later epoch). Gradients of an old
 * epoch are discarded (DeDLOC / hivemind semantics), with a log line. */
void ap__collab_drop_epoch_samples(ap_collab_t *c, const char *why)
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

/* A laggard's download ended (ap__collab_decide). */
void ap__collab_load_done(ap_collab_t *c, int status, uint64_t epoch, uint64_t optim_step)
{
    if (c->cb && c->mark_dl_us) c->st.download_us += ap_rt_now_us(c->rt) - c->mark_dl_us;
    c->mark_dl_us = 0;
    if (status == 0) {
        ap__collab_enter_epoch(c, AP__EPOCH_LOADED, epoch, optim_step);
        ap_info(OPT_MOD, "caught up: epoch %llu loaded from peers", (unsigned long long)c->epoch);
    } else {
        ap_warn(OPT_MOD, "state download failed (%s); training on from epoch %llu",
                ap_strerror(status), (unsigned long long)c->epoch);
    }
    ap__collab_report(c, NULL);
    ap__collab_update_stats(c);
    ap__collab_schedule_refresh(c);
    ap__collab_finish_user(c, 0);
}
