/* A SWARM stage server on a runtime: decodes stage calls, runs them on its
 * stage model, answers. Sans-I/O: runtime.h only. */
#include "apiary/log.h"
#include "apiary/swarm.h"

#include <stdlib.h>
#include <string.h>

#define MOD "swarm"

struct ap_swarm_server {
    ap_rt_t *rt;
    ap_nn_model_t *m;
    uint32_t stage;
    ap_codec_cfg_t codec;
    ap_swarm_server_stats_t st;
};

static ap_log_limit_t refuse_lim;

static void refuse(ap_swarm_server_t *s, ap_rpc_req_t *req, int rc, const char *why)
{
    char who[AP_PEER_SHORT_LEN];
    ap_peer_id_short(ap_rpc_req_peer(req), who);
    ap_log_limited(&refuse_lim, AP_LOG_WARN, MOD, "stage %u: refused a call from %s: %s (%s)",
                   s->stage, who, why ? why : "invalid", ap_err_name(rc));
    s->st.refused++;
    ap_rpc_respond_error(req, rc, why ? why : "invalid");
}

static void on_call(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    ap_swarm_server_t *s = arg;
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    const char *why = NULL;
    ap_swarm_req_t q;
    int rc = ap_swarm_req_decode(data, len, &q, &why);
    if (rc) {
        refuse(s, req, rc, why);
        return;
    }
    ap_swarm_resp_t r;
    rc = ap_swarm_stage_run(s->m, s->stage, &q, &r, &why);
    const ap_swarm_op_t op = q.op;
    ap_swarm_req_clear(&q);
    if (rc) {
        refuse(s, req, rc, why);
        return;
    }
    uint8_t *out;
    size_t olen;
    rc = ap_swarm_resp_encode(&r, &s->codec, &out, &olen);
    ap_swarm_resp_clear(&r);
    if (rc) {
        refuse(s, req, rc, "cannot encode the answer");
        return;
    }
    if (op == AP_SWARM_FORWARD)
        s->st.forwards++;
    else
        s->st.backwards++;
    ap_rpc_respond(req, out, olen);
    free(out);
}

int ap_swarm_server_new(ap_rt_t *rt, ap_nn_model_t *m, uint32_t stage, const ap_codec_cfg_t *codec,
                        ap_swarm_server_t **out)
{
    if (!rt || !m || !out) return AP_EINVAL;
    ap_nn_gpt_config_t c;
    if (ap_nn_model_gpt_config(m, &c)) return AP_EINVAL;
    ap_swarm_server_t *s = calloc(1, sizeof *s);
    if (!s) return AP_ENOMEM;
    s->rt = rt;
    s->m = m;
    s->stage = stage;
    if (codec)
        s->codec = *codec;
    else
        s->codec.id = AP_CODEC_BLOCKWISE8;
    int rc = ap_rt_rpc_register(rt, AP_SWARM_PROTO_STAGE, AP_SWARM_MSG_MAX, on_call, s);
    if (rc) {
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

void ap_swarm_server_free(ap_swarm_server_t *s)
{
    if (!s) return;
    ap_rt_rpc_unregister(s->rt, AP_SWARM_PROTO_STAGE);
    free(s);
}

void ap_swarm_server_stats(const ap_swarm_server_t *s, ap_swarm_server_stats_t *out)
{
    if (s && out) *out = s->st;
}
