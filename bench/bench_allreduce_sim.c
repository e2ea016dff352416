/* `apiary bench allreduce-sim`: the butterfly all-reduce on SIMULATED links
 * (runtime/sim, virtual time). It measures the protocol's schedule against
 * the DeDLOC model, not the machine: round time / the LP's lower bound on
 * equal and heterogeneous links, and the speed-up of balanced parts over
 * equal parts on the heterogeneous links. Metric names carry the "sim_"
 * prefix so they are never mistaken for the loopback/netns benchmark
 * (`apiary bench allreduce`, which needs the TCP transport). */
#include "bench.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/log.h"
#include "apiary/sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct node_state {
    ap_avg_service_t *svc;
    float *data;
    bool done;
    ap_allreduce_result_t res;
} node_state_t;

static void on_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    node_state_t *s = arg;
    s->res = *res;
    s->done = true;
}

typedef struct all_done_arg {
    node_state_t *st;
    int n;
} all_done_arg_t;

static bool all_done(void *arg)
{
    all_done_arg_t *a = arg;
    for (int i = 0; i < a->n; i++)
        if (!a->st[i].done) return false;
    return true;
}

/* One round on links up/down (bytes/s) with declared bandwidths decl (NULL =
 * the true links). Returns the slowest peer's round time (virtual s), or a
 * negative value on failure. */
static double run_round(int n, const ap_avg_role_t *roles, const double *up, const double *down,
                        const double *decl, uint64_t elems)
{
    ap_sim_t *sim = ap_sim_new(42);
    if (!sim) return -1;
    node_state_t *st = calloc((size_t)n, sizeof *st);
    ap_avg_member_t *mem = calloc((size_t)n, sizeof *mem);
    double worst = -1;
    for (int i = 0; i < n; i++) {
        ap_sim_node_opts_t o = {.up_bps = (uint64_t)(up[i] * 8),
                                .down_bps = (uint64_t)(down[i] * 8)};
        if (ap_sim_add_node(sim, &o) < 0) goto out;
    }
    for (int i = 0; i < n; i++) {
        ap_rt_t *rt = ap_sim_node(sim, i);
        if (ap_avg_service_new(rt, &st[i].svc)) goto out;
        mem[i] = (ap_avg_member_t){*ap_rt_self(rt), roles[i], decl ? decl[i] : up[i],
                                   decl ? decl[i] : down[i]};
        if (roles[i] != AP_AVG_AUX) {
            st[i].data = malloc(elems * sizeof(float));
            if (!st[i].data) goto out;
            for (uint64_t k = 0; k < elems; k++) st[i].data[k] = (float)((k * 31 + i) % 97);
        }
    }
    ap_avg_group_t g = {.members = mem, .n = (size_t)n};
    memset(g.id, 0x42, sizeof g.id);
    /* the equal-parts run declares bandwidths its links do not have: a long
     * deadline lets it finish so its time can be measured */
    ap_allreduce_opts_t ro = {.chunk_elems = (uint32_t)(elems / 64 ? elems / 64 : 1),
                              .deadline_factor = 50};
    for (int i = 0; i < n; i++)
        if (ap_allreduce_start(st[i].svc, &g, st[i].data, elems, 1.0, &ro, on_done, &st[i], NULL))
            goto out;
    all_done_arg_t a = {st, n};
    if (!ap_sim_run_until(sim, all_done, &a, ap_sim_now_us(sim) + 3600ull * 1000000)) goto out;
    worst = 0;
    for (int i = 0; i < n; i++) {
        if (st[i].res.status || st[i].res.averaged_fraction != 1.0) {
            worst = -1;
            break;
        }
        double s = (double)st[i].res.elapsed_us / 1e6;
        if (s > worst) worst = s;
    }
out:
    for (int i = 0; i < n; i++) {
        if (st[i].svc) ap_avg_service_free(st[i].svc);
        free(st[i].data);
    }
    ap_sim_free(sim);
    free(st);
    free(mem);
    return worst;
}

static double lp_bound(int n, const ap_avg_role_t *roles, const double *up, const double *down,
                       uint64_t elems)
{
    ap_avg_bw_t bw[16];
    double sh[16], t;
    for (int i = 0; i < n; i++) bw[i] = (ap_avg_bw_t){roles[i], up[i], down[i]};
    if (ap_avg_balance(bw, (size_t)n, NULL, sh, &t)) return -1;
    return t * (double)elems * 4;
}

static int bench_allreduce_sim(ap_bench_ctx_t *c, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    ap_log_set_level(AP_LOG_ERROR);
    uint64_t elems = c->quick ? (1u << 18) : (1u << 22);
    char f[160];
    /* equal links: 4 peers at 100 Mbit/s */
    {
        const ap_avg_role_t r[4] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL};
        const double b[4] = {12.5e6, 12.5e6, 12.5e6, 12.5e6};
        double t = run_round(4, r, b, b, NULL, elems), lb = lp_bound(4, r, b, b, elems);
        if (t < 0 || lb <= 0) return 1;
        snprintf(f, sizeof f,
                 "\"links\":\"equal\",\"peers\":4,\"elems\":%llu,\"round_s\":%.4f,"
                 "\"bound_s\":%.4f,\"simulated\":true",
                 (unsigned long long)elems, t, lb);
        ap_bench_report(c, "sim_round_over_bound", t / lb, "x", f);
    }
    /* heterogeneous: 1000/100/100/20 Mbit/s and a client-only peer at 100 */
    {
        const ap_avg_role_t r[5] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL,
                                    AP_AVG_CLIENT};
        const double b[5] = {125e6, 12.5e6, 12.5e6, 2.5e6, 12.5e6};
        const double same[5] = {12.5e6, 12.5e6, 12.5e6, 12.5e6, 12.5e6};
        double t = run_round(5, r, b, b, NULL, elems), lb = lp_bound(5, r, b, b, elems);
        double teq = run_round(5, r, b, b, same, elems);
        if (t < 0 || lb <= 0 || teq < 0) return 1;
        snprintf(f, sizeof f,
                 "\"links\":\"hetero\",\"peers\":5,\"elems\":%llu,\"round_s\":%.4f,"
                 "\"bound_s\":%.4f,\"simulated\":true",
                 (unsigned long long)elems, t, lb);
        ap_bench_report(c, "sim_round_over_bound", t / lb, "x", f);
        snprintf(f, sizeof f,
                 "\"links\":\"hetero\",\"peers\":5,\"elems\":%llu,\"equal_parts_s\":%.4f,"
                 "\"balanced_s\":%.4f,\"simulated\":true",
                 (unsigned long long)elems, teq, t);
        ap_bench_report(c, "sim_balanced_speedup", teq / t, "x", f);
    }
    return 0;
}

AP_BENCH(bench_allreduce_sim_def, "allreduce-sim", bench_allreduce_sim,
         "butterfly all-reduce on simulated links: round time vs the DeDLOC LP bound")
