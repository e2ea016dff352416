/* Layer kernels of the model kit: forward and backward of linear, embedding,
 * layer norm, GELU, causal self-attention, softmax cross-entropy and dropout.
 * Shapes are in apiary/nn.h. Matrix products go to OpenBLAS (one thread per
 * call); everything is split across the worker pool by rows or columns so
 * that no two threads ever write the same float. */
#include "nn/nn_impl.h"

#include "base/pool.h"

#if defined(__GNUC__) && !defined(__clang__)
/* The element-wise loops below are written to vectorise; GCC's -O2 cost
 * model leaves most of them scalar, and it will not if-convert float
 * compares (clamps) while FP traps are modelled, nor call sqrtf without
 * errno. We use neither traps nor errno, so this file asks for -O3,
 * -fno-trapping-math and -fno-math-errno (clang vectorises them at -O2). */
#pragma GCC optimize("O3", "no-trapping-math", "no-math-errno")
#endif

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

/* exp(x) for float, vectorisable (no libm call, no branches): x = n ln2 + r
 * with |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (truncation
 * error r^8/8! < 6e-9, below float rounding), 2^n through the exponent bits.
 * Inputs are clamped to [-87, 88] (no overflow to inf, no denormals). */
__attribute__((always_inline)) static inline float fast_expf(float x)
{
    x = x > -87.0f ? x : -87.0f; /* maxps/minps operand order: NaN stays NaN */
    x = x < 88.0f ? x : 88.0f;
    /* round to nearest by the 1.5 * 2^23 trick (branch-free, |t| < 2^22) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln2 split in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

float ap__nn_expf(float x)
{
    return fast_expf(x);
}

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static void blas_init_once(void)
{
    openblas_set_num_threads(1);
}
void ap__nn_blas_init(void)
{
    pthread_once(&blas_once, blas_init_once);
}

void ap__nn_par(size_t n, size_t min_grain, int balanced, void (*fn)(void *arg, size_t b, size_t e),
                void *arg)
{
    ap_pool_t *p = ap__pool_global();
    size_t nt = (size_t)ap__pool_size(p) + 1;
    size_t grain = min_grain ? min_grain : 1;
    if (balanced) {
        size_t g = (n + nt - 1) / nt;
        if (g > grain) grain = g;
    }
    ap__pool_parallel_for(p, n, grain, fn, arg);
}

/* ------------------------------------------------------------------------ */
/* linear                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct lin_args {
    float *out, *din, *dw, *db;
    const float *in, *w, *b, *dout;
    int N, C, OC;
    float beta; /* din accumulation: 1 = +=, 0 = overwrite */
} lin_args_t;

static void lin_fwd_rows(void *arg, size_t r0, size_t r1)
{
    const lin_args_t *a = arg;
    int rows = (int)(r1 - r0);
    float *out = a->out + r0 * (size_t)a->OC;
    if (a->b)
        for (int r = 0; r < rows; r++) memcpy(out + (size_t)r * a->OC, a->b, sizeof(float) * a->OC);
    /* out (rows,OC) = in (rows,C) @ w^T (C,OC) [+ out] */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, a->OC, a->C, 1.0f,
                a->in + r0 * (size_t)a->C, a->C, a->w, a->C, a->b ? 1.0f : 0.0f, out, a->OC);
}

void ap_nn_linear_forward(float *out, const float *in, const float *w, const float *b, int N, int C,
                          int OC)
{
    ap__nn_blas_init();
    lin_args_t a = {.out = out, .in = in, .w = w, .b = b, .N = N, .C = C, .OC = OC};
    ap__nn_par((size_t)N, 16, 1, lin_fwd_rows, &a);
}

static void lin_bwd_din_rows(void *arg, size_t r0, size_t r1)
{
    const lin_args_t *a = arg;
    /* din (rows,C) += dout (rows,OC) @ w (OC,C) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(r1 - r0), a->C, a->OC, 1.0f,
                a->dout + r0 * (size_t)a->OC, a->OC, a->w, a->C, a->beta,
                a->din + r0 * (size_t)a->C, a->C);
}

static void lin_bwd_dw_cols(void *arg, size_t o0, size_t o1)
{
    const lin_args_t *a = arg;
    int no = (int)(o1 - o0);
    if (a->dw) /* dw[o0:o1] (no,C) += dout[:, o0:o1]^T (no,N) @ in (N,C) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, no, a->C, a->N, 1.0f, a->dout + o0,
                    a->OC, a->in, a->C, 1.0f, a->dw + o0 * (size_t)a->C, a->C);
    if (a->db) {
        for (int n = 0; n < a->N; n++) {
            const float *d = a->dout + (size_t)n * a->OC + o0;
            float *db = a->db + o0;
            for (int o = 0; o < no; o++) db[o] += d[o];
        }
    }
}

void ap__nn_linear_backward_ex(float *din, float *dw, float *db, const float *dout, const float *in,
                               const float *w, int N, int C, int OC, bool acc)
{
    ap__nn_blas_init();
    lin_args_t a = {.din = din,
                    .dw = dw,
                    .db = db,
                    .dout = dout,
                    .in = in,
                    .w = w,
                    .N = N,
                    .C = C,
                    .OC = OC,
                    .beta = acc ? 1.0f : 0.0f};
    if (din) ap__nn_par((size_t)N, 16, 1, lin_bwd_din_rows, &a);
    if (dw || db) ap__nn_par((size_t)OC, 16, 1, lin_bwd_dw_cols, &a);
}

void ap_nn_linear_backward(float *din, float *dw, float *db, const float *dout, const float *in,
                           const float *w, int N, int C, int OC)
{
    ap__nn_linear_backward_ex(din, dw, db, dout, in, w, N, C, OC, true);
}

/* ------------------------------------------------------------------------ */
/* embedding                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct emb_args {
    float *out, *dwte, *dwpe;
    const float *wte, *wpe, *dout;
    const int32_t *tok;
    int B, T, C;
} emb_args_t;

static void emb_fwd_rows(void *arg, size_t r0, size_t r1)
{
    const emb_args_t *a = arg;
    for (size_t r = r0; r < r1; r++) {
        int t = (int)(r % (size_t)a->T);
        const float *e = a->wte + (size_t)a->tok[r] * a->C;
        const float *p = a->wpe + (size_t)t * a->C;
        float *o = a->out + r * (size_t)a->C;
        for (int c = 0; c < a->C; c++) o[c] = e[c] + p[c];
    }
}

void ap_nn_embed_forward(float *out, const int32_t *tokens, const float *wte, const float *wpe,
                         int B, int T, int C)
{
    emb_args_t a = {.out = out, .wte = wte, .wpe = wpe, .tok = tokens, .B = B, .T = T, .C = C};
    ap__nn_par((size_t)B * T, 64, 0, emb_fwd_rows, &a);
}

/* Column split: every thread owns channels [c0,c1) of every row of dwte/dwpe. */
static void emb_bwd_cols(void *arg, size_t c0, size_t c1)
{
    const emb_args_t *a = arg;
    for (int b = 0; b < a->B; b++)
        for (int t = 0; t < a->T; t++) {
            size_t r = (size_t)b * a->T + t;
            const float *d = a->dout + r * (size_t)a->C;
            float *e = a->dwte + (size_t)a->tok[r] * a->C;
            for (size_t c = c0; c < c1; c++) e[c] += d[c];
            if (a->dwpe) {
                float *p = a->dwpe + (size_t)t * a->C;
                for (size_t c = c0; c < c1; c++) p[c] += d[c];
            }
        }
}

void ap_nn_embed_backward(float *dwte, float *dwpe, const float *dout, const int32_t *tokens, int B,
                          int T, int C)
{
    emb_args_t a = {
        .dwte = dwte, .dwpe = dwpe, .dout = dout, .tok = tokens, .B = B, .T = T, .C = C};
    ap__nn_par((size_t)C, 16, 1, emb_bwd_cols, &a);
}

/* ------------------------------------------------------------------------ */
/* layer norm                                                                */
/* ------------------------------------------------------------------------ */

typedef struct ln_args {
    float *out, *mean, *rstd, *din, *dw, *db;
    const float *in, *w, *b, *dout, *cmean, *crstd;
    int N, C;
} ln_args_t;

/* Sums in 16 independent lanes so the compiler can vectorise them without
 * reassociating (no -ffast-math); the lane order is fixed, so results do
 * not depend on the thread count. */
__attribute__((always_inline)) static inline float lane_sum(const float *restrict x, int n)
{
    float acc[16] = {0};
    int c = 0;
    for (; c + 16 <= n; c += 16)
        for (int k = 0; k < 16; k++) acc[k] += x[c + k];
    float s = 0.0f;
    for (; c < n; c++) s += x[c];
    for (int k = 0; k < 16; k++) s += acc[k];
    return s;
}

__attribute__((always_inline)) static inline float lane_sqdev(const float *restrict x, float m,
                                                              int n)
{
    float acc[16] = {0};
    int c = 0;
    for (; c + 16 <= n; c += 16)
        for (int k = 0; k < 16; k++) {
            float d = x[c + k] - m;
            acc[k] += d * d;
        }
    float s = 0.0f;
    for (; c < n; c++) s += (x[c] - m) * (x[c] - m);
    for (int k = 0; k < 16; k++) s += acc[k];
    return s;
}

NN_SIMD static void ln_fwd_rows(void *arg, size_t r0, size_t r1)
{
    const ln_args_t *a = arg;
    const int C = a->C;
    const float *restrict w = a->w, *restrict b = a->b;
    for (size_t r = r0; r < r1; r++) {
        const float *restrict x = a->in + r * (size_t)C;
        float m = lane_sum(x, C) / (float)C;
        float v = lane_sqdev(x, m, C) / (float)C;
        float s = 1.0f / sqrtf(v + 1e-5f);
        float *restrict o = a->out + r * (size_t)C;
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * w[c] + b[c];
        a->mean[r] = m;
        a->rstd[r] = s;
    }
}

void ap_nn_layernorm_forward(float *out, float *mean, float *rstd, const float *in, const float *w,
                             const float *b, int N, int C)
{
    ln_args_t a = {
        .out = out, .mean = mean, .rstd = rstd, .in = in, .w = w, .b = b, .N = N, .C = C};
    ap__nn_par((size_t)N, 32, 0, ln_fwd_rows, &a);
}

NN_SIMD static void ln_bwd_rows(void *arg, size_t r0, size_t r1)
{
    const ln_args_t *a = arg;
    const int C = a->C;
    const float *restrict w = a->w;
    for (size_t r = r0; r < r1; r++) {
        const float *restrict x = a->in + r * (size_t)C, *restrict dy = a->dout + r * (size_t)C;
        const float m = a->cmean[r], s = a->crstd[r];
        /* dnorm = dy * w; din = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) */
        float acc1[16] = {0}, acc2[16] = {0}, sd = 0.0f, sdn = 0.0f;
        int c = 0;
        for (; c + 16 <= C; c += 16)
            for (int k = 0; k < 16; k++) {
                float n = (x[c + k] - m) * s, dn = dy[c + k] * w[c + k];
                acc1[k] += dn;
                acc2[k] += dn * n;
            }
        for (; c < C; c++) {
            float n = (x[c] - m) * s, dn = dy[c] * w[c];
            sd += dn;
            sdn += dn * n;
        }
        for (int k = 0; k < 16; k++) sd += acc1[k], sdn += acc2[k];
        sd /= (float)C;
        sdn /= (float)C;
        float *restrict dx = a->din + r * (size_t)C;
        for (c = 0; c < C; c++) {
            float n = (x[c] - m) * s, dn = dy[c] * w[c];
            dx[c] += s * (dn - sd - n * sdn);
        }
    }
}

NN_SIMD static void ln_bwd_cols(void *arg, size_t c0, size_t c1)
{
    const ln_args_t *a = arg;
    const int C = a->C;
    float *restrict dw = a->dw, *restrict db = a->db;
    for (int r = 0; r < a->N; r++) {
        const float *restrict x = a->in + (size_t)r * C, *restrict dy = a->dout + (size_t)r * C;
        const float m = a->cmean[r], s = a->crstd[r];
        if (dw)
            for (size_t c = c0; c < c1; c++) dw[c] += dy[c] * (x[c] - m) * s;
        if (db)
            for (size_t c = c0; c < c1; c++) db[c] += dy[c];
    }
}

void ap_nn_layernorm_backward(float *din, float *dw, float *db, const float *dout, const float *in,
                              const float *w, const float *mean, const float *rstd, int N, int C)
{
    ln_args_t a = {.din = din,
                   .dw = dw,
                   .db = db,
                   .dout = dout,
                   .in = in,
                   .w = w,
                   .cmean = mean,
                   .crstd = rstd,
                   .N = N,
                   .C = C};
    if (din) ap__nn_par((size_t)N, 32, 0, ln_bwd_rows, &a);
    if (dw || db) ap__nn_par((size_t)C, 16, 1, ln_bwd_cols, &a);
}

/* ------------------------------------------------------------------------ */
/* GELU (tanh approximation)                                                 */
/* ------------------------------------------------------------------------ */

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */

typedef struct ew_args {
    float *out;
    const float *in, *dout;
    float p;
    uint64_t seed;
} ew_args_t;

NN_SIMD static void gelu_fwd_range(void *arg, size_t i0, size_t i1)
{
    const ew_args_t *a = arg;
    float *restrict out = a->out;
    const float *restrict in = a->in;
    /* 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation for negative x */
    for (size_t i = i0; i < i1; i++) {
        float x = in[i];
        float u = GELU_K * (x + 0.044715f * x * x * x);
        out[i] = x / (1.0f + fast_expf(-2.0f * u));
    }
}

void ap_nn_gelu_forward(float *out, const float *in, size_t n)
{
    ew_args_t a = {.out = out, .in = in};
    ap__nn_par(n, 4096, 0, gelu_fwd_range, &a);
}

NN_SIMD static void gelu_bwd_range(void *arg, size_t i0, size_t i1)
{
    const ew_args_t *a = arg;
    float *restrict out = a->out;
    const float *restrict in = a->in, *restrict dout = a->dout;
    /* gelu = x s, s = sigmoid(2u): gelu' = s + 2 x s (1-s) u' */
#define GELU_GRAD(i)                                                                               \
    float x = in[i];                                                                               \
    float u = GELU_K * (x + 0.044715f * x * x * x);                                                \
    float sg = 1.0f / (1.0f + fast_expf(-2.0f * u));                                               \
    float du = GELU_K * (1.0f + 3.0f * 0.044715f * x * x);                                         \
    float g = (sg + 2.0f * x * sg * (1.0f - sg) * du) * dout[i]
    if (a->p != 0.0f) {
        for (size_t i = i0; i < i1; i++) {
            GELU_GRAD(i);
            out[i] += g;
        }
    } else {
        for (size_t i = i0; i < i1; i++) {
            GELU_GRAD(i);
            out[i] = g;
        }
    }
#undef GELU_GRAD
}

void ap__nn_gelu_backward_ex(float *din, const float *in, const float *dout, size_t n, bool acc)
{
    ew_args_t a = {.out = din, .in = in, .dout = dout, .p = acc ? 1.0f : 0.0f};
    ap__nn_par(n, 4096, 0, gelu_bwd_range, &a);
}

void ap_nn_gelu_backward(float *din, const float *in, const float *dout, size_t n)
{
    ap__nn_gelu_backward_ex(din, in, dout, n, true);
}

/* ------------------------------------------------------------------------ */
/* causal self-attention                                                     */
/* ------------------------------------------------------------------------ */

typedef struct att_args {
    float *out, *att, *dqkv, *scratch;
    const float *qkv, *dout, *catt;
    int B, T, C, NH;
    float beta; /* dqkv accumulation: 1 = +=, 0 = overwrite */
} att_args_t;

/* One (b,h) pair per item. q/k/v rows of head h live at qkv + (b*T+t)*3C +
 * {0,C,2C} + h*hs with row stride 3C, so BLAS reads them in place. */
NN_SIMD static void att_fwd_heads(void *arg, size_t i0, size_t i1)
{
    const att_args_t *a = arg;
    const int T = a->T, C = a->C, NH = a->NH, hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    for (size_t i = i0; i < i1; i++) {
        int b = (int)(i / (size_t)NH), h = (int)(i % (size_t)NH);
        const float *q = a->qkv + (size_t)b * T * C3 + (size_t)h * hs;
        const float *k = q + C, *v = q + 2 * C;
        float *P = a->att + i * (size_t)T * T; /* (T,T) */
        /* S (T,T) = scale * Q (T,hs) @ K^T (hs,T) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q, C3, k, C3, 0.0f, P,
                    T);
        for (int t = 0; t < T; t++) {
            float *row = P + (size_t)t * T;
            float mx = row[0];
            for (int j = 1; j <= t; j++) mx = row[j] > mx ? row[j] : mx;
            for (int j = 0; j <= t; j++) row[j] = fast_expf(row[j] - mx);
            float inv = 1.0f / lane_sum(row, t + 1);
            for (int j = 0; j <= t; j++) row[j] *= inv;
            for (int j = t + 1; j < T; j++) row[j] = 0.0f;
        }
        /* Y (T,hs) = P (T,T) @ V (T,hs), written into out (B,T,C) at head h */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, P, T, v, C3, 0.0f,
                    a->out + (size_t)b * T * C + (size_t)h * hs, C);
    }
}

void ap_nn_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
{
    ap__nn_blas_init();
    att_args_t a = {.out = out, .att = att, .qkv = qkv, .B = B, .T = T, .C = C, .NH = NH};
    ap__nn_par((size_t)B * NH, 1, 0, att_fwd_heads, &a);
}

NN_SIMD static void att_bwd_heads(void *arg, size_t i0, size_t i1)
{
    const att_args_t *a = arg;
    const int T = a->T, C = a->C, NH = a->NH, hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    for (size_t i = i0; i < i1; i++) {
        int b = (int)(i / (size_t)NH), h = (int)(i % (size_t)NH);
        size_t qoff = (size_t)b * T * C3 + (size_t)h * hs;
        const float *q = a->qkv + qoff, *k = q + C, *v = q + 2 * C;
        float *dq = a->dqkv + qoff, *dk = dq + C, *dv = dq + 2 * C;
        const float *dy = a->dout + (size_t)b * T * C + (size_t)h * hs; /* (T,hs), stride C */
        const float *P = a->catt + i * (size_t)T * T;
        float *dP = a->scratch + i * (size_t)T * T;
        /* dP (T,T) = dY (T,hs) @ V^T (hs,T) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, dy, C, v, C3, 0.0f, dP,
                    T);
        /* dV (T,hs) += P^T (T,T) @ dY (T,hs) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, P, T, dy, C, a->beta,
                    dv, C3);
        /* softmax backward, in place: dS = scale * P * (dP - sum_j P dP) */
        for (int t = 0; t < T; t++) {
            const float *p = P + (size_t)t * T;
            float *d = dP + (size_t)t * T;
            float dot = 0.0f;
            for (int j = 0; j <= t; j++) dot += p[j] * d[j];
            for (int j = 0; j <= t; j++) d[j] = scale * p[j] * (d[j] - dot);
            for (int j = t + 1; j < T; j++) d[j] = 0.0f;
        }
        /* dQ (T,hs) += dS (T,T) @ K (T,hs);  dK (T,hs) += dS^T (T,T) @ Q (T,hs) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, dP, T, k, C3,
                    a->beta, dq, C3);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, dP, T, q, C3, a->beta,
                    dk, C3);
    }
}

void ap_nn_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                              const float *att, int B, int T, int C, int NH)
{
    ap__nn_attention_backward_ex(dqkv, scratch, dout, qkv, att, B, T, C, NH, true);
}

void ap__nn_attention_backward_ex(float *dqkv, float *scratch, const float *dout, const float *qkv,
                                  const float *att, int B, int T, int C, int NH, bool acc)
{
    ap__nn_blas_init();
    att_args_t a = {.beta = acc ? 1.0f : 0.0f,
                    .dqkv = dqkv,
                    .scratch = scratch,
                    .dout = dout,
                    .qkv = qkv,
                    .catt = att,
                    .B = B,
                    .T = T,
                    .C = C,
                    .NH = NH};
    ap__nn_par((size_t)B * NH, 1, 0, att_bwd_heads, &a);
}

/* ------------------------------------------------------------------------ */
/* softmax cross-entropy                                                     */
/* ------------------------------------------------------------------------ */

typedef struct xent_args {
    float *probs, *losses, *dlogits;
    const float *logits, *cprobs;
    const int32_t *targets;
    float dloss;
    int N, V;
} xent_args_t;

NN_SIMD static void xent_fwd_rows(void *arg, size_t r0, size_t r1)
{
    const xent_args_t *a = arg;
    const int V = a->V;
    for (size_t r = r0; r < r1; r++) {
        const float *l = a->logits + r * (size_t)V;
        float *p = a->probs + r * (size_t)V; /* may alias l */
        float mx = l[0];
        for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
        /* read the target logit before p (which may alias l) overwrites it */
        const bool want_loss = a->losses && a->targets;
        const float lt = want_loss ? l[a->targets[r]] : 0.0f;
        for (int v = 0; v < V; v++) p[v] = fast_expf(l[v] - mx);
        float sum = lane_sum(p, V), inv = 1.0f / sum;
        for (int v = 0; v < V; v++) p[v] *= inv;
        /* log-sum-exp form keeps the loss finite when p[target] underflows;
         * NaN anywhere in the row propagates through sum */
        if (want_loss) a->losses[r] = (mx - lt) + logf(sum);
    }
}

float ap_nn_xent_forward(float *probs, float *losses, const float *logits, const int32_t *targets,
                         int N, int V)
{
    xent_args_t a = {
        .probs = probs, .losses = losses, .logits = logits, .targets = targets, .N = N, .V = V};
    ap__nn_par((size_t)N, 8, 0, xent_fwd_rows, &a);
    if (!losses || !targets || N <= 0) return 0.0f;
    double s = 0.0;
    for (int r = 0; r < N; r++) s += losses[r];
    return (float)(s / N);
}

NN_SIMD static void xent_bwd_rows(void *arg, size_t r0, size_t r1)
{
    const xent_args_t *a = arg;
    const int V = a->V;
    const float dl = a->dloss;
    for (size_t r = r0; r < r1; r++) {
        const float *p = a->cprobs + r * (size_t)V;
        float *d = a->dlogits + r * (size_t)V; /* may alias p */
        for (int v = 0; v < V; v++) d[v] = p[v] * dl;
        d[a->targets[r]] -= a->dloss;
    }
}

void ap_nn_xent_backward(float *dlogits, const float *probs, const int32_t *targets, float dloss,
                         int N, int V)
{
    xent_args_t a = {
        .dlogits = dlogits, .cprobs = probs, .targets = targets, .dloss = dloss, .N = N, .V = V};
    ap__nn_par((size_t)N, 8, 0, xent_bwd_rows, &a);
}

/* ------------------------------------------------------------------------ */
/* dropout                                                                   */
/* ------------------------------------------------------------------------ */

__attribute__((always_inline)) static inline float keep_scale(uint64_t seed, size_t i, float p)
{
    uint64_t h = ap__nn_mix64(seed ^ ap__nn_mix64((uint64_t)i));
    float u = (float)(h >> 40) * (1.0f / 16777216.0f);
    return u >= p ? 1.0f / (1.0f - p) : 0.0f;
}

static void drop_fwd_range(void *arg, size_t i0, size_t i1)
{
    const ew_args_t *a = arg;
    for (size_t i = i0; i < i1; i++) a->out[i] = a->in[i] * keep_scale(a->seed, i, a->p);
}

void ap_nn_dropout_forward(float *out, const float *in, size_t n, float p, uint64_t seed)
{
    ew_args_t a = {.out = out, .in = in, .p = p, .seed = seed};
    ap__nn_par(n, 4096, 0, drop_fwd_range, &a);
}

static void drop_bwd_range(void *arg, size_t i0, size_t i1)
{
    const ew_args_t *a = arg;
    for (size_t i = i0; i < i1; i++) a->out[i] += a->dout[i] * keep_scale(a->seed, i, a->p);
}

void ap_nn_dropout_backward(float *din, const float *dout, size_t n, float p, uint64_t seed)
{
    ew_args_t a = {.out = din, .dout = dout, .p = p, .seed = seed};
    ap__nn_par(n, 4096, 0, drop_bwd_range, &a);
}
