/* CenteredClip: the weighted mean when nothing is clipped, the fixed-point
 * identity at the output, bounded influence of far-away inputs, AVX2 ==
 * scalar bit for bit, the median start, bad input. */
#include "aptest.h"

#include "apiary/btard.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rs = 1;
static uint64_t rnd(void)
{
    uint64_t z = (rs += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double unif(void)
{
    return ((double)(rnd() >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void)
{
    return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif());
}

typedef struct set {
    size_t n, d;
    float **x;
    double *w;
} set_t;

static set_t set_new(size_t n, size_t d)
{
    set_t s = {n, d, calloc(n, sizeof(float *)), calloc(n, sizeof(double))};
    for (size_t i = 0; i < n; i++) {
        s.x[i] = calloc(d, sizeof(float));
        s.w[i] = 1;
    }
    return s;
}
static void set_free(set_t *s)
{
    for (size_t i = 0; i < s->n; i++) free(s->x[i]);
    free(s->x);
    free(s->w);
}
static const float *const *X(const set_t *s)
{
    return (const float *const *)s->x;
}

static double dist(const float *a, const double *b, size_t d)
{
    double s = 0;
    for (size_t k = 0; k < d; k++) s += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
    return sqrt(s);
}

/* weighted mean of inputs [i0, i1) */
static void wmean(const set_t *s, size_t i0, size_t i1, double *m)
{
    double W = 0;
    for (size_t k = 0; k < s->d; k++) m[k] = 0;
    for (size_t i = i0; i < i1; i++) {
        W += s->w[i];
        for (size_t k = 0; k < s->d; k++) m[k] += s->w[i] * s->x[i][k];
    }
    for (size_t k = 0; k < s->d; k++) m[k] /= W;
}

static void test_no_clip_is_weighted_mean(void **st)
{
    (void)st;
    rs = ap_test_seed(11);
    size_t n = 9, d = 37;
    set_t s = set_new(n, d);
    for (size_t i = 0; i < n; i++) {
        s.w[i] = 0.1 + 3 * unif();
        for (size_t k = 0; k < d; k++) s.x[i][k] = (float)(1 + gauss());
    }
    double *m = calloc(d, sizeof(double));
    wmean(&s, 0, n, m);
    float *out = calloc(d, sizeof(float));
    /* tau far above every distance from the median: one step is the mean */
    ap_btard_clip_cfg_t cfg = {.tau = 1e6, .max_iter = 1, .eps = 0};
    ap_btard_clip_stats_t sts;
    assert_ok(ap_btard_clip(NULL, X(&s), s.w, n, d, &cfg, out, &sts));
    assert_int_equal(sts.iters, 1);
    assert_int_equal(sts.clipped, 0);
    assert_int_equal(sts.excluded, 0);
    for (size_t k = 0; k < d; k++) assert_true(fabs(out[k] - m[k]) <= 1e-6 * (1 + fabs(m[k])));
    /* more steps from there do not move it (beyond rounding) */
    cfg = (ap_btard_clip_cfg_t){.tau = INFINITY, .max_iter = 50, .eps = 1e-9};
    assert_ok(ap_btard_clip(NULL, X(&s), s.w, n, d, &cfg, out, &sts));
    assert_true(sts.converged);
    assert_true(sts.iters <= 2);
    for (size_t k = 0; k < d; k++) assert_true(fabs(out[k] - m[k]) <= 1e-6 * (1 + fabs(m[k])));
    /* and with a small tau it is not the mean: the test can tell */
    s.x[0][0] += 100;
    wmean(&s, 0, n, m);
    cfg.tau = 0.5;
    cfg.max_iter = 1;
    assert_ok(ap_btard_clip(NULL, X(&s), s.w, n, d, &cfg, out, &sts));
    assert_true(sts.clipped > 0);
    assert_true(fabs(out[0] - m[0]) > 1);
    free(out);
    free(m);
    set_free(&s);
}

static void test_fixed_point(void **st)
{
    (void)st;
    rs = ap_test_seed(12);
    size_t n = 12, d = 50;
    set_t s = set_new(n, d);
    for (size_t i = 0; i < n; i++) {
        s.w[i] = 0.5 + unif();
        double scale = i < 3 ? 40 : 1; /* three far, heavy inputs */
        for (size_t k = 0; k < d; k++) s.x[i][k] = (float)(2 + scale * gauss());
    }
    float *out = calloc(d, sizeof(float));
    double *r = calloc(d, sizeof(double));
    ap_btard_clip_cfg_t cfg = {.tau = 2.0, .max_iter = 10000, .eps = 1e-10};
    ap_btard_clip_stats_t sts;
    assert_ok(ap_btard_clip(NULL, X(&s), s.w, n, d, &cfg, out, &sts));
    assert_true(sts.converged);
    assert_true(sts.clipped >= 3);
    double norm;
    assert_ok(ap_btard_clip_residual(X(&s), s.w, n, d, cfg.tau, out, r, &norm));
    /* float rounding of the output leaves ~1e-7 relative per coordinate */
    assert_true(norm < 1e-5);
    /* the identity is not trivially small: the weighted mean is no fixed point */
    double *m = calloc(d, sizeof(double));
    wmean(&s, 0, n, m);
    float *mf = calloc(d, sizeof(float));
    for (size_t k = 0; k < d; k++) mf[k] = (float)m[k];
    double norm_mean;
    assert_ok(ap_btard_clip_residual(X(&s), s.w, n, d, cfg.tau, mf, r, &norm_mean));
    assert_true(norm_mean > 1e-2);
    free(mf);
    free(m);
    free(r);
    free(out);
    set_free(&s);
}

static void unit_dir(double *dir, size_t d)
{
    double nd = 0;
    for (size_t k = 0; k < d; k++) {
        dir[k] = gauss();
        nd += dir[k] * dir[k];
    }
    for (size_t k = 0; k < d; k++) dir[k] /= sqrt(nd);
}

/* b of n inputs moved arbitrarily far (all in one direction, the worst case,
 * or each its own): |v - honest mean| <= b tau / (n - b). */
static void check_influence(size_t n, size_t b, bool same_dir, double far)
{
    size_t d = 24;
    double tau = 1.0;
    set_t s = set_new(n, d);
    double *dir = calloc(d, sizeof(double));
    unit_dir(dir, d);
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < d; k++) s.x[i][k] = (float)(-3 + 0.03 * gauss());
    for (size_t i = n - b; i < n; i++) {
        if (!same_dir) {
            unit_dir(dir, d);
        }
        for (size_t k = 0; k < d; k++) s.x[i][k] = (float)(s.x[i][k] + far * dir[k]);
    }
    double *mh = calloc(d, sizeof(double));
    wmean(&s, 0, n - b, mh);
    float *out = calloc(d, sizeof(float));
    ap_btard_clip_cfg_t cfg = {.tau = tau, .max_iter = 20000, .eps = 1e-9};
    ap_btard_clip_stats_t sts;
    assert_ok(ap_btard_clip(NULL, X(&s), NULL, n, d, &cfg, out, &sts));
    assert_true(sts.converged);
    assert_true(sts.clipped >= (int)b);
    double *o = calloc(d, sizeof(double));
    for (size_t k = 0; k < d; k++) o[k] = out[k];
    double err = 0;
    for (size_t k = 0; k < d; k++) err += (o[k] - mh[k]) * (o[k] - mh[k]);
    err = sqrt(err);
    double bound = (double)b * tau / (double)(n - b);
    if (err > bound + 1e-4)
        fail_msg("n=%zu b=%zu far=%g: |v - mean| = %g > %g", n, b, far, err, bound);
    /* honest inputs stay within tau of the result (the bound's premise) */
    for (size_t i = 0; i < n - b; i++) assert_true(dist(s.x[i], o, d) <= tau);
    /* the plain mean is dragged away: the test can fail */
    double *ma = calloc(d, sizeof(double));
    wmean(&s, 0, n, ma);
    double errm = 0;
    for (size_t k = 0; k < d; k++) errm += (ma[k] - mh[k]) * (ma[k] - mh[k]);
    if (same_dir && far >= 1e3) assert_true(sqrt(errm) > 10 * bound);
    free(ma);
    free(o);
    free(out);
    free(mh);
    free(dir);
    set_free(&s);
}

static void test_bounded_influence(void **st)
{
    (void)st;
    rs = ap_test_seed(13);
    const size_t bs[] = {1, 3, 7};
    const double fars[] = {10, 1e3, 1e6, 1e30};
    for (size_t bi = 0; bi < 3; bi++)
        for (size_t fi = 0; fi < 4; fi++) {
            check_influence(16, bs[bi], true, fars[fi]);
            check_influence(16, bs[bi], false, fars[fi]);
        }
    check_influence(5, 2, true, 1e4);
}

static void test_simd_equals_scalar(void **st)
{
    (void)st;
    ap_btard_force_scalar(false);
    if (strcmp(ap_btard_kernels_name(), "avx2") != 0) {
        printf("skipped: no AVX2 kernels on this CPU or APIARY_NO_SIMD set\n");
        return;
    }
    rs = ap_test_seed(14);
    const size_t ns[] = {1, 2, 5, 16, 33};
    const size_t ds[] = {1, 7, 8, 9, 15, 16, 17, 1000, 4099};
    ap_btard_clip_ws_t *ws = ap_btard_clip_ws_new();
    for (size_t a = 0; a < 5; a++)
        for (size_t b = 0; b < 9; b++) {
            size_t n = ns[a], d = ds[b];
            set_t s = set_new(n, d);
            for (size_t i = 0; i < n; i++) {
                s.w[i] = unif() < 0.2 ? 1 : unif() * 4;
                double sc = (i % 4 == 3) ? 1e4 : 1;
                for (size_t k = 0; k < d; k++)
                    s.x[i][k] = (float)(sc * gauss() / (fabs(gauss()) + 0.05));
            }
            float *o1 = calloc(d, sizeof(float)), *o2 = calloc(d, sizeof(float));
            ap_btard_clip_cfg_t cfg = {.tau = 0.5 + 3 * unif() * sqrt((double)d), 300, 1e-7};
            ap_btard_clip_stats_t s1, s2;
            ap_btard_force_scalar(true);
            assert_ok(ap_btard_clip(ws, X(&s), s.w, n, d, &cfg, o1, &s1));
            ap_btard_force_scalar(false);
            assert_ok(ap_btard_clip(ws, X(&s), s.w, n, d, &cfg, o2, &s2));
            if (memcmp(o1, o2, d * sizeof(float)) != 0) fail_msg("n=%zu d=%zu differ", n, d);
            assert_int_equal(s1.iters, s2.iters);
            assert_int_equal(s1.clipped, s2.clipped);
            assert_memory_equal(&s1.last_step, &s2.last_step, sizeof(double));
            free(o1);
            free(o2);
            set_free(&s);
        }
    ap_btard_clip_ws_free(ws);
}

static void test_median_start(void **st)
{
    (void)st;
    /* 0, 1, 100 with tau 0.5: median 1; the pulls of 0 and 100 cancel */
    float a = 0, b = 1, c = 100;
    const float *x[] = {&a, &b, &c};
    float out;
    ap_btard_clip_cfg_t cfg = {.tau = 0.5, .max_iter = 5, .eps = 0};
    ap_btard_clip_stats_t sts;
    assert_ok(ap_btard_clip(NULL, x, NULL, 3, 1, &cfg, &out, &sts));
    assert_true(fabsf(out - 1.0f) < 1e-6f);
    assert_int_equal(sts.clipped, 2);
    /* weighted: 10 on the value 100 moves the median there */
    double w[] = {1, 1, 10};
    cfg.max_iter = 1;
    assert_ok(ap_btard_clip(NULL, x, w, 3, 1, &cfg, &out, &sts));
    assert_true(out > 99 && out < 100);
    /* even count, equal weights: the midpoint */
    const float *x2[] = {&a, &b};
    cfg = (ap_btard_clip_cfg_t){.tau = 1e-3, .max_iter = 1, .eps = 0};
    assert_ok(ap_btard_clip(NULL, x2, NULL, 2, 1, &cfg, &out, &sts));
    assert_true(fabsf(out - 0.5f) < 1e-6f);
}

static void test_bad_input(void **st)
{
    (void)st;
    float a[2] = {1, 2}, b[2] = {NAN, 0}, c[2] = {3, INFINITY}, out[2];
    const float *x[] = {a, b, c};
    ap_btard_clip_cfg_t cfg = ap_btard_clip_cfg_default();
    ap_btard_clip_stats_t sts;
    assert_ok(ap_btard_clip(NULL, x, NULL, 3, 2, &cfg, out, &sts));
    assert_int_equal(sts.excluded, 2);
    assert_true(out[0] == 1 && out[1] == 2);
    const float *bad[] = {b, c};
    assert_int_equal(ap_btard_clip(NULL, bad, NULL, 2, 2, &cfg, out, &sts), AP_EINVAL);
    double w[] = {1, -1, 1};
    assert_int_equal(ap_btard_clip(NULL, x, w, 3, 2, &cfg, out, NULL), AP_EINVAL);
    double w0[] = {0, 1, 1};
    assert_int_equal(ap_btard_clip(NULL, x, w0, 3, 2, &cfg, out, NULL), AP_EINVAL);
    double wn[] = {1, NAN, 1};
    assert_int_equal(ap_btard_clip(NULL, x, wn, 3, 2, &cfg, out, NULL), AP_EINVAL);
    ap_btard_clip_cfg_t bc = cfg;
    bc.tau = 0;
    assert_int_equal(ap_btard_clip(NULL, x, NULL, 3, 2, &bc, out, NULL), AP_EINVAL);
    bc = cfg;
    bc.max_iter = 0;
    assert_int_equal(ap_btard_clip(NULL, x, NULL, 3, 2, &bc, out, NULL), AP_EINVAL);
    bc = cfg;
    bc.eps = NAN;
    assert_int_equal(ap_btard_clip(NULL, x, NULL, 3, 2, &bc, out, NULL), AP_EINVAL);
    assert_int_equal(ap_btard_clip(NULL, x, NULL, 0, 2, &cfg, out, NULL), AP_EINVAL);
    assert_int_equal(ap_btard_clip(NULL, x, NULL, 3, 0, &cfg, out, NULL), AP_EINVAL);
    assert_int_equal(ap_btard_clip(NULL, x, NULL, AP_BTARD_CLIP_MAX_INPUTS + 1, 2, &cfg, out, NULL),
                     AP_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_clip_is_weighted_mean),
        cmocka_unit_test(test_fixed_point),
        cmocka_unit_test(test_bounded_influence),
        cmocka_unit_test(test_simd_equals_scalar),
        cmocka_unit_test(test_median_start),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
