/* `apiary bench match-sim [--json] [--quick]`: matchmaking over the DHT on
 * the simulator. N peers (64; 16 with --quick) on 20 ms links with 5 ms
 * jitter start looking within 0.5 s, with deadlines uniform in 3..5 s and
 * target group size 16 (min 2). Reports, in virtual time, the median and
 * the maximum time from a peer's start to its group, the fraction of peers
 * that got a group, the mean group size and the join RPCs per peer. */
#include "apiary/avg.h"
#include "apiary/dht.h"
#include "apiary/log.h"
#include "apiary/sim.h"
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct peer {
    ap_dht_t *dht;
    ap_avg_service_t *svc;
    ap_avg_matchmaker_t *mm;
    uint64_t start_us, end_us;
    int status;
    bool ended;
    size_t n;
} peer_t;

typedef struct run {
    peer_t *p;
    int n;
} run_t;

static void on_match(ap_rt_t *rt, void *arg, int status, const ap_avg_group_t *g)
{
    peer_t *p = arg;
    p->ended = true;
    p->status = status;
    p->end_us = ap_rt_now_us(rt);
    p->n = status == 0 ? g->n : 0;
}

static bool all_ended(void *arg)
{
    run_t *r = arg;
    for (int i = 0; i < r->n; i++)
        if (!r->p[i].ended) return false;
    return true;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int run(ap_bench_ctx_t *c, int argc, char **argv)
{
    (void)argc, (void)argv;
    ap_log_set_level(AP_LOG_ERROR);
    const int n = c->quick ? 16 : 64;
    const uint32_t target = 16;
    ap_sim_t *sim = ap_sim_new(42);
    if (!sim) return 1;
    ap_sim_link_t link = {.latency_us = 20000, .jitter_us = 5000};
    ap_sim_set_default_link(sim, &link);
    peer_t *p = calloc((size_t)n, sizeof *p);
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) rc = ap_sim_add_node(sim, NULL) == i ? 0 : 1;
    for (int i = 0; i < n && rc == 0; i++) {
        ap_rt_t *rt = ap_sim_node(sim, i);
        rc = ap_dht_new(rt, NULL, &p[i].dht);
        if (!rc) rc = ap_avg_service_new(rt, &p[i].svc);
        if (!rc) rc = ap_avg_matchmaker_new(p[i].svc, p[i].dht, &p[i].mm);
    }
    /* each peer knows 3 others; the DHT fills the rest */
    for (int i = 0; i < n && rc == 0; i++)
        for (int k = 1; k <= 3; k++) {
            int j = (i + k * 7) % n;
            char a[32];
            snprintf(a, sizeof a, "/sim/%d", j);
            if (j != i) ap_dht_add_peer(p[i].dht, ap_sim_peer_id(sim, j), a);
        }
    if (rc) {
        fprintf(stderr, "match-sim: set-up failed\n");
        goto out;
    }
    ap_rt_stats_t s0;
    uint64_t rpcs0 = 0;
    for (int i = 0; i < n; i++) {
        ap_rt_get_stats(ap_sim_node(sim, i), &s0);
        rpcs0 += s0.rpc_calls;
    }
    double t0 = ap_bench_now();
    static const uint8_t key[] = "bench/match-sim";
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < n && rc == 0; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        ap_rt_t *rt = ap_sim_node(sim, i);
        ap_avg_member_t me = {.id = *ap_rt_self(rt), .role = AP_AVG_NORMAL, .up = 1e7, .down = 1e7};
        ap_avg_match_t m = {.key = key,
                            .key_len = sizeof key - 1,
                            .target_group_size = target,
                            .deadline_at_us = ap_rt_now_us(rt) + 3000000 + rng % 2000000};
        p[i].start_us = ap_rt_now_us(rt);
        rc = ap_avg_match_start(p[i].mm, &m, &me, on_match, &p[i], NULL);
        ap_sim_run_for(sim, 500000 / (uint64_t)n);
    }
    run_t r = {p, n};
    if (rc || !ap_sim_run_until(sim, all_ended, &r, ap_sim_now_us(sim) + 60000000ull)) {
        fprintf(stderr, "match-sim: searches did not end\n");
        rc = 1;
        goto out;
    }
    double wall = ap_bench_now() - t0;
    uint64_t *t = calloc((size_t)n, sizeof *t), rpcs = 0;
    int grouped = 0;
    double members = 0;
    for (int i = 0; i < n; i++) {
        t[i] = p[i].end_us - p[i].start_us;
        if (p[i].status == 0) grouped++, members += (double)p[i].n;
        ap_rt_stats_t st;
        ap_rt_get_stats(ap_sim_node(sim, i), &st);
        rpcs += st.rpc_calls;
    }
    qsort(t, (size_t)n, sizeof *t, cmp_u64);
    char f[96];
    snprintf(f, sizeof f, "\"peers\":%d,\"target\":%u,\"latency_ms\":20", n, target);
    ap_bench_report(c, "match_median_s", (double)t[n / 2] / 1e6, "s", f);
    ap_bench_report(c, "match_max_s", (double)t[n - 1] / 1e6, "s", f);
    ap_bench_report(c, "grouped_fraction", (double)grouped / n, "", f);
    ap_bench_report(c, "mean_group_size", grouped ? members / grouped : 0, "peers", f);
    ap_bench_report(c, "rpcs_per_peer", (double)(rpcs - rpcs0) / n, "calls", f);
    ap_bench_report(c, "wall_s", wall, "s", f);
    free(t);
out:
    for (int i = 0; i < n; i++) {
        ap_dht_free(p[i].dht);
        ap_avg_matchmaker_free(p[i].mm);
        ap_avg_service_free(p[i].svc);
    }
    ap_sim_free(sim);
    free(p);
    return rc;
}

AP_BENCH(bench_match_sim, "match-sim", run,
         "matchmaking over the DHT on the simulator: time to a group, grouped fraction");
