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

/* A protocol spoken on streams. Callbacks run on the loop thread. */
typedef struct ap_p2p_proto {
    const char *name;
    void (*on_open)(ap_p2p_stream_t *s); /* negotiated: the stream is usable */
    void (*on_data)(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
    void (*on_fin)(ap_p2p_stream_t *s);               /* the peer closed its direction */
    void (*on_close)(ap_p2p_stream_t *s, int status); /* last call for s */
} ap_p2p_proto_t;

typedef struct ap_p2p_conn_cbs {
    void (*on_ready)(ap_p2p_conn_t *c, void *arg);             /* upgraded, streams may open */
    void (*on_close)(ap_p2p_conn_t *c, void *arg, int status); /* last call for c */
} ap_p2p_conn_cbs_t;

/* A host: identity, the protocols it serves, what identify announces. */
ap_p2p_host_t *ap__p2p_host_new(uv_loop_t *loop, const ap_identity_t *id, const char *agent);
/* protos must outlive the host (at most 32). */
int ap__p2p_host_serve(ap_p2p_host_t *h, const ap_p2p_proto_t *proto);
/* Serves "/ipfs/id/1.0.0" and "/ipfs/ping/1.0.0". */
int ap__p2p_host_serve_basics(ap_p2p_host_t *h);
/* Listens on ma (ip4/ip6 + tcp; port 0 picks one); *bound gets the address. */
int ap__p2p_host_listen(ap_p2p_host_t *h, const ap_multiaddr_t *ma, ap_multiaddr_t *bound);
/* Closes the listener and every connection; frees h once they are gone
 * (run the loop). */
void ap__p2p_host_free(ap_p2p_host_t *h);
/* As ap__p2p_host_free, then calls done(arg) once h is freed. */
void ap__p2p_host_free_then(ap_p2p_host_t *h, void (*done)(void *arg), void *arg);
/* Serves an accepted TCP socket as the listening side of a libp2p
 * connection; pre holds the n bytes already read from it (the start of
 * "/multistream/1.0.0"). h owns sock from here on, also on error. */
int ap__p2p_host_adopt(ap_p2p_host_t *h, uv_os_sock_t sock, const uint8_t *pre, size_t n);
const ap_identity_t *ap__p2p_host_identity(const ap_p2p_host_t *h);

/* Dials ma (ip4/ip6 + tcp; a /p2p/ part is the PeerID the remote must
 * prove, else AP_EAUTH). */
int ap__p2p_dial(ap_p2p_host_t *h, const ap_multiaddr_t *ma, const ap_p2p_conn_cbs_t *cbs,
                 void *arg, ap_p2p_conn_t **out);
void ap__p2p_conn_close(ap_p2p_conn_t *c);
/* The address c's TCP connection comes from (ip4/ip6 + tcp), its host, and
 * the host's loop. */
const ap_multiaddr_t *ap__p2p_conn_remote(const ap_p2p_conn_t *c);
ap_p2p_host_t *ap__p2p_conn_host(const ap_p2p_conn_t *c);
uv_loop_t *ap__p2p_host_loop(const ap_p2p_host_t *h);
const ap_peer_id_t *ap__p2p_conn_peer(const ap_p2p_conn_t *c);
/* The muxer in use ("/yamux/1.0.0") and whether it was agreed in the
 * handshake. */
const char *ap__p2p_conn_muxer(const ap_p2p_conn_t *c, bool *early);

/* Opens a stream speaking proto (negotiated; proto->on_close with
 * AP_ENOPROTO if the peer answers "na"). */
int ap__p2p_stream_open(ap_p2p_conn_t *c, const ap_p2p_proto_t *proto, void *udata,
                        ap_p2p_stream_t **out);
/* Queues bytes (the stream must be open: after on_open). */
int ap__p2p_stream_write(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
int ap__p2p_stream_close(ap_p2p_stream_t *s); /* half-close */
void ap__p2p_stream_reset(ap_p2p_stream_t *s);
void *ap__p2p_stream_udata(const ap_p2p_stream_t *s);
void ap__p2p_stream_set_udata(ap_p2p_stream_t *s, void *udata);
ap_p2p_conn_t *ap__p2p_stream_conn(const ap_p2p_stream_t *s);
/* The protocol the stream speaks (the one passed to open or served). */
const ap_p2p_proto_t *ap__p2p_stream_proto(const ap_p2p_stream_t *s);

#endif
