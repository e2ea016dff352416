#include "base/codec.h"
#include "apiary/error.h"

#include <string.h>

static const char hexdig[] = "0123456789abcdef";

char *ap__hex_encode(char *out, const uint8_t *in, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hexdig[in[i] >> 4];
        out[2 * i + 1] = hexdig[in[i] & 15];
    }
    out[2 * n] = 0;
    return out;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int ap__hex_decode(uint8_t *out, size_t cap, const char *in)
{
    size_t n = strlen(in);
    if (n % 2) return AP_EINVAL;
    if (n / 2 > cap) return AP_ERANGE;
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(in[2 * i]), lo = hexval(in[2 * i + 1]);
        if (hi < 0 || lo < 0) return AP_EINVAL;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return (int)(n / 2);
}

static const char b58[] = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz";

#define B58_MAX_IN 256

int ap__base58_encode(char *out, size_t cap, const uint8_t *in, size_t n)
{
    if (n > B58_MAX_IN) return AP_ERANGE;
    size_t zeros = 0;
    while (zeros < n && in[zeros] == 0) zeros++;
    /* log(256)/log(58) < 1.37 */
    uint8_t digits[B58_MAX_IN * 138 / 100 + 2];
    size_t nd = 0;
    for (size_t i = zeros; i < n; i++) {
        unsigned carry = in[i];
        for (size_t j = 0; j < nd; j++) {
            carry += (unsigned)digits[j] << 8;
            digits[j] = (uint8_t)(carry % 58);
            carry /= 58;
        }
        while (carry) {
            digits[nd++] = (uint8_t)(carry % 58);
            carry /= 58;
        }
    }
    size_t len = zeros + nd;
    if (len + 1 > cap) return AP_ERANGE;
    for (size_t i = 0; i < zeros; i++) out[i] = '1';
    for (size_t i = 0; i < nd; i++) out[zeros + i] = b58[digits[nd - 1 - i]];
    out[len] = 0;
    return (int)len;
}

int ap__base58_decode(uint8_t *out, size_t cap, const char *in)
{
    size_t n = strlen(in);
    if (n > B58_MAX_IN * 2) return AP_ERANGE;
    size_t zeros = 0;
    while (zeros < n && in[zeros] == '1') zeros++;
    uint8_t bytes[B58_MAX_IN * 2];
    size_t nb = 0;
    for (size_t i = zeros; i < n; i++) {
        const char *p = strchr(b58, in[i]);
        if (!p || !in[i]) return AP_EINVAL;
        unsigned carry = (unsigned)(p - b58);
        for (size_t j = 0; j < nb; j++) {
            carry += (unsigned)bytes[j] * 58;
            bytes[j] = (uint8_t)carry;
            carry >>= 8;
        }
        while (carry) {
            if (nb >= sizeof bytes) return AP_ERANGE;
            bytes[nb++] = (uint8_t)carry;
            carry >>= 8;
        }
    }
    size_t len = zeros + nb;
    if (len > cap) return AP_ERANGE;
    memset(out, 0, zeros);
    for (size_t i = 0; i < nb; i++) out[zeros + i] = bytes[nb - 1 - i];
    return (int)len;
}
