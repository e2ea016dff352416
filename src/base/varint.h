/* Unsigned LEB128 varints (protobuf / multiformats encoding). Internal. */
#ifndef AP_BASE_VARINT_H
#define AP_BASE_VARINT_H

#include <stddef.h>
#include <stdint.h>

#define AP_UVARINT_MAX 10

/* Writes v into out (room for AP_UVARINT_MAX bytes); returns bytes written. */
size_t ap__uvarint_put(uint8_t *out, uint64_t v);
/* Decodes from in[0..len). Returns bytes consumed (> 0), or AP_ECORRUPT for a
 * truncated, overlong (> 10 bytes or overflowing 64 bits) or non-minimal
 * encoding. */
int ap__uvarint_get(const uint8_t *in, size_t len, uint64_t *out);
size_t ap__uvarint_len(uint64_t v);

/* The multiformats unsigned-varint (libp2p length prefixes): the same
 * encoding, but at most AP_MF_UVARINT_MAX bytes (values below 2^63) and
 * always minimal. Returns bytes consumed (> 0); AP_EAGAIN when in[0..len)
 * is a valid but incomplete prefix (read more bytes); AP_ECORRUPT for an
 * overlong or non-minimal encoding. */
#define AP_MF_UVARINT_MAX 9
int ap__mf_uvarint_get(const uint8_t *in, size_t len, uint64_t *out);

#endif
