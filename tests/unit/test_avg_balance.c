/* DeDLOC load balancing: LP vs closed form, optimality against an independent
 * bisection on the formulas, canonical tie-break, min share, rounding;
 * and the default chunk size a group's links imply. */
#include "aptest.h"

#include "apiary/avg.h"
#include "averaging/allreduce.h"
#include "base/arena.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state;
static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rnd01(void)
{
    return (double)(rnd() >> 11) / 9007199254740992.0;
}

/* Loads straight from the formulas (P = 1). */
static void loads(const ap_avg_bw_t *p, size_t n, size_t i, double a, double *up, double *down)
{
    size_t ns = 0, nr = 0;
    for (size_t j = 0; j < n; j++) {
        ns += p[j].role != AP_AVG_AUX;
        nr += p[j].role != AP_AVG_AUX;
    }
    bool s = p[i].role != AP_AVG_AUX, r = s;
    *up = (s ? 1 - a : 0) + a * (double)(nr - r);
    *down = (r ? 1 - a : 0) + a * (double)(ns - s);
}

/* Independent optimum: bisection on T, feasibility = per-peer intervals of a
 * (loads are linear in a) whose bounds straddle Σ a = 1. */
static bool feasible(const ap_avg_bw_t *p, size_t n, double t)
{
    double slo = 0, shi = 0;
    for (size_t i = 0; i < n; i++) {
        double u0, d0, u1, d1;
        loads(p, n, i, 0, &u0, &d0);
        loads(p, n, i, 1, &u1, &d1);
        double lo = 0, hi = p[i].role == AP_AVG_CLIENT ? 0 : 1;
        const double l0[2] = {u0, d0}, l1[2] = {u1, d1}, b[2] = {p[i].up, p[i].down};
        for (int k = 0; k < 2; k++) {
            double cap = b[k] * t, slope = l1[k] - l0[k];
            if (slope > 0)
                hi = fmin(hi, (cap - l0[k]) / slope);
            else if (slope < 0)
                lo = fmax(lo, (cap - l0[k]) / slope);
            else if (l0[k] > cap)
                return false;
        }
        if (lo > hi) return false;
        slo += lo;
        shi += hi;
    }
    return slo <= 1 && shi >= 1;
}

static double bisect(const ap_avg_bw_t *p, size_t n)
{
    double lo = 0, hi = 1;
    while (!feasible(p, n, hi)) hi *= 2;
    for (int it = 0; it < 200; it++) {
        double mid = 0.5 * (lo + hi);
        if (feasible(p, n, mid))
            hi = mid;
        else
            lo = mid;
    }
    return hi;
}

static void random_peers(ap_avg_bw_t *p, size_t n, bool symmetric)
{
    bool any_acc = false;
    size_t senders = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rnd() % 10;
        p[i].role = r < 6 ? AP_AVG_NORMAL : r < 8 ? AP_AVG_CLIENT : AP_AVG_AUX;
        p[i].up = 1e6 * pow(100.0, rnd01()); /* 1 MB/s .. 100 MB/s */
        p[i].down = symmetric ? p[i].up : 1e6 * pow(100.0, rnd01());
        any_acc |= p[i].role != AP_AVG_CLIENT;
        senders += p[i].role != AP_AVG_AUX;
    }
    if (!any_acc) p[0].role = AP_AVG_NORMAL;
    if (senders < 2) p[0].role = p[n - 1].role = AP_AVG_NORMAL;
}

static void check_split(const ap_avg_bw_t *p, size_t n, const double *a, double t)
{
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        assert_true(a[i] >= 0);
        if (p[i].role == AP_AVG_CLIENT) assert_true(a[i] == 0);
        sum += a[i];
    }
    assert_true(fabs(sum - 1) < 1e-12);
    double ts;
    assert_ok(ap_avg_split_time(p, n, a, &ts));
    assert_true(ts <= t * (1 + 1e-6));
}

static void test_lp_matches_closed_form(void **state)
{
    (void)state;
    rng_state = ap_test_seed(6);
    ap_avg_bw_t p[40];
    double a1[40], a2[40];
    for (int trial = 0; trial < (ap_test_sanitized() ? 60 : 300); trial++) {
        size_t n = 2 + rnd() % 39;
        random_peers(p, n, true);
        double t1, t2;
        assert_ok(ap_avg_balance(p, n, NULL, a1, &t1));
        assert_ok(ap_avg_balance_closed_form(p, n, a2, &t2));
        if (fabs(t1 - t2) > 1e-6 * t2)
            fail_msg("trial %d n %zu: lp %.12g cf %.12g", trial, n, t1, t2);
        for (size_t i = 0; i < n; i++)
            if (fabs(a1[i] - a2[i]) > 1e-6)
                fail_msg("trial %d share %zu: %g vs %g", trial, i, a1[i], a2[i]);
        check_split(p, n, a1, t1);
        check_split(p, n, a2, t2);
    }
}

static void test_lp_optimal_asymmetric(void **state)
{
    (void)state;
    rng_state = ap_test_seed(7) + 1;
    ap_avg_bw_t p[32];
    double a[32], b[32];
    for (int trial = 0; trial < (ap_test_sanitized() ? 60 : 300); trial++) {
        size_t n = 1 + rnd() % 32;
        random_peers(p, n, false);
        if (n == 1) p[0].role = AP_AVG_NORMAL;
        double t;
        assert_ok(ap_avg_balance(p, n, NULL, a, &t));
        double tb = bisect(p, n);
        if (fabs(t - tb) > 1e-6 * tb + 1e-30)
            fail_msg("trial %d n %zu: lp %.12g bisect %.12g", trial, n, t, tb);
        check_split(p, n, a, t);
        /* no random feasible split beats it */
        for (int k = 0; k < 20; k++) {
            double s = 0;
            for (size_t i = 0; i < n; i++) {
                b[i] = p[i].role == AP_AVG_CLIENT ? 0 : rnd01();
                s += b[i];
            }
            if (s == 0) continue;
            for (size_t i = 0; i < n; i++) b[i] /= s;
            double tr;
            assert_ok(ap_avg_split_time(p, n, b, &tr));
            assert_true(tr >= tb * (1 - 1e-9) - 1e-30);
        }
        /* deterministic: same inputs, bit-identical split */
        double t2;
        assert_ok(ap_avg_balance(p, n, NULL, b, &t2));
        assert_memory_equal(a, b, n * sizeof *a);
        assert_true(t == t2);
    }
}

static void test_known_instances(void **state)
{
    (void)state;
    double a[8], t;
    /* 4 equal normal peers, b = 1: T = (2n − 2)/Σb = 1.5, a = 1/4 */
    ap_avg_bw_t eq[4];
    for (int i = 0; i < 4; i++) eq[i] = (ap_avg_bw_t){AP_AVG_NORMAL, 1, 1};
    assert_ok(ap_avg_balance(eq, 4, NULL, a, &t));
    assert_true(fabs(t - 1.5) < 1e-6);
    for (int i = 0; i < 4; i++) assert_true(fabs(a[i] - 0.25) < 1e-6);
    /* 3 normal + 1 client: T = 5/3, a = 1/3 for the normal peers */
    eq[3].role = AP_AVG_CLIENT;
    assert_ok(ap_avg_balance(eq, 4, NULL, a, &t));
    assert_true(fabs(t - 5.0 / 3) < 1e-6);
    for (int i = 0; i < 3; i++) assert_true(fabs(a[i] - 1.0 / 3) < 1e-6);
    assert_true(a[3] == 0);
    /* Many optima: 2 normal + 1 aux, b = 1. T* = 1; the normal peers may take
     * any share, the aux at most 1/2. Canonical: the same fraction θ = 0.4 of
     * each interval -> 0.4, 0.4, 0.2. */
    ap_avg_bw_t amb[3] = {{AP_AVG_NORMAL, 1, 1}, {AP_AVG_NORMAL, 1, 1}, {AP_AVG_AUX, 1, 1}};
    assert_ok(ap_avg_balance(amb, 3, NULL, a, &t));
    assert_true(fabs(t - 1) < 1e-6);
    assert_true(fabs(a[0] - 0.4) < 1e-6 && fabs(a[1] - 0.4) < 1e-6 && fabs(a[2] - 0.2) < 1e-6);
    /* 10x bandwidth differences: the fast peer reduces more than its equal share */
    ap_avg_bw_t het[5] = {{AP_AVG_NORMAL, 125e6, 125e6},
                          {AP_AVG_NORMAL, 12.5e6, 12.5e6},
                          {AP_AVG_NORMAL, 12.5e6, 12.5e6},
                          {AP_AVG_NORMAL, 2.5e6, 2.5e6},
                          {AP_AVG_CLIENT, 12.5e6, 12.5e6}};
    double eqs[5] = {0.25, 0.25, 0.25, 0.25, 0}, teq;
    assert_ok(ap_avg_balance(het, 5, NULL, a, &t));
    assert_ok(ap_avg_split_time(het, 5, eqs, &teq));
    /* the slow sender bounds T (it must upload its whole vector): it reduces
     * nothing, and equal parts are > 1.5x slower */
    assert_true(fabs(t - 1 / 2.5e6) < 1e-6 * t);
    assert_true(a[3] == 0 && a[4] == 0);
    assert_true(teq / t > 1.5);
    /* slow peer as auxiliary: T = 1/12.5e6 (the 100 Mbit senders' own upload);
     * they have no slack left, so the 1000 Mbit peer reduces almost all and
     * the aux up to what its link allows at T: b·T/|S| = 2.5·0.08/4 = 0.05 */
    het[3].role = AP_AVG_AUX;
    assert_ok(ap_avg_balance(het, 5, NULL, a, &t));
    assert_true(fabs(t - 1 / 12.5e6) < 1e-6 * t);
    assert_true(a[1] == 0 && a[2] == 0 && a[4] == 0);
    /* canonical: both at θ = 1/1.05 of their intervals [0,1] and [0,0.05] */
    assert_true(fabs(a[3] - 0.05 / 1.05) < 1e-6 && fabs(a[0] - 1 / 1.05) < 1e-6);
}

static void test_min_share(void **state)
{
    (void)state;
    ap_avg_bw_t p[4] = {{AP_AVG_NORMAL, 10, 10},
                        {AP_AVG_NORMAL, 10, 10},
                        {AP_AVG_NORMAL, 10, 10},
                        {AP_AVG_AUX, 0.3, 0.3}};
    double a[4], t, t0;
    assert_ok(ap_avg_balance(p, 4, NULL, a, &t0));
    assert_true(a[3] > 0 && a[3] < 0.1);
    ap_avg_balance_opts_t o = {.min_share = 0.1};
    assert_ok(ap_avg_balance(p, 4, &o, a, &t));
    assert_true(a[3] == 0);
    assert_true(fabs(a[0] + a[1] + a[2] - 1) < 1e-12);
    for (int i = 0; i < 3; i++) assert_true(a[i] >= 0.1);
    assert_true(t >= t0 * (1 - 1e-9));
}

static void test_round_counts(void **state)
{
    (void)state;
    uint64_t c[64];
    double third[3] = {1.0 / 3, 1.0 / 3, 1.0 / 3};
    assert_ok(ap_avg_round_counts(third, 3, 10, c));
    assert_true(c[0] == 4 && c[1] == 3 && c[2] == 3);
    double sh[64];
    rng_state = ap_test_seed(8) + 2;
    for (int trial = 0; trial < 500; trial++) {
        size_t n = 1 + rnd() % 64;
        double s = 0;
        for (size_t i = 0; i < n; i++) {
            sh[i] = rnd() % 4 == 0 ? 0 : rnd01();
            s += sh[i];
        }
        if (s == 0) sh[0] = s = 1;
        for (size_t i = 0; i < n; i++) sh[i] /= s;
        uint64_t total = rnd() % 3 ? rnd() % 100000 : (rnd() % (1ull << 36));
        assert_ok(ap_avg_round_counts(sh, n, total, c));
        uint64_t sum = 0;
        for (size_t i = 0; i < n; i++) {
            sum += c[i];
            if (sh[i] == 0) assert_true(c[i] == 0);
            double q = sh[i] * (double)total;
            assert_true(fabs((double)c[i] - q) < 1.0 + 1e-6 * q);
        }
        assert_true(sum == total);
    }
    double bad[2] = {0.5, NAN};
    assert_int_equal(ap_avg_round_counts(bad, 2, 10, c), AP_EINVAL);
    double zero[2] = {0, 0};
    assert_int_equal(ap_avg_round_counts(zero, 2, 10, c), AP_EINVAL);
}

static void test_bad_input(void **state)
{
    (void)state;
    double a[3], t;
    ap_avg_bw_t p[3] = {{AP_AVG_NORMAL, 1, 1}, {AP_AVG_NORMAL, 0, 1}, {AP_AVG_NORMAL, 1, 1}};
    assert_int_equal(ap_avg_balance(p, 3, NULL, a, &t), AP_EINVAL);
    p[1].up = NAN;
    assert_int_equal(ap_avg_balance(p, 3, NULL, a, &t), AP_EINVAL);
    p[1].up = 1;
    p[0].role = p[1].role = p[2].role = AP_AVG_CLIENT; /* nobody accepts */
    assert_int_equal(ap_avg_balance(p, 3, NULL, a, &t), AP_EINVAL);
    p[0].role = p[1].role = p[2].role = AP_AVG_AUX; /* nobody sends */
    assert_int_equal(ap_avg_balance(p, 3, NULL, a, &t), AP_EINVAL);
    p[0].role = 7;
    assert_int_equal(ap_avg_balance(p, 3, NULL, a, &t), AP_EINVAL);
    assert_int_equal(ap_avg_balance(p, 0, NULL, a, &t), AP_EINVAL);
    ap_avg_bw_t asym[2] = {{AP_AVG_NORMAL, 1, 2}, {AP_AVG_NORMAL, 1, 1}};
    assert_int_equal(ap_avg_balance_closed_form(asym, 2, a, &t), AP_ENOTSUP);
}

static void test_moshpit_key(void **state)
{
    (void)state;
    uint8_t k1[32], k2[32];
    uint32_t a[3] = {1, 2, 3}, b[3] = {9, 2, 3}, c[3] = {1, 7, 3};
    /* round 0: dimension 0 is active, so it does not enter the key */
    assert_ok(ap_avg_moshpit_key("x", a, 3, 0, k1));
    assert_ok(ap_avg_moshpit_key("x", b, 3, 0, k2));
    assert_memory_equal(k1, k2, 32);
    assert_ok(ap_avg_moshpit_key("x", c, 3, 0, k2));
    assert_memory_not_equal(k1, k2, 32);
    /* round 1: dimension 1 active: a and c meet, a and b do not */
    assert_ok(ap_avg_moshpit_key("x", a, 3, 1, k1));
    assert_ok(ap_avg_moshpit_key("x", c, 3, 1, k2));
    assert_memory_equal(k1, k2, 32);
    assert_ok(ap_avg_moshpit_key("x", b, 3, 1, k2));
    assert_memory_not_equal(k1, k2, 32);
    /* the round (same active dimension, round 4 vs 1) and the prefix separate runs */
    assert_ok(ap_avg_moshpit_key("x", a, 3, 4, k2));
    assert_memory_not_equal(k1, k2, 32);
    assert_ok(ap_avg_moshpit_key("y", a, 3, 1, k2));
    assert_memory_not_equal(k1, k2, 32);
    assert_ok(ap_avg_moshpit_advance(a, 3, 4, 5)); /* 4 mod 3 = dimension 1 */
    assert_true(a[0] == 1 && a[1] == 5 && a[2] == 3);
    assert_int_equal(ap_avg_moshpit_key("x", a, 0, 0, k1), AP_EINVAL);
    assert_int_equal(ap_avg_moshpit_advance(a, 9, 0, 0), AP_EINVAL);
}

/* chunk_elems = 0: the slowest declared link's 5 ms, a power of two in
 * [4096, 16384]; every member computes it from the same group. */
static uint32_t chunk_for(const double *mbit_up, const double *mbit_down, size_t n)
{
    ap_avg_member_t m[8];
    memset(m, 0, sizeof m);
    for (size_t i = 0; i < n; i++) {
        m[i].id.b[0] = (uint8_t)i;
        m[i].up = mbit_up[i] * 125000.0;
        m[i].down = mbit_down[i] * 125000.0;
    }
    ap_avg_group_t g = {.members = m, .n = n};
    return ap__avg_auto_chunk(&g);
}

static void test_auto_chunk(void **state)
{
    (void)state;
    double gbit[4] = {8000, 8000, 8000, 8000}, m100[4] = {100, 100, 100, 100};
    double m200[2] = {200, 200}, m50[2] = {50, 50}, m20[1] = {20};
    assert_int_equal(chunk_for(gbit, gbit, 4), 16384);
    assert_int_equal(chunk_for(m200, m200, 2), 16384);
    assert_int_equal(chunk_for(m100, m100, 4), 8192);
    assert_int_equal(chunk_for(m50, m50, 2), 4096);
    assert_int_equal(chunk_for(m20, m20, 1), 4096);
    /* the slowest direction of the slowest member decides */
    double up[4] = {1000, 100, 100, 20}, down[4] = {1000, 1000, 1000, 1000};
    assert_int_equal(chunk_for(up, down, 4), 4096);
    double up2[2] = {8000, 8000}, down2[2] = {8000, 100};
    assert_int_equal(chunk_for(up2, down2, 2), 8192);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lp_matches_closed_form),
        cmocka_unit_test(test_lp_optimal_asymmetric),
        cmocka_unit_test(test_known_instances),
        cmocka_unit_test(test_min_share),
        cmocka_unit_test(test_round_counts),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_moshpit_key),
        cmocka_unit_test(test_auto_chunk),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
