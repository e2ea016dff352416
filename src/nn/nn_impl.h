/* Model kit internals shared by the src/nn files. */
#ifndef AP_NN_IMPL_H
#define AP_NN_IMPL_H

#include "apiary/nn.h"
#include "base/arena.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define NN_LOG "nn"

/* ---- deterministic random numbers (no global state) ---- */
static inline uint64_t ap__nn_mix64(uint64_t z)
{
    /* splitmix64 finaliser */
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct ap__nn_rng {
    uint64_t s;
} ap__nn_rng_t;

static inline uint64_t ap__nn_rng_u64(ap__nn_rng_t *r)
{
    r->s += 0x9e3779b97f4a7c15ull;
    uint64_t z = r->s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* uniform in [0,1) with 24 bits */
static inline float ap__nn_rng_unif(ap__nn_rng_t *r)
{
    return (float)(ap__nn_rng_u64(r) >> 40) * (1.0f / 16777216.0f);
}
/* standard normal (Box-Muller, one value per call) */
static inline float ap__nn_rng_normal(ap__nn_rng_t *r)
{
    double u1 = ((double)(ap__nn_rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = (double)(ap__nn_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* Hot element-wise loops are compiled for AVX-512F, AVX2 and the
 * baseline, picked at load time by CPU feature (not model: "arch=" clones
 * only match that exact CPU model) via GCC function multi-versioning; the Debian
 * build targets baseline x86-64). Other compilers get the baseline. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(APIARY_SANITIZED)
#define NN_SIMD __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define NN_SIMD
#endif

/* sqrt(x) for x >= 0 without the errno path GCC attaches to sqrtf (which
 * keeps loops scalar; `#pragma GCC optimize("no-math-errno")` does not
 * remove it): a bit-level 1/sqrt estimate refined by three Newton steps
 * (relative error < 1e-7 after the third), times x. sqrt(0) = 0. */
__attribute__((always_inline)) static inline float ap__nn_sqrtf(float x)
{
    int32_t i;
    memcpy(&i, &x, 4);
    i = 0x5f3759df - (i >> 1);
    float y;
    memcpy(&y, &i, 4);
    float hx = 0.5f * x;
    y = y * (1.5f - hx * y * y);
    y = y * (1.5f - hx * y * y);
    y = y * (1.5f - hx * y * y);
    return x * y;
}

/* ---- threading ---- */
/* Sets OpenBLAS to one thread per call (once per process). */
void ap__nn_blas_init(void);
/* parallel_for over [0,n) on the global pool with chunks of at least
 * min_grain and at most one chunk per thread when balanced = true. */
void ap__nn_par(size_t n, size_t min_grain, int balanced, void (*fn)(void *arg, size_t b, size_t e),
                void *arg);

/* ---- kernel variants: acc = false overwrites the input gradient instead
 * of accumulating (saves zeroing scratch buffers) ---- */
void ap__nn_linear_backward_ex(float *din, float *dw, float *db, const float *dout, const float *in,
                               const float *w, int N, int C, int OC, bool acc);
void ap__nn_gelu_backward_ex(float *din, const float *in, const float *dout, size_t n, bool acc);
void ap__nn_attention_backward_ex(float *dqkv, float *scratch, const float *dout, const float *qkv,
                                  const float *att, int B, int T, int C, int NH, bool acc);
float ap__nn_expf(float x);

/* ---- params arena ---- */
typedef struct ap__nn_layout {
    ap_nn_view_t *views;
    size_t nviews, cap;
    size_t count;
} ap__nn_layout_t;

int ap__nn_layout_add(ap__nn_layout_t *l, const char *name, int rows, int cols);
void ap__nn_layout_free(ap__nn_layout_t *l);

/* ---- the model object ---- */
#define NN_MAX_LAYERS 256

typedef struct gpt_block_ptrs {
    float *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
} gpt_block_ptrs_t;

typedef struct gpt_block_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (B,T,C), (B,T), (B,T) */
    float *qkv;                       /* (B,T,3C) */
    float *att;                       /* (B,NH,T,T) */
    float *atty;                      /* (B,T,C) */
    float *res2;                      /* (B,T,C) x + drop(proj(atty)) */
    float *ln2, *ln2_mean, *ln2_rstd; /* (B,T,C), (B,T), (B,T) */
    float *fch, *fch_gelu;            /* (B,T,4C) */
    float *res3;                      /* (B,T,C) block output */
} gpt_block_acts_t;

struct ap_nn_model {
    ap_nn_kind_t kind;
    ap_nn_params_t params;
    ap__nn_layout_t layout;
    ap_arena_t pg;   /* params | grads */
    ap_arena_t acts; /* activations saved for backward */
    ap_arena_t scr;  /* backward scratch */
    bool train;
    uint64_t drop_seed, drop_ctr, cur_drop; /* dropout stream */
    int fwd_B, fwd_T;                       /* shape of the last forward; 0 = none */
    bool fwd_loss;                          /* last forward computed a loss */
    union {
        ap_nn_gpt_config_t gpt;
        ap_nn_mlp_config_t mlp;
    } cfg;
    /* GPT */
    float *wte, *wpe, *lnfw, *lnfb, *lmw; /* params (NULL when not in this stage) */
    gpt_block_ptrs_t *blk;                /* [nblk] params of each of this stage's blocks */
    gpt_block_ptrs_t *gblk;               /* [nblk] grads */
    float *gwte, *gwpe, *glnfw, *glnfb, *glmw;
    gpt_block_acts_t *bacts; /* [nblk] */
    int nblk;
    float *encoded;                   /* (B,T,C) stage input */
    float *lnf, *lnf_mean, *lnf_rstd; /* (B,T,C), (B,T), (B,T) */
    float *probs, *losses;            /* (B,T,V), (B,T) */
    int32_t *tokens, *targets;        /* (B,T) copies */
    /* scratch */
    float *d_res, *d_tmp, *d_ln, *d_h4a, *d_h4b, *d_att; /* BTC,BTC,BTC,BT4C,BT4C,BNHTT */
    /* MLP */
    int nlin; /* linear layers */
    float *mw[AP_NN_MLP_MAX_HIDDEN + 1], *mb[AP_NN_MLP_MAX_HIDDEN + 1];
    float *gmw[AP_NN_MLP_MAX_HIDDEN + 1], *gmb[AP_NN_MLP_MAX_HIDDEN + 1];
    float *mx;                          /* (B,in) input copy */
    float *mpre[AP_NN_MLP_MAX_HIDDEN];  /* (B,h) pre-activation */
    float *mpost[AP_NN_MLP_MAX_HIDDEN]; /* (B,h) post-GELU */
    float *mlogits;                     /* (B,classes) -> probs */
    float *mlosses;                     /* (B) */
    int32_t *mlabels;                   /* (B) */
    float *mda, *mdb;                   /* (B,maxw) scratch */
};

/* Allocates params+grads for m->layout into m->pg and sets m->params. */
int ap__nn_alloc_params(ap_nn_model_t *m);
float *ap__nn_view_ptr(ap_nn_model_t *m, const char *name, bool grad);

/* model config words for checkpoints (16 u32) */
void ap__nn_config_words(const ap_nn_model_t *m, uint32_t w[16]);

#endif
