/* Apiary — one butterfly all-reduce round (prefix ap_allreduce_).
 *
 * A group (apiary/avg.h) averages one flat float32 vector: it is split into
 * one contiguous part per reducing peer, sized by the load-balancing LP
 * (ap_avg_balance); every sender streams each part to its reducer as chunks,
 * the reducer computes the weighted mean chunk by chunk and streams it back
 * on the same stream. Rounds run through the node's averaging service
 * (ap_avg_service_new). docs/averaging.md gives the wire format, pacing and
 * the fault rules.
 *
 * Protocol code: everything here runs on the runtime's loop thread. */
#ifndef APIARY_ALLREDUCE_H
#define APIARY_ALLREDUCE_H

#include "apiary/avg.h"
#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_ALLREDUCE_MAX_ELEMS (1ull << 34) /* 16 G elements */

/* A robust reducer for one whole part (ap_allreduce_opts_t.reduce): writes
 * the aggregate of the n inputs x[0..n-1] (d floats each, all finite) with
 * weights w (finite, >= 0, not all 0) to out, which aliases no input; sets
 * *clipped to how many inputs it limited. 0 or a negative AP_E* code (the
 * part then stays local for everyone, as when its reducer fails). Runs on
 * the loop thread. ap_btard_butterfly_clip (apiary/btard.h) is CenteredClip
 * in this shape ("ButterflyClip"). */
typedef int (*ap_allreduce_reduce_fn)(void *arg, const float *const *x, const double *w, size_t n,
                                      size_t d, float *out, uint32_t *clipped);

typedef struct ap_allreduce_opts {
    /* Elements per chunk; same in the whole group. 0 = from the group: the
     * largest power of two not above what the slowest declared link (min of
     * up and down over the members) moves in 5 ms, within [4096, 16384]; so
     * 16384 (64 KiB of float32) from 200 Mbit/s up, 8192 at 100 Mbit/s, 4096
     * at 50 Mbit/s and below. Smaller chunks queue less data ahead of results
     * on a slow uplink; larger ones cost less CPU per byte on fast links. Every
     * member computes the same value from the same group. */
    uint32_t chunk_elems;
    uint8_t codec;    /* ap_avg_codec_t; same in the whole group */
    double min_share; /* as in ap_avg_balance_opts_t; same in the whole group */
    /* Round deadline: start + connect_grace_us + deadline_factor·T_lp +
     * deadline_slack_us, where T_lp is the LP's predicted time for this group
     * (0 = 4 and 2 s). */
    double deadline_factor;
    uint64_t deadline_slack_us;
    /* Stall rule: a stream with no message for max(stall_min_us,
     * stall_factor·expected message time at its measured rate) is dropped
     * (0 = 1 s and 10). */
    uint64_t stall_min_us;
    double stall_factor;
    /* How long a member may take to connect (its first stream to arrive,
     * or the connection a higher-index peer waits for before dialing) before
     * it counts as gone (0 = 2 s). A member whose dial fails is dropped at
     * once. */
    uint64_t connect_grace_us;
    /* Absolute cap on the round deadline in ap_rt_now_us() time (0 = none). */
    uint64_t deadline_at_us;
    /* Pacing (local; members may differ): a sender sends data chunk c of a
     * part only while c < (result chunks received for that part) + lead, so
     * it never runs far ahead of a reducer that waits for slower senders
     * and spends its upload on parts and results that can progress.
     * 0 = automatic (default): the lead of each part follows its measured
     * result rate × smallest send-to-result round trip, so it fits loopback,
     * shaped and long-RTT paths alike (docs/averaging.md, "Pacing");
     * N = a fixed lead of N chunks; AP_ALLREDUCE_LEAD_OFF = no pacing (up to the
     * stream window). */
    uint32_t max_lead_chunks;
    /* Aggregation (same in the whole group). NULL (default): the weighted
     * mean, chunk by chunk as chunks arrive. Otherwise each reducer keeps
     * every sender's copy of its part and, once all live senders delivered
     * the whole part, replaces it by reduce(reduce_arg, ...) over them (its
     * own copy included; a sender dropped before the end is left out). The
     * results then all leave at the end of the part, so pacing is off
     * (max_lead_chunks is taken as AP_ALLREDUCE_LEAD_OFF) and the reducer
     * holds one copy of its part per sender. */
    ap_allreduce_reduce_fn reduce;
    void *reduce_arg;
} ap_allreduce_opts_t;

/* ap_allreduce_opts_t.max_lead_chunks: no pacing (data runs ahead of the
 * results up to the stream window). */
#define AP_ALLREDUCE_LEAD_OFF UINT32_MAX

typedef struct ap_allreduce_result {
    int status;               /* 0, AP_ECANCELED, or the error that stopped the round */
    uint64_t elems;           /* vector length */
    uint64_t elems_averaged;  /* elements replaced by a group average (receivers) */
    double averaged_fraction; /* elems_averaged / elems (receivers; 1.0 for aux) */
    uint32_t parts_failed;    /* parts whose reducer failed (stayed local, wholly or partly) */
    uint32_t senders_dropped; /* senders this peer's reducer dropped (failed, stalled, bad) */
    uint32_t senders_used;    /* senders that delivered this peer's whole part */
    uint64_t my_part_elems;   /* elements this peer reduced */
    uint32_t inputs_clipped;  /* opts.reduce: inputs it limited on this peer's part */
    uint32_t inputs_reduced;  /* opts.reduce: inputs it aggregated (own copy included) */
    uint64_t bytes_sent, bytes_received; /* chunk payload bytes of this round */
    uint64_t elapsed_us;
    double predicted_s; /* the LP bound for the group: t·P·4 */
    /* Per member, in the group's order (n entries, valid during the done
     * call only; NULL when out of memory): AP_ALLREDUCE_PART_FAILED if its
     * part stayed local here (wholly or partly), AP_ALLREDUCE_SENDER_DROPPED
     * if this peer's reducer dropped it as a sender; 0 for this peer. */
    const uint8_t *member_faults;
} ap_allreduce_result_t;

#define AP_ALLREDUCE_PART_FAILED    1u
#define AP_ALLREDUCE_SENDER_DROPPED 2u

typedef struct ap_allreduce ap_allreduce_t;

/* Called once per round on the loop thread when the round is over and every
 * stream of it is closed. res is valid during the call only. The round object
 * is freed right after done returns. */
typedef void (*ap_allreduce_done_fn)(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res);

/* Starts one all-reduce round on this node.
 *  g:       the group; this node must be in it (else AP_EINVAL). Copied.
 *  data:    n_elems float32 values, owned by the caller, which must keep it
 *           valid and untouched until done runs; the round reads it and writes
 *           the averages into it in place. May be NULL for an AUX member.
 *  weight:  this node's weight (finite, ≥ 0; ignored for AUX). A chunk's
 *           result is Σ w_j x_j / Σ w_j over the senders that delivered it
 *           (the plain mean of them if that sum is 0).
 * Every member must call this with the same g, n_elems and opts. done runs
 * exactly once, never before this returns. *out (may be NULL) is valid until
 * done runs. Loop thread. */
AP_EXPORT int ap_allreduce_start(ap_avg_service_t *svc, const ap_avg_group_t *g, float *data,
                                 uint64_t n_elems, double weight, const ap_allreduce_opts_t *opts,
                                 ap_allreduce_done_fn done, void *arg, ap_allreduce_t **out);

/* Aborts the round: every stream is reset, the parts not yet averaged keep
 * their local values, done runs later with status AP_ECANCELED. Loop thread. */
AP_EXPORT void ap_allreduce_cancel(ap_allreduce_t *ar);

#ifdef __cplusplus
}
#endif
#endif
