/* libp2p Noise ("/noise"): Noise_XX_25519_ChaChaPoly_SHA256 with the libp2p
 * handshake payload. The payload's bytes against the field numbers of the
 * libp2p specification, the early stream-muxer negotiation (initiator's
 * preference wins, no overlap fails, a side without a list falls back),
 * identity keys of another type refused with their type named, a wrong
 * expected PeerID refused, and the two dialects (SHA-256 and BLAKE2b) never
 * completing a handshake with each other. */
#include "aptest.h"

#include "libp2p.pb-c.h"
#include "net/secure.h"
#include "noise.pb-c.h"

#include <sodium.h>
#include <string.h>

static const char *const MUX2 = "/apiary/mux/2";
static const char *const YAMUX = "/yamux/1.0.0";

static void creds(ap_secure_creds_t *c, uint8_t seed_byte, ap_noise_hash_t hash,
                  const char *const *muxers, size_t n)
{
    uint8_t seed[32];
    memset(seed, seed_byte, sizeof seed);
    ap_identity_t id;
    assert_ok(ap_identity_from_seed(&id, seed));
    assert_ok(ap__secure_creds_init_muxers(c, &id, hash, NULL, muxers, n));
}

static int run(ap_secure_hs_t *a, ap_secure_hs_t *b, int *failed_side)
{
    static uint8_t m[AP_NOISE_MSG_MAX];
    size_t ml;
    for (int i = 0; i < 3; i++) {
        ap_secure_hs_t *w = i % 2 ? b : a, *r = i % 2 ? a : b;
        int rc = ap__secure_write(w, m, sizeof m, &ml);
        if (rc) {
            *failed_side = i % 2;
            return rc;
        }
        rc = ap__secure_read(r, m, ml);
        if (rc) {
            *failed_side = 1 - i % 2;
            return rc;
        }
    }
    return 0;
}

static void test_payload_bytes(void **state)
{
    (void)state;
    const char *const mux[] = {MUX2, YAMUX};
    ap_secure_creds_t c;
    creds(&c, 5, AP_NOISE_SHA256, mux, 2);
    const uint8_t *p = c.payload;
    size_t o = 0;
    /* field 1 identity_key (bytes): a PublicKey {Type = Ed25519, Data = pk} */
    assert_int_equal(p[o++], 0x0a);
    assert_int_equal(p[o++], 36);
    assert_memory_equal(p + o, "\x08\x01\x12\x20", 4);
    assert_memory_equal(p + o + 4, c.id.pk, 32);
    o += 36;
    /* field 2 identity_sig: Ed25519 over "noise-libp2p-static-key:" || s */
    assert_int_equal(p[o++], 0x12);
    assert_int_equal(p[o++], 64);
    uint8_t msg[24 + 32];
    memcpy(msg, "noise-libp2p-static-key:", 24);
    memcpy(msg + 24, c.s_pub, 32);
    assert_int_equal(crypto_sign_verify_detached(p + o, msg, sizeof msg, c.id.pk), 0);
    o += 64;
    /* field 4 extensions: NoiseExtensions { field 2 stream_muxers x2 } */
    assert_int_equal(p[o++], 0x22);
    assert_int_equal(p[o++], 2 + 13 + 2 + 12);
    assert_memory_equal(p + o, "\x12\x0d/apiary/mux/2\x12\x0c/yamux/1.0.0", 29);
    o += 29;
    assert_int_equal(o, c.payload_len);

    /* no muxers: no extensions field at all (Apiary's own dialect as before) */
    creds(&c, 5, AP_NOISE_BLAKE2B, NULL, 0);
    assert_int_equal(c.payload_len, 2 + 36 + 2 + 64);
    /* bad lists */
    uint8_t seed[32] = {1};
    ap_identity_t id;
    assert_ok(ap_identity_from_seed(&id, seed));
    const char *const empty[] = {""};
    const char *const nine[9] = {YAMUX, YAMUX, YAMUX, YAMUX, YAMUX, YAMUX, YAMUX, YAMUX, YAMUX};
    assert_int_equal(ap__secure_creds_init_muxers(&c, &id, AP_NOISE_SHA256, NULL, empty, 1),
                     AP_EINVAL);
    assert_int_equal(ap__secure_creds_init_muxers(&c, &id, AP_NOISE_SHA256, NULL, nine, 9),
                     AP_EINVAL);
}

/* Handshake between an initiator listing im[0..in) and a responder listing
 * rm[0..rn); want: the agreed muxer, "" for none (fall back to
 * multistream-select), NULL for a failed handshake. */
static void early(const char *const *im, size_t in, const char *const *rm, size_t rn,
                  const char *want)
{
    ap_secure_creds_t ci, cr;
    creds(&ci, 1, AP_NOISE_SHA256, im, in);
    creds(&cr, 2, AP_NOISE_SHA256, rm, rn);
    ap_secure_hs_t a, b;
    assert_ok(ap__secure_init(&a, &ci, true, &cr.id.id, NULL));
    assert_ok(ap__secure_init(&b, &cr, false, NULL, NULL));
    int side = -1;
    int rc = run(&a, &b, &side);
    if (!want) {
        assert_int_equal(rc, AP_ENOPROTO);
        assert_int_equal(side, 0); /* the initiator sees it first, in message 2 */
        assert_false(ap__secure_done(&a));
        return;
    }
    assert_ok(rc);
    assert_true(ap__secure_done(&a) && ap__secure_done(&b));
    assert_true(ap_peer_id_eq(ap__secure_remote(&b), &ci.id.id));
    const char *ga = a.info.muxer >= 0 ? ci.muxers[a.info.muxer] : "";
    const char *gb = b.info.muxer >= 0 ? cr.muxers[b.info.muxer] : "";
    assert_string_equal(ga, want);
    assert_string_equal(gb, want);
    assert_int_equal(a.info.has_muxers, rn > 0);
    assert_int_equal(b.info.has_muxers, in > 0);
    assert_int_equal(a.info.key_type, AP_KEY_ED25519);
    /* the transport keys work */
    ap_noise_cs_t as, ar, bs, br;
    assert_ok(ap__secure_split(&a, &as, &ar));
    assert_ok(ap__secure_split(&b, &bs, &br));
    uint8_t buf[32] = "hello";
    assert_ok(ap__noise_cs_encrypt(&as, NULL, 0, buf, 5, buf));
    assert_ok(ap__noise_cs_decrypt(&br, NULL, 0, buf, 5 + AP_NOISE_TAGLEN, buf));
    assert_memory_equal(buf, "hello", 5);
}

static void test_early_muxer(void **state)
{
    (void)state;
    const char *const both_native[] = {MUX2, YAMUX};
    const char *const both_yamux[] = {YAMUX, MUX2};
    const char *const y[] = {YAMUX};
    const char *const n[] = {MUX2};
    early(both_native, 2, both_yamux, 2, MUX2); /* the initiator's preference */
    early(both_yamux, 2, both_native, 2, YAMUX);
    early(y, 1, both_native, 2, YAMUX);
    early(both_native, 2, y, 1, YAMUX);
    early(n, 1, y, 1, NULL);  /* no overlap: the handshake fails */
    early(NULL, 0, y, 1, ""); /* one side without a list: fall back */
    early(y, 1, NULL, 0, "");
}

/* A payload whose identity key is PublicKey{type, data[0..len)}. */
static size_t forged(int type, size_t len, uint8_t *out, size_t cap)
{
    uint8_t data[600], key[700], sig[64];
    randombytes_buf(data, sizeof data);
    randombytes_buf(sig, sizeof sig);
    Libp2p__PublicKey k = LIBP2P__PUBLIC_KEY__INIT;
    k.type = (Libp2p__KeyType)type;
    k.data.data = data;
    k.data.len = len;
    size_t kl = libp2p__public_key__pack(&k, key);
    Apiary__NoiseHandshakePayload p = APIARY__NOISE_HANDSHAKE_PAYLOAD__INIT;
    p.has_identity_key = 1;
    p.identity_key.data = key;
    p.identity_key.len = kl;
    p.has_identity_sig = 1;
    p.identity_sig.data = sig;
    p.identity_sig.len = sizeof sig;
    assert_true(apiary__noise_handshake_payload__get_packed_size(&p) <= cap);
    return apiary__noise_handshake_payload__pack(&p, out);
}

static void test_key_types(void **state)
{
    (void)state;
    uint8_t rs[32], buf[AP_SECURE_PAYLOAD_MAX];
    randombytes_buf(rs, sizeof rs);
    ap_secure_remote_t info;
    struct {
        int type;
        size_t len;
        const char *name;
    } cases[] = {{AP_KEY_RSA, 294, "RSA"},
                 {AP_KEY_SECP256K1, 33, "Secp256k1"},
                 {AP_KEY_ECDSA, 91, "ECDSA"},
                 {7, 32, "unknown"}};
    for (size_t i = 0; i < 4; i++) {
        size_t n = forged(cases[i].type, cases[i].len, buf, sizeof buf);
        assert_int_equal(ap__secure_check_payload_ex(buf, n, rs, NULL, 0, true, &info), AP_ENOTSUP);
        assert_int_equal(info.key_type, cases[i].type);
        assert_string_equal(ap__secure_key_type_name(info.key_type), cases[i].name);
    }
    assert_string_equal(ap__secure_key_type_name(AP_KEY_ED25519), "Ed25519");
    /* an Ed25519 key of the wrong size is corrupt, not another type */
    size_t n = forged(AP_KEY_ED25519, 31, buf, sizeof buf);
    assert_int_equal(ap__secure_check_payload_ex(buf, n, rs, NULL, 0, true, &info), AP_ECORRUPT);
    /* a key that is no PublicKey at all */
    n = forged(AP_KEY_ED25519, 32, buf, sizeof buf);
    buf[2] = 0xff; /* the PublicKey's first tag */
    assert_int_equal(ap__secure_check_payload_ex(buf, n, rs, NULL, 0, true, &info), AP_ECORRUPT);
    assert_int_equal(info.key_type, -1);
    /* a key type beyond int32 (truncated to a negative enum by the decoder):
     * corrupt, not "another type" (found by fuzz_p2p_noise_payload) */
    static const uint8_t huge[] = {0x0a, 0x0e, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff,
                                   0xff, 0xff, 0xff, 0x00, 0x12, 0x02, 0x41, 0x42};
    assert_int_equal(ap__secure_check_payload_ex(huge, sizeof huge, rs, NULL, 0, true, &info),
                     AP_ECORRUPT);

    /* in a handshake: the responder presents an RSA key */
    const char *const y[] = {YAMUX};
    ap_secure_creds_t ci, cr;
    creds(&ci, 1, AP_NOISE_SHA256, y, 1);
    creds(&cr, 2, AP_NOISE_SHA256, y, 1);
    cr.payload_len = forged(AP_KEY_RSA, 294, cr.payload, sizeof cr.payload);
    ap_secure_hs_t a, b;
    assert_ok(ap__secure_init(&a, &ci, true, NULL, NULL));
    assert_ok(ap__secure_init(&b, &cr, false, NULL, NULL));
    int side = -1;
    assert_int_equal(run(&a, &b, &side), AP_ENOTSUP);
    assert_int_equal(side, 0);
    assert_int_equal(a.info.key_type, AP_KEY_RSA);
    assert_null(ap__secure_remote(&a));
}

static void test_expected_peer_and_dialects(void **state)
{
    (void)state;
    const char *const y[] = {YAMUX};
    ap_secure_creds_t ci, cr, cx, cb;
    creds(&ci, 1, AP_NOISE_SHA256, y, 1);
    creds(&cr, 2, AP_NOISE_SHA256, y, 1);
    creds(&cx, 3, AP_NOISE_SHA256, y, 1);
    ap_secure_hs_t a, b;
    int side = -1;
    /* the dialer expected cx but reached cr: refused, and it knows who it was */
    assert_ok(ap__secure_init(&a, &ci, true, &cx.id.id, NULL));
    assert_ok(ap__secure_init(&b, &cr, false, NULL, NULL));
    assert_int_equal(run(&a, &b, &side), AP_EAUTH);
    assert_int_equal(side, 0);
    assert_true(ap_peer_id_eq(ap__secure_remote(&a), &cr.id.id));
    assert_false(ap__secure_done(&a));
    /* SHA-256 against BLAKE2b: message 2 does not decrypt */
    creds(&cb, 2, AP_NOISE_BLAKE2B, y, 1);
    assert_ok(ap__secure_init(&a, &ci, true, NULL, NULL));
    assert_ok(ap__secure_init(&b, &cb, false, NULL, NULL));
    assert_int_equal(run(&a, &b, &side), AP_EAUTH);
    assert_int_equal(side, 0);
}

int main(void)
{
    if (sodium_init() < 0) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_payload_bytes),
        cmocka_unit_test(test_early_muxer),
        cmocka_unit_test(test_key_types),
        cmocka_unit_test(test_expected_peer_and_dialects),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
