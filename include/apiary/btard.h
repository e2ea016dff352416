/* Apiary — Byzantine-tolerant aggregation (BTARD building blocks).
 *
 * Two pieces: CenteredClip (a robust average) and MPRNG (shared randomness
 * no participant can bias). Both are sans-I/O: they compute on their inputs
 * and hand messages back to the caller, who carries them.
 *
 * CenteredClip: a robust weighted average of n vectors. Starting from the
 * coordinate-wise weighted median v_0, it iterates
 *
 *     v_{t+1} = v_t + sum_i w_i (x_i - v_t) min(1, tau / |x_i - v_t|) / sum_i w_i
 *
 * until the step |v_{t+1} - v_t| <= eps or max_iter steps were taken. With
 * b of n equally weighted inputs replaced by arbitrary vectors, and the honest
 * inputs within tau of the result, the result lies within b*tau/(n - b) of the
 * honest inputs' mean (each Byzantine input moves the fixed point by at most
 * tau / n). With tau at least every input's distance from v_0 the first step
 * lands on the weighted mean.
 *
 * Determinism: the result depends only on the inputs, their order and the
 * configuration. The AVX2 kernels (chosen at run time; APIARY_NO_SIMD=1 forces
 * the scalar reference) give the same bits as the scalar reference: every
 * sum is taken in double in a fixed order, every product rounded, no fused
 * multiply-add.
 *
 * Thread safety: the functions keep no global state beyond the kernel choice;
 * a workspace belongs to one thread at a time. */
#ifndef APIARY_BTARD_H
#define APIARY_BTARD_H

#include "apiary/avg.h"
#include "apiary/common.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/peer.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of every hash, seed and MPRNG value. */
#define AP_BTARD_HASH_LEN 32

/* Hard caps on one CenteredClip call. */
#define AP_BTARD_CLIP_MAX_INPUTS 4096
#define AP_BTARD_CLIP_MAX_ITER   100000

typedef struct ap_btard_clip_cfg {
    double tau;   /* clipping radius, > 0 (may be INFINITY: no clipping) */
    int max_iter; /* steps at most, 1..AP_BTARD_CLIP_MAX_ITER */
    double eps;   /* stop when a step moves the estimate by <= eps (L2), >= 0 */
} ap_btard_clip_cfg_t;

/* tau = 1, max_iter = 100, eps = 1e-6. */
AP_EXPORT ap_btard_clip_cfg_t ap_btard_clip_cfg_default(void);

typedef struct ap_btard_clip_stats {
    int iters;        /* steps taken (0 if only the median was computed) */
    bool converged;   /* the last step was <= eps */
    int clipped;      /* inputs farther than tau from the estimate the last step started at */
    int excluded;     /* inputs left out: weight 0, or a NaN/Inf element */
    double last_step; /* L2 length of the last step (0 if iters == 0) */
} ap_btard_clip_stats_t;

/* Scratch memory reused across calls (grows to the largest n and d seen).
 * One thread at a time. ap_btard_clip_ws_free(NULL) is a no-op. */
typedef struct ap_btard_clip_ws ap_btard_clip_ws_t;
AP_EXPORT ap_btard_clip_ws_t *ap_btard_clip_ws_new(void);
AP_EXPORT void ap_btard_clip_ws_free(ap_btard_clip_ws_t *ws);

/* CenteredClip of the n vectors x[0..n-1], each of d floats, with weights w
 * (NULL = all 1; each finite and >= 0). Writes the d floats of the result to
 * out (which may alias no input). Inputs with weight 0 or any NaN/Inf element
 * are left out (counted in stats->excluded). ws may be NULL (the call then
 * allocates and frees its own scratch). stats may be NULL.
 * Errors: AP_EINVAL (bad configuration, n or d of 0, n over the cap, a
 * negative or non-finite weight, or every input left out), AP_ENOMEM. The
 * caller keeps ownership of every buffer. */
AP_EXPORT AP_NODISCARD int ap_btard_clip(ap_btard_clip_ws_t *ws, const float *const *x,
                                         const double *w, size_t n, size_t d,
                                         const ap_btard_clip_cfg_t *cfg, float *out,
                                         ap_btard_clip_stats_t *stats);

/* The CenteredClip residual at v: r = sum_i w_i (x_i - v) min(1, tau/|x_i - v|)
 * / sum_i w_i over the inputs ap_btard_clip would use; at a fixed point r = 0.
 * Writes d doubles to r and returns |r| (L2) in *norm. Same errors as
 * ap_btard_clip. */
AP_EXPORT AP_NODISCARD int ap_btard_clip_residual(const float *const *x, const double *w, size_t n,
                                                  size_t d, double tau, const float *v, double *r,
                                                  double *norm);

/* ButterflyClip: CenteredClip as the part reducer of the butterfly
 * all-reduce (apiary/allreduce.h). Set ap_allreduce_opts_t.reduce =
 * ap_btard_butterfly_clip and .reduce_arg = an ap_btard_bclip_t that outlives
 * the round: each reducer then aggregates the peers' copies of its part with
 * CenteredClip(cfg) instead of the weighted mean. cfg.tau is a distance over
 * one part (its L2 norm). ws: scratch, may be NULL (allocated per call); the
 * caller owns it. last: the stats of the latest call. One thread at a time
 * (the loop thread of the rounds that use it). */
typedef struct ap_btard_bclip {
    ap_btard_clip_cfg_t cfg;
    ap_btard_clip_ws_t *ws;
    ap_btard_clip_stats_t last;
} ap_btard_bclip_t;

/* An ap_allreduce_reduce_fn: arg is an ap_btard_bclip_t. 0, AP_EINVAL,
 * AP_ENOMEM (as ap_btard_clip). */
AP_EXPORT int ap_btard_butterfly_clip(void *arg, const float *const *x, const double *w, size_t n,
                                      size_t d, float *out, uint32_t *clipped);

/* ---- verification primitives --------------------------------------------------
 *
 * The pieces BTARD's checks are built from. All are deterministic functions
 * of their inputs, so every peer (and anyone auditing an accusation) gets the
 * same answer from the same public data. */

/* BLAKE2b-256 of "apiary/btard/floats" || le64(n) || the n floats as
 * little-endian bytes: the commitment to a part or an aggregate. */
AP_EXPORT void ap_btard_hash_floats(const float *x, size_t n, uint8_t out[AP_BTARD_HASH_LEN]);

/* A pseudo-random unit direction: z[k] = +-1/sqrt(n), the signs from a
 * ChaCha20 stream keyed by BLAKE2b-256("apiary/btard/dir" || seed || le32(part)). */
AP_EXPORT void ap_btard_direction(const uint8_t seed[AP_BTARD_HASH_LEN], uint32_t part, size_t n,
                                  float *z);

/* A peer's check values for one part it sent (x) and the aggregate it got
 * (v): *dist = |x - v| and *proj = min(1, tau / |x - v|) <x - v, z>. At a
 * CenteredClip fixed point the weighted sum of proj over the inputs is 0. */
AP_EXPORT void ap_btard_clip_proj(const float *x, const float *v, const float *z, size_t n,
                                  double tau, double *dist, double *proj);

/* The aggregate check: |sum_i w_i proj_i / sum_i w_i| <= tol (w NULL = all 1). */
AP_EXPORT bool ap_btard_proj_sum_ok(const double *proj, const double *w, size_t n, double tol);

/* The minibatch of peer `peer` for a step: batch indices drawn uniformly
 * (with replacement) from [0, n_examples), from a ChaCha20 stream keyed by
 * BLAKE2b-256("apiary/btard/batch" || seed || le32(peer)). n_examples > 0. */
AP_EXPORT void ap_btard_minibatch(const uint8_t seed[AP_BTARD_HASH_LEN], uint32_t peer,
                                  uint64_t n_examples, size_t batch, uint64_t *idx);

/* k distinct validators among n peers and a target for each (never itself),
 * uniformly from the seed (stream key "apiary/btard/validators"). k <= n,
 * n >= 2, else AP_EINVAL. */
AP_EXPORT AP_NODISCARD int ap_btard_pick_validators(const uint8_t seed[AP_BTARD_HASH_LEN], size_t n,
                                                    size_t k, uint32_t *validators,
                                                    uint32_t *targets);

/* Whether a recomputed gradient matches a committed one within floating-point
 * slack: |a - b| <= atol + rtol |b| (L2), and both finite. */
AP_EXPORT bool ap_btard_grad_match(const float *a, const float *b, size_t n, double rtol,
                                   double atol);

/* Tests and benches: force the scalar kernels (true) or the best (false). */
AP_EXPORT void ap_btard_force_scalar(bool scalar);
/* Name of the kernels in use: "scalar" or "avx2". */
AP_EXPORT const char *ap_btard_kernels_name(void);

/* ---- MPRNG: shared randomness by commit and reveal --------------------------
 *
 * n peers in an agreed order derive a 256-bit seed that none of them can
 * bias or predict while at least one is honest:
 *   1. each participant picks a random 256-bit value r_i and broadcasts a
 *      signed commitment h_i = BLAKE2b-256("apiary/btard/mprng/commit" || ctx
 *      || attempt || PeerID_i || r_i);
 *   2. once it holds every participant's commitment it broadcasts r_i, signed;
 *   3. seed = BLAKE2b-256("apiary/btard/mprng/seed" || ctx || attempt ||
 *      (index_i || r_i) for every participant in peer order).
 * A participant that sends no commitment or no reveal before the phase's
 * deadline, reveals a value that does not match its commitment, or signs two
 * different commitments for one attempt is excluded for the rest of the round
 * (its fault is recorded), and the round restarts as attempt + 1 without it,
 * every participant with a fresh value. The last two faults are provable: the
 * two signed messages are evidence anyone can check
 * (ap_btard_mprng_check_evidence).
 *
 * Driving it: ap_btard_mprng_start() with a fresh value whenever the state is
 * NEED_VALUE; broadcast every message ap_btard_mprng_outbox() yields to every
 * other peer; pass every received message to ap_btard_mprng_receive() and,
 * when it returns 1, relay that message to every other peer (so a message one
 * honest peer saw reaches all); call ap_btard_mprng_deadline() when the
 * current phase's deadline passes. Values must come from a cryptographic RNG
 * in deployment; the state machine takes them from the caller so runs replay.
 *
 * Messages are capped at AP_BTARD_MSG_MAX bytes; malformed ones, bad
 * signatures and senders outside the group are refused with an error return
 * and change nothing. */

#define AP_BTARD_MSG_MAX         512
#define AP_BTARD_MPRNG_MAX_PEERS 1024

/* Signs msg with the local peer's identity key (e.g. ap_rt_sign). */
typedef void (*ap_btard_sign_fn)(void *arg, const uint8_t *msg, size_t len,
                                 uint8_t sig[AP_ED25519_SIG_LEN]);

typedef enum ap_btard_mprng_state {
    AP_BTARD_MPRNG_NEED_VALUE = 1, /* waiting for ap_btard_mprng_start */
    AP_BTARD_MPRNG_COMMITTING = 2, /* committed; waiting for the others' commitments */
    AP_BTARD_MPRNG_REVEALING = 3,  /* revealed; waiting for the others' reveals */
    AP_BTARD_MPRNG_DONE = 4,       /* the seed is known */
} ap_btard_mprng_state_t;

typedef enum ap_btard_fault {
    AP_BTARD_FAULT_NONE = 0,
    AP_BTARD_FAULT_NO_COMMIT = 1,    /* no commitment before the deadline */
    AP_BTARD_FAULT_NO_REVEAL = 2,    /* no reveal before the deadline */
    AP_BTARD_FAULT_BAD_REVEAL = 3,   /* reveal does not match the commitment (provable) */
    AP_BTARD_FAULT_EQUIVOCATION = 4, /* two different commitments (provable) */
    /* an aggregator signed a check of its part whose projections do not sum
     * to ~0: its aggregate is no CenteredClip fixed point of the inputs it
     * lists (provable by that one message; the verified step below) */
    AP_BTARD_FAULT_BAD_AGGREGATE = 5,
    /* the verified step's gradient check: a member's committed part is not
     * the gradient a validator (and every judge) recomputes from the public
     * state and the member's seeded minibatch */
    AP_BTARD_FAULT_BAD_GRADIENT = 6,
    /* an accusation that does not hold: the accuser was not the target's
     * validator, or the target's part matches the recomputation */
    AP_BTARD_FAULT_FALSE_ACCUSATION = 7,
    /* the verified step: two different signed StepCommits, or two different
     * signed AggChecks, by one member for one step (an honest member signs
     * each once and relays the others' unchanged): an aggregator telling
     * different members it produced different aggregates, i.e. sending
     * different results to different peers (provable by the two messages) */
    AP_BTARD_FAULT_STEP_EQUIVOCATION = 8,
} ap_btard_fault_t;

/* Name of a fault ("no_commit", ...), "none" for NONE. Static string. */
AP_EXPORT const char *ap_btard_fault_name(ap_btard_fault_t f);

typedef struct ap_btard_mprng_cfg {
    uint8_t ctx[AP_BTARD_HASH_LEN]; /* the round's context (e.g. a hash of run id and step) */
    const ap_peer_id_t *peers;      /* the group in its agreed order; copied */
    size_t n;                       /* 1..AP_BTARD_MPRNG_MAX_PEERS */
    size_t self;                    /* this peer's index in peers */
    ap_btard_sign_fn sign;          /* signs as peers[self] */
    void *sign_arg;
} ap_btard_mprng_cfg_t;

typedef struct ap_btard_mprng ap_btard_mprng_t;

/* NULL on bad configuration (n out of range, self >= n, no sign function,
 * duplicate peers) or out of memory. The state starts at NEED_VALUE. */
AP_EXPORT ap_btard_mprng_t *ap_btard_mprng_new(const ap_btard_mprng_cfg_t *cfg);
AP_EXPORT void ap_btard_mprng_free(ap_btard_mprng_t *m);

/* Commits to value for the current attempt (state must be NEED_VALUE, else
 * AP_ESTATE) and queues the signed commitment in the outbox. */
AP_EXPORT AP_NODISCARD int ap_btard_mprng_start(ap_btard_mprng_t *m,
                                                const uint8_t value[AP_BTARD_HASH_LEN]);

/* Takes a received message. Returns 1 if it was new and valid (relay it;
 * a commitment for the next attempt counts, and is kept for then), 0 if it
 * changes nothing (a duplicate, an old attempt, an excluded sender), or AP_EMSGSIZE,
 * AP_ECORRUPT, AP_ENOTSUP, AP_EAUTH (bad signature), AP_EPROTO (another
 * round's context), AP_EPERM (sender not in the group). msg is not kept. */
AP_EXPORT AP_NODISCARD int ap_btard_mprng_receive(ap_btard_mprng_t *m, const uint8_t *msg,
                                                  size_t len);

/* The current phase's deadline passed: participants that have not sent the
 * phase's message are excluded (NO_COMMIT / NO_REVEAL) and, if any was, the
 * round restarts (state NEED_VALUE). Returns how many were excluded. */
AP_EXPORT int ap_btard_mprng_deadline(ap_btard_mprng_t *m);

/* Next message of this peer's to broadcast: true and (*msg, *len), valid until
 * the next call on m; false when there is none. */
AP_EXPORT bool ap_btard_mprng_outbox(ap_btard_mprng_t *m, const uint8_t **msg, size_t *len);

AP_EXPORT ap_btard_mprng_state_t ap_btard_mprng_state(const ap_btard_mprng_t *m);
AP_EXPORT uint32_t ap_btard_mprng_attempt(const ap_btard_mprng_t *m);
/* The seed; AP_ESTATE unless the state is DONE. */
AP_EXPORT AP_NODISCARD int ap_btard_mprng_seed(const ap_btard_mprng_t *m,
                                               uint8_t seed[AP_BTARD_HASH_LEN]);
/* Why peer i is excluded (NONE while it takes part). */
AP_EXPORT ap_btard_fault_t ap_btard_mprng_fault(const ap_btard_mprng_t *m, size_t i);
/* Evidence of a provable fault of peer i: the two signed messages, valid
 * while m lives. AP_ENOTFOUND if there is none. */
AP_EXPORT int ap_btard_mprng_evidence(const ap_btard_mprng_t *m, size_t i, const uint8_t **a,
                                      size_t *alen, const uint8_t **b, size_t *blen);
/* Checks evidence against accused for the round ctx: 0 and *fault set if the
 * two messages prove BAD_REVEAL or EQUIVOCATION, AP_EINVAL if they prove
 * nothing, or a decode error. Needs nothing but the messages. */
AP_EXPORT AP_NODISCARD int ap_btard_mprng_check_evidence(const uint8_t ctx[AP_BTARD_HASH_LEN],
                                                         const ap_peer_id_t *accused,
                                                         const uint8_t *a, size_t alen,
                                                         const uint8_t *b, size_t blen,
                                                         ap_btard_fault_t *fault);

/* ---- MPRNG over the runtime -----------------------------------------------
 *
 * Runs MPRNG rounds between nodes: every message goes to every other group
 * member as a unary RPC on AP_BTARD_MPRNG_PROTO (empty response), every new
 * valid message is relayed once, each phase has a deadline. One service per
 * node carries any number of concurrent rounds, told apart by their context;
 * messages of a round not started here yet are kept (at most
 * AP_BTARD_PENDING_PER_PEER per sender, AP_BTARD_PENDING_MAX in all) and
 * handed to it when it starts. A peer's value for an attempt is a hash of its
 * signature on the round's context and attempt and of 32 bytes of the
 * runtime's RNG (see docs/btard.md). Loop thread only. */

#define AP_BTARD_MPRNG_PROTO      "/apiary/btard/mprng/1"
#define AP_BTARD_PENDING_PER_PEER 8
#define AP_BTARD_PENDING_MAX      1024

typedef struct ap_btard_svc ap_btard_svc_t;
typedef struct ap_btard_round ap_btard_round_t;

/* Registers the protocol handler on rt. AP_EEXIST if one is registered. */
AP_EXPORT AP_NODISCARD int ap_btard_svc_new(ap_rt_t *rt, ap_btard_svc_t **out);
/* Cancels every round still running (their done callbacks run with
 * AP_ECANCELED) and unregisters the handler. NULL is a no-op. */
AP_EXPORT void ap_btard_svc_free(ap_btard_svc_t *svc);

/* Misbehaviour for experiments and tests (off unless asked). */
typedef enum ap_btard_mprng_attack {
    AP_BTARD_MPRNG_HONEST = 0,
    AP_BTARD_MPRNG_WITHHOLD_REVEAL = 1, /* commits, never reveals */
} ap_btard_mprng_attack_t;

/* Result of a round: status 0 and the seed, or AP_ETIMEDOUT (no seed after
 * max_attempts attempts), AP_ECANCELED. m is the round's state machine (for
 * ap_btard_mprng_fault and the evidence), valid during the callback only. */
typedef void (*ap_btard_round_fn)(void *arg, int status, const uint8_t seed[AP_BTARD_HASH_LEN],
                                  const ap_btard_mprng_t *m);

typedef struct ap_btard_round_cfg {
    uint8_t ctx[AP_BTARD_HASH_LEN];
    const ap_peer_id_t *peers; /* the group in its agreed order, including this node; copied */
    size_t n;
    uint64_t phase_timeout_us; /* deadline of each phase; 0 = 5 s */
    int max_attempts;          /* 0 = n */
    ap_btard_mprng_attack_t attack;
    ap_btard_round_fn done; /* called exactly once, never from inside ap_btard_round_start */
    void *arg;
} ap_btard_round_cfg_t;

/* Starts a round. AP_EINVAL (bad configuration, this node not in peers),
 * AP_EEXIST (a round with this context runs), AP_ENOMEM. The round frees
 * itself after done returns. */
AP_EXPORT AP_NODISCARD int ap_btard_round_start(ap_btard_svc_t *svc,
                                                const ap_btard_round_cfg_t *cfg);

/* ---- global bans ------------------------------------------------------------
 *
 * A peer proven to have cheated is banned for the whole run: the proof goes
 * into the DHT as one entry of the run's ban dictionary, key
 * "btard/bans/<64 hex digits of the run id>", subkey = the banned PeerID's
 * bytes, value = an encoded Ban (proto/btard.proto) carrying the two signed
 * messages. Storing nodes that run ap_btard_ban_validator refuse any entry
 * under a ban key that does not prove its subkey's peer guilty, and readers
 * check every entry again, so nobody can ban an honest peer. MPRNG rounds of
 * a run use ap_btard_round_ctx as their context, so evidence names the run. */

#define AP_BTARD_BAN_PREFIX  "btard/bans/"
#define AP_BTARD_BAN_KEY_LEN (sizeof AP_BTARD_BAN_PREFIX - 1 + 2 * AP_BTARD_HASH_LEN)
#define AP_BTARD_BAN_MAX     (2 * AP_BTARD_STEP_MSG_MAX + 128) /* bytes of a Ban */

/* ctx = BLAKE2b-256("apiary/btard/round" || run || le64(step) || le32(round)). */
AP_EXPORT void ap_btard_round_ctx(const uint8_t run[AP_BTARD_HASH_LEN], uint64_t step,
                                  uint32_t round, uint8_t ctx[AP_BTARD_HASH_LEN]);

/* Writes the run's ban key (AP_BTARD_BAN_KEY_LEN bytes plus a NUL). */
AP_EXPORT void ap_btard_ban_key(const uint8_t run[AP_BTARD_HASH_LEN],
                                char key[AP_BTARD_BAN_KEY_LEN + 1]);

typedef struct ap_btard_ban {
    uint8_t run[AP_BTARD_HASH_LEN];
    uint64_t step;
    uint32_t round;
    ap_peer_id_t peer;
    ap_btard_fault_t fault;     /* BAD_REVEAL, EQUIVOCATION or BAD_AGGREGATE */
    const uint8_t *ev_a, *ev_b; /* the two signed messages (borrowed); BAD_AGGREGATE:
                                 * ev_a = the signed AggCheck, ev_b empty */
    size_t ev_a_len, ev_b_len;
} ap_btard_ban_t;

/* Encodes b into out (cap >= AP_BTARD_BAN_MAX); *len gets the size.
 * AP_EINVAL if the evidence does not prove b->fault against b->peer. */
AP_EXPORT AP_NODISCARD int ap_btard_ban_encode(const ap_btard_ban_t *b, uint8_t *out, size_t cap,
                                               size_t *len);
/* Decodes a Ban value and checks that it proves peer guilty (and, if run is
 * not NULL, that it belongs to that run). On success *out holds the run,
 * step, round, peer and fault (its evidence pointers NULL). AP_EMSGSIZE,
 * AP_ECORRUPT, AP_EINVAL (proves nothing against peer, or another run). */
AP_EXPORT AP_NODISCARD int ap_btard_ban_check(const uint8_t *value, size_t len,
                                              const ap_peer_id_t *peer,
                                              const uint8_t run[AP_BTARD_HASH_LEN],
                                              ap_btard_ban_t *out);

/* A DHT validator (ap_dht_add_validator; arg unused): refuses records under a
 * key starting with AP_BTARD_BAN_PREFIX unless the key is a well-formed ban
 * key, the subkey a PeerID and the value a Ban proving that peer guilty in
 * that run. Other keys pass. */
AP_EXPORT int ap_btard_ban_validator(void *arg, const ap_dht_record_t *rec,
                                     const ap_peer_id_t *from_peer);

/* Stores a ban in the DHT (expiring at expiration_ms, wall clock). cb as for
 * ap_dht_store. */
AP_EXPORT AP_NODISCARD int ap_btard_ban_publish(ap_dht_t *dht, const ap_btard_ban_t *b,
                                                int64_t expiration_ms, ap_dht_store_fn cb,
                                                void *arg);

/* The peers banned in a run, as read from the DHT: every entry is checked
 * again; entries that prove nothing are skipped. banned (n of them, no
 * duplicates) is valid during the callback only. status as for ap_dht_get. */
typedef void (*ap_btard_bans_fn)(void *arg, int status, const ap_peer_id_t *banned, size_t n);
AP_EXPORT AP_NODISCARD int ap_btard_bans_fetch(ap_dht_t *dht, const uint8_t run[AP_BTARD_HASH_LEN],
                                               ap_btard_bans_fn cb, void *arg);

/* A set of banned peers, e.g. filled from ap_btard_bans_fetch and from the
 * local convictions, and handed to matchmaking as its exclude filter
 * (ap_avg_match_t.exclude = ap_btard_banlist_has, .exclude_arg = the list).
 * Holds at most AP_BTARD_BANLIST_MAX peers. One thread at a time. */
#define AP_BTARD_BANLIST_MAX 65536
typedef struct ap_btard_banlist ap_btard_banlist_t;
AP_EXPORT ap_btard_banlist_t *ap_btard_banlist_new(void);
AP_EXPORT void ap_btard_banlist_free(ap_btard_banlist_t *bl);
/* 1 if added, 0 if it was there, AP_ELIMIT when full, AP_ENOMEM. */
AP_EXPORT int ap_btard_banlist_add(ap_btard_banlist_t *bl, const ap_peer_id_t *peer);
/* bl is an ap_btard_banlist_t * (void * to fit ap_avg_match_t.exclude). */
AP_EXPORT bool ap_btard_banlist_has(void *bl, const ap_peer_id_t *peer);
AP_EXPORT size_t ap_btard_banlist_count(const ap_btard_banlist_t *bl);

/* ---- the verified step: commitments and the aggregation check ----------------
 *
 * After a ButterflyClip round (all-reduce whose reducer is
 * ap_btard_verified_clip), the members of the group check it over
 * AP_BTARD_STEP_PROTO (every message signed and relayed once, as MPRNG's):
 *   1. every member broadcasts a StepCommit: its weight, the hash
 *      (ap_btard_hash_floats) of each part it sent, of each aggregate it
 *      received, and of the aggregate it produced for its own part;
 *   2. the members run an MPRNG round (context ap_btard_round_ctx(run, step,
 *      1)) for the step's seed, unknown to anyone when it committed;
 *   3. every aggregator broadcasts an AggCheck of its part: for each input
 *      it used (its hash and weight) |x - v| and min(1, tau/|x - v|)
 *      <x - v, z>, z = ap_btard_direction(seed, part), v its aggregate;
 *   4. every member checks the entry of each of its own parts against its
 *      own copy and the aggregate it received and broadcasts a StepReport
 *      naming the parts it disputes.
 * Verdict, from the signed messages alone (the same at every member that got
 * them): an AggCheck whose weighted mean projection exceeds
 * AP_BTARD_PROJ_TOL * tau convicts its aggregator (AP_BTARD_FAULT_BAD_AGGREGATE;
 * that message is the ban's evidence); a part fails (nobody convicted) if its
 * commit or check is missing, its check names another aggregate than the
 * aggregator committed, a member received another aggregate than the one
 * committed, a committed input is missing from the check, or a member
 * disputes it. The step is to be applied only if no part failed. An honest
 * aggregator never signs a failing check: ap_btard_verified_clip iterates
 * until the residual is under half the tolerance, and the check is skipped
 * (the part fails) if it is not.
 * Gradient check (cfg.validators > 0 and cfg.grad): the seed picks the
 * validators and their targets; a validator recomputes its target's vector
 * and, for each part j whose check lists the target's committed input,
 * compares that entry's |x - v| and projection with those of the
 * recomputation against the aggregate v (slack AP_BTARD_GRAD_ATOL +
 * AP_BTARD_GRAD_RTOL |g - v|, twice that for the projection); on a mismatch
 * its signed StepReport accuses (target, j). Every member judges every
 * accusation the same way: a mismatch convicts the target
 * (AP_BTARD_FAULT_BAD_GRADIENT), a match or an accuser that is not the
 * target's validator convicts the accuser (AP_BTARD_FAULT_FALSE_ACCUSATION);
 * an accusation on a part the target disputed, whose check or aggregate is
 * missing, or whose check is on another seed than this member's, is not
 * judged, nor are the accusations of a member excluded from the MPRNG round. The provable MPRNG
 * faults of the step's round (bad_reveal, equivocation) convict too; a missed deadline (no_commit,
 * no_reveal) never does: the round goes on without that member, which is
 * listed in verdict.excluded (its own check is then on another seed, so its
 * part fails and the step is dropped). A step with a conviction is not
 * applied. Only bad_aggregate, bad_reveal and equivocation bans are
 * self-proving (ap_btard_ban_encode refuses the others: they are kept by
 * the members that judged them). */

#define AP_BTARD_STEP_PROTO     "/apiary/btard/step/1"
#define AP_BTARD_STEP_MAX_PEERS 64
#define AP_BTARD_STEP_MSG_MAX   8192
#define AP_BTARD_PROJ_TOL       1e-4 /* of tau: the aggregation check's tolerance */

/* One input of an aggregator's check. */
typedef struct ap_btard_agg_entry {
    uint8_t hash[AP_BTARD_HASH_LEN];
    double weight, dist, proj;
} ap_btard_agg_entry_t;

/* Whether n entries fail the check: a weight negative or not finite, a
 * value not finite, no weight at all, or |sum w proj / sum w| >
 * AP_BTARD_PROJ_TOL * tau (tau finite and > 0, else it fails too). */
AP_EXPORT bool ap_btard_agg_fails(const ap_btard_agg_entry_t *e, size_t n, double tau);

/* The recording reducer: ButterflyClip that also keeps the inputs and the
 * result of its latest call for the check. Same use as ap_btard_bclip_t
 * (reduce = ap_btard_verified_clip, reduce_arg = an ap_btard_vclip_t). It
 * runs at least 1000 steps with eps <= AP_BTARD_PROJ_TOL * tau / 4 and sets
 * `fixed` when the residual is within half the check's tolerance.
 * shift (experiments, 0 = honest): added to every element of the aggregate
 * it returns, the "Byzantine aggregator" attack. Buffers grow to the largest
 * call and are freed by ap_btard_vclip_close. One thread at a time. */
typedef struct ap_btard_vclip {
    ap_btard_bclip_t clip;
    float shift;
    /* the latest call (have = true until ap_btard_vclip_reset) */
    bool have, fixed;
    size_t n, d;
    float *copies; /* n * d */
    double *w;     /* n */
    float *out;    /* d */
    double *res;   /* d: scratch for the residual */
    size_t cap_copies, cap_n, cap_d;
} ap_btard_vclip_t;

AP_EXPORT int ap_btard_verified_clip(void *arg, const float *const *x, const double *w, size_t n,
                                     size_t d, float *out, uint32_t *clipped);
AP_EXPORT void ap_btard_vclip_reset(ap_btard_vclip_t *v);
AP_EXPORT void ap_btard_vclip_close(ap_btard_vclip_t *v);

typedef struct ap_btard_step_svc ap_btard_step_svc_t;

/* Registers AP_BTARD_STEP_PROTO on rt; steps run their MPRNG rounds on
 * mprng (which must outlive this service). AP_EEXIST if registered. */
AP_EXPORT AP_NODISCARD int ap_btard_step_svc_new(ap_rt_t *rt, ap_btard_svc_t *mprng,
                                                 ap_btard_step_svc_t **out);
/* Cancels the running steps (done with AP_ECANCELED). NULL is a no-op. */
AP_EXPORT void ap_btard_step_svc_free(ap_btard_step_svc_t *svc);

/* The outcome of a step, valid during the done callback only. */
typedef struct ap_btard_verdict {
    int status;        /* 0, AP_ECANCELED, or the MPRNG round's error (then apply = false) */
    bool apply;        /* every part passed: apply the aggregated step */
    uint32_t parts_ok; /* parts that passed */
    uint32_t parts_failed;
    uint32_t disputes;               /* parts disputed by some member */
    uint32_t accusations;            /* accusations judged (gradient check) */
    uint8_t seed[AP_BTARD_HASH_LEN]; /* the step's seed (status 0) */
    size_t nconvicted;               /* members proven to have cheated in this step */
    const ap_btard_ban_t *bans;      /* one per convicted member (its evidence borrowed) */
    /* members left out of the step's MPRNG round for a missed commit or
     * reveal deadline (no_commit, no_reveal): not convicted, since a slow
     * or departing honest peer misses deadlines too; the caller may leave
     * them out of its next groups */
    size_t nexcluded;
    const ap_peer_id_t *excluded;
    /* With cfg.state: the group's state is the one the most commitments in
     * hand name (ties: the smallest hash), and in_sync the members that
     * committed it. out_of_sync: this node's state is not it; the caller
     * should reload its state from in_sync members (an honest member that
     * missed a step, or applied one the others dropped, recovers so) */
    bool out_of_sync;
    size_t nin_sync;
    const ap_peer_id_t *in_sync;
} ap_btard_verdict_t;

typedef void (*ap_btard_step_fn)(void *arg, const ap_btard_verdict_t *v);

/* Attacks on the check (experiments, off unless asked). */
typedef enum ap_btard_step_attack {
    AP_BTARD_STEP_HONEST = 0,
    AP_BTARD_STEP_FALSE_DISPUTE = 1,   /* disputes every part it sent */
    AP_BTARD_STEP_FALSE_ACCUSE = 2,    /* accuses the next member in the group every step */
    AP_BTARD_STEP_WITHHOLD_REVEAL = 3, /* withholds its reveal in the step's MPRNG round */
    /* an aggregator that sent its aggregate v to the first half of the group
     * (members 0..n/2-1) and v + 0.5 per element to the second half (the
     * caller delivers those copies): it sends the first half a StepCommit
     * naming v and the second half one naming v + 0.5 (its AggCheck, of v,
     * goes to everyone) */
    AP_BTARD_STEP_EQUIVOCATE = 4,
} ap_btard_step_attack_t;

/* Recomputes what member `member` of the step's group should have sent: its
 * gradient from the public state (the parameters every member holds) and its
 * minibatch, chosen by a seed known before the round (e.g. from the run, the
 * step and the member's PeerID with ap_btard_minibatch). out holds the whole
 * vector (the sum of the round's counts). 0, or an error: then this node
 * judges no accusation against that member. */
typedef int (*ap_btard_grad_fn)(void *arg, uint32_t member, float *out);

#define AP_BTARD_GRAD_RTOL 1e-3 /* gradient check: relative slack for another CPU */
#define AP_BTARD_GRAD_ATOL 1e-6 /* and absolute */

typedef struct ap_btard_step_cfg {
    uint8_t run[AP_BTARD_HASH_LEN];
    uint64_t step;             /* contexts: ap_btard_round_ctx(run, step, 0 and 1) */
    const ap_peer_id_t *peers; /* the round's group in its order, this node included; copied */
    size_t n;                  /* 2..AP_BTARD_STEP_MAX_PEERS */
    const uint64_t *counts;    /* n: elements of each member's part (the round's split); copied */
    const float *sent;         /* this node's vector as it entered the round (NULL: sent none) */
    const float *result;       /* the vector after the round */
    double weight;             /* this node's weight in the round */
    const ap_btard_vclip_t *vclip; /* this node's reducer (NULL or !have: no part) */
    double tau;                    /* the run's CenteredClip radius */
    uint64_t phase_timeout_us;     /* each phase's deadline (0 = 5 s) */
    ap_btard_step_attack_t attack;
    ap_btard_step_fn done; /* exactly once, never from inside ap_btard_step_start */
    void *arg;
    /* The gradient check (off when validators = 0 or grad = NULL): the
     * step's seed picks `validators` members and a target each
     * (ap_btard_pick_validators; at most n). Every member judges every
     * accusation with grad, so all members must use the same validators. */
    uint32_t validators;
    ap_btard_grad_fn grad;
    void *grad_arg;
    /* The public state this node's vector was computed on (its parameters),
     * AP_BTARD_HASH_LEN bytes (ap_btard_hash_floats), or NULL: not stated;
     * copied. When stated, it goes into this node's commitment, and a
     * member that committed another state (or none) is not in sync: its
     * gradient is not checked (neither accused nor judged against this
     * node's state, nor are its accusations judged), a part it sent fails
     * ("another state"), so the step is not applied; verdict.out_of_sync
     * tells the members whose state is not the group's (see the verdict). */
    const uint8_t *state;
} ap_btard_step_cfg_t;

/* Starts the check of one step. sent, result and vclip must stay valid and
 * unchanged until done runs. AP_EINVAL (bad configuration, this node not in
 * peers), AP_EEXIST (this step runs), AP_ENOMEM. */
AP_EXPORT AP_NODISCARD int ap_btard_step_start(ap_btard_step_svc_t *svc,
                                               const ap_btard_step_cfg_t *cfg);

/* The split of a round of elems elements among these members, as
 * ap_allreduce_start computes it (min_share 0): counts[i] elements for
 * member i. 0 or ap_avg_balance's error. */
AP_EXPORT AP_NODISCARD int ap_btard_split(const ap_avg_member_t *members, size_t n, uint64_t elems,
                                          uint64_t *counts);

#ifdef __cplusplus
}
#endif
#endif
