/* Determinism (same seed -> same run bit for bit) and scale (10k nodes). */
#include "aptest.h"

#include "apiary/sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MS  1000ull
#define SEC 1000000ull

/* A chatty protocol: every node periodically calls a random peer with a
 * random payload, sometimes streams a few messages, and sometimes does some
 * compute. Everything random comes from the node's runtime RNG. */
typedef struct world {
    ap_sim_t *sim;
    int n;
    uint64_t *digest; /* per node: folds every completion it saw */
    uint64_t *timer;
} world_t;

static world_t *g_w;

static void fold(int node, uint64_t v)
{
    uint64_t h = g_w->digest[node];
    h = (h ^ v) * 0x100000001b3ull;
    g_w->digest[node] = h ^ (h >> 31);
}

static int node_of(ap_rt_t *rt)
{
    return ap_sim_node_index(g_w->sim, rt);
}

static void on_done(ap_rt_t *rt, void *arg, int st, const uint8_t *r, size_t n, const char *e)
{
    fold(node_of(rt), (uint64_t)(int64_t)st ^ (n << 8) ^ (ap_rt_now_us(rt) << 20));
}

static void handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    size_t n;
    const uint8_t *p = ap_rpc_req_data(req, &n);
    fold(node_of(rt), n ^ (p && n ? p[0] : 0));
    if (ap_rt_rand_below(rt, 10) == 0)
        ap_rpc_respond_error(req, AP_EBUSY, "busy");
    else
        ap_rpc_respond(req, p, n / 2);
}

static void s_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    fold(node_of(ap_stream_rt(s)), n);
}
static void s_close(ap_stream_t *s, void *arg, int st)
{
    fold(node_of(ap_stream_rt(s)), (uint64_t)(int64_t)st);
}
static const ap_stream_cbs_t cbs = {s_msg, NULL, NULL, s_close};

static int s_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                    const uint8_t *hello, size_t len)
{
    ap_stream_set_cbs(s, &cbs, NULL);
    ap_stream_close(s);
    return 0;
}

static void after(ap_rt_t *rt, void *arg, int st)
{
    fold(node_of(rt), 77 + (uint64_t)st);
}

static void tick(ap_rt_t *rt, void *arg)
{
    int self = node_of(rt);
    int peer = (int)ap_rt_rand_below(rt, (uint64_t)g_w->n);
    uint8_t buf[3000];
    size_t len = (size_t)ap_rt_rand_below(rt, sizeof buf);
    ap_rt_rand_bytes(rt, buf, len);
    ap_rpc_opts_t o = {.timeout_us = 2 * SEC};
    ap_rt_rpc_call(rt, ap_sim_peer_id(g_w->sim, peer), "/chat/1", buf, len, &o, on_done, NULL);
    uint64_t r = ap_rt_rand_below(rt, 8);
    if (r == 0) {
        ap_stream_t *s;
        if (ap_rt_stream_open(rt, ap_sim_peer_id(g_w->sim, peer), "/bulk/1", NULL, 0, NULL, &cbs,
                              NULL, &s) == 0) {
            for (int k = 0; k < 4; k++) ap_stream_send(s, buf, len);
            ap_stream_close(s);
        }
    } else if (r == 1) {
        ap_rt_work(rt, 1e6 * (double)ap_rt_rand_below(rt, 100), NULL, after, NULL);
    }
    (void)self;
}

static void boot(ap_sim_t *sim, int i, ap_rt_t *rt, void *arg)
{
    assert_ok(ap_rt_rpc_register(rt, "/chat/1", 0, handler, NULL));
    assert_ok(ap_rt_stream_listen(rt, "/bulk/1", NULL, s_accept, NULL));
    uint64_t period = 20 * MS + ap_rt_rand_below(rt, 80 * MS);
    g_w->timer[i] = ap_rt_timer_start(rt, ap_rt_rand_below(rt, period), period, tick, NULL);
}

typedef struct run_result {
    uint64_t hash;
    uint64_t digest;
    ap_sim_stats_t st;
} run_result_t;

static run_result_t run_world(uint64_t seed, int n, uint64_t duration)
{
    world_t w = {0};
    g_w = &w;
    w.n = n;
    w.digest = calloc((size_t)n, sizeof *w.digest);
    w.timer = calloc((size_t)n, sizeof *w.timer);
    w.sim = ap_sim_new(seed);
    assert_non_null(w.sim);
    ap_sim_link_t l = {.latency_us = 15 * MS, .jitter_us = 10 * MS, .bandwidth_bps = 50000000};
    ap_sim_set_default_link(w.sim, &l);
    for (int i = 0; i < n; i++) {
        ap_sim_node_opts_t o = {.on_restart = boot, .flops = 1e9, .skew_ms = i % 7};
        if (i % 5 == 0) {
            o.up_bps = 2000000;
            o.down_bps = 20000000;
        }
        assert_int_equal(ap_sim_add_node(w.sim, &o), i);
    }
    for (int i = 0; i < n; i++) boot(w.sim, i, ap_sim_node(w.sim, i), NULL);
    ap_sim_run_for(w.sim, duration / 4);
    int *groups = calloc((size_t)n, sizeof *groups);
    for (int i = 0; i < n; i++) groups[i] = i % 3 == 0;
    ap_sim_partition(w.sim, groups);
    ap_sim_crash(w.sim, 1);
    ap_sim_crash(w.sim, 2);
    ap_sim_run_for(w.sim, duration / 4);
    ap_sim_heal(w.sim);
    ap_sim_restart(w.sim, 1);
    ap_sim_run_for(w.sim, duration / 2);
    run_result_t r;
    r.hash = ap_sim_trace_hash(w.sim);
    ap_sim_get_stats(w.sim, &r.st);
    r.digest = 0;
    for (int i = 0; i < n; i++) r.digest = (r.digest ^ w.digest[i]) * 0x9e3779b97f4a7c15ull;
    ap_sim_free(w.sim);
    free(groups);
    free(w.digest);
    free(w.timer);
    g_w = NULL;
    return r;
}

static void test_same_seed_same_run(void **state)
{
    int n = ap_test_sanitized() ? 40 : 100;
    uint64_t seed = ap_test_seed(42);
    run_result_t a = run_world(seed, n, 4 * SEC);
    run_result_t b = run_world(seed, n, 4 * SEC);
    run_result_t c = run_world(seed + 1, n, 4 * SEC);
    printf("# %d nodes: %llu events, %llu messages, hash %016llx / %016llx / other seed %016llx\n",
           n, (unsigned long long)a.st.events, (unsigned long long)a.st.messages,
           (unsigned long long)a.hash, (unsigned long long)b.hash, (unsigned long long)c.hash);
    assert_true(a.st.messages > 1000);
    assert_int_equal(a.hash, b.hash);
    assert_int_equal(a.digest, b.digest);
    assert_int_equal(a.st.events, b.st.events);
    assert_int_equal(a.st.messages, b.st.messages);
    assert_int_equal(a.st.bytes, b.st.bytes);
    assert_true(a.hash != c.hash);
    assert_true(a.digest != c.digest);
}

/* ---- scale ------------------------------------------------------------------ */

static int g_done, g_ok;
static void scale_done(ap_rt_t *rt, void *arg, int st, const uint8_t *r, size_t n, const char *e)
{
    g_done++;
    if (st == 0 && n == 8) g_ok++;
}
static bool all_done(void *arg)
{
    return g_done == *(int *)arg;
}

static void test_ten_thousand_nodes(void **state)
{
    int n = ap_test_sanitized() ? 2000 : 10000;
    ap_sim_t *sim = ap_sim_new(ap_test_seed(9));
    ap_sim_link_t l = {.latency_us = 30 * MS, .jitter_us = 20 * MS};
    ap_sim_set_default_link(sim, &l);
    for (int i = 0; i < n; i++) {
        assert_int_equal(ap_sim_add_node(sim, NULL), i);
        assert_ok(ap_rt_rpc_register(ap_sim_node(sim, i), "/echo/1", 0, ap_test_rpc_echo, NULL));
    }
    g_done = g_ok = 0;
    int want = 0;
    for (int i = 0; i < n; i++) {
        ap_rt_t *rt = ap_sim_node(sim, i);
        for (int k = 0; k < 4; k++) {
            int p = (int)ap_rt_rand_below(rt, (uint64_t)n);
            if (p == i) continue;
            ap_rt_rpc_call(rt, ap_sim_peer_id(sim, p), "/echo/1", (const uint8_t *)"8 bytes!", 8,
                           NULL, scale_done, NULL);
            want++;
        }
    }
    assert_true(ap_sim_run_until(sim, all_done, &want, ap_sim_now_us(sim) + 60 * SEC));
    assert_int_equal(g_ok, want);
    ap_sim_stats_t st;
    ap_sim_get_stats(sim, &st);
    printf("# %d nodes: %d calls, %llu events, %llu connections\n", n, want,
           (unsigned long long)st.events, (unsigned long long)st.connections);
    ap_sim_free(sim);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_seed_same_run),
        cmocka_unit_test(test_ten_thousand_nodes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
