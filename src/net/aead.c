/* ChaCha20-Poly1305 over OpenSSL's EVP interface, with libsodium's as the
 * fallback. See aead.h. */
#include "net/aead.h"
#include "apiary/error.h"
#include "apiary/log.h"

#include <limits.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdlib.h>
#include <sodium.h>
#include <string.h>

_Static_assert(crypto_aead_chacha20poly1305_ietf_KEYBYTES == AP_AEAD_KEYLEN, "key size");
_Static_assert(crypto_aead_chacha20poly1305_ietf_NPUBBYTES == AP_AEAD_NONCELEN, "nonce size");
_Static_assert(crypto_aead_chacha20poly1305_ietf_ABYTES == AP_AEAD_TAGLEN, "tag size");
_Static_assert(AP_AEAD_PLAIN_MAX <= INT_MAX, "EVP takes int lengths");

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static EVP_CIPHER *g_cipher;    /* fetched once; NULL if the provider lacks it */
static bool g_use_openssl;      /* the process-wide choice */
static pthread_key_t g_ctx_key; /* each thread's contexts (ctx_set_t) */
static bool g_key_ok;

/* Each thread keeps a few EVP contexts per direction, each bound to one key:
 * a message under a key already bound only sets the nonce, which skips the
 * key schedule and most of EVP's setup (a 64-byte seal costs about 30 % less).
 * A connection's two directions and a few connections served by one thread
 * each keep their context; a new key replaces the slot used longest ago. */
#define AP_AEAD_SLOTS 4

typedef struct {
    EVP_CIPHER_CTX *ctx;
    uint64_t used; /* last use, from the set's clock; 0 = no key bound */
    uint8_t key[AP_AEAD_KEYLEN];
} ctx_slot_t;

typedef struct {
    ctx_slot_t slot[2][AP_AEAD_SLOTS]; /* [enc][i] */
    uint64_t clock;
} ctx_set_t;

static void ctx_free(void *p)
{
    ctx_set_t *set = p;
    for (int d = 0; d < 2; d++)
        for (int i = 0; i < AP_AEAD_SLOTS; i++) EVP_CIPHER_CTX_free(set->slot[d][i].ctx);
    sodium_memzero(set, sizeof *set);
    free(set);
}

static void init_once(void)
{
    g_key_ok = pthread_key_create(&g_ctx_key, ctx_free) == 0;
    g_cipher = EVP_CIPHER_fetch(NULL, "ChaCha20-Poly1305", NULL);
    g_use_openssl = g_cipher && g_key_ok;
    if (!g_use_openssl)
        ap_log(AP_LOG_INFO, "aead",
               "OpenSSL offers no ChaCha20-Poly1305 here: using libsodium's (slower)");
}

static ctx_set_t *thread_set(void)
{
    ctx_set_t *set = pthread_getspecific(g_ctx_key);
    if (set) return set;
    set = calloc(1, sizeof *set);
    if (!set) return NULL;
    if (pthread_setspecific(g_ctx_key, set) != 0) {
        free(set);
        return NULL;
    }
    return set;
}

/* The context bound to key for direction enc with nonce set: the slot that
 * holds key (compared in constant time) gets only the nonce; otherwise the
 * oldest slot is rebound. */
static ctx_slot_t *bound_slot(int enc, const uint8_t *key, const uint8_t *nonce)
{
    ctx_set_t *set = thread_set();
    if (!set) return NULL;
    ctx_slot_t *slots = set->slot[enc ? 1 : 0], *s = NULL, *oldest = &slots[0];
    for (int i = 0; i < AP_AEAD_SLOTS; i++) {
        if (slots[i].used && sodium_memcmp(slots[i].key, key, AP_AEAD_KEYLEN) == 0) {
            s = &slots[i];
            break;
        }
        if (slots[i].used < oldest->used) oldest = &slots[i];
    }
    if (s) {
        s->used = ++set->clock;
        if (EVP_CipherInit_ex2(s->ctx, NULL, NULL, nonce, enc, NULL) == 1) return s;
        s->used = 0; /* rebind from scratch below */
    } else {
        s = oldest;
    }
    if (!s->ctx && !(s->ctx = EVP_CIPHER_CTX_new())) return NULL;
    s->used = 0;
    if (EVP_CipherInit_ex2(s->ctx, g_cipher, key, nonce, enc, NULL) != 1) return NULL;
    memcpy(s->key, key, AP_AEAD_KEYLEN);
    s->used = ++set->clock;
    return s;
}

const char *ap__aead_impl(void)
{
    pthread_once(&g_once, init_once);
    return g_use_openssl ? "openssl" : "libsodium";
}

bool ap__aead_use_openssl(bool on)
{
    pthread_once(&g_once, init_once);
    if (on && !(g_cipher && g_key_ok)) return false;
    g_use_openssl = on;
    return true;
}

/* One EVP pass on a context with key and nonce set: the associated data, the
 * message. For
 * decryption the expected tag is set before the final step, which fails if
 * it does not match. */
static int evp_pass(EVP_CIPHER_CTX *ctx, int enc, const uint8_t *ad, size_t adlen,
                    const uint8_t *in, size_t len, uint8_t *out, uint8_t *tag)
{
    int n = 0;
    if (adlen && EVP_CipherUpdate(ctx, NULL, &n, ad, (int)adlen) != 1) return AP_EIO;
    if (len && EVP_CipherUpdate(ctx, out, &n, in, (int)len) != 1) return AP_EIO;
    if (!enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_TAG, AP_AEAD_TAGLEN, tag) != 1)
        return AP_EIO;
    if (EVP_CipherFinal_ex(ctx, out + len, &n) != 1) return enc ? AP_EIO : AP_EAUTH;
    if (enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, AP_AEAD_TAGLEN, tag) != 1)
        return AP_EIO;
    return 0;
}

/* After a failed pass (a forged message included) the slot is unbound, so
 * the next message under its key starts from a fresh key setup. */
static int evp_run(int enc, const uint8_t *key, const uint8_t *nonce, const uint8_t *ad,
                   size_t adlen, const uint8_t *in, size_t len, uint8_t *out, uint8_t *tag)
{
    ctx_slot_t *s = bound_slot(enc, key, nonce);
    if (!s) return AP_EIO;
    int rc = evp_pass(s->ctx, enc, ad, adlen, in, len, out, tag);
    if (rc) s->used = 0;
    return rc;
}

int ap__aead_seal(const uint8_t key[AP_AEAD_KEYLEN], const uint8_t nonce[AP_AEAD_NONCELEN],
                  const uint8_t *ad, size_t adlen, const uint8_t *plain, size_t len, uint8_t *out)
{
    if (len > AP_AEAD_PLAIN_MAX || adlen > AP_AEAD_PLAIN_MAX) return AP_EMSGSIZE;
    pthread_once(&g_once, init_once);
    if (!g_use_openssl) {
        crypto_aead_chacha20poly1305_ietf_encrypt_detached(out, out + len, NULL, plain, len, ad,
                                                           adlen, NULL, nonce, key);
        return 0;
    }
    int rc = evp_run(1, key, nonce, ad, adlen, plain, len, out, out + len);
    if (rc) sodium_memzero(out, len + AP_AEAD_TAGLEN);
    return rc;
}

int ap__aead_open(const uint8_t key[AP_AEAD_KEYLEN], const uint8_t nonce[AP_AEAD_NONCELEN],
                  const uint8_t *ad, size_t adlen, const uint8_t *cipher, size_t len,
                  const uint8_t tag[AP_AEAD_TAGLEN], uint8_t *out)
{
    if (len > AP_AEAD_PLAIN_MAX || adlen > AP_AEAD_PLAIN_MAX) return AP_EMSGSIZE;
    pthread_once(&g_once, init_once);
    if (!g_use_openssl) {
        if (crypto_aead_chacha20poly1305_ietf_decrypt_detached(out, NULL, cipher, len, tag, ad,
                                                               adlen, nonce, key) != 0)
            return AP_EAUTH;
        return 0;
    }
    uint8_t t[AP_AEAD_TAGLEN]; /* the tag may sit right after an in-place buffer */
    memcpy(t, tag, sizeof t);
    int rc = evp_run(0, key, nonce, ad, adlen, cipher, len, out, t);
    if (rc && len) sodium_memzero(out, len);
    return rc;
}
