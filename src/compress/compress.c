/* Codecs, wire header, chunked tensors, error feedback, policies. The wire
 * format is specified in docs/compression.md. */
#include "apiary/compress.h"
#include "apiary/log.h"
#include "base/pool.h"
#include "compress/kernels.h"
#include "compress/wire.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- kernel dispatch ------------------------------------------------------ */

static const ap__kernels_t *g_best;
static _Atomic int g_force_scalar;
static pthread_once_t g_kern_once = PTHREAD_ONCE_INIT;
static void kern_init(void)
{
    const ap__kernels_t *k = ap__kernels_avx2();
    const char *env = getenv("APIARY_NO_SIMD");
    g_best = (k && !(env && *env && strcmp(env, "0") != 0)) ? k : &ap__kernels_scalar;
}
const ap__kernels_t *ap__kernels(void)
{
    pthread_once(&g_kern_once, kern_init);
    return atomic_load(&g_force_scalar) ? &ap__kernels_scalar : g_best;
}
void ap__compress_force_scalar(bool scalar)
{
    atomic_store(&g_force_scalar, scalar ? 1 : 0);
}

/* ---- names ------------------------------------------------------------------ */

static const char *const codec_names[] = {
    "none", "fp16", "bf16", "meanstd16", "uniform8", "quantile8", "blockwise8", "topk", "randk"};
_Static_assert(sizeof codec_names / sizeof codec_names[0] == AP_CODEC__COUNT,
               "one name per ap_codec_id_t");

const char *ap_codec_name(ap_codec_id_t id)
{
    return (unsigned)id < AP_CODEC__COUNT ? codec_names[id] : NULL;
}

int ap_codec_parse(const char *name, ap_codec_id_t *out)
{
    if (!name) return AP_EINVAL;
    for (int i = 0; i < AP_CODEC__COUNT; i++)
        if (!strcmp(name, codec_names[i])) {
            *out = (ap_codec_id_t)i;
            return 0;
        }
    return AP_EINVAL;
}

bool ap_codec_is_biased(ap_codec_id_t id)
{
    return id != AP_CODEC_NONE && id != AP_CODEC_RANDK;
}

/* ---- sizes ------------------------------------------------------------------ */

uint32_t ap_compress_k(const ap_codec_cfg_t *cfg, size_t count)
{
    if (!cfg || (cfg->id != AP_CODEC_TOPK && cfg->id != AP_CODEC_RANDK)) return 0;
    if (count == 0) return 0;
    size_t k;
    if (cfg->k > 0)
        k = cfg->k;
    else {
        double f = cfg->fraction > 0 && cfg->fraction <= 1 ? cfg->fraction : 0.01;
        k = (size_t)llround(f * (double)count);
        if (k < 1) k = 1;
    }
    return (uint32_t)(k > count ? count : k);
}

static uint32_t cfg_param(const ap_codec_cfg_t *cfg, size_t count)
{
    switch (cfg->id) {
    case AP_CODEC_BLOCKWISE8:
        return AP_COMPRESS_BLOCK;
    case AP_CODEC_TOPK:
    case AP_CODEC_RANDK:
        return ap_compress_k(cfg, count);
    default:
        return 0;
    }
}

size_t ap_compress_size_ex(const ap_codec_cfg_t *cfg, size_t count, uint64_t offset, unsigned flags)
{
    uint64_t p;
    if (!cfg || (unsigned)cfg->id >= AP_CODEC__COUNT || !ap__cw_flags_ok(flags)) return 0;
    uint32_t param = cfg_param(cfg, count);
    bool seed = cfg->id == AP_CODEC_RANDK && !(flags & AP_COMPRESS_NO_SEED);
    if (!ap__cw_payload_size(cfg->id, count, param, seed, &p)) return 0;
    return ap__cw_hdr_size(cfg->id, (uint32_t)count, offset, param, flags) + (size_t)p;
}

size_t ap_compress_size(const ap_codec_cfg_t *cfg, size_t count)
{
    return ap_compress_size_ex(cfg, count, 0, 0);
}

/* ---- header -------------------------------------------------------------------- */

static void put_u32(uint8_t *p, uint32_t v)
{
    memcpy(p, &v, 4);
}
static void put_u64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, 8);
}
static void put_f32(uint8_t *p, float v)
{
    memcpy(p, &v, 4);
}
static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static float get_f32(const uint8_t *p)
{
    float v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- rand-k index generator -------------------------------------------------------
 * Indices of a chunk of n elements: idx_j = (pi(j) + r) mod n for j < k, where
 * pi is a 4-round Feistel permutation of [0, 2^(2h)) restricted to [0, n) by
 * cycle walking and r is a uniform shift; both come from the seed. The shift
 * makes every index appear with probability exactly k/n over seeds. */

#define splitmix64 ap__splitmix64
#define mix64      ap__mix64

typedef struct randk_gen {
    uint64_t n, shift, key[4];
    unsigned h; /* bits per half */
    uint64_t mask;
} randk_gen_t;

static void randk_init(randk_gen_t *g, uint64_t seed, uint64_t n)
{
    uint64_t s = seed;
    g->n = n;
    unsigned bits = 1;
    while (bits < 64 && (1ull << bits) < n) bits++;
    g->h = (bits + 1) / 2;
    g->mask = (1ull << g->h) - 1;
    for (int i = 0; i < 4; i++) g->key[i] = splitmix64(&s);
    g->shift = n ? splitmix64(&s) % n : 0;
}

static inline uint64_t feistel(const randk_gen_t *g, uint64_t x)
{
    uint64_t l = x >> g->h, r = x & g->mask;
    for (int i = 0; i < 4; i++) {
        uint64_t t = l ^ (mix64(r ^ g->key[i]) & g->mask);
        l = r;
        r = t;
    }
    return (l << g->h) | r;
}

static inline uint64_t randk_index(const randk_gen_t *g, uint64_t j)
{
    if (g->n <= 1) return 0;
    uint64_t x = j;
    do x = feistel(g, x);
    while (x >= g->n);
    x += g->shift;
    return x >= g->n ? x - g->n : x;
}

uint64_t ap__randk_index(uint64_t seed, uint64_t n, uint64_t j);
uint64_t ap__randk_index(uint64_t seed, uint64_t n, uint64_t j)
{
    randk_gen_t g;
    randk_init(&g, seed, n);
    return randk_index(&g, j);
}

#define chunk_seed ap__cw_chunk_seed

/* ---- per-codec encoders ------------------------------------------------------------- */

static void stats_combine(const double s[8], const double q[8], size_t n, double *mean, double *std)
{
    double a = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    double b = ((q[0] + q[4]) + (q[1] + q[5])) + ((q[2] + q[6]) + (q[3] + q[7]));
    double m = n ? a / (double)n : 0;
    double v = n ? b / (double)n - m * m : 0;
    *mean = m;
    *std = v > 0 ? sqrt(v) : 0;
}

static float clampf_d(double v)
{
    if (v > FLT_MAX) return FLT_MAX;
    if (v < -FLT_MAX) return -FLT_MAX;
    return (float)v;
}

static int enc_meanstd(const ap__kernels_t *K, const float *src, size_t n, uint8_t *p)
{
    double s[8], q[8], mean, std;
    if (!K->stats(src, n, s, q)) return AP_ENONFINITE;
    stats_combine(s, q, n, &mean, &std);
    float fm = (float)mean, fs = clampf_d(std);
    float inv = fs > 0 ? 1.0f / fs : 0.0f;
    if (isinf(inv)) { /* std below ~3e-39: treat as constant */
        inv = 0;
        fs = 0;
    }
    put_f32(p, fm);
    put_f32(p + 4, fs);
    K->ms_enc(src, n, fm, inv, p + 8);
    return 0;
}

/* Codebook from a strided sample: entry c = mean of sampled members of bin c,
 * clamped to [lo_c, hi_c]; empty bins get the bin centre. */
static void codebook_from_sample(const float *src, size_t n, const uint8_t *codes, size_t stride,
                                 const double lo[256], const double hi[256], uint8_t *p)
{
    double sum[256] = {0};
    uint32_t cnt[256] = {0};
    for (size_t i = 0; i < n; i += stride) {
        sum[codes[i]] += src[i];
        cnt[codes[i]]++;
    }
    for (int c = 0; c < 256; c++) {
        double v = cnt[c] ? sum[c] / cnt[c] : (lo[c] + hi[c]) / 2;
        if (v < lo[c]) v = lo[c];
        if (v > hi[c]) v = hi[c];
        put_f32(p + 4 * c, clampf_d(v));
    }
}

#define CODEBOOK_SAMPLES 16384

static int enc_uniform8(const ap__kernels_t *K, const float *src, size_t n, uint8_t *p)
{
    double s[8], q[8], mean, std;
    if (!K->stats(src, n, s, q)) return AP_ENONFINITE;
    stats_combine(s, q, n, &mean, &std);
    double lo = mean - 6 * std, hi = mean + 6 * std;
    if (lo < -FLT_MAX) lo = -FLT_MAX;
    if (hi > FLT_MAX) hi = FLT_MAX;
    float flo = (float)lo;
    double w = (hi - (double)flo) / 256;
    float inv = w > 0 ? (float)(1 / w) : 0.0f;
    if (isinf(inv)) inv = 0; /* degenerate range: everything in bin 0 */
    uint8_t *codes = p + 1024;
    K->u8_codes(src, n, flo, inv, codes);
    double blo[256], bhi[256];
    for (int c = 0; c < 256; c++) {
        if (inv == 0) { /* all codes are 0; entry 0 is the sample mean */
            blo[c] = c ? flo : -FLT_MAX;
            bhi[c] = c ? flo : FLT_MAX;
        } else {
            blo[c] = (double)flo + c * w;
            bhi[c] = (double)flo + (c + 1) * w;
        }
    }
    size_t stride = n > CODEBOOK_SAMPLES ? n / CODEBOOK_SAMPLES : 1;
    codebook_from_sample(src, n, codes, stride, blo, bhi, p);
    return 0;
}

/* Radix sort of floats (sortable-key transform, 4 byte passes). */
static void sort_floats(float *a, float *tmp, size_t n)
{
    uint32_t *k = (uint32_t *)(void *)a, *t = (uint32_t *)(void *)tmp;
    for (size_t i = 0; i < n; i++) k[i] ^= (k[i] >> 31) ? 0xffffffffu : 0x80000000u;
    for (int sh = 0; sh < 32; sh += 8) {
        size_t cnt[257] = {0};
        for (size_t i = 0; i < n; i++) cnt[((k[i] >> sh) & 0xff) + 1]++;
        for (int b = 0; b < 256; b++) cnt[b + 1] += cnt[b];
        for (size_t i = 0; i < n; i++) t[cnt[(k[i] >> sh) & 0xff]++] = k[i];
        uint32_t *x = k;
        k = t;
        t = x;
    }
    /* 4 passes: the data is back in a */
    for (size_t i = 0; i < n; i++) k[i] ^= (k[i] >> 31) ? 0x80000000u : 0xffffffffu;
}

/* The quantile plan of a chunk (see kernels.h): sample quantiles
 * b_1..b_255 of a strided sample, snapped to the grid. lo and hi (256 each,
 * may be NULL) receive each code's value range: the edges of its first and
 * last cell, with code 0 reaching down to the chunk's min and code 255 up to
 * its max. Returns false for non-finite input. Exposed for tests. */
bool ap__q8_plan(const ap__kernels_t *K, const float *src, size_t n, ap__q8_plan_t *plan,
                 double *lo, double *hi, float *sample, size_t *ns);
bool ap__q8_plan(const ap__kernels_t *K, const float *src, size_t n, ap__q8_plan_t *plan,
                 double *lo, double *hi, float *sample, size_t *ns)
{
    float mn, mx;
    if (!K->minmax(src, n, &mn, &mx)) return false;
    size_t m = n < AP_COMPRESS_Q8_SAMPLE ? n : AP_COMPRESS_Q8_SAMPLE;
    float tmp[AP_COMPRESS_Q8_SAMPLE], b[256];
    for (size_t i = 0; i < m; i++) sample[i] = src[(size_t)(((uint64_t)i * n) / m)];
    sort_floats(sample, tmp, m);
    for (int c = 1; c < 256; c++) b[c] = m ? sample[((size_t)c * m) / 256] : 0.0f;
    double span = (double)b[255] - b[1];
    float ginv = span > 0 ? (float)(AP__Q8_GRID / span) : 0.0f;
    if (!(ginv > 0) || isinf(ginv)) ginv = FLT_MAX; /* degenerate: split at b1 only */
    plan->b1 = b[1];
    plan->ginv = ginv;
    int cellc[256];
    for (int c = 1; c < 256; c++) cellc[c] = ap__q8_cell(plan, b[c]);
    int c = 0; /* lut[j] = #{c : cell(b_c) <= j}; cell(b_c) is non-decreasing in c */
    for (int j = 0; j <= AP__Q8_GRID + 1; j++) {
        while (c < 255 && cellc[c + 1] <= j) c++;
        plan->lut[j] = (uint8_t)c;
    }
    if (lo && hi) {
        for (int k = 0; k < 256; k++) {
            lo[k] = INFINITY;
            hi[k] = -INFINITY;
        }
        for (int j = 0; j <= AP__Q8_GRID + 1; j++) {
            int k = plan->lut[j];
            double l = j == 0 ? mn : (double)plan->b1 + (j - 1) / (double)ginv;
            double h = j == AP__Q8_GRID + 1 ? mx : (double)plan->b1 + j / (double)ginv;
            if (l < lo[k]) lo[k] = l;
            if (h > hi[k]) hi[k] = h;
        }
        for (int k = 0; k < 256; k++) {
            if (lo[k] < mn) lo[k] = mn;
            if (hi[k] > mx) hi[k] = mx;
            if (!(hi[k] >= lo[k])) lo[k] = hi[k] = b[1]; /* unused code */
        }
    }
    *ns = m;
    return true;
}

static int enc_quantile8(const ap__kernels_t *K, const float *src, size_t n, uint8_t *p)
{
    ap__q8_plan_t plan;
    float sample[AP_COMPRESS_Q8_SAMPLE];
    double lo[256], hi[256], sum[256] = {0};
    uint32_t cnt[256] = {0};
    size_t m;
    if (!ap__q8_plan(K, src, n, &plan, lo, hi, sample, &m)) return AP_ENONFINITE;
    K->q8_codes(src, n, &plan, p + 1024);
    for (size_t i = 0; i < m; i++) {
        uint8_t c = plan.lut[ap__q8_cell(&plan, sample[i])];
        sum[c] += sample[i];
        cnt[c]++;
    }
    for (int c = 0; c < 256; c++) {
        double v = cnt[c] ? sum[c] / cnt[c] : (lo[c] + hi[c]) / 2;
        if (v < lo[c]) v = lo[c];
        if (v > hi[c]) v = hi[c];
        put_f32(p + 4 * c, clampf_d(v));
    }
    return 0;
}

static int enc_blockwise8(const ap__kernels_t *K, const float *src, size_t n, uint8_t *p)
{
    size_t nb = (n + AP_COMPRESS_BLOCK - 1) / AP_COMPRESS_BLOCK;
    uint8_t *codes = p + 4 * nb;
    for (size_t b = 0; b < nb; b++) {
        size_t o = b * AP_COMPRESS_BLOCK, m = n - o < AP_COMPRESS_BLOCK ? n - o : AP_COMPRESS_BLOCK;
        float amax;
        if (!K->absmax(src + o, m, &amax)) return AP_ENONFINITE;
        put_f32(p + 4 * b, amax);
        K->bw_codes(src + o, m, amax, codes + o);
    }
    return 0;
}

static inline uint32_t fkey(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u & 0x7fffffffu;
}

/* Top-k by exact radix selection of the k-th largest |x| (3 histogram passes,
 * no scratch), then one pass emitting indices in increasing order. */
static int enc_topk(const float *src, size_t n, uint32_t k, uint8_t *p)
{
    for (size_t i = 0; i < n; i++)
        if (fkey(src[i]) >= 0x7f800000u) return AP_ENONFINITE;
    uint8_t *pi = p, *pv = p + 4 * (size_t)k;
    if (k == 0) return 0;
    static const int shifts[3] = {20, 9, 0};
    static const uint32_t widths[3] = {11, 11, 9};
    uint32_t prefix = 0, pmask = 0;
    size_t need = k; /* how many still to take among keys matching the prefix */
    uint32_t hist[2048];
    for (int pass = 0; pass < 3; pass++) {
        uint32_t nb = 1u << widths[pass];
        memset(hist, 0, sizeof hist);
        for (size_t i = 0; i < n; i++) {
            uint32_t key = fkey(src[i]);
            if ((key & pmask) == prefix) hist[(key >> shifts[pass]) & (nb - 1)]++;
        }
        uint32_t b = nb;
        while (b-- > 0) {
            if (hist[b] >= need) break;
            need -= hist[b];
        }
        prefix |= b << shifts[pass];
        pmask |= (nb - 1) << shifts[pass];
    }
    uint32_t T = prefix; /* the k-th largest key; take `need` of the keys == T */
    size_t out = 0;
    for (size_t i = 0; i < n && out < k; i++) {
        uint32_t key = fkey(src[i]);
        if (key > T || (key == T && need > 0)) {
            if (key == T) need--;
            put_u32(pi + 4 * out, (uint32_t)i);
            put_f32(pv + 4 * out, src[i]);
            out++;
        }
    }
    return out == k ? 0 : AP_EINVAL; /* cannot happen: defensive */
}

/* The values (after the seed when with_seed). */
static int enc_randk(const float *src, size_t n, uint32_t k, uint64_t seed, bool with_seed,
                     uint8_t *p)
{
    if (with_seed) {
        put_u64(p, seed);
        p += 8;
    }
    randk_gen_t g;
    randk_init(&g, seed, n);
    for (uint32_t j = 0; j < k; j++) {
        float v = src[randk_index(&g, j)];
        if (!(fabsf(v) <= FLT_MAX)) return AP_ENONFINITE;
        put_f32(p + 4 * (size_t)j, v);
    }
    return 0;
}

static int encode_with(const ap__kernels_t *K, const ap_codec_cfg_t *cfg, const float *src,
                       size_t count, uint64_t offset, unsigned flags, uint8_t *out, size_t cap,
                       size_t *out_len)
{
    if (!cfg || (!src && count) || !out || (unsigned)cfg->id >= AP_CODEC__COUNT) return AP_EINVAL;
    if (count > AP_COMPRESS_MAX_COUNT || !ap__cw_flags_ok(flags)) return AP_EINVAL;
    if (offset > UINT64_MAX - count) return AP_EINVAL;
    size_t total = ap_compress_size_ex(cfg, count, offset, flags);
    if (!total) return AP_EINVAL;
    if (cap < total) return AP_EMSGSIZE;
    uint32_t param = cfg_param(cfg, count);
    size_t hl = ap__cw_hdr_size(cfg->id, (uint32_t)count, offset, param, flags);
    uint8_t *p = out + hl;
    int rc = 0;
    switch (cfg->id) {
    case AP_CODEC_NONE:
        memcpy(p, src, 4 * count);
        break;
    case AP_CODEC_FP16:
        K->f16_enc(src, count, p);
        break;
    case AP_CODEC_BF16:
        K->bf16_enc(src, count, p);
        break;
    case AP_CODEC_MEANSTD16:
        rc = enc_meanstd(K, src, count, p);
        break;
    case AP_CODEC_UNIFORM8:
        rc = enc_uniform8(K, src, count, p);
        break;
    case AP_CODEC_QUANTILE8:
        rc = enc_quantile8(K, src, count, p);
        break;
    case AP_CODEC_BLOCKWISE8:
        rc = enc_blockwise8(K, src, count, p);
        break;
    case AP_CODEC_TOPK:
        rc = enc_topk(src, count, param, p);
        break;
    case AP_CODEC_RANDK:
        rc = enc_randk(src, count, param, chunk_seed(cfg->seed, offset),
                       !(flags & AP_COMPRESS_NO_SEED), p);
        break;
    default:
        return AP_EINVAL;
    }
    if (rc) return rc;
    ap__cw_hdr_write(out, cfg->id, (uint32_t)count, offset, (uint32_t)(total - hl), param, flags);
    if (out_len) *out_len = total;
    return 0;
}

int ap_compress_encode(const ap_codec_cfg_t *cfg, const float *src, size_t count, uint64_t offset,
                       uint8_t *out, size_t cap, size_t *out_len)
{
    return encode_with(ap__kernels(), cfg, src, count, offset, 0, out, cap, out_len);
}

int ap_compress_encode_ex(const ap_codec_cfg_t *cfg, const float *src, size_t count,
                          uint64_t offset, unsigned flags, uint8_t *out, size_t cap,
                          size_t *out_len)
{
    return encode_with(ap__kernels(), cfg, src, count, offset, flags, out, cap, out_len);
}

/* ---- decoders ------------------------------------------------------------------------- */

static bool all_finite(const uint8_t *p, size_t nfloats)
{
    for (size_t i = 0; i < nfloats; i++)
        if (!(fabsf(get_f32(p + 4 * i)) <= FLT_MAX)) return false;
    return true;
}

static int decode_body(const ap_compress_hdr_t *hp, const uint8_t *p, const uint64_t *seed,
                       float *dst, size_t dst_count, ap__dmode_t m);

/* seed: the sender's cfg->seed for a chunk without its seed (NULL: unknown). */
static int decode_impl(const uint8_t *in, size_t len, const uint64_t *seed, float *dst,
                       size_t dst_count, ap_compress_hdr_t *hdr_out, ap__dmode_t m)
{
    ap_compress_hdr_t h;
    int rc = ap_compress_parse(in, len, &h);
    if (rc) {
        ap_log(AP_LOG_DEBUG, "compress", "rejected chunk: %s", ap_err_name(rc));
        return rc;
    }
    rc = decode_body(&h, in + h.hdr_len, seed, dst, dst_count, m);
    if (!rc && hdr_out) *hdr_out = h;
    return rc;
}

/* A bare chunk: the header comes from what the receiver expects. */
static int decode_bare(const ap_codec_cfg_t *cfg, size_t count, uint64_t offset, unsigned flags,
                       const uint8_t *in, size_t len, float *dst, size_t dst_count, ap__dmode_t m)
{
    if (!cfg || (unsigned)cfg->id >= AP_CODEC__COUNT || !(flags & AP_COMPRESS_BARE) ||
        !ap__cw_flags_ok(flags) || count > AP_COMPRESS_MAX_COUNT || offset > UINT64_MAX - count)
        return AP_EINVAL;
    if (!in && len) return AP_EINVAL;
    uint32_t param = cfg_param(cfg, count);
    bool seed = cfg->id == AP_CODEC_RANDK && !(flags & AP_COMPRESS_NO_SEED);
    uint64_t want;
    if (!ap__cw_payload_size(cfg->id, count, param, seed, &want)) return AP_EINVAL;
    if (len != want) return AP_ECORRUPT;
    ap_compress_hdr_t h = {.codec = cfg->id,
                           .count = (uint32_t)count,
                           .offset = offset,
                           .payload_len = (uint32_t)want,
                           .param = param,
                           .version = 0,
                           .hdr_len = 0,
                           .has_seed = seed};
    return decode_body(&h, in, &cfg->seed, dst, dst_count, m);
}

int ap_compress_decode_bare(const ap_codec_cfg_t *cfg, size_t count, uint64_t offset,
                            unsigned flags, const uint8_t *in, size_t len, float *dst,
                            size_t dst_count)
{
    return decode_bare(cfg, count, offset, flags, in, len, dst, dst_count,
                       (ap__dmode_t){.add = false, .alpha = 1});
}

int ap_compress_decode_add_bare(const ap_codec_cfg_t *cfg, size_t count, uint64_t offset,
                                unsigned flags, const uint8_t *in, size_t len, float alpha,
                                float *dst, size_t dst_count)
{
    return decode_bare(cfg, count, offset, flags, in, len, dst, dst_count,
                       (ap__dmode_t){.add = true, .alpha = alpha});
}

/* The payload p of the chunk h (validated), into dst. */
static int decode_body(const ap_compress_hdr_t *hp, const uint8_t *p, const uint64_t *seed,
                       float *dst, size_t dst_count, ap__dmode_t m)
{
    ap_compress_hdr_t h = *hp;
    if (h.codec == AP_CODEC_RANDK && !h.has_seed && !seed) return AP_EPROTO;
    if (h.offset > dst_count || h.count > dst_count - h.offset) return AP_ERANGE;
    if (!dst && h.count) return AP_EINVAL;
    const ap__kernels_t *K = ap__kernels();
    float *d = dst + h.offset;
    size_t n = h.count;
    switch (h.codec) {
    case AP_CODEC_NONE:
        if (!m.add)
            memcpy(d, p, 4 * n);
        else
            for (size_t i = 0; i < n; i++) d[i] += m.alpha * get_f32(p + 4 * i);
        break;
    case AP_CODEC_FP16:
        K->f16_dec(p, n, d, m);
        break;
    case AP_CODEC_BF16:
        K->bf16_dec(p, n, d, m);
        break;
    case AP_CODEC_MEANSTD16: {
        float mean = get_f32(p), std = get_f32(p + 4);
        if (!all_finite(p, 2) || std < 0) return AP_ECORRUPT;
        K->ms_dec(p + 8, n, mean, std, d, m);
        break;
    }
    case AP_CODEC_UNIFORM8:
    case AP_CODEC_QUANTILE8: {
        if (!all_finite(p, 256)) return AP_ECORRUPT;
        float table[256];
        memcpy(table, p, sizeof table);
        K->lut_dec(p + 1024, n, table, d, m);
        break;
    }
    case AP_CODEC_BLOCKWISE8: {
        size_t B = h.param, nb = (n + B - 1) / B;
        if (!all_finite(p, nb)) return AP_ECORRUPT;
        for (size_t b = 0; b < nb; b++)
            if (get_f32(p + 4 * b) < 0) return AP_ECORRUPT;
        const float *mag = ap__bw_mag();
        const uint8_t *codes = p + 4 * nb;
        for (size_t b = 0; b < nb; b++) {
            float a = get_f32(p + 4 * b), table[256];
            for (int c = 0; c < 128; c++) {
                table[c] = mag[c] * a;
                table[c + 128] = -(mag[c] * a);
            }
            size_t o = b * B, cnt = n - o < B ? n - o : B;
            K->lut_dec(codes + o, cnt, table, d + o, m);
        }
        break;
    }
    case AP_CODEC_TOPK: {
        size_t k = h.param;
        const uint8_t *pi = p, *pv = p + 4 * k;
        uint32_t prev = 0;
        for (size_t j = 0; j < k; j++) {
            uint32_t ix = get_u32(pi + 4 * j);
            if (ix >= n || (j > 0 && ix <= prev)) return AP_ECORRUPT;
            prev = ix;
        }
        if (!all_finite(pv, k)) return AP_ECORRUPT;
        if (!m.add) memset(d, 0, 4 * n);
        for (size_t j = 0; j < k; j++) {
            float v = get_f32(pv + 4 * j);
            float *t = d + get_u32(pi + 4 * j);
            *t = m.add ? *t + m.alpha * v : v;
        }
        break;
    }
    case AP_CODEC_RANDK: {
        size_t k = h.param;
        uint64_t cs = h.has_seed ? get_u64(p) : chunk_seed(*seed, h.offset);
        const uint8_t *pv = h.has_seed ? p + 8 : p;
        if (!all_finite(pv, k)) return AP_ECORRUPT;
        randk_gen_t g;
        randk_init(&g, cs, n);
        float scale = k ? (float)((double)n / (double)k) : 0.0f;
        if (!m.add) memset(d, 0, 4 * n);
        for (size_t j = 0; j < k; j++) {
            float v = get_f32(pv + 4 * j) * scale;
            float *t = d + randk_index(&g, j);
            *t = m.add ? *t + m.alpha * v : v;
        }
        break;
    }
    default:
        return AP_ENOTSUP;
    }
    return 0;
}

int ap_compress_decode(const uint8_t *in, size_t len, float *dst, size_t dst_count,
                       ap_compress_hdr_t *hdr)
{
    return decode_impl(in, len, NULL, dst, dst_count, hdr, (ap__dmode_t){.add = false, .alpha = 1});
}

int ap_compress_decode_add(const uint8_t *in, size_t len, float alpha, float *dst, size_t dst_count,
                           ap_compress_hdr_t *hdr)
{
    return decode_impl(in, len, NULL, dst, dst_count, hdr,
                       (ap__dmode_t){.add = true, .alpha = alpha});
}

int ap_compress_decode_seeded(const uint8_t *in, size_t len, uint64_t seed, float *dst,
                              size_t dst_count, ap_compress_hdr_t *hdr)
{
    return decode_impl(in, len, &seed, dst, dst_count, hdr,
                       (ap__dmode_t){.add = false, .alpha = 1});
}

int ap_compress_decode_add_seeded(const uint8_t *in, size_t len, uint64_t seed, float alpha,
                                  float *dst, size_t dst_count, ap_compress_hdr_t *hdr)
{
    return decode_impl(in, len, &seed, dst, dst_count, hdr,
                       (ap__dmode_t){.add = true, .alpha = alpha});
}

/* Internal: encode with an explicit kernel set (tests compare fast vs scalar). */
int ap__compress_encode_k(const ap__kernels_t *K, const ap_codec_cfg_t *cfg, const float *src,
                          size_t count, uint64_t offset, uint8_t *out, size_t cap, size_t *out_len);
int ap__compress_encode_k(const ap__kernels_t *K, const ap_codec_cfg_t *cfg, const float *src,
                          size_t count, uint64_t offset, uint8_t *out, size_t cap, size_t *out_len)
{
    return encode_with(K, cfg, src, count, offset, 0, out, cap, out_len);
}

/* ---- tensors -------------------------------------------------------------------------- */

size_t ap_compress_nchunks(size_t n, size_t chunk)
{
    if (chunk == 0) chunk = AP_COMPRESS_CHUNK_DEFAULT;
    return (n + chunk - 1) / chunk;
}

typedef struct tensor_job {
    const ap_codec_cfg_t *cfg;
    const float *src;
    size_t n, chunk, slot, cap;
    uint8_t *out;
    size_t *lens;
    const uint8_t *const *msgs;
    const size_t *clens;
    float *dst;
    _Atomic int rc;
} tensor_job_t;

static void set_rc(tensor_job_t *j, int rc)
{
    int z = 0;
    if (rc) atomic_compare_exchange_strong(&j->rc, &z, rc);
}

static void enc_range(void *arg, size_t b, size_t e)
{
    tensor_job_t *j = arg;
    for (size_t i = b; i < e; i++) {
        size_t o = i * j->chunk, cnt = j->n - o < j->chunk ? j->n - o : j->chunk;
        size_t at = i * j->slot;
        if (at > j->cap) {
            set_rc(j, AP_EMSGSIZE);
            continue;
        }
        set_rc(j, ap_compress_encode(j->cfg, j->src + o, cnt, o, j->out + at, j->cap - at,
                                     &j->lens[i]));
    }
}

int ap_compress_encode_tensor(const ap_codec_cfg_t *cfg, const float *src, size_t n, size_t chunk,
                              uint8_t *out, size_t cap, size_t *lens)
{
    if (chunk == 0) chunk = AP_COMPRESS_CHUNK_DEFAULT;
    if (chunk > AP_COMPRESS_MAX_COUNT || !cfg || !lens) return AP_EINVAL;
    size_t nc = ap_compress_nchunks(n, chunk);
    tensor_job_t j = {.cfg = cfg,
                      .src = src,
                      .n = n,
                      .chunk = chunk,
                      .out = out,
                      .cap = cap,
                      .lens = lens,
                      .slot = ap_compress_size(cfg, chunk)};
    if (!j.slot) return AP_EINVAL;
    if (nc && (nc - 1) * j.slot + ap_compress_size(cfg, n - (nc - 1) * chunk) > cap)
        return AP_EMSGSIZE;
    atomic_init(&j.rc, 0);
    ap__pool_parallel_for(nc > 1 ? ap__pool_global() : NULL, nc, 1, enc_range, &j);
    return atomic_load(&j.rc);
}

static void dec_range(void *arg, size_t b, size_t e)
{
    tensor_job_t *j = arg;
    for (size_t i = b; i < e; i++)
        set_rc(j, ap_compress_decode(j->msgs[i], j->clens[i], j->dst, j->n, NULL));
}

int ap_compress_decode_tensor(const uint8_t *const *msgs, const size_t *lens, size_t nchunks,
                              float *dst, size_t n)
{
    if (!msgs || !lens) return AP_EINVAL;
    tensor_job_t j = {.msgs = msgs, .clens = lens, .dst = dst, .n = n};
    atomic_init(&j.rc, 0);
    ap__pool_parallel_for(nchunks > 1 ? ap__pool_global() : NULL, nchunks, 1, dec_range, &j);
    return atomic_load(&j.rc);
}

/* ---- error feedback --------------------------------------------------------------------- */

struct ap_compress_ef {
    size_t n;
    float *e;   /* residual */
    float *tmp; /* x + e for the chunk being encoded */
};

ap_compress_ef_t *ap_compress_ef_new(size_t n)
{
    ap_compress_ef_t *ef = calloc(1, sizeof *ef);
    if (!ef) return NULL;
    ef->n = n;
    ef->e = calloc(n ? n : 1, sizeof(float));
    ef->tmp = calloc(n ? n : 1, sizeof(float));
    if (!ef->e || !ef->tmp) {
        ap_compress_ef_free(ef);
        return NULL;
    }
    return ef;
}

void ap_compress_ef_free(ap_compress_ef_t *ef)
{
    if (!ef) return;
    free(ef->e);
    free(ef->tmp);
    free(ef);
}

void ap_compress_ef_reset(ap_compress_ef_t *ef)
{
    if (ef) memset(ef->e, 0, ef->n * sizeof(float));
}

const float *ap_compress_ef_residual(const ap_compress_ef_t *ef)
{
    return ef ? ef->e : NULL;
}

int ap_compress_ef_encode(ap_compress_ef_t *ef, const ap_codec_cfg_t *cfg, const float *src,
                          size_t count, uint64_t offset, uint8_t *out, size_t cap, size_t *out_len)
{
    return ap_compress_ef_encode_ex(ef, cfg, src, count, offset, 0, out, cap, out_len);
}

int ap_compress_ef_encode_ex(ap_compress_ef_t *ef, const ap_codec_cfg_t *cfg, const float *src,
                             size_t count, uint64_t offset, unsigned flags, uint8_t *out,
                             size_t cap, size_t *out_len)
{
    if (!ef || !cfg || (!src && count)) return AP_EINVAL;
    if (offset > ef->n || count > ef->n - offset) return AP_ERANGE;
    float *e = ef->e + offset, *t = ef->tmp + offset;
    for (size_t i = 0; i < count; i++) t[i] = src[i] + e[i];
    size_t len;
    int rc = ap_compress_encode_ex(cfg, t, count, offset, flags, out, cap, &len);
    if (rc) return rc;
    /* decode what was sent into the residual slot, then e = (x + e) - sent */
    rc = (flags & AP_COMPRESS_BARE)
             ? ap_compress_decode_bare(cfg, count, offset, flags, out, len, ef->e, ef->n)
             : ap_compress_decode_seeded(out, len, cfg->seed, ef->e, ef->n, NULL);
    if (rc) return rc;
    for (size_t i = 0; i < count; i++) e[i] = t[i] - e[i];
    if (out_len) *out_len = len;
    return 0;
}

/* ---- policies ---------------------------------------------------------------------------- */

#define POLICY_NAME_MAX 128
typedef struct policy_rule {
    char name[POLICY_NAME_MAX];
    ap_codec_cfg_t cfg;
    bool ef;
} policy_rule_t;

struct ap_compress_policy {
    ap_codec_cfg_t role[AP_ROLE__COUNT];
    bool role_ef[AP_ROLE__COUNT];
    size_t small_below;
    policy_rule_t *rules;
    size_t nrules, cap;
};

ap_compress_policy_t *ap_compress_policy_new(void)
{
    ap_compress_policy_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->role[AP_ROLE_GRADIENT] = (ap_codec_cfg_t){.id = AP_CODEC_BLOCKWISE8};
    p->role_ef[AP_ROLE_GRADIENT] = true;
    p->role[AP_ROLE_PARAMETER] = (ap_codec_cfg_t){.id = AP_CODEC_FP16};
    p->role[AP_ROLE_OPTIMIZER_STATE] = (ap_codec_cfg_t){.id = AP_CODEC_BLOCKWISE8};
    p->role[AP_ROLE_ACTIVATION] = (ap_codec_cfg_t){.id = AP_CODEC_FP16};
    p->small_below = 4096;
    return p;
}

void ap_compress_policy_free(ap_compress_policy_t *p)
{
    if (!p) return;
    free(p->rules);
    free(p);
}

void ap_compress_policy_set_role(ap_compress_policy_t *p, ap_tensor_role_t role,
                                 const ap_codec_cfg_t *cfg, bool error_feedback)
{
    if (!p || !cfg || (unsigned)role >= AP_ROLE__COUNT) return;
    p->role[role] = *cfg;
    p->role_ef[role] = error_feedback;
}

void ap_compress_policy_set_small(ap_compress_policy_t *p, size_t small_below)
{
    if (p) p->small_below = small_below;
}

int ap_compress_policy_set_tensor(ap_compress_policy_t *p, const char *name,
                                  const ap_codec_cfg_t *cfg, bool error_feedback)
{
    if (!p || !name || !cfg || strlen(name) >= POLICY_NAME_MAX) return AP_EINVAL;
    for (size_t i = 0; i < p->nrules; i++)
        if (!strcmp(p->rules[i].name, name)) {
            p->rules[i].cfg = *cfg;
            p->rules[i].ef = error_feedback;
            return 0;
        }
    if (p->nrules == p->cap) {
        size_t nc = p->cap ? 2 * p->cap : 8;
        policy_rule_t *r = realloc(p->rules, nc * sizeof *r);
        if (!r) return AP_ENOMEM;
        p->rules = r;
        p->cap = nc;
    }
    policy_rule_t *r = &p->rules[p->nrules++];
    memset(r, 0, sizeof *r);
    strcpy(r->name, name);
    r->cfg = *cfg;
    r->ef = error_feedback;
    return 0;
}

ap_codec_cfg_t ap_compress_policy_pick(const ap_compress_policy_t *p, const char *name,
                                       ap_tensor_role_t role, size_t n, bool *error_feedback)
{
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    bool ef = false;
    ap_codec_cfg_t r = none;
    if (!p) goto out;
    if (name)
        for (size_t i = 0; i < p->nrules; i++)
            if (!strcmp(p->rules[i].name, name)) {
                r = p->rules[i].cfg;
                ef = p->rules[i].ef;
                goto out;
            }
    if (n < p->small_below || (unsigned)role >= AP_ROLE__COUNT) goto out;
    r = p->role[role];
    ef = p->role_ef[role];
out:
    if (error_feedback) *error_feedback = ef && ap_codec_is_biased(r.id);
    return r;
}
