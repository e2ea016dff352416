/* BTARD verification primitives: commitments, random directions, clipped
 * projections, seeded minibatches and validator choice (see apiary/btard.h). */
#include "apiary/btard.h"

#include <math.h>
#include <sodium.h>
#include <string.h>

static void le32(uint8_t out[4], uint32_t v)
{
    for (int i = 0; i < 4; i++) out[i] = (uint8_t)(v >> (8 * i));
}

void ap_btard_hash_floats(const float *x, size_t n, uint8_t out[AP_BTARD_HASH_LEN])
{
    static const char tag[] = "apiary/btard/floats";
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)n >> (8 * i));
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&st, len, 8);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    crypto_generichash_update(&st, (const uint8_t *)x, n * sizeof(float));
#else
    for (size_t k = 0; k < n; k++) {
        uint32_t u;
        memcpy(&u, &x[k], 4);
        uint8_t b[4];
        le32(b, u);
        crypto_generichash_update(&st, b, 4);
    }
#endif
    crypto_generichash_final(&st, out, AP_BTARD_HASH_LEN);
}

/* A ChaCha20 stream of u64 keyed by BLAKE2b(tag || seed || le32(idx)). */
typedef struct stream {
    uint8_t key[crypto_stream_chacha20_KEYBYTES];
    uint64_t block;
    uint64_t buf[8];
    int pos;
} stream_t;

static void stream_init(stream_t *s, const char *tag, const uint8_t seed[AP_BTARD_HASH_LEN],
                        uint32_t idx)
{
    uint8_t ib[4];
    le32(ib, idx);
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, sizeof s->key);
    crypto_generichash_update(&st, (const uint8_t *)tag, strlen(tag));
    crypto_generichash_update(&st, seed, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, ib, 4);
    crypto_generichash_final(&st, s->key, sizeof s->key);
    s->block = 0;
    s->pos = 8;
}

static uint64_t stream_u64(stream_t *s)
{
    if (s->pos == 8) {
        uint8_t nonce[crypto_stream_chacha20_NONCEBYTES] = {0};
        uint8_t b[64] = {0};
        crypto_stream_chacha20_xor_ic(b, b, sizeof b, nonce, s->block++, s->key);
        for (int i = 0; i < 8; i++) {
            uint64_t v = 0;
            for (int j = 7; j >= 0; j--) v = (v << 8) | b[8 * i + j];
            s->buf[i] = v;
        }
        s->pos = 0;
    }
    return s->buf[s->pos++];
}

static uint64_t stream_below(stream_t *s, uint64_t n)
{
    uint64_t lim = UINT64_MAX - UINT64_MAX % n;
    for (;;) {
        uint64_t v = stream_u64(s);
        if (v < lim) return v % n;
    }
}

void ap_btard_direction(const uint8_t seed[AP_BTARD_HASH_LEN], uint32_t part, size_t n, float *z)
{
    stream_t s;
    stream_init(&s, "apiary/btard/dir", seed, part);
    float a = n ? (float)(1.0 / sqrt((double)n)) : 0;
    uint64_t bits = 0;
    for (size_t k = 0; k < n; k++) {
        if (k % 64 == 0) bits = stream_u64(&s);
        z[k] = (bits >> (k % 64)) & 1 ? a : -a;
    }
    sodium_memzero(&s, sizeof s);
}

void ap_btard_clip_proj(const float *x, const float *v, const float *z, size_t n, double tau,
                        double *dist, double *proj)
{
    double d2 = 0, p = 0;
    for (size_t k = 0; k < n; k++) {
        double t = (double)x[k] - (double)v[k];
        d2 += t * t;
        p += t * (double)z[k];
    }
    double d = sqrt(d2);
    *dist = d;
    *proj = d > tau ? p * (tau / d) : p;
}

bool ap_btard_proj_sum_ok(const double *proj, const double *w, size_t n, double tol)
{
    double s = 0, W = 0;
    for (size_t i = 0; i < n; i++) {
        double wi = w ? w[i] : 1.0;
        s += wi * proj[i];
        W += wi;
    }
    if (!(W > 0) || !isfinite(s)) return false;
    return fabs(s / W) <= tol;
}

void ap_btard_minibatch(const uint8_t seed[AP_BTARD_HASH_LEN], uint32_t peer, uint64_t n_examples,
                        size_t batch, uint64_t *idx)
{
    stream_t s;
    stream_init(&s, "apiary/btard/batch", seed, peer);
    for (size_t j = 0; j < batch; j++) idx[j] = n_examples ? stream_below(&s, n_examples) : 0;
}

int ap_btard_pick_validators(const uint8_t seed[AP_BTARD_HASH_LEN], size_t n, size_t k,
                             uint32_t *validators, uint32_t *targets)
{
    if (n < 2 || k > n || n > UINT32_MAX) return AP_EINVAL;
    stream_t s;
    stream_init(&s, "apiary/btard/validators", seed, 0);
    /* distinct validators by rejection; each target uniform among the others */
    for (size_t j = 0; j < k; j++) {
        uint32_t c;
        bool dup;
        do {
            c = (uint32_t)stream_below(&s, n);
            dup = false;
            for (size_t q = 0; q < j; q++) dup |= validators[q] == c;
        } while (dup);
        validators[j] = c;
        uint32_t t = (uint32_t)stream_below(&s, n - 1);
        targets[j] = t >= c ? t + 1 : t;
    }
    return 0;
}

bool ap_btard_grad_match(const float *a, const float *b, size_t n, double rtol, double atol)
{
    double e = 0, nb = 0;
    for (size_t k = 0; k < n; k++) {
        if (!isfinite(a[k]) || !isfinite(b[k])) return false;
        double t = (double)a[k] - (double)b[k];
        e += t * t;
        nb += (double)b[k] * (double)b[k];
    }
    return sqrt(e) <= atol + rtol * sqrt(nb);
}
