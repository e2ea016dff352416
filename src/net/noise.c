/* Noise XX (revision 34) over libsodium primitives. See noise.h.
 * Section numbers below refer to https://noiseprotocol.org/noise.html rev 34. */
#include "net/noise.h"
#include "apiary/error.h"
#include "net/aead.h"

#include <sodium.h>
#include <string.h>

_Static_assert(crypto_scalarmult_BYTES == AP_NOISE_DHLEN, "X25519 size");
_Static_assert(AP_AEAD_TAGLEN == AP_NOISE_TAGLEN, "tag size");
_Static_assert(AP_AEAD_NONCELEN == 12, "nonce size");

/* ---- hash, HMAC, HKDF (section 4.3) ---------------------------------------- */

size_t ap__noise_hashlen(ap_noise_hash_t hash)
{
    return hash == AP_NOISE_SHA256 ? 32 : 64;
}

static size_t blocklen(ap_noise_hash_t hash)
{
    return hash == AP_NOISE_SHA256 ? 64 : 128;
}

typedef union {
    crypto_generichash_blake2b_state b2;
    crypto_hash_sha256_state sha;
} hash_state_t;

static void h_init(ap_noise_hash_t hash, hash_state_t *st)
{
    if (hash == AP_NOISE_SHA256)
        crypto_hash_sha256_init(&st->sha);
    else
        crypto_generichash_blake2b_init(&st->b2, NULL, 0, 64);
}

static void h_update(ap_noise_hash_t hash, hash_state_t *st, const uint8_t *p, size_t n)
{
    if (hash == AP_NOISE_SHA256)
        crypto_hash_sha256_update(&st->sha, p, n);
    else
        crypto_generichash_blake2b_update(&st->b2, p, n);
}

static void h_final(ap_noise_hash_t hash, hash_state_t *st, uint8_t *out)
{
    if (hash == AP_NOISE_SHA256)
        crypto_hash_sha256_final(&st->sha, out);
    else
        crypto_generichash_blake2b_final(&st->b2, out, 64);
}

/* HASH(a || b) */
static void hash2(ap_noise_hash_t hash, const uint8_t *a, size_t alen, const uint8_t *b,
                  size_t blen, uint8_t *out)
{
    hash_state_t st;
    h_init(hash, &st);
    h_update(hash, &st, a, alen);
    if (blen) h_update(hash, &st, b, blen);
    h_final(hash, &st, out);
    sodium_memzero(&st, sizeof st);
}

void ap__noise_hmac(ap_noise_hash_t hash, const uint8_t *key, size_t keylen, const uint8_t *data,
                    size_t len, uint8_t *out)
{
    /* RFC 2104: keys longer than the block are hashed; then zero-padded. */
    size_t bl = blocklen(hash), hl = ap__noise_hashlen(hash);
    uint8_t k0[128], pad[128], inner[AP_NOISE_MAXHASH];
    memset(k0, 0, sizeof k0);
    if (keylen > bl)
        hash2(hash, key, keylen, NULL, 0, k0);
    else if (keylen)
        memcpy(k0, key, keylen);
    hash_state_t st;
    for (size_t i = 0; i < bl; i++) pad[i] = k0[i] ^ 0x36;
    h_init(hash, &st);
    h_update(hash, &st, pad, bl);
    if (len) h_update(hash, &st, data, len);
    h_final(hash, &st, inner);
    for (size_t i = 0; i < bl; i++) pad[i] = k0[i] ^ 0x5c;
    h_init(hash, &st);
    h_update(hash, &st, pad, bl);
    h_update(hash, &st, inner, hl);
    h_final(hash, &st, out);
    sodium_memzero(k0, sizeof k0);
    sodium_memzero(pad, sizeof pad);
    sodium_memzero(inner, sizeof inner);
    sodium_memzero(&st, sizeof st);
}

void ap__noise_hkdf(ap_noise_hash_t hash, const uint8_t *ck, const uint8_t *ikm, size_t ikm_len,
                    uint8_t *out1, uint8_t *out2, uint8_t *out3)
{
    size_t hl = ap__noise_hashlen(hash);
    uint8_t temp[AP_NOISE_MAXHASH], buf[AP_NOISE_MAXHASH + 1];
    ap__noise_hmac(hash, ck, hl, ikm, ikm_len, temp);
    uint8_t one = 0x01;
    ap__noise_hmac(hash, temp, hl, &one, 1, out1);
    memcpy(buf, out1, hl);
    buf[hl] = 0x02;
    ap__noise_hmac(hash, temp, hl, buf, hl + 1, out2);
    if (out3) {
        memcpy(buf, out2, hl);
        buf[hl] = 0x03;
        ap__noise_hmac(hash, temp, hl, buf, hl + 1, out3);
    }
    sodium_memzero(temp, sizeof temp);
    sodium_memzero(buf, sizeof buf);
}

/* ---- CipherState (section 5.1) --------------------------------------------- */

static void nonce12(uint8_t out[12], uint64_t n)
{
    memset(out, 0, 4);
    for (int i = 0; i < 8; i++) out[4 + i] = (uint8_t)(n >> (8 * i));
}

int ap__noise_cs_encrypt(ap_noise_cs_t *cs, const uint8_t *ad, size_t adlen, const uint8_t *plain,
                         size_t len, uint8_t *out)
{
    if (!cs->has_key) {
        if (out != plain && len) memmove(out, plain, len);
        return 0;
    }
    if (cs->n == UINT64_MAX) return AP_ELIMIT; /* reserved: never used as a nonce */
    uint8_t nonce[12];
    nonce12(nonce, cs->n);
    int rc = ap__aead_seal(cs->k, nonce, ad, adlen, plain, len, out);
    if (rc) return rc;
    cs->n++;
    return 0;
}

int ap__noise_cs_decrypt(ap_noise_cs_t *cs, const uint8_t *ad, size_t adlen, const uint8_t *cipher,
                         size_t len, uint8_t *out)
{
    if (!cs->has_key) {
        if (out != cipher && len) memmove(out, cipher, len);
        return 0;
    }
    if (len < AP_NOISE_TAGLEN) return AP_ECORRUPT;
    if (cs->n == UINT64_MAX) return AP_ELIMIT;
    uint8_t nonce[12];
    nonce12(nonce, cs->n);
    size_t plen = len - AP_NOISE_TAGLEN;
    int rc = ap__aead_open(cs->k, nonce, ad, adlen, cipher, plen, cipher + plen, out);
    if (rc) return rc;
    cs->n++;
    return 0;
}

void ap__noise_cs_clear(ap_noise_cs_t *cs)
{
    sodium_memzero(cs, sizeof *cs);
}

/* ---- SymmetricState (section 5.2) ------------------------------------------ */

static void mix_hash(ap_noise_hs_t *hs, const uint8_t *data, size_t len)
{
    hash2(hs->hash, hs->h, hs->hashlen, data, len, hs->h);
}

static void mix_key(ap_noise_hs_t *hs, const uint8_t *ikm, size_t len)
{
    uint8_t temp_k[AP_NOISE_MAXHASH];
    ap__noise_hkdf(hs->hash, hs->ck, ikm, len, hs->ck, temp_k, NULL);
    memcpy(hs->cs.k, temp_k, 32); /* truncated to 32 bytes when HASHLEN is 64 */
    hs->cs.n = 0;
    hs->cs.has_key = true;
    sodium_memzero(temp_k, sizeof temp_k);
}

/* EncryptAndHash: plain -> out (len + tag if keyed). Returns bytes written. */
static int encrypt_and_hash(ap_noise_hs_t *hs, const uint8_t *plain, size_t len, uint8_t *out,
                            size_t *written)
{
    int rc = ap__noise_cs_encrypt(&hs->cs, hs->h, hs->hashlen, plain, len, out);
    if (rc != 0) return rc;
    size_t n = len + (hs->cs.has_key ? AP_NOISE_TAGLEN : 0);
    mix_hash(hs, out, n);
    *written = n;
    return 0;
}

static int decrypt_and_hash(ap_noise_hs_t *hs, const uint8_t *cipher, size_t len, uint8_t *out)
{
    /* Hash the ciphertext before decrypting in case out aliases it. */
    uint8_t h_next[AP_NOISE_MAXHASH];
    hash2(hs->hash, hs->h, hs->hashlen, cipher, len, h_next);
    int rc = ap__noise_cs_decrypt(&hs->cs, hs->h, hs->hashlen, cipher, len, out);
    if (rc == 0) memcpy(hs->h, h_next, hs->hashlen);
    return rc;
}

static int dh(const uint8_t priv[32], const uint8_t pub[32], uint8_t out[32])
{
    /* libsodium refuses an all-zero result (a low-order public key): treat
     * it as an authentication failure rather than mixing in a known key. */
    return crypto_scalarmult(out, priv, pub) == 0 ? 0 : AP_EAUTH;
}

static int mix_dh(ap_noise_hs_t *hs, const uint8_t *priv, const uint8_t *pub)
{
    uint8_t shared[32];
    int rc = dh(priv, pub, shared);
    if (rc == 0) mix_key(hs, shared, sizeof shared);
    sodium_memzero(shared, sizeof shared);
    return rc;
}

/* ---- HandshakeState (section 5.3) ------------------------------------------ */

int ap__noise_hs_init(ap_noise_hs_t *hs, ap_noise_hash_t hash, bool initiator,
                      const uint8_t *prologue, size_t prologue_len,
                      const uint8_t s_priv[AP_NOISE_DHLEN], const uint8_t *e_priv)
{
    if (sodium_init() < 0) return AP_ESYS;
    if (hash != AP_NOISE_BLAKE2B && hash != AP_NOISE_SHA256) return AP_EINVAL;
    memset(hs, 0, sizeof *hs);
    hs->hash = hash;
    hs->hashlen = ap__noise_hashlen(hash);
    hs->initiator = initiator;
    const char *name = hash == AP_NOISE_SHA256 ? "Noise_XX_25519_ChaChaPoly_SHA256"
                                               : "Noise_XX_25519_ChaChaPoly_BLAKE2b";
    size_t nl = strlen(name);
    if (nl <= hs->hashlen)
        memcpy(hs->h, name, nl); /* zero-padded to HASHLEN */
    else
        hash2(hash, (const uint8_t *)name, nl, NULL, 0, hs->h);
    memcpy(hs->ck, hs->h, hs->hashlen);
    mix_hash(hs, prologue, prologue_len);
    memcpy(hs->s, s_priv, AP_NOISE_DHLEN);
    crypto_scalarmult_base(hs->s_pub, hs->s);
    if (e_priv) {
        memcpy(hs->e, e_priv, AP_NOISE_DHLEN);
        crypto_scalarmult_base(hs->e_pub, hs->e);
        hs->has_e = true;
    }
    return 0;
}

bool ap__noise_hs_my_turn(const ap_noise_hs_t *hs)
{
    return hs->step < 3 && ((hs->step % 2 == 0) == hs->initiator);
}

bool ap__noise_hs_done(const ap_noise_hs_t *hs)
{
    return hs->step == 3 && !hs->failed;
}

static size_t tagged(const ap_noise_hs_t *hs, int step, size_t n)
{
    /* step 0 has no key yet; steps 1 and 2 are keyed before s and payload. */
    (void)hs;
    return step == 0 ? n : n + AP_NOISE_TAGLEN;
}

size_t ap__noise_hs_write_len(const ap_noise_hs_t *hs, size_t payload_len)
{
    switch (hs->step) {
    case 0:
        return AP_NOISE_DHLEN + tagged(hs, 0, payload_len);
    case 1:
        return AP_NOISE_DHLEN + tagged(hs, 1, AP_NOISE_DHLEN) + tagged(hs, 1, payload_len);
    case 2:
        return tagged(hs, 2, AP_NOISE_DHLEN) + tagged(hs, 2, payload_len);
    default:
        return 0;
    }
}

static int fail(ap_noise_hs_t *hs, int rc)
{
    hs->failed = rc;
    return rc;
}

int ap__noise_hs_write(ap_noise_hs_t *hs, const uint8_t *payload, size_t payload_len, uint8_t *out,
                       size_t cap, size_t *out_len)
{
    if (hs->failed) return hs->failed;
    if (!ap__noise_hs_my_turn(hs)) return AP_ESTATE;
    size_t need = ap__noise_hs_write_len(hs, payload_len);
    if (need > cap || need > AP_NOISE_MSG_MAX) return AP_EMSGSIZE;
    size_t off = 0, w;
    int rc;
    if (hs->step <= 1) { /* token e */
        if (!hs->has_e) {
            crypto_box_keypair(hs->e_pub, hs->e); /* fresh X25519 key pair */
            hs->has_e = true;
        }
        memcpy(out, hs->e_pub, AP_NOISE_DHLEN);
        mix_hash(hs, hs->e_pub, AP_NOISE_DHLEN);
        off += AP_NOISE_DHLEN;
    }
    if (hs->step == 1) { /* responder: ee, s, es */
        if ((rc = mix_dh(hs, hs->e, hs->re)) != 0) return fail(hs, rc);
        if ((rc = encrypt_and_hash(hs, hs->s_pub, AP_NOISE_DHLEN, out + off, &w)) != 0)
            return fail(hs, rc);
        off += w;
        if ((rc = mix_dh(hs, hs->s, hs->re)) != 0) return fail(hs, rc);
    } else if (hs->step == 2) { /* initiator: s, se */
        if ((rc = encrypt_and_hash(hs, hs->s_pub, AP_NOISE_DHLEN, out + off, &w)) != 0)
            return fail(hs, rc);
        off += w;
        if ((rc = mix_dh(hs, hs->s, hs->re)) != 0) return fail(hs, rc);
    }
    if ((rc = encrypt_and_hash(hs, payload, payload_len, out + off, &w)) != 0) return fail(hs, rc);
    off += w;
    *out_len = off;
    hs->step++;
    return 0;
}

int ap__noise_hs_read(ap_noise_hs_t *hs, const uint8_t *msg, size_t len, uint8_t *payload,
                      size_t cap, size_t *payload_len)
{
    if (hs->failed) return hs->failed;
    if (hs->step >= 3 || ap__noise_hs_my_turn(hs)) return AP_ESTATE;
    if (len > AP_NOISE_MSG_MAX) return fail(hs, AP_EMSGSIZE);
    /* the fixed part: e (steps 0, 1) and encrypted s (steps 1, 2) */
    size_t fixed = hs->step == 0   ? AP_NOISE_DHLEN
                   : hs->step == 1 ? AP_NOISE_DHLEN + AP_NOISE_DHLEN + AP_NOISE_TAGLEN
                                   : AP_NOISE_DHLEN + AP_NOISE_TAGLEN;
    size_t min = fixed + (hs->step == 0 ? 0 : AP_NOISE_TAGLEN);
    if (len < min) return fail(hs, AP_ECORRUPT);
    size_t plen = len - fixed - (hs->step == 0 ? 0 : AP_NOISE_TAGLEN);
    if (plen > cap) return fail(hs, AP_EMSGSIZE);
    size_t off = 0;
    int rc;
    if (hs->step <= 1) { /* token e */
        memcpy(hs->re, msg, AP_NOISE_DHLEN);
        hs->has_re = true;
        mix_hash(hs, hs->re, AP_NOISE_DHLEN);
        off += AP_NOISE_DHLEN;
    }
    if (hs->step == 1) { /* initiator reads ee, s, es */
        if ((rc = mix_dh(hs, hs->e, hs->re)) != 0) return fail(hs, rc);
        if ((rc = decrypt_and_hash(hs, msg + off, AP_NOISE_DHLEN + AP_NOISE_TAGLEN, hs->rs)) != 0)
            return fail(hs, rc == AP_ECORRUPT ? AP_ECORRUPT : AP_EAUTH);
        off += AP_NOISE_DHLEN + AP_NOISE_TAGLEN;
        hs->has_rs = true;
        if ((rc = mix_dh(hs, hs->e, hs->rs)) != 0) return fail(hs, rc);
    } else if (hs->step == 2) { /* responder reads s, se */
        if ((rc = decrypt_and_hash(hs, msg + off, AP_NOISE_DHLEN + AP_NOISE_TAGLEN, hs->rs)) != 0)
            return fail(hs, AP_EAUTH);
        off += AP_NOISE_DHLEN + AP_NOISE_TAGLEN;
        hs->has_rs = true;
        if ((rc = mix_dh(hs, hs->e, hs->rs)) != 0) return fail(hs, rc);
    }
    if ((rc = decrypt_and_hash(hs, msg + off, len - off, payload)) != 0) return fail(hs, AP_EAUTH);
    *payload_len = plen;
    hs->step++;
    return 0;
}

int ap__noise_hs_split(ap_noise_hs_t *hs, ap_noise_cs_t *send, ap_noise_cs_t *recv)
{
    if (!ap__noise_hs_done(hs)) return AP_ESTATE;
    uint8_t k1[AP_NOISE_MAXHASH], k2[AP_NOISE_MAXHASH];
    ap__noise_hkdf(hs->hash, hs->ck, NULL, 0, k1, k2, NULL);
    ap_noise_cs_t *c1 = hs->initiator ? send : recv, *c2 = hs->initiator ? recv : send;
    memset(c1, 0, sizeof *c1);
    memset(c2, 0, sizeof *c2);
    memcpy(c1->k, k1, 32);
    memcpy(c2->k, k2, 32);
    c1->has_key = c2->has_key = true;
    sodium_memzero(k1, sizeof k1);
    sodium_memzero(k2, sizeof k2);
    sodium_memzero(hs->ck, sizeof hs->ck);
    ap__noise_cs_clear(&hs->cs);
    return 0;
}

const uint8_t *ap__noise_hs_hash(const ap_noise_hs_t *hs, size_t *len)
{
    if (len) *len = hs->hashlen;
    return hs->h;
}

const uint8_t *ap__noise_hs_remote_static(const ap_noise_hs_t *hs)
{
    return hs->has_rs ? hs->rs : NULL;
}

void ap__noise_hs_clear(ap_noise_hs_t *hs)
{
    sodium_memzero(hs, sizeof *hs);
}
