/* Apiary — collaborative training (DeDLOC), prefix ap_collab_: the
 * collaborative optimizer, its progress tracking and state sharing. The
 * progress record is in apiary/progress.h, the run's configuration in
 * apiary/run_config.h.
 *
 * A RUN (named by run_id) is one model trained by any number of peers. One
 * GLOBAL EPOCH is target_batch_size samples, contributed by whichever peers
 * are there. Each peer computes gradients on its own batches and hands them to
 * ap_collab_submit(); the optimizer
 *   - accumulates them locally (sum of grad * samples);
 *   - reports its PROGRESS in the DHT: under the key "<run_id>_progress", one
 *     owner-signed subkey per peer ("[owner:<PeerID>]") holding (epoch,
 *     samples accumulated, samples/s, wall time, role, bandwidth, donor flag);
 *   - estimates the global number of samples of the current epoch and the ETA
 *     of the next epoch from every peer's record (extrapolated by its speed),
 *     and refreshes that view more often as the ETA nears;
 *   - when the epoch is due, averages the accumulated gradients with the
 *     other peers of the epoch (all-reduce, weight = samples accumulated) and
 *     applies the same step of the model kit's solver (SGD/Adam/AdamW/LAMB,
 *     apiary/nn.h) as every other peer: this equals one big-batch step;
 *   - every average_state_every epochs also averages parameters and optimizer
 *     state (equal weights), which pulls peers that drifted apart back
 *     together;
 *   - if averaging fails (in whole or in part) steps on what it has (the local
 *     gradients for the parts not averaged) and logs a WARN saying so.
 *
 * GROUPS. By default the group of an epoch is formed from the progress
 * records (config dht_matchmaking: with the averaging module's DHT
 * matchmaker instead, docs/training.md). A peer that finds the epoch due
 * marks its record READY (with its wall time) and waits matchmaking_window;
 * a peer between batches that sees a READY record of its epoch joins at once.
 * The group is every fresh record of the epoch that became ready within
 * matchmaking_window of the first one, ordered by PeerID; a peer that became
 * ready later is not in it and catches up by downloading the state. The group
 * id is a hash of (run_id, epoch, members): peers whose views still differ
 * run disjoint rounds and the parts they miss stay local (docs/training.md,
 * "Groups").
 *
 * STATE SHARING. Peers that accept connections advertise themselves as
 * donors (flag in their progress record). A newcomer (ap_collab_start) or a
 * laggard (a peer that sees others in a later epoch) downloads parameters,
 * optimizer state and epoch over streams ("/apiary/optim/state/1") from up to
 * max_donors donors at once, a contiguous part from each; a part whose donor
 * leaves or misbehaves is re-requested from another donor from where it
 * stopped. A wrong-shaped, non-finite or corrupt part is refused and logged.
 *
 * THREADING. An ap_collab_t belongs to the loop thread of its runtime: every
 * function here except the *_sync wrappers must be called there, and every
 * callback runs there. The *_sync wrappers are for a user's training thread
 * next to a node of the real driver (apiary/node.h).
 *
 * BUFFERS. The parameter buffer (params, n floats) is BORROWED from the caller
 * for the optimizer's lifetime. The optimizer writes it only (a) inside
 * ap_collab_start until its callback runs and (b) between ap_collab_submit
 * and its callback; the caller must not touch params then, and may read and
 * write it freely otherwise (e.g. compute the next batch). All other memory
 * (optimizer state, accumulators, averaging and download buffers) is owned by
 * the optimizer and allocated once in ap_collab_new.
 *
 * Protocol code: sans-I/O, runtime.h only (runs unchanged on the simulator). */
#ifndef APIARY_COLLAB_H
#define APIARY_COLLAB_H

#include "apiary/avg.h"
#include "apiary/btard.h"
#include "apiary/common.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/nn.h"
#include "apiary/progress.h"
#include "apiary/run_config.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_COLLAB_STATE_PROTO "/apiary/optim/state/1"
#define AP_COLLAB_RUN_ID_MAX  128 /* bytes of a run id */
#define AP_COLLAB_MAX_DONORS  16

/* ---- the collaborative optimizer --------------------------------------------- */

typedef struct ap_collab ap_collab_t;

/* The gradient check's gradient (ap_collab_config_t.btard_validators): the
 * gradient a member sends at `epoch` on the parameters params (n floats,
 * those every member of the round holds) and the minibatch drawn from seed
 * (BLAKE2b-256("apiary/btard/grad" || BLAKE2b-256(run id) || le64(epoch) ||
 * PeerID), e.g. with ap_btard_minibatch). Written to out (n floats). It must
 * be a pure function of its arguments and not touch the caller's model
 * (called on the runtime's thread while the caller may compute a batch).
 * 0, or an error: then this peer judges no accusation against that member
 * (and, for its own vector, sends the mean of its submitted gradients). */
typedef int (*ap_collab_grad_fn)(void *arg, const float *params, size_t n, uint64_t epoch,
                                 const uint8_t seed[32], float *out);

typedef struct ap_collab_config {
    const char *run_id;           /* 1..AP_COLLAB_RUN_ID_MAX bytes; copied */
    uint64_t target_batch_size;   /* samples per global epoch (> 0) */
    ap_avg_role_t role;           /* NORMAL, CLIENT (no incoming connections) or AUX */
    ap_nn_solver_config_t solver; /* the local optimizer every peer applies */
    ap_nn_lr_schedule_t lr;       /* learning rate per global epoch (warm-up, decay) */
    double max_grad_norm;         /* clip the averaged gradient (0 = no clipping) */
    /* What the model is (ap_nn_model_kind, 0 = not given; ap_nn_model_shape):
     * part of the run's configuration every peer must share with optim, lr
     * and max_grad_norm; the optimizer's arithmetic does not read it. */
    uint32_t model_kind;
    uint32_t model_shape[AP_NN_SHAPE_WORDS];
    uint32_t average_state_every;  /* epochs between state averaging (0 = never) */
    double up, down;               /* declared bandwidth, bytes/s (0 = averager's estimate) */
    uint64_t averaging_timeout_us; /* cap on one averaging round (0 = 30 s) */
    uint32_t chunk_elems;          /* all-reduce chunk (0 = 16384) */
    uint8_t codec;       /* gradient rounds' codec (ap_avg_codec_t, the same on every peer) */
    uint8_t state_codec; /* state rounds' codec (average_state_every; parameters and optimizer
                            state; 0 = float32; the same on every peer). State downloads are
                            always float32 */
    uint64_t matchmaking_window_us; /* gathering READY peers (0 = 1 s) */
    /* Progress tracking. */
    int64_t progress_ttl_ms; /* expiration of a record (0 = 60 s) */
    /* Records older than this are ignored (0 = 20 s). A peer reports at least
     * every min(1 s, stale_ms / 4), in every phase, and says so in its record;
     * a record that has not changed for 3 such intervals + 2 s between our
     * reads counts as gone before stale_ms (docs/training.md, "Peers that
     * leave"). */
    int64_t stale_ms;
    int64_t max_skew_ms;     /* tolerated clock skew (0 = 5 s) */
    uint64_t min_refresh_us; /* adaptive refresh period bounds (0 = 0.5 s, 10 s) */
    uint64_t max_refresh_us;
    /* State sharing. */
    int max_donors;               /* parallel donors per download (0 = 3) */
    uint64_t download_timeout_us; /* whole download (0 = 120 s) */
    bool load_state_on_start;     /* download from donors in ap_collab_start (default true
                                     via ap_collab_config_default) */
    /* Delayed updates (default false): when an epoch is due, the submit's
     * callback runs as soon as the peer is READY and the matchmaking wait,
     * the averaging round(s) and the optimizer step run in the background
     * while the caller computes the next batches. Those batches are
     * accumulated for the next epoch; their gradients are computed on the
     * parameters of before the step (one optimizer step stale). The step is
     * applied to the optimizer's own copy of the parameters and copied into
     * params at the first ap_collab_submit (or ap_collab_apply_update) after
     * the round ended. Costs 2·n more floats.
     * CAP: during a background round the peer accumulates for the next
     * epoch at most its share of the target, target · (its speed / the
     * summed speeds of the records in this or the next epoch), speeds as
     * reported when the round's records were written; a submit that reaches
     * the share waits (its callback is held) until the round is over. So
     * the next epoch averages at most the target plus about one local batch
     * per peer instead of every batch computed during the round. */
    bool delayed_updates;
    /* Cap on the samples this peer accumulates per epoch (0 = none). At the
     * cap, ap_collab_submit WAITS (its callback is held) until the epoch's
     * round is over (or the peer downloads the state), polling the progress
     * view every min(min_refresh, matchmaking_window / 4). With
     * max_local_samples = b and target_batch_size = P·b, each of P peers
     * contributes exactly one batch of b per epoch ("exact" mode: the run
     * equals a single process with batch P·b). The run needs peers whose caps
     * add up to the target, else the waiting peers wait for ever (until
     * someone joins). Delayed updates: the cap also bounds the batches
     * accumulated for the next epoch during a background round. */
    uint64_t max_local_samples;
    /* Group formation through the averaging module's DHT matchmaker
     * (ap_avg_match_start, key "<run_id>_grad_<epoch>", target group size =
     * the peers of this epoch in the progress view, min 2, deadline = now +
     * matchmaking_window) instead of the READY-window scheme over the
     * progress records (default false; docs/training.md, "Groups"). A peer
     * that became ready after the epoch's window closed still counts as late.
     * Creates a matchmaker on the runtime (one per node). */
    bool dht_matchmaking;
    /* The model's shape as the application names it (e.g. "gpt L2 H4 E128
     * T64"), part of the run's configuration every peer must share; at most
     * AP_RUN_CONFIG_MODEL_MAX - 1 printable bytes, copied. NULL = none (the
     * parameter count still must match). */
    const char *model_desc;
    /* Byzantine-tolerant gradient averaging (default false; docs/btard.md):
     * every reducer of a gradient round aggregates the peers' copies of its
     * part with CenteredClip (ButterflyClip, apiary/btard.h) instead of the
     * weighted mean, so that a few peers' poisoned gradients move each part
     * by at most b·tau/(n − b). Every peer of the run must set the same
     * three values. State rounds stay the mean: a Byzantine-tolerant run
     * should set average_state_every = 0. */
    bool byzantine_tolerant;
    double btard_tau;        /* CenteredClip radius over one part, L2 (0 = 1.0) */
    uint32_t btard_max_iter; /* CenteredClip steps at most (0 = 100) */
    /* With byzantine_tolerant every gradient round is also checked by the
     * verified step (apiary/btard.h) before it is applied: a round that
     * fails the check is dropped by every member, an aggregator proven to
     * have cheated is banned for the run (a ban record in the DHT, read by
     * every peer) and left out of groups from then on.
     * btard_attack_shift (experiments; 0 = honest): as an aggregator, add
     * this to every element of the part it aggregates. */
    float btard_attack_shift;
    /* btard_attack_step (experiments; AP_BTARD_STEP_HONEST = 0 = honest):
     * this peer attacks the check (a false accuser, a withheld reveal, ...;
     * apiary/btard.h ap_btard_step_attack_t). */
    ap_btard_step_attack_t btard_attack_step;
    /* Closed runs (apiary/run_token.h; docs/closed_runs.md). run_owner: the
     * owner's PeerID as text; set, the run is CLOSED: this peer takes part
     * only with a valid unexpired token of its own (ap_collab_start fails
     * with AP_EPERM otherwise, ap_collab_refusal says why), ignores the
     * progress records of peers without one or revoked by the owner, refuses
     * their state requests and group joins, and stops (AP_EPERM from the
     * next submit) when the owner revokes it. NULL = an open run: no token
     * is checked. token: this peer's token in text form (NULL = none; the
     * owner needs none), carried in its records and state requests. Both are
     * copied; a malformed one is AP_EINVAL from ap_collab_new. */
    const char *run_owner;
    const char *token;
    /* The verified step's gradient check (byzantine_tolerant; docs/btard.md,
     * "Gradient check"): btard_validators members of every gradient round,
     * picked by the step's seed, recompute another member's gradient with
     * btard_grad and accuse it on a mismatch; every member judges each
     * accusation with btard_grad too. 0 = off (the default); at most
     * AP_BTARD_STEP_MAX_PEERS; every peer of the run must set the same value
     * (it is part of the run's configuration). With it on, the vector this
     * peer sends in a gradient round is btard_grad's on its own seed (the
     * submitted gradients still count the epoch's samples and loss), so a
     * validator's recomputation has the same bits. Needs btard_grad and is
     * refused with delayed_updates or average_state_every != 0 (AP_EINVAL
     * from ap_collab_new): state rounds leave the members with different
     * parameters, so no validator could recompute another's gradient. */
    uint32_t btard_validators;
    ap_collab_grad_fn btard_grad;
    void *btard_grad_arg;
} ap_collab_config_t;

/* Defaults: role NORMAL, Adam defaults, constant lr 1e-3, state averaging
 * every 5 epochs, load_state_on_start true, the zeros above. run_id and
 * target_batch_size must still be set. */
AP_EXPORT void ap_collab_config_default(ap_collab_config_t *cfg);

typedef struct ap_collab_stats {
    uint64_t epoch;                /* global epoch this peer is in */
    uint64_t local_samples;        /* accumulated in this epoch */
    double global_samples;         /* estimate for this epoch, all peers */
    double global_sps;             /* sum of the fresh training peers' speeds (any epoch) */
    double eta_s;                  /* estimated seconds until the epoch is due */
    uint32_t peers;                /* fresh records in the run (any epoch) */
    uint32_t last_group_size;      /* members of the last averaging round */
    double last_averaged_fraction; /* of the last gradient round (1 = complete) */
    uint64_t last_epoch_samples;   /* samples the last global step averaged */
    uint64_t epochs_failed;        /* epochs stepped with incomplete averaging */
    uint64_t state_rounds;         /* state averaging rounds completed */
    uint64_t state_loads;          /* successful state downloads */
    uint64_t state_parts_refused;  /* downloaded parts refused (bad shape/corrupt) */
    uint64_t records_refused;      /* progress records refused as impossible */
    uint64_t bytes_served;         /* state bytes sent to others */
    float last_loss;               /* mean loss of the last submitted batch */
    uint64_t rounds;               /* gradient averaging rounds completed (any outcome) */
    /* averaging payload bytes, cumulative: every round (gradient and state) */
    uint64_t bytes_sent, bytes_received;
    uint32_t last_round_ms; /* duration of the last gradient round */
    /* delayed updates: samples submitted while a background round ran */
    uint64_t samples_during_rounds;
    uint64_t delayed_steps; /* steps applied from the background */
    /* submits whose callback was held: at max_local_samples, or (delayed
     * updates) at this peer's share of the next epoch during a round */
    uint64_t submits_held;
    /* samples of an epoch whose round was over without them (late peer:
     * missed the group, or behind the others), discarded */
    uint64_t samples_dropped;
    /* Where the caller's time went while a submit's callback was held
     * (microseconds, cumulative; with delayed updates the background part
     * of a round is not counted): from READY to the start of its round
     * (matchmaking), in the gradient and state rounds and the step, and
     * downloading the state as a laggard. */
    uint64_t group_wait_us, averaging_us, download_us;
    /* donors that failed a state download (each is then left out of
     * downloads for a back-off doubling per failure, 1 s .. 60 s) */
    uint64_t state_donor_failures;
    /* progress records refused because the peer's run configuration differs
     * (each peer logged once per configuration) */
    uint64_t peers_refused;
    bool refused; /* the run refused this peer's configuration (ap_collab_refusal) */
    /* closed runs: progress records ignored for want of a valid token
     * (missing, expired, forged, another peer's) or revoked, and state
     * requests and group joins refused for that reason */
    uint64_t unauthorized_records, unauthorized_requests;
    bool shut_out; /* closed run: this peer has no valid token or was revoked */
    /* byzantine_tolerant: peers banned (convicted here or read from the
     * DHT), and gradient rounds dropped because their check failed */
    uint64_t peers_banned, btard_steps_dropped;
    /* epochs stepped at once because no other peer of the run had a fresh
     * record (no group to wait for: the matchmaking window was skipped) */
    uint64_t lone_epochs;
    /* byzantine_tolerant: members this peer named for not delivering in a
     * gradient round, and members most of a group named, left out of it
     * (docs/btard.md, "Members that do not deliver") */
    uint64_t btard_named, btard_left_out;
} ap_collab_stats_t;

/* Called on the loop thread. status: 0, or an error (see each function). */
typedef void (*ap_collab_fn)(ap_rt_t *rt, void *arg, int status);

/* Creates the optimizer. dht and svc (the node's DHT and averaging service)
 * are borrowed and must outlive it. params (n floats) is borrowed (see
 * BUFFERS); views (may be NULL) give LAMB its per-layer segments and are
 * copied. Registers AP_COLLAB_STATE_PROTO on rt (one collab per runtime).
 * AP_EINVAL on a bad config. Loop thread. */
AP_EXPORT int ap_collab_new(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                            const ap_collab_config_t *cfg, float *params, size_t n,
                            const ap_nn_view_t *views, size_t nviews, ap_collab_t **out);
/* Cancels everything pending (callbacks run with AP_ECANCELED first), frees.
 * NULL is a no-op. Not from inside one of its callbacks. */
AP_EXPORT void ap_collab_free(ap_collab_t *c);
/* Switches a normal peer to client-only (it cannot accept connections: it
 * neither reduces a part nor serves the state) or back, from the next
 * round on, e.g. when the node learns it is behind a NAT (apiary/node.h,
 * ap_node_nat_start). AP_ESTATE for an auxiliary peer. Loop thread. */
AP_EXPORT int ap_collab_set_client(ap_collab_t *c, bool client);

/* Joins the run: reads the progress records; if donors exist and
 * load_state_on_start, downloads the state (epoch, parameters, optimizer
 * state) from them, else keeps params as they are (the caller initialised
 * them; every first peer must use the same initialisation). Then reports
 * progress and starts the refresh timer. cb runs once; status 0, AP_ECONFIG
 * (every other peer of the run has another configuration: this peer must
 * not train; ap_collab_refusal names the field), or the download error
 * (params untouched then; the peer may still train), or AP_EPERM (a closed
 * run's owner revoked this peer). Returns AP_EPERM at once (cb not called)
 * when the run is closed and this peer has no valid unexpired token of its
 * own: ap_collab_refusal then says "run R is closed: ask its owner for a
 * token" (or why its token is not valid). An AUX
 * peer then follows the epochs by itself and joins every round. */
AP_EXPORT int ap_collab_start(ap_collab_t *c, ap_collab_fn cb, void *arg);

/* Adds one local batch: grad (n floats, the MEAN gradient over `samples`
 * samples; copied, borrowed for the call) and its mean loss. Reports progress
 * and, if the epoch is due, runs the averaging round and the optimizer step
 * (params change), or, if this peer is behind the others, downloads their
 * state. cb runs once when the caller may compute the next batch; status 0,
 * AP_ECANCELED (freed), AP_ECONFIG (the run refused this peer's
 * configuration: see ap_collab_refusal; every later submit returns it too),
 * AP_EPERM (closed run: the owner revoked this peer; every later submit too)
 * or AP_EBUSY (a submit is pending: cb is not called).
 * Not for AUX peers (AP_ESTATE). */
AP_EXPORT int ap_collab_submit(ap_collab_t *c, const float *grad, uint32_t samples, float loss,
                               ap_collab_fn cb, void *arg);

/* Delayed updates: copies a step finished in the background into params.
 * Returns 1 if params changed, 0 if no update is waiting, AP_EBUSY while a
 * background round runs (params untouched). The caller must not be computing
 * on params. Loop thread. (ap_collab_submit does this by itself.) */
AP_EXPORT int ap_collab_apply_update(ap_collab_t *c);
/* The freshest parameters: the optimizer's copy while a background step
 * runs or waits to be copied (delayed updates), else params. Read-only,
 * owned by the collab. Loop thread. */
AP_EXPORT const float *ap_collab_current_params(const ap_collab_t *c);
/* Whether a background round (delayed updates) is running or its update
 * waits to be copied into params. */
AP_EXPORT bool ap_collab_update_pending(const ap_collab_t *c);

/* A checkpoint consistent with one epoch, from the optimizer's buffers: the
 * freshest parameters (ap_collab_current_params), the optimizer state and
 * the epoch (stored as the checkpoint's step), encoded by the model kit
 * (ap_nn_checkpoint_encode_flat; m gives the shape only and its buffers are
 * not read, so the caller may be computing on them). Works at any moment on
 * the loop thread, also while a background round runs or its update waits
 * (delayed updates): step, epoch and state change together there. *buf is
 * malloc'd (caller frees; write it with ap_nn_checkpoint_write, off the loop
 * thread); *epoch may be NULL. AP_EINVAL if m's size differs, AP_ESTATE for
 * an AUX peer (no parameters). Resume with ap_nn_checkpoint_load into the
 * model and ap_collab_solver_mut, then ap_collab_set_epoch(step). */
AP_EXPORT int ap_collab_checkpoint_encode(const ap_collab_t *c, ap_nn_model_t *m, uint8_t **buf,
                                          size_t *len, uint64_t *epoch);

AP_EXPORT void ap_collab_get_stats(const ap_collab_t *c, ap_collab_stats_t *out);
/* This peer's run configuration (what its records carry). */
AP_EXPORT void ap_collab_run_config(const ap_collab_t *c, ap_run_config_t *out);
/* Why the run refused this peer (its configuration differs: the field and
 * both values), once an operation ended with AP_ECONFIG, or why a closed
 * run shuts it out, once one ended with AP_EPERM; NULL otherwise.
 * Owned by the collab, valid until it is freed; readable from the user's
 * thread after the *_sync call that returned AP_ECONFIG. */
AP_EXPORT const char *ap_collab_refusal(const ap_collab_t *c);

/* byzantine_tolerant: whether peer is in this peer's ban list (convicted
 * here or read from the DHT); false otherwise. On the runtime's thread. */
AP_EXPORT bool ap_collab_banned(const ap_collab_t *c, const ap_peer_id_t *peer);
AP_EXPORT uint64_t ap_collab_epoch(const ap_collab_t *c);
/* The optimizer state (owned by the collab; read-only for the caller). */
AP_EXPORT const ap_nn_solver_t *ap_collab_solver(const ap_collab_t *c);
/* Overrides the epoch and optimizer state, e.g. when resuming from a
 * checkpoint (ap_nn_checkpoint_load into ap_collab_solver_mut). Loop thread,
 * only while nothing is pending. */
AP_EXPORT ap_nn_solver_t *ap_collab_solver_mut(ap_collab_t *c);
AP_EXPORT void ap_collab_set_epoch(ap_collab_t *c, uint64_t epoch);

/* Lets a pending submit go: its callback runs now with AP_ECANCELED (the
 * batch stays counted; rounds in progress go on). For a caller that must
 * stop (a signal, a deadline) while an epoch waits for peers that may never
 * come. No-op when no submit is pending. Loop thread. */
AP_EXPORT void ap_collab_release(ap_collab_t *c);

/* ---- a step made by the caller ------------------------------------------------
 *
 * For an optimizer of the caller's own (e.g. a PyTorch one over views of these
 * buffers): the collab runs exactly as above (accumulation, rounds, state
 * averaging, state sharing), but where it would apply its solver's step it
 * calls step_fn instead. The model kit's solver is still created from
 * cfg->solver (its kind and settings are part of the run configuration every
 * peer must share) but only its step counter is used; cfg->lr is not read.
 *
 * step_fn runs on the loop thread, once per global epoch that stepped, with
 *   params  the buffer to update in place: the caller's params, or with
 *           delayed updates the optimizer's own copy (ap_collab_buffers),
 *           which the collab copies into params at the next submit;
 *   grad    the averaged gradient (n floats; clipped to max_grad_norm; the
 *           function may overwrite it);
 *   epoch   the global epoch this step ends;
 *   step    the steps this optimizer took before (downloaded with the state).
 * It returns 0, or a negative error: the step is then skipped (logged) and the
 * step counter stays. It must not call into the collab.
 *
 * The optimizer STATE is state_count floats owned by the collab
 * (ap_collab_buffers), zero-initialised: the caller keeps its optimizer's
 * state there (views), so that state averaging and state downloads carry it
 * like the solver's state. Peers must use one state layout (state_count is
 * part of the run configuration). */
typedef int (*ap_collab_step_fn)(void *arg, float *params, float *grad, uint64_t epoch,
                                 uint64_t step);

/* ap_collab_new (no LAMB views) with the caller's step and state_count floats
 * of optimizer state. AP_EINVAL also if step_fn is NULL. Loop thread. */
AP_EXPORT int ap_collab_new_custom(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                                   const ap_collab_config_t *cfg, float *params, size_t n,
                                   size_t state_count, ap_collab_step_fn step_fn, void *arg,
                                   ap_collab_t **out);
/* The collab's buffers, stable for its lifetime (any pointer may be NULL):
 * *shadow the delayed updates' copy of the parameters (NULL without delayed
 * updates), *grad the buffer step_fn gets the averaged gradient in (n
 * floats), *state the optimizer state (*state_count floats; NULL if 0). Any
 * thread (the pointers do not change). */
AP_EXPORT void ap_collab_buffers(ap_collab_t *c, float **shadow, float **grad, float **state,
                                 size_t *state_count);
/* Steps taken by the optimizer (the solver's counter: downloaded with the
 * state, set by ap_collab_resume). Loop thread, or from the *_sync caller's
 * thread while no submit is pending and no background round runs. */
AP_EXPORT uint64_t ap_collab_optim_step(const ap_collab_t *c);
/* Resumes from a checkpoint of the caller's own: epoch (ap_collab_set_epoch)
 * and the optimizer's step counter (the caller wrote params and the state
 * buffer). Loop thread, only while nothing is pending. */
AP_EXPORT void ap_collab_resume(ap_collab_t *c, uint64_t epoch, uint64_t optim_step);
AP_EXPORT int ap_collab_new_custom_sync(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                                        const ap_collab_config_t *cfg, float *params, size_t n,
                                        size_t state_count, ap_collab_step_fn step_fn, void *arg,
                                        ap_collab_t **out);
AP_EXPORT int ap_collab_resume_sync(ap_collab_t *c, uint64_t epoch, uint64_t optim_step);

/* ---- blocking wrappers for a user thread (real driver, apiary/node.h) -------- */

/* ap_collab_new / _free on the loop thread. */
AP_EXPORT int ap_collab_new_sync(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                                 const ap_collab_config_t *cfg, float *params, size_t n,
                                 const ap_nn_view_t *views, size_t nviews, ap_collab_t **out);
AP_EXPORT void ap_collab_free_sync(ap_rt_t *rt, ap_collab_t *c);
AP_EXPORT int ap_collab_start_sync(ap_collab_t *c);
/* ap_collab_release on the loop thread, from any other thread (e.g. a
 * watchdog while the training thread is blocked in ap_collab_submit_sync). */
AP_EXPORT void ap_collab_release_sync(ap_collab_t *c);
/* Blocks until the submit's callback; returns its status. */
AP_EXPORT int ap_collab_submit_sync(ap_collab_t *c, const float *grad, uint32_t samples,
                                    float loss);
AP_EXPORT int ap_collab_get_stats_sync(ap_collab_t *c, ap_collab_stats_t *out);
/* ap_collab_checkpoint_encode on the loop thread (the encoding is a copy;
 * write the file on the calling thread). */
AP_EXPORT int ap_collab_checkpoint_encode_sync(ap_collab_t *c, ap_nn_model_t *m, uint8_t **buf,
                                               size_t *len, uint64_t *epoch);

#ifdef __cplusplus
}
#endif
#endif
