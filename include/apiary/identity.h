/* Apiary — node identity: an Ed25519 key pair and its key file.
 *
 * A node is its Ed25519 key. The PeerID (apiary/peer.h) is derived from the
 * public half, so whoever holds the key file IS that peer: the file is
 * created with mode 0600 and a file that group or others may read is
 * refused.
 *
 * FILE FORMAT. The file holds exactly the 68 bytes of libp2p's protobuf
 * PrivateKey message for an Ed25519 key:
 *     0x08 0x01            field 1 (KeyType) = 1 (Ed25519)
 *     0x12 0x40            field 2 (Data), 64 bytes:
 *     seed[32] || pk[32]   the libsodium secret key (seed, then public key)
 * This is the format go-libp2p and rust-libp2p write (crypto.MarshalPrivateKey),
 * so a key can move between Apiary and libp2p tools, and it is one fixed
 * size, so the parser is a length check and two memcmp. Parsing is strict:
 * any other size, key type, field layout, or a public key that does not match
 * the seed is AP_ECORRUPT. See docs/transport.md.
 *
 * THREADING. All functions are reentrant; none keeps state. */
#ifndef APIARY_IDENTITY_H
#define APIARY_IDENTITY_H

#include "apiary/common.h"
#include "apiary/peer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_IDENTITY_SEED_LEN 32
#define AP_IDENTITY_FILE_LEN 68 /* bytes of the key file */

/* A key pair. sk is libsodium's Ed25519 secret key (seed || pk). Plain
 * value type: copy it freely, wipe it with ap_identity_wipe when done. */
typedef struct ap_identity {
    uint8_t sk[AP_ED25519_SK_LEN];
    uint8_t pk[AP_ED25519_PK_LEN];
    ap_peer_id_t id;
} ap_identity_t;

/* A fresh random key pair (OS randomness). AP_ESYS if libsodium cannot start. */
AP_EXPORT int ap_identity_generate(ap_identity_t *out);
/* The key pair of a 32-byte seed (deterministic; for tests and simulations). */
AP_EXPORT int ap_identity_from_seed(ap_identity_t *out, const uint8_t seed[AP_IDENTITY_SEED_LEN]);

/* Encodes the 68-byte file form into out. */
AP_EXPORT void ap_identity_encode(const ap_identity_t *id, uint8_t out[AP_IDENTITY_FILE_LEN]);
/* Strictly decodes the file form (exactly AP_IDENTITY_FILE_LEN bytes).
 * AP_ECORRUPT on anything else; *out is untouched then. */
AP_EXPORT AP_NODISCARD int ap_identity_decode(ap_identity_t *out, const uint8_t *data, size_t len);

/* Loads a key file. Errors (each also logs one line naming the path):
 *   AP_ENOTFOUND  the file does not exist
 *   AP_EPERM      group or others may read or write it (chmod 600 fixes it),
 *                 or it is not a regular file
 *   AP_ECORRUPT   wrong size or content
 *   AP_EIO        read error */
AP_EXPORT int ap_identity_load(ap_identity_t *out, const char *path);

/* Writes id to path atomically with mode 0600: a temporary file in the same
 * directory is written, fsync'ed and then linked into place. Never replaces
 * an existing file (AP_EEXIST). */
AP_EXPORT int ap_identity_save(const ap_identity_t *id, const char *path);

/* The `--identity PATH` behaviour: loads path, or, if it does not exist,
 * generates a key and saves it there. *created (may be NULL) tells which.
 * If two processes race to create the file, both end up with the same key
 * (the loser of the race loads the winner's file). */
AP_EXPORT int ap_identity_load_or_create(ap_identity_t *out, const char *path, bool *created);
/* After a failed ap_identity_load, _save or _load_or_create on this thread:
 * one sentence naming the file and the cause ("... is accessible by group or
 * others (mode 0644) ...", "cannot open ...: No such file or directory"), for
 * the caller's error message. "" when the last call gave no detail. */
AP_EXPORT const char *ap_identity_last_error(void);

/* Overwrites the secret key with zeros. */
AP_EXPORT void ap_identity_wipe(ap_identity_t *id);

#ifdef __cplusplus
}
#endif
#endif
