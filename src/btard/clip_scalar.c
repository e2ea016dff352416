/* CenteredClip scalar reference kernels (see clip_kernels.h). */
#include "btard/clip_kernels.h"

void ap__clip_dist2_ref(const float *x, const double *v, size_t k0, size_t k1, double lanes[8])
{
    for (size_t k = k0; k < k1; k++) {
        double t = (double)x[k] - v[k];
        lanes[k & 7] += t * t;
    }
}

void ap__clip_step_ref(const float *const *x, const double *c, size_t n, const double *v,
                       double *vnew, size_t k0, size_t k1, double lanes[8])
{
    for (size_t k = k0; k < k1; k++) {
        double s = 0;
        for (size_t i = 0; i < n; i++) s = s + c[i] * ((double)x[i][k] - v[k]);
        vnew[k] = v[k] + s;
        lanes[k & 7] += s * s;
    }
}

static void dist2(const float *x, const double *v, size_t d, double lanes[8])
{
    ap__clip_dist2_ref(x, v, 0, d, lanes);
}

static void step(const float *const *x, const double *c, size_t n, const double *v, double *vnew,
                 size_t d, double lanes[8])
{
    ap__clip_step_ref(x, c, n, v, vnew, 0, d, lanes);
}

const ap__clip_kernels_t ap__clip_kernels_scalar = {
    .name = "scalar",
    .dist2 = dist2,
    .step = step,
};
