/* Faults in the simulator: partitions and healing, crash and restart. */
#include "aptest.h"

#include "apiary/sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MS  1000ull
#define SEC 1000000ull

typedef struct rec {
    int calls, status;
    uint64_t at;
} rec_t;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *r, size_t n, const char *e)
{
    rec_t *x = arg;
    x->calls++;
    x->status = status;
    x->at = ap_rt_now_us(rt);
}

static ap_rpc_req_t *g_held;
static void hold(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    g_held = req;
}

typedef struct watch {
    int up, down;
} watch_t;
static void on_peer(ap_rt_t *rt, void *arg, const ap_peer_id_t *p, ap_peer_event_t ev)
{
    watch_t *w = arg;
    if (ev == AP_PEER_CONNECTED)
        w->up++;
    else
        w->down++;
}

static bool rec_done(void *arg)
{
    return ((rec_t *)arg)->calls > 0;
}

static ap_sim_t *mk(int n)
{
    ap_sim_t *sim = ap_sim_new(ap_test_seed(3));
    assert_non_null(sim);
    ap_sim_link_t l = {.latency_us = 2 * MS};
    ap_sim_set_default_link(sim, &l);
    for (int i = 0; i < n; i++) assert_int_equal(ap_sim_add_node(sim, NULL), i);
    return sim;
}

static void call(ap_sim_t *sim, int from, int to, const char *proto, uint64_t timeout, rec_t *r)
{
    memset(r, 0, sizeof *r);
    ap_rpc_opts_t o = {.timeout_us = timeout};
    assert_true(ap_rt_rpc_call(ap_sim_node(sim, from), ap_sim_peer_id(sim, to), proto,
                               (const uint8_t *)"x", 1, &o, on_done, r) != 0);
}

/* ---- partitions ------------------------------------------------------------ */

typedef struct sflag {
    int closes, status;
} sflag_t;
static void sf_close(ap_stream_t *s, void *arg, int st)
{
    sflag_t *f = arg;
    f->closes++;
    f->status = st;
}
static const ap_stream_cbs_t sf_cbs = {NULL, NULL, NULL, sf_close};
static sflag_t g_srv_flag;
static int sf_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *h, size_t n)
{
    ap_stream_set_cbs(s, &sf_cbs, &g_srv_flag);
    return 0;
}

static void test_partition_and_heal(void **state)
{
    ap_sim_t *sim = mk(4);
    for (int i = 0; i < 4; i++) {
        assert_ok(ap_rt_rpc_register(ap_sim_node(sim, i), "/ap_test_rpc_echo/1", 0,
                                     ap_test_rpc_echo, NULL));
        assert_ok(ap_rt_rpc_register(ap_sim_node(sim, i), "/hold/1", 0, hold, NULL));
        assert_ok(ap_rt_stream_listen(ap_sim_node(sim, i), "/s/1", NULL, sf_accept, NULL));
    }
    watch_t w0 = {0}, w2 = {0};
    assert_true(ap_rt_peer_watch(ap_sim_node(sim, 0), on_peer, &w0) != 0);
    assert_true(ap_rt_peer_watch(ap_sim_node(sim, 2), on_peer, &w2) != 0);
    rec_t r, pending, same;
    call(sim, 0, 2, "/ap_test_rpc_echo/1", 0, &r);
    assert_true(ap_sim_run_until(sim, rec_done, &r, 10 * SEC));
    assert_int_equal(r.status, 0);
    assert_int_equal(w0.up, 1);
    assert_int_equal(w2.up, 1);
    /* an established stream and a call in flight across the future cut */
    sflag_t cli = {0};
    ap_stream_t *s;
    memset(&g_srv_flag, 0, sizeof g_srv_flag);
    assert_ok(ap_rt_stream_open(ap_sim_node(sim, 0), ap_sim_peer_id(sim, 2), "/s/1", NULL, 0, NULL,
                                &sf_cbs, &cli, &s));
    call(sim, 0, 2, "/hold/1", 0, &pending);
    ap_sim_run_for(sim, 100 * MS);
    assert_non_null(g_held);

    int groups[4] = {0, 0, 1, 1};
    assert_ok(ap_sim_partition(sim, groups));
    assert_false(ap_rt_is_connected(ap_sim_node(sim, 0), ap_sim_peer_id(sim, 2)));
    ap_sim_run_for(sim, 1 * MS);
    /* established connection dropped at once: ECLOSED, DISCONNECTED */
    assert_int_equal(pending.calls, 1);
    assert_int_equal(pending.status, AP_ECLOSED);
    assert_int_equal(w0.down, 1);
    assert_int_equal(w2.down, 1);
    assert_int_equal(cli.closes, 1);
    assert_int_equal(cli.status, AP_ECLOSED);
    assert_int_equal(g_srv_flag.closes, 1);
    assert_int_equal(g_srv_flag.status, AP_ECLOSED);
    ap_rpc_respond(g_held, NULL, 0); /* dropped: caller gone */
    g_held = NULL;

    /* across the cut: the call times out; within a side: works */
    call(sim, 0, 3, "/ap_test_rpc_echo/1", 500 * MS, &r);
    call(sim, 0, 1, "/ap_test_rpc_echo/1", 500 * MS, &same);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(r.calls, 1);
    assert_int_equal(r.status, AP_ETIMEDOUT);
    assert_int_equal(same.status, 0);
    assert_int_equal(same.calls, 1);
    /* with a longer deadline the connect timeout ends it: EUNREACH */
    ap_sim_set_connect_timeout(sim, 2 * SEC);
    call(sim, 1, 2, "/ap_test_rpc_echo/1", 30 * SEC, &r);
    ap_sim_run_for(sim, 5 * SEC);
    assert_int_equal(r.calls, 1);
    assert_int_equal(r.status, AP_EUNREACH);

    ap_sim_heal(sim);
    call(sim, 0, 3, "/ap_test_rpc_echo/1", 0, &r);
    call(sim, 2, 0, "/ap_test_rpc_echo/1", 0, &same);
    /* 0 -> 3 reuses the attempt begun during the partition: its SYN is
     * retried every second */
    ap_sim_run_for(sim, 1500 * MS);
    assert_int_equal(r.status, 0);
    assert_int_equal(r.calls, 1);
    assert_int_equal(same.status, 0);
    assert_int_equal(w0.up, 4); /* to 2, 1, 3, and 2 again after healing */
    ap_sim_free(sim);
}

/* ---- crash and restart ---------------------------------------------------- */

typedef struct harness {
    int crashes, restarts;
    int timer_fires;
    rec_t own_call; /* a call the crashed node had in flight */
} harness_t;

static void h_tick(ap_rt_t *rt, void *arg)
{
    ((harness_t *)arg)->timer_fires++;
}

static void h_restart(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    harness_t *h = arg;
    h->restarts++;
    assert_ok(ap_rt_rpc_register(rt, "/ap_test_rpc_echo/1", 0, ap_test_rpc_echo, NULL));
}

static void h_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    harness_t *h = arg;
    h->crashes++;
    /* pending operations were completed before the hook */
    assert_int_equal(h->own_call.calls, 1);
    assert_int_equal(h->own_call.status, AP_ECANCELED);
    /* the runtime refuses new work */
    assert_int_equal(ap_rt_timer_start(rt, 1, 0, h_tick, h), 0);
}

static void test_crash_mid_call_and_restart(void **state)
{
    ap_sim_t *sim = mk(3);
    harness_t h = {0};
    assert_ok(ap_sim_set_hooks(sim, 1, h_crash, h_restart, &h));
    ap_rt_t *n1 = ap_sim_node(sim, 1);
    assert_ok(ap_rt_rpc_register(n1, "/hold/1", 0, hold, NULL));
    assert_ok(ap_rt_rpc_register(ap_sim_node(sim, 2), "/hold/1", 0, hold, NULL));
    ap_rt_timer_start(n1, 10 * MS, 10 * MS, h_tick, &h);
    watch_t w = {0};
    ap_rt_peer_watch(ap_sim_node(sim, 0), on_peer, &w);
    ap_peer_id_t id1 = *ap_sim_peer_id(sim, 1);

    rec_t r;
    call(sim, 0, 1, "/hold/1", 0, &r);
    /* node 1 itself has a call in flight to node 2 */
    call(sim, 1, 2, "/hold/1", 0, &h.own_call);
    ap_sim_run_for(sim, 100 * MS);
    assert_non_null(g_held);
    ap_rpc_req_t *held_by_2 = g_held; /* node 2 holds node 1's request */
    assert_int_equal(r.calls, 0);
    int fires = h.timer_fires;
    assert_true(fires > 0);

    assert_ok(ap_sim_crash(sim, 1));
    assert_int_equal(ap_sim_crash(sim, 1), AP_ESTATE);
    assert_null(ap_sim_node(sim, 1));
    assert_false(ap_sim_is_up(sim, 1));
    assert_int_equal(h.crashes, 1);
    ap_sim_run_for(sim, 1 * MS);
    /* the caller learns at once: connection lost */
    assert_int_equal(r.calls, 1);
    assert_int_equal(r.status, AP_ECLOSED);
    assert_int_equal(w.down, 1);
    ap_rpc_respond(held_by_2, NULL, 0); /* to a dead caller: dropped */
    g_held = NULL;
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(h.timer_fires, fires); /* its timers died with it */
    assert_int_equal(h.own_call.calls, 1);

    /* calling a crashed node: refused after a round trip */
    call(sim, 0, 1, "/ap_test_rpc_echo/1", 0, &r);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(r.calls, 1);
    assert_int_equal(r.status, AP_EUNREACH);

    /* restart: same identity, fresh state rebuilt by the hook */
    assert_ok(ap_sim_restart(sim, 1));
    assert_int_equal(ap_sim_restart(sim, 1), AP_ESTATE);
    assert_int_equal(h.restarts, 1);
    n1 = ap_sim_node(sim, 1);
    assert_non_null(n1);
    assert_true(ap_peer_id_eq(ap_rt_self(n1), &id1));
    call(sim, 0, 1, "/ap_test_rpc_echo/1", 0, &r);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(r.status, 0);
    /* the old handler is gone */
    call(sim, 0, 1, "/hold/1", 0, &r);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(r.status, AP_ENOPROTO);
    assert_int_equal(h.timer_fires, fires);
    ap_sim_free(sim);
}

/* Crash a node mid-stream: the peer's stream closes with AP_ECLOSED, the
 * crashed side's with AP_ECANCELED; work in progress is cancelled. */
static int g_after_status = 1;
static void w_after(ap_rt_t *rt, void *arg, int st)
{
    g_after_status = st;
}

static void test_crash_streams_and_work(void **state)
{
    ap_sim_t *sim = mk(2);
    assert_ok(ap_rt_stream_listen(ap_sim_node(sim, 1), "/s/1", NULL, sf_accept, NULL));
    sflag_t cli = {0};
    memset(&g_srv_flag, 0, sizeof g_srv_flag);
    ap_stream_t *s;
    assert_ok(ap_rt_stream_open(ap_sim_node(sim, 0), ap_sim_peer_id(sim, 1), "/s/1", NULL, 0, NULL,
                                &sf_cbs, &cli, &s));
    ap_sim_set_flops(sim, 1, 1.0);
    assert_ok(ap_rt_work(ap_sim_node(sim, 1), 100.0, NULL, w_after, NULL));
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(g_after_status, 1);
    assert_ok(ap_sim_crash(sim, 1));
    assert_int_equal(g_srv_flag.closes, 1);
    assert_int_equal(g_srv_flag.status, AP_ECANCELED);
    assert_int_equal(g_after_status, AP_ECANCELED);
    ap_sim_run_for(sim, 1 * MS);
    assert_int_equal(cli.closes, 1);
    assert_int_equal(cli.status, AP_ECLOSED);
    ap_sim_run_for(sim, 200 * SEC); /* the cancelled work never completes again */
    assert_int_equal(g_after_status, AP_ECANCELED);
    ap_sim_free(sim);
}

/* A node crashes itself from its own handler via a scheduled crash, and is
 * brought back by a scheduled restart. */
static ap_sim_t *g_sim;
static void suicide(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    int me = ap_sim_node_index(g_sim, rt);
    assert_ok(ap_sim_schedule(g_sim, me, 0, false));
    assert_ok(ap_sim_schedule(g_sim, me, ap_rt_now_us(rt) + 3 * SEC, true));
    g_held = req; /* never answered: the node dies first */
}

static void test_scheduled_crash_restart(void **state)
{
    ap_sim_t *sim = mk(2);
    g_sim = sim;
    harness_t h = {0};
    assert_ok(ap_sim_set_hooks(sim, 1, NULL, h_restart, &h));
    assert_ok(ap_rt_rpc_register(ap_sim_node(sim, 1), "/die/1", 0, suicide, NULL));
    assert_int_equal(ap_sim_schedule(sim, 7, 0, false), AP_EINVAL);
    rec_t r;
    call(sim, 0, 1, "/die/1", 0, &r);
    assert_true(ap_sim_run_until(sim, rec_done, &r, 10 * SEC));
    assert_int_equal(r.status, AP_ECLOSED);
    assert_false(ap_sim_is_up(sim, 1));
    uint64_t died = r.at;
    ap_sim_run_for(sim, 5 * SEC);
    assert_true(ap_sim_is_up(sim, 1));
    assert_int_equal(h.restarts, 1);
    call(sim, 0, 1, "/ap_test_rpc_echo/1", 0, &r);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(r.status, 0);
    assert_true(died < 3 * SEC);
    g_held = NULL;
    ap_sim_free(sim);
}

/* Idle connections are closed; busy ones are not; the next call reconnects. */
static void test_idle_connections(void **state)
{
    ap_sim_t *sim = mk(3);
    for (int i = 0; i < 3; i++) {
        assert_ok(ap_rt_rpc_register(ap_sim_node(sim, i), "/ap_test_rpc_echo/1", 0,
                                     ap_test_rpc_echo, NULL));
        assert_ok(ap_rt_rpc_register(ap_sim_node(sim, i), "/hold/1", 0, hold, NULL));
    }
    ap_sim_set_idle_timeout(sim, 5 * SEC);
    watch_t w = {0};
    ap_rt_peer_watch(ap_sim_node(sim, 0), on_peer, &w);
    rec_t r, held;
    call(sim, 0, 1, "/ap_test_rpc_echo/1", 0, &r);
    call(sim, 0, 2, "/hold/1", 60 * SEC, &held); /* keeps 0<->2 busy */
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(r.status, 0);
    assert_non_null(g_held);
    assert_int_equal(w.up, 2);
    ap_sim_run_for(sim, 10 * SEC);
    assert_false(ap_rt_is_connected(ap_sim_node(sim, 0), ap_sim_peer_id(sim, 1)));
    assert_false(ap_rt_is_connected(ap_sim_node(sim, 1), ap_sim_peer_id(sim, 0)));
    assert_true(ap_rt_is_connected(ap_sim_node(sim, 0), ap_sim_peer_id(sim, 2)));
    assert_int_equal(w.down, 1);
    assert_int_equal(held.calls, 0);
    ap_rpc_respond(g_held, NULL, 0);
    g_held = NULL;
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(held.status, 0);
    call(sim, 0, 1, "/ap_test_rpc_echo/1", 0, &r);
    ap_sim_run_for(sim, 1 * SEC);
    assert_int_equal(r.status, 0);
    assert_int_equal(w.up, 3);
    ap_sim_run_for(sim, 20 * SEC); /* now both idle */
    assert_int_equal(w.down, 3);
    ap_sim_stats_t st;
    ap_sim_get_stats(sim, &st);
    assert_int_equal(st.connections, 0);
    ap_sim_free(sim);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_partition_and_heal),
        cmocka_unit_test(test_crash_mid_call_and_restart),
        cmocka_unit_test(test_crash_streams_and_work),
        cmocka_unit_test(test_scheduled_crash_restart),
        cmocka_unit_test(test_idle_connections),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
