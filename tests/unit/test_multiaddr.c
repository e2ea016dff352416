#include "aptest.h"

#include "apiary/identity.h"
#include "apiary/multiaddr.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <uv.h>

static char idtext[AP_PEER_ID_STR_MAX];
static ap_peer_id_t pid;

static int setup(void **state)
{
    (void)state;
    uint8_t seed[32] = {7};
    ap_identity_t id;
    if (ap_identity_from_seed(&id, seed) != 0) return -1;
    pid = id.id;
    ap_peer_id_str(&pid, idtext);
    return 0;
}

static void roundtrip(const char *text, const char *canonical)
{
    ap_multiaddr_t ma, back;
    char buf[AP_MA_TEXT_MAX];
    int rc = ap_multiaddr_parse(&ma, text);
    if (rc != 0) fail_msg("parse(%s) = %s", text, ap_err_name(rc));
    int n = ap_multiaddr_print(&ma, buf, sizeof buf);
    assert_true(n > 0);
    assert_string_equal(buf, canonical ? canonical : text);
    assert_int_equal((size_t)n, strlen(buf));
    assert_ok(ap_multiaddr_parse(&back, buf));
    assert_true(ap_multiaddr_eq(&ma, &back));
    uint8_t bin[AP_MA_BINARY_MAX];
    n = ap_multiaddr_encode(&ma, bin, sizeof bin);
    assert_true(n > 0);
    memset(&back, 0xaa, sizeof back);
    assert_ok(ap_multiaddr_decode(&back, bin, (size_t)n));
    assert_true(ap_multiaddr_eq(&ma, &back));
    /* every strict prefix of the binary form that cuts a component is invalid */
    for (int k = 1; k < n; k++) {
        ap_multiaddr_t t;
        int r = ap_multiaddr_decode(&t, bin, (size_t)k);
        if (r == 0) {
            /* a valid prefix must be a shorter address, never equal */
            assert_false(ap_multiaddr_eq(&t, &ma));
        }
    }
}

static void test_text_roundtrip(void **state)
{
    (void)state;
    char a[512], b[512];
    roundtrip("/ip4/127.0.0.1/tcp/4001", NULL);
    roundtrip("/ip4/0.0.0.0/tcp/0", NULL);
    roundtrip("/ip4/255.255.255.255/tcp/65535", NULL);
    roundtrip("/ip4/10.1.2.3", NULL);
    roundtrip("/ip6/::1/tcp/31337", NULL);
    roundtrip("/ip6/2001:0db8:0000:0000:0000:0000:0000:0001/tcp/1", "/ip6/2001:db8::1/tcp/1");
    roundtrip("/dns4/example.org/tcp/443", NULL);
    roundtrip("/dns6/a-b_c.example/tcp/80", NULL);
    snprintf(a, sizeof a, "/ip4/127.0.0.1/tcp/4001/p2p/%s", idtext);
    roundtrip(a, NULL);
    snprintf(a, sizeof a, "/ip4/127.0.0.1/tcp/4001/ipfs/%s", idtext);
    snprintf(b, sizeof b, "/ip4/127.0.0.1/tcp/4001/p2p/%s", idtext);
    roundtrip(a, b);
    snprintf(a, sizeof a, "/p2p/%s", idtext);
    roundtrip(a, NULL);
    snprintf(a, sizeof a, "/dns4/localhost/p2p/%s", idtext);
    roundtrip(a, NULL);

    ap_multiaddr_t ma;
    snprintf(a, sizeof a, "/ip4/1.2.3.4/tcp/5/p2p/%s", idtext);
    assert_ok(ap_multiaddr_parse(&ma, a));
    assert_int_equal(ma.host, AP_MA_HOST_IP4);
    assert_true(ma.has_tcp);
    assert_int_equal(ma.port, 5);
    assert_true(ma.has_peer);
    assert_true(ap_peer_id_eq(&ma.peer, &pid));
    const uint8_t ip[4] = {1, 2, 3, 4};
    assert_memory_equal(ma.ip, ip, 4);
}

static void test_rejects(void **state)
{
    (void)state;
    char longdns[400];
    memset(longdns, 'a', sizeof longdns);
    memcpy(longdns, "/dns4/", 6);
    longdns[6 + 254] = 0;
    char badid[200];
    snprintf(badid, sizeof badid, "/ip4/1.2.3.4/tcp/1/p2p/%sx", idtext);
    char twice[300];
    snprintf(twice, sizeof twice, "/p2p/%s/p2p/%s", idtext, idtext);
    char after[300];
    snprintf(after, sizeof after, "/p2p/%s/tcp/1", idtext);
    const char *bad[] = {
        "",
        "/",
        "//",
        "ip4/1.2.3.4",
        "/ip4",
        "/ip4/",
        "/ip4/1.2.3",
        "/ip4/1.2.3.4.5",
        "/ip4/256.1.1.1",
        "/ip4/01.2.3.4",
        "/ip4/1.2.3.4/",
        "/ip4/1.2.3.4/tcp",
        "/ip4/1.2.3.4/tcp/",
        "/ip4/1.2.3.4/tcp/65536",
        "/ip4/1.2.3.4/tcp/-1",
        "/ip4/1.2.3.4/tcp/+1",
        "/ip4/1.2.3.4/tcp/08",
        "/ip4/1.2.3.4/tcp/1x",
        "/ip4/1.2.3.4/udp/1",
        "/ip6/1.2.3.4",
        "/ip6/:::1",
        "/ip4/1.2.3.4/ip4/1.2.3.4",
        "/tcp/1",
        "/dns4/",
        "/dns4/a..b",
        "/dns4/.a",
        "/dns4/a.",
        "/dns4/a b",
        "/dns4/a/b",
        "/dns4/ex%41mple",
        "/p2p/",
        "/p2p/notapeerid",
        "/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
        "/ip4/1.2.3.4/tcp/1/tcp/2",
        "/unknown/x",
        longdns,
        badid,
        twice,
        after,
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ap_multiaddr_t ma;
        int rc = ap_multiaddr_parse(&ma, bad[i]);
        if (rc != AP_EADDR) fail_msg("accepted '%s' (rc %d)", bad[i], rc);
    }
    assert_int_equal(ap_multiaddr_parse(NULL, "/ip4/1.2.3.4"), AP_EADDR);
    /* a name of exactly 253 characters is fine, 254 is not */
    char ok[300] = "/dns4/";
    for (int i = 0; i < 4; i++) {
        strcat(ok, i ? "." : "");
        size_t L = i < 3 ? 63 : 61;
        size_t at = strlen(ok);
        memset(ok + at, 'b', L);
        ok[at + L] = 0;
    }
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, ok));
    assert_int_equal(strlen(ma.dns), 253);
}

static void test_binary(void **state)
{
    (void)state;
    /* /ip4/127.0.0.1/tcp/4001 per the multiaddr spec: 04 7f000001 06 0fa1 */
    const uint8_t want[] = {0x04, 0x7f, 0x00, 0x00, 0x01, 0x06, 0x0f, 0xa1};
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/4001"));
    uint8_t out[AP_MA_BINARY_MAX];
    assert_int_equal(ap_multiaddr_encode(&ma, out, sizeof out), sizeof want);
    assert_memory_equal(out, want, sizeof want);
    assert_int_equal(ap_multiaddr_encode(&ma, out, 7), AP_ERANGE);
    /* p2p code 421 is the two-byte varint a5 03 */
    char a[200];
    snprintf(a, sizeof a, "/p2p/%s", idtext);
    assert_ok(ap_multiaddr_parse(&ma, a));
    int n = ap_multiaddr_encode(&ma, out, sizeof out);
    assert_int_equal(n, 2 + 1 + AP_PEER_ID_LEN);
    assert_int_equal(out[0], 0xa5);
    assert_int_equal(out[1], 0x03);
    assert_int_equal(out[2], AP_PEER_ID_LEN);
    /* bad binary */
    const uint8_t bad1[] = {0x04, 0x7f, 0x00};                               /* short ip4 */
    const uint8_t bad2[] = {0x06, 0x0f, 0xa1};                               /* tcp first */
    const uint8_t bad3[] = {0x36, 0x05, 'a', '.', 'b'};                      /* dns len > data */
    const uint8_t bad4[] = {0x36, 0x03, 'a', ' ', 'b'};                      /* bad dns char */
    const uint8_t bad5[] = {0x04, 1, 2, 3, 4, 0x06, 0x00, 0x01, 0x06, 0, 1}; /* tcp twice */
    const uint8_t bad6[] = {0x80, 0x00};       /* non-minimal varint */
    const uint8_t bad7[] = {0x11, 0x00, 0x00}; /* udp */
    const uint8_t *bads[] = {bad1, bad2, bad3, bad4, bad5, bad6, bad7};
    const size_t lens[] = {sizeof bad1, sizeof bad2, sizeof bad3, sizeof bad4,
                           sizeof bad5, sizeof bad6, sizeof bad7};
    for (size_t i = 0; i < 7; i++)
        assert_int_equal(ap_multiaddr_decode(&ma, bads[i], lens[i]), AP_EADDR);
    assert_int_equal(ap_multiaddr_decode(&ma, out, 0), AP_EADDR);
}

static void test_circuit(void **state)
{
    (void)state;
    uint8_t seed[32] = {9};
    ap_identity_t other;
    assert_ok(ap_identity_from_seed(&other, seed));
    char dst[AP_PEER_ID_STR_MAX], a[600], b[600];
    ap_peer_id_str(&other.id, dst);
    snprintf(a, sizeof a, "/ip4/1.2.3.4/tcp/4001/p2p/%s/p2p-circuit/p2p/%s", idtext, dst);
    roundtrip(a, NULL);
    snprintf(a, sizeof a, "/p2p-circuit/p2p/%s", dst);
    roundtrip(a, NULL);
    roundtrip("/p2p-circuit", NULL);
    snprintf(a, sizeof a, "/dns6/example.org/tcp/1/ipfs/%s/p2p-circuit/ipfs/%s", idtext, dst);
    snprintf(b, sizeof b, "/dns6/example.org/tcp/1/p2p/%s/p2p-circuit/p2p/%s", idtext, dst);
    roundtrip(a, b);

    ap_multiaddr_t ma;
    snprintf(a, sizeof a, "/ip4/1.2.3.4/tcp/4001/p2p/%s/p2p-circuit/p2p/%s", idtext, dst);
    assert_ok(ap_multiaddr_parse(&ma, a));
    assert_true(ma.circuit && ma.has_peer && ma.has_dst);
    assert_true(ap_peer_id_eq(&ma.peer, &pid));
    assert_true(ap_peer_id_eq(&ma.dst, &other.id));
    /* the binary form: ... a5 03 26 <relay> a2 02 a5 03 26 <target> */
    uint8_t bin[AP_MA_BINARY_MAX];
    int n = ap_multiaddr_encode(&ma, bin, sizeof bin);
    assert_int_equal(n, 5 + 3 + 41 + 2 + 41);
    assert_int_equal(bin[49], 0xa2); /* 290 */
    assert_int_equal(bin[50], 0x02);
    assert_memory_equal(bin + 54, other.id.b, AP_PEER_ID_LEN);
    /* a circuit is not dialled directly, nor resolved */
    struct sockaddr_storage ss;
    assert_int_equal(ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss), AP_EADDR);
    /* circuit and direct forms of the same relay differ */
    ap_multiaddr_t direct;
    snprintf(b, sizeof b, "/ip4/1.2.3.4/tcp/4001/p2p/%s", idtext);
    assert_ok(ap_multiaddr_parse(&direct, b));
    assert_false(ap_multiaddr_eq(&ma, &direct));

    /* the longest form still fits the documented buffers */
    char dns[254];
    memset(dns, 'a', 253);
    for (int i = 63; i < 253; i += 64) dns[i] = '.';
    dns[253] = 0;
    snprintf(a, sizeof a, "/dns6/%s/tcp/65535/p2p/%s/p2p-circuit/p2p/%s", dns, idtext, dst);
    assert_true(strlen(a) < AP_MA_TEXT_MAX);
    roundtrip(a, NULL);

    /* rejects: twice, a value, something after the target, tcp after it */
    const char *bad_fmt[] = {"/p2p-circuit/p2p-circuit",        "/p2p-circuit/tcp/1",
                             "/p2p-circuit/p2p/%s/p2p/%s",      "/p2p-circuit/ip4/1.2.3.4",
                             "/p2p-circuit/p2p/%s/p2p-circuit", "/p2p-circuit/p2p"};
    for (size_t i = 0; i < sizeof bad_fmt / sizeof *bad_fmt; i++) {
        snprintf(a, sizeof a, bad_fmt[i], dst, dst);
        if (ap_multiaddr_parse(&ma, a) == 0) fail_msg("accepted %s", a);
    }
    const uint8_t bad1[] = {0xa2, 0x02, 0xa2, 0x02};             /* circuit twice */
    const uint8_t bad2[] = {0xa2, 0x02, 0x06, 0x00, 0x01};       /* tcp after circuit */
    const uint8_t bad3[] = {0xa2, 0x02, 0x04, 127, 0, 0, 1};     /* host after circuit */
    const uint8_t bad4[] = {0xa2, 0x02, 0xa5, 0x03, 0x26, 0x00}; /* truncated target */
    assert_int_equal(ap_multiaddr_decode(&ma, bad1, sizeof bad1), AP_EADDR);
    assert_int_equal(ap_multiaddr_decode(&ma, bad2, sizeof bad2), AP_EADDR);
    assert_int_equal(ap_multiaddr_decode(&ma, bad3, sizeof bad3), AP_EADDR);
    assert_int_equal(ap_multiaddr_decode(&ma, bad4, sizeof bad4), AP_EADDR);
}

static void test_sockaddr(void **state)
{
    (void)state;
    ap_multiaddr_t ma, back;
    struct sockaddr_storage ss;
    assert_ok(ap_multiaddr_parse(&ma, "/ip6/::1/tcp/9"));
    assert_ok(ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss));
    assert_int_equal(ss.ss_family, AF_INET6);
    assert_int_equal(ntohs(((struct sockaddr_in6 *)&ss)->sin6_port), 9);
    assert_ok(ap_multiaddr_from_sockaddr(&back, &ss));
    assert_true(ap_multiaddr_eq(&ma, &back));
    assert_ok(ap_multiaddr_parse(&ma, "/dns4/localhost/tcp/9"));
    assert_int_equal(ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss), AP_EADDR);
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/1.2.3.4"));
    assert_int_equal(ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss), AP_EADDR);
}

typedef struct {
    int calls, status;
    size_t n;
    ap_multiaddr_t first;
} res_t;

static void on_resolved(void *arg, int status, const ap_multiaddr_t *addrs, size_t n)
{
    res_t *r = arg;
    r->calls++;
    r->status = status;
    r->n = n;
    if (n) r->first = addrs[0];
}

static void test_resolve(void **state)
{
    (void)state;
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    ap_multiaddr_t ma;
    char a[300];
    snprintf(a, sizeof a, "/dns4/localhost/tcp/77/p2p/%s", idtext);
    assert_ok(ap_multiaddr_parse(&ma, a));
    res_t r1 = {0}, r2 = {0}, r3 = {0}, r4 = {0};
    assert_ok(ap_multiaddr_resolve(&loop, &ma, on_resolved, &r1, NULL));
    assert_int_equal(r1.calls, 0); /* never inside the call */
    ap_multiaddr_t lit;
    assert_ok(ap_multiaddr_parse(&lit, "/ip4/10.9.8.7/tcp/5"));
    assert_ok(ap_multiaddr_resolve(&loop, &lit, on_resolved, &r2, NULL));
    /* no DNS traffic leaves the host in tests: a bad numeric host fails in
     * getaddrinfo itself, and the cancelled lookup is of localhost */
    ap_multiaddr_t nx;
    assert_ok(ap_multiaddr_parse(&nx, "/dns4/localhost/tcp/1"));
    ap_ma_resolve_t *h = NULL;
    assert_ok(ap_multiaddr_resolve(&loop, &nx, on_resolved, &r4, &h));
    ap_multiaddr_resolve_cancel(h);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(r1.calls, 1);
    assert_ok(r1.status);
    assert_true(r1.n >= 1);
    assert_int_equal(r1.first.host, AP_MA_HOST_IP4);
    const uint8_t lo[4] = {127, 0, 0, 1};
    assert_memory_equal(r1.first.ip, lo, 4);
    assert_int_equal(r1.first.port, 77);
    assert_true(r1.first.has_peer && ap_peer_id_eq(&r1.first.peer, &pid));
    assert_int_equal(r2.calls, 1);
    assert_ok(r2.status);
    assert_true(ap_multiaddr_eq(&r2.first, &lit));
    (void)r3;
    assert_int_equal(r4.calls, 1);
    assert_int_equal(r4.status, AP_ECANCELED);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_roundtrip), cmocka_unit_test(test_rejects),
        cmocka_unit_test(test_binary),         cmocka_unit_test(test_sockaddr),
        cmocka_unit_test(test_resolve),        cmocka_unit_test(test_circuit),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
