/* Internals of the collaborative optimizer (src/optim/). */
#ifndef AP_OPTIM_COLLAB_IMPL_H
#define AP_OPTIM_COLLAB_IMPL_H

#include "apiary/optim.h"

#include <sodium.h>

#define OPT_MOD          "optim"
#define AP__STATE_CHUNK  16384 /* floats per state chunk message (64 KiB) */
#define AP__MAX_SERVING  8     /* concurrent state uploads per donor */
#define AP__MAX_RANGES   64    /* download ranges (parts and re-requests) */
#define AP__PROGRESS_MAX 256   /* bytes of an encoded progress record */
#define AP__VIEW_MAX     4096  /* progress records kept per fetch */

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

typedef struct dl_state {
    bool active;
    ap_peer_id_t donors[AP_OPTIM_MAX_DONORS];
    bool donor_bad[AP_OPTIM_MAX_DONORS];
    int ndonors;
    dl_range_t ranges[AP__MAX_RANGES];
    int nranges;
    bool have_epoch;
    uint64_t epoch, optim_step;
    uint64_t timer;
    int open_streams;
    int status; /* first fatal error */
    ap_collab_fn done;
} dl_state_t;

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
    char run_id[AP_OPTIM_RUN_ID_MAX + 1];
    uint8_t run_hash[32];
    char key[AP_OPTIM_RUN_ID_MAX + 16];
    size_t key_len;
    char subkey[AP_PEER_ID_STR_MAX + 16];
    size_t subkey_len;

    float *params;
    size_t n;
    ap_nn_optim_t *opt;
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
    bool started;

    /* the latest view of the run */
    ap_progress_t *view;
    size_t nview;
    uint64_t view_at_us;
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
    char mm_key[AP_OPTIM_RUN_ID_MAX + 32];

    dl_state_t dl;
    serve_ctx_t *serving[AP__MAX_SERVING];

    ap_collab_stats_t st;
    int refs;  /* async operations holding a pointer to this object */
    bool dead; /* ap_collab_free ran; memory goes when refs reaches 0 */
};

/* state.c */
int ap__state_listen(struct ap_collab *c);
void ap__state_unlisten(struct ap_collab *c);
void ap__state_abort_serving(struct ap_collab *c);
/* Downloads from the donors among the view at the highest epoch; done runs
 * once (status 0: params/optimizer/epoch replaced). */
int ap__state_download(struct ap_collab *c, ap_collab_fn done);
void ap__state_download_abort(struct ap_collab *c, int err);

/* collab.c */
void ap__collab_unref(struct ap_collab *c);
/* The freshest parameters (shadow during/after a background step). */
const float *ap__collab_cur_params(const struct ap_collab *c);

#endif
