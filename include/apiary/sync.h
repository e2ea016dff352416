/* Apiary — completing a blocking call (prefix ap_sync_): the token that a
 * function run on a node's loop thread by ap_node_call_sync (apiary/node.h)
 * completes, now or later from a callback. */
#ifndef APIARY_SYNC_H
#define APIARY_SYNC_H

#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ap_sync ap_sync_t;
/* Runs on the loop thread. It must arrange that ap_sync_complete(done, ...)
 * is called exactly once: now, or later from a callback (RPC done, stream
 * on_close, timer...). Callbacks owed by the node always run, at the latest
 * in ap_node_free, so completing from one is enough. */
typedef void (*ap_sync_fn)(ap_rt_t *rt, void *arg, ap_sync_t *done);

/* Completes a call_sync with status. Any thread; exactly once per call. */
AP_EXPORT void ap_sync_complete(ap_sync_t *done, int status);

#ifdef __cplusplus
}
#endif
#endif
