/* SWARM stage calls: a pipeline of three stage models driven through encoded
 * stage calls equals the whole model in one process (loss, gradients,
 * parameters after SGD steps); blockwise 8-bit activations train to within
 * 2 % of the uncompressed loss; bad requests and garbage answers are refused
 * with a reason. Also writes the fuzz seed corpus when asked
 * (APIARY_WRITE_CORPUS=dir). */
#include "aptest.h"

#include "apiary/swarm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NL  4
#define NHD 2
#define CW  16
#define BB  2
#define TT  8
#define S   3

static const int cut[S + 1] = {0, 1, 3, 4};

typedef struct pipe {
    ap_nn_model_t *whole;
    ap_nn_model_t *st[S];
} pipe_t;

static void copy_params(ap_nn_model_t *from, ap_nn_model_t *to)
{
    ap_nn_params_t *a = ap_nn_model_params(from), *b = ap_nn_model_params(to);
    for (size_t i = 0; i < b->nviews; i++) {
        const ap_nn_view_t *v = &b->views[i];
        const ap_nn_view_t *w = ap_nn_params_find(a, v->name);
        assert_non_null(w);
        assert_int_equal(w->count, v->count);
        memcpy(b->data + v->offset, a->data + w->offset, v->count * sizeof(float));
    }
}

static void pipe_new(pipe_t *p)
{
    ap_nn_gpt_config_t wc = ap_nn_gpt_config_default(TT, NL, NHD, CW, BB);
    assert_ok(ap_nn_gpt_new(&wc, &p->whole));
    ap_nn_model_init(p->whole, 7);
    for (int s = 0; s < S; s++) {
        ap_nn_gpt_config_t c = wc;
        c.layer_begin = cut[s];
        c.layer_end = cut[s + 1];
        c.embed = s == 0;
        c.head = s == S - 1;
        assert_ok(ap_nn_gpt_new(&c, &p->st[s]));
        copy_params(p->whole, p->st[s]);
    }
}

static void pipe_free(pipe_t *p)
{
    ap_nn_model_free(p->whole);
    for (int s = 0; s < S; s++) ap_nn_model_free(p->st[s]);
}

/* One call through the wire both ways: encode, decode, run, encode, decode,
 * check. */
static void call(ap_nn_model_t *m, uint32_t stage, const ap_swarm_req_t *q,
                 const ap_codec_cfg_t *codec, ap_swarm_resp_t *r)
{
    uint8_t *buf;
    size_t len;
    const char *why = NULL;
    assert_ok(ap_swarm_req_encode(q, codec, &buf, &len));
    ap_swarm_req_t dq;
    assert_ok(ap_swarm_req_decode(buf, len, &dq, &why));
    free(buf);
    ap_swarm_resp_t sr;
    int rc = ap_swarm_stage_run(m, stage, &dq, &sr, &why);
    if (rc) fail_msg("stage %u refused: %s", stage, why ? why : "?");
    assert_ok(ap_swarm_resp_encode(&sr, codec, &buf, &len));
    ap_swarm_resp_clear(&sr);
    assert_ok(ap_swarm_resp_decode(buf, len, r, &why));
    free(buf);
    assert_ok(ap_swarm_resp_check(q, r, stage == 0, stage == S - 1, &why));
    ap_swarm_req_clear(&dq);
}

/* A trainer's micro-batch: forwards through the stages keeping each stage's
 * input, then backwards from the last. Returns the loss. */
static float micro_batch(pipe_t *p, const int32_t *tok, const int32_t *tgt,
                         const ap_codec_cfg_t *codec)
{
    float *ins[S] = {0};
    ap_swarm_resp_t r;
    for (int s = 0; s < S - 1; s++) {
        ap_swarm_req_t q = {
            .op = AP_SWARM_FORWARD, .stage = (uint32_t)s, .B = BB, .T = TT, .C = CW};
        q.tokens = s == 0 ? (int32_t *)tok : NULL;
        q.in = ins[s];
        call(p->st[s], (uint32_t)s, &q, codec, &r);
        ins[s + 1] = r.act;
    }
    float *dout = NULL, loss = 0;
    for (int s = S - 1; s >= 0; s--) {
        ap_swarm_req_t q = {
            .op = AP_SWARM_BACKWARD, .stage = (uint32_t)s, .B = BB, .T = TT, .C = CW};
        q.tokens = s == 0 ? (int32_t *)tok : NULL;
        q.targets = s == S - 1 ? (int32_t *)tgt : NULL;
        q.in = ins[s];
        q.dout = dout;
        call(p->st[s], (uint32_t)s, &q, codec, &r);
        if (s == S - 1) loss = r.loss;
        free(dout);
        dout = r.act;
    }
    assert_null(dout);
    for (int s = 0; s < S; s++) free(ins[s]);
    return loss;
}

static void sgd(ap_nn_model_t *m, float lr)
{
    ap_nn_params_t *p = ap_nn_model_params(m);
    for (size_t i = 0; i < p->count; i++) p->data[i] -= lr * p->grad[i];
}

static void batch(uint64_t seed, int32_t *tok, int32_t *tgt)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    int32_t w[BB * (TT + 1)];
    for (int i = 0; i < BB * (TT + 1); i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        w[i] = (int32_t)(x % 8) + 'a'; /* a small alphabet: learnable */
    }
    for (int b = 0; b < BB; b++)
        for (int t = 0; t < TT; t++) {
            tok[b * TT + t] = w[b * (TT + 1) + t];
            tgt[b * TT + t] = w[b * (TT + 1) + t + 1];
        }
}

static float max_rel_diff(ap_nn_model_t *whole, ap_nn_model_t *st, bool grad)
{
    ap_nn_params_t *a = ap_nn_model_params(whole), *b = ap_nn_model_params(st);
    float worst = 0;
    for (size_t i = 0; i < b->nviews; i++) {
        const ap_nn_view_t *v = &b->views[i];
        const ap_nn_view_t *w = ap_nn_params_find(a, v->name);
        const float *x = (grad ? a->grad : a->data) + w->offset;
        const float *y = (grad ? b->grad : b->data) + v->offset;
        for (size_t k = 0; k < v->count; k++) {
            float d = fabsf(x[k] - y[k]) / (fabsf(x[k]) + 1e-3f);
            if (d > worst) worst = d;
        }
    }
    return worst;
}

/* Uncompressed stage calls = the whole model: loss, gradients, and the
 * parameters after five SGD steps. */
static void test_equivalence(void **state)
{
    (void)state;
    pipe_t p;
    pipe_new(&p);
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    int32_t tok[BB * TT], tgt[BB * TT];
    for (int step = 0; step < 5; step++) {
        batch((uint64_t)step, tok, tgt);
        ap_nn_model_zero_grad(p.whole);
        for (int s = 0; s < S; s++) ap_nn_model_zero_grad(p.st[s]);
        float lw;
        assert_ok(ap_nn_gpt_loss(p.whole, tok, tgt, BB, TT, &lw));
        assert_ok(ap_nn_gpt_backward(p.whole, NULL, NULL));
        float ls = micro_batch(&p, tok, tgt, &none);
        print_message("step %d: whole %.6f pipeline %.6f\n", step, lw, ls);
        assert_true(fabsf(lw - ls) <= 1e-5f * fabsf(lw));
        for (int s = 0; s < S; s++) assert_true(max_rel_diff(p.whole, p.st[s], true) < 1e-3f);
        sgd(p.whole, 0.1f);
        for (int s = 0; s < S; s++) sgd(p.st[s], 0.1f);
    }
    for (int s = 0; s < S; s++) {
        float d = max_rel_diff(p.whole, p.st[s], false);
        print_message("stage %d: max relative parameter difference %g\n", s, d);
        assert_true(d < 1e-4f);
    }
    pipe_free(&p);
}

/* Blockwise 8-bit activations and gradients: the loss after 60 SGD steps is
 * within 2 % of the uncompressed pipeline's. */
static void test_blockwise8(void **state)
{
    (void)state;
    pipe_t a, b;
    pipe_new(&a);
    pipe_new(&b);
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    int32_t tok[BB * TT], tgt[BB * TT];
    float la = 0, lb = 0, first = 0;
    for (int step = 0; step < 60; step++) {
        batch((uint64_t)(step % 4), tok, tgt);
        for (int s = 0; s < S; s++) {
            ap_nn_model_zero_grad(a.st[s]);
            ap_nn_model_zero_grad(b.st[s]);
        }
        la = micro_batch(&a, tok, tgt, &none);
        lb = micro_batch(&b, tok, tgt, NULL);
        if (step == 0) first = la;
        for (int s = 0; s < S; s++) {
            sgd(a.st[s], 0.2f);
            sgd(b.st[s], 0.2f);
        }
    }
    print_message("loss %.4f -> uncompressed %.4f, blockwise8 %.4f\n", first, la, lb);
    assert_true(la < 0.9f * first);
    assert_true(fabsf(la - lb) <= 0.02f * la);
    pipe_free(&a);
    pipe_free(&b);
}

static void expect_refused(ap_nn_model_t *m, uint32_t stage, const ap_swarm_req_t *q)
{
    ap_swarm_resp_t r;
    const char *why = NULL;
    assert_int_not_equal(ap_swarm_stage_run(m, stage, q, &r, &why), 0);
    assert_non_null(why);
    print_message("refused: %s\n", why);
}

/* Requests that do not fit the stage are refused with a reason. */
static void test_refusals(void **state)
{
    (void)state;
    pipe_t p;
    pipe_new(&p);
    int32_t tok[BB * TT], tgt[BB * TT];
    batch(1, tok, tgt);
    float in[BB * TT * CW] = {0};
    ap_swarm_req_t q = {.op = AP_SWARM_FORWARD, .stage = 1, .B = BB, .T = TT, .C = CW, .in = in};
    q.stage = 2;
    expect_refused(p.st[1], 1, &q); /* wrong stage */
    q.stage = 1;
    q.C = CW + 1;
    expect_refused(p.st[1], 1, &q); /* wrong width */
    q.C = CW;
    q.B = BB + 1;
    expect_refused(p.st[1], 1, &q); /* batch over the cap */
    q.B = BB;
    q.in = NULL;
    expect_refused(p.st[1], 1, &q); /* no input */
    q.stage = 0;
    expect_refused(p.st[0], 0, &q); /* first stage without tokens */
    q.tokens = tok;
    tok[3] = 999;
    expect_refused(p.st[0], 0, &q); /* token out of range */
    tok[3] = 'a';
    q.op = AP_SWARM_BACKWARD;
    expect_refused(p.st[0], 0, &q); /* backward without dout */
    q.stage = 2;
    q.tokens = NULL;
    q.in = in;
    expect_refused(p.st[2], 2, &q); /* last-stage backward without targets */
    pipe_free(&p);
}

/* Decoders refuse truncation, trailing bytes, bad magic/version/flags,
 * oversized shapes, wrong-shaped and non-finite tensors; resp_check refuses
 * garbage answers. */
static void test_bad_bytes(void **state)
{
    (void)state;
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    float in[BB * TT * CW];
    for (int i = 0; i < BB * TT * CW; i++) in[i] = (float)i / 100.0f;
    ap_swarm_req_t q = {.op = AP_SWARM_FORWARD, .stage = 1, .B = BB, .T = TT, .C = CW, .in = in};
    uint8_t *buf;
    size_t len;
    const char *why;
    ap_swarm_req_t d;
    assert_ok(ap_swarm_req_encode(&q, &none, &buf, &len));
    assert_ok(ap_swarm_req_decode(buf, len, &d, &why));
    assert_memory_equal(d.in, in, sizeof in);
    ap_swarm_req_clear(&d);
    for (size_t cutlen = 0; cutlen < len; cutlen += 7)
        assert_int_not_equal(ap_swarm_req_decode(buf, cutlen, &d, &why), 0);
    uint8_t *big = malloc(len + 1);
    memcpy(big, buf, len);
    big[len] = 0;
    assert_int_equal(ap_swarm_req_decode(big, len + 1, &d, &why), AP_ECORRUPT);
    free(big);
    buf[1] = 9;
    assert_int_equal(ap_swarm_req_decode(buf, len, &d, &why), AP_EVERSION);
    buf[1] = 1;
    buf[3] |= 0x80;
    assert_int_equal(ap_swarm_req_decode(buf, len, &d, &why), AP_ECORRUPT);
    buf[3] &= 0x7f;
    buf[11] = 3; /* BB = 3: the tensor no longer has BB*TT*CW elements */
    assert_int_equal(ap_swarm_req_decode(buf, len, &d, &why), AP_ECORRUPT);
    print_message("wrong shape: %s\n", why);
    buf[8] = 0x7f; /* huge BB */
    assert_int_equal(ap_swarm_req_decode(buf, len, &d, &why), AP_ELIMIT);
    free(buf);
    /* the caller's budget: 4 bytes at the end when flagged (16), never 0 */
    q.budget_us = 250000;
    assert_ok(ap_swarm_req_encode(&q, &none, &buf, &len));
    assert_int_equal(buf[3] & 16, 16);
    assert_ok(ap_swarm_req_decode(buf, len, &d, &why));
    assert_int_equal(d.budget_us, 250000);
    ap_swarm_req_clear(&d);
    assert_int_equal(ap_swarm_req_decode(buf, len - 1, &d, &why), AP_ECORRUPT);
    memset(buf + len - 4, 0, 4);
    assert_int_equal(ap_swarm_req_decode(buf, len, &d, &why), AP_ECORRUPT);
    print_message("zero budget: %s\n", why);
    free(buf);
    q.budget_us = 0;
    in[5] = NAN;
    assert_ok(ap_swarm_req_encode(&q, &none, &buf, &len));
    assert_int_equal(ap_swarm_req_decode(buf, len, &d, &why), AP_ENONFINITE);
    print_message("nan: %s\n", why);
    free(buf);
    assert_int_equal(ap_swarm_req_encode(&q, NULL, &buf, &len), AP_ENONFINITE);
    in[5] = 0;

    /* Garbage answers. */
    ap_swarm_resp_t r = {.op = AP_SWARM_FORWARD, .B = BB, .T = TT, .C = CW, .act = in};
    assert_ok(ap_swarm_resp_check(&q, &r, false, false, &why));
    r.B = 1;
    assert_int_equal(ap_swarm_resp_check(&q, &r, false, false, &why), AP_EPROTO);
    r.B = BB;
    r.act = NULL;
    assert_int_equal(ap_swarm_resp_check(&q, &r, false, false, &why), AP_EPROTO);
    r.op = AP_SWARM_BACKWARD;
    assert_int_equal(ap_swarm_resp_check(&q, &r, false, false, &why), AP_EPROTO);
    r.op = AP_SWARM_FORWARD;
    r.has_loss = true;
    r.loss = NAN;
    assert_int_equal(ap_swarm_resp_encode(&r, NULL, &buf, &len), AP_ENONFINITE);
}

/* Writes one seed per message kind into $APIARY_WRITE_CORPUS. */
static void test_write_corpus(void **state)
{
    (void)state;
    const char *dir = getenv("APIARY_WRITE_CORPUS");
    if (!dir) skip();
    int32_t tok[BB * TT], tgt[BB * TT];
    batch(3, tok, tgt);
    float x[BB * TT * CW];
    for (int i = 0; i < BB * TT * CW; i++) x[i] = sinf((float)i);
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE}, fp16 = {.id = AP_CODEC_FP16};
    struct {
        const char *name;
        ap_swarm_req_t q;
        const ap_codec_cfg_t *c;
    } reqs[] = {
        {"req_fwd_first", {.op = AP_SWARM_FORWARD, .B = BB, .T = TT, .C = CW, .tokens = tok}, NULL},
        {"req_fwd_mid",
         {.op = AP_SWARM_FORWARD, .stage = 1, .B = BB, .T = TT, .C = CW, .in = x},
         NULL},
        {"req_bwd_mid",
         {.op = AP_SWARM_BACKWARD, .stage = 1, .B = BB, .T = TT, .C = CW, .in = x, .dout = x},
         &fp16},
        {"req_bwd_last",
         {.op = AP_SWARM_BACKWARD, .stage = 2, .B = BB, .T = TT, .C = CW, .in = x, .targets = tgt},
         &none},
        {"req_budget",
         {.op = AP_SWARM_FORWARD, .B = BB, .T = TT, .C = CW, .tokens = tok, .budget_us = 150000},
         &none},
    };
    char path[1024];
    uint8_t *buf;
    size_t len;
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
        assert_ok(ap_swarm_req_encode(&reqs[i].q, reqs[i].c, &buf, &len));
        snprintf(path, sizeof path, "%s/%s", dir, reqs[i].name);
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        fwrite(buf, 1, len, f);
        fclose(f);
        free(buf);
    }
    struct {
        const char *name;
        ap_swarm_resp_t r;
    } resps[] = {
        {"resp_fwd", {.op = AP_SWARM_FORWARD, .B = BB, .T = TT, .C = CW, .act = x}},
        {"resp_loss",
         {.op = AP_SWARM_BACKWARD,
          .B = BB,
          .T = TT,
          .C = CW,
          .has_loss = true,
          .loss = 2.5f,
          .act = x}},
        {"resp_first_bwd", {.op = AP_SWARM_BACKWARD, .B = 1, .T = 1, .C = 4}},
    };
    for (size_t i = 0; i < sizeof resps / sizeof resps[0]; i++) {
        assert_ok(ap_swarm_resp_encode(&resps[i].r, i == 1 ? &none : NULL, &buf, &len));
        snprintf(path, sizeof path, "%s/%s", dir, resps[i].name);
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        fwrite(buf, 1, len, f);
        fclose(f);
        free(buf);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equivalence),  cmocka_unit_test(test_blockwise8),
        cmocka_unit_test(test_refusals),     cmocka_unit_test(test_bad_bytes),
        cmocka_unit_test(test_write_corpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
