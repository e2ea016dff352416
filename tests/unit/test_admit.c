/* Connection admission: per-IP and total pending handshakes, random early
 * drop, eviction of the busiest source's oldest handshake, open-connection
 * limits with reserved slots, least-useful eviction of idle connections. */
#include "aptest.h"

#include "base/admit.h"

#include <string.h>

static void ip4(uint8_t ip[16], uint8_t a, uint8_t b, uint8_t c, uint8_t d)
{
    memset(ip, 0, 16);
    ip[10] = ip[11] = 0xff;
    ip[12] = a, ip[13] = b, ip[14] = c, ip[15] = d;
}

/* One source stalls every handshake it starts: a new source still gets in. */
static void test_stalled_flood(void **state)
{
    (void)state;
    ap_admit_t a;
    ap_admit_config_t c = {.hs_start = 16, .hs_full = 64, .hs_per_ip = 8};
    ap_admit_init(&a, &c);
    uint8_t bad[16], good[16];
    ip4(bad, 10, 0, 0, 1);
    ip4(good, 10, 0, 0, 2);
    uint64_t id = 1, victim = 0;
    int admitted = 0;
    for (int i = 0; i < 1000; i++)
        if (ap_admit_inbound(&a, id++, bad, (uint64_t)i, (uint32_t)i * 2654435761u, &victim) !=
            AP_ADMIT_DROP)
            admitted++;
    assert_int_equal(admitted, 8); /* per-IP cap */
    assert_int_equal(ap_admit_stats(&a)->pending, 8);
    /* many attacking addresses fill the total; a new address is still let in,
     * at the expense of the busiest source's oldest handshake */
    uint8_t ip[16];
    for (int s = 0; s < 100; s++) {
        ip4(ip, 10, 1, 0, (uint8_t)s);
        for (int k = 0; k < 8; k++)
            if (ap_admit_inbound(&a, id++, ip, 2000 + (uint64_t)s, 0, &victim) == AP_ADMIT_EVICT)
                ap_admit_gone(&a, victim); /* the transport closes it */
    }
    assert_true(ap_admit_stats(&a)->pending <= 64);
    assert_true(ap_admit_stats(&a)->dropped_random > 0 || ap_admit_stats(&a)->dropped_full > 0);
    uint64_t legit = id++;
    ap_admit_verdict_t v = ap_admit_inbound(&a, legit, good, 5000, 0, &victim);
    assert_int_not_equal(v, AP_ADMIT_DROP);
    if (v == AP_ADMIT_EVICT) {
        assert_int_not_equal(victim, legit);
        ap_admit_gone(&a, victim);
    }
    assert_true(ap_admit_open(&a, legit, false, 0, &victim) == AP_ADMIT_OK);
    assert_int_equal(ap_admit_stats(&a)->open_in, 1);
    ap_admit_gone(&a, legit);
    assert_int_equal(ap_admit_stats(&a)->open_in, 0);
    ap_admit_close(&a);
}

/* Random early drop: only sources that already have a handshake pending. */
static void test_random_early_drop(void **state)
{
    (void)state;
    ap_admit_t a;
    ap_admit_config_t c = {.hs_start = 4, .hs_rate_pct = 50, .hs_full = 100, .hs_per_ip = 100};
    ap_admit_init(&a, &c);
    uint8_t ip[16];
    ip4(ip, 192, 0, 2, 1);
    uint64_t victim, id = 1;
    for (int i = 0; i < 4; i++) assert_int_equal(ap_admit_inbound(&a, id++, ip, 0, 0, &victim), 0);
    /* rnd % 100 < 50 drops, >= 50 admits, at the soft limit */
    assert_int_equal(ap_admit_inbound(&a, id++, ip, 0, 10, &victim), AP_ADMIT_DROP);
    assert_int_equal(ap_admit_inbound(&a, id++, ip, 0, 99, &victim), AP_ADMIT_OK);
    /* a new source is never dropped at random */
    uint8_t other[16];
    ip4(other, 192, 0, 2, 2);
    assert_int_equal(ap_admit_inbound(&a, id++, other, 0, 0, &victim), AP_ADMIT_OK);
    assert_int_equal(ap_admit_stats(&a)->dropped_random, 1);
    ap_admit_close(&a);
}

/* Open connections: per-IP cap, and slots only known peers and own dials get. */
static void test_open_limits(void **state)
{
    (void)state;
    ap_admit_t a;
    ap_admit_config_t c = {.max_conns = 20,
                           .reserved_out = 4,
                           .reserved_known = 4,
                           .conns_per_ip = 100,
                           .hs_per_ip = 100,
                           .hs_full = 100,
                           .hs_start = 100};
    ap_admit_init(&a, &c);
    uint8_t ip[16];
    uint64_t id = 1, victim;
    int opened = 0;
    for (int i = 0; i < 30; i++) {
        ip4(ip, 10, 2, 0, (uint8_t)i);
        uint64_t me = id++;
        assert_int_not_equal(ap_admit_inbound(&a, me, ip, 0, 0, &victim), AP_ADMIT_DROP);
        if (ap_admit_open(&a, me, false, 0, &victim) == AP_ADMIT_OK)
            opened++;
        else
            ap_admit_gone(&a, me);
    }
    assert_int_equal(opened, 12); /* 20 - 4 - 4 */
    /* a known peer still gets in, up to the reserve */
    for (int i = 0; i < 4; i++) {
        ip4(ip, 10, 3, 0, (uint8_t)i);
        uint64_t me = id++;
        ap_admit_inbound(&a, me, ip, 0, 0, &victim);
        assert_true(ap_admit_open(&a, me, true, 0, &victim) == AP_ADMIT_OK);
    }
    ip4(ip, 10, 3, 0, 99);
    uint64_t me = id++;
    ap_admit_inbound(&a, me, ip, 0, 0, &victim);
    assert_false(ap_admit_open(&a, me, true, 0, &victim) == AP_ADMIT_OK);
    ap_admit_gone(&a, me);
    /* the node's own dials have theirs */
    for (int i = 0; i < 4; i++) assert_true(ap_admit_outbound(&a, id++, ip));
    assert_false(ap_admit_outbound(&a, id++, ip));
    assert_int_equal(ap_admit_stats(&a)->open_in + ap_admit_stats(&a)->open_out, 20);
    /* per-IP cap */
    ap_admit_close(&a);
    ap_admit_config_t c2 = {.conns_per_ip = 3, .evict_idle_ms = 1000};
    ap_admit_init(&a, &c2);
    ip4(ip, 10, 9, 9, 9);
    int ok = 0, evicted = 0;
    uint64_t first = id;
    for (int i = 0; i < 10; i++) {
        uint64_t x = id++;
        ap_admit_inbound(&a, x, ip, (uint64_t)i, 0, &victim);
        ap_admit_verdict_t v = ap_admit_open(&a, x, false, (uint64_t)i, &victim);
        if (v == AP_ADMIT_OK) ok++;
        if (v == AP_ADMIT_EVICT) {
            /* the address's budget turns over, the longest idle first */
            assert_int_equal(victim, first + (uint64_t)evicted);
            evicted++;
            ap_admit_gone(&a, victim);
        }
    }
    assert_int_equal(ok, 3);
    assert_int_equal(evicted, 7);
    assert_int_equal(ap_admit_stats(&a)->open_in, 3);
    assert_int_equal(ap_admit_stats(&a)->pending, 0);
    ap_admit_close(&a);
}

/* One client holds every shared slot open and idle: a newcomer gets in in
 * place of the longest idle connection of the busiest source; active and
 * known connections are never the ones closed; the per-IP limit evicts
 * within the newcomer's own IP. */
static void test_idle_eviction(void **state)
{
    (void)state;
    ap_admit_t a;
    ap_admit_config_t c = {.max_conns = 20,
                           .reserved_out = 2,
                           .reserved_known = 2,
                           .conns_per_ip = 100,
                           .evict_idle_ms = 1000};
    ap_admit_init(&a, &c);
    uint8_t bad[16], good[16], known_ip[16];
    ip4(bad, 10, 5, 0, 1);
    ip4(good, 10, 5, 0, 2);
    ip4(known_ip, 10, 5, 0, 3);
    uint64_t victim = 0, held[16];
    /* one known peer, then 15 held connections: 16 = 20 - 2 - 2 */
    uint64_t kn = 100;
    assert_int_equal(ap_admit_inbound(&a, kn, known_ip, 0, 0, &victim), AP_ADMIT_OK);
    assert_int_equal(ap_admit_open(&a, kn, true, 0, &victim), AP_ADMIT_OK);
    for (int i = 0; i < 15; i++) {
        held[i] = 1 + (uint64_t)i;
        assert_int_equal(ap_admit_inbound(&a, held[i], bad, (uint64_t)i, 0, &victim), 0);
        assert_int_equal(ap_admit_open(&a, held[i], false, (uint64_t)i, &victim), AP_ADMIT_OK);
    }
    /* full, and nobody idle long enough yet: refused */
    uint64_t g1 = 200;
    assert_int_equal(ap_admit_inbound(&a, g1, good, 500, 0, &victim), AP_ADMIT_OK);
    assert_int_equal(ap_admit_open(&a, g1, false, 500, &victim), AP_ADMIT_DROP);
    ap_admit_gone(&a, g1);
    /* held[0] stays active; the known peer is idle but protected */
    ap_admit_touch(&a, held[0], 5000);
    uint64_t g2 = 201;
    assert_int_equal(ap_admit_inbound(&a, g2, good, 5000, 0, &victim), AP_ADMIT_OK);
    assert_int_equal(ap_admit_open(&a, g2, false, 5000, &victim), AP_ADMIT_EVICT);
    assert_int_equal(victim, held[1]); /* the longest idle of the busiest source */
    ap_admit_gone(&a, victim);
    assert_int_equal(ap_admit_stats(&a)->evicted_idle, 1);
    /* more newcomers: every one of them gets in, the held ones make room */
    for (uint64_t g = 300; g < 307; g++) { /* while the held source is the busiest */
        assert_int_equal(ap_admit_inbound(&a, g, good, 6000, 0, &victim), AP_ADMIT_OK);
        assert_int_equal(ap_admit_open(&a, g, false, 6000, &victim), AP_ADMIT_EVICT);
        assert_int_not_equal(victim, held[0]);
        assert_int_not_equal(victim, kn);
        assert_true(victim < 100); /* one of the held */
        ap_admit_gone(&a, victim);
    }
    assert_int_equal(ap_admit_stats(&a)->open_known, 1);
    assert_int_equal(ap_admit_stats(&a)->open_in, 16);
    ap_admit_close(&a);
    /* per-IP limit: the newcomer replaces an idle connection of its own IP */
    ap_admit_config_t c2 = {.conns_per_ip = 3, .evict_idle_ms = 1000};
    ap_admit_init(&a, &c2);
    uint64_t id = 1;
    for (int i = 0; i < 3; i++, id++) {
        ap_admit_inbound(&a, id, bad, 0, 0, &victim);
        assert_int_equal(ap_admit_open(&a, id, false, 0, &victim), AP_ADMIT_OK);
    }
    ap_admit_inbound(&a, id, good, 0, 0, &victim);
    assert_int_equal(ap_admit_open(&a, id, false, 0, &victim), AP_ADMIT_OK); /* other IP */
    id++;
    ap_admit_inbound(&a, id, bad, 2000, 0, &victim);
    assert_int_equal(ap_admit_open(&a, id, false, 2000, &victim), AP_ADMIT_EVICT);
    assert_true(victim >= 1 && victim <= 3);
    ap_admit_gone(&a, victim);
    assert_int_equal(ap_admit_stats(&a)->open_in, 4);
    ap_admit_close(&a);
}

/* A connection handed to another transport keeps its entry under a new id:
 * same state, same age (it is still the oldest at the limit), one count. */
static void test_rekey(void **state)
{
    (void)state;
    ap_admit_t a;
    ap_admit_config_t c = {.hs_start = 4, .hs_full = 4, .hs_per_ip = 4, .hs_min_age_ms = 100};
    ap_admit_init(&a, &c);
    uint8_t ip[16], other[16];
    ip4(ip, 10, 0, 0, 1);
    ip4(other, 10, 0, 0, 9);
    uint64_t victim = 0;
    assert_int_equal(ap_admit_inbound(&a, 2, ip, 0, 0, &victim), AP_ADMIT_OK);
    for (uint64_t id = 4; id <= 8; id += 2) {
        ip4(ip, 10, 0, 1, (uint8_t)id);
        assert_int_equal(ap_admit_inbound(&a, id, ip, 50, 0, &victim), AP_ADMIT_OK);
    }
    ip4(ip, 10, 0, 0, 1);
    /* refused: unknown id, id 0, an id in use */
    assert_false(ap_admit_rekey(&a, 99, 3));
    assert_false(ap_admit_rekey(&a, 2, 0));
    assert_false(ap_admit_rekey(&a, 2, 4));
    assert_true(ap_admit_rekey(&a, 2, 3));
    assert_false(ap_admit_rekey(&a, 2, 5)); /* the old id is gone */
    assert_int_equal(ap_admit_stats(&a)->pending, 4);
    assert_int_equal(ap_admit_pending_ip(&a, ip), 1);
    /* at the limit the oldest goes: the rekeyed one, under its new id */
    assert_int_equal(ap_admit_inbound(&a, 10, other, 500, 0, &victim), AP_ADMIT_EVICT);
    assert_int_equal(victim, 3);
    ap_admit_gone(&a, 3);
    assert_int_equal(ap_admit_pending_ip(&a, ip), 0);
    assert_int_equal(ap_admit_stats(&a)->pending, 4);
    /* a rekeyed entry opens and closes as any other */
    assert_true(ap_admit_rekey(&a, 10, 11));
    assert_int_equal(ap_admit_open(&a, 11, false, 600, &victim), AP_ADMIT_OK);
    assert_int_equal(ap_admit_stats(&a)->open_in, 1);
    ap_admit_gone(&a, 11);
    assert_int_equal(ap_admit_stats(&a)->open_in, 0);
    assert_int_equal(ap_admit_pending_ip(&a, other), 0);
    ap_admit_close(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stalled_flood), cmocka_unit_test(test_random_early_drop),
        cmocka_unit_test(test_open_limits),   cmocka_unit_test(test_idle_eviction),
        cmocka_unit_test(test_rekey),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
