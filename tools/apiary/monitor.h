/* The run monitor (docs/monitor.md): a model of the run built from its
 * progress records, rendered as JSON (/api/state) and Prometheus text
 * (/metrics), and served over HTTP next to a node. */
#ifndef AP_CLI_MONITOR_H
#define AP_CLI_MONITOR_H

#include "apiary/dht.h"
#include "apiary/node.h"
#include "apiary/collab.h"
#include "apiary/progress.h"
#include "apiary/run_config.h"

#include <stddef.h>
#include <stdint.h>

#define MON_PEERS_MAX  1024 /* peers kept (a flood of records beyond is dropped, logged) */
#define MON_HISTORY    512  /* points of the loss and samples/s plots */
#define MON_ROUNDS_MAX 32   /* recent averaging rounds shown */
#define MON_STALE_MS   60000

typedef struct mon_peer {
    char id[AP_PEER_ID_STR_MAX];
    ap_progress_t p;
    int64_t first_seen_ms;
    bool clamped_logged;
} mon_peer_t;

typedef struct mon_point {
    double x, y; /* epoch or wall-clock seconds, value */
} mon_point_t;

typedef struct mon_round {
    uint64_t epoch;
    char peer[16]; /* short id of the reporter */
    uint32_t group, ms;
    double fraction;
    bool failed;
} mon_round_t;

typedef struct mon_state {
    char run_id[AP_COLLAB_RUN_ID_MAX + 1];
    int64_t now_ms;
    uint64_t target_batch;
    mon_peer_t *peers; /* MON_PEERS_MAX */
    size_t npeers;
    mon_point_t loss[MON_HISTORY], sps[MON_HISTORY];
    size_t nloss, nsps;
    mon_round_t rounds[MON_ROUNDS_MAX];
    size_t nrounds, rounds_next;
    uint64_t refreshes, refresh_failures, records_seen, records_refused, records_clamped,
        records_dropped;
    /* summary of the last absorb */
    uint64_t epoch;
    double global_samples, global_sps, eta_s;
    int64_t started_ms;
} mon_state_t;

int mon_state_init(mon_state_t *m, const char *run_id);
void mon_state_free(mon_state_t *m);
/* Folds a DHT read of "<run_id>_progress" into the model: decodes and checks
 * every record (refused ones are counted and logged), clamps absurd monitor
 * fields (logged once per peer), then updates the summary and the plots. */
void mon_state_absorb(mon_state_t *m, const ap_dht_result_t *res, int64_t now_ms);
/* Adds (or replaces) one peer's decoded record; used by absorb and the bench. */
void mon_state_put(mon_state_t *m, const char *peer_id, const ap_progress_t *p);
/* Recomputes the summary and appends plot points. */
void mon_state_update(mon_state_t *m);

/* Render into a malloc'd NUL-terminated string (*len its length); NULL on
 * out of memory. */
char *mon_render_json(const mon_state_t *m, size_t *len);
char *mon_render_metrics(const mon_state_t *m, const char *extra, size_t *len);

/* The page (web/monitor.html, embedded at build time). */
extern const char ap_web_monitor_html[];
extern const size_t ap_web_monitor_html_len;

/* A monitor serving next to a node: a thread reads the run's progress
 * records from dht every period and pushes them to the page's event
 * streams; the HTTP server runs on the node's loop. */
typedef struct mon_server mon_server_t;
int mon_server_start(ap_rt_t *rt, ap_dht_t *dht, const char *run_id, const char *http_addr,
                     mon_server_t **out);
/* The URL of the page ("http://127.0.0.1:PORT/"). */
const char *mon_server_url(const mon_server_t *s);
/* Stops the thread and the HTTP server; before freeing the node. */
void mon_server_stop(mon_server_t *s);

#endif
