/* libFuzzer target: every compression decoder on untrusted bytes, both
 * header versions. The first input byte picks the destination size
 * relation, plain or accumulating decode, with or without the receiver's
 * rand-k seed, and whether to re-frame the chunk into the other header
 * version; the rest is one wire chunk. Decoding must never read or write out
 * of bounds, a successful decode must touch only its chunk's range, and a
 * re-framed chunk must decode to the same bits. With bit 5 of the first
 * byte the rest is a bare chunk (AP_COMPRESS_BARE) instead: 5 bytes say
 * what the receiver expects (codec, u16 count, k, offset; bit 6 = no rand-k
 * seed), then the payload; a successful bare decode must touch only its
 * range and equal the decode of the same payload behind a compact header. */
#include "apiary/compress.h"
#include "compress/wire.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DST_MAX (1u << 20)
#define SEED    0x5eedull

static int decode(const uint8_t *in, size_t len, uint8_t sel, float *dst, size_t n,
                  ap_compress_hdr_t *h)
{
    if (sel & 4)
        return (sel & 2) ? ap_compress_decode_add_seeded(in, len, SEED, 0.5f, dst, n, h)
                         : ap_compress_decode_seeded(in, len, SEED, dst, n, h);
    return (sel & 2) ? ap_compress_decode_add(in, len, 0.5f, dst, n, h)
                     : ap_compress_decode(in, len, dst, n, h);
}

static void fill7(float *d, size_t n)
{
    for (size_t i = 0; i < n; i++) d[i] = 7.0f;
}

static void fuzz_bare(uint8_t sel, const uint8_t *data, size_t size)
{
    if (size < 5) return;
    ap_codec_cfg_t c = {.id = (ap_codec_id_t)(data[0] % 10), .k = data[3], .seed = SEED};
    size_t count = (size_t)data[1] | (size_t)data[2] << 8, off = data[4] & 15;
    unsigned flags = AP_COMPRESS_BARE | ((sel & 64) ? AP_COMPRESS_NO_SEED : 0);
    data += 5;
    size -= 5;
    size_t n = count + off - ((sel & 1) && count + off ? 1 : 0);
    float *a = malloc((n + 2) * sizeof(float)), *b = malloc((n + 2) * sizeof(float));
    if (!a || !b) abort();
    fill7(a, n + 2);
    int rc = (sel & 2) ? ap_compress_decode_add_bare(&c, count, off, flags, data, size, 0.5f, a, n)
                       : ap_compress_decode_bare(&c, count, off, flags, data, size, a, n);
    if (a[n] != 7.0f || a[n + 1] != 7.0f) abort();
    for (size_t i = 0; i < off && i < n; i++)
        if (a[i] != 7.0f) abort(); /* wrote outside its chunk */
    if (rc == 0) {                 /* the same payload behind a compact header decodes the same */
        uint32_t param = c.id == AP_CODEC_BLOCKWISE8 ? AP_COMPRESS_BLOCK : ap_compress_k(&c, count);
        unsigned f2 = AP_COMPRESS_COMPACT | (flags & AP_COMPRESS_NO_SEED);
        uint8_t *v2 = malloc(AP_COMPRESS_V2_HDR_MAX + size);
        if (!v2) abort();
        size_t hl = ap__cw_hdr_write(v2, c.id, (uint32_t)count, off, (uint32_t)size, param, f2);
        memcpy(v2 + hl, data, size);
        fill7(b, n + 2);
        int rc2 = (sel & 2) ? ap_compress_decode_add_seeded(v2, hl + size, SEED, 0.5f, b, n, NULL)
                            : ap_compress_decode_seeded(v2, hl + size, SEED, b, n, NULL);
        if (rc2 != 0 || memcmp(a, b, (n + 2) * sizeof(float))) abort();
        free(v2);
    }
    free(a);
    free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t sel = data[0];
    data++;
    size--;
    if (sel & 32) {
        fuzz_bare(sel, data, size);
        return 0;
    }
    ap_compress_hdr_t h;
    size_t dst_count = 64;
    bool parsed = ap_compress_parse(data, size, &h) == 0;
    if (parsed) {
        /* fit the destination to the claimed chunk when it is small enough,
         * sometimes one short to exercise the range check */
        uint64_t need = h.offset + h.count;
        if (need <= DST_MAX) dst_count = (size_t)need - ((sel & 1) && need ? 1 : 0);
    }
    float *dst = malloc((dst_count + 2) * sizeof(float));
    if (!dst) return 0;
    for (size_t i = 0; i < dst_count + 2; i++) dst[i] = 7.0f;
    /* canaries at dst_count and dst_count+1 */
    int rc = decode(data, size, sel, dst, dst_count, &h);
    if (dst[dst_count] != 7.0f || dst[dst_count + 1] != 7.0f) abort();
    if (rc == 0) {
        for (size_t i = 0; i < h.offset && i < dst_count; i++)
            if (dst[i] != 7.0f) abort(); /* wrote outside its chunk */
    }
    if (parsed && (sel & 8)) {
        /* into the other version, keeping (or adding) the seed */
        unsigned flags = h.version == 1 ? AP_COMPRESS_COMPACT : 0;
        size_t cap = size + 64, olen = 0;
        uint8_t *re = malloc(cap);
        float *d2 = malloc((dst_count + 2) * sizeof(float));
        if (!re || !d2) abort();
        if (ap_compress_reframe(data, size, true, SEED, flags, re, cap, &olen) != 0) abort();
        ap_compress_hdr_t h2;
        if (ap_compress_parse(re, olen, &h2) != 0) abort();
        if (h2.count != h.count || h2.offset != h.offset || h2.param != h.param) abort();
        for (size_t i = 0; i < dst_count + 2; i++) d2[i] = 7.0f;
        int rc2 = decode(re, olen, (uint8_t)(sel | 4), d2, dst_count, NULL);
        if (rc == 0 && (rc2 != 0 || memcmp(dst, d2, (dst_count + 2) * sizeof(float)))) abort();
        free(re);
        free(d2);
    }
    free(dst);
    return 0;
}
