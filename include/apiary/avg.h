/* Apiary — decentralized averaging, the common part (prefix ap_avg_): roles,
 * DeDLOC load balancing, groups, the per-node averaging service, Moshpit group
 * keys and matchmaking over the DHT. The all-reduce round is in
 * apiary/allreduce.h, the Averager (tensors averaged step by step) in
 * apiary/averager.h.
 *
 * Load balancing and butterfly all-reduce:
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
 * Groups come from matchmaking over the DHT (ap_avg_match_start, below;
 * ap_averager_step uses it), or from the caller (ap_averager_step_group). */
#ifndef APIARY_AVG_H
#define APIARY_AVG_H

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

/* ---- groups and the averaging service ----------------------------------------- */

#define AP_AVG_GROUP_ID_LEN 32
#define AP_AVG_PROTO        "/apiary/avg/allreduce/1"

typedef struct ap_avg_member {
    ap_peer_id_t id;
    ap_avg_role_t role;
    double up, down; /* bytes/s, as declared by the peer (measured in rounds) */
} ap_avg_member_t;

/* Most bytes a peer may give its group (ap_avg_match_t.gather). */
#define AP_AVG_GATHER_MAX 512

/* One member's gathered bytes (len 0: it gave none). */
typedef struct ap_avg_gather {
    const uint8_t *data;
    size_t len;
} ap_avg_gather_t;

/* A group as the leader announced it: every member holds the same copy. */
typedef struct ap_avg_group {
    uint8_t id[AP_AVG_GROUP_ID_LEN];
    const ap_avg_member_t *members; /* ordered; borrowed for the call only */
    size_t n;
    /* Set by matchmaking in the group it hands its callback: n entries, in
     * the members' order, what each member gave as ap_avg_match_t.gather
     * (borrowed for the call only). Never read from a group given to
     * ap_allreduce_start or ap_averager_step_group (it may be left unset). */
    const ap_avg_gather_t *gather;
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

typedef struct ap_avg_service ap_avg_service_t;

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
    /* Peers to keep out (e.g. banned ones, ap_btard_banlist_has): never
     * joined as a leader, their joins rejected. NULL = nobody. Called on the
     * loop thread; arg borrowed for the search's lifetime. */
    bool (*exclude)(void *arg, const ap_peer_id_t *peer);
    void *exclude_arg;
    /* This peer's bytes for its group (hivemind's gather): every member of
     * the group it joins receives them (ap_avg_group_t.gather); they never go
     * to the DHT. Up to AP_AVG_GATHER_MAX bytes (AP_EINVAL above); copied at
     * start. NULL / 0: none. */
    const uint8_t *gather;
    size_t gather_len;
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

#ifdef __cplusplus
}
#endif
#endif
