/* Fuzz target: the SWARM stage call decoders. Each input is tried as a
 * request and as a response; one that decodes is re-encoded without
 * compression and must decode again to the same shape and values. */
#include "apiary/swarm.h"

#include <stdlib.h>
#include <string.h>

static void same(const float *a, const float *b, size_t n)
{
    if (!a != !b) abort();
    if (a && memcmp(a, b, n * sizeof *a)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    const char *why = NULL;
    uint8_t *out = NULL;
    size_t len = 0;
    ap_swarm_req_t q, q2;
    if (ap_swarm_req_decode(data, size, &q, &why) == 0) {
        if (ap_swarm_req_encode(&q, &none, &out, &len) != 0) abort();
        if (ap_swarm_req_decode(out, len, &q2, &why) != 0) abort();
        size_t n = (size_t)q.B * q.T * q.C;
        if (q2.B != q.B || q2.T != q.T || q2.C != q.C || q2.stage != q.stage) abort();
        if (q2.budget_us != q.budget_us) abort();
        same(q.in, q2.in, n);
        same(q.dout, q2.dout, n);
        if (!q.tokens != !q2.tokens || !q.targets != !q2.targets) abort();
        free(out);
        ap_swarm_req_clear(&q);
        ap_swarm_req_clear(&q2);
    }
    ap_swarm_resp_t r, r2;
    if (ap_swarm_resp_decode(data, size, &r, &why) == 0) {
        if (ap_swarm_resp_encode(&r, &none, &out, &len) != 0) abort();
        if (ap_swarm_resp_decode(out, len, &r2, &why) != 0) abort();
        if (r2.B != r.B || r2.has_loss != r.has_loss) abort();
        same(r.act, r2.act, (size_t)r.B * r.T * r.C);
        free(out);
        ap_swarm_resp_clear(&r);
        ap_swarm_resp_clear(&r2);
    }
    return 0;
}
