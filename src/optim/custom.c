/* The collaborative optimizer with a step made by the caller
 * (ap_collab_new_custom): the collab's buffers for the caller's views, its
 * step counter, resuming, and the blocking wrappers of these.
 * Sans-I/O except the *_sync wrappers (real driver). */
#include "collab_impl.h"

#include "apiary/node.h"
#include "apiary/sync.h"

int ap_collab_new_custom(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                         const ap_collab_config_t *cfg, float *params, size_t n, size_t state_count,
                         ap_collab_step_fn step_fn, void *arg, ap_collab_t **out)
{
    if (!step_fn || !out || state_count == SIZE_MAX) return AP_EINVAL;
    ap_collab_t *c = NULL;
    int rc = ap__collab_create(rt, dht, svc, cfg, params, n, NULL, 0, state_count, &c);
    if (rc) return rc;
    c->step_fn = step_fn;
    c->step_arg = arg;
    *out = c;
    return 0;
}

void ap_collab_buffers(ap_collab_t *c, float **shadow, float **grad, float **state,
                       size_t *state_count)
{
    if (shadow) *shadow = c->shadow;
    if (grad) *grad = c->buf;
    if (state) *state = c->opt->state_count ? c->opt->state : NULL;
    if (state_count) *state_count = c->opt->state_count;
}

uint64_t ap_collab_optim_step(const ap_collab_t *c)
{
    return c->opt->step;
}

void ap_collab_resume(ap_collab_t *c, uint64_t epoch, uint64_t optim_step)
{
    c->opt->step = optim_step;
    ap__collab_enter_epoch(c, AP__EPOCH_RESUMED, epoch, optim_step);
}

typedef struct custom_args {
    ap_dht_t *dht;
    ap_avg_service_t *svc;
    const ap_collab_config_t *cfg;
    float *params;
    size_t n, state_count;
    ap_collab_step_fn fn;
    void *arg;
    ap_collab_t *c;
    uint64_t epoch, optim_step;
} custom_args_t;

static void do_new_custom(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    custom_args_t *a = arg;
    ap_sync_complete(done, ap_collab_new_custom(rt, a->dht, a->svc, a->cfg, a->params, a->n,
                                                a->state_count, a->fn, a->arg, &a->c));
}

int ap_collab_new_custom_sync(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                              const ap_collab_config_t *cfg, float *params, size_t n,
                              size_t state_count, ap_collab_step_fn step_fn, void *arg,
                              ap_collab_t **out)
{
    custom_args_t a = {.dht = dht,
                       .svc = svc,
                       .cfg = cfg,
                       .params = params,
                       .n = n,
                       .state_count = state_count,
                       .fn = step_fn,
                       .arg = arg};
    int rc = ap_node_call_sync(rt, do_new_custom, &a);
    if (rc == 0) *out = a.c;
    return rc;
}

static void do_resume(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    custom_args_t *a = arg;
    if (a->c->phase != PH_IDLE || a->c->bg || a->c->adopt) {
        ap_sync_complete(done, AP_EBUSY);
        return;
    }
    ap_collab_resume(a->c, a->epoch, a->optim_step);
    ap_sync_complete(done, 0);
}

int ap_collab_resume_sync(ap_collab_t *c, uint64_t epoch, uint64_t optim_step)
{
    custom_args_t a = {.c = c, .epoch = epoch, .optim_step = optim_step};
    return ap_node_call_sync(c->rt, do_resume, &a);
}
