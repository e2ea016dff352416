/* Growable byte buffer and bounded reader. Internal. */
#ifndef AP_BASE_BUF_H
#define AP_BASE_BUF_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

/* A growable byte buffer. Zero-initialise ({0}) or ap__buf_init; free with
 * ap__buf_free. data may be NULL while cap == 0. */
typedef struct ap_buf {
    uint8_t *data;
    size_t len;
    size_t cap;
} ap_buf_t;

void ap__buf_init(ap_buf_t *b);
void ap__buf_free(ap_buf_t *b);
/* Ensures room for extra more bytes. AP_ENOMEM on failure (b unchanged). */
int ap__buf_reserve(ap_buf_t *b, size_t extra);
int ap__buf_append(ap_buf_t *b, const void *p, size_t n);
int ap__buf_append_u8(ap_buf_t *b, uint8_t v);
int ap__buf_append_be16(ap_buf_t *b, uint16_t v);
int ap__buf_append_be32(ap_buf_t *b, uint32_t v);
int ap__buf_append_be64(ap_buf_t *b, uint64_t v);
int ap__buf_append_uvarint(ap_buf_t *b, uint64_t v);
/* Drops the first n bytes (memmove). */
void ap__buf_consume(ap_buf_t *b, size_t n);
static inline void ap__buf_reset(ap_buf_t *b)
{
    b->len = 0;
}

/* A bounded reader over untrusted bytes: every read checks the end first and
 * sets err (sticky) instead of reading past it. */
typedef struct ap_reader {
    const uint8_t *p;
    const uint8_t *end;
    int err; /* 0 or AP_ECORRUPT after the first out-of-bounds read */
} ap_reader_t;

static inline void ap__reader_init(ap_reader_t *r, const void *p, size_t n)
{
    r->p = (const uint8_t *)p;
    r->end = r->p + n;
    r->err = 0;
}
static inline size_t ap__reader_left(const ap_reader_t *r)
{
    return (size_t)(r->end - r->p);
}
uint8_t ap__read_u8(ap_reader_t *r);
uint16_t ap__read_be16(ap_reader_t *r);
uint32_t ap__read_be32(ap_reader_t *r);
uint64_t ap__read_be64(ap_reader_t *r);
uint64_t ap__read_uvarint(ap_reader_t *r);
/* Returns a pointer to the next n bytes and advances, or NULL (err set). */
const uint8_t *ap__read_bytes(ap_reader_t *r, size_t n);

/* Big-endian helpers on raw memory. */
static inline void ap__put_be16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static inline void ap__put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}
static inline void ap__put_be64(uint8_t *p, uint64_t v)
{
    ap__put_be32(p, (uint32_t)(v >> 32));
    ap__put_be32(p + 4, (uint32_t)v);
}
static inline uint16_t ap__get_be16(const uint8_t *p)
{
    return (uint16_t)((p[0] << 8) | p[1]);
}
static inline uint32_t ap__get_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t ap__get_be64(const uint8_t *p)
{
    return ((uint64_t)ap__get_be32(p) << 32) | ap__get_be32(p + 4);
}
static inline void ap__put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}
static inline uint32_t ap__get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline void ap__put_le64(uint8_t *p, uint64_t v)
{
    ap__put_le32(p, (uint32_t)v);
    ap__put_le32(p + 4, (uint32_t)(v >> 32));
}
static inline uint64_t ap__get_le64(const uint8_t *p)
{
    return (uint64_t)ap__get_le32(p) | ((uint64_t)ap__get_le32(p + 4) << 32);
}

#endif
