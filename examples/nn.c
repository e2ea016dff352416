/* The model kit: a small byte-level GPT learns to continue a repeating text
 * with AdamW; the loss falls within a few dozen steps. */
#include <apiary/error.h>
#include <apiary/nn.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define B 4
#define T 32

int main(void)
{
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(/*ctx*/ T, /*layers*/ 2, /*heads*/ 2,
                                                      /*width*/ 32, /*batch*/ B);
    ap_nn_model_t *m;
    if (ap_nn_gpt_new(&cfg, &m) != 0) return 1;
    ap_nn_model_init(m, 1);
    ap_nn_params_t *p = ap_nn_model_params(m);
    ap_nn_solver_config_t oc = ap_nn_solver_defaults(AP_NN_ADAMW);
    ap_nn_solver_t *o;
    if (ap_nn_solver_new(&oc, p->count, p->views, p->nviews, &o) != 0) return 1;

    static const char text[] = "the quick brown fox jumps over the lazy dog. ";
    size_t tl = strlen(text);
    int32_t tokens[B * T], targets[B * T];
    float first = 0, loss = 0;
    for (int step = 0; step < 60; step++) {
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                size_t at = (size_t)(step * 7 + b * 11 + t);
                tokens[b * T + t] = (uint8_t)text[at % tl];
                targets[b * T + t] = (uint8_t)text[(at + 1) % tl];
            }
        ap_nn_model_zero_grad(m);
        int rc = ap_nn_gpt_loss(m, tokens, targets, B, T, &loss);
        if (rc == AP_ENONFINITE) continue; /* skip the step */
        if (rc != 0) return 1;
        if (step == 0) first = loss;
        ap_nn_gpt_backward(m, NULL, NULL);
        ap_nn_clip_grad_norm(p->grad, p->count, 1.0);
        ap_nn_solver_step(o, p->data, p->grad, 3e-3f);
    }
    printf("loss %.3f -> %.3f over 60 steps (%zu parameters)\n", first, loss, p->count);
    ap_nn_solver_free(o);
    ap_nn_model_free(m);
    return loss < first * 0.7f ? 0 : 1;
}
