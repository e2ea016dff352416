/* Circuit relay v2 over loopback, in one loop (no root needed): a peer
 * reserves a slot on a relay and announces the circuit address in
 * identify; another peer dials it through the relay, the libp2p upgrade
 * runs end to end inside the circuit, ping data goes through and comes
 * back; a bulk protocol is refused on the relayed connection; a circuit
 * over its data limit is reset; a dial to a peer without a reservation is
 * refused; a flood of reservations is refused while the relay keeps
 * serving circuits. Everything is freed and the loop runs dry. */
#include "aptest.h"
#include "p2ptest.h"

#include "apiary/identity.h"
#include "apiary/log.h"
#include "p2p/autonat_uv.h"
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

/* ---- a dial through the relay and ping data over it ------------------------------ */

typedef struct pinger {
    uint8_t sent[96 << 10], got[96 << 10];
    size_t nsend, ngot;
    bool closed;
    int close_status;
} pinger_t;

static void p_open(ap_p2p_stream_t *s)
{
    pinger_t *p = ap__p2p_stream_udata(s);
    for (size_t off = 0; off < p->nsend; off += 4096) {
        size_t n = p->nsend - off < 4096 ? p->nsend - off : 4096;
        if (ap__p2p_stream_write(s, p->sent + off, n) != 0) break;
    }
}
static void p_data(ap_p2p_stream_t *s, const uint8_t *b, size_t n)
{
    pinger_t *p = ap__p2p_stream_udata(s);
    if (n > sizeof p->got - p->ngot) n = sizeof p->got - p->ngot;
    memcpy(p->got + p->ngot, b, n);
    p->ngot += n;
}
static void p_close(ap_p2p_stream_t *s, int st)
{
    pinger_t *p = ap__p2p_stream_udata(s);
    p->closed = true;
    p->close_status = st;
}
static const ap_p2p_proto_t ping_c = {AP_PING_PROTO, p_open, p_data, NULL, p_close};
static const ap_p2p_proto_t echo_c = {AP_P2P_ECHO_PROTO, p_open, p_data, NULL, p_close};

static int g_inbound;
static ap_peer_id_t g_inbound_peer;
static void on_inbound(void *arg, ap_p2p_conn_t *c)
{
    (void)arg;
    assert_true(ap__p2p_conn_relayed(c));
    g_inbound++;
    g_inbound_peer = *ap__p2p_conn_peer(c);
}

static ap_relay_client_t *g_cl;
static ap_multiaddr_t g_a_bound;
static int a_addrs(void *arg, ap_multiaddr_t *out, int max)
{
    (void)arg;
    out[0] = g_a_bound;
    return 1 + ap__relay_client_addrs(g_cl, out + 1, max - 1);
}

typedef struct idres {
    bool done;
    int status;
    ap_identify_t id;
} idres_t;
static void on_identify(void *arg, int status, const ap_identify_t *id)
{
    idres_t *r = arg;
    r->done = true;
    r->status = status;
    if (id) r->id = *id;
}

static void test_relay_loopback(void **state)
{
    (void)state;
    static pinger_t pg, big;
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    ap_identity_t rid = ap_test_ident(11), aid = ap_test_ident(12), bid = ap_test_ident(13),
                  cid = ap_test_ident(14);
    ap_p2p_host_t *R = ap__p2p_host_new(&loop, &rid, "apiary-test");
    ap_p2p_host_t *A = ap__p2p_host_new(&loop, &aid, "apiary-test");
    ap_p2p_host_t *B = ap__p2p_host_new(&loop, &bid, "apiary-test");
    ap_p2p_host_t *C = ap__p2p_host_new(&loop, &cid, "apiary-test");
    assert_ok(ap__p2p_host_serve_basics(R));
    assert_ok(ap__p2p_host_serve_basics(A));
    assert_ok(ap__p2p_host_serve_echo(A));
    assert_ok(ap__p2p_host_serve_basics(B));
    ap_relay_limits_t lim;
    ap__relay_limits_default(&lim);
    lim.circuit_bytes = 64u << 10;
    lim.reservations_per_ip = 6;
    ap_relay_service_t *svc = ap__relay_serve(R, &lim);
    assert_non_null(svc);

    ap_multiaddr_t any, rb;
    assert_ok(ap_multiaddr_parse(&any, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(R, &any, &rb));
    assert_ok(ap__p2p_host_listen(A, &any, &g_a_bound));
    rb.has_peer = true;
    rb.peer = rid.id;

    /* A reserves on R */
    g_cl = ap__relay_client_new(A, &rb, 1, on_inbound, NULL);
    assert_non_null(g_cl);
    ap__p2p_host_set_addrs(A, a_addrs, NULL);
    unsigned live = 0;
    AP_TEST_RUN_UNTIL(&loop, (ap__relay_client_reservations(g_cl, &live), live == 1));
    ap_multiaddr_t circ[4];
    assert_int_equal(ap__relay_client_addrs(g_cl, circ, 4), 1);
    assert_true(circ[0].circuit);
    assert_true(ap_peer_id_eq(&circ[0].peer, &rid.id));
    assert_int_equal(circ[0].port, rb.port);

    /* identify of A announces the circuit address */
    idres_t ir = {0};
    ap_multiaddr_t am = g_a_bound;
    am.has_peer = true;
    am.peer = aid.id;
    assert_ok(ap__p2p_identify_peer(C, &am, 10000, on_identify, &ir));
    AP_TEST_RUN_UNTIL(&loop, ir.done);
    assert_int_equal(ir.status, 0);
    bool announced = false;
    for (size_t i = 0; i < ir.id.nlisten; i++)
        if (ir.id.listen[i].circuit && ap_peer_id_eq(&ir.id.listen[i].peer, &rid.id))
            announced = true;
    assert_true(announced);

    /* B dials A through R: the upgrade runs inside the circuit */
    ap_multiaddr_t target = circ[0];
    target.has_dst = true;
    target.dst = aid.id;
    char text[AP_MA_TEXT_MAX];
    ap_multiaddr_print(&target, text, sizeof text);
    print_message("dialling %s\n", text);
    ap_test_dialer_t d = {0};
    assert_ok(ap__circuit_dial(B, &target, &ap_test_dialer_cbs, &d));
    AP_TEST_RUN_UNTIL(&loop, d.ready || d.closed);
    assert_true(d.ready);
    assert_true(ap__p2p_conn_relayed(d.c));
    assert_true(ap_peer_id_eq(ap__p2p_conn_peer(d.c), &aid.id));
    AP_TEST_RUN_UNTIL(&loop, g_inbound == 1);
    assert_true(ap_peer_id_eq(&g_inbound_peer, &bid.id));

    /* ping data through it, every byte checked */
    pg.nsend = 20000;
    for (size_t i = 0; i < pg.nsend; i++) pg.sent[i] = (uint8_t)(i * 7 + 3);
    assert_ok(ap__p2p_stream_open(d.c, &ping_c, &pg, NULL));
    AP_TEST_RUN_UNTIL(&loop, pg.ngot == pg.nsend);
    assert_memory_equal(pg.got, pg.sent, pg.nsend);

    /* a bulk protocol is refused on a relayed connection */
    static pinger_t eg;
    eg.nsend = 10;
    assert_ok(ap__p2p_stream_open(d.c, &echo_c, &eg, NULL));
    AP_TEST_RUN_UNTIL(&loop, eg.closed);
    assert_int_equal(eg.close_status, AP_ENOPROTO);
    assert_int_equal(eg.ngot, 0);

    /* over the circuit's 64 KiB: the relay resets it */
    big.nsend = sizeof big.sent;
    memset(big.sent, 0x5a, big.nsend);
    assert_ok(ap__p2p_stream_open(d.c, &ping_c, &big, NULL));
    AP_TEST_RUN_UNTIL(&loop, d.closed);
    assert_true(big.ngot < big.nsend);
    ap_relay_svc_stats_t st = ap__relay_service_stats(svc);
    print_message("relay: %u reserved, %u circuits, %u reset, %llu bytes\n", st.reserved,
                  st.circuits, st.circ_reset, (unsigned long long)st.bytes);
    assert_int_equal(st.circ_reset, 1);
    assert_true(st.bytes <= lim.circuit_bytes);
    AP_TEST_RUN_UNTIL(&loop, ap__relay_service_circuits(svc) == 0);

    /* C has no reservation: a circuit to it is refused */
    ap_test_dialer_t dn = {0};
    ap_multiaddr_t tc = target;
    tc.dst = cid.id;
    assert_ok(ap__circuit_dial(B, &tc, &ap_test_dialer_cbs, &dn));
    AP_TEST_RUN_UNTIL(&loop, dn.closed);
    assert_false(dn.ready);
    assert_int_equal(dn.status, AP_ENOTFOUND);

    /* a flood of reservations from one IP: refused past the per-IP limit */
    enum { NFLOOD = 10 };
    ap_p2p_host_t *fl[NFLOOD];
    ap_relay_client_t *fc[NFLOOD];
    for (int i = 0; i < NFLOOD; i++) {
        ap_identity_t fid = ap_test_ident((uint8_t)(40 + i));
        fl[i] = ap__p2p_host_new(&loop, &fid, "apiary-test");
        fc[i] = ap__relay_client_new(fl[i], &rb, 1, NULL, NULL);
        assert_non_null(fc[i]);
    }
    AP_TEST_RUN_UNTIL(&loop, (st = ap__relay_service_stats(svc), st.resv_refused >= NFLOOD - 5));
    print_message("flood: %u reserved, %u refused\n", st.reserved, st.resv_refused);

    /* the relay still serves: B reaches A again */
    ap_test_dialer_t d2 = {0};
    static pinger_t pg2;
    pg2.nsend = 1000;
    memset(pg2.sent, 7, pg2.nsend);
    assert_ok(ap__circuit_dial(B, &target, &ap_test_dialer_cbs, &d2));
    AP_TEST_RUN_UNTIL(&loop, d2.ready || d2.closed);
    assert_true(d2.ready);
    assert_ok(ap__p2p_stream_open(d2.c, &ping_c, &pg2, NULL));
    AP_TEST_RUN_UNTIL(&loop, pg2.ngot == pg2.nsend);

    g_freed = 0;
    ap__p2p_host_free_then(R, freed, NULL);
    ap__p2p_host_free_then(A, freed, NULL);
    ap__p2p_host_free_then(B, freed, NULL);
    ap__p2p_host_free_then(C, freed, NULL);
    for (int i = 0; i < NFLOOD; i++) ap__p2p_host_free_then(fl[i], freed, NULL);
    AP_TEST_RUN_UNTIL(&loop, g_freed == 4 + NFLOOD);
    ap__relay_service_free(svc);
    ap__relay_client_free(g_cl);
    for (int i = 0; i < NFLOOD; i++) ap__relay_client_free(fc[i]);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_relay_loopback),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
