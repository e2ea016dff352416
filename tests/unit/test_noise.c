/* Noise XX: every published vector in tests/data/noise/noise-xx*.json,
 * byte for byte, both hashes; the HMAC/HKDF building blocks against RFC
 * vectors; and the failure behaviour (altered, replayed, reordered, truncated
 * messages, nonce exhaustion) — each over both AEAD implementations. */
#include "aptest.h"

#include "net/aead.h"
#include "net/noise.h"
#include "net/secure.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a minimal JSON reader for the vector files ----------------------------
 * Values: objects, arrays, strings (escapes \" \\ \/ only), and bare
 * literals/numbers (kept as text). Enough for these files; fails loudly on
 * anything else. */
typedef struct jv {
    char type; /* 'o' object, 'a' array, 's' string, 'l' literal */
    char *str;
    struct jv **items; /* array items or object values */
    char **keys;       /* object keys */
    size_t n;
} jv_t;

static const char *ws(const char *p)
{
    while (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t') p++;
    return p;
}

static jv_t *jparse(const char **pp);

static char *jstring(const char **pp)
{
    const char *p = *pp;
    if (*p != '"') return NULL;
    p++;
    char *out = malloc(strlen(p) + 1), *o = out;
    while (*p && *p != '"') {
        if (*p == '\\') {
            p++;
            if (*p != '"' && *p != '\\' && *p != '/') {
                free(out);
                return NULL;
            }
        }
        *o++ = *p++;
    }
    if (*p != '"') {
        free(out);
        return NULL;
    }
    *o = 0;
    *pp = p + 1;
    return out;
}

static void jpush(jv_t *v, char *key, jv_t *item)
{
    v->items = realloc(v->items, (v->n + 1) * sizeof *v->items);
    v->keys = realloc(v->keys, (v->n + 1) * sizeof *v->keys);
    v->items[v->n] = item;
    v->keys[v->n] = key;
    v->n++;
}

static jv_t *jparse(const char **pp)
{
    const char *p = ws(*pp);
    jv_t *v = calloc(1, sizeof *v);
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        v->type = *p == '{' ? 'o' : 'a';
        p = ws(p + 1);
        while (*p != close) {
            char *key = NULL;
            if (v->type == 'o') {
                key = jstring(&p);
                assert_non_null(key);
                p = ws(p);
                assert_int_equal(*p, ':');
                p++;
            }
            jv_t *item = jparse(&p);
            jpush(v, key, item);
            p = ws(p);
            if (*p == ',')
                p = ws(p + 1);
            else
                assert_int_equal(*p, close);
        }
        p++;
    } else if (*p == '"') {
        v->type = 's';
        v->str = jstring(&p);
        assert_non_null(v->str);
    } else {
        const char *s = p;
        while (*p && !strchr(",]} \n\r\t", *p)) p++;
        assert_true(p > s);
        v->type = 'l';
        v->str = strndup(s, (size_t)(p - s));
    }
    *pp = p;
    return v;
}

static void jfree(jv_t *v)
{
    if (!v) return;
    for (size_t i = 0; i < v->n; i++) {
        jfree(v->items[i]);
        free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    free(v);
}

static jv_t *jget(const jv_t *o, const char *key)
{
    if (o->type != 'o') return NULL;
    for (size_t i = 0; i < o->n; i++)
        if (strcmp(o->keys[i], key) == 0) return o->items[i];
    return NULL;
}

/* hex field -> malloc'd bytes */
static uint8_t *jhex(const jv_t *o, const char *key, size_t *len)
{
    jv_t *v = jget(o, key);
    if (!v || v->type != 's') fail_msg("missing hex field %s", key);
    size_t n = strlen(v->str) / 2;
    uint8_t *b = malloc(n + 1);
    size_t bl = 0;
    if (sodium_hex2bin(b, n + 1, v->str, strlen(v->str), NULL, &bl, NULL) != 0 || bl != n)
        fail_msg("bad hex in %s", key);
    *len = n;
    return b;
}

/* ---- the vectors ------------------------------------------------------------ */

static int vectors_run;

static void run_vector(const jv_t *vec, const char *file)
{
    jv_t *name = jget(vec, "protocol_name");
    if (!name) name = jget(vec, "name");
    assert_non_null(name);
    ap_noise_hash_t hash = AP_NOISE_BLAKE2B;
    if (strcmp(name->str, "Noise_XX_25519_ChaChaPoly_BLAKE2b") == 0)
        hash = AP_NOISE_BLAKE2B;
    else if (strcmp(name->str, "Noise_XX_25519_ChaChaPoly_SHA256") == 0)
        hash = AP_NOISE_SHA256;
    else
        fail_msg("%s: unexpected protocol %s", file, name->str);
    jv_t *psks = jget(vec, "init_psks");
    assert_true(!psks || psks->n == 0);

    size_t ipl, rpl, n;
    uint8_t *ipro = jhex(vec, "init_prologue", &ipl);
    uint8_t *rpro = jhex(vec, "resp_prologue", &rpl);
    uint8_t *is = jhex(vec, "init_static", &n);
    assert_int_equal(n, 32);
    uint8_t *ie = jhex(vec, "init_ephemeral", &n);
    assert_int_equal(n, 32);
    uint8_t *rs = jhex(vec, "resp_static", &n);
    assert_int_equal(n, 32);
    uint8_t *re = jhex(vec, "resp_ephemeral", &n);
    assert_int_equal(n, 32);

    ap_noise_hs_t ini, res;
    assert_ok(ap__noise_hs_init(&ini, hash, true, ipro, ipl, is, ie));
    assert_ok(ap__noise_hs_init(&res, hash, false, rpro, rpl, rs, re));
    ap_noise_cs_t isend, irecv, rsend, rrecv;

    jv_t *msgs = jget(vec, "messages");
    assert_non_null(msgs);
    assert_true(msgs->n >= 5);
    static uint8_t out[AP_NOISE_MSG_MAX], got[AP_NOISE_MSG_MAX];
    for (size_t i = 0; i < msgs->n; i++) {
        size_t pl, cl, ol, gl;
        uint8_t *payload = jhex(msgs->items[i], "payload", &pl);
        uint8_t *ct = jhex(msgs->items[i], "ciphertext", &cl);
        bool from_init = i % 2 == 0;
        if (i < 3) {
            ap_noise_hs_t *w = from_init ? &ini : &res, *r = from_init ? &res : &ini;
            assert_true(ap__noise_hs_my_turn(w));
            assert_false(ap__noise_hs_my_turn(r));
            assert_int_equal(ap__noise_hs_write_len(w, pl), cl);
            assert_ok(ap__noise_hs_write(w, payload, pl, out, sizeof out, &ol));
            assert_ok(ap__noise_hs_read(r, ct, cl, got, sizeof got, &gl));
            if (i == 2) {
                assert_true(ap__noise_hs_done(&ini) && ap__noise_hs_done(&res));
                jv_t *hh = jget(vec, "handshake_hash");
                if (hh) {
                    size_t hl, l1, l2;
                    uint8_t *want = jhex(vec, "handshake_hash", &hl);
                    assert_memory_equal(ap__noise_hs_hash(&ini, &l1), want, hl);
                    assert_memory_equal(ap__noise_hs_hash(&res, &l2), want, hl);
                    assert_int_equal(l1, hl);
                    assert_int_equal(l2, hl);
                    free(want);
                }
                uint8_t pub[32];
                crypto_scalarmult_base(pub, rs);
                assert_memory_equal(ap__noise_hs_remote_static(&ini), pub, 32);
                crypto_scalarmult_base(pub, is);
                assert_memory_equal(ap__noise_hs_remote_static(&res), pub, 32);
                assert_ok(ap__noise_hs_split(&ini, &isend, &irecv));
                assert_ok(ap__noise_hs_split(&res, &rsend, &rrecv));
            }
        } else {
            ap_noise_cs_t *w = from_init ? &isend : &rsend, *r = from_init ? &rrecv : &irecv;
            assert_ok(ap__noise_cs_encrypt(w, NULL, 0, payload, pl, out));
            ol = pl + AP_NOISE_TAGLEN;
            assert_ok(ap__noise_cs_decrypt(r, NULL, 0, ct, cl, got));
            gl = cl - AP_NOISE_TAGLEN;
        }
        if (ol != cl || memcmp(out, ct, cl) != 0)
            fail_msg("%s %s message %zu: ciphertext differs", file, name->str, i);
        assert_int_equal(gl, pl);
        assert_memory_equal(got, payload, pl);
        free(payload);
        free(ct);
    }
    ap__noise_hs_clear(&ini);
    ap__noise_hs_clear(&res);
    free(ipro);
    free(rpro);
    free(is);
    free(ie);
    free(rs);
    free(re);
    vectors_run++;
}

static void run_file(const char *rel)
{
    const char *path = ap_test_data_path(rel);
    char *text = ap_test_read_file(path, NULL);
    if (!text) fail_msg("cannot read %s (set APIARY_TEST_DATA)", path);
    const char *p = text;
    jv_t *root = jparse(&p);
    jv_t *vecs = jget(root, "vectors");
    assert_non_null(vecs);
    assert_true(vecs->n >= 2);
    int hashes = 0;
    for (size_t i = 0; i < vecs->n; i++) {
        run_vector(vecs->items[i], rel);
        jv_t *nm = jget(vecs->items[i], "protocol_name");
        if (!nm) nm = jget(vecs->items[i], "name");
        hashes |= strstr(nm->str, "BLAKE2b") ? 1 : 2;
    }
    assert_int_equal(hashes, 3); /* both suites present in every file */
    jfree(root);
    free(text);
}

static void test_vectors_cacophony(void **state)
{
    (void)state;
    run_file("noise/noise-xx.json");
}
static void test_vectors_noise_c(void **state)
{
    (void)state;
    run_file("noise/noise-xx-noise-c.json");
}
static void test_vectors_snow(void **state)
{
    (void)state;
    run_file("noise/noise-xx-snow.json");
    assert_int_equal(vectors_run, 6);
}

/* ---- building blocks: RFC 4231 HMAC-SHA256 and RFC 5869 HKDF ------------- */

static void test_hmac_hkdf_rfc(void **state)
{
    (void)state;
    /* RFC 4231 test case 2 */
    uint8_t out[64], want[64];
    ap__noise_hmac(AP_NOISE_SHA256, (const uint8_t *)"Jefe", 4,
                   (const uint8_t *)"what do ya want for nothing?", 28, out);
    sodium_hex2bin(want, 32, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", 64,
                   NULL, NULL, NULL);
    assert_memory_equal(out, want, 32);
    /* RFC 4231 test case 6: key longer than the block is hashed first */
    uint8_t key[131];
    memset(key, 0xaa, sizeof key);
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    ap__noise_hmac(AP_NOISE_SHA256, key, sizeof key, (const uint8_t *)m6, strlen(m6), out);
    sodium_hex2bin(want, 32, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", 64,
                   NULL, NULL, NULL);
    assert_memory_equal(out, want, 32);
    /* BLAKE2b HMAC against a direct construction with libsodium's hash */
    uint8_t k0[128] = {0}, ipad[128 + 5], opad[128 + 64], inner[64];
    memcpy(k0, "Jefe", 4);
    for (int i = 0; i < 128; i++) {
        ipad[i] = k0[i] ^ 0x36;
        opad[i] = k0[i] ^ 0x5c;
    }
    memcpy(ipad + 128, "hello", 5);
    crypto_generichash_blake2b(inner, 64, ipad, sizeof ipad, NULL, 0);
    memcpy(opad + 128, inner, 64);
    crypto_generichash_blake2b(want, 64, opad, sizeof opad, NULL, 0);
    ap__noise_hmac(AP_NOISE_BLAKE2B, (const uint8_t *)"Jefe", 4, (const uint8_t *)"hello", 5, out);
    assert_memory_equal(out, want, 64);
    /* RFC 5869 test case 3 (salt = empty -> HashLen zeros; info empty): the
     * Noise HKDF is HKDF-Expand with info = "" over PRK = HMAC(ck, ikm) */
    uint8_t ikm[22], ck[32] = {0}, o1[32], o2[32];
    memset(ikm, 0x0b, sizeof ikm);
    ap__noise_hkdf(AP_NOISE_SHA256, ck, ikm, sizeof ikm, o1, o2, NULL);
    uint8_t okm[64];
    sodium_hex2bin(
        okm, 42,
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a"
        "96c8",
        84, NULL, NULL, NULL);
    assert_memory_equal(o1, okm, 32);
    assert_memory_equal(o2, okm + 32, 10);
}

/* ---- failure behaviour -------------------------------------------------------- */

static void handshake(ap_noise_hash_t hash, ap_noise_cs_t *is, ap_noise_cs_t *ir, ap_noise_cs_t *rs,
                      ap_noise_cs_t *rr)
{
    uint8_t s1[32], s2[32], m[256], p[256];
    size_t ml, pl;
    randombytes_buf(s1, 32);
    randombytes_buf(s2, 32);
    ap_noise_hs_t a, b;
    assert_ok(ap__noise_hs_init(&a, hash, true, NULL, 0, s1, NULL));
    assert_ok(ap__noise_hs_init(&b, hash, false, NULL, 0, s2, NULL));
    for (int i = 0; i < 3; i++) {
        ap_noise_hs_t *w = i % 2 ? &b : &a, *r = i % 2 ? &a : &b;
        assert_ok(ap__noise_hs_write(w, (const uint8_t *)"hi", 2, m, sizeof m, &ml));
        assert_ok(ap__noise_hs_read(r, m, ml, p, sizeof p, &pl));
        assert_int_equal(pl, 2);
    }
    assert_ok(ap__noise_hs_split(&a, is, ir));
    assert_ok(ap__noise_hs_split(&b, rs, rr));
    ap__noise_hs_clear(&a);
    ap__noise_hs_clear(&b);
}

static void test_transport_failures(void **state)
{
    (void)state;
    ap_noise_cs_t is, ir, rs, rr;
    handshake(AP_NOISE_BLAKE2B, &is, &ir, &rs, &rr);
    uint8_t m1[64], m2[64], out[64];
    assert_ok(ap__noise_cs_encrypt(&is, NULL, 0, (const uint8_t *)"first", 5, m1));
    assert_ok(ap__noise_cs_encrypt(&is, NULL, 0, (const uint8_t *)"second", 6, m2));
    /* reordered: m2 before m1 fails, and does not advance the nonce */
    assert_int_equal(ap__noise_cs_decrypt(&rr, NULL, 0, m2, 6 + 16, out), AP_EAUTH);
    assert_int_equal(rr.n, 0);
    assert_ok(ap__noise_cs_decrypt(&rr, NULL, 0, m1, 5 + 16, out));
    assert_memory_equal(out, "first", 5);
    /* replayed m1 fails */
    assert_int_equal(ap__noise_cs_decrypt(&rr, NULL, 0, m1, 5 + 16, out), AP_EAUTH);
    /* altered m2: each bit of ciphertext and tag */
    for (size_t bit = 0; bit < (6 + 16) * 8; bit += 7) {
        uint8_t bad[64];
        memcpy(bad, m2, sizeof bad);
        bad[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        assert_int_equal(ap__noise_cs_decrypt(&rr, NULL, 0, bad, 6 + 16, out), AP_EAUTH);
    }
    /* truncated */
    assert_int_equal(ap__noise_cs_decrypt(&rr, NULL, 0, m2, 15, out), AP_ECORRUPT);
    assert_int_equal(ap__noise_cs_decrypt(&rr, NULL, 0, m2, 6 + 15, out), AP_EAUTH);
    /* the genuine m2 still opens: failures left the state intact */
    assert_ok(ap__noise_cs_decrypt(&rr, NULL, 0, m2, 6 + 16, out));
    assert_memory_equal(out, "second", 6);
    /* wrong direction's key */
    assert_ok(ap__noise_cs_encrypt(&is, NULL, 0, (const uint8_t *)"x", 1, m1));
    assert_int_equal(ap__noise_cs_decrypt(&ir, NULL, 0, m1, 17, out), AP_EAUTH);
    /* in-place seal and open */
    uint8_t buf[64] = "in place";
    assert_ok(ap__noise_cs_encrypt(&rs, NULL, 0, buf, 8, buf));
    assert_ok(ap__noise_cs_decrypt(&ir, NULL, 0, buf, 8 + 16, buf));
    assert_memory_equal(buf, "in place", 8);
    /* nonce exhaustion: 2^64-1 is reserved */
    is.n = UINT64_MAX - 1;
    rr.n = UINT64_MAX - 1;
    assert_ok(ap__noise_cs_encrypt(&is, NULL, 0, (const uint8_t *)"z", 1, m1));
    assert_ok(ap__noise_cs_decrypt(&rr, NULL, 0, m1, 17, out));
    assert_int_equal(ap__noise_cs_encrypt(&is, NULL, 0, (const uint8_t *)"z", 1, m1), AP_ELIMIT);
    assert_int_equal(ap__noise_cs_decrypt(&rr, NULL, 0, m1, 17, out), AP_ELIMIT);
}

static void test_handshake_failures(void **state)
{
    (void)state;
    uint8_t s1[32], s2[32], m0[256], m1[256], m2[256], p[256];
    size_t l0, l1, l2, pl;
    randombytes_buf(s1, 32);
    randombytes_buf(s2, 32);
    for (int hash = 0; hash < 2; hash++) {
        for (int victim = 0; victim < 3; victim++) {
            ap_noise_hs_t a, b;
            assert_ok(ap__noise_hs_init(&a, (ap_noise_hash_t)hash, true, (const uint8_t *)"p", 1,
                                        s1, NULL));
            assert_ok(ap__noise_hs_init(&b, (ap_noise_hash_t)hash, false, (const uint8_t *)"p", 1,
                                        s2, NULL));
            /* out of turn */
            assert_int_equal(ap__noise_hs_write(&b, NULL, 0, m1, sizeof m1, &l1), AP_ESTATE);
            assert_int_equal(ap__noise_hs_read(&a, m1, 32, p, sizeof p, &pl), AP_ESTATE);
            assert_ok(ap__noise_hs_write(&a, NULL, 0, m0, sizeof m0, &l0));
            if (victim == 0) {
                /* message 0 is plaintext: altering it is caught at message 1,
                 * when the hashes diverge */
                m0[3] ^= 1;
            }
            assert_ok(ap__noise_hs_read(&b, m0, l0, p, sizeof p, &pl));
            assert_ok(ap__noise_hs_write(&b, (const uint8_t *)"resp", 4, m1, sizeof m1, &l1));
            if (victim == 1) m1[l1 - 1] ^= 1;
            int rc = ap__noise_hs_read(&a, m1, l1, p, sizeof p, &pl);
            if (victim <= 1) {
                assert_int_equal(rc, AP_EAUTH);
                /* sticky */
                assert_int_equal(ap__noise_hs_write(&a, NULL, 0, m2, sizeof m2, &l2), AP_EAUTH);
                continue;
            }
            assert_ok(rc);
            assert_ok(ap__noise_hs_write(&a, (const uint8_t *)"init", 4, m2, sizeof m2, &l2));
            /* truncated third message */
            ap_noise_hs_t b2 = b;
            assert_int_equal(ap__noise_hs_read(&b2, m2, 47, p, sizeof p, &pl), AP_ECORRUPT);
            m2[5] ^= 1;
            assert_int_equal(ap__noise_hs_read(&b, m2, l2, p, sizeof p, &pl), AP_EAUTH);
            assert_false(ap__noise_hs_done(&b));
            ap_noise_cs_t x, y;
            assert_int_equal(ap__noise_hs_split(&b, &x, &y), AP_ESTATE);
        }
    }
    /* too-short first messages */
    ap_noise_hs_t b;
    assert_ok(ap__noise_hs_init(&b, AP_NOISE_BLAKE2B, false, NULL, 0, s2, NULL));
    assert_int_equal(ap__noise_hs_read(&b, m0, 31, p, sizeof p, &pl), AP_ECORRUPT);
    /* a low-order ephemeral (all zeros) is refused at the first DH */
    ap_noise_hs_t a;
    uint8_t zero[32] = {0};
    assert_ok(ap__noise_hs_init(&a, AP_NOISE_BLAKE2B, true, NULL, 0, s1, NULL));
    assert_ok(ap__noise_hs_init(&b, AP_NOISE_BLAKE2B, false, NULL, 0, s2, NULL));
    assert_ok(ap__noise_hs_read(&b, zero, 32, p, sizeof p, &pl));
    assert_int_equal(ap__noise_hs_write(&b, NULL, 0, m1, sizeof m1, &l1), AP_EAUTH);
    /* oversized payload */
    static uint8_t big[AP_NOISE_MSG_MAX + 1], bigout[AP_NOISE_MSG_MAX + 100];
    assert_ok(ap__noise_hs_init(&a, AP_NOISE_BLAKE2B, true, NULL, 0, s1, NULL));
    assert_int_equal(ap__noise_hs_write(&a, big, AP_NOISE_MSG_MAX - 31, bigout, sizeof bigout, &l0),
                     AP_EMSGSIZE);
    assert_ok(ap__noise_hs_write(&a, big, AP_NOISE_MSG_MAX - 32, bigout, sizeof bigout, &l0));
    assert_int_equal(l0, AP_NOISE_MSG_MAX);
}

/* ---- the identity payload (secure.h) ----------------------------------------- */

static void make_creds(ap_secure_creds_t *c, uint8_t seed_byte)
{
    uint8_t seed[32];
    memset(seed, seed_byte, sizeof seed);
    ap_identity_t id;
    assert_ok(ap_identity_from_seed(&id, seed));
    assert_ok(ap__secure_creds_init(c, &id, AP_NOISE_BLAKE2B, NULL));
}

/* Runs the 3 messages; returns the first error and which side saw it. */
static int run_secure(ap_secure_hs_t *a, ap_secure_hs_t *b, int *failed_side)
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

static void test_secure_handshake(void **state)
{
    (void)state;
    ap_secure_creds_t ca, cb, cc;
    make_creds(&ca, 1);
    make_creds(&cb, 2);
    make_creds(&cc, 3);
    ap_secure_hs_t a, b;
    int side = -1;
    /* expected PeerID matches */
    assert_ok(ap__secure_init(&a, &ca, true, &cb.id.id, NULL));
    assert_ok(ap__secure_init(&b, &cb, false, NULL, NULL));
    assert_ok(run_secure(&a, &b, &side));
    assert_true(ap__secure_done(&a) && ap__secure_done(&b));
    assert_true(ap_peer_id_eq(ap__secure_remote(&a), &cb.id.id));
    assert_true(ap_peer_id_eq(ap__secure_remote(&b), &ca.id.id));
    ap_noise_cs_t as, ar, bs, br;
    assert_ok(ap__secure_split(&a, &as, &ar));
    assert_ok(ap__secure_split(&b, &bs, &br));
    uint8_t buf[64] = "ping";
    assert_ok(ap__noise_cs_encrypt(&as, NULL, 0, buf, 4, buf));
    assert_ok(ap__noise_cs_decrypt(&br, NULL, 0, buf, 20, buf));
    assert_memory_equal(buf, "ping", 4);

    /* wrong expected PeerID: the initiator stops at message 2, before
     * revealing its own identity, and knows who answered instead */
    assert_ok(ap__secure_init(&a, &ca, true, &cc.id.id, NULL));
    assert_ok(ap__secure_init(&b, &cb, false, NULL, NULL));
    assert_int_equal(run_secure(&a, &b, &side), AP_EAUTH);
    assert_int_equal(side, 0);
    assert_true(ap_peer_id_eq(ap__secure_remote(&a), &cb.id.id));
    assert_false(ap__secure_done(&a));
    assert_false(ap__secure_done(&b));
    assert_int_equal(ap__secure_split(&a, &as, &ar), AP_ESTATE);

    /* a payload that signs a different static key (replayed from another
     * session): the signature check fails */
    ap_secure_creds_t forged = cb;
    assert_ok(ap__secure_make_payload(&cb.id, cc.s_pub, forged.payload, sizeof forged.payload,
                                      &forged.payload_len));
    assert_ok(ap__secure_init(&a, &ca, true, NULL, NULL));
    assert_ok(ap__secure_init(&b, &forged, false, NULL, NULL));
    assert_int_equal(run_secure(&a, &b, &side), AP_EAUTH);
    assert_int_equal(side, 0);
    assert_null(ap__secure_remote(&a));

    /* a payload with garbage instead of protobuf */
    forged = cb;
    memset(forged.payload, 0xff, 40);
    forged.payload_len = 40;
    assert_ok(ap__secure_init(&a, &ca, true, NULL, NULL));
    assert_ok(ap__secure_init(&b, &forged, false, NULL, NULL));
    assert_int_equal(run_secure(&a, &b, &side), AP_ECORRUPT);
    /* an empty payload in message 3 */
    forged = ca;
    forged.payload_len = 0;
    assert_ok(ap__secure_init(&a, &forged, true, NULL, NULL));
    assert_ok(ap__secure_init(&b, &cb, false, NULL, NULL));
    assert_int_equal(run_secure(&a, &b, &side), AP_ECORRUPT);
    assert_int_equal(side, 1);
    assert_int_equal(b.noise.step + 1, 3); /* the message that failed */
    /* a bad signature in message 3: logged as message 3 */
    forged = ca;
    assert_ok(ap__secure_make_payload(&ca.id, cc.s_pub, forged.payload, sizeof forged.payload,
                                      &forged.payload_len));
    assert_ok(ap__secure_init(&a, &forged, true, NULL, NULL));
    assert_ok(ap__secure_init(&b, &cb, false, NULL, NULL));
    assert_int_equal(run_secure(&a, &b, &side), AP_EAUTH);
    assert_int_equal(side, 1);
    assert_int_equal(b.noise.step + 1, 3);
    /* and one in message 2 as message 2 */
    forged = cb;
    assert_ok(ap__secure_make_payload(&cb.id, cc.s_pub, forged.payload, sizeof forged.payload,
                                      &forged.payload_len));
    assert_ok(ap__secure_init(&a, &ca, true, NULL, NULL));
    assert_ok(ap__secure_init(&b, &forged, false, NULL, NULL));
    assert_int_equal(run_secure(&a, &b, &side), AP_EAUTH);
    assert_int_equal(a.noise.step + 1, 2);
}

static void test_secure_payload_checks(void **state)
{
    (void)state;
    ap_secure_creds_t c;
    make_creds(&c, 9);
    ap_peer_id_t id;
    assert_ok(ap__secure_check_payload(c.payload, c.payload_len, c.s_pub, &id));
    assert_true(ap_peer_id_eq(&id, &c.id.id));
    /* every single-bit flip of the payload is refused (or, if it only
     * changes protobuf framing harmlessly, still yields the same id) */
    for (size_t bit = 0; bit < c.payload_len * 8; bit++) {
        uint8_t p[AP_SECURE_PAYLOAD_MAX];
        memcpy(p, c.payload, c.payload_len);
        p[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        ap_peer_id_t got;
        int rc = ap__secure_check_payload(p, c.payload_len, c.s_pub, &got);
        if (rc == 0)
            assert_true(ap_peer_id_eq(&got, &c.id.id));
        else
            assert_true(rc == AP_ECORRUPT || rc == AP_EAUTH || rc == AP_ENOTSUP);
    }
    /* truncations */
    for (size_t n = 0; n < c.payload_len; n++) {
        ap_peer_id_t got;
        assert_int_not_equal(ap__secure_check_payload(c.payload, n, c.s_pub, &got), 0);
    }
    uint8_t other[32];
    randombytes_buf(other, sizeof other);
    assert_int_equal(ap__secure_check_payload(c.payload, c.payload_len, other, &id), AP_EAUTH);
}

int main(void)
{
    if (sodium_init() < 0) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vectors_cacophony),  cmocka_unit_test(test_vectors_noise_c),
        cmocka_unit_test(test_vectors_snow),       cmocka_unit_test(test_hmac_hkdf_rfc),
        cmocka_unit_test(test_transport_failures), cmocka_unit_test(test_handshake_failures),
        cmocka_unit_test(test_secure_handshake),   cmocka_unit_test(test_secure_payload_checks),
    };
    /* Everything twice: over OpenSSL's AEAD (the default) and libsodium's. */
    int failed = cmocka_run_group_tests_name("noise/openssl", tests, NULL, NULL);
    if (!ap__aead_use_openssl(false)) return 1;
    vectors_run = 0;
    failed += cmocka_run_group_tests_name("noise/libsodium", tests, NULL, NULL);
    return failed;
}
