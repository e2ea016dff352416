/* The run's configuration every peer must share: what a collab's is, and the
 * comparison that names the first differing field with both values. The
 * wire encoding and the digest are in progress.c. */
#include "collab_impl.h"

#include <stdio.h>
#include <string.h>

static const char *codec_name(uint32_t c, char *tmp, size_t n)
{
    switch (c) {
    case AP_AVG_CODEC_F32:
        return "none";
    case AP_AVG_CODEC_FP16:
        return "fp16";
    case AP_AVG_CODEC_BF16:
        return "bf16";
    case AP_AVG_CODEC_UNIFORM8:
        return "uniform8";
    case AP_AVG_CODEC_BLOCKWISE8:
        return "blockwise8";
    default:
        snprintf(tmp, n, "codec %u", c);
        return tmp;
    }
}

static const char *solver_name(uint32_t k, char *tmp, size_t n)
{
    switch (k) {
    case AP_NN_SGD:
        return "sgd";
    case AP_NN_ADAM:
        return "adam";
    case AP_NN_ADAMW:
        return "adamw";
    case AP_NN_LAMB:
        return "lamb";
    default:
        snprintf(tmp, n, "optimizer %u", k);
        return tmp;
    }
}

static const char *lr_kind_name(uint32_t k, char *tmp, size_t n)
{
    switch (k) {
    case AP_NN_LR_CONSTANT:
        return "constant";
    case AP_NN_LR_LINEAR:
        return "linear";
    case AP_NN_LR_COSINE:
        return "cosine";
    case AP_NN_LR_RSQRT:
        return "rsqrt";
    default:
        snprintf(tmp, n, "schedule %u", k);
        return tmp;
    }
}

void ap__collab_make_run_config(const ap_collab_t *c, ap_run_config_t *rc)
{
    memset(rc, 0, sizeof *rc);
    if (c->cfg.model_desc) snprintf(rc->model, sizeof rc->model, "%s", c->cfg.model_desc);
    rc->n_params = c->n;
    rc->state_count = c->opt->state_count;
    rc->codec = c->cfg.codec;
    rc->state_codec = c->cfg.state_codec;
    rc->target_batch_size = c->cfg.target_batch_size;
    rc->solver = (uint32_t)c->cfg.solver.kind;
    rc->lr_kind = (uint32_t)c->cfg.lr.kind;
    rc->lr = c->cfg.lr.base;
    rc->lr_min = c->cfg.lr.min;
    rc->warmup = c->cfg.lr.warmup;
    rc->lr_total = c->cfg.lr.total;
    rc->weight_decay = c->cfg.solver.weight_decay;
    rc->clip = c->cfg.max_grad_norm;
    rc->state_every = c->cfg.average_state_every;
    rc->exact = c->cfg.max_local_samples != 0;
    rc->dht_matchmaking = c->cfg.dht_matchmaking;
    rc->byzantine_tolerant = c->cfg.byzantine_tolerant;
    rc->btard_tau = c->cfg.byzantine_tolerant ? c->cfg.btard_tau : 0;
    rc->btard_validators = c->cfg.byzantine_tolerant ? c->cfg.btard_validators : 0;
}

typedef struct diff_out {
    char *out;
    size_t cap;
    const char *an, *bn;
} diff_out_t;

static int differs(diff_out_t *d, const char *field, const char *a, const char *b)
{
    snprintf(d->out, d->cap, "%s: %s %s, %s %s", field, a, d->an, b, d->bn);
    return 1;
}

int ap_run_config_diff(const ap_run_config_t *a, const char *a_name, const ap_run_config_t *b,
                       const char *b_name, char *out, size_t cap)
{
    char ta[80], tb[80];
    diff_out_t d = {out, cap, a_name ? a_name : "here", b_name ? b_name : "there"};
    if (cap) out[0] = 0;
    if (strcmp(a->model, b->model) != 0) {
        snprintf(ta, sizeof ta, "'%s'", a->model);
        snprintf(tb, sizeof tb, "'%s'", b->model);
        return differs(&d, "model", ta, tb);
    }
#define U64(field, name)                                                                           \
    if (a->field != b->field) {                                                                    \
        snprintf(ta, sizeof ta, "%llu", (unsigned long long)a->field);                             \
        snprintf(tb, sizeof tb, "%llu", (unsigned long long)b->field);                             \
        return differs(&d, name, ta, tb);                                                          \
    }
#define NUM(field, name)                                                                           \
    if (a->field != b->field) {                                                                    \
        snprintf(ta, sizeof ta, "%g", (double)a->field);                                           \
        snprintf(tb, sizeof tb, "%g", (double)b->field);                                           \
        return differs(&d, name, ta, tb);                                                          \
    }
#define NAMED(field, name, fn)                                                                     \
    if (a->field != b->field) {                                                                    \
        char xa[32], xb[32];                                                                       \
        return differs(&d, name, fn(a->field, xa, sizeof xa), fn(b->field, xb, sizeof xb));        \
    }
#define FLAG(field, name)                                                                          \
    if (a->field != b->field)                                                                      \
        return differs(&d, name, a->field ? "on" : "off", b->field ? "on" : "off");
    U64(n_params, "parameter count")
    NAMED(solver, "optimizer", solver_name)
    U64(state_count, "optimizer state size")
    NAMED(codec, "compression", codec_name)
    U64(target_batch_size, "target batch size")
    NUM(lr, "learning rate")
    NAMED(lr_kind, "schedule", lr_kind_name)
    U64(warmup, "warm-up epochs")
    U64(lr_total, "schedule epochs")
    NUM(lr_min, "final learning rate")
    NUM(weight_decay, "weight decay")
    NUM(clip, "gradient clipping")
    U64(state_every, "state averaging every")
    FLAG(exact, "exact mode")
    FLAG(dht_matchmaking, "dht matchmaking")
    FLAG(byzantine_tolerant, "byzantine-tolerant")
    NUM(btard_tau, "btard tau")
    NAMED(state_codec, "state compression", codec_name)
    U64(btard_validators, "btard validators")
#undef U64
#undef NUM
#undef NAMED
#undef FLAG
    return 0;
}

void ap_collab_run_config(const ap_collab_t *c, ap_run_config_t *out)
{
    *out = c->runcfg;
}

const char *ap_collab_refusal(const ap_collab_t *c)
{
    return c->refused || c->shut_out ? c->refusal : NULL;
}
