/* yamux session (see yamux.h). */
#include "p2p/yamux.h"
#include "apiary/error.h"
#include "base/buf.h"

#include <stdlib.h>
#include <string.h>

typedef struct ystream {
    uint32_t id;
    uint32_t send_win; /* bytes we may still send */
    uint32_t recv_win; /* credit the peer still has */
    uint32_t recv_max; /* current window size */
    uint64_t unread;   /* delivered, not yet consumed */
    uint64_t consumed; /* consumed, not yet granted back */
    bool stalled;      /* the peer used the whole window since the last grant */
    bool fin_sent, fin_recv;
} ystream_t;

void ap__yamux_hdr_put(uint8_t out[AP_YAMUX_HDR_LEN], const ap_yamux_hdr_t *h)
{
    out[0] = h->version;
    out[1] = h->type;
    ap__put_be16(out + 2, h->flags);
    ap__put_be32(out + 4, h->stream);
    ap__put_be32(out + 8, h->length);
}

int ap__yamux_hdr_get(const uint8_t in[AP_YAMUX_HDR_LEN], ap_yamux_hdr_t *h)
{
    h->version = in[0];
    h->type = in[1];
    h->flags = ap__get_be16(in + 2);
    h->stream = ap__get_be32(in + 4);
    h->length = ap__get_be32(in + 8);
    return h->version == 0 && h->type <= AP_YAMUX_GOAWAY ? 0 : AP_EPROTO;
}

static void frame(ap_yamux_t *y, uint8_t type, uint16_t flags, uint32_t id, uint32_t length,
                  const uint8_t *payload, size_t n)
{
    uint8_t h[AP_YAMUX_HDR_LEN];
    ap_yamux_hdr_t hd = {0, type, flags, id, length};
    ap__yamux_hdr_put(h, &hd);
    y->cbs.write(y->arg, h, payload, n);
}

static ystream_t *find(const ap_yamux_t *y, uint32_t id)
{
    uint64_t v;
    return ap__u64map_get(&y->streams, id, &v) ? (ystream_t *)(uintptr_t)v : NULL;
}

static void forget(ap_yamux_t *y, ystream_t *s)
{
    ap__u64map_del(&y->streams, s->id, NULL);
    free(s);
}

/* Removes s, then tells the user. */
static void finish(ap_yamux_t *y, ystream_t *s, int st)
{
    uint32_t id = s->id;
    forget(y, s);
    if (y->cbs.on_close) y->cbs.on_close(y->arg, id, st);
}

static ystream_t *add(ap_yamux_t *y, uint32_t id)
{
    ystream_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->id = id;
    s->send_win = AP_YAMUX_WINDOW_INIT;
    s->recv_win = AP_YAMUX_WINDOW_INIT;
    s->recv_max = AP_YAMUX_WINDOW_INIT;
    if (ap__u64map_put(&y->streams, id, (uint64_t)(uintptr_t)s) != 0) {
        free(s);
        return NULL;
    }
    return s;
}

void ap__yamux_init(ap_yamux_t *y, bool client, const ap_yamux_cbs_t *cbs, void *arg,
                    size_t max_streams)
{
    memset(y, 0, sizeof *y);
    y->client = client;
    y->cbs = *cbs;
    y->arg = arg;
    y->max_streams = max_streams ? max_streams : AP_YAMUX_STREAMS_MAX;
    y->next_id = client ? 1 : 2;
}

void ap__yamux_free(ap_yamux_t *y, int status)
{
    /* on_close may call back into y: with err set, nothing new starts */
    if (!y->err) y->err = status ? status : AP_ECLOSED;
    while (y->streams.n) {
        size_t pos = 0;
        uint64_t v;
        if (!ap__u64map_next(&y->streams, &pos, NULL, &v)) break;
        finish(y, (ystream_t *)(uintptr_t)v, status);
    }
    ap__u64map_free(&y->streams);
}

static int fail(ap_yamux_t *y, int err)
{
    if (!y->err) {
        y->err = err;
        if (!y->goaway_sent) {
            y->goaway_sent = true;
            frame(y, AP_YAMUX_GOAWAY, 0, 0, AP_YAMUX_GOAWAY_PROTO, NULL, 0);
        }
    }
    return y->err;
}

/* ---- receiving -------------------------------------------------------------- */

static bool remote_parity(const ap_yamux_t *y, uint32_t id)
{
    return (id & 1) == (y->client ? 0u : 1u);
}

/* SYN: the peer opens id. Returns the stream, or NULL (refused or skipped). */
static ystream_t *remote_open(ap_yamux_t *y, uint32_t id, int *err)
{
    if (!remote_parity(y, id) || find(y, id)) {
        *err = AP_EPROTO;
        return NULL;
    }
    if (y->goaway_sent || y->streams.n >= y->max_streams) {
        frame(y, AP_YAMUX_WINDOW, AP_YAMUX_RST, id, 0, NULL, 0);
        return NULL;
    }
    ystream_t *s = add(y, id);
    if (!s) {
        frame(y, AP_YAMUX_WINDOW, AP_YAMUX_RST, id, 0, NULL, 0);
        return NULL;
    }
    frame(y, AP_YAMUX_WINDOW, AP_YAMUX_ACK, id, 0, NULL, 0);
    int rc = y->cbs.on_open ? y->cbs.on_open(y->arg, id) : AP_ENOPROTO;
    s = find(y, id);
    if (rc != 0 && s) {
        frame(y, AP_YAMUX_WINDOW, AP_YAMUX_RST, id, 0, NULL, 0);
        forget(y, s);
        return NULL;
    }
    return s;
}

/* The header of y->cur is complete: act on it. */
static int on_header(ap_yamux_t *y)
{
    ap_yamux_hdr_t *h = &y->cur;
    int rc = ap__yamux_hdr_get(y->hdr, h);
    if (rc) return fail(y, rc);
    y->frames_in++;
    y->left = h->type == AP_YAMUX_DATA ? h->length : 0;
    y->cur_deliver = false;
    if (h->type == AP_YAMUX_PING || h->type == AP_YAMUX_GOAWAY) {
        if (h->stream != 0) return fail(y, AP_EPROTO);
        if (h->type == AP_YAMUX_GOAWAY) {
            y->goaway_recv = true;
            if (y->cbs.on_goaway) y->cbs.on_goaway(y->arg, h->length);
        } else if (h->flags & AP_YAMUX_SYN) {
            frame(y, AP_YAMUX_PING, AP_YAMUX_ACK, 0, h->length, NULL, 0);
        } else if ((h->flags & AP_YAMUX_ACK) && y->cbs.on_pong) {
            y->cbs.on_pong(y->arg, h->length);
        }
        return 0;
    }
    if (h->stream == 0) return fail(y, AP_EPROTO);
    uint32_t id = h->stream;
    ystream_t *s;
    if (h->flags & AP_YAMUX_SYN) {
        int err = 0;
        s = remote_open(y, id, &err);
        if (err) return fail(y, err);
    } else {
        s = find(y, id);
    }
    if (!s) return 0; /* unknown or refused: skip the payload */
    if (h->flags & AP_YAMUX_RST) {
        finish(y, s, AP_ERESET);
        return 0;
    }
    if (h->type == AP_YAMUX_WINDOW) {
        if ((uint64_t)s->send_win + h->length > UINT32_MAX) return fail(y, AP_EPROTO);
        bool was_full = s->send_win == 0;
        s->send_win += h->length;
        if (was_full && s->send_win && !s->fin_sent && y->cbs.on_writable) {
            y->cbs.on_writable(y->arg, id);
            if (!(s = find(y, id))) return 0;
        }
    } else if (h->length) {
        if (s->fin_recv || h->length > s->recv_win) {
            /* past the window (or after FIN): reset that stream only */
            frame(y, AP_YAMUX_WINDOW, AP_YAMUX_RST, id, 0, NULL, 0);
            finish(y, s, AP_ELIMIT);
            return 0;
        }
        s->recv_win -= h->length;
        if (s->recv_win == 0) s->stalled = true;
        y->cur_deliver = true;
    }
    if ((h->flags & AP_YAMUX_FIN) && y->left == 0 && !s->fin_recv) {
        /* FIN without payload to wait for: act now (else after the payload) */
        s->fin_recv = true;
        if (y->cbs.on_fin) y->cbs.on_fin(y->arg, id);
        if ((s = find(y, id)) && s->fin_sent) finish(y, s, 0);
    }
    return 0;
}

static void payload_done(ap_yamux_t *y)
{
    if (!(y->cur.flags & AP_YAMUX_FIN) || y->cur.type != AP_YAMUX_DATA || y->cur.length == 0)
        return;
    ystream_t *s = find(y, y->cur.stream);
    if (!s || !y->cur_deliver || s->fin_recv) return;
    s->fin_recv = true;
    if (y->cbs.on_fin) y->cbs.on_fin(y->arg, s->id);
    if ((s = find(y, y->cur.stream)) && s->fin_sent) finish(y, s, 0);
}

int ap__yamux_feed(ap_yamux_t *y, const uint8_t *in, size_t len)
{
    size_t off = 0;
    while (!y->err && off < len) {
        if (y->left) { /* payload of the current data frame */
            size_t n = len - off < y->left ? len - off : y->left;
            y->left -= (uint32_t)n;
            ystream_t *s = y->cur_deliver ? find(y, y->cur.stream) : NULL;
            if (s) {
                s->unread += n;
                if (y->cbs.on_data) y->cbs.on_data(y->arg, s->id, in + off, n);
            }
            off += n;
            y->bytes_in += n;
            if (y->left == 0) payload_done(y);
            continue;
        }
        size_t n = AP_YAMUX_HDR_LEN - y->hdr_len;
        if (n > len - off) n = len - off;
        memcpy(y->hdr + y->hdr_len, in + off, n);
        y->hdr_len += n;
        off += n;
        if (y->hdr_len < AP_YAMUX_HDR_LEN) break;
        y->hdr_len = 0;
        int rc = on_header(y);
        if (rc) return rc;
        if (y->cur.type == AP_YAMUX_DATA && y->cur.length == 0) payload_done(y);
    }
    return y->err;
}

/* ---- sending ---------------------------------------------------------------- */

int ap__yamux_open(ap_yamux_t *y, uint32_t *id)
{
    if (y->err) return y->err;
    if (y->goaway_sent || y->goaway_recv) return AP_ESHUTDOWN;
    if (y->streams.n >= y->max_streams) return AP_ELIMIT;
    if (y->next_id > UINT32_MAX - 2) return AP_ELIMIT;
    ystream_t *s = add(y, y->next_id);
    if (!s) return AP_ENOMEM;
    y->next_id += 2;
    frame(y, AP_YAMUX_WINDOW, AP_YAMUX_SYN, s->id, 0, NULL, 0);
    *id = s->id;
    return 0;
}

long ap__yamux_send(ap_yamux_t *y, uint32_t id, const uint8_t *data, size_t len)
{
    ystream_t *s = find(y, id);
    if (y->err || !s || s->fin_sent) return AP_ECLOSED;
    size_t sent = 0;
    while (sent < len && s->send_win) {
        size_t n = len - sent;
        if (n > s->send_win) n = s->send_win;
        if (n > AP_YAMUX_FRAME_MAX) n = AP_YAMUX_FRAME_MAX;
        frame(y, AP_YAMUX_DATA, 0, id, (uint32_t)n, data + sent, n);
        s->send_win -= (uint32_t)n;
        sent += n;
    }
    return (long)sent;
}

void ap__yamux_consume(ap_yamux_t *y, uint32_t id, size_t n)
{
    ystream_t *s = find(y, id);
    if (!s || y->err) return;
    if (n > s->unread) n = (size_t)s->unread;
    s->unread -= n;
    s->consumed += n;
    if (s->fin_recv || s->consumed < s->recv_max / 2) return;
    uint64_t delta = s->consumed;
    if (s->stalled && s->recv_max < AP_YAMUX_WINDOW_MAX && y->growth < AP_YAMUX_GROWTH_MAX) {
        uint32_t grow = s->recv_max; /* double */
        if (grow > AP_YAMUX_WINDOW_MAX - s->recv_max) grow = AP_YAMUX_WINDOW_MAX - s->recv_max;
        if (grow > AP_YAMUX_GROWTH_MAX - y->growth)
            grow = (uint32_t)(AP_YAMUX_GROWTH_MAX - y->growth);
        s->recv_max += grow;
        y->growth += grow;
        delta += grow;
    }
    s->recv_win += (uint32_t)delta;
    s->consumed = 0;
    s->stalled = false;
    frame(y, AP_YAMUX_WINDOW, 0, id, (uint32_t)delta, NULL, 0);
}

int ap__yamux_close(ap_yamux_t *y, uint32_t id)
{
    ystream_t *s = find(y, id);
    if (y->err || !s) return AP_ECLOSED;
    if (s->fin_sent) return 0;
    s->fin_sent = true;
    frame(y, AP_YAMUX_WINDOW, AP_YAMUX_FIN, id, 0, NULL, 0);
    if (s->fin_recv) finish(y, s, 0);
    return 0;
}

void ap__yamux_reset(ap_yamux_t *y, uint32_t id)
{
    ystream_t *s = find(y, id);
    if (!s) return;
    if (!y->err) frame(y, AP_YAMUX_WINDOW, AP_YAMUX_RST, id, 0, NULL, 0);
    forget(y, s);
}

void ap__yamux_ping(ap_yamux_t *y, uint32_t opaque)
{
    if (!y->err) frame(y, AP_YAMUX_PING, AP_YAMUX_SYN, 0, opaque, NULL, 0);
}

void ap__yamux_goaway(ap_yamux_t *y, uint32_t code)
{
    if (y->err || y->goaway_sent) return;
    y->goaway_sent = true;
    frame(y, AP_YAMUX_GOAWAY, 0, 0, code, NULL, 0);
}

size_t ap__yamux_nstreams(const ap_yamux_t *y)
{
    return y->streams.n;
}

uint32_t ap__yamux_send_window(const ap_yamux_t *y, uint32_t id)
{
    ystream_t *s = find(y, id);
    return s ? s->send_win : 0;
}

uint32_t ap__yamux_recv_window(const ap_yamux_t *y, uint32_t id)
{
    ystream_t *s = find(y, id);
    return s ? s->recv_max : 0;
}
