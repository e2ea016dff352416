/* DCUtR on a libp2p host (libuv): hole punching after a relayed
 * connection. Internal.
 *
 * ap__dcutr_serve makes a host answer "/libp2p/dcutr" (the A side: the
 * peer that dialled through the relay) and ap__dcutr_start runs the B side
 * (the peer reached through its relay) on a relayed connection:
 *   B: CONNECT with its addresses, A: CONNECT with its own, B: SYNC;
 *   A dials B's addresses as soon as SYNC arrives, B dials A's after half
 *   the round trip it measured, both from their listen port (a socket with
 *   SO_REUSEADDR/SO_REUSEPORT bound to it, then handed to libuv), so the
 *   SYNs cross in the NATs. A is the client of the connection this makes
 *   (multistream-select and Noise initiator), B the server, whoever's SYN
 *   got through first. Within an attempt, a dial refused (a NAT answering
 *   RST: our SYN arrived before the peer's own SYN opened its mapping) is
 *   made again at once, up to 32 dials per address, and a SYN unanswered
 *   for 200 ms (a NAT dropping it) is replaced by a fresh one from the
 *   same port; a direct
 *   connection the listener accepted from the peer also counts. An
 *   attempt lasts attempt_ms; B tries up to attempts times.
 * On success (either side) the pending dials are closed, new streams find
 * the direct connection first (ap__p2p_host_find), and the relayed one is
 * closed after grace_ms. On failure the relayed connection stays.
 *
 * Addresses sent: the host's (ap__p2p_host_addrs) that are not circuits;
 * addresses received: at most AP_DCUTR_DIAL_MAX ip4/ip6 + tcp ones are
 * dialled. A malformed message resets the stream with one log line naming
 * the peer; a peer sends at most one CONNECT and one SYNC per stream. */
#ifndef AP_P2P_DCUTR_UV_H
#define AP_P2P_DCUTR_UV_H

#include "p2p/dcutr.h"
#include "p2p/p2p_conn.h"

#define AP_DCUTR_DIAL_MAX 4

typedef struct ap_dcutr ap_dcutr_t;

typedef struct ap_dcutr_opts {
    uint16_t port;       /* the listen port dials leave from (0: ephemeral) */
    uint64_t attempt_ms; /* 3000 */
    uint64_t grace_ms;   /* 2000: the relayed connection closes after it */
    int attempts;        /* 3 (B side) */
    /* The addresses sent in CONNECT (NULL: the host's, ap__p2p_host_addrs);
     * circuits among them are left out. */
    ap_p2p_addrs_fn addrs;
    void *addrs_arg;
} ap_dcutr_opts_t;

/* One result per punch, on either side: status 0 and the direct
 * connection (the punch no longer holds its callbacks: the receiver may
 * take it over with ap__p2p_conn_set_cbs), or a negative AP_E* code (AP_ETIMEDOUT: no attempt got
 * through); attempts used; ms from the start (B: ap__dcutr_start; A: the
 * first CONNECT) to the direct connection. */
typedef void (*ap_dcutr_result_fn)(void *arg, const ap_peer_id_t *peer, bool b_side, int status,
                                   int attempts, double ms, ap_p2p_conn_t *direct);

/* Serves DCUtR on h (before it accepts connections); o NULL: defaults.
 * Free it after h is freed (the loop must run once more). */
ap_dcutr_t *ap__dcutr_serve(ap_p2p_host_t *h, const ap_dcutr_opts_t *o, ap_dcutr_result_fn cb,
                            void *arg);
void ap__dcutr_free(ap_dcutr_t *d);
/* Starts the B side on relayed (a relayed connection that reached us). */
int ap__dcutr_start(ap_dcutr_t *d, ap_p2p_conn_t *relayed);

typedef struct ap_dcutr_stats {
    unsigned started, direct, failed, refused_dials, bad;
    unsigned redials; /* dials made at once after a refusal */
} ap_dcutr_stats_t;
ap_dcutr_stats_t ap__dcutr_stats(const ap_dcutr_t *d);

#endif
