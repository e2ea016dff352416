/* Apiary — decentralized averaging: load balancing and butterfly all-reduce.
 *
 * A group of peers averages one flat float32 vector (the concatenation of a
 * fixed set of tensors). The vector is split into one contiguous part per
 * reducing peer, sized by the DeDLOC load-balancing LP so that the round's
 * communication time is minimal; every sender streams each part to its
 * reducer as chunks, the reducer computes the weighted mean chunk by chunk
 * and streams it back on the same stream (both directions at once).
 *
 * Roles:
 *   - AP_AVG_NORMAL: sends its data, receives the results, reduces a part.
 *   - AP_AVG_CLIENT: cannot accept connections; sends and receives, reduces
 *     nothing (share 0).
 *   - AP_AVG_AUX: accepts connections and reduces a part; contributes no data
 *     (weight 0) and receives no results (it has no data to replace).
 * So S (senders) = R (receivers) = NORMAL ∪ CLIENT and A (acceptors) =
 * NORMAL ∪ AUX. See docs/averaging.md for the LP, the tie-break, the rounding,
 * the wire format and the fault rules.
 *
 * Protocol code: everything here runs on the runtime's loop thread (runtime.h)
 * and uses nothing but runtime.h, so it runs unchanged on the simulator and on
 * the real driver.
 *
 * Groups come from matchmaking over the DHT (ap_averager_step, below), or
 * from the caller (ap_averager_step_group). */
#ifndef APIARY_AVERAGER_H
#define APIARY_AVERAGER_H

#include "apiary/common.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/peer.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ap_avg_role { AP_AVG_NORMAL = 0, AP_AVG_CLIENT = 1, AP_AVG_AUX = 2 } ap_avg_role_t;

/* ---- load balancing (DeDLOC) ---------------------------------------------
 *
 * With P elements, share a_i of peer i, minimise T subject to
 *   Σ a_i = 1, a_i ≥ 0, a_i = 0 for i ∉ A,
 *   upload_i   = P·[i∈S]·(1−a_i) + P·a_i·|R∖{i}| ≤ u_i·T,
 *   download_i = P·[i∈R]·(1−a_i) + P·a_i·|S∖{i}| ≤ d_i·T.
 * The functions below work with P = 1 element of 1 byte: the returned t is in
 * seconds per (element·byte); the round's lower bound in seconds for P
 * elements of b bytes is t·P·b. */

typedef struct ap_avg_bw {
    ap_avg_role_t role;
    double up;   /* upload bandwidth, bytes/s; finite, > 0 */
    double down; /* download bandwidth, bytes/s; finite, > 0 */
} ap_avg_bw_t;

typedef struct ap_avg_balance_opts {
    /* Peers whose share would be below min_share get none (0 = keep all).
     * They are dropped one at a time, smallest first, re-solving after each. */
    double min_share;
} ap_avg_balance_opts_t;

#define AP_AVG_MAX_PEERS 1024

/* Solves the LP with lp_solve and returns the canonical optimal split:
 * shares[n] (sum 1, 0 outside A) and *t (may be NULL). The split is a pure
 * function of the inputs (canonical post-processing, docs/averaging.md), so
 * every peer computes the same one. AP_EINVAL on bad input (n == 0 or >
 * AP_AVG_MAX_PEERS, bad bandwidth or role, no acceptor, no sender);
 * AP_ENOMEM; AP_EIO if the solver fails. Any thread; no state. */
AP_EXPORT int ap_avg_balance(const ap_avg_bw_t *peers, size_t n, const ap_avg_balance_opts_t *opts,
                             double *shares, double *t);

/* The closed-form (water-filling) optimum, valid when up == down for every
 * peer and at least two peers send: AP_ENOTSUP otherwise. Same canonical
 * split as ap_avg_balance (no min_share). Any thread. */
AP_EXPORT int ap_avg_balance_closed_form(const ap_avg_bw_t *peers, size_t n, double *shares,
                                         double *t);

/* The communication time (seconds per element·byte, as t above) of a given
 * split: max over peers of upload/u and download/d. AP_EINVAL on bad input. */
AP_EXPORT int ap_avg_split_time(const ap_avg_bw_t *peers, size_t n, const double *shares,
                                double *t);

/* Rounds shares (≥ 0, summing to ~1) to element counts summing exactly to
 * total, by largest remainder (Hamilton): floors first, then one more element
 * to the largest fractional remainders, ties to the lower index. A share of 0
 * always gets 0. AP_EINVAL if a share is negative or non-finite or all are 0. */
AP_EXPORT int ap_avg_round_counts(const double *shares, size_t n, uint64_t total, uint64_t *counts);

/* ---- butterfly all-reduce -------------------------------------------------- */

#define AP_AVG_GROUP_ID_LEN 32
#define AP_AVG_PROTO        "/apiary/avg/allreduce/1"
#define AP_AVG_MAX_ELEMS    (1ull << 34) /* 16 G elements */

typedef struct ap_avg_member {
    ap_peer_id_t id;
    ap_avg_role_t role;
    double up, down; /* bytes/s, as declared by the peer (measured in rounds) */
} ap_avg_member_t;

/* A group as the leader announced it: every member holds the same copy. */
typedef struct ap_avg_group {
    uint8_t id[AP_AVG_GROUP_ID_LEN];
    const ap_avg_member_t *members; /* ordered; borrowed for the call only */
    size_t n;
} ap_avg_group_t;

/* Chunk codecs (the wire's codec byte; the same numbers as apiary/compress.h).
 * Results travel with the same codec as the data. */
typedef enum ap_avg_codec {
    AP_AVG_CODEC_F32 = 0,        /* raw float32, exact */
    AP_AVG_CODEC_FP16 = 1,       /* IEEE half */
    AP_AVG_CODEC_BF16 = 2,       /* bfloat16 */
    AP_AVG_CODEC_UNIFORM8 = 4,   /* 8-bit uniform bins over mean ± 6 std */
    AP_AVG_CODEC_BLOCKWISE8 = 6, /* 8-bit blockwise dynamic codebook */
} ap_avg_codec_t;

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
     * N = a fixed lead of N chunks; AP_AVG_LEAD_OFF = no pacing (up to the
     * stream window). */
    uint32_t max_lead_chunks;
} ap_allreduce_opts_t;

/* ap_allreduce_opts_t.max_lead_chunks: no pacing (data runs ahead of the
 * results up to the stream window). */
#define AP_AVG_LEAD_OFF UINT32_MAX

typedef struct ap_allreduce_result {
    int status;               /* 0, AP_ECANCELED, or the error that stopped the round */
    uint64_t elems;           /* vector length */
    uint64_t elems_averaged;  /* elements replaced by a group average (receivers) */
    double averaged_fraction; /* elems_averaged / elems (receivers; 1.0 for aux) */
    uint32_t parts_failed;    /* parts whose reducer failed (stayed local, wholly or partly) */
    uint32_t senders_dropped; /* senders this peer's reducer dropped (failed, stalled, bad) */
    uint32_t senders_used;    /* senders that delivered this peer's whole part */
    uint64_t my_part_elems;   /* elements this peer reduced */
    uint64_t bytes_sent, bytes_received; /* chunk payload bytes of this round */
    uint64_t elapsed_us;
    double predicted_s; /* the LP bound for the group: t·P·4 */
} ap_allreduce_result_t;

typedef struct ap_avg_service ap_avg_service_t;
typedef struct ap_allreduce ap_allreduce_t;

/* Called once per round on the loop thread when the round is over and every
 * stream of it is closed. res is valid during the call only. The round object
 * is freed right after done returns. */
typedef void (*ap_allreduce_done_fn)(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res);

/* The per-node service: listens on AP_AVG_PROTO and routes incoming streams to
 * the running round with the same group id (a stream that arrives before its
 * round starts waits, paused, up to 10 s; at most 256 such streams). Loop
 * thread. Free only when no round runs (AP_EBUSY otherwise). */
AP_EXPORT int ap_avg_service_new(ap_rt_t *rt, ap_avg_service_t **out);
AP_EXPORT int ap_avg_service_free(ap_avg_service_t *svc);

/* Blocking forms for a user thread (NOT the loop thread) of a node of the
 * real driver (include/apiary/node.h): they run ap_avg_service_new / _free
 * on rt's loop and wait. rt is the node the service lives on. */
AP_EXPORT int ap_avg_service_new_sync(ap_rt_t *rt, ap_avg_service_t **out);
AP_EXPORT int ap_avg_service_free_sync(ap_rt_t *rt, ap_avg_service_t *svc);

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

/* ---- Moshpit groups ---------------------------------------------------------
 *
 * Peers sit on a virtual d-dimensional grid. In round r the active dimension
 * is r mod d, and the peers that share every OTHER coordinate form a group:
 * its key is BLAKE2b-256(prefix, r, those coordinates). After the round a
 * peer's coordinate on the active dimension becomes its index in the group,
 * so the next round mixes peers that were in different groups. On a full
 * s^d grid, d rounds give every peer the exact global mean (tested on 16x16);
 * matchmaking (ap_avg_match_t.key) looks peers up by this key. */

#define AP_AVG_MOSHPIT_MAX_DIMS 8

/* key = BLAKE2b-256(prefix || round || coords except dimension round mod d).
 * prefix is any run-wide name (e.g. the experiment). AP_EINVAL if dims is 0
 * or > AP_AVG_MOSHPIT_MAX_DIMS. Any thread. */
AP_EXPORT int ap_avg_moshpit_key(const char *prefix, const uint32_t *coords, int dims,
                                 uint64_t round, uint8_t key[AP_AVG_GROUP_ID_LEN]);
/* Sets coords[round mod dims] = index (this peer's index in its group). */
AP_EXPORT int ap_avg_moshpit_advance(uint32_t *coords, int dims, uint64_t round, uint32_t index);

/* ---- the Averager ------------------------------------------------------------
 *
 * Owns a fixed set of float32 tensors (one contiguous, pre-faulted buffer) and
 * averages them with a group, in place, one step at a time. The user writes
 * the tensors through ap_averager_tensor() only while no step runs. */

typedef enum ap_avg_stage {
    AP_AVG_STAGE_LOOKING = 1, /* looking for a group (matchmaking) */
    AP_AVG_STAGE_RUNNING = 2, /* the all-reduce round runs */
    AP_AVG_STAGE_DONE = 3,    /* finished; see the result for the averaged fraction */
    AP_AVG_STAGE_FAILED = 4,  /* canceled or could not run */
} ap_avg_stage_t;

typedef struct ap_averager_opts {
    ap_avg_role_t role;
    /* Declared bandwidth in bytes/s. 0 = the measured estimate: an EWMA of
     * the payload rates of this peer's past rounds (starts at 1 MB/s). */
    double up, down;
    ap_allreduce_opts_t round; /* chunk size, codec, min share, deadlines */
} ap_averager_opts_t;

typedef struct ap_averager ap_averager_t;
typedef struct ap_avg_step ap_avg_step_t;

/* Creates an averager over ntensors tensors of sizes[i] elements (zeroed).
 * Loop thread. AP_EINVAL if the total exceeds AP_AVG_MAX_ELEMS. */
AP_EXPORT int ap_averager_new(ap_avg_service_t *svc, const size_t *sizes, size_t ntensors,
                              const ap_averager_opts_t *opts, ap_averager_t **out);
/* AP_EBUSY while a step runs. Loop thread. */
AP_EXPORT int ap_averager_free(ap_averager_t *av);
/* Blocking forms for a user thread of a node of the real driver: run
 * ap_averager_new / _free on the loop of rt (the service's node) and wait. */
AP_EXPORT int ap_averager_new_sync(ap_rt_t *rt, ap_avg_service_t *svc, const size_t *sizes,
                                   size_t ntensors, const ap_averager_opts_t *opts,
                                   ap_averager_t **out);
AP_EXPORT int ap_averager_free_sync(ap_rt_t *rt, ap_averager_t *av);
/* Tensor i (owned by the averager, valid until ap_averager_free); NULL if out
 * of range. Write it only while no step runs. */
AP_EXPORT float *ap_averager_tensor(ap_averager_t *av, size_t i, size_t *n_elems);
/* Whether a step runs (loop thread). */
AP_EXPORT bool ap_averager_running(const ap_averager_t *av);
/* The bandwidth this peer declares in its next group (configured or measured). */
AP_EXPORT void ap_averager_bandwidth(const ap_averager_t *av, double *up, double *down);
/* The member entry this peer contributes to a group (id, role, bandwidth). */
AP_EXPORT void ap_averager_member(const ap_averager_t *av, ap_avg_member_t *out);

typedef void (*ap_avg_step_fn)(ap_rt_t *rt, void *arg, ap_avg_step_t *step);

/* Starts one step in group g (copied) with this peer's weight; deadline_at_us
 * (ap_rt_now_us time, 0 = none) caps the round. cb (may be NULL) runs on the
 * loop thread when the step is DONE or FAILED. *out is the handle: poll it,
 * cancel it, and free it with ap_avg_step_free. AP_EBUSY if a step runs.
 * Loop thread. */
AP_EXPORT int ap_averager_step_group(ap_averager_t *av, const ap_avg_group_t *g, double weight,
                                     uint64_t deadline_at_us, ap_avg_step_fn cb, void *arg,
                                     ap_avg_step_t **out);
AP_EXPORT ap_avg_stage_t ap_avg_step_stage(const ap_avg_step_t *st);
/* The round's result once DONE or FAILED, else NULL. Valid until freed. */
AP_EXPORT const ap_allreduce_result_t *ap_avg_step_result(const ap_avg_step_t *st);
/* Cancels a running step (it ends FAILED with AP_ECANCELED; cb still runs). */
AP_EXPORT void ap_avg_step_cancel(ap_avg_step_t *st);
/* Frees the handle; a running step is canceled and freed when it ends. */
AP_EXPORT void ap_avg_step_free(ap_avg_step_t *st);

/* Blocking form for a user thread (NOT the loop thread): runs
 * ap_averager_step_group on the loop thread through ap_rt_post and waits for
 * the end. g is copied before returning. Returns the start error, or the
 * round's status; *res (may be NULL) gets the result. */
AP_EXPORT int ap_averager_step_group_wait(ap_averager_t *av, const ap_avg_group_t *g, double weight,
                                          uint64_t deadline_at_us, ap_allreduce_result_t *res);

/* ---- matchmaking over the DHT ----------------------------------------------
 *
 * Peers looking for a group declare themselves in the DHT dictionary of the
 * group key (subkey "[owner:<PeerID>]", owner-signed; value: role, declared
 * bandwidth, addresses, and the expiration = when the peer stops looking).
 * Searchers are totally ordered by (expiration, PeerID). A peer only ever asks
 * a peer EARLIER than itself to lead it, so the wait-for graph is acyclic and
 * no deadlock can form (no timeout is needed to break one). The earliest
 * peer of a group leads: it answers each join with "rejected" (with a
 * reason), "redirect" (it follows a better leader itself), "full", or holds
 * it and answers "begin" once the group reaches target_group_size, or at its
 * expiration if it has min_group_size members. "begin" carries the group id,
 * the peer order (leader first, then by the order above) and what each
 * declared. A follower that starts following a leader redirects its own
 * waiting followers to it. Details: docs/averaging.md, "Matchmaking".
 *
 * Everything runs on the loop thread of the runtime (sans-I/O). */

#define AP_AVG_MATCH_PROTO "/apiary/avg/match/1"

typedef struct ap_avg_matchmaker ap_avg_matchmaker_t;

typedef struct ap_avg_match {
    const uint8_t *key;         /* group key: a run-wide name, or ap_avg_moshpit_key(); borrowed */
    size_t key_len;             /* 1..256 bytes */
    uint32_t target_group_size; /* begin as soon as the group has this many (0 = 16; ≤ 256) */
    uint32_t min_group_size;    /* at the deadline begin if ≥ this many (0 = 2; ≥ 2) */
    uint64_t deadline_at_us;    /* when looking ends (ap_rt_now_us time); required */
    uint64_t poll_us;           /* re-read the DHT this often while looking (0 = 200 ms) */
    /* A follower waits for its leader's answer up to its own deadline plus
     * this (0 = 2 s): the leader expires first, so its answer is due by then. */
    uint64_t answer_grace_us;
} ap_avg_match_t;

/* The matchmaker of one node: registers AP_AVG_MATCH_PROTO on the service's
 * runtime and declares through dht (same runtime; borrowed, must outlive
 * it). Loop thread. */
AP_EXPORT int ap_avg_matchmaker_new(ap_avg_service_t *svc, ap_dht_t *dht,
                                    ap_avg_matchmaker_t **out);
/* AP_EBUSY while a search runs. Loop thread. */
AP_EXPORT int ap_avg_matchmaker_free(ap_avg_matchmaker_t *mm);

/* Blocking forms for a user thread of a node of the real driver: run
 * ap_avg_matchmaker_new / _free on the loop of rt (the service's node). */
AP_EXPORT int ap_avg_matchmaker_new_sync(ap_rt_t *rt, ap_avg_service_t *svc, ap_dht_t *dht,
                                         ap_avg_matchmaker_t **out);
AP_EXPORT int ap_avg_matchmaker_free_sync(ap_rt_t *rt, ap_avg_matchmaker_t *mm);

typedef struct ap_avg_search ap_avg_search_t;
/* status 0: g is the group (valid during the call only; this peer is in it).
 * Else AP_ETIMEDOUT (no group of min_group_size by the deadline),
 * AP_ECANCELED, or the error that stopped the search. The search object is
 * freed after the callback returns. */
typedef void (*ap_avg_match_fn)(ap_rt_t *rt, void *arg, int status, const ap_avg_group_t *g);

/* Looks for a group as member self (its id must be this node's). One search
 * per key per node at a time (AP_EBUSY). cb runs exactly once, never inside
 * this call. *out (may be NULL) is valid until cb runs. Loop thread. */
AP_EXPORT int ap_avg_match_start(ap_avg_matchmaker_t *mm, const ap_avg_match_t *m,
                                 const ap_avg_member_t *self, ap_avg_match_fn cb, void *arg,
                                 ap_avg_search_t **out);
/* Ends the search: cb runs with AP_ECANCELED before this returns; waiting
 * followers are told "rejected". */
AP_EXPORT void ap_avg_match_cancel(ap_avg_search_t *s);

/* One step with matchmaking: stage LOOKING until a group is found, then
 * RUNNING as ap_averager_step_group (the round's deadline comes from the
 * averager's round options). If no group forms, the step ends FAILED with
 * the search's status in the result. cb, *out, cancel and free as in
 * ap_averager_step_group. Loop thread. */
AP_EXPORT int ap_averager_step(ap_averager_t *av, ap_avg_matchmaker_t *mm, const ap_avg_match_t *m,
                               double weight, ap_avg_step_fn cb, void *arg, ap_avg_step_t **out);
/* The group the step ran in (valid once RUNNING; NULL before): its size. */
AP_EXPORT size_t ap_avg_step_group_size(const ap_avg_step_t *st);

/* Blocking form of ap_averager_step for a user thread (NOT the loop thread)
 * of a node of the real driver: looks for a group and averages in it, then
 * returns. m is copied (its key must stay valid until this returns). If
 * look_us > 0 the search's deadline is look_us after the step starts on the
 * loop (m->deadline_at_us is then ignored: a user thread cannot read the
 * loop's clock); else m->deadline_at_us is used as given. Returns the start
 * error or the step's status (0: *res tells the averaged fraction;
 * AP_ETIMEDOUT: no group formed). res and group_size may be NULL. Write the
 * tensors only while no step runs, i.e. between calls. */
AP_EXPORT int ap_averager_step_sync(ap_rt_t *rt, ap_averager_t *av, ap_avg_matchmaker_t *mm,
                                    const ap_avg_match_t *m, uint64_t look_us, double weight,
                                    ap_allreduce_result_t *res, size_t *group_size);

#ifdef __cplusplus
}
#endif
#endif
