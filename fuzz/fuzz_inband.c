/* libFuzzer target: the mux's frames inside a yamux stream (the libp2p
 * bridge, src/runtime/uv/inband.h) fed untrusted bytes.
 *
 * Input: one mode byte (bit 0: we opened the stream; bits 1-3: read size
 * 1..7 bytes or all at once), then the peer's bytes on yamux stream 5 whose
 * protocol is "/apiary/dht/1" (the mux's id for it is 7 when we opened it).
 * Invariants: no crash, no leak; every frame handed on is one whole frame
 * with a valid header, the mux's id, and no OPEN on a stream we opened; an
 * error stops the feed for good. */
#include "apiary/error.h"
#include "runtime/uv/inband.h"

#include <stdlib.h>
#include <string.h>

static uint8_t scratch[AP_FRAME_HDR + AP_FRAME_PAYLOAD_MAX];
static bool opener;

static int emit(void *arg, const uint8_t *frame, size_t len)
{
    ap_inband_t *ib = arg;
    ap_frame_t f;
    if (len < AP_FRAME_HDR || ap__frame_parse_hdr(frame, &f) != 0) abort();
    if (AP_FRAME_HDR + (size_t)f.len != len || f.sid != ib->sid) abort();
    if (f.type == AP_FRAME_OPEN && opener) abort();
    if (f.type == AP_FRAME_GOAWAY) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    opener = data[0] & 1;
    size_t chunk = (data[0] >> 1) & 7;
    data++;
    size--;
    ap_inband_t ib;
    memset(&ib, 0, sizeof ib);
    ib.yid = 5;
    ib.sid = opener ? 7 : 5;
    ib.opener = opener;
    ib.name = opener ? NULL : "/apiary/dht/1";
    size_t off = 0;
    while (off < size) {
        size_t step = chunk ? (chunk < size - off ? chunk : size - off) : size - off;
        int rc = ap__inband_feed(&ib, data + off, step, scratch, emit, &ib);
        off += step;
        if (rc < 0) break;
    }
    (void)ap__inband_orphaned(&ib, 0);
    ap__inband_free(&ib);
    return 0;
}
