/* ChaCha20-Poly1305 (RFC 8439, 96-bit nonce, 16-byte tag): the AEAD under
 * Noise's CipherState. Internal to the library.
 *
 * Two implementations give the same bytes: OpenSSL's EVP cipher (libcrypto;
 * on x86-64 with AVX-512 or AVX2 it seals and opens about 3x faster than
 * libsodium's, which is what bounds an encrypted stream on a small machine)
 * and libsodium's crypto_aead_chacha20poly1305_ietf_*. OpenSSL's is used when
 * its provider offers the cipher (checked once per process); otherwise, or
 * after ap__aead_use_openssl(false), libsodium's.
 *
 * Thread-safe: each thread keeps its own OpenSSL contexts, a few per
 * direction, each bound to the last keys it used, so that a message under a
 * key already bound sets only its nonce (created on first use; freed and the
 * key copies zeroed at thread exit). A failed call unbinds its context. */
#ifndef AP_NET_AEAD_H
#define AP_NET_AEAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_AEAD_KEYLEN   32
#define AP_AEAD_NONCELEN 12
#define AP_AEAD_TAGLEN   16
/* Longest plaintext one call takes (Noise messages are far below it). */
#define AP_AEAD_PLAIN_MAX ((size_t)1 << 30)

/* Seals plain (len bytes) with ad (adlen bytes, may be NULL if 0) into out:
 * len bytes of ciphertext followed by the tag. out may equal plain (in place);
 * any other overlap is not allowed. Returns 0, AP_EMSGSIZE if len or adlen
 * exceeds AP_AEAD_PLAIN_MAX, or AP_EIO if the library failed (out is then
 * zeroed). */
int ap__aead_seal(const uint8_t key[AP_AEAD_KEYLEN], const uint8_t nonce[AP_AEAD_NONCELEN],
                  const uint8_t *ad, size_t adlen, const uint8_t *plain, size_t len, uint8_t *out);

/* Opens cipher (len bytes of ciphertext) against tag into out (len bytes; may
 * equal cipher). Returns 0, or AP_EAUTH if the tag does not verify (out is
 * then zeroed: no unauthenticated plaintext is left behind), AP_EMSGSIZE, or
 * AP_EIO. */
int ap__aead_open(const uint8_t key[AP_AEAD_KEYLEN], const uint8_t nonce[AP_AEAD_NONCELEN],
                  const uint8_t *ad, size_t adlen, const uint8_t *cipher, size_t len,
                  const uint8_t tag[AP_AEAD_TAGLEN], uint8_t *out);

/* Which implementation the calls use: "openssl" or "libsodium". */
const char *ap__aead_impl(void);

/* Chooses OpenSSL's implementation (true, the default when available) or
 * libsodium's (false) for the whole process. Returns false if OpenSSL's was
 * asked for and is not available. For tests and benchmarks; not thread-safe
 * against concurrent seal/open. */
bool ap__aead_use_openssl(bool on);

#endif
