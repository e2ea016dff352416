/* Resource manager: reservations across connection, peer, protocol and node
 * scopes; a full scope refuses cleanly and is named; releases free scopes. */
#include "aptest.h"

#include "apiary/error.h"
#include "base/rcmgr.h"

#include <sodium.h>
#include <string.h>

static ap_peer_id_t rand_peer(void)
{
    uint8_t pk[32];
    randombytes_buf(pk, 32);
    ap_peer_id_t p;
    ap_peer_id_from_ed25519(&p, pk);
    return p;
}

static void test_scopes(void **state)
{
    (void)state;
    ap_rcmgr_config_t c;
    ap_rcmgr_config_default(&c);
    c.node.memory = 1000;
    c.peer.memory = 400;
    c.conn.memory = 300;
    c.proto.memory = 0; /* unlimited */
    ap_rcmgr_t *m = ap_rcmgr_new(&c);
    assert_non_null(m);
    ap_peer_id_t pa = rand_peer(), pb = rand_peer();
    ap_rc_span_t a1 = {.conn = ap_rcmgr_conn(m),
                       .peer = ap_rcmgr_peer(m, &pa),
                       .proto = ap_rcmgr_proto(m, "/apiary/dht/1")};
    ap_rc_span_t a2 = {.conn = ap_rcmgr_conn(m), .peer = ap_rcmgr_peer(m, &pa), .proto = a1.proto};
    ap_rc_scope_t *full = NULL;
    /* the connection's own limit */
    assert_ok(ap_rc_reserve_mem(m, &a1, 300, &full));
    assert_int_equal(ap_rc_reserve_mem(m, &a1, 1, &full), AP_ELIMIT);
    assert_int_equal(ap_rc_scope_kind(full), AP_RC_CONN);
    /* the peer's, across its two connections */
    assert_ok(ap_rc_reserve_mem(m, &a2, 100, &full));
    assert_int_equal(ap_rc_reserve_mem(m, &a2, 1, &full), AP_ELIMIT);
    assert_int_equal(ap_rc_scope_kind(full), AP_RC_PEER);
    char line[256];
    ap_rc_scope_describe(full, line, sizeof line);
    assert_non_null(strstr(line, "memory 400/400"));
    /* a scope without a limit says so ("-"), not "/0" */
    ap_rc_scope_describe(a1.proto, line, sizeof line);
    assert_non_null(strstr(line, "protocol /apiary/dht/1: memory 400/-"));
    /* a refusal reserves nothing anywhere */
    assert_int_equal(ap_rc_scope_use(ap_rcmgr_node(m))->memory, 400);
    assert_int_equal(ap_rc_scope_use(a2.conn)->memory, 100);
    /* another peer is not held back by the first ... */
    ap_rc_span_t b1 = {.conn = ap_rcmgr_conn(m), .peer = ap_rcmgr_peer(m, &pb)};
    assert_ok(ap_rc_reserve_mem(m, &b1, 300, &full));
    /* ... until the node is full */
    ap_rc_span_t b2 = {.conn = ap_rcmgr_conn(m), .peer = ap_rcmgr_peer(m, &pb)};
    ap_rc_span_t b3 = {.conn = ap_rcmgr_conn(m), .peer = ap_rcmgr_peer(m, &pb)};
    assert_ok(ap_rc_reserve_mem(m, &b2, 100, &full));
    assert_int_equal(ap_rc_reserve_mem(m, &b3, 300, &full), AP_ELIMIT);
    assert_int_equal(ap_rc_scope_kind(full), AP_RC_PEER);
    ap_peer_id_t pc = rand_peer();
    ap_rc_span_t c1 = {.conn = ap_rcmgr_conn(m), .peer = ap_rcmgr_peer(m, &pc)};
    assert_ok(ap_rc_reserve_mem(m, &c1, 200, &full));
    assert_int_equal(ap_rc_reserve_mem(m, &c1, 1, &full), AP_ELIMIT);
    assert_int_equal(ap_rc_scope_kind(full), AP_RC_NODE);
    assert_int_equal(ap_rcmgr_refusals(m), 4);
    /* releases give the room back */
    ap_rc_release_mem(m, &a1, 300);
    ap_rc_span_t c2 = {.conn = ap_rcmgr_conn(m), .peer = ap_rcmgr_peer(m, &pc)};
    assert_ok(ap_rc_reserve_mem(m, &c2, 200, &full));
    assert_int_equal(ap_rc_scope_use(a1.proto)->memory, 100);
    /* streams and connections */
    for (int i = 0; i < 256; i++) assert_ok(ap_rc_reserve_stream(m, &a1, &full));
    assert_int_equal(ap_rc_reserve_stream(m, &a1, &full), AP_ELIMIT);
    assert_int_equal(ap_rc_scope_kind(full), AP_RC_CONN);
    for (int i = 0; i < 256; i++) ap_rc_release_stream(m, &a1);
    assert_ok(ap_rc_reserve_conn(m, &a1, &full));
    assert_int_equal(ap_rc_reserve_conn(m, &a1, &full), AP_ELIMIT); /* one per conn scope */
    ap_rc_release_conn(m, &a1);
    /* drop everything: scopes go with their last reservation and reference */
    ap_rc_release_mem(m, &a2, 100);
    ap_rc_release_mem(m, &b1, 300);
    ap_rc_release_mem(m, &b2, 100);
    ap_rc_release_mem(m, &c1, 200);
    ap_rc_release_mem(m, &c2, 200);
    ap_rc_span_t spans[] = {a1, a2, b1, b2, b3, c1, c2};
    for (size_t i = 0; i < sizeof spans / sizeof spans[0]; i++) {
        ap_rc_scope_unref(spans[i].conn);
        ap_rc_scope_unref(spans[i].peer);
    }
    ap_rc_scope_unref(a1.proto);
    ap_rc_scope_unref(a2.proto == a1.proto ? NULL : a2.proto);
    assert_int_equal(ap_rc_scope_use(ap_rcmgr_node(m))->memory, 0);
    ap_rcmgr_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scopes),
    };
    if (sodium_init() < 0) return 1;
    return cmocka_run_group_tests(tests, NULL, NULL);
}
