/* The plain SGD step of stage servers training on their own gradients:
 * global-norm clipping and refusal of non-finite gradients. */
#include "apiary/log.h"
#include "apiary/swarm.h"

#include <math.h>

#define MOD "swarm"

static ap_log_limit_t nonfinite_lim;

int ap_swarm_sgd_step(ap_nn_params_t *p, float lr, float clip, double *norm_out)
{
    if (norm_out) *norm_out = 0;
    if (!p || !p->data || !p->grad || !isfinite(lr) || !isfinite(clip) || clip < 0)
        return AP_EINVAL;
    double n2 = 0;
    for (size_t k = 0; k < p->count; k++) n2 += (double)p->grad[k] * (double)p->grad[k];
    const double norm = sqrt(n2);
    if (norm_out) *norm_out = norm;
    if (!isfinite(norm)) {
        ap_log_limited(&nonfinite_lim, AP_LOG_WARN, MOD,
                       "sgd: refused a non-finite gradient (%zu parameters); not applied",
                       p->count);
        for (size_t k = 0; k < p->count; k++) p->grad[k] = 0;
        return AP_EINVAL;
    }
    const float scale = clip > 0 && norm > clip ? (float)(clip / norm) : 1.0f;
    const float step = lr * scale;
    for (size_t k = 0; k < p->count; k++) {
        p->data[k] -= step * p->grad[k];
        p->grad[k] = 0;
    }
    return AP_OK;
}
