/* libuv driver: a node's reachability (AutoNAT v1 client) and port mapping.
 * Internal; the API is ap_node_nat_* in apiary/node.h, docs/nat.md. */
#ifndef AP_RUNTIME_UV_NATMON_H
#define AP_RUNTIME_UV_NATMON_H

#include "apiary/node.h"

struct ap_node;

/* Loop thread: frees the monitor of n, if any (its libp2p host closes
 * asynchronously). */
void ap__natmon_free(struct ap_node *n);
/* Any thread but the loop's (or the driver of a caller-driven host): stops
 * the port mapping of n's monitor, removing the mapping on the gateway
 * (blocking, bounded by the gateway timeouts). */
void ap__natmon_unmap(struct ap_node *n);

#endif
