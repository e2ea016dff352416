/* A node started with ap_node_opts_t.relay_service serves circuit relay v2
 * on its TCP port (loopback, no root needed): a libp2p peer reserves a slot
 * on it, another peer dials the first through the node's circuit and the
 * libp2p upgrade runs end to end inside it. A node that cannot relay (an
 * in-process or dial-only node) refuses the option. */
#include "aptest.h"
#include "p2ptest.h"

#include "apiary/identity.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "p2p/relay_svc.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

static int g_freed;
static void freed(void *arg)
{
    (void)arg;
    g_freed++;
}

static int g_inbound;
static ap_peer_id_t g_inbound_peer;
static void on_inbound(void *arg, ap_p2p_conn_t *c)
{
    (void)arg;
    assert_true(ap__p2p_conn_relayed(c));
    g_inbound++;
    g_inbound_peer = *ap__p2p_conn_peer(c);
}

static void test_node_relays(void **state)
{
    (void)state;
    ap_host_t *nh = ap_host_new();
    assert_non_null(nh);
    assert_ok(ap_host_start(nh));
    ap_rt_t *relay = NULL;
    ap_node_opts_t no = {.listen = "/ip4/127.0.0.1/tcp/0",
                         .relay_service = true,
                         .relay_limits = {.max_reservations = 4, .circuit_bytes = 1u << 20}};
    assert_ok(ap_node_new(nh, &no, &relay));
    char addr[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_node_listen_addrs_sync(relay, addr, 1, true), 1);
    ap_multiaddr_t rma;
    assert_ok(ap_multiaddr_parse(&rma, addr[0]));
    assert_true(rma.has_peer);

    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    ap_identity_t aid = ap_test_ident(21), bid = ap_test_ident(22);
    ap_p2p_host_t *A = ap__p2p_host_new(&loop, &aid, "apiary-test");
    ap_p2p_host_t *B = ap__p2p_host_new(&loop, &bid, "apiary-test");
    assert_ok(ap__p2p_host_serve_basics(A));
    assert_ok(ap__p2p_host_serve_basics(B));
    ap_relay_client_t *cl = ap__relay_client_new(A, &rma, 1, on_inbound, NULL);
    assert_non_null(cl);
    unsigned live = 0;
    AP_TEST_RUN_UNTIL(&loop, (ap__relay_client_reservations(cl, &live), live == 1));
    ap_multiaddr_t circ[2];
    assert_int_equal(ap__relay_client_addrs(cl, circ, 2), 1);
    assert_true(circ[0].circuit);
    assert_true(ap_peer_id_eq(&circ[0].peer, &rma.peer));

    /* B reaches A through the node */
    ap_multiaddr_t target = circ[0];
    target.has_dst = true;
    target.dst = aid.id;
    ap_test_dialer_t d = {0};
    assert_ok(ap__circuit_dial(B, &target, &ap_test_dialer_cbs, &d));
    AP_TEST_RUN_UNTIL(&loop, d.ready || d.closed);
    assert_true(d.ready);
    assert_true(ap__p2p_conn_relayed(d.c));
    assert_true(ap_peer_id_eq(ap__p2p_conn_peer(d.c), &aid.id));
    AP_TEST_RUN_UNTIL(&loop, g_inbound == 1);
    assert_true(ap_peer_id_eq(&g_inbound_peer, &bid.id));

    g_freed = 0;
    ap__p2p_host_free_then(A, freed, NULL);
    ap__p2p_host_free_then(B, freed, NULL);
    AP_TEST_RUN_UNTIL(&loop, g_freed == 2);
    ap__relay_client_free(cl);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
    ap_node_free(relay);
    assert_ok(ap_host_free(nh));
}

static void test_relay_needs_listener(void **state)
{
    (void)state;
    ap_host_t *nh = ap_host_new();
    assert_non_null(nh);
    assert_ok(ap_host_start(nh));
    ap_rt_t *rt = NULL;
    ap_node_opts_t mem = {.relay_service = true};
    assert_int_equal(ap_node_new(nh, &mem, &rt), AP_EINVAL);
    ap_node_opts_t dial = {.dial_only = true, .relay_service = true};
    assert_int_equal(ap_node_new(nh, &dial, &rt), AP_EINVAL);
    ap_node_opts_t big = {.listen = "/ip4/127.0.0.1/tcp/0",
                          .relay_service = true,
                          .relay_limits = {.max_reservations = AP_RELAY_TABLE_MAX + 1}};
    assert_int_equal(ap_node_new(nh, &big, &rt), AP_EINVAL);
    /* the failed attempts left nothing behind: the same options without
     * the relay work */
    ap_node_opts_t ok = {.listen = "/ip4/127.0.0.1/tcp/0"};
    assert_ok(ap_node_new(nh, &ok, &rt));
    ap_node_free(rt);
    assert_ok(ap_host_free(nh));
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_node_relays),
        cmocka_unit_test(test_relay_needs_listener),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
