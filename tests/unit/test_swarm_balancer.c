/* The SWARM trainer's server choice: shares proportional to measured speed,
 * a failed server banned until it publishes a newer record, no task lost, a
 * timeout not banning, newcomers entering at the minimum, lying
 * announcements judged by delivery, deadlines following measured times. */
#include "aptest.h"

#include "apiary/swarm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FAR (1ull << 60)

static ap_peer_id_t pid(int i)
{
    uint8_t pk[AP_ED25519_PK_LEN];
    memset(pk, 0, sizeof pk);
    pk[0] = (uint8_t)(i + 1);
    pk[31] = (uint8_t)(i * 7 + 3);
    ap_peer_id_t id;
    ap_peer_id_from_ed25519(&id, pk);
    return id;
}

static int which(const ap_peer_id_t *p, int n)
{
    for (int i = 0; i < n; i++) {
        ap_peer_id_t q = pid(i);
        if (ap_peer_id_eq(p, &q)) return i;
    }
    return -1;
}

/* Runs tasks of size 1 from task `from` to `to`; a server is alive while
 * alive[i]; a call to a dead server fails and the task is retried. Counts
 * completed tasks per server in done[], failed calls in *fails. */
static void run(ap_swarm_balancer_t *b, const double *speed, const bool *alive, int n, int from,
                int to, uint64_t *now, long *done, long *fails)
{
    for (int t = from; t < to; t++) {
        for (int attempt = 0;; attempt++) {
            assert_true(attempt < n + 1);
            ap_peer_id_t p;
            uint64_t dl = 0;
            assert_ok(ap_swarm_balancer_pick(b, 1.0, *now, &p, &dl));
            int i = which(&p, n);
            assert_true(i >= 0);
            assert_true(dl > 0);
            if (!alive[i]) {
                ap_swarm_balancer_report(b, &p, AP_ECLOSED, 1.0, 1000, *now);
                (*fails)++;
                continue;
            }
            uint64_t us = (uint64_t)(1e6 / speed[i]);
            ap_swarm_balancer_report(b, &p, 0, 1.0, us, *now);
            done[i]++;
            break;
        }
        *now += 1000;
    }
}

static void check_shares(const long *done, const double *speed, const bool *alive, int n,
                         long total)
{
    double sum = 0;
    for (int i = 0; i < n; i++) sum += alive[i] ? speed[i] : 0;
    for (int i = 0; i < n; i++) {
        double want = alive[i] ? speed[i] / sum : 0;
        double got = (double)done[i] / (double)total;
        print_message("server %d speed %g: share %.4f want %.4f\n", i, speed[i], got, want);
        if (want == 0)
            assert_int_equal(done[i], 0);
        else
            assert_true(fabs(got - want) <= 0.02 * want);
    }
}

static ap_swarm_balancer_t *with_servers(int n, double announced)
{
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(NULL);
    assert_non_null(b);
    for (int i = 0; i < n; i++) {
        ap_peer_id_t p = pid(i);
        assert_ok(ap_swarm_balancer_update(b, &p, announced, FAR, 0));
    }
    assert_int_equal(ap_swarm_balancer_count(b), (size_t)n);
    return b;
}

/* Speeds 1, 2, 4, 8 over 10,000 tasks: shares within 2 % of v/15. The
 * fastest dies at task 5,000: one failed call, then nothing; the others'
 * shares go to v/7; every task completes. */
static void test_shares_and_kill(void **state)
{
    (void)state;
    const double speed[4] = {1, 2, 4, 8};
    bool alive[4] = {true, true, true, true};
    ap_swarm_balancer_t *b = with_servers(4, 0);
    uint64_t now = 1000000;
    long done[4] = {0}, fails = 0;
    run(b, speed, alive, 4, 0, 10000, &now, done, &fails);
    assert_int_equal(fails, 0);
    check_shares(done, speed, alive, 4, 10000);
    ap_swarm_balancer_free(b);

    b = with_servers(4, 0);
    memset(done, 0, sizeof done);
    run(b, speed, alive, 4, 0, 5000, &now, done, &fails);
    check_shares(done, speed, alive, 4, 5000);
    alive[3] = false;
    long after[4] = {0};
    run(b, speed, alive, 4, 5000, 10000, &now, after, &fails);
    assert_int_equal(fails, 1); /* its first failed call, then nothing */
    check_shares(after, speed, alive, 4, 5000);
    long total = 0;
    for (int i = 0; i < 4; i++) total += done[i] + after[i];
    assert_int_equal(total, 10000); /* no task lost */
    ap_swarm_server_info_t info;
    ap_peer_id_t dead = pid(3);
    assert_ok(ap_swarm_balancer_info(b, &dead, now, &info));
    assert_true(info.banned);
    assert_int_equal(info.failed, 1);
    assert_int_equal(ap_swarm_balancer_eligible(b, now), 3);
    assert_true(fabs(ap_swarm_balancer_throughput(b, now) - 7.0) < 0.01);
    ap_swarm_balancer_free(b);
}

/* A ban lasts until the server publishes a newer record: the record known
 * at the ban, read again (same stamp), does not lift it however long it
 * lives; a record with a later stamp brings the server back at the current
 * minimum (no burst of catch-up tasks); an older record is ignored; a banned
 * server whose record expires with nothing newer is forgotten. */
static void test_ban_until_newer_record(void **state)
{
    (void)state;
    const double speed[3] = {1, 1, 1};
    bool alive[3] = {true, true, true};
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(NULL);
    uint64_t now = 1000;
    for (int i = 0; i < 3; i++) {
        ap_peer_id_t p = pid(i);
        assert_ok(ap_swarm_balancer_update_record(b, &p, 1, 500000000, 100, now));
    }
    long done[3] = {0}, fails = 0;
    alive[2] = false;
    run(b, speed, alive, 3, 0, 300, &now, done, &fails);
    assert_int_equal(fails, 1);
    assert_int_equal(done[2], 0);
    /* The same record read again (its expiry converted with jitter) and an
     * older one do not lift the ban, even long after it began. */
    ap_peer_id_t p2 = pid(2);
    assert_ok(ap_swarm_balancer_update_record(b, &p2, 1, 500000300, 100, now));
    assert_ok(ap_swarm_balancer_update_record(b, &p2, 1, 400000000, 90, now));
    alive[2] = true;
    now = 300000000;
    run(b, speed, alive, 3, 0, 300, &now, done, &fails);
    assert_int_equal(done[2], 0);
    ap_swarm_server_info_t info;
    assert_ok(ap_swarm_balancer_info(b, &p2, now, &info));
    assert_true(info.banned);
    /* A newer record (the server refreshed, or restarted and announced)
     * brings it back at once, at the minimum: over the next 30 tasks it
     * gets its fair third, not all. */
    assert_ok(ap_swarm_balancer_update_record(b, &p2, 1, 600000000, 101, now));
    assert_ok(ap_swarm_balancer_info(b, &p2, now, &info));
    assert_false(info.banned);
    long d2[3] = {0};
    run(b, speed, alive, 3, 0, 30, &now, d2, &fails);
    print_message("after the ban: %ld %ld %ld\n", d2[0], d2[1], d2[2]);
    assert_true(d2[2] >= 9 && d2[2] <= 11);
    assert_true(d2[0] >= 9 && d2[0] <= 11);
    /* Banned again, and its record never refreshed: forgotten once it
     * expires, while the others, refreshed, stay. */
    alive[2] = false;
    const long f0 = fails;
    run(b, speed, alive, 3, 0, 30, &now, d2, &fails);
    assert_int_equal(fails, f0 + 1);
    for (int i = 0; i < 2; i++) {
        ap_peer_id_t p = pid(i);
        assert_ok(ap_swarm_balancer_update_record(b, &p, 1, 900000000, 102, now));
    }
    assert_int_equal(ap_swarm_balancer_count(b), 3);
    now = 700000000;
    memset(d2, 0, sizeof d2);
    run(b, speed, alive, 3, 0, 30, &now, d2, &fails);
    assert_int_equal(d2[2], 0);
    assert_int_equal(fails, f0 + 1);
    assert_int_equal(ap_swarm_balancer_count(b), 2);
    assert_int_equal(ap_swarm_balancer_info(b, &p2, now, &info), AP_ENOTFOUND);
    ap_swarm_balancer_free(b);
}

/* A timeout does not ban; it raises the server's measured time. */
static void test_timeout_no_ban(void **state)
{
    (void)state;
    ap_swarm_balancer_t *b = with_servers(2, 0);
    ap_peer_id_t p;
    uint64_t dl;
    assert_ok(ap_swarm_balancer_pick(b, 1, 0, &p, &dl));
    ap_swarm_balancer_report(b, &p, AP_ETIMEDOUT, 1, dl, 0);
    ap_swarm_server_info_t info;
    assert_ok(ap_swarm_balancer_info(b, &p, 0, &info));
    assert_false(info.banned);
    assert_int_equal(info.timed_out, 1);
    assert_int_equal(ap_swarm_balancer_eligible(b, 0), 2);
    /* It is still picked in turn: its key holds the one unit charged, while
     * the other server's calls take 1 ms per unit, so its turn comes after
     * about 1,000 of theirs. */
    int seen = 0;
    for (int i = 0; i < 2000; i++) {
        ap_peer_id_t q;
        assert_ok(ap_swarm_balancer_pick(b, 1, 0, &q, NULL));
        seen += ap_peer_id_eq(&q, &p);
        ap_swarm_balancer_report(b, &q, 0, 1, 1000, 0);
    }
    assert_true(seen > 0);
    ap_swarm_balancer_free(b);
}

/* A server announcing 100 units/s that delivers 1 is judged by delivery: it
 * ends with its 1/3 share next to a server of speed 2 that announced 1. */
static void test_lying_announcement(void **state)
{
    (void)state;
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(NULL);
    ap_peer_id_t p0 = pid(0), p1 = pid(1);
    assert_ok(ap_swarm_balancer_update(b, &p0, 100, FAR, 0));
    assert_ok(ap_swarm_balancer_update(b, &p1, 1, FAR, 0));
    const double speed[2] = {1, 2};
    const bool alive[2] = {true, true};
    uint64_t now = 0;
    long warm[2] = {0}, done[2] = {0}, fails = 0;
    run(b, speed, alive, 2, 0, 100, &now, warm, &fails);
    run(b, speed, alive, 2, 0, 3000, &now, done, &fails);
    check_shares(done, speed, alive, 2, 3000);
    ap_swarm_balancer_free(b);
}

/* Deadlines follow measured call times: unmeasured = the maximum; after
 * steady 20 ms calls, between the mean and the factor's bound; slower calls
 * lengthen it; the bounds hold. */
static void test_deadlines(void **state)
{
    (void)state;
    ap_swarm_balancer_opts_t o = {0};
    o.deadline_min_us = 5000;
    o.deadline_max_us = 10000000;
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(&o);
    ap_peer_id_t p = pid(0), q;
    assert_ok(ap_swarm_balancer_update(b, &p, 0, FAR, 0));
    uint64_t dl;
    assert_ok(ap_swarm_balancer_pick(b, 2, 0, &q, &dl));
    assert_int_equal(dl, 10000000);
    for (int i = 0; i < 40; i++) {
        ap_swarm_balancer_report(b, &p, 0, 2, 20000, 0);
        assert_ok(ap_swarm_balancer_pick(b, 2, 0, &q, &dl));
    }
    print_message("deadline after 20 ms calls: %llu us\n", (unsigned long long)dl);
    assert_true(dl >= 40000 && dl <= 80000);
    uint64_t before = dl;
    for (int i = 0; i < 10; i++) ap_swarm_balancer_report(b, &p, 0, 2, 200000, 0);
    assert_ok(ap_swarm_balancer_pick(b, 2, 0, &q, &dl));
    assert_true(dl > before);
    for (int i = 0; i < 40; i++) ap_swarm_balancer_report(b, &p, 0, 2, 10, 0);
    assert_ok(ap_swarm_balancer_pick(b, 2, 0, &q, &dl));
    assert_int_equal(dl, 5000);
    for (int i = 0; i < 40; i++) ap_swarm_balancer_report(b, &p, 0, 2, 100000000, 0);
    assert_ok(ap_swarm_balancer_pick(b, 2, 0, &q, &dl));
    assert_int_equal(dl, 10000000);
    ap_swarm_balancer_free(b);
}

/* Bad arguments, empty balancer, removal, an expired record, the cap. */
static void test_edges(void **state)
{
    (void)state;
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(NULL);
    ap_peer_id_t p = pid(0), q;
    assert_int_equal(ap_swarm_balancer_pick(b, 1, 0, &q, NULL), AP_ENOTFOUND);
    assert_int_equal(ap_swarm_balancer_pick(b, 0, 0, &q, NULL), AP_EINVAL);
    assert_int_equal(ap_swarm_balancer_pick(b, NAN, 0, &q, NULL), AP_EINVAL);
    assert_ok(ap_swarm_balancer_update(b, &p, INFINITY, 10, 20)); /* already expired */
    assert_int_equal(ap_swarm_balancer_count(b), 0);
    assert_ok(ap_swarm_balancer_update(b, &p, NAN, 100, 0));
    assert_ok(ap_swarm_balancer_pick(b, 1, 50, &q, NULL));
    assert_int_equal(ap_swarm_balancer_pick(b, 1, 100, &q, NULL), AP_ENOTFOUND);
    assert_int_equal(ap_swarm_balancer_count(b), 0);
    assert_ok(ap_swarm_balancer_update(b, &p, 1, 100, 0));
    ap_swarm_balancer_remove(b, &p);
    ap_swarm_balancer_remove(b, &p);
    assert_int_equal(ap_swarm_balancer_count(b), 0);
    ap_swarm_balancer_report(b, &p, AP_EPROTO, 1, 1, 0); /* unknown: ignored */
    assert_int_equal(ap_swarm_balancer_info(b, &p, 0, &(ap_swarm_server_info_t){0}), AP_ENOTFOUND);
    int rc = 0, i;
    for (i = 0; i <= AP_SWARM_BALANCER_MAX && rc == 0; i++) {
        ap_peer_id_t r = pid(i);
        r.b[10] = (uint8_t)(i >> 8); /* distinct bytes; validity not needed here */
        r.b[11] = (uint8_t)i;
        rc = ap_swarm_balancer_update(b, &r, 1, FAR, 0);
    }
    assert_int_equal(rc, AP_ELIMIT);
    assert_int_equal(ap_swarm_balancer_count(b), AP_SWARM_BALANCER_MAX);
    /* Removing from the middle keeps the heap consistent: all still picked. */
    for (i = 0; i < 100; i++) {
        ap_peer_id_t r = pid(i);
        r.b[10] = (uint8_t)(i >> 8);
        r.b[11] = (uint8_t)i;
        ap_swarm_balancer_remove(b, &r);
    }
    for (i = 0; i < 3 * AP_SWARM_BALANCER_MAX; i++)
        assert_ok(ap_swarm_balancer_pick(b, 1, 0, &q, NULL));
    ap_swarm_balancer_free(b);
    ap_swarm_balancer_free(NULL);
}

/* Servers whose accumulated keys differ only by rounding (throughputs equal
 * to 1e-12) tie and take turns in the order they were first seen. */
static void test_ties(void **state)
{
    (void)state;
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(NULL);
    assert_non_null(b);
    const double v[3] = {10.0, 10.0 * (1 + 1e-12), 10.0 * (1 - 1e-12)};
    for (int i = 0; i < 3; i++) {
        ap_peer_id_t p = pid(i);
        assert_ok(ap_swarm_balancer_update(b, &p, v[i], FAR, 0));
    }
    int count[3] = {0};
    for (int k = 0; k < 300; k++) {
        ap_peer_id_t p;
        assert_ok(ap_swarm_balancer_pick(b, 1.0, 0, &p, NULL));
        const int w = which(&p, 3);
        assert_int_equal(w, k % 3);
        count[w]++;
    }
    assert_int_equal(count[0], 100);
    assert_int_equal(count[2], 100);
    ap_swarm_balancer_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shares_and_kill),
        cmocka_unit_test(test_ban_until_newer_record),
        cmocka_unit_test(test_timeout_no_ban),
        cmocka_unit_test(test_lying_announcement),
        cmocka_unit_test(test_deadlines),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_ties),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
