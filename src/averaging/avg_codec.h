/* The chunk codec seam of the all-reduce: raw little-endian float32, and the
 * fixed-size codecs of the compress module (apiary/compress.h). */
#ifndef AP_AVERAGING_AVG_CODEC_H
#define AP_AVERAGING_AVG_CODEC_H

#include <stddef.h>
#include <stdint.h>

typedef struct ap__avg_codec {
    uint8_t id;
    const char *name;
    /* Encoded bytes of n elements (exact; the decoder checks it). */
    size_t (*size)(uint32_t n);
    /* Writes exactly size(n) bytes; 0 or an AP_E* code. */
    int (*encode)(const float *x, uint32_t n, uint8_t *out);
    /* Decodes exactly n elements from len bytes; AP_ECORRUPT on a size
     * mismatch, AP_ENONFINITE if a value is NaN or infinite. */
    int (*decode)(const uint8_t *in, size_t len, uint32_t n, float *out);
    /* Non-NULL when the payload IS n host-order float32 values (raw float32
     * on a little-endian host): checks size and finiteness as decode would
     * (same return codes) without copying, so the caller may read the
     * values from the payload in place. */
    int (*check_raw)(const uint8_t *in, size_t len, uint32_t n);
} ap__avg_codec_t;

/* Element i of a payload that check_raw accepted. */
static inline float ap__avg_raw_get(const uint8_t *in, size_t i)
{
    float v;
    __builtin_memcpy(&v, in + 4 * i, 4);
    return v;
}

/* NULL if the id is unknown. */
const ap__avg_codec_t *ap__avg_codec_get(uint32_t id);

#endif
