/* Apiary — the runtime interface.
 *
 * Every protocol (DHT, averaging, collaborative optimizer) is
 * written against this interface and nothing else: no sockets, no libuv
 * handles, no time(), no rand(). Two drivers implement it:
 *   - the real driver (apiary/node.h): libuv loop, TCP + Noise + stream mux;
 *   - the simulator (apiary/sim.h): N nodes in one thread, virtual time,
 *     simulated links, partitions, crashes; deterministic from one seed.
 *
 * THREADING. An ap_rt_t belongs to one loop thread. Every function here must
 * be called on that thread (from a callback the runtime invoked), except
 * ap_rt_post(), which any thread may call. Callbacks are always invoked on the
 * loop thread, never re-entrantly from inside the call that registered them,
 * unless a function says otherwise.
 *
 * HANDLES. Timers, calls and streams are named by 64-bit ids (never 0) or by
 * opaque pointers whose lifetime the functions below state. Cancelling an id
 * that already finished is a harmless no-op, so protocol code never holds a
 * dangling pointer.
 *
 * ERRORS. Functions return 0 or a negative AP_E* code (apiary/error.h). */
#ifndef APIARY_RUNTIME_H
#define APIARY_RUNTIME_H

#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/peer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ap_rt ap_rt_t;
typedef struct ap_rpc_req ap_rpc_req_t;
typedef struct ap_stream ap_stream_t;

/* Default caps. Every message size on the wire is capped. */
#define AP_RT_PROTO_MAX              64         /* protocol name bytes incl. NUL */
#define AP_RT_RPC_MAX_DEFAULT        (1u << 20) /* default request/response cap */
#define AP_RT_STREAM_MSG_MAX_DEFAULT (4u << 20) /* default stream message cap */
#define AP_RT_STREAM_WINDOW_DEFAULT  (1u << 20) /* default per-stream send window */
#define AP_RT_ADDR_MAX               256        /* multiaddr text incl. NUL */

/* ---- identity ----------------------------------------------------------- */

/* This node's PeerID. Valid for the lifetime of rt. */
AP_EXPORT const ap_peer_id_t *ap_rt_self(ap_rt_t *rt);

/* Signs msg with this node's Ed25519 key (deterministic signatures). */
AP_EXPORT void ap_rt_sign(ap_rt_t *rt, const uint8_t *msg, size_t len,
                          uint8_t sig[AP_ED25519_SIG_LEN]);

/* The addresses other peers should dial to reach this node, as multiaddr
 * text (e.g. "/ip4/10.0.0.2/tcp/4001", or "/sim/17" in the simulator): the
 * announced addresses if the node has any, else the listen addresses with a
 * wildcard host replaced by the host's interface addresses (node.h), most
 * preferred first; with the trailing "/p2p/<id>" only if with_id. Writes up to max entries of
 * AP_RT_ADDR_MAX bytes into addrs and returns how many exist (may be more than max). */
AP_EXPORT int ap_rt_listen_addrs(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id);

/* ---- time and randomness ------------------------------------------------ */

/* Monotonic time in microseconds since an arbitrary origin. Use for timeouts. */
AP_EXPORT uint64_t ap_rt_now_us(ap_rt_t *rt);
/* Wall-clock time in milliseconds since the Unix epoch. Use only where peers
 * must agree (DHT expirations); expect skew between peers. In the simulator
 * each node may have its own skew. */
AP_EXPORT int64_t ap_rt_wall_ms(ap_rt_t *rt);

/* This node's RNG: seeded (reproducible in the simulator; from the seed given
 * to the driver, or from the OS if none). Not for keys or nonces. */
AP_EXPORT uint64_t ap_rt_rand_u64(ap_rt_t *rt);
/* Uniform in [0, n) without modulo bias; n > 0. */
AP_EXPORT uint64_t ap_rt_rand_below(ap_rt_t *rt, uint64_t n);
/* Uniform double in [0, 1). */
AP_EXPORT double ap_rt_rand_double(ap_rt_t *rt);
AP_EXPORT void ap_rt_rand_bytes(ap_rt_t *rt, void *buf, size_t len);

/* ---- timers ------------------------------------------------------------- */

typedef void (*ap_timer_fn)(ap_rt_t *rt, void *arg);

/* Fires cb once after delay_us, then every period_us if period_us > 0.
 * Returns the timer id (never 0), or 0 if out of memory. Timers due at the
 * same instant fire in the order they were started. */
AP_EXPORT uint64_t ap_rt_timer_start(ap_rt_t *rt, uint64_t delay_us, uint64_t period_us,
                                     ap_timer_fn cb, void *arg);
/* Stops a timer; safe from inside its own callback and on an id that already
 * fired (no-op). Returns true if the timer was pending. */
AP_EXPORT bool ap_rt_timer_stop(ap_rt_t *rt, uint64_t timer_id);

/* ---- cross-thread entry ------------------------------------------------- */

typedef void (*ap_post_fn)(ap_rt_t *rt, void *arg);
/* Runs fn(rt, arg) soon on the loop thread. Callable from ANY thread: this is
 * how a user's thread talks to a node (see ap_node_call_sync in apiary/node.h).
 * Posted functions run in the order posted. AP_ESHUTDOWN if the node is
 * closing (fn will not run). */
AP_EXPORT int ap_rt_post(ap_rt_t *rt, ap_post_fn fn, void *arg);

/* ---- compute offload ---------------------------------------------------- */

typedef void (*ap_work_fn)(void *arg);                                /* runs on a worker thread */
typedef void (*ap_after_work_fn)(ap_rt_t *rt, void *arg, int status); /* loop thread */

/* Runs work(arg) off the loop thread (uv: worker pool; sim: inline, then the
 * node is charged cost units of virtual compute time through its compute
 * hook before after() runs). cost is a rough FLOP/byte count; 0 = free.
 * after() always runs, with AP_ECANCELED if the node shut down first (work may
 * or may not have run then). */
AP_EXPORT int ap_rt_work(ap_rt_t *rt, double cost, ap_work_fn work, ap_after_work_fn after,
                         void *arg);

/* ---- peers and addresses ------------------------------------------------ */

/* Teaches the runtime an address of a peer (multiaddr text). Later calls and
 * streams to that peer dial it when no connection exists. */
AP_EXPORT int ap_rt_add_addr(ap_rt_t *rt, const ap_peer_id_t *peer, const char *addr);

typedef void (*ap_dial_fn)(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer);
/* Connects to an address whose PeerID may be unknown (bootstrap). If addr has a
 * /p2p/ component the remote id must match (else AP_EAUTH). cb gets the remote
 * PeerID on success. Exactly one cb call. */
AP_EXPORT int ap_rt_dial(ap_rt_t *rt, const char *addr, uint64_t timeout_us, ap_dial_fn cb,
                         void *arg);

/* Whether a connection to the peer is currently up. */
AP_EXPORT bool ap_rt_is_connected(ap_rt_t *rt, const ap_peer_id_t *peer);

typedef enum ap_peer_event { AP_PEER_CONNECTED = 1, AP_PEER_DISCONNECTED = 2 } ap_peer_event_t;
typedef void (*ap_peer_fn)(ap_rt_t *rt, void *arg, const ap_peer_id_t *peer, ap_peer_event_t ev);
/* Subscribes to connect/disconnect events. Returns a watch id (never 0) for
 * ap_rt_peer_unwatch, or 0 if out of memory. */
AP_EXPORT uint64_t ap_rt_peer_watch(ap_rt_t *rt, ap_peer_fn cb, void *arg);
AP_EXPORT void ap_rt_peer_unwatch(ap_rt_t *rt, uint64_t watch_id);

/* ---- unary RPC ------------------------------------------------------------
 * Protocols are versioned names ("/apiary/dht/1"). A handler gets a request
 * and answers exactly once with ap_rpc_respond or ap_rpc_respond_error, now or
 * later (keep the req pointer). */

typedef void (*ap_rpc_handler_fn)(ap_rt_t *rt, void *arg, ap_rpc_req_t *req);

/* Registers the handler for proto. max_req is the request size cap (0 =
 * AP_RT_RPC_MAX_DEFAULT); a larger request is refused with AP_EMSGSIZE without
 * calling the handler. AP_EEXIST if proto has a handler already. */
AP_EXPORT int ap_rt_rpc_register(ap_rt_t *rt, const char *proto, size_t max_req,
                                 ap_rpc_handler_fn handler, void *arg);
AP_EXPORT void ap_rt_rpc_unregister(ap_rt_t *rt, const char *proto);

/* Request accessors; valid until the handler responds. */
AP_EXPORT const ap_peer_id_t *ap_rpc_req_peer(const ap_rpc_req_t *req);
AP_EXPORT const uint8_t *ap_rpc_req_data(const ap_rpc_req_t *req, size_t *len);
/* Responds; data is copied. Frees req: do not touch it afterwards. If the
 * caller is gone (cancelled, crashed, disconnected) the response is dropped. */
AP_EXPORT void ap_rpc_respond(ap_rpc_req_t *req, const uint8_t *data, size_t len);
/* Responds with an error code (negative AP_E*) and a short message (may be
 * NULL), which the caller's done callback receives. Frees req. */
AP_EXPORT void ap_rpc_respond_error(ap_rpc_req_t *req, int err, const char *msg);
/* A response built in place, for large ones: a buffer of len bytes, owned
 * by the runtime, already counted against the limits of the caller's
 * connection, peer and protocol and of the node (the same as
 * ap_rpc_respond would). Fill it, then send it with ap_rpc_respond_commit,
 * or drop it with ap_rpc_respond_error; either frees req. NULL when the
 * response cannot be held -- a limit is full (the caller gets AP_ELIMIT and
 * the reason), the caller is gone, out of memory: req has then been
 * answered and freed already, so a refused response costs no work. */
AP_EXPORT uint8_t *ap_rpc_respond_begin(ap_rpc_req_t *req, size_t len);
AP_EXPORT void ap_rpc_respond_commit(ap_rpc_req_t *req);

/* Completion of a call. status 0: resp/len hold the response (valid only
 * during the callback). Otherwise status is AP_ETIMEDOUT, AP_ECANCELED,
 * AP_EUNREACH, AP_ECLOSED (connection lost mid-call), AP_ENOPROTO,
 * AP_EMSGSIZE, or the code the handler sent with ap_rpc_respond_error (then
 * errmsg is its message, else NULL). */
typedef void (*ap_rpc_done_fn)(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                               const char *errmsg);

typedef struct ap_rpc_opts {
    uint64_t timeout_us; /* deadline relative to now; 0 = 30 s */
    size_t max_resp;     /* response cap; 0 = AP_RT_RPC_MAX_DEFAULT */
} ap_rpc_opts_t;

/* Calls proto on peer with req (copied). done is called exactly once, never
 * before this function returns. Returns the call id (never 0), or 0 if the
 * call could not even be queued (out of memory) — then done is not called. */
AP_EXPORT uint64_t ap_rt_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                                  const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                                  ap_rpc_done_fn done, void *arg);
/* Cancels a pending call: done runs with AP_ECANCELED before this returns.
 * No-op (returns false) if the call already completed. */
AP_EXPORT bool ap_rt_rpc_cancel(ap_rt_t *rt, uint64_t call_id);

/* ---- streams ---------------------------------------------------------------
 * An ordered, reliable sequence of messages between two peers, in both
 * directions, with flow control. Messages keep their boundaries.
 *
 * Send side: ap_stream_send copies the message into the stream's send buffer.
 * It returns AP_EAGAIN (and copies nothing) when the buffered bytes would
 * exceed the send window; on_writable then fires once the buffer has drained
 * below half the window. So memory stays bounded however fast a sender is.
 *
 * Receive side: on_msg delivers each message in order; credit goes back to
 * the sender once on_msg returns, unless the receiver paused the stream with
 * ap_stream_pause(s, true): then no further on_msg runs and the sender's
 * window fills, until ap_stream_pause(s, false).
 *
 * End: ap_stream_close sends a graceful end after the buffered messages (the
 * peer sees on_end, and can keep sending until it closes too);
 * ap_stream_reset aborts both directions at once. on_close runs exactly once
 * per stream on each side, with 0 (both sides closed gracefully) or an error
 * (AP_ERESET, AP_ECLOSED when the connection dropped, AP_ETIMEDOUT, ...);
 * after on_close the ap_stream_t is freed: do not touch it. */

typedef struct ap_stream_cbs {
    void (*on_msg)(ap_stream_t *s, void *arg, const uint8_t *data, size_t len);
    void (*on_writable)(ap_stream_t *s, void *arg);
    void (*on_end)(ap_stream_t *s, void *arg); /* peer closed its direction */
    void (*on_close)(ap_stream_t *s, void *arg, int status);
} ap_stream_cbs_t;

typedef struct ap_stream_opts {
    size_t window;            /* send window in bytes; 0 = AP_RT_STREAM_WINDOW_DEFAULT */
    size_t max_msg;           /* cap on a received message; 0 = AP_RT_STREAM_MSG_MAX_DEFAULT */
    uint64_t open_timeout_us; /* connect + accept; 0 = 30 s */
} ap_stream_opts_t;

/* Called when a peer opens a stream on proto. hello/len is the opener's first
 * message (may be empty). Return 0 to accept after setting the stream's
 * callbacks with ap_stream_set_cbs, or an AP_E* code to refuse (the opener's
 * on_close gets AP_ERESET). */
typedef int (*ap_stream_accept_fn)(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                                   const uint8_t *hello, size_t len);

AP_EXPORT int ap_rt_stream_listen(ap_rt_t *rt, const char *proto, const ap_stream_opts_t *opts,
                                  ap_stream_accept_fn accept, void *arg);
AP_EXPORT void ap_rt_stream_unlisten(ap_rt_t *rt, const char *proto);

/* Opens a stream to peer on proto, sending hello first. The stream is usable
 * for sending at once (messages queue until it is established). On failure to
 * connect or a refusal, on_close runs with the error. *out receives the
 * handle. */
AP_EXPORT int ap_rt_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                                const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                                const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out);

AP_EXPORT void ap_stream_set_cbs(ap_stream_t *s, const ap_stream_cbs_t *cbs, void *arg);
AP_EXPORT int ap_stream_send(ap_stream_t *s, const uint8_t *data, size_t len);

/* One piece of a gathered message (ap_stream_sendv). base may be NULL when
 * len is 0. */
typedef struct ap_iovec {
    const void *base;
    size_t len;
} ap_iovec_t;

/* Most pieces one ap_stream_sendv call takes. */
#define AP_STREAM_IOV_MAX 64

/* Gather send: sends ONE message whose bytes are iov[0], iov[1], ...,
 * iov[iovcnt-1] concatenated, copied straight from the pieces into the
 * stream's send buffer (one copy; the caller need not first assemble e.g. a
 * frame header and a payload read in place from a tensor). Exactly
 * ap_stream_send of the concatenation otherwise: the receiver gets one
 * on_msg with all the bytes; the window check, AP_EAGAIN (nothing copied,
 * on_writable follows) and the error codes apply to the total length.
 * Pieces of length 0 are allowed; iovcnt 0 sends an empty message. The
 * caller keeps ownership of iov and the pieces, which are only read during
 * the call. AP_EINVAL if iovcnt < 0 or > AP_STREAM_IOV_MAX, or iov (or a
 * piece's base with len > 0) is NULL; AP_EMSGSIZE if the total overflows. */
AP_EXPORT int ap_stream_sendv(ap_stream_t *s, const ap_iovec_t *iov, int iovcnt);
/* Bytes currently buffered for sending, and the window. */
AP_EXPORT size_t ap_stream_buffered(const ap_stream_t *s);
AP_EXPORT size_t ap_stream_window(const ap_stream_t *s);
AP_EXPORT void ap_stream_pause(ap_stream_t *s, bool paused);
AP_EXPORT int ap_stream_close(ap_stream_t *s);
AP_EXPORT void ap_stream_reset(ap_stream_t *s, int err);
AP_EXPORT const ap_peer_id_t *ap_stream_peer(const ap_stream_t *s);
AP_EXPORT ap_rt_t *ap_stream_rt(const ap_stream_t *s);
AP_EXPORT uint64_t ap_stream_id(const ap_stream_t *s);

/* ---- memory held on a peer's account -------------------------------------
 * Protocol code that holds or queues bytes for a peer on its own initiative
 * (records sent to a peer in the background, such as a DHT hand-over, until
 * the call completes) reserves them in the node's memory budget: the
 * peer's scope and the node's, the same budget the transport counts queued
 * responses and buffers in (ap_node_limits_t; on the node one reservation
 * takes at most half of what is free, so it never crowds out another
 * peer's request). The simulator keeps the same scopes, with the limits of
 * ap_sim_set_memory. peer may be NULL (the node only). 0, or AP_ELIMIT when
 * a scope cannot hold them (nothing is reserved then): skip or defer the
 * work. Release the same amount for the same peer when the bytes are gone.
 * Loop thread. */
AP_EXPORT int ap_rt_mem_reserve(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes);
AP_EXPORT void ap_rt_mem_release(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes);

/* ---- statistics --------------------------------------------------------- */

typedef struct ap_rt_stats {
    uint64_t bytes_sent; /* payload + framing bytes written to the network */
    uint64_t bytes_received;
    uint64_t rpc_calls;
    uint64_t rpc_served;
    uint64_t streams_opened;
    uint64_t streams_accepted;
    uint32_t connections;
    /* connections this node told to go away (GOAWAY: duplicate connections
     * to one peer after a simultaneous dial; docs/protocol.md), and streams
     * a peer opened after its own GOAWAY (refused). 0 in the simulator. */
    uint64_t goaways;
    uint64_t goaway_refused;
} ap_rt_stats_t;

AP_EXPORT void ap_rt_get_stats(ap_rt_t *rt, ap_rt_stats_t *out);

#ifdef __cplusplus
}
#endif
#endif
