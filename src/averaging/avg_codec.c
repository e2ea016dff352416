#include "averaging/avg_codec.h"

#include "apiary/error.h"

#include <math.h>
#include <string.h>

static size_t f32_size(uint32_t n)
{
    return (size_t)n * 4;
}

static void f32_encode(const float *x, uint32_t n, uint8_t *out)
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
}

static int f32_decode(const uint8_t *in, size_t len, uint32_t n, float *out)
{
    if (len != (size_t)n * 4) return AP_ECORRUPT;
    int bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)in[4 * i] | ((uint32_t)in[4 * i + 1] << 8) |
                     ((uint32_t)in[4 * i + 2] << 16) | ((uint32_t)in[4 * i + 3] << 24);
        bad |= (v & 0x7f800000u) == 0x7f800000u; /* exponent all ones: Inf or NaN */
        memcpy(&out[i], &v, 4);
    }
    return bad ? AP_ENONFINITE : 0;
}

static const ap__avg_codec_t codecs[] = {
    {0, "none", f32_size, f32_encode, f32_decode},
};

const ap__avg_codec_t *ap__avg_codec_get(uint32_t id)
{
    for (size_t i = 0; i < sizeof codecs / sizeof codecs[0]; i++)
        if (codecs[i].id == id) return &codecs[i];
    return NULL;
}
