/* Collaborative training from C: two peers (two nodes of the real driver in
 * one process, TCP + Noise on 127.0.0.1) fit one linear model together. Each
 * peer's training thread creates its DHT, averaging service and
 * collaborative optimizer with the blocking _sync forms, then computes
 * batches and submits them; every 64 samples from both peers make one
 * global step. A program of your own runs one such peer per machine. */
#include <apiary/avg.h>
#include <apiary/collab.h>
#include <apiary/dht.h>
#include <apiary/host.h>
#include <apiary/nn.h>
#include <apiary/node.h>

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DIM    16
#define BATCH  16
#define EPOCHS 4

typedef struct peer {
    ap_rt_t *rt;
    const char *bootstrap; /* NULL for the first peer */
    int index;
    int rc;
    float first_loss, last_loss; /* on the same held-out batch: before and after */
    uint64_t epoch;
    pthread_barrier_t *done; /* both peers' loops ended: only then do they leave */
} peer_t;

/* Mean gradient and loss of 0.5 (w·x - y)^2 over a batch, y = w*·x with
 * w*[i] = i / DIM. */
static float compute_batch(const float *w, float *grad, unsigned *seed)
{
    float loss = 0;
    memset(grad, 0, DIM * sizeof *grad);
    for (int b = 0; b < BATCH; b++) {
        float x[DIM], err = 0;
        for (int i = 0; i < DIM; i++) {
            x[i] = (float)rand_r(seed) / (float)RAND_MAX - 0.5f;
            err += (w[i] - (float)i / DIM) * x[i];
        }
        for (int i = 0; i < DIM; i++) grad[i] += err * x[i] / BATCH;
        loss += 0.5f * err * err / BATCH;
    }
    return loss;
}

/* The loss of w on a fixed held-out batch (the same for every peer): a peer
 * that joins late downloads trained parameters, so its own first training
 * batch would tell nothing. */
static float eval_loss(const float *w)
{
    unsigned seed = 12345;
    float grad[DIM];
    return compute_batch(w, grad, &seed);
}

static void *peer_main(void *arg)
{
    peer_t *p = arg;
    ap_dht_t *dht = NULL;
    ap_avg_service_t *svc = NULL;
    ap_collab_t *c = NULL;
    float params[DIM] = {0}, grad[DIM]; /* every first peer starts from the same values */
    unsigned seed = 1 + (unsigned)p->index;

    int rc = ap_dht_new_sync(p->rt, NULL, &dht);
    if (rc == 0 && p->bootstrap) rc = ap_dht_bootstrap_sync(dht, &p->bootstrap, 1);
    if (rc == 0) rc = ap_avg_service_new_sync(p->rt, &svc);

    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "example-run";
    cfg.target_batch_size = 4 * BATCH; /* samples per global step, from all peers */
    cfg.solver = ap_nn_solver_defaults(AP_NN_SGD);
    cfg.lr.base = 0.5f;
    cfg.matchmaking_window_us = 200000;
    if (rc == 0) rc = ap_collab_new_sync(p->rt, dht, svc, &cfg, params, DIM, NULL, 0, &c);
    p->first_loss = eval_loss(params);
    if (rc == 0) ap_collab_start_sync(c); /* downloads the state if peers exist */
    for (int i = 0; rc == 0 && p->epoch < EPOCHS && i < 1000; i++) {
        float loss = compute_batch(params, grad, &seed);  /* params are ours between submits */
        rc = ap_collab_submit_sync(c, grad, BATCH, loss); /* may step params */
        ap_collab_stats_t st;
        if (rc == 0) rc = ap_collab_get_stats_sync(c, &st);
        if (rc == 0) p->epoch = st.epoch;
    }
    p->last_loss = eval_loss(params);
    /* A peer that finishes first stays (serving the DHT and its state) until
     * the other is done too: a late joiner must find it to download from. */
    pthread_barrier_wait(p->done);
    ap_collab_free_sync(p->rt, c);
    ap_avg_service_free_sync(p->rt, svc);
    ap_dht_free_sync(dht);
    p->rc = rc;
    return NULL;
}

int main(void)
{
    ap_host_t *host = ap_host_new();
    if (!host || ap_host_start(host) != 0) return 1;
    peer_t peers[2] = {{.index = 0}, {.index = 1}};
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
        rc = ap_node_new(host, &o, &peers[i].rt);
    }
    char addr[1][AP_RT_ADDR_MAX] = {""}; /* the first peer's, with /p2p/<id> */
    if (rc == 0 && ap_node_listen_addrs_sync(peers[0].rt, addr, 1, true) < 1) rc = AP_ESTATE;
    peers[1].bootstrap = addr[0];
    pthread_barrier_t done;
    bool barrier = rc == 0 && pthread_barrier_init(&done, NULL, 2) == 0;
    if (!barrier && rc == 0) rc = AP_ENOMEM;
    peers[0].done = peers[1].done = &done;
    pthread_t th[2];
    int started = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        if (pthread_create(&th[i], NULL, peer_main, &peers[i]) != 0)
            rc = AP_ENOMEM;
        else
            started++;
    }
    if (started == 1) pthread_barrier_wait(&done); /* let the one started peer leave */
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (barrier) pthread_barrier_destroy(&done);
    int ok = rc == 0 && started == 2;
    for (int i = 0; i < started; i++) {
        printf("peer %d: %s, epoch %llu, held-out loss %.4f -> %.4f\n", i, ap_strerror(peers[i].rc),
               (unsigned long long)peers[i].epoch, peers[i].first_loss, peers[i].last_loss);
        ok = ok && peers[i].rc == 0 && peers[i].epoch >= EPOCHS &&
             peers[i].last_loss < peers[i].first_loss;
    }
    ap_host_stop(host);
    int frc = ap_host_free(host);
    return ok && frc == 0 ? 0 : 1;
}
