#include "base/varint.h"
#include "apiary/error.h"

size_t ap__uvarint_put(uint8_t *out, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        out[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    out[n++] = (uint8_t)v;
    return n;
}

size_t ap__uvarint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

int ap__uvarint_get(const uint8_t *in, size_t len, uint64_t *out)
{
    uint64_t v = 0;
    for (size_t i = 0; i < len && i < AP_UVARINT_MAX; i++) {
        uint8_t b = in[i];
        if (i == 9 && b > 1) return AP_ECORRUPT; /* overflows 64 bits */
        v |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            if (b == 0 && i > 0) return AP_ECORRUPT; /* non-minimal */
            *out = v;
            return (int)(i + 1);
        }
    }
    return AP_ECORRUPT;
}

int ap__mf_uvarint_get(const uint8_t *in, size_t len, uint64_t *out)
{
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++) {
        if (i == AP_MF_UVARINT_MAX) return AP_ECORRUPT;
        uint8_t b = in[i];
        v |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            if (b == 0 && i > 0) return AP_ECORRUPT; /* non-minimal */
            *out = v;
            return (int)(i + 1);
        }
    }
    return len >= AP_MF_UVARINT_MAX ? AP_ECORRUPT : AP_EAGAIN;
}
