/* A whole SWARM run on the network simulator, for the SWARM scenario tests
 * and `apiary bench swarm`: a bootstrap DHT node, stage servers of given
 * speeds (each with its DHT node, announcing itself, and optionally its
 * rebalancing loop), and trainers that keep micro-batches in flight, routed
 * by the DHT alone. Servers train their stage with plain SGD on their own
 * gradients; a moving server copies its new stage's parameters from a live
 * server of that stage before it serves. Speeds are in micro-batches (one
 * forward and one backward of the stage) per virtual second. */
#ifndef APIARY_TESTING_SWARM_WORLD_H
#define APIARY_TESTING_SWARM_WORLD_H

#include "apiary/sim.h"
#include "apiary/swarm.h"

#include <stdbool.h>
#include <stdint.h>

#define AP_TEST_SW_SERVERS_MAX  64
#define AP_TEST_SW_TRAINERS_MAX 16

typedef struct ap_test_sw_cfg {
    uint32_t stages;        /* 1..8 */
    uint32_t slots;         /* server slots (servers joining later included) */
    uint32_t trainers;      /* 1..AP_TEST_SW_TRAINERS_MAX */
    uint32_t inflight;      /* micro-batches each trainer keeps in flight */
    double unit;            /* micro-batches/s of a server of speed 1 */
    bool rebalance;         /* run every server's rebalancing loop */
    uint64_t rebalance_us;  /* its period T (default 2 s) */
    uint64_t announce_us;   /* announcement period (default 1 s; records live 3) */
    uint64_t record_ttl_us; /* the servers' record TTL (0 = 3 announcement periods) */
    bool hetero_links;      /* per-node latency 2..20 ms and bandwidth 50..1000 Mbit/s */
    bool compressed;        /* blockwise 8-bit activations (default float32) */
    uint32_t pipelines;     /* 0 = one SWARM; K = K separate runs (fixed pipelines):
                               slot i serves run i % K, trainer k drives run k % K */
    float lr;               /* the servers' SGD learning rate (0 = default 0.002) */
    float clip;             /* global-norm clip of each SGD step (0 = default 1; < 0: none) */
    uint64_t seed;
} ap_test_sw_cfg_t;

typedef struct ap_test_sw ap_test_sw_t;

/* Builds the world (no server yet); NULL on failure. */
ap_test_sw_t *ap_test_sw_new(const ap_test_sw_cfg_t *cfg);
void ap_test_sw_free(ap_test_sw_t *w);
/* Starts server slot i (< slots) at stage with speed (in units); a slot
 * crashed before may start again (a new server). 0 or an error. */
int ap_test_sw_start(ap_test_sw_t *w, uint32_t i, uint32_t stage, double speed);
/* Crashes server slot i (no-op if down). */
void ap_test_sw_crash(ap_test_sw_t *w, uint32_t i);
/* Starts the trainers (after the servers). */
int ap_test_sw_train(ap_test_sw_t *w);
void ap_test_sw_run(ap_test_sw_t *w, uint64_t us);
ap_sim_t *ap_test_sw_sim(ap_test_sw_t *w);

bool ap_test_sw_up(const ap_test_sw_t *w, uint32_t i);
/* The stage slot i serves now (or last served). */
uint32_t ap_test_sw_stage(const ap_test_sw_t *w, uint32_t i);
double ap_test_sw_speed(const ap_test_sw_t *w, uint32_t i);
uint32_t ap_test_sw_moves(const ap_test_sw_t *w, uint32_t i);
uint64_t ap_test_sw_backwards(const ap_test_sw_t *w, uint32_t i); /* since its start */
/* Totals over the trainers. */
uint64_t ap_test_sw_samples(const ap_test_sw_t *w);
uint64_t ap_test_sw_failed(const ap_test_sw_t *w);
/* SGD steps the servers refused (non-finite gradients). */
uint64_t ap_test_sw_refused(const ap_test_sw_t *w);
uint64_t ap_test_sw_bytes(const ap_test_sw_t *w);
/* Samples/s over the next us of virtual time (runs the world). */
double ap_test_sw_rate(ap_test_sw_t *w, uint64_t us);
/* The least stage total of the live servers' speeds, in samples/s: the
 * pipeline's throughput under the current assignment (ideal). */
double ap_test_sw_assigned(const ap_test_sw_t *w);
/* The best least stage total over every assignment of the live servers
 * (integer speeds), in samples/s; -1 if it cannot be computed. */
double ap_test_sw_optimum(const ap_test_sw_t *w);
/* The rebalancing loop's counters of slot i; AP_ENOTFOUND without one. */
int ap_test_sw_rebalance_stats(const ap_test_sw_t *w, uint32_t i, ap_swarm_rebalance_stats_t *out);
/* The throughput slot i announces now (tokens/s), and whether it is an
 * estimate (not yet measured on served calls). */
double ap_test_sw_announced(const ap_test_sw_t *w, uint32_t i);
bool ap_test_sw_estimated(const ap_test_sw_t *w, uint32_t i);
/* Tokens of a micro-batch (a server of speed v computes v x unit of them
 * per second). */
uint32_t ap_test_sw_tokens(void);
/* Micro-batch rows (samples per micro-batch). */
uint32_t ap_test_sw_rows(void);

#endif
