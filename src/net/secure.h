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
#define AP_SECURE_PAYLOAD_MAX 4096 /* ours are ~110-160 bytes; an RSA key fits */
#define AP_SECURE_MUXERS_MAX  8    /* stream muxers we list in the extensions */

/* libp2p key types (the KeyType of proto/libp2p.proto). Only Ed25519 is
 * accepted; the others are named in the error. */
enum { AP_KEY_RSA = 0, AP_KEY_ED25519 = 1, AP_KEY_SECP256K1 = 2, AP_KEY_ECDSA = 3 };
/* "RSA", "Ed25519", "Secp256k1", "ECDSA", or "unknown". Static string. */
const char *ap__secure_key_type_name(int type);

/* Per-transport credentials: the identity, the X25519 static key and the
 * precomputed payload. Build once, share across connections (read-only). */
typedef struct ap_secure_creds {
    ap_identity_t id;
    uint8_t s_priv[AP_NOISE_DHLEN], s_pub[AP_NOISE_DHLEN];
    uint8_t payload[AP_SECURE_PAYLOAD_MAX];
    size_t payload_len;
    ap_noise_hash_t hash;
    const char *muxers[AP_SECURE_MUXERS_MAX]; /* static strings, preferred first */
    size_t nmuxers;
} ap_secure_creds_t;

/* Makes creds for id with a fresh random static key (s_priv NULL) or a given
 * one. hash: AP_NOISE_BLAKE2B for Apiary's own transport, AP_NOISE_SHA256 for
 * libp2p's "/noise". */
int ap__secure_creds_init(ap_secure_creds_t *c, const ap_identity_t *id, ap_noise_hash_t hash,
                          const uint8_t *s_priv);
/* Same, and the payload carries the NoiseExtensions stream_muxers list
 * (libp2p's early muxer negotiation): muxers[0..n) are protocol ids with
 * static storage, in order of preference (AP_EINVAL if n >
 * AP_SECURE_MUXERS_MAX or an id is empty or longer than 256 bytes). */
int ap__secure_creds_init_muxers(ap_secure_creds_t *c, const ap_identity_t *id,
                                 ap_noise_hash_t hash, const uint8_t *s_priv,
                                 const char *const *muxers, size_t n);
void ap__secure_creds_clear(ap_secure_creds_t *c);

/* What a remote's payload said. */
typedef struct ap_secure_remote {
    ap_peer_id_t id;
    int key_type;    /* the identity key's KeyType; -1 if unreadable */
    bool has_muxers; /* it listed stream muxers (early negotiation) */
    int muxer;       /* the agreed muxer: an index into our creds' muxers; -1 none */
} ap_secure_remote_t;

typedef struct ap_secure_hs {
    ap_noise_hs_t noise;
    const ap_secure_creds_t *creds; /* borrowed; must outlive the handshake */
    bool has_expected;
    ap_peer_id_t expected;
    bool has_remote;
    ap_peer_id_t remote;
    ap_secure_remote_t info; /* valid once has_remote; key_type also after AP_ENOTSUP */
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
 *   AP_ECORRUPT  malformed message or payload (bad protobuf, bad key)
 *   AP_ENOTSUP   an identity key that is not Ed25519 (hs->info.key_type
 *                tells which, for the log line)
 *   AP_ENOPROTO  both sides listed stream muxers and none is common
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
/* Same, and the early muxer negotiation against ours[0..nours): the agreed
 * muxer is the first of the initiator's list that the responder also lists
 * (we_initiate: the first of ours that the remote lists). AP_ENOPROTO when
 * both lists are non-empty and share nothing; errors as ap__secure_read. */
int ap__secure_check_payload_ex(const uint8_t *payload, size_t len,
                                const uint8_t rs[AP_NOISE_DHLEN], const char *const *ours,
                                size_t nours, bool we_initiate, ap_secure_remote_t *out);

/* Builds a payload for creds-like inputs (tests use it to forge payloads);
 * muxers may be NULL (n 0): no extensions. */
int ap__secure_make_payload(const ap_identity_t *id, const uint8_t s_pub[AP_NOISE_DHLEN],
                            uint8_t *out, size_t cap, size_t *len);
int ap__secure_make_payload_muxers(const ap_identity_t *id, const uint8_t s_pub[AP_NOISE_DHLEN],
                                   const char *const *muxers, size_t n, uint8_t *out, size_t cap,
                                   size_t *len);

#endif
