/* Shared harness of the collaborative-training scenarios on the simulator:
 * N sim nodes, each with a DHT, an averaging service, an MLP from the model
 * kit and a collaborative optimizer; a trainer state machine per peer that
 * computes a batch (charged as virtual compute time with ap_rt_work), submits
 * it and goes on. Crash/restart hooks rebuild a peer from nothing, so a
 * restarted peer is a newcomer that must download the state. */
#ifndef AP_OPTIM_HARNESS_H
#define AP_OPTIM_HARNESS_H

#include "aptest.h"

#include "apiary/avg.h"
#include "apiary/collab.h"
#include "apiary/dht.h"
#include "apiary/log.h"
#include "apiary/nn.h"
#include "apiary/sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OH_DIM     16
#define OH_HIDDEN  32
#define OH_CLASSES 4
#define OH_TASK    0x5eed7a5cull
#define OH_STREAM  0x0da7aull

typedef struct oh_env oh_env_t;

typedef struct oh_peer {
    oh_env_t *env;
    int idx;
    ap_dht_t *dht;
    ap_avg_service_t *svc;
    ap_nn_model_t *model;
    ap_collab_t *collab;
    ap_avg_role_t role;
    int batch;
    double batch_cost; /* compute units per batch */
    bool started, start_failed, stop, busy, up;
    bool sign_flip;    /* an attacker: submits its gradient times -1000 */
    float btard_shift; /* byzantine_tolerant: a cheating aggregator (btard_attack_shift) */
    uint64_t batches;  /* batches computed (data cursor) */
    uint64_t epochs_seen;
    float *x;
    int32_t *y;
    float last_loss;
    /* loss of the batches submitted in each epoch (epochs < OH_EPOCH_LOG) */
    double ep_loss[64];
    uint32_t ep_batches[64];
} oh_peer_t;

#define OH_EPOCH_LOG 64

struct oh_env {
    ap_sim_t *sim;
    int n;
    oh_peer_t *p;
    ap_collab_config_t cfg;
    int data_slots;      /* peer i's k-th batch starts at sample (k*data_slots + i)*batch */
    uint64_t max_epochs; /* trainers stop at this epoch */
    uint64_t init_seed;
    uint64_t data_stream; /* the synthetic stream the batches come from */
};

static void oh_next_batch(oh_peer_t *p);

static void oh_work(void *arg)
{
    oh_peer_t *p = arg;
    oh_env_t *e = p->env;
    uint64_t first = (p->batches * (uint64_t)e->data_slots + (uint64_t)p->idx) * (uint64_t)p->batch;
    ap_nn_synth_classify(OH_TASK, e->data_stream, first, p->batch, OH_DIM, OH_CLASSES, p->x, p->y);
    ap_nn_model_zero_grad(p->model);
    float loss = 0;
    if (ap_nn_mlp_forward(p->model, p->x, p->y, p->batch, &loss) == 0) ap_nn_mlp_backward(p->model);
    p->last_loss = loss;
}

static void oh_submitted(ap_rt_t *rt, void *arg, int status)
{
    oh_peer_t *p = arg;
    p->busy = false;
    if (status) return;
    oh_next_batch(p);
}

static void oh_after(ap_rt_t *rt, void *arg, int status)
{
    oh_peer_t *p = arg;
    if (status || !p->collab) {
        p->busy = false;
        return;
    }
    p->batches++;
    uint64_t ep = ap_collab_epoch(p->collab);
    if (ep < OH_EPOCH_LOG) {
        p->ep_loss[ep] += p->last_loss;
        p->ep_batches[ep]++;
    }
    ap_nn_params_t *pr = ap_nn_model_params(p->model);
    if (p->sign_flip)
        for (size_t k = 0; k < pr->count; k++) pr->grad[k] *= -1000.0f;
    int rc =
        ap_collab_submit(p->collab, pr->grad, (uint32_t)p->batch, p->last_loss, oh_submitted, p);
    if (rc) p->busy = false;
}

static void oh_next_batch(oh_peer_t *p)
{
    if (p->stop || !p->collab || ap_collab_epoch(p->collab) >= p->env->max_epochs) {
        p->busy = false;
        return;
    }
    p->busy = true;
    if (ap_rt_work(ap_sim_node(p->env->sim, p->idx), p->batch_cost, oh_work, oh_after, p) != 0)
        p->busy = false;
}

static void oh_started(ap_rt_t *rt, void *arg, int status)
{
    oh_peer_t *p = arg;
    p->started = true;
    if (status) p->start_failed = true;
    if (p->role != AP_AVG_AUX) oh_next_batch(p);
}

static ap_nn_model_t *oh_model(int max_batch, uint64_t seed)
{
    ap_nn_mlp_config_t mc = {.in_dim = OH_DIM,
                             .n_hidden = 1,
                             .hidden = {OH_HIDDEN},
                             .n_classes = OH_CLASSES,
                             .max_batch = max_batch};
    ap_nn_model_t *m = NULL;
    assert_ok(ap_nn_mlp_new(&mc, &m));
    ap_nn_model_init(m, seed);
    return m;
}

static void oh_peer_start(oh_env_t *e, int i);

/* arg: the peer to start once its DHT joined, or NULL */
static void oh_boot_done(ap_dht_t *dht, void *arg, int status)
{
    (void)dht;
    (void)status;
    oh_peer_t *p = arg;
    if (p && p->collab) oh_peer_start(p->env, p->idx);
}

/* Builds peer i's protocol objects on its (live) node; joins via node `boot`
 * and, if start_after_boot, starts the collab once the DHT joined. */
static void oh_peer_up2(oh_env_t *e, int i, int boot, bool start_after_boot)
{
    oh_peer_t *p = &e->p[i];
    ap_rt_t *rt = ap_sim_node(e->sim, i);
    ap_dht_config_t dc;
    ap_dht_config_default(&dc);
    dc.rpc_timeout_us = 1000000;
    dc.client_mode = false;
    assert_ok(ap_dht_new(rt, &dc, &p->dht));
    if (boot >= 0 && boot != i) {
        char a[32];
        snprintf(a, sizeof a, "/sim/%d", boot);
        const char *ad[1] = {a};
        assert_ok(ap_dht_bootstrap(p->dht, ad, 1, oh_boot_done, start_after_boot ? p : NULL));
    }
    assert_ok(ap_avg_service_new(rt, &p->svc));
    if (!p->model) p->model = oh_model(p->batch, e->init_seed);
    ap_nn_model_init(p->model, e->init_seed); /* a fresh peer starts from scratch */
    ap_nn_params_t *pr = ap_nn_model_params(p->model);
    ap_collab_config_t cfg = e->cfg;
    cfg.role = p->role;
    cfg.btard_attack_shift = p->btard_shift;
    assert_ok(ap_collab_new(rt, p->dht, p->svc, &cfg, pr->data, pr->count, pr->views, pr->nviews,
                            &p->collab));
    p->up = true;
    p->started = p->start_failed = false;
    p->busy = false;
}

static void oh_peer_up(oh_env_t *e, int i, int boot)
{
    oh_peer_up2(e, i, boot, false);
}

static void oh_peer_start(oh_env_t *e, int i)
{
    assert_ok(ap_collab_start(e->p[i].collab, oh_started, &e->p[i]));
}

static void oh_peer_down(oh_env_t *e, int i)
{
    oh_peer_t *p = &e->p[i];
    ap_collab_free(p->collab);
    p->collab = NULL;
    ap_dht_free(p->dht);
    p->dht = NULL;
    if (p->svc) ap_avg_service_free(p->svc);
    p->svc = NULL;
    p->up = false;
    p->busy = false;
}

static void oh_on_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    oh_peer_down(arg, node);
}

static int oh_live_boot(oh_env_t *e, int except)
{
    for (int j = 0; j < e->n; j++)
        if (j != except && e->p[j].up) return j;
    return -1;
}

static void oh_on_restart(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    oh_env_t *e = arg;
    oh_peer_up2(e, node, oh_live_boot(e, node), true);
}

/* n peers with the given batch sizes/costs/roles (NULL = defaults: batch b,
 * 1 s per batch at flops 1e9, normal). Links: 1 ms, 100 Mbit/s. */
static void oh_env_init(oh_env_t *e, int n, uint64_t seed, const ap_collab_config_t *cfg, int b,
                        const double *flops, const ap_avg_role_t *roles)
{
    memset(e, 0, sizeof *e);
    e->sim = ap_sim_new(seed);
    e->n = n;
    e->cfg = *cfg;
    e->data_slots = n;
    e->max_epochs = UINT64_MAX;
    e->init_seed = 1234;
    e->data_stream = OH_STREAM;
    e->p = calloc((size_t)n, sizeof *e->p);
    ap_sim_link_t l = {.bandwidth_bps = 100000000, .latency_us = 1000, .jitter_us = 0};
    ap_sim_set_default_link(e->sim, &l);
    for (int i = 0; i < n; i++) {
        ap_sim_node_opts_t o = {.flops = flops ? flops[i] : 1e9,
                                .on_crash = oh_on_crash,
                                .on_restart = oh_on_restart,
                                .hook_arg = e};
        assert_true(ap_sim_add_node(e->sim, &o) == i);
        oh_peer_t *p = &e->p[i];
        p->env = e;
        p->idx = i;
        p->batch = b;
        p->batch_cost = 1e9;
        p->role = roles ? roles[i] : AP_AVG_NORMAL;
        p->x = malloc(sizeof(float) * (size_t)b * OH_DIM);
        p->y = malloc(sizeof(int32_t) * (size_t)b);
    }
}

static void oh_env_free(oh_env_t *e)
{
    for (int i = 0; i < e->n; i++) {
        if (e->p[i].up) oh_peer_down(e, i);
        ap_nn_model_free(e->p[i].model);
        free(e->p[i].x);
        free(e->p[i].y);
    }
    ap_sim_free(e->sim);
    free(e->p);
}

/* Mean loss of a parameter vector on a fixed evaluation set. */
static __attribute__((unused)) double oh_eval(const float *params, size_t count)
{
    enum { NE = 512 };
    static float x[NE * OH_DIM];
    static int32_t y[NE];
    ap_nn_model_t *m = oh_model(NE, 1);
    ap_nn_params_t *pr = ap_nn_model_params(m);
    assert_int_equal(pr->count, count);
    memcpy(pr->data, params, count * sizeof(float));
    ap_nn_synth_classify(OH_TASK, 0xe7a1ull, 0, NE, OH_DIM, OH_CLASSES, x, y);
    float loss = 0;
    assert_ok(ap_nn_mlp_forward(m, x, y, NE, &loss));
    ap_nn_model_free(m);
    return loss;
}

static __attribute__((unused)) double oh_max_diff(const float *a, const float *b, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++) {
        double t = fabs((double)a[i] - (double)b[i]);
        if (t > d) d = t;
    }
    return d;
}

typedef struct oh_epoch_pred {
    oh_env_t *e;
    uint64_t epoch;
    int min_peers;
} oh_epoch_pred_t;

/* True when at least min_peers live non-aux peers reached epoch. */
static __attribute__((unused)) bool oh_reached(void *arg)
{
    oh_epoch_pred_t *q = arg;
    int k = 0;
    for (int i = 0; i < q->e->n; i++) {
        oh_peer_t *p = &q->e->p[i];
        if (p->up && p->collab && p->role != AP_AVG_AUX && ap_collab_epoch(p->collab) >= q->epoch)
            k++;
    }
    return k >= q->min_peers;
}

#endif
