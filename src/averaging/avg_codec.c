#include "averaging/avg_codec.h"

#include "apiary/avg.h"

#include "apiary/compress.h"
#include "apiary/error.h"
#include "compress/kernels.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

static size_t f32_size(uint32_t n)
{
    return (size_t)n * 4;
}

static int f32_encode(const float *x, uint32_t n, uint8_t *out)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(out, x, (size_t)n * 4);
#else
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, &x[i], 4);
        out[4 * i] = (uint8_t)v;
        out[4 * i + 1] = (uint8_t)(v >> 8);
        out[4 * i + 2] = (uint8_t)(v >> 16);
        out[4 * i + 3] = (uint8_t)(v >> 24);
    }
#endif
    return 0;
}

/* Whether any of the n floats at p (any alignment) is Inf or NaN: the
 * vectorised check of the compress kernels (it runs over every byte of a
 * round). */
static bool any_nonfinite(const uint8_t *p, size_t n)
{
    return !ap__kernels()->all_finite(p, n);
}

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static int f32_check_raw(const uint8_t *in, size_t len, uint32_t n)
{
    if (len != (size_t)n * 4) return AP_ECORRUPT;
    return any_nonfinite(in, n) ? AP_ENONFINITE : 0;
}

static int f32_decode(const uint8_t *in, size_t len, uint32_t n, float *out)
{
    int rc = f32_check_raw(in, len, n);
    if (rc == AP_ECORRUPT) return rc;
    memcpy(out, in, (size_t)n * 4);
    return rc;
}
#define F32_CHECK_RAW f32_check_raw
#else
static int f32_decode(const uint8_t *in, size_t len, uint32_t n, float *out)
{
    if (len != (size_t)n * 4) return AP_ECORRUPT;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)in[4 * i] | ((uint32_t)in[4 * i + 1] << 8) |
                     ((uint32_t)in[4 * i + 2] << 16) | ((uint32_t)in[4 * i + 3] << 24);
        memcpy(&out[i], &v, 4);
    }
    return any_nonfinite((const uint8_t *)out, n) ? AP_ENONFINITE : 0;
}
#define F32_CHECK_RAW NULL
#endif

/* compress-module codecs: the chunk is one compress message (its own header,
 * offset 0); the decoder checks codec, count and offset, then finiteness. */
static bool finite_all(const float *x, uint32_t n)
{
    return !any_nonfinite((const uint8_t *)x, n);
}

#define CX(name, cid)                                                                              \
    static size_t name##_size(uint32_t n)                                                          \
    {                                                                                              \
        ap_codec_cfg_t cfg = {.id = cid};                                                          \
        return ap_compress_size(&cfg, n);                                                          \
    }                                                                                              \
    static int name##_encode(const float *x, uint32_t n, uint8_t *out)                             \
    {                                                                                              \
        ap_codec_cfg_t cfg = {.id = cid};                                                          \
        size_t len;                                                                                \
        return ap_compress_encode(&cfg, x, n, 0, out, ap_compress_size(&cfg, n), &len);            \
    }                                                                                              \
    static int name##_decode(const uint8_t *in, size_t len, uint32_t n, float *out)                \
    {                                                                                              \
        ap_compress_hdr_t h;                                                                       \
        if (ap_compress_parse(in, len, &h) || h.codec != cid || h.count != n || h.offset != 0)     \
            return AP_ECORRUPT;                                                                    \
        if (ap_compress_decode(in, len, out, n, NULL)) return AP_ECORRUPT;                         \
        return finite_all(out, n) ? 0 : AP_ENONFINITE;                                             \
    }

CX(fp16, AP_CODEC_FP16)
CX(bf16, AP_CODEC_BF16)
CX(uniform8, AP_CODEC_UNIFORM8)
CX(blockwise8, AP_CODEC_BLOCKWISE8)

/* The averaging codec ids are the compression codec ids (one wire space). */
_Static_assert(AP_AVG_CODEC_F32 == (int)AP_CODEC_NONE, "codec ids agree");
_Static_assert(AP_AVG_CODEC_FP16 == (int)AP_CODEC_FP16, "codec ids agree");
_Static_assert(AP_AVG_CODEC_BF16 == (int)AP_CODEC_BF16, "codec ids agree");
_Static_assert(AP_AVG_CODEC_UNIFORM8 == (int)AP_CODEC_UNIFORM8, "codec ids agree");
_Static_assert(AP_AVG_CODEC_BLOCKWISE8 == (int)AP_CODEC_BLOCKWISE8, "codec ids agree");

static const ap__avg_codec_t codecs[] = {
    {AP_AVG_CODEC_F32, "none", f32_size, f32_encode, f32_decode, F32_CHECK_RAW},
    {AP_AVG_CODEC_FP16, "fp16", fp16_size, fp16_encode, fp16_decode, NULL},
    {AP_AVG_CODEC_BF16, "bf16", bf16_size, bf16_encode, bf16_decode, NULL},
    {AP_AVG_CODEC_UNIFORM8, "uniform8", uniform8_size, uniform8_encode, uniform8_decode, NULL},
    {AP_AVG_CODEC_BLOCKWISE8, "blockwise8", blockwise8_size, blockwise8_encode, blockwise8_decode,
     NULL},
};

const ap__avg_codec_t *ap__avg_codec_get(uint32_t id)
{
    for (size_t i = 0; i < sizeof codecs / sizeof codecs[0]; i++)
        if (codecs[i].id == id) return &codecs[i];
    return NULL;
}
