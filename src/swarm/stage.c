/* A stage server's compute: one decoded stage call on a model-kit GPT stage.
 * The backward recomputes the forward from the inputs it carries, so it may
 * reach any server of the stage. */
#include "apiary/swarm.h"

#include <stdlib.h>
#include <string.h>

#define REFUSE(reason)                                                                             \
    do {                                                                                           \
        if (why) *why = (reason);                                                                  \
        return AP_EINVAL;                                                                          \
    } while (0)

int ap_swarm_stage_run(ap_nn_model_t *m, uint32_t stage, const ap_swarm_req_t *q,
                       ap_swarm_resp_t *resp, const char **why)
{
    if (!m || !q || !resp) return AP_EINVAL;
    memset(resp, 0, sizeof *resp);
    ap_nn_gpt_config_t c;
    if (ap_nn_model_gpt_config(m, &c)) REFUSE("stage model is not a GPT stage");
    if (q->stage != stage) REFUSE("wrong stage");
    if (q->C != (uint32_t)c.n_embd) REFUSE("wrong width");
    if (q->B > (uint32_t)c.max_batch || q->T > (uint32_t)c.ctx) REFUSE("batch too large");
    if (c.embed && !q->tokens) REFUSE("first stage needs tokens");
    if (!c.embed && !q->in) REFUSE("stage needs input activations");
    const bool bwd = q->op == AP_SWARM_BACKWARD;
    if (bwd && c.head && !q->targets) REFUSE("last stage backward needs targets");
    if (bwd && !c.head && !q->dout) REFUSE("backward needs the output gradient");
    const size_t NC = (size_t)q->B * q->T * q->C;
    float *out = NULL, *din = NULL;
    if (!c.head && !(out = malloc(NC * sizeof *out))) return AP_ENOMEM;
    ap_nn_gpt_io_t io = {0};
    io.B = (int)q->B;
    io.T = (int)q->T;
    io.tokens = c.embed ? q->tokens : NULL;
    io.in = c.embed ? NULL : q->in;
    io.targets = c.head ? q->targets : NULL;
    io.out = out;
    int rc = ap_nn_gpt_forward(m, &io);
    if (rc) {
        if (why) *why = "forward failed on this input";
        goto fail;
    }
    if (bwd) {
        if (!c.embed && !(din = malloc(NC * sizeof *din))) {
            rc = AP_ENOMEM;
            goto fail;
        }
        if ((rc = ap_nn_gpt_backward(m, q->dout, din))) {
            if (why) *why = "backward failed";
            goto fail;
        }
        free(out);
        out = NULL;
    }
    resp->op = q->op;
    resp->B = q->B;
    resp->T = q->T;
    resp->C = q->C;
    resp->has_loss = c.head && q->targets;
    resp->loss = resp->has_loss ? io.loss : 0;
    resp->act = bwd ? din : out;
    return 0;
fail:
    free(out);
    free(din);
    return rc;
}
