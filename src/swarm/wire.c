/* SWARM stage call messages: encoding and the untrusted-bytes decoders
 * (format in docs/swarm.md). */
#include "apiary/swarm.h"

#include "base/buf.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define REQ_MAGIC  0x53
#define RESP_MAGIC 0x54
#define VERSION    1
#define REQ_HDR    20
#define RESP_HDR   16

enum { F_TOKENS = 1, F_TARGETS = 2, F_IN = 4, F_DOUT = 8, F_BUDGET = 16 };
enum { F_LOSS = 1, F_ACT = 2 };

#define FAIL(code, reason)                                                                         \
    do {                                                                                           \
        if (why) *why = (reason);                                                                  \
        rc = (code);                                                                               \
        goto fail;                                                                                 \
    } while (0)

static int shape_ok(uint32_t B, uint32_t T, uint32_t C)
{
    if (!B || !T || !C) return AP_EINVAL;
    uint64_t n = (uint64_t)B * T;
    if (n > AP_SWARM_TOKENS_MAX || n * C > AP_SWARM_TENSOR_MAX) return AP_ELIMIT;
    return 0;
}

static const ap_codec_cfg_t *codec_or_default(const ap_codec_cfg_t *c, ap_codec_cfg_t *tmp)
{
    if (c) return c;
    memset(tmp, 0, sizeof *tmp);
    tmp->id = AP_CODEC_BLOCKWISE8;
    return tmp;
}

static size_t tensor_bound(const ap_codec_cfg_t *c, size_t n)
{
    size_t s = ap_compress_size(c, n);
    return s ? 4 + s : 0;
}

static int put_tensor(ap_buf_t *b, const ap_codec_cfg_t *c, const float *x, size_t n)
{
    size_t need = ap_compress_size(c, n);
    if (!need) return AP_EINVAL;
    int rc = ap__buf_reserve(b, 4 + need);
    if (rc) return rc;
    size_t got = 0;
    rc = ap_compress_encode(c, x, n, 0, b->data + b->len + 4, need, &got);
    if (rc) return rc;
    ap__put_be32(b->data + b->len, (uint32_t)got);
    b->len += 4 + got;
    return 0;
}

static int put_ints(ap_buf_t *b, const int32_t *v, size_t n)
{
    int rc = ap__buf_reserve(b, 4 * n);
    if (rc) return rc;
    for (size_t i = 0; i < n; i++) ap__put_be32(b->data + b->len + 4 * i, (uint32_t)v[i]);
    b->len += 4 * n;
    return 0;
}

static void put_hdr(uint8_t *p, uint8_t magic, uint8_t op, uint8_t flags)
{
    p[0] = magic;
    p[1] = VERSION;
    p[2] = op;
    p[3] = flags;
}

int ap_swarm_req_encode(const ap_swarm_req_t *r, const ap_codec_cfg_t *codec, uint8_t **out,
                        size_t *len)
{
    if (!r || !out || !len) return AP_EINVAL;
    if (r->op != AP_SWARM_FORWARD && r->op != AP_SWARM_BACKWARD) return AP_EINVAL;
    int rc = shape_ok(r->B, r->T, r->C);
    if (rc) return rc;
    ap_codec_cfg_t tmp;
    const ap_codec_cfg_t *c = codec_or_default(codec, &tmp);
    const size_t N = (size_t)r->B * r->T, NC = N * r->C;
    if (!tensor_bound(c, NC)) return AP_EINVAL;
    uint8_t flags =
        (uint8_t)((r->tokens ? F_TOKENS : 0) | (r->targets ? F_TARGETS : 0) | (r->in ? F_IN : 0) |
                  (r->dout ? F_DOUT : 0) | (r->budget_us ? F_BUDGET : 0));
    ap_buf_t b;
    ap__buf_init(&b);
    if ((rc = ap__buf_reserve(&b, REQ_HDR))) goto fail;
    put_hdr(b.data, REQ_MAGIC, (uint8_t)r->op, flags);
    ap__put_be32(b.data + 4, r->stage);
    ap__put_be32(b.data + 8, r->B);
    ap__put_be32(b.data + 12, r->T);
    ap__put_be32(b.data + 16, r->C);
    b.len = REQ_HDR;
    if (r->tokens && (rc = put_ints(&b, r->tokens, N))) goto fail;
    if (r->targets && (rc = put_ints(&b, r->targets, N))) goto fail;
    if (r->in && (rc = put_tensor(&b, c, r->in, NC))) goto fail;
    if (r->dout && (rc = put_tensor(&b, c, r->dout, NC))) goto fail;
    if (r->budget_us) {
        if ((rc = ap__buf_reserve(&b, 4))) goto fail;
        ap__put_be32(b.data + b.len, r->budget_us);
        b.len += 4;
    }
    if (b.len > AP_SWARM_MSG_MAX) {
        rc = AP_ELIMIT;
        goto fail;
    }
    *out = b.data;
    *len = b.len;
    return 0;
fail:
    ap__buf_free(&b);
    return rc;
}

int ap_swarm_resp_encode(const ap_swarm_resp_t *r, const ap_codec_cfg_t *codec, uint8_t **out,
                         size_t *len)
{
    if (!r || !out || !len) return AP_EINVAL;
    if (r->op != AP_SWARM_FORWARD && r->op != AP_SWARM_BACKWARD) return AP_EINVAL;
    int rc = shape_ok(r->B, r->T, r->C);
    if (rc) return rc;
    if (r->has_loss && !isfinite(r->loss)) return AP_ENONFINITE;
    ap_codec_cfg_t tmp;
    const ap_codec_cfg_t *c = codec_or_default(codec, &tmp);
    const size_t NC = (size_t)r->B * r->T * r->C;
    uint8_t flags = (uint8_t)((r->has_loss ? F_LOSS : 0) | (r->act ? F_ACT : 0));
    ap_buf_t b;
    ap__buf_init(&b);
    if ((rc = ap__buf_reserve(&b, RESP_HDR + 4))) goto fail;
    put_hdr(b.data, RESP_MAGIC, (uint8_t)r->op, flags);
    ap__put_be32(b.data + 4, r->B);
    ap__put_be32(b.data + 8, r->T);
    ap__put_be32(b.data + 12, r->C);
    b.len = RESP_HDR;
    if (r->has_loss) {
        uint32_t bits;
        memcpy(&bits, &r->loss, 4);
        ap__put_be32(b.data + b.len, bits);
        b.len += 4;
    }
    if (r->act && (rc = put_tensor(&b, c, r->act, NC))) goto fail;
    *out = b.data;
    *len = b.len;
    return 0;
fail:
    ap__buf_free(&b);
    return rc;
}

/* ---- decoding ----------------------------------------------------------- */

static int get_ints(const uint8_t *in, size_t len, size_t *pos, size_t n, int32_t **out)
{
    if (len - *pos < 4 * n) return AP_ECORRUPT;
    int32_t *v = malloc(n * sizeof *v);
    if (!v) return AP_ENOMEM;
    for (size_t i = 0; i < n; i++) v[i] = (int32_t)ap__get_be32(in + *pos + 4 * i);
    *pos += 4 * n;
    *out = v;
    return 0;
}

static int get_tensor(const uint8_t *in, size_t len, size_t *pos, size_t n, float **out,
                      const char **why)
{
    if (len - *pos < 4) {
        if (why) *why = "truncated tensor";
        return AP_ECORRUPT;
    }
    uint32_t tl = ap__get_be32(in + *pos);
    *pos += 4;
    if (tl > len - *pos) {
        if (why) *why = "truncated tensor";
        return AP_ECORRUPT;
    }
    ap_compress_hdr_t h;
    int rc = ap_compress_parse(in + *pos, tl, &h);
    if (rc) {
        if (why) *why = "bad tensor encoding";
        return rc;
    }
    if (h.count != n || h.offset != 0) {
        if (why) *why = "tensor has the wrong shape";
        return AP_ECORRUPT;
    }
    float *x = malloc(n * sizeof *x);
    if (!x) return AP_ENOMEM;
    rc = ap_compress_decode(in + *pos, tl, x, n, NULL);
    if (rc) {
        free(x);
        if (why) *why = "bad tensor encoding";
        return rc;
    }
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) {
            free(x);
            if (why) *why = "non-finite value in tensor";
            return AP_ENONFINITE;
        }
    *pos += tl;
    *out = x;
    return 0;
}

static int get_hdr(const uint8_t *in, size_t len, size_t hdr, uint8_t magic, uint8_t known,
                   const char **why)
{
    if (len > AP_SWARM_MSG_MAX) {
        if (why) *why = "message too large";
        return AP_ELIMIT;
    }
    if (len < hdr || in[0] != magic) {
        if (why) *why = "not a swarm stage message";
        return AP_ECORRUPT;
    }
    if (in[1] != VERSION) {
        if (why) *why = "unsupported version";
        return AP_EVERSION;
    }
    if (in[2] != AP_SWARM_FORWARD && in[2] != AP_SWARM_BACKWARD) {
        if (why) *why = "unknown operation";
        return AP_ECORRUPT;
    }
    if (in[3] & ~known) {
        if (why) *why = "unknown flags";
        return AP_ECORRUPT;
    }
    return 0;
}

static int get_shape(uint32_t B, uint32_t T, uint32_t C, const char **why)
{
    int rc = shape_ok(B, T, C);
    if (rc == AP_EINVAL) {
        if (why) *why = "empty shape";
        return AP_ECORRUPT;
    }
    if (rc && why) *why = "tensor too large";
    return rc;
}

int ap_swarm_req_decode(const uint8_t *in, size_t len, ap_swarm_req_t *r, const char **why)
{
    if (!r) return AP_EINVAL;
    memset(r, 0, sizeof *r);
    if (!in) return AP_EINVAL;
    int rc =
        get_hdr(in, len, REQ_HDR, REQ_MAGIC, F_TOKENS | F_TARGETS | F_IN | F_DOUT | F_BUDGET, why);
    if (rc) return rc;
    uint8_t flags = in[3];
    r->op = (ap_swarm_op_t)in[2];
    r->stage = ap__get_be32(in + 4);
    r->B = ap__get_be32(in + 8);
    r->T = ap__get_be32(in + 12);
    r->C = ap__get_be32(in + 16);
    if ((rc = get_shape(r->B, r->T, r->C, why))) goto fail;
    const size_t N = (size_t)r->B * r->T, NC = N * r->C;
    size_t pos = REQ_HDR;
    if ((flags & F_TOKENS) && (rc = get_ints(in, len, &pos, N, &r->tokens)))
        FAIL(rc, "truncated tokens");
    if ((flags & F_TARGETS) && (rc = get_ints(in, len, &pos, N, &r->targets)))
        FAIL(rc, "truncated targets");
    if ((flags & F_IN) && (rc = get_tensor(in, len, &pos, NC, &r->in, why))) goto fail;
    if ((flags & F_DOUT) && (rc = get_tensor(in, len, &pos, NC, &r->dout, why))) goto fail;
    if (flags & F_BUDGET) {
        if (len - pos < 4) FAIL(AP_ECORRUPT, "truncated budget");
        r->budget_us = ap__get_be32(in + pos);
        pos += 4;
        if (!r->budget_us) FAIL(AP_ECORRUPT, "zero budget");
    }
    if (pos != len) FAIL(AP_ECORRUPT, "trailing bytes");
    return 0;
fail:
    ap_swarm_req_clear(r);
    return rc;
}

int ap_swarm_resp_decode(const uint8_t *in, size_t len, ap_swarm_resp_t *r, const char **why)
{
    if (!r) return AP_EINVAL;
    memset(r, 0, sizeof *r);
    if (!in) return AP_EINVAL;
    int rc = get_hdr(in, len, RESP_HDR, RESP_MAGIC, F_LOSS | F_ACT, why);
    if (rc) return rc;
    uint8_t flags = in[3];
    r->op = (ap_swarm_op_t)in[2];
    r->B = ap__get_be32(in + 4);
    r->T = ap__get_be32(in + 8);
    r->C = ap__get_be32(in + 12);
    if ((rc = get_shape(r->B, r->T, r->C, why))) goto fail;
    size_t pos = RESP_HDR;
    if (flags & F_LOSS) {
        if (len - pos < 4) FAIL(AP_ECORRUPT, "truncated loss");
        uint32_t bits = ap__get_be32(in + pos);
        memcpy(&r->loss, &bits, 4);
        pos += 4;
        if (!isfinite(r->loss)) FAIL(AP_ENONFINITE, "non-finite loss");
        r->has_loss = true;
    }
    if ((flags & F_ACT) &&
        (rc = get_tensor(in, len, &pos, (size_t)r->B * r->T * r->C, &r->act, why)))
        goto fail;
    if (pos != len) FAIL(AP_ECORRUPT, "trailing bytes");
    return 0;
fail:
    ap_swarm_resp_clear(r);
    return rc;
}

void ap_swarm_req_clear(ap_swarm_req_t *r)
{
    if (!r) return;
    free(r->tokens);
    free(r->targets);
    free(r->in);
    free(r->dout);
    r->tokens = r->targets = NULL;
    r->in = r->dout = NULL;
}

void ap_swarm_resp_clear(ap_swarm_resp_t *r)
{
    if (!r) return;
    free(r->act);
    r->act = NULL;
}

int ap_swarm_resp_check(const ap_swarm_req_t *q, const ap_swarm_resp_t *r, bool first, bool last,
                        const char **why)
{
    const char *w = NULL;
    if (r->op != q->op)
        w = "answer to another operation";
    else if (r->B != q->B || r->T != q->T || r->C != q->C)
        w = "answer has the wrong shape";
    else if (last && q->targets && !r->has_loss)
        w = "answer lacks the loss";
    else if (!last && r->has_loss)
        w = "unexpected loss";
    else if (q->op == AP_SWARM_FORWARD && !last && !r->act)
        w = "answer lacks the activations";
    else if (q->op == AP_SWARM_BACKWARD && !first && !r->act)
        w = "answer lacks the input gradient";
    else if (((q->op == AP_SWARM_FORWARD && last) || (q->op == AP_SWARM_BACKWARD && first)) &&
             r->act)
        w = "unexpected tensor";
    if (!w) return 0;
    if (why) *why = w;
    return AP_EPROTO;
}
