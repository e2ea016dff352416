/* `apiary train --btard-validators`: the gradient check's gradient (see
 * train_btard.c). */
#ifndef AP_CLI_TRAIN_BTARD_H
#define AP_CLI_TRAIN_BTARD_H

#include "apiary/collab.h"
#include "apiary/nn.h"

#include <stdint.h>

/* `apiary train --attack NAME` (experiments, off unless asked). */
typedef enum ap_train_attack {
    AP_TRAIN_HONEST = 0,
    AP_TRAIN_SIGN_FLIP,        /* sign-flip: the gradient times -1000 */
    AP_TRAIN_RANDOM_DIRECTION, /* random-direction: 1000 x |g| along a unit direction
                                * from the epoch alone (every attacker the same) */
    AP_TRAIN_IPM,              /* ipm: -0.5 x its own gradient (its estimate of the
                                * honest mean: inner-product manipulation) */
    AP_TRAIN_LABEL_FLIP,       /* label-flip: labels y -> C-1-y (MLP classes, GPT bytes) */
    AP_TRAIN_BAD_AGGREGATOR,   /* bad-aggregator: adds 0.1 to the part it aggregates */
    AP_TRAIN_FALSE_ACCUSER,    /* false-accuser: accuses the next member every step */
    AP_TRAIN_WITHHOLD_REVEAL,  /* withhold-reveal: withholds its MPRNG reveal */
} ap_train_attack_t;

/* The attack named (as above), or -1. */
int ap_train_attack_parse(const char *name);
/* The names, comma-separated, for messages. */
const char *ap_train_attack_names(void);
/* The name of attack a ("honest" for AP_TRAIN_HONEST). */
const char *ap_train_attack_name(ap_train_attack_t a);
/* A gradient attack applied to g (n floats) at epoch; no-op for the others. */
void ap_train_attack_grad(ap_train_attack_t a, uint64_t epoch, float *g, size_t n);
/* label-flip on n labels of `classes` classes; no-op for the others. */
void ap_train_attack_labels(ap_train_attack_t a, int32_t *y, size_t n, int classes);

typedef struct ap_train_grad ap_train_grad_t;

/* A model of m's configuration of its own, for ap_train_grad (m itself is
 * not touched again). text: GPT's corpus (NULL for the MLP; borrowed).
 * data_seed: the run's data seed. batch: samples per recomputed gradient.
 * attack: AP_TRAIN_HONEST, or a gradient or label attack that every
 * gradient it computes then carries (its own vector and its recomputations
 * of others' alike). NULL on AP_ENOMEM or a model kind it cannot copy. */
ap_train_grad_t *ap_train_grad_new(ap_nn_model_t *m, const ap_nn_text_t *text, uint64_t data_seed,
                                   int batch, ap_train_attack_t attack);
void ap_train_grad_free(ap_train_grad_t *g);

/* ap_collab_grad_fn over an ap_train_grad_t: the mean gradient over the
 * batch samples ap_btard_minibatch draws from seed (MLP: samples of the
 * synthetic stream; GPT: windows of the corpus), at params. */
int ap_train_grad(void *arg, const float *params, size_t n, uint64_t epoch, const uint8_t seed[32],
                  float *out);

#endif
