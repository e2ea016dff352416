/* Apiary — a collaborative run's progress records (prefix ap_progress_): what
 * each peer of a run (apiary/collab.h) reports in the DHT under
 * "<run_id>_progress" (epoch, samples, speed, role, bandwidth, donor flag and
 * the run's configuration), and their validated decoding. */
#ifndef APIARY_PROGRESS_H
#define APIARY_PROGRESS_H

#include "apiary/avg.h"
#include "apiary/common.h"
#include "apiary/peer.h"
#include "apiary/run_config.h"
#include "apiary/run_token.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Cap on the samples/s a progress record may claim. */
#define AP_PROGRESS_MAX_SPS      1e9
#define AP_PROGRESS_LEFT_OUT_MAX 4

typedef struct ap_progress {
    ap_peer_id_t peer;
    uint64_t epoch;
    int64_t samples;        /* accumulated in this epoch */
    double samples_per_s;   /* the peer's recent speed */
    int64_t time_ms;        /* wall clock of the report */
    int64_t epoch_start_ms; /* wall clock when the peer began this epoch */
    ap_avg_role_t role;
    double up, down;  /* declared bandwidth, bytes/s */
    bool donor;       /* serves state downloads */
    int64_t ready_ms; /* wall clock when it became ready to average this epoch; 0 = not */
    bool refused;     /* the peer stopped: the run refused its configuration */
    /* for the run's monitor (docs/monitor.md); decode passes them unchecked */
    float loss;                          /* mean loss of the last batch */
    bool has_loss;                       /* loss is set (0 is a loss; false = none yet) */
    uint64_t bytes_sent, bytes_received; /* averaging payload, cumulative */
    uint64_t rounds, rounds_failed;      /* gradient rounds, and of them incomplete */
    uint32_t last_group, last_round_ms;  /* the last round's members and duration */
    float last_fraction;                 /* the last round's averaged fraction */
    /* The longest the peer lets pass between two of its records, ms (0 = not
     * said, as from older peers; decode passes any value: a reader uses the
     * smaller of its own stale_ms and a few of these intervals) */
    uint32_t report_ms;
    bool has_config; /* config and config_digest are set (always, from ap_collab) */
    uint8_t config_digest[AP_RUN_CONFIG_DIGEST_LEN]; /* of config (set by encode and decode) */
    ap_run_config_t config;
    /* closed runs (apiary/run_token.h): the peer's join token; decode checks
     * its form, not its signature (the reader does, against its run) */
    bool has_token;
    ap_run_token_t token;
    /* byzantine-tolerant runs: members that did not deliver in the peer's
     * recent gradient rounds (decode refuses more than
     * AP_PROGRESS_LEFT_OUT_MAX or a malformed PeerID, AP_ECORRUPT) */
    uint32_t nleft_out;
    ap_peer_id_t left_out[AP_PROGRESS_LEFT_OUT_MAX];
} ap_progress_t;

/* Encodes a record (protobuf, proto/optim.proto) into buf (cap bytes); returns
 * the length or AP_EMSGSIZE. */
AP_EXPORT int ap_progress_encode(const ap_progress_t *p, uint8_t *buf, size_t cap);
/* Decodes and validates an untrusted record read from the DHT. now_ms is the
 * reader's wall clock, max_skew_ms the tolerated clock skew. Refused (error,
 * nothing written):
 *   AP_ECORRUPT   undecodable;
 *   AP_ERANGE     negative samples or speed, non-finite numbers, speed over
 *                 AP_PROGRESS_MAX_SPS, a time more than max_skew_ms in the future,
 *                 an epoch start after the report, a ready time outside
 *                 [epoch start, report], a bad role or bandwidth;
 *   AP_ELIMIT     more samples than the reported speed allows over the epoch's
 *                 duration (samples > 2·sps·(elapsed + 1 s) + 1);
 *   AP_ECORRUPT   also: a configuration with a model description that is too
 *                 long or not printable; AP_ERANGE: a non-finite learning
 *                 rate, weight decay or clipping norm.
 *   AP_ECORRUPT   also: a token that is not one (ap_run_token_unpack).
 *   AP_ECORRUPT   also: more than AP_PROGRESS_LEFT_OUT_MAX left_out entries,
 *                 or one that is not a PeerID.
 * A record without a configuration decodes with has_config false, one
 * without a token with has_token false.
 * peer is not part of the encoding (it is the owner of the subkey). */
AP_EXPORT AP_NODISCARD int ap_progress_decode(const uint8_t *buf, size_t len, int64_t now_ms,
                                              int64_t max_skew_ms, ap_progress_t *out);

#ifdef __cplusplus
}
#endif
#endif
