/* identify ("/ipfs/id/1.0.0", push "/ipfs/id/push/1.0.0") and ping
 * ("/ipfs/ping/1.0.0") message codecs. Internal, sans-I/O.
 *
 * identify: the responder writes one Identify protobuf (proto/libp2p.proto)
 * with a multiformats-varint length prefix and closes the stream. Fields:
 * protocolVersion, agentVersion, publicKey (a libp2p PublicKey), listenAddrs
 * and observedAddr (binary multiaddrs), protocols, signedPeerRecord (kept
 * opaque). Decoding is bounded: the message is at most AP_IDENTIFY_MSG_MAX
 * bytes, strings at most AP_IDENTIFY_STR_MAX, at most AP_IDENTIFY_ADDRS_MAX
 * addresses and AP_IDENTIFY_PROTOS_MAX protocols (the rest: AP_ELIMIT); a
 * listen address Apiary cannot represent (QUIC, WebSocket, ...) is counted
 * in addrs_other, not an error. A public key of another type than Ed25519
 * is reported (key_type) and leaves has_id false.
 *
 * ping: the dialer sends 32 random bytes, the responder echoes them; both
 * repeat on the same stream. */
#ifndef AP_P2P_IDENTIFY_H
#define AP_P2P_IDENTIFY_H

#include "apiary/multiaddr.h"
#include "apiary/peer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_IDENTIFY_PROTO      "/ipfs/id/1.0.0"
#define AP_IDENTIFY_PUSH_PROTO "/ipfs/id/push/1.0.0"
#define AP_PING_PROTO          "/ipfs/ping/1.0.0"
#define AP_PING_LEN            32

#define AP_IDENTIFY_MSG_MAX    8192 /* bytes of one Identify message */
#define AP_IDENTIFY_STR_MAX    256  /* protocolVersion, agentVersion, a protocol id */
#define AP_IDENTIFY_ADDRS_MAX  32
#define AP_IDENTIFY_PROTOS_MAX 128

typedef struct ap_identify {
    char protocol_version[AP_IDENTIFY_STR_MAX + 1];
    char agent_version[AP_IDENTIFY_STR_MAX + 1];
    bool has_key;
    int key_type; /* libp2p KeyType, valid if has_key */
    bool has_id;  /* an Ed25519 key: id is its PeerID */
    ap_peer_id_t id;
    ap_multiaddr_t listen[AP_IDENTIFY_ADDRS_MAX];
    size_t nlisten;
    size_t addrs_other; /* listen addresses of transports Apiary does not speak */
    bool has_observed;
    ap_multiaddr_t observed;
    const char *protocols[AP_IDENTIFY_PROTOS_MAX]; /* point into text */
    size_t nprotocols;
    size_t signed_record_len;       /* 0 = none (the record itself is not kept) */
    char text[AP_IDENTIFY_MSG_MAX]; /* the protocol ids, NUL-terminated */
} ap_identify_t;

/* Encodes id (the PublicKey comes from pk, an Ed25519 key; observed may be
 * NULL) as a length-prefixed message into out. Returns the length or
 * AP_EMSGSIZE. */
int ap__identify_encode(const ap_identify_t *id, const uint8_t pk[AP_ED25519_PK_LEN], uint8_t *out,
                        size_t cap);

/* Decodes one Identify message body (no length prefix; untrusted).
 * AP_ECORRUPT (not a valid message or a string with NUL), AP_EMSGSIZE (over
 * AP_IDENTIFY_MSG_MAX), AP_ELIMIT (too many or too long fields). */
int ap__identify_decode(const uint8_t *msg, size_t len, ap_identify_t *out);

/* The length prefix of a message in in[0..len): 1 and *body_len, 0 when more
 * bytes are needed, AP_EMSGSIZE / AP_ECORRUPT. *hdr_len: prefix bytes. */
int ap__identify_frame(const uint8_t *in, size_t len, size_t *hdr_len, size_t *body_len);

#endif
