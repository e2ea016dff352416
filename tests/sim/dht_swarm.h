/* A swarm of DHT nodes on simnet, shared by the DHT scenario tests (each test
 * file includes this once). */
#ifndef AP_TEST_DHT_SWARM_H
#define AP_TEST_DHT_SWARM_H

#include "apiary/dht.h"
#include "runtime/rt_impl.h"
#include "simnet.h"

#define SW_FN static __attribute__((unused))

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct swarm {
    simnet_t *net;
    int n;
    ap_dht_t **dht;
    ap_dht_config_t cfg;
    int pending; /* callbacks outstanding */
    int boot_ok, boot_fail;
    uint64_t rng[4];
} swarm_t;

SW_FN uint64_t sw_rand(swarm_t *s, uint64_t n)
{
    return ap__rng_next(s->rng) % n;
}

SW_FN void sw_boot_done(ap_dht_t *dht, void *arg, int status)
{
    swarm_t *s = arg;
    s->pending--;
    if (status == 0)
        s->boot_ok++;
    else
        s->boot_fail++;
}

SW_FN bool sw_idle(void *arg)
{
    return ((swarm_t *)arg)->pending == 0;
}

SW_FN void sw_run_idle(swarm_t *s, uint64_t timeout_us)
{
    simnet_run_until(s->net, sw_idle, s, timeout_us);
}

SW_FN int sw_start_node(swarm_t *s, int i)
{
    return ap_dht_new(simnet_rt(s->net, i), &s->cfg, &s->dht[i]);
}

/* Node i joins through 1..3 random live nodes among [0, i) (or among all
 * other live nodes if below is 0). */
SW_FN void sw_bootstrap(swarm_t *s, int i, int below)
{
    char addrs[3][32];
    const char *ptrs[3];
    int range = below > 0 ? below : s->n;
    int want = 1 + (int)sw_rand(s, 3);
    int m = 0;
    for (int tries = 0; m < want && tries < 50; tries++) {
        int j = (int)sw_rand(s, (uint64_t)range);
        if (j == i || !s->dht[j]) continue;
        snprintf(addrs[m], sizeof addrs[m], "/sim/%d", j);
        ptrs[m] = addrs[m];
        m++;
    }
    if (m == 0) return;
    s->pending++;
    if (ap_dht_bootstrap(s->dht[i], ptrs, (size_t)m, sw_boot_done, s) != 0) {
        s->pending--;
        s->boot_fail++;
    }
}

/* n simulated nodes of which the first nstart join one after another every
 * join_gap_us (the others stay unstarted: s->dht[i] == NULL). */
SW_FN swarm_t *sw_new_n(int n, int nstart, uint64_t seed, uint64_t latency_us,
                        const ap_dht_config_t *cfg, uint64_t join_gap_us)
{
    swarm_t *s = calloc(1, sizeof *s);
    s->n = n;
    s->net = simnet_new(n, seed, latency_us, latency_us / 5);
    s->dht = calloc((size_t)n, sizeof *s->dht);
    if (cfg)
        s->cfg = *cfg;
    else
        ap_dht_config_default(&s->cfg);
    ap__rng_seed(s->rng, seed ^ 0xabcdef);
    if (sw_start_node(s, 0)) return NULL;
    for (int i = 1; i < nstart; i++) {
        if (sw_start_node(s, i)) return NULL;
        sw_bootstrap(s, i, i);
        simnet_run_until(s->net, NULL, NULL, join_gap_us);
    }
    sw_run_idle(s, 120ull * 1000000);
    return s;
}

SW_FN swarm_t *sw_new(int n, uint64_t seed, uint64_t latency_us, const ap_dht_config_t *cfg,
                      uint64_t join_gap_us)
{
    return sw_new_n(n, n, seed, latency_us, cfg, join_gap_us);
}

SW_FN void sw_crash(swarm_t *s, int i)
{
    if (!s->dht[i]) return;
    ap_dht_free(s->dht[i]);
    s->dht[i] = NULL;
    simnet_crash(s->net, i);
}

SW_FN void sw_free(swarm_t *s)
{
    for (int i = 0; i < s->n; i++) ap_dht_free(s->dht[i]);
    simnet_free(s->net);
    free(s->dht);
    free(s);
}

SW_FN int sw_random_live(swarm_t *s)
{
    for (;;) {
        int i = (int)sw_rand(s, (uint64_t)s->n);
        if (s->dht[i]) return i;
    }
}

/* ---- synchronous-looking store/get on top of the simulator ---------------- */

typedef struct op {
    swarm_t *s;
    bool done;
    int status;
    int nstored;
    bool found;
    int hops;
    char value[256];
    size_t nrecords;
    bool is_dict;
    int64_t exp;
} op_t;

SW_FN void sw_store_cb(ap_dht_t *dht, void *arg, int status, int nstored)
{
    op_t *o = arg;
    o->done = true;
    o->status = status;
    o->nstored = nstored;
    o->s->pending--;
}

SW_FN void sw_get_cb(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res)
{
    op_t *o = arg;
    o->done = true;
    o->status = status;
    if (status == 0 && res) {
        o->found = res->found;
        o->hops = res->hops;
        o->nrecords = res->nrecords;
        o->is_dict = res->is_dict;
        if (res->found && !res->is_dict) {
            size_t n = res->records[0].value_len < sizeof o->value - 1 ? res->records[0].value_len
                                                                       : sizeof o->value - 1;
            memcpy(o->value, res->records[0].value, n);
            o->value[n] = 0;
            o->exp = res->records[0].expiration_ms;
        }
    }
    o->s->pending--;
}

SW_FN int sw_store(swarm_t *s, int node, const char *key, const char *subkey, const char *value,
                   int64_t ttl_ms, op_t *o)
{
    memset(o, 0, sizeof *o);
    o->s = s;
    ap_rt_t *rt = simnet_rt(s->net, node);
    ap_dht_record_t r = {.key = (const uint8_t *)key,
                         .key_len = strlen(key),
                         .subkey = (const uint8_t *)subkey,
                         .subkey_len = subkey ? strlen(subkey) : 0,
                         .value = (const uint8_t *)value,
                         .value_len = strlen(value),
                         .expiration_ms = ap_rt_wall_ms(rt) + ttl_ms};
    s->pending++;
    int rc = ap_dht_store(s->dht[node], &r, sw_store_cb, o);
    if (rc) {
        s->pending--;
        o->done = true;
        o->status = rc;
    }
    return rc;
}

SW_FN int sw_get(swarm_t *s, int node, const char *key, bool latest, op_t *o)
{
    memset(o, 0, sizeof *o);
    o->s = s;
    s->pending++;
    int rc = ap_dht_get(s->dht[node], (const uint8_t *)key, strlen(key), latest, sw_get_cb, o);
    if (rc) {
        s->pending--;
        o->done = true;
        o->status = rc;
    }
    return rc;
}

#endif
