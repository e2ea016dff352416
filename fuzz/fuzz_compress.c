/* libFuzzer target: every compression decoder on untrusted bytes. The first
 * input byte picks the destination size relation; the rest is one wire chunk.
 * Decoding must never read or write out of bounds, and a successful decode
 * must touch only its chunk's range. */
#include "apiary/compress.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DST_MAX (1u << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t sel = data[0];
    data++;
    size--;
    ap_compress_hdr_t h;
    size_t dst_count = 64;
    if (ap_compress_parse(data, size, &h) == 0) {
        /* fit the destination to the claimed chunk when it is small enough,
         * sometimes one short to exercise the range check */
        uint64_t need = h.offset + h.count;
        if (need <= DST_MAX) dst_count = (size_t)need - ((sel & 1) && need ? 1 : 0);
    }
    float *dst = malloc((dst_count + 2) * sizeof(float));
    if (!dst) return 0;
    for (size_t i = 0; i < dst_count + 2; i++) dst[i] = 7.0f;
    /* canaries at dst_count and dst_count+1 */
    int rc = (sel & 2) ? ap_compress_decode_add(data, size, 0.5f, dst, dst_count, &h)
                       : ap_compress_decode(data, size, dst, dst_count, &h);
    if (dst[dst_count] != 7.0f || dst[dst_count + 1] != 7.0f) abort();
    if (rc == 0) {
        for (size_t i = 0; i < h.offset && i < dst_count; i++)
            if (dst[i] != 7.0f) abort(); /* wrote outside its chunk */
    }
    free(dst);
    return 0;
}
