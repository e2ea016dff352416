/* Mux frame codec. See frame.h and docs/protocol.md. */
#include "runtime/uv/frame.h"

#include "apiary/error.h"
#include "apiary/runtime.h"

#include <string.h>

int ap__frame_parse_hdr(const uint8_t h[AP_FRAME_HDR], ap_frame_t *f)
{
    f->type = h[0];
    f->flags = h[1];
    f->sid = ap__get_be32(h + 2);
    f->len = ap__get_be16(h + 6);
    f->payload = NULL;
    switch (f->type) {
    case AP_FRAME_OPEN:
        if (f->flags & ~AP_FRAME_F_RPC) return AP_EPROTO;
        if (f->sid == 0 || f->len < 4 + 1 + 1 || f->len > 4 + 1 + AP_RT_PROTO_MAX - 1)
            return AP_EPROTO;
        return 0;
    case AP_FRAME_DATA:
        if (f->flags & ~AP_FRAME_F_START) return AP_EPROTO;
        if (f->sid == 0) return AP_EPROTO;
        if ((f->flags & AP_FRAME_F_START) ? f->len < 4 : f->len == 0) return AP_EPROTO;
        return 0;
    case AP_FRAME_CLOSE:
        if (f->flags || f->sid == 0 || f->len != 0) return AP_EPROTO;
        return 0;
    case AP_FRAME_RESET:
        if (f->flags || f->sid == 0 || f->len < 3 || f->len > 3 + AP_FRAME_RESET_MSG_MAX)
            return AP_EPROTO;
        return 0;
    case AP_FRAME_WINDOW:
        if (f->flags & ~AP_FRAME_F_ACCEPT) return AP_EPROTO;
        if (f->len != 4) return AP_EPROTO;
        if (f->sid == 0 && f->flags) return AP_EPROTO;
        return 0;
    case AP_FRAME_GOAWAY:
        if (f->flags || f->sid != 0 || f->len != 0) return AP_EPROTO;
        return 0;
    default:
        return AP_EPROTO;
    }
}

int ap__frame_parse_open(const ap_frame_t *f, uint32_t *window, char *proto, size_t proto_cap)
{
    if (f->type != AP_FRAME_OPEN || f->len < 6) return AP_EPROTO;
    *window = ap__get_be32(f->payload);
    size_t plen = f->payload[4];
    if (plen == 0 || plen + 5 != f->len || plen + 1 > proto_cap || plen >= AP_RT_PROTO_MAX)
        return AP_EPROTO;
    const uint8_t *p = f->payload + 5;
    if (p[0] != '/') return AP_EPROTO;
    for (size_t i = 0; i < plen; i++)
        if (p[i] <= 0x20 || p[i] >= 0x7f) return AP_EPROTO; /* printable ASCII only */
    memcpy(proto, p, plen);
    proto[plen] = 0;
    return 0;
}

int ap__frame_parse_data(const ap_frame_t *f, bool *has_total, uint32_t *total,
                         const uint8_t **data, size_t *n)
{
    if (f->type != AP_FRAME_DATA) return AP_EPROTO;
    if (f->flags & AP_FRAME_F_START) {
        if (f->len < 4) return AP_EPROTO;
        *has_total = true;
        *total = ap__get_be32(f->payload);
        *data = f->payload + 4;
        *n = f->len - 4u;
        if (*n > *total) return AP_EPROTO;
    } else {
        if (f->len == 0) return AP_EPROTO;
        *has_total = false;
        *total = 0;
        *data = f->payload;
        *n = f->len;
    }
    return 0;
}

int ap__frame_parse_reset(const ap_frame_t *f, int *code, char *msg, size_t msg_cap)
{
    if (f->type != AP_FRAME_RESET || f->len < 3) return AP_EPROTO;
    unsigned c = ap__get_be16(f->payload);
    size_t mlen = f->payload[2];
    if (c == 0 || mlen + 3 != f->len || mlen > AP_FRAME_RESET_MSG_MAX || mlen + 1 > msg_cap)
        return AP_EPROTO;
    const uint8_t *p = f->payload + 3;
    for (size_t i = 0; i < mlen; i++)
        if (p[i] < 0x20 || p[i] == 0x7f) return AP_EPROTO; /* no control characters */
    memcpy(msg, p, mlen);
    msg[mlen] = 0;
    *code = -(int)c;
    return 0;
}

int ap__frame_parse_window(const ap_frame_t *f, uint32_t *delta)
{
    if (f->type != AP_FRAME_WINDOW || f->len != 4) return AP_EPROTO;
    *delta = ap__get_be32(f->payload);
    if (*delta > INT32_MAX) return AP_EPROTO;
    return 0;
}

static int put_hdr(ap_buf_t *b, uint8_t type, uint8_t flags, uint32_t sid, size_t len)
{
    if (len > AP_FRAME_PAYLOAD_MAX) return AP_EINVAL;
    if (ap__buf_reserve(b, AP_FRAME_HDR + len) < 0) return AP_ENOMEM;
    uint8_t *h = b->data + b->len;
    h[0] = type;
    h[1] = flags;
    ap__put_be32(h + 2, sid);
    ap__put_be16(h + 6, (uint16_t)len);
    b->len += AP_FRAME_HDR;
    return 0;
}

static void put_raw(ap_buf_t *b, const void *p, size_t n)
{
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
}

int ap__frame_put_open(ap_buf_t *b, uint32_t sid, bool rpc, uint32_t window, const char *proto)
{
    size_t plen = strlen(proto);
    if (plen == 0 || plen >= AP_RT_PROTO_MAX) return AP_EINVAL;
    int rc = put_hdr(b, AP_FRAME_OPEN, rpc ? AP_FRAME_F_RPC : 0, sid, 5 + plen);
    if (rc < 0) return rc;
    uint8_t w[5];
    ap__put_be32(w, window);
    w[4] = (uint8_t)plen;
    put_raw(b, w, 5);
    put_raw(b, proto, plen);
    return 0;
}

int ap__frame_put_data(ap_buf_t *b, uint32_t sid, bool start, uint32_t total, const uint8_t *data,
                       size_t n)
{
    int rc = put_hdr(b, AP_FRAME_DATA, start ? AP_FRAME_F_START : 0, sid, n + (start ? 4 : 0));
    if (rc < 0) return rc;
    if (start) {
        uint8_t t[4];
        ap__put_be32(t, total);
        put_raw(b, t, 4);
    }
    put_raw(b, data, n);
    return 0;
}

int ap__frame_put_close(ap_buf_t *b, uint32_t sid)
{
    return put_hdr(b, AP_FRAME_CLOSE, 0, sid, 0);
}

int ap__frame_put_goaway(ap_buf_t *b)
{
    return put_hdr(b, AP_FRAME_GOAWAY, 0, 0, 0);
}

int ap__frame_put_reset(ap_buf_t *b, uint32_t sid, int code, const char *msg)
{
    uint8_t tmp[3 + AP_FRAME_RESET_MSG_MAX];
    unsigned c = code < 0 ? (unsigned)-code : (unsigned)-AP_ERESET;
    if (c > 0xffff) c = (unsigned)-AP_ERESET;
    size_t mlen = 0;
    for (; msg && msg[mlen] && mlen < AP_FRAME_RESET_MSG_MAX; mlen++) {
        unsigned char ch = (unsigned char)msg[mlen];
        tmp[3 + mlen] = (ch < 0x20 || ch == 0x7f) ? '?' : ch;
    }
    ap__put_be16(tmp, (uint16_t)c);
    tmp[2] = (uint8_t)mlen;
    int rc = put_hdr(b, AP_FRAME_RESET, 0, sid, 3 + mlen);
    if (rc < 0) return rc;
    put_raw(b, tmp, 3 + mlen);
    return 0;
}

int ap__frame_put_window(ap_buf_t *b, uint32_t sid, bool accept, uint32_t delta)
{
    int rc = put_hdr(b, AP_FRAME_WINDOW, accept ? AP_FRAME_F_ACCEPT : 0, sid, 4);
    if (rc < 0) return rc;
    uint8_t d[4];
    ap__put_be32(d, delta);
    put_raw(b, d, 4);
    return 0;
}

int ap__frame_dec_feed(ap_frame_dec_t *d, const uint8_t *p, size_t n, ap_frame_fn fn, void *arg)
{
    ap_frame_t f;
    while (n > 0) {
        if (d->have == 0 && n >= AP_FRAME_HDR) {
            /* Fast path: whole frames straight from the input, no copy. */
            int rc = ap__frame_parse_hdr(p, &f);
            if (rc < 0) return rc;
            if (n >= AP_FRAME_HDR + (size_t)f.len) {
                f.payload = p + AP_FRAME_HDR;
                p += AP_FRAME_HDR + f.len;
                n -= AP_FRAME_HDR + f.len;
                rc = fn(arg, &f);
                if (rc != 0) return rc;
                continue;
            }
        }
        /* Slow path: accumulate a header, then the payload. */
        if (d->have < AP_FRAME_HDR) {
            size_t k = AP_FRAME_HDR - d->have;
            if (k > n) k = n;
            memcpy(d->buf + d->have, p, k);
            d->have += k;
            p += k;
            n -= k;
            if (d->have < AP_FRAME_HDR) return 0;
            int rc = ap__frame_parse_hdr(d->buf, &f);
            if (rc < 0) return rc;
        }
        ap__frame_parse_hdr(d->buf, &f); /* validated above */
        size_t want = AP_FRAME_HDR + (size_t)f.len - d->have;
        size_t k = want < n ? want : n;
        memcpy(d->buf + d->have, p, k);
        d->have += k;
        p += k;
        n -= k;
        if (k < want) return 0;
        d->have = 0;
        f.payload = d->buf + AP_FRAME_HDR;
        int rc = fn(arg, &f);
        if (rc != 0) return rc;
    }
    return 0;
}
