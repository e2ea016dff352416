/* Secure TCP transport: connection I/O. Write blocks, sealing and the write
 * queue's pipelining; reading, framing and opening Noise messages. */
#include "net/tcp_impl.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- writing ---------------------------------------------------------------------
 * The write queue is a FIFO of blocks of up to WBLOCK_CAP bytes of whole
 * frames. Full blocks are handed to libuv at once (several may be in
 * flight), so sealing the next block overlaps with the kernel sending the
 * previous one. The last, partly filled block goes out at once when nothing
 * is in flight; a small one (WBLOCK_EARLY_BYTES) also when libuv holds no
 * unsent bytes and fewer than WBLOCK_EARLY_MAX writes await their callback
 * (a write that went straight into the kernel still waits a loop turn for
 * its callback; a credit frame must not wait for it). Otherwise it waits for
 * a batch (bulk data, or the socket is full). While a read is
 * processed it waits for the end of the read (or RX_FLUSH_BYTES of it), so
 * what the layer above answers to one read goes out in one write. A few
 * spare blocks are kept per busy connection to avoid page faults of fresh
 * memory, and released by the sweep once the connection is quiet. */

static void write_cb(uv_write_t *req, int status);

static void wblock_recycle(ap_tcp_conn_t *c, wblock_t *b)
{
    /* keep as many spares as the queue cap can use: no fresh pages while busy */
    size_t max_spare = c->t->cfg.write_queue_max / WBLOCK_CAP + 2;
    if ((size_t)c->nspare < max_spare && c->st != C_CLOSING) {
        b->next = c->spare;
        c->spare = b;
        c->nspare++;
    } else {
        free(b);
    }
}

void ap__tcp_wblocks_free(ap_tcp_conn_t *c)
{
    while (c->spare) {
        wblock_t *b = c->spare;
        c->spare = b->next;
        free(b);
    }
    c->nspare = 0;
}

/* Room for a frame of need bytes at the end of the queue. */
static uint8_t *wq_reserve(ap_tcp_conn_t *c, size_t need)
{
    wblock_t *t = c->wq_tail;
    if (t && !t->submitted && WBLOCK_CAP - t->len >= need) return t->data + t->len;
    wblock_t *b = c->spare;
    if (b) {
        c->spare = b->next;
        c->nspare--;
    } else if (!(b = malloc(sizeof *b))) {
        return NULL;
    }
    b->next = NULL;
    b->c = c;
    b->len = 0;
    b->submitted = false;
    b->req.data = b;
    if (t)
        t->next = b;
    else
        c->wq_head = b;
    c->wq_tail = b;
    if (!c->wq_unsub) c->wq_unsub = b;
    return b->data;
}

static void wq_commit(ap_tcp_conn_t *c, size_t n)
{
    c->wq_tail->len += n;
    c->queued += n;
}

/* Hands ready blocks to libuv. */
void ap__tcp_flush(ap_tcp_conn_t *c)
{
    if (c->st == C_CLOSING || c->st == C_CONNECTING) return;
    if (c->sink) { /* no socket: the bytes count as sent */
        while (c->wq_head) {
            wblock_t *b = c->wq_head;
            c->wq_head = b->next;
            c->queued -= b->len;
            wblock_recycle(c, b);
        }
        c->wq_tail = c->wq_unsub = NULL;
        return;
    }
    while (c->wq_unsub) {
        wblock_t *b = c->wq_unsub;
        if (!b->next) { /* the open tail: see above */
            if (c->in_read) break;
            if (c->inflight > 0 && (b->len > WBLOCK_EARLY_BYTES || c->h.write_queue_size > 0 ||
                                    c->inflight >= WBLOCK_EARLY_MAX))
                break;
        }
        uv_buf_t ub = uv_buf_init((char *)b->data, (unsigned)b->len);
        int rc = uv_write(&b->req, (uv_stream_t *)&c->h, &ub, 1, write_cb);
        if (rc != 0) {
            if (c->st == C_OPEN)
                ap_info(MOD, "connection %s %s lost: %s", c->outbound ? "to" : "from", c->who,
                        uv_strerror(rc));
            ap__tcp_conn_abort(c, AP_ECLOSED);
            return;
        }
        b->submitted = true;
        if (c->inflight++ == 0) c->write_started = ap__tcp_now_ms(c->t);
        c->wq_unsub = b->next;
    }
}

static void write_cb(uv_write_t *req, int status)
{
    wblock_t *b = req->data;
    ap_tcp_conn_t *c = b->c;
    ap_tcp_t *t = c->t;
    /* writes complete in order: b is the head */
    c->wq_head = b->next;
    if (!c->wq_head) c->wq_tail = NULL;
    c->inflight--;
    c->queued -= b->len;
    if (status == 0) t->stats.bytes_sent += b->len;
    wblock_recycle(c, b);
    if (c->st == C_CLOSING) return;
    if (status < 0) {
        /* the peer is gone (reset, broken pipe): one line, as when a read
         * finds it closed */
        if (c->st == C_OPEN)
            ap_info(MOD, "connection %s %s lost: write failed: %s", c->outbound ? "to" : "from",
                    c->who, uv_strerror(status));
        else
            ap_debug(MOD, "write to %s failed: %s", c->who, uv_strerror(status));
        ap__tcp_conn_abort(c, AP_ECLOSED);
        return;
    }
    c->write_started = ap__tcp_now_ms(t); /* progress */
    ap__tcp_flush(c);
    if (c->draining && c->queued == 0) {
        ap__tcp_conn_abort(c, 0);
        return;
    }
    if (c->want_writable && c->queued <= t->cfg.write_queue_max / 2 && c->st == C_OPEN) {
        c->want_writable = false;
        if (t->cbs.on_writable) t->cbs.on_writable(t->arg, c);
    }
}

/* Appends one plaintext handshake frame. */
int ap__tcp_queue_plain(ap_tcp_conn_t *c, const uint8_t *m, size_t n)
{
    uint8_t *p = wq_reserve(c, 2 + n);
    if (!p) return AP_ENOMEM;
    ap__put_be16(p, (uint16_t)n);
    memcpy(p + 2, m, n);
    wq_commit(c, 2 + n);
    return 0;
}

/* Encrypts the gathered buffers into transport frames. A zero-length send
 * makes one empty frame (keepalive). */
int ap__tcp_queue_sealed(ap_tcp_conn_t *c, const uv_buf_t *bufs, size_t n, size_t total)
{
    size_t frames = total ? (total + AP_NOISE_PLAIN_MAX - 1) / AP_NOISE_PLAIN_MAX : 1;
    size_t bi = 0, boff = 0, left = total;
    (void)n;
    for (size_t f = 0; f < frames; f++) {
        size_t chunk = left < AP_NOISE_PLAIN_MAX ? left : AP_NOISE_PLAIN_MAX;
        uint8_t *hdr = wq_reserve(c, 2 + chunk + AP_NOISE_TAGLEN);
        if (!hdr) return AP_ENOMEM; /* frames queued so far stay valid */
        uint8_t *body = hdr + 2;
        const uint8_t *src = body;
        size_t got = 0;
        if (chunk > 0 && bufs[bi].len - boff >= chunk) {
            /* the chunk lies in one buffer: seal straight from it, no copy */
            src = (const uint8_t *)bufs[bi].base + boff;
            got = chunk;
            boff += chunk;
            if (boff == bufs[bi].len) {
                bi++;
                boff = 0;
            }
        }
        while (got < chunk) {
            size_t avail = bufs[bi].len - boff;
            size_t take = chunk - got < avail ? chunk - got : avail;
            memcpy(body + got, bufs[bi].base + boff, take);
            got += take;
            boff += take;
            if (boff == bufs[bi].len) {
                bi++;
                boff = 0;
            }
        }
        int rc = ap__noise_cs_encrypt(&c->send, NULL, 0, src, chunk, body);
        if (rc) return rc; /* nonce exhausted: caller closes */
        ap__put_be16(hdr, (uint16_t)(chunk + AP_NOISE_TAGLEN));
        wq_commit(c, 2 + chunk + AP_NOISE_TAGLEN);
        left -= chunk;
        if (c->wq_tail->len + 2 + AP_NOISE_MSG_MAX > WBLOCK_CAP)
            ap__tcp_flush(c); /* a full block */
    }
    c->last_tx = ap__tcp_now_ms(c->t);
    return 0;
}

int ap__tcp_sendv(ap_tcp_conn_t *c, const uv_buf_t *bufs, size_t n)
{
    if (c->st != C_OPEN || c->draining) return AP_ECLOSED;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += bufs[i].len;
    if (total == 0) return 0;
    if (c->queued > 0 && c->queued + total > c->t->cfg.write_queue_max) {
        c->want_writable = true;
        return AP_EAGAIN;
    }
    int rc = ap__tcp_queue_sealed(c, bufs, n, total);
    if (rc == AP_ELIMIT) {
        ap__tcp_conn_fail(c, AP_ELIMIT, "send nonce exhausted");
        return AP_ECLOSED;
    }
    if (rc) return rc;
    c->last_app = c->last_tx;
    ap__tcp_touch(c);
    ap__tcp_flush(c);
    return 0;
}

int ap__tcp_write(ap_tcp_conn_t *c, const uint8_t *data, size_t len)
{
    if (c->st != C_OPEN || c->draining) return AP_ECLOSED;
    if (len > 0) {
        uv_buf_t b = uv_buf_init((char *)data, (unsigned)len);
        int rc = ap__tcp_queue_sealed(c, &b, 1, len);
        if (rc == AP_ELIMIT) {
            ap__tcp_conn_fail(c, AP_ELIMIT, "send nonce exhausted");
            return AP_ECLOSED;
        }
        if (rc) {
            ap__tcp_conn_fail(c, rc, "cannot queue %zu bytes", len);
            return AP_ECLOSED;
        }
        c->last_app = c->last_tx;
        ap__tcp_touch(c);
        ap__tcp_flush(c);
    }
    if (c->queued > c->t->cfg.write_queue_max) {
        c->want_writable = true;
        return 1;
    }
    return 0;
}

int ap__tcp_send(ap_tcp_conn_t *c, const uint8_t *data, size_t len)
{
    uv_buf_t b = uv_buf_init((char *)data, (unsigned)len);
    return ap__tcp_sendv(c, &b, 1);
}

size_t ap__tcp_queued(const ap_tcp_conn_t *c)
{
    return c->queued;
}

int ap__tcp_writes_inflight(const ap_tcp_conn_t *c)
{
    return c->inflight;
}

/* ---- reading ---------------------------------------------------------------------- */

static void data_frame(ap_tcp_conn_t *c, uint8_t *m, size_t n)
{
    ap_tcp_t *t = c->t;
    int rc = ap__noise_cs_decrypt(&c->recv, NULL, 0, m, n, m);
    if (rc != 0) {
        ap__tcp_conn_fail(
            c, rc == AP_ELIMIT ? AP_ELIMIT : AP_EAUTH,
            "transport message %llu does not decrypt (altered, replayed or reordered)",
            (unsigned long long)c->recv.n);
        return;
    }
    size_t plen = n - AP_NOISE_TAGLEN;
    if (plen == 0) return; /* keepalive */
    c->last_app = ap__tcp_now_ms(t);
    ap__tcp_touch(c);
    if (t->cbs.on_data) t->cbs.on_data(t->arg, c, m, plen);
}

/* Checks a frame length as soon as its 2-byte header is known. */
static bool frame_len_ok(ap_tcp_conn_t *c, size_t len)
{
    if (c->st == C_HANDSHAKE) {
        if (len > AP_TCP_HS_MSG_MAX || len < AP_NOISE_DHLEN) {
            ap__tcp_conn_fail(c, AP_EPROTO, "handshake message of %zu bytes", len);
            return false;
        }
        if (!ap__secure_my_turn(c->hs)) return true;
        ap__tcp_conn_fail(c, AP_EPROTO, "handshake message out of turn");
        return false;
    }
    if (len < AP_NOISE_TAGLEN) {
        ap__tcp_conn_fail(c, AP_EPROTO, "transport message of %zu bytes", len);
        return false;
    }
    return true;
}

static void frame(ap_tcp_conn_t *c, uint8_t *m, size_t n)
{
    if (c->st == C_HANDSHAKE)
        ap__tcp_hs_frame(c, m, n);
    else if (c->st == C_OPEN)
        data_frame(c, m, n);
}

/* A frame of n bytes was processed inside read_cb: writes held since the
 * read began go out once RX_FLUSH_BYTES were processed. */
static void read_progress(ap_tcp_conn_t *c, size_t n)
{
    if (!c->in_read) return;
    c->rx_unflushed += n;
    if (c->rx_unflushed < RX_FLUSH_BYTES) return;
    c->rx_unflushed = 0;
    if (!c->wq_unsub) return;
    c->in_read = false;
    ap__tcp_flush(c);
    c->in_read = true;
}

void ap__tcp_process(ap_tcp_conn_t *c, uint8_t *p, size_t n)
{
    while (n > 0 && (c->st == C_HANDSHAKE || c->st == C_OPEN)) {
        if (c->plen == 0 && n >= 2) {
            size_t len = ap__get_be16(p);
            if (!frame_len_ok(c, len)) return;
            if (n >= 2 + len) { /* whole frame in the read buffer: no copy */
                frame(c, p + 2, len);
                p += 2 + len;
                n -= 2 + len;
                read_progress(c, 2 + len);
                continue;
            }
        }
        /* accumulate a partial frame */
        if (!c->part && !(c->part = malloc(FRAME_MAX))) {
            ap__tcp_conn_abort(c, AP_ENOMEM);
            return;
        }
        size_t need;
        if (c->plen < 2) {
            need = 2 - c->plen;
        } else {
            need = 2 + (size_t)ap__get_be16(c->part) - c->plen;
        }
        size_t take = n < need ? n : need;
        memcpy(c->part + c->plen, p, take);
        c->plen += take;
        p += take;
        n -= take;
        if (c->plen == 2 && !frame_len_ok(c, ap__get_be16(c->part))) return;
        if (c->plen >= 2 && c->plen == 2 + (size_t)ap__get_be16(c->part)) {
            size_t len = c->plen - 2;
            c->plen = 0;
            frame(c, c->part + 2, len);
            read_progress(c, 2 + len);
        }
    }
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    ap_tcp_conn_t *c = h->data;
    (void)suggested;
    *buf = uv_buf_init((char *)c->t->rbuf, (unsigned)c->t->cfg.read_buf_size);
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    ap_tcp_conn_t *c = s->data;
    ap_tcp_t *t = c->t;
    (void)buf;
    if (nread == 0) return;
    if (nread < 0) {
        if (c->plen > 0) {
            ap__tcp_conn_fail(c, AP_EPROTO,
                              "connection ended inside a %zu-byte message (truncated)",
                              c->plen >= 2 ? (size_t)ap__get_be16(c->part) : (size_t)0);
            return;
        }
        if (c->st == C_OPEN) {
            ap_info(MOD, "connection %s %s closed by peer", c->outbound ? "to" : "from", c->who);
        } else if (c->st == C_HANDSHAKE) {
            ap_debug(MOD, "%s closed during handshake", c->who);
            t->stats.handshakes_failed++;
        }
        ap__tcp_conn_abort(c, c->st == C_HANDSHAKE && c->outbound ? AP_EUNREACH : AP_ECLOSED);
        return;
    }
    t->stats.bytes_received += (uint64_t)nread;
    c->last_rx = ap__tcp_now_ms(t);
    if (!c->outbound && !c->sniffed) {
        c->sniffed = true;
        if (ap__tcp_sniff(c, t->rbuf, (size_t)nread)) return;
    }
    c->in_read = true;
    c->rx_unflushed = 0;
    ap__tcp_process(c, t->rbuf, (size_t)nread);
    c->in_read = false;
    if (c->wq_unsub) ap__tcp_flush(c); /* what was written while processing it */
}

void ap__tcp_start_reading(ap_tcp_conn_t *c)
{
    if (c->reading || c->paused || c->st == C_CLOSING) return;
    if (uv_read_start((uv_stream_t *)&c->h, alloc_cb, read_cb) == 0) c->reading = true;
}

void ap__tcp_pause_read(ap_tcp_conn_t *c, bool paused)
{
    if (c->st == C_CLOSING) return;
    c->paused = paused;
    if (paused && c->reading) {
        uv_read_stop((uv_stream_t *)&c->h);
        c->reading = false;
    } else if (!paused) {
        c->last_rx = ap__tcp_now_ms(c->t);
        ap__tcp_start_reading(c);
    }
}
