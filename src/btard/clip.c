/* CenteredClip: start at the coordinate-wise weighted median, then clipped
 * weighted steps until the step is below eps (see apiary/btard.h). */
#include "apiary/btard.h"
#include "btard/clip_kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- kernel dispatch ------------------------------------------------------ */

static const ap__clip_kernels_t *g_best;
static _Atomic int g_force_scalar;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void kern_init(void)
{
    const ap__clip_kernels_t *k = ap__clip_kernels_avx2();
    const char *env = getenv("APIARY_NO_SIMD");
    g_best = (k && !(env && *env && strcmp(env, "0") != 0)) ? k : &ap__clip_kernels_scalar;
}

const ap__clip_kernels_t *ap__clip_kernels(void)
{
    pthread_once(&g_once, kern_init);
    return atomic_load(&g_force_scalar) ? &ap__clip_kernels_scalar : g_best;
}

void ap_btard_force_scalar(bool scalar)
{
    atomic_store(&g_force_scalar, scalar ? 1 : 0);
}

const char *ap_btard_kernels_name(void)
{
    return ap__clip_kernels()->name;
}

/* ---- workspace -------------------------------------------------------------- */

typedef struct wv {
    double v;
    double w;
} wv_t;

struct ap_btard_clip_ws {
    size_t cap_d, cap_n;
    double *v, *vnew; /* d each */
    double *c, *wi;   /* n each */
    const float **xs; /* n */
    wv_t *sort;       /* n */
};

ap_btard_clip_ws_t *ap_btard_clip_ws_new(void)
{
    return calloc(1, sizeof(ap_btard_clip_ws_t));
}

void ap_btard_clip_ws_free(ap_btard_clip_ws_t *ws)
{
    if (!ws) return;
    free(ws->v);
    free(ws->vnew);
    free(ws->c);
    free(ws->wi);
    free(ws->xs);
    free(ws->sort);
    free(ws);
}

static int ws_reserve(ap_btard_clip_ws_t *ws, size_t n, size_t d)
{
    if (d > ws->cap_d) {
        if (d > SIZE_MAX / sizeof(double)) return AP_ENOMEM;
        double *a = realloc(ws->v, d * sizeof(double));
        if (!a) return AP_ENOMEM;
        ws->v = a;
        a = realloc(ws->vnew, d * sizeof(double));
        if (!a) return AP_ENOMEM;
        ws->vnew = a;
        ws->cap_d = d;
    }
    if (n > ws->cap_n) {
        double *c = realloc(ws->c, n * sizeof(double));
        if (!c) return AP_ENOMEM;
        ws->c = c;
        c = realloc(ws->wi, n * sizeof(double));
        if (!c) return AP_ENOMEM;
        ws->wi = c;
        const float **xs = realloc(ws->xs, n * sizeof(*xs));
        if (!xs) return AP_ENOMEM;
        ws->xs = xs;
        wv_t *s = realloc(ws->sort, n * sizeof(wv_t));
        if (!s) return AP_ENOMEM;
        ws->sort = s;
        ws->cap_n = n;
    }
    return 0;
}

ap_btard_clip_cfg_t ap_btard_clip_cfg_default(void)
{
    return (ap_btard_clip_cfg_t){.tau = 1.0, .max_iter = 100, .eps = 1e-6};
}

static bool cfg_ok(const ap_btard_clip_cfg_t *cfg)
{
    return cfg && cfg->tau > 0 && !isnan(cfg->tau) && cfg->max_iter >= 1 &&
           cfg->max_iter <= AP_BTARD_CLIP_MAX_ITER && cfg->eps >= 0 && isfinite(cfg->eps);
}

static bool all_finite(const float *x, size_t d)
{
    for (size_t k = 0; k < d; k++)
        if (!isfinite(x[k])) return false;
    return true;
}

/* Picks the inputs that take part: ws->xs[0..m-1] with weights ws->wi, sum *W. */
static int select_inputs(ap_btard_clip_ws_t *ws, const float *const *x, const double *w, size_t n,
                         size_t d, size_t *m_out, double *W, int *excluded)
{
    size_t m = 0;
    double sum = 0;
    *excluded = 0;
    for (size_t i = 0; i < n; i++) {
        double wi = w ? w[i] : 1.0;
        if (!(wi >= 0) || !isfinite(wi) || !x[i]) return AP_EINVAL;
        if (wi == 0 || !all_finite(x[i], d)) {
            (*excluded)++;
            continue;
        }
        ws->xs[m] = x[i];
        ws->wi[m] = wi;
        sum += wi;
        m++;
    }
    if (m == 0 || !(sum > 0) || !isfinite(sum)) return AP_EINVAL;
    *m_out = m;
    *W = sum;
    return 0;
}

/* ---- weighted median -------------------------------------------------------- */

static int wv_cmp(const void *a, const void *b)
{
    double x = ((const wv_t *)a)->v, y = ((const wv_t *)b)->v;
    return (x > y) - (x < y);
}

static void sort_wv(wv_t *s, size_t m)
{
    if (m > 32) {
        qsort(s, m, sizeof(*s), wv_cmp);
        return;
    }
    for (size_t i = 1; i < m; i++) {
        wv_t t = s[i];
        size_t j = i;
        while (j > 0 && s[j - 1].v > t.v) {
            s[j] = s[j - 1];
            j--;
        }
        s[j] = t;
    }
}

/* The smallest value whose cumulative weight reaches half the total; when it
 * reaches exactly half, the midpoint with the next value (the usual median
 * for equal weights and an even count). */
static double wmedian(wv_t *s, size_t m, double W)
{
    sort_wv(s, m);
    double half = 0.5 * W, cum = 0;
    for (size_t j = 0; j < m; j++) {
        cum += s[j].w;
        if (cum == half && j + 1 < m) return 0.5 * s[j].v + 0.5 * s[j + 1].v;
        if (cum >= half) return s[j].v;
    }
    return s[m - 1].v;
}

static void median_init(ap_btard_clip_ws_t *ws, size_t m, size_t d, double W)
{
    for (size_t k = 0; k < d; k++) {
        for (size_t i = 0; i < m; i++) ws->sort[i] = (wv_t){ws->xs[i][k], ws->wi[i]};
        ws->v[k] = wmedian(ws->sort, m, W);
    }
}

/* ---- the iteration ---------------------------------------------------------- */

/* c_i = (w_i / W) * min(1, tau / |x_i - v|); returns how many were clipped. */
static int clip_coeffs(const ap__clip_kernels_t *K, ap_btard_clip_ws_t *ws, size_t m, size_t d,
                       double W, double tau, const double *v)
{
    int clipped = 0;
    for (size_t i = 0; i < m; i++) {
        double lanes[8] = {0};
        K->dist2(ws->xs[i], v, d, lanes);
        double dist = sqrt(ap__clip_lanes_sum(lanes));
        double f = 1.0;
        if (dist > tau) {
            f = tau / dist;
            clipped++;
        }
        ws->c[i] = (ws->wi[i] / W) * f;
    }
    return clipped;
}

int ap_btard_clip(ap_btard_clip_ws_t *ws, const float *const *x, const double *w, size_t n,
                  size_t d, const ap_btard_clip_cfg_t *cfg, float *out,
                  ap_btard_clip_stats_t *stats)
{
    if (!x || !out || n == 0 || d == 0 || n > AP_BTARD_CLIP_MAX_INPUTS || !cfg_ok(cfg))
        return AP_EINVAL;
    ap_btard_clip_ws_t *own = NULL;
    if (!ws) {
        ws = own = ap_btard_clip_ws_new();
        if (!ws) return AP_ENOMEM;
    }
    ap_btard_clip_stats_t st = {0};
    size_t m = 0;
    double W = 0;
    int rc = ws_reserve(ws, n, d);
    if (rc == 0) rc = select_inputs(ws, x, w, n, d, &m, &W, &st.excluded);
    if (rc == 0) {
        const ap__clip_kernels_t *K = ap__clip_kernels();
        median_init(ws, m, d, W);
        for (int t = 0; t < cfg->max_iter; t++) {
            st.clipped = clip_coeffs(K, ws, m, d, W, cfg->tau, ws->v);
            double lanes[8] = {0};
            K->step(ws->xs, ws->c, m, ws->v, ws->vnew, d, lanes);
            double *tmp = ws->v;
            ws->v = ws->vnew;
            ws->vnew = tmp;
            st.iters = t + 1;
            st.last_step = sqrt(ap__clip_lanes_sum(lanes));
            if (st.last_step <= cfg->eps) {
                st.converged = true;
                break;
            }
        }
        for (size_t k = 0; k < d; k++) out[k] = (float)ws->v[k];
    }
    if (stats) *stats = st;
    ap_btard_clip_ws_free(own);
    return rc;
}

int ap_btard_clip_residual(const float *const *x, const double *w, size_t n, size_t d, double tau,
                           const float *v, double *r, double *norm)
{
    if (!x || !v || !r || !norm || n == 0 || d == 0 || n > AP_BTARD_CLIP_MAX_INPUTS || !(tau > 0))
        return AP_EINVAL;
    ap_btard_clip_ws_t *ws = ap_btard_clip_ws_new();
    if (!ws) return AP_ENOMEM;
    size_t m = 0;
    double W = 0;
    int excluded = 0;
    int rc = ws_reserve(ws, n, d);
    if (rc == 0) rc = select_inputs(ws, x, w, n, d, &m, &W, &excluded);
    if (rc == 0) {
        for (size_t k = 0; k < d; k++) ws->v[k] = v[k];
        clip_coeffs(&ap__clip_kernels_scalar, ws, m, d, W, tau, ws->v);
        double sq = 0;
        for (size_t k = 0; k < d; k++) {
            double s = 0;
            for (size_t i = 0; i < m; i++) s = s + ws->c[i] * ((double)ws->xs[i][k] - ws->v[k]);
            r[k] = s;
            sq += s * s;
        }
        *norm = sqrt(sq);
    }
    ap_btard_clip_ws_free(ws);
    return rc;
}

int ap_btard_butterfly_clip(void *arg, const float *const *x, const double *w, size_t n, size_t d,
                            float *out, uint32_t *clipped)
{
    ap_btard_bclip_t *b = arg;
    if (!b || !clipped) return AP_EINVAL;
    ap_btard_clip_stats_t st = {0};
    int rc = ap_btard_clip(b->ws, x, w, n, d, &b->cfg, out, &st);
    b->last = st;
    *clipped = rc ? 0 : (uint32_t)st.clipped;
    return rc;
}
