/* Codecs: bounds on many input shapes, fast path == scalar reference, NaN/Inf
 * rules, rand-k unbiasedness, top-k contraction, error feedback, bad input,
 * chunked tensors, policies. */
#include "aptest.h"

#include "apiary/compress.h"
#include "compress/kernels.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int ap__compress_encode_k(const ap__kernels_t *K, const ap_codec_cfg_t *cfg, const float *src,
                          size_t count, uint64_t offset, uint8_t *out, size_t cap, size_t *out_len);
bool ap__q8_plan(const ap__kernels_t *K, const float *src, size_t n, ap__q8_plan_t *plan,
                 double *lo, double *hi, float *sample, size_t *ns);

/* ---- test RNG ---- */
static uint64_t rs;
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

enum { IN_NORMAL, IN_HEAVY, IN_CONST, IN_ZERO, IN_TINY, IN_HUGE, IN_MIXED, IN__COUNT };
static const char *in_names[] = {"normal", "heavy", "const", "zero", "tiny", "huge", "mixed"};

static void fill(float *x, size_t n, int kind)
{
    for (size_t i = 0; i < n; i++) {
        double g = gauss();
        switch (kind) {
        case IN_NORMAL:
            x[i] = (float)(0.3 + 2 * g);
            break;
        case IN_HEAVY:
            x[i] = (float)(g / (fabs(gauss()) + 1e-3));
            break; /* ~Cauchy */
        case IN_CONST:
            x[i] = 3.25f;
            break;
        case IN_ZERO:
            x[i] = 0;
            break;
        case IN_TINY:
            x[i] = (float)(1e-41 * g);
            break; /* subnormal floats */
        case IN_HUGE:
            x[i] = (float)(1e37 * g);
            break;
        case IN_MIXED:
            x[i] = (float)(g * pow(10, (double)(rnd() % 12) - 6));
            break;
        }
    }
}

static const size_t N = 10007;
static const float *cached;
/* quantile plan cache for codec_bound */ /* not a multiple of 8 or of the block */

static double codec_bound(ap_codec_id_t id, const float *x, size_t n, size_t i, const uint8_t *enc)
{
    double xi = x[i];
    const uint8_t *p = enc + AP_COMPRESS_HDR_LEN;
    switch (id) {
    case AP_CODEC_FP16:
        if (fabs(xi) > 65504) return fabs(xi) - 65504;
        return fabs(xi) >= 6.103515625e-05 ? ldexp(fabs(xi), -11) : ldexp(1, -25);
    case AP_CODEC_BF16:
        return fabs(xi) >= ldexp(1, -126) ? ldexp(fabs(xi), -8) : ldexp(1, -134);
    case AP_CODEC_MEANSTD16: {
        float mean, std;
        memcpy(&mean, p, 4);
        memcpy(&std, p + 4, 4);
        if (std == 0) /* documented: std < ~2^-126 travels as the mean alone */
            return fabs(xi - mean) * 1.000001 + 1e-45;
        return 1.01 * ldexp(fabs(xi - mean), -11) + ldexp(std, -25) +
               ldexp(fabs(xi) + fabs(mean), -22) + 1e-45;
    }
    case AP_CODEC_UNIFORM8: {
        static double mean, std, mn, mx;
        if (cached != x) {
            double s = 0, q = 0;
            for (size_t j = 0; j < n; j++) s += x[j];
            mean = s / n;
            for (size_t j = 0; j < n; j++) q += (x[j] - mean) * (x[j] - mean);
            std = sqrt(q / n);
            mn = x[0], mx = x[0];
            for (size_t j = 0; j < n; j++) mn = fmin(mn, x[j]), mx = fmax(mx, x[j]);
            cached = x;
        }
        double lo = mean - 6 * std, hi = mean + 6 * std;
        double dist = xi < lo ? lo - xi : xi > hi ? xi - hi : 0;
        if (256 / (12 * std) > FLT_MAX) return mx - mn; /* documented: one bin */
        return 1.001 * 12 * std / 256 + dist + 1e-6 * fabs(xi) + 1e-44;
    }
    case AP_CODEC_QUANTILE8: {
        static ap__q8_plan_t plan;
        static double lo[256], hi[256];
        static float sample[AP_COMPRESS_Q8_SAMPLE];
        size_t m;
        if (cached != x) {
            assert_true(ap__q8_plan(&ap__kernels_scalar, x, n, &plan, lo, hi, sample, &m));
            cached = x;
        }
        int c = plan.lut[ap__q8_cell(&plan, x[i])];
        /* x lies in its code's range up to the rounding of the cell arithmetic */
        return (hi[c] - lo[c]) * 1.000001 + 2e-7 * (fabs(lo[c]) + fabs(hi[c])) + 1e-44;
    }
    case AP_CODEC_BLOCKWISE8: {
        size_t b = i / AP_COMPRESS_BLOCK;
        float a;
        memcpy(&a, p + 4 * b, 4);
        return 0.00785 * a + ldexp(fabs(xi), -22) + 1e-45;
    }
    default:
        return 0;
    }
}

static void check_roundtrip(ap_codec_id_t id, int kind)
{
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    fill(x, N, kind);
    cached = NULL;
    ap_codec_cfg_t cfg = {.id = id, .fraction = 0.05, .seed = 99};
    size_t cap = ap_compress_size(&cfg, N), len = 0;
    assert_true(cap > AP_COMPRESS_HDR_LEN || id == AP_CODEC_NONE);
    uint8_t *enc = malloc(cap), *enc2 = malloc(cap);
    assert_ok(ap_compress_encode(&cfg, x, N, 0, enc, cap, &len));
    assert_int_equal(len, cap);
    /* fast path produces the reference's bytes */
    size_t len2 = 0;
    assert_ok(ap__compress_encode_k(&ap__kernels_scalar, &cfg, x, N, 0, enc2, cap, &len2));
    assert_int_equal(len2, len);
    if (memcmp(enc, enc2, len) != 0)
        fail_msg("%s/%s: fast encode != scalar", ap_codec_name(id), in_names[kind]);
    ap_compress_hdr_t h;
    assert_ok(ap_compress_decode(enc, len, y, N, &h));
    assert_int_equal(h.codec, id);
    assert_int_equal(h.count, N);
    float *y2 = malloc(N * sizeof *y2);
    ap__compress_force_scalar(true);
    assert_ok(ap_compress_decode(enc, len, y2, N, NULL));
    ap__compress_force_scalar(false);
    if (memcmp(y, y2, N * 4) != 0)
        fail_msg("%s/%s: fast decode != scalar", ap_codec_name(id), in_names[kind]);
    if (id == AP_CODEC_TOPK) {
        double e2 = 0, x2 = 0;
        uint32_t k = ap_compress_k(&cfg, N);
        for (size_t i = 0; i < N; i++) {
            e2 += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
            x2 += (double)x[i] * x[i];
        }
        assert_true(e2 <= (1.0 - (double)k / N) * x2 * (1 + 1e-12) + 1e-300);
    } else if (id == AP_CODEC_RANDK) {
        uint32_t k = ap_compress_k(&cfg, N);
        float sc = (float)((double)N / k);
        size_t nz = 0;
        for (size_t i = 0; i < N; i++) {
            if (y[i] != 0 || (x[i] == 0 && y[i] == 0 && 0)) nz++;
            if (y[i] != 0) assert_true(y[i] == x[i] * sc);
        }
        if (kind == IN_NORMAL) assert_int_equal(nz, k);
    } else if (id == AP_CODEC_NONE) {
        assert_memory_equal(x, y, N * 4);
    } else {
        for (size_t i = 0; i < N; i++) {
            double err = fabs((double)y[i] - x[i]), b = codec_bound(id, x, N, i, enc);
            if (!(err <= b))
                fail_msg("%s/%s: |y-x| = %g > bound %g at %zu (x=%g y=%g)", ap_codec_name(id),
                         in_names[kind], err, b, i, x[i], y[i]);
        }
    }
    if (kind == IN_CONST || kind == IN_ZERO) {
        if (id == AP_CODEC_UNIFORM8 || id == AP_CODEC_QUANTILE8 || id == AP_CODEC_MEANSTD16 ||
            id == AP_CODEC_BLOCKWISE8 || id == AP_CODEC_FP16 || id == AP_CODEC_BF16)
            for (size_t i = 0; i < N; i++) assert_true(y[i] == x[i]);
    }
    free(x);
    free(y);
    free(y2);
    free(enc);
    free(enc2);
}

static void test_roundtrip_all(void **state)
{
    (void)state;
    rs = ap_test_seed(1);
    for (int id = 0; id < AP_CODEC__COUNT; id++)
        for (int kind = 0; kind < IN__COUNT; kind++) check_roundtrip((ap_codec_id_t)id, kind);
}

static void test_fast_matches_scalar_many(void **state)
{
    (void)state;
    if (!ap__kernels_avx2()) skip();
    rs = ap_test_seed(2);
    /* many lengths (tails), many scales */
    for (int it = 0; it < (ap_test_sanitized() ? 15 : 60); it++) {
        size_t n = 1 + rnd() % 9000;
        float *x = malloc(n * 4);
        fill(x, n, (int)(rnd() % IN__COUNT));
        for (int id = 1; id <= AP_CODEC_BLOCKWISE8; id++) {
            ap_codec_cfg_t cfg = {.id = (ap_codec_id_t)id};
            size_t cap = ap_compress_size(&cfg, n), l1, l2;
            uint8_t *a = malloc(cap), *b = malloc(cap);
            assert_ok(ap__compress_encode_k(ap__kernels_avx2(), &cfg, x, n, 0, a, cap, &l1));
            assert_ok(ap__compress_encode_k(&ap__kernels_scalar, &cfg, x, n, 0, b, cap, &l2));
            assert_int_equal(l1, l2);
            if (memcmp(a, b, l1))
                fail_msg("codec %s n=%zu: fast != scalar", ap_codec_name((ap_codec_id_t)id), n);
            free(a);
            free(b);
        }
        free(x);
    }
    /* blockwise: values within a few ulps of every threshold, several block
     * scales (the fast path's near-threshold detection must catch them) */
    {
        const float *P = ap__bw_probe();
        float scales[] = {1.0f, 3.7f, 1e-20f, 2.5e30f};
        for (size_t si = 0; si < 4; si++) {
            float v[2048];
            size_t n = 0;
            v[n++] = scales[si];
            for (int j = 1; j < 128; j++)
                for (int d = -4; d <= 4; d++) {
                    float t = P[j];
                    for (int k = 0; k < (d < 0 ? -d : d); k++)
                        t = nextafterf(t, d < 0 ? 0.0f : 2.0f);
                    v[n++] = (d & 1 ? -t : t) * scales[si];
                }
            uint8_t a[2048], b[2048];
            float amax = 0;
            ap__kernels_scalar.absmax(v, n, &amax);
            ap__kernels_avx2()->bw_codes(v, n, amax, a);
            ap__kernels_scalar.bw_codes(v, n, amax, b);
            assert_memory_equal(a, b, n);
        }
    }
    /* large chunks (grid/LUT fast paths engage above ~16K elements) */
    for (int kind = 0; kind < IN__COUNT; kind++) {
        size_t n = 70001;
        float *x = malloc(n * 4);
        fill(x, n, kind);
        for (int id = 1; id <= AP_CODEC_BLOCKWISE8; id++) {
            ap_codec_cfg_t cfg = {.id = (ap_codec_id_t)id};
            size_t cap = ap_compress_size(&cfg, n), l1, l2;
            uint8_t *a = malloc(cap), *b = malloc(cap);
            assert_ok(ap__compress_encode_k(ap__kernels_avx2(), &cfg, x, n, 0, a, cap, &l1));
            assert_ok(ap__compress_encode_k(&ap__kernels_scalar, &cfg, x, n, 0, b, cap, &l2));
            if (memcmp(a, b, l1))
                fail_msg("codec %s, %s input, n=%zu: fast != scalar",
                         ap_codec_name((ap_codec_id_t)id), in_names[kind], n);
            free(a);
            free(b);
        }
        free(x);
    }
    /* fp16/bf16 conversions on every float bit pattern class: random bits */
    int nbits = ap_test_sanitized() ? 20000 : 200000;
    for (int it = 0; it < nbits; it++) {
        uint32_t u = (uint32_t)rnd();
        float f;
        memcpy(&f, &u, 4);
        float buf[8] = {f, f, f, f, f, f, f, f};
        uint8_t o1[16], o2[16];
        ap__kernels_avx2()->f16_enc(buf, 8, o1);
        ap__kernels_scalar.f16_enc(buf, 8, o2);
        if (memcmp(o1, o2, 16)) fail_msg("f16 mismatch for 0x%08x", u);
        ap__kernels_avx2()->bf16_enc(buf, 8, o1); /* 8 < 16: scalar tail; use 16 below */
        float b16[16];
        for (int j = 0; j < 16; j++) b16[j] = f;
        uint8_t p1[32], p2[32];
        ap__kernels_avx2()->bf16_enc(b16, 16, p1);
        ap__kernels_scalar.bf16_enc(b16, 16, p2);
        if (memcmp(p1, p2, 32)) fail_msg("bf16 mismatch for 0x%08x", u);
        uint16_t h = (uint16_t)u;
        uint8_t hb[16];
        for (int j = 0; j < 8; j++) memcpy(hb + 2 * j, &h, 2);
        float d1[8], d2[8];
        ap__dmode_t m = {.add = false, .alpha = 1};
        ap__kernels_avx2()->f16_dec(hb, 8, d1, m);
        ap__kernels_scalar.f16_dec(hb, 8, d2, m);
        if (memcmp(d1, d2, 32)) fail_msg("f16 decode mismatch for 0x%04x", h);
    }
}

static void test_nonfinite(void **state)
{
    (void)state;
    float x[64];
    for (int i = 0; i < 64; i++) x[i] = (float)i - 30;
    x[5] = NAN;
    x[9] = INFINITY;
    x[10] = -INFINITY;
    uint8_t out[2048];
    size_t len;
    float y[64];
    ap_codec_cfg_t c = {.id = AP_CODEC_FP16};
    assert_ok(ap_compress_encode(&c, x, 64, 0, out, sizeof out, &len));
    assert_ok(ap_compress_decode(out, len, y, 64, NULL));
    assert_true(isnan(y[5]));
    assert_true(y[9] == 65504.0f && y[10] == -65504.0f);
    c.id = AP_CODEC_BF16;
    assert_ok(ap_compress_encode(&c, x, 64, 0, out, sizeof out, &len));
    assert_ok(ap_compress_decode(out, len, y, 64, NULL));
    assert_true(isnan(y[5]) && isinf(y[9]) && y[9] > 0 && isinf(y[10]) && y[10] < 0);
    float big = FLT_MAX;
    c.id = AP_CODEC_BF16;
    assert_ok(ap_compress_encode(&c, &big, 1, 0, out, sizeof out, &len));
    assert_ok(ap_compress_decode(out, len, y, 1, NULL));
    assert_true(isfinite(y[0]) && y[0] > 3e38f);
    c.id = AP_CODEC_NONE;
    assert_ok(ap_compress_encode(&c, x, 64, 0, out, sizeof out, &len));
    assert_ok(ap_compress_decode(out, len, y, 64, NULL));
    assert_true(isnan(y[5]) && isinf(y[9]));
    ap_codec_id_t lossy[] = {AP_CODEC_MEANSTD16, AP_CODEC_UNIFORM8, AP_CODEC_QUANTILE8,
                             AP_CODEC_BLOCKWISE8, AP_CODEC_TOPK};
    for (size_t i = 0; i < sizeof lossy / sizeof lossy[0]; i++) {
        c = (ap_codec_cfg_t){.id = lossy[i], .k = 4};
        assert_int_equal(ap_compress_encode(&c, x, 64, 0, out, sizeof out, &len), AP_ENONFINITE);
        float z[64];
        memcpy(z, x, sizeof z);
        z[5] = 0; /* only Inf left */
        assert_int_equal(ap_compress_encode(&c, z, 64, 0, out, sizeof out, &len), AP_ENONFINITE);
    }
    /* rand-k with every value NaN is refused */
    float nan8[8];
    for (int i = 0; i < 8; i++) nan8[i] = NAN;
    c = (ap_codec_cfg_t){.id = AP_CODEC_RANDK, .k = 2, .seed = 1};
    assert_int_equal(ap_compress_encode(&c, nan8, 8, 0, out, sizeof out, &len), AP_ENONFINITE);
}

/* The all-reduce's weighted-sum kernels: the scalar ones are the reference
 * C expressions (checked against them here), and AVX2 gives the same bits
 * for every length (tails) and alignment of the input. */
static void test_wsum_kernels(void **state)
{
    (void)state;
    rs = ap_test_seed(11);
    const ap__kernels_t *ks[2] = {&ap__kernels_scalar, ap__kernels_avx2()};
    enum { NMAX = 1000 };
    uint8_t *raw = malloc(4 * NMAX + 8);
    float *own = malloc(sizeof(float) * NMAX), *m1 = malloc(sizeof(float) * NMAX);
    double *acc = malloc(sizeof(double) * NMAX), *ref = malloc(sizeof(double) * NMAX);
    assert_true(raw && own && m1 && acc && ref);
    for (int it = 0; it < 40; it++) {
        size_t n = it < 20 ? (size_t)it : 1 + rnd() % NMAX;
        size_t mis = rnd() % 4; /* the payload's alignment in a message */
        float x[NMAX];
        for (size_t i = 0; i < n; i++) {
            x[i] = (float)((unif() - 0.5) * exp((unif() - 0.5) * 40));
            own[i] = (float)((unif() - 0.5) * 3);
        }
        memcpy(raw + mis, x, 4 * n);
        double w = unif() * 3 + 0.01, ow = unif() + 0.5, wt = w + ow + unif();
        for (int k = 0; k < 2; k++) {
            if (!ks[k]) continue;
            const ap__kernels_t *K = ks[k];
            assert_true(K->all_finite(raw + mis, n));
            K->wsum_init(acc, own, ow, raw + mis, n, w);
            for (size_t i = 0; i < n; i++) ref[i] = ow * own[i] + w * x[i];
            assert_memory_equal(acc, ref, n * sizeof(double));
            K->wsum_add(acc, raw + mis, n, w * 0.75);
            for (size_t i = 0; i < n; i++) ref[i] += w * 0.75 * x[i];
            assert_memory_equal(acc, ref, n * sizeof(double));
            K->wsum_init(acc, NULL, ow, raw + mis, n, w);
            for (size_t i = 0; i < n; i++) ref[i] = w * x[i];
            assert_memory_equal(acc, ref, n * sizeof(double));
            K->wsum_add(acc, own, n, ow);
            for (size_t i = 0; i < n; i++) ref[i] += ow * own[i];
            K->wsum_mean(m1, acc, n, wt);
            for (size_t i = 0; i < n; i++) {
                float r = (float)(ref[i] / wt);
                assert_memory_equal(&m1[i], &r, 4);
            }
            /* one non-finite value anywhere (also in a tail) is found */
            if (n) {
                size_t at = rnd() % n;
                float bad[3] = {NAN, INFINITY, -INFINITY};
                for (int b = 0; b < 3; b++) {
                    memcpy(raw + mis + 4 * at, &bad[b], 4);
                    assert_false(K->all_finite(raw + mis, n));
                }
                memcpy(raw + mis + 4 * at, &x[at], 4);
                float big = FLT_MAX, tiny = FLT_TRUE_MIN;
                memcpy(raw + mis + 4 * at, &big, 4);
                assert_true(K->all_finite(raw + mis, n));
                memcpy(raw + mis + 4 * at, &tiny, 4);
                assert_true(K->all_finite(raw + mis, n));
                memcpy(raw + mis + 4 * at, &x[at], 4);
            }
        }
    }
    free(raw);
    free(own);
    free(m1);
    free(acc);
    free(ref);
}

static void test_randk_unbiased(void **state)
{
    (void)state;
    rs = ap_test_seed(3);
    enum { D = 10, K = 5 };
    const int draws = 100000;
    float z[D];
    double mean[D] = {0}, sq = 0, z2 = 0;
    for (int i = 0; i < D; i++) {
        z[i] = (float)(gauss() + 0.5);
        z2 += (double)z[i] * z[i];
    }
    uint8_t out[256];
    float y[D];
    size_t len;
    for (int t = 0; t < draws; t++) {
        ap_codec_cfg_t c = {.id = AP_CODEC_RANDK, .k = K, .seed = rnd()};
        assert_ok(ap_compress_encode(&c, z, D, 0, out, sizeof out, &len));
        assert_int_equal(len, AP_COMPRESS_HDR_LEN + 8 + 4 * K); /* only values travel */
        assert_ok(ap_compress_decode(out, len, y, D, NULL));
        double s = 0;
        int nz = 0;
        for (int i = 0; i < D; i++) {
            mean[i] += y[i];
            s += (double)y[i] * y[i];
            nz += y[i] != 0;
        }
        assert_int_equal(nz, K); /* k distinct indices */
        sq += s;
    }
    double err = 0;
    for (int i = 0; i < D; i++) err += (mean[i] / draws - z[i]) * (mean[i] / draws - z[i]);
    assert_true(sqrt(err / z2) < 0.01);
    for (int i = 0; i < D; i++) assert_true(fabs(mean[i] / draws - z[i]) < 0.01 * sqrt(z2));
    double ratio = (sq / draws) / ((double)D / K * z2);
    assert_true(fabs(ratio - 1) < 0.01);

    /* the index generator covers every index with the same frequency on a
     * bigger, odd-sized vector (Feistel + cycle walking + shift) */
    enum { D2 = 1000, K2 = 20 };
    static float v[D2], w[D2];
    static int hits[D2];
    for (int i = 0; i < D2; i++) v[i] = 1;
    for (int t = 0; t < 5000; t++) {
        ap_codec_cfg_t c = {.id = AP_CODEC_RANDK, .k = K2, .seed = rnd()};
        uint8_t o[512];
        assert_ok(ap_compress_encode(&c, v, D2, 0, o, sizeof o, &len));
        assert_ok(ap_compress_decode(o, len, w, D2, NULL));
        for (int i = 0; i < D2; i++) hits[i] += w[i] != 0;
    }
    /* expected 100 per index; binomial sd ~ 9.9: allow 6 sd */
    for (int i = 0; i < D2; i++) assert_true(hits[i] > 40 && hits[i] < 160);
}

static int cmp_desc(const void *a, const void *b)
{
    const float *x = *(const float *const *)a, *y = *(const float *const *)b;
    float ax = fabsf(*x), ay = fabsf(*y);
    if (ax != ay) return ax < ay ? 1 : -1;
    return x < y ? -1 : 1;
}

static void test_topk_exact(void **state)
{
    (void)state;
    rs = ap_test_seed(4);
    for (int it = 0; it < 40; it++) {
        size_t n = 1 + rnd() % 3000;
        float *x = malloc(n * 4), *y = malloc(n * 4);
        const float **ptr = malloc(n * sizeof *ptr);
        for (size_t i = 0; i < n; i++) /* many ties: few distinct magnitudes */
            x[i] = (float)((int)(rnd() % 21) - 10) * (it % 2 ? 1.0f : 0.37f);
        size_t k = rnd() % (n + 1);
        ap_codec_cfg_t c = {.id = AP_CODEC_TOPK, .k = (uint32_t)k};
        if (k == 0) c.fraction = 1e-9; /* k = 0 is not expressible: min 1 */
        size_t kk = ap_compress_k(&c, n);
        size_t cap = ap_compress_size(&c, n), len;
        uint8_t *out = malloc(cap);
        assert_ok(ap_compress_encode(&c, x, n, 0, out, cap, &len));
        assert_ok(ap_compress_decode(out, len, y, n, NULL));
        for (size_t i = 0; i < n; i++) ptr[i] = &x[i];
        qsort(ptr, n, sizeof *ptr, cmp_desc);
        char *sel = calloc(n, 1);
        for (size_t j = 0; j < kk; j++) sel[ptr[j] - x] = 1;
        double e2 = 0, x2 = 0;
        for (size_t i = 0; i < n; i++) {
            assert_true(y[i] == (sel[i] ? x[i] : 0.0f));
            e2 += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
            x2 += (double)x[i] * x[i];
        }
        assert_true(e2 <= (1 - (double)kk / n) * x2 + 1e-9);
        free(sel);
        free(out);
        free(x);
        free(y);
        free(ptr);
    }
}

static void test_error_feedback(void **state)
{
    (void)state;
    rs = ap_test_seed(5);
    enum { D = 2000, T = 300 };
    ap_codec_id_t ids[] = {AP_CODEC_TOPK, AP_CODEC_BLOCKWISE8, AP_CODEC_UNIFORM8, AP_CODEC_FP16};
    for (size_t ci = 0; ci < sizeof ids / sizeof ids[0]; ci++) {
        ap_codec_cfg_t c = {.id = ids[ci], .fraction = 0.01};
        ap_compress_ef_t *ef = ap_compress_ef_new(D);
        assert_non_null(ef);
        static float x[D], y[D];
        static double sx[D], sy[D];
        memset(sx, 0, sizeof sx);
        memset(sy, 0, sizeof sy);
        size_t cap = ap_compress_size(&c, D), len;
        uint8_t *out = malloc(cap);
        double max_gap_noef = 0;
        for (int t = 0; t < T; t++) {
            for (int i = 0; i < D; i++) x[i] = (float)(gauss() + 0.2 * sin(i)); /* drift */
            /* chunks of 1000 to exercise offsets */
            for (int o = 0; o < D; o += 1000) {
                assert_ok(ap_compress_ef_encode(ef, &c, x + o, 1000, (uint64_t)o, out, cap, &len));
                assert_ok(ap_compress_decode(out, len, y, D, NULL));
            }
            const float *e = ap_compress_ef_residual(ef);
            for (int i = 0; i < D; i++) {
                sx[i] += x[i];
                sy[i] += y[i];
                /* invariant: sum of inputs - sum of sent == residual */
                double gap = sx[i] - sy[i];
                assert_true(fabs(gap - e[i]) <= 1e-3 * (1 + fabs(sx[i])));
                if (fabs(gap) > max_gap_noef) max_gap_noef = fabs(gap);
            }
        }
        /* the residual stays bounded (does not grow like T) */
        const float *e = ap_compress_ef_residual(ef);
        double emax = 0;
        for (int i = 0; i < D; i++) emax = fmax(emax, fabs(e[i]));
        assert_true(emax < 0.25 * T * 0.2 + 60);
        ap_compress_ef_free(ef);
        free(out);
    }
}

static void test_bad_input(void **state)
{
    (void)state;
    float x[300], y[300];
    for (int i = 0; i < 300; i++) x[i] = (float)i;
    for (int id = 0; id < AP_CODEC__COUNT; id++) {
        ap_codec_cfg_t c = {.id = (ap_codec_id_t)id, .k = 7, .seed = 3};
        uint8_t out[4096], bad[4096];
        size_t len;
        assert_ok(ap_compress_encode(&c, x, 300, 0, out, sizeof out, &len));
        /* truncated at every length */
        for (size_t l = 0; l < len; l++) assert_true(ap_compress_decode(out, l, y, 300, NULL) < 0);
        /* extra byte */
        memcpy(bad, out, len);
        bad[len] = 0;
        assert_int_equal(ap_compress_decode(bad, len + 1, y, 300, NULL), AP_ECORRUPT);
        /* count that does not match the payload */
        if (id != AP_CODEC_TOPK && id != AP_CODEC_RANDK) { /* sparse: size depends on k only */
            memcpy(bad, out, len);
            uint32_t cnt = 301;
            memcpy(bad + 4, &cnt, 4);
            assert_int_equal(ap_compress_decode(bad, len, y, 400, NULL), AP_ECORRUPT);
        }
        /* unknown codec, bad magic, bad version, flags */
        memcpy(bad, out, len);
        bad[2] = 200;
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ENOTSUP);
        memcpy(bad, out, len);
        bad[0] ^= 1;
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        memcpy(bad, out, len);
        bad[1] = 9;
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_EVERSION);
        memcpy(bad, out, len);
        bad[3] = 1;
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        /* chunk outside the destination */
        assert_int_equal(ap_compress_decode(out, len, y, 299, NULL), AP_ERANGE);
        memcpy(bad, out, len);
        uint64_t off = UINT64_MAX - 5;
        memcpy(bad + 8, &off, 8);
        assert_true(ap_compress_decode(bad, len, y, 300, NULL) < 0);
        /* payload_len lie */
        memcpy(bad, out, len);
        uint32_t pl;
        memcpy(&pl, bad + 16, 4);
        pl += 1;
        memcpy(bad + 16, &pl, 4);
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        /* param lie (k larger than count) */
        if (id == AP_CODEC_TOPK || id == AP_CODEC_RANDK || id == AP_CODEC_BLOCKWISE8) {
            memcpy(bad, out, len);
            uint32_t pr = id == AP_CODEC_BLOCKWISE8 ? 0 : 301;
            memcpy(bad + 20, &pr, 4);
            assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        }
        /* NaN in a codebook / scale */
        if (id >= AP_CODEC_MEANSTD16 && id <= AP_CODEC_BLOCKWISE8) {
            memcpy(bad, out, len);
            float nanv = NAN;
            memcpy(bad + AP_COMPRESS_HDR_LEN, &nanv, 4);
            assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        }
        if (id == AP_CODEC_TOPK) { /* duplicate / out-of-range index */
            memcpy(bad, out, len);
            memcpy(bad + AP_COMPRESS_HDR_LEN + 4, bad + AP_COMPRESS_HDR_LEN, 4);
            assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
            memcpy(bad, out, len);
            uint32_t big = 300;
            memcpy(bad + AP_COMPRESS_HDR_LEN + 4 * 6, &big, 4);
            assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        }
        /* encoder: buffer too small */
        assert_int_equal(ap_compress_encode(&c, x, 300, 0, out, len - 1, &len), AP_EMSGSIZE);
    }
    ap_codec_cfg_t c = {.id = (ap_codec_id_t)77};
    uint8_t out[64];
    size_t len;
    assert_int_equal(ap_compress_encode(&c, x, 3, 0, out, sizeof out, &len), AP_EINVAL);
}

static void test_tensor_chunks(void **state)
{
    (void)state;
    rs = ap_test_seed(6);
    size_t n = ap_test_sanitized() ? 100000 : 1000003, chunk = 65536;
    float *x = malloc(n * 4), *y = malloc(n * 4), *z = malloc(n * 4);
    fill(x, n, IN_NORMAL);
    for (int id = 0; id < AP_CODEC__COUNT; id++) {
        ap_codec_cfg_t c = {.id = (ap_codec_id_t)id, .fraction = 0.1, .seed = 5};
        size_t nc = ap_compress_nchunks(n, chunk), slot = ap_compress_size(&c, chunk);
        uint8_t *out = malloc(nc * slot);
        size_t *lens = calloc(nc, sizeof *lens);
        const uint8_t **msgs = calloc(nc, sizeof *msgs);
        assert_ok(ap_compress_encode_tensor(&c, x, n, chunk, out, nc * slot, lens));
        for (size_t i = 0; i < nc; i++) msgs[nc - 1 - i] = out + i * slot; /* any order */
        size_t *rl = calloc(nc, sizeof *rl);
        for (size_t i = 0; i < nc; i++) rl[nc - 1 - i] = lens[i];
        assert_ok(ap_compress_decode_tensor(msgs, rl, nc, y, n));
        /* same as encoding chunk by chunk serially */
        for (size_t i = 0; i < nc; i++) {
            size_t o = i * chunk, cnt = n - o < chunk ? n - o : chunk, len;
            uint8_t *one = malloc(slot);
            assert_ok(ap_compress_encode(&c, x + o, cnt, o, one, slot, &len));
            assert_int_equal(len, lens[i]);
            assert_memory_equal(one, out + i * slot, len);
            assert_ok(ap_compress_decode(one, len, z, n, NULL));
            free(one);
        }
        assert_memory_equal(y, z, n * 4);
        free(out);
        free(lens);
        free(rl);
        free(msgs);
    }
    /* decode_add accumulates alpha * decoded */
    ap_codec_cfg_t c = {.id = AP_CODEC_FP16};
    size_t cap = ap_compress_size(&c, 1000), len;
    uint8_t *out = malloc(cap);
    assert_ok(ap_compress_encode(&c, x, 1000, 0, out, cap, &len));
    assert_ok(ap_compress_decode(out, len, y, n, NULL));
    for (int i = 0; i < 1000; i++) z[i] = 1.0f;
    assert_ok(ap_compress_decode_add(out, len, 0.5f, z, n, NULL));
    for (int i = 0; i < 1000; i++) assert_true(z[i] == 1.0f + 0.5f * y[i]);
    free(out);
    free(x);
    free(y);
    free(z);
}

static void test_policy(void **state)
{
    (void)state;
    ap_compress_policy_t *p = ap_compress_policy_new();
    assert_non_null(p);
    bool ef;
    ap_codec_cfg_t c = ap_compress_policy_pick(p, "w", AP_ROLE_GRADIENT, 1 << 20, &ef);
    assert_int_equal(c.id, AP_CODEC_BLOCKWISE8);
    assert_true(ef);
    c = ap_compress_policy_pick(p, "w", AP_ROLE_GRADIENT, 100, &ef);
    assert_int_equal(c.id, AP_CODEC_NONE);
    assert_false(ef);
    c = ap_compress_policy_pick(p, "w", AP_ROLE_PARAMETER, 1 << 20, &ef);
    assert_int_equal(c.id, AP_CODEC_FP16);
    ap_codec_cfg_t t = {.id = AP_CODEC_TOPK, .fraction = 0.01};
    assert_ok(ap_compress_policy_set_tensor(p, "emb", &t, true));
    c = ap_compress_policy_pick(p, "emb", AP_ROLE_PARAMETER, 10, &ef);
    assert_int_equal(c.id, AP_CODEC_TOPK);
    assert_true(ef);
    ap_codec_cfg_t r = {.id = AP_CODEC_RANDK, .fraction = 0.1};
    ap_compress_policy_set_role(p, AP_ROLE_ACTIVATION, &r, true);
    c = ap_compress_policy_pick(p, NULL, AP_ROLE_ACTIVATION, 1 << 20, &ef);
    assert_int_equal(c.id, AP_CODEC_RANDK);
    assert_false(ef); /* unbiased: no residual */
    ap_compress_policy_set_small(p, 0);
    c = ap_compress_policy_pick(p, NULL, AP_ROLE_GRADIENT, 1, &ef);
    assert_int_equal(c.id, AP_CODEC_BLOCKWISE8);
    ap_codec_id_t id;
    assert_ok(ap_codec_parse("quantile8", &id));
    assert_int_equal(id, AP_CODEC_QUANTILE8);
    assert_int_equal(ap_codec_parse("zip", &id), AP_EINVAL);
    ap_compress_policy_free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_all), cmocka_unit_test(test_fast_matches_scalar_many),
        cmocka_unit_test(test_nonfinite),     cmocka_unit_test(test_randk_unbiased),
        cmocka_unit_test(test_topk_exact),    cmocka_unit_test(test_error_feedback),
        cmocka_unit_test(test_bad_input),     cmocka_unit_test(test_tensor_chunks),
        cmocka_unit_test(test_policy),        cmocka_unit_test(test_wsum_kernels),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
