/* Compression kernels: a scalar reference and an AVX2/F16C fast path with the
 * same results bit for bit (tests compare them). Internal. */
#ifndef AP_COMPRESS_KERNELS_H
#define AP_COMPRESS_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <math.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the compression wire format is little-endian; add byte swaps for this host"
#endif

#define AP__FP16_MAX 65504.0f

/* Scalar conversions (the reference; match F16C's cvtps2ph/cvtph2ps with
 * round-to-nearest-even after clamping to +-65504). */
uint16_t ap__f32_to_f16(float f);
float ap__f16_to_f32(uint16_t h);
uint16_t ap__f32_to_bf16(float f);
float ap__bf16_to_f32(uint16_t h);

/* QUANTILE8 plan: the sample quantiles b_1..b_255 snapped to a uniform grid
 * of AP__Q8_GRID cells over [b_1, b_255] (plus one cell below and one above).
 * cell(x) = clamp(floor((x - b1) * ginv) + 1, 0, GRID + 1) in float
 * arithmetic; code(x) = lut[cell(x)] = #{c : cell(b_c) <= cell(x)}. */
#define AP__Q8_GRID 4096
typedef struct ap__q8_plan {
    float b1, ginv;
    uint8_t lut[AP__Q8_GRID + 2];
} ap__q8_plan_t;

static inline int ap__q8_cell(const ap__q8_plan_t *p, float x)
{
    float t = floorf((x - p->b1) * p->ginv) + 1.0f;
    t = t < 0.0f ? 0.0f : t;
    t = t > (float)(AP__Q8_GRID + 1) ? (float)(AP__Q8_GRID + 1) : t;
    return (int)t;
}

/* Decode destination mode: add == false: dst[i] = y; else dst[i] += alpha*y. */
typedef struct ap__dmode {
    bool add;
    float alpha;
} ap__dmode_t;

typedef struct ap__kernels {
    const char *name;
    void (*f16_enc)(const float *src, size_t n, uint8_t *out);
    void (*f16_dec)(const uint8_t *in, size_t n, float *dst, ap__dmode_t m);
    void (*bf16_enc)(const float *src, size_t n, uint8_t *out);
    void (*bf16_dec)(const uint8_t *in, size_t n, float *dst, ap__dmode_t m);
    /* h = f16(clamp((x - mean) * inv)); y = mean + std * h */
    void (*ms_enc)(const float *src, size_t n, float mean, float inv, uint8_t *out);
    void (*ms_dec)(const uint8_t *in, size_t n, float mean, float std, float *dst, ap__dmode_t m);
    /* 8 double lanes (lane = i mod 8) of sum and sum of squares; returns
     * false if any element is NaN or Inf. */
    bool (*stats)(const float *src, size_t n, double sum[8], double sq[8]);
    /* code = clamp(floor((x - lo) * inv), 0, 255) */
    void (*u8_codes)(const float *src, size_t n, float lo, float inv, uint8_t *codes);
    /* y = table[code] */
    void (*lut_dec)(const uint8_t *codes, size_t n, const float table[256], float *dst,
                    ap__dmode_t m);
    /* min and max; false if any NaN or Inf */
    bool (*minmax)(const float *src, size_t n, float *mn, float *mx);
    /* code = plan->lut[ap__q8_cell(plan, x)] */
    void (*q8_codes)(const float *src, size_t n, const struct ap__q8_plan *plan, uint8_t *codes);
    /* max |x|; false if any NaN or Inf */
    bool (*absmax)(const float *src, size_t n, float *amax);
    /* blockwise codes for one block given amax (see compress.c) */
    void (*bw_codes)(const float *src, size_t n, float amax, uint8_t *codes);
    /* ---- the all-reduce's weighted sums (averaging/allreduce_reduce.c) ----
     * x points at n little-endian float32 values at any alignment (a chunk
     * in a received message). Each element is computed in double exactly as
     * the C expression in the comment (every product rounded, then the sum:
     * no fused multiply-add), so both kernel sets give the same bits. */
    /* true iff none of the n floats at x is NaN or Inf */
    bool (*all_finite)(const void *x, size_t n);
    /* acc[i] += w * x[i] */
    void (*wsum_add)(double *acc, const void *x, size_t n, double w);
    /* acc[i] = ow * own[i] + w * x[i]; acc[i] = w * x[i] if own is NULL */
    void (*wsum_init)(double *acc, const float *own, double ow, const void *x, size_t n, double w);
    /* dst[i] = (float)(acc[i] / w) */
    void (*wsum_mean)(float *dst, const double *acc, size_t n, double w);
} ap__kernels_t;

extern const ap__kernels_t ap__kernels_scalar;
/* NULL when the build or the CPU lacks AVX2+F16C. */
const ap__kernels_t *ap__kernels_avx2(void);
/* The kernels in use (AVX2 when available unless disabled). */
const ap__kernels_t *ap__kernels(void);
/* Tests and benches: force the scalar reference (true) or the best (false). */
void ap__compress_force_scalar(bool scalar);

/* Shared helpers used by both kernel sets. */
/* Blockwise codebook: magnitudes m[0..127] = (j/127)^2, probe table P[0..128]
 * with P[0] = -inf, P[t] ~ (m[t-1]+m[t])/2, P[128] = +inf; code magnitude
 * index = largest j with P[j] < u. P[t] is defined by this float expression
 * so that SIMD code can compute it without a table. */
static inline float ap__bw_probe_at(int t)
{
    return (float)(2 * t * t - 2 * t + 1) * (1.0f / 32258.0f);
}
const float *ap__bw_mag(void);
const float *ap__bw_probe(void);
uint8_t ap__bw_code_ref(float x, float inv, float amax, bool use_div);

#endif
