/* GPT-style byte-level language model (GPT-2 block layout), buildable as a
 * whole model or as one pipeline stage. reference: Radford et al. 2019,
 * "Language Models are Unsupervised Multitask Learners" (pre-LN blocks). */
#include "nn/nn_impl.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ap_nn_gpt_config_t ap_nn_gpt_config_default(int ctx, int n_layer, int n_head, int n_embd,
                                            int max_batch)
{
    ap_nn_gpt_config_t c = {.vocab = 256,
                            .ctx = ctx,
                            .n_layer = n_layer,
                            .n_head = n_head,
                            .n_embd = n_embd,
                            .max_batch = max_batch,
                            .layer_begin = 0,
                            .layer_end = n_layer,
                            .embed = true,
                            .head = true};
    return c;
}

static int check_config(const ap_nn_gpt_config_t *c)
{
#define BAD(...)                                                                                   \
    do {                                                                                           \
        ap_warn(NN_LOG, "gpt config: " __VA_ARGS__);                                               \
        return AP_EINVAL;                                                                          \
    } while (0)
    if (c->vocab < 2 || c->vocab > 65536) BAD("vocab %d not in [2, 65536]", c->vocab);
    if (c->ctx < 1 || c->ctx > 8192) BAD("ctx %d not in [1, 8192]", c->ctx);
    if (c->n_layer < 1 || c->n_layer > NN_MAX_LAYERS) BAD("n_layer %d not in [1, 256]", c->n_layer);
    if (c->n_head < 1 || c->n_embd < 1 || c->n_embd > 16384 || c->n_embd % c->n_head)
        BAD("n_embd %d must be a multiple of n_head %d (<= 16384)", c->n_embd, c->n_head);
    if (c->max_batch < 1 || c->max_batch > 65536) BAD("max_batch %d out of range", c->max_batch);
    if (!(c->dropout >= 0.0f && c->dropout < 1.0f)) BAD("dropout %g not in [0, 1)", c->dropout);
    if (c->layer_begin < 0 || c->layer_begin > c->layer_end || c->layer_end > c->n_layer)
        BAD("stage layers [%d, %d) not within [0, %d]", c->layer_begin, c->layer_end, c->n_layer);
    if (c->embed && c->layer_begin != 0) BAD("an embedding stage must start at layer 0");
    if (c->head && c->layer_end != c->n_layer) BAD("a head stage must end at the last layer");
    if (!c->embed && !c->head && c->layer_begin == c->layer_end) BAD("empty stage");
    double acts = (double)c->max_batch * c->ctx * ((double)c->n_embd * 20 + c->vocab) +
                  (double)c->max_batch * c->n_head * c->ctx * c->ctx;
    if (acts * (c->layer_end - c->layer_begin + 1) > 1e11) BAD("activations would exceed 400 GB");
    return 0;
#undef BAD
}

static const char *blk_names[12] = {"ln1.w",       "ln1.b",       "attn.qkv.w", "attn.qkv.b",
                                    "attn.proj.w", "attn.proj.b", "ln2.w",      "ln2.b",
                                    "mlp.fc.w",    "mlp.fc.b",    "mlp.proj.w", "mlp.proj.b"};

static void blk_shapes(int C, int rows[12], int cols[12])
{
    int r[12] = {C, C, 3 * C, 3 * C, C, C, C, C, 4 * C, 4 * C, C, C};
    int k[12] = {1, 1, C, 1, C, 1, 1, 1, C, 1, 4 * C, 1};
    memcpy(rows, r, sizeof r);
    memcpy(cols, k, sizeof k);
}

static void blk_prefix(const ap_nn_gpt_config_t *c, int layer, char *buf, size_t n)
{
    if (c->share_layers)
        snprintf(buf, n, "h");
    else
        snprintf(buf, n, "h%d", layer);
}

static int build_layout(ap__nn_layout_t *l, const ap_nn_gpt_config_t *c)
{
    int rc = 0, C = c->n_embd, rows[12], cols[12];
    blk_shapes(C, rows, cols);
    if (c->embed) {
        if ((rc = ap__nn_layout_add(l, "wte", c->vocab, C))) return rc;
        if ((rc = ap__nn_layout_add(l, "wpe", c->ctx, C))) return rc;
    }
    int nsets = c->share_layers ? (c->layer_end > c->layer_begin) : c->layer_end - c->layer_begin;
    for (int s = 0; s < nsets; s++) {
        char pre[16], name[AP_NN_NAME_MAX];
        blk_prefix(c, c->layer_begin + s, pre, sizeof pre);
        for (int i = 0; i < 12; i++) {
            snprintf(name, sizeof name, "%s.%s", pre, blk_names[i]);
            if ((rc = ap__nn_layout_add(l, name, rows[i], cols[i]))) return rc;
        }
    }
    if (c->head) {
        if ((rc = ap__nn_layout_add(l, "lnf.w", C, 1))) return rc;
        if ((rc = ap__nn_layout_add(l, "lnf.b", C, 1))) return rc;
        if ((rc = ap__nn_layout_add(l, "lm_head.w", c->vocab, C))) return rc;
    }
    return 0;
}

size_t ap_nn_gpt_param_count(const ap_nn_gpt_config_t *cfg)
{
    ap__nn_layout_t l = {0};
    size_t n = 0;
    if (check_config(cfg) == 0 && build_layout(&l, cfg) == 0) {
        for (size_t i = 0; i < l.nviews; i++) n += l.views[i].count;
    }
    ap__nn_layout_free(&l);
    return n;
}

static void set_blk_ptrs(ap_nn_model_t *m, int s, bool grad, gpt_block_ptrs_t *p)
{
    char pre[16], name[AP_NN_NAME_MAX];
    blk_prefix(&m->cfg.gpt, m->cfg.gpt.layer_begin + s, pre, sizeof pre);
    float **f = (float **)p;
    for (int i = 0; i < 12; i++) {
        snprintf(name, sizeof name, "%s.%s", pre, blk_names[i]);
        f[i] = ap__nn_view_ptr(m, name, grad);
    }
}

/* Declares the activation or scratch views; idx fills pointers after commit. */
typedef struct slot {
    float **dst;
    int view;
} slot_t;

typedef struct slots {
    slot_t *s;
    size_t n, cap;
    int err;
} slots_t;

static void want(slots_t *ss, ap_arena_t *a, const char *name, size_t count, float **dst)
{
    if (ss->err) return;
    if (ss->n == ss->cap) {
        size_t cap = ss->cap ? ss->cap * 2 : 64;
        slot_t *s = realloc(ss->s, cap * sizeof *s);
        if (!s) {
            ss->err = AP_ENOMEM;
            return;
        }
        ss->s = s;
        ss->cap = cap;
    }
    int v = ap__arena_add(a, name, count);
    if (v < 0) {
        ss->err = v;
        return;
    }
    ss->s[ss->n++] = (slot_t){dst, v};
}

static int commit(slots_t *ss, ap_arena_t *a)
{
    int rc = ss->err;
    if (!rc) rc = ap__arena_commit(a);
    if (!rc)
        for (size_t i = 0; i < ss->n; i++) *ss->s[i].dst = ap__arena_ptr(a, ss->s[i].view);
    free(ss->s);
    memset(ss, 0, sizeof *ss);
    return rc;
}

int ap_nn_gpt_new(const ap_nn_gpt_config_t *cfg, ap_nn_model_t **out)
{
    *out = NULL;
    int rc = check_config(cfg);
    if (rc) return rc;
    ap__nn_blas_init();
    ap_nn_model_t *m = calloc(1, sizeof *m);
    if (!m) return AP_ENOMEM;
    m->kind = AP_NN_GPT;
    m->cfg.gpt = *cfg;
    ap__arena_init(&m->acts);
    ap__arena_init(&m->scr);
    const ap_nn_gpt_config_t *c = &m->cfg.gpt;
    if ((rc = build_layout(&m->layout, c)) || (rc = ap__nn_alloc_params(m))) goto fail;
    m->nblk = c->layer_end - c->layer_begin;
    if (m->nblk > 0) {
        m->blk = calloc((size_t)m->nblk, sizeof *m->blk);
        m->gblk = calloc((size_t)m->nblk, sizeof *m->gblk);
        m->bacts = calloc((size_t)m->nblk, sizeof *m->bacts);
        if (!m->blk || !m->gblk || !m->bacts) {
            rc = AP_ENOMEM;
            goto fail;
        }
        for (int s = 0; s < m->nblk; s++) {
            set_blk_ptrs(m, s, false, &m->blk[s]);
            set_blk_ptrs(m, s, true, &m->gblk[s]);
        }
    }
    if (c->embed) {
        m->wte = ap__nn_view_ptr(m, "wte", false);
        m->wpe = ap__nn_view_ptr(m, "wpe", false);
        m->gwte = ap__nn_view_ptr(m, "wte", true);
        m->gwpe = ap__nn_view_ptr(m, "wpe", true);
    }
    if (c->head) {
        m->lnfw = ap__nn_view_ptr(m, "lnf.w", false);
        m->lnfb = ap__nn_view_ptr(m, "lnf.b", false);
        m->lmw = ap__nn_view_ptr(m, "lm_head.w", false);
        m->glnfw = ap__nn_view_ptr(m, "lnf.w", true);
        m->glnfb = ap__nn_view_ptr(m, "lnf.b", true);
        m->glmw = ap__nn_view_ptr(m, "lm_head.w", true);
    }

    /* activations, sized once for (max_batch, ctx) */
    const size_t B = (size_t)c->max_batch, T = (size_t)c->ctx, C = (size_t)c->n_embd,
                 NH = (size_t)c->n_head, V = (size_t)c->vocab;
    const size_t BT = B * T, BTC = BT * C;
    slots_t ss = {0};
    want(&ss, &m->acts, "encoded", BTC, &m->encoded);
    want(&ss, &m->acts, "tokens", BT, (float **)&m->tokens);
    want(&ss, &m->acts, "targets", BT, (float **)&m->targets);
    for (int s = 0; s < m->nblk; s++) {
        gpt_block_acts_t *a = &m->bacts[s];
        char n[AP_ARENA_NAME_MAX];
#define ACT(field, count)                                                                          \
    snprintf(n, sizeof n, "b%d." #field, s);                                                       \
    want(&ss, &m->acts, n, count, &a->field)
        ACT(ln1, BTC);
        ACT(ln1_mean, BT);
        ACT(ln1_rstd, BT);
        ACT(qkv, 3 * BTC);
        ACT(att, B * NH * T * T);
        ACT(atty, BTC);
        ACT(res2, BTC);
        ACT(ln2, BTC);
        ACT(ln2_mean, BT);
        ACT(ln2_rstd, BT);
        ACT(fch, 4 * BTC);
        ACT(fch_gelu, 4 * BTC);
        ACT(res3, BTC);
#undef ACT
    }
    if (c->head) {
        want(&ss, &m->acts, "lnf", BTC, &m->lnf);
        want(&ss, &m->acts, "lnf_mean", BT, &m->lnf_mean);
        want(&ss, &m->acts, "lnf_rstd", BT, &m->lnf_rstd);
        want(&ss, &m->acts, "probs", BT * V, &m->probs);
        want(&ss, &m->acts, "losses", BT, &m->losses);
    }
    if ((rc = commit(&ss, &m->acts))) goto fail;
    /* backward scratch, shared by all blocks */
    want(&ss, &m->scr, "d_res", BTC, &m->d_res);
    want(&ss, &m->scr, "d_tmp", BTC, &m->d_tmp);
    if (m->nblk > 0) {
        want(&ss, &m->scr, "d_ln", BTC, &m->d_ln);
        want(&ss, &m->scr, "d_h4a", 4 * BTC, &m->d_h4a);
        want(&ss, &m->scr, "d_h4b", 4 * BTC, &m->d_h4b);
        want(&ss, &m->scr, "d_att", B * NH * T * T, &m->d_att);
    }
    if ((rc = commit(&ss, &m->scr))) goto fail;
    *out = m;
    return 0;
fail:
    if (rc == AP_ENOMEM) ap_warn(NN_LOG, "gpt: out of memory allocating the model");
    ap_nn_model_free(m);
    return rc;
}

typedef struct add_args {
    float *y;
    const float *x;
} add_args_t;

NN_SIMD static void add_range(void *arg, size_t i0, size_t i1)
{
    const add_args_t *a = arg;
    float *restrict y = a->y;
    const float *restrict x = a->x;
    for (size_t i = i0; i < i1; i++) y[i] += x[i];
}

/* y (n) += x (n) */
static void vec_add(float *y, const float *x, size_t n)
{
    add_args_t a = {y, x};
    ap__nn_par(n, 8192, 0, add_range, &a);
}

static uint64_t site_seed(const ap_nn_model_t *m, int layer, int site)
{
    return ap__nn_mix64(m->cur_drop ^ ap__nn_mix64((uint64_t)layer * 2 + (uint64_t)site + 1));
}

static int check_tokens(const int32_t *t, size_t n, int V, const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (t[i] < 0 || t[i] >= V) {
            ap_warn(NN_LOG, "gpt: %s[%zu] = %d is not in [0, %d)", what, i, (int)t[i], V);
            return AP_EINVAL;
        }
    return 0;
}

int ap_nn_gpt_forward(ap_nn_model_t *m, ap_nn_gpt_io_t *io)
{
    if (!m || !io || m->kind != AP_NN_GPT) return AP_EINVAL;
    const ap_nn_gpt_config_t *c = &m->cfg.gpt;
    const int B = io->B, T = io->T, C = c->n_embd, NH = c->n_head, V = c->vocab;
    m->fwd_B = m->fwd_T = 0;
    m->fwd_loss = false;
    if (B < 1 || B > c->max_batch || T < 1 || T > c->ctx) {
        ap_warn(NN_LOG, "gpt: batch (%d, %d) exceeds (%d, %d)", B, T, c->max_batch, c->ctx);
        return AP_EINVAL;
    }
    if ((c->embed && !io->tokens) || (!c->embed && !io->in) || (!c->head && !io->out)) {
        ap_warn(NN_LOG, "gpt: stage needs %s", c->embed ? "tokens" : !io->in ? "in" : "out");
        return AP_EINVAL;
    }
    const size_t N = (size_t)B * T, NC = N * (size_t)C;
    int rc;
    float *x = m->encoded;
    if (c->embed) {
        if ((rc = check_tokens(io->tokens, N, V, "tokens"))) return rc;
        memcpy(m->tokens, io->tokens, N * sizeof(int32_t));
        ap_nn_embed_forward(x, m->tokens, m->wte, m->wpe, B, T, C);
    } else {
        memcpy(x, io->in, NC * sizeof(float));
    }
    const bool drop = m->train && c->dropout > 0.0f;
    if (drop) m->cur_drop = ap__nn_mix64(m->drop_seed ^ ap__nn_mix64(++m->drop_ctr));
    for (int s = 0; s < m->nblk; s++) {
        const gpt_block_ptrs_t *P = &m->blk[s];
        gpt_block_acts_t *A = &m->bacts[s];
        ap_nn_layernorm_forward(A->ln1, A->ln1_mean, A->ln1_rstd, x, P->ln1w, P->ln1b, (int)N, C);
        ap_nn_linear_forward(A->qkv, A->ln1, P->qkvw, P->qkvb, (int)N, C, 3 * C);
        ap_nn_attention_forward(A->atty, A->att, A->qkv, B, T, C, NH);
        ap_nn_linear_forward(A->res2, A->atty, P->projw, P->projb, (int)N, C, C);
        if (drop) ap_nn_dropout_forward(A->res2, A->res2, NC, c->dropout, site_seed(m, s, 0));
        vec_add(A->res2, x, NC);
        ap_nn_layernorm_forward(A->ln2, A->ln2_mean, A->ln2_rstd, A->res2, P->ln2w, P->ln2b, (int)N,
                                C);
        ap_nn_linear_forward(A->fch, A->ln2, P->fcw, P->fcb, (int)N, C, 4 * C);
        ap_nn_gelu_forward(A->fch_gelu, A->fch, 4 * NC);
        ap_nn_linear_forward(A->res3, A->fch_gelu, P->fcprojw, P->fcprojb, (int)N, 4 * C, C);
        if (drop) ap_nn_dropout_forward(A->res3, A->res3, NC, c->dropout, site_seed(m, s, 1));
        vec_add(A->res3, A->res2, NC);
        x = A->res3;
    }
    m->fwd_B = B;
    m->fwd_T = T;
    if (!c->head) {
        memcpy(io->out, x, NC * sizeof(float));
        return 0;
    }
    ap_nn_layernorm_forward(m->lnf, m->lnf_mean, m->lnf_rstd, x, m->lnfw, m->lnfb, (int)N, C);
    ap_nn_linear_forward(m->probs, m->lnf, m->lmw, NULL, (int)N, C, V); /* logits */
    if (!io->targets) {
        ap_nn_xent_forward(m->probs, NULL, m->probs, NULL, (int)N, V);
        return 0;
    }
    if ((rc = check_tokens(io->targets, N, V, "targets"))) {
        m->fwd_B = m->fwd_T = 0;
        return rc;
    }
    memcpy(m->targets, io->targets, N * sizeof(int32_t));
    io->loss = ap_nn_xent_forward(m->probs, m->losses, m->probs, m->targets, (int)N, V);
    if (!isfinite(io->loss)) {
        ap_warn(NN_LOG, "gpt: non-finite loss %g (diverged parameters or learning rate too high)",
                (double)io->loss);
        m->fwd_B = m->fwd_T = 0;
        return AP_ENONFINITE;
    }
    m->fwd_loss = true;
    return 0;
}

/* Gradient through a residual-dropout site: dout itself when dropout is
 * off, else dst = dropout_backward(dout). */
static const float *drop_bwd(ap_nn_model_t *m, float *dst, const float *dout, size_t n, bool drop,
                             int s, int site)
{
    if (!drop) return dout;
    memset(dst, 0, n * sizeof(float));
    ap_nn_dropout_backward(dst, dout, n, m->cfg.gpt.dropout, site_seed(m, s, site));
    return dst;
}

int ap_nn_gpt_backward(ap_nn_model_t *m, const float *dout, float *din)
{
    if (!m || m->kind != AP_NN_GPT) return AP_EINVAL;
    const ap_nn_gpt_config_t *c = &m->cfg.gpt;
    if (!m->fwd_B || (c->head && !m->fwd_loss)) {
        ap_warn(NN_LOG, "gpt: backward without a matching forward%s",
                c->head ? " with targets" : "");
        return AP_ESTATE;
    }
    if (!c->head && !dout) return AP_EINVAL;
    const int B = m->fwd_B, T = m->fwd_T, C = c->n_embd, NH = c->n_head, V = c->vocab;
    const int N = B * T;
    const size_t NC = (size_t)N * C;
    const bool drop = m->train && c->dropout > 0.0f;
    float *G = m->d_res;
    const float *xlast = m->nblk ? m->bacts[m->nblk - 1].res3 : m->encoded;
    if (c->head) {
        /* dlogits overwrite the probabilities in place */
        ap_nn_xent_backward(m->probs, m->probs, m->targets, 1.0f / (float)N, N, V);
        ap__nn_linear_backward_ex(m->d_tmp, m->glmw, NULL, m->probs, m->lnf, m->lmw, N, C, V,
                                  false);
        memset(G, 0, NC * sizeof(float));
        ap_nn_layernorm_backward(G, m->glnfw, m->glnfb, m->d_tmp, xlast, m->lnfw, m->lnf_mean,
                                 m->lnf_rstd, N, C);
        m->fwd_loss = false; /* probs are gone */
    } else {
        memcpy(G, dout, NC * sizeof(float));
    }
    for (int s = m->nblk - 1; s >= 0; s--) {
        const gpt_block_ptrs_t *P = &m->blk[s], *GP = &m->gblk[s];
        const gpt_block_acts_t *A = &m->bacts[s];
        const float *xin = s ? m->bacts[s - 1].res3 : m->encoded;
        /* res3 = res2 + drop(fcproj(gelu(fc(ln2(res2))))) */
        const float *dproj = drop_bwd(m, m->d_tmp, G, NC, drop, s, 1);
        ap__nn_linear_backward_ex(m->d_h4a, GP->fcprojw, GP->fcprojb, dproj, A->fch_gelu,
                                  P->fcprojw, N, 4 * C, C, false);
        ap__nn_gelu_backward_ex(m->d_h4b, A->fch, m->d_h4a, 4 * NC, false);
        ap__nn_linear_backward_ex(m->d_ln, GP->fcw, GP->fcb, m->d_h4b, A->ln2, P->fcw, N, C, 4 * C,
                                  false);
        ap_nn_layernorm_backward(G, GP->ln2w, GP->ln2b, m->d_ln, A->res2, P->ln2w, A->ln2_mean,
                                 A->ln2_rstd, N, C);
        /* res2 = x + drop(proj(attn(qkv(ln1(x))))) */
        dproj = drop_bwd(m, m->d_tmp, G, NC, drop, s, 0);
        float *datty = m->d_ln, *dqkv = m->d_h4a, *dln1 = m->d_h4b;
        ap__nn_linear_backward_ex(datty, GP->projw, GP->projb, dproj, A->atty, P->projw, N, C, C,
                                  false);
        ap__nn_attention_backward_ex(dqkv, m->d_att, datty, A->qkv, A->att, B, T, C, NH, false);
        ap__nn_linear_backward_ex(dln1, GP->qkvw, GP->qkvb, dqkv, A->ln1, P->qkvw, N, C, 3 * C,
                                  false);
        ap_nn_layernorm_backward(G, GP->ln1w, GP->ln1b, dln1, xin, P->ln1w, A->ln1_mean,
                                 A->ln1_rstd, N, C);
    }
    if (c->embed) ap_nn_embed_backward(m->gwte, m->gwpe, G, m->tokens, B, T, C);
    if (din) memcpy(din, G, NC * sizeof(float));
    return 0;
}

int ap_nn_gpt_loss(ap_nn_model_t *m, const int32_t *tokens, const int32_t *targets, int B, int T,
                   float *loss)
{
    ap_nn_gpt_io_t io = {.B = B, .T = T, .tokens = tokens, .targets = targets};
    int rc = ap_nn_gpt_forward(m, &io);
    if (loss) *loss = io.loss;
    return rc;
}

const float *ap_nn_gpt_probs(const ap_nn_model_t *m)
{
    if (!m || m->kind != AP_NN_GPT || !m->cfg.gpt.head || !m->fwd_B) return NULL;
    return m->probs;
}

int ap_nn_gpt_generate(ap_nn_model_t *m, const uint8_t *prompt, int len, uint8_t *out, int n,
                       float temperature, uint64_t seed)
{
    if (!m || m->kind != AP_NN_GPT || !m->cfg.gpt.embed || !m->cfg.gpt.head || len < 1 || n < 0 ||
        !(temperature > 0.0f) || m->cfg.gpt.vocab > 256)
        return AP_EINVAL;
    const int ctx = m->cfg.gpt.ctx, V = m->cfg.gpt.vocab;
    int32_t *win = malloc(sizeof(int32_t) * (size_t)ctx);
    double *p = malloc(sizeof(double) * (size_t)V);
    if (!win || !p) {
        free(win);
        free(p);
        return AP_ENOMEM;
    }
    bool train = m->train;
    m->train = false;
    ap__nn_rng_t r = {ap__nn_mix64(seed)};
    int rc = 0;
    for (int i = 0; i < n; i++) {
        /* window = the last ctx bytes of prompt + out[0..i) */
        int total = len + i, T = total < ctx ? total : ctx;
        for (int t = 0; t < T; t++) {
            int k = total - T + t;
            win[t] = k < len ? prompt[k] : out[k - len];
        }
        ap_nn_gpt_io_t io = {.B = 1, .T = T, .tokens = win};
        if ((rc = ap_nn_gpt_forward(m, &io))) break;
        const float *pr = m->probs + (size_t)(T - 1) * V;
        double sum = 0.0;
        for (int v = 0; v < V; v++) {
            p[v] = pow((double)pr[v] + 1e-30, 1.0 / temperature);
            sum += p[v];
        }
        double u = (double)ap__nn_rng_unif(&r) * sum, acc = 0.0;
        int pick = V - 1;
        for (int v = 0; v < V; v++) {
            acc += p[v];
            if (u < acc) {
                pick = v;
                break;
            }
        }
        out[i] = (uint8_t)pick;
    }
    m->train = train;
    free(win);
    free(p);
    return rc;
}
