/* CenteredClip AVX2 kernels, chosen at run time. Each produces exactly what
 * the scalar reference in clip_scalar.c produces (tests check bit equality):
 * 8 coordinates per iteration, lanes k..k+3 and k+4..k+7 in two registers
 * (MULPD then ADDPD, each rounded; this target has no FMA to contract into);
 * the tail runs the scalar code on the same lanes. */
#include "btard/clip_kernels.h"

#include <pthread.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define AVX __attribute__((target("avx2")))

AVX static inline __m256d load4(const float *p)
{
    return _mm256_cvtps_pd(_mm_loadu_ps(p));
}

AVX static void dist2(const float *x, const double *v, size_t d, double lanes[8])
{
    __m256d a = _mm256_loadu_pd(lanes), b = _mm256_loadu_pd(lanes + 4);
    size_t k = 0;
    for (; k + 8 <= d; k += 8) {
        __m256d t0 = _mm256_sub_pd(load4(x + k), _mm256_loadu_pd(v + k));
        __m256d t1 = _mm256_sub_pd(load4(x + k + 4), _mm256_loadu_pd(v + k + 4));
        a = _mm256_add_pd(a, _mm256_mul_pd(t0, t0));
        b = _mm256_add_pd(b, _mm256_mul_pd(t1, t1));
    }
    _mm256_storeu_pd(lanes, a);
    _mm256_storeu_pd(lanes + 4, b);
    ap__clip_dist2_ref(x, v, k, d, lanes);
}

AVX static void step(const float *const *x, const double *c, size_t n, const double *v,
                     double *vnew, size_t d, double lanes[8])
{
    __m256d a = _mm256_loadu_pd(lanes), b = _mm256_loadu_pd(lanes + 4);
    size_t k = 0;
    for (; k + 8 <= d; k += 8) {
        __m256d v0 = _mm256_loadu_pd(v + k), v1 = _mm256_loadu_pd(v + k + 4);
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
        for (size_t i = 0; i < n; i++) {
            __m256d ci = _mm256_set1_pd(c[i]);
            const float *xi = x[i] + k;
            s0 = _mm256_add_pd(s0, _mm256_mul_pd(ci, _mm256_sub_pd(load4(xi), v0)));
            s1 = _mm256_add_pd(s1, _mm256_mul_pd(ci, _mm256_sub_pd(load4(xi + 4), v1)));
        }
        _mm256_storeu_pd(vnew + k, _mm256_add_pd(v0, s0));
        _mm256_storeu_pd(vnew + k + 4, _mm256_add_pd(v1, s1));
        a = _mm256_add_pd(a, _mm256_mul_pd(s0, s0));
        b = _mm256_add_pd(b, _mm256_mul_pd(s1, s1));
    }
    _mm256_storeu_pd(lanes, a);
    _mm256_storeu_pd(lanes + 4, b);
    ap__clip_step_ref(x, c, n, v, vnew, k, d, lanes);
}

static const ap__clip_kernels_t avx2_kernels = {
    .name = "avx2",
    .dist2 = dist2,
    .step = step,
};

static const ap__clip_kernels_t *avx2_or_null;
static void avx2_detect(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) avx2_or_null = &avx2_kernels;
}

const ap__clip_kernels_t *ap__clip_kernels_avx2(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, avx2_detect);
    return avx2_or_null;
}

#else
const ap__clip_kernels_t *ap__clip_kernels_avx2(void)
{
    return NULL;
}
#endif
