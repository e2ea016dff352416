/* identify: encode / decode round trip, the wire bytes of a message built by
 * hand from the specification's field numbers, keys of another type, listen
 * addresses of transports Apiary does not speak, the length prefix, and
 * every bound (size, count, string length, NUL in a string). */
#include "aptest.h"

#include "apiary/identity.h"
#include "p2p/identify.h"

#include <stdlib.h>
#include <string.h>

static ap_identity_t me;

static int setup(void **state)
{
    (void)state;
    uint8_t seed[32] = {4};
    return ap_identity_from_seed(&me, seed);
}

static void test_roundtrip(void **state)
{
    (void)state;
    ap_identify_t *in = calloc(1, sizeof *in), *out = calloc(1, sizeof *out);
    strcpy(in->protocol_version, "ipfs/0.1.0");
    strcpy(in->agent_version, "apiary/0.1.0");
    assert_ok(ap_multiaddr_parse(&in->listen[0], "/ip4/127.0.0.1/tcp/4001"));
    assert_ok(ap_multiaddr_parse(&in->listen[1], "/ip6/::1/tcp/4002"));
    in->nlisten = 2;
    in->has_observed = true;
    assert_ok(ap_multiaddr_parse(&in->observed, "/ip4/10.0.0.7/tcp/55555"));
    const char *protos[] = {"/ipfs/id/1.0.0", "/ipfs/ping/1.0.0", "/apiary/dht/1"};
    for (int i = 0; i < 3; i++) in->protocols[i] = protos[i];
    in->nprotocols = 3;
    uint8_t buf[AP_IDENTIFY_MSG_MAX + 16];
    int n = ap__identify_encode(in, me.pk, buf, sizeof buf);
    assert_true(n > 0);
    size_t hl, bl;
    assert_int_equal(ap__identify_frame(buf, (size_t)n, &hl, &bl), 1);
    assert_int_equal(hl + bl, (size_t)n);
    assert_int_equal(ap__identify_frame(buf, 0, &hl, &bl), 0);
    assert_ok(ap__identify_decode(buf + hl, bl, out));
    assert_string_equal(out->protocol_version, "ipfs/0.1.0");
    assert_string_equal(out->agent_version, "apiary/0.1.0");
    assert_true(out->has_key && out->has_id);
    assert_int_equal(out->key_type, 1);
    assert_true(ap_peer_id_eq(&out->id, &me.id));
    assert_int_equal(out->nlisten, 2);
    assert_true(ap_multiaddr_eq(&out->listen[1], &in->listen[1]));
    assert_true(out->has_observed && ap_multiaddr_eq(&out->observed, &in->observed));
    assert_int_equal(out->nprotocols, 3);
    for (int i = 0; i < 3; i++) assert_string_equal(out->protocols[i], protos[i]);
    assert_int_equal(ap__identify_encode(in, me.pk, buf, 10), AP_EMSGSIZE);
    free(in);
    free(out);
}

/* Appends a length-delimited field. */
static size_t fld(uint8_t *p, size_t o, unsigned field, const void *v, size_t n)
{
    p[o++] = (uint8_t)(field << 3 | 2);
    if (n >= 128) {
        p[o++] = (uint8_t)(0x80 | (n & 0x7f));
        p[o++] = (uint8_t)(n >> 7);
    } else {
        p[o++] = (uint8_t)n;
    }
    memcpy(p + o, v, n);
    return o + n;
}

static void test_wire(void **state)
{
    (void)state;
    ap_identify_t *out = calloc(1, sizeof *out);
    static uint8_t m[AP_IDENTIFY_MSG_MAX * 2];
    size_t o = 0;
    uint8_t key[36];
    memcpy(key, "\x08\x01\x12\x20", 4);
    memcpy(key + 4, me.pk, 32);
    const uint8_t tcp[] = {0x04, 1, 2, 3, 4, 0x06, 0x0f, 0xa1};
    /* /ip4/1.2.3.4/udp/4001/quic-v1: udp 273, quic-v1 461 */
    const uint8_t quic[] = {0x04, 1, 2, 3, 4, 0x91, 0x02, 0x0f, 0xa1, 0xcd, 0x03};
    o = fld(m, o, 5, "ipfs/0.1.0", 10);
    o = fld(m, o, 6, "js-libp2p/1.0.0", 15);
    o = fld(m, o, 1, key, sizeof key);
    o = fld(m, o, 2, tcp, sizeof tcp);
    o = fld(m, o, 2, quic, sizeof quic);
    o = fld(m, o, 4, tcp, sizeof tcp);
    o = fld(m, o, 3, "/ipfs/ping/1.0.0", 16);
    o = fld(m, o, 8, "\x0a\x01x", 3);
    assert_ok(ap__identify_decode(m, o, out));
    assert_string_equal(out->agent_version, "js-libp2p/1.0.0");
    assert_true(ap_peer_id_eq(&out->id, &me.id));
    assert_int_equal(out->nlisten, 1);
    assert_int_equal(out->addrs_other, 1);
    assert_true(out->has_observed);
    assert_int_equal(out->observed.port, 4001);
    assert_int_equal(out->nprotocols, 1);
    assert_string_equal(out->protocols[0], "/ipfs/ping/1.0.0");
    assert_int_equal(out->signed_record_len, 3);

    /* an RSA key: reported, no PeerID */
    o = fld(m, 0, 1,
            "\x08\x00\x12\x03"
            "abc",
            7);
    assert_ok(ap__identify_decode(m, o, out));
    assert_true(out->has_key);
    assert_false(out->has_id);
    assert_int_equal(out->key_type, 0);
    /* a key that is no PublicKey */
    o = fld(m, 0, 1, "\xff", 1);
    assert_int_equal(ap__identify_decode(m, o, out), AP_ECORRUPT);
    /* NUL inside a string */
    o = fld(m, 0, 3, "/a\0b", 4);
    assert_int_equal(ap__identify_decode(m, o, out), AP_ECORRUPT);
    o = fld(m, 0, 6, "x\0", 2);
    assert_int_equal(ap__identify_decode(m, o, out), AP_ECORRUPT);
    /* too many addresses, too many protocols, too long a string */
    o = 0;
    for (int i = 0; i < AP_IDENTIFY_ADDRS_MAX + 1; i++) o = fld(m, o, 2, tcp, sizeof tcp);
    assert_int_equal(ap__identify_decode(m, o, out), AP_ELIMIT);
    o = 0;
    for (int i = 0; i < AP_IDENTIFY_PROTOS_MAX + 1; i++) o = fld(m, o, 3, "/p", 2);
    assert_int_equal(ap__identify_decode(m, o, out), AP_ELIMIT);
    char longs[AP_IDENTIFY_STR_MAX + 1];
    memset(longs, 'a', sizeof longs);
    o = fld(m, 0, 6, longs, sizeof longs);
    assert_int_equal(ap__identify_decode(m, o, out), AP_ELIMIT);
    /* garbage, and a message over the cap */
    assert_int_equal(ap__identify_decode((const uint8_t *)"\x0a\x05"
                                                          "ab",
                                         4, out),
                     AP_ECORRUPT);
    assert_int_equal(ap__identify_decode(m, AP_IDENTIFY_MSG_MAX + 1, out), AP_EMSGSIZE);
    size_t hl, bl;
    assert_int_equal(ap__identify_frame((const uint8_t *)"\x81\x40", 2, &hl, &bl), AP_EMSGSIZE);
    assert_int_equal(ap__identify_frame((const uint8_t *)"\x80\x00", 2, &hl, &bl), AP_ECORRUPT);
    assert_int_equal(ap__identify_frame((const uint8_t *)"\x80\x40", 2, &hl, &bl), 1);
    assert_int_equal(bl, 8192);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_wire),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
