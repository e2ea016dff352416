/* Resource manager: every byte a peer can make the node hold, counted
 * against scopes, with reservations that fail cleanly. The model is
 * go-libp2p's resource manager, reduced to what Apiary's transports need.
 *
 * Scopes: the NODE (one), one per PEER, one per PROTOCOL, one per
 * CONNECTION. Each has limits on memory (bytes), streams and connections,
 * and its current use. A reservation names a span: the connection, its
 * peer, the protocol (any may be NULL) and always the node; it succeeds in
 * all of them or in none, and a refusal names the scope that was full ("peer
 * 12D3KooW...: memory 8388608/8388608"), for the RESET or RPC error the
 * caller sends. Whoever reserved releases the same amount on the same span
 * (the span's scopes stay alive while they hold a reservation or a
 * reference).
 *
 * What the transports count: queued responses and stream send buffers (until
 * the peer's credit lets them go), partial requests (with a deadline),
 * receive buffers. Handshakes in progress are not counted here but by
 * connection admission (base/admit.h), the one count of them for native
 * and libp2p connections alike. Not thread-safe (the node's loop thread).
 * Internal. */
#ifndef AP_BASE_RCMGR_H
#define AP_BASE_RCMGR_H

#include "apiary/peer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ap_rc_limit {
    uint64_t memory;  /* bytes; 0 = no limit */
    uint32_t streams; /* open streams; 0 = no limit */
    uint32_t conns;   /* connections; 0 = no limit */
} ap_rc_limit_t;

typedef struct ap_rcmgr_config {
    ap_rc_limit_t node;  /* (256 MiB, 8192 streams, 1024 connections) */
    ap_rc_limit_t peer;  /* each peer (16 MiB, 512 streams, 8 connections) */
    ap_rc_limit_t proto; /* each protocol (128 MiB, 4096 streams) */
    ap_rc_limit_t conn;  /* each connection (8 MiB, 256 streams) */
    /* Memory one stream may hold (0 = no limit): checked by the caller
     * against what it reserved for the stream (ap_rc_stream_fits). */
    uint64_t stream_memory;
    /* One memory reservation may take at most half of the free memory of
     * the node and of its protocol, so a few peers together cannot take all
     * of it: a small request from another peer always fits. */
    bool node_fair_share;
} ap_rcmgr_config_t;

typedef enum ap_rc_kind { AP_RC_NODE, AP_RC_PEER, AP_RC_PROTO, AP_RC_CONN } ap_rc_kind_t;

typedef struct ap_rc_use {
    uint64_t memory;
    uint32_t streams, conns;
} ap_rc_use_t;

typedef struct ap_rc_scope ap_rc_scope_t;
typedef struct ap_rcmgr ap_rcmgr_t;

/* A span: the scopes one reservation is made in (NULLs skipped; the node is
 * always included). */
typedef struct ap_rc_span {
    ap_rc_scope_t *conn, *peer, *proto;
} ap_rc_span_t;

void ap_rcmgr_config_default(ap_rcmgr_config_t *c);
/* cfg NULL = defaults. NULL on out of memory. */
ap_rcmgr_t *ap_rcmgr_new(const ap_rcmgr_config_t *cfg);
/* Frees the manager; every scope must have been released. */
void ap_rcmgr_free(ap_rcmgr_t *m);

/* The scope of a peer / protocol, created on first use, with a reference
 * the caller drops with ap_rc_scope_unref. NULL on out of memory. */
ap_rc_scope_t *ap_rcmgr_peer(ap_rcmgr_t *m, const ap_peer_id_t *peer);
ap_rc_scope_t *ap_rcmgr_proto(ap_rcmgr_t *m, const char *proto);
/* A new connection scope (one reference). The connection itself is counted
 * (conns) in the node and, once known, its peer: reserve it with
 * ap_rc_reserve_conn. */
ap_rc_scope_t *ap_rcmgr_conn(ap_rcmgr_t *m);
void ap_rc_scope_unref(ap_rc_scope_t *s);
/* One more reference to s (NULL: none); returns s. */
ap_rc_scope_t *ap_rc_scope_ref(ap_rc_scope_t *s);

/* Reservations. 0, or AP_ELIMIT with *full (may be NULL) set to the scope
 * that refused (nothing is reserved then). */
int ap_rc_reserve_mem(ap_rcmgr_t *m, const ap_rc_span_t *sp, uint64_t bytes, ap_rc_scope_t **full);
void ap_rc_release_mem(ap_rcmgr_t *m, const ap_rc_span_t *sp, uint64_t bytes);
int ap_rc_reserve_stream(ap_rcmgr_t *m, const ap_rc_span_t *sp, ap_rc_scope_t **full);
void ap_rc_release_stream(ap_rcmgr_t *m, const ap_rc_span_t *sp);
int ap_rc_reserve_conn(ap_rcmgr_t *m, const ap_rc_span_t *sp, ap_rc_scope_t **full);
void ap_rc_release_conn(ap_rcmgr_t *m, const ap_rc_span_t *sp);

/* One line describing a scope's use against its limits, e.g.
 * "peer 12D3KooW...: memory 1048576/16777216, streams 3/512, conns 1/8". */
void ap_rc_scope_describe(const ap_rc_scope_t *s, char *out, size_t n);
ap_rc_kind_t ap_rc_scope_kind(const ap_rc_scope_t *s);
const ap_rc_use_t *ap_rc_scope_use(const ap_rc_scope_t *s);
/* The node scope. */
ap_rc_scope_t *ap_rcmgr_node(ap_rcmgr_t *m);
/* Refusals so far, all scopes. */
uint64_t ap_rcmgr_refusals(const ap_rcmgr_t *m);
const ap_rcmgr_config_t *ap_rcmgr_config(const ap_rcmgr_t *m);
/* Whether a stream holding `held` bytes may reserve `bytes` more
 * (stream_memory); a refusal is counted. */
bool ap_rc_stream_fits(ap_rcmgr_t *m, uint64_t held, uint64_t bytes);
/* A report of the node scope, every protocol scope and the (at most
 * max_peers) peers holding the most memory, one scope per line. Returns the
 * length written (truncated to n - 1). */
size_t ap_rcmgr_report(const ap_rcmgr_t *m, int max_peers, char *out, size_t n);
/* Peer scopes alive (peers with a connection or a reservation). */
size_t ap_rcmgr_npeers(const ap_rcmgr_t *m);

#endif
