/* SWARM announcements: the stage key, the value codec and its refusals, the
 * owner subkey, and a balancer fed from a DHT result (expiry converted from
 * wall-clock time; malformed and expired entries skipped). */
#include "aptest.h"

#include "apiary/swarm.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static ap_peer_id_t pid(int i)
{
    uint8_t pk[AP_ED25519_PK_LEN] = {0};
    pk[0] = (uint8_t)(i + 1);
    ap_peer_id_t id;
    ap_peer_id_from_ed25519(&id, pk);
    return id;
}

/* Server i's record of a: its owner subkey written into sk (96 bytes), the
 * value into val, expiring at exp_ms. */
static ap_dht_record_t owner_record(int i, const ap_swarm_announce_t *a, char *sk, uint8_t *val,
                                    int64_t exp_ms)
{
    char pidtxt[AP_PEER_ID_STR_MAX];
    ap_peer_id_t p = pid(i);
    snprintf(sk, 96, "[owner:%s]", ap_peer_id_str(&p, pidtxt));
    ap_swarm_announce_encode(a, val);
    return (ap_dht_record_t){.subkey = (const uint8_t *)sk,
                             .subkey_len = strlen(sk),
                             .value = val,
                             .value_len = AP_SWARM_ANNOUNCE_LEN,
                             .expiration_ms = exp_ms};
}

static void test_codec(void **state)
{
    (void)state;
    char key[AP_SWARM_KEY_MAX];
    assert_int_equal(ap_swarm_stage_key("run1", 3, key), 18);
    assert_string_equal(key, "swarm/run1/stage/3");
    assert_int_equal(ap_swarm_stage_key("", 3, key), AP_EINVAL);
    char big[AP_SWARM_RUN_MAX + 2];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    assert_int_equal(ap_swarm_stage_key(big, 3, key), AP_EINVAL);

    ap_swarm_announce_t a = {.throughput = 123.5,
                             .estimate = true,
                             .queue = 7,
                             .version = 99,
                             .period_ms = 1000,
                             .ttl_ms = 30000},
                        d;
    uint8_t v[AP_SWARM_ANNOUNCE_LEN];
    assert_int_equal(sizeof v, 32);
    ap_swarm_announce_encode(&a, v);
    assert_int_equal(v[1], 2);
    assert_int_equal(v[2], AP_SWARM_ANNOUNCE_ESTIMATE);
    assert_ok(ap_swarm_announce_decode(v, sizeof v, &d));
    assert_true(d.throughput == 123.5 && d.queue == 7 && d.version == 99);
    assert_true(d.estimate && d.period_ms == 1000 && d.ttl_ms == 30000);
    assert_int_equal(ap_swarm_announce_decode(v, sizeof v - 1, &d), AP_ECORRUPT);
    assert_int_equal(ap_swarm_announce_decode(v, 24, &d), AP_ECORRUPT); /* version 1's length */
    v[1] = 1;
    assert_int_equal(ap_swarm_announce_decode(v, sizeof v, &d), AP_EVERSION);
    v[1] = 2;
    v[2] = 2; /* an unknown flag */
    assert_int_equal(ap_swarm_announce_decode(v, sizeof v, &d), AP_ECORRUPT);
    v[2] = 0;
    v[3] = 1;
    assert_int_equal(ap_swarm_announce_decode(v, sizeof v, &d), AP_ECORRUPT);
    v[3] = 0;
    assert_ok(ap_swarm_announce_decode(v, sizeof v, &d));
    assert_false(d.estimate);
    a.throughput = 0; /* an estimate of nothing is not sent as one */
    ap_swarm_announce_encode(&a, v);
    assert_int_equal(v[2], 0);
    v[2] = AP_SWARM_ANNOUNCE_ESTIMATE;
    assert_int_equal(ap_swarm_announce_decode(v, sizeof v, &d), AP_ECORRUPT);
    v[2] = 0;
    a.throughput = NAN;
    ap_swarm_announce_encode(&a, v); /* a non-finite claim is sent as 0 */
    assert_ok(ap_swarm_announce_decode(v, sizeof v, &d));
    assert_true(d.throughput == 0);
    double nan = NAN;
    uint64_t bits;
    memcpy(&bits, &nan, 8);
    for (int k = 0; k < 8; k++) v[4 + k] = (uint8_t)(bits >> (56 - 8 * k));
    assert_int_equal(ap_swarm_announce_decode(v, sizeof v, &d), AP_ECORRUPT);
    memset(v + 4, 0, 8);
    v[4] = 0x80; /* -0: refused, so every value has one encoding */
    assert_int_equal(ap_swarm_announce_decode(v, sizeof v, &d), AP_ECORRUPT);
}

static void test_feed(void **state)
{
    (void)state;
    char sk[4][96];
    uint8_t vals[4][AP_SWARM_ANNOUNCE_LEN];
    ap_dht_record_t recs[5];
    const int64_t wall = 1700000000000;
    for (int i = 0; i < 4; i++) {
        ap_swarm_announce_t a = {.throughput = 10.0 * (i + 1)};
        recs[i] = owner_record(i, &a, sk[i], vals[i], wall + 30000);
    }
    recs[2].expiration_ms = wall - 1; /* expired */
    recs[3].value_len = 5;            /* malformed */
    recs[4] = recs[0];
    recs[4].subkey = (const uint8_t *)"plain";
    recs[4].subkey_len = 5; /* not an owner subkey */
    ap_dht_result_t res = {.found = true, .is_dict = true, .nrecords = 5, .records = recs};
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(NULL);
    const uint64_t now = 5000000;
    assert_int_equal(ap_swarm_balancer_feed(b, &res, now, wall), 2);
    assert_int_equal(ap_swarm_balancer_count(b), 2);
    ap_swarm_server_info_t info;
    ap_peer_id_t p1 = pid(1);
    assert_ok(ap_swarm_balancer_info(b, &p1, now, &info));
    assert_true(info.throughput == 20.0);
    assert_int_equal(info.expires_us, now + 30000000ull);
    /* Past the expiry the servers are gone. */
    ap_peer_id_t q;
    assert_int_equal(ap_swarm_balancer_pick(b, 1, now + 30000000ull, &q, NULL), AP_ENOTFOUND);
    res.found = false;
    assert_int_equal(ap_swarm_balancer_feed(b, &res, now, wall), 0);
    assert_int_equal(ap_swarm_balancer_feed(NULL, &res, now, wall), AP_EINVAL);
    ap_swarm_balancer_free(b);
}

/* A record says when it was made (its expiry minus the TTL it carries) and
 * its owner's period; 1.5 periods (plus the reader's slack) after it was
 * made, its owner has missed a refresh. */
static void test_stale(void **state)
{
    (void)state;
    char sk[3][96];
    uint8_t vals[3][AP_SWARM_ANNOUNCE_LEN];
    ap_dht_record_t recs[3];
    const int64_t wall = 1700000000000;
    for (int i = 0; i < 3; i++) {
        /* server 0: made 0.2 s ago; 1: made 1.6 s ago; 2: says no period */
        ap_swarm_announce_t a = {
            .throughput = 5, .estimate = i == 0, .period_ms = i == 2 ? 0 : 1000, .ttl_ms = 3000};
        recs[i] = owner_record(i, &a, sk[i], vals[i], wall + (i == 1 ? 1400 : 2800));
    }
    ap_dht_result_t res = {.found = true, .is_dict = true, .nrecords = 3, .records = recs};
    ap_swarm_member_t m[3];
    int64_t exp[3];
    assert_int_equal(ap_swarm_members_from(&res, 1, wall, m, exp, 3), 3);
    assert_true(m[0].estimate && !m[1].estimate);
    assert_int_equal(m[0].made_ms, wall - 200);
    assert_int_equal(m[1].made_ms, wall - 1600);
    assert_int_equal(m[0].period_ms, 1000);
    assert_false(ap_swarm_member_stale(&m[0], wall, 0));
    assert_true(ap_swarm_member_stale(&m[1], wall, 0));
    assert_false(ap_swarm_member_stale(&m[1], wall, 100)); /* a slow read: 1.6 s is within */
    assert_false(ap_swarm_member_stale(&m[1], wall - 101, 0));
    assert_false(ap_swarm_member_stale(&m[2], wall + 10000, 0)); /* no period: never */
    assert_false(ap_swarm_member_stale(NULL, wall, 0));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codec),
        cmocka_unit_test(test_feed),
        cmocka_unit_test(test_stale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
