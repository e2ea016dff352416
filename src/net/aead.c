/* ChaCha20-Poly1305 over OpenSSL's EVP interface, with libsodium's as the
 * fallback. See aead.h. */
#include "net/aead.h"
#include "apiary/error.h"
#include "apiary/log.h"

#include <limits.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sodium.h>
#include <string.h>

_Static_assert(crypto_aead_chacha20poly1305_ietf_KEYBYTES == AP_AEAD_KEYLEN, "key size");
_Static_assert(crypto_aead_chacha20poly1305_ietf_NPUBBYTES == AP_AEAD_NONCELEN, "nonce size");
_Static_assert(crypto_aead_chacha20poly1305_ietf_ABYTES == AP_AEAD_TAGLEN, "tag size");
_Static_assert(AP_AEAD_PLAIN_MAX <= INT_MAX, "EVP takes int lengths");

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static EVP_CIPHER *g_cipher;    /* fetched once; NULL if the provider lacks it */
static bool g_use_openssl;      /* the process-wide choice */
static pthread_key_t g_ctx_key; /* each thread's EVP_CIPHER_CTX */
static bool g_key_ok;

static void ctx_free(void *p)
{
    EVP_CIPHER_CTX_free(p);
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

static EVP_CIPHER_CTX *thread_ctx(void)
{
    EVP_CIPHER_CTX *ctx = pthread_getspecific(g_ctx_key);
    if (ctx) return ctx;
    ctx = EVP_CIPHER_CTX_new();
    if (!ctx) return NULL;
    if (pthread_setspecific(g_ctx_key, ctx) != 0) {
        EVP_CIPHER_CTX_free(ctx);
        return NULL;
    }
    return ctx;
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

/* One EVP pass: key and nonce, the associated data, the message. For
 * decryption the expected tag is set before the final step, which fails if
 * it does not match. */
static int evp_run(int enc, const uint8_t *key, const uint8_t *nonce, const uint8_t *ad,
                   size_t adlen, const uint8_t *in, size_t len, uint8_t *out, uint8_t *tag)
{
    EVP_CIPHER_CTX *ctx = thread_ctx();
    if (!ctx) return AP_ENOMEM;
    int n = 0;
    if (EVP_CipherInit_ex2(ctx, g_cipher, key, nonce, enc, NULL) != 1) return AP_EIO;
    if (adlen && EVP_CipherUpdate(ctx, NULL, &n, ad, (int)adlen) != 1) return AP_EIO;
    if (len && EVP_CipherUpdate(ctx, out, &n, in, (int)len) != 1) return AP_EIO;
    if (!enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_TAG, AP_AEAD_TAGLEN, tag) != 1)
        return AP_EIO;
    if (EVP_CipherFinal_ex(ctx, out + len, &n) != 1) return enc ? AP_EIO : AP_EAUTH;
    if (enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, AP_AEAD_TAGLEN, tag) != 1)
        return AP_EIO;
    return 0;
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
