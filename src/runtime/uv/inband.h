/* The mux's frames inside one yamux stream (p2p_bridge.c), sans-I/O.
 * Internal.
 *
 * One ap_inband_t per yamux stream that carries a mux stream. Incoming bytes
 * (untrusted) are cut into whole frames (frame.h), each checked: its stream
 * id must be the yamux stream's (yid); on a stream the peer opened, the first
 * frame must be an OPEN naming the negotiated protocol and no OPEN may
 * follow; on one we opened, no OPEN at all; no GOAWAY or connection-level
 * frame. A checked frame gets the mux's own id (sid) and is handed to emit.
 * A partial frame waits in rx (at most one frame: 8 + 65,535 bytes).
 *
 * The state also tracks how the mux stream ends on each side (CLOSE sent /
 * received, RESET either way), so the bridge knows whether the mux must be
 * told that a yamux stream ended under it. */
#ifndef AP_RUNTIME_UV_INBAND_H
#define AP_RUNTIME_UV_INBAND_H

#include "base/buf.h"
#include "runtime/uv/frame.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ap_inband {
    uint32_t yid;     /* the id in-band (the yamux stream's) */
    uint32_t sid;     /* the mux's id */
    bool opener;      /* we opened it */
    bool got_open;    /* peer-opened: its OPEN arrived */
    bool lclose;      /* CLOSE or RESET written by our mux */
    bool rclose;      /* CLOSE or RESET from the peer */
    bool done;        /* the mux stream is over on both sides (or reset) */
    const char *name; /* the negotiated protocol (peer-opened streams) */
    ap_buf_t rx;      /* a frame arriving in parts */
} ap_inband_t;

/* Handles one checked frame (len bytes, the mux's id in it; valid during
 * the call). Nonzero stops the feed and is returned. */
typedef int (*ap_inband_emit_fn)(void *arg, const uint8_t *frame, size_t len);

/* Feeds n bytes from the peer. scratch: AP_FRAME_HDR + AP_FRAME_PAYLOAD_MAX
 * bytes the frame is rewritten in. 0, AP_EPROTO (a bad frame: the stream
 * must be reset; nothing more may be fed), AP_ENOMEM, or emit's nonzero
 * value. */
int ap__inband_feed(ap_inband_t *ib, const uint8_t *p, size_t n, uint8_t *scratch,
                    ap_inband_emit_fn emit, void *arg);
/* Our mux wrote a frame of this type on the stream. */
void ap__inband_sent(ap_inband_t *ib, uint8_t type);
/* Whether the mux must learn that the stream is gone when its yamux stream
 * ends now with status (0: both directions finished). */
bool ap__inband_orphaned(const ap_inband_t *ib, int status);
void ap__inband_free(ap_inband_t *ib);

#endif
