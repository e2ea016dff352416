/* BTARD verification primitives: part hashes, directions, clipped
 * projections and their sum at a CenteredClip fixed point (and away from
 * it), seeded minibatches, validator choice, gradient matching. */
#include "aptest.h"

#include "apiary/btard.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static void test_hash(void **st)
{
    (void)st;
    float a[5] = {1, 2, 3, 4, 5}, b[5] = {1, 2, 3, 4, 5};
    uint8_t ha[32], hb[32], hc[32];
    ap_btard_hash_floats(a, 5, ha);
    ap_btard_hash_floats(b, 5, hb);
    assert_memory_equal(ha, hb, 32);
    b[4] = nextafterf(5, 6); /* one ulp */
    ap_btard_hash_floats(b, 5, hb);
    assert_memory_not_equal(ha, hb, 32);
    ap_btard_hash_floats(a, 4, hc); /* a prefix is another commitment */
    assert_memory_not_equal(ha, hc, 32);
    float z0 = 0.0f, z1 = -0.0f; /* the bytes are committed, not the value */
    ap_btard_hash_floats(&z0, 1, ha);
    ap_btard_hash_floats(&z1, 1, hb);
    assert_memory_not_equal(ha, hb, 32);
}

static void test_direction(void **st)
{
    (void)st;
    uint8_t s1[32] = {1}, s2[32] = {2};
    enum { D = 300 };
    float z[D], z2[D], z3[D];
    ap_btard_direction(s1, 0, D, z);
    ap_btard_direction(s1, 0, D, z2);
    assert_memory_equal(z, z2, sizeof z);
    double n2 = 0;
    int pos = 0;
    for (int k = 0; k < D; k++) {
        n2 += (double)z[k] * z[k];
        pos += z[k] > 0;
    }
    assert_true(fabs(n2 - 1) < 1e-5);
    assert_true(pos > 100 && pos < 200);
    ap_btard_direction(s1, 1, D, z2);
    ap_btard_direction(s2, 0, D, z3);
    assert_memory_not_equal(z, z2, sizeof z);
    assert_memory_not_equal(z, z3, sizeof z);
}

static void test_projection_check(void **st)
{
    (void)st;
    enum { N = 10, D = 40 };
    uint64_t r = 5;
    float *x[N];
    for (int i = 0; i < N; i++) {
        x[i] = malloc(D * sizeof(float));
        for (int k = 0; k < D; k++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            double u = (double)(r >> 11) / 9007199254740992.0 - 0.5;
            x[i][k] = (float)(i >= 8 ? 50 * u : u);
        }
    }
    float v[D], vbad[D], z[D];
    ap_btard_clip_cfg_t cfg = {.tau = 0.5, .max_iter = 5000, .eps = 1e-7};
    ap_btard_clip_stats_t sts;
    assert_ok(ap_btard_clip(NULL, (const float *const *)x, NULL, N, D, &cfg, v, &sts));
    assert_true(sts.converged);
    uint8_t seed[32] = {9};
    int caught = 0;
    for (uint32_t part = 0; part < 20; part++) {
        ap_btard_direction(seed, part, D, z);
        double proj[N], dist;
        for (int i = 0; i < N; i++) ap_btard_clip_proj(x[i], v, z, D, cfg.tau, &dist, &proj[i]);
        assert_true(ap_btard_proj_sum_ok(proj, NULL, N, 1e-5));
        /* an aggregate moved by delta (|delta| = tau / 2) fails for most directions */
        for (int k = 0; k < D; k++) vbad[k] = v[k] + (k % 2 ? 0.5f : -0.5f) * 0.5f / sqrtf(D);
        for (int i = 0; i < N; i++) ap_btard_clip_proj(x[i], vbad, z, D, cfg.tau, &dist, &proj[i]);
        caught += !ap_btard_proj_sum_ok(proj, NULL, N, 1e-5);
    }
    assert_true(caught >= 18);
    /* dist and the clip factor */
    float a[2] = {3, 4}, o[2] = {0, 0}, e[2] = {1, 0};
    double dist, p;
    ap_btard_clip_proj(a, o, e, 2, 10, &dist, &p);
    assert_true(dist == 5 && p == 3);
    ap_btard_clip_proj(a, o, e, 2, 1, &dist, &p);
    assert_true(fabs(p - 0.6) < 1e-12);
    double bad[2] = {NAN, 0};
    assert_false(ap_btard_proj_sum_ok(bad, NULL, 2, 1));
    for (int i = 0; i < N; i++) free(x[i]);
}

static void test_minibatch(void **st)
{
    (void)st;
    uint8_t seed[32] = {3};
    uint64_t a[4000], b[4000];
    ap_btard_minibatch(seed, 4, 10, 4000, a);
    ap_btard_minibatch(seed, 4, 10, 4000, b);
    assert_memory_equal(a, b, sizeof a);
    int cnt[10] = {0};
    for (int j = 0; j < 4000; j++) {
        assert_true(a[j] < 10);
        cnt[a[j]]++;
    }
    for (int c = 0; c < 10; c++) assert_true(cnt[c] > 300 && cnt[c] < 500);
    ap_btard_minibatch(seed, 5, 10, 4000, b);
    assert_memory_not_equal(a, b, sizeof a);
}

static void test_validators(void **st)
{
    (void)st;
    uint8_t seed[32] = {4};
    uint32_t v[16], t[16];
    int as_target[16] = {0};
    for (int s = 0; s < 200; s++) {
        seed[1] = (uint8_t)s;
        assert_ok(ap_btard_pick_validators(seed, 16, 5, v, t));
        for (int j = 0; j < 5; j++) {
            assert_true(v[j] < 16 && t[j] < 16 && v[j] != t[j]);
            for (int q = 0; q < j; q++) assert_true(v[q] != v[j]);
            as_target[t[j]]++;
        }
    }
    for (int i = 0; i < 16; i++) assert_true(as_target[i] > 20); /* ~62 each */
    assert_ok(ap_btard_pick_validators(seed, 2, 2, v, t));
    assert_true(t[0] == v[1] && t[1] == v[0]);
    assert_int_equal(ap_btard_pick_validators(seed, 1, 1, v, t), AP_EINVAL);
    assert_int_equal(ap_btard_pick_validators(seed, 4, 5, v, t), AP_EINVAL);
}

static void test_grad_match(void **st)
{
    (void)st;
    float a[3] = {1, 2, 3}, b[3] = {1, 2, 3.0001f}, c[3] = {1, 2, NAN};
    assert_true(ap_btard_grad_match(a, a, 3, 0, 0));
    assert_true(ap_btard_grad_match(b, a, 3, 1e-4, 0));
    assert_false(ap_btard_grad_match(b, a, 3, 1e-6, 0));
    assert_false(ap_btard_grad_match(c, a, 3, 1, 1));
    assert_false(ap_btard_grad_match(a, c, 3, 1, 1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hash),
        cmocka_unit_test(test_direction),
        cmocka_unit_test(test_projection_check),
        cmocka_unit_test(test_minibatch),
        cmocka_unit_test(test_validators),
        cmocka_unit_test(test_grad_match),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
