/* Circuit relay v2 ("/libp2p/circuit/relay/0.2.0/hop" and ".../stop"):
 * message codec and the relay's bookkeeping of reservations and circuits.
 * Internal, sans-I/O.
 *
 * A peer behind a NAT RESERVEs a slot on a public relay (hop protocol);
 * the relay answers STATUS OK with the reservation's expiry and its own
 * addresses. Another peer asks the relay to CONNECT it to the reserved
 * peer; the relay opens a stop stream to the reserved peer with CONNECT,
 * and after both answered OK it copies bytes between the two streams,
 * within the circuit's limit (duration and bytes). Each message is a
 * protobuf (proto/relay.proto) behind a multiformats-varint length.
 *
 * Decoding is bounded: at most AP_RELAY_MSG_MAX bytes, AP_RELAY_ADDRS_MAX
 * addresses per list (more: AP_ELIMIT), a voucher of at most
 * AP_RELAY_VOUCHER_MAX bytes (kept as a length only); addresses Apiary
 * cannot represent are counted in addrs_other.
 *
 * The relay's limits (ap_relay_limits_t, defaults from
 * ap__relay_limits_default, sized for training's control traffic: DHT,
 * matchmaking, progress and DCUtR, not bulk transfers):
 * - reservations: at most max_reservations in all and reservations_per_ip
 *   per IP; a peer refreshing its reservation keeps its slot; a peer
 *   reserving more often than reserve_rate per minute is refused;
 * - circuits: at most max_circuits in all and circuits_per_peer per peer
 *   (as either end); only to a peer with a live reservation;
 * - each circuit: circuit_duration_us and circuit_bytes (both directions
 *   together); ap__relay_account returns AP_ELIMIT once either is
 *   exceeded and the caller resets both streams. */
#ifndef AP_P2P_RELAY_H
#define AP_P2P_RELAY_H

#include "apiary/multiaddr.h"
#include "apiary/peer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_RELAY_HOP_PROTO   "/libp2p/circuit/relay/0.2.0/hop"
#define AP_RELAY_STOP_PROTO  "/libp2p/circuit/relay/0.2.0/stop"
#define AP_RELAY_MSG_MAX     4096
#define AP_RELAY_ADDRS_MAX   16
#define AP_RELAY_VOUCHER_MAX 1024
#define AP_RELAY_TABLE_MAX   1024 /* hard cap on reservations and circuits tracked */

enum { AP_RELAY_HOP_RESERVE = 0, AP_RELAY_HOP_CONNECT = 1, AP_RELAY_HOP_STATUS = 2 };
enum { AP_RELAY_STOP_CONNECT = 0, AP_RELAY_STOP_STATUS = 1 };

typedef enum ap_relay_status {
    AP_RELAY_UNUSED = 0,
    AP_RELAY_OK = 100,
    AP_RELAY_RESERVATION_REFUSED = 200,
    AP_RELAY_RESOURCE_LIMIT_EXCEEDED = 201,
    AP_RELAY_PERMISSION_DENIED = 202,
    AP_RELAY_CONNECTION_FAILED = 203,
    AP_RELAY_NO_RESERVATION = 204,
    AP_RELAY_MALFORMED_MESSAGE = 400,
    AP_RELAY_UNEXPECTED_MESSAGE = 401,
} ap_relay_status_t;

typedef struct ap_relay_msg {
    bool stop; /* a StopMessage (else a HopMessage) */
    int type;
    bool has_peer;
    bool peer_other; /* an id that is not an Ed25519 PeerID */
    ap_peer_id_t peer;
    ap_multiaddr_t addrs[AP_RELAY_ADDRS_MAX];
    size_t naddrs, addrs_other;
    bool has_reservation; /* hop only */
    uint64_t expire;      /* Unix seconds */
    ap_multiaddr_t raddrs[AP_RELAY_ADDRS_MAX];
    size_t nraddrs, raddrs_other;
    size_t voucher_len;
    bool has_limit;
    bool has_duration, has_data;
    uint32_t duration; /* seconds */
    uint64_t data;     /* bytes */
    bool has_status;
    int status; /* ap_relay_status_t or a value this version does not know */
} ap_relay_msg_t;

/* Encodes m (a HopMessage or StopMessage by m->stop) with its length
 * prefix. Returns the length, AP_EMSGSIZE or AP_EINVAL (too many
 * addresses). */
int ap__relay_encode(const ap_relay_msg_t *m, uint8_t *out, size_t cap);
/* Decodes one message body (untrusted) as a StopMessage if stop, else a
 * HopMessage. AP_ECORRUPT, AP_EMSGSIZE, AP_ELIMIT. */
int ap__relay_decode(bool stop, const uint8_t *msg, size_t len, ap_relay_msg_t *out);
/* The length prefix: 1 and *body_len; 0 when more bytes are needed;
 * AP_EMSGSIZE / AP_ECORRUPT. */
int ap__relay_frame(const uint8_t *in, size_t len, size_t *hdr_len, size_t *body_len);
const char *ap__relay_status_name(int status);

/* Reads one length-prefixed message from a stream's bytes. */
typedef struct ap_relay_rd {
    uint8_t buf[AP_RELAY_MSG_MAX + 16];
    size_t len;
} ap_relay_rd_t;
/* Takes bytes of p (n of them) until one message is complete: returns 1
 * with it decoded into *m (a StopMessage if stop) and *used the bytes of p
 * it took (the rest follows the message); 0 when all of p was taken and
 * more is needed; a negative AP_E* code on a malformed or oversized
 * message. */
int ap__relay_rd_feed(ap_relay_rd_t *r, bool stop, const uint8_t *p, size_t n, ap_relay_msg_t *m,
                      size_t *used);

/* ---- the relay's bookkeeping --------------------------------------------------- */

typedef struct ap_relay_limits {
    uint32_t max_reservations;    /* 128 */
    uint32_t reservations_per_ip; /* 8 */
    uint32_t reserve_rate;        /* reservations per peer per minute: 4 */
    uint32_t max_circuits;        /* 256 */
    uint32_t circuits_per_peer;   /* 16 */
    uint64_t reservation_ttl_us;  /* 1 h */
    uint64_t circuit_duration_us; /* 10 min */
    uint64_t circuit_bytes;       /* 4 MiB */
} ap_relay_limits_t;

void ap__relay_limits_default(ap_relay_limits_t *l);

typedef struct ap_relay_resv {
    ap_peer_id_t peer;
    uint8_t ip[16];
    uint64_t expire_us;
    uint64_t recent[4]; /* times of its latest reservations (rate limit) */
} ap_relay_resv_t;

typedef struct ap_relay_circ {
    uint64_t id; /* 0: free */
    ap_peer_id_t src, dst;
    uint64_t start_us, bytes;
} ap_relay_circ_t;

typedef struct ap_relay {
    ap_relay_limits_t lim;
    ap_relay_resv_t *resv;
    size_t nresv, resv_cap;
    ap_relay_circ_t *circ;
    size_t ncirc, circ_cap;
    uint64_t next_id;
} ap_relay_t;

/* AP_EINVAL when a limit is 0 or over AP_RELAY_TABLE_MAX; AP_ENOMEM. */
int ap__relay_init(ap_relay_t *r, const ap_relay_limits_t *lim);
void ap__relay_free(ap_relay_t *r);

/* A RESERVE from peer at ip (remote: its connection's address). Returns
 * AP_RELAY_OK with *expire_us, or the refusal (RESERVATION_REFUSED,
 * RESOURCE_LIMIT_EXCEEDED) with the reason in why. */
int ap__relay_reserve(ap_relay_t *r, const ap_peer_id_t *peer, const ap_multiaddr_t *remote,
                      uint64_t now_us, uint64_t *expire_us, char *why, size_t wn);
/* Whether dst holds a live reservation. */
bool ap__relay_reserved(const ap_relay_t *r, const ap_peer_id_t *dst, uint64_t now_us);
/* A CONNECT from src to dst: AP_RELAY_OK with a circuit id, or
 * NO_RESERVATION / RESOURCE_LIMIT_EXCEEDED / PERMISSION_DENIED. */
int ap__relay_connect(ap_relay_t *r, const ap_peer_id_t *src, const ap_peer_id_t *dst,
                      uint64_t now_us, uint64_t *id, char *why, size_t wn);
/* Counts n bytes through circuit id; 0, or AP_ELIMIT once the circuit is
 * over its bytes or duration (the caller resets it), AP_ENOTFOUND. */
int ap__relay_account(ap_relay_t *r, uint64_t id, uint64_t n, uint64_t now_us);
void ap__relay_circuit_end(ap_relay_t *r, uint64_t id);
/* Drops the reservations of the peers for which gone(arg, peer) is true (a
 * reservation ends with its holder's connection); returns how many. */
size_t ap__relay_drop_if(ap_relay_t *r, bool (*gone)(void *arg, const ap_peer_id_t *peer),
                         void *arg);
size_t ap__relay_circuits(const ap_relay_t *r);

#endif
