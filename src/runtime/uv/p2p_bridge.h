/* The node's mux over libp2p connections (p2p_bridge.c): the libp2p host
 * on a node's TCP port serves the node's protocols, and a node set to dial
 * with libp2p (ap_node_set_wire) dials through it. Internal. */
#ifndef AP_RUNTIME_UV_P2P_BRIDGE_H
#define AP_RUNTIME_UV_P2P_BRIDGE_H

#include "p2p/p2p_conn.h"
#include "runtime/uv/uv_impl.h"

/* One per TCP node; it outlives the node until the transport is closed
 * (node is NULL from the node's stop on: connections then get identify and
 * ping only). */
typedef struct ap_p2pb_stats {
    uint64_t conns_native; /* connections up with AP_P2P_NATIVE_MUX */
    uint64_t conns_yamux;  /* connections up with yamux */
    uint64_t streams_out;  /* mux streams carried as yamux streams we opened */
    uint64_t streams_in;   /* ... the peer opened */
    uint64_t bad_frames;   /* yamux streams reset for a bad in-band frame */
    uint64_t relayed_in;   /* relayed connections that became the node's: accepted */
    uint64_t relayed_out;  /* ... dialled */
    uint64_t bulk_refused; /* bulk streams refused over a relayed connection */
    uint64_t direct_taken; /* hole-punched direct connections handed to the node */
} ap_p2pb_stats_t;

typedef struct ap_p2pb {
    ap_node_t *node;
    uv_loop_t *loop;
    ap_p2p_bridge_t ops; /* given to the host (ap__p2p_host_set_bridge) */
    ap_p2pb_stats_t stats;
    bool relay_bulk; /* bulk protocols also over relayed connections */
} ap_p2pb_t;

/* The node protocols that carry bulk data (all-reduce parts, state
 * downloads): not carried over a relayed connection unless relay_bulk. */
bool ap__p2pb_bulk(const char *proto);

/* native: list AP_P2P_NATIVE_MUX before yamux. */
int ap__p2pb_init(ap_p2pb_t *b, ap_node_t *n, uv_loop_t *loop, bool native);
/* Dials addr (ip4/ip6 + tcp [+ /p2p/ID]) through h: *out is a connection
 * in the dialing state (on_up once upgraded, on_close with the error). */
int ap__p2pb_dial(ap_p2pb_t *b, ap_p2p_host_t *h, const char *addr, ap_conn_t **out);
/* The same through a circuit relay: ma is /.../p2p/RELAY/p2p-circuit/p2p/PEER
 * (relay_svc.h, ap__circuit_dial); the connection is yamux, relayed. */
int ap__p2pb_dial_circuit(ap_p2pb_t *b, ap_p2p_host_t *h, const ap_multiaddr_t *ma,
                          ap_conn_t **out);
/* Hands pc (a ready direct connection, e.g. hole-punched) to the node as one
 * of its connections, dialled by whichever side initiated pc. Nothing
 * happens if the node already has it. */
void ap__p2pb_take(ap_p2pb_t *b, ap_p2p_conn_t *pc);

/* tcp_conn.c: node n's bridge (NULL for a node without TCP). Loop thread. */
const ap_p2pb_t *ap__tcpc_bridge(ap_node_t *n);

#endif
