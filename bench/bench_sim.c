/* `apiary bench sim`: simulator throughput.
 *
 *   events_per_s   delivered messages (RPC requests + responses) per wall
 *                  second: 1000 nodes, 4 concurrent ping-pong RPC loops each,
 *                  every call to a random one of the node's 8 neighbours
 *                  (a fixed random peer set, like a routing table or an
 *                  averaging group), 1 ms +- 0.5 ms links. Baseline: push+pop
 *                  pairs per second of a bare binary heap of the same size
 *                  (the ceiling of any heap-based simulator).
 *   bw_msgs_per_s  delivered stream messages per wall second with the
 *                  bandwidth model busy: 200 nodes on 100 Mbit/s links with
 *                  asymmetric node capacities, 4 KiB messages, 64 KiB
 *                  windows, 2 streams per node.
 *   vsec_per_s     virtual seconds simulated per wall second (RPC scenario). */
#include "bench.h"

#include "apiary/sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define PP_NEIGH 8

typedef struct pp {
    ap_sim_t *sim;
    int n;
    int *neigh; /* n * PP_NEIGH */
} pp_t;
static pp_t g_pp;

static void pp_echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    size_t n;
    const uint8_t *p = ap_rpc_req_data(req, &n);
    ap_rpc_respond(req, p, n);
}

static void pp_done(ap_rt_t *rt, void *arg, int st, const uint8_t *r, size_t n, const char *e);

static void pp_fire(ap_rt_t *rt)
{
    int self = ap_sim_node_index(g_pp.sim, rt);
    int peer = g_pp.neigh[self * PP_NEIGH + (int)ap_rt_rand_below(rt, PP_NEIGH)];
    static const uint8_t payload[32] = "ping-ping-ping-ping-ping-ping-pi";
    ap_rt_rpc_call(rt, ap_sim_peer_id(g_pp.sim, peer), "/bench/ping/1", payload, sizeof payload,
                   NULL, pp_done, NULL);
}

static void pp_done(ap_rt_t *rt, void *arg, int st, const uint8_t *r, size_t n, const char *e)
{
    pp_fire(rt);
}

typedef struct msg_goal {
    ap_sim_t *sim;
    uint64_t target;
} msg_goal_t;

static bool reached(void *arg)
{
    msg_goal_t *g = arg;
    ap_sim_stats_t st;
    ap_sim_get_stats(g->sim, &st);
    return st.messages >= g->target;
}

static int run_pingpong(ap_bench_ctx_t *c, double *rate, double *vrate, double *cpu_rate)
{
    int n = 1000;
    uint64_t target = c->quick ? 300000 : 4000000;
    ap_sim_t *sim = ap_sim_new(1);
    if (!sim) return 1;
    ap_sim_link_t l = {.latency_us = 1000, .jitter_us = 500};
    ap_sim_set_default_link(sim, &l);
    for (int i = 0; i < n; i++) {
        if (ap_sim_add_node(sim, NULL) < 0) return 1;
        ap_rt_rpc_register(ap_sim_node(sim, i), "/bench/ping/1", 0, pp_echo, NULL);
    }
    g_pp.sim = sim;
    g_pp.n = n;
    g_pp.neigh = malloc((size_t)n * PP_NEIGH * sizeof *g_pp.neigh);
    if (!g_pp.neigh) return 1;
    for (int i = 0; i < n; i++) {
        ap_rt_t *rt = ap_sim_node(sim, i);
        for (int k = 0; k < PP_NEIGH; k++) {
            int p = (int)ap_rt_rand_below(rt, (uint64_t)n - 1);
            g_pp.neigh[i * PP_NEIGH + k] = p >= i ? p + 1 : p;
        }
    }
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 4; k++) pp_fire(ap_sim_node(sim, i));
    /* warm up: connections, pools, heap capacity */
    msg_goal_t g = {sim, target / 10};
    ap_sim_run_until(sim, reached, &g, UINT64_MAX);
    ap_sim_stats_t s0, s1;
    ap_sim_get_stats(sim, &s0);
    uint64_t v0 = ap_sim_now_us(sim);
    g.target = s0.messages + target;
    double t0 = ap_bench_now(), c0 = cpu_now();
    /* check the goal every 64k virtual microseconds instead of every event */
    while (!reached(&g)) ap_sim_run_for(sim, 65536);
    double dt = ap_bench_now() - t0, cdt = cpu_now() - c0;
    ap_sim_get_stats(sim, &s1);
    *rate = (double)(s1.messages - s0.messages) / dt;
    *cpu_rate = (double)(s1.messages - s0.messages) / cdt;
    *vrate = (double)(ap_sim_now_us(sim) - v0) / 1e6 / dt;
    ap_sim_free(sim);
    free(g_pp.neigh);
    return 0;
}

/* ---- streams under the bandwidth model ----------------------------------------- */

typedef struct bw_sender {
    ap_stream_t *s;
} bw_sender_t;

static uint8_t g_chunk[4096];

static void bw_pump(ap_stream_t *s)
{
    while (ap_stream_send(s, g_chunk, sizeof g_chunk) == 0) {
    }
}
static void bw_writable(ap_stream_t *s, void *arg)
{
    bw_pump(s);
}
static void bw_close(ap_stream_t *s, void *arg, int st)
{
    ((bw_sender_t *)arg)->s = NULL;
}
static const ap_stream_cbs_t bw_snd = {NULL, bw_writable, NULL, bw_close};
static const ap_stream_cbs_t bw_rcv = {NULL, NULL, NULL, NULL};
static int bw_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *p,
                     const uint8_t *h, size_t n)
{
    ap_stream_set_cbs(s, &bw_rcv, NULL);
    return 0;
}

static int run_bandwidth(ap_bench_ctx_t *c, double *rate)
{
    int n = 200;
    uint64_t target = c->quick ? 100000 : 1000000;
    ap_sim_t *sim = ap_sim_new(2);
    if (!sim) return 1;
    ap_sim_link_t l = {.latency_us = 5000, .jitter_us = 1000, .bandwidth_bps = 100000000};
    ap_sim_set_default_link(sim, &l);
    bw_sender_t *snd = calloc((size_t)n * 2, sizeof *snd);
    if (!snd) return 1;
    for (int i = 0; i < n; i++) {
        ap_sim_node_opts_t o = {.up_bps = (i % 4 == 0) ? 20000000 : 0,
                                .down_bps = (i % 3 == 0) ? 200000000 : 0};
        if (ap_sim_add_node(sim, &o) < 0) return 1;
        ap_rt_stream_listen(ap_sim_node(sim, i), "/bench/bulk/1", NULL, bw_accept, NULL);
    }
    for (int i = 0; i < n; i++) {
        ap_rt_t *rt = ap_sim_node(sim, i);
        for (int k = 0; k < 2; k++) {
            int peer = (i + 1 + k * 7 + (int)ap_rt_rand_below(rt, 5)) % n;
            ap_stream_opts_t so = {.window = 64 * 1024}; /* > bandwidth x RTT */
            ap_rt_stream_open(rt, ap_sim_peer_id(sim, peer), "/bench/bulk/1", NULL, 0, &so, &bw_snd,
                              &snd[i * 2 + k], &snd[i * 2 + k].s);
            bw_pump(snd[i * 2 + k].s);
        }
    }
    msg_goal_t g = {sim, target / 10};
    ap_sim_run_until(sim, reached, &g, UINT64_MAX);
    ap_sim_stats_t s0, s1;
    ap_sim_get_stats(sim, &s0);
    g.target = s0.messages + target;
    double t0 = ap_bench_now();
    while (!reached(&g)) ap_sim_run_for(sim, 65536);
    double dt = ap_bench_now() - t0;
    ap_sim_get_stats(sim, &s1);
    *rate = (double)(s1.messages - s0.messages) / dt;
    ap_sim_free(sim);
    free(snd);
    return 0;
}

/* ---- baseline: a bare binary heap of 24-byte events ------------------------------- */

typedef struct hev {
    uint64_t t, seq;
    uint32_t a, b;
} hev_t;

static double heap_baseline(size_t size, uint64_t ops)
{
    hev_t *h = malloc(size * sizeof *h);
    if (!h) return 0;
    uint64_t x = 88172645463325252ull, seq = 0;
    size_t n = 0;
    for (; n < size; n++) h[n] = (hev_t){.t = (x = x * 6364136223846793005ull + 1) >> 40};
    for (size_t i = n / 2; i-- > 0;) { /* heapify */
        size_t j = i;
        hev_t e = h[j];
        for (;;) {
            size_t c = 2 * j + 1;
            if (c >= n) break;
            if (c + 1 < n && h[c + 1].t < h[c].t) c++;
            if (h[c].t >= e.t) break;
            h[j] = h[c];
            j = c;
        }
        h[j] = e;
    }
    double t0 = ap_bench_now();
    uint64_t sink = 0;
    for (uint64_t k = 0; k < ops; k++) {
        hev_t top = h[0];
        sink += top.a;
        /* pop */
        hev_t e = h[--n];
        size_t j = 0;
        for (;;) {
            size_t c = 2 * j + 1;
            if (c >= n) break;
            if (c + 1 < n && h[c + 1].t < h[c].t) c++;
            if (h[c].t >= e.t) break;
            h[j] = h[c];
            j = c;
        }
        h[j] = e;
        /* push a later event */
        x = x * 6364136223846793005ull + 1;
        hev_t ne = {.t = top.t + 1 + ((x >> 33) & 4095), .seq = seq++, .a = (uint32_t)x};
        j = n++;
        while (j > 0 && ne.t < h[(j - 1) / 2].t) {
            h[j] = h[(j - 1) / 2];
            j = (j - 1) / 2;
        }
        h[j] = ne;
    }
    double dt = ap_bench_now() - t0;
    free(h);
    if (sink == 42) printf(" ");
    return (double)ops / dt;
}

static int bench_sim(ap_bench_ctx_t *c, int argc, char **argv)
{
    double rate = 0, vrate = 0, bw = 0, cpu_rate = 0;
    const char *only = argc > 1 ? argv[1] : "all"; /* rpc | bw | all */
    if (strcmp(only, "rpc") && strcmp(only, "bw") && strcmp(only, "all")) {
        fprintf(stderr, "usage: apiary bench sim [--json] [--quick] [rpc|bw|all]\n");
        return 2;
    }
    if (strcmp(only, "bw") == 0) goto bw;
    if (run_pingpong(c, &rate, &vrate, &cpu_rate) != 0) return 1;
    double base = heap_baseline(8000, c->quick ? 2000000 : 20000000);
    ap_bench_report_vs(c, "events_per_s", rate, "msg/s", base,
                       "\"nodes\":1000,\"scenario\":\"rpc-pingpong\",\"baseline_what\":"
                       "\"bare heap push+pop/s\"");
    /* the machines are shared: CPU time shows what the code does on its own */
    ap_bench_report(c, "events_per_cpu_s", cpu_rate, "msg/s", "\"scenario\":\"rpc-pingpong\"");
    ap_bench_report(c, "vsec_per_s", vrate, "x", "\"scenario\":\"rpc-pingpong\"");
    if (strcmp(only, "rpc") == 0) return 0;
bw:
    if (run_bandwidth(c, &bw) != 0) return 1;
    ap_bench_report(c, "bw_msgs_per_s", bw, "msg/s",
                    "\"nodes\":200,\"scenario\":\"streams-100mbit\",\"msg_bytes\":4096");
    return 0;
}

AP_BENCH(bench_sim_def, "sim", bench_sim, "simulator: delivered messages per wall second")
