/* Scalar reference kernels for the codecs (see kernels.h). */
#include "compress/kernels.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

static inline uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t ap__f32_to_f16(float f)
{
    /* Clamp first (NaN passes: comparisons with NaN are false). */
    if (f > AP__FP16_MAX) f = AP__FP16_MAX;
    if (f < -AP__FP16_MAX) f = -AP__FP16_MAX;
    uint32_t x = f2u(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) /* NaN: quiet, keep the top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x38800000u) { /* normal half: rebias, round to nearest even */
        uint32_t r = ax - 0x38000000u;
        r += 0x0fffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    /* subnormal half (or zero): value / 2^-24, rounded to nearest even */
    float s = u2f(ax) * 16777216.0f; /* exact: power-of-two scaling */
    return (uint16_t)(sign | (uint16_t)lrintf(s));
}

float ap__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return u2f(sign | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0));
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f); /* exact */
        return sign ? -v : v;
    }
    return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t ap__f32_to_bf16(float f)
{
    uint32_t x = f2u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    uint32_t r = x + 0x7fffu + ((x >> 16) & 1u);
    uint16_t h = (uint16_t)(r >> 16);
    if ((h & 0x7fffu) == 0x7f80u && (x & 0x7fffffffu) != 0x7f800000u) h--; /* clamp */
    return h;
}

float ap__bf16_to_f32(uint16_t h)
{
    return u2f((uint32_t)h << 16);
}

static inline void put16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, 2);
}
static inline uint16_t get16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline void store(float *d, float y, ap__dmode_t m)
{
    *d = m.add ? *d + m.alpha * y : y;
}

static void f16_enc(const float *src, size_t n, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) put16(out + 2 * i, ap__f32_to_f16(src[i]));
}
static void f16_dec(const uint8_t *in, size_t n, float *dst, ap__dmode_t m)
{
    for (size_t i = 0; i < n; i++) store(dst + i, ap__f16_to_f32(get16(in + 2 * i)), m);
}
static void bf16_enc(const float *src, size_t n, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) put16(out + 2 * i, ap__f32_to_bf16(src[i]));
}
static void bf16_dec(const uint8_t *in, size_t n, float *dst, ap__dmode_t m)
{
    for (size_t i = 0; i < n; i++) store(dst + i, ap__bf16_to_f32(get16(in + 2 * i)), m);
}
static void ms_enc(const float *src, size_t n, float mean, float inv, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) put16(out + 2 * i, ap__f32_to_f16((src[i] - mean) * inv));
}
static void ms_dec(const uint8_t *in, size_t n, float mean, float std, float *dst, ap__dmode_t m)
{
    for (size_t i = 0; i < n; i++) {
        float h = ap__f16_to_f32(get16(in + 2 * i));
        store(dst + i, mean + std * h, m);
    }
}

static bool stats(const float *src, size_t n, double sum[8], double sq[8])
{
    for (int j = 0; j < 8; j++) sum[j] = sq[j] = 0;
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        float x = src[i];
        if (!(fabsf(x) <= FLT_MAX)) ok = false;
        double v = x;
        sum[i & 7] += v;
        sq[i & 7] += v * v;
    }
    return ok;
}

static void u8_codes(const float *src, size_t n, float lo, float inv, uint8_t *codes)
{
    for (size_t i = 0; i < n; i++) {
        float t = floorf((src[i] - lo) * inv);
        t = t < 0.0f ? 0.0f : t;
        t = t > 255.0f ? 255.0f : t;
        codes[i] = (uint8_t)t;
    }
}

static void lut_dec(const uint8_t *codes, size_t n, const float table[256], float *dst,
                    ap__dmode_t m)
{
    for (size_t i = 0; i < n; i++) store(dst + i, table[codes[i]], m);
}

static bool minmax(const float *src, size_t n, float *mn, float *mx)
{
    float a = FLT_MAX, b = -FLT_MAX;
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        float x = src[i];
        if (!(fabsf(x) <= FLT_MAX)) ok = false;
        a = x < a ? x : a;
        b = x > b ? x : b;
    }
    *mn = a;
    *mx = b;
    return ok;
}

static void q8_codes(const float *src, size_t n, const ap__q8_plan_t *plan, uint8_t *codes)
{
    for (size_t i = 0; i < n; i++) codes[i] = plan->lut[ap__q8_cell(plan, src[i])];
}

static bool absmax(const float *src, size_t n, float *amax)
{
    float a = 0;
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        float v = fabsf(src[i]);
        if (!(v <= FLT_MAX)) ok = false;
        a = v > a ? v : a;
    }
    *amax = a;
    return ok;
}

/* ---- blockwise codebook ---- */
static float bw_mag[128], bw_probe[129];
static pthread_once_t bw_once = PTHREAD_ONCE_INIT;
static void bw_init(void)
{
    for (int j = 0; j < 128; j++) bw_mag[j] = (float)((double)j * j / (127.0 * 127.0));
    bw_probe[0] = -INFINITY;
    for (int t = 1; t < 128; t++) bw_probe[t] = ap__bw_probe_at(t);
    bw_probe[128] = INFINITY;
}
const float *ap__bw_mag(void)
{
    pthread_once(&bw_once, bw_init);
    return bw_mag;
}
const float *ap__bw_probe(void)
{
    pthread_once(&bw_once, bw_init);
    return bw_probe;
}

uint8_t ap__bw_code_ref(float x, float inv, float amax, bool use_div)
{
    const float *P = ap__bw_probe();
    float ax = fabsf(x);
    float u = use_div ? ax / amax : ax * inv;
    unsigned c = 0;
    for (unsigned s = 64; s; s >>= 1) c += s & (0u - (unsigned)(P[c + s] < u));
    return (uint8_t)((signbit(x) ? 0x80u : 0u) | c);
}

/* amax > 0 with finite 1/amax uses multiplication; amax == 0 gives all-zero
 * magnitudes; tiny amax (1/amax overflows) divides. */
static void bw_codes(const float *src, size_t n, float amax, uint8_t *codes)
{
    float inv = amax > 0 ? 1.0f / amax : 0.0f;
    bool use_div = amax > 0 && isinf(inv);
    for (size_t i = 0; i < n; i++) codes[i] = ap__bw_code_ref(src[i], inv, amax, use_div);
}

static inline float ldf(const void *x, size_t i)
{
    float v;
    memcpy(&v, (const uint8_t *)x + 4 * i, 4);
    return v;
}

/* (v & exponent) + one exponent step carries into bit 31 exactly when the
 * exponent is all ones (Inf or NaN); branch-free. */
static bool all_finite(const void *x, size_t n)
{
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, (const uint8_t *)x + 4 * i, 4);
        acc |= (v & 0x7f800000u) + 0x00800000u;
    }
    return (acc & 0x80000000u) == 0;
}

static void wsum_add(double *acc, const void *x, size_t n, double w)
{
    for (size_t i = 0; i < n; i++) acc[i] += w * ldf(x, i);
}

static void wsum_init(double *acc, const float *own, double ow, const void *x, size_t n, double w)
{
    if (own)
        for (size_t i = 0; i < n; i++) acc[i] = ow * own[i] + w * ldf(x, i);
    else
        for (size_t i = 0; i < n; i++) acc[i] = w * ldf(x, i);
}

static void wsum_mean(float *dst, const double *acc, size_t n, double w)
{
    for (size_t i = 0; i < n; i++) dst[i] = (float)(acc[i] / w);
}

const ap__kernels_t ap__kernels_scalar = {
    .name = "scalar",
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
