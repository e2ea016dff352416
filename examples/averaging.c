/* Three peers average a tensor: each is a node of the real driver (TCP +
 * Noise on 127.0.0.1) with a DHT, an averaging service, a matchmaker and an
 * averager, all created from the peer's own thread with the blocking _sync
 * forms. The peers find each other under one group key in the DHT and run
 * one butterfly all-reduce; afterwards every peer holds the mean. */
#include <apiary/allreduce.h>
#include <apiary/averager.h>
#include <apiary/avg.h>
#include <apiary/dht.h>
#include <apiary/error.h>
#include <apiary/host.h>
#include <apiary/node.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define PEERS 3
#define ELEMS 10000

typedef struct peer {
    ap_rt_t *rt;
    const char *bootstrap; /* the first peer's address with /p2p/<id> */
    int index;
    int rc;
    double averaged_fraction;
    float first, last; /* tensor values after the step */
} peer_t;

static void *peer_main(void *arg)
{
    peer_t *p = arg;
    ap_dht_t *dht = NULL;
    ap_avg_service_t *svc = NULL;
    ap_avg_matchmaker_t *mm = NULL;
    ap_averager_t *av = NULL;
    int rc = ap_dht_new_sync(p->rt, NULL, &dht);
    if (rc == 0 && p->index > 0) rc = ap_dht_bootstrap_sync(dht, &p->bootstrap, 1);
    if (rc == 0) rc = ap_avg_service_new_sync(p->rt, &svc);
    if (rc == 0) rc = ap_avg_matchmaker_new_sync(p->rt, svc, dht, &mm);
    size_t sizes[] = {ELEMS};
    ap_averager_opts_t o = {.role = AP_AVG_NORMAL}; /* or AP_AVG_CLIENT / AP_AVG_AUX */
    if (rc == 0) rc = ap_averager_new_sync(p->rt, svc, sizes, 1, &o, &av);
    if (rc == 0) {
        float *w = ap_averager_tensor(av, 0, NULL); /* write only between steps */
        for (size_t i = 0; i < ELEMS; i++) w[i] = (float)(p->index + 1);
        static const char key[] = "example-run/round-1"; /* any run-wide name */
        ap_avg_match_t m = {.key = (const uint8_t *)key,
                            .key_len = strlen(key),
                            .target_group_size = PEERS,
                            .min_group_size = PEERS};
        ap_allreduce_result_t res;
        rc = ap_averager_step_sync(p->rt, av, mm, &m, /*look_us=*/20000000, /*weight=*/1.0, &res,
                                   NULL);
        if (rc == 0) {
            p->averaged_fraction = res.averaged_fraction;
            p->first = w[0];
            p->last = w[ELEMS - 1];
        }
    }
    ap_averager_free_sync(p->rt, av);
    ap_avg_matchmaker_free_sync(p->rt, mm);
    ap_avg_service_free_sync(p->rt, svc);
    ap_dht_free_sync(dht);
    p->rc = rc;
    return NULL;
}

int main(void)
{
    ap_host_t *host = ap_host_new();
    if (!host || ap_host_start(host) != 0) return 1;
    peer_t peers[PEERS];
    memset(peers, 0, sizeof peers);
    int rc = 0;
    for (int i = 0; i < PEERS && rc == 0; i++) {
        ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
        rc = ap_node_new(host, &o, &peers[i].rt);
        peers[i].index = i;
    }
    char addr[1][AP_RT_ADDR_MAX] = {""}; /* the first peer's, with /p2p/<id> */
    if (rc == 0 && ap_node_listen_addrs_sync(peers[0].rt, addr, 1, true) < 1) rc = AP_ESTATE;
    pthread_t th[PEERS];
    int started = 0;
    for (int i = 0; i < PEERS && rc == 0; i++) {
        peers[i].bootstrap = addr[0];
        if (pthread_create(&th[i], NULL, peer_main, &peers[i]) != 0)
            rc = AP_ENOMEM;
        else
            started++;
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);

    int ok = rc == 0 && started == PEERS;
    const float mean = (1.0f + 2.0f + 3.0f) / 3.0f; /* equal weights */
    for (int i = 0; i < started; i++) {
        printf("peer %d: %s, averaged fraction %.2f, values %.3f .. %.3f\n", i,
               ap_strerror(peers[i].rc), peers[i].averaged_fraction, peers[i].first, peers[i].last);
        ok = ok && peers[i].rc == 0 && peers[i].averaged_fraction == 1.0 &&
             fabsf(peers[i].first - mean) < 1e-6f && fabsf(peers[i].last - mean) < 1e-6f;
    }
    ap_host_stop(host);
    int frc = ap_host_free(host);
    return ok && frc == 0 ? 0 : 1;
}
