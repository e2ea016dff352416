/* Model objects: the flat parameter arena with named views, and the parts
 * every model kind shares (free, init, zero_grad, accessors). */
#include "nn/nn_impl.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <stdlib.h>
#include <string.h>

int ap__nn_layout_add(ap__nn_layout_t *l, const char *name, int rows, int cols)
{
    if (strlen(name) >= AP_NN_NAME_MAX) return AP_EINVAL;
    if (l->nviews == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 32;
        ap_nn_view_t *v = realloc(l->views, cap * sizeof *v);
        if (!v) return AP_ENOMEM;
        l->views = v;
        l->cap = cap;
    }
    ap_nn_view_t *v = &l->views[l->nviews++];
    memset(v, 0, sizeof *v);
    strcpy(v->name, name);
    /* 16-float (64-byte) alignment for every view */
    v->offset = (l->count + 15) & ~(size_t)15;
    v->rows = rows;
    v->cols = cols;
    v->count = (size_t)rows * (size_t)cols;
    l->count = v->offset + v->count;
    return 0;
}

void ap__nn_layout_free(ap__nn_layout_t *l)
{
    free(l->views);
    memset(l, 0, sizeof *l);
}

int ap__nn_alloc_params(ap_nn_model_t *m)
{
    size_t n = (m->layout.count + 15) & ~(size_t)15;
    ap__arena_init(&m->pg);
    int rc;
    if ((rc = ap__arena_add(&m->pg, "params", n)) < 0) return rc;
    if ((rc = ap__arena_add(&m->pg, "grads", n)) < 0) return rc;
    if ((rc = ap__arena_commit(&m->pg)) < 0) return rc;
    m->params.data = ap__arena_ptr(&m->pg, 0);
    m->params.grad = ap__arena_ptr(&m->pg, 1);
    m->params.count = m->layout.count;
    m->params.views = m->layout.views;
    m->params.nviews = m->layout.nviews;
    return 0;
}

float *ap__nn_view_ptr(ap_nn_model_t *m, const char *name, bool grad)
{
    const ap_nn_view_t *v = ap_nn_params_find(&m->params, name);
    if (!v) return NULL;
    return (grad ? m->params.grad : m->params.data) + v->offset;
}

const ap_nn_view_t *ap_nn_params_find(const ap_nn_params_t *p, const char *name)
{
    if (!p || !name) return NULL;
    for (size_t i = 0; i < p->nviews; i++)
        if (strcmp(p->views[i].name, name) == 0) return &p->views[i];
    return NULL;
}

void ap_nn_model_free(ap_nn_model_t *m)
{
    if (!m) return;
    ap__arena_free(&m->pg);
    ap__arena_free(&m->acts);
    ap__arena_free(&m->scr);
    ap__nn_layout_free(&m->layout);
    free(m->blk);
    free(m->gblk);
    free(m->bacts);
    free(m);
}

ap_nn_kind_t ap_nn_model_kind(const ap_nn_model_t *m)
{
    return m->kind;
}
ap_nn_params_t *ap_nn_model_params(ap_nn_model_t *m)
{
    return &m->params;
}

int ap_nn_model_gpt_config(const ap_nn_model_t *m, ap_nn_gpt_config_t *cfg)
{
    if (m->kind != AP_NN_GPT) return AP_EINVAL;
    *cfg = m->cfg.gpt;
    return 0;
}

int ap_nn_model_mlp_config(const ap_nn_model_t *m, ap_nn_mlp_config_t *cfg)
{
    if (m->kind != AP_NN_MLP) return AP_EINVAL;
    *cfg = m->cfg.mlp;
    return 0;
}

static bool ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

void ap_nn_model_init(ap_nn_model_t *m, uint64_t seed)
{
    const ap_nn_params_t *p = &m->params;
    memset(p->data, 0, p->count * sizeof(float));
    for (size_t i = 0; i < p->nviews; i++) {
        const ap_nn_view_t *v = &p->views[i];
        float *w = p->data + v->offset;
        /* Seeded per view name: a pipeline stage initialised with the same
         * seed holds exactly the whole model's values for its layers. */
        ap__nn_rng_t r = {ap__nn_mix64(seed) ^ name_hash(v->name)};
        if (ends_with(v->name, ".b")) continue; /* biases 0 */
        if (strstr(v->name, "ln") && ends_with(v->name, ".w")) {
            for (size_t j = 0; j < v->count; j++) w[j] = 1.0f;
            continue;
        }
        if (m->kind == AP_NN_GPT) {
            float std = 0.02f;
            if (ends_with(v->name, "proj.w")) std /= sqrtf(2.0f * (float)m->cfg.gpt.n_layer);
            for (size_t j = 0; j < v->count; j++) w[j] = std * ap__nn_rng_normal(&r);
        } else {
            float bound = 1.0f / sqrtf((float)v->cols); /* torch.nn.Linear default range */
            for (size_t j = 0; j < v->count; j++)
                w[j] = bound * (2.0f * ap__nn_rng_unif(&r) - 1.0f);
        }
    }
}

static void zero_range(void *arg, size_t i0, size_t i1)
{
    memset((float *)arg + i0, 0, (i1 - i0) * sizeof(float));
}

void ap_nn_model_zero_grad(ap_nn_model_t *m)
{
    ap__nn_par(m->params.count, 1 << 16, 1, zero_range, m->params.grad);
}

void ap_nn_model_set_train(ap_nn_model_t *m, bool train, uint64_t seed)
{
    m->train = train;
    m->drop_seed = seed;
    m->drop_ctr = 0;
}

size_t ap_nn_model_bytes(const ap_nn_model_t *m, size_t *params_grads, size_t *activations,
                         size_t *scratch)
{
    size_t pg = m->pg.count * sizeof(float), a = m->acts.count * sizeof(float),
           s = m->scr.count * sizeof(float);
    if (params_grads) *params_grads = pg;
    if (activations) *activations = a;
    if (scratch) *scratch = s;
    return pg + a + s;
}

void ap_nn_model_shape(const ap_nn_model_t *m, uint32_t w[AP_NN_SHAPE_WORDS])
{
    ap__nn_config_words(m, w);
}

void ap__nn_config_words(const ap_nn_model_t *m, uint32_t w[16])
{
    memset(w, 0, 16 * sizeof *w);
    if (m->kind == AP_NN_GPT) {
        const ap_nn_gpt_config_t *c = &m->cfg.gpt;
        w[0] = (uint32_t)c->vocab;
        w[1] = (uint32_t)c->ctx;
        w[2] = (uint32_t)c->n_layer;
        w[3] = (uint32_t)c->n_head;
        w[4] = (uint32_t)c->n_embd;
        w[5] = c->share_layers;
        w[6] = (uint32_t)c->layer_begin;
        w[7] = (uint32_t)c->layer_end;
        w[8] = c->embed;
        w[9] = c->head;
    } else {
        const ap_nn_mlp_config_t *c = &m->cfg.mlp;
        w[0] = (uint32_t)c->in_dim;
        w[1] = (uint32_t)c->n_hidden;
        for (int i = 0; i < AP_NN_MLP_MAX_HIDDEN; i++) w[2 + i] = (uint32_t)c->hidden[i];
        w[10] = (uint32_t)c->n_classes;
    }
}
