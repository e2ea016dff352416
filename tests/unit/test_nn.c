/* Model kit tests: every layer's backward against central finite differences
 * of an independent double-precision reference; the whole GPT (and MLP)
 * against the same; pipeline stages against the whole model; overfitting;
 * optimizers against hand-computed steps; data; checkpoints; bad input. */
#include "aptest.h"

#include "apiary/log.h"
#include "apiary/nn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------ */

static uint64_t rs = 88172645463325252ull;
static double urand(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (double)(rs >> 11) * (1.0 / 9007199254740992.0);
}
static float frand(float scale)
{
    return (float)((urand() * 2.0 - 1.0) * scale);
}
static void fill(float *p, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) p[i] = frand(scale);
}
static double *todouble(const float *p, size_t n)
{
    double *d = malloc(n * sizeof *d);
    for (size_t i = 0; i < n; i++) d[i] = p[i];
    return d;
}

/* Relative error with an absolute floor, as in most gradient checkers. */
static void expect_close(const char *what, size_t i, double got, double want, double rtol,
                         double atol)
{
    double err = fabs(got - want), lim = atol + rtol * fabs(want);
    if (!(err <= lim))
        fail_msg("%s[%zu]: got %.8g want %.8g (err %.3g > %.3g)", what, i, got, want, err, lim);
}

/* A scalar objective f(x) evaluated by the double reference; FD gradient of
 * f with respect to x[i]. */
typedef double (*objective_fn)(void *ctx);
static double fd(double *x, size_t i, objective_fn f, void *ctx)
{
    const double h = 1e-6;
    double s = x[i];
    x[i] = s + h;
    double fp = f(ctx);
    x[i] = s - h;
    double fm = f(ctx);
    x[i] = s;
    return (fp - fm) / (2 * h);
}

static void check_grad(const char *what, double *x, const float *analytic, size_t n, objective_fn f,
                       void *ctx, double rtol, double atol)
{
    for (size_t i = 0; i < n; i++) expect_close(what, i, analytic[i], fd(x, i, f, ctx), rtol, atol);
}

/* ---- double-precision reference layers (plain loops) -------------------- */

static void ref_linear(double *out, const double *in, const double *w, const double *b, int N,
                       int C, int OC)
{
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = b ? b[o] : 0.0;
            for (int c = 0; c < C; c++) s += in[n * C + c] * w[o * C + c];
            out[n * OC + o] = s;
        }
}

static void ref_layernorm(double *out, const double *in, const double *w, const double *b, int N,
                          int C)
{
    for (int n = 0; n < N; n++) {
        double m = 0, v = 0;
        for (int c = 0; c < C; c++) m += in[n * C + c];
        m /= C;
        for (int c = 0; c < C; c++) v += (in[n * C + c] - m) * (in[n * C + c] - m);
        v /= C;
        double s = 1.0 / sqrt(v + 1e-5);
        for (int c = 0; c < C; c++) out[n * C + c] = (in[n * C + c] - m) * s * w[c] + b[c];
    }
}

static double ref_gelu1(double x)
{
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

static void ref_attention(double *out, const double *qkv, int B, int T, int C, int NH)
{
    int hs = C / NH;
    double *p = malloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const double *q = qkv + (size_t)(b * T + t) * 3 * C + h * hs;
                double mx = -1e300, sum = 0;
                for (int j = 0; j <= t; j++) {
                    const double *k = qkv + (size_t)(b * T + j) * 3 * C + C + h * hs;
                    double s = 0;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    p[j] = s / sqrt((double)hs);
                    if (p[j] > mx) mx = p[j];
                }
                for (int j = 0; j <= t; j++) sum += (p[j] = exp(p[j] - mx));
                double *o = out + (size_t)(b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) {
                    double s = 0;
                    for (int j = 0; j <= t; j++)
                        s += p[j] / sum * qkv[(size_t)(b * T + j) * 3 * C + 2 * C + h * hs + i];
                    o[i] = s;
                }
            }
    free(p);
}

static double ref_xent(const double *logits, const int32_t *tg, int N, int V)
{
    double tot = 0;
    for (int n = 0; n < N; n++) {
        double mx = -1e300, s = 0;
        for (int v = 0; v < V; v++) mx = fmax(mx, logits[n * V + v]);
        for (int v = 0; v < V; v++) s += exp(logits[n * V + v] - mx);
        tot += mx + log(s) - logits[n * V + tg[n]];
    }
    return tot / N;
}

/* <out, R> : the objective used for layer checks (R random, fixed). */
static double dot(const double *a, const float *r, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * r[i];
    return s;
}

/* ---- per-layer checks --------------------------------------------------- */

typedef struct lin_ctx {
    double *in, *w, *b, *out;
    const float *R;
    int N, C, OC;
} lin_ctx_t;

static double lin_obj(void *p)
{
    lin_ctx_t *c = p;
    ref_linear(c->out, c->in, c->w, c->b, c->N, c->C, c->OC);
    return dot(c->out, c->R, (size_t)c->N * c->OC);
}

static void test_linear(void **state)
{
    (void)state;
    /* N large enough that the pool splits rows and columns across threads */
    const int N = 37, C = 11, OC = 19;
    float in[37 * 11], w[19 * 11], b[19], R[37 * 19], out[37 * 19];
    fill(in, sizeof in / 4, 1), fill(w, sizeof w / 4, 1), fill(b, 19, 1), fill(R, sizeof R / 4, 1);
    ap_nn_linear_forward(out, in, w, b, N, C, OC);
    lin_ctx_t c = {todouble(in, N * C),
                   todouble(w, OC * C),
                   todouble(b, OC),
                   malloc(sizeof(double) * N * OC),
                   R,
                   N,
                   C,
                   OC};
    lin_obj(&c);
    for (int i = 0; i < N * OC; i++) expect_close("linear.out", i, out[i], c.out[i], 1e-5, 1e-5);
    float din[37 * 11], dw[19 * 11], db[19];
    memset(din, 0, sizeof din), memset(dw, 0, sizeof dw), memset(db, 0, sizeof db);
    ap_nn_linear_backward(din, dw, db, R, in, w, N, C, OC);
    check_grad("linear.din", c.in, din, N * C, lin_obj, &c, 1e-4, 1e-4);
    check_grad("linear.dw", c.w, dw, OC * C, lin_obj, &c, 1e-4, 1e-4);
    check_grad("linear.db", c.b, db, OC, lin_obj, &c, 1e-4, 1e-4);
    /* accumulation: a second backward doubles every gradient */
    float dw2[19 * 11];
    memcpy(dw2, dw, sizeof dw);
    ap_nn_linear_backward(NULL, dw2, NULL, R, in, w, N, C, OC);
    for (int i = 0; i < OC * C; i++) expect_close("linear.acc", i, dw2[i], 2 * dw[i], 1e-6, 1e-6);
    free(c.in), free(c.w), free(c.b), free(c.out);
}

typedef struct ln_ctx {
    double *in, *w, *b, *out;
    const float *R;
    int N, C;
} ln_ctx_t;

static double ln_obj(void *p)
{
    ln_ctx_t *c = p;
    ref_layernorm(c->out, c->in, c->w, c->b, c->N, c->C);
    return dot(c->out, c->R, (size_t)c->N * c->C);
}

static void test_layernorm(void **state)
{
    (void)state;
    enum { N = 40, C = 24 };
    float in[N * C], w[C], b[C], R[N * C], out[N * C], mean[N], rstd[N];
    fill(in, N * C, 2), fill(w, C, 1.5f), fill(b, C, 1), fill(R, N * C, 1);
    ap_nn_layernorm_forward(out, mean, rstd, in, w, b, N, C);
    ln_ctx_t c = {todouble(in, N * C),
                  todouble(w, C),
                  todouble(b, C),
                  malloc(sizeof(double) * N * C),
                  R,
                  N,
                  C};
    ln_obj(&c);
    for (int i = 0; i < N * C; i++) expect_close("ln.out", i, out[i], c.out[i], 1e-4, 1e-5);
    float din[N * C] = {0}, dw[C] = {0}, db[C] = {0};
    ap_nn_layernorm_backward(din, dw, db, R, in, w, mean, rstd, N, C);
    check_grad("ln.din", c.in, din, N * C, ln_obj, &c, 1e-3, 1e-4);
    check_grad("ln.dw", c.w, dw, C, ln_obj, &c, 1e-3, 1e-4);
    check_grad("ln.db", c.b, db, C, ln_obj, &c, 1e-3, 1e-4);
    free(c.in), free(c.w), free(c.b), free(c.out);
}

typedef struct gelu_ctx {
    double *in;
    const float *R;
    size_t n;
} gelu_ctx_t;

static double gelu_obj(void *p)
{
    gelu_ctx_t *c = p;
    double s = 0;
    for (size_t i = 0; i < c->n; i++) s += ref_gelu1(c->in[i]) * c->R[i];
    return s;
}

static void test_gelu(void **state)
{
    (void)state;
    enum { n = 9000 }; /* > one pool grain */
    float *in = malloc(n * 4), *R = malloc(n * 4), *out = malloc(n * 4), *din = calloc(n, 4);
    fill(in, n, 4), fill(R, n, 1);
    ap_nn_gelu_forward(out, in, n);
    gelu_ctx_t c = {todouble(in, n), R, n};
    for (size_t i = 0; i < n; i++)
        expect_close("gelu.out", i, out[i], ref_gelu1(c.in[i]), 1e-5, 1e-6);
    ap_nn_gelu_backward(din, in, R, n);
    for (size_t i = 0; i < n; i += 7) /* FD per element: f is separable */
        expect_close("gelu.din", i, din[i], fd(c.in, i, gelu_obj, &c), 1e-3, 1e-4);
    free(in), free(R), free(out), free(din), free(c.in);
}

typedef struct att_ctx {
    double *qkv, *out;
    const float *R;
    int B, T, C, NH;
} att_ctx_t;

static double att_obj(void *p)
{
    att_ctx_t *c = p;
    ref_attention(c->out, c->qkv, c->B, c->T, c->C, c->NH);
    return dot(c->out, c->R, (size_t)c->B * c->T * c->C);
}

static void test_attention(void **state)
{
    (void)state;
    enum { B = 2, T = 6, C = 12, NH = 3 };
    float qkv[B * T * 3 * C], R[B * T * C], out[B * T * C], att[B * NH * T * T],
        scr[B * NH * T * T], dqkv[B * T * 3 * C] = {0};
    fill(qkv, sizeof qkv / 4, 1.5f), fill(R, sizeof R / 4, 1);
    ap_nn_attention_forward(out, att, qkv, B, T, C, NH);
    att_ctx_t c = {
        todouble(qkv, sizeof qkv / 4), malloc(sizeof(double) * B * T * C), R, B, T, C, NH};
    att_obj(&c);
    for (int i = 0; i < B * T * C; i++) expect_close("att.out", i, out[i], c.out[i], 1e-4, 1e-5);
    /* causal: probabilities above the diagonal are exactly zero, rows sum to 1 */
    for (int r = 0; r < B * NH * T; r++) {
        int t = r % T;
        double s = 0;
        for (int j = 0; j < T; j++) {
            if (j > t) assert_true(att[r * T + j] == 0.0f);
            s += att[r * T + j];
        }
        expect_close("att.rowsum", (size_t)r, s, 1.0, 1e-5, 0);
    }
    ap_nn_attention_backward(dqkv, scr, R, qkv, att, B, T, C, NH);
    check_grad("att.dqkv", c.qkv, dqkv, sizeof qkv / 4, att_obj, &c, 1e-3, 1e-4);
    free(c.qkv), free(c.out);
}

typedef struct xent_ctx {
    double *logits;
    const int32_t *tg;
    int N, V;
} xent_ctx_t;

static double xent_obj(void *p)
{
    xent_ctx_t *c = p;
    return ref_xent(c->logits, c->tg, c->N, c->V);
}

static void test_xent(void **state)
{
    (void)state;
    enum { N = 9, V = 13 };
    float logits[N * V], probs[N * V], losses[N];
    int32_t tg[N];
    fill(logits, N * V, 3);
    for (int i = 0; i < N; i++) tg[i] = (int32_t)(urand() * V);
    float l = ap_nn_xent_forward(probs, losses, logits, tg, N, V);
    xent_ctx_t c = {todouble(logits, N * V), tg, N, V};
    expect_close("xent.loss", 0, l, xent_obj(&c), 1e-5, 1e-6);
    ap_nn_xent_backward(probs, probs, tg, 1.0f / N, N, V); /* in place */
    check_grad("xent.dlogits", c.logits, probs, N * V, xent_obj, &c, 1e-4, 1e-6);
    /* huge logits stay finite (log-sum-exp) */
    float big[2] = {1000.0f, -1000.0f}, pb[2], lb[1];
    int32_t t1 = 1;
    float lbig = ap_nn_xent_forward(pb, lb, big, &t1, 1, 2);
    expect_close("xent.big", 0, lbig, 2000.0, 1e-6, 0);
    free(c.logits);
}

typedef struct emb_ctx {
    double *wte, *wpe, *out;
    const int32_t *tok;
    const float *R;
    int B, T, C;
} emb_ctx_t;

static double emb_obj(void *p)
{
    emb_ctx_t *c = p;
    double s = 0;
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++)
            for (int i = 0; i < c->C; i++)
                s += (c->wte[c->tok[b * c->T + t] * c->C + i] + c->wpe[t * c->C + i]) *
                     c->R[(b * c->T + t) * c->C + i];
    return s;
}

static void test_embedding(void **state)
{
    (void)state;
    enum { B = 3, T = 5, C = 20, V = 7 };
    float wte[V * C], wpe[T * C], out[B * T * C], R[B * T * C], dwte[V * C] = {0},
                                                                         dwpe[T * C] = {0};
    int32_t tok[B * T];
    fill(wte, V * C, 1), fill(wpe, T * C, 1), fill(R, B * T * C, 1);
    for (int i = 0; i < B * T; i++) tok[i] = (int32_t)(urand() * 4); /* repeats on purpose */
    ap_nn_embed_forward(out, tok, wte, wpe, B, T, C);
    for (int r = 0; r < B * T; r++)
        for (int i = 0; i < C; i++)
            expect_close("emb.out", (size_t)r, out[r * C + i],
                         (double)wte[tok[r] * C + i] + wpe[(r % T) * C + i], 1e-6, 0);
    ap_nn_embed_backward(dwte, dwpe, R, tok, B, T, C);
    emb_ctx_t c = {todouble(wte, V * C), todouble(wpe, T * C), NULL, tok, R, B, T, C};
    check_grad("emb.dwte", c.wte, dwte, V * C, emb_obj, &c, 1e-4, 1e-5);
    check_grad("emb.dwpe", c.wpe, dwpe, T * C, emb_obj, &c, 1e-4, 1e-5);
    free(c.wte), free(c.wpe);
}

static void test_dropout(void **state)
{
    (void)state;
    enum { n = 20000 };
    float *in = malloc(n * 4), *out = malloc(n * 4), *out2 = malloc(n * 4), *d = calloc(n, 4),
          *R = malloc(n * 4);
    fill(in, n, 1), fill(R, n, 1);
    ap_nn_dropout_forward(out, in, n, 0.25f, 42);
    ap_nn_dropout_forward(out2, in, n, 0.25f, 42);
    assert_memory_equal(out, out2, n * 4); /* same seed, same mask */
    int kept = 0;
    for (int i = 0; i < n; i++) {
        if (out[i] != 0.0f) {
            kept++;
            expect_close("drop.scale", (size_t)i, out[i], in[i] / 0.75, 1e-6, 0);
        }
    }
    /* 15000 expected; binomial sd ~61: +-8 sd */
    assert_in_range(kept, 14500, 15500);
    /* backward is the same linear map: d/din <out,R> = mask*R/(1-p) */
    ap_nn_dropout_backward(d, R, n, 0.25f, 42);
    for (int i = 0; i < n; i++) {
        double want = out[i] != 0.0f ? R[i] / 0.75 : 0.0;
        expect_close("drop.din", (size_t)i, d[i], want, 1e-6, 0);
    }
    ap_nn_dropout_forward(out2, in, n, 0.25f, 43);
    assert_true(memcmp(out, out2, n * 4) != 0); /* another seed, another mask */
    free(in), free(out), free(out2), free(d), free(R);
}

/* ---- whole GPT in double precision ------------------------------------- */

typedef struct gref {
    ap_nn_gpt_config_t cfg;
    const ap_nn_params_t *p; /* float layout (names, offsets) */
    double *w;               /* double copy of params */
    const int32_t *tok, *tg;
    int B, T;
} gref_t;

static double *V_(gref_t *g, const char *name)
{
    const ap_nn_view_t *v = ap_nn_params_find(g->p, name);
    if (!v) fail_msg("no view %s", name);
    return g->w + v->offset;
}

static double gref_loss(void *ctx)
{
    gref_t *g = ctx;
    const int B = g->B, T = g->T, C = g->cfg.n_embd, V = g->cfg.vocab, N = B * T;
    double *x = malloc(sizeof(double) * N * C), *h = malloc(sizeof(double) * N * C),
           *qkv = malloc(sizeof(double) * N * 3 * C), *y = malloc(sizeof(double) * N * C),
           *f = malloc(sizeof(double) * N * 4 * C), *lg = malloc(sizeof(double) * N * V);
    double *wte = V_(g, "wte"), *wpe = V_(g, "wpe");
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) x[n * C + c] = wte[g->tok[n] * C + c] + wpe[(n % T) * C + c];
    for (int l = 0; l < g->cfg.n_layer; l++) {
        char pre[16], nm[64];
        if (g->cfg.share_layers)
            snprintf(pre, sizeof pre, "h");
        else
            snprintf(pre, sizeof pre, "h%d", l);
#define P(s) (snprintf(nm, sizeof nm, "%s.%s", pre, s), V_(g, nm))
        ref_layernorm(h, x, P("ln1.w"), P("ln1.b"), N, C);
        ref_linear(qkv, h, P("attn.qkv.w"), P("attn.qkv.b"), N, C, 3 * C);
        ref_attention(y, qkv, B, T, C, g->cfg.n_head);
        ref_linear(h, y, P("attn.proj.w"), P("attn.proj.b"), N, C, C);
        for (int i = 0; i < N * C; i++) x[i] += h[i];
        ref_layernorm(h, x, P("ln2.w"), P("ln2.b"), N, C);
        ref_linear(f, h, P("mlp.fc.w"), P("mlp.fc.b"), N, C, 4 * C);
        for (int i = 0; i < N * 4 * C; i++) f[i] = ref_gelu1(f[i]);
        ref_linear(h, f, P("mlp.proj.w"), P("mlp.proj.b"), N, 4 * C, C);
        for (int i = 0; i < N * C; i++) x[i] += h[i];
#undef P
    }
    ref_layernorm(h, x, V_(g, "lnf.w"), V_(g, "lnf.b"), N, C);
    ref_linear(lg, h, V_(g, "lm_head.w"), NULL, N, C, V);
    double loss = ref_xent(lg, g->tg, N, V);
    free(x), free(h), free(qkv), free(y), free(f), free(lg);
    return loss;
}

static void gpt_gradcheck(bool share)
{
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(5, 2, 2, 8, 2);
    cfg.vocab = 11; /* small vocabulary keeps the check fast */
    cfg.share_layers = share;
    ap_nn_model_t *m;
    assert_ok(ap_nn_gpt_new(&cfg, &m));
    ap_nn_model_init(m, 7);
    ap_nn_params_t *p = ap_nn_model_params(m);
    /* larger weights than the init so every path carries signal */
    for (size_t i = 0; i < p->nviews; i++)
        if (!strstr(p->views[i].name, "ln"))
            fill(p->data + p->views[i].offset, p->views[i].count, 0.4f);
    int32_t tok[10], tg[10];
    for (int i = 0; i < 10; i++) tok[i] = (int32_t)(urand() * 11), tg[i] = (int32_t)(urand() * 11);
    float loss;
    ap_nn_model_zero_grad(m);
    assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 5, &loss));
    assert_ok(ap_nn_gpt_backward(m, NULL, NULL));
    gref_t g = {cfg, p, todouble(p->data, p->count), tok, tg, 2, 5};
    expect_close("gpt.loss", 0, loss, gref_loss(&g), 1e-5, 1e-6);
    size_t checked = 0;
    for (size_t v = 0; v < p->nviews; v++) {
        const ap_nn_view_t *vw = &p->views[v];
        for (size_t i = 0; i < vw->count; i++) {
            size_t k = vw->offset + i;
            expect_close(vw->name, i, p->grad[k], fd(g.w, k, gref_loss, &g), 2e-3, 2e-5);
            checked++;
        }
    }
    assert_true(checked > 1000);
    free(g.w);
    ap_nn_model_free(m);
}

static void test_gpt_gradcheck(void **state)
{
    (void)state;
    gpt_gradcheck(false);
}

static void test_gpt_gradcheck_shared(void **state)
{
    (void)state;
    gpt_gradcheck(true);
}

/* Two stages (embed + layer 0 | layer 1 + head) reproduce the whole model's
 * loss and gradients, passing activations and their gradients as buffers. */
static void test_gpt_stages(void **state)
{
    (void)state;
    ap_nn_gpt_config_t whole = ap_nn_gpt_config_default(8, 3, 2, 16, 3);
    ap_nn_gpt_config_t s0 = whole, s1 = whole;
    s0.layer_end = 1, s0.head = false;
    s1.layer_begin = 1, s1.embed = false;
    ap_nn_model_t *mw, *m0, *m1;
    assert_ok(ap_nn_gpt_new(&whole, &mw));
    assert_ok(ap_nn_gpt_new(&s0, &m0));
    assert_ok(ap_nn_gpt_new(&s1, &m1));
    ap_nn_model_init(mw, 3), ap_nn_model_init(m0, 3), ap_nn_model_init(m1, 3);
    ap_nn_params_t *pw = ap_nn_model_params(mw), *p0 = ap_nn_model_params(m0),
                   *p1 = ap_nn_model_params(m1);
    assert_int_equal(ap_nn_gpt_param_count(&s0) + ap_nn_gpt_param_count(&s1),
                     ap_nn_gpt_param_count(&whole));
    assert_null(ap_nn_params_find(p0, "lm_head.w"));
    assert_null(ap_nn_params_find(p1, "wte"));
    int32_t tok[24], tg[24];
    for (int i = 0; i < 24; i++)
        tok[i] = (int32_t)(urand() * 256), tg[i] = (int32_t)(urand() * 256);
    float lw, act[24 * 16], dact[24 * 16];
    ap_nn_model_zero_grad(mw), ap_nn_model_zero_grad(m0), ap_nn_model_zero_grad(m1);
    assert_ok(ap_nn_gpt_loss(mw, tok, tg, 3, 8, &lw));
    assert_ok(ap_nn_gpt_backward(mw, NULL, NULL));
    ap_nn_gpt_io_t io0 = {.B = 3, .T = 8, .tokens = tok, .out = act};
    assert_ok(ap_nn_gpt_forward(m0, &io0));
    ap_nn_gpt_io_t io1 = {.B = 3, .T = 8, .in = act, .targets = tg};
    assert_ok(ap_nn_gpt_forward(m1, &io1));
    expect_close("stage.loss", 0, io1.loss, lw, 1e-6, 1e-6);
    assert_ok(ap_nn_gpt_backward(m1, NULL, dact));
    assert_ok(ap_nn_gpt_backward(m0, dact, NULL));
    size_t seen = 0;
    for (size_t v = 0; v < pw->nviews; v++) {
        const ap_nn_view_t *a = &pw->views[v];
        const ap_nn_view_t *b = ap_nn_params_find(p0, a->name);
        const ap_nn_params_t *ps = p0;
        if (!b) b = ap_nn_params_find(p1, a->name), ps = p1;
        assert_non_null(b);
        assert_int_equal(a->count, b->count);
        seen++;
        for (size_t i = 0; i < a->count; i++) {
            assert_true(pw->data[a->offset + i] == ps->data[b->offset + i]);
            expect_close(a->name, i, ps->grad[b->offset + i], pw->grad[a->offset + i], 1e-4, 1e-7);
        }
    }
    assert_int_equal(seen, p0->nviews + p1->nviews);
    /* a middle stage without dout is refused; backward before forward too */
    assert_int_equal(ap_nn_gpt_backward(m0, NULL, NULL), AP_EINVAL);
    assert_int_equal(ap_nn_gpt_backward(m1, NULL, dact), AP_ESTATE);
    ap_nn_model_free(mw), ap_nn_model_free(m0), ap_nn_model_free(m1);
}

static float train_gpt_steps(ap_nn_model_t *m, ap_nn_solver_t *o, const int32_t *tok,
                             const int32_t *tg, int B, int T, int steps, float lr)
{
    float loss = 0;
    ap_nn_params_t *p = ap_nn_model_params(m);
    for (int s = 0; s < steps; s++) {
        ap_nn_model_zero_grad(m);
        assert_ok(ap_nn_gpt_loss(m, tok, tg, B, T, &loss));
        assert_ok(ap_nn_gpt_backward(m, NULL, NULL));
        ap_nn_clip_grad_norm(p->grad, p->count, 1.0);
        assert_ok(ap_nn_solver_step(o, p->data, p->grad, lr));
    }
    return loss;
}

/* A tiny GPT memorises one batch: loss from ~ln(256) to near zero. */
static void test_gpt_overfit(void **state)
{
    (void)state;
    const char *text = "the quick brown fox jumps over the lazy dog; pack my box with five dozen";
    enum { B = 2, T = 24 };
    int32_t tok[B * T], tg[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (uint8_t)text[i], tg[i] = (uint8_t)text[i + 1];
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(T, 2, 2, 32, B);
    ap_nn_model_t *m;
    assert_ok(ap_nn_gpt_new(&cfg, &m));
    ap_nn_model_init(m, 1);
    ap_nn_params_t *p = ap_nn_model_params(m);
    ap_nn_solver_config_t oc = ap_nn_solver_defaults(AP_NN_ADAMW);
    oc.weight_decay = 0;
    ap_nn_solver_t *o;
    assert_ok(ap_nn_solver_new(&oc, p->count, p->views, p->nviews, &o));
    float first;
    assert_ok(ap_nn_gpt_loss(m, tok, tg, B, T, &first));
    expect_close("initial loss", 0, first, log(256.0), 0.05, 0);
    float loss = train_gpt_steps(m, o, tok, tg, B, T, 150, 1e-2f);
    if (!(loss < 0.05f)) fail_msg("loss after 150 steps: %g (from %g)", loss, first);
    /* it learned the text: greedy-ish sampling reproduces the continuation */
    uint8_t gen[8];
    assert_ok(ap_nn_gpt_generate(m, (const uint8_t *)text, 12, gen, 8, 0.05f, 5));
    assert_memory_equal(gen, text + 12, 8);
    ap_nn_solver_free(o);
    ap_nn_model_free(m);
}

/* Dropout in training mode: deterministic for a seed, different from eval. */
static void test_gpt_dropout(void **state)
{
    (void)state;
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(8, 2, 2, 16, 2);
    cfg.dropout = 0.2f;
    ap_nn_model_t *m;
    assert_ok(ap_nn_gpt_new(&cfg, &m));
    ap_nn_model_init(m, 9);
    int32_t tok[16], tg[16];
    for (int i = 0; i < 16; i++)
        tok[i] = (int32_t)(urand() * 256), tg[i] = (int32_t)(urand() * 256);
    float le, l1, l2, l3;
    assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 8, &le));
    ap_nn_model_set_train(m, true, 77);
    assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 8, &l1));
    assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 8, &l2)); /* next masks */
    ap_nn_model_set_train(m, true, 77);
    assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 8, &l3)); /* replay */
    assert_true(l1 != le && l1 != l2);
    assert_true(l1 == l3);
    /* backward with dropout (fixed masks): central differences of the float
     * model along unit directions, the gradient's own and three random ones;
     * error bounded relative to |g| (float loss, h = 1e-3) */
    ap_nn_params_t *p = ap_nn_model_params(m);
    const size_t n = p->count;
    float *dir = malloc(n * 4), *w0 = malloc(n * 4), *g = malloc(n * 4);
    memcpy(w0, p->data, n * 4);
    ap_nn_model_set_train(m, true, 5);
    ap_nn_model_zero_grad(m);
    assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 8, &l1));
    assert_ok(ap_nn_gpt_backward(m, NULL, NULL));
    memcpy(g, p->grad, n * 4);
    double gn = ap_nn_grad_norm(g, n);
    assert_true(gn > 0.1);
    for (int d = 0; d < 4; d++) {
        if (d == 0)
            memcpy(dir, g, n * 4);
        else
            fill(dir, n, 1);
        double dn = ap_nn_grad_norm(dir, n), an = 0;
        for (size_t i = 0; i < n; i++) dir[i] = (float)(dir[i] / dn), an += (double)g[i] * dir[i];
        const float h = 1e-3f;
        float lp, lm;
        for (size_t i = 0; i < n; i++) p->data[i] = w0[i] + h * dir[i];
        ap_nn_model_set_train(m, true, 5);
        assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 8, &lp));
        for (size_t i = 0; i < n; i++) p->data[i] = w0[i] - h * dir[i];
        ap_nn_model_set_train(m, true, 5);
        assert_ok(ap_nn_gpt_loss(m, tok, tg, 2, 8, &lm));
        expect_close("dropout.dirderiv", (size_t)d, an, ((double)lp - lm) / (2 * h), 0,
                     0.002 * gn + 2e-4);
    }
    free(dir), free(w0), free(g);
    ap_nn_model_free(m);
}

static void test_gpt_bad_input(void **state)
{
    (void)state;
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(4, 1, 2, 8, 1);
    ap_nn_model_t *m;
    ap_nn_gpt_config_t bad = cfg;
    bad.n_embd = 9; /* not a multiple of n_head */
    assert_int_equal(ap_nn_gpt_new(&bad, &m), AP_EINVAL);
    bad = cfg, bad.layer_begin = 1; /* embed stage must start at 0 */
    assert_int_equal(ap_nn_gpt_new(&bad, &m), AP_EINVAL);
    assert_ok(ap_nn_gpt_new(&cfg, &m));
    ap_nn_model_init(m, 1);
    int32_t tok[4] = {1, 2, 300, 4}, tg[4] = {1, 2, 3, 4};
    float loss;
    assert_int_equal(ap_nn_gpt_loss(m, tok, tg, 1, 4, &loss), AP_EINVAL); /* token 300 */
    tok[2] = 3;
    assert_int_equal(ap_nn_gpt_loss(m, tok, tg, 2, 4, &loss), AP_EINVAL); /* B > max */
    assert_int_equal(ap_nn_gpt_loss(m, tok, tg, 1, 5, &loss), AP_EINVAL); /* T > ctx */
    assert_int_equal(ap_nn_gpt_backward(m, NULL, NULL), AP_ESTATE);
    /* non-finite loss is reported, not propagated */
    ap_nn_params_t *p = ap_nn_model_params(m);
    p->data[ap_nn_params_find(p, "lm_head.w")->offset] = NAN;
    assert_int_equal(ap_nn_gpt_loss(m, tok, tg, 1, 4, &loss), AP_ENONFINITE);
    assert_int_equal(ap_nn_gpt_backward(m, NULL, NULL), AP_ESTATE);
    ap_nn_model_free(m);
}

/* ---- MLP ---------------------------------------------------------------- */

typedef struct mref {
    const ap_nn_mlp_config_t *cfg;
    const ap_nn_params_t *p;
    double *w;
    const float *x;
    const int32_t *y;
    int B;
} mref_t;

static double mref_loss(void *ctx)
{
    mref_t *r = ctx;
    const ap_nn_mlp_config_t *c = r->cfg;
    double *a = malloc(sizeof(double) * r->B * 64), *b = malloc(sizeof(double) * r->B * 64);
    for (int i = 0; i < r->B * c->in_dim; i++) a[i] = r->x[i];
    int width = c->in_dim;
    for (int l = 0; l <= c->n_hidden; l++) {
        char nw[16], nb[16];
        snprintf(nw, sizeof nw, "l%d.w", l), snprintf(nb, sizeof nb, "l%d.b", l);
        int out = l == c->n_hidden ? c->n_classes : c->hidden[l];
        ref_linear(b, a, r->w + ap_nn_params_find(r->p, nw)->offset,
                   r->w + ap_nn_params_find(r->p, nb)->offset, r->B, width, out);
        if (l < c->n_hidden)
            for (int i = 0; i < r->B * out; i++) b[i] = ref_gelu1(b[i]);
        double *t = a;
        a = b, b = t;
        width = out;
    }
    double loss = ref_xent(a, r->y, r->B, c->n_classes);
    free(a), free(b);
    return loss;
}

static void test_mlp(void **state)
{
    (void)state;
    ap_nn_mlp_config_t cfg = {
        .in_dim = 6, .n_hidden = 2, .hidden = {16, 12}, .n_classes = 4, .max_batch = 256};
    ap_nn_model_t *m;
    assert_ok(ap_nn_mlp_new(&cfg, &m));
    ap_nn_model_init(m, 11);
    ap_nn_params_t *p = ap_nn_model_params(m);
    /* gradient check against the double reference */
    float x[8 * 6];
    int32_t y[8];
    ap_nn_synth_classify(1, 2, 0, 8, 6, 4, x, y);
    float loss;
    ap_nn_model_zero_grad(m);
    assert_ok(ap_nn_mlp_forward(m, x, y, 8, &loss));
    assert_ok(ap_nn_mlp_backward(m));
    mref_t r = {&cfg, p, todouble(p->data, p->count), x, y, 8};
    expect_close("mlp.loss", 0, loss, mref_loss(&r), 1e-5, 1e-6);
    check_grad("mlp.grad", r.w, p->grad, p->count, mref_loss, &r, 1e-3, 1e-5);
    free(r.w);
    /* it learns the synthetic task: held-out accuracy > 90% */
    ap_nn_solver_config_t oc = ap_nn_solver_defaults(AP_NN_SGD);
    oc.nesterov = true;
    ap_nn_solver_t *o;
    assert_ok(ap_nn_solver_new(&oc, p->count, NULL, 0, &o));
    float xb[64 * 6];
    int32_t yb[64];
    for (int s = 0; s < 300; s++) {
        ap_nn_synth_classify(1, 100, (uint64_t)s * 64, 64, 6, 4, xb, yb);
        ap_nn_model_zero_grad(m);
        assert_ok(ap_nn_mlp_forward(m, xb, yb, 64, &loss));
        assert_ok(ap_nn_mlp_backward(m));
        assert_ok(ap_nn_solver_step(o, p->data, p->grad, 0.05f));
    }
    float xt[256 * 6];
    int32_t yt[256];
    ap_nn_synth_classify(1, 999, 0, 256, 6, 4, xt, yt); /* another sample stream */
    assert_ok(ap_nn_mlp_forward(m, xt, NULL, 256, NULL));
    const float *pr = ap_nn_mlp_probs(m);
    int right = 0;
    for (int i = 0; i < 256; i++) {
        int best = 0;
        for (int k = 1; k < 4; k++)
            if (pr[i * 4 + k] > pr[i * 4 + best]) best = k;
        right += best == yt[i];
    }
    if (right < 231) fail_msg("accuracy %d/256", right);
    int32_t badlab[1] = {4};
    assert_int_equal(ap_nn_mlp_forward(m, xt, badlab, 1, &loss), AP_EINVAL);
    ap_nn_solver_free(o);
    ap_nn_model_free(m);
}

/* ---- optimizers: hand-computed steps ------------------------------------ */

static void run_opt(ap_nn_solver_config_t oc, const float *p0, const float (*g)[3], int steps,
                    float lr, float *out)
{
    ap_nn_solver_t *o;
    assert_ok(ap_nn_solver_new(&oc, 3, NULL, 0, &o));
    memcpy(out, p0, 12);
    for (int s = 0; s < steps; s++) assert_ok(ap_nn_solver_step(o, out, g[s], lr));
    assert_int_equal(o->step, steps);
    ap_nn_solver_free(o);
}

static void test_optim_steps(void **state)
{
    (void)state;
    const float p0[3] = {1.0f, -2.0f, 0.5f};
    const float g[2][3] = {{0.5f, -1.0f, 2.0f}, {1.0f, 0.0f, -1.0f}};
    float p[3];
    ap_nn_solver_config_t c;
    /* SGD, momentum 0.9, lr 0.1:
     * s1: buf = g1; p = p0 - 0.1 g1 = {0.95, -1.9, 0.3}
     * s2: buf = 0.9 g1 + g2 = {1.45, -0.9, 0.8}; p = {0.805, -1.81, 0.22} */
    c = ap_nn_solver_defaults(AP_NN_SGD);
    run_opt(c, p0, g, 2, 0.1f, p);
    const float sgd[3] = {0.805f, -1.81f, 0.22f};
    for (int i = 0; i < 3; i++) expect_close("sgd", i, p[i], sgd[i], 1e-6, 1e-6);
    /* Nesterov: update = g + 0.9 buf.
     * s1: buf = g1, upd = 1.9 g1 = {0.95,-1.9,3.8}; p = {0.905,-1.81,0.12}
     * s2: buf = {1.45,-0.9,0.8}, upd = g2 + 0.9 buf = {2.305,-0.81,-0.28};
     *     p = {0.6745, -1.729, 0.148} */
    c.nesterov = true;
    run_opt(c, p0, g, 2, 0.1f, p);
    const float nes[3] = {0.6745f, -1.729f, 0.148f};
    for (int i = 0; i < 3; i++) expect_close("nesterov", i, p[i], nes[i], 1e-6, 1e-6);
    /* Adam (b1 .9, b2 .999, eps 1e-8), lr 0.01: step 1 moves every coordinate
     * by lr*sign(g) (m_hat = g, v_hat = g^2): {0.99, -1.99, 0.49}.
     * step 2, coordinate 0: m = .9*.05+.1*1 = .145, v = .999*.00025+.001 = .00124975
     *   m_hat = .145/.19 = .763157895, v_hat = .00124975/.001999 = .625187594
     *   p = .99 - .01*.763157895/.790688051 = .980348183
     * coordinate 1 (g2 = 0): m = -.09, v = .000999; m_hat = -.473684211,
     *   v_hat = .49974987, p = -1.99 + .01*.473684211/.706929183 = -1.983299406
     * coordinate 2: m = .18-.1 = .08, v = .003996+.001 = .004996;
     *   m_hat = .421052632, v_hat = 2.499249625, p = .49 - .01*.421052632/1.580901459
     *   = .487336627 */
    c = ap_nn_solver_defaults(AP_NN_ADAM);
    run_opt(c, p0, g, 1, 0.01f, p);
    const float ad1[3] = {0.99f, -1.99f, 0.49f};
    for (int i = 0; i < 3; i++) expect_close("adam1", i, p[i], ad1[i], 1e-6, 1e-6);
    run_opt(c, p0, g, 2, 0.01f, p);
    const float ad2[3] = {0.980348183f, -1.983299406f, 0.487336627f};
    for (int i = 0; i < 3; i++) expect_close("adam2", i, p[i], ad2[i], 1e-5, 1e-6);
    /* Adam with L2 (wd 0.1): g1' = g1 + 0.1 p0 = {0.6,-1.2,2.05}; step 1 is
     * still lr*sign: {0.99,-1.99,0.49}. AdamW (wd 0.1): p *= 1 - lr*wd first:
     * {0.999, -1.998, 0.4995} then -lr*sign(g): {0.989, -1.988, 0.4895} */
    c.weight_decay = 0.1f;
    run_opt(c, p0, g, 1, 0.01f, p);
    for (int i = 0; i < 3; i++) expect_close("adam-l2", i, p[i], ad1[i], 1e-6, 1e-6);
    c = ap_nn_solver_defaults(AP_NN_ADAMW);
    c.weight_decay = 0.1f;
    run_opt(c, p0, g, 1, 0.01f, p);
    const float aw[3] = {0.989f, -1.988f, 0.4895f};
    for (int i = 0; i < 3; i++) expect_close("adamw", i, p[i], aw[i], 1e-6, 1e-6);
    /* LAMB (wd 0, eps 1e-6) step 1: r = sign(g)*(|g|/(|g|+1e-6)) ~ {1,-1,1};
     * ||p0|| = sqrt(1+4+.25) = 2.291287847, ||r|| = sqrt(3) (to 1e-6);
     * trust = 1.322876; p = p0 - 0.01*1.322876*r = {0.98677124, -1.98677124, 0.48677124} */
    c = ap_nn_solver_defaults(AP_NN_LAMB);
    c.weight_decay = 0;
    run_opt(c, p0, g, 1, 0.01f, p);
    const float lb[3] = {0.98677124f, -1.98677124f, 0.48677124f};
    for (int i = 0; i < 3; i++) expect_close("lamb", i, p[i], lb[i], 1e-5, 1e-6);
    /* LAMB with two segments: trust ratios differ per segment.
     * seg A = {0,1}: ||p|| = sqrt(5) = 2.236068, ||r|| = sqrt(2): trust 1.581139
     * seg B = {2}: ||p|| = .5, ||r|| = 1: trust .5 */
    ap_nn_view_t segs[2] = {{.offset = 0, .count = 2}, {.offset = 2, .count = 1}};
    ap_nn_solver_t *o;
    assert_ok(ap_nn_solver_new(&c, 3, segs, 2, &o));
    memcpy(p, p0, 12);
    assert_ok(ap_nn_solver_step(o, p, g[0], 0.01f));
    const float lb2[3] = {1.0f - 0.01581139f, -2.0f + 0.01581139f, 0.5f - 0.005f};
    for (int i = 0; i < 3; i++) expect_close("lamb-seg", i, p[i], lb2[i], 1e-5, 1e-6);
    assert_int_equal(o->state_count, 6);
    ap_nn_solver_reset(o);
    assert_int_equal(o->step, 0);
    assert_int_equal(ap_nn_solver_step(o, p, g[0], NAN), AP_ENONFINITE);
    ap_nn_solver_free(o);
    ap_nn_solver_config_t badc = ap_nn_solver_defaults(AP_NN_ADAM);
    badc.beta1 = 1.0f;
    assert_int_equal(ap_nn_solver_new(&badc, 3, NULL, 0, &o), AP_EINVAL);
}

static void test_clip_and_schedule(void **state)
{
    (void)state;
    float g[4] = {3, 4, 0, 0};
    expect_close("norm", 0, ap_nn_clip_grad_norm(g, 4, 10.0), 5.0, 1e-12, 0);
    assert_true(g[0] == 3.0f); /* under the limit: untouched */
    expect_close("norm", 0, ap_nn_clip_grad_norm(g, 4, 1.0), 5.0, 1e-12, 0);
    expect_close("clipped", 0, ap_nn_grad_norm(g, 4), 1.0, 1e-5, 0);
    expect_close("clipped0", 0, g[0], 0.6, 1e-5, 0);
    float gn[2] = {1, INFINITY};
    assert_false(isfinite(ap_nn_clip_grad_norm(gn, 2, 1.0)));
    assert_true(gn[0] == 1.0f);

    ap_nn_lr_schedule_t s = {
        .kind = AP_NN_LR_COSINE, .base = 1.0f, .min = 0.1f, .warmup = 10, .total = 110};
    expect_close("warm0", 0, ap_nn_lr_at(&s, 0), 0.1, 1e-6, 0);
    expect_close("warm9", 0, ap_nn_lr_at(&s, 9), 1.0, 1e-6, 0);
    expect_close("cos10", 0, ap_nn_lr_at(&s, 10), 1.0, 1e-6, 0);
    expect_close("cos60", 0, ap_nn_lr_at(&s, 60), 0.55, 1e-6, 0);
    expect_close("cos110", 0, ap_nn_lr_at(&s, 110), 0.1, 1e-6, 0);
    expect_close("cos999", 0, ap_nn_lr_at(&s, 999), 0.1, 1e-6, 0);
    s.kind = AP_NN_LR_LINEAR;
    expect_close("lin35", 0, ap_nn_lr_at(&s, 35), 1.0 - 0.9 * 0.25, 1e-6, 0);
    s.kind = AP_NN_LR_CONSTANT;
    expect_close("const", 0, ap_nn_lr_at(&s, 500), 1.0, 1e-6, 0);

    /* rsqrt: warm-up, base until total, then base * sqrt(total / (step + 1))
     * down to min. */
    s = (ap_nn_lr_schedule_t){
        .kind = AP_NN_LR_RSQRT, .base = 1.0f, .min = 0.1f, .warmup = 3, .total = 10};
    expect_close("rs0", 0, ap_nn_lr_at(&s, 0), 1.0 / 3, 1e-6, 0);
    expect_close("rs9", 0, ap_nn_lr_at(&s, 9), 1.0, 1e-6, 0);
    expect_close("rs10", 0, ap_nn_lr_at(&s, 10), sqrt(10.0 / 11), 1e-6, 0);
    expect_close("rs39", 0, ap_nn_lr_at(&s, 39), 0.5, 1e-6, 0);
    expect_close("rs999", 0, ap_nn_lr_at(&s, 999), 0.1, 1e-6, 0);
    for (uint64_t i = 10; i < 200; i++) /* never rises after the warm-up */
        assert_true(ap_nn_lr_at(&s, i + 1) <= ap_nn_lr_at(&s, i));
    s.total = 0; /* the decay starts where the warm-up ends */
    expect_close("rsw3", 0, ap_nn_lr_at(&s, 3), sqrt(0.75), 1e-6, 0);
    expect_close("rsw11", 0, ap_nn_lr_at(&s, 11), 0.5, 1e-6, 0);
    s.warmup = 0;
    expect_close("rs00", 0, ap_nn_lr_at(&s, 0), 1.0, 1e-6, 0);
    expect_close("rs03", 0, ap_nn_lr_at(&s, 3), 0.5, 1e-6, 0);
    ap_nn_lr_kind_t k = AP_NN_LR_CONSTANT;
    assert_int_equal(ap_nn_lr_kind_from_name("rsqrt", &k), 0);
    assert_int_equal(k, AP_NN_LR_RSQRT);
    assert_string_equal(ap_nn_lr_kind_name(AP_NN_LR_RSQRT), "rsqrt");
}

/* ---- data ---------------------------------------------------------------- */

static void test_text_data(void **state)
{
    (void)state;
    ap_nn_text_t *d;
    assert_int_equal(ap_nn_text_open("/nonexistent/apiary.txt", &d), AP_ENOTFOUND);
    char path[] = "/tmp/apiary_nn_textXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(ap_nn_text_open(path, &d), AP_EINVAL); /* empty */
    assert_int_equal(ap_nn_text_open("/tmp", &d), AP_EIO);  /* a directory */
    /* 10 windows of T=8: bytes 0..80 */
    uint8_t buf[81];
    for (int i = 0; i < 81; i++) buf[i] = (uint8_t)i;
    assert_int_equal(write(fd, buf, 81), 81);
    close(fd);
    assert_ok(ap_nn_text_open(path, &d));
    unlink(path);
    assert_int_equal(ap_nn_text_size(d), 81);
    assert_int_equal(ap_nn_text_windows(d, 8), 10);
    int32_t in[10 * 8], tg[10 * 8], in2[10 * 8], tg2[10 * 8];
    uint64_t cur = 0, cur2 = 0;
    assert_ok(ap_nn_text_batch(d, 5, &cur, 10, 8, in, tg));
    assert_int_equal(cur, 10);
    int seen[10] = {0};
    for (int b = 0; b < 10; b++) {
        int w = in[b * 8] / 8;
        assert_int_equal(in[b * 8], w * 8); /* window start */
        seen[w]++;
        for (int t = 0; t < 8; t++) {
            assert_int_equal(in[b * 8 + t], w * 8 + t);
            assert_int_equal(tg[b * 8 + t], w * 8 + t + 1);
        }
    }
    for (int w = 0; w < 10; w++) assert_int_equal(seen[w], 1); /* an epoch is a permutation */
    assert_ok(ap_nn_text_batch(d, 5, &cur2, 10, 8, in2, tg2));
    assert_memory_equal(in, in2, sizeof in); /* same seed, same order */
    assert_ok(ap_nn_text_batch(d, 5, &cur2, 10, 8, in2, tg2));
    assert_true(memcmp(in, in2, sizeof in) != 0); /* next epoch reshuffles */
    cur2 = 0;
    assert_ok(ap_nn_text_batch(d, 6, &cur2, 10, 8, in2, tg2));
    assert_true(memcmp(in, in2, sizeof in) != 0);                             /* another seed */
    assert_int_equal(ap_nn_text_batch(d, 5, &cur, 1, 81, in, tg), AP_EINVAL); /* no window */
    ap_nn_text_free(d);
    /* the shipped corpus loads */
    assert_ok(ap_nn_text_open(ap_nn_default_corpus(), &d));
    assert_true(ap_nn_text_size(d) > 100000);
    ap_nn_text_free(d);
}

/* ---- checkpoints -------------------------------------------------------- */

static void test_checkpoint(void **state)
{
    (void)state;
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(8, 2, 2, 16, 2);
    ap_nn_model_t *m, *m2;
    assert_ok(ap_nn_gpt_new(&cfg, &m));
    assert_ok(ap_nn_gpt_new(&cfg, &m2));
    ap_nn_model_init(m, 1);
    ap_nn_params_t *p = ap_nn_model_params(m), *p2 = ap_nn_model_params(m2);
    ap_nn_solver_config_t oc = ap_nn_solver_defaults(AP_NN_ADAMW);
    ap_nn_solver_t *o, *o2;
    assert_ok(ap_nn_solver_new(&oc, p->count, p->views, p->nviews, &o));
    assert_ok(ap_nn_solver_new(&oc, p->count, p->views, p->nviews, &o2));
    int32_t tok[16], tg[16];
    for (int i = 0; i < 16; i++) tok[i] = i * 7, tg[i] = i * 5;
    train_gpt_steps(m, o, tok, tg, 2, 8, 3, 1e-3f);
    char path[] = "/tmp/apiary_nn_ckptXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_ok(ap_nn_checkpoint_save(path, m, o, 1234));
    uint64_t step = 0;
    assert_ok(ap_nn_checkpoint_load(path, m2, o2, &step));
    assert_int_equal(step, 1234);
    assert_int_equal(o2->step, 3);
    assert_memory_equal(p->data, p2->data, p->count * 4);
    assert_memory_equal(o->state, o2->state, o->state_count * 4);
    /* weights only */
    assert_ok(ap_nn_checkpoint_load(path, m2, NULL, NULL));

    uint8_t *buf;
    size_t len;
    assert_ok(ap_nn_checkpoint_encode(m, o, 9, &buf, &len));
    /* any flipped byte is caught (header fields or checksum) */
    for (size_t i = 0; i < len; i += len / 37) {
        buf[i] ^= 0x20;
        assert_true(ap_nn_checkpoint_decode(buf, len, m2, o2, NULL) < 0);
        buf[i] ^= 0x20;
    }
    assert_int_equal(ap_nn_checkpoint_decode(buf, len - 1, m2, o2, NULL), AP_ECORRUPT);
    assert_int_equal(ap_nn_checkpoint_decode(buf, 10, m2, o2, NULL), AP_ECORRUPT);
    buf[8] = 2; /* version */
    assert_int_equal(ap_nn_checkpoint_decode(buf, len, m2, o2, NULL), AP_EVERSION);
    buf[8] = 1;
    assert_ok(ap_nn_checkpoint_decode(buf, len, m2, o2, NULL));
    /* another model shape */
    ap_nn_gpt_config_t other = ap_nn_gpt_config_default(8, 3, 2, 16, 2);
    ap_nn_model_t *m3;
    assert_ok(ap_nn_gpt_new(&other, &m3));
    assert_int_equal(ap_nn_checkpoint_decode(buf, len, m3, NULL, NULL), AP_EINVAL);
    assert_int_equal(ap_nn_checkpoint_load(path, m3, NULL, NULL), AP_EINVAL);
    /* another optimizer kind */
    ap_nn_solver_config_t sc = ap_nn_solver_defaults(AP_NN_SGD);
    ap_nn_solver_t *os;
    assert_ok(ap_nn_solver_new(&sc, p->count, NULL, 0, &os));
    assert_int_equal(ap_nn_checkpoint_decode(buf, len, m2, os, NULL), AP_EINVAL);
    /* an MLP file into a GPT */
    ap_nn_mlp_config_t mc = {.in_dim = 4, .n_classes = 2, .max_batch = 1};
    ap_nn_model_t *mm;
    assert_ok(ap_nn_mlp_new(&mc, &mm));
    uint8_t *mb;
    size_t ml;
    assert_ok(ap_nn_checkpoint_encode(mm, NULL, 0, &mb, &ml));
    assert_int_equal(ap_nn_checkpoint_decode(mb, ml, m2, NULL, NULL), AP_EINVAL);
    assert_int_equal(ap_nn_checkpoint_decode(mb, ml, mm, o2, NULL), AP_EINVAL); /* no optim */
    assert_ok(ap_nn_checkpoint_decode(mb, ml, mm, NULL, NULL));
    free(mb);
    /* truncated file */
    assert_int_equal(truncate(path, (off_t)(len - 100)), 0);
    assert_int_equal(ap_nn_checkpoint_load(path, m2, o2, NULL), AP_ECORRUPT);
    unlink(path);
    assert_int_equal(ap_nn_checkpoint_load(path, m2, o2, NULL), AP_ENOTFOUND);
    /* m2 still holds the good weights after all the failures */
    assert_memory_equal(p->data, p2->data, p->count * 4);
    free(buf);
    ap_nn_solver_free(os), ap_nn_solver_free(o), ap_nn_solver_free(o2);
    ap_nn_model_free(mm), ap_nn_model_free(m3), ap_nn_model_free(m), ap_nn_model_free(m2);
}

static void test_memory_layout(void **state)
{
    (void)state;
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(16, 2, 2, 32, 4);
    ap_nn_model_t *m;
    assert_ok(ap_nn_gpt_new(&cfg, &m));
    ap_nn_params_t *p = ap_nn_model_params(m);
    /* views are disjoint, aligned, in order, and cover the arena */
    size_t end = 0, sum = 0;
    for (size_t i = 0; i < p->nviews; i++) {
        assert_true(p->views[i].offset >= end);
        assert_int_equal(p->views[i].offset % 16, 0);
        assert_int_equal(p->views[i].count, (size_t)p->views[i].rows * p->views[i].cols);
        end = p->views[i].offset + p->views[i].count;
        sum += p->views[i].count;
    }
    assert_int_equal(end, p->count);
    assert_int_equal(sum, ap_nn_gpt_param_count(&cfg));
    assert_int_equal((uintptr_t)p->data % 64, 0);
    assert_int_equal((uintptr_t)p->grad % 64, 0);
    /* 12 C^2 + 13 C per block, embeddings, head */
    size_t C = 32, want = 2 * (12 * C * C + 13 * C) + 256 * C + 16 * C + 2 * C + 256 * C;
    assert_int_equal(sum, want);
    ap_nn_model_free(m);
}

int main(void)
{
    ap_log_set_level(AP_LOG_OFF);
    rs ^= ap_test_seed(0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_layernorm),
        cmocka_unit_test(test_gelu),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_xent),
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_dropout),
        cmocka_unit_test(test_gpt_gradcheck),
        cmocka_unit_test(test_gpt_gradcheck_shared),
        cmocka_unit_test(test_gpt_stages),
        cmocka_unit_test(test_gpt_overfit),
        cmocka_unit_test(test_gpt_dropout),
        cmocka_unit_test(test_gpt_bad_input),
        cmocka_unit_test(test_mlp),
        cmocka_unit_test(test_optim_steps),
        cmocka_unit_test(test_clip_and_schedule),
        cmocka_unit_test(test_text_data),
        cmocka_unit_test(test_checkpoint),
        cmocka_unit_test(test_memory_layout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
