/* libFuzzer target for the checkpoint decoder (ap_nn_checkpoint_decode).
 *
 * Input: one selector byte, then the file bytes. Selector bit 0-1 pick the
 * target (GPT + AdamW state, GPT weights only, MLP weights only); bit 2 asks
 * the harness to recompute the BLAKE2b trailer so mutations reach the
 * header and payload checks behind the checksum. The seed corpus
 * (fuzz/corpus/checkpoint/) holds valid files for these exact models, made by
 * `apiary nn-train --fuzz-corpus DIR`. */
#include "apiary/log.h"
#include "apiary/nn.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

/* Shared with tools/apiary/cmd_nn.c (--fuzz-corpus). */
static ap_nn_gpt_config_t fuzz_gpt_config(void)
{
    ap_nn_gpt_config_t c = ap_nn_gpt_config_default(4, 1, 1, 4, 1);
    c.vocab = 8;
    return c;
}

static ap_nn_model_t *gpt, *mlp;
static ap_nn_solver_t *opt;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!gpt) {
        ap_log_set_level(AP_LOG_OFF);
        if (sodium_init() < 0) abort();
        ap_nn_gpt_config_t gc = fuzz_gpt_config();
        ap_nn_mlp_config_t mc = {
            .in_dim = 3, .n_hidden = 1, .hidden = {4}, .n_classes = 2, .max_batch = 1};
        if (ap_nn_gpt_new(&gc, &gpt) || ap_nn_mlp_new(&mc, &mlp)) abort();
        ap_nn_params_t *p = ap_nn_model_params(gpt);
        ap_nn_solver_config_t oc = ap_nn_solver_defaults(AP_NN_ADAMW);
        if (ap_nn_solver_new(&oc, p->count, p->views, p->nviews, &opt)) abort();
    }
    if (size < 1) return 0;
    uint8_t sel = data[0];
    size_t len = size - 1;
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) return 0;
    memcpy(buf, data + 1, len);
    if ((sel & 4) && len >= AP_NN_CKPT_HEADER + 32)
        crypto_generichash(buf + len - 32, 32, buf, len - 32, NULL, 0);
    uint64_t step;
    int rc; /* any outcome is fine: the decoder must not crash or leak */
    switch (sel & 3) {
    case 0:
        rc = ap_nn_checkpoint_decode(buf, len, gpt, opt, &step);
        break;
    case 1:
        rc = ap_nn_checkpoint_decode(buf, len, gpt, NULL, &step);
        break;
    default:
        rc = ap_nn_checkpoint_decode(buf, len, mlp, NULL, NULL);
        break;
    }
    (void)rc;
    free(buf);
    return 0;
}
