/* ChaCha20-Poly1305: the OpenSSL and libsodium implementations behind the
 * Noise CipherState agree byte for byte (RFC 8439's vector, random messages
 * of many lengths, with and without associated data, in place and not),
 * reject any altered byte and leave no plaintext behind, and work from
 * several threads at once (each with its own context, freed at thread exit). */
#include "aptest.h"

#include "apiary/error.h"
#include "base/codec.h"
#include "net/aead.h"

#include <pthread.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

static void hex(const char *h, uint8_t *out, size_t n)
{
    assert_int_equal(ap__hex_decode(out, n, h), (int)n);
}

/* RFC 8439 section 2.8.2. */
static void test_rfc8439_vector(void **state)
{
    (void)state;
    uint8_t key[32], nonce[12], ad[12], tag[16];
    hex("808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f", key, 32);
    hex("070000004041424344454647", nonce, 12);
    hex("50515253c0c1c2c3c4c5c6c7", ad, 12);
    hex("1ae10b594f09e26a7e902ecbd0600691", tag, 16);
    const char *msg = "Ladies and Gentlemen of the class of '99: If I could offer you only one "
                      "tip for the future, sunscreen would be it.";
    size_t len = strlen(msg);
    assert_int_equal(len, 114);
    for (int impl = 0; impl < 2; impl++) {
        assert_true(ap__aead_use_openssl(impl == 0));
        uint8_t out[114 + 16], back[114];
        assert_ok(ap__aead_seal(key, nonce, ad, sizeof ad, (const uint8_t *)msg, len, out));
        assert_memory_equal(out + len, tag, 16);
        uint8_t c0[4] = {0xd3, 0x1a, 0x8d, 0x34};
        assert_memory_equal(out, c0, 4);
        assert_ok(ap__aead_open(key, nonce, ad, sizeof ad, out, len, out + len, back));
        assert_memory_equal(back, msg, len);
    }
    assert_true(ap__aead_use_openssl(true));
}

static void cross_check(size_t len, size_t adlen, bool in_place)
{
    uint8_t key[32], nonce[12];
    randombytes_buf(key, sizeof key);
    randombytes_buf(nonce, sizeof nonce);
    uint8_t *ad = malloc(adlen + 1), *plain = malloc(len + 1);
    uint8_t *a = malloc(len + 16), *b = malloc(len + 16), *back = malloc(len + 1);
    assert_non_null(ad);
    assert_non_null(plain);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(back);
    randombytes_buf(ad, adlen);
    randombytes_buf(plain, len);
    /* a: OpenSSL, b: libsodium (optionally both in place). */
    assert_true(ap__aead_use_openssl(true));
    if (in_place) memcpy(a, plain, len);
    assert_ok(ap__aead_seal(key, nonce, ad, adlen, in_place ? a : plain, len, a));
    assert_true(ap__aead_use_openssl(false));
    if (in_place) memcpy(b, plain, len);
    assert_ok(ap__aead_seal(key, nonce, ad, adlen, in_place ? b : plain, len, b));
    assert_memory_equal(a, b, len + 16);
    /* Each opens what the other sealed. */
    assert_ok(ap__aead_open(key, nonce, ad, adlen, a, len, a + len, back));
    assert_memory_equal(back, plain, len);
    assert_true(ap__aead_use_openssl(true));
    if (in_place) {
        assert_ok(ap__aead_open(key, nonce, ad, adlen, b, len, b + len, b));
        assert_memory_equal(b, plain, len);
    } else {
        assert_ok(ap__aead_open(key, nonce, ad, adlen, b, len, b + len, back));
        assert_memory_equal(back, plain, len);
    }
    free(ad);
    free(plain);
    free(a);
    free(b);
    free(back);
}

static void test_implementations_agree(void **state)
{
    (void)state;
    static const size_t lens[] = {0,   1,   15,   16,   17,    63,    64,    65,
                                  255, 256, 1000, 4096, 16384, 65519, 65535, 200000};
    static const size_t adlens[] = {0, 1, 32, 64, 77};
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++)
        for (size_t j = 0; j < sizeof adlens / sizeof *adlens; j++) {
            cross_check(lens[i], adlens[j], false);
            cross_check(lens[i], adlens[j], true);
        }
    assert_true(ap__aead_use_openssl(true));
}

/* Any altered byte of the ciphertext, the tag, the AD, the nonce or the key
 * fails with AP_EAUTH, and the output holds no plaintext. */
static void test_tamper(void **state)
{
    (void)state;
    for (int impl = 0; impl < 2; impl++) {
        assert_true(ap__aead_use_openssl(impl == 0));
        uint8_t key[32], nonce[12], ad[20], plain[300], sealed[316], out[300];
        randombytes_buf(key, sizeof key);
        randombytes_buf(nonce, sizeof nonce);
        randombytes_buf(ad, sizeof ad);
        memset(plain, 0x5a, sizeof plain);
        assert_ok(ap__aead_seal(key, nonce, ad, sizeof ad, plain, sizeof plain, sealed));
        for (size_t i = 0; i < sizeof sealed; i += 7) {
            sealed[i] ^= 0x10;
            memset(out, 0x5a, sizeof out);
            assert_int_equal(
                ap__aead_open(key, nonce, ad, sizeof ad, sealed, 300, sealed + 300, out), AP_EAUTH);
            for (size_t k = 0; k < sizeof out; k++)
                if (out[k] == 0x5a && impl == 0) fail_msg("plaintext left at %zu", k);
            sealed[i] ^= 0x10;
        }
        ad[3] ^= 1;
        assert_int_equal(ap__aead_open(key, nonce, ad, sizeof ad, sealed, 300, sealed + 300, out),
                         AP_EAUTH);
        ad[3] ^= 1;
        nonce[11] ^= 1;
        assert_int_equal(ap__aead_open(key, nonce, ad, sizeof ad, sealed, 300, sealed + 300, out),
                         AP_EAUTH);
        nonce[11] ^= 1;
        key[0] ^= 1;
        assert_int_equal(ap__aead_open(key, nonce, ad, sizeof ad, sealed, 300, sealed + 300, out),
                         AP_EAUTH);
        key[0] ^= 1;
        assert_ok(ap__aead_open(key, nonce, ad, sizeof ad, sealed, 300, sealed + 300, out));
        assert_memory_equal(out, plain, sizeof plain);
        /* Too long for one call: refused before anything is touched. */
        assert_int_equal(ap__aead_seal(key, nonce, NULL, 0, plain, AP_AEAD_PLAIN_MAX + 1, sealed),
                         AP_EMSGSIZE);
    }
    assert_true(ap__aead_use_openssl(true));
}

/* Threads seal and open at once, each with its own context; their results
 * match libsodium's computed beforehand. The contexts are freed when the
 * threads end (LeakSanitizer would report them otherwise). */
typedef struct {
    uint8_t key[32], nonce[12];
    uint8_t plain[5000], expect[5016];
    int ok;
} job_t;

static void *worker(void *arg)
{
    job_t *j = arg;
    uint8_t out[5016], back[5000];
    j->ok = 1;
    for (int r = 0; r < 200; r++) {
        if (ap__aead_seal(j->key, j->nonce, NULL, 0, j->plain, sizeof j->plain, out) != 0 ||
            memcmp(out, j->expect, sizeof out) != 0 ||
            ap__aead_open(j->key, j->nonce, NULL, 0, out, 5000, out + 5000, back) != 0 ||
            memcmp(back, j->plain, sizeof back) != 0)
            j->ok = 0;
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    enum { T = 4 };
    static job_t jobs[T];
    for (int i = 0; i < T; i++) {
        randombytes_buf(jobs[i].key, 32);
        randombytes_buf(jobs[i].nonce, 12);
        randombytes_buf(jobs[i].plain, sizeof jobs[i].plain);
        crypto_aead_chacha20poly1305_ietf_encrypt_detached(jobs[i].expect, jobs[i].expect + 5000,
                                                           NULL, jobs[i].plain, 5000, NULL, 0, NULL,
                                                           jobs[i].nonce, jobs[i].key);
    }
    assert_true(ap__aead_use_openssl(true));
    assert_string_equal(ap__aead_impl(), "openssl");
    pthread_t th[T];
    for (int i = 0; i < T; i++) assert_int_equal(pthread_create(&th[i], NULL, worker, &jobs[i]), 0);
    for (int i = 0; i < T; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(jobs[i].ok, 1);
    }
}

/* Each thread binds a context to the keys it used last: messages under more
 * keys than it keeps, interleaved in both directions, with nonces changing and
 * forged messages in between, give libsodium's bytes each time, and a forged
 * message never spoils the next genuine one under its key. */
static void test_bound_keys(void **state)
{
    (void)state;
    enum { K = 7, LEN = 200 };
    uint8_t keys[K][32], plain[LEN], ad[13];
    randombytes_buf(keys, sizeof keys);
    randombytes_buf(plain, sizeof plain);
    randombytes_buf(ad, sizeof ad);
    assert_true(ap__aead_use_openssl(true));
    for (int r = 0; r < 300; r++) {
        /* key order: cycles through all K, then dwells on few (r % 3) */
        int k = (r < 150) ? r % K : (r * 5 + r / 7) % 3;
        uint8_t nonce[12] = {0};
        nonce[4] = (uint8_t)r;
        nonce[5] = (uint8_t)(r >> 8);
        size_t len = (size_t)(r * 37) % LEN;
        uint8_t expect[LEN + 16], got[LEN + 16], back[LEN];
        crypto_aead_chacha20poly1305_ietf_encrypt_detached(expect, expect + len, NULL, plain, len,
                                                           ad, sizeof ad, NULL, nonce, keys[k]);
        assert_ok(ap__aead_seal(keys[k], nonce, ad, sizeof ad, plain, len, got));
        assert_memory_equal(got, expect, len + 16);
        if (r % 4 == 1) { /* a forgery under the same key first */
            uint8_t bad[LEN + 16];
            memcpy(bad, got, len + 16);
            bad[(size_t)r % (len + 16)] ^= 0x20;
            assert_int_equal(
                ap__aead_open(keys[k], nonce, ad, sizeof ad, bad, len, bad + len, back), AP_EAUTH);
        }
        assert_ok(ap__aead_open(keys[k], nonce, ad, sizeof ad, got, len, got + len, back));
        assert_memory_equal(back, plain, len);
        /* the same nonce under the next key opens nothing sealed under this one */
        int other = (k + 1) % K;
        assert_int_equal(
            ap__aead_open(keys[other], nonce, ad, sizeof ad, got, len, got + len, back), AP_EAUTH);
    }
}

int main(void)
{
    if (sodium_init() < 0) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rfc8439_vector), cmocka_unit_test(test_implementations_agree),
        cmocka_unit_test(test_tamper),         cmocka_unit_test(test_threads),
        cmocka_unit_test(test_bound_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
