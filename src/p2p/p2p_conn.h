/* A libp2p connection over TCP on a libuv loop. Internal.
 *
 * Upgrade, as every libp2p implementation does it: multistream-select
 * "/noise"; Noise_XX_25519_ChaChaPoly_SHA256 with the libp2p payload (each
 * Noise message behind a 2-byte big-endian length); yamux, chosen in the
 * handshake (NoiseExtensions) or, when the peer listed no muxers, with
 * multistream-select inside the encrypted channel; then yamux streams whose
 * protocol is negotiated with multistream-select.
 *
 * Bounds: a handshake message is at most 65,535 bytes; each negotiation is
 * capped as in multistream.h; yamux as in yamux.h; any violation closes the
 * connection (or the stream) with one log line naming the peer.
 *
 * Everything runs on the loop thread. Objects are freed by the library:
 * a stream after its on_close, a connection after its on_close. */
#ifndef AP_P2P_CONN_H
#define AP_P2P_CONN_H

#include "apiary/identity.h"
#include "apiary/multiaddr.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct ap_p2p_conn ap_p2p_conn_t;
typedef struct ap_p2p_stream ap_p2p_stream_t;
typedef struct ap_p2p_host ap_p2p_host_t;

/* A protocol spoken on streams. Callbacks run on the loop thread. Flow
 * control: ap__p2p_stream_set_flow. */
typedef struct ap_p2p_proto {
    const char *name;
    void (*on_open)(ap_p2p_stream_t *s); /* negotiated: the stream is usable */
    void (*on_data)(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
    void (*on_fin)(ap_p2p_stream_t *s);               /* the peer closed its direction */
    void (*on_close)(ap_p2p_stream_t *s, int status); /* last call for s */
} ap_p2p_proto_t;

/* Bytes a stream queues beyond the peer's window before writes are refused. */
#define AP_P2P_STREAM_QUEUE_MAX (4u << 20)
/* Bytes a connection hands to the socket before its streams wait for the
 * kernel to take them (queued stream bytes stay in the streams meanwhile). */
#define AP_P2P_CONN_WQ_MAX (1u << 20)

typedef struct ap_p2p_conn_cbs {
    void (*on_ready)(ap_p2p_conn_t *c, void *arg);             /* upgraded, streams may open */
    void (*on_close)(ap_p2p_conn_t *c, void *arg, int status); /* last call for c */
} ap_p2p_conn_cbs_t;

/* More callbacks, for a connection serving a node (ap__p2p_conn_set_cbs);
 * arg is the one of ap_p2p_conn_cbs_t. */
typedef struct ap_p2p_conn_xcbs {
    /* AP_P2P_NATIVE_MUX connections: the decrypted bytes of the channel, in
     * order (valid during the call). */
    void (*on_data)(ap_p2p_conn_t *c, void *arg, const uint8_t *p, size_t n);
    /* After ap__p2p_conn_want_drain: the backlog fell to its low mark. */
    void (*on_drain)(ap_p2p_conn_t *c, void *arg);
    /* The peer sent yamux Go Away: it opens no more streams. */
    void (*on_goaway)(ap_p2p_conn_t *c, void *arg);
} ap_p2p_conn_xcbs_t;

/* The node's own stream muxer (runtime/uv's mux, docs/protocol.md), offered
 * in the upgrade like any libp2p muxer; a host serving a node lists it
 * before yamux, so two Apiary nodes agree on it in the Noise handshake. */
#define AP_P2P_NATIVE_MUX "/apiary/mux/2"

/* A host serving a node (runtime/uv/p2p_bridge.c): its connections carry the
 * node's protocols, by name, over either muxer. */
typedef struct ap_p2p_bridge {
    bool native; /* list AP_P2P_NATIVE_MUX before yamux (else yamux only) */
    /* Whether a stream named proto is the node's: its negotiation selects
     * it, and the stream is served by proto below. */
    bool (*serves)(void *arg, const char *proto);
    /* The same on a relayed connection (NULL: none of the node's): the
     * node refuses its bulk protocols there unless it allows them. */
    bool (*serves_relayed)(void *arg, const char *proto);
    const ap_p2p_proto_t *proto;
    /* An inbound connection is upgraded (before its on_ready): the node
     * takes it over with ap__p2p_conn_set_cbs. */
    void (*on_conn)(void *arg, ap_p2p_conn_t *c);
} ap_p2p_bridge_t;
/* Before the host has connections (AP_ESTATE otherwise); b outlives h. */
int ap__p2p_host_set_bridge(ap_p2p_host_t *h, const ap_p2p_bridge_t *b, void *arg);
void *ap__p2p_host_bridge_arg(const ap_p2p_host_t *h);
/* Replaces c's callbacks (x may be NULL). */
void ap__p2p_conn_set_cbs(ap_p2p_conn_t *c, const ap_p2p_conn_cbs_t *cbs,
                          const ap_p2p_conn_xcbs_t *x, void *arg);
/* The arg c's callbacks get. */
void *ap__p2p_conn_arg(const ap_p2p_conn_t *c);
void ap__p2p_conn_set_user(ap_p2p_conn_t *c, void *user);
void *ap__p2p_conn_user(const ap_p2p_conn_t *c);
bool ap__p2p_conn_initiator(const ap_p2p_conn_t *c);
/* Whether the agreed muxer is AP_P2P_NATIVE_MUX (no libp2p streams then). */
bool ap__p2p_conn_native(const ap_p2p_conn_t *c);
/* AP_P2P_NATIVE_MUX: seals and queues n bytes (copied). 0 or AP_ECLOSED. */
int ap__p2p_conn_write(ap_p2p_conn_t *c, const uint8_t *p, size_t n);
/* Bytes c holds to send: the streams' queues and what the socket has not
 * taken. */
size_t ap__p2p_conn_backlog(const ap_p2p_conn_t *c);
/* on_drain fires once the backlog is at most low (from a loop callback). */
void ap__p2p_conn_want_drain(ap_p2p_conn_t *c, size_t low);
/* yamux Go Away (normal): the peer opens no more streams here. */
void ap__p2p_conn_goaway(ap_p2p_conn_t *c);

/* A host: identity, the protocols it serves, what identify announces. */
ap_p2p_host_t *ap__p2p_host_new(uv_loop_t *loop, const ap_identity_t *id, const char *agent);
/* protos must outlive the host (at most 32). */
int ap__p2p_host_serve(ap_p2p_host_t *h, const ap_p2p_proto_t *proto);
/* Serves a bulk protocol (tensors, state download): refused over a relayed
 * connection, as is opening one there (AP_EPERM), unless
 * ap__p2p_host_relay_bulk allowed it (a relay carries control traffic). */
int ap__p2p_host_serve_bulk(ap_p2p_host_t *h, const ap_p2p_proto_t *proto);
/* Serves "/ipfs/id/1.0.0" and "/ipfs/ping/1.0.0". */
int ap__p2p_host_serve_basics(ap_p2p_host_t *h);
/* Serves AP_P2P_ECHO_PROTO (tests and benchmarks; a bulk protocol): every
 * byte is sent back,
 * the stream closed after the peer's FIN once all is sent; the peer's
 * window reopens only as the echoed bytes leave, so a peer that does not
 * read the echo is stopped. */
#define AP_P2P_ECHO_PROTO "/echo/1.0.0"
int ap__p2p_host_serve_echo(ap_p2p_host_t *h);
/* Listens on ma (ip4/ip6 + tcp; port 0 picks one; SO_REUSEPORT set, so
 * ap__p2p_dial_from may dial from the port); *bound gets the address. */
int ap__p2p_host_listen(ap_p2p_host_t *h, const ap_multiaddr_t *ma, ap_multiaddr_t *bound);
/* Closes the listener and every connection; frees h once they are gone
 * (run the loop). */
void ap__p2p_host_free(ap_p2p_host_t *h);
/* As ap__p2p_host_free, then calls done(arg) once h is freed. */
void ap__p2p_host_free_then(ap_p2p_host_t *h, void (*done)(void *arg), void *arg);
/* Serves an accepted TCP socket as the listening side of a libp2p
 * connection; pre holds the n bytes already read from it (the start of
 * "/multistream/1.0.0"). h owns sock from here on, also on error.
 * admit_id: the socket's pending entry in the host's admission (the
 * transport that accepted it shares it), which the connection takes over
 * with its age; 0: it is admitted here like an accepted one. deadline:
 * when its upgrade must be done (uv_now ms; 0: the handshake timeout from
 * now). AP_ELIMIT: admission refused it. */
int ap__p2p_host_adopt(ap_p2p_host_t *h, uv_os_sock_t sock, const uint8_t *pre, size_t n,
                       uint64_t admit_id, uint64_t deadline);

/* Admission of inbound libp2p connections (accepted or adopted), by
 * connection admission (base/admit.h): the handshake in progress
 * (multistream-select, Noise, muxer selection) is pending there per remote
 * IP and in all, then the upgraded connection is open there (per IP, in
 * all, slots kept for known peers), until it closes. The host's own
 * admission, or one it shares with the TCP transport on its port
 * (ap__p2p_host_set_admit), so native and libp2p connections use one budget
 * and either kind may be closed to make room for the other. Every
 * connection not upgraded within the handshake deadline is closed
 * (AP_ETIMEDOUT). The host's connections have admission ids with
 * AP_P2P_ADMIT_TAG set; ids of the sharer's have it clear. Outbound and
 * relayed connections are not admitted. */
#define AP_P2P_HS_TIMEOUT_MS 10000
#define AP_P2P_ADMIT_TAG     1u
struct ap_admit;
typedef struct ap_p2p_admit_hooks {
    /* closes the sharer's connection id (AP_P2P_ADMIT_TAG clear) that
     * admission chose to make room */
    void (*evict)(void *arg, uint64_t id);
    /* optional: whether peer is one the node knows (base/admit.h: the
     * known slots) */
    bool (*is_known)(void *arg, const ap_peer_id_t *peer);
} ap_p2p_admit_hooks_t;
/* Admission to share (NULL: the host's own, with admit's defaults), with
 * hooks (copied) and their arg; a must outlive the host. Set before
 * connections arrive. */
void ap__p2p_host_set_admit(ap_p2p_host_t *h, struct ap_admit *a, const ap_p2p_admit_hooks_t *hooks,
                            void *arg);
/* Closes (AP_ELIMIT) the host's connection whose admission id is id, which
 * a sharer's admission chose to make room. */
void ap__p2p_host_evict(ap_p2p_host_t *h, uint64_t id);
/* The admission the host counts in. */
struct ap_admit *ap__p2p_host_admit(ap_p2p_host_t *h);
/* What peers make the host hold, counted in a resource manager
 * (base/rcmgr.h: the node's, so its limits bound libp2p connections as they
 * bound native ones). For each inbound connection once upgraded, in a
 * connection scope and its peer's scope: the bytes written to it and not yet
 * taken by the socket (answers to pings, stream opens and resets, identify,
 * data), and each stream the peer opens, until the stream is handed to the
 * node's mux (which counts it from then on) or ends. A stream over a stream
 * limit is reset; a connection whose unsent bytes a scope refuses, or that
 * holds more than AP_P2P_UNSENT_MAX of them (a peer that does not read), is
 * closed; one rate-limited WARN names the peer and the full scope.
 * AP_P2P_UNSENT_MAX holds for every connection, with or without a manager.
 * Setting another manager (or NULL) first releases every reservation in the
 * old one: do it before that one is freed. */
#define AP_P2P_UNSENT_MAX (16u << 20)
struct ap_rcmgr;
void ap__p2p_host_set_rcmgr(ap_p2p_host_t *h, struct ap_rcmgr *m);
/* The handshake deadline, ms (0: AP_P2P_HS_TIMEOUT_MS). */
void ap__p2p_host_set_hs_timeout(ap_p2p_host_t *h, uint64_t ms);
const ap_identity_t *ap__p2p_host_identity(const ap_p2p_host_t *h);
/* What identify announces as the host's listen addresses: fn writes at most
 * max addresses into out (a /p2p/ part is dropped) and returns how many it
 * wrote; it runs for each identify answer, so the list follows the node's
 * addresses as they change. Without fn: the address ap__p2p_host_listen
 * bound, if any (an adopted connection's host has none). */
typedef int (*ap_p2p_addrs_fn)(void *arg, ap_multiaddr_t *out, int max);
void ap__p2p_host_set_addrs(ap_p2p_host_t *h, ap_p2p_addrs_fn fn, void *arg);
/* The addresses identify announces now (at most max, into out). */
int ap__p2p_host_addrs(ap_p2p_host_t *h, ap_multiaddr_t *out, int max);

/* Dials ma (ip4/ip6 + tcp; a /p2p/ part is the PeerID the remote must
 * prove, else AP_EAUTH). */
int ap__p2p_dial(ap_p2p_host_t *h, const ap_multiaddr_t *ma, const ap_p2p_conn_cbs_t *cbs,
                 void *arg, ap_p2p_conn_t **out);
/* As ap__p2p_dial, listing yamux alone: a connection for libp2p protocols
 * (relay reservations and hops), never the native muxer. */
int ap__p2p_dial_streams(ap_p2p_host_t *h, const ap_multiaddr_t *ma, const ap_p2p_conn_cbs_t *cbs,
                         void *arg, ap_p2p_conn_t **out);
/* As ap__p2p_dial, from a socket bound to port with SO_REUSEADDR and
 * SO_REUSEPORT (the listen port: the host's listener sets both), and with
 * the role given: initiator false runs multistream-select and Noise as the
 * listening side although we dial (DCUtR's TCP simultaneous open fixes the
 * roles). port 0: an ephemeral port. AP_EBUSY when port cannot be bound. */
int ap__p2p_dial_from(ap_p2p_host_t *h, const ap_multiaddr_t *ma, uint16_t port, bool initiator,
                      const ap_p2p_conn_cbs_t *cbs, void *arg, ap_p2p_conn_t **out);
void ap__p2p_conn_close(ap_p2p_conn_t *c);
/* The address c's TCP connection comes from (ip4/ip6 + tcp), its host, and
 * the host's loop. */
const ap_multiaddr_t *ap__p2p_conn_remote(const ap_p2p_conn_t *c);
ap_p2p_host_t *ap__p2p_conn_host(const ap_p2p_conn_t *c);
uv_loop_t *ap__p2p_host_loop(const ap_p2p_host_t *h);
const ap_peer_id_t *ap__p2p_conn_peer(const ap_p2p_conn_t *c);
/* The muxer in use ("/yamux/1.0.0" or AP_P2P_NATIVE_MUX) and whether it
 * was agreed in the handshake. */
const char *ap__p2p_conn_muxer(const ap_p2p_conn_t *c, bool *early);

/* Opens a stream speaking proto (negotiated; proto->on_close with
 * AP_ENOPROTO if the peer answers "na"). */
int ap__p2p_stream_open(ap_p2p_conn_t *c, const ap_p2p_proto_t *proto, void *udata,
                        ap_p2p_stream_t **out);
/* Sends bytes (the stream must be open: after on_open; copied): what the
 * peer's window and the socket take goes out now, the rest waits in the
 * stream's queue and leaves as the peer grants credit. 0, or AP_EAGAIN (and
 * nothing taken) when the queue would pass AP_P2P_STREAM_QUEUE_MAX (a write
 * into an empty queue is always taken); on_writable follows. AP_ESTATE
 * before on_open, AP_ECLOSED once our direction is closed. */
int ap__p2p_stream_write(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
/* As ap__p2p_stream_write, never refused for the queue's size: for a
 * caller whose own flow control bounds what it writes (the bridge). */
int ap__p2p_stream_write_all(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
/* Bytes waiting in the stream's send queue. */
size_t ap__p2p_stream_queued(const ap_p2p_stream_t *s);
/* Flow control of s; call it in on_open or right after ap__p2p_stream_open.
 * on_writable (may be NULL) runs once the send queue fell to at most half of
 * AP_P2P_STREAM_QUEUE_MAX after ap__p2p_stream_write refused bytes.
 * Receiving: by default the bytes handed to on_data count as read at once
 * (the peer's window reopens); with manual_consume the protocol calls
 * ap__p2p_stream_consume when it is done with them, so a reader that stops
 * consuming stops the sender (yamux back-pressure). */
void ap__p2p_stream_set_flow(ap_p2p_stream_t *s, void (*on_writable)(ap_p2p_stream_t *s),
                             bool manual_consume);
/* manual_consume: n bytes handed to on_data are processed. */
void ap__p2p_stream_consume(ap_p2p_stream_t *s, size_t n);
/* Half-close (FIN), sent once the queue has drained. */
int ap__p2p_stream_close(ap_p2p_stream_t *s);
void ap__p2p_stream_reset(ap_p2p_stream_t *s);
void *ap__p2p_stream_udata(const ap_p2p_stream_t *s);
void ap__p2p_stream_set_udata(ap_p2p_stream_t *s, void *udata);
ap_p2p_conn_t *ap__p2p_stream_conn(const ap_p2p_stream_t *s);
/* The protocol id negotiated (also for a name the bridge served). */
const char *ap__p2p_stream_name(const ap_p2p_stream_t *s);
/* The stream's yamux id. */
uint32_t ap__p2p_stream_id(const ap_p2p_stream_t *s);
/* The protocol the stream speaks (the one passed to open or served). */
const ap_p2p_proto_t *ap__p2p_stream_proto(const ap_p2p_stream_t *s);

/* A libp2p connection carried by the open stream carrier (a relayed
 * circuit: the stream is a byte pipe to the far peer): the whole upgrade
 * (multistream-select, Noise, muxer) runs inside it, end to end. pre holds
 * the n bytes already read from carrier past the relay's messages. From
 * here on the carrier's bytes go to the connection (not to its protocol's
 * on_data); closing the connection half-closes the carrier, and the
 * carrier's end (FIN, reset, close) closes the connection. remote is the
 * circuit address the peer is reached at. On such a connection identify
 * reports no observed address, and bulk protocols are refused (opening one
 * is AP_EPERM, and the listening side answers "na"). */
int ap__p2p_conn_over(ap_p2p_stream_t *carrier, bool initiator, const ap_peer_id_t *expected,
                      const ap_multiaddr_t *remote, const uint8_t *pre, size_t n,
                      const ap_p2p_conn_cbs_t *cbs, void *arg, ap_p2p_conn_t **out);
bool ap__p2p_conn_relayed(const ap_p2p_conn_t *c);
void ap__p2p_host_relay_bulk(ap_p2p_host_t *h, bool allow);
/* A ready connection to peer: AP_P2P_FIND_ANY a direct one if any, else a
 * relayed one; AP_P2P_FIND_DIRECT / _RELAYED only that kind. NULL when
 * there is none. */
enum { AP_P2P_FIND_ANY = 0, AP_P2P_FIND_DIRECT = 1, AP_P2P_FIND_RELAYED = 2 };
ap_p2p_conn_t *ap__p2p_host_find(ap_p2p_host_t *h, const ap_peer_id_t *peer, int which);

#endif
