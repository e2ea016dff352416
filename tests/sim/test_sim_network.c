/* The simulator's network model: bandwidth, fair sharing, asymmetric node
 * capacities, latency and jitter without reordering. */
#include "aptest.h"

#include "apiary/sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MS   1000ull
#define SEC  1000000ull
#define MBIT 1000000ull
#define MIB  (1u << 20)

/* A sender that pushes `total` bytes in messages of `msg` bytes as fast as
 * the window allows, and its receiver. */
typedef struct flow {
    ap_stream_t *s;
    uint64_t total, sent;
    size_t msg;
    uint8_t *buf;
    /* receiver */
    uint64_t got;
    uint64_t last_at;
    int closes;
} flow_t;

static void pump(flow_t *f)
{
    while (f->s && f->sent < f->total) {
        size_t n = f->total - f->sent < f->msg ? (size_t)(f->total - f->sent) : f->msg;
        int rc = ap_stream_send(f->s, f->buf, n);
        if (rc == AP_EAGAIN) return;
        assert_int_equal(rc, 0);
        f->sent += n;
    }
}

static void snd_writable(ap_stream_t *s, void *arg)
{
    pump(arg);
}
static void snd_close(ap_stream_t *s, void *arg, int status)
{
    ((flow_t *)arg)->s = NULL;
}
static const ap_stream_cbs_t snd_cbs = {NULL, snd_writable, NULL, snd_close};

static void rcv_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t len)
{
    flow_t *f = arg;
    f->got += len;
    f->last_at = ap_rt_now_us(ap_stream_rt(s));
}
static void rcv_close(ap_stream_t *s, void *arg, int status)
{
    ((flow_t *)arg)->closes++;
}
static const ap_stream_cbs_t rcv_cbs = {rcv_msg, NULL, NULL, rcv_close};

/* hello carries the flow pointer so the acceptor can bind the receiver */
static int accept_flow(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                       const uint8_t *hello, size_t len)
{
    flow_t *f;
    assert_int_equal(len, sizeof f);
    memcpy(&f, hello, sizeof f);
    ap_stream_set_cbs(s, &rcv_cbs, f);
    return 0;
}

static void start_flow(ap_sim_t *sim, flow_t *f, int from, int to, uint64_t total, size_t msg,
                       size_t window)
{
    ap_rt_t *a = ap_sim_node(sim, from), *b = ap_sim_node(sim, to);
    memset(f, 0, sizeof *f);
    f->total = total;
    f->msg = msg;
    f->buf = calloc(1, msg);
    assert_non_null(f->buf);
    int rc = ap_rt_stream_listen(b, "/flow/1", NULL, accept_flow, NULL);
    assert_true(rc == 0 || rc == AP_EEXIST);
    ap_stream_opts_t o = {.window = window};
    assert_ok(ap_rt_stream_open(a, ap_sim_peer_id(sim, to), "/flow/1", (const uint8_t *)&f,
                                sizeof f, &o, &snd_cbs, f, &f->s));
    pump(f);
}

static void end_flow(flow_t *f)
{
    free(f->buf);
}

static ap_sim_t *mk(int n, const ap_sim_link_t *l)
{
    ap_sim_t *sim = ap_sim_new(ap_test_seed(11));
    assert_non_null(sim);
    ap_sim_set_default_link(sim, l);
    for (int i = 0; i < n; i++) assert_int_equal(ap_sim_add_node(sim, NULL), i);
    return sim;
}

static bool flow_done(void *arg)
{
    flow_t *f = arg;
    return f->got == f->total;
}

/* 10^9 bytes over 100 Mbit/s take 80 s (within 2%). */
static void test_gigabyte_over_100mbit(void **state)
{
    uint64_t total = ap_test_sanitized() ? 200000000ull : 1000000000ull;
    double want_s = (double)total * 8 / 100e6;
    ap_sim_link_t l = {.latency_us = 1 * MS};
    ap_sim_t *sim = mk(2, &l);
    ap_sim_link_t fast = {.bandwidth_bps = 100 * MBIT, .latency_us = 1 * MS};
    assert_ok(ap_sim_set_link(sim, 0, 1, &fast));
    flow_t f;
    start_flow(sim, &f, 0, 1, total, MIB, 4 * MIB);
    assert_true(ap_sim_run_until(sim, flow_done, &f, 1000 * SEC));
    double took = (double)f.last_at / 1e6;
    printf("# %llu bytes over 100 Mbit/s: %.4f s virtual (ideal %.1f s)\n",
           (unsigned long long)total, took, want_s);
    assert_true(fabs(took - want_s) / want_s < 0.02);
    /* and not faster than the wire allows */
    assert_true(took >= want_s);
    end_flow(&f);
    ap_sim_free(sim);
}

/* Two concurrent streams on one 100 Mbit/s link each get half. */
static void test_two_streams_share_link(void **state)
{
    ap_sim_link_t l = {.latency_us = 2 * MS};
    ap_sim_t *sim = mk(2, &l);
    ap_sim_link_t fast = {.bandwidth_bps = 100 * MBIT, .latency_us = 2 * MS};
    assert_ok(ap_sim_set_link(sim, 0, 1, &fast));
    flow_t f[2];
    for (int i = 0; i < 2; i++) start_flow(sim, &f[i], 0, 1, UINT64_MAX / 2, 256 * 1024, MIB);
    ap_sim_run_for(sim, 20 * SEC);
    double cap = 100e6 / 8 * 20; /* bytes the link can carry in 20 s */
    double g0 = (double)f[0].got, g1 = (double)f[1].got;
    printf("# shared link: %.1f MB + %.1f MB of %.1f MB\n", g0 / 1e6, g1 / 1e6, cap / 1e6);
    assert_true(fabs(g0 - cap / 2) / (cap / 2) < 0.03);
    assert_true(fabs(g1 - cap / 2) / (cap / 2) < 0.03);
    assert_true(g0 + g1 <= cap);
    for (int i = 0; i < 2; i++) end_flow(&f[i]);
    ap_sim_free(sim);
}

/* Two senders into one receiver share its download; one sender to two
 * receivers shares its upload. */
static void test_node_capacity_sharing(void **state)
{
    ap_sim_link_t l = {.latency_us = 1 * MS};
    ap_sim_t *sim = mk(5, &l);
    assert_ok(ap_sim_set_node_bw(sim, 2, 0, 40 * MBIT)); /* receiver of 0 and 1 */
    assert_ok(ap_sim_set_node_bw(sim, 3, 60 * MBIT, 0)); /* sender to 0 and 4 */
    flow_t in[2], out[2];
    start_flow(sim, &in[0], 0, 2, UINT64_MAX / 2, 64 * 1024, MIB);
    start_flow(sim, &in[1], 1, 2, UINT64_MAX / 2, 64 * 1024, MIB);
    start_flow(sim, &out[0], 3, 0, UINT64_MAX / 2, 64 * 1024, MIB);
    start_flow(sim, &out[1], 3, 4, UINT64_MAX / 2, 64 * 1024, MIB);
    ap_sim_run_for(sim, 10 * SEC);
    double in_half = 40e6 / 8 * 10 / 2, out_half = 60e6 / 8 * 10 / 2;
    for (int i = 0; i < 2; i++) {
        printf("# down share %d: %.2f MB (ideal %.2f); up share %d: %.2f MB (ideal %.2f)\n", i,
               (double)in[i].got / 1e6, in_half / 1e6, i, (double)out[i].got / 1e6, out_half / 1e6);
        assert_true(fabs((double)in[i].got - in_half) / in_half < 0.03);
        assert_true(fabs((double)out[i].got - out_half) / out_half < 0.03);
    }
    for (int i = 0; i < 2; i++) {
        end_flow(&in[i]);
        end_flow(&out[i]);
    }
    ap_sim_free(sim);
}

/* A home link: 10 Mbit/s up, 100 Mbit/s down. */
static void test_asymmetric_node(void **state)
{
    ap_sim_link_t l = {.latency_us = 5 * MS};
    ap_sim_t *sim = mk(2, &l);
    assert_ok(ap_sim_set_node_bw(sim, 0, 10 * MBIT, 100 * MBIT));
    flow_t up, down;
    uint64_t total = 10000000; /* 10 MB: 8 s up, 0.8 s down */
    start_flow(sim, &up, 0, 1, total, 256 * 1024, MIB);
    start_flow(sim, &down, 1, 0, total, 256 * 1024, MIB);
    assert_true(ap_sim_run_until(sim, flow_done, &up, 100 * SEC));
    assert_true(flow_done(&down));
    double tu = (double)up.last_at / 1e6, td = (double)down.last_at / 1e6;
    printf("# asymmetric: 10 MB up %.3f s (ideal 8), down %.3f s (ideal 0.8)\n", tu, td);
    assert_true(fabs(tu - 8.0) / 8.0 < 0.02);
    assert_true(fabs(td - 0.8) / 0.8 < 0.05);
    end_flow(&up);
    end_flow(&down);
    ap_sim_free(sim);
}

/* Changing a link mid-transfer changes the rate from then on. */
static void test_link_change_mid_transfer(void **state)
{
    ap_sim_link_t l = {.latency_us = 1 * MS, .bandwidth_bps = 100 * MBIT};
    ap_sim_t *sim = mk(2, &l);
    flow_t f;
    start_flow(sim, &f, 0, 1, 100000000, 256 * 1024, MIB); /* 8 s at 100 Mbit/s */
    ap_sim_run_for(sim, 4 * SEC);
    ap_sim_link_t slow = {.latency_us = 1 * MS, .bandwidth_bps = 50 * MBIT};
    assert_ok(ap_sim_set_link(sim, 0, 1, &slow)); /* the other 50 MB take 8 s */
    assert_true(ap_sim_run_until(sim, flow_done, &f, 100 * SEC));
    double t = (double)f.last_at / 1e6;
    printf("# link slowed at 4 s: done at %.3f s (ideal 12)\n", t);
    assert_true(fabs(t - 12.0) / 12.0 < 0.02);
    end_flow(&f);
    ap_sim_free(sim);
}

/* ---- latency and jitter ---------------------------------------------------- */

typedef struct jit {
    ap_stream_t *s;
    uint32_t next_send, next_recv, n;
    bool in_order;
    uint64_t min_d, max_d;
    int distinct_delays;
    uint64_t last_d;
} jit_t;
static jit_t g_j;

static void j_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t len)
{
    uint32_t seq;
    uint64_t sent;
    memcpy(&seq, d, 4);
    memcpy(&sent, d + 4, 8);
    if (seq != g_j.next_recv) g_j.in_order = false;
    g_j.next_recv = seq + 1;
    uint64_t delay = ap_rt_now_us(ap_stream_rt(s)) - sent;
    if (delay < g_j.min_d) g_j.min_d = delay;
    if (delay > g_j.max_d) g_j.max_d = delay;
    if (delay != g_j.last_d) g_j.distinct_delays++;
    g_j.last_d = delay;
}
static const ap_stream_cbs_t j_rcv = {j_msg, NULL, NULL, NULL};
static const ap_stream_cbs_t j_snd = {NULL, NULL, NULL, NULL};

static int j_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                    const uint8_t *hello, size_t len)
{
    ap_stream_set_cbs(s, &j_rcv, NULL);
    return 0;
}

static void j_tick(ap_rt_t *rt, void *arg)
{
    if (g_j.next_send >= g_j.n) return;
    uint8_t m[12];
    uint64_t now = ap_rt_now_us(rt);
    memcpy(m, &g_j.next_send, 4);
    memcpy(m + 4, &now, 8);
    assert_ok(ap_stream_send(g_j.s, m, sizeof m));
    g_j.next_send++;
}

static void test_latency_jitter_no_reorder(void **state)
{
    ap_sim_link_t l = {.latency_us = 20 * MS, .jitter_us = 15 * MS};
    ap_sim_t *sim = mk(2, &l);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1);
    memset(&g_j, 0, sizeof g_j);
    g_j.n = 2000;
    g_j.in_order = true;
    g_j.min_d = UINT64_MAX;
    assert_ok(ap_rt_stream_listen(b, "/j/1", NULL, j_accept, NULL));
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/j/1", NULL, 0, NULL, &j_snd, NULL, &g_j.s));
    ap_sim_run_for(sim, 200 * MS); /* established */
    uint64_t tid = ap_rt_timer_start(a, 0, 1 * MS, j_tick, NULL);
    ap_sim_run_for(sim, 3 * SEC);
    ap_rt_timer_stop(a, tid);
    printf("# jitter: %u msgs, delay %.3f..%.3f ms, %d changes\n", g_j.next_recv,
           (double)g_j.min_d / 1e3, (double)g_j.max_d / 1e3, g_j.distinct_delays);
    assert_int_equal(g_j.next_recv, g_j.n);
    assert_true(g_j.in_order);
    assert_true(g_j.min_d >= 20 * MS);
    assert_true(g_j.max_d <= 35 * MS);
    assert_true(g_j.max_d - g_j.min_d >= 5 * MS); /* the jitter is real */
    assert_true(g_j.distinct_delays > 100);
    ap_sim_free(sim);
}

/* Per-direction latency: a slow forward path and a fast return path. */
static void rpc_echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_rpc_respond(req, NULL, 0);
}
static uint64_t g_rtt_done;
static void rpc_done(ap_rt_t *rt, void *arg, int st, const uint8_t *r, size_t n, const char *e)
{
    assert_int_equal(st, 0);
    g_rtt_done = ap_rt_now_us(rt);
}

static void test_directional_latency(void **state)
{
    ap_sim_link_t l = {.latency_us = 1 * MS};
    ap_sim_t *sim = mk(2, &l);
    ap_sim_link_t ab = {.latency_us = 30 * MS}, ba = {.latency_us = 10 * MS};
    assert_ok(ap_sim_set_link(sim, 0, 1, &ab));
    assert_ok(ap_sim_set_link(sim, 1, 0, &ba));
    assert_int_equal(ap_sim_set_link(sim, 1, 1, &ab), AP_EINVAL);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1);
    assert_ok(ap_rt_rpc_register(b, "/e/1", 0, rpc_echo, NULL));
    g_rtt_done = 0;
    ap_rt_rpc_call(a, ap_rt_self(b), "/e/1", NULL, 0, NULL, rpc_done, NULL);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(g_rtt_done, 2 * (30 + 10) * MS); /* handshake + call */
    ap_sim_free(sim);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gigabyte_over_100mbit),
        cmocka_unit_test(test_two_streams_share_link),
        cmocka_unit_test(test_node_capacity_sharing),
        cmocka_unit_test(test_asymmetric_node),
        cmocka_unit_test(test_link_change_mid_transfer),
        cmocka_unit_test(test_latency_jitter_no_reorder),
        cmocka_unit_test(test_directional_latency),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
