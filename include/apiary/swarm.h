/* Apiary — SWARM parallelism: pipeline stages served by swarms of peers.
 *
 * A model is cut into S pipeline stages. Each stage is served by a swarm of
 * peers holding a replica of that stage; trainers push micro-batches through
 * the pipeline and choose, per stage and per call, one server of that stage.
 * See docs/swarm.md for the design.
 *
 * This header holds the parts a trainer uses to choose servers.
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
 *     deliver is judged by what it delivers.
 *   - A newly seen server, or one coming back from a ban, enters at the
 *     current minimum key: it neither gets a burst of catch-up tasks nor waits
 *     behind the others' history.
 *   - A failed call (the server refused, answered garbage, or the connection
 *     broke) bans the server until its DHT record expires: it gets no task
 *     until a record refreshed after that instant says it is back. A timeout
 *     does not ban (the server may just be slow): it counts as a call that
 *     took at least the deadline.
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
#include "apiary/error.h"
#include "apiary/peer.h"

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
    double default_throughput; /* units/s assumed when nothing is known; 0 = 1 */
} ap_swarm_balancer_opts_t;

/* One server's state, for status lines and tests. */
typedef struct ap_swarm_server_info {
    ap_peer_id_t peer;
    double throughput;   /* measured (or announced until measured), units/s */
    bool measured;       /* at least one call completed */
    bool banned;         /* banned at the time asked */
    uint64_t expires_us; /* its DHT record's expiry */
    uint64_t tasks;      /* tasks picked for it */
    uint64_t ok, failed, timed_out;
} ap_swarm_server_info_t;

/* opts may be NULL (defaults). NULL if out of memory. */
AP_EXPORT ap_swarm_balancer_t *ap_swarm_balancer_new(const ap_swarm_balancer_opts_t *opts);
AP_EXPORT void ap_swarm_balancer_free(ap_swarm_balancer_t *b);

/* Adds a server seen in the DHT, or refreshes one: announced is the
 * throughput its record claims (units/s; ignored once measured, or if not
 * finite and positive), expires_us when its record expires. A new server
 * enters at the current minimum key. AP_ELIMIT beyond AP_SWARM_BALANCER_MAX
 * servers, AP_ENOMEM. */
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
 * (ban until the server's record expires). size is the task's size. Unknown
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

#ifdef __cplusplus
}
#endif
#endif
