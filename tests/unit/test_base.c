#include "aptest.h"

#include "apiary/log.h"
#include "apiary/peer.h"
#include "base/arena.h"
#include "base/buf.h"
#include "base/codec.h"
#include "base/pool.h"
#include "base/u64map.h"
#include "base/varint.h"

#include <sodium.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static void test_errors(void **state)
{
    (void)state;
    assert_string_equal(ap_err_name(AP_ETIMEDOUT), "ETIMEDOUT");
    assert_string_equal(ap_strerror(AP_ETIMEDOUT), "deadline exceeded");
    assert_string_equal(ap_err_name(0), "OK");
    assert_string_equal(ap_err_name(-9999), "UNKNOWN");
    assert_string_equal(ap_strerror(12345), "unknown error");
    /* every code has a distinct name and a message */
#define CHECK(name, num, msg)                                                                      \
    assert_int_equal(AP_##name, -(num));                                                           \
    assert_string_equal(ap_err_name(AP_##name), #name);                                            \
    assert_string_equal(ap_strerror(AP_##name), msg);
    AP_ERRNO_MAP(CHECK)
#undef CHECK
    assert_int_equal(ap_err_from_errno(-110), AP_ETIMEDOUT); /* ETIMEDOUT on Linux */
    assert_int_equal(ap_err_from_errno(-111), AP_EUNREACH);  /* ECONNREFUSED */
}

static char last_msg[256];
static int sink_calls;
static void sink(void *arg, ap_log_level_t lvl, const char *mod, const char *msg)
{
    (void)arg;
    (void)lvl;
    snprintf(last_msg, sizeof last_msg, "%s:%s", mod, msg);
    sink_calls++;
}

static void test_log(void **state)
{
    (void)state;
    ap_log_level_t l;
    assert_int_equal(ap_log_parse_level("debug", &l), 0);
    assert_int_equal(l, AP_LOG_DEBUG);
    assert_int_equal(ap_log_parse_level("bogus", &l), AP_EINVAL);
    ap_log_set_sink(sink, NULL);
    ap_log_set_level(AP_LOG_WARN);
    ap_info("test", "hidden %d", 1);
    assert_int_equal(sink_calls, 0);
    ap_warn("test", "shown %d\nnext", 2);
    assert_int_equal(sink_calls, 1);
    assert_string_equal(last_msg, "test:shown 2?next"); /* control chars neutralised */
    ap_log_set_sink(NULL, NULL);
}

static void test_log_limited(void **state)
{
    (void)state;
    ap_log_set_sink(sink, NULL);
    ap_log_set_level(AP_LOG_WARN);
    /* a window no test run can outlast: 3 lines pass, the rest are counted */
    static ap_log_limit_t lim = {.burst = 3, .window_ms = 3600 * 1000};
    sink_calls = 0;
    for (int i = 0; i < 1000; i++) ap_log_limited(&lim, AP_LOG_WARN, "net", "bad input %d", i);
    assert_int_equal(sink_calls, 3);
    assert_string_equal(last_msg, "net:bad input 2");
    assert_int_equal(lim.suppressed, 997);
    /* the next window's first line carries the count */
    lim.window_start_ms -= 3600 * 1000;
    ap_log_limited(&lim, AP_LOG_WARN, "net", "bad input %d", 1000);
    assert_int_equal(sink_calls, 4);
    assert_string_equal(last_msg, "net:bad input 1000 (+997 similar lines suppressed)");
    assert_int_equal(lim.suppressed, 0);
    /* below the level: neither shown nor counted */
    ap_log_limited(&lim, AP_LOG_INFO, "net", "quiet");
    assert_int_equal(sink_calls, 4);
    ap_log_set_sink(NULL, NULL);
}

static void test_buf_reader(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    for (int i = 0; i < 1000; i++) assert_ok(ap__buf_append_be32(&b, (uint32_t)i));
    assert_ok(ap__buf_append_uvarint(&b, 300));
    assert_int_equal(b.len, 4002);
    ap_reader_t r;
    ap__reader_init(&r, b.data, b.len);
    for (int i = 0; i < 1000; i++) assert_int_equal(ap__read_be32(&r), (uint32_t)i);
    assert_int_equal(ap__read_uvarint(&r), 300);
    assert_int_equal(r.err, 0);
    assert_int_equal(ap__read_u8(&r), 0);
    assert_int_equal(r.err, AP_ECORRUPT);
    assert_null(ap__read_bytes(&r, 0)); /* sticky error */
    ap__buf_consume(&b, 4000);
    assert_int_equal(b.len, 2);
    ap__buf_free(&b);
}

static void test_varint(void **state)
{
    (void)state;
    uint8_t out[AP_UVARINT_MAX];
    uint64_t vals[] = {0, 1, 127, 128, 300, 16384, UINT32_MAX, UINT64_MAX};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        size_t n = ap__uvarint_put(out, vals[i]);
        assert_int_equal(n, ap__uvarint_len(vals[i]));
        uint64_t v;
        assert_int_equal(ap__uvarint_get(out, n, &v), (int)n);
        assert_true(v == vals[i]);
        if (n > 1) assert_int_equal(ap__uvarint_get(out, n - 1, &v), AP_ECORRUPT);
    }
    uint8_t overlong[11];
    memset(overlong, 0xff, sizeof overlong);
    uint64_t v;
    assert_int_equal(ap__uvarint_get(overlong, sizeof overlong, &v), AP_ECORRUPT);
    uint8_t nonmin[2] = {0x80, 0x00};
    assert_int_equal(ap__uvarint_get(nonmin, 2, &v), AP_ECORRUPT);
    uint8_t over64[10] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02};
    assert_int_equal(ap__uvarint_get(over64, 10, &v), AP_ECORRUPT);
}

static void test_hex_base58(void **state)
{
    (void)state;
    char s[64];
    uint8_t in[] = {0x00, 0x01, 0xab, 0xff};
    assert_string_equal(ap__hex_encode(s, in, 4), "0001abff");
    uint8_t out[8];
    assert_int_equal(ap__hex_decode(out, sizeof out, "0001ABff"), 4);
    assert_memory_equal(out, in, 4);
    assert_int_equal(ap__hex_decode(out, sizeof out, "abc"), AP_EINVAL);
    assert_int_equal(ap__hex_decode(out, sizeof out, "zz"), AP_EINVAL);
    assert_int_equal(ap__hex_decode(out, 1, "0001"), AP_ERANGE);
    /* Known base58btc vectors (draft-msporny-base58). */
    assert_int_equal(ap__base58_encode(s, sizeof s, (const uint8_t *)"Hello World!", 12), 17);
    assert_string_equal(s, "2NEpo7TZRRrLZSi2U");
    uint8_t z[] = {0, 0, 0x28, 0x7f, 0xb4, 0xcd};
    ap__base58_encode(s, sizeof s, z, sizeof z);
    assert_string_equal(s, "11233QC4");
    uint8_t back[16];
    assert_int_equal(ap__base58_decode(back, sizeof back, "11233QC4"), 6);
    assert_memory_equal(back, z, 6);
    assert_int_equal(ap__base58_decode(back, sizeof back, "0OIl"), AP_EINVAL);
    assert_int_equal(ap__base58_encode(s, 4, z, sizeof z), AP_ERANGE);
    /* random round trips */
    for (int i = 0; i < 200; i++) {
        uint8_t r[40];
        size_t n = (size_t)(i % 40);
        for (size_t j = 0; j < n; j++) r[j] = (uint8_t)((i * 31 + j * 7) & (j % 3 ? 0xff : 0));
        char t[80];
        assert_true(ap__base58_encode(t, sizeof t, r, n) >= 0);
        uint8_t d[40];
        assert_int_equal(ap__base58_decode(d, sizeof d, t), (int)n);
        assert_memory_equal(d, r, n);
    }
}

static void test_peer_id(void **state)
{
    (void)state;
    assert_true(sodium_init() >= 0);
    uint8_t pk[32], sk[64], seed[32] = {1};
    crypto_sign_seed_keypair(pk, sk, seed);
    ap_peer_id_t id, id2;
    ap_peer_id_from_ed25519(&id, pk);
    char s[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(&id, s);
    assert_int_equal(strncmp(s, "12D3KooW", 8), 0);
    assert_int_equal(strlen(s), 52);
    assert_ok(ap_peer_id_parse(&id2, s));
    assert_true(ap_peer_id_eq(&id, &id2));
    uint8_t pk2[32];
    assert_ok(ap_peer_id_pubkey(&id2, pk2));
    assert_memory_equal(pk, pk2, 32);
    assert_int_equal(ap_peer_id_parse(&id2, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"),
                     AP_EINVAL); /* an RSA-style sha256 id is not an Ed25519 identity */
    assert_int_equal(ap_peer_id_parse(&id2, "12D3KooW!"), AP_EINVAL);
    uint8_t sig[64];
    crypto_sign_detached(sig, NULL, (const uint8_t *)"msg", 3, sk);
    assert_ok(ap_peer_verify(&id, (const uint8_t *)"msg", 3, sig));
    sig[0] ^= 1;
    assert_int_equal(ap_peer_verify(&id, (const uint8_t *)"msg", 3, sig), AP_EAUTH);
    char sh[AP_PEER_SHORT_LEN];
    ap_peer_id_short(&id, sh);
    assert_string_equal(sh, s + 44);
}

static void test_arena(void **state)
{
    (void)state;
    ap_arena_t a;
    ap__arena_init(&a);
    int v0 = ap__arena_add(&a, "w", 3);
    int v1 = ap__arena_add(&a, "b", 1000);
    assert_true(v0 == 0 && v1 == 1);
    assert_null(ap__arena_ptr(&a, v0));
    assert_ok(ap__arena_commit(&a));
    float *w = ap__arena_ptr(&a, v0), *b = ap__arena_ptr(&a, v1);
    assert_true(((uintptr_t)w % AP_ARENA_ALIGN) == 0);
    assert_true(((uintptr_t)b % AP_ARENA_ALIGN) == 0);
    assert_true(b >= w + 3);
    for (int i = 0; i < 1000; i++) assert_true(b[i] == 0.0f);
    assert_int_equal(ap__arena_find(&a, "b"), 1);
    assert_int_equal(ap__arena_find(&a, "zz"), -1);
    assert_int_equal(ap__arena_add(&a, "late", 1), AP_ESTATE);
    ap__arena_free(&a);
}

typedef struct {
    atomic_long sum;
    int *hits;
} pf_t;

static void pf_fn(void *arg, size_t b, size_t e)
{
    pf_t *p = arg;
    for (size_t i = b; i < e; i++) {
        p->hits[i]++;
        atomic_fetch_add(&p->sum, (long)i);
    }
}

static atomic_int task_count;
static void task_fn(void *arg)
{
    (void)arg;
    atomic_fetch_add(&task_count, 1);
}

static void test_pool(void **state)
{
    (void)state;
    ap_pool_t *p = ap__pool_new(3);
    assert_non_null(p);
    assert_int_equal(ap__pool_size(p), 3);
    size_t n = 100003;
    pf_t f = {.hits = calloc(n, sizeof(int))};
    atomic_init(&f.sum, 0);
    ap__pool_parallel_for(p, n, 64, pf_fn, &f);
    for (size_t i = 0; i < n; i++) assert_int_equal(f.hits[i], 1);
    assert_true(atomic_load(&f.sum) == (long)(n * (n - 1) / 2));
    for (int i = 0; i < 100; i++) assert_ok(ap__pool_submit(p, task_fn, NULL));
    ap__pool_free(p); /* drains the queue */
    assert_int_equal(atomic_load(&task_count), 100);
    /* serial fallback */
    memset(f.hits, 0, n * sizeof(int));
    ap__pool_parallel_for(NULL, n, 1, pf_fn, &f);
    for (size_t i = 0; i < n; i++) assert_int_equal(f.hits[i], 1);
    free(f.hits);
    assert_non_null(ap__pool_global());
}

/* The map against a plain array model under random puts/deletes, with keys
 * chosen to collide (few distinct homes) so backward-shift deletion is hit. */
static void test_u64map(void **state)
{
    (void)state;
    enum { K = 600 };
    static uint64_t model[K];
    static bool present[K];
    ap_u64map_t m = {0};
    uint64_t v;
    assert_int_equal(ap__u64map_put(&m, AP_U64MAP_EMPTY, 1), AP_EINVAL);
    assert_false(ap__u64map_get(&m, 7, &v));
    assert_false(ap__u64map_del(&m, 7, NULL));
    uint64_t rng = ap_test_seed(1);
    size_t n = 0;
    for (int step = 0; step < 200000; step++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t k = (size_t)(rng >> 33) % K;
        uint64_t key = (uint64_t)k * 0x100000000ull; /* k << 32, and key 0 too */
        if ((rng >> 20) & 1) {
            assert_int_equal(ap__u64map_put(&m, key, rng), 0);
            if (!present[k]) n++;
            present[k] = true;
            model[k] = rng;
        } else {
            bool had = ap__u64map_del(&m, key, &v);
            assert_int_equal(had, present[k]);
            if (had) {
                assert_int_equal(v, model[k]);
                n--;
            }
            present[k] = false;
        }
        assert_int_equal(m.n, n);
        if (step % 997 == 0)
            for (size_t j = 0; j < K; j++) {
                bool got = ap__u64map_get(&m, (uint64_t)j << 32, &v);
                assert_int_equal(got, present[j]);
                if (got) assert_int_equal(v, model[j]);
            }
    }
    size_t seen = 0, pos = 0;
    uint64_t key;
    while (ap__u64map_next(&m, &pos, &key, &v)) {
        size_t j = (size_t)(key >> 32);
        assert_true(j < K && present[j]);
        assert_int_equal(v, model[j]);
        seen++;
    }
    assert_int_equal(seen, n);
    ap__u64map_free(&m);
    assert_int_equal(m.cap, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),     cmocka_unit_test(test_log),
        cmocka_unit_test(test_buf_reader), cmocka_unit_test(test_varint),
        cmocka_unit_test(test_hex_base58), cmocka_unit_test(test_peer_id),
        cmocka_unit_test(test_arena),      cmocka_unit_test(test_pool),
        cmocka_unit_test(test_u64map),     cmocka_unit_test(test_log_limited),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
