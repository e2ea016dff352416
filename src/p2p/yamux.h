/* yamux ("/yamux/1.0.0"): the stream multiplexer of libp2p. Internal,
 * sans-I/O: bytes in through ap__yamux_feed, frames out through the write
 * callback, no socket, no clock.
 *
 * Every frame starts with a 12-byte header (big-endian):
 *     version u8 (0) | type u8 | flags u16 | stream id u32 | length u32
 * type 0 Data (length bytes of payload follow), 1 Window Update (length =
 * credit added), 2 Ping (length = opaque value), 3 Go Away (length = error
 * code: 0 normal, 1 protocol error, 2 internal error); flags SYN 1 (opens a
 * stream / a ping request), ACK 2 (accepts / answers), FIN 4 (half-close),
 * RST 8 (abort). Stream 0 carries only Ping and Go Away. The side that
 * dialled the connection (client) opens odd stream ids, the other even ones.
 *
 * Flow control: each direction of each stream starts with a 256 KiB window
 * (AP_YAMUX_WINDOW_INIT); the receiver grants credit with Window Updates as
 * its reader consumes (ap__yamux_consume), in batches of at least half the
 * window. Window growth: when a sender used up the whole window since the
 * last grant (it was window-limited), the grant also doubles the window, up
 * to AP_YAMUX_WINDOW_MAX and within a per-session growth budget. A reader
 * that stops consuming stops the grants, so the sender's window fills: that
 * is the back-pressure runtime.h's streams need. A peer that sends past the
 * window has that stream reset.
 *
 * Bad input: a wrong version, unknown type, a data or window frame on stream
 * 0, a ping on another stream, a SYN with the wrong parity or for a stream
 * that exists, a window beyond 2^32-1: the session fails (ap__yamux_feed
 * returns AP_EPROTO, a Go Away with code 1 is written; the caller closes the
 * connection and logs one line naming the peer). Frames for unknown streams
 * are skipped. A SYN beyond max_streams, or after we sent Go Away, is
 * answered with RST.
 *
 * Callbacks run inside ap__yamux_feed (and on_close also inside
 * ap__yamux_close when that completes a stream); they may call any function
 * here except ap__yamux_free. */
#ifndef AP_P2P_YAMUX_H
#define AP_P2P_YAMUX_H

#include "base/u64map.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_YAMUX_PROTO       "/yamux/1.0.0"
#define AP_YAMUX_HDR_LEN     12
#define AP_YAMUX_WINDOW_INIT (256u * 1024)
#define AP_YAMUX_WINDOW_MAX  (16u << 20)
#define AP_YAMUX_GROWTH_MAX  (64u << 20)  /* sum of window growth over a session */
#define AP_YAMUX_FRAME_MAX   (64u * 1024) /* payload of one data frame we send */
#define AP_YAMUX_STREAMS_MAX 1024         /* default open streams per session */

enum { AP_YAMUX_DATA = 0, AP_YAMUX_WINDOW = 1, AP_YAMUX_PING = 2, AP_YAMUX_GOAWAY = 3 };
enum { AP_YAMUX_SYN = 1, AP_YAMUX_ACK = 2, AP_YAMUX_FIN = 4, AP_YAMUX_RST = 8 };
enum { AP_YAMUX_GOAWAY_NORMAL = 0, AP_YAMUX_GOAWAY_PROTO = 1, AP_YAMUX_GOAWAY_INTERNAL = 2 };

typedef struct ap_yamux_hdr {
    uint8_t version, type;
    uint16_t flags;
    uint32_t stream, length;
} ap_yamux_hdr_t;

void ap__yamux_hdr_put(uint8_t out[AP_YAMUX_HDR_LEN], const ap_yamux_hdr_t *h);
/* AP_EPROTO for a version other than 0 or an unknown type. */
int ap__yamux_hdr_get(const uint8_t in[AP_YAMUX_HDR_LEN], ap_yamux_hdr_t *h);

typedef struct ap_yamux_cbs {
    /* Writes one frame: the header and (data frames) n payload bytes. The
     * caller queues them in order; it owns its own buffering limits. */
    void (*write)(void *arg, const uint8_t hdr[AP_YAMUX_HDR_LEN], const uint8_t *payload, size_t n);
    /* The peer opened stream id. Return 0 to accept, an AP_E* code to refuse
     * (the stream is reset). */
    int (*on_open)(void *arg, uint32_t id);
    /* Payload for id; call ap__yamux_consume when it was processed. */
    void (*on_data)(void *arg, uint32_t id, const uint8_t *p, size_t n);
    void (*on_fin)(void *arg, uint32_t id);           /* the peer closed its direction */
    void (*on_writable)(void *arg, uint32_t id);      /* the send window reopened */
    void (*on_close)(void *arg, uint32_t id, int st); /* 0, AP_ERESET, AP_ELIMIT (overrun),
                                                         AP_EPROTO / AP_ECLOSED (session) */
    void (*on_pong)(void *arg, uint32_t opaque);      /* answer to ap__yamux_ping */
    void (*on_goaway)(void *arg, uint32_t code);
} ap_yamux_cbs_t;

typedef struct ap_yamux {
    bool client;
    ap_yamux_cbs_t cbs;
    void *arg;
    size_t max_streams;
    ap_u64map_t streams; /* id -> struct ystream * */
    uint32_t next_id;
    bool goaway_sent, goaway_recv;
    int err; /* sticky session error */
    uint64_t growth;
    /* the frame being read */
    uint8_t hdr[AP_YAMUX_HDR_LEN];
    size_t hdr_len;
    ap_yamux_hdr_t cur;
    uint32_t left;    /* payload bytes of cur still to come */
    bool cur_deliver; /* cur's payload goes to its stream */
    uint64_t frames_in, bytes_in;
} ap_yamux_t;

/* client: we dialled the connection. max_streams 0 = AP_YAMUX_STREAMS_MAX. */
void ap__yamux_init(ap_yamux_t *y, bool client, const ap_yamux_cbs_t *cbs, void *arg,
                    size_t max_streams);
/* Closes every remaining stream with on_close(status) and frees the state.
 * status: AP_ECLOSED when the connection went away. */
void ap__yamux_free(ap_yamux_t *y, int status);

/* Feeds received bytes (untrusted). 0, or the sticky session error. */
int ap__yamux_feed(ap_yamux_t *y, const uint8_t *in, size_t len);

/* Opens a stream: *id gets its id. AP_ESHUTDOWN after a Go Away either way,
 * AP_ELIMIT at max_streams. */
int ap__yamux_open(ap_yamux_t *y, uint32_t *id);
/* Sends up to len bytes of data on id: returns how many the send window
 * took (0 when it is full: wait for on_writable), or AP_ECLOSED (unknown
 * stream or our direction closed). */
long ap__yamux_send(ap_yamux_t *y, uint32_t id, const uint8_t *data, size_t len);
/* The reader processed n bytes of id's data: credit is granted back. */
void ap__yamux_consume(ap_yamux_t *y, uint32_t id, size_t n);
/* Half-closes our direction (FIN). */
int ap__yamux_close(ap_yamux_t *y, uint32_t id);
/* Aborts id (RST) and forgets it; no on_close for it. */
void ap__yamux_reset(ap_yamux_t *y, uint32_t id);
void ap__yamux_ping(ap_yamux_t *y, uint32_t opaque);
void ap__yamux_goaway(ap_yamux_t *y, uint32_t code);

/* Introspection for tests and stats. */
size_t ap__yamux_nstreams(const ap_yamux_t *y);
uint32_t ap__yamux_send_window(const ap_yamux_t *y, uint32_t id);
uint32_t ap__yamux_recv_window(const ap_yamux_t *y, uint32_t id); /* current window size */

#endif
