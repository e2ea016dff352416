/* AutoNAT v1 ("/libp2p/autonat/1.0.0"): message codec and the server's
 * dial-back policy. Internal, sans-I/O.
 *
 * A client that wants to know whether it is reachable opens a stream to a
 * server and sends DIAL with its PeerID and candidate addresses; the server
 * dials the client back on a fresh connection and answers DIAL_RESPONSE:
 * OK (with the address that worked), E_DIAL_ERROR (nothing answered),
 * E_DIAL_REFUSED (the server would not try), E_BAD_REQUEST. Each message is
 * a protobuf (proto/autonat.proto) behind a multiformats-varint length.
 *
 * Decoding is bounded: a message is at most AP_AUTONAT_MSG_MAX bytes, it
 * carries at most AP_AUTONAT_ADDRS_MAX addresses (more: AP_ELIMIT) and a
 * status text of at most AP_AUTONAT_TEXT_MAX bytes (longer: AP_ELIMIT); an
 * address Apiary cannot represent is counted in addrs_other.
 *
 * Server policy (ap__autonat_srv_check), so that a server cannot be used to
 * make connections to third parties:
 * - a request that arrived over a relayed connection is refused;
 * - the PeerID in the request, when present, must be the requester's;
 * - only addresses whose IP is the one the request came from, with a TCP
 *   port, are dialled (at most AP_AUTONAT_DIAL_MAX); none left: refused;
 * - at most AP_AUTONAT_PEER_RATE requests per peer and AP_AUTONAT_GLOBAL_RATE
 *   in all per AP_AUTONAT_WINDOW_US; over either: refused. */
#ifndef AP_P2P_AUTONAT_H
#define AP_P2P_AUTONAT_H

#include "apiary/multiaddr.h"
#include "apiary/peer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_AUTONAT_PROTO       "/libp2p/autonat/1.0.0"
#define AP_AUTONAT_MSG_MAX     4096
#define AP_AUTONAT_ADDRS_MAX   16
#define AP_AUTONAT_TEXT_MAX    128
#define AP_AUTONAT_DIAL_MAX    4
#define AP_AUTONAT_PEER_RATE   3
#define AP_AUTONAT_GLOBAL_RATE 30
#define AP_AUTONAT_WINDOW_US   60000000ull
#define AP_AUTONAT_TRACKED     64 /* requesters remembered for the rate limit */

typedef enum ap_autonat_type {
    AP_AUTONAT_DIAL = 0,
    AP_AUTONAT_DIAL_RESPONSE = 1,
} ap_autonat_type_t;

typedef enum ap_autonat_status {
    AP_AUTONAT_OK = 0,
    AP_AUTONAT_E_DIAL_ERROR = 100,
    AP_AUTONAT_E_DIAL_REFUSED = 101,
    AP_AUTONAT_E_BAD_REQUEST = 200,
    AP_AUTONAT_E_INTERNAL = 300,
} ap_autonat_status_t;

typedef struct ap_autonat_msg {
    int type; /* ap_autonat_type_t; -1 when absent */
    /* DIAL */
    bool has_dial;
    bool has_id;   /* an Ed25519 PeerID in the request */
    bool id_other; /* an id of another form (not an Ed25519 PeerID) */
    ap_peer_id_t id;
    ap_multiaddr_t addrs[AP_AUTONAT_ADDRS_MAX];
    size_t naddrs;
    size_t addrs_other;
    /* DIAL_RESPONSE */
    bool has_response;
    int status; /* ap_autonat_status_t or a value this version does not know */
    char text[AP_AUTONAT_TEXT_MAX + 1];
    bool has_addr;
    ap_multiaddr_t addr;
} ap_autonat_msg_t;

/* Encodes DIAL (id and n <= AP_AUTONAT_ADDRS_MAX addresses) with its length
 * prefix. Returns the length or AP_EMSGSIZE / AP_EINVAL. */
int ap__autonat_encode_dial(const ap_peer_id_t *id, const ap_multiaddr_t *addrs, size_t n,
                            uint8_t *out, size_t cap);
/* Encodes DIAL_RESPONSE (text and addr may be NULL) with its length prefix. */
int ap__autonat_encode_response(int status, const char *text, const ap_multiaddr_t *addr,
                                uint8_t *out, size_t cap);
/* Decodes one message body (untrusted). AP_ECORRUPT (not a message, a text
 * with NUL), AP_EMSGSIZE, AP_ELIMIT. */
int ap__autonat_decode(const uint8_t *msg, size_t len, ap_autonat_msg_t *out);
/* The length prefix in in[0..len): 1 and *body_len; 0 when more bytes are
 * needed; AP_EMSGSIZE (over AP_AUTONAT_MSG_MAX) / AP_ECORRUPT. */
int ap__autonat_frame(const uint8_t *in, size_t len, size_t *hdr_len, size_t *body_len);

const char *ap__autonat_status_name(int status);

/* ---- the server's policy ------------------------------------------------------ */

typedef struct ap_autonat_srv {
    struct {
        ap_peer_id_t peer;
        uint64_t t[AP_AUTONAT_PEER_RATE]; /* times of its recent requests */
        bool used;
    } tracked[AP_AUTONAT_TRACKED];
    uint64_t global[AP_AUTONAT_GLOBAL_RATE];
    size_t global_at;
} ap_autonat_srv_t;

void ap__autonat_srv_init(ap_autonat_srv_t *s);

/* Decides on a DIAL request from peer `from`, received at now_us over a
 * connection whose remote address is `remote` (relayed: over a circuit).
 * Returns AP_AUTONAT_OK with the addresses to dial in dial[0..*ndial), or
 * the refusal's status with the reason in why (n bytes). A request that is
 * answered counts toward the rate limits, also when refused for its
 * addresses. */
int ap__autonat_srv_check(ap_autonat_srv_t *s, const ap_autonat_msg_t *req,
                          const ap_peer_id_t *from, const ap_multiaddr_t *remote, bool relayed,
                          uint64_t now_us, ap_multiaddr_t dial[AP_AUTONAT_DIAL_MAX], size_t *ndial,
                          char *why, size_t n);

#endif
