/* Internals of the libuv driver: host, node, mux. See docs/runtime-uv.md. */
#ifndef AP_RUNTIME_UV_IMPL_H
#define AP_RUNTIME_UV_IMPL_H

#include "apiary/host.h"
#include "apiary/node.h"
#include "base/buf.h"
#include "base/rcmgr.h"
#include "base/u64map.h"
#include "runtime/rt_impl.h"
#include "runtime/uv/conn.h"
#include "runtime/uv/frame.h"

#include <stdatomic.h>
#include <uv.h>

/* ---- limits (docs/protocol.md) ------------------------------------------- */
#define AP_MUX_FRAG        32768u      /* DATA bytes per frame (scheduling quantum) */
#define AP_MUX_CONN_WINDOW (16u << 20) /* connection-level credit */
#define AP_MUX_MAX_STREAMS 1024        /* live streams + calls per connection */
/* What peers can make a node hold: received messages (reassembly and paused
 * queues) and queued RPC responses, counted in the node's resource manager
 * (base/rcmgr.h) per stream, connection, peer, protocol and node; the
 * defaults of ap_node_limits_t. On the node and on a protocol, one
 * reservation may take at most half of what is free, so many peers together
 * cannot take it all (another peer's small request always fits). */
#define AP_MUX_STREAM_MEM_MAX  (32u << 20)  /* per stream */
#define AP_MUX_CONN_MEM_MAX    (64u << 20)  /* per connection */
#define AP_MUX_PEER_MEM_MAX    (64u << 20)  /* per peer, all its connections */
#define AP_MUX_PROTO_MEM_MAX   (192u << 20) /* per protocol, all peers */
#define AP_MUX_NODE_MEM_MAX    (256u << 20) /* the whole node */
#define AP_MUX_PEER_STREAMS    1024         /* streams a peer opened to us, all connections */
#define AP_MUX_NODE_STREAMS    16384        /* streams peers opened to us, all peers */
#define AP_MUX_PEER_CONNS      16           /* connections per peer */
#define AP_MUX_STALL_US        (20000000u)  /* stalled partial message / queued response: reset */
#define AP_MUX_SWEEP_US        (2000000u)   /* how often stalls are looked for */
#define AP_MUX_FLUSH_BYTES     (256u << 10) /* write to the transport in batches of this */
#define AP_MUX_DIRECT_MIN      (4096u)      /* DATA fragments this big skip the frame buffer */
#define AP_MUX_DIAL_TIMEOUT_US (10000000u)  /* implicit dials */
#define AP_MUX_DRAIN_US        (30000000u)  /* a connection after GOAWAY: close by then */
#define AP_MSG_CACHE_BYTES     (16u << 20)  /* recycled message buffers per node */
#define AP_NODE_MAX_ADDRS      8            /* remembered addresses per peer */

/* ---- id map: nonzero u64 id -> pointer (base/u64map.h) ------------------- */
typedef ap_u64map_t ap_idmap_t;

static inline int ap__idmap_put(ap_idmap_t *m, uint64_t k, void *v)
{
    return k ? ap__u64map_put(m, k, (uint64_t)(uintptr_t)v) : AP_EINVAL;
}
static inline void *ap__idmap_get(const ap_idmap_t *m, uint64_t k)
{
    uint64_t v;
    return k && ap__u64map_get(m, k, &v) ? (void *)(uintptr_t)v : NULL;
}
static inline void *ap__idmap_del(ap_idmap_t *m, uint64_t k)
{
    uint64_t v;
    return k && ap__u64map_del(m, k, &v) ? (void *)(uintptr_t)v : NULL;
}
/* Next value in an iteration started with *pos = 0; NULL at the end. */
static inline void *ap__idmap_next(const ap_idmap_t *m, size_t *pos)
{
    uint64_t v;
    return ap__u64map_next(m, pos, NULL, &v) ? (void *)(uintptr_t)v : NULL;
}
static inline void ap__idmap_free(ap_idmap_t *m)
{
    ap__u64map_free(m);
}

/* ---- host ----------------------------------------------------------------- */

/* A unit of work for the loop, queued from any thread. run(t, false) runs it
 * on the loop; run(t, true) discards it (host or node closing) and must free
 * whatever it holds. */
typedef struct ap_task ap_task_t;
struct ap_task {
    ap_task_t *next;
    void (*run)(ap_task_t *t, bool discard);
    struct ap_node *node; /* owner node, or NULL (transport tasks) */
};

typedef struct ap_timer ap_timer_t;
struct ap_timer {
    uint64_t id, seq, due, period;
    struct ap_node *node;
    ap_timer_fn cb;
    void *arg;
    size_t idx; /* position in the heap */
};

typedef struct ap_node ap_node_t;

struct ap_host {
    uv_loop_t loop;
    uv_async_t async;
    uv_timer_t timer;
    uv_timer_t wake; /* bounds the wait of ap_host_run_once */
    uv_timer_t trim; /* returns freed heap memory to the OS (host.c) */
    unsigned trim_ticks;
    uv_mutex_t mu; /* guards the task queue and the thread ids */
    ap_task_t *head, *tail;
    uv_thread_t thread;
    bool threaded;
    atomic_bool stop;
    uv_thread_t loop_tid; /* thread running the loop now (valid if in_loop) */
    atomic_bool in_loop;
    uv_thread_t owner;
    /* loop-thread state */
    ap_node_t *nodes;
    uint64_t nodes_gen; /* bumped when a node is freed */
    ap_timer_t **heap;
    size_t nheap, heap_cap;
    ap_idmap_t timers;
    uint64_t next_timer_id, next_seq;
    uint64_t armed_due; /* due time the uv timer is armed for, 0 = none */
    bool soon;          /* node deferred work pending */
    /* work requests */
    uv_mutex_t work_mu;
    uv_cond_t work_cv;
};

/* Queues t for the loop (any thread) and wakes it. AP_ESHUTDOWN if the task's
 * node is closing (t untouched). */
int ap__host_post(ap_host_t *h, ap_task_t *t);
/* Loop thread: makes the host process deferred node work soon. */
void ap__host_kick(ap_host_t *h);
/* Runs fn(arg) on h's loop thread: directly if the caller is that thread or
 * the host is caller-driven, else through the task queue, waiting for it.
 * AP_ESHUTDOWN if the host discarded it (being freed). */
int ap__host_on_loop(ap_host_t *h, void (*fn)(void *arg), void *arg);
uint64_t ap__host_now_us(ap_host_t *h);

/* ---- mux ------------------------------------------------------------------ */

typedef struct ap_mconn ap_mconn_t;
typedef struct ap_mstream ap_mstream_t;
typedef struct ap_msg ap_msg_t;

struct ap_msg {
    ap_msg_t *next;
    size_t len, off; /* off: bytes already framed (send) */
    size_t cap;      /* bytes allocated after the header */
    bool exempt;     /* the opener's first message (hello / request): no stream credit */
    bool started;
    /* Room for a DATA frame header right before data: a big fragment is
     * written to the transport straight from here, its header over the bytes
     * before it (the header room for the first, already-sent bytes for the
     * next ones), without a copy into the connection's frame buffer. */
    uint8_t head[AP_FRAME_HDR + 4];
    uint8_t data[];
};

enum { MS_STREAM = 0, MS_CALL = 1, MS_SERVE = 2 };

struct ap_mstream {
    struct ap_stream pub; /* head: rt, peer, id, cbs, arg, window, max_msg */
    ap_node_t *node;
    ap_mconn_t *conn; /* NULL once detached (finished) */
    uint32_t sid;
    uint8_t kind;
    bool opener;     /* we sent OPEN */
    bool accepted;   /* opener: got ACCEPT; acceptor: accept() returned 0 */
    bool got_hello;  /* acceptor: first message received */
    bool lclose;     /* close requested locally */
    bool close_sent; /* CLOSE frame written */
    bool rclosed;    /* CLOSE received */
    bool end_fired;  /* on_end delivered */
    bool finished;   /* on_close queued; conn detached */
    bool paused;
    bool delivering; /* inside the delivery loop */
    bool in_sched;
    bool want_writable;
    bool writable_queued;
    bool drain_queued;
    bool accepted_by_user; /* the user owns callbacks: on_close is owed */
    bool accepting;        /* inside the listener's accept() */
    bool close_fired;      /* on_close already delivered */
    /* send side */
    ap_msg_t *sq, *sq_tail;
    size_t sbuf;          /* bytes queued, not yet framed */
    int64_t credit;       /* stream send credit granted by the peer */
    size_t inflight;      /* bytes framed, not yet acknowledged by the peer */
    uint32_t peer_window; /* the peer's own window (OPEN / ACCEPT) */
    ap_mstream_t *sched_next;
    /* receive side */
    uint8_t *rx; /* reassembly buffer of the message in progress */
    uint32_t rx_total, rx_have;
    bool rx_active, rx_exempt;
    ap_msg_t *rq, *rq_tail; /* complete messages waiting (paused) */
    size_t rq_bytes;
    uint32_t rx_window; /* credit we grant */
    int64_t rx_credit;  /* credit the peer still holds */
    uint32_t unacked;
    size_t rx_charged; /* this stream's share of conn->rx_buffered */
    /* resource manager (mux_rc.c): the scopes this stream's memory and
     * count are reserved in (set at the first reservation), and how much */
    ap_rc_span_t rc;
    bool rc_set, rc_stream; /* span set; an inbound stream is counted */
    uint64_t rc_mem;
    size_t resp_charged;  /* SERVE: response bytes not yet framed (conn/node->resp_queued) */
    uint64_t progress_us; /* last DATA in or out of a partial message / queued response */
    /* close */
    int status;
    char errmsg[AP_FRAME_RESET_MSG_MAX + 1];
    bool has_errmsg;
    uint64_t open_timer;
    /* RPC (kind CALL: caller side; SERVE: server side) */
    ap_rpc_done_fn done;
    void *done_arg;
    uint64_t call_id;
    size_t max_resp;
    struct ap_uv_req *req; /* SERVE: the request handed to the handler */
    /* SERVE: a complete request waiting for its turn (mux_serve.c) */
    ap_msg_t *serve_msg;
    ap_mstream_t *serve_next;
    bool in_serveq;
    char proto[AP_RT_PROTO_MAX];
    ap_mstream_t *dnext; /* node's list of streams waiting for on_close */
};

enum { MC_DIALING = 0, MC_UP = 1, MC_DEAD = 2 };

struct ap_mconn {
    ap_node_t *node;
    ap_mconn_t *next; /* node's list */
    ap_conn_t *t;     /* transport; NULL once released */
    int state;
    bool known_peer; /* peer is known (implicit dial or accepted) */
    ap_peer_id_t peer;
    char short_id[AP_PEER_SHORT_LEN];
    bool warned_streams; /* the stream-cap warning was logged */
    bool blocked;        /* transport above high-water */
    bool flush_queued;
    bool in_read;
    /* A credit WINDOW frame waits in obuf: on_read hands obuf to the
     * transport before it returns, so credit goes back while the peer still
     * has window left, not a loop turn (and a whole read burst) later. */
    bool credit_owed;
    ap_mconn_t *flush_next;
    ap_buf_t obuf;       /* frames not yet handed to the transport */
    size_t direct_bytes; /* bytes of big DATA frames written directly this round */
    ap_frame_dec_t *dec;
    ap_idmap_t streams; /* sid -> ap_mstream_t */
    uint32_t nstreams;
    uint32_t next_sid;
    uint32_t last_remote_sid;
    ap_mstream_t *sched_head, *sched_tail;
    int64_t credit;    /* connection send credit */
    int64_t rx_credit; /* connection credit the peer holds */
    uint32_t unacked;
    size_t rx_buffered;               /* bytes in reassembly + paused queues */
    size_t resp_queued;               /* RPC response bytes queued, not yet framed */
    ap_rc_scope_t *rc_conn, *rc_peer; /* resource scopes (peer: once up) */
    bool rc_counted;                  /* the connection is counted in them */
    uint64_t rc_warned_us;            /* last refusal WARN (one per 10 s per connection) */
    uint64_t dial_timer;
    /* implicit dial: the position, in the order the peer's book is dialled
     * (direct addresses newest first, then circuits), of the next address to
     * try if this one fails before the connection is up (-1: none left) */
    int book_next;
    /* GOAWAY (docs/protocol.md): no new streams on this connection once
     * either is set; closed when both are set and no stream is left, or when
     * drain_timer fires */
    bool goaway_sent, goaway_rcvd;
    uint64_t drain_timer;
    /* explicit dials waiting for this connection */
    struct ap_dial *dials;
    /* requests waiting for their handler (mux_serve.c), and the node's ring
     * of connections that have some */
    ap_mstream_t *serveq_head, *serveq_tail;
    ap_mconn_t *serve_next;
    bool in_serve_ring;
};

/* ---- node ----------------------------------------------------------------- */

typedef struct ap_book {
    ap_peer_id_t peer;
    int n;
    char addrs[AP_NODE_MAX_ADDRS][AP_RT_ADDR_MAX];
} ap_book_t;

typedef struct ap_defer ap_defer_t;
struct ap_defer {
    ap_defer_t *next;
    void (*fn)(ap_node_t *n, void *arg, int status);
    void *arg;
    int status;
};

struct ap_node {
    struct ap_rt rt; /* must be first */
    ap_host_t *host;
    ap_node_t *next; /* host's list */
    atomic_bool closing;
    const struct ap_uv_transport *transport; /* the one it listens on (node.c's table) */
    unsigned mem_no;                         /* mem.c's state: the node's number */
    struct ap_tcpc *tcpc;                    /* tcp_conn.c's state, or NULL */
    ap_node_admission_t admission;           /* its port's admission limits (0 = default) */
    struct ap_natmon *natmon;                /* natmon.c's state (AutoNAT), or NULL */
    bool hole_punch;                         /* relays given and DCUtR on (tcp_conn.c) */
    char addr[AP_RT_ADDR_MAX];               /* the bound listen address ("" dial-only) */
    /* What peers are told (addrs.c): the announced addresses, or for a
     * wildcard listen address the interface addresses read at ifaddr_at. */
    char announce[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int nannounce;
    char ifaddr[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int nifaddr;
    uint64_t ifaddr_at;
    ap_mconn_t *conns;
    ap_book_t *book;
    size_t nbook, book_cap;
    ap_idmap_t calls; /* call id -> ap_mstream_t */
    uint64_t next_id;
    ap_rt_stats_t stats;
    struct ap_uv_work *works;
    struct ap_uv_req *reqs; /* RPC requests handed to handlers, unanswered */
    ap_msg_t *msg_cache;    /* recycled message buffers (mux_stream.c) */
    size_t msg_cache_bytes;
    uint64_t msg_allocs, msg_allocs_seen; /* an idle cache is released (host.c) */
    ap_defer_t *dq, *dq_tail;             /* deferred callbacks */
    ap_mstream_t *closeq, *closeq_tail;   /* streams waiting for on_close */
    ap_mconn_t *flushq;
    bool processing;
    /* what peers make this node hold (mux_stream.c): bounded node-wide */
    size_t rx_buffered, resp_queued;
    ap_rcmgr_t *rc;       /* limits per stream, connection, peer, protocol, node */
    uint64_t rt_mem_held; /* ap_rt_mem_reserve'd by protocol code (mux_rc.c) */
    uint64_t sweep_timer; /* stalled partial messages and responses */
    uint64_t stall_us;    /* 0 = AP_MUX_STALL_US (tests shorten it) */
    uint64_t refused_rx, refused_resp, refused_streams, refused_conns, stalled_reset;
    /* connections with requests waiting, served in turn (mux_serve.c) */
    ap_mconn_t *serve_ring, *serve_ring_tail;
    bool serve_pass_queued;
};

/* addrs.c */
int ap__node_set_announce(ap_node_t *n, const char *const *addrs, int naddrs);
int ap__node_addrs(ap_node_t *n, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id);

/* node.c */
int ap__node_defer(ap_node_t *n, void (*fn)(ap_node_t *, void *, int), void *arg, int status);
void ap__node_run_soon(ap_node_t *n); /* loop: deferred callbacks, on_close, flushes */
bool ap__node_has_soon(const ap_node_t *n);
/* A transport hands an accepted, authenticated connection to node n. */
void ap__node_accept_conn(ap_node_t *n, ap_conn_t *c);
ap_node_t *ap__node_by_mem(unsigned no); /* registry lookup (caller's loop thread) */

/* mux_conn.c, mux_stream.c, mux_frame.c (internals: mux_impl.h) */
extern const ap_rt_ops_t ap__uv_ops_mux; /* the mux part of the ops (merged in node.c) */
ap_mconn_t *ap__mconn_new(ap_node_t *n, ap_conn_t *t, bool up);
void ap__mconn_flush(ap_mconn_t *c);
void ap__mux_close_all(ap_node_t *n);
void ap__mux_free_reqs(ap_node_t *n);
void ap__mux_free_cache(ap_node_t *n);
/* Whether peer is in the node's address book (mux_conn.c): a peer it knows
 * (routing-table contacts, peers it dialled), for admission. */
bool ap__node_knows(const ap_node_t *n, const ap_peer_id_t *peer);
/* The node's resource manager (mux_rc.c), with the default limits. */
int ap__mux_rc_init(ap_node_t *n);
void ap__mux_rc_free(ap_node_t *n);
int ap__mux_mem_reserve(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes);
void ap__mux_mem_release(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes);
/* Test and fuzz hook: bytes as if read from c's transport. */
void ap__mux_feed(ap_mconn_t *c, const uint8_t *p, size_t n);
uint64_t ap__mux_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                          const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                          ap_rpc_done_fn done, void *arg);
bool ap__mux_rpc_cancel(ap_rt_t *rt, uint64_t call_id);
void ap__mux_rpc_respond(ap_rpc_req_t *req, int err, const char *errmsg, const uint8_t *data,
                         size_t len);
uint8_t *ap__mux_rpc_respond_begin(ap_rpc_req_t *req, size_t len);
void ap__mux_rpc_respond_commit(ap_rpc_req_t *req);
int ap__mux_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                        const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                        const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out);
int ap__mux_stream_send(ap_stream_t *s, const uint8_t *data, size_t len);
int ap__mux_stream_sendv(ap_stream_t *s, const ap_iovec_t *iov, int iovcnt, size_t total);
size_t ap__mux_stream_buffered(const ap_stream_t *s);
void ap__mux_stream_pause(ap_stream_t *s, bool paused);
int ap__mux_stream_close(ap_stream_t *s);
void ap__mux_stream_reset(ap_stream_t *s, int err);
int ap__mux_dial(ap_rt_t *rt, const char *addr, uint64_t timeout_us, ap_dial_fn cb, void *arg);
bool ap__mux_is_connected(ap_rt_t *rt, const ap_peer_id_t *peer);
int ap__mux_add_addr(ap_rt_t *rt, const ap_peer_id_t *peer, const char *addr);

/* ---- transports ------------------------------------------------------------ */

/* One entry per transport a node can run (node.c holds the table). A node
 * runs the transport its listen address names and dials each address through
 * the entry whose parse accepts it. */
typedef struct ap_uv_transport {
    const char *scheme; /* "memory", "tcp" (logs) */
    /* Whether addr is one of this transport's and reachable from n: 0 (sets
     * *has_id and, if true, *id), AP_EADDR if addr is not this transport's,
     * AP_ENOTSUP if it is but n cannot dial it. n NULL: the syntax only. */
    int (*parse)(ap_node_t *n, const char *addr, bool *has_id, ap_peer_id_t *id);
    /* Opens a connection to addr from n, returned DIALING: on_up or on_close
     * follows from the loop. */
    int (*dial)(ap_node_t *n, const char *addr, ap_conn_t **out);
    /* Starts the transport on n, listening on listen (NULL: an address of its
     * choosing, or none); sets n->addr. */
    int (*listen)(ap_node_t *n, const char *listen);
    /* Stops it on n, once the mux has released n's connections. */
    void (*stop)(ap_node_t *n);
} ap_uv_transport_t;

/* mem.c: in-process transport, "/memory/<n>[/p2p/<id>]" (any node dials it) */
extern const ap_uv_transport_t ap__uv_mem_transport;

/* tcp_conn.c: the secure TCP transport (src/net/tcp.h) behind the same seam,
 * ip4/ip6/dns4/dns6 + /tcp multiaddrs [/p2p/<id>]. Its node runs one
 * transport on its host's loop (n->tcpc); listen NULL: dial-only. */
extern const ap_uv_transport_t ap__uv_tcp_transport;
/* The node's TCP transport (src/net/tcp.h), or NULL for an in-process node
 * (tests and fuzzing). */
struct ap_tcp *ap__tcpc_transport(ap_node_t *n);
/* The resource manager its libp2p connections count in (ap_node_set_limits
 * replaces the node's). */
void ap__tcpc_set_rcmgr(ap_node_t *n, ap_rcmgr_t *m);
/* Serves circuit relay v2 hop on the node's TCP port (tcp_conn.c): AP_EINVAL
 * without a TCP listener. */
int ap__tcpc_serve_relay(ap_node_t *n, const ap_node_relay_limits_t *l);
/* The relay options of o on n (tcp_conn.c): relay_bulk; reservations on
 * o->relays and, with n->hole_punch, DCUtR. AP_EINVAL without a TCP
 * listener, AP_EADDR for a bad relay address. */
int ap__tcpc_use_relays(ap_node_t *n, const ap_node_opts_t *o);
/* The circuit addresses n advertises now (none while AutoNAT finds it
 * public), text without /p2p/SELF; at most AP_NODE_MAX_CIRCUITS. */
#define AP_NODE_MAX_CIRCUITS 4
int ap__tcpc_circuit_addrs(ap_node_t *n, char (*out)[AP_RT_ADDR_MAX], int max);

/* node.c: the transport for addr, through the table (the entry's parse
 * result: AP_EADDR if no transport knows addr). */
int ap__addr_parse(ap_node_t *n, const char *addr, bool *has_id, ap_peer_id_t *id);
int ap__addr_dial(ap_node_t *n, const char *addr, ap_conn_t **out);

#endif
