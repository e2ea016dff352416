/* AVX2 + F16C kernels, chosen at run time. Each produces exactly what the
 * scalar reference in kernels_scalar.c produces (tests check bit equality);
 * tails and rare cases call the scalar code. */
#include "compress/kernels.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

#define AVX __attribute__((target("avx2,f16c")))

AVX static inline void vstore(float *d, __m256 y, ap__dmode_t m)
{
    if (m.add) y = _mm256_add_ps(_mm256_loadu_ps(d), _mm256_mul_ps(_mm256_set1_ps(m.alpha), y));
    _mm256_storeu_ps(d, y);
}

/* clamp to +-65504 keeping NaN: MIN/MAXPS return the second operand when
 * either is NaN, so the input goes second. */
AVX static inline __m256 clamp16(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(AP__FP16_MAX), x);
    return _mm256_max_ps(_mm256_set1_ps(-AP__FP16_MAX), x);
}

AVX static void f16_enc(const float *src, size_t n, uint8_t *out)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(clamp16(_mm256_loadu_ps(src + i)), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), h);
    }
    ap__kernels_scalar.f16_enc(src + i, n - i, out + 2 * i);
}

AVX static void f16_dec(const uint8_t *in, size_t n, float *dst, ap__dmode_t m)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        vstore(dst + i,
               _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i))), m);
    ap__kernels_scalar.f16_dec(in + 2 * i, n - i, dst + i, m);
}

/* 8 floats -> 8 bf16 (in the low 16 bits of each 32-bit lane) */
AVX static inline __m256i bf16_lanes(__m256 v)
{
    const __m256i x = _mm256_castps_si256(v);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    const __m256i ax = _mm256_and_si256(x, absmask);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    __m256i h = _mm256_srli_epi32(r, 16);
    /* clamp finite values that rounded to Inf */
    __m256i hinf = _mm256_cmpeq_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7fff)),
                                      _mm256_set1_epi32(0x7f80));
    __m256i isinf = _mm256_cmpeq_epi32(ax, inf);
    h = _mm256_sub_epi32(h,
                         _mm256_and_si256(_mm256_andnot_si256(isinf, hinf), _mm256_set1_epi32(1)));
    /* NaN: quiet, truncated */
    __m256i isnan = _mm256_cmpgt_epi32(ax, inf);
    __m256i qn = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    h = _mm256_blendv_epi8(h, qn, isnan);
    return _mm256_and_si256(h, _mm256_set1_epi32(0xffff));
}

AVX static void bf16_enc(const float *src, size_t n, uint8_t *out)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = bf16_lanes(_mm256_loadu_ps(src + i));
        __m256i b = bf16_lanes(_mm256_loadu_ps(src + i + 8));
        __m256i p = _mm256_packus_epi32(a, b); /* a0-3 b0-3 a4-7 b4-7 */
        p = _mm256_permute4x64_epi64(p, 0xd8);
        _mm256_storeu_si256((__m256i *)(void *)(out + 2 * i), p);
    }
    ap__kernels_scalar.bf16_enc(src + i, n - i, out + 2 * i);
}

AVX static void bf16_dec(const uint8_t *in, size_t n, float *dst, ap__dmode_t m)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w =
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i)));
        vstore(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), m);
    }
    ap__kernels_scalar.bf16_dec(in + 2 * i, n - i, dst + i, m);
}

AVX static void ms_enc(const float *src, size_t n, float mean, float inv, uint8_t *out)
{
    const __m256 vm = _mm256_set1_ps(mean), vi = _mm256_set1_ps(inv);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(src + i), vm), vi);
        _mm_storeu_si128((__m128i *)(void *)(out + 2 * i),
                         _mm256_cvtps_ph(clamp16(z), _MM_FROUND_TO_NEAREST_INT));
    }
    ap__kernels_scalar.ms_enc(src + i, n - i, mean, inv, out + 2 * i);
}

AVX static void ms_dec(const uint8_t *in, size_t n, float mean, float std, float *dst,
                       ap__dmode_t m)
{
    const __m256 vm = _mm256_set1_ps(mean), vs = _mm256_set1_ps(std);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 h = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i)));
        vstore(dst + i, _mm256_add_ps(vm, _mm256_mul_ps(vs, h)), m);
    }
    ap__kernels_scalar.ms_dec(in + 2 * i, n - i, mean, std, dst + i, m);
}

AVX static bool stats(const float *src, size_t n, double sum[8], double sq[8])
{
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, q0 = s0, q1 = s0;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 bad = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        bad = _mm256_or_ps(
            bad, _mm256_cmp_ps(_mm256_and_ps(x, absmask), _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
        s0 = _mm256_add_pd(s0, lo);
        s1 = _mm256_add_pd(s1, hi);
        q0 = _mm256_add_pd(q0, _mm256_mul_pd(lo, lo));
        q1 = _mm256_add_pd(q1, _mm256_mul_pd(hi, hi));
    }
    _mm256_storeu_pd(sum, s0);
    _mm256_storeu_pd(sum + 4, s1);
    _mm256_storeu_pd(sq, q0);
    _mm256_storeu_pd(sq + 4, q1);
    bool ok = _mm256_movemask_ps(bad) == 0;
    for (; i < n; i++) {
        float x = src[i];
        if (!(fabsf(x) <= FLT_MAX)) ok = false;
        double v = x;
        sum[i & 7] += v;
        sq[i & 7] += v * v;
    }
    return ok;
}

/* 8 int32 lanes (0..255) -> 8 bytes at out */
AVX static inline void store_codes8(uint8_t *out, __m256i c)
{
    __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    __m128i w = _mm_packus_epi32(lo, hi);
    __m128i b = _mm_packus_epi16(w, w);
    _mm_storel_epi64((__m128i *)(void *)out, b);
}

AVX static void u8_codes(const float *src, size_t n, float lo, float inv, uint8_t *codes)
{
    const __m256 vl = _mm256_set1_ps(lo), vi = _mm256_set1_ps(inv);
    const __m256 z = _mm256_setzero_ps(), top = _mm256_set1_ps(255.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_floor_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(src + i), vl), vi));
        t = _mm256_min_ps(_mm256_max_ps(t, z), top);
        store_codes8(codes + i, _mm256_cvttps_epi32(t));
    }
    ap__kernels_scalar.u8_codes(src + i, n - i, lo, inv, codes + i);
}

AVX static void lut_dec(const uint8_t *codes, size_t n, const float table[256], float *dst,
                        ap__dmode_t m)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i c =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(codes + i)));
        vstore(dst + i, _mm256_i32gather_ps(table, c, 4), m);
    }
    ap__kernels_scalar.lut_dec(codes + i, n - i, table, dst + i, m);
}

AVX static bool minmax(const float *src, size_t n, float *mn, float *mx)
{
    __m256 a = _mm256_set1_ps(FLT_MAX), b = _mm256_set1_ps(-FLT_MAX), bad = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        bad = _mm256_or_ps(
            bad, _mm256_cmp_ps(_mm256_and_ps(x, absmask), _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
        a = _mm256_min_ps(a, x);
        b = _mm256_max_ps(b, x);
    }
    float ta[8], tb[8];
    _mm256_storeu_ps(ta, a);
    _mm256_storeu_ps(tb, b);
    float lo, hi;
    bool ok = ap__kernels_scalar.minmax(src + i, n - i, &lo, &hi);
    for (int j = 0; j < 8; j++) {
        lo = ta[j] < lo ? ta[j] : lo;
        hi = tb[j] > hi ? tb[j] : hi;
    }
    *mn = lo;
    *mx = hi;
    return ok && _mm256_movemask_ps(bad) == 0;
}

/* Quantile codes: the cell arithmetic in AVX2 (same float operations as
 * ap__q8_cell), then byte lookups (scalar loads: table gathers are slow on
 * CPUs with the GDS microcode mitigation). */
AVX static void q8_codes(const float *src, size_t n, const ap__q8_plan_t *plan, uint8_t *codes)
{
    const __m256 vb1 = _mm256_set1_ps(plan->b1), vg = _mm256_set1_ps(plan->ginv);
    const __m256 one = _mm256_set1_ps(1.0f), z = _mm256_setzero_ps(),
                 top = _mm256_set1_ps((float)(AP__Q8_GRID + 1));
    const uint8_t *lut = plan->lut;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(src + i), vb1), vg);
        t = _mm256_add_ps(_mm256_floor_ps(t), one);
        t = _mm256_min_ps(_mm256_max_ps(t, z), top);
        int32_t c[8];
        _mm256_storeu_si256((__m256i *)(void *)c, _mm256_cvttps_epi32(t));
        for (int j = 0; j < 8; j++) codes[i + (size_t)j] = lut[c[j]];
    }
    ap__kernels_scalar.q8_codes(src + i, n - i, plan, codes + i);
}

AVX static bool absmax(const float *src, size_t n, float *amax)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 a = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_and_ps(_mm256_loadu_ps(src + i), absmask);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
        a = _mm256_max_ps(a, x);
    }
    float ta[8], r;
    _mm256_storeu_ps(ta, a);
    bool ok = ap__kernels_scalar.absmax(src + i, n - i, &r);
    for (int j = 0; j < 8; j++) r = ta[j] > r ? ta[j] : r;
    *amax = r;
    return ok && _mm256_movemask_ps(bad) == 0;
}

/* Blockwise codes without table lookups. The reference's code is the
 * largest j with P(j) < u, P(j) = ((j - 1/2)^2 + 1/4) / 127^2, i.e. in exact
 * arithmetic j = floor(s) with s = 1/2 + sqrt(max(0, 127^2 u - 1/4)),
 * clamped to 127. The float evaluation of s is accurate to ~1e-5, and the
 * reference's float-rounded thresholds move the answer only when s is within
 * ~1e-5 of an integer, so lanes with frac(s) in [0.001, 0.999] are exact;
 * the others (about 0.2 %) take the reference. */
AVX static void bw_codes(const float *src, size_t n, float amax, uint8_t *codes)
{
    float inv = amax > 0 ? 1.0f / amax : 0.0f;
    if (amax > 0 && isinf(inv)) {
        ap__kernels_scalar.bw_codes(src, n, amax, codes);
        return;
    }
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 vi = _mm256_set1_ps(inv), k2 = _mm256_set1_ps(16129.0f),
                 quarter = _mm256_set1_ps(0.25f), half = _mm256_set1_ps(0.5f),
                 zero = _mm256_setzero_ps(), c127 = _mm256_set1_ps(127.0f),
                 lo = _mm256_set1_ps(0.001f), hi = _mm256_set1_ps(0.999f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        __m256 u = _mm256_mul_ps(_mm256_and_ps(x, absmask), vi);
        __m256 a = _mm256_max_ps(_mm256_sub_ps(_mm256_mul_ps(u, k2), quarter), zero);
        __m256 sv = _mm256_add_ps(half, _mm256_sqrt_ps(a));
        __m256 fl = _mm256_floor_ps(sv), fr = _mm256_sub_ps(sv, fl);
        int nearm = _mm256_movemask_ps(
            _mm256_or_ps(_mm256_cmp_ps(fr, lo, _CMP_LT_OQ), _mm256_cmp_ps(fr, hi, _CMP_GT_OQ)));
        __m256i g = _mm256_cvttps_epi32(_mm256_min_ps(fl, c127));
        __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 24),
                                        _mm256_set1_epi32(0x80));
        store_codes8(codes + i, _mm256_or_si256(g, sign));
        if (nearm)
            for (int j = 0; j < 8; j++)
                if (nearm >> j & 1)
                    codes[i + (size_t)j] = ap__bw_code_ref(src[i + (size_t)j], inv, amax, false);
    }
    ap__kernels_scalar.bw_codes(src + i, n - i, amax, codes + i);
}

/* 8 floats at x + i (any alignment), widened to two vectors of 4 doubles:
 * exact. */
AVX static inline void ld8d(const void *x, size_t i, __m256d *lo, __m256d *hi)
{
    __m256 v = _mm256_loadu_ps((const float *)(const void *)((const uint8_t *)x + 4 * i));
    *lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    *hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
}

AVX static bool all_finite(const void *x, size_t n)
{
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const uint8_t *p = (const uint8_t *)x + 4 * i;
        for (int k = 0; k < 4; k++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32 * k));
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(v, em), em));
        }
    }
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)((const uint8_t *)x + 4 * i));
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(v, em), em));
    }
    if (!_mm256_testz_si256(bad, bad)) return false;
    return ap__kernels_scalar.all_finite((const uint8_t *)x + 4 * i, n - i);
}

/* The products and sums below are the scalar kernels' operations lane by
 * lane (MULPD then ADDPD, each rounded; this target has no FMA to contract
 * into), so the results are the same bits. */
AVX static void wsum_add(double *acc, const void *x, size_t n, double w)
{
    const __m256d vw = _mm256_set1_pd(w);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d lo, hi;
        ld8d(x, i, &lo, &hi);
        _mm256_storeu_pd(acc + i, _mm256_add_pd(_mm256_loadu_pd(acc + i), _mm256_mul_pd(vw, lo)));
        _mm256_storeu_pd(acc + i + 4,
                         _mm256_add_pd(_mm256_loadu_pd(acc + i + 4), _mm256_mul_pd(vw, hi)));
    }
    ap__kernels_scalar.wsum_add(acc + i, (const uint8_t *)x + 4 * i, n - i, w);
}

AVX static void wsum_init(double *acc, const float *own, double ow, const void *x, size_t n,
                          double w)
{
    const __m256d vw = _mm256_set1_pd(w), vo = _mm256_set1_pd(ow);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d lo, hi;
        ld8d(x, i, &lo, &hi);
        lo = _mm256_mul_pd(vw, lo);
        hi = _mm256_mul_pd(vw, hi);
        if (own) {
            __m256 o = _mm256_loadu_ps(own + i);
            lo = _mm256_add_pd(_mm256_mul_pd(vo, _mm256_cvtps_pd(_mm256_castps256_ps128(o))), lo);
            hi = _mm256_add_pd(_mm256_mul_pd(vo, _mm256_cvtps_pd(_mm256_extractf128_ps(o, 1))), hi);
        }
        _mm256_storeu_pd(acc + i, lo);
        _mm256_storeu_pd(acc + i + 4, hi);
    }
    ap__kernels_scalar.wsum_init(acc + i, own ? own + i : NULL, ow, (const uint8_t *)x + 4 * i,
                                 n - i, w);
}

AVX static void wsum_mean(float *dst, const double *acc, size_t n, double w)
{
    const __m256d vw = _mm256_set1_pd(w);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128 lo = _mm256_cvtpd_ps(_mm256_div_pd(_mm256_loadu_pd(acc + i), vw));
        __m128 hi = _mm256_cvtpd_ps(_mm256_div_pd(_mm256_loadu_pd(acc + i + 4), vw));
        _mm256_storeu_ps(dst + i, _mm256_set_m128(hi, lo));
    }
    ap__kernels_scalar.wsum_mean(dst + i, acc + i, n - i, w);
}

static const ap__kernels_t avx2_kernels = {
    .name = "avx2",
    .f16_enc = f16_enc,
    .f16_dec = f16_dec,
    .bf16_enc = bf16_enc,
    .bf16_dec = bf16_dec,
    .ms_enc = ms_enc,
    .ms_dec = ms_dec,
    .stats = stats,
    .u8_codes = u8_codes,
    .lut_dec = lut_dec,
    .minmax = minmax,
    .q8_codes = q8_codes,
    .absmax = absmax,
    .bw_codes = bw_codes,
    .all_finite = all_finite,
    .wsum_add = wsum_add,
    .wsum_init = wsum_init,
    .wsum_mean = wsum_mean,
};

static const ap__kernels_t *avx2_or_null;
static void avx2_detect(void)
{
    /* avx2 via the compiler (it also checks that the OS saves YMM state);
     * F16C from CPUID.1:ECX bit 29 (older clang lacks "f16c" here). CPUID
     * traps in VMs, so this runs once. */
    __builtin_cpu_init();
    unsigned a, b, c, d;
    if (__builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)))
        avx2_or_null = &avx2_kernels;
}

const ap__kernels_t *ap__kernels_avx2(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, avx2_detect);
    return avx2_or_null;
}

#else
const ap__kernels_t *ap__kernels_avx2(void)
{
    return NULL;
}
#endif
