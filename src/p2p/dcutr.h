/* DCUtR, Direct Connection Upgrade through Relay ("/libp2p/dcutr"):
 * message codec. Internal, sans-I/O.
 *
 * After a relayed connection from A to B, B opens a dcutr stream and sends
 * CONNECT with its addresses; A answers CONNECT with its own; B measures
 * the round trip, sends SYNC and dials A after half of it; A dials B as
 * soon as SYNC arrives. Both dial from their listen port, so the two SYNs
 * cross in the NATs (TCP simultaneous open); on the connection this makes,
 * A is the client (multistream-select and Noise initiator) and B the
 * server. Each message is a HolePunch protobuf (proto/dcutr.proto) behind
 * a multiformats-varint length.
 *
 * Decoding is bounded: at most AP_DCUTR_MSG_MAX bytes, AP_DCUTR_ADDRS_MAX
 * addresses (more: AP_ELIMIT); an unknown type is AP_EPROTO; addresses
 * Apiary cannot represent are counted in addrs_other. */
#ifndef AP_P2P_DCUTR_H
#define AP_P2P_DCUTR_H

#include "apiary/multiaddr.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_DCUTR_PROTO     "/libp2p/dcutr"
#define AP_DCUTR_MSG_MAX   4096
#define AP_DCUTR_ADDRS_MAX 16

enum { AP_DCUTR_CONNECT = 100, AP_DCUTR_SYNC = 300 };

typedef struct ap_dcutr_msg {
    int type;
    ap_multiaddr_t addrs[AP_DCUTR_ADDRS_MAX];
    size_t naddrs, addrs_other;
} ap_dcutr_msg_t;

/* Encodes m with its length prefix. Returns the length, AP_EMSGSIZE, or
 * AP_EINVAL (too many addresses, or a type that is not CONNECT/SYNC). */
int ap__dcutr_encode(const ap_dcutr_msg_t *m, uint8_t *out, size_t cap);
/* Decodes one message body (untrusted). AP_ECORRUPT, AP_EMSGSIZE, AP_ELIMIT,
 * AP_EPROTO. */
int ap__dcutr_decode(const uint8_t *msg, size_t len, ap_dcutr_msg_t *out);

/* Reads one length-prefixed message from a stream's bytes, as
 * ap__relay_rd_feed (relay.h): 1 with *m and *used, 0 for more, < 0. */
typedef struct ap_dcutr_rd {
    uint8_t buf[AP_DCUTR_MSG_MAX + 16];
    size_t len;
} ap_dcutr_rd_t;
int ap__dcutr_rd_feed(ap_dcutr_rd_t *r, const uint8_t *p, size_t n, ap_dcutr_msg_t *m,
                      size_t *used);

#endif
