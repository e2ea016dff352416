/* Internals of the collaborative optimizer (src/optim/). */
#ifndef AP_OPTIM_COLLAB_IMPL_H
#define AP_OPTIM_COLLAB_IMPL_H

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/btard.h"
#include "apiary/collab.h"
#include "apiary/nn.h"
#include "apiary/progress.h"
#include "apiary/run_config.h"
#include "apiary/run_token.h"
#include "optim.pb-c.h"

#include <sodium.h>

#define OPT_MOD          "optim"
#define AP__STATE_CHUNK  16384 /* floats per state chunk message (64 KiB) */
#define AP__MAX_SERVING  8     /* concurrent state uploads per donor */
#define AP__MAX_RANGES   64    /* download ranges (parts and re-requests) */
#define AP__PROGRESS_MAX 1024  /* bytes of an encoded progress record (config, token, left_out) */
#define AP__VIEW_MAX     4096  /* progress records kept per fetch */
#define AP__REFUSED_LOG  64    /* peers of another configuration remembered (logged once) */
#define AP__REVOKED_MAX  1024  /* revoked peers of a closed run kept */
/* Peers that leave: a record that has not changed for AP__REPORT_MISSED of
 * its peer's report intervals plus AP__REPORT_SLACK_MS (store latency, timers
 * late under load), by our own clock between fetches, counts as gone (it is
 * out of the counts, groups and downloads) without waiting for stale_ms. */
#define AP__REPORT_MISSED   3
#define AP__REPORT_SLACK_MS 2000
#define AP__REPORT_MAX_MS   1000 /* our report interval: min(this, stale_ms / 4) */

/* When a peer's record last changed, by our wall clock (view.c). */
typedef struct view_seen {
    ap_peer_id_t peer;
    int64_t time_ms; /* the record's time then */
    int64_t seen_ms; /* our clock when we first saw that time */
} view_seen_t;

typedef enum collab_phase {
    PH_IDLE = 0,
    PH_STARTING,
    PH_REPORTING, /* submit: store + fetch before deciding */
    PH_AVERAGING,
    PH_STATE_AVG,
    PH_DOWNLOADING,
    PH_WAITING, /* at max_local_samples: the submit waits for the epoch's round */
} collab_phase_t;

typedef struct dl_range {
    uint64_t offset, count, received;
    int donor; /* index in dl.donors, -1 unassigned */
    ap_stream_t *s;
    bool hdr, hashed, done;
    crypto_generichash_state hs;
} dl_range_t;

/* Reports a finished download: status 0 with the donors' epoch and optimizer
 * step (the buffer given to ap__state_download holds the state), or the
 * error that ended it. */
typedef void (*ap__dl_fn)(struct ap_collab *c, int status, uint64_t epoch, uint64_t optim_step);

typedef struct dl_state {
    bool active;
    ap_peer_id_t donors[AP_COLLAB_MAX_DONORS];
    bool donor_bad[AP_COLLAB_MAX_DONORS];
    int ndonors;
    dl_range_t ranges[AP__MAX_RANGES];
    int nranges;
    float *dst; /* the caller's buffer: total floats */
    uint64_t min_epoch;
    bool have_epoch;
    uint64_t epoch, optim_step;
    uint64_t timer;
    int open_streams;
    int status; /* first fatal error */
    ap__dl_fn done;
} dl_state_t;

/* A donor that failed a download part: left out of downloads until `until`
 * (back-off doubling per failure, from AP__BACKOFF_MIN_US to
 * AP__BACKOFF_MAX_US); a part it delivers forgets it. */
#define AP__DONOR_MEMO     32
#define AP__BACKOFF_MIN_US 1000000ull
#define AP__BACKOFF_MAX_US 60000000ull
typedef struct donor_memo {
    ap_peer_id_t id;
    uint32_t fails;
    uint64_t until_us;
    char why[48]; /* the last failure, for the log */
} donor_memo_t;

typedef struct serve_ctx {
    struct ap_collab *c;
    ap_stream_t *s;
    float *snap;
    uint64_t count, sent;
    bool hash_sent;
    uint8_t hash[32];
} serve_ctx_t;

struct ap_collab {
    ap_rt_t *rt;
    ap_dht_t *dht;
    ap_avg_service_t *svc;
    ap_collab_config_t cfg;
    char run_id[AP_COLLAB_RUN_ID_MAX + 1];
    uint8_t run_hash[32];
    char key[AP_COLLAB_RUN_ID_MAX + 16];
    size_t key_len;
    char subkey[AP_PEER_ID_STR_MAX + 16];
    size_t subkey_len;

    float *params;
    size_t n;
    ap_nn_solver_t *opt;
    float *acc; /* n: Σ grad·samples of this epoch */
    float *buf; /* total = n + state_count: averaging and downloads */
    size_t total;
    size_t buf_bytes, acc_bytes;
    /* delayed updates (NULL otherwise): the next epoch's accumulator while a
     * round runs in the background, and the optimizer's copy of params that
     * the background step writes */
    float *acc_next, *shadow;
    uint64_t next_samples;
    bool bg;             /* a round runs in the background (the caller is computing) */
    bool adopt;          /* shadow holds a finished update not yet copied into params */
    bool bg_stepped;     /* the background round stepped (accumulators swapped) */
    int64_t bg_start_ms; /* wall clock when the background round began */
    double ready_sps;    /* our speed in the READY record (the background cap's share) */
    uint64_t wait_timer; /* PH_WAITING: next poll of the view */

    uint64_t epoch;
    uint64_t local_samples;
    int64_t epoch_start_ms;
    double sps;
    uint64_t last_submit_us, started_us;
    /* where a held submit's time goes (stats group/averaging/download_us):
     * when this peer became ready, its round began, its download began */
    uint64_t mark_ready_us, mark_round_us, mark_dl_us;
    bool started;
    bool has_loss; /* a batch was submitted: st.last_loss is a loss (0 included) */

    /* the latest view of the run */
    ap_progress_t *view;
    size_t nview;
    int64_t *view_seen;     /* per entry: our wall clock when its record last changed */
    bool *view_silent;      /* per entry: it missed its report intervals (gone) */
    view_seen_t *seen_prev; /* scratch: the previous view's, sorted by peer */
    int64_t report_ms;      /* the interval our records promise */
    uint64_t view_at_us;
    /* the last view: others_seen_us != 0 if it had a fresh record of another
     * peer; alone_since_us: when the views last turned to none */
    uint64_t others_seen_us, alone_since_us;
    bool fetching;
    int64_t last_exp_ms;
    uint64_t last_report_us;
    uint64_t refresh_timer;

    /* the pending submit / start */
    collab_phase_t phase;
    ap_collab_fn cb;
    void *cb_arg;

    /* averaging */
    ap_allreduce_t *ar;
    ap_avg_member_t members[AP_AVG_MAX_PEERS];
    size_t nmembers;
    uint64_t round_samples;
    bool aux_in_round;
    int64_t ready_ms;  /* when this peer became ready in this epoch (0 = not) */
    int64_t cutoff_ms; /* the epoch's group: ready by this time */
    uint64_t mm_timer;
    ap_avg_matchmaker_t *mm; /* dht_matchmaking: the averaging module's matchmaker */
    ap_avg_search_t *search; /* the running search (NULL = none) */
    char mm_key[AP_COLLAB_RUN_ID_MAX + 64];
    /* byzantine_tolerant (btard_step.c): the recording reducer, the check
     * services, what this peer sent into the round, the ban list */
    ap_btard_vclip_t vclip;
    ap_btard_svc_t *bmprng;
    ap_btard_step_svc_t *bstep;
    float *bsent;
    ap_btard_banlist_t *banlist;
    bool verifying, bans_fetching;
    /* the last check found this peer's parameters not the group's: reload
     * them from the members that were in sync (resync_from) */
    bool resync;
    size_t nresync;
    ap_peer_id_t resync_from[AP_BTARD_STEP_MAX_PEERS];
    /* members that did not deliver in one of this peer's gradient rounds,
     * named in its records until epoch `until` (exclusive); a member most
     * of the group names is left out of the group (round.c) */
    struct {
        ap_peer_id_t peer;
        uint64_t until;
    } shun[AP_PROGRESS_LEFT_OUT_MAX];
    size_t nshun;

    /* the run's configuration (progress records, matchmaking key) */
    ap_run_config_t runcfg;
    uint8_t cfg_digest[AP_RUN_CONFIG_DIGEST_LEN];
    char cfg_hex[2 * 8 + 1]; /* the digest's first 8 bytes, for the matchmaking key */
    bool refused;            /* the run refused our configuration: every operation fails */
    char refusal[AP_RUN_CONFIG_MSG_MAX + 96];
    struct {
        ap_peer_id_t id;
        uint8_t digest[AP_RUN_CONFIG_DIGEST_LEN];
    } refused_log[AP__REFUSED_LOG]; /* peers refused and logged (once per configuration) */
    int nrefused_log, refused_next;

    /* closed runs (closed.c) */
    bool closed;        /* cfg.run_owner set */
    ap_peer_id_t owner; /* the run's owner */
    bool has_token;     /* cfg.token given (parsed) */
    ap_run_token_t token;
    bool shut_out; /* no valid token of our own, or revoked: every operation fails */
    char revoked_key[AP_COLLAB_RUN_ID_MAX + 16];
    size_t revoked_key_len;
    ap_peer_id_t *revoked; /* AP__REVOKED_MAX */
    size_t nrevoked;
    struct {
        ap_peer_id_t id;
        int why;
    } unauth_log[AP__REFUSED_LOG]; /* peers refused for want of a token (logged once) */
    int nunauth_log, unauth_next;

    dl_state_t dl;
    donor_memo_t memo[AP__DONOR_MEMO];
    int nmemo;
    serve_ctx_t *serving[AP__MAX_SERVING];

    /* ap_collab_new_custom: the caller's step replaces the solver's */
    ap_collab_step_fn step_fn;
    void *step_arg;

    ap_collab_stats_t st;
    int refs;  /* async operations holding a pointer to this object */
    bool dead; /* ap_collab_free ran; memory goes when refs reaches 0 */
};

/* ---- state.c: state sharing ---- */
int ap__state_listen(struct ap_collab *c);
void ap__state_unlisten(struct ap_collab *c);
void ap__state_abort_serving(struct ap_collab *c);
/* How many donors a download would use: fresh donor records at epoch >=
 * min_epoch and not in back-off. 0 = no donor at all; AP_EAGAIN = donors
 * exist but every one failed recently (logged with the reasons). */
int ap__state_donors(struct ap_collab *c, uint64_t min_epoch);
/* Downloads [params | optimizer state] (c->total floats) into dst from the
 * donors (as ap__state_donors) at the highest epoch among them. Writes
 * nothing else of the collab; done runs once (also from inside this call on
 * an immediate failure). AP_ENOTFOUND / AP_EAGAIN (done not called) as
 * ap__state_donors, AP_EBUSY if one runs. */
int ap__state_download(struct ap_collab *c, float *dst, uint64_t min_epoch, ap__dl_fn done);
void ap__state_download_abort(struct ap_collab *c, int err);

/* ---- collab.c: lifetime, start, submit ---- */
/* ap_collab_new with, if state_count != SIZE_MAX, an optimizer state of
 * state_count floats instead of the solver's (ap_collab_new_custom). */
int ap__collab_create(ap_rt_t *rt, ap_dht_t *dht, ap_avg_service_t *svc,
                      const ap_collab_config_t *cfg, float *params, size_t n,
                      const ap_nn_view_t *views, size_t nviews, size_t state_count,
                      ap_collab_t **out);
void ap__collab_unref(struct ap_collab *c);
/* The freshest parameters (shadow during/after a background step). */
const float *ap__collab_cur_params(const struct ap_collab *c);
/* Runs the pending callback (if any) without touching the phase. */
void ap__collab_release_user(struct ap_collab *c, int status);
/* Ends the pending operation: back to IDLE, then the callback (or, at
 * max_local_samples, keeps waiting for this epoch's round). */
void ap__collab_finish_user(struct ap_collab *c, int status);
bool ap__collab_at_local_cap(const struct ap_collab *c);

/* ---- view.c: progress records and the view of the run ---- */
typedef void (*ap__step_fn)(struct ap_collab *c);
typedef struct ap__estimate {
    double global, sps, eta_s;
    double sps_all;    /* every fresh training peer's speed, any epoch, me included */
    uint64_t reported; /* samples reported (not extrapolated) in my epoch, me included */
    uint64_t max_epoch;
    uint32_t peers;
} ap__estimate_t;
bool ap__collab_is_self(const struct ap_collab *c, const ap_peer_id_t *p);
/* View entry i is a live peer: its record is younger than stale_ms and it has
 * not missed its report intervals. */
bool ap__collab_fresh(const struct ap_collab *c, size_t i, int64_t now_ms);
void ap__collab_estimate(struct ap_collab *c, ap__estimate_t *e);
void ap__collab_update_stats(struct ap_collab *c);
/* Stores our record; next (may be NULL) runs when the store ends. */
void ap__collab_report(struct ap_collab *c, ap__step_fn next);
/* Reads the records into the view; next (may be NULL) runs then. */
void ap__collab_fetch(struct ap_collab *c, ap__step_fn next);
void ap__collab_schedule_refresh(struct ap_collab *c);
int64_t ap__collab_first_ready(struct ap_collab *c);
bool ap__collab_gathering(struct ap_collab *c);
void ap__collab_aux_check(struct ap_collab *c);

/* ---- round.c: groups, averaging rounds and the epoch decision ---- */
void ap__collab_decide(struct ap_collab *c);
void ap__collab_fetch_decide(struct ap_collab *c);
void ap__collab_begin_averaging(struct ap_collab *c);
uint64_t ap__collab_bg_cap(struct ap_collab *c);
void ap__collab_after_epoch(struct ap_collab *c);

/* ---- runcfg.c: the run's configuration ---- */
void ap__collab_make_run_config(const struct ap_collab *c, ap_run_config_t *rc);
/* The RunConfig message of progress records and state requests (progress.c):
 * from_pb validates an untrusted one (AP_ECORRUPT / AP_ERANGE). to_pb points
 * m->model into rc. */
void ap__run_config_to_pb(const ap_run_config_t *rc, Apiary__Optim__RunConfig *m);
int ap__run_config_from_pb(const Apiary__Optim__RunConfig *m, ap_run_config_t *rc);

/* ---- closed.c: closed runs (apiary/run_token.h) ---- */
/* token.c: the bytes a token's signature covers (out: AP__TOKEN_MSG_MAX);
 * for signers other than an ap_identity_t (ap_rt_sign in tests). */
#define AP__TOKEN_MSG_MAX (20 + AP_COLLAB_RUN_ID_MAX + 1 + AP_PEER_ID_LEN + 8)
size_t ap__run_token_message(const char *run_id, const ap_peer_id_t *peer, int64_t expires_ms,
                             uint8_t *out);
/* Reads cfg.run_owner / cfg.token (AP_EINVAL if malformed, logged). */
int ap__closed_init(struct ap_collab *c);
void ap__closed_free(struct ap_collab *c);
/* Whether peer may take part: 0, or why not (AP_ENOTFOUND no token,
 * AP_ESTALE revoked, or ap_run_token_verify's error). Always 0 in an open
 * run and for the owner. tok may be NULL (none). */
int ap__closed_check(struct ap_collab *c, const ap_peer_id_t *peer, const ap_run_token_t *tok);
/* Logs a refusal once per (peer, reason): what = "progress record", ... */
void ap__closed_note(struct ap_collab *c, const ap_peer_id_t *peer, int why, const char *what);
/* This peer's own admission: 0, or AP_EPERM with c->refusal set and logged. */
int ap__closed_self_check(struct ap_collab *c);
/* The owner's revocation records (the "<run>_revoked" key). */
void ap__closed_absorb_revoked(struct ap_collab *c, const ap_dht_result_t *res);
/* The matchmaker's exclude hook: peers not in the (admitted) view. */
bool ap__closed_exclude(void *arg, const ap_peer_id_t *peer);

/* ---- btard_step.c: byzantine_tolerant rounds ---- */
int ap__btard_collab_init(struct ap_collab *c);
void ap__btard_collab_stop(struct ap_collab *c);
void ap__btard_collab_release(struct ap_collab *c);
bool ap__btard_banned(const struct ap_collab *c, const ap_peer_id_t *peer);
/* The matchmaker's exclude hook: banned peers, and closed runs' unadmitted. */
bool ap__btard_exclude(void *arg, const ap_peer_id_t *peer);
void ap__btard_fetch_bans(struct ap_collab *c);
void ap__btard_before_round(struct ap_collab *c, float *data);
/* After a complete gradient round: starts its check (true; the check ends
 * in ap__collab_grad_finish) or false when it does not apply. */
bool ap__btard_verify(struct ap_collab *c, const ap_allreduce_result_t *res);
/* Names the members that did not deliver in this gradient round (res's
 * member_faults) in this peer's records for the next few epochs. */
void ap__btard_name_faults(struct ap_collab *c, const ap_allreduce_result_t *res);
/* round.c: the end of a gradient round: step (if apply) and go on. */
void ap__collab_grad_finish(struct ap_collab *c, bool apply);

/* ---- epoch.c: the step and the epoch change ---- */
typedef enum ap__epoch_how {
    AP__EPOCH_STEPPED,  /* the epoch's round stepped: epoch + 1 (the epoch argument is ignored) */
    AP__EPOCH_LOADED,   /* a download finished: c->buf holds the state, optim_step given */
    AP__EPOCH_JUMPED,   /* behind without a donor: the others' epoch, local state */
    AP__EPOCH_FOLLOWED, /* an auxiliary peer follows the run's epoch */
    AP__EPOCH_RESUMED,  /* resumed from a checkpoint */
} ap__epoch_how_t;
/* Every change of c->epoch goes through here. */
void ap__collab_enter_epoch(struct ap_collab *c, ap__epoch_how_t how, uint64_t epoch,
                            uint64_t optim_step);
void ap__collab_apply_step(struct ap_collab *c, float *grad);
void ap__collab_drop_epoch_samples(struct ap_collab *c, const char *why);
void ap__collab_load_done(struct ap_collab *c, int status, uint64_t epoch, uint64_t optim_step);

#endif
