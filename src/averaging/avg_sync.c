/* Blocking forms of the averaging API for user threads, through the real
 * driver's ap_node_call_sync (include/apiary/node.h): each runs the loop-
 * thread function on the node's loop and waits for it. */
#include "apiary/allreduce.h"
#include "apiary/averager.h"
#include "apiary/avg.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include <string.h>

/* ---- the service ------------------------------------------------------------ */

static void svc_new_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_sync_complete(done, ap_avg_service_new(rt, arg));
}

int ap_avg_service_new_sync(ap_rt_t *rt, ap_avg_service_t **out)
{
    if (!rt || !out) return AP_EINVAL;
    ap_avg_service_t *svc = NULL;
    int rc = ap_node_call_sync(rt, svc_new_fn, &svc);
    if (rc == 0) *out = svc;
    return rc;
}

static void svc_free_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_sync_complete(done, ap_avg_service_free(arg));
}

int ap_avg_service_free_sync(ap_rt_t *rt, ap_avg_service_t *svc)
{
    if (!svc) return 0;
    if (!rt) return AP_EINVAL;
    return ap_node_call_sync(rt, svc_free_fn, svc);
}

/* ---- the averager ------------------------------------------------------------- */

typedef struct av_new_ctx {
    ap_avg_service_t *svc;
    const size_t *sizes;
    size_t n;
    const ap_averager_opts_t *opts;
    ap_averager_t *out;
} av_new_ctx_t;

static void av_new_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    av_new_ctx_t *c = arg;
    ap_sync_complete(done, ap_averager_new(c->svc, c->sizes, c->n, c->opts, &c->out));
}

int ap_averager_new_sync(ap_rt_t *rt, ap_avg_service_t *svc, const size_t *sizes, size_t ntensors,
                         const ap_averager_opts_t *opts, ap_averager_t **out)
{
    if (!rt || !svc || !out) return AP_EINVAL;
    av_new_ctx_t c = {.svc = svc, .sizes = sizes, .n = ntensors, .opts = opts};
    int rc = ap_node_call_sync(rt, av_new_fn, &c);
    if (rc == 0) *out = c.out;
    return rc;
}

static void av_free_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_sync_complete(done, ap_averager_free(arg));
}

int ap_averager_free_sync(ap_rt_t *rt, ap_averager_t *av)
{
    if (!av) return 0;
    if (!rt) return AP_EINVAL;
    return ap_node_call_sync(rt, av_free_fn, av);
}

/* ---- matchmaking ---------------------------------------------------------------- */

typedef struct mm_new_ctx {
    ap_avg_service_t *svc;
    ap_dht_t *dht;
    ap_avg_matchmaker_t *out;
} mm_new_ctx_t;

static void mm_new_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    mm_new_ctx_t *c = arg;
    ap_sync_complete(done, ap_avg_matchmaker_new(c->svc, c->dht, &c->out));
}

int ap_avg_matchmaker_new_sync(ap_rt_t *rt, ap_avg_service_t *svc, ap_dht_t *dht,
                               ap_avg_matchmaker_t **out)
{
    if (!rt || !svc || !dht || !out) return AP_EINVAL;
    mm_new_ctx_t c = {.svc = svc, .dht = dht};
    int rc = ap_node_call_sync(rt, mm_new_fn, &c);
    if (rc == 0) *out = c.out;
    return rc;
}

static void mm_free_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_sync_complete(done, ap_avg_matchmaker_free(arg));
}

int ap_avg_matchmaker_free_sync(ap_rt_t *rt, ap_avg_matchmaker_t *mm)
{
    if (!mm) return 0;
    if (!rt) return AP_EINVAL;
    return ap_node_call_sync(rt, mm_free_fn, mm);
}

/* ---- one step with matchmaking ------------------------------------------------------ */

typedef struct step_ctx {
    ap_averager_t *av;
    ap_avg_matchmaker_t *mm;
    ap_avg_match_t m;
    double weight;
    uint64_t look_us;
    ap_allreduce_result_t res;
    size_t group_n;
    ap_sync_t *done;
} step_ctx_t;

static void step_done(ap_rt_t *rt, void *arg, ap_averager_step_t *st)
{
    step_ctx_t *c = arg;
    const ap_allreduce_result_t *r = ap_averager_step_result(st);
    int status = AP_ESTATE;
    if (r) {
        c->res = *r;
        status = r->status;
    }
    c->group_n = ap_averager_step_group_size(st);
    ap_averager_step_free(st);
    ap_sync_complete(c->done, status);
}

static void step_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    step_ctx_t *c = arg;
    c->done = done;
    if (c->look_us) c->m.deadline_at_us = ap_rt_now_us(rt) + c->look_us;
    ap_averager_step_t *st;
    int rc = ap_averager_step(c->av, c->mm, &c->m, c->weight, step_done, c, &st);
    if (rc) ap_sync_complete(done, rc);
}

int ap_averager_step_sync(ap_rt_t *rt, ap_averager_t *av, ap_avg_matchmaker_t *mm,
                          const ap_avg_match_t *m, uint64_t look_us, double weight,
                          ap_allreduce_result_t *res, size_t *group_size)
{
    if (!rt || !av || !mm || !m) return AP_EINVAL;
    step_ctx_t c = {.av = av, .mm = mm, .m = *m, .weight = weight, .look_us = look_us};
    int rc = ap_node_call_sync(rt, step_fn, &c);
    if (res) *res = c.res;
    if (group_size) *group_size = c.group_n;
    return rc;
}
