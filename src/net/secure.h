/* Authenticated Noise XX handshake: Noise (noise.h) plus the identity
 * payload that binds the Noise static key to an Ed25519 PeerID. Internal,
 * sans-I/O.
 *
 * Each side has a long-lived X25519 static key (one per transport, random)
 * and its Ed25519 identity. The payload (proto/noise.proto) carries the
 * Ed25519 public key and a signature over
 *     "noise-libp2p-static-key:" || static X25519 public key
 * so the receiver learns the sender's PeerID and that the PeerID's owner
 * controls the static key Noise authenticated. Message 1 (-> e) carries an
 * empty payload; the responder sends its identity in message 2, the
 * initiator in message 3.
 *
 * Wire: every handshake message travels with a 2-byte big-endian length
 * prefix (done by the transport, not here). */
#ifndef AP_NET_SECURE_H
#define AP_NET_SECURE_H

#include "apiary/identity.h"
#include "net/noise.h"

#define AP_SECURE_SIG_PREFIX  "noise-libp2p-static-key:"
#define AP_SECURE_PAYLOAD_MAX 1024 /* our payloads are ~110 bytes; refuse more */

/* Per-transport credentials: the identity, the X25519 static key and the
 * precomputed payload. Build once, share across connections (read-only). */
typedef struct ap_secure_creds {
    ap_identity_t id;
    uint8_t s_priv[AP_NOISE_DHLEN], s_pub[AP_NOISE_DHLEN];
    uint8_t payload[AP_SECURE_PAYLOAD_MAX];
    size_t payload_len;
    ap_noise_hash_t hash;
} ap_secure_creds_t;

/* Makes creds for id with a fresh random static key (s_priv NULL) or a given
 * one. hash: AP_NOISE_BLAKE2B for Apiary. */
int ap__secure_creds_init(ap_secure_creds_t *c, const ap_identity_t *id, ap_noise_hash_t hash,
                          const uint8_t *s_priv);
void ap__secure_creds_clear(ap_secure_creds_t *c);

typedef struct ap_secure_hs {
    ap_noise_hs_t noise;
    const ap_secure_creds_t *creds; /* borrowed; must outlive the handshake */
    bool has_expected;
    ap_peer_id_t expected;
    bool has_remote;
    ap_peer_id_t remote;
} ap_secure_hs_t;

/* expected: the PeerID the dialer wants (NULL = accept anyone; a responder
 * passes NULL). e_priv: fixed ephemeral key for tests, else NULL. */
int ap__secure_init(ap_secure_hs_t *hs, const ap_secure_creds_t *creds, bool initiator,
                    const ap_peer_id_t *expected, const uint8_t *e_priv);
/* Same, with a Noise prologue (mixed into the handshake hash: both sides must
 * use the same bytes or message 2 fails to decrypt). ap__secure_init uses an
 * empty one. */
int ap__secure_init_prologue(ap_secure_hs_t *hs, const ap_secure_creds_t *creds, bool initiator,
                             const ap_peer_id_t *expected, const uint8_t *e_priv,
                             const uint8_t *prologue, size_t prologue_len);

bool ap__secure_my_turn(const ap_secure_hs_t *hs);
bool ap__secure_done(const ap_secure_hs_t *hs);

/* Writes our next handshake message (no length prefix) into out, cap >=
 * AP_NOISE_MSG_MAX is always enough. */
int ap__secure_write(ap_secure_hs_t *hs, uint8_t *out, size_t cap, size_t *out_len);

/* Reads the peer's next message (untrusted). Errors:
 *   AP_ECORRUPT  malformed message or payload (bad protobuf, wrong key type)
 *   AP_EAUTH     Noise decryption failed, bad signature, or the peer is not
 *                the expected PeerID (ap__secure_remote tells who it was)
 *   AP_ESTATE    not the peer's turn / handshake already failed
 * After a failure hs->noise.step + 1 is the number (1..3) of the message
 * that failed, for the log line. */
int ap__secure_read(ap_secure_hs_t *hs, const uint8_t *msg, size_t len);

/* The authenticated remote PeerID, once known (NULL before). On an
 * expected-PeerID mismatch it is the id the peer proved. */
const ap_peer_id_t *ap__secure_remote(const ap_secure_hs_t *hs);

/* Transport keys after done; wipes the handshake state. */
int ap__secure_split(ap_secure_hs_t *hs, ap_noise_cs_t *send, ap_noise_cs_t *recv);
void ap__secure_clear(ap_secure_hs_t *hs);

/* Checks a decrypted payload against the remote static key rs; on success
 * writes the peer's id. Exposed for the fuzzer and tests. */
int ap__secure_check_payload(const uint8_t *payload, size_t len, const uint8_t rs[AP_NOISE_DHLEN],
                             ap_peer_id_t *out);

/* Builds a payload for creds-like inputs (tests use it to forge payloads). */
int ap__secure_make_payload(const ap_identity_t *id, const uint8_t s_pub[AP_NOISE_DHLEN],
                            uint8_t *out, size_t cap, size_t *len);

#endif
