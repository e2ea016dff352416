/* libp2p connections: what leaves for the wire (see p2p_impl.h). Raw
 * writes before the handshake, Noise transport messages after it, the
 * write blocks they are sealed into and when those go to libuv.
 *
 * Sealing: written bytes (yamux frames, the native mux's bytes) are
 * gathered into one open Noise message in the open write block, sealed in
 * place once it holds AP_NOISE_PLAIN_MAX bytes or when its block leaves. So
 * several frames share one message (a 64 KiB data frame with its header and
 * the window updates around it, the native mux's frames) instead of costing
 * a message, a tag and a nonce each.
 *
 * Submission: the open block goes to libuv when it is full; at the end of
 * the loop callback that wrote it (a read, a write completion: everything
 * one callback answers leaves in one write); outside callbacks at once when
 * no write is in flight, or when it is small and the socket has taken
 * everything so far (a credit frame must not wait), and otherwise when the
 * write in flight completes: the bytes written meanwhile leave together.
 * Blocks are reused (a few spares per busy connection, so a bulk transfer
 * touches no fresh pages); an idle connection keeps one. */
#include "apiary/error.h"
#include "apiary/log.h"
#include "p2p/p2p_impl.h"

#include <stdlib.h>
#include <string.h>

#define WBLK_CAP    (256u * 1024u + 4096u) /* 4 whole maximal Noise messages */
#define WBLK_SPARES ((AP_P2P_CONN_WQ_MAX / WBLK_CAP) + 2)
#define EARLY_BYTES (16u * 1024u) /* a small block goes early ... */
#define EARLY_MAX   2             /* ... behind at most this many writes */
#define MSG_MIN     1024u         /* no new message in less room than this */

typedef struct wblk {
    uv_write_t req;
    struct wblk *next;
    size_t len;
    uint8_t data[WBLK_CAP];
} wblk_t;

/* Bytes of the open block, its open message included (sealed size). */
static size_t open_bytes(const ap_p2p_conn_t *c)
{
    if (!c->cur) return 0;
    return c->cur->len + (c->msg_open ? 2 + c->msg_len + AP_NOISE_TAGLEN : 0);
}

/* Bytes written and not yet on the socket (for a relayed connection: in
 * its carrier stream's queue). */
static size_t unsent(const ap_p2p_conn_t *c)
{
    size_t q = c->car ? ap__p2p_stream_queued(c->car) : c->tcp.write_queue_size;
    return q + open_bytes(c);
}

size_t ap__p2p_conn_backlog(const ap_p2p_conn_t *c)
{
    return unsent(c) + c->qbytes;
}

void ap__p2p_conn_want_drain(ap_p2p_conn_t *c, size_t low)
{
    c->drain_owed = true;
    c->drain_low = low;
}

void ap__p2p_drain_check(ap_p2p_conn_t *c)
{
    if (c->closing || !c->drain_owed || ap__p2p_conn_backlog(c) > c->drain_low) return;
    c->drain_owed = false;
    if (c->x.on_drain) c->x.on_drain(c, c->arg);
}

#define RC_CHUNK (64u * 1024u) /* unsent bytes are reserved in steps of this */

void ap__p2p_unsent_check(ap_p2p_conn_t *c)
{
    if (c->closing) return;
    size_t u = unsent(c);
    static ap_log_limit_t lim = {.burst = 8, .window_ms = 10000};
    if (u > AP_P2P_UNSENT_MAX) {
        ap_log_limited(&lim, AP_LOG_WARN, "p2p",
                       "peer %s: closing: it does not read (%zu bytes unsent, at most %u)",
                       c->peer_short[0] ? c->peer_short : "(handshake)", u,
                       (unsigned)AP_P2P_UNSENT_MAX);
        ap__p2p_conn_fail(c, AP_ELIMIT);
        return;
    }
    ap_rcmgr_t *m = c->h->rc;
    if (!m || !c->rc.conn) return;
    uint64_t want = ((uint64_t)u + RC_CHUNK - 1) / RC_CHUNK * RC_CHUNK;
    if (want > c->rc_mem) {
        ap_rc_scope_t *full = NULL;
        if (ap_rc_reserve_mem(m, &c->rc, want - c->rc_mem, &full) != 0) {
            char d[200];
            ap_rc_scope_describe(full, d, sizeof d);
            ap_log_limited(&lim, AP_LOG_WARN, "p2p",
                           "peer %s: closing: it does not read (%zu bytes unsent): %s",
                           c->peer_short, u, d);
            ap__p2p_conn_fail(c, AP_ELIMIT);
            return;
        }
        c->rc_mem = want;
    } else if (c->rc_mem > want + RC_CHUNK) {
        ap_rc_release_mem(m, &c->rc, c->rc_mem - want);
        c->rc_mem = want;
    }
}

bool ap__p2p_wq_full(const ap_p2p_conn_t *c)
{
    if (c->car) return unsent(c) > AP_P2P_CONN_WQ_MAX || ap__p2p_wq_full(c->car->c);
    return unsent(c) > AP_P2P_CONN_WQ_MAX;
}

static void blk_put(ap_p2p_conn_t *c, wblk_t *b)
{
    if (c->nspare < (int)WBLK_SPARES && !c->closing) {
        b->next = c->spare;
        c->spare = b;
        c->nspare++;
    } else {
        free(b);
    }
}

/* An idle connection keeps one spare block. */
static void spares_trim(ap_p2p_conn_t *c)
{
    while (c->nspare > 1) {
        wblk_t *b = c->spare;
        c->spare = b->next;
        c->nspare--;
        free(b);
    }
}

void ap__p2p_wblocks_free(ap_p2p_conn_t *c)
{
    free(c->cur);
    c->cur = NULL;
    c->msg_open = false;
    while (c->spare) {
        wblk_t *b = c->spare;
        c->spare = b->next;
        free(b);
    }
    c->nspare = 0;
}

static void written(uv_write_t *req, int status)
{
    wblk_t *b = (wblk_t *)req;
    ap_p2p_conn_t *c = req->handle->data;
    (void)status; /* a failed write shows up as a read error */
    c->inflight--;
    blk_put(c, b);
    if (c->closing) return;
    c->batch++;
    if (c->wq_blocked && unsent(c) <= AP_P2P_CONN_WQ_MAX / 2) ap__p2p_conn_drained(c);
    c->batch--;
    ap__p2p_conn_submit(c); /* what was written while b was in flight */
    ap__p2p_unsent_check(c);
    if (c->closing) return;
    if (c->inflight == 0 && !c->cur && c->qbytes == 0) spares_trim(c);
    ap__p2p_drain_check(c);
}

/* Seals the open message in place. */
static void seal_open(ap_p2p_conn_t *c)
{
    if (!c->msg_open) return;
    c->msg_open = false;
    uint8_t *o = c->cur->data + c->cur->len;
    if (ap__noise_cs_encrypt(&c->tx, NULL, 0, o + 2, c->msg_len, o + 2) != 0) {
        ap__p2p_conn_fail(c, AP_ELIMIT); /* the send nonce is exhausted */
        return;
    }
    ap__put_be16(o, (uint16_t)(c->msg_len + AP_NOISE_TAGLEN));
    c->cur->len += 2 + c->msg_len + AP_NOISE_TAGLEN;
}

void ap__p2p_conn_submit(ap_p2p_conn_t *c)
{
    seal_open(c);
    wblk_t *b = c->cur;
    if (!b || b->len == 0 || c->closing) return;
    c->cur = NULL;
    if (c->relayed) { /* the carrier stream copies it */
        int rc = c->car ? ap__p2p_stream_queue(c->car, b->data, b->len) : AP_ECLOSED;
        blk_put(c, b);
        if (rc) ap__p2p_conn_fail(c, rc);
        return;
    }
    uv_buf_t ub = uv_buf_init((char *)b->data, (unsigned)b->len);
    if (uv_write(&b->req, (uv_stream_t *)&c->tcp, &ub, 1, written) != 0) {
        free(b);
        ap__p2p_conn_fail(c, AP_ECLOSED);
        return;
    }
    c->inflight++;
}

/* An open block with room for need more bytes (need <= WBLK_CAP), or NULL
 * when the connection failed. */
static wblk_t *blk_room(ap_p2p_conn_t *c, size_t need)
{
    if (c->cur && WBLK_CAP - open_bytes(c) < need) ap__p2p_conn_submit(c);
    if (c->closing) return NULL;
    if (!c->cur) {
        wblk_t *b = c->spare;
        if (b) {
            c->spare = b->next;
            c->nspare--;
        } else if (!(b = malloc(sizeof *b))) {
            ap__p2p_conn_fail(c, AP_ENOMEM);
            return NULL;
        }
        b->len = 0;
        c->cur = b;
        c->msg_open = false;
    }
    return c->cur;
}

/* After a write: the open block leaves now or later (see the top). */
static void out_done(ap_p2p_conn_t *c)
{
    ap__p2p_unsent_check(c);
    if (!c->cur || c->closing) return;
    size_t n = open_bytes(c);
    if (n > WBLK_CAP - 2048) {
        ap__p2p_conn_submit(c);
        return;
    }
    if (c->batch > 0) return;
    if (c->relayed || c->inflight == 0 ||
        (n <= EARLY_BYTES && c->inflight < EARLY_MAX && c->tcp.write_queue_size == 0))
        ap__p2p_conn_submit(c);
}

void ap__p2p_raw_write(ap_p2p_conn_t *c, const uint8_t *p, size_t n)
{
    seal_open(c); /* order: nothing sealed may follow these bytes */
    while (n && !c->closing) {
        size_t k = n < AP_NOISE_MSG_MAX + 2 ? n : AP_NOISE_MSG_MAX + 2;
        wblk_t *b = blk_room(c, k);
        if (!b) return;
        memcpy(b->data + b->len, p, k);
        b->len += k;
        p += k;
        n -= k;
    }
    out_done(c);
}

void ap__p2p_secure_write(ap_p2p_conn_t *c, const uint8_t *a, size_t an, const uint8_t *b,
                          size_t bn)
{
    while ((an || bn) && !c->closing) {
        if (c->msg_open && c->msg_len == AP_NOISE_PLAIN_MAX) seal_open(c);
        wblk_t *w = blk_room(c, 2 + MSG_MIN + AP_NOISE_TAGLEN);
        if (!w) return;
        if (!c->msg_open) {
            c->msg_open = true;
            c->msg_len = 0;
        }
        /* room in this message: the Noise limit, and what the block holds */
        size_t room = AP_NOISE_PLAIN_MAX - c->msg_len;
        size_t in_blk = WBLK_CAP - (w->len + 2 + c->msg_len + AP_NOISE_TAGLEN);
        if (in_blk < room) room = in_blk;
        if (room == 0) { /* the block is full: it leaves, the next one opens */
            ap__p2p_conn_submit(c);
            continue;
        }
        uint8_t *dst = w->data + w->len + 2 + c->msg_len;
        const uint8_t **src = an ? &a : &b;
        size_t *left = an ? &an : &bn;
        size_t k = *left < room ? *left : room;
        memcpy(dst, *src, k);
        *src += k;
        *left -= k;
        c->msg_len += k;
    }
    out_done(c);
}
