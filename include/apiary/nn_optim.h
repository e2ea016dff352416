/* Apiary — local optimizers, gradient clipping, learning-rate schedules and
 * checkpoints for the model kit (apiary/nn.h).
 *
 * Optimizers work on flat float buffers (params, grads) and keep their own
 * state in ONE flat float buffer (`state`, `state_count` floats) so that it
 * can be averaged between peers and transferred like the parameters. The
 * collaborative optimizer (apiary/optim.h) is built on top of these.
 *
 * Conventions follow PyTorch (torch.optim.SGD / Adam / AdamW) so results can
 * be compared step for step; LAMB follows You et al. 2019 (Algorithm 2) with
 * bias correction and per-view trust ratios.
 *
 * Threads: steps run on the calling thread plus the worker pool; an optimizer
 * object must be used by one thread at a time. */
#ifndef APIARY_NN_OPTIM_H
#define APIARY_NN_OPTIM_H

#include "apiary/common.h"
#include "apiary/nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ap_nn_optim_kind {
    AP_NN_SGD = 1,   /* state: momentum buffer (n) */
    AP_NN_ADAM = 2,  /* state: m (n) | v (n); weight decay is L2 added to the gradient */
    AP_NN_ADAMW = 3, /* state: m (n) | v (n); decoupled weight decay */
    AP_NN_LAMB = 4,  /* state: m (n) | v (n); layer-wise trust ratio per view */
} ap_nn_optim_kind_t;

typedef struct ap_nn_optim_config {
    ap_nn_optim_kind_t kind;
    float momentum;     /* SGD; 0 = plain SGD (no state is used) */
    bool nesterov;      /* SGD */
    float beta1, beta2; /* Adam/AdamW/LAMB */
    float eps;
    float weight_decay;
} ap_nn_optim_config_t;

/* Names for command lines and logs: "sgd", "adam", "adamw", "lamb".
 * ap_nn_optim_kind_name returns "?" for an unknown kind; _from_name returns
 * 0 or AP_EINVAL (*out untouched). */
AP_EXPORT const char *ap_nn_optim_kind_name(ap_nn_optim_kind_t kind);
AP_EXPORT int ap_nn_optim_kind_from_name(const char *name, ap_nn_optim_kind_t *out);

/* PyTorch defaults for a kind (SGD: momentum 0.9; Adam*: 0.9, 0.999, 1e-8;
 * LAMB: 0.9, 0.999, 1e-6; weight decay 0, or 0.01 for AdamW/LAMB). */
AP_EXPORT ap_nn_optim_config_t ap_nn_optim_defaults(ap_nn_optim_kind_t kind);

typedef struct ap_nn_optim {
    ap_nn_optim_config_t cfg;
    size_t n;           /* parameters */
    float *state;       /* (state_count) flat state, zero-initialised; owned */
    size_t state_count; /* n for SGD, 2n for Adam/AdamW/LAMB */
    uint64_t step;      /* steps taken (for bias correction) */
    ap_nn_view_t *segs; /* LAMB trust-ratio segments (copied views); owned */
    size_t nsegs;
} ap_nn_optim_t;

/* Creates an optimizer for n parameters. views/nviews (may be NULL/0) give
 * LAMB its per-layer segments; without them LAMB uses one segment.
 * AP_EINVAL on a bad config, AP_ENOMEM. Free with ap_nn_optim_free. */
AP_EXPORT int ap_nn_optim_new(const ap_nn_optim_config_t *cfg, size_t n, const ap_nn_view_t *views,
                              size_t nviews, ap_nn_optim_t **out);
AP_EXPORT void ap_nn_optim_free(ap_nn_optim_t *o);
/* Zeroes the state and the step counter. */
AP_EXPORT void ap_nn_optim_reset(ap_nn_optim_t *o);
/* One update: params (n) -= f(grads (n), state) with learning rate lr.
 * grads is read only. Increments o->step. AP_ENONFINITE (state untouched)
 * if lr is not finite. */
AP_EXPORT int ap_nn_optim_step(ap_nn_optim_t *o, float *params, const float *grads, float lr);

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
} ap_nn_lr_kind_t;

typedef struct ap_nn_lr_schedule {
    ap_nn_lr_kind_t kind;
    float base, min; /* peak and final rate */
    uint64_t warmup; /* steps of linear warm-up from base/warmup to base */
    uint64_t total;  /* steps at which the decay reaches min (then stays) */
} ap_nn_lr_schedule_t;

/* "constant", "linear", "cosine" (as ap_nn_optim_kind_name / _from_name). */
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
AP_EXPORT int ap_nn_checkpoint_save(const char *path, ap_nn_model_t *m, const ap_nn_optim_t *o,
                                    uint64_t step);
/* Loads into m (and o if given; the file must then contain a matching
 * optimizer, and o->step is restored). *step may be NULL. */
AP_EXPORT int ap_nn_checkpoint_load(const char *path, ap_nn_model_t *m, ap_nn_optim_t *o,
                                    uint64_t *step);
/* The same two over memory. encode: *buf is malloc'd, caller frees. decode:
 * buf (len) is untrusted and borrowed. */
AP_EXPORT int ap_nn_checkpoint_encode(ap_nn_model_t *m, const ap_nn_optim_t *o, uint64_t step,
                                      uint8_t **buf, size_t *len);
/* Like ap_nn_checkpoint_encode, but the parameters come from the flat buffer
 * params (m's parameter count floats, borrowed for the call) instead of m's
 * own: m gives only the shape (its configuration; m's buffers are not read),
 * e.g. a collaborative optimizer's copy of the parameters. */
AP_EXPORT int ap_nn_checkpoint_encode_flat(ap_nn_model_t *m, const float *params,
                                           const ap_nn_optim_t *o, uint64_t step, uint8_t **buf,
                                           size_t *len);
/* Writes an encoded checkpoint (buf, len; borrowed) to path atomically (temp
 * file, fsync, rename). AP_EIO on failure (logged). */
AP_EXPORT int ap_nn_checkpoint_write(const char *path, const uint8_t *buf, size_t len);
AP_EXPORT AP_NODISCARD int ap_nn_checkpoint_decode(const uint8_t *buf, size_t len, ap_nn_model_t *m,
                                                   ap_nn_optim_t *o, uint64_t *step);

#ifdef __cplusplus
}
#endif
#endif
