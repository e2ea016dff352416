/* `apiary train --btard-validators`: the gradient check's gradient (see
 * train_btard.c). */
#ifndef AP_CLI_TRAIN_BTARD_H
#define AP_CLI_TRAIN_BTARD_H

#include "apiary/collab.h"
#include "apiary/nn.h"

#include <stdint.h>

typedef struct ap_train_grad ap_train_grad_t;

/* A model of m's configuration of its own, for ap_train_grad (m itself is
 * not touched again). text: GPT's corpus (NULL for the MLP; borrowed).
 * data_seed: the run's data seed. batch: samples per recomputed gradient.
 * scale: 1, or the sign-flip attack's -1000 (experiments: every gradient
 * it computes is scaled). NULL on AP_ENOMEM or a model kind it cannot copy. */
ap_train_grad_t *ap_train_grad_new(ap_nn_model_t *m, const ap_nn_text_t *text, uint64_t data_seed,
                                   int batch, float scale);
void ap_train_grad_free(ap_train_grad_t *g);

/* ap_collab_grad_fn over an ap_train_grad_t: the mean gradient over the
 * batch samples ap_btard_minibatch draws from seed (MLP: samples of the
 * synthetic stream; GPT: windows of the corpus), at params. */
int ap_train_grad(void *arg, const float *params, size_t n, uint64_t epoch, const uint8_t seed[32],
                  float *out);

#endif
