/* Apiary — the model kit: tensors, layers, an MLP, a GPT-style byte-level
 * transformer, data sets, solvers (the local optimizers), gradient clipping,
 * learning-rate schedules and checkpoints; prefix ap_nn_.
 *
 * Everything is float32. A model keeps its parameters and their gradients in
 * ONE flat arena: `params.data[0 .. count)` and `params.grad[0 .. count)`,
 * both 64-byte aligned, with a table of named views (offset, count, shape)
 * into them. The collaboration layers (averaging, compression, optimizers)
 * only ever see these flat buffers; the views are what they slice.
 *
 * Dimension letters used in every shape comment:
 *   B batch, T time (sequence), C channels (model width), OC output channels,
 *   NH heads, hs = C/NH head size, V vocabulary (256 bytes), N rows (= B*T),
 *   L layers.
 *
 * Threads: every kernel runs on the calling thread plus the process-wide
 * worker pool (APIARY_THREADS); OpenBLAS is set to one thread per call so the
 * two never oversubscribe the cores (see docs/nn.md). A model object is not
 * thread-safe: one thread at a time may call into a given model. Different
 * models may be used from different threads.
 *
 * Ownership: every buffer passed in is borrowed for the duration of the call
 * only, unless stated otherwise; every pointer returned into a model stays
 * valid until ap_nn_model_free().
 *
 * Errors: functions returning int give 0 or a negative AP_E* code; bad input
 * (shapes, out-of-range tokens, corrupt files, non-finite losses) is an error
 * return plus a log line (module "nn"), never an abort. */
#ifndef APIARY_NN_H
#define APIARY_NN_H

#include "apiary/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Flat parameters with named views                                         */
/* ------------------------------------------------------------------------ */

#define AP_NN_NAME_MAX 48

typedef struct ap_nn_view {
    char name[AP_NN_NAME_MAX]; /* e.g. "h3.attn.qkv.w", "wte" */
    size_t offset;             /* in floats from params.data (and params.grad) */
    size_t count;              /* floats */
    int rows, cols;            /* 2-D shape (rows*cols == count); cols = 1 for vectors */
} ap_nn_view_t;

typedef struct ap_nn_params {
    float *data;  /* (count) parameters; 64-byte aligned */
    float *grad;  /* (count) gradients, same layout; 64-byte aligned */
    size_t count; /* floats in each of data/grad (views are packed, 16-float aligned) */
    const ap_nn_view_t *views;
    size_t nviews;
} ap_nn_params_t;

/* Finds a view by name; NULL if absent. */
AP_EXPORT const ap_nn_view_t *ap_nn_params_find(const ap_nn_params_t *p, const char *name);

/* ------------------------------------------------------------------------ */
/* Layers (kernels). Plain functions over caller buffers. Shapes are given  */
/* for each argument; all backward kernels ACCUMULATE (+=) into every       */
/* gradient they write unless stated otherwise, so the caller zeroes them.  */
/* Gradient pointers documented "may be NULL" are skipped when NULL.        */
/* Kernels trust their arguments (the model entry points validate input).   */
/* ------------------------------------------------------------------------ */

/* Linear (OpenBLAS sgemm). reference: torch.nn.Linear.
 * out (N,OC) = in (N,C) @ w^T + b;  w (OC,C), b (OC) or NULL. */
AP_EXPORT void ap_nn_linear_forward(float *out, const float *in, const float *w, const float *b,
                                    int N, int C, int OC);
/* din (N,C) += dout (N,OC) @ w;  dw (OC,C) += dout^T @ in;  db (OC) += sum_n dout.
 * din, dw, db may be NULL. */
AP_EXPORT void ap_nn_linear_backward(float *din, float *dw, float *db, const float *dout,
                                     const float *in, const float *w, int N, int C, int OC);

/* Token + position embedding. tokens (B,T) in [0,V); wte (V,C); wpe (>=T,C).
 * out (B,T,C) = wte[tokens[b,t]] + wpe[t]. */
AP_EXPORT void ap_nn_embed_forward(float *out, const int32_t *tokens, const float *wte,
                                   const float *wpe, int B, int T, int C);
/* dwte (V,C) += scatter of dout (B,T,C) by token; dwpe (T,C) += sum_b dout. dwpe may be NULL. */
AP_EXPORT void ap_nn_embed_backward(float *dwte, float *dwpe, const float *dout,
                                    const int32_t *tokens, int B, int T, int C);

/* Layer norm over the last dimension, eps 1e-5. reference: torch.nn.LayerNorm.
 * in (N,C), w (C), b (C) -> out (N,C); saves mean (N), rstd (N) for backward. */
AP_EXPORT void ap_nn_layernorm_forward(float *out, float *mean, float *rstd, const float *in,
                                       const float *w, const float *b, int N, int C);
/* din (N,C), dw (C), db (C) += ...; dw, db may be NULL. */
AP_EXPORT void ap_nn_layernorm_backward(float *din, float *dw, float *db, const float *dout,
                                        const float *in, const float *w, const float *mean,
                                        const float *rstd, int N, int C);

/* GELU, tanh approximation. reference: torch.nn.GELU(approximate="tanh").
 * out (n) = gelu(in (n)); out may alias in. */
AP_EXPORT void ap_nn_gelu_forward(float *out, const float *in, size_t n);
/* din (n) += gelu'(in) * dout. din must not alias in or dout. */
AP_EXPORT void ap_nn_gelu_backward(float *din, const float *in, const float *dout, size_t n);

/* Causal multi-head self-attention (no projections; see the GPT block).
 * qkv (B,T,3C) holds q | k | v, each (B,T,NH,hs). out (B,T,C);
 * att (B,NH,T,T) saves the softmax probabilities (upper triangle zero).
 * Scores are scaled by 1/sqrt(hs). C % NH == 0. */
AP_EXPORT void ap_nn_attention_forward(float *out, float *att, const float *qkv, int B, int T,
                                       int C, int NH);
/* dqkv (B,T,3C) += ...; scratch (B,NH,T,T) is overwritten (no need to zero). */
AP_EXPORT void ap_nn_attention_backward(float *dqkv, float *scratch, const float *dout,
                                        const float *qkv, const float *att, int B, int T, int C,
                                        int NH);

/* Softmax cross-entropy. logits (N,V), targets (N) in [0,V).
 * probs (N,V) = softmax(logits) (probs may alias logits); losses (N) = -log p[target].
 * Returns the mean loss (double accumulation). */
AP_EXPORT float ap_nn_xent_forward(float *probs, float *losses, const float *logits,
                                   const int32_t *targets, int N, int V);
/* dlogits (N,V) = (probs - onehot(targets)) * dloss. OVERWRITES dlogits (may alias probs);
 * dloss is the gradient of the objective w.r.t. each row's loss (1/N for a mean). */
AP_EXPORT void ap_nn_xent_backward(float *dlogits, const float *probs, const int32_t *targets,
                                   float dloss, int N, int V);

/* Inverted dropout with a counter-based RNG: the mask of element i is a pure
 * function of (seed, i), so backward regenerates it and nothing is stored.
 * out (n) = in * keep(seed,i) / (1-p); out may alias in. 0 <= p < 1. */
AP_EXPORT void ap_nn_dropout_forward(float *out, const float *in, size_t n, float p, uint64_t seed);
/* din (n) += dout * keep(seed,i) / (1-p). din must not alias dout. */
AP_EXPORT void ap_nn_dropout_backward(float *din, const float *dout, size_t n, float p,
                                      uint64_t seed);

/* ------------------------------------------------------------------------ */
/* Models                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct ap_nn_model ap_nn_model_t;

typedef enum ap_nn_kind {
    AP_NN_MLP = 1,
    AP_NN_GPT = 2,
} ap_nn_kind_t;

#define AP_NN_MLP_MAX_HIDDEN 8

/* MLP classifier: in_dim -> [linear, GELU] x n_hidden -> linear -> softmax CE. */
typedef struct ap_nn_mlp_config {
    int in_dim;
    int n_hidden;                     /* 0 .. AP_NN_MLP_MAX_HIDDEN */
    int hidden[AP_NN_MLP_MAX_HIDDEN]; /* widths */
    int n_classes;
    int max_batch; /* activations are allocated once for this many rows */
} ap_nn_mlp_config_t;

/* GPT-style byte-level language model (GPT-2 block: pre-LN, GELU MLP of 4C,
 * learned positions, untied LM head without bias).
 *
 * Pipeline stages: a model object may hold only layers [layer_begin, layer_end)
 * of an n_layer model; `embed` says it owns the embeddings (first stage) and
 * `head` the final norm + LM head + loss (last stage). A whole model is
 * {0, n_layer, true, true}; ap_nn_gpt_config_default() fills that. Parameter
 * names use global layer indices, so stage views match the whole model's. */
typedef struct ap_nn_gpt_config {
    int vocab;                  /* V; 256 for bytes */
    int ctx;                    /* max T */
    int n_layer;                /* L of the whole model */
    int n_head;                 /* NH */
    int n_embd;                 /* C, multiple of n_head */
    int max_batch;              /* max B; activations are allocated once for (max_batch, ctx) */
    bool share_layers;          /* ALBERT-style: all blocks use one set of block weights */
    float dropout;              /* residual dropout probability in training mode, [0, 1) */
    int layer_begin, layer_end; /* this stage's blocks */
    bool embed, head;           /* first / last stage */
} ap_nn_gpt_config_t;

/* A whole-model config: V=256, the given sizes, layers [0,L), embed+head, no dropout. */
AP_EXPORT ap_nn_gpt_config_t ap_nn_gpt_config_default(int ctx, int n_layer, int n_head, int n_embd,
                                                      int max_batch);

/* Creates a model with zero parameters (call ap_nn_model_init). All memory
 * (parameters, gradients, activations, scratch) is allocated here, once,
 * pre-faulted. *out is owned by the caller: ap_nn_model_free. AP_EINVAL on a
 * bad config (logged), AP_ENOMEM. */
AP_EXPORT int ap_nn_mlp_new(const ap_nn_mlp_config_t *cfg, ap_nn_model_t **out);
AP_EXPORT int ap_nn_gpt_new(const ap_nn_gpt_config_t *cfg, ap_nn_model_t **out);
AP_EXPORT void ap_nn_model_free(ap_nn_model_t *m);

AP_EXPORT ap_nn_kind_t ap_nn_model_kind(const ap_nn_model_t *m);
/* The model's flat parameters, gradients and views (owned by the model). */
AP_EXPORT ap_nn_params_t *ap_nn_model_params(ap_nn_model_t *m);
/* Configs (copies). AP_EINVAL if the model is of the other kind. */
AP_EXPORT int ap_nn_model_gpt_config(const ap_nn_model_t *m, ap_nn_gpt_config_t *cfg);
AP_EXPORT int ap_nn_model_mlp_config(const ap_nn_model_t *m, ap_nn_mlp_config_t *cfg);

/* The model's kind and shape as AP_NN_SHAPE_WORDS numbers (the words a
 * checkpoint stores: GPT vocab, ctx, layers, heads, width, shared blocks,
 * stage; MLP sizes; unused words 0): two models of the same kind with equal
 * words have the same parameters' layout. For comparing configurations
 * between peers. */
#define AP_NN_SHAPE_WORDS 16
AP_EXPORT void ap_nn_model_shape(const ap_nn_model_t *m, uint32_t w[AP_NN_SHAPE_WORDS]);

/* Deterministic initialisation from seed: weights N(0, 0.02) (GPT; residual
 * projections scaled by 1/sqrt(2L)) or Kaiming-uniform (MLP), biases 0,
 * layer-norm gains 1. */
AP_EXPORT void ap_nn_model_init(ap_nn_model_t *m, uint64_t seed);
/* Sets params.grad to zero. Backward passes accumulate into it. */
AP_EXPORT void ap_nn_model_zero_grad(ap_nn_model_t *m);
/* Training mode enables dropout; the seed plus an internal counter (advanced
 * by each forward) picks the masks, so runs are reproducible. Default: eval. */
AP_EXPORT void ap_nn_model_set_train(ap_nn_model_t *m, bool train, uint64_t seed);
/* Bytes of memory the model allocated (params+grads, activations, scratch). */
AP_EXPORT size_t ap_nn_model_bytes(const ap_nn_model_t *m, size_t *params_grads,
                                   size_t *activations, size_t *scratch);

/* MLP forward: x (B,in_dim), labels (B) in [0,n_classes) or NULL.
 * *loss = mean cross-entropy when labels are given. B <= max_batch.
 * AP_EINVAL on bad shapes/labels, AP_ENONFINITE when the loss is not finite. */
AP_EXPORT int ap_nn_mlp_forward(ap_nn_model_t *m, const float *x, const int32_t *labels, int B,
                                float *loss);
/* Accumulates d(mean loss)/d(params) into params.grad; needs a forward with labels. */
AP_EXPORT int ap_nn_mlp_backward(ap_nn_model_t *m);
/* Class probabilities (B,n_classes) of the last forward (until the next
 * forward or backward). NULL if none. */
AP_EXPORT const float *ap_nn_mlp_probs(const ap_nn_model_t *m);

/* GPT stage I/O for one forward pass. */
typedef struct ap_nn_gpt_io {
    int B, T;               /* B <= max_batch, T <= ctx */
    const int32_t *tokens;  /* (B,T) bytes in [0,V): required by the first stage */
    const float *in;        /* (B,T,C) activations: required by the other stages */
    const int32_t *targets; /* (B,T) next tokens: last stage; NULL = inference, no loss */
    float *out;             /* (B,T,C): non-last stages write their output here (caller's) */
    float loss;             /* set by the last stage when targets are given: mean CE */
} ap_nn_gpt_io_t;

/* Forward pass of this stage. Validates shapes and tokens. Keeps everything
 * backward needs inside the model (until the next forward). A last stage with
 * targets returns AP_ENONFINITE (and logs) if the loss is NaN/inf. */
AP_EXPORT int ap_nn_gpt_forward(ap_nn_model_t *m, ap_nn_gpt_io_t *io);
/* Backward pass of this stage, accumulating into params.grad.
 * dout (B,T,C): gradient of the loss w.r.t. this stage's output (non-last
 * stages; ignored by the last stage, which starts from its own loss).
 * din (B,T,C) or NULL: receives (overwritten) the gradient w.r.t. io.in
 * (non-first stages). AP_ESTATE if no forward with a loss/output preceded it. */
AP_EXPORT int ap_nn_gpt_backward(ap_nn_model_t *m, const float *dout, float *din);
/* Convenience for a whole model: forward with tokens and targets. */
AP_EXPORT int ap_nn_gpt_loss(ap_nn_model_t *m, const int32_t *tokens, const int32_t *targets, int B,
                             int T, float *loss);
/* Probabilities (B,T,V) of the last forward of a last stage (valid until the
 * next forward or backward, which reuses the buffer). NULL otherwise. */
AP_EXPORT const float *ap_nn_gpt_probs(const ap_nn_model_t *m);
/* Number of parameters a config would have (without building it). */
AP_EXPORT size_t ap_nn_gpt_param_count(const ap_nn_gpt_config_t *cfg);
/* Samples n bytes after prompt (len >= 1) with the given temperature (> 0) and
 * seed into out (caller's, n bytes), feeding back the last ctx bytes. Whole
 * models with vocab <= 256 only (AP_EINVAL otherwise). Dropout is off while
 * sampling. */
AP_EXPORT int ap_nn_gpt_generate(ap_nn_model_t *m, const uint8_t *prompt, int len, uint8_t *out,
                                 int n, float temperature, uint64_t seed);

/* ------------------------------------------------------------------------ */
/* Data                                                                      */
/* ------------------------------------------------------------------------ */

/* Hard cap on a text file loaded as a data set. */
#define AP_NN_TEXT_MAX_BYTES ((size_t)1 << 30)

typedef struct ap_nn_text ap_nn_text_t;

/* Loads a whole file as bytes. AP_ENOTFOUND (missing), AP_EIO (unreadable),
 * AP_EINVAL (empty or shorter than 2 bytes), AP_ELIMIT (too large); each logged
 * with the path. *out: caller frees with ap_nn_text_free. */
AP_EXPORT int ap_nn_text_open(const char *path, ap_nn_text_t **out);
/* Same over a copy of memory. */
AP_EXPORT int ap_nn_text_from_memory(const uint8_t *bytes, size_t len, ap_nn_text_t **out);
AP_EXPORT void ap_nn_text_free(ap_nn_text_t *d);
AP_EXPORT size_t ap_nn_text_size(const ap_nn_text_t *d);
AP_EXPORT const uint8_t *ap_nn_text_bytes(const ap_nn_text_t *d);

/* Batches of (B,T) windows. The text is cut into non-overlapping windows of
 * T+1 bytes (starting at `offset` of the cut, so different peers may use
 * different cuts); each epoch visits every window once in an order that is a
 * pure function of (seed, epoch). inputs (B,T) = window[0..T), targets (B,T)
 * = window[1..T]. `cursor` is the caller's position (start at 0; it counts
 * windows served, so epoch = cursor / windows). AP_EINVAL if the text has no
 * full window for this T. */
AP_EXPORT int ap_nn_text_batch(const ap_nn_text_t *d, uint64_t seed, uint64_t *cursor, int B, int T,
                               int32_t *inputs, int32_t *targets);
/* Windows per epoch for this T (0 if the text is too short). */
AP_EXPORT size_t ap_nn_text_windows(const ap_nn_text_t *d, int T);

/* Synthetic classification: `classes` Gaussian clusters in `dim` dimensions
 * whose centres are a function of task_seed (distance ~3 sigma apart); sample
 * i of the stream sample_seed is a pure function of (task_seed, sample_seed, i).
 * x (n,dim), y (n). */
AP_EXPORT void ap_nn_synth_classify(uint64_t task_seed, uint64_t sample_seed, uint64_t first, int n,
                                    int dim, int classes, float *x, int32_t *y);

/* Path of the small corpus shipped in data/ (build-tree path baked in at
 * compile time; APIARY_DATA overrides the directory). Static string. */
AP_EXPORT const char *ap_nn_default_corpus(void);

/* ---- solvers: the local optimizers ----------------------------------------
 *
 * Solvers (the local optimizers SGD, Adam, AdamW, LAMB; named apart from the
 * collaborative optimizer of apiary/collab.h, which is built on them) work on
 * flat float buffers (params, grads) and keep their own state in ONE flat
 * float buffer (`state`, `state_count` floats) so that it can be averaged
 * between peers and transferred like the parameters.
 *
 * Conventions follow PyTorch (torch.optim.SGD / Adam / AdamW) so results can
 * be compared step for step; LAMB follows You et al. 2019 (Algorithm 2) with
 * bias correction and per-view trust ratios.
 *
 * Threads: steps run on the calling thread plus the worker pool; a solver
 * object must be used by one thread at a time. */

typedef enum ap_nn_solver_kind {
    AP_NN_SGD = 1,   /* state: momentum buffer (n) */
    AP_NN_ADAM = 2,  /* state: m (n) | v (n); weight decay is L2 added to the gradient */
    AP_NN_ADAMW = 3, /* state: m (n) | v (n); decoupled weight decay */
    AP_NN_LAMB = 4,  /* state: m (n) | v (n); layer-wise trust ratio per view */
} ap_nn_solver_kind_t;

typedef struct ap_nn_solver_config {
    ap_nn_solver_kind_t kind;
    float momentum;     /* SGD; 0 = plain SGD (no state is used) */
    bool nesterov;      /* SGD */
    float beta1, beta2; /* Adam/AdamW/LAMB */
    float eps;
    float weight_decay;
} ap_nn_solver_config_t;

/* Names for command lines and logs: "sgd", "adam", "adamw", "lamb".
 * ap_nn_solver_kind_name returns "?" for an unknown kind; _from_name returns
 * 0 or AP_EINVAL (*out untouched). */
AP_EXPORT const char *ap_nn_solver_kind_name(ap_nn_solver_kind_t kind);
AP_EXPORT int ap_nn_solver_kind_from_name(const char *name, ap_nn_solver_kind_t *out);

/* PyTorch defaults for a kind (SGD: momentum 0.9; Adam*: 0.9, 0.999, 1e-8;
 * LAMB: 0.9, 0.999, 1e-6; weight decay 0, or 0.01 for AdamW/LAMB). */
AP_EXPORT ap_nn_solver_config_t ap_nn_solver_defaults(ap_nn_solver_kind_t kind);

typedef struct ap_nn_solver {
    ap_nn_solver_config_t cfg;
    size_t n;           /* parameters */
    float *state;       /* (state_count) flat state, zero-initialised; owned */
    size_t state_count; /* n for SGD, 2n for Adam/AdamW/LAMB */
    uint64_t step;      /* steps taken (for bias correction) */
    ap_nn_view_t *segs; /* LAMB trust-ratio segments (copied views); owned */
    size_t nsegs;
} ap_nn_solver_t;

/* Creates an optimizer for n parameters. views/nviews (may be NULL/0) give
 * LAMB its per-layer segments; without them LAMB uses one segment.
 * AP_EINVAL on a bad config, AP_ENOMEM. Free with ap_nn_solver_free. */
AP_EXPORT int ap_nn_solver_new(const ap_nn_solver_config_t *cfg, size_t n,
                               const ap_nn_view_t *views, size_t nviews, ap_nn_solver_t **out);
AP_EXPORT void ap_nn_solver_free(ap_nn_solver_t *o);
/* Zeroes the state and the step counter. */
AP_EXPORT void ap_nn_solver_reset(ap_nn_solver_t *o);
/* One update: params (n) -= f(grads (n), state) with learning rate lr.
 * grads is read only. Increments o->step. AP_ENONFINITE (state untouched)
 * if lr is not finite. */
AP_EXPORT int ap_nn_solver_step(ap_nn_solver_t *o, float *params, const float *grads, float lr);

/* L2 norm of g (n), double accumulation. */
AP_EXPORT double ap_nn_grad_norm(const float *g, size_t n);
/* Global-norm clipping: if the norm exceeds max_norm, scales g by
 * max_norm/norm. Returns the norm before clipping; a non-finite norm leaves g
 * untouched (the caller should skip the step and report it). */
AP_EXPORT double ap_nn_clip_grad_norm(float *g, size_t n, double max_norm);

typedef enum ap_nn_lr_kind {
    AP_NN_LR_CONSTANT = 0, /* base (after warm-up) */
    AP_NN_LR_LINEAR = 1,   /* warm-up, then linear decay to min at total */
    AP_NN_LR_COSINE = 2,   /* warm-up, then half-cosine decay to min at total */
    AP_NN_LR_RSQRT = 3,    /* warm-up, base until total, then base * sqrt(total / (step
                            * + 1)), never below min; total 0 (or within the warm-up)
                            * starts the decay where the warm-up ends */
} ap_nn_lr_kind_t;

typedef struct ap_nn_lr_schedule {
    ap_nn_lr_kind_t kind;
    float base, min; /* peak and final rate */
    uint64_t warmup; /* steps of linear warm-up from base/warmup to base */
    uint64_t total;  /* steps at which the decay reaches min (then stays);
                      * for AP_NN_LR_RSQRT the step where the decay starts */
} ap_nn_lr_schedule_t;

/* "constant", "linear", "cosine", "rsqrt" (as ap_nn_solver_kind_name / _from_name). */
AP_EXPORT const char *ap_nn_lr_kind_name(ap_nn_lr_kind_t kind);
AP_EXPORT int ap_nn_lr_kind_from_name(const char *name, ap_nn_lr_kind_t *out);

/* Learning rate for step (0-based). */
AP_EXPORT float ap_nn_lr_at(const ap_nn_lr_schedule_t *s, uint64_t step);

/* ------------------------------------------------------------------------ */
/* Checkpoints                                                               */
/* ------------------------------------------------------------------------ */

/* File format (little-endian; docs/nn.md):
 *   header 160 bytes: magic "APNNCKPT", u32 version (1), u32 header size (160),
 *     u32 model kind, u32 config words[16], u64 param count,
 *     u32 optim kind (0 = none), u32 optim flags (bit 0 nesterov), u64 optim state count,
 *     u64 optim step, f32 momentum, beta1, beta2, eps, weight decay, u64 train step,
 *     16 zero bytes
 *   payload: params (count f32) | optim state (state count f32)
 *   trailer: BLAKE2b-256 of header+payload (32 bytes)
 * Loading checks everything against the given model/optimizer before
 * reading any payload: wrong magic/truncated/checksum -> AP_ECORRUPT, other
 * version -> AP_EVERSION, other model shape/kind or optimizer kind/size ->
 * AP_EINVAL, non-finite numbers -> AP_ENONFINITE (optimizer hyperparameters
 * are stored but not enforced: the caller's configuration wins);
 * each logged with the reason. The model and optimizer are left untouched on
 * any error. */
#define AP_NN_CKPT_VERSION 1
#define AP_NN_CKPT_HEADER  160

/* Writes model params (+ optimizer state if o != NULL) and step to path,
 * atomically (temp file + rename). AP_EIO on failure. */
AP_EXPORT int ap_nn_checkpoint_save(const char *path, ap_nn_model_t *m, const ap_nn_solver_t *o,
                                    uint64_t step);
/* Loads into m (and o if given; the file must then contain a matching
 * optimizer, and o->step is restored). *step may be NULL. */
AP_EXPORT int ap_nn_checkpoint_load(const char *path, ap_nn_model_t *m, ap_nn_solver_t *o,
                                    uint64_t *step);
/* The same two over memory. encode: *buf is malloc'd, caller frees. decode:
 * buf (len) is untrusted and borrowed. */
AP_EXPORT int ap_nn_checkpoint_encode(ap_nn_model_t *m, const ap_nn_solver_t *o, uint64_t step,
                                      uint8_t **buf, size_t *len);
/* Like ap_nn_checkpoint_encode, but the parameters come from the flat buffer
 * params (m's parameter count floats, borrowed for the call) instead of m's
 * own: m gives only the shape (its configuration; m's buffers are not read),
 * e.g. a collaborative optimizer's copy of the parameters. */
AP_EXPORT int ap_nn_checkpoint_encode_flat(ap_nn_model_t *m, const float *params,
                                           const ap_nn_solver_t *o, uint64_t step, uint8_t **buf,
                                           size_t *len);
/* Writes an encoded checkpoint (buf, len; borrowed) to path atomically (temp
 * file, fsync, rename). AP_EIO on failure (logged). */
AP_EXPORT int ap_nn_checkpoint_write(const char *path, const uint8_t *buf, size_t len);
AP_EXPORT AP_NODISCARD int ap_nn_checkpoint_decode(const uint8_t *buf, size_t len, ap_nn_model_t *m,
                                                   ap_nn_solver_t *o, uint64_t *step);

#ifdef __cplusplus
}
#endif
#endif
