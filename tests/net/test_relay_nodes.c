/* Nodes given relays (ap_node_opts_t.relays) on loopback, no root needed:
 * a node N reserves a slot on a relay node R and advertises its circuit
 * address after its direct ones; a peer that knows N only by the circuit
 * reaches N through R, its RPCs work there, and a bulk protocol (the
 * all-reduce's) is refused with AP_EPERM unless the nodes allow bulk over
 * relays. A peer that knows both of N's addresses dials the direct one
 * first, however the book ordered them. Bad relay options are refused. */
#include "aptest.h"

#include "apiary/avg.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/multiaddr.h"
#include "apiary/node.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CTL_PROTO "/apiary/test/relayed/1"

typedef struct call {
    bool done;
    int status;
    size_t len;
} call_t;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt;
    (void)resp;
    (void)errmsg;
    call_t *c = arg;
    c->done = true;
    c->status = status;
    c->len = len;
}

static bool call_done(void *arg)
{
    return ((call_t *)arg)->done;
}

static bool live_resv(void *arg)
{
    ap_node_relay_stats_t st;
    ap_node_relay_stats(arg, &st);
    return st.live_reservations == 1;
}

/* N's circuit address (with /p2p/N) from its listen addresses. */
static void circuit_of(ap_rt_t *n, char out[AP_RT_ADDR_MAX], char direct[AP_RT_ADDR_MAX])
{
    char a[8][AP_RT_ADDR_MAX];
    int k = ap_rt_listen_addrs(n, a, 8, true);
    assert_true(k >= 2);
    out[0] = direct[0] = 0;
    for (int i = 0; i < k && i < 8; i++) {
        ap_multiaddr_t ma;
        assert_ok(ap_multiaddr_parse(&ma, a[i]));
        if (ma.circuit) {
            assert_int_equal(direct[0] != 0, 1); /* direct addresses come first */
            assert_true(ma.has_dst && ap_peer_id_eq(&ma.dst, ap_rt_self(n)));
            snprintf(out, AP_RT_ADDR_MAX, "%.255s", a[i]);
        } else if (!direct[0]) {
            snprintf(direct, AP_RT_ADDR_MAX, "%.255s", a[i]);
        }
    }
    assert_true(out[0] != 0);
}

static void rpc(ap_host_t *h, ap_rt_t *from, ap_rt_t *to, const char *proto, call_t *c)
{
    memset(c, 0, sizeof *c);
    static const uint8_t ping[5] = "hello";
    assert_true(ap_rt_rpc_call(from, ap_rt_self(to), proto, ping, sizeof ping, NULL, on_done, c));
    assert_true(ap_host_run_until(h, call_done, c, 30000000ull));
}

static void through_relay(bool bulk)
{
    ap_host_t *h = ap_host_new(); /* caller-driven: everything on this thread */
    assert_non_null(h);
    ap_rt_t *relay, *n, *d, *e;
    ap_node_opts_t ro = {.listen = "/ip4/127.0.0.1/tcp/0", .relay_service = true};
    assert_ok(ap_node_new(h, &ro, &relay));
    char raddr[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(relay, raddr, 1, true), 1);
    const char *relays[1] = {raddr[0]};
    ap_node_opts_t no = {.listen = "/ip4/127.0.0.1/tcp/0",
                         .relays = relays,
                         .nrelays = 1,
                         .relay_bulk = bulk,
                         .no_hole_punch = true};
    assert_ok(ap_node_new(h, &no, &n));
    ap_node_opts_t po = {.listen = "/ip4/127.0.0.1/tcp/0", .relay_bulk = bulk};
    assert_ok(ap_node_new(h, &po, &d));
    assert_ok(ap_node_new(h, &po, &e));
    assert_ok(ap_rt_rpc_register(n, CTL_PROTO, 0, ap_test_rpc_echo, NULL));
    assert_ok(ap_rt_rpc_register(n, AP_AVG_PROTO, 0, ap_test_rpc_echo, NULL));
    assert_true(ap_host_run_until(h, live_resv, n, 30000000ull));

    char circ[AP_RT_ADDR_MAX], direct[AP_RT_ADDR_MAX];
    circuit_of(n, circ, direct);
    /* d knows N by its circuit only (and an address where nobody listens) */
    char id[AP_PEER_ID_STR_MAX], dead[AP_RT_ADDR_MAX];
    ap_peer_id_str(ap_rt_self(n), id);
    snprintf(dead, sizeof dead, "/ip4/127.0.0.1/tcp/1/p2p/%s", id);
    assert_ok(ap_rt_add_addr(d, ap_rt_self(n), circ));
    assert_ok(ap_rt_add_addr(d, ap_rt_self(n), dead));
    call_t c;
    rpc(h, d, n, CTL_PROTO, &c);
    assert_int_equal(c.status, 0);
    assert_int_equal(c.len, 5);
    ap_node_relay_stats_t sd, sn;
    ap_node_relay_stats(d, &sd);
    ap_node_relay_stats(n, &sn);
    assert_int_equal(sd.relayed_out, 1);
    assert_int_equal(sn.relayed_in, 1);
    assert_int_equal(sn.punch_started, 0); /* no_hole_punch */
    /* bulk: refused over the relay unless both allow it */
    rpc(h, d, n, AP_AVG_PROTO, &c);
    if (bulk) {
        assert_int_equal(c.status, 0);
    } else {
        assert_int_equal(c.status, AP_EPERM);
        ap_node_relay_stats(d, &sd);
        assert_int_equal(sd.bulk_refused, 1);
        rpc(h, d, n, CTL_PROTO, &c); /* the connection is still fine */
        assert_int_equal(c.status, 0);
    }

    /* e learns the circuit last (the newest): the direct address is still
     * dialled first, and the call never touches the relay */
    assert_ok(ap_rt_add_addr(e, ap_rt_self(n), direct));
    assert_ok(ap_rt_add_addr(e, ap_rt_self(n), circ));
    rpc(h, e, n, AP_AVG_PROTO, &c);
    assert_int_equal(c.status, 0);
    ap_node_relay_stats_t se;
    ap_node_relay_stats(e, &se);
    assert_int_equal(se.relayed_out, 0);

    ap_node_free(e);
    ap_node_free(d);
    ap_node_free(n);
    ap_node_free(relay);
    assert_ok(ap_host_free(h));
}

static void test_control_through_relay(void **state)
{
    (void)state;
    through_relay(false);
}

static void test_bulk_allowed(void **state)
{
    (void)state;
    through_relay(true);
}

static void test_relay_options_refused(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_rt_t *rt = NULL;
    const char *good[1] = {
        "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"};
    const char *bad[][1] = {{"/ip4/127.0.0.1/tcp/4001"}, /* no /p2p/ */
                            {"/ip4/127.0.0.1/tcp/4001/p2p/"
                             "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA/p2p-circuit"},
                            {"nonsense"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0", .relays = bad[i], .nrelays = 1};
        assert_int_equal(ap_node_new(h, &o, &rt), AP_EADDR);
    }
    ap_node_opts_t mem = {.relays = good, .nrelays = 1};
    assert_int_equal(ap_node_new(h, &mem, &rt), AP_EINVAL);
    ap_node_opts_t dial = {.dial_only = true, .relays = good, .nrelays = 1};
    assert_int_equal(ap_node_new(h, &dial, &rt), AP_EINVAL);
    ap_node_opts_t many = {
        .listen = "/ip4/127.0.0.1/tcp/0", .relays = good, .nrelays = AP_NODE_MAX_RELAYS + 1};
    assert_int_equal(ap_node_new(h, &many, &rt), AP_EINVAL);
    /* nothing was left behind: a node with a good relay starts (the relay
     * is not there: it retries in the background) */
    ap_node_opts_t ok = {.listen = "/ip4/127.0.0.1/tcp/0", .relays = good, .nrelays = 1};
    assert_ok(ap_node_new(h, &ok, &rt));
    ap_node_free(rt);
    assert_ok(ap_host_free(h));
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_control_through_relay),
        cmocka_unit_test(test_bulk_allowed),
        cmocka_unit_test(test_relay_options_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
