/* DHT routing table: buckets, split rule, replacement lists, back-off,
 * nearest-peer queries. */
#include "aptest.h"

#include "apiary/dht.h"
#include "dht/record.h"
#include "dht/routing.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

static ap_peer_id_t random_peer(void)
{
    uint8_t pk[32];
    randombytes_buf(pk, 32);
    ap_peer_id_t p;
    ap_peer_id_from_ed25519(&p, pk);
    return p;
}

static void check_invariants(ap__dht_routing_t *rt)
{
    /* every contact lives in the bucket whose prefix it matches; buckets hold
     * at most k; ids are consistent; no peer twice */
    for (int i = 0; i < rt->nbuckets; i++) {
        ap__dht_bucket_t *bk = &rt->buckets[i];
        assert_true(bk->n <= rt->k);
        assert_true(bk->nrepl <= rt->k);
        for (int j = 0; j < bk->n; j++) {
            assert_int_equal(ap__dht_routing_bucket_of(rt, bk->nodes[j].id), i);
            uint8_t id[20];
            ap_dht_peer_node_id(&bk->nodes[j].peer, id);
            assert_memory_equal(id, bk->nodes[j].id, 20);
            assert_true(ap__dht_common_prefix(bk->nodes[j].id, bk->prefix) >= bk->depth);
        }
    }
    /* the buckets partition the space: depths sum as a complete prefix code */
    double total = 0;
    for (int i = 0; i < rt->nbuckets; i++) total += 1.0 / (double)(1ull << rt->buckets[i].depth);
    assert_true(total > 0.999999 && total < 1.000001);
}

static void test_split_rule(void **state)
{
    (void)state;
    ap_peer_id_t self = random_peer();
    uint8_t self_id[20];
    ap_dht_peer_node_id(&self, self_id);
    ap__dht_routing_t rt;
    assert_ok(ap__dht_routing_init(&rt, self_id, 20, 5, 3, 1000, 64000));
    int n = ap_test_sanitized() ? 1000 : 5000;
    int added = 0, pending = 0;
    for (int i = 0; i < n; i++) {
        ap_peer_id_t p = random_peer();
        ap__dht_contact_t *check;
        int r = ap__dht_routing_seen(&rt, &p, "/sim/1", (uint64_t)i, &check);
        assert_true(r >= 0);
        if (r == AP__RT_ADDED) added++;
        if (r == AP__RT_PENDING) pending++;
    }
    check_invariants(&rt);
    assert_int_equal((size_t)added, ap__dht_routing_size(&rt));
    assert_true(pending > 0);
    /* With b = 5 the table keeps far more than k * log2(n) contacts would
     * give with b = 1: every bucket off the own path splits to depth 5. */
    ap__dht_routing_t rt1;
    assert_ok(ap__dht_routing_init(&rt1, self_id, 20, 1, 3, 1000, 64000));
    for (int i = 0; i < n; i++) {
        ap_peer_id_t p = random_peer();
        assert_true(ap__dht_routing_seen(&rt1, &p, NULL, 0, NULL) >= 0);
    }
    check_invariants(&rt1);
    assert_true(ap__dht_routing_size(&rt) > 2 * ap__dht_routing_size(&rt1));
    /* a bucket that overflowed (has replacements) refused to split: it is off
     * the own path at a depth that is a multiple of b */
    int overflowed = 0;
    for (int i = 0; i < rt.nbuckets; i++) {
        ap__dht_bucket_t *bk = &rt.buckets[i];
        bool has_self = ap__dht_common_prefix(self_id, bk->prefix) >= bk->depth;
        if (bk->nrepl > 0) {
            overflowed++;
            assert_false(has_self);
            assert_int_equal(bk->n, rt.k);
            assert_int_equal(bk->depth % 5, 0);
        }
    }
    assert_true(overflowed > 0);
    /* the own id is ignored */
    assert_int_equal(ap__dht_routing_seen(&rt, &self, NULL, 0, NULL), AP__RT_IGNORED);
    ap__dht_routing_close(&rt);
    ap__dht_routing_close(&rt1);
}

static void test_nearest(void **state)
{
    (void)state;
    ap_peer_id_t self = random_peer();
    uint8_t self_id[20];
    ap_dht_peer_node_id(&self, self_id);
    ap__dht_routing_t rt;
    assert_ok(ap__dht_routing_init(&rt, self_id, 20, 5, 3, 1000, 64000));
    for (int i = 0; i < 2000; i++) {
        ap_peer_id_t p = random_peer();
        ap__dht_routing_seen(&rt, &p, NULL, 0, NULL);
    }
    uint8_t target[20];
    randombytes_buf(target, 20);
    ap__dht_contact_t out[20];
    int m = ap__dht_routing_nearest(&rt, target, 20, 0, false, out);
    assert_int_equal(m, 20);
    for (int i = 1; i < m; i++) assert_true(ap__dht_cmp_dist(target, out[i - 1].id, out[i].id) < 0);
    /* brute force: nothing in the table is nearer than out[19] but missing */
    int nearer = 0;
    for (int i = 0; i < rt.nbuckets; i++)
        for (int j = 0; j < rt.buckets[i].n; j++)
            if (ap__dht_cmp_dist(target, rt.buckets[i].nodes[j].id, out[19].id) <= 0) nearer++;
    assert_int_equal(nearer, 20);
    ap__dht_routing_close(&rt);
}

static void test_replacement_and_backoff(void **state)
{
    (void)state;
    ap_peer_id_t self = random_peer();
    uint8_t self_id[20];
    ap_dht_peer_node_id(&self, self_id);
    ap__dht_routing_t rt;
    /* k = 2, b = 1: buckets off the own path never split */
    assert_ok(ap__dht_routing_init(&rt, self_id, 2, 1, 2, 1000, 4000));
    /* find three peers in the half of the space without the own id */
    ap_peer_id_t far[3];
    int nf = 0;
    while (nf < 3) {
        ap_peer_id_t p = random_peer();
        uint8_t id[20];
        ap_dht_peer_node_id(&p, id);
        if ((id[0] & 0x80) != (self_id[0] & 0x80)) far[nf++] = p;
    }
    ap__dht_contact_t *check = NULL;
    assert_int_equal(ap__dht_routing_seen(&rt, &far[0], "/a", 10, &check), AP__RT_ADDED);
    assert_int_equal(ap__dht_routing_seen(&rt, &far[1], "/b", 20, &check), AP__RT_ADDED);
    /* full: the third one waits, and we are asked to check the least recent */
    assert_int_equal(ap__dht_routing_seen(&rt, &far[2], "/c", 30, &check), AP__RT_PENDING);
    assert_non_null(check);
    assert_true(ap_peer_id_eq(&check->peer, &far[0]));
    assert_int_equal(ap__dht_routing_replacements(&rt), 1);
    /* a second sighting does not start a second check */
    assert_int_equal(ap__dht_routing_seen(&rt, &far[2], "/c", 31, &check), AP__RT_PENDING);
    assert_null(check);
    /* first failure: backed off (excluded from nearest), not yet replaced */
    assert_false(ap__dht_routing_failed(&rt, &far[0], 40));
    ap__dht_contact_t *c0 = ap__dht_routing_lookup(&rt, &far[0]);
    assert_non_null(c0);
    assert_int_equal(c0->backoff_until_us, 40 + 1000);
    ap__dht_contact_t out[4];
    uint8_t t[20];
    memcpy(t, c0->id, 20);
    int m = ap__dht_routing_nearest(&rt, t, 4, 41, false, out);
    for (int i = 0; i < m; i++) assert_false(ap_peer_id_eq(&out[i].peer, &far[0]));
    m = ap__dht_routing_nearest(&rt, t, 4, 41 + 1000, false, out);
    assert_true(ap_peer_id_eq(&out[0].peer, &far[0]));
    /* second failure: back-off doubled, and replaced by the waiting peer */
    assert_true(ap__dht_routing_failed(&rt, &far[0], 2000));
    assert_null(ap__dht_routing_lookup(&rt, &far[0]));
    assert_non_null(ap__dht_routing_lookup(&rt, &far[2]));
    assert_int_equal(ap__dht_routing_replacements(&rt), 0);
    /* a live answer clears back-off */
    assert_false(ap__dht_routing_failed(&rt, &far[1], 3000));
    assert_int_equal(ap__dht_routing_seen(&rt, &far[1], NULL, 3001, NULL), AP__RT_UPDATED);
    assert_int_equal(ap__dht_routing_lookup(&rt, &far[1])->failures, 0);
    assert_string_equal(ap__dht_routing_lookup(&rt, &far[1])->addr, "/b");
    /* without replacements a peer is only dropped after 2 * max_failures */
    for (int i = 0; i < 3; i++) assert_false(ap__dht_routing_failed(&rt, &far[1], 4000));
    assert_true(ap__dht_routing_failed(&rt, &far[1], 5000));
    assert_null(ap__dht_routing_lookup(&rt, &far[1]));
    ap__dht_routing_close(&rt);
}

static void test_random_id_in_bucket(void **state)
{
    (void)state;
    ap_peer_id_t self = random_peer();
    uint8_t self_id[20];
    ap_dht_peer_node_id(&self, self_id);
    ap__dht_routing_t rt;
    assert_ok(ap__dht_routing_init(&rt, self_id, 4, 5, 3, 1000, 64000));
    for (int i = 0; i < 500; i++) {
        ap_peer_id_t p = random_peer();
        ap__dht_routing_seen(&rt, &p, NULL, 0, NULL);
    }
    for (int i = 0; i < rt.nbuckets; i++) {
        uint8_t rnd[20], id[20];
        randombytes_buf(rnd, 20);
        ap__dht_routing_random_id(&rt, i, rnd, id);
        assert_int_equal(ap__dht_routing_bucket_of(&rt, id), i);
    }
    ap__dht_routing_close(&rt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split_rule),
        cmocka_unit_test(test_nearest),
        cmocka_unit_test(test_replacement_and_backoff),
        cmocka_unit_test(test_random_id_in_bucket),
    };
    if (sodium_init() < 0) return 1;
    return cmocka_run_group_tests(tests, NULL, NULL);
}
