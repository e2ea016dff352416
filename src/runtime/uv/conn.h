/* The connection seam between a transport and the node's stream multiplexer.
 * Internal.
 *
 * A connection is a bidirectional, ordered, reliable byte pipe to one
 * authenticated peer. Two transports implement it, each an entry of the
 * node's transport table (uv_impl.h, ap_uv_transport_t): the in-process one
 * (mem.c) and TCP + Noise XX (tcp_conn.c over src/net/tcp*.c; one Noise
 * message per write batch, each at most 65,535 bytes: the mux never writes a
 * frame larger than AP_FRAME_HDR + AP_FRAME_PAYLOAD_MAX).
 *
 * Who calls whom (all on the loop thread of the host the connection belongs
 * to; a transport crossing threads does so internally):
 *   mux -> transport: vt->write, vt->close.
 *   transport -> mux: cbs.on_up, cbs.on_read, cbs.on_drain, cbs.on_close.
 * The transport never calls back from inside write() or close(): callbacks
 * always run from the loop, so the mux may write while handling on_read.
 *
 * Lifetime: the transport creates the conn (dial or accept) and owns its
 * memory. The mux calls vt->close exactly once to release it; after close
 * returns the conn pointer is dead and no callback runs. on_close may arrive
 * first (peer gone, transport error): the mux must still call vt->close.
 *
 * Back-pressure: write() always takes the bytes (copied; the caller keeps
 * ownership of p) but returns 1 once the transport's queue of unsent bytes is
 * above its high-water mark. The mux then stops producing DATA frames (it
 * still writes small control frames) until on_drain, which the transport
 * calls once the queue fell below its low-water mark. Memory per connection
 * stays bounded by the high-water mark plus one flush of the mux. */
#ifndef AP_RUNTIME_UV_CONN_H
#define AP_RUNTIME_UV_CONN_H

#include "apiary/peer.h"

#include <stddef.h>
#include <stdint.h>

typedef struct ap_conn ap_conn_t;

typedef struct ap_conn_cbs {
    /* The connection is authenticated: remote is the peer's id. Fires once,
     * before any on_read (accepted connections are handed over already up:
     * on_up does not fire for them). */
    void (*on_up)(void *user, ap_conn_t *c, const ap_peer_id_t *remote);
    /* Bytes from the peer, in order; p is valid during the call only. */
    void (*on_read)(void *user, ap_conn_t *c, const uint8_t *p, size_t n);
    /* The write queue drained below the low-water mark after write() had
     * returned 1. */
    void (*on_drain)(void *user, ap_conn_t *c);
    /* The connection failed or the peer closed it: AP_ECLOSED (peer gone
     * after on_up), AP_EUNREACH (dial failed), AP_EAUTH, ... Fires at most
     * once; no on_read follows. */
    void (*on_close)(void *user, ap_conn_t *c, int status);
} ap_conn_cbs_t;

typedef struct ap_conn_vt {
    /* 0, 1 (above high-water: pause DATA until on_drain), or AP_ECLOSED (the
     * bytes were dropped; on_close follows). */
    int (*write)(ap_conn_t *c, const uint8_t *p, size_t n);
    /* Releases the connection; bytes written before are still delivered,
     * then the peer sees on_close(AP_ECLOSED). */
    void (*close)(ap_conn_t *c);
} ap_conn_vt_t;

struct ap_conn {
    const ap_conn_vt_t *vt;
    ap_conn_cbs_t cbs; /* set by the mux before returning to the loop */
    void *user;
    ap_peer_id_t remote; /* valid once up */
    bool dialer;         /* this side dialed (picks odd stream ids) */
    bool relayed;        /* through a circuit relay: a direct connection is preferred */
};

#endif
