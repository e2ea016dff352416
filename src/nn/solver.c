/* Local optimizers on flat buffers, gradient clipping, LR schedules.
 * reference: torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW (PyTorch
 * 1.13 semantics), LAMB: You et al. 2019, "Large Batch Optimization for Deep
 * Learning: Training BERT in 76 minutes", Algorithm 2. */
#include "apiary/nn.h"

#include "apiary/error.h"
#include "apiary/log.h"
#include "nn/nn_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* vectorise the update loops (sqrtf without errno; see src/nn/kernels.c) */
#pragma GCC optimize("O3", "no-trapping-math", "no-math-errno")
#endif

ap_nn_solver_config_t ap_nn_solver_defaults(ap_nn_solver_kind_t kind)
{
    ap_nn_solver_config_t c = {.kind = kind, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    if (kind == AP_NN_SGD) c.momentum = 0.9f;
    if (kind == AP_NN_ADAMW) c.weight_decay = 0.01f;
    if (kind == AP_NN_LAMB) {
        c.eps = 1e-6f;
        c.weight_decay = 0.01f;
    }
    return c;
}

static bool valid(const ap_nn_solver_config_t *c)
{
    if (c->kind < AP_NN_SGD || c->kind > AP_NN_LAMB) return false;
    if (!(c->weight_decay >= 0.0f) || !isfinite(c->weight_decay)) return false;
    if (c->kind == AP_NN_SGD)
        return c->momentum >= 0.0f && c->momentum < 1.0f && (!c->nesterov || c->momentum > 0.0f);
    return c->beta1 >= 0.0f && c->beta1 < 1.0f && c->beta2 >= 0.0f && c->beta2 < 1.0f &&
           c->eps > 0.0f && isfinite(c->eps);
}

int ap_nn_solver_new(const ap_nn_solver_config_t *cfg, size_t n, const ap_nn_view_t *views,
                     size_t nviews, ap_nn_solver_t **out)
{
    *out = NULL;
    if (!cfg || !valid(cfg) || n == 0) {
        ap_warn(NN_LOG, "optim: invalid configuration (kind %d)", cfg ? (int)cfg->kind : -1);
        return AP_EINVAL;
    }
    for (size_t i = 0; i < nviews; i++)
        if (views[i].offset + views[i].count > n) return AP_EINVAL;
    ap_nn_solver_t *o = calloc(1, sizeof *o);
    if (!o) return AP_ENOMEM;
    o->cfg = *cfg;
    o->n = n;
    o->state_count = cfg->kind == AP_NN_SGD ? n : 2 * n;
    o->state = ap__big_alloc(o->state_count * sizeof(float));
    if (nviews) {
        o->segs = malloc(nviews * sizeof *o->segs);
        o->nsegs = nviews;
    } else {
        o->segs = calloc(1, sizeof *o->segs);
        o->nsegs = 1;
        if (o->segs) o->segs[0].count = n;
    }
    if (!o->state || !o->segs) {
        ap_nn_solver_free(o);
        return AP_ENOMEM;
    }
    if (nviews) memcpy(o->segs, views, nviews * sizeof *views);
    *out = o;
    return 0;
}

void ap_nn_solver_free(ap_nn_solver_t *o)
{
    if (!o) return;
    ap__big_free(o->state, o->state_count * sizeof(float));
    free(o->segs);
    free(o);
}

void ap_nn_solver_reset(ap_nn_solver_t *o)
{
    memset(o->state, 0, o->state_count * sizeof(float));
    o->step = 0;
}

typedef struct ostep {
    ap_nn_solver_t *o;
    float *p;
    const float *g;
    float lr, bc1, bc2;
} ostep_t;

NN_SIMD static void sgd_range(void *arg, size_t i0, size_t i1)
{
    const ostep_t *s = arg;
    const ap_nn_solver_config_t *c = &s->o->cfg;
    float *buf = s->o->state;
    const bool first = s->o->step == 0;
    for (size_t i = i0; i < i1; i++) {
        float g = s->g[i] + c->weight_decay * s->p[i];
        if (c->momentum > 0.0f) {
            /* torch: buf = g on the first step, else mu*buf + g (dampening 0) */
            buf[i] = first ? g : c->momentum * buf[i] + g;
            g = c->nesterov ? g + c->momentum * buf[i] : buf[i];
        }
        s->p[i] -= s->lr * g;
    }
}

NN_SIMD static void adam_range(void *arg, size_t i0, size_t i1)
{
    const ostep_t *s = arg;
    const ap_nn_solver_config_t *c = &s->o->cfg;
    float *restrict mo = s->o->state, *restrict ve = s->o->state + s->o->n;
    float *restrict p = s->p;
    const float *restrict gr = s->g;
    const float b1 = c->beta1, b2 = c->beta2, lr = s->lr, eps = c->eps, bc1 = s->bc1, bc2 = s->bc2;
    /* AdamW decays the weights (decay < 1); Adam adds wd * p to the gradient (l2) */
    const float decay = c->kind == AP_NN_ADAMW ? 1.0f - lr * c->weight_decay : 1.0f;
    const float l2 = c->kind == AP_NN_ADAMW ? 0.0f : c->weight_decay;
    for (size_t i = i0; i < i1; i++) {
        float g = gr[i] + l2 * p[i];
        float w = p[i] * decay;
        mo[i] = b1 * mo[i] + (1.0f - b1) * g;
        ve[i] = b2 * ve[i] + (1.0f - b2) * g * g;
        float mh = mo[i] / bc1, vh = ve[i] / bc2;
        p[i] = w - lr * mh / (ap__nn_sqrtf(vh) + eps);
    }
}

/* LAMB, one segment per item: moments, then the trust ratio of the segment. */
static void lamb_segs(void *arg, size_t j0, size_t j1)
{
    const ostep_t *s = arg;
    const ap_nn_solver_config_t *c = &s->o->cfg;
    float *mo = s->o->state, *ve = s->o->state + s->o->n;
    for (size_t j = j0; j < j1; j++) {
        const ap_nn_view_t *v = &s->o->segs[j];
        double pn = 0.0, un = 0.0;
        for (size_t i = v->offset; i < v->offset + v->count; i++) {
            float g = s->g[i];
            mo[i] = c->beta1 * mo[i] + (1.0f - c->beta1) * g;
            ve[i] = c->beta2 * ve[i] + (1.0f - c->beta2) * g * g;
            float u =
                (mo[i] / s->bc1) / (sqrtf(ve[i] / s->bc2) + c->eps) + c->weight_decay * s->p[i];
            pn += (double)s->p[i] * s->p[i];
            un += (double)u * u;
        }
        pn = sqrt(pn);
        un = sqrt(un);
        float trust = (pn > 0.0 && un > 0.0) ? (float)(pn / un) : 1.0f;
        for (size_t i = v->offset; i < v->offset + v->count; i++) {
            float u =
                (mo[i] / s->bc1) / (sqrtf(ve[i] / s->bc2) + c->eps) + c->weight_decay * s->p[i];
            s->p[i] -= s->lr * trust * u;
        }
    }
}

int ap_nn_solver_step(ap_nn_solver_t *o, float *params, const float *grads, float lr)
{
    if (!o || !params || !grads) return AP_EINVAL;
    if (!isfinite(lr)) {
        ap_warn(NN_LOG, "optim: non-finite learning rate, step skipped");
        return AP_ENONFINITE;
    }
    ostep_t s = {.o = o, .p = params, .g = grads, .lr = lr};
    const ap_nn_solver_config_t *c = &o->cfg;
    double t = (double)(o->step + 1);
    s.bc1 = (float)(1.0 - pow(c->beta1, t));
    s.bc2 = (float)(1.0 - pow(c->beta2, t));
    switch (c->kind) {
    case AP_NN_SGD:
        ap__nn_par(o->n, 8192, 0, sgd_range, &s);
        break;
    case AP_NN_ADAM:
    case AP_NN_ADAMW:
        ap__nn_par(o->n, 8192, 0, adam_range, &s);
        break;
    case AP_NN_LAMB:
        ap__nn_par(o->nsegs, 1, 0, lamb_segs, &s);
        break;
    }
    o->step++;
    return 0;
}

/* Fixed 64 parts, each summed in double over 8 lanes: the result does not
 * depend on the thread count. */
enum { NORM_PARTS = 64 };

typedef struct norm_args {
    float *g;
    size_t n, per;
    double *part;
    float scale;
} norm_args_t;

NN_SIMD static void norm_parts(void *arg, size_t k0, size_t k1)
{
    const norm_args_t *a = arg;
    for (size_t k = k0; k < k1; k++) {
        size_t b = k * a->per, e = b + a->per < a->n ? b + a->per : a->n;
        const float *restrict g = a->g;
        double acc[8] = {0}, s = 0.0;
        size_t i = b;
        for (; i + 8 <= e; i += 8)
            for (int l = 0; l < 8; l++) acc[l] += (double)g[i + l] * g[i + l];
        for (; i < e; i++) s += (double)g[i] * g[i];
        for (int l = 0; l < 8; l++) s += acc[l];
        a->part[k] = s;
    }
}

double ap_nn_grad_norm(const float *g, size_t n)
{
    double part[NORM_PARTS] = {0};
    norm_args_t a = {(float *)g, n, (n + NORM_PARTS - 1) / NORM_PARTS, part, 0};
    if (n > 0) ap__nn_par(NORM_PARTS, 1, 1, norm_parts, &a);
    double s = 0.0;
    for (size_t k = 0; k < NORM_PARTS; k++) s += part[k];
    return sqrt(s);
}

NN_SIMD static void scale_range(void *arg, size_t i0, size_t i1)
{
    const norm_args_t *a = arg;
    float *restrict g = a->g;
    const float k = a->scale;
    for (size_t i = i0; i < i1; i++) g[i] *= k;
}

double ap_nn_clip_grad_norm(float *g, size_t n, double max_norm)
{
    double norm = ap_nn_grad_norm(g, n);
    if (!isfinite(norm)) return norm;
    if (max_norm > 0.0 && norm > max_norm) {
        norm_args_t a = {g, n, 0, NULL, (float)(max_norm / (norm + 1e-6))};
        ap__nn_par(n, 16384, 0, scale_range, &a);
    }
    return norm;
}

static const struct {
    const char *name;
    int kind;
} optim_names[] = {{"sgd", AP_NN_SGD},
                   {"adam", AP_NN_ADAM},
                   {"adamw", AP_NN_ADAMW},
                   {"lamb", AP_NN_LAMB}},
  lr_names[] = {{"constant", AP_NN_LR_CONSTANT},
                {"linear", AP_NN_LR_LINEAR},
                {"cosine", AP_NN_LR_COSINE},
                {"rsqrt", AP_NN_LR_RSQRT}};

const char *ap_nn_solver_kind_name(ap_nn_solver_kind_t kind)
{
    for (size_t i = 0; i < sizeof optim_names / sizeof optim_names[0]; i++)
        if (optim_names[i].kind == (int)kind) return optim_names[i].name;
    return "?";
}

int ap_nn_solver_kind_from_name(const char *name, ap_nn_solver_kind_t *out)
{
    for (size_t i = 0; name && i < sizeof optim_names / sizeof optim_names[0]; i++)
        if (strcmp(optim_names[i].name, name) == 0) {
            *out = (ap_nn_solver_kind_t)optim_names[i].kind;
            return 0;
        }
    return AP_EINVAL;
}

const char *ap_nn_lr_kind_name(ap_nn_lr_kind_t kind)
{
    for (size_t i = 0; i < sizeof lr_names / sizeof lr_names[0]; i++)
        if (lr_names[i].kind == (int)kind) return lr_names[i].name;
    return "?";
}

int ap_nn_lr_kind_from_name(const char *name, ap_nn_lr_kind_t *out)
{
    for (size_t i = 0; name && i < sizeof lr_names / sizeof lr_names[0]; i++)
        if (strcmp(lr_names[i].name, name) == 0) {
            *out = (ap_nn_lr_kind_t)lr_names[i].kind;
            return 0;
        }
    return AP_EINVAL;
}

float ap_nn_lr_at(const ap_nn_lr_schedule_t *s, uint64_t step)
{
    if (s->warmup > 0 && step < s->warmup) return s->base * (float)(step + 1) / (float)s->warmup;
    if (s->kind == AP_NN_LR_CONSTANT) return s->base;
    if (s->kind == AP_NN_LR_RSQRT) {
        uint64_t from = s->total > s->warmup ? s->total : s->warmup;
        if (from == 0) from = 1;
        if (step < from) return s->base;
        double r = s->base * sqrt((double)from / (double)(step + 1));
        return (float)(r > s->min ? r : s->min);
    }
    if (s->total <= s->warmup || step >= s->total) return s->min;
    double frac = (double)(step - s->warmup) / (double)(s->total - s->warmup);
    double k = s->kind == AP_NN_LR_LINEAR ? 1.0 - frac : 0.5 * (1.0 + cos(M_PI * frac));
    return (float)(s->min + (s->base - s->min) * k);
}
