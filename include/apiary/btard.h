/* Apiary — Byzantine-tolerant aggregation (BTARD building blocks).
 *
 * CenteredClip: a robust weighted average of n vectors. Starting from the
 * coordinate-wise weighted median v_0, it iterates
 *
 *     v_{t+1} = v_t + sum_i w_i (x_i - v_t) min(1, tau / |x_i - v_t|) / sum_i w_i
 *
 * until the step |v_{t+1} - v_t| <= eps or max_iter steps were taken. With
 * b of n equally weighted inputs replaced by arbitrary vectors, and the honest
 * inputs within tau of the result, the result lies within b*tau/(n - b) of the
 * honest inputs' mean (each Byzantine input moves the fixed point by at most
 * tau / n). With tau at least every input's distance from v_0 the first step
 * lands on the weighted mean.
 *
 * Determinism: the result depends only on the inputs, their order and the
 * configuration. The AVX2 kernels (chosen at run time; APIARY_NO_SIMD=1 forces
 * the scalar reference) give the same bits as the scalar reference: every
 * sum is taken in double in a fixed order, every product rounded, no fused
 * multiply-add.
 *
 * Thread safety: the functions keep no global state beyond the kernel choice;
 * a workspace belongs to one thread at a time. */
#ifndef APIARY_BTARD_H
#define APIARY_BTARD_H

#include "apiary/common.h"
#include "apiary/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Hard caps on one CenteredClip call. */
#define AP_BTARD_CLIP_MAX_INPUTS 4096
#define AP_BTARD_CLIP_MAX_ITER   100000

typedef struct ap_btard_clip_cfg {
    double tau;   /* clipping radius, > 0 (may be INFINITY: no clipping) */
    int max_iter; /* steps at most, 1..AP_BTARD_CLIP_MAX_ITER */
    double eps;   /* stop when a step moves the estimate by <= eps (L2), >= 0 */
} ap_btard_clip_cfg_t;

/* tau = 1, max_iter = 100, eps = 1e-6. */
AP_EXPORT ap_btard_clip_cfg_t ap_btard_clip_cfg_default(void);

typedef struct ap_btard_clip_stats {
    int iters;        /* steps taken (0 if only the median was computed) */
    bool converged;   /* the last step was <= eps */
    int clipped;      /* inputs farther than tau from the estimate the last step started at */
    int excluded;     /* inputs left out: weight 0, or a NaN/Inf element */
    double last_step; /* L2 length of the last step (0 if iters == 0) */
} ap_btard_clip_stats_t;

/* Scratch memory reused across calls (grows to the largest n and d seen).
 * One thread at a time. ap_btard_clip_ws_free(NULL) is a no-op. */
typedef struct ap_btard_clip_ws ap_btard_clip_ws_t;
AP_EXPORT ap_btard_clip_ws_t *ap_btard_clip_ws_new(void);
AP_EXPORT void ap_btard_clip_ws_free(ap_btard_clip_ws_t *ws);

/* CenteredClip of the n vectors x[0..n-1], each of d floats, with weights w
 * (NULL = all 1; each finite and >= 0). Writes the d floats of the result to
 * out (which may alias no input). Inputs with weight 0 or any NaN/Inf element
 * are left out (counted in stats->excluded). ws may be NULL (the call then
 * allocates and frees its own scratch). stats may be NULL.
 * Errors: AP_EINVAL (bad configuration, n or d of 0, n over the cap, a
 * negative or non-finite weight, or every input left out), AP_ENOMEM. The
 * caller keeps ownership of every buffer. */
AP_EXPORT AP_NODISCARD int ap_btard_clip(ap_btard_clip_ws_t *ws, const float *const *x,
                                         const double *w, size_t n, size_t d,
                                         const ap_btard_clip_cfg_t *cfg, float *out,
                                         ap_btard_clip_stats_t *stats);

/* The CenteredClip residual at v: r = sum_i w_i (x_i - v) min(1, tau/|x_i - v|)
 * / sum_i w_i over the inputs ap_btard_clip would use; at a fixed point r = 0.
 * Writes d doubles to r and returns |r| (L2) in *norm. Same errors as
 * ap_btard_clip. */
AP_EXPORT AP_NODISCARD int ap_btard_clip_residual(const float *const *x, const double *w, size_t n,
                                                  size_t d, double tau, const float *v, double *r,
                                                  double *norm);

/* Tests and benches: force the scalar kernels (true) or the best (false). */
AP_EXPORT void ap_btard_force_scalar(bool scalar);
/* Name of the kernels in use: "scalar" or "avx2". */
AP_EXPORT const char *ap_btard_kernels_name(void);

#ifdef __cplusplus
}
#endif
#endif
