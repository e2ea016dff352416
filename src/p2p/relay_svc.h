/* Circuit relay v2 on a libp2p host (libuv): the relay service, and the
 * client side (reservations, dialling through a relay, accepting relayed
 * connections). Internal.
 *
 * Service (ap__relay_serve): answers "/libp2p/circuit/relay/0.2.0/hop".
 * RESERVE and CONNECT are checked by ap_relay_t (relay.h) with the limits
 * given; a request that came over a relayed connection is refused. For an
 * accepted CONNECT the relay opens ".../stop" on its direct connection to
 * the reserved peer, and once that peer answers OK it answers the dialler
 * OK and copies bytes between the two streams. Every byte is counted: a
 * circuit over its data or duration limit is reset on both sides (also a
 * circuit whose peer does not read: a stream queue that would pass its cap
 * resets the circuit). Each refusal is answered and logged in one line
 * naming the peer.
 *
 * Client (ap__relay_client_new): keeps a reservation on each relay given
 * (dialled, then RESERVE; refreshed at 3/4 of its lifetime; redialled after
 * a failure), serves ".../stop" for those relays (a STOP CONNECT from any
 * other peer is refused), and runs the normal libp2p upgrade over every
 * accepted circuit as the listening side (p2p_conn.h, ap__p2p_conn_over).
 * ap__relay_client_addrs gives the circuit addresses to announce
 * ("/ip4/R/tcp/P/p2p/RELAY/p2p-circuit").
 *
 * Dialling (ap__circuit_dial): "/.../p2p/RELAY/p2p-circuit/p2p/PEER" reuses
 * a direct connection to the relay or dials it, sends CONNECT and, on OK,
 * upgrades the stream as the dialling side, expecting PEER.
 *
 * Everything runs on the host's loop thread. */
#ifndef AP_P2P_RELAY_SVC_H
#define AP_P2P_RELAY_SVC_H

#include "p2p/p2p_conn.h"
#include "p2p/relay.h"

typedef struct ap_relay_service ap_relay_service_t;

typedef struct ap_relay_svc_stats {
    unsigned reserved, resv_refused; /* RESERVE answered OK / refused */
    unsigned circuits, circ_refused; /* CONNECT answered OK / refused or failed */
    unsigned circ_reset;             /* circuits reset over a limit */
    uint64_t bytes;                  /* bytes copied through circuits */
} ap_relay_svc_stats_t;

/* Serves the hop protocol on h (before h accepts connections); lim NULL:
 * the defaults. The service lives as long as h: free it after h (the loop
 * must run once more for its timer). */
ap_relay_service_t *ap__relay_serve(ap_p2p_host_t *h, const ap_relay_limits_t *lim);
void ap__relay_service_free(ap_relay_service_t *svc);
ap_relay_svc_stats_t ap__relay_service_stats(const ap_relay_service_t *svc);
size_t ap__relay_service_circuits(const ap_relay_service_t *svc);

typedef struct ap_relay_client ap_relay_client_t;

/* A relayed connection accepted through one of the client's relays is
 * ready (c is relayed; its peer is the dialler). */
typedef void (*ap_relay_inbound_fn)(void *arg, ap_p2p_conn_t *c);

/* Keeps reservations on relays[0..n) (each with /p2p/RELAY; copied; at most
 * AP_RELAY_CLIENT_MAX) and serves the stop protocol on h (before h accepts
 * connections). Free it after h (the loop must run once more). */
#define AP_RELAY_CLIENT_MAX 8
ap_relay_client_t *ap__relay_client_new(ap_p2p_host_t *h, const ap_multiaddr_t *relays, size_t n,
                                        ap_relay_inbound_fn on_inbound, void *arg);
void ap__relay_client_free(ap_relay_client_t *cl);
/* Writes the circuit addresses of the live reservations (at most max). */
int ap__relay_client_addrs(const ap_relay_client_t *cl, ap_multiaddr_t *out, int max);
/* The IPs (ip4/ip6, no port) our relays see us at, as identify on each
 * relay connection reported them (at most max, distinct). */
int ap__relay_client_observed(const ap_relay_client_t *cl, ap_multiaddr_t *out, int max);
/* Reservations obtained so far (refreshes included) and live now. */
unsigned ap__relay_client_reservations(const ap_relay_client_t *cl, unsigned *live);

/* Dials ma (a circuit address with the relay's address, /p2p/RELAY and
 * /p2p/PEER). cbs->on_ready runs with the relayed connection; cbs->on_close
 * runs once at the end, with c NULL when the circuit never opened (status:
 * AP_EUNREACH, or AP_EPERM/AP_ENOTFOUND/AP_ELIMIT for the relay's
 * refusals, AP_ETIMEDOUT). */
int ap__circuit_dial(ap_p2p_host_t *h, const ap_multiaddr_t *ma, const ap_p2p_conn_cbs_t *cbs,
                     void *arg);

#endif
