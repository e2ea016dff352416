/* The plain SGD step of stage servers training on their own gradients:
 * global-norm clipping and refusal of non-finite gradients. */
#include "apiary/log.h"
#include "apiary/nn.h"
#include "apiary/swarm.h"

#include <math.h>

#define MOD "swarm"

static ap_log_limit_t nonfinite_lim;

int ap_swarm_sgd_step(ap_nn_params_t *p, float lr, float clip, double *norm_out)
{
    if (norm_out) *norm_out = 0;
    if (!p || !p->data || !p->grad || !isfinite(lr) || !isfinite(clip) || clip < 0)
        return AP_EINVAL;
    /* the model kit's global-norm clipping (it leaves a non-finite gradient as it is) */
    const double norm = ap_nn_clip_grad_norm(p->grad, p->count, clip);
    if (norm_out) *norm_out = norm;
    if (!isfinite(norm)) {
        ap_log_limited(&nonfinite_lim, AP_LOG_WARN, MOD,
                       "sgd: refused a non-finite gradient (%zu parameters); not applied",
                       p->count);
        for (size_t k = 0; k < p->count; k++) p->grad[k] = 0;
        return AP_EINVAL;
    }
    for (size_t k = 0; k < p->count; k++) {
        p->data[k] -= lr * p->grad[k];
        p->grad[k] = 0;
    }
    return AP_OK;
}
