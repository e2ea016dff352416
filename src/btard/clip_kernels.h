/* CenteredClip kernels: a scalar reference and an AVX2 fast path with the
 * same results bit for bit (tests compare them). Internal.
 *
 * Sums over coordinates k go to 8 double lanes (lane = k mod 8); the caller
 * adds the lanes in the fixed order of ap__clip_lanes_sum. Each element is
 * computed in double exactly as the C expression in the comment, every
 * product rounded, then the sum (no fused multiply-add). */
#ifndef AP_BTARD_CLIP_KERNELS_H
#define AP_BTARD_CLIP_KERNELS_H

#include <stdbool.h>
#include <stddef.h>

typedef struct ap__clip_kernels {
    const char *name;
    /* lanes[k & 7] += t * t with t = (double)x[k] - v[k], k in [0, d) */
    void (*dist2)(const float *x, const double *v, size_t d, double lanes[8]);
    /* for k in [0, d): s = 0; for i in 0..n-1: s = s + c[i] * ((double)x[i][k] - v[k]);
     * vnew[k] = v[k] + s; lanes[k & 7] += s * s */
    void (*step)(const float *const *x, const double *c, size_t n, const double *v, double *vnew,
                 size_t d, double lanes[8]);
} ap__clip_kernels_t;

/* The scalar reference over coordinates [k0, k1) (lane = k mod 8). */
void ap__clip_dist2_ref(const float *x, const double *v, size_t k0, size_t k1, double lanes[8]);
void ap__clip_step_ref(const float *const *x, const double *c, size_t n, const double *v,
                       double *vnew, size_t k0, size_t k1, double lanes[8]);

extern const ap__clip_kernels_t ap__clip_kernels_scalar;
/* NULL when the build or the CPU lacks AVX2. */
const ap__clip_kernels_t *ap__clip_kernels_avx2(void);
/* The kernels in use. */
const ap__clip_kernels_t *ap__clip_kernels(void);

static inline double ap__clip_lanes_sum(const double l[8])
{
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

#endif
