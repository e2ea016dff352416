/* Mux frame codec (docs/protocol.md). Pure functions, no I/O. Internal.
 *
 * Every frame is an 8-byte header followed by at most 65,535 payload bytes:
 *     type u8 | flags u8 | stream id u32 BE | payload length u16 BE
 * The decoder is fed arbitrary byte slices (untrusted) and emits whole frames;
 * it never allocates: a frame split across reads is reassembled in a fixed
 * buffer inside the decoder. */
#ifndef AP_RUNTIME_UV_FRAME_H
#define AP_RUNTIME_UV_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"

#define AP_FRAME_HDR         8
#define AP_FRAME_PAYLOAD_MAX 65535u

enum ap_frame_type {
    AP_FRAME_OPEN = 1,   /* open a stream: window u32, proto_len u8, proto */
    AP_FRAME_DATA = 2,   /* a message fragment; START: total length u32 first */
    AP_FRAME_CLOSE = 3,  /* half-close: the sender sends no more DATA */
    AP_FRAME_RESET = 4,  /* abort both directions: code u16, msg_len u8, msg */
    AP_FRAME_WINDOW = 5, /* credit: delta u32; stream 0 = connection level */
    AP_FRAME_GOAWAY = 6, /* stream 0, empty: the sender opens no more streams here */
};

/* Mux wire version. 2 added GOAWAY. Bound into the transport's handshake
 * (the Noise prologue, see AP_TCP_PROLOGUE in src/net/tcp.h), so peers of
 * different versions fail the handshake instead of misreading frames. */
#define AP_MUX_WIRE_VERSION 2

/* flags */
#define AP_FRAME_F_RPC    0x01 /* OPEN: the stream is one unary RPC */
#define AP_FRAME_F_START  0x01 /* DATA: first fragment of a message */
#define AP_FRAME_F_ACCEPT 0x01 /* WINDOW: the acceptor accepted the stream */

#define AP_FRAME_RESET_MSG_MAX 200 /* bytes of the reason text in RESET */

typedef struct ap_frame {
    uint8_t type;
    uint8_t flags;
    uint32_t sid;
    uint16_t len;
    const uint8_t *payload; /* len bytes, valid during the callback only */
} ap_frame_t;

/* Validates a header: known type, flags allowed for the type, stream id rules
 * that need no connection state (0 only for connection-level WINDOW), fixed
 * payload sizes. Fills f (payload NULL). 0 or AP_EPROTO. */
int ap__frame_parse_hdr(const uint8_t h[AP_FRAME_HDR], ap_frame_t *f);

/* Payload parsers: strict (exact lengths, valid contents). 0 or AP_EPROTO. */
int ap__frame_parse_open(const ap_frame_t *f, uint32_t *window, char *proto, size_t proto_cap);
/* DATA: *total is set (and *has_total true) for START; data/n is the message
 * bytes carried by this frame. */
int ap__frame_parse_data(const ap_frame_t *f, bool *has_total, uint32_t *total,
                         const uint8_t **data, size_t *n);
/* RESET: *code is a negative AP_E* value; msg is NUL-terminated text. */
int ap__frame_parse_reset(const ap_frame_t *f, int *code, char *msg, size_t msg_cap);
int ap__frame_parse_window(const ap_frame_t *f, uint32_t *delta);

/* Encoders: append one whole frame to b. 0 or AP_ENOMEM / AP_EINVAL. */
int ap__frame_put_open(ap_buf_t *b, uint32_t sid, bool rpc, uint32_t window, const char *proto);
/* Appends a DATA frame; total is written iff start. n + (start ? 4 : 0)
 * must not exceed AP_FRAME_PAYLOAD_MAX. */
int ap__frame_put_data(ap_buf_t *b, uint32_t sid, bool start, uint32_t total, const uint8_t *data,
                       size_t n);
int ap__frame_put_close(ap_buf_t *b, uint32_t sid);
int ap__frame_put_reset(ap_buf_t *b, uint32_t sid, int code, const char *msg);
int ap__frame_put_window(ap_buf_t *b, uint32_t sid, bool accept, uint32_t delta);
int ap__frame_put_goaway(ap_buf_t *b);

/* Streaming decoder. */
typedef struct ap_frame_dec {
    size_t have; /* bytes of the current partial frame in buf */
    uint8_t buf[AP_FRAME_HDR + AP_FRAME_PAYLOAD_MAX];
} ap_frame_dec_t;

typedef int (*ap_frame_fn)(void *arg, const ap_frame_t *f);

static inline void ap__frame_dec_init(ap_frame_dec_t *d)
{
    d->have = 0;
}
/* Feeds n bytes; calls fn for each complete frame in order. Stops at the
 * first error: a bad header (AP_EPROTO) or a nonzero return of fn (returned
 * as is; positive values stop feeding without error, e.g. when the
 * connection was closed inside fn). After an error the decoder must not be
 * fed again. */
int ap__frame_dec_feed(ap_frame_dec_t *d, const uint8_t *p, size_t n, ap_frame_fn fn, void *arg);

#endif
