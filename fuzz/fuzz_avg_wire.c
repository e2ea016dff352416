/* Fuzz target: the averaging wire decoders (stream hello, chunk frames, and
 * the float32 chunk codec). First byte selects the decoder. */
#include "averaging/allreduce.h"
#include "averaging/avg_codec.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const uint8_t *b = data + 1;
    size_t n = size - 1;
    switch (data[0] % 3) {
    case 0: {
        ap__avg_hello_t h;
        if (ap__avg_hello_decode(b, n, &h) == 0) {
            if (h.offset + h.count > h.total || h.chunk_elems == 0 || !(h.weight > 0)) abort();
            uint8_t out[AP__AVG_HELLO_MAX];
            size_t len = ap__avg_hello_encode(&h, out);
            ap__avg_hello_t h2;
            if (!len || ap__avg_hello_decode(out, len, &h2) || memcmp(&h, &h2, sizeof h)) abort();
        }
        break;
    }
    case 1: {
        ap__avg_frame_t f;
        if (ap__avg_frame_parse(b, n, &f) == 0) {
            if (f.payload + f.payload_len != b + n) abort();
            const ap__avg_codec_t *c = ap__avg_codec_get(f.codec);
            if (c && f.elems <= 4096) {
                float *x = malloc((size_t)f.elems * sizeof(float) + 1);
                int rc = c->decode(f.payload, f.payload_len, f.elems, x);
                if (rc == 0)
                    for (uint32_t i = 0; i < f.elems; i++)
                        if (!isfinite(x[i])) abort();
                free(x);
            }
        }
        break;
    }
    default: {
        const ap__avg_codec_t *c = ap__avg_codec_get(0);
        uint32_t elems = (uint32_t)(n / 4);
        float *x = malloc((size_t)elems * sizeof(float) + 1);
        if (c->decode(b, n, elems, x) == 0 && n % 4) abort(); /* size must be exact */
        free(x);
        break;
    }
    }
    return 0;
}
