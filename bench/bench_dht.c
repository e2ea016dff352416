/* `apiary bench dht`: the DHT on the simulator (50 ms links, N = 1,000 and
 * 10,000): success rate with no faults, after 20% of the nodes crashed, and
 * under 10% churn per simulated minute; round trips and RPCs per get; p50/p99
 * get latency in virtual time. The round-trip figure is reported against a
 * baseline measured in the same run: the same swarm with the classic split
 * rule (b = 1).
 *
 * The simulator is apiary/sim.h (one connection per node pair, a one round
 * trip handshake on first contact, 50 ms +0..10 ms jitter one way). A crashed
 * node's DHT is freed by the sim's on_crash hook.
 *
 * Loopback part: 64 nodes on one libuv host (the real driver, its own loop
 * thread), over TCP + Noise on 127.0.0.1 ("transport":"tcp") and over the
 * in-process transport ("transport":"memory"); the bench thread calls the
 * blocking wrappers, as a user's training thread would. The baseline is one
 * raw RPC round trip through the same path (call_sync + an empty handler),
 * measured in the same run.
 *
 * Options: --nodes N (only this simulated size), --keys K (gets per phase,
 * default 300), --seed S, --part sim|loopback|all. */
#include "bench.h"

#include "apiary/dht.h"
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "apiary/sim.h"
#include "apiary/sync.h"
#include "runtime/rt_impl.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct bsw {
    ap_sim_t *sim;
    int n;
    ap_dht_t **dht;
    ap_dht_config_t cfg;
    int pending;
    uint64_t rng[4];
    /* joins while the swarm is built: virtual ms from ap_dht_bootstrap to
     * its callback, per node (index 0 never joins) */
    double *join_ms;
    int njoin;
} bsw_t;

typedef struct bjoin {
    bsw_t *s;
    uint64_t t0;
    bool record;
} bjoin_t;

typedef struct bop {
    bsw_t *s;
    bool done, found;
    int status, hops;
    uint64_t t0, t1;
    char value[64];
} bop_t;

static uint64_t brand(bsw_t *s, uint64_t n)
{
    return ap__rng_next(s->rng) % n;
}

static void boot_cb(ap_dht_t *d, void *arg, int status)
{
    bjoin_t *j = arg;
    j->s->pending--;
    if (j->record && status == 0 && j->s->join_ms)
        j->s->join_ms[j->s->njoin++] = (double)(ap_sim_now_us(j->s->sim) - j->t0) / 1000.0;
    free(j);
}
static bool idle(void *arg)
{
    return ((bsw_t *)arg)->pending == 0;
}

static void run_for(bsw_t *s, bool (*pred)(void *), void *arg, uint64_t us)
{
    ap_sim_run_until(s->sim, pred, arg, ap_sim_now_us(s->sim) + us);
}

static void on_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    bsw_t *s = arg;
    ap_dht_free(s->dht[node]);
    s->dht[node] = NULL;
}

static void bootstrap(bsw_t *s, int i, int below)
{
    char a[3][32];
    const char *p[3];
    int want = 1 + (int)brand(s, 3), m = 0;
    for (int t = 0; m < want && t < 50; t++) {
        int j = (int)brand(s, (uint64_t)(below > 0 ? below : s->n));
        if (j == i || !s->dht[j]) continue;
        snprintf(a[m], sizeof a[m], "/sim/%d", j);
        p[m] = a[m];
        m++;
    }
    if (!m) return;
    bjoin_t *jn = malloc(sizeof *jn);
    if (!jn) return;
    jn->s = s;
    jn->t0 = ap_sim_now_us(s->sim);
    jn->record = below > 0; /* joins while building, not restarts under churn */
    s->pending++;
    if (ap_dht_bootstrap(s->dht[i], p, (size_t)m, boot_cb, jn)) {
        s->pending--;
        free(jn);
    }
}

static bsw_t *bsw_new(int n, uint64_t seed, const ap_dht_config_t *cfg)
{
    bsw_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->n = n;
    s->cfg = *cfg;
    s->sim = ap_sim_new(seed);
    s->dht = calloc((size_t)n, sizeof *s->dht);
    s->join_ms = calloc((size_t)n, sizeof *s->join_ms);
    if (!s->sim || !s->dht || !s->join_ms) return NULL;
    ap_sim_link_t link = {.latency_us = 50000, .jitter_us = 10000};
    ap_sim_set_default_link(s->sim, &link);
    ap_sim_node_opts_t no = {.on_crash = on_crash, .hook_arg = s};
    for (int i = 0; i < n; i++)
        if (ap_sim_add_node(s->sim, &no) != i) return NULL;
    ap__rng_seed(s->rng, seed ^ 0x5eed);
    for (int i = 0; i < n; i++) {
        if (ap_dht_new(ap_sim_node(s->sim, i), &s->cfg, &s->dht[i])) return NULL;
        if (i) bootstrap(s, i, i);
        run_for(s, NULL, NULL, 20000);
    }
    run_for(s, idle, s, 600ull * 1000000);
    return s;
}

static void bsw_free(bsw_t *s)
{
    for (int i = 0; i < s->n; i++) ap_dht_free(s->dht[i]);
    ap_sim_free(s->sim);
    free(s->dht);
    free(s->join_ms);
    free(s);
}

static int live(bsw_t *s)
{
    for (;;) {
        int i = (int)brand(s, (uint64_t)s->n);
        if (s->dht[i]) return i;
    }
}

static void crash(bsw_t *s, int i)
{
    ap_sim_crash(s->sim, i); /* on_crash frees the DHT */
}

static void store_cb(ap_dht_t *d, void *arg, int status, int nstored)
{
    bop_t *o = arg;
    o->done = true;
    o->status = status;
    o->s->pending--;
}

static void get_cb(ap_dht_t *d, void *arg, int status, const ap_dht_result_t *res)
{
    bop_t *o = arg;
    o->done = true;
    o->status = status;
    o->t1 = ap_sim_now_us(o->s->sim);
    if (status == 0 && res && res->found && !res->is_dict) {
        o->found = true;
        o->hops = res->hops;
        size_t m = res->records[0].value_len < 63 ? res->records[0].value_len : 63;
        memcpy(o->value, res->records[0].value, m);
        o->value[m] = 0;
    }
    o->s->pending--;
}

static void store_all(bsw_t *s, const char *prefix, int nkeys)
{
    bop_t *ops = calloc((size_t)nkeys, sizeof *ops);
    char key[64], val[64];
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        snprintf(val, sizeof val, "v-%d", i);
        int node = live(s);
        ap_dht_record_t r = {.key = (const uint8_t *)key,
                             .key_len = strlen(key),
                             .value = (const uint8_t *)val,
                             .value_len = strlen(val),
                             .expiration_ms = ap_rt_wall_ms(ap_sim_node(s->sim, node)) + 3600000};
        ops[i].s = s;
        s->pending++;
        if (ap_dht_store(s->dht[node], &r, store_cb, &ops[i])) s->pending--;
    }
    run_for(s, idle, s, 600ull * 1000000);
    free(ops);
}

typedef struct gstats {
    int n, found;
    double hops, rpcs;
    double *lat_ms;
} gstats_t;

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
    if (n == 0) return 0;
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

/* One get at a time from random nodes, so latency and RPC counts are per get. */
static void get_all(bsw_t *s, const char *prefix, int nkeys, gstats_t *g)
{
    memset(g, 0, sizeof *g);
    g->lat_ms = calloc((size_t)nkeys, sizeof *g->lat_ms);
    char key[64], val[64];
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        snprintf(val, sizeof val, "v-%d", i);
        int node = live(s);
        ap_dht_stats_t a, b;
        ap_dht_get_stats(s->dht[node], &a);
        bop_t o = {.s = s, .t0 = ap_sim_now_us(s->sim)};
        s->pending++;
        if (ap_dht_get(s->dht[node], (const uint8_t *)key, strlen(key), false, get_cb, &o)) {
            s->pending--;
            continue;
        }
        run_for(s, idle, s, 600ull * 1000000);
        ap_dht_get_stats(s->dht[node], &b);
        g->n++;
        if (o.found && !strcmp(o.value, val)) {
            g->found++;
            g->hops += o.hops;
            g->lat_ms[g->found - 1] = (double)(o.t1 - o.t0) / 1000.0;
        }
        g->rpcs += (double)(b.rpcs_sent - a.rpcs_sent);
    }
    qsort(g->lat_ms, (size_t)g->found, sizeof *g->lat_ms, cmp_d);
}

static void fields(char *buf, size_t n, int nodes, const char *crashed, const char *churn)
{
    if (crashed)
        snprintf(buf, n, "\"nodes\":%d,\"crashed\":%s,\"churn\":%s", nodes, crashed, churn);
    else
        snprintf(buf, n, "\"nodes\":%d", nodes);
}

static int run_size(ap_bench_ctx_t *c, int n, int nkeys, uint64_t seed, bool churn)
{
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    char f[160];
    double t0 = ap_bench_now();

    /* baseline: classic split rule (b = 1), same seed and workload */
    ap_dht_config_t base = cfg;
    base.depth_mod = 1;
    bsw_t *sb = bsw_new(n, seed, &base);
    if (!sb) return 1;
    qsort(sb->join_ms, (size_t)sb->njoin, sizeof *sb->join_ms, cmp_d);
    double bj50 = pct(sb->join_ms, sb->njoin, 0.5), bj99 = pct(sb->join_ms, sb->njoin, 0.99);
    double bjmax = sb->njoin ? sb->join_ms[sb->njoin - 1] : 0;
    store_all(sb, "k", nkeys);
    gstats_t gb;
    get_all(sb, "k", nkeys, &gb);
    bsw_free(sb);

    bsw_t *s = bsw_new(n, seed, &cfg);
    if (!s) return 1;
    double built = ap_bench_now();
    /* joins: bootstrap call to callback (dial + ping the 1-3 initial peers,
     * self-lookup, one refresh pass over the buckets), virtual time */
    qsort(s->join_ms, (size_t)s->njoin, sizeof *s->join_ms, cmp_d);
    fields(f, sizeof f, n, NULL, NULL);
    ap_bench_report_vs(c, "sim_join_p50_ms", pct(s->join_ms, s->njoin, 0.5), "ms", bj50, f);
    ap_bench_report_vs(c, "sim_join_p99_ms", pct(s->join_ms, s->njoin, 0.99), "ms", bj99, f);
    ap_bench_report_vs(c, "sim_join_max_ms", s->njoin ? s->join_ms[s->njoin - 1] : 0, "ms", bjmax,
                       f);
    store_all(s, "k", nkeys);
    gstats_t g;
    get_all(s, "k", nkeys, &g);
    fields(f, sizeof f, n, "0", "0");
    ap_bench_report(c, "sim_success_rate", (double)g.found / g.n, "ratio", f);
    fields(f, sizeof f, n, NULL, NULL);
    ap_bench_report_vs(c, "sim_round_trips_per_get", g.found ? g.hops / g.found : 0, "rtt",
                       gb.found ? gb.hops / gb.found : 0, f);
    ap_bench_report_vs(c, "sim_rpcs_per_get", g.rpcs / g.n, "rpcs", gb.rpcs / gb.n, f);
    ap_bench_report_vs(c, "sim_get_p50_ms", pct(g.lat_ms, g.found, 0.5), "ms",
                       pct(gb.lat_ms, gb.found, 0.5), f);
    ap_bench_report_vs(c, "sim_get_p99_ms", pct(g.lat_ms, g.found, 0.99), "ms",
                       pct(gb.lat_ms, gb.found, 0.99), f);
    free(g.lat_ms);
    free(gb.lat_ms);

    /* 20% of the nodes crash between store and get */
    for (int k = 0; k < n / 5; k++) crash(s, live(s));
    get_all(s, "k", nkeys, &g);
    fields(f, sizeof f, n, "0.2", "0");
    ap_bench_report(c, "sim_success_rate", (double)g.found / g.n, "ratio", f);
    free(g.lat_ms);

    if (churn) {
        /* 10% churn per simulated minute for 3 minutes, gets at the end of each */
        store_all(s, "ch", nkeys);
        int per = n / 100 > 0 ? n / 100 : 1, found = 0, total = 0;
        for (int tick = 0; tick < 30; tick++) {
            for (int k = 0; k < per; k++) crash(s, live(s));
            for (int k = 0, t = 0; k < per && t < 10 * n; t++) {
                int i = (int)brand(s, (uint64_t)n);
                if (s->dht[i]) continue;
                if (ap_sim_restart(s->sim, i)) break;
                if (ap_dht_new(ap_sim_node(s->sim, i), &s->cfg, &s->dht[i])) break;
                bootstrap(s, i, 0);
                k++;
            }
            run_for(s, NULL, NULL, 6000000);
            if (tick % 10 == 9) {
                get_all(s, "ch", nkeys, &g);
                found += g.found;
                total += g.n;
                free(g.lat_ms);
            }
        }
        fields(f, sizeof f, n, "0", "0.1");
        ap_bench_report(c, "sim_success_rate", total ? (double)found / total : 0, "ratio", f);
    }
    double rtsum = 0;
    int alive = 0;
    for (int i = 0; i < n; i++) {
        if (!s->dht[i]) continue;
        ap_dht_stats_t st;
        ap_dht_get_stats(s->dht[i], &st);
        rtsum += (double)st.routing_peers;
        alive++;
    }
    fields(f, sizeof f, n, NULL, NULL);
    ap_bench_report(c, "sim_routing_peers_mean", alive ? rtsum / alive : 0, "peers", f);
    if (!c->json)
        printf("  (N=%d: swarm built in %.1f s wall, whole run %.1f s wall)\n", n, built - t0,
               ap_bench_now() - t0);
    bsw_free(s);
    return 0;
}

/* ---- loopback: the real driver ------------------------------------------- */

static void echo_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_rpc_respond(req, (const uint8_t *)"", 0);
}

typedef struct ping_ctx {
    const ap_peer_id_t *peer;
    ap_sync_t *done;
} ping_ctx_t;

static void ping_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    ap_sync_complete(((ping_ctx_t *)arg)->done, status);
}

static void ping_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ping_ctx_t *p = arg;
    p->done = done;
    if (!ap_rt_rpc_call(rt, p->peer, "/apiary/bench/echo/1", (const uint8_t *)"x", 1, NULL,
                        ping_done, p))
        ap_sync_complete(done, AP_ENOMEM);
}

static void reg_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_sync_complete(done, ap_rt_rpc_register(rt, "/apiary/bench/echo/1", 0, echo_handler, NULL));
}

static void addr_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    char a[1][AP_RT_ADDR_MAX];
    int n = ap_rt_listen_addrs(rt, a, 1, false);
    if (n >= 1) memcpy(arg, a[0], AP_RT_ADDR_MAX);
    ap_sync_complete(done, n >= 1 ? 0 : AP_EADDR);
}

static void wall_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    *(int64_t *)arg = ap_rt_wall_ms(rt);
    ap_sync_complete(done, 0);
}

typedef struct lb {
    double *st, *gt; /* sorted latencies, ms */
    int stored, found;
} lb_t;

/* nkeys stores then nkeys gets, one at a time, each from a random node. */
static void lb_measure(lb_t *m, ap_dht_t **dht, int nn, int nkeys, const char *prefix,
                       uint64_t rng[4], int64_t now)
{
    m->st = calloc((size_t)nkeys, sizeof *m->st);
    m->gt = calloc((size_t)nkeys, sizeof *m->gt);
    char key[64], val[64];
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        snprintf(val, sizeof val, "v-%d", i);
        ap_dht_record_t r = {.key = (const uint8_t *)key,
                             .key_len = strlen(key),
                             .value = (const uint8_t *)val,
                             .value_len = strlen(val),
                             .expiration_ms = now + 600000};
        int ns = 0;
        double t0 = ap_bench_now();
        int e = ap_dht_store_sync(dht[ap__rng_next(rng) % (uint64_t)nn], &r, &ns);
        m->st[m->stored] = (ap_bench_now() - t0) * 1e3;
        if (e == 0) m->stored++;
    }
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        snprintf(val, sizeof val, "v-%d", i);
        ap_dht_result_t *res = NULL;
        double t0 = ap_bench_now();
        int e = ap_dht_get_sync(dht[ap__rng_next(rng) % (uint64_t)nn], (const uint8_t *)key,
                                strlen(key), false, &res);
        double dt = (ap_bench_now() - t0) * 1e3;
        if (e == 0 && res && res->found && res->records[0].value_len == strlen(val) &&
            !memcmp(res->records[0].value, val, strlen(val)))
            m->gt[m->found++] = dt;
        ap_dht_result_free(res);
    }
    qsort(m->st, (size_t)m->stored, sizeof *m->st, cmp_d);
    qsort(m->gt, (size_t)m->found, sizeof *m->gt, cmp_d);
}

static int run_loopback(ap_bench_ctx_t *c, int nkeys, uint64_t seed, bool tcp)
{
    enum { NN = 64 };
    ap_host_t *h = ap_host_new();
    if (!h || ap_host_start(h)) return 1;
    ap_rt_t *rt[NN];
    ap_dht_t *dht[NN];
    int rc = 0;
    for (int i = 0; i < NN && !rc; i++) {
        ap_node_opts_t o = {.rng_seed = seed * 131 + (uint64_t)i + 1,
                            .listen = tcp ? "/ip4/127.0.0.1/tcp/0" : NULL};
        rc = ap_node_new(h, &o, &rt[i]);
        if (!rc) rc = ap_dht_new_sync(rt[i], NULL, &dht[i]);
    }
    char addr0[AP_RT_ADDR_MAX];
    if (!rc) rc = ap_node_call_sync(rt[0], addr_fn, addr0);
    const char *boot[1] = {addr0};
    for (int i = 1; i < NN && !rc; i++) rc = ap_dht_bootstrap_sync(dht[i], boot, 1);
    if (!rc) rc = ap_node_call_sync(rt[1], reg_fn, NULL);
    if (rc) {
        fprintf(stderr, "bench dht loopback: set-up failed: %s\n", ap_err_name(rc));
        ap_host_free(h);
        return 1;
    }
    for (int i = 2; i < NN && !rc; i++) rc = ap_node_call_sync(rt[i], reg_fn, NULL);
    ap_node_call_sync(rt[0], reg_fn, NULL);
    uint64_t rng[4];
    ap__rng_seed(rng, seed ^ 0x100b);
    lb_t cold = {0}, warm = {0};
    int64_t now = 0;
    ap_node_call_sync(rt[0], wall_fn, &now);
    /* cold: right after the joins, most pairs of nodes have no connection yet */
    lb_measure(&cold, dht, NN, nkeys, "cold", rng, now);
    /* warm: every node has talked to every other (as in a long-running swarm,
     * where the routing table peers are connected) */
    for (int i = 0; i < NN; i++)
        for (int j = 0; j < NN; j++) {
            if (i == j) continue;
            ping_ctx_t pc = {.peer = ap_rt_self(rt[j])};
            ap_node_call_sync(rt[i], ping_fn, &pc);
        }
    lb_measure(&warm, dht, NN, nkeys, "warm", rng, now);
    /* baseline: raw RPC round trips through the same user-thread path */
    double *pt = calloc((size_t)nkeys, sizeof *pt);
    ping_ctx_t pc = {.peer = ap_rt_self(rt[1])};
    for (int i = 0; i < nkeys; i++) {
        double t0 = ap_bench_now();
        ap_node_call_sync(rt[0], ping_fn, &pc);
        pt[i] = (ap_bench_now() - t0) * 1e3;
    }
    for (int i = 0; i < NN; i++) ap_dht_free_sync(dht[i]);
    ap_host_free(h);
    qsort(pt, (size_t)nkeys, sizeof *pt, cmp_d);
    const char *f =
        tcp ? "\"nodes\":64,\"transport\":\"tcp\"" : "\"nodes\":64,\"transport\":\"memory\"";
    double rpc50 = pct(pt, nkeys, 0.5), rpc90 = pct(pt, nkeys, 0.9);
    ap_bench_report(c, "loopback_success_rate", (double)(cold.found + warm.found) / (2 * nkeys),
                    "ratio", f);
    ap_bench_report_vs(c, "loopback_get_p50_ms", pct(warm.gt, warm.found, 0.5), "ms", rpc50, f);
    ap_bench_report_vs(c, "loopback_get_p90_ms", pct(warm.gt, warm.found, 0.9), "ms", rpc90, f);
    ap_bench_report_vs(c, "loopback_store_p50_ms", pct(warm.st, warm.stored, 0.5), "ms", rpc50, f);
    ap_bench_report_vs(c, "loopback_store_p90_ms", pct(warm.st, warm.stored, 0.9), "ms", rpc90, f);
    ap_bench_report_vs(c, "loopback_get_cold_p50_ms", pct(cold.gt, cold.found, 0.5), "ms", rpc50,
                       f);
    ap_bench_report_vs(c, "loopback_store_cold_p50_ms", pct(cold.st, cold.stored, 0.5), "ms", rpc50,
                       f);
    free(cold.st);
    free(cold.gt);
    free(warm.st);
    free(warm.gt);
    free(pt);
    return 0;
}

static int bench_dht(ap_bench_ctx_t *c, int argc, char **argv)
{
    int only = 0, nkeys = c->quick ? 100 : 300;
    bool do_sim = true, do_loop = true;
    uint64_t seed = 1;
    static const struct option opts[] = {{"nodes", required_argument, 0, 'n'},
                                         {"keys", required_argument, 0, 'k'},
                                         {"seed", required_argument, 0, 's'},
                                         {"part", required_argument, 0, 'p'},
                                         {0, 0, 0, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (ch == 'n')
            only = atoi(optarg);
        else if (ch == 'k')
            nkeys = atoi(optarg);
        else if (ch == 's')
            seed = strtoull(optarg, NULL, 10);
        else if (ch == 'p') {
            do_sim = !strcmp(optarg, "sim") || !strcmp(optarg, "all");
            do_loop = !strcmp(optarg, "loopback") || !strcmp(optarg, "all");
            if (!do_sim && !do_loop) return 2;
        } else
            return 2;
    }
    if (ap_log_get_level() == AP_LOG_WARN) ap_log_set_level(AP_LOG_ERROR); /* crashes log WARNs */
    int sizes[2] = {c->quick ? 200 : 1000, c->quick ? 1000 : 10000};
    for (int i = 0; do_sim && i < 2; i++) {
        if (only && sizes[i] != only) continue;
        if (run_size(c, sizes[i], nkeys, seed, i == 0)) return 1;
    }
    if (do_sim && only && only != sizes[0] && only != sizes[1] &&
        run_size(c, only, nkeys, seed, true))
        return 1;
    if (do_loop && run_loopback(c, nkeys, seed, true)) return 1;
    if (do_loop && run_loopback(c, nkeys, seed, false)) return 1;
    return 0;
}

AP_BENCH(bench_dht_def, "dht", bench_dht,
         "DHT on the simulator: success, round trips, latency (N=1k,10k)")
