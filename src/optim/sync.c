/* Blocking wrappers of the collaborative optimizer for a user's thread next to
 * a node of the real driver. */
#include "collab_impl.h"

#include "apiary/avg.h"
#include "apiary/collab.h"
#include "apiary/nn.h"
#include "apiary/node.h"
#include "apiary/sync.h"

typedef struct sync_args {
    ap_dht_t *dht;
    ap_avg_service_t *svc;
    const ap_collab_config_t *cfg;
    float *params;
    size_t n;
    const ap_nn_view_t *views;
    size_t nviews;
    ap_collab_t *c;
    const float *grad;
    uint32_t samples;
    float loss;
    ap_collab_stats_t *stats;
    ap_sync_t *done;
} sync_args_t;

static void do_new(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    sync_args_t *a = arg;
    ap_sync_complete(done, ap_collab_new(rt, a->dht, a->svc, a->cfg, a->params, a->n, a->views,
                                         a->nviews, &a->c));
}

int ap_collab_new_sync(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                       const ap_collab_config_t *cfg, float *params, size_t n,
                       const ap_nn_view_t *views, size_t nviews, ap_collab_t **out)
{
    sync_args_t a = {.dht = dht,
                     .svc = svc,
                     .cfg = cfg,
                     .params = params,
                     .n = n,
                     .views = views,
                     .nviews = nviews};
    int rc = ap_node_call_sync(rt, do_new, &a);
    if (rc == 0) *out = a.c;
    return rc;
}

static void do_free(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_collab_free(((sync_args_t *)arg)->c);
    ap_sync_complete(done, 0);
}

void ap_collab_free_sync(ap_rt_t *rt, ap_collab_t *c)
{
    sync_args_t a = {.c = c};
    ap_node_call_sync(rt, do_free, &a);
}

static void cb_done(ap_rt_t *rt, void *arg, int status)
{
    ap_sync_complete(((sync_args_t *)arg)->done, status);
}

static void do_start(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    sync_args_t *a = arg;
    a->done = done;
    int rc = ap_collab_start(a->c, cb_done, a);
    if (rc) ap_sync_complete(done, rc);
}

int ap_collab_start_sync(ap_collab_t *c)
{
    sync_args_t a = {.c = c};
    return ap_node_call_sync(c->rt, do_start, &a);
}

static void do_submit(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    sync_args_t *a = arg;
    a->done = done;
    int rc = ap_collab_submit(a->c, a->grad, a->samples, a->loss, cb_done, a);
    if (rc) ap_sync_complete(done, rc);
}

static void do_release(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    ap_collab_release(((sync_args_t *)arg)->c);
    ap_sync_complete(done, 0);
}

void ap_collab_release_sync(ap_collab_t *c)
{
    sync_args_t a = {.c = c};
    ap_node_call_sync(c->rt, do_release, &a);
}

int ap_collab_submit_sync(ap_collab_t *c, const float *grad, uint32_t samples, float loss)
{
    sync_args_t a = {.c = c, .grad = grad, .samples = samples, .loss = loss};
    return ap_node_call_sync(c->rt, do_submit, &a);
}

static void do_stats(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    sync_args_t *a = arg;
    ap_collab_get_stats(a->c, a->stats);
    ap_sync_complete(done, 0);
}

int ap_collab_get_stats_sync(ap_collab_t *c, ap_collab_stats_t *out)
{
    sync_args_t a = {.c = c, .stats = out};
    return ap_node_call_sync(c->rt, do_stats, &a);
}

typedef struct ckpt_args {
    ap_collab_t *c;
    ap_nn_model_t *m;
    uint8_t **buf;
    size_t *len;
    uint64_t *epoch;
} ckpt_args_t;

static void do_ckpt(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ckpt_args_t *a = arg;
    ap_sync_complete(done, ap_collab_checkpoint_encode(a->c, a->m, a->buf, a->len, a->epoch));
}

int ap_collab_checkpoint_encode_sync(ap_collab_t *c, ap_nn_model_t *m, uint8_t **buf, size_t *len,
                                     uint64_t *epoch)
{
    ckpt_args_t a = {.c = c, .m = m, .buf = buf, .len = len, .epoch = epoch};
    return ap_node_call_sync(c->rt, do_ckpt, &a);
}
