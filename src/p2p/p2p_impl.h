/* Internals of libp2p connections, shared by their files:
 *   p2p_wire.c  raw and sealed writes, write blocks, when they leave
 *   p2p_conn.c  streams, the upgrade, reading
 *   p2p_host.c  the host: protocols served (identify, ping, echo), listening,
 *               adopting sockets, freeing
 * The API is p2p/p2p_conn.h. */
#ifndef AP_P2P_IMPL_H
#define AP_P2P_IMPL_H

#include "base/buf.h"
#include "base/admit.h"
#include "base/rcmgr.h"
#include "base/u64map.h"
#include "net/secure.h"
#include "p2p/identify.h"
#include "p2p/multistream.h"
#include "p2p/p2p_conn.h"
#include "p2p/yamux.h"

#define PROTOS_MAX  32
#define NOISE_PROTO "/noise"

struct ap_p2p_host {
    uv_loop_t *loop;
    ap_secure_creds_t creds;
    ap_secure_creds_t ycreds; /* yamux only: what a relayed connection lists */
    char agent[AP_IDENTIFY_STR_MAX + 1];
    const ap_p2p_proto_t *protos[PROTOS_MAX];
    const char *names[PROTOS_MAX];
    size_t nprotos;
    const char *ctl_names[PROTOS_MAX]; /* what a relayed connection may open */
    size_t nctl;
    bool relay_bulk; /* bulk protocols also over relayed connections */
    uv_tcp_t listener;
    bool listening, freeing;
    ap_multiaddr_t bound;
    size_t nconns;
    struct ap_p2p_conn *conns; /* every live connection */
    void (*done)(void *);      /* after the host is freed (ap__p2p_host_free_then) */
    void *done_arg;
    ap_p2p_addrs_fn addrs_fn; /* identify's listen addresses (ap__p2p_host_set_addrs) */
    void *addrs_arg;
    const ap_p2p_bridge_t *bridge; /* the node it serves (ap__p2p_host_set_bridge), or NULL */
    void *bridge_arg;
    /* Admission of inbound connections (ap__p2p_host_set_admit): the
     * host's own, or the TCP transport's. */
    ap_admit_t *admit, own_admit;
    ap_p2p_admit_hooks_t admit_hooks;
    void *admit_arg;
    /* What peers make it hold (ap__p2p_host_set_rcmgr): the node's
     * resource manager, or NULL. */
    ap_rcmgr_t *rc;
    uint64_t hs_timeout_ms; /* a connection not upgraded by then is closed */
    uv_timer_t hs_timer;    /* checks the deadlines */
    bool hs_timer_open;
};

enum { P_CONNECT, P_MSS, P_NOISE, P_MUXSEL, P_YAMUX, P_NATIVE, P_DEAD };

struct ap_p2p_conn {
    uv_tcp_t tcp;
    uv_connect_t creq;
    ap_p2p_host_t *h;
    bool initiator, ready, closing;
    int phase, status;
    ap_mss_t mss;
    ap_secure_hs_t hs;
    ap_noise_cs_t tx, rx;
    bool early;
    ap_buf_t raw; /* bytes not yet framed */
    ap_yamux_t y;
    bool y_init;
    ap_u64map_t streams; /* yamux id -> ap_p2p_stream_t * */
    ap_peer_id_t peer;
    char peer_short[AP_PEER_SHORT_LEN];
    ap_multiaddr_t remote;       /* the address the peer is seen at */
    bool wq_blocked;             /* a stream waits for the socket's queue to drain */
    bool relayed;                /* over a circuit: car carries the bytes */
    const ap_secure_creds_t *cr; /* the credentials (and muxers) of the handshake */
    struct ap_p2p_stream *car;
    struct wblk *cur;   /* the open write block (not yet handed to libuv) */
    struct wblk *spare; /* blocks kept for reuse */
    int nspare, inflight;
    bool msg_open;   /* cur ends in a Noise message still gathering bytes ... */
    size_t msg_len;  /* ... of msg_len plaintext bytes (at cur->len + 2) */
    int batch;       /* inside a callback: the open block waits for its end */
    size_t qbytes;   /* bytes in the streams' send queues */
    bool drain_owed; /* on_drain once the backlog is down to drain_low */
    size_t drain_low;
    void *user; /* ap__p2p_conn_set_user */
    ap_p2p_conn_cbs_t cbs;
    ap_p2p_conn_xcbs_t x;
    void *arg;
    bool announced;       /* on_ready fired: on_close is owed */
    uint64_t admit_id;    /* its entry in h->admit (inbound, direct), or 0 */
    ap_rc_span_t rc;      /* its connection and peer scopes in h->rc (inbound, upgraded) */
    uint64_t rc_mem;      /* unsent bytes reserved there */
    uint64_t hs_deadline; /* uv_now: the upgrade must be done by then */
    struct ap_p2p_conn *next, *prev;
};

struct ap_p2p_stream {
    ap_p2p_conn_t *c;
    uint32_t id;
    ap_mss_t mss;
    bool ready;
    const ap_p2p_proto_t *proto;
    const char *want[1];
    void *udata;
    /* send queue: bytes past the peer's window (or the socket's queue) */
    ap_buf_t q;
    size_t qoff;        /* bytes of q already sent */
    bool fin_pending;   /* FIN once q is empty */
    bool lclosed;       /* ap__p2p_stream_close was called */
    bool want_writable; /* a write was refused: on_writable owed */
    bool echo;          /* the echo server: credit goes back as bytes leave q */
    bool manual;        /* ap__p2p_stream_set_flow: the protocol consumes */
    bool rc_stream;     /* counted in its connection's span (h->rc) */
    void (*on_writable)(ap_p2p_stream_t *s);
    ap_p2p_conn_t *inner; /* a connection carried by this stream */
};

/* p2p_wire.c */
/* Bytes before the handshake's keys (multistream-select, Noise handshake
 * messages), as they are. */
void ap__p2p_raw_write(ap_p2p_conn_t *c, const uint8_t *p, size_t n);
/* a (an bytes) then b (bn bytes) into Noise transport messages. */
void ap__p2p_secure_write(ap_p2p_conn_t *c, const uint8_t *a, size_t an, const uint8_t *b,
                          size_t bn);
/* The open write block goes to libuv (end of a batch). */
void ap__p2p_conn_submit(ap_p2p_conn_t *c);
/* More than AP_P2P_CONN_WQ_MAX bytes wait for the socket (or the carrier). */
bool ap__p2p_wq_full(const ap_p2p_conn_t *c);
/* An owed on_drain, if the backlog is down to its mark (ends loop callbacks). */
void ap__p2p_drain_check(ap_p2p_conn_t *c);
/* Frees the open block and the spares (the connection is gone). */
void ap__p2p_wblocks_free(ap_p2p_conn_t *c);

/* p2p_conn.c */
/* The socket's queue drained: every stream with queued bytes goes on. */
void ap__p2p_conn_drained(ap_p2p_conn_t *c);
ap_p2p_conn_t *ap__p2p_conn_new(ap_p2p_host_t *h, bool initiator, const ap_peer_id_t *expected);
/* Starts the upgrade on a connected socket. */
void ap__p2p_conn_start(ap_p2p_conn_t *c);
void ap__p2p_conn_fail(ap_p2p_conn_t *c, int err);
/* Handles the bytes in c->raw (an adopted socket's first bytes). */
void ap__p2p_conn_process(ap_p2p_conn_t *c);
/* Appends to s's queue (no cap) and sends what can go. */
int ap__p2p_stream_queue(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
/* p2p_host.c: frees h once its listener, timer and connections are gone. */
void ap__p2p_host_release(ap_p2p_host_t *h);
/* Admission (p2p_host.c): c's upgrade is done; false if c was refused
 * (closed). c is gone from admission (on close). Application data moved
 * on c (its idle clock). */
bool ap__p2p_admit_open(ap_p2p_conn_t *c);
void ap__p2p_admit_gone(ap_p2p_conn_t *c);
void ap__p2p_admit_touch(ap_p2p_conn_t *c);
/* Resource manager (p2p_host.c): c's scopes once it is upgraded; what c
 * holds released and its scopes dropped (closing); a stream the peer opens
 * counted (false: refused, logged) and released. */
void ap__p2p_rc_attach(ap_p2p_conn_t *c);
void ap__p2p_rc_detach(ap_p2p_conn_t *c);
bool ap__p2p_rc_stream(ap_p2p_stream_t *s);
void ap__p2p_rc_stream_release(ap_p2p_stream_t *s);
/* p2p_wire.c: c's unsent bytes against AP_P2P_UNSENT_MAX and their
 * reservation; closes c when either refuses. */
void ap__p2p_unsent_check(ap_p2p_conn_t *c);

#endif
