/* Noise_XX_25519_ChaChaPoly_{BLAKE2b,SHA256}: the Noise Protocol Framework,
 * revision 34, XX pattern only. Internal.
 *
 * Sans-I/O: the handshake state machine takes and returns whole Noise
 * messages (no length prefix; the transport adds it) and never touches a
 * socket or a clock. Ephemeral keys may be injected (test vectors);
 * otherwise they come from libsodium's CSPRNG.
 *
 *     -> e
 *     <- e, ee, s, es
 *     -> s, se
 *
 * Primitives (all libsodium): X25519 (crypto_scalarmult), ChaCha20-Poly1305
 * IETF with nonce = 4 zero bytes || 64-bit little-endian counter, BLAKE2b-512
 * or SHA-256, and HMAC/HKDF built exactly as the spec's section 4.3 defines
 * them over the chosen hash (HMAC block size 128 for BLAKE2b, 64 for SHA-256).
 *
 * Secrets are wiped when a state is cleared (ap__noise_hs_clear,
 * ap__noise_cs_clear). */
#ifndef AP_NET_NOISE_H
#define AP_NET_NOISE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_NOISE_DHLEN     32
#define AP_NOISE_TAGLEN    16
#define AP_NOISE_MAXHASH   64
#define AP_NOISE_MSG_MAX   65535 /* a Noise message, ciphertext and tag included */
#define AP_NOISE_PLAIN_MAX (AP_NOISE_MSG_MAX - AP_NOISE_TAGLEN)

typedef enum ap_noise_hash { AP_NOISE_BLAKE2B = 0, AP_NOISE_SHA256 = 1 } ap_noise_hash_t;

/* A CipherState: key, and the nonce of the next message. */
typedef struct ap_noise_cs {
    uint8_t k[32];
    uint64_t n;
    bool has_key;
} ap_noise_cs_t;

/* Seals plain (len bytes) with ad into out (len + AP_NOISE_TAGLEN bytes; out
 * may equal plain for in-place). Without a key, copies plain. AP_ELIMIT when
 * the nonce is exhausted (2^64 - 1 is reserved): the connection must close. */
int ap__noise_cs_encrypt(ap_noise_cs_t *cs, const uint8_t *ad, size_t adlen, const uint8_t *plain,
                         size_t len, uint8_t *out);
/* Opens cipher (len bytes, tag included) into out (len - AP_NOISE_TAGLEN
 * bytes; out may equal cipher). AP_EAUTH if the tag does not verify (altered,
 * replayed or reordered message: the nonce is implicit) — n is then NOT
 * advanced, as the spec requires. AP_ECORRUPT if len < AP_NOISE_TAGLEN. */
int ap__noise_cs_decrypt(ap_noise_cs_t *cs, const uint8_t *ad, size_t adlen, const uint8_t *cipher,
                         size_t len, uint8_t *out);
void ap__noise_cs_clear(ap_noise_cs_t *cs);

/* The handshake state. */
typedef struct ap_noise_hs {
    ap_noise_hash_t hash;
    size_t hashlen;
    bool initiator;
    int step;   /* messages processed so far, 0..3 */
    int failed; /* sticky error after any failure */
    uint8_t ck[AP_NOISE_MAXHASH];
    uint8_t h[AP_NOISE_MAXHASH];
    ap_noise_cs_t cs;
    uint8_t s[AP_NOISE_DHLEN], s_pub[AP_NOISE_DHLEN];
    uint8_t e[AP_NOISE_DHLEN], e_pub[AP_NOISE_DHLEN];
    bool has_e;
    uint8_t rs[AP_NOISE_DHLEN], re[AP_NOISE_DHLEN];
    bool has_rs, has_re;
} ap_noise_hs_t;

/* Initialize(): protocol name Noise_XX_25519_ChaChaPoly_<hash>, the prologue,
 * our static private key s, and optionally a fixed ephemeral private key
 * (NULL = generate when needed). */
int ap__noise_hs_init(ap_noise_hs_t *hs, ap_noise_hash_t hash, bool initiator,
                      const uint8_t *prologue, size_t prologue_len,
                      const uint8_t s_priv[AP_NOISE_DHLEN], const uint8_t *e_priv);

/* Whose turn: true if the next handshake step is ours to write. */
bool ap__noise_hs_my_turn(const ap_noise_hs_t *hs);
/* True once all three messages are processed (then call split). */
bool ap__noise_hs_done(const ap_noise_hs_t *hs);

/* Size of the next message we write, for a payload of payload_len bytes. */
size_t ap__noise_hs_write_len(const ap_noise_hs_t *hs, size_t payload_len);

/* WriteMessage: writes the next handshake message into out (cap bytes) and
 * stores its length in *out_len. AP_ESTATE if it is not our turn,
 * AP_EMSGSIZE if the message would exceed cap or AP_NOISE_MSG_MAX. */
int ap__noise_hs_write(ap_noise_hs_t *hs, const uint8_t *payload, size_t payload_len, uint8_t *out,
                       size_t cap, size_t *out_len);
/* ReadMessage: processes the peer's next message (untrusted) and writes its
 * payload into payload (cap bytes; AP_NOISE_MSG_MAX always suffices),
 * *payload_len its length. AP_ECORRUPT (too short), AP_EAUTH (decryption or
 * DH failure), AP_ESTATE (not the peer's turn). Any failure is sticky: the
 * handshake is dead. */
int ap__noise_hs_read(ap_noise_hs_t *hs, const uint8_t *msg, size_t len, uint8_t *payload,
                      size_t cap, size_t *payload_len);

/* Split(): the transport CipherStates, send and recv from our point of view
 * (initiator: send = c1, recv = c2). Only after done. Wipes the handshake's
 * chaining key. */
int ap__noise_hs_split(ap_noise_hs_t *hs, ap_noise_cs_t *send, ap_noise_cs_t *recv);

/* The handshake hash h (hashlen bytes), valid after done, for channel
 * binding. */
const uint8_t *ap__noise_hs_hash(const ap_noise_hs_t *hs, size_t *len);
/* The peer's static public key, valid once received (initiator: after
 * message 2, responder: after message 3). NULL before. */
const uint8_t *ap__noise_hs_remote_static(const ap_noise_hs_t *hs);
void ap__noise_hs_clear(ap_noise_hs_t *hs);

/* The hash and HMAC-HKDF, exposed for tests (RFC 4231 / RFC 5869 vectors).
 * hkdf writes 2 or 3 outputs of hashlen bytes (out3 may be NULL). */
size_t ap__noise_hashlen(ap_noise_hash_t hash);
void ap__noise_hmac(ap_noise_hash_t hash, const uint8_t *key, size_t keylen, const uint8_t *data,
                    size_t len, uint8_t *out);
void ap__noise_hkdf(ap_noise_hash_t hash, const uint8_t *ck, const uint8_t *ikm, size_t ikm_len,
                    uint8_t *out1, uint8_t *out2, uint8_t *out3);

#endif
