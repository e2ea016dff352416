/* Shared harness of the all-reduce scenario tests: N nodes on a testbed, one
 * averaging service each, rounds started on a chosen subset, results
 * collected, and the reference weighted mean computed in double. */
#ifndef AP_AVG_HARNESS_H
#define AP_AVG_HARNESS_H

#include "aptest.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/log.h"
#include "averaging/allreduce.h"
#include "apiary/sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct avg_node {
    ap_avg_service_t *svc;
    ap_allreduce_t *ar;
    float *data, *orig;
    double weight;
    ap_avg_role_t role;
    bool in_round, done, crashed;
    ap_allreduce_result_t res;
} avg_node_t;

typedef struct avg_env {
    ap_sim_t *sim;
    int n;
    uint64_t elems;
    avg_node_t *nd;
    uint64_t rng;
    int running;
    double *up, *down; /* link capacities, bytes/s: what avg_start declares */
} avg_env_t;

static uint64_t avg_rnd(avg_env_t *e)
{
    uint64_t z = (e->rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double avg_rnd01(avg_env_t *e)
{
    return (double)(avg_rnd(e) >> 11) / 9007199254740992.0;
}

/* Driver-specific helpers: the only place the tests touch the driver
 * (runtime/sim: virtual time, per-node upload/download capacity with fair
 * sharing, 1 ms links). */
static inline ap_rt_t *avg_rt(avg_env_t *e, int i)
{
    return ap_sim_node(e->sim, i);
}
static inline const ap_peer_id_t *avg_peer_id(avg_env_t *e, int i)
{
    return ap_sim_peer_id(e->sim, i);
}
static inline bool avg_run_until(avg_env_t *e, bool (*pred)(void *), void *arg, uint64_t us)
{
    return ap_sim_run_until(e->sim, pred, arg, ap_sim_now_us(e->sim) + us);
}
static inline void avg_run_for(avg_env_t *e, uint64_t us)
{
    ap_sim_run_for(e->sim, us);
}
/* Link capacities in bytes/s; also the bandwidth avg_start declares. */
static inline void avg_set_bw(avg_env_t *e, int i, double up, double down)
{
    assert_ok(ap_sim_set_node_bw(e->sim, i, (uint64_t)(up * 8), (uint64_t)(down * 8)));
    e->up[i] = up;
    e->down[i] = down;
}
/* A crashed node's protocol objects die with it (its runtime is gone). */
static inline void avg__on_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg);

static inline void avg_env_init(avg_env_t *e, int n, uint64_t elems, uint64_t seed)
{
    memset(e, 0, sizeof *e);
    e->sim = ap_sim_new(seed);
    assert_non_null(e->sim);
    e->n = n;
    e->elems = elems;
    e->rng = seed * 7919 + 1;
    e->nd = calloc((size_t)n, sizeof *e->nd);
    e->up = malloc((size_t)n * sizeof *e->up);
    e->down = malloc((size_t)n * sizeof *e->down);
    for (int i = 0; i < n; i++) {
        ap_sim_node_opts_t so = {
            .up_bps = 1000000000, .down_bps = 1000000000, .on_crash = avg__on_crash, .hook_arg = e};
        assert_true(ap_sim_add_node(e->sim, &so) == i);
        e->up[i] = e->down[i] = 125e6; /* 1 Gbit/s */
    }
    for (int i = 0; i < n; i++) {
        avg_node_t *d = &e->nd[i];
        assert_ok(ap_avg_service_new(avg_rt(e, i), &d->svc));
        d->data = malloc(elems * sizeof(float) + 4);
        d->orig = malloc(elems * sizeof(float) + 4);
        for (uint64_t k = 0; k < elems; k++)
            d->orig[k] = d->data[k] = (float)(avg_rnd01(e) * 200 - 100);
        d->weight = 0.5 + 4 * avg_rnd01(e);
    }
}

static inline void avg_env_free(avg_env_t *e)
{
    for (int i = 0; i < e->n; i++) {
        avg_node_t *d = &e->nd[i];
        if (d->crashed)
            ap__avg_service_abandon(d->svc);
        else
            assert_ok(ap_avg_service_free(d->svc));
        free(d->data);
        free(d->orig);
    }
    ap_sim_free(e->sim);
    free(e->nd);
    free(e->up);
    free(e->down);
}

static inline void avg_on_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    avg_node_t *d = arg;
    d->res = *res;
    d->done = true;
    d->ar = NULL;
}

/* Starts a round among members idx[0..m) (group order = idx order) with the
 * roles in e->nd[*].role and declared bandwidths up/down (NULL = 125e6). */
static inline void avg_start(avg_env_t *e, const int *idx, int m, const uint8_t gid[32],
                             const double *up, const double *down, const ap_allreduce_opts_t *o)
{
    ap_avg_member_t *mem = calloc((size_t)m, sizeof *mem);
    for (int k = 0; k < m; k++) {
        mem[k].id = *avg_peer_id(e, idx[k]);
        mem[k].role = e->nd[idx[k]].role;
        mem[k].up = up ? up[k] : e->up[idx[k]];
        mem[k].down = down ? down[k] : e->down[idx[k]];
    }
    ap_avg_group_t g = {.members = mem, .n = (size_t)m};
    memcpy(g.id, gid, 32);
    for (int k = 0; k < m; k++) {
        avg_node_t *d = &e->nd[idx[k]];
        d->done = false;
        d->in_round = true;
        float *buf = d->role == AP_AVG_AUX ? NULL : d->data;
        assert_ok(
            ap_allreduce_start(d->svc, &g, buf, e->elems, d->weight, o, avg_on_done, d, &d->ar));
    }
    free(mem);
}

static inline bool avg_all_done(void *arg)
{
    avg_env_t *e = arg;
    for (int i = 0; i < e->n; i++)
        if (e->nd[i].in_round && !e->nd[i].crashed && !e->nd[i].done) return false;
    return true;
}

static inline void avg__on_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    (void)sim;
    (void)rt;
    avg_env_t *e = arg;
    ap__avg_service_abandon(e->nd[node].svc);
    e->nd[node].svc = NULL;
    e->nd[node].ar = NULL;
}

static inline void avg_crash(avg_env_t *e, int i)
{
    e->nd[i].crashed = true;
    assert_ok(ap_sim_crash(e->sim, i));
}

/* Weighted mean over the senders among idx (skipping crashed unless
 * include_crashed), from the original data. */
static inline void avg_reference(avg_env_t *e, const int *idx, int m, const bool *include,
                                 double *out)
{
    for (uint64_t k = 0; k < e->elems; k++) {
        double s = 0, w = 0;
        for (int j = 0; j < m; j++) {
            avg_node_t *d = &e->nd[idx[j]];
            if (d->role == AP_AVG_AUX || (include && !include[j])) continue;
            s += d->weight * d->orig[k];
            w += d->weight;
        }
        out[k] = s / w;
    }
}

static inline bool close_rel(double got, double want, double tol)
{
    return fabs(got - want) <= tol * (fabs(want) > 1 ? fabs(want) : 1);
}

#endif
