/* The recording reducer for the verified step, the aggregation check's sum
 * and the all-reduce's split (see apiary/btard.h). */
#include "apiary/btard.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

bool ap_btard_agg_fails(const ap_btard_agg_entry_t *e, size_t n, double tau)
{
    if (!e || n == 0 || !isfinite(tau) || !(tau > 0)) return true;
    double sw = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(e[i].weight) || e[i].weight < 0 || !isfinite(e[i].dist) ||
            !isfinite(e[i].proj))
            return true;
        sw += e[i].weight;
        s += e[i].weight * e[i].proj;
    }
    if (!(sw > 0) || !isfinite(sw) || !isfinite(s)) return true;
    return fabs(s / sw) > AP_BTARD_PROJ_TOL * tau;
}

static int grow(void **p, size_t *cap, size_t want, size_t elem)
{
    if (want <= *cap) return 0;
    void *q = realloc(*p, want * elem);
    if (!q) return AP_ENOMEM;
    *p = q;
    *cap = want;
    return 0;
}

int ap_btard_verified_clip(void *arg, const float *const *x, const double *w, size_t n, size_t d,
                           float *out, uint32_t *clipped)
{
    ap_btard_vclip_t *v = arg;
    if (!v || !clipped || !x || !out || n == 0 || d == 0 || n > AP_BTARD_STEP_MAX_PEERS ||
        d > SIZE_MAX / sizeof(float) / n)
        return AP_EINVAL;
    v->have = false;
    size_t cd = v->cap_d;
    if (grow((void **)&v->copies, &v->cap_copies, n * d, sizeof(float)) ||
        grow((void **)&v->w, &v->cap_n, n, sizeof(double)) ||
        grow((void **)&v->out, &v->cap_d, d, sizeof(float)))
        return AP_ENOMEM;
    if (v->cap_d != cd || !v->res) {
        double *r = realloc(v->res, v->cap_d * sizeof(double));
        if (!r) return AP_ENOMEM;
        v->res = r;
    }
    ap_btard_bclip_t b = v->clip;
    double tol = AP_BTARD_PROJ_TOL * b.cfg.tau;
    if (isfinite(tol)) {
        if (b.cfg.max_iter < 1000) b.cfg.max_iter = 1000;
        if (b.cfg.eps > tol / 4) b.cfg.eps = tol / 4;
    }
    int rc = ap_btard_butterfly_clip(&b, x, w, n, d, out, clipped);
    v->clip.last = b.last;
    if (rc) return rc;
    if (v->shift != 0)
        for (size_t k = 0; k < d; k++) out[k] += v->shift;
    for (size_t i = 0; i < n; i++) {
        memcpy(v->copies + i * d, x[i], d * sizeof(float));
        v->w[i] = w ? w[i] : 1.0;
    }
    memcpy(v->out, out, d * sizeof(float));
    v->n = n;
    v->d = d;
    double norm = INFINITY;
    const float *const *xs = x;
    v->fixed = ap_btard_clip_residual(xs, v->w, n, d, b.cfg.tau, out, v->res, &norm) == 0 &&
               norm <= tol / 2;
    v->have = true;
    return 0;
}

void ap_btard_vclip_reset(ap_btard_vclip_t *v)
{
    if (v) v->have = false;
}

void ap_btard_vclip_close(ap_btard_vclip_t *v)
{
    if (!v) return;
    free(v->copies);
    free(v->w);
    free(v->out);
    free(v->res);
    v->copies = v->out = NULL;
    v->w = v->res = NULL;
    v->cap_copies = v->cap_n = v->cap_d = 0;
    v->have = false;
}

int ap_btard_split(const ap_avg_member_t *members, size_t n, uint64_t elems, uint64_t *counts)
{
    if (!members || !counts || n == 0 || n > AP_AVG_MAX_PEERS) return AP_EINVAL;
    ap_avg_bw_t *bw = malloc(n * sizeof *bw);
    double *shares = malloc(n * sizeof *shares);
    int rc = AP_ENOMEM;
    if (bw && shares) {
        for (size_t i = 0; i < n; i++)
            bw[i] = (ap_avg_bw_t){members[i].role, members[i].up, members[i].down};
        ap_avg_balance_opts_t bo = {.min_share = 0};
        double t;
        rc = ap_avg_balance(bw, n, &bo, shares, &t);
        if (rc == 0) rc = ap_avg_round_counts(shares, n, elems, counts);
    }
    free(bw);
    free(shares);
    return rc;
}
