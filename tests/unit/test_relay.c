/* Circuit relay v2 codec and the relay's limits (p2p/relay.h). */
#include "aptest.h"

#include "apiary/identity.h"
#include "p2p/relay.h"

#include <string.h>

static ap_peer_id_t peer(unsigned seed)
{
    uint8_t s[32] = {0};
    memcpy(s, &seed, sizeof seed);
    ap_identity_t id;
    int rc = ap_identity_from_seed(&id, s);
    assert_int_equal(rc, 0);
    return id.id;
}

static ap_multiaddr_t ma(const char *text)
{
    ap_multiaddr_t a;
    if (ap_multiaddr_parse(&a, text) != 0) fail_msg("bad multiaddr %s", text);
    return a;
}

static void roundtrip(const ap_relay_msg_t *m, ap_relay_msg_t *out)
{
    uint8_t buf[AP_RELAY_MSG_MAX + 16];
    int n = ap__relay_encode(m, buf, sizeof buf);
    assert_true(n > 0);
    size_t hl, bl;
    assert_int_equal(ap__relay_frame(buf, (size_t)n, &hl, &bl), 1);
    assert_int_equal(hl + bl, (size_t)n);
    assert_ok(ap__relay_decode(m->stop, buf + hl, bl, out));
}

static void test_codec(void **state)
{
    (void)state;
    static ap_relay_msg_t m, d;
    memset(&m, 0, sizeof m);
    m.type = AP_RELAY_HOP_STATUS;
    m.has_status = true;
    m.status = AP_RELAY_OK;
    m.has_reservation = true;
    m.expire = 1764640000;
    m.raddrs[0] = ma("/ip4/198.18.0.1/tcp/4001");
    m.nraddrs = 1;
    m.has_limit = m.has_duration = m.has_data = true;
    m.duration = 600;
    m.data = 4u << 20;
    roundtrip(&m, &d);
    assert_false(d.stop);
    assert_int_equal(d.type, AP_RELAY_HOP_STATUS);
    assert_true(d.has_status && d.status == AP_RELAY_OK);
    assert_true(d.has_reservation && d.expire == 1764640000);
    assert_int_equal(d.nraddrs, 1);
    assert_true(ap_multiaddr_eq(&d.raddrs[0], &m.raddrs[0]));
    assert_true(d.has_limit && d.duration == 600 && d.data == (4u << 20));

    memset(&m, 0, sizeof m);
    m.stop = true;
    m.type = AP_RELAY_STOP_CONNECT;
    m.has_peer = true;
    m.peer = peer(7);
    roundtrip(&m, &d);
    assert_true(d.stop && d.type == AP_RELAY_STOP_CONNECT && d.has_peer && !d.peer_other);
    assert_true(ap_peer_id_eq(&d.peer, &m.peer));
    assert_false(d.has_status);
}

static void test_malformed(void **state)
{
    (void)state;
    static ap_relay_msg_t d;
    /* type is required */
    const uint8_t no_type[] = {0x28, 0x64}; /* status = OK only */
    assert_int_equal(ap__relay_decode(false, no_type, sizeof no_type, &d), AP_ECORRUPT);
    assert_int_equal(d.type, -1);
    const uint8_t junk[] = {0xff, 0xff};
    assert_int_equal(ap__relay_decode(true, junk, sizeof junk, &d), AP_ECORRUPT);
    assert_int_equal(ap__relay_decode(true, NULL, 0, &d), AP_ECORRUPT);
    size_t hl, bl;
    const uint8_t big[] = {0x81, 0x40};
    assert_int_equal(ap__relay_frame(big, 2, &hl, &bl), AP_EMSGSIZE);
    /* a Peer whose id is not a PeerID: decoded, flagged */
    const uint8_t odd[] = {0x08, 0x01, 0x12, 0x04, 0x0a, 0x02, 0x12, 0x00};
    assert_ok(ap__relay_decode(false, odd, sizeof odd, &d));
    assert_true(d.has_peer && d.peer_other);
}

static void test_reservations(void **state)
{
    (void)state;
    ap_relay_limits_t lim;
    ap__relay_limits_default(&lim);
    lim.max_reservations = 20;
    lim.reservations_per_ip = 8;
    ap_relay_t r;
    assert_ok(ap__relay_init(&r, &lim));
    char why[128];
    uint64_t exp, t = 1000;
    ap_multiaddr_t ip1 = ma("/ip4/198.18.0.101/tcp/1"), ip2 = ma("/ip4/198.18.0.102/tcp/1");
    ap_peer_id_t a = peer(1);
    assert_int_equal(ap__relay_reserve(&r, &a, &ip1, t, &exp, why, sizeof why), AP_RELAY_OK);
    assert_int_equal(exp, t + lim.reservation_ttl_us);
    assert_true(ap__relay_reserved(&r, &a, t));
    /* refreshing keeps the slot; reserving too often is refused */
    for (int i = 1; i < 4; i++)
        assert_int_equal(ap__relay_reserve(&r, &a, &ip1, t + i, &exp, why, sizeof why),
                         AP_RELAY_OK);
    assert_int_equal(ap__relay_reserve(&r, &a, &ip1, t + 5, &exp, why, sizeof why),
                     AP_RELAY_RESERVATION_REFUSED);
    print_message("refused: %s\n", why);
    /* a flood from one IP stops at reservations_per_ip */
    int ok = 0;
    for (unsigned i = 0; i < 100; i++) {
        ap_peer_id_t p = peer(100 + i);
        ok += ap__relay_reserve(&r, &p, &ip1, t, &exp, why, sizeof why) == AP_RELAY_OK;
    }
    assert_int_equal(ok, 7); /* a holds one of the 8 */
    print_message("refused: %s\n", why);
    /* from many IPs, at max_reservations */
    ok = 0;
    for (unsigned i = 0; i < 100; i++) {
        ap_peer_id_t p = peer(300 + i);
        ap_multiaddr_t ip = ip2;
        ip.ip[3] = (uint8_t)i;
        ok += ap__relay_reserve(&r, &p, &ip, t, &exp, why, sizeof why) == AP_RELAY_OK;
    }
    assert_int_equal(ok, 20 - 8);
    /* they expire */
    assert_false(ap__relay_reserved(&r, &a, t + lim.reservation_ttl_us + 10));
    ap_peer_id_t late = peer(999);
    assert_int_equal(
        ap__relay_reserve(&r, &late, &ip1, t + lim.reservation_ttl_us + 10, &exp, why, sizeof why),
        AP_RELAY_OK);
    ap__relay_free(&r);
}

static void test_circuits(void **state)
{
    (void)state;
    ap_relay_limits_t lim;
    ap__relay_limits_default(&lim);
    lim.circuits_per_peer = 2;
    lim.circuit_bytes = 1000;
    ap_relay_t r;
    assert_ok(ap__relay_init(&r, &lim));
    char why[128];
    uint64_t exp, id[3], t = 1;
    ap_peer_id_t a = peer(1), b = peer(2), c = peer(3);
    ap_multiaddr_t ip = ma("/ip4/198.18.0.101/tcp/1");
    assert_int_equal(ap__relay_connect(&r, &a, &b, t, &id[0], why, sizeof why),
                     AP_RELAY_NO_RESERVATION);
    assert_int_equal(ap__relay_reserve(&r, &b, &ip, t, &exp, why, sizeof why), AP_RELAY_OK);
    assert_int_equal(ap__relay_connect(&r, &b, &b, t, &id[0], why, sizeof why),
                     AP_RELAY_PERMISSION_DENIED);
    assert_int_equal(ap__relay_connect(&r, &a, &b, t, &id[0], why, sizeof why), AP_RELAY_OK);
    assert_int_equal(ap__relay_connect(&r, &c, &b, t, &id[1], why, sizeof why), AP_RELAY_OK);
    assert_int_equal(ap__relay_connect(&r, &a, &b, t, &id[2], why, sizeof why),
                     AP_RELAY_RESOURCE_LIMIT_EXCEEDED);
    assert_int_equal(ap__relay_circuits(&r), 2);
    /* bytes */
    assert_ok(ap__relay_account(&r, id[0], 600, t));
    assert_int_equal(ap__relay_account(&r, id[0], 600, t), AP_ELIMIT);
    ap__relay_circuit_end(&r, id[0]);
    assert_int_equal(ap__relay_account(&r, id[0], 1, t), AP_ENOTFOUND);
    /* duration */
    assert_ok(ap__relay_account(&r, id[1], 1, t + lim.circuit_duration_us));
    assert_int_equal(ap__relay_account(&r, id[1], 1, t + lim.circuit_duration_us + 1), AP_ELIMIT);
    ap__relay_circuit_end(&r, id[1]);
    assert_int_equal(ap__relay_circuits(&r), 0);
    assert_int_equal(ap__relay_connect(&r, &a, &b, t, &id[2], why, sizeof why), AP_RELAY_OK);
    ap__relay_free(&r);
    lim.max_circuits = 0;
    assert_int_equal(ap__relay_init(&r, &lim), AP_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codec),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_reservations),
        cmocka_unit_test(test_circuits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
