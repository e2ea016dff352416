/* Internals of the stream multiplexer, shared by its three files:
 *   mux_conn.c    connections, duplicates and GOAWAY, the address book, dialing
 *   mux_stream.c  streams and RPC calls, message buffers, delivery to the user
 *   mux_frame.c   outgoing framing (scheduler, flush) and the incoming frame handlers
 * The types (ap_mconn_t, ap_mstream_t, ap_msg_t) and the entry points the rest
 * of the driver calls are in uv_impl.h. */
#ifndef AP_RUNTIME_UV_MUX_IMPL_H
#define AP_RUNTIME_UV_MUX_IMPL_H

#include "runtime/uv/uv_impl.h"

#define NODE(rt) ((ap_node_t *)(rt))
#define MS(s)    ((ap_mstream_t *)(s))

/* ---- mux_conn.c ------------------------------------------------------------ */

/* Queues c for a flush from the loop. */
void ap__mconn_want_flush(ap_mconn_t *c);
/* After queueing a control frame in c->obuf: fails c on rc < 0 (out of
 * memory), else queues a flush. */
void ap__mconn_ctl_rc(ap_mconn_t *c, int rc);
/* Queues a RESET of stream sid (c may be NULL or dead: nothing sent). */
void ap__mconn_send_reset(ap_mconn_t *c, uint32_t sid, int code, const char *msg);
/* Closes c: its streams and calls finish, its dials fail, it is freed from
 * the loop. why (or NULL) is logged as a warning. */
void ap__mconn_fail(ap_mconn_t *c, int status, const char *why);
/* Sends GOAWAY once: no new streams on c, closed once drained. */
void ap__mconn_goaway(ap_mconn_t *c);
/* The connection to peer, dialling it from the address book if none exists. */
int ap__mconn_get(ap_node_t *n, const ap_peer_id_t *peer, ap_mconn_t **out);

/* ---- mux_frame.c ----------------------------------------------------------- */

/* The transport's on_read: decodes and handles frames. */
void ap__mconn_on_read(void *user, ap_conn_t *t, const uint8_t *p, size_t n);

/* ---- mux_stream.c ---------------------------------------------------------- */

ap_msg_t *ap__mux_msg_alloc(ap_node_t *n, size_t len);
ap_msg_t *ap__mux_msg_new(ap_node_t *n, const uint8_t *data, size_t len);
void ap__mux_msg_free(ap_node_t *n, ap_msg_t *m); /* back to the node's cache, or freed */

ap_mstream_t *ap__ms_new(ap_node_t *n, int kind);
/* Finishes s with status: detached from its connection, buffers freed, its
 * on_close / RPC callback queued. Idempotent. */
void ap__ms_finish(ap_mstream_t *s, int status);
/* Whether s has something it may frame now (credit, accepted). */
bool ap__ms_eligible(const ap_mstream_t *s);
/* Puts s on its connection's send schedule if eligible. */
void ap__ms_schedule(ap_mstream_t *s);
/* Sends CLOSE once everything queued is framed, if a close was requested. */
void ap__ms_try_close(ap_mstream_t *s);
void ap__ms_check_writable(ap_mstream_t *s);
/* Returns credit for the bytes received (force: even below a quarter window). */
void ap__ms_ack(ap_mstream_t *s, bool force);
/* Delivers on_end (or fails the call) once the peer closed and all is read. */
void ap__ms_maybe_end(ap_mstream_t *s);
/* Hands one complete message (taken off s) to the user. */
void ap__ms_deliver(ap_mstream_t *s, ap_msg_t *m);
/* The opener's first message arrived: ask the listener (stream) or run the
 * handler (RPC). */
void ap__ms_accept(ap_mstream_t *s, ap_msg_t *hello);
/* A complete request: queued for its handler (mux_serve.c), which runs in
 * turn with other connections' requests, a bounded number per loop turn, so
 * a burst from one peer cannot hold the loop (and every other peer) for long. */
void ap__ms_serve(ap_mstream_t *s, ap_msg_t *req);
/* Runs the handler for req now (mux_stream.c). */
void ap__ms_serve_now(ap_mstream_t *s, ap_msg_t *req);
/* s finishes: taken out of its connection's serve queue. */
void ap__ms_serve_unqueue(ap_mstream_t *s);
/* c fails: its waiting requests are dropped and it leaves the ring. */
void ap__mc_serve_drop(ap_mconn_t *c);
/* k bytes of s's queued response were framed (or dropped): released from
 * the connection's and the node's response budget. */
void ap__ms_resp_release(ap_mstream_t *s, size_t k);
/* Starts the node's stall sweep if it is not running: a partial message or
 * a queued response that makes no progress for AP_MUX_STALL_US is reset, its
 * memory released. */
void ap__mux_sweep_start(ap_node_t *n);

/* ---- mux_rc.c ----------------------------------------------------------- */

/* c is up with its peer known: counted in the peer's scope (AP_ELIMIT, with
 * a WARN, if the peer has too many connections). */
int ap__mc_rc_up(ap_mconn_t *c);
/* c is gone: its count and scope references released. */
void ap__mc_rc_down(ap_mconn_t *c);
/* bytes more held for s (what: "a message", "a response"): 0, or AP_ELIMIT
 * with a WARN naming the peer and the full scope, and a short reason for
 * the RESET in why. */
int ap__ms_rc_reserve(ap_mstream_t *s, size_t bytes, const char *what, char *why, size_t nwhy);
void ap__ms_rc_release(ap_mstream_t *s, size_t bytes);
/* A stream the peer opened: counted (AP_ELIMIT as above). */
int ap__ms_rc_open(ap_mstream_t *s, char *why, size_t nwhy);
/* s finished: everything it holds released. */
void ap__ms_rc_end(ap_mstream_t *s);
/* bytes of what s holds (a request handed to its handler) move to *to /
 * *to_mem, with references to s's scopes: counted there until
 * ap__rc_hold_drop, whatever becomes of s. */
void ap__ms_rc_move(ap_mstream_t *s, size_t bytes, ap_rc_span_t *to, uint64_t *to_mem);
void ap__rc_hold_drop(ap_node_t *n, ap_rc_span_t *sp, uint64_t *mem);

#endif
