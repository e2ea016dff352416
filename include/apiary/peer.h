/* Apiary — peer identities.
 *
 * A peer is named by its PeerID, in libp2p's encoding: the identity multihash
 * of the protobuf-encoded Ed25519 public key
 *     0x00 0x24 | 0x08 0x01 0x12 0x20 | pk[32]         (38 bytes)
 * printed in base58btc ("12D3KooW..."). The public key can be read back out of
 * the PeerID, so a signature by a peer can be checked from its id alone. */
#ifndef APIARY_PEER_H
#define APIARY_PEER_H

#include "apiary/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_PEER_ID_LEN     38 /* bytes of an Ed25519 identity multihash */
#define AP_PEER_ID_STR_MAX 64 /* base58 text incl. NUL (52 chars used) */
#define AP_PEER_SHORT_LEN  12 /* "…" + last 8 chars + NUL, for logs */
#define AP_ED25519_PK_LEN  32
#define AP_ED25519_SK_LEN  64
#define AP_ED25519_SIG_LEN 64

typedef struct ap_peer_id {
    uint8_t b[AP_PEER_ID_LEN];
} ap_peer_id_t;

/* Builds the PeerID of an Ed25519 public key. */
AP_EXPORT void ap_peer_id_from_ed25519(ap_peer_id_t *out, const uint8_t pk[AP_ED25519_PK_LEN]);
/* Extracts the Ed25519 public key. AP_EINVAL if the bytes are not an
 * Ed25519 identity multihash. */
AP_EXPORT int ap_peer_id_pubkey(const ap_peer_id_t *id, uint8_t pk[AP_ED25519_PK_LEN]);
/* Validates raw bytes (e.g. from the wire) and copies them into *out. */
AP_EXPORT int ap_peer_id_from_bytes(ap_peer_id_t *out, const uint8_t *b, size_t len);
/* base58 text form; buf must hold AP_PEER_ID_STR_MAX bytes. Returns buf. */
AP_EXPORT char *ap_peer_id_str(const ap_peer_id_t *id, char buf[AP_PEER_ID_STR_MAX]);
/* Short form for log lines: the last 8 base58 characters. Returns buf. */
AP_EXPORT char *ap_peer_id_short(const ap_peer_id_t *id, char buf[AP_PEER_SHORT_LEN]);
/* Parses the base58 text form. AP_EINVAL on bad characters or a non-Ed25519
 * identity. */
AP_EXPORT int ap_peer_id_parse(ap_peer_id_t *out, const char *text);
AP_EXPORT bool ap_peer_id_eq(const ap_peer_id_t *a, const ap_peer_id_t *b);
AP_EXPORT int ap_peer_id_cmp(const ap_peer_id_t *a, const ap_peer_id_t *b);
/* A well-mixed 64-bit hash of the id, for hash tables. */
AP_EXPORT uint64_t ap_peer_id_hash(const ap_peer_id_t *id);

/* Verifies an Ed25519 signature by the peer named by id. 0 if valid, AP_EAUTH
 * otherwise. */
AP_EXPORT AP_NODISCARD int ap_peer_verify(const ap_peer_id_t *id, const uint8_t *msg, size_t len,
                                          const uint8_t sig[AP_ED25519_SIG_LEN]);

#ifdef __cplusplus
}
#endif
#endif
