/* AutoNAT v1 codec and server policy (p2p/autonat.h), observed addresses and
 * the reachability verdict (p2p/reach.h). */
#include "aptest.h"

#include "apiary/identity.h"
#include "p2p/autonat.h"
#include "p2p/reach.h"

#include <string.h>

static ap_peer_id_t peer(uint8_t seed)
{
    uint8_t s[32];
    memset(s, seed, sizeof s);
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

static void decode_framed(const uint8_t *buf, int n, ap_autonat_msg_t *m)
{
    assert_true(n > 0);
    size_t hl, bl;
    assert_int_equal(ap__autonat_frame(buf, (size_t)n, &hl, &bl), 1);
    assert_int_equal(hl + bl, (size_t)n);
    assert_ok(ap__autonat_decode(buf + hl, bl, m));
}

static void test_codec_roundtrip(void **state)
{
    (void)state;
    ap_peer_id_t me = peer(1);
    ap_multiaddr_t a[2] = {ma("/ip4/198.18.0.101/tcp/4001"), ma("/ip6/::1/tcp/5")};
    uint8_t buf[AP_AUTONAT_MSG_MAX + 16];
    ap_autonat_msg_t m;
    decode_framed(buf, ap__autonat_encode_dial(&me, a, 2, buf, sizeof buf), &m);
    assert_int_equal(m.type, AP_AUTONAT_DIAL);
    assert_true(m.has_dial && m.has_id && !m.id_other);
    assert_true(ap_peer_id_eq(&m.id, &me));
    assert_int_equal(m.naddrs, 2);
    assert_true(ap_multiaddr_eq(&m.addrs[0], &a[0]));
    assert_true(ap_multiaddr_eq(&m.addrs[1], &a[1]));

    decode_framed(buf, ap__autonat_encode_response(AP_AUTONAT_OK, "fine", &a[0], buf, sizeof buf),
                  &m);
    assert_int_equal(m.type, AP_AUTONAT_DIAL_RESPONSE);
    assert_true(m.has_response && m.has_addr);
    assert_int_equal(m.status, AP_AUTONAT_OK);
    assert_string_equal(m.text, "fine");
    assert_true(ap_multiaddr_eq(&m.addr, &a[0]));

    decode_framed(
        buf, ap__autonat_encode_response(AP_AUTONAT_E_DIAL_ERROR, NULL, NULL, buf, sizeof buf), &m);
    assert_int_equal(m.status, AP_AUTONAT_E_DIAL_ERROR);
    assert_false(m.has_addr);
}

/* Bytes as go-libp2p writes them: a DIAL for id 0x00 0x24 ... with one
 * /ip4/1.2.3.4/tcp/4001 address, hand-assembled from the specification. */
static void test_wire_bytes(void **state)
{
    (void)state;
    ap_peer_id_t me = peer(2);
    uint8_t body[128];
    size_t k = 0;
    const uint8_t addr[] = {0x04, 1, 2, 3, 4, 0x06, 0x0f, 0xa1};
    body[k++] = 0x08; /* type = DIAL */
    body[k++] = 0x00;
    body[k++] = 0x12; /* dial */
    body[k++] = (uint8_t)(2 + 2 + AP_PEER_ID_LEN + 2 + sizeof addr);
    body[k++] = 0x0a; /* peer */
    body[k++] = (uint8_t)(2 + AP_PEER_ID_LEN + 2 + sizeof addr);
    body[k++] = 0x0a; /* id */
    body[k++] = AP_PEER_ID_LEN;
    memcpy(body + k, me.b, AP_PEER_ID_LEN);
    k += AP_PEER_ID_LEN;
    body[k++] = 0x12; /* addrs */
    body[k++] = sizeof addr;
    memcpy(body + k, addr, sizeof addr);
    k += sizeof addr;
    ap_autonat_msg_t m;
    assert_ok(ap__autonat_decode(body, k, &m));
    assert_int_equal(m.type, AP_AUTONAT_DIAL);
    assert_true(ap_peer_id_eq(&m.id, &me));
    assert_int_equal(m.naddrs, 1);
    ap_multiaddr_t want = ma("/ip4/1.2.3.4/tcp/4001");
    assert_true(ap_multiaddr_eq(&m.addrs[0], &want));
    /* and our encoder produces the same body */
    uint8_t buf[256];
    int n = ap__autonat_encode_dial(&me, &want, 1, buf, sizeof buf);
    assert_int_equal((size_t)n, 1 + k);
    assert_memory_equal(buf + 1, body, k);
}

static void test_decode_limits(void **state)
{
    (void)state;
    static ap_multiaddr_t many[AP_AUTONAT_ADDRS_MAX];
    for (int i = 0; i < AP_AUTONAT_ADDRS_MAX; i++) many[i] = ma("/ip4/1.2.3.4/tcp/1");
    uint8_t buf[AP_AUTONAT_MSG_MAX + 16];
    ap_peer_id_t me = peer(3);
    ap_autonat_msg_t m;
    decode_framed(buf, ap__autonat_encode_dial(&me, many, AP_AUTONAT_ADDRS_MAX, buf, sizeof buf),
                  &m);
    assert_int_equal(m.naddrs, AP_AUTONAT_ADDRS_MAX);
    assert_int_equal(ap__autonat_encode_dial(&me, many, AP_AUTONAT_ADDRS_MAX + 1, buf, sizeof buf),
                     AP_EINVAL);
    /* garbage, an oversized length, a truncated prefix */
    const uint8_t junk[] = {0xff, 0xff, 0xff};
    assert_int_equal(ap__autonat_decode(junk, sizeof junk, &m), AP_ECORRUPT);
    assert_int_equal(m.type, -1);
    size_t hl, bl;
    const uint8_t big[] = {0x81, 0x40}; /* 8193 */
    assert_int_equal(ap__autonat_frame(big, 2, &hl, &bl), AP_EMSGSIZE);
    assert_int_equal(ap__autonat_frame(big, 1, &hl, &bl), 0);
    assert_int_equal(ap__autonat_decode(NULL, 0, &m), 0); /* an empty message */
    assert_int_equal(m.type, -1);
    /* a status text over the cap */
    char text[AP_AUTONAT_TEXT_MAX + 2];
    memset(text, 'a', sizeof text - 1);
    text[sizeof text - 1] = 0;
    int n = ap__autonat_encode_response(0, text, NULL, buf, sizeof buf);
    assert_true(n > 0); /* the encoder cuts it */
    decode_framed(buf, n, &m);
    assert_int_equal(strlen(m.text), AP_AUTONAT_TEXT_MAX);
}

static void test_server_policy(void **state)
{
    (void)state;
    static ap_autonat_srv_t s;
    ap__autonat_srv_init(&s);
    ap_peer_id_t a = peer(4), b = peer(5);
    ap_multiaddr_t remote = ma("/ip4/198.18.0.101/tcp/51234");
    ap_autonat_msg_t req = {.type = AP_AUTONAT_DIAL, .has_dial = true, .has_id = true, .id = a};
    req.addrs[0] = ma("/ip4/198.18.0.101/tcp/4001");
    req.addrs[1] = ma("/ip4/203.0.113.9/tcp/4001");  /* a third party: never dialled */
    req.addrs[2] = ma("/ip4/198.18.0.101/tcp/4001"); /* a duplicate */
    req.addrs[3] = ma("/ip4/198.18.0.101/tcp/4002");
    req.naddrs = 4;
    ap_multiaddr_t dial[AP_AUTONAT_DIAL_MAX];
    size_t nd;
    char why[160];
    uint64_t t = 1000000;
    assert_int_equal(ap__autonat_srv_check(&s, &req, &a, &remote, false, t, dial, &nd, why, 160),
                     AP_AUTONAT_OK);
    assert_int_equal(nd, 2);
    assert_int_equal(dial[0].port, 4001);
    assert_int_equal(dial[1].port, 4002);
    assert_true(dial[0].has_peer && ap_peer_id_eq(&dial[0].peer, &a));
    /* over a relay: refused */
    assert_int_equal(ap__autonat_srv_check(&s, &req, &a, &remote, true, t, dial, &nd, why, 160),
                     AP_AUTONAT_E_DIAL_REFUSED);
    /* the request names another peer */
    assert_int_equal(ap__autonat_srv_check(&s, &req, &b, &remote, false, t, dial, &nd, why, 160),
                     AP_AUTONAT_E_BAD_REQUEST);
    /* only third-party addresses */
    ap_autonat_msg_t third = req;
    third.id = b;
    third.addrs[0] = req.addrs[1];
    third.naddrs = 1;
    assert_int_equal(ap__autonat_srv_check(&s, &third, &b, &remote, false, t, dial, &nd, why, 160),
                     AP_AUTONAT_E_DIAL_REFUSED);
    assert_int_equal(nd, 0);
    print_message("refused: %s\n", why);
    /* a's budget: 3 per window (one used above) */
    assert_int_equal(
        ap__autonat_srv_check(&s, &req, &a, &remote, false, t + 1, dial, &nd, why, 160),
        AP_AUTONAT_OK);
    assert_int_equal(
        ap__autonat_srv_check(&s, &req, &a, &remote, false, t + 2, dial, &nd, why, 160),
        AP_AUTONAT_OK);
    assert_int_equal(
        ap__autonat_srv_check(&s, &req, &a, &remote, false, t + 3, dial, &nd, why, 160),
        AP_AUTONAT_E_DIAL_REFUSED);
    print_message("refused: %s\n", why);
    /* a window later, a is served again */
    assert_int_equal(ap__autonat_srv_check(&s, &req, &a, &remote, false,
                                           t + AP_AUTONAT_WINDOW_US + 4, dial, &nd, why, 160),
                     AP_AUTONAT_OK);
    /* a flood from many peers hits the global budget */
    int ok = 0, refused = 0;
    for (int i = 0; i < 3 * AP_AUTONAT_GLOBAL_RATE; i++) {
        ap_peer_id_t p = peer((uint8_t)(10 + i));
        ap_autonat_msg_t r = req;
        r.id = p;
        int st = ap__autonat_srv_check(&s, &r, &p, &remote, false, t + AP_AUTONAT_WINDOW_US + 5,
                                       dial, &nd, why, 160);
        ok += st == AP_AUTONAT_OK;
        refused += st == AP_AUTONAT_E_DIAL_REFUSED;
    }
    assert_true(ok < AP_AUTONAT_GLOBAL_RATE);
    assert_int_equal(ok + refused, 3 * AP_AUTONAT_GLOBAL_RATE);
}

static void test_observed(void **state)
{
    (void)state;
    static ap_obs_t o;
    ap__obs_init(&o);
    ap_multiaddr_t seen = ma("/ip4/198.18.0.101/tcp/40000");
    ap_multiaddr_t out[4];
    ap_peer_id_t p1 = peer(1), p2 = peer(2), p3 = peer(3);
    uint64_t t = 5;
    assert_ok(ap__obs_add(&o, &p1, &seen, t));
    assert_ok(ap__obs_add(&o, &p1, &seen, t)); /* the same peer twice counts once */
    assert_ok(ap__obs_add(&o, &p2, &seen, t));
    assert_int_equal(ap__obs_believed(&o, t, out, 4), 0);
    assert_ok(ap__obs_add(&o, &p3, &seen, t));
    assert_int_equal(ap__obs_believed(&o, t, out, 4), 1);
    assert_true(ap_multiaddr_eq(&out[0], &seen));
    /* p3 now sees another address: its old report goes */
    ap_multiaddr_t other = ma("/ip4/198.18.0.101/tcp/40001");
    assert_ok(ap__obs_add(&o, &p3, &other, t));
    assert_int_equal(ap__obs_count(&o, &seen, t), 2);
    assert_int_equal(ap__obs_believed(&o, t, out, 4), 0);
    /* ... but all three still agree on the IP */
    assert_int_equal(ap__obs_believed_ips(&o, t, out, 4), 1);
    assert_false(out[0].has_tcp);
    assert_memory_equal(out[0].ip, seen.ip, 4);
    /* reports expire */
    assert_ok(ap__obs_add(&o, &p3, &seen, t));
    assert_int_equal(ap__obs_believed(&o, t + AP_OBS_TTL_US + 1, out, 4), 0);
    ap_multiaddr_t circ = ma(
        "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit");
    assert_int_equal(ap__obs_add(&o, &p1, &circ, t), AP_EINVAL);
    /* a flood of one-observer addresses from many peers keeps the table
     * bounded and does not displace the believed address */
    for (int i = 0; i < 200; i++) {
        ap_multiaddr_t x = seen;
        x.port = (uint16_t)(1000 + i);
        ap_peer_id_t p = peer((uint8_t)(40 + i));
        assert_ok(ap__obs_add(&o, &p, &x, t + 10));
    }
    assert_int_equal(ap__obs_believed(&o, t + 10, out, 4), 1);
    assert_true(ap_multiaddr_eq(&out[0], &seen));
}

static void test_reachability(void **state)
{
    (void)state;
    ap_reach_t r;
    const uint64_t retry = 5000000, recheck = 900000000;
    ap__reach_init(&r, 0, retry, recheck);
    assert_true(ap__reach_due(&r, 0));
    ap_peer_id_t s1 = peer(1), s2 = peer(2), s3 = peer(3), s4 = peer(4);
    ap_multiaddr_t a = ma("/ip4/198.18.0.1/tcp/4001");
    /* one server's repeated word is not enough */
    assert_false(ap__reach_answer(&r, &s1, AP_AUTONAT_OK, &a, 1));
    assert_false(ap__reach_answer(&r, &s1, AP_AUTONAT_OK, &a, 2));
    assert_false(ap__reach_answer(&r, &s2, AP_AUTONAT_OK, &a, 3));
    assert_int_equal(r.state, AP_REACH_UNKNOWN);
    /* refusals are no votes */
    assert_false(ap__reach_answer(&r, &s3, AP_AUTONAT_E_DIAL_REFUSED, NULL, 4));
    assert_true(ap__reach_answer(&r, &s3, AP_AUTONAT_OK, &a, 5));
    assert_int_equal(r.state, AP_REACH_PUBLIC);
    assert_true(r.has_addr && ap_multiaddr_eq(&r.addr, &a));
    assert_false(ap__reach_due(&r, 6));
    assert_true(ap__reach_due(&r, 5 + recheck));
    /* one contrary answer: still public, but look again soon */
    assert_false(ap__reach_answer(&r, &s4, AP_AUTONAT_E_DIAL_ERROR, NULL, 10));
    assert_int_equal(r.state, AP_REACH_PUBLIC);
    assert_true(ap__reach_due(&r, 10 + retry));
    assert_false(ap__reach_answer(&r, &s1, AP_AUTONAT_E_DIAL_ERROR, NULL, 11));
    assert_true(ap__reach_answer(&r, &s2, AP_AUTONAT_E_DIAL_ERROR, NULL, 12));
    assert_int_equal(r.state, AP_REACH_PRIVATE);
    assert_false(r.has_addr);
    assert_int_equal(r.changes, 2);
    assert_string_equal(ap__reach_name(r.state), "private");
    ap__reach_probed(&r, 20);
    assert_false(ap__reach_due(&r, 21));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codec_roundtrip), cmocka_unit_test(test_wire_bytes),
        cmocka_unit_test(test_decode_limits),   cmocka_unit_test(test_server_policy),
        cmocka_unit_test(test_observed),        cmocka_unit_test(test_reachability),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
