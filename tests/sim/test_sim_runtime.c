/* The simulator as a runtime: RPC, timers, streams, dial, clocks, compute. */
#include "aptest.h"

#include "apiary/sim.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MS  1000ull
#define SEC 1000000ull

typedef struct done_rec {
    int calls;
    int status;
    uint64_t at;
    size_t len;
    uint8_t data[64];
    char errmsg[64];
} done_rec_t;

static ap_sim_t *g_sim;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    done_rec_t *d = arg;
    d->calls++;
    d->status = status;
    d->at = ap_rt_now_us(rt);
    d->len = len;
    if (resp && len <= sizeof d->data) memcpy(d->data, resp, len);
    snprintf(d->errmsg, sizeof d->errmsg, "%s", errmsg ? errmsg : "");
}

static void echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    size_t len;
    const uint8_t *p = ap_rpc_req_data(req, &len);
    ap_rpc_respond(req, p, len);
}

static void fails(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_rpc_respond_error(req, AP_ENOTFOUND, "no such key");
}

static ap_rpc_req_t *g_held;
static void hold(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    g_held = req;
}

static ap_sim_t *mk(int n, uint64_t lat_us)
{
    ap_sim_t *sim = ap_sim_new(ap_test_seed(7));
    assert_non_null(sim);
    ap_sim_link_t l = {.latency_us = lat_us};
    ap_sim_set_default_link(sim, &l);
    for (int i = 0; i < n; i++) assert_int_equal(ap_sim_add_node(sim, NULL), i);
    g_sim = sim;
    return sim;
}

static bool rec_done(void *arg)
{
    return ((done_rec_t *)arg)->calls > 0;
}

static void test_rpc_echo_and_latency(void **state)
{
    ap_sim_t *sim = mk(2, 5 * MS);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1);
    assert_ok(ap_rt_rpc_register(b, "/echo/1", 0, echo, NULL));
    done_rec_t d = {0};
    uint64_t id =
        ap_rt_rpc_call(a, ap_rt_self(b), "/echo/1", (const uint8_t *)"hello", 5, NULL, on_done, &d);
    assert_true(id != 0);
    assert_int_equal(d.calls, 0); /* never before the call returns */
    assert_true(ap_sim_run_until(sim, rec_done, &d, 10 * SEC));
    assert_int_equal(d.status, 0);
    assert_int_equal(d.len, 5);
    assert_memory_equal(d.data, "hello", 5);
    /* handshake (SYN + SYN-ACK) then request + response: 4 one-way delays */
    assert_int_equal(d.at, 20 * MS);
    assert_true(ap_rt_is_connected(a, ap_rt_self(b)));
    assert_true(ap_rt_is_connected(b, ap_rt_self(a)));
    /* on an open connection: one round trip */
    memset(&d, 0, sizeof d);
    uint64_t t0 = ap_sim_now_us(sim);
    ap_rt_rpc_call(a, ap_rt_self(b), "/echo/1", (const uint8_t *)"x", 1, NULL, on_done, &d);
    assert_true(ap_sim_run_until(sim, rec_done, &d, t0 + 10 * SEC));
    assert_int_equal(d.at - t0, 10 * MS);
    ap_rt_stats_t st;
    ap_rt_get_stats(a, &st);
    assert_int_equal(st.rpc_calls, 2);
    assert_int_equal(st.connections, 1);
    assert_true(st.bytes_sent >= 2 * AP_SIM_FRAME_OVERHEAD + 6);
    ap_rt_get_stats(b, &st);
    assert_int_equal(st.rpc_served, 2);
    ap_sim_free(sim);
}

static void test_rpc_errors(void **state)
{
    ap_sim_t *sim = mk(3, 1 * MS);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1);
    assert_ok(ap_rt_rpc_register(b, "/fail/1", 0, fails, NULL));
    assert_ok(ap_rt_rpc_register(b, "/small/1", 4, echo, NULL));
    assert_ok(ap_rt_rpc_register(b, "/hold/1", 0, hold, NULL));
    assert_int_equal(ap_rt_rpc_register(b, "/hold/1", 0, hold, NULL), AP_EEXIST);
    done_rec_t d[6] = {0};
    ap_rt_rpc_call(a, ap_rt_self(b), "/fail/1", NULL, 0, NULL, on_done, &d[0]);
    ap_rt_rpc_call(a, ap_rt_self(b), "/none/1", NULL, 0, NULL, on_done, &d[1]);
    ap_rt_rpc_call(a, ap_rt_self(b), "/small/1", (const uint8_t *)"12345", 5, NULL, on_done, &d[2]);
    ap_peer_id_t stranger = *ap_rt_self(b);
    stranger.b[AP_PEER_ID_LEN - 1] ^= 1;
    ap_rt_rpc_call(a, &stranger, "/fail/1", NULL, 0, NULL, on_done, &d[3]);
    ap_rpc_opts_t o = {.timeout_us = 300 * MS};
    ap_rt_rpc_call(a, ap_rt_self(b), "/hold/1", NULL, 0, &o, on_done, &d[4]);
    ap_rpc_opts_t small = {.max_resp = 2};
    ap_rt_rpc_call(a, ap_rt_self(b), "/small/1", (const uint8_t *)"abc", 3, &small, on_done, &d[5]);
    ap_sim_run_for(sim, 1 * SEC);
    for (int i = 0; i < 6; i++) assert_int_equal(d[i].calls, 1);
    assert_int_equal(d[0].status, AP_ENOTFOUND);
    assert_string_equal(d[0].errmsg, "no such key");
    assert_int_equal(d[1].status, AP_ENOPROTO);
    assert_int_equal(d[2].status, AP_EMSGSIZE);
    assert_int_equal(d[3].status, AP_EUNREACH);
    assert_int_equal(d[4].status, AP_ETIMEDOUT);
    assert_int_equal(d[4].at, 300 * MS);
    assert_int_equal(d[5].status, AP_EMSGSIZE);
    /* the late response to a timed-out call is dropped */
    assert_non_null(g_held);
    ap_rpc_respond(g_held, (const uint8_t *)"late", 4);
    g_held = NULL;
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(d[4].calls, 1);
    /* cancel: done runs before cancel returns, exactly once */
    done_rec_t c = {0};
    uint64_t id = ap_rt_rpc_call(a, ap_rt_self(b), "/hold/1", NULL, 0, NULL, on_done, &c);
    assert_true(ap_rt_rpc_cancel(a, id));
    assert_int_equal(c.calls, 1);
    assert_int_equal(c.status, AP_ECANCELED);
    assert_false(ap_rt_rpc_cancel(a, id));
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(c.calls, 1);
    assert_non_null(g_held);
    ap_rpc_respond(g_held, NULL, 0);
    g_held = NULL;
    ap_sim_free(sim);
}

/* ---- timers ---------------------------------------------------------------- */

typedef struct tlog {
    int n;
    int order[16];
    uint64_t at[16];
    uint64_t self_id;
    ap_rt_t *rt;
} tlog_t;
static tlog_t g_tl;

static void t_mark(ap_rt_t *rt, void *arg)
{
    int v = (int)(intptr_t)arg;
    if (g_tl.n < 16) {
        g_tl.order[g_tl.n] = v;
        g_tl.at[g_tl.n] = ap_rt_now_us(rt);
    }
    g_tl.n++;
    if (v == 9 && g_tl.n >= 6) assert_true(ap_rt_timer_stop(rt, g_tl.self_id));
}

static void test_timers(void **state)
{
    ap_sim_t *sim = mk(1, 0);
    ap_rt_t *a = ap_sim_node(sim, 0);
    memset(&g_tl, 0, sizeof g_tl);
    ap_rt_timer_start(a, 10 * MS, 0, t_mark, (void *)1);
    ap_rt_timer_start(a, 10 * MS, 0, t_mark, (void *)2);
    ap_rt_timer_start(a, 5 * MS, 0, t_mark, (void *)3);
    uint64_t dead = ap_rt_timer_start(a, 7 * MS, 0, t_mark, (void *)4);
    assert_true(ap_rt_timer_stop(a, dead));
    assert_false(ap_rt_timer_stop(a, dead));
    ap_sim_run_for(sim, 20 * MS);
    assert_int_equal(g_tl.n, 3);
    assert_int_equal(g_tl.order[0], 3);
    assert_int_equal(g_tl.order[1], 1); /* same instant: start order */
    assert_int_equal(g_tl.order[2], 2);
    assert_int_equal(g_tl.at[1], 10 * MS);
    /* periodic, stopped from inside its own callback on the 3rd firing */
    g_tl.self_id = ap_rt_timer_start(a, 1 * MS, 2 * MS, t_mark, (void *)9);
    ap_sim_run_for(sim, 100 * MS);
    assert_int_equal(g_tl.n, 6);
    assert_int_equal(g_tl.at[5] - g_tl.at[4], 2 * MS);
    assert_int_equal(ap_sim_now_us(sim), 120 * MS);
    ap_sim_free(sim);
}

/* ---- clocks, compute ---------------------------------------------------------- */

static int g_after_n;
static uint64_t g_after_at[4];
static int g_worked;
static void w_work(void *arg)
{
    g_worked++;
}
static void w_after(ap_rt_t *rt, void *arg, int status)
{
    assert_int_equal(status, 0);
    g_after_at[(intptr_t)arg] = ap_rt_now_us(rt);
    g_after_n++;
}

static double cost_fn(void *arg, int node, double cost)
{
    return cost * 3.0;
}

static void test_clock_skew_and_compute(void **state)
{
    ap_sim_t *sim = mk(3, 0);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1), *c = ap_sim_node(sim, 2);
    assert_ok(ap_sim_set_skew(sim, 1, 5000));
    assert_ok(ap_sim_set_skew(sim, 2, -1500));
    ap_sim_run_for(sim, 2 * SEC);
    assert_int_equal(ap_rt_wall_ms(a), 1735689600000ll + 2000);
    assert_int_equal(ap_rt_wall_ms(b) - ap_rt_wall_ms(a), 5000);
    assert_int_equal(ap_rt_wall_ms(c) - ap_rt_wall_ms(a), -1500);
    assert_int_equal(ap_rt_now_us(b), 2 * SEC);

    /* node 0 at 1e9 units/s, node 1 ten times slower, node 2 custom */
    assert_ok(ap_sim_set_flops(sim, 0, 1e9));
    assert_ok(ap_sim_set_flops(sim, 1, 1e8));
    assert_ok(ap_sim_set_compute(sim, 2, cost_fn, NULL));
    uint64_t t0 = ap_sim_now_us(sim);
    g_after_n = g_worked = 0;
    assert_ok(ap_rt_work(a, 1e9, w_work, w_after, (void *)0));
    assert_ok(ap_rt_work(b, 1e9, w_work, w_after, (void *)1));
    assert_ok(ap_rt_work(b, 5e8, w_work, w_after, (void *)2)); /* queued behind */
    assert_ok(ap_rt_work(c, 1000, w_work, w_after, (void *)3));
    assert_int_equal(g_worked, 4); /* inline */
    assert_int_equal(g_after_n, 0);
    ap_sim_run_for(sim, 60 * SEC);
    assert_int_equal(g_after_n, 4);
    assert_int_equal(g_after_at[0] - t0, 1 * SEC);
    assert_int_equal(g_after_at[1] - t0, 10 * SEC);
    assert_int_equal(g_after_at[2] - t0, 15 * SEC);
    assert_int_equal(g_after_at[3] - t0, 3000);
    ap_sim_free(sim);
}

/* ---- dial and addresses ------------------------------------------------------ */

typedef struct dial_rec {
    int n, status;
    ap_peer_id_t peer;
} dial_rec_t;
static void on_dial(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    dial_rec_t *d = arg;
    d->n++;
    d->status = status;
    if (peer) d->peer = *peer;
}

static void test_dial_and_addrs(void **state)
{
    ap_sim_t *sim = mk(3, 2 * MS);
    ap_rt_t *a = ap_sim_node(sim, 0);
    char addrs[2][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(ap_sim_node(sim, 2), addrs, 2, false), 1);
    assert_string_equal(addrs[0], "/sim/2");
    assert_int_equal(ap_rt_listen_addrs(ap_sim_node(sim, 2), addrs, 2, true), 1);
    char id[AP_PEER_ID_STR_MAX], want[AP_RT_ADDR_MAX];
    snprintf(want, sizeof want, "/sim/2/p2p/%s", ap_peer_id_str(ap_sim_peer_id(sim, 2), id));
    assert_string_equal(addrs[0], want);
    assert_int_equal(ap_sim_find_peer(sim, ap_sim_peer_id(sim, 2)), 2);
    assert_int_equal(ap_sim_node_index(sim, ap_sim_node(sim, 1)), 1);

    dial_rec_t d[4] = {0};
    assert_ok(ap_rt_dial(a, "/sim/1", 0, on_dial, &d[0]));
    assert_ok(ap_rt_dial(a, addrs[0], 0, on_dial, &d[1]));
    char wrong[AP_RT_ADDR_MAX];
    snprintf(wrong, sizeof wrong, "/sim/1/p2p/%s", id); /* node 2's id on node 1 */
    assert_ok(ap_rt_dial(a, wrong, 0, on_dial, &d[2]));
    assert_ok(ap_rt_dial(a, "/sim/77", 0, on_dial, &d[3]));
    assert_int_equal(ap_rt_dial(a, "/sim/1", 0, NULL, NULL), AP_EINVAL);
    assert_int_equal(ap_rt_dial(a, "/ip4/1.2.3.4/tcp/1", 0, on_dial, &d[0]), AP_EADDR);
    assert_int_equal(ap_rt_dial(a, "/sim/x", 0, on_dial, &d[0]), AP_EADDR);
    for (int i = 0; i < 4; i++) assert_int_equal(d[i].n, 0);
    ap_sim_run_for(sim, 1 * SEC);
    for (int i = 0; i < 4; i++) assert_int_equal(d[i].n, 1);
    assert_int_equal(d[0].status, 0);
    assert_true(ap_peer_id_eq(&d[0].peer, ap_sim_peer_id(sim, 1)));
    assert_int_equal(d[1].status, 0);
    assert_true(ap_peer_id_eq(&d[1].peer, ap_sim_peer_id(sim, 2)));
    assert_int_equal(d[2].status, AP_EAUTH);
    assert_int_equal(d[3].status, AP_EUNREACH);
    assert_ok(ap_rt_add_addr(a, ap_sim_peer_id(sim, 2), "/sim/2"));
    assert_int_equal(ap_rt_add_addr(a, ap_sim_peer_id(sim, 2), "/dns/x"), AP_EADDR);
    /* identities are real Ed25519 keys */
    uint8_t sig[AP_ED25519_SIG_LEN];
    ap_rt_sign(a, (const uint8_t *)"msg", 3, sig);
    assert_ok(ap_peer_verify(ap_rt_self(a), (const uint8_t *)"msg", 3, sig));
    assert_int_equal(ap_peer_verify(ap_sim_peer_id(sim, 1), (const uint8_t *)"msg", 3, sig),
                     AP_EAUTH);
    ap_sim_free(sim);
    /* same seed, same identities; another seed, other identities */
    ap_sim_t *s1 = ap_sim_new(5), *s2 = ap_sim_new(5), *s3 = ap_sim_new(6);
    for (int i = 0; i < 2; i++) {
        ap_sim_add_node(s1, NULL);
        ap_sim_add_node(s2, NULL);
        ap_sim_add_node(s3, NULL);
    }
    assert_true(ap_peer_id_eq(ap_sim_peer_id(s1, 1), ap_sim_peer_id(s2, 1)));
    assert_false(ap_peer_id_eq(ap_sim_peer_id(s1, 1), ap_sim_peer_id(s3, 1)));
    assert_false(ap_peer_id_eq(ap_sim_peer_id(s1, 0), ap_sim_peer_id(s1, 1)));
    ap_sim_free(s1);
    ap_sim_free(s2);
    ap_sim_free(s3);
}

/* ---- streams ------------------------------------------------------------------- */

typedef struct sside {
    ap_stream_t *s;
    int msgs, ends, closes, close_status, writable;
    uint64_t bytes;
    uint32_t next_seq;
    bool order_ok;
    bool pause_after_first;
} sside_t;

static sside_t g_srv;

static void s_msg(ap_stream_t *s, void *arg, const uint8_t *data, size_t len)
{
    sside_t *x = arg;
    if (len >= 4) {
        uint32_t seq;
        memcpy(&seq, data, 4);
        if (seq != x->next_seq) x->order_ok = false;
        x->next_seq = seq + 1;
    }
    x->msgs++;
    x->bytes += len;
    if (x->pause_after_first && x->msgs == 1) ap_stream_pause(s, true);
}
static void s_writable(ap_stream_t *s, void *arg)
{
    ((sside_t *)arg)->writable++;
}
static void s_end(ap_stream_t *s, void *arg)
{
    ((sside_t *)arg)->ends++;
}
static void s_close(ap_stream_t *s, void *arg, int status)
{
    sside_t *x = arg;
    x->closes++;
    x->close_status = status;
    x->s = NULL;
}
static const ap_stream_cbs_t s_cbs = {s_msg, s_writable, s_end, s_close};

static int g_accept_rc;
static uint8_t g_hello[16];
static size_t g_hello_len;
static int s_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                    const uint8_t *hello, size_t len)
{
    if (g_accept_rc) return g_accept_rc;
    memset(&g_srv, 0, sizeof g_srv);
    g_srv.order_ok = true;
    g_srv.s = s;
    g_hello_len = len < sizeof g_hello ? len : sizeof g_hello;
    memcpy(g_hello, hello, g_hello_len);
    ap_stream_set_cbs(s, &s_cbs, &g_srv);
    return 0;
}

static void test_stream_lifecycle(void **state)
{
    ap_sim_t *sim = mk(2, 3 * MS);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1);
    ap_stream_opts_t lo = {.window = 1000};
    assert_ok(ap_rt_stream_listen(b, "/s/1", &lo, s_accept, NULL));
    g_accept_rc = 0;
    sside_t cli = {.order_ok = true};
    ap_stream_opts_t o = {.window = 1000};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/s/1", (const uint8_t *)"hi", 2, &o, &s_cbs,
                                &cli, &cli.s));
    assert_non_null(cli.s);
    assert_int_equal(ap_stream_window(cli.s), 1000);
    /* usable at once: messages queue until established */
    uint8_t msg[400] = {0};
    for (uint32_t i = 0; i < 2; i++) {
        memcpy(msg, &i, 4);
        assert_ok(ap_stream_send(cli.s, msg, sizeof msg));
    }
    assert_int_equal(ap_stream_send(cli.s, msg, sizeof msg), AP_EAGAIN);
    assert_int_equal(ap_stream_buffered(cli.s), 800);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(g_hello_len, 2);
    assert_memory_equal(g_hello, "hi", 2);
    assert_int_equal(g_srv.msgs, 2);
    assert_true(g_srv.order_ok);
    assert_int_equal(cli.writable, 1);
    assert_int_equal(ap_stream_buffered(cli.s), 0);
    /* pause: no on_msg, sender's window fills; unpause drains in order */
    g_srv.pause_after_first = true;
    g_srv.msgs = 0;
    g_srv.next_seq = 2;
    uint32_t sent = 2;
    for (int i = 0; i < 2; i++) {
        memcpy(msg, &sent, 4);
        assert_ok(ap_stream_send(cli.s, msg, sizeof msg));
        sent++;
    }
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(g_srv.msgs, 1);
    assert_int_equal(ap_stream_buffered(cli.s), 400);
    g_srv.pause_after_first = false;
    ap_stream_pause(g_srv.s, false);
    assert_int_equal(g_srv.msgs, 1); /* not re-entrant */
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(g_srv.msgs, 2);
    assert_true(g_srv.order_ok);
    assert_int_equal(ap_stream_buffered(cli.s), 0);
    /* server -> client direction works too */
    memset(msg, 0, 4);
    assert_ok(ap_stream_send(g_srv.s, msg, 10));
    /* graceful close from the client, then the server */
    assert_ok(ap_stream_close(cli.s));
    assert_int_equal(ap_stream_send(cli.s, msg, 1), AP_ECLOSED);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(cli.msgs, 1);
    assert_int_equal(g_srv.ends, 1);
    assert_int_equal(g_srv.closes, 0);
    assert_int_equal(cli.closes, 0);
    assert_ok(ap_stream_close(g_srv.s));
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(g_srv.closes, 1);
    assert_int_equal(g_srv.close_status, 0);
    assert_int_equal(cli.ends, 1);
    assert_int_equal(cli.closes, 1);
    assert_int_equal(cli.close_status, 0);
    ap_rt_stats_t st;
    ap_rt_get_stats(b, &st);
    assert_int_equal(st.streams_accepted, 1);

    /* reset: both sides closed, the peer with AP_ERESET */
    sside_t c2 = {.order_ok = true};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/s/1", NULL, 0, NULL, &s_cbs, &c2, &c2.s));
    ap_sim_run_for(sim, 1 * SEC);
    assert_non_null(g_srv.s);
    ap_stream_reset(c2.s, AP_ECANCELED);
    assert_int_equal(c2.closes, 1); /* the resetting side closes at once */
    assert_int_equal(c2.close_status, AP_ECANCELED);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(c2.closes, 1);
    assert_int_equal(g_srv.closes, 1);
    assert_int_equal(g_srv.close_status, AP_ERESET);

    /* refused by accept, and no listener */
    g_accept_rc = AP_EPERM;
    sside_t c3 = {0}, c4 = {0};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/s/1", NULL, 0, NULL, &s_cbs, &c3, &c3.s));
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/nope/1", NULL, 0, NULL, &s_cbs, &c4, &c4.s));
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(c3.closes, 1);
    assert_int_equal(c3.close_status, AP_ERESET);
    assert_int_equal(c4.closes, 1);
    assert_int_equal(c4.close_status, AP_ENOPROTO);
    g_accept_rc = 0;

    /* message over the receiver's cap resets the stream */
    ap_rt_stream_unlisten(b, "/s/1");
    ap_stream_opts_t tiny = {.max_msg = 8};
    assert_ok(ap_rt_stream_listen(b, "/s/1", &tiny, s_accept, NULL));
    sside_t c5 = {0};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/s/1", NULL, 0, NULL, &s_cbs, &c5, &c5.s));
    assert_ok(ap_stream_send(c5.s, msg, 9));
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(c5.closes, 1);
    assert_int_equal(c5.close_status, AP_ERESET);
    assert_int_equal(g_srv.closes, 1);
    assert_int_equal(g_srv.close_status, AP_EMSGSIZE);
    assert_int_equal(g_srv.msgs, 0);

    /* unknown peer */
    sside_t c6 = {0};
    ap_peer_id_t stranger = *ap_rt_self(b);
    stranger.b[AP_PEER_ID_LEN - 1] ^= 1;
    assert_ok(ap_rt_stream_open(a, &stranger, "/s/1", NULL, 0, NULL, &s_cbs, &c6, &c6.s));
    assert_int_equal(c6.closes, 0);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(c6.closes, 1);
    assert_int_equal(c6.close_status, AP_EUNREACH);
    ap_sim_free(sim);
}

/* ---- posts ------------------------------------------------------------------ */

static int g_post_seq[4], g_npost;
static void on_post(ap_rt_t *rt, void *arg)
{
    g_post_seq[g_npost++] = (int)(intptr_t)arg;
}

static void test_post(void **state)
{
    ap_sim_t *sim = mk(1, 0);
    ap_rt_t *a = ap_sim_node(sim, 0);
    g_npost = 0;
    assert_ok(ap_rt_post(a, on_post, (void *)1));
    assert_ok(ap_rt_post(a, on_post, (void *)2));
    assert_int_equal(g_npost, 0);
    ap_sim_run_for(sim, 1);
    assert_int_equal(g_npost, 2);
    assert_int_equal(g_post_seq[0], 1);
    assert_int_equal(g_post_seq[1], 2);
    ap_sim_free(sim);
}

/* ap_rt_post is the one call any thread may make. */
static _Atomic int g_thread_posts;
static void on_thread_post(ap_rt_t *rt, void *arg)
{
    g_thread_posts++;
}
static void *poster(void *arg)
{
    for (int i = 0; i < 1000; i++) ap_rt_post(arg, on_thread_post, NULL);
    return NULL;
}
static bool thousand(void *arg)
{
    return g_thread_posts == 1000;
}

static void test_post_from_thread(void **state)
{
    ap_sim_t *sim = mk(1, 0);
    ap_rt_t *a = ap_sim_node(sim, 0);
    g_thread_posts = 0;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, poster, a), 0);
    /* keep the loop busy while the thread posts */
    ap_rt_timer_start(a, 1, 1, t_mark, (void *)0);
    while (!ap_sim_run_until(sim, thousand, NULL, ap_sim_now_us(sim) + 1000)) {
    }
    pthread_join(th, NULL);
    assert_int_equal(g_thread_posts, 1000);
    ap_sim_free(sim);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rpc_echo_and_latency),
        cmocka_unit_test(test_rpc_errors),
        cmocka_unit_test(test_timers),
        cmocka_unit_test(test_clock_skew_and_compute),
        cmocka_unit_test(test_dial_and_addrs),
        cmocka_unit_test(test_stream_lifecycle),
        cmocka_unit_test(test_post),
        cmocka_unit_test(test_post_from_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
