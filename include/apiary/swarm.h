/* Apiary — SWARM parallelism: pipeline stages served by swarms of peers.
 *
 * A model is cut into S pipeline stages. Each stage is served by a swarm of
 * peers holding a replica of that stage; trainers push micro-batches through
 * the pipeline and choose, per stage and per call, one server of that stage.
 * See docs/swarm.md for the design.
 *
 * This header holds the balancer a trainer uses to choose servers, the stage
 * call messages, and the stage compute a server runs on them.
 *
 * BALANCER. Interleaved weighted round-robin over the servers of one stage.
 * Every server carries an accumulated expected time ("key"); a task goes to
 * the server with the least key, whose key then grows by task size divided by
 * the server's throughput. Over many tasks each server gets a share of the
 * tasks proportional to its throughput, and the tasks of one server are
 * spread evenly in time rather than sent in bursts.
 *   - Throughput is what the trainer measures from its own calls (size over
 *     elapsed time, smoothed); the throughput a server announces is used only
 *     until the first measurement, so a server announcing speed it does not
 *     deliver is judged by what it delivers. A server neither measured nor
 *     announcing counts as fast as the fastest measured one until measured.
 *   - A newly seen server, or one coming back from a ban, enters at the
 *     current minimum key: it neither gets a burst of catch-up tasks nor waits
 *     behind the others' history.
 *   - A failed call (the server refused, answered garbage, or the connection
 *     broke) bans the server until it publishes a newer DHT record than the
 *     one known at the ban (a later stamp: the record's own expiration
 *     time): a dead server's record is never refreshed, so it stays banned
 *     and is forgotten when that record expires; a live or restarted one
 *     gets tasks again from its next refresh, however long its records live.
 *     A timeout does not ban (the server may just be slow): it counts as a
 *     call that took at least the deadline.
 *   - Deadlines follow measured call times: a margin above the smoothed mean
 *     and deviation of the server's time per unit of work, clamped to the
 *     bounds in the options.
 *
 * The balancer is a plain data structure: it does no I/O and reads no clock.
 * Times are microseconds on any one monotonic clock the caller chooses
 * (ap_rt_now_us in protocol code), including record expiry times, which the
 * caller converts from the DHT's wall-clock milliseconds. Not thread-safe. */
#ifndef APIARY_SWARM_H
#define APIARY_SWARM_H

#include "apiary/common.h"
#include "apiary/compress.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/nn.h"
#include "apiary/peer.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_SWARM_BALANCER_MAX 4096 /* servers one balancer tracks */

typedef struct ap_swarm_balancer ap_swarm_balancer_t;

typedef struct ap_swarm_balancer_opts {
    double ema;                /* weight of a new measurement; 0 = 0.25 */
    double deadline_sigmas;    /* margin in deviations above the mean; 0 = 4 */
    double deadline_factor;    /* and at least this times the mean; 0 = 3 */
    uint64_t deadline_min_us;  /* 0 = 100 ms */
    uint64_t deadline_max_us;  /* 0 = 60 s; also the deadline before any measurement */
    double default_throughput; /* units/s assumed when nothing is known (no measurement,
                                  no announcement, no other server measured); 0 = 1 */
} ap_swarm_balancer_opts_t;

/* One server's state, for status lines and tests. */
typedef struct ap_swarm_server_info {
    ap_peer_id_t peer;
    double throughput;   /* measured (or announced until measured), units/s */
    bool measured;       /* at least one call completed */
    bool banned;         /* banned (until a newer record) */
    uint64_t expires_us; /* its DHT record's expiry */
    uint64_t tasks;      /* tasks picked for it */
    uint64_t ok, failed, timed_out;
} ap_swarm_server_info_t;

/* opts may be NULL (defaults). NULL if out of memory. */
AP_EXPORT ap_swarm_balancer_t *ap_swarm_balancer_new(const ap_swarm_balancer_opts_t *opts);
AP_EXPORT void ap_swarm_balancer_free(ap_swarm_balancer_t *b);

/* Adds a server seen in the DHT, or refreshes one: announced is the
 * throughput its record claims (units/s; ignored once measured, or if not
 * finite and positive), expires_us when its record expires, stamp the
 * record's own version: any number that grows with every record the server
 * publishes (the DHT record's wall-clock expiration_ms; not converted, so
 * re-reading one record gives the same stamp). A record with a stamp below
 * one already seen is ignored; one above the stamp known when the server was
 * banned lifts the ban (the server re-enters at the current minimum key). A
 * new server enters at the current minimum key. AP_ELIMIT beyond
 * AP_SWARM_BALANCER_MAX servers, AP_ENOMEM. */
AP_EXPORT int ap_swarm_balancer_update_record(ap_swarm_balancer_t *b, const ap_peer_id_t *peer,
                                              double announced, uint64_t expires_us, uint64_t stamp,
                                              uint64_t now_us);
/* ap_swarm_balancer_update_record with stamp = expires_us (for callers whose
 * expiry times do not jitter from one read of a record to the next). */
AP_EXPORT int ap_swarm_balancer_update(ap_swarm_balancer_t *b, const ap_peer_id_t *peer,
                                       double announced, uint64_t expires_us, uint64_t now_us);
/* Forgets a server. No-op if unknown. */
AP_EXPORT void ap_swarm_balancer_remove(ap_swarm_balancer_t *b, const ap_peer_id_t *peer);

/* Chooses the server for a task of the given size (> 0, in the units of
 * throughput): the eligible server with the least key (ties: the one known
 * longest), whose key then advances by size / throughput. Servers whose
 * record expired at now_us are dropped; banned ones are skipped. Writes the
 * server to *peer and the call's deadline (relative, microseconds) to
 * *deadline_us (may be NULL). AP_ENOTFOUND if no server is eligible,
 * AP_EINVAL on a bad size. */
AP_EXPORT int ap_swarm_balancer_pick(ap_swarm_balancer_t *b, double size, uint64_t now_us,
                                     ap_peer_id_t *peer, uint64_t *deadline_us);

/* Reports how a call to peer went: status 0 = success after elapsed_us;
 * AP_ETIMEDOUT = no answer within the deadline (no ban; the measurement
 * counts elapsed_us as a lower bound); any other negative code = failure
 * (ban until a newer record of the server: see _update_record; a banned
 * server whose record expires is forgotten). size is the task's size. Unknown
 * peers are ignored. */
AP_EXPORT void ap_swarm_balancer_report(ap_swarm_balancer_t *b, const ap_peer_id_t *peer,
                                        int status, double size, uint64_t elapsed_us,
                                        uint64_t now_us);

/* Number of servers tracked (banned ones included) / eligible at now_us. */
AP_EXPORT size_t ap_swarm_balancer_count(const ap_swarm_balancer_t *b);
AP_EXPORT size_t ap_swarm_balancer_eligible(const ap_swarm_balancer_t *b, uint64_t now_us);
/* Sum of the throughputs of the eligible servers at now_us (units/s). */
AP_EXPORT double ap_swarm_balancer_throughput(const ap_swarm_balancer_t *b, uint64_t now_us);
/* The info of a tracked server. AP_ENOTFOUND if unknown. */
AP_EXPORT int ap_swarm_balancer_info(const ap_swarm_balancer_t *b, const ap_peer_id_t *peer,
                                     uint64_t now_us, ap_swarm_server_info_t *out);

/* ---- stage calls -----------------------------------------------------------
 * A trainer calls a stage server with a request and gets a response, both
 * byte strings specified in docs/swarm.md. Activations and their gradients
 * travel compressed by a codec of compress.h (blockwise 8-bit by default).
 *   FORWARD   first stage: tokens; other stages: in (B,T,C).
 *             Response: out (B,T,C), or for the last stage the loss (with
 *             targets) and no tensor.
 *   BACKWARD  the forward's input again (tokens or in) plus dout (B,T,C) of
 *             the stage's output, or targets for the last stage. The server
 *             recomputes the forward (the backward may reach another server
 *             than the forward did), accumulates its parameter gradients and
 *             answers din (B,T,C) (none for the first stage) and, for the
 *             last stage, the loss. */

#define AP_SWARM_PROTO_STAGE "/apiary/swarm/stage/1"
#define AP_SWARM_TENSOR_MAX  (1u << 22)  /* B*T*C floats per tensor */
#define AP_SWARM_TOKENS_MAX  (1u << 20)  /* B*T per micro-batch */
#define AP_SWARM_MSG_MAX     (64u << 20) /* bytes of a request or response */

typedef enum ap_swarm_op { AP_SWARM_FORWARD = 1, AP_SWARM_BACKWARD = 2 } ap_swarm_op_t;

/* A decoded request, or one to encode. Arrays are NULL when absent; decoded
 * ones are owned by the struct (ap_swarm_req_clear). */
typedef struct ap_swarm_req {
    ap_swarm_op_t op;
    uint32_t stage;     /* index of the stage called */
    uint32_t B, T, C;   /* micro-batch, sequence, width */
    int32_t *tokens;    /* (B,T) */
    int32_t *targets;   /* (B,T) */
    float *in;          /* (B,T,C) */
    float *dout;        /* (B,T,C) */
    uint32_t budget_us; /* the caller waits this long for the answer (0 = not said): a server
                           does not start a call that has waited in its queue that long */
} ap_swarm_req_t;

typedef struct ap_swarm_resp {
    ap_swarm_op_t op;
    uint32_t B, T, C;
    bool has_loss;
    float loss;
    float *act; /* out (FORWARD) or din (BACKWARD), (B,T,C); NULL if none */
} ap_swarm_resp_t;

/* Encodes into a malloc'd buffer (*out, *len; the caller frees). Tensors
 * are encoded with codec (NULL = BLOCKWISE8). AP_EINVAL on a bad shape,
 * AP_ELIMIT beyond the caps, AP_ENONFINITE from a lossy codec. */
AP_EXPORT int ap_swarm_req_encode(const ap_swarm_req_t *r, const ap_codec_cfg_t *codec,
                                  uint8_t **out, size_t *len);
AP_EXPORT int ap_swarm_resp_encode(const ap_swarm_resp_t *r, const ap_codec_cfg_t *codec,
                                   uint8_t **out, size_t *len);
/* Decodes untrusted bytes into *r (zeroed first; on error nothing to free).
 * Checks the header, shapes against the caps, each tensor's codec header
 * (one chunk of exactly B*T*C elements) and that every decoded value is
 * finite. *why (may be NULL) receives a static reason on error. AP_ECORRUPT,
 * AP_EVERSION, AP_ELIMIT, AP_ENONFINITE, AP_ENOMEM. */
AP_EXPORT int ap_swarm_req_decode(const uint8_t *in, size_t len, ap_swarm_req_t *r,
                                  const char **why);
AP_EXPORT int ap_swarm_resp_decode(const uint8_t *in, size_t len, ap_swarm_resp_t *r,
                                   const char **why);
AP_EXPORT void ap_swarm_req_clear(ap_swarm_req_t *r);
AP_EXPORT void ap_swarm_resp_clear(ap_swarm_resp_t *r);

/* Checks that a response answers a request: same op and shape, an
 * activation tensor exactly when one is due, a loss exactly when due (last
 * stage: last is true). A server whose answer fails this answered garbage.
 * 0 or AP_EPROTO with *why. */
AP_EXPORT int ap_swarm_resp_check(const ap_swarm_req_t *q, const ap_swarm_resp_t *r, bool first,
                                  bool last, const char **why);

/* Runs a decoded request on a stage model (a GPT stage of the model kit):
 * checks it fits the stage (stage index, width, batch and context caps, the
 * inputs this stage needs), runs forward, or forward and backward
 * (accumulating into the model's gradients), and fills *resp (owned:
 * ap_swarm_resp_clear). AP_EINVAL with *why when the request does not fit,
 * or the model kit's error. */
AP_EXPORT int ap_swarm_stage_run(ap_nn_model_t *m, uint32_t stage, const ap_swarm_req_t *q,
                                 ap_swarm_resp_t *resp, const char **why);

/* ---- adaptive rebalancing ---------------------------------------------------
 * Every server periodically (ap_swarm_rebalance_delay) reads all stages'
 * server records from the DHT and computes the same plan from them; a server
 * that finds itself in the plan downloads its new stage's state from that
 * stage's peers, then serves it. The plan (docs/swarm.md, with why it
 * converges): repeatedly take the single move, of one server from a stage
 * with at least two servers to another stage, that most improves the sorted
 * vector of stage throughputs (lexicographically: first the minimum), if it
 * raises the first component it changes by at least the margin (relative);
 * ties go to the lowest peer id; a stage loses at most one server per plan
 * and a server moves at most once. */

#define AP_SWARM_STAGES_MAX 256

typedef struct ap_swarm_member {
    ap_peer_id_t peer;
    uint32_t stage;    /* < nstages */
    double throughput; /* as announced in its record, units/s */
    /* Filled by ap_swarm_members_from; the plan ignores them. */
    bool estimate;      /* the throughput is an estimate (AP_SWARM_ANNOUNCE_ESTIMATE) */
    int64_t made_ms;    /* wall-clock ms the record was made (expiry - TTL); 0 = unknown */
    uint32_t period_ms; /* its owner's announcement period; 0 = unknown */
} ap_swarm_member_t;

/* Fills to[i] with member i's stage after this period's moves (its own stage
 * if it stays) and returns the number of movers, or AP_EINVAL (nstages 0 or
 * over AP_SWARM_STAGES_MAX, a stage index out of range, a negative or
 * non-finite throughput), AP_ENOMEM. margin: e.g. 0.05. Deterministic in
 * the set of members (their order does not matter). */
AP_EXPORT int ap_swarm_rebalance_plan(const ap_swarm_member_t *m, size_t n, uint32_t nstages,
                                      double margin, uint32_t *to);
/* The delay to the next rebalancing check: uniform in [period/2, 3 period/2)
 * from u in [0,1) (ap_rt_rand_double), so servers do not act in lockstep. */
AP_EXPORT uint64_t ap_swarm_rebalance_delay(uint64_t period_us, double u);
/* Whether a member's record is stale at wall_ms: made more than 1.5 of its
 * owner's announcement periods plus slack_ms ago, so its owner has missed a
 * refresh (crashed, preempted) although the record has not expired yet.
 * False when the record does not say when it was made or its period. */
AP_EXPORT bool ap_swarm_member_stale(const ap_swarm_member_t *m, int64_t wall_ms, int64_t slack_ms);
/* The pipeline's throughput under an assignment: the least stage total
 * (0 if a stage has no server). */
AP_EXPORT double ap_swarm_pipeline_throughput(const ap_swarm_member_t *m, const uint32_t *stage,
                                              size_t n, uint32_t nstages);

/* ---- stage servers and trainers on a runtime ----------------------------------
 * Sans-I/O: both talk only to runtime.h. Loop-thread only. */

typedef struct ap_swarm_server ap_swarm_server_t;
typedef struct ap_swarm_trainer ap_swarm_trainer_t;

typedef struct ap_swarm_server_stats {
    uint64_t forwards, backwards; /* calls answered */
    uint64_t refused;             /* calls refused (bad bytes or not fitting the stage) */
    uint64_t expired;  /* calls not computed: they waited in the queue past their budget */
    uint64_t samples;  /* rows (B) of the backwards answered */
    uint32_t queue;    /* calls waiting or computing now */
    double throughput; /* measured, units/s (0 = not yet) */
    uint64_t announces, announce_failures; /* DHT stores of its record */
} ap_swarm_server_stats_t;

#define AP_SWARM_QUEUE_MAX 64 /* calls a server holds; beyond, refused with AP_EBUSY */

/* Serves stage `stage` of a GPT stage model m (borrowed; the server
 * accumulates its gradients) under AP_SWARM_PROTO_STAGE, answering with
 * codec (NULL = BLOCKWISE8). Calls are decoded on arrival (a refusal goes
 * back as an error with the reason, and a log line names the caller),
 * queued (at most AP_SWARM_QUEUE_MAX), and computed one at a time with
 * ap_rt_work (a worker thread in the real driver, virtual compute time in the
 * simulator: cost 2 x tokens x parameters for a forward, 3 times that for a
 * backward). The server measures its throughput from its own compute, in
 * tokens of micro-batches per second: a micro-batch costs a stage one
 * forward and one backward (a forward counts a quarter of a micro-batch, a
 * backward three quarters), the last stage only the backward (trainers skip
 * its forward), so stage totals compare as pipeline capacity.
 * AP_EEXIST if rt serves a stage already. */
AP_EXPORT int ap_swarm_server_new(ap_rt_t *rt, ap_nn_model_t *m, uint32_t stage,
                                  const ap_codec_cfg_t *codec, ap_swarm_server_t **out);
/* Unregisters, answers the queued calls with AP_ESHUTDOWN and frees. If a
 * compute is running, the server's memory goes when it ends: the caller must
 * not free m before ap_swarm_server_idle held (the real driver) or the node
 * was shut down. */
AP_EXPORT void ap_swarm_server_free(ap_swarm_server_t *s);
AP_EXPORT void ap_swarm_server_stats(const ap_swarm_server_t *s, ap_swarm_server_stats_t *out);
/* Measured throughput, else the estimate (the one given to _announce, or
 * the synthetic call's), else 0; 0 while leaving. */
AP_EXPORT double ap_swarm_server_throughput(const ap_swarm_server_t *s);
/* Whether ap_swarm_server_throughput is an estimate (not yet measured on
 * served calls); its record then carries AP_SWARM_ANNOUNCE_ESTIMATE. */
AP_EXPORT bool ap_swarm_server_estimated(const ap_swarm_server_t *s);
AP_EXPORT uint32_t ap_swarm_server_stage(const ap_swarm_server_t *s);
/* Paused, the server keeps queueing calls but starts no compute (the model's
 * parameters may then be changed, e.g. by an optimizer step, once
 * ap_swarm_server_idle). Unpausing starts the queue again. */
AP_EXPORT void ap_swarm_server_pause(ap_swarm_server_t *s, bool paused);
/* No compute running. */
AP_EXPORT bool ap_swarm_server_idle(const ap_swarm_server_t *s);
/* Called on the loop thread after every answered BACKWARD with its rows (B),
 * when the model's gradients hold that call's contribution: the place to
 * hand accumulated gradients to an optimizer (pause, step, zero, unpause). */
typedef void (*ap_swarm_backward_fn)(ap_swarm_server_t *s, void *arg, uint64_t samples);
AP_EXPORT void ap_swarm_server_on_backward(ap_swarm_server_t *s, ap_swarm_backward_fn fn,
                                           void *arg);
/* One plain SGD step from p's accumulated gradients, for servers training
 * their stage alone: when clip > 0 and the gradients' global L2 norm exceeds
 * clip, they are scaled down to norm clip; then data -= lr * grad, and the
 * gradients are zeroed. A gradient holding a non-finite value (or whose norm
 * overflows) is refused: no parameter changes, the gradients are zeroed, a
 * rate-limited warning is logged and AP_EINVAL returned. *norm_out (may be
 * NULL) gets the norm before clipping. AP_EINVAL also for a non-finite lr or
 * a negative or non-finite clip. */
AP_EXPORT int ap_swarm_sgd_step(ap_nn_params_t *p, float lr, float clip, double *norm_out);
/* The stage version its record carries (e.g. the optimizer's epoch). */
AP_EXPORT void ap_swarm_server_set_version(ap_swarm_server_t *s, uint64_t version);
/* Serves another stage with another model (a rebalancing move; the caller
 * loaded m's state first). Queued calls get AP_EINVAL "wrong stage"; the
 * measured throughput starts again and the leaving mark is cleared; the
 * record is stored under the new stage at once, saying 0 (unmeasured) until
 * a synthetic backward of the new stage, queued first, has measured its
 * compute: the record then carries that estimate (stored at once) until the
 * first served call measures the throughput. AP_EBUSY while a compute
 * runs. */
AP_EXPORT int ap_swarm_server_set_stage(ap_swarm_server_t *s, ap_nn_model_t *m, uint32_t stage);
/* Marks the server as leaving its stage (a move has begun) or not: its
 * record then announces throughput 0, stored at once, so the other servers'
 * rebalancing loops, which decide nothing while a server is unmeasured, wait
 * for the move to finish instead of moving too. */
AP_EXPORT void ap_swarm_server_leave(ap_swarm_server_t *s, bool leaving);
/* Announces the server in dht: stores its record (ap_swarm_stage_key(run,
 * its stage), subkey "[owner:<its PeerID>]", value: throughput, queue length,
 * version) now and every period_us (>= 100 ms), each living the record TTL
 * (ap_swarm_server_announce_ttl; by default 3 periods), so a server that
 * stops refreshing disappears within one TTL. A refresh is never skipped
 * because an earlier store is still in flight (a slow DHT): up to 4 stores
 * run at once, and one due beyond that starts when one of them ends, so the
 * record stays stored while the server lives as long as a store takes less
 * than the TTL minus one period. initial_throughput is announced, as an
 * estimate, until the first measurement; with 0 the server queues a
 * synthetic backward of its stage first and announces what that compute
 * gives, as an estimate, as soon as it is done. The first measurement on a
 * served call is stored at once. Each record carries the period and the TTL,
 * so readers see how old it is. dht is borrowed and must outlive the server.
 * AP_EINVAL (period out of range, or a TTL set before that is below 3
 * periods), AP_EEXIST if announcing already. */
AP_EXPORT int ap_swarm_server_announce(ap_swarm_server_t *s, ap_dht_t *dht, const char *run,
                                       uint64_t period_us, double initial_throughput);

#define AP_SWARM_RECORD_TTL_MAX_US (12ull * 3600 * 1000000) /* 12 h; DHT nodes refuse > 1 day */

/* Sets how long each stored record lives (ttl_us; 0 = the default, 3
 * announcement periods). It must be at least 3 periods, so that a record
 * outlives two missed or slow refreshes, and at most
 * AP_SWARM_RECORD_TTL_MAX_US: AP_EINVAL otherwise (checked now if the server
 * announces already, else by ap_swarm_server_announce). Applies from the next
 * store. A longer TTL means fewer lost records on a slow DHT but a dead
 * server stays in the records longer; trainers ban a failing server until it
 * publishes a newer record, not until this TTL (see the balancer). */
AP_EXPORT int ap_swarm_server_announce_ttl(ap_swarm_server_t *s, uint64_t ttl_us);
/* The record TTL in use (us); 0 before ap_swarm_server_announce with no TTL set. */
AP_EXPORT uint64_t ap_swarm_server_record_ttl(const ap_swarm_server_t *s);

/* A trainer drives micro-batches through nstages stages, one balancer per
 * stage. codec NULL = BLOCKWISE8; attempts = calls per pipeline step before
 * the micro-batch fails (0 = 16). */
AP_EXPORT int ap_swarm_trainer_new(ap_rt_t *rt, uint32_t nstages, uint32_t width,
                                   const ap_codec_cfg_t *codec, int attempts,
                                   ap_swarm_trainer_t **out);
/* Cancels the micro-batches in flight (their callbacks run with
 * AP_ECANCELED) and frees. */
AP_EXPORT void ap_swarm_trainer_free(ap_swarm_trainer_t *t);
/* The balancer of a stage (to feed it servers from the DHT: update). */
AP_EXPORT ap_swarm_balancer_t *ap_swarm_trainer_balancer(ap_swarm_trainer_t *t, uint32_t stage);

typedef void (*ap_swarm_batch_fn)(ap_rt_t *rt, void *arg, int status, float loss);
/* Pushes one micro-batch (tokens and targets (B,T), copied) forward through
 * every stage and backward again. A failed or garbage answer bans that
 * server and the step is retried on another; a timeout retries without a
 * ban. done runs once, later: 0 and the loss, or the error of the last
 * attempt. */
AP_EXPORT int ap_swarm_trainer_submit(ap_swarm_trainer_t *t, uint32_t B, uint32_t T,
                                      const int32_t *tokens, const int32_t *targets,
                                      ap_swarm_batch_fn done, void *arg);
AP_EXPORT uint64_t ap_swarm_trainer_bytes(const ap_swarm_trainer_t *t); /* sent + received */
/* Routes by the DHT: reads every stage's records (ap_swarm_watch) every
 * period_us and feeds them to the stage balancers (a server whose freshest
 * record is in another stage leaves this stage's balancer); a step that
 * finds no eligible server reads again at once. No static server list is
 * needed. dht is borrowed and must outlive the trainer. AP_EEXIST if
 * watching already. */
AP_EXPORT int ap_swarm_trainer_watch(ap_swarm_trainer_t *t, ap_dht_t *dht, const char *run,
                                     uint64_t period_us);
typedef struct ap_swarm_trainer_stats {
    uint64_t batches, failed;                              /* micro-batches done / failed */
    uint64_t samples;                                      /* rows of the batches done */
    uint64_t calls, call_failures, call_timeouts, garbage; /* timeouts include "queue full" */
    uint64_t reads;                                        /* DHT reads of the stage records */
} ap_swarm_trainer_stats_t;
AP_EXPORT void ap_swarm_trainer_stats(const ap_swarm_trainer_t *t, ap_swarm_trainer_stats_t *out);

/* ---- the live rebalancing loop -------------------------------------------------
 * A rebalancer runs beside a stage server that announces itself: after a
 * delay drawn by ap_swarm_rebalance_delay(period_us) it reads every stage's
 * records (one ap_swarm_watch read), puts the server itself into that view
 * with its actual stage and measured throughput (its record may lag), and
 * computes ap_swarm_rebalance_plan with the margin. When the plan moves this
 * server it calls fn(rb, arg, from, to) and stops checking; the owner then
 * downloads stage `to`'s parameters and optimizer state from that stage's
 * peers, switches the server (ap_swarm_server_set_stage, which re-announces
 * under the new stage at once) and reports with ap_swarm_rebalancer_moved.
 * Trainers then route the server to its new stage only (its newest record).
 * Hysteresis: the plan's margin; throughputs rounded to an eighth of an
 * octave before planning, so measurement noise does not change the plan from
 * one server's view to another's; records whose owner stopped refreshing
 * them (ap_swarm_member_stale, with the read's duration as slack) are left
 * out of the view; no decision while any server in the view announces
 * throughput 0 (an estimate counts), and a mover marks itself leaving
 * (ap_swarm_server_leave: its record says 0) from its decision until it has
 * an estimate in its new stage, so the others wait for its move instead of
 * moving too; a server that has moved sits out `cooldown` checks; a server
 * never leaves a stage it serves alone (the half of a swap whose partner
 * has not moved yet waits). With the randomised delays spreading the
 * checks, servers do not herd. */

typedef struct ap_swarm_rebalancer ap_swarm_rebalancer_t;

typedef struct ap_swarm_rebalance_opts {
    uint64_t period_us; /* T, >= 100 ms: checks are T/2..3T/2 apart */
    double margin;      /* relative gain a move must bring; 0 = 0.05 */
    uint32_t cooldown;  /* checks a server sits out after it moved; 0 = 2 */
} ap_swarm_rebalance_opts_t;

typedef struct ap_swarm_rebalance_stats {
    uint64_t checks;       /* views read */
    uint64_t moves;        /* moves handed to the owner */
    uint64_t failed_moves; /* reported failed by the owner */
    uint64_t skipped;      /* checks without a decision (failed read, unmeasured servers,
                              last of its stage, cooling down) */
    double last_min;       /* pipeline throughput in the last view (least stage total) */
    double last_planned;   /* and after that view's plan */
    uint64_t stale;        /* records left out of a view: their owner stopped refreshing */
} ap_swarm_rebalance_stats_t;

/* fn runs on the loop thread; it may call ap_swarm_rebalancer_moved at once
 * or later, or ap_swarm_rebalancer_free. */
typedef void (*ap_swarm_move_fn)(ap_swarm_rebalancer_t *rb, void *arg, uint32_t from, uint32_t to);
/* s and dht are borrowed and must outlive the rebalancer; run is the run id
 * the server announces under. AP_EINVAL (bad options, the server's stage not
 * below nstages), AP_ENOMEM. */
AP_EXPORT int ap_swarm_rebalancer_new(ap_rt_t *rt, ap_swarm_server_t *s, ap_dht_t *dht,
                                      const char *run, uint32_t nstages,
                                      const ap_swarm_rebalance_opts_t *opts, ap_swarm_move_fn fn,
                                      void *arg, ap_swarm_rebalancer_t **out);
/* The move handed to fn is over: status 0 = the server now serves its new
 * stage; otherwise it stayed. Checking resumes (after the cooldown). */
AP_EXPORT void ap_swarm_rebalancer_moved(ap_swarm_rebalancer_t *rb, int status);
/* Stops; fn is not called again. Safe from inside fn. */
AP_EXPORT void ap_swarm_rebalancer_free(ap_swarm_rebalancer_t *rb);
AP_EXPORT void ap_swarm_rebalancer_stats(const ap_swarm_rebalancer_t *rb,
                                         ap_swarm_rebalance_stats_t *out);

/* ---- reading the stage records ---------------------------------------------
 * A watch gets every stage's key (ap_swarm_stage_key(run, 0..nstages-1)) from
 * the DHT in one batch (latest: the k nearest nodes' dictionaries merged)
 * now and every period_us (>= 50 ms), and hands the results to fn: status 0
 * and res[0..nstages-1] (valid only during the call), or the DHT's error and
 * NULL. One read at a time; ap_swarm_watch_now asks for one more at once. */
typedef struct ap_swarm_watch ap_swarm_watch_t;
typedef void (*ap_swarm_watch_fn)(ap_rt_t *rt, void *arg, int status, const ap_dht_result_t *res,
                                  uint32_t nstages);
AP_EXPORT int ap_swarm_watch_new(ap_rt_t *rt, ap_dht_t *dht, const char *run, uint32_t nstages,
                                 uint64_t period_us, ap_swarm_watch_fn fn, void *arg,
                                 ap_swarm_watch_t **out);
/* Stops; fn is not called again. Safe from inside fn. */
AP_EXPORT void ap_swarm_watch_free(ap_swarm_watch_t *w);
AP_EXPORT void ap_swarm_watch_now(ap_swarm_watch_t *w);
AP_EXPORT uint64_t ap_swarm_watch_reads(const ap_swarm_watch_t *w);
/* The servers in a watch's results: one member per announcer (a server with
 * records in several stages, having moved, counts where its record expires
 * last), with its announced throughput and record expiry; expired and
 * malformed entries are skipped; expires_ms[i] gets member i's record
 * expiry (wall-clock ms). Writes at most max; returns the count or
 * AP_ELIMIT (more than max), AP_EINVAL. */
AP_EXPORT int ap_swarm_members_from(const ap_dht_result_t *res, uint32_t nstages, int64_t wall_ms,
                                    ap_swarm_member_t *m, int64_t *expires_ms, size_t max);

/* ---- announcements in the DHT ------------------------------------------------
 * A stage server announces itself under the key ap_swarm_stage_key(run,
 * stage) with the owner-signed subkey "[owner:<its PeerID>]" (the DHT checks
 * the signature) and the value below, and refreshes it before it expires.
 * Value (big-endian, 32 bytes): magic 0x57, version 2, a flags byte
 * (AP_SWARM_ANNOUNCE_ESTIMATE; other bits zero), a zero byte, throughput
 * (IEEE double bits, units/s, finite and >= 0), queue length (uint32), stage
 * version (uint64, e.g. the optimizer epoch), the announcement period (ms,
 * uint32; 0 = not given) and the record's TTL (ms, uint32; 0 = not given).
 * With period and TTL a reader knows how long ago a record was made (its
 * TTL minus the time it has left), hence whether its owner stopped
 * refreshing it, well before it expires. */

#define AP_SWARM_ANNOUNCE_LEN      32
#define AP_SWARM_ANNOUNCE_ESTIMATE 0x01 /* the throughput is an estimate, not yet measured */
#define AP_SWARM_RUN_MAX           128  /* run id bytes */
#define AP_SWARM_KEY_MAX           (AP_SWARM_RUN_MAX + 32)

typedef struct ap_swarm_announce {
    double throughput;
    bool estimate; /* throughput estimated (its own compute of the stage measured on a
                      synthetic call), not yet measured on served calls; needs throughput > 0 */
    uint32_t queue;
    uint64_t version;
    uint32_t period_ms; /* announcement period (0 = not given) */
    uint32_t ttl_ms;    /* the record's TTL (0 = not given) */
} ap_swarm_announce_t;

/* "swarm/<run>/stage/<stage>" into key (AP_SWARM_KEY_MAX bytes); returns its
 * length, or AP_EINVAL for an empty run id or one over AP_SWARM_RUN_MAX. */
AP_EXPORT int ap_swarm_stage_key(const char *run, uint32_t stage, char key[AP_SWARM_KEY_MAX]);
AP_EXPORT void ap_swarm_announce_encode(const ap_swarm_announce_t *a,
                                        uint8_t out[AP_SWARM_ANNOUNCE_LEN]);
/* AP_ECORRUPT (length, magic, reserved bits, throughput, an estimate of 0),
 * AP_EVERSION. */
AP_EXPORT int ap_swarm_announce_decode(const uint8_t *in, size_t len, ap_swarm_announce_t *a);
/* Reads the announcer of a record from its "[owner:<PeerID>]" subkey. */
AP_EXPORT int ap_swarm_announce_owner(const ap_dht_record_t *rec, ap_peer_id_t *peer);

/* Feeds a balancer from the result of a DHT get of a stage key: every
 * well-formed entry updates its server with the announced throughput and
 * the record's expiry, converted from wall-clock milliseconds (wall_ms =
 * ap_rt_wall_ms now) to the balancer's clock (now_us). Malformed entries are
 * skipped. Returns the number of servers fed, or AP_EINVAL. */
AP_EXPORT int ap_swarm_balancer_feed(ap_swarm_balancer_t *b, const ap_dht_result_t *res,
                                     uint64_t now_us, int64_t wall_ms);

#ifdef __cplusplus
}
#endif
#endif
