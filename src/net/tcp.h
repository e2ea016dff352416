/* The secure TCP transport: TCP + Noise XX (secure.h), presenting each
 * authenticated connection as an ordered, encrypted byte pipe to one remote
 * PeerID — the "connection" the stream multiplexer (runtime/uv) runs on.
 * Internal.
 *
 * WIRE. After TCP connect, three handshake messages, then transport
 * messages; every message is [u16 big-endian length][bytes]. A transport
 * message is ChaCha20-Poly1305 of up to 65,519 plaintext bytes (65,535 with
 * the tag), nonce = its index in its direction. A zero-length plaintext is a
 * keepalive and is not delivered. Any decrypt failure (altered, replayed,
 * reordered, truncated data), an oversized handshake message, or a
 * handshake that is not finished by the deadline closes the connection with
 * one WARN log line naming the peer (its short PeerID, or its address when it
 * has not authenticated yet).
 *
 * VERSION. The handshake's Noise prologue is AP_TCP_PROLOGUE (the version of
 * what runs on top: the mux wire protocol); a peer with another prologue
 * fails the handshake at message 2 (AP_EAUTH), before any frame is read.
 * ONE CONNECTION PER PEER. When two authenticated connections to the same
 * peer exist (both sides dialled at once), both ends keep the one dialled by
 * the smaller PeerID (memcmp of the id bytes) and close the other; two
 * connections dialled by the same side: the older is kept. Dials to a peer
 * with a pending dial join it. With cfg.keep_duplicates, a duplicate dialled
 * by the other side is not closed: it is announced like any connection and
 * the layer above retires it (the mux's GOAWAY); ap__tcp_find returns the
 * one the rule keeps.
 *
 * ADMISSION (base/admit.h). One admission for every connection on the port,
 * native and libp2p (the libp2p host on the port shares it, tcp_p2p.c): a
 * libp2p connection is admitted at accept like a native one and takes its
 * entry along to the host, which keeps it through its upgrade and while it
 * is open. Inbound handshakes pending are limited per source IP
 * (hs_per_ip) and in total (random early drop past a quarter of
 * max_handshakes, a stalled one closed for a newcomer at the limit, of
 * either kind); each must be done within handshake_timeout_ms. Open
 * connections: at most max_conns, conns_per_ip per source IP, 64 of them kept for the
 * node's own dials and 64 for known peers; when an inbound handshake
 * completes at a limit, the least useful inbound connection (idle for evict_idle_ms,
 * from the source holding the most, the longest idle first) is closed
 * (AP_ELIMIT) to make room, else the newcomer is closed. Sockets: at most
 * max_conns + max_handshakes.
 *
 * LIVENESS. If nothing was sent for keepalive_ms, an empty message is sent;
 * if nothing arrived for dead_ms, the peer is declared dead (AP_ETIMEDOUT);
 * if no application bytes moved for idle_ms, the connection is closed (0).
 *
 * BACK-PRESSURE. ap__tcp_send copies and encrypts at once into a write queue
 * of at most write_queue_max bytes; beyond that it returns AP_EAGAIN and
 * on_writable fires when the queue drains below half. Receiving: each
 * transport message is delivered to on_data; ap__tcp_pause_read stops
 * reading from the socket from the next read on (the rest of the current
 * read is still delivered), so the kernel buffers and then the sender's
 * queue fill up.
 *
 * MEMORY. An idle open connection holds its struct and the libuv handle
 * (about 1 KiB); read and write buffers are allocated while data flows and
 * released after a quiet sweep period.
 *
 * THREADING. Everything runs on the loop thread of the uv_loop_t given to
 * ap__tcp_new; every function must be called on it. Callbacks are never
 * invoked from inside the API call that caused them, except on_data /
 * on_writable which run from libuv read/write callbacks. */
#ifndef AP_NET_TCP_H
#define AP_NET_TCP_H

#include "apiary/identity.h"
#include "base/admit.h"
#include "apiary/multiaddr.h"
#include "net/noise.h"

#include <uv.h>

typedef struct ap_tcp ap_tcp_t;
typedef struct ap_tcp_conn ap_tcp_conn_t;

#define AP_TCP_HS_MSG_MAX    2048 /* handshake messages are ~200 bytes; cap memory */
#define AP_TCP_MAX_LISTENERS 4
/* Noise prologue: bumped with the mux wire version (frame.h,
 * AP_MUX_WIRE_VERSION); version 1 used an empty prologue. */
#define AP_TCP_PROLOGUE "/apiary/mux/2"

typedef struct ap_tcp_cfg {
    size_t max_conns;              /* open connections; 0 = 1024 (see ADMISSION) */
    size_t max_handshakes;         /* inbound handshakes in progress; 0 = 256 */
    size_t hs_per_ip;              /* of them, from one source IP; 0 = 16 */
    uint64_t handshake_timeout_ms; /* inbound: accept -> done; 0 = 10 s */
    uint64_t keepalive_ms;         /* 0 = 15 s; UINT64_MAX = never */
    uint64_t dead_ms;              /* 0 = 3 * keepalive; UINT64_MAX = never */
    uint64_t idle_ms;              /* 0 = never */
    size_t write_queue_max;        /* 0 = 4 MiB */
    ap_noise_hash_t hash;          /* AP_NOISE_BLAKE2B (0) by default */
    size_t read_buf_size;          /* shared read buffer; 0 = 1 MiB */
    bool keep_duplicates;          /* see ONE CONNECTION PER PEER above */
    size_t conns_per_ip;           /* open inbound connections per source IP; 0 = 64 */
    uint32_t evict_idle_ms; /* idle this long, an inbound connection may make room; 0 = 200 */
    bool reuse_port;        /* listeners set SO_REUSEPORT: dials may leave from their port */
} ap_tcp_cfg_t;

typedef struct ap_tcp_cbs {
    /* A connection authenticated and is now the one to c's peer. */
    void (*on_conn)(void *arg, ap_tcp_conn_t *c);
    /* Decrypted bytes, in order; data valid during the call only. */
    void (*on_data)(void *arg, ap_tcp_conn_t *c, const uint8_t *data, size_t len);
    /* The write queue drained below half after an AP_EAGAIN. */
    void (*on_writable)(void *arg, ap_tcp_conn_t *c);
    /* The connection is gone (only for connections on_conn announced).
     * status: 0 (closed locally or idle), AP_ECLOSED (peer closed / reset),
     * AP_ETIMEDOUT (dead peer), AP_EAUTH (decrypt failure), AP_EPROTO,
     * AP_ESHUTDOWN (transport closing), AP_EEXIST (lost the duplicate rule).
     * c is freed right after this returns. */
    void (*on_close)(void *arg, ap_tcp_conn_t *c, int status);
    /* Optional: whether peer is one the node already knows (its address
     * book: routing-table contacts, peers it dialled). An inbound connection
     * from a known peer may use the slots kept for known peers
     * (reserved_known), which a flood of fresh identities cannot fill. */
    bool (*is_known)(void *arg, const ap_peer_id_t *peer);
} ap_tcp_cbs_t;

/* Creates the transport on loop for identity id (copied). cfg may be NULL
 * (defaults). cbs is copied; arg is passed to every callback. */
int ap__tcp_new(uv_loop_t *loop, const ap_identity_t *id, const ap_tcp_cfg_t *cfg,
                const ap_tcp_cbs_t *cbs, void *arg, ap_tcp_t **out);

/* Closes every connection (on_close with AP_ESHUTDOWN) and listener; done
 * (may be NULL) runs once everything is released, from the loop; then t is
 * freed. Pending dials complete with AP_ESHUTDOWN. */
void ap__tcp_close(ap_tcp_t *t, void (*done)(void *arg), void *arg);

/* Listens on an ip4/ip6 multiaddr with /tcp (port 0 = any; read the bound
 * address back with ap__tcp_listen_addrs). */
int ap__tcp_listen(ap_tcp_t *t, const char *multiaddr);
/* The bound listen addresses (with /p2p/<self>). Returns the count. */
int ap__tcp_listen_addrs(ap_tcp_t *t, ap_multiaddr_t *out, int max);
/* The addresses libp2p peers on the transport's port are told (identify's
 * listen addresses): fn writes at most max into out and returns how many;
 * it runs for each identify answer (the node gives its announced or
 * interface addresses, runtime/uv/tcp_conn.c). Without fn: the bound listen
 * addresses whose host is not a wildcard. */
typedef int (*ap_tcp_addrs_fn)(void *arg, ap_multiaddr_t *out, int max);
void ap__tcp_set_announce(ap_tcp_t *t, ap_tcp_addrs_fn fn, void *arg);

/* The node the libp2p host on the transport's port serves (p2p_conn.h,
 * ap_p2p_bridge_t): set before the first libp2p connection. */
struct ap_p2p_bridge;
void ap__tcp_set_bridge(ap_tcp_t *t, const struct ap_p2p_bridge *b, void *arg);
/* The resource manager the libp2p host on the port counts what its peers
 * make it hold in (p2p_conn.h, ap__p2p_host_set_rcmgr: the node's), or NULL;
 * a change releases what was held in the old one at once. */
struct ap_rcmgr;
void ap__tcp_set_rcmgr(ap_tcp_t *t, struct ap_rcmgr *m);
/* That host (created on first use; NULL when out of memory): libp2p dials
 * go through it. */
struct ap_p2p_host *ap__tcp_p2p_host(ap_tcp_t *t);
/* Serves circuit relay v2 hop on that host with limits lim (relay.h; NULL:
 * the defaults); the service is freed with the host. Before the first
 * libp2p connection. AP_EEXIST if already served, AP_ENOMEM. */
struct ap_relay_limits;
int ap__tcp_serve_relay(ap_tcp_t *t, const struct ap_relay_limits *lim);
/* The relay service, or NULL. */
struct ap_relay_service *ap__tcp_relay(ap_tcp_t *t);
/* Circuit relay v2 client on that host (relay_svc.h, ap__relay_client_new):
 * reservations on relays[0..n), relayed connections handed to on_inbound.
 * Freed with the host. NULL: out of memory, a bad relay address, or
 * already made. */
struct ap_relay_client;
struct ap_p2p_conn;
struct ap_relay_client *ap__tcp_use_relays(ap_tcp_t *t, const ap_multiaddr_t *relays, size_t n,
                                           void (*on_inbound)(void *arg, struct ap_p2p_conn *c),
                                           void *arg);
struct ap_relay_client *ap__tcp_relay_client(ap_tcp_t *t);
/* DCUtR on that host (p2p/dcutr_uv.h, ap__dcutr_serve); freed with it. */
struct ap_dcutr;
struct ap_dcutr_opts;
struct ap_dcutr *ap__tcp_serve_dcutr(ap_tcp_t *t, const struct ap_dcutr_opts *o,
                                     void (*cb)(void *arg, const ap_peer_id_t *peer, bool b_side,
                                                int status, int attempts, double ms,
                                                struct ap_p2p_conn *direct),
                                     void *arg);
struct ap_dcutr *ap__tcp_dcutr(ap_tcp_t *t);

typedef void (*ap_tcp_dial_fn)(void *arg, int status, ap_tcp_conn_t *c);
/* Dials addr (ip4/ip6/dns4/dns6 + /tcp [+ /p2p/ID]) with a timeout covering
 * resolution, TCP connect and handshake (0 = 30 s). Returns an error and
 * never calls cb for what is known at once: AP_EADDR (not such an address),
 * AP_EINVAL (our own PeerID), AP_ELIMIT (max_conns reached), AP_ESHUTDOWN,
 * AP_ENOMEM. Otherwise returns 0 and cb runs exactly once, later, with 0 and
 * the open connection to that peer (possibly one that existed already), or
 * AP_EUNREACH (refused, no route, closed during the handshake),
 * AP_ETIMEDOUT, AP_EAUTH (the peer is not the /p2p/ id, or failed the
 * handshake), AP_ELIMIT (no connection slot left), AP_EEXIST (lost the duplicate rule),
 * AP_ESHUTDOWN. */
int ap__tcp_dial(ap_tcp_t *t, const char *addr, uint64_t timeout_ms, ap_tcp_dial_fn cb, void *arg);

/* The open connection to peer, or NULL. */
ap_tcp_conn_t *ap__tcp_find(ap_tcp_t *t, const ap_peer_id_t *peer);

/* Queues data (copied, encrypted now). 0, AP_EAGAIN (queue full: nothing
 * queued, wait for on_writable), AP_ECLOSED. A send larger than the queue
 * cap is accepted when the queue is empty. */
int ap__tcp_send(ap_tcp_conn_t *c, const uint8_t *data, size_t len);
/* The connection-seam form (runtime/uv/conn.h): always queues the bytes;
 * returns 0, 1 when the queue is above write_queue_max (on_writable follows
 * once it is below half), or AP_ECLOSED (bytes dropped). */
int ap__tcp_write(ap_tcp_conn_t *c, const uint8_t *data, size_t len);
/* Same as ap__tcp_send, gathering n buffers into one logical write (no extra copy). */
int ap__tcp_sendv(ap_tcp_conn_t *c, const uv_buf_t *bufs, size_t n);
size_t ap__tcp_queued(const ap_tcp_conn_t *c);
/* Writes handed to libuv whose callback has not run yet (tests: the write
 * queue's pipelining, tcp_io.c "writing"). */
int ap__tcp_writes_inflight(const ap_tcp_conn_t *c);
void ap__tcp_pause_read(ap_tcp_conn_t *c, bool paused);
/* Sends what is queued, then closes; on_close(0) follows. */
void ap__tcp_conn_close(ap_tcp_conn_t *c);
/* Closes at once, dropping the queue; on_close(err) follows. */
void ap__tcp_conn_abort(ap_tcp_conn_t *c, int err);

/* Fuzzing and tests only: an authenticated connection to peer with the given
 * transport cipher states and no socket. Bytes from the "peer" are fed with
 * ap__tcp_conn_feed (the same framing loop as socket reads: length prefix,
 * decrypt, on_data); bytes written to it are dropped. on_conn fires before
 * this returns. AP_EEXIST if peer is connected. */
int ap__tcp_conn_inject(ap_tcp_t *t, const ap_peer_id_t *peer, const ap_noise_cs_t *send,
                        const ap_noise_cs_t *recv, bool outbound, ap_tcp_conn_t **out);
void ap__tcp_conn_feed(ap_tcp_conn_t *c, const uint8_t *p, size_t n);
/* Whether c is open (not failed or closing); c stays valid until on_close. */
bool ap__tcp_conn_is_open(const ap_tcp_conn_t *c);

const ap_peer_id_t *ap__tcp_conn_peer(const ap_tcp_conn_t *c);
bool ap__tcp_conn_outbound(const ap_tcp_conn_t *c);
void ap__tcp_conn_set_user(ap_tcp_conn_t *c, void *user);
void *ap__tcp_conn_user(const ap_tcp_conn_t *c);
const ap_identity_t *ap__tcp_identity(const ap_tcp_t *t);

typedef struct ap_tcp_stats {
    uint64_t bytes_sent, bytes_received; /* on the wire */
    uint32_t open, handshaking;
    uint64_t handshakes_ok, handshakes_failed, closed_bad_input, dup_closed;
    uint64_t dup_kept;      /* duplicates left open for the layer above (keep_duplicates) */
    uint64_t refused_open;  /* handshakes done but refused by the open-connection limits */
    uint64_t evicted_idle;  /* idle inbound connections closed to make room for a newcomer */
    ap_admit_stats_t admit; /* admission (base/admit.h) */
} ap_tcp_stats_t;
void ap__tcp_get_stats(const ap_tcp_t *t, ap_tcp_stats_t *out);

/* ss's address as 16 bytes (IPv4 as ::ffff:a.b.c.d; zeros if neither): the
 * key of admission and of the handshake counts, for libp2p connections too. */
void ap__tcp_ip16(const struct sockaddr_storage *ss, uint8_t ip[16]);

#endif
