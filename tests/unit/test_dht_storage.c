/* DHT storage: latest-expiration-wins, dictionaries, expiry, limits, eviction,
 * per-peer rate limits, per-peer quotas and fair eviction. */
#include "aptest.h"

#include "apiary/dht.h"
#include "dht/storage.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>

#define HOUR_MS (3600 * 1000)

static ap_dht_record_t R(const char *key, const char *sub, const char *val, int64_t exp)
{
    ap_dht_record_t r = {.key = (const uint8_t *)key,
                         .key_len = strlen(key),
                         .subkey = sub ? (const uint8_t *)sub : NULL,
                         .subkey_len = sub ? strlen(sub) : 0,
                         .value = (const uint8_t *)val,
                         .value_len = strlen(val),
                         .expiration_ms = exp};
    return r;
}

static ap__dht_sentry_t *find(ap__dht_storage_t *st, const char *key, int64_t now)
{
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_key_id((const uint8_t *)key, strlen(key), id);
    return ap__dht_storage_find(st, id, now);
}

static const ap__dht_srec_t *sub_of(ap__dht_sentry_t *e, const char *sub)
{
    for (size_t i = 0; i < e->nrecs; i++)
        if (e->recs[i]->subkey_len == strlen(sub) &&
            !memcmp(e->recs[i]->subkey, sub, e->recs[i]->subkey_len))
            return e->recs[i];
    return NULL;
}

static void test_latest_wins(void **state)
{
    (void)state;
    ap__dht_storage_t st;
    ap__dht_storage_init(&st, 100, 1 << 20, HOUR_MS, 0);
    int64_t now = 1000000;
    ap_dht_record_t a = R("k", NULL, "old", now + 100);
    assert_ok(ap__dht_storage_put(&st, &a, NULL, false, now));
    ap_dht_record_t b = R("k", NULL, "new", now + 200);
    assert_ok(ap__dht_storage_put(&st, &b, NULL, false, now));
    /* not later: refused, equal too */
    ap_dht_record_t c = R("k", NULL, "older", now + 150);
    assert_int_equal(ap__dht_storage_put(&st, &c, NULL, false, now), AP_ESTALE);
    ap_dht_record_t d = R("k", NULL, "same", now + 200);
    assert_int_equal(ap__dht_storage_put(&st, &d, NULL, false, now), AP_ESTALE);
    ap__dht_sentry_t *e = find(&st, "k", now);
    assert_non_null(e);
    assert_int_equal(e->nrecs, 1);
    assert_memory_equal(e->recs[0]->value, "new", 3);
    assert_int_equal(ap__dht_storage_records(&st), 1);
    /* expired and far-future stores are refused */
    ap_dht_record_t x = R("x", NULL, "v", now);
    assert_int_equal(ap__dht_storage_put(&st, &x, NULL, false, now), AP_EEXPIRED);
    x.expiration_ms = now + HOUR_MS + 1;
    assert_int_equal(ap__dht_storage_put(&st, &x, NULL, false, now), AP_ERANGE);
    /* expiry: never returned after it */
    assert_non_null(find(&st, "k", now + 199));
    assert_null(find(&st, "k", now + 200));
    assert_int_equal(ap__dht_storage_records(&st), 0);
    assert_int_equal(st.bytes, 0);
    ap__dht_storage_close(&st);
}

static void test_dictionary(void **state)
{
    (void)state;
    ap__dht_storage_t st;
    ap__dht_storage_init(&st, 100, 1 << 20, HOUR_MS, 0);
    int64_t now = 5000;
    ap_dht_record_t r1 = R("peers", "alice", "1", now + 100);
    ap_dht_record_t r2 = R("peers", "bob", "2", now + 300);
    assert_ok(ap__dht_storage_put(&st, &r1, NULL, false, now));
    assert_ok(ap__dht_storage_put(&st, &r2, NULL, false, now));
    ap_dht_record_t r3 = R("peers", "alice", "1b", now + 50);
    assert_int_equal(ap__dht_storage_put(&st, &r3, NULL, false, now), AP_ESTALE);
    ap_dht_record_t r4 = R("peers", "alice", "1c", now + 150);
    assert_ok(ap__dht_storage_put(&st, &r4, NULL, false, now));
    ap__dht_sentry_t *e = find(&st, "peers", now);
    assert_true(e->is_dict);
    assert_int_equal(e->nrecs, 2);
    assert_memory_equal(sub_of(e, "alice")->value, "1c", 2);
    /* each subkey expires on its own */
    e = find(&st, "peers", now + 150);
    assert_int_equal(e->nrecs, 1);
    assert_null(sub_of(e, "alice"));
    assert_non_null(sub_of(e, "bob"));
    /* a plain value replaces the dictionary only if it outlives all of it */
    ap_dht_record_t p = R("peers", NULL, "plain", now + 300);
    assert_int_equal(ap__dht_storage_put(&st, &p, NULL, false, now + 150), AP_ESTALE);
    p.expiration_ms = now + 301;
    assert_ok(ap__dht_storage_put(&st, &p, NULL, false, now + 150));
    e = find(&st, "peers", now + 150);
    assert_false(e->is_dict);
    assert_int_equal(e->nrecs, 1);
    assert_int_equal(ap__dht_storage_records(&st), 1);
    /* and back to a dictionary */
    ap_dht_record_t d = R("peers", "carol", "3", now + 400);
    assert_ok(ap__dht_storage_put(&st, &d, NULL, false, now + 150));
    e = find(&st, "peers", now + 150);
    assert_true(e->is_dict);
    assert_int_equal(e->nrecs, 1);
    ap__dht_storage_close(&st);
}

static void test_limits_and_eviction(void **state)
{
    (void)state;
    ap__dht_storage_t st;
    ap__dht_storage_init(&st, 10, 1 << 20, HOUR_MS, 0);
    int64_t now = 0;
    char key[32];
    /* 10 records expiring at 1000..1900 */
    for (int i = 0; i < 10; i++) {
        snprintf(key, sizeof key, "k%d", i);
        ap_dht_record_t r = R(key, NULL, "v", 1000 + 100 * i);
        assert_ok(ap__dht_storage_put(&st, &r, NULL, false, now));
    }
    /* a record expiring before all of them cannot evict anything */
    ap_dht_record_t early = R("early", NULL, "v", 999);
    assert_int_equal(ap__dht_storage_put(&st, &early, NULL, false, now), AP_EFULL);
    /* a later one evicts the earliest-expiring (k0) */
    ap_dht_record_t late = R("late", NULL, "v", 5000);
    assert_ok(ap__dht_storage_put(&st, &late, NULL, false, now));
    assert_int_equal(ap__dht_storage_records(&st), 10);
    assert_null(find(&st, "k0", now));
    assert_non_null(find(&st, "k1", now));
    assert_non_null(find(&st, "late", now));
    /* updating an existing record at the limit needs no eviction */
    ap_dht_record_t upd = R("k1", NULL, "v2", 6000);
    assert_ok(ap__dht_storage_put(&st, &upd, NULL, false, now));
    assert_non_null(find(&st, "k2", now));
    ap__dht_storage_close(&st);

    /* byte limit */
    ap__dht_storage_init(&st, 1000, 2000, HOUR_MS, 0);
    static char big[1001];
    memset(big, 'x', 1000);
    ap_dht_record_t b1 = R("b1", NULL, big, 100);
    ap_dht_record_t b2 = R("b2", NULL, big, 200);
    assert_ok(ap__dht_storage_put(&st, &b1, NULL, false, 0));
    assert_ok(ap__dht_storage_put(&st, &b2, NULL, false, 0)); /* evicts b1 */
    assert_null(find(&st, "b1", 0));
    assert_true(st.bytes <= 2000);
    char huge[3000];
    memset(huge, 'y', sizeof huge - 1);
    huge[sizeof huge - 1] = 0;
    ap_dht_record_t h = R("h", NULL, huge, 300);
    assert_int_equal(ap__dht_storage_put(&st, &h, NULL, false, 0), AP_EFULL);
    assert_non_null(find(&st, "b2", 0)); /* stored data unaffected */
    ap__dht_storage_close(&st);
}

static void test_rate_limit(void **state)
{
    (void)state;
    ap__dht_storage_t st;
    ap__dht_storage_init(&st, 100, 1 << 20, HOUR_MS, 5);
    ap_peer_id_t p1, p2;
    uint8_t pk[32];
    randombytes_buf(pk, 32);
    ap_peer_id_from_ed25519(&p1, pk);
    randombytes_buf(pk, 32);
    ap_peer_id_from_ed25519(&p2, pk);
    uint64_t t = 1000;
    for (int i = 0; i < 5; i++) assert_ok(ap__dht_storage_charge(&st, &p1, t));
    assert_int_equal(ap__dht_storage_charge(&st, &p1, t), AP_ERATE);
    assert_ok(ap__dht_storage_charge(&st, &p2, t));  /* other peers unaffected */
    assert_ok(ap__dht_storage_charge(&st, NULL, t)); /* local stores never limited */
    assert_int_equal(ap__dht_storage_charge(&st, &p1, t + 59999999), AP_ERATE);
    assert_ok(ap__dht_storage_charge(&st, &p1, t + 60000000)); /* next minute */
    /* many peers: the table stays bounded and each peer keeps its budget */
    for (int i = 0; i < 5000; i++) {
        ap_peer_id_t p;
        randombytes_buf(pk, 32);
        ap_peer_id_from_ed25519(&p, pk);
        assert_ok(ap__dht_storage_charge(&st, &p, t + 60000001));
    }
    ap__dht_storage_close(&st);
}

static void test_many_keys(void **state)
{
    (void)state;
    ap__dht_storage_t st;
    ap__dht_storage_init(&st, 100000, 64 << 20, HOUR_MS, 0);
    char key[32];
    int n = ap_test_sanitized() ? 2000 : 20000;
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "key-%d", i);
        ap_dht_record_t r = R(key, (i % 3) ? "s" : NULL, key, 1000 + (i * 7919) % 5000);
        assert_ok(ap__dht_storage_put(&st, &r, NULL, false, 0));
    }
    assert_int_equal(st.nentries, (size_t)n);
    for (int i = 0; i < n; i += 97) {
        snprintf(key, sizeof key, "key-%d", i);
        ap__dht_sentry_t *e = find(&st, key, 0);
        assert_non_null(e);
        assert_memory_equal(e->recs[0]->value, key, strlen(key));
    }
    /* expire half the range: exactly the records with exp <= 3500 go */
    size_t expect = 0;
    for (int i = 0; i < n; i++)
        if (1000 + (i * 7919) % 5000 > 3500) expect++;
    ap__dht_storage_expire(&st, 3500);
    assert_int_equal(ap__dht_storage_records(&st), expect);
    ap__dht_storage_expire(&st, 1 << 30);
    assert_int_equal(ap__dht_storage_records(&st), 0);
    assert_int_equal(st.nentries, 0);
    assert_int_equal(st.bytes, 0);
    ap__dht_storage_close(&st);
}

static ap_peer_id_t rand_peer(void)
{
    uint8_t pk[32];
    randombytes_buf(pk, 32);
    ap_peer_id_t p;
    ap_peer_id_from_ed25519(&p, pk);
    return p;
}

/* Counts every record and byte by walking the entries (the ground truth the
 * per-contributor accounting must agree with). */
static void walk_count(void *arg, ap__dht_sentry_t *e)
{
    size_t *c = arg;
    for (size_t i = 0; i < e->nrecs; i++) {
        c[0]++;
        c[1] += e->recs[i]->bytes;
    }
}

static void check_accounting(ap__dht_storage_t *st)
{
    size_t walked[2] = {0, 0}, recs = 0, bytes = 0;
    ap__dht_storage_foreach(st, walk_count, walked);
    for (size_t i = 0; i < st->ncontribs; i++) {
        assert_true(st->contribs[i]->nheap > 0); /* no empty contributor kept */
        recs += st->contribs[i]->nheap;
        bytes += st->contribs[i]->bytes;
    }
    assert_int_equal(recs, walked[0]);
    assert_int_equal(bytes, walked[1]);
    assert_int_equal(recs, ap__dht_storage_records(st));
}

static void test_quota(void **state)
{
    (void)state;
    ap__dht_storage_t st;
    ap__dht_storage_init(&st, 1000, 1 << 20, HOUR_MS, 0);
    ap__dht_storage_set_quota(&st, 64 * 1024, 5);
    ap_peer_id_t a = rand_peer(), b = rand_peer();
    char key[32];
    for (int i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "a%d", i);
        ap_dht_record_t r = R(key, NULL, "v", 1000 + i);
        assert_ok(ap__dht_storage_put_from(&st, &a, &r, NULL, false, 0));
    }
    ap_dht_record_t r6 = R("a5", NULL, "v", 2000);
    assert_int_equal(ap__dht_storage_put_from(&st, &a, &r6, NULL, false, 0), AP_EQUOTA);
    /* replacing one of its own records costs no extra record */
    ap_dht_record_t upd = R("a0", NULL, "v2", 3000);
    assert_ok(ap__dht_storage_put_from(&st, &a, &upd, NULL, false, 0));
    /* other peers and the node itself have their own budgets */
    assert_ok(ap__dht_storage_put_from(&st, &b, &r6, NULL, false, 0));
    ap_dht_record_t loc = R("mine", NULL, "v", 3000);
    assert_ok(ap__dht_storage_put(&st, &loc, NULL, false, 0));
    size_t n, by;
    ap__dht_storage_held(&st, &a, &n, &by);
    assert_int_equal(n, 5);
    ap__dht_storage_held(&st, &b, &n, &by);
    assert_int_equal(n, 1);
    /* byte quota */
    static char big[40 * 1024];
    memset(big, 'x', sizeof big - 1);
    ap_dht_record_t b1 = R("b-big1", NULL, big, 3000), b2 = R("b-big2", NULL, big, 3000);
    assert_ok(ap__dht_storage_put_from(&st, &b, &b1, NULL, false, 0));
    assert_int_equal(ap__dht_storage_put_from(&st, &b, &b2, NULL, false, 0), AP_EQUOTA);
    check_accounting(&st);
    /* expiry releases the quota */
    ap__dht_storage_expire(&st, 1500);
    ap__dht_storage_held(&st, &a, &n, &by);
    assert_int_equal(n, 1);
    ap_dht_record_t r7 = R("a7", NULL, "v", 4000);
    assert_ok(ap__dht_storage_put_from(&st, &a, &r7, NULL, false, 0));
    check_accounting(&st);
    ap__dht_storage_close(&st);
}

/* A writer filling the store with long-lived records never pushes out what
 * a small contributor stored before: the largest contributor pays. */
static void test_fair_eviction(void **state)
{
    (void)state;
    ap__dht_storage_t st;
    ap__dht_storage_init(&st, 100, 1 << 20, 24 * HOUR_MS, 0);
    ap__dht_storage_set_quota(&st, SIZE_MAX, SIZE_MAX); /* eviction alone must protect */
    ap_peer_id_t legit = rand_peer(), hostile = rand_peer();
    ap_dht_record_t keep = R("legit", NULL, "value", 3600 * 1000);
    assert_ok(ap__dht_storage_put_from(&st, &legit, &keep, NULL, false, 0));
    char key[32];
    int stored = 0;
    for (int i = 0; i < 2000; i++) {
        snprintf(key, sizeof key, "flood-%d", i);
        ap_dht_record_t r = R(key, NULL, "x", 23 * 3600 * 1000 + i);
        if (ap__dht_storage_put_from(&st, &hostile, &r, NULL, false, 0) == 0) stored++;
    }
    assert_int_equal(stored, 2000); /* it evicts its own oldest records */
    assert_non_null(find(&st, "legit", 0));
    assert_true(st.evicted >= 1900);
    assert_int_equal(ap__dht_storage_records(&st), 100);
    check_accounting(&st);
    /* a sybil crowd: many identities of one record each still take from the
     * largest first; the legitimate record survives as long as anyone holds more */
    ap_peer_id_t other = rand_peer();
    for (int i = 0; i < 20; i++) {
        snprintf(key, sizeof key, "o-%d", i);
        ap_dht_record_t r = R(key, NULL, "y", 1000 + i);
        assert_ok(ap__dht_storage_put_from(&st, &other, &r, NULL, false, 0));
    }
    assert_non_null(find(&st, "legit", 0));
    const ap__dht_contrib_t *big = ap__dht_storage_largest(&st);
    assert_non_null(big);
    assert_true(ap_peer_id_eq(&big->peer, &hostile));
    check_accounting(&st);
    /* the store's own key being replaced while full */
    ap_dht_record_t keep2 = R("legit", NULL, "value2", 7200 * 1000);
    assert_ok(ap__dht_storage_put_from(&st, &legit, &keep2, NULL, false, 0));
    check_accounting(&st);
    ap__dht_storage_close(&st);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_latest_wins),         cmocka_unit_test(test_dictionary),
        cmocka_unit_test(test_limits_and_eviction), cmocka_unit_test(test_rate_limit),
        cmocka_unit_test(test_many_keys),           cmocka_unit_test(test_quota),
        cmocka_unit_test(test_fair_eviction),
    };
    if (sodium_init() < 0) return 1;
    return cmocka_run_group_tests(tests, NULL, NULL);
}
