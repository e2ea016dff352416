/* Apiary — the real runtime driver's hosts (prefix ap_host_): one libuv loop
 * each, on which nodes (apiary/node.h) live.
 *
 * A HOST owns one libuv loop. Either it runs the loop on its own thread
 * (ap_host_start: the normal case for a node in a program or the CLI), or the
 * caller drives it (ap_host_run_once / ap_host_run_until: tests). Several
 * nodes may live on one host.
 *
 * THREADING. ap_host_* functions are called by the thread that created the
 * host (the "owner"). */
#ifndef APIARY_HOST_H
#define APIARY_HOST_H

#include "apiary/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ap_host ap_host_t;

/* Creates a host with its loop (not running). NULL on failure. */
AP_EXPORT ap_host_t *ap_host_new(void);
/* Starts a thread that runs the loop until ap_host_stop. AP_ESTATE if already
 * started. */
AP_EXPORT int ap_host_start(ap_host_t *h);
/* Stops and joins the loop thread (no-op if not started). Nodes stay alive;
 * the owner may then drive the loop itself or free the host. */
AP_EXPORT void ap_host_stop(ap_host_t *h);
/* Caller-driven mode (host not started): runs one loop iteration, waiting for
 * at most max_wait_us for an event (0 = do not block). Returns whether more
 * work is pending (handles active). */
AP_EXPORT bool ap_host_run_once(ap_host_t *h, uint64_t max_wait_us);
/* Runs the loop until pred(arg) holds (checked after every iteration) or
 * timeout_us of monotonic time passed. Returns whether pred held. pred NULL:
 * run for the whole timeout. */
AP_EXPORT bool ap_host_run_until(ap_host_t *h, bool (*pred)(void *arg), void *arg,
                                 uint64_t timeout_us);
/* Stops the loop thread if any, frees every node still on the host (as
 * ap_node_free), runs the loop until every handle and request is done and
 * closes it. Owner thread only. Returns 0, or AP_EBUSY if the loop could
 * not be closed cleanly (a leak: a bug). */
AP_EXPORT int ap_host_free(ap_host_t *h);

#ifdef __cplusplus
}
#endif
#endif
