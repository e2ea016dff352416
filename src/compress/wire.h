/* Chunk headers of both wire versions (docs/compression.md, "Wire format"):
 * sizes, writing, parsing, re-framing. Internal to src/compress. */
#ifndef AP_COMPRESS_WIRE_H
#define AP_COMPRESS_WIRE_H

#include "apiary/compress.h"

/* Version 2 flag byte (byte 1): codec id in bits 0-3. */
#define AP__CW_OFFSET 0x10u /* a varint offset follows the count */
#define AP__CW_BLOCK  0x20u /* BLOCKWISE8: a varint block size follows (not 4096) */
#define AP__CW_SEED   0x40u /* RANDK: the payload starts with the u64 seed */

/* Exact payload bytes for (codec, count, param, seed in the payload); false
 * for a combination the format does not allow. */
bool ap__cw_payload_size(ap_codec_id_t id, uint64_t count, uint64_t param, bool seed,
                         uint64_t *out);

/* Header bytes for a chunk under encoder flags (flags already checked). */
size_t ap__cw_hdr_size(ap_codec_id_t id, uint32_t count, uint64_t offset, uint32_t param,
                       unsigned flags);
/* Writes that header; returns its length. */
size_t ap__cw_hdr_write(uint8_t *out, ap_codec_id_t id, uint32_t count, uint64_t offset,
                        uint32_t payload_len, uint32_t param, unsigned flags);
/* Whether the encoder flags are valid. */
bool ap__cw_flags_ok(unsigned flags);

static inline uint64_t ap__splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline uint64_t ap__mix64(uint64_t x)
{
    uint64_t s = x;
    return ap__splitmix64(&s);
}
/* The seed the rand-k generator uses for the chunk at offset, from the
 * caller's seed (part of the wire format). */
static inline uint64_t ap__cw_chunk_seed(uint64_t seed, uint64_t offset)
{
    return ap__mix64(seed ^ ap__mix64(offset ^ 0x6a09e667f3bcc909ull));
}

#endif
