#include "base/buf.h"
#include "base/varint.h"
#include "apiary/error.h"

#include <stdlib.h>
#include <string.h>

void ap__buf_init(ap_buf_t *b)
{
    memset(b, 0, sizeof *b);
}

void ap__buf_free(ap_buf_t *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

int ap__buf_reserve(ap_buf_t *b, size_t extra)
{
    if (extra > SIZE_MAX - b->len) return AP_ENOMEM;
    size_t need = b->len + extra;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    uint8_t *p = realloc(b->data, cap);
    if (!p) return AP_ENOMEM;
    b->data = p;
    b->cap = cap;
    return 0;
}

int ap__buf_append(ap_buf_t *b, const void *p, size_t n)
{
    if (n == 0) return 0;
    int rc = ap__buf_reserve(b, n);
    if (rc) return rc;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

int ap__buf_append_u8(ap_buf_t *b, uint8_t v)
{
    return ap__buf_append(b, &v, 1);
}

int ap__buf_append_be16(ap_buf_t *b, uint16_t v)
{
    uint8_t t[2];
    ap__put_be16(t, v);
    return ap__buf_append(b, t, 2);
}

int ap__buf_append_be32(ap_buf_t *b, uint32_t v)
{
    uint8_t t[4];
    ap__put_be32(t, v);
    return ap__buf_append(b, t, 4);
}

int ap__buf_append_be64(ap_buf_t *b, uint64_t v)
{
    uint8_t t[8];
    ap__put_be64(t, v);
    return ap__buf_append(b, t, 8);
}

int ap__buf_append_uvarint(ap_buf_t *b, uint64_t v)
{
    uint8_t t[AP_UVARINT_MAX];
    return ap__buf_append(b, t, ap__uvarint_put(t, v));
}

void ap__buf_consume(ap_buf_t *b, size_t n)
{
    if (n >= b->len) {
        b->len = 0;
        return;
    }
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
}

const uint8_t *ap__read_bytes(ap_reader_t *r, size_t n)
{
    if (r->err || n > ap__reader_left(r)) {
        r->err = AP_ECORRUPT;
        return NULL;
    }
    const uint8_t *p = r->p;
    r->p += n;
    return p;
}

uint8_t ap__read_u8(ap_reader_t *r)
{
    const uint8_t *p = ap__read_bytes(r, 1);
    return p ? p[0] : 0;
}

uint16_t ap__read_be16(ap_reader_t *r)
{
    const uint8_t *p = ap__read_bytes(r, 2);
    return p ? ap__get_be16(p) : 0;
}

uint32_t ap__read_be32(ap_reader_t *r)
{
    const uint8_t *p = ap__read_bytes(r, 4);
    return p ? ap__get_be32(p) : 0;
}

uint64_t ap__read_be64(ap_reader_t *r)
{
    const uint8_t *p = ap__read_bytes(r, 8);
    return p ? ap__get_be64(p) : 0;
}

uint64_t ap__read_uvarint(ap_reader_t *r)
{
    if (r->err) return 0;
    uint64_t v;
    int n = ap__uvarint_get(r->p, ap__reader_left(r), &v);
    if (n < 0) {
        r->err = AP_ECORRUPT;
        return 0;
    }
    r->p += n;
    return v;
}
