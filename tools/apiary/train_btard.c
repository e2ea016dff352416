/* `apiary train --btard-validators`: the gradient check's gradient. The
 * vector a peer sends and a validator's recomputation of it are the same
 * function of the epoch's parameters and a minibatch drawn from the peer's
 * seed (apiary/collab.h, ap_collab_grad_fn), computed on a model of its own
 * so that the training thread's model is never touched. */
#include "train_btard.h"

#include "apiary/btard.h"
#include "apiary/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The synthetic MLP stream's samples drawn from (an infinite stream) */
#define SYNTH_SPAN (1ull << 40)

struct ap_train_grad {
    ap_nn_model_t *m;
    const ap_nn_text_t *text;
    uint64_t seed;
    int batch, T;
    ap_train_attack_t attack;
    uint64_t *idx;
    int32_t *in, *tg;
    float *x;
};

void ap_train_grad_free(ap_train_grad_t *g)
{
    if (!g) return;
    ap_nn_model_free(g->m);
    free(g->idx);
    free(g->in);
    free(g->tg);
    free(g->x);
    free(g);
}

ap_train_grad_t *ap_train_grad_new(ap_nn_model_t *m, const ap_nn_text_t *text, uint64_t data_seed,
                                   int batch, ap_train_attack_t attack)
{
    ap_train_grad_t *g = calloc(1, sizeof *g);
    if (!g || batch <= 0) {
        free(g);
        return NULL;
    }
    g->text = text;
    g->seed = data_seed;
    g->batch = batch;
    g->attack = attack;
    int rc;
    ap_nn_gpt_config_t gc;
    ap_nn_mlp_config_t mc;
    if (ap_nn_model_gpt_config(m, &gc) == 0) {
        if (!text)
            rc = AP_EINVAL;
        else
            rc = ap_nn_gpt_new(&gc, &g->m);
        g->T = gc.ctx;
        size_t toks = (size_t)batch * (size_t)gc.ctx;
        if (!rc &&
            (!(g->in = malloc(toks * sizeof *g->in)) || !(g->tg = malloc(toks * sizeof *g->tg))))
            rc = AP_ENOMEM;
    } else if (ap_nn_model_mlp_config(m, &mc) == 0) {
        rc = ap_nn_mlp_new(&mc, &g->m);
        if (!rc && (!(g->x = malloc((size_t)batch * (size_t)mc.in_dim * sizeof *g->x)) ||
                    !(g->tg = malloc((size_t)batch * sizeof *g->tg))))
            rc = AP_ENOMEM;
    } else {
        rc = AP_EINVAL;
    }
    if (!rc && !(g->idx = malloc((size_t)batch * sizeof *g->idx))) rc = AP_ENOMEM;
    if (rc) {
        ap_train_grad_free(g);
        return NULL;
    }
    return g;
}

int ap_train_grad(void *arg, const float *params, size_t n, uint64_t epoch, const uint8_t seed[32],
                  float *out)
{
    ap_train_grad_t *g = arg;
    ap_nn_params_t *pr = ap_nn_model_params(g->m);
    if (n != pr->count) return AP_EINVAL;
    memcpy(pr->data, params, n * sizeof(float));
    ap_nn_model_zero_grad(g->m);
    float loss = 0;
    int rc;
    if (g->text) {
        uint64_t windows = ap_nn_text_windows(g->text, g->T);
        if (!windows) return AP_EINVAL;
        ap_btard_minibatch(seed, 0, windows, (size_t)g->batch, g->idx);
        rc = 0;
        for (int b = 0; b < g->batch && !rc; b++) {
            uint64_t cursor = g->idx[b];
            size_t o = (size_t)b * (size_t)g->T;
            rc = ap_nn_text_batch(g->text, g->seed, &cursor, 1, g->T, g->in + o, g->tg + o);
        }
        ap_train_attack_labels(g->attack, g->tg, (size_t)g->batch * (size_t)g->T, 256);
        if (!rc) rc = ap_nn_gpt_loss(g->m, g->in, g->tg, g->batch, g->T, &loss);
        if (!rc) rc = ap_nn_gpt_backward(g->m, NULL, NULL);
    } else {
        ap_nn_mlp_config_t mc;
        rc = ap_nn_model_mlp_config(g->m, &mc);
        if (rc) return rc;
        ap_btard_minibatch(seed, 0, SYNTH_SPAN, (size_t)g->batch, g->idx);
        for (int b = 0; b < g->batch; b++)
            ap_nn_synth_classify(7, g->seed, g->idx[b], 1, mc.in_dim, mc.n_classes,
                                 g->x + (size_t)b * (size_t)mc.in_dim, g->tg + b);
        ap_train_attack_labels(g->attack, g->tg, (size_t)g->batch, mc.n_classes);
        rc = ap_nn_mlp_forward(g->m, g->x, g->tg, g->batch, &loss);
        if (!rc) rc = ap_nn_mlp_backward(g->m);
    }
    if (rc) return rc;
    memcpy(out, pr->grad, n * sizeof(float));
    ap_train_attack_grad(g->attack, epoch, out, n);
    return 0;
}

static const char *const attack_names[] = {[AP_TRAIN_HONEST] = "honest",
                                           [AP_TRAIN_SIGN_FLIP] = "sign-flip",
                                           [AP_TRAIN_RANDOM_DIRECTION] = "random-direction",
                                           [AP_TRAIN_IPM] = "ipm",
                                           [AP_TRAIN_LABEL_FLIP] = "label-flip",
                                           [AP_TRAIN_BAD_AGGREGATOR] = "bad-aggregator",
                                           [AP_TRAIN_FALSE_ACCUSER] = "false-accuser",
                                           [AP_TRAIN_WITHHOLD_REVEAL] = "withhold-reveal"};

int ap_train_attack_parse(const char *name)
{
    for (int a = AP_TRAIN_SIGN_FLIP; a <= AP_TRAIN_WITHHOLD_REVEAL; a++)
        if (name && strcmp(name, attack_names[a]) == 0) return a;
    return -1;
}

const char *ap_train_attack_names(void)
{
    static char list[160];
    if (!list[0])
        for (int a = AP_TRAIN_SIGN_FLIP; a <= AP_TRAIN_WITHHOLD_REVEAL; a++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                     a > AP_TRAIN_SIGN_FLIP ? ", " : "", attack_names[a]);
    return list;
}

const char *ap_train_attack_name(ap_train_attack_t a)
{
    return a >= AP_TRAIN_HONEST && a <= AP_TRAIN_WITHHOLD_REVEAL ? attack_names[a] : "?";
}

void ap_train_attack_grad(ap_train_attack_t a, uint64_t epoch, float *g, size_t n)
{
    if (a == AP_TRAIN_SIGN_FLIP) {
        for (size_t i = 0; i < n; i++) g[i] *= -1000.0f;
    } else if (a == AP_TRAIN_IPM) {
        for (size_t i = 0; i < n; i++) g[i] *= -0.5f;
    } else if (a == AP_TRAIN_RANDOM_DIRECTION) {
        double norm = 0;
        for (size_t i = 0; i < n; i++) norm += (double)g[i] * g[i];
        norm = sqrt(norm);
        uint8_t seed[AP_BTARD_HASH_LEN] = "apiary attack: random direction";
        for (int i = 0; i < 8; i++) seed[AP_BTARD_HASH_LEN - 8 + i] = (uint8_t)(epoch >> (8 * i));
        /* the unit direction in place of g (its signs do not read g) */
        ap_btard_direction(seed, 0, n, g);
        for (size_t i = 0; i < n; i++) g[i] = (float)(1000.0 * norm * g[i]);
    }
}

void ap_train_attack_labels(ap_train_attack_t a, int32_t *y, size_t n, int classes)
{
    if (a != AP_TRAIN_LABEL_FLIP) return;
    for (size_t i = 0; i < n; i++) y[i] = classes - 1 - y[i];
}
