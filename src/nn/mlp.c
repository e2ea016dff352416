/* MLP classifier: in_dim -> [linear, GELU] x n_hidden -> linear -> softmax CE. */
#include "nn/nn_impl.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int lin_in(const ap_nn_mlp_config_t *c, int i)
{
    return i == 0 ? c->in_dim : c->hidden[i - 1];
}
static int lin_out(const ap_nn_mlp_config_t *c, int i)
{
    return i == c->n_hidden ? c->n_classes : c->hidden[i];
}

int ap_nn_mlp_new(const ap_nn_mlp_config_t *cfg, ap_nn_model_t **out)
{
    *out = NULL;
    const ap_nn_mlp_config_t *c = cfg;
    bool ok = c->in_dim >= 1 && c->in_dim <= (1 << 20) && c->n_hidden >= 0 &&
              c->n_hidden <= AP_NN_MLP_MAX_HIDDEN && c->n_classes >= 2 &&
              c->n_classes <= (1 << 20) && c->max_batch >= 1 && c->max_batch <= (1 << 20);
    for (int i = 0; ok && i < c->n_hidden; i++) ok = c->hidden[i] >= 1 && c->hidden[i] <= (1 << 16);
    if (!ok) {
        ap_warn(NN_LOG, "mlp config: in_dim %d, n_hidden %d, n_classes %d, max_batch %d invalid",
                c->in_dim, c->n_hidden, c->n_classes, c->max_batch);
        return AP_EINVAL;
    }
    ap__nn_blas_init();
    ap_nn_model_t *m = calloc(1, sizeof *m);
    if (!m) return AP_ENOMEM;
    m->kind = AP_NN_MLP;
    m->cfg.mlp = *c;
    for (int i = c->n_hidden; i < AP_NN_MLP_MAX_HIDDEN; i++) m->cfg.mlp.hidden[i] = 0;
    c = &m->cfg.mlp;
    ap__arena_init(&m->acts);
    ap__arena_init(&m->scr);
    m->nlin = c->n_hidden + 1;
    int rc = 0;
    char name[AP_NN_NAME_MAX];
    for (int i = 0; i < m->nlin && !rc; i++) {
        snprintf(name, sizeof name, "l%d.w", i);
        rc = ap__nn_layout_add(&m->layout, name, lin_out(c, i), lin_in(c, i));
        snprintf(name, sizeof name, "l%d.b", i);
        if (!rc) rc = ap__nn_layout_add(&m->layout, name, lin_out(c, i), 1);
    }
    if (rc || (rc = ap__nn_alloc_params(m))) goto fail;
    for (int i = 0; i < m->nlin; i++) {
        snprintf(name, sizeof name, "l%d.w", i);
        m->mw[i] = ap__nn_view_ptr(m, name, false);
        m->gmw[i] = ap__nn_view_ptr(m, name, true);
        snprintf(name, sizeof name, "l%d.b", i);
        m->mb[i] = ap__nn_view_ptr(m, name, false);
        m->gmb[i] = ap__nn_view_ptr(m, name, true);
    }
    size_t B = (size_t)c->max_batch, maxw = (size_t)c->n_classes;
    int vx = ap__arena_add(&m->acts, "x", B * (size_t)c->in_dim), vpre[AP_NN_MLP_MAX_HIDDEN],
        vpost[AP_NN_MLP_MAX_HIDDEN];
    for (int i = 0; i < c->n_hidden; i++) {
        vpre[i] = ap__arena_add(&m->acts, "pre", B * (size_t)c->hidden[i]);
        vpost[i] = ap__arena_add(&m->acts, "post", B * (size_t)c->hidden[i]);
        if ((size_t)c->hidden[i] > maxw) maxw = (size_t)c->hidden[i];
    }
    int vl = ap__arena_add(&m->acts, "logits", B * (size_t)c->n_classes);
    int vloss = ap__arena_add(&m->acts, "losses", B);
    int vlab = ap__arena_add(&m->acts, "labels", B);
    if (vx < 0 || vl < 0 || vloss < 0 || vlab < 0 || (rc = ap__arena_commit(&m->acts))) {
        rc = rc ? rc : AP_ENOMEM;
        goto fail;
    }
    m->mx = ap__arena_ptr(&m->acts, vx);
    for (int i = 0; i < c->n_hidden; i++) {
        m->mpre[i] = ap__arena_ptr(&m->acts, vpre[i]);
        m->mpost[i] = ap__arena_ptr(&m->acts, vpost[i]);
    }
    m->mlogits = ap__arena_ptr(&m->acts, vl);
    m->mlosses = ap__arena_ptr(&m->acts, vloss);
    m->mlabels = (int32_t *)ap__arena_ptr(&m->acts, vlab);
    int va = ap__arena_add(&m->scr, "da", B * maxw), vb = ap__arena_add(&m->scr, "db", B * maxw);
    if (va < 0 || vb < 0 || (rc = ap__arena_commit(&m->scr))) {
        rc = rc ? rc : AP_ENOMEM;
        goto fail;
    }
    m->mda = ap__arena_ptr(&m->scr, va);
    m->mdb = ap__arena_ptr(&m->scr, vb);
    *out = m;
    return 0;
fail:
    ap_nn_model_free(m);
    return rc;
}

int ap_nn_mlp_forward(ap_nn_model_t *m, const float *x, const int32_t *labels, int B, float *loss)
{
    if (!m || m->kind != AP_NN_MLP || !x) return AP_EINVAL;
    const ap_nn_mlp_config_t *c = &m->cfg.mlp;
    m->fwd_B = 0;
    m->fwd_loss = false;
    if (B < 1 || B > c->max_batch) {
        ap_warn(NN_LOG, "mlp: batch %d not in [1, %d]", B, c->max_batch);
        return AP_EINVAL;
    }
    if (labels)
        for (int i = 0; i < B; i++)
            if (labels[i] < 0 || labels[i] >= c->n_classes) {
                ap_warn(NN_LOG, "mlp: label[%d] = %d not in [0, %d)", i, (int)labels[i],
                        c->n_classes);
                return AP_EINVAL;
            }
    memcpy(m->mx, x, sizeof(float) * (size_t)B * c->in_dim);
    const float *h = m->mx;
    for (int i = 0; i < c->n_hidden; i++) {
        ap_nn_linear_forward(m->mpre[i], h, m->mw[i], m->mb[i], B, lin_in(c, i), lin_out(c, i));
        ap_nn_gelu_forward(m->mpost[i], m->mpre[i], (size_t)B * c->hidden[i]);
        h = m->mpost[i];
    }
    int L = c->n_hidden;
    ap_nn_linear_forward(m->mlogits, h, m->mw[L], m->mb[L], B, lin_in(c, L), c->n_classes);
    m->fwd_B = B;
    if (!labels) {
        ap_nn_xent_forward(m->mlogits, NULL, m->mlogits, NULL, B, c->n_classes);
        return 0;
    }
    memcpy(m->mlabels, labels, sizeof(int32_t) * (size_t)B);
    float l = ap_nn_xent_forward(m->mlogits, m->mlosses, m->mlogits, m->mlabels, B, c->n_classes);
    if (loss) *loss = l;
    if (!isfinite(l)) {
        ap_warn(NN_LOG, "mlp: non-finite loss %g", (double)l);
        m->fwd_B = 0;
        return AP_ENONFINITE;
    }
    m->fwd_loss = true;
    return 0;
}

int ap_nn_mlp_backward(ap_nn_model_t *m)
{
    if (!m || m->kind != AP_NN_MLP) return AP_EINVAL;
    if (!m->fwd_B || !m->fwd_loss) {
        ap_warn(NN_LOG, "mlp: backward without a forward with labels");
        return AP_ESTATE;
    }
    const ap_nn_mlp_config_t *c = &m->cfg.mlp;
    const int B = m->fwd_B;
    ap_nn_xent_backward(m->mlogits, m->mlogits, m->mlabels, 1.0f / (float)B, B, c->n_classes);
    m->fwd_loss = false;
    const float *d = m->mlogits; /* (B, out of layer i) */
    for (int i = c->n_hidden; i >= 0; i--) {
        const float *in = i ? m->mpost[i - 1] : m->mx;
        int fi = lin_in(c, i), fo = lin_out(c, i);
        if (i == 0) {
            ap_nn_linear_backward(NULL, m->gmw[0], m->gmb[0], d, in, m->mw[0], B, fi, fo);
            break;
        }
        memset(m->mda, 0, sizeof(float) * (size_t)B * fi);
        ap_nn_linear_backward(m->mda, m->gmw[i], m->gmb[i], d, in, m->mw[i], B, fi, fo);
        memset(m->mdb, 0, sizeof(float) * (size_t)B * fi);
        ap_nn_gelu_backward(m->mdb, m->mpre[i - 1], m->mda, (size_t)B * fi);
        d = m->mdb;
    }
    return 0;
}

const float *ap_nn_mlp_probs(const ap_nn_model_t *m)
{
    if (!m || m->kind != AP_NN_MLP || !m->fwd_B) return NULL;
    return m->mlogits;
}
