/* Text encodings: hex and base58btc. Internal. */
#ifndef AP_BASE_CODEC_H
#define AP_BASE_CODEC_H

#include <stddef.h>
#include <stdint.h>

/* Lower-case hex; out must hold 2*n+1 bytes. Returns out. */
char *ap__hex_encode(char *out, const uint8_t *in, size_t n);
/* Decodes exactly strlen(in)/2 bytes into out (cap bytes). Returns the byte
 * count or AP_EINVAL (odd length, bad digit) / AP_ERANGE (too long). */
int ap__hex_decode(uint8_t *out, size_t cap, const char *in);

/* base58btc (Bitcoin alphabet). Writes a NUL-terminated string into out
 * (cap bytes). Returns its length or AP_ERANGE if it does not fit. */
int ap__base58_encode(char *out, size_t cap, const uint8_t *in, size_t n);
/* Decodes into out (cap bytes). Returns the byte count, AP_EINVAL on a bad
 * character, AP_ERANGE if the result would exceed cap. */
int ap__base58_decode(uint8_t *out, size_t cap, const char *in);

#endif
