/* AutoNAT v1 and one-shot identify on a libp2p host (libuv). Internal.
 *
 * Server: ap__autonat_serve makes a host answer "/libp2p/autonat/1.0.0".
 * Each DIAL request is checked by ap__autonat_srv_check (autonat.h: only
 * the requester's own IP, never over a relay, rate-limited); the accepted
 * addresses are dialled one after the other, each on a fresh connection
 * that must prove the requester's PeerID within dial_timeout_ms. The first
 * that succeeds is answered OK with that address; none: E_DIAL_ERROR. A
 * refusal or a malformed request is answered and logged in one line naming
 * the peer.
 *
 * Client: ap__autonat_probe dials a server, sends DIAL with addrs and calls
 * cb once with the answer (or a negative AP_E* status: cannot reach the
 * server, timeout, malformed answer). ap__p2p_identify_peer dials a peer,
 * reads its identify message and calls cb once. Both close their
 * connection afterwards; cb runs on the loop thread. */
#ifndef AP_P2P_AUTONAT_UV_H
#define AP_P2P_AUTONAT_UV_H

#include "p2p/autonat.h"
#include "p2p/identify.h"
#include "p2p/p2p_conn.h"

typedef struct ap_autonat_service ap_autonat_service_t;

/* Serves AutoNAT on h (before h listens or adopts connections). The
 * service lives as long as h; ap__autonat_service_free after h is freed. */
ap_autonat_service_t *ap__autonat_serve(ap_p2p_host_t *h, uint64_t dial_timeout_ms);
void ap__autonat_service_free(ap_autonat_service_t *svc);
/* Requests answered so far, by status (OK, E_DIAL_ERROR, refused, bad). */
typedef struct ap_autonat_stats {
    unsigned ok, dial_error, refused, bad;
} ap_autonat_stats_t;
ap_autonat_stats_t ap__autonat_service_stats(const ap_autonat_service_t *svc);

/* status: an ap_autonat_status_t (>= 0) or a negative AP_E* code; addr is
 * the address the server reached (OK only), text its status text. */
typedef void (*ap_autonat_probe_cb)(void *arg, int status, const ap_multiaddr_t *addr,
                                    const char *text);
int ap__autonat_probe(ap_p2p_host_t *h, const ap_multiaddr_t *server, const ap_multiaddr_t *addrs,
                      size_t n, uint64_t timeout_ms, ap_autonat_probe_cb cb, void *arg);

/* status 0 and the peer's identify message, or a negative AP_E* code. */
typedef void (*ap_identify_cb)(void *arg, int status, const ap_identify_t *id);
int ap__p2p_identify_peer(ap_p2p_host_t *h, const ap_multiaddr_t *peer, uint64_t timeout_ms,
                          ap_identify_cb cb, void *arg);

#endif
