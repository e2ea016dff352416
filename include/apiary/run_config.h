/* Apiary — a collaborative run's configuration (prefix ap_run_config_): what
 * every peer of a run (apiary/collab.h) must share, its digest and the
 * description of a difference. */
#ifndef APIARY_RUN_CONFIG_H
#define APIARY_RUN_CONFIG_H

#include "apiary/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What every peer of a run must share. It travels in every progress record
 * (the fields; readers compare their 16-byte digest) and, as its digest, in
 * the key of the DHT matchmaker's groups (so join requests only reach peers of the same
 * configuration). A reader refuses the record of a peer whose configuration
 * differs from its own, naming the first differing field and both values;
 * such a peer is in no group, no estimate and no download. A peer that finds
 * itself alone against the run (no live peer agrees with it, and it is
 * starting, or a peer that differs is in a later epoch) stops with
 * AP_ECONFIG (ap_collab_refusal says why) after one record marked refused,
 * so the others log the difference too. docs/training.md, "Peers must
 * agree". */

#define AP_RUN_CONFIG_MODEL_MAX  64 /* bytes of the model description, with the NUL */
#define AP_RUN_CONFIG_DIGEST_LEN 16
#define AP_RUN_CONFIG_MSG_MAX    256 /* bytes of a difference's description */

typedef struct ap_run_config {
    char model[AP_RUN_CONFIG_MODEL_MAX]; /* the application's name of the model's shape ("" = none)
                                          */
    uint64_t n_params, state_count;
    uint32_t codec; /* ap_avg_codec_t of the gradient rounds */
    uint64_t target_batch_size;
    uint32_t solver;  /* ap_nn_solver_kind_t */
    uint32_t lr_kind; /* ap_nn_lr_kind_t */
    float lr, lr_min, weight_decay;
    uint64_t warmup, lr_total;
    double clip;
    uint32_t state_every;
    bool exact, dht_matchmaking;
    bool byzantine_tolerant;   /* apiary/collab.h: ButterflyClip rounds, checked */
    double btard_tau;          /* their CenteredClip radius (0 unless byzantine_tolerant) */
    uint32_t state_codec;      /* ap_avg_codec_t of the state rounds */
    uint32_t btard_validators; /* the gradient check's validators per step (0 = off) */
} ap_run_config_t;

/* BLAKE2b-128 of the configuration's canonical encoding. */
AP_EXPORT void ap_run_config_digest(const ap_run_config_t *rc,
                                    uint8_t out[AP_RUN_CONFIG_DIGEST_LEN]);
/* 0 if a and b agree; else 1 and out (cap bytes, NUL-terminated) names the
 * first differing field with both values: "<field>: <a> <a_name>, <b>
 * <b_name>" (e.g. "compression: fp16 here, none at 12D3KooW..."). */
AP_EXPORT int ap_run_config_diff(const ap_run_config_t *a, const char *a_name,
                                 const ap_run_config_t *b, const char *b_name, char *out,
                                 size_t cap);

#ifdef __cplusplus
}
#endif
#endif
