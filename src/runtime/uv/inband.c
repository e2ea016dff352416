/* The mux's frames inside one yamux stream (see inband.h). */
#include "runtime/uv/inband.h"

#include "apiary/error.h"
#include "apiary/runtime.h"

#include <string.h>

#define HDR ((size_t)AP_FRAME_HDR)

static size_t frame_len(const uint8_t *h)
{
    return HDR + (size_t)ap__get_be16(h + 6);
}

/* Checks frame (flen bytes, from the peer) and rewrites its id. */
static int check(ap_inband_t *ib, uint8_t *frame, size_t flen)
{
    ap_frame_t f;
    if (ap__frame_parse_hdr(frame, &f) != 0 || f.sid != ib->yid || f.type == AP_FRAME_GOAWAY)
        return AP_EPROTO;
    if (HDR + f.len != flen) return AP_EPROTO;
    f.payload = frame + HDR;
    if (f.type == AP_FRAME_OPEN) {
        char name[AP_RT_PROTO_MAX];
        uint32_t window;
        if (ib->opener || ib->got_open || !ib->name ||
            ap__frame_parse_open(&f, &window, name, sizeof name) != 0 ||
            strcmp(name, ib->name) != 0)
            return AP_EPROTO;
        ib->got_open = true;
    } else if (!ib->opener && !ib->got_open) {
        return AP_EPROTO;
    }
    if (f.type == AP_FRAME_CLOSE) {
        ib->rclose = true;
        if (ib->lclose) ib->done = true;
    } else if (f.type == AP_FRAME_RESET) {
        ib->done = ib->rclose = true;
    }
    if (ib->sid != ib->yid) ap__put_be32(frame + 2, ib->sid);
    return 0;
}

int ap__inband_feed(ap_inband_t *ib, const uint8_t *p, size_t n, uint8_t *scratch,
                    ap_inband_emit_fn emit, void *arg)
{
    while (n) {
        const uint8_t *f;
        size_t flen;
        if (ib->rx.len || n < HDR) {
            size_t have = ib->rx.len;
            size_t need = have < HDR ? HDR - have : frame_len(ib->rx.data) - have;
            size_t k = n < need ? n : need;
            if (ap__buf_append(&ib->rx, p, k) != 0) return AP_ENOMEM;
            p += k;
            n -= k;
            if (ib->rx.len < HDR) return 0;
            flen = frame_len(ib->rx.data);
            if (ib->rx.len < flen) continue;
            f = ib->rx.data;
        } else {
            flen = frame_len(p);
            if (n < flen) {
                if (ap__buf_append(&ib->rx, p, n) != 0) return AP_ENOMEM;
                return 0;
            }
            f = p;
            p += flen;
            n -= flen;
        }
        memcpy(scratch, f, flen);
        ib->rx.len = 0;
        int rc = check(ib, scratch, flen);
        if (rc) return rc;
        rc = emit(arg, scratch, flen);
        if (rc) return rc;
    }
    return 0;
}

void ap__inband_sent(ap_inband_t *ib, uint8_t type)
{
    if (type == AP_FRAME_CLOSE) {
        ib->lclose = true;
        if (ib->rclose) ib->done = true;
    } else if (type == AP_FRAME_RESET) {
        ib->done = ib->lclose = true;
    }
}

bool ap__inband_orphaned(const ap_inband_t *ib, int status)
{
    if (ib->done || (status == 0 && ib->lclose && ib->rclose)) return false;
    return ib->opener || ib->got_open; /* the mux knows the stream */
}

void ap__inband_free(ap_inband_t *ib)
{
    ap__buf_free(&ib->rx);
}
