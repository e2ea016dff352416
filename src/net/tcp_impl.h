/* Internals of the secure TCP transport, shared by its files:
 *   tcp.c        the transport object, peer table, closing, the sweep, accessors
 *   tcp_admit.c  listening, accepting under the caps, the handshake, duplicates
 *   tcp_dial.c   resolving, connecting, completing dials
 *   tcp_io.c     write blocks and queue, reading and framing
 * The API is net/tcp.h. */
#ifndef AP_NET_TCP_IMPL_H
#define AP_NET_TCP_IMPL_H

#include "base/admit.h"
#include "base/buf.h"
#include "net/secure.h"
#include "net/tcp.h"

#define MOD            "net"
#define FRAME_MAX      (2u + AP_NOISE_MSG_MAX)
#define DRAIN_MS       5000u
#define BUF_RELEASE_MS 1000u

typedef enum { C_CONNECTING, C_HANDSHAKE, C_OPEN, C_CLOSING } conn_state_t;

typedef struct dial_req dial_req_t;
typedef struct wblock wblock_t;
struct dial_req {
    ap_tcp_t *t;
    ap_tcp_dial_fn cb;
    void *arg;
    ap_multiaddr_t ma;
    uint64_t deadline;
    ap_ma_resolve_t *res;
    bool timed_out;
    int status; /* for deferred completions */
    dial_req_t *next, *prev;
};

/* Write blocks: small enough that a stream's bytes reach the peer in pieces
 * well below a mux stream window (1 MiB by default), so the receiver opens
 * one piece while this side seals the next; big enough that a busy
 * connection costs one syscall per 256 KiB. */
#define WBLOCK_CAP (256u * 1024u + 2048u) /* 4 whole maximal frames, 8 of the mux's */
/* Writes made while a read is processed are held, to go out together (the
 * mux's credit frames, echoes), at the latest after this much input. */
#define RX_FLUSH_BYTES (128u * 1024u)
/* Small tails (credit frames, RPC, echoes) are handed to libuv before
 * earlier writes completed, at most this many writes in flight then. */
#define WBLOCK_EARLY_MAX   2
#define WBLOCK_EARLY_BYTES (16u * 1024u)

struct wblock {
    uv_write_t req;
    wblock_t *next;
    ap_tcp_conn_t *c;
    size_t len;
    bool submitted;
    uint8_t data[WBLOCK_CAP];
};

struct ap_tcp_conn {
    ap_tcp_t *t;
    uv_tcp_t h;
    uv_connect_t creq;
    uv_write_t wreq;
    conn_state_t st;
    bool outbound, announced, counted_hs, reading, paused, draining, want_writable;
    bool admitted; /* counted by t->admit (inbound: from accept; outbound: from connect) */
    bool has_expected;
    bool sniffed;        /* the first inbound bytes were looked at (tcp_p2p.c) */
    bool in_read;        /* inside read_cb: the open tail waits (see flush) */
    size_t rx_unflushed; /* bytes processed in this read since writes went out */
    bool sink;           /* injected (fuzzing): no socket; written bytes are dropped */
    ap_peer_id_t expected;
    ap_peer_id_t peer; /* valid once authenticated */
    bool has_peer;
    int close_status;
    char who[64]; /* short PeerID or remote address, for logs */
    ap_secure_hs_t *hs;
    ap_noise_cs_t send, recv;
    uint8_t *part; /* partial frame */
    size_t plen;
    wblock_t *wq_head, *wq_tail, *wq_unsub, *spare;
    int inflight, nspare;
    size_t queued;
    uint64_t deadline, last_rx, last_tx, last_app, write_started, drain_started;
    dial_req_t *reqs; /* dials waiting for this connection */
    void *user;
    ap_tcp_conn_t *next, *prev; /* all connections */
    ap_tcp_conn_t *hnext;       /* peer table chain */
};

struct ap_tcp {
    uv_loop_t *loop;
    ap_secure_creds_t creds;
    ap_tcp_cfg_t cfg;
    ap_tcp_cbs_t cbs;
    void *arg;
    uv_tcp_t *listeners[AP_TCP_MAX_LISTENERS];
    ap_multiaddr_t listen_ma[AP_TCP_MAX_LISTENERS];
    int nlisteners;
    uv_timer_t sweep, kick;
    uint64_t sweep_ms;
    uint8_t *rbuf;
    ap_tcp_conn_t *conns;
    size_t nconns, nhandshaking;
    /* Admission (tcp_admit.c): handshakes and open connections per source
     * address and in all, native and libp2p alike (the libp2p host on the
     * port shares it: its connections' ids have AP_P2P_ADMIT_TAG set). */
    ap_admit_t admit;
    ap_tcp_conn_t **table;
    size_t table_cap, table_n;
    dial_req_t *resolving, *deferred;
    int handles;
    bool closing;
    void (*done)(void *);
    void *done_arg;
    ap_tcp_stats_t stats;
    struct ap_p2p_host *p2p;            /* serves libp2p dialers on the same port (tcp_p2p.c) */
    struct ap_autonat_service *autonat; /* AutoNAT v1 on that host */
    struct ap_relay_service *relay;     /* circuit relay v2 hop on it, or NULL */
    struct ap_relay_client *relay_cl;   /* reservations on relays (ap__tcp_use_relays), or NULL */
    struct ap_dcutr *dcutr;             /* hole punching on it, or NULL */
    ap_tcp_addrs_fn announce;           /* identify's listen addresses (ap__tcp_set_announce) */
    const struct ap_p2p_bridge *bridge; /* the node the host serves (ap__tcp_set_bridge) */
    struct ap_rcmgr *rc;                /* the host's resource manager (ap__tcp_set_rcmgr) */
    void *bridge_arg;
    void *announce_arg;
};

/* tcp.c */
uint64_t ap__tcp_now_ms(ap_tcp_t *t);
void ap__tcp_list_push(dial_req_t **head, dial_req_t *r);
void ap__tcp_list_remove(dial_req_t **head, dial_req_t *r);
/* Calls the close callback once every handle is closed. */
void ap__tcp_maybe_finish(ap_tcp_t *t);
void ap__tcp_set_who_addr(ap_tcp_conn_t *c); /* c->who: the remote address */
void ap__tcp_set_who_peer(ap_tcp_conn_t *c); /* c->who: the short PeerID */
int ap__tcp_table_insert(ap_tcp_t *t, ap_tcp_conn_t *c);
void ap__tcp_table_remove(ap_tcp_t *t, ap_tcp_conn_t *c);
ap_tcp_conn_t *ap__tcp_conn_new(ap_tcp_t *t, bool outbound);
/* Closes c because of bad input or a failed peer: exactly one WARN line. */
void ap__tcp_conn_fail(ap_tcp_conn_t *c, int err, const char *fmt, ...) AP_PRINTF(3, 4);
void ap__tcp_listener_closed(uv_handle_t *h);

/* Application bytes moved on c (c->last_app): admission's idle clock. */
static inline void ap__tcp_touch(ap_tcp_conn_t *c)
{
    if (c->admitted) ap_admit_touch(&c->t->admit, (uint64_t)(uintptr_t)c, c->last_app);
}

/* tcp_admit.c */
int ap__tcp_hs_start(ap_tcp_conn_t *c);
void ap__tcp_hs_frame(ap_tcp_conn_t *c, const uint8_t *m, size_t n);
/* Closes the connection admission chose to make room (id: a native
 * connection, or one of the libp2p host's). */
void ap__tcp_admit_evict(ap_tcp_t *t, uint64_t id);

/* tcp_dial.c */
void ap__tcp_dial_done(dial_req_t *r, int status, ap_tcp_conn_t *c);
/* Completes every dial waiting for c. */
void ap__tcp_dials_done(ap_tcp_conn_t *c, int status);

/* tcp_p2p.c */
/* On an inbound connection's first bytes: when they start multistream-select
 * (0x13), hands the socket to the libp2p host and closes c; returns true
 * when c is gone. */
bool ap__tcp_sniff(ap_tcp_conn_t *c, const uint8_t *p, size_t n);
/* Frees the libp2p host on close (counted as a handle). */
void ap__tcp_p2p_close(ap_tcp_t *t);

/* tcp_io.c */
void ap__tcp_wblocks_free(ap_tcp_conn_t *c);
void ap__tcp_flush(ap_tcp_conn_t *c);
int ap__tcp_queue_plain(ap_tcp_conn_t *c, const uint8_t *m, size_t n);
int ap__tcp_queue_sealed(ap_tcp_conn_t *c, const uv_buf_t *bufs, size_t n, size_t total);
void ap__tcp_start_reading(ap_tcp_conn_t *c);
/* Bytes read from c's socket (or fed by a test). */
void ap__tcp_process(ap_tcp_conn_t *c, uint8_t *p, size_t n);

#endif
