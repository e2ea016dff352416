/* Secure TCP transport: TCP + Noise XX + identity payload (see tcp.h). */
#include "net/tcp.h"
#include "apiary/error.h"
#include "apiary/log.h"
#include "base/buf.h"
#include "net/secure.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD            "net"
#define FRAME_MAX      (2u + AP_NOISE_MSG_MAX)
#define DRAIN_MS       5000u
#define BUF_RELEASE_MS 1000u

typedef enum { C_CONNECTING, C_HANDSHAKE, C_OPEN, C_CLOSING } conn_state_t;

typedef struct dial_req dial_req_t;
typedef struct wblock wblock_t;
struct dial_req {
    ap_tcp_t *t;
    ap_tcp_dial_fn cb;
    void *arg;
    ap_multiaddr_t ma;
    uint64_t deadline;
    ap_ma_resolve_t *res;
    bool timed_out;
    int status; /* for deferred completions */
    dial_req_t *next, *prev;
};

/* Write blocks: small enough that a stream's bytes reach the peer in pieces
 * well below a mux stream window (1 MiB by default), so the receiver opens
 * one piece while this side seals the next; big enough that a busy
 * connection costs one syscall per 256 KiB. */
#define WBLOCK_CAP (256u * 1024u + 2048u) /* 4 whole maximal frames, 8 of the mux's */
/* Writes made while a read is processed are held, to go out together (the
 * mux's credit frames, echoes), at the latest after this much input. */
#define RX_FLUSH_BYTES (128u * 1024u)
/* Small tails (credit frames, RPC, echoes) are handed to libuv before
 * earlier writes completed, at most this many writes in flight then. */
#define WBLOCK_EARLY_MAX   2
#define WBLOCK_EARLY_BYTES (16u * 1024u)

struct wblock {
    uv_write_t req;
    wblock_t *next;
    ap_tcp_conn_t *c;
    size_t len;
    bool submitted;
    uint8_t data[WBLOCK_CAP];
};

struct ap_tcp_conn {
    ap_tcp_t *t;
    uv_tcp_t h;
    uv_connect_t creq;
    uv_write_t wreq;
    conn_state_t st;
    bool outbound, announced, counted_hs, reading, paused, draining, want_writable;
    bool has_expected;
    bool in_read;        /* inside read_cb: the open tail waits (see flush) */
    size_t rx_unflushed; /* bytes processed in this read since writes went out */
    bool sink;           /* injected (fuzzing): no socket; written bytes are dropped */
    ap_peer_id_t expected;
    ap_peer_id_t peer; /* valid once authenticated */
    bool has_peer;
    int close_status;
    char who[64]; /* short PeerID or remote address, for logs */
    ap_secure_hs_t *hs;
    ap_noise_cs_t send, recv;
    uint8_t *part; /* partial frame */
    size_t plen;
    wblock_t *wq_head, *wq_tail, *wq_unsub, *spare;
    int inflight, nspare;
    size_t queued;
    uint64_t deadline, last_rx, last_tx, last_app, write_started, drain_started;
    dial_req_t *reqs; /* dials waiting for this connection */
    void *user;
    ap_tcp_conn_t *next, *prev; /* all connections */
    ap_tcp_conn_t *hnext;       /* peer table chain */
};

struct ap_tcp {
    uv_loop_t *loop;
    ap_secure_creds_t creds;
    ap_tcp_cfg_t cfg;
    ap_tcp_cbs_t cbs;
    void *arg;
    uv_tcp_t *listeners[AP_TCP_MAX_LISTENERS];
    ap_multiaddr_t listen_ma[AP_TCP_MAX_LISTENERS];
    int nlisteners;
    uv_timer_t sweep, kick;
    uint64_t sweep_ms;
    uint8_t *rbuf;
    ap_tcp_conn_t *conns;
    size_t nconns, nhandshaking;
    ap_tcp_conn_t **table;
    size_t table_cap, table_n;
    dial_req_t *resolving, *deferred;
    int handles;
    bool closing;
    void (*done)(void *);
    void *done_arg;
    ap_tcp_stats_t stats;
};

/* ---- small helpers ------------------------------------------------------ */

static uint64_t now_ms(ap_tcp_t *t)
{
    return uv_now(t->loop);
}

static void list_push(dial_req_t **head, dial_req_t *r)
{
    r->prev = NULL;
    r->next = *head;
    if (*head) (*head)->prev = r;
    *head = r;
}

static void list_remove(dial_req_t **head, dial_req_t *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        *head = r->next;
    if (r->next) r->next->prev = r->prev;
    r->next = r->prev = NULL;
}

static void maybe_finish(ap_tcp_t *t)
{
    if (!t->closing || t->handles > 0) return;
    void (*done)(void *) = t->done;
    void *arg = t->done_arg;
    free(t->table);
    free(t->rbuf);
    ap__secure_creds_clear(&t->creds);
    free(t);
    if (done) done(arg);
}

static void set_who_addr(ap_tcp_conn_t *c)
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    char ip[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (uv_tcp_getpeername(&c->h, (struct sockaddr *)&ss, &len) == 0) {
        if (ss.ss_family == AF_INET) {
            uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof ip);
            port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof ip);
            port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
        }
    }
    snprintf(c->who, sizeof c->who, "%s:%d", ip, port);
}

static void set_who_peer(ap_tcp_conn_t *c)
{
    char s[AP_PEER_SHORT_LEN];
    snprintf(c->who, sizeof c->who, "%s", ap_peer_id_short(&c->peer, s));
}

/* ---- peer table ---------------------------------------------------------- */

static ap_tcp_conn_t **bucket(ap_tcp_t *t, const ap_peer_id_t *p)
{
    return &t->table[ap_peer_id_hash(p) & (t->table_cap - 1)];
}

static int table_grow(ap_tcp_t *t)
{
    size_t ncap = t->table_cap ? t->table_cap * 2 : 64;
    ap_tcp_conn_t **nt = calloc(ncap, sizeof *nt);
    if (!nt) return AP_ENOMEM;
    for (size_t i = 0; i < t->table_cap; i++) {
        ap_tcp_conn_t *c = t->table[i];
        while (c) {
            ap_tcp_conn_t *nx = c->hnext;
            ap_tcp_conn_t **b = &nt[ap_peer_id_hash(&c->peer) & (ncap - 1)];
            c->hnext = *b;
            *b = c;
            c = nx;
        }
    }
    free(t->table);
    t->table = nt;
    t->table_cap = ncap;
    return 0;
}

static int table_insert(ap_tcp_t *t, ap_tcp_conn_t *c)
{
    if (t->table_n + 1 > t->table_cap) {
        int rc = table_grow(t);
        if (rc) return rc;
    }
    ap_tcp_conn_t **b = bucket(t, &c->peer);
    c->hnext = *b;
    *b = c;
    t->table_n++;
    return 0;
}

static void table_remove(ap_tcp_t *t, ap_tcp_conn_t *c)
{
    if (!t->table_cap) return;
    for (ap_tcp_conn_t **p = bucket(t, &c->peer); *p; p = &(*p)->hnext) {
        if (*p == c) {
            *p = c->hnext;
            c->hnext = NULL;
            t->table_n--;
            return;
        }
    }
}

ap_tcp_conn_t *ap__tcp_find(ap_tcp_t *t, const ap_peer_id_t *peer)
{
    if (!t->table_cap) return NULL;
    for (ap_tcp_conn_t *c = *bucket(t, peer); c; c = c->hnext)
        if (ap_peer_id_eq(&c->peer, peer)) return c;
    return NULL;
}

/* ---- dial completion ------------------------------------------------------- */

static void complete_req(dial_req_t *r, int status, ap_tcp_conn_t *c)
{
    r->cb(r->arg, status, status == 0 ? c : NULL);
    free(r);
}

static void complete_conn_reqs(ap_tcp_conn_t *c, int status)
{
    while (c->reqs) {
        dial_req_t *r = c->reqs;
        c->reqs = r->next;
        complete_req(r, status, c);
        /* a callback may have closed c: the rest then fail */
        if (status == 0 && c->st != C_OPEN) status = AP_ECLOSED;
    }
}

static void kick_cb(uv_timer_t *h)
{
    ap_tcp_t *t = h->data;
    while (t->deferred) {
        dial_req_t *r = t->deferred;
        list_remove(&t->deferred, r);
        ap_tcp_conn_t *c = NULL;
        int status = r->status;
        if (status == 0) {
            c = r->ma.has_peer ? ap__tcp_find(t, &r->ma.peer) : NULL;
            if (!c) status = AP_ECLOSED;
        }
        complete_req(r, status, c);
    }
}

static void defer_req(ap_tcp_t *t, dial_req_t *r, int status)
{
    r->status = status;
    list_push(&t->deferred, r);
    uv_timer_start(&t->kick, kick_cb, 0, 0);
}

/* ---- closing ----------------------------------------------------------------- */

static void wblocks_free(ap_tcp_conn_t *c);

static void conn_closed(uv_handle_t *h)
{
    ap_tcp_conn_t *c = h->data;
    ap_tcp_t *t = c->t;
    if (c->prev)
        c->prev->next = c->next;
    else
        t->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    t->nconns--;
    if (c->announced && t->cbs.on_close) t->cbs.on_close(t->arg, c, c->close_status);
    complete_conn_reqs(c, c->close_status ? c->close_status : AP_ECLOSED);
    if (c->hs) {
        ap__secure_clear(c->hs);
        free(c->hs);
    }
    ap__noise_cs_clear(&c->send);
    ap__noise_cs_clear(&c->recv);
    free(c->part);
    while (c->wq_head) { /* unsubmitted blocks; submitted ones completed before this */
        wblock_t *b = c->wq_head;
        c->wq_head = b->next;
        free(b);
    }
    wblocks_free(c);
    free(c);
    t->handles--;
    maybe_finish(t);
}

static void conn_close(ap_tcp_conn_t *c, int status)
{
    if (c->st == C_CLOSING) return;
    ap_tcp_t *t = c->t;
    if (c->st == C_OPEN && c->has_peer && ap__tcp_find(t, &c->peer) == c) table_remove(t, c);
    if (c->counted_hs) {
        c->counted_hs = false;
        t->nhandshaking--;
    }
    if (c->st == C_OPEN) t->stats.open--;
    c->st = C_CLOSING;
    c->close_status = status;
    uv_close((uv_handle_t *)&c->h, conn_closed);
}

/* Closes c because of bad input or a failed peer: exactly one WARN line. */
static void conn_fail(ap_tcp_conn_t *c, int err, const char *fmt, ...) AP_PRINTF(3, 4);
static void conn_fail(ap_tcp_conn_t *c, int err, const char *fmt, ...)
{
    if (c->st == C_CLOSING) return;
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    ap_warn(MOD, "closing %sconnection %s %s: %s (%s)", c->st == C_OPEN ? "" : "unauthenticated ",
            c->outbound ? "to" : "from", c->who, why, ap_err_name(err));
    if (c->st != C_OPEN) c->t->stats.handshakes_failed++;
    c->t->stats.closed_bad_input++;
    conn_close(c, err);
}

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

static void wblocks_free(ap_tcp_conn_t *c)
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
static void flush(ap_tcp_conn_t *c)
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
            conn_close(c, AP_ECLOSED);
            return;
        }
        b->submitted = true;
        if (c->inflight++ == 0) c->write_started = now_ms(c->t);
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
        conn_close(c, AP_ECLOSED);
        return;
    }
    c->write_started = now_ms(t); /* progress */
    flush(c);
    if (c->draining && c->queued == 0) {
        conn_close(c, 0);
        return;
    }
    if (c->want_writable && c->queued <= t->cfg.write_queue_max / 2 && c->st == C_OPEN) {
        c->want_writable = false;
        if (t->cbs.on_writable) t->cbs.on_writable(t->arg, c);
    }
}

/* Appends one plaintext handshake frame. */
static int queue_plain(ap_tcp_conn_t *c, const uint8_t *m, size_t n)
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
static int queue_sealed(ap_tcp_conn_t *c, const uv_buf_t *bufs, size_t n, size_t total)
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
        if (c->wq_tail->len + 2 + AP_NOISE_MSG_MAX > WBLOCK_CAP) flush(c); /* a full block */
    }
    c->last_tx = now_ms(c->t);
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
    int rc = queue_sealed(c, bufs, n, total);
    if (rc == AP_ELIMIT) {
        conn_fail(c, AP_ELIMIT, "send nonce exhausted");
        return AP_ECLOSED;
    }
    if (rc) return rc;
    c->last_app = c->last_tx;
    flush(c);
    return 0;
}

int ap__tcp_write(ap_tcp_conn_t *c, const uint8_t *data, size_t len)
{
    if (c->st != C_OPEN || c->draining) return AP_ECLOSED;
    if (len > 0) {
        uv_buf_t b = uv_buf_init((char *)data, (unsigned)len);
        int rc = queue_sealed(c, &b, 1, len);
        if (rc == AP_ELIMIT) {
            conn_fail(c, AP_ELIMIT, "send nonce exhausted");
            return AP_ECLOSED;
        }
        if (rc) {
            conn_fail(c, rc, "cannot queue %zu bytes", len);
            return AP_ECLOSED;
        }
        c->last_app = c->last_tx;
        flush(c);
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

/* ---- handshake ------------------------------------------------------------------- */

static int hs_write(ap_tcp_conn_t *c)
{
    uint8_t m[AP_TCP_HS_MSG_MAX];
    size_t n;
    int rc = ap__secure_write(c->hs, m, sizeof m, &n);
    if (rc == 0) rc = queue_plain(c, m, n);
    if (rc == 0) flush(c);
    return rc;
}

/* Both ends agree: between two connections to the same peer, keep the one
 * dialled by the smaller PeerID; same dialler: keep the older one. */
static bool new_wins(ap_tcp_t *t, ap_tcp_conn_t *old, ap_tcp_conn_t *nw)
{
    if (old->outbound == nw->outbound) return false;
    const ap_peer_id_t *self = &t->creds.id.id;
    bool self_smaller = ap_peer_id_cmp(self, &nw->peer) < 0;
    /* the winner is the connection we dialled iff we are the smaller id */
    return nw->outbound == self_smaller;
}

static void hs_finish(ap_tcp_conn_t *c)
{
    ap_tcp_t *t = c->t;
    int rc = ap__secure_split(c->hs, &c->send, &c->recv);
    free(c->hs);
    c->hs = NULL;
    if (rc) {
        conn_fail(c, AP_EPROTO, "handshake split failed");
        return;
    }
    if (c->counted_hs) {
        c->counted_hs = false;
        t->nhandshaking--;
    }
    t->stats.handshakes_ok++;
    ap_tcp_conn_t *old = ap__tcp_find(t, &c->peer);
    bool in_table = true;
    if (old && t->cfg.keep_duplicates && old->outbound != c->outbound) {
        /* both stay open; the layer above retires the loser (GOAWAY) */
        t->stats.dup_kept++;
        if (new_wins(t, old, c)) {
            ap_debug(MOD, "duplicate connection %s %s: it becomes the peer's connection",
                     c->outbound ? "to" : "from", c->who);
            table_remove(t, old);
        } else {
            ap_debug(MOD, "duplicate connection %s %s: kept open for the layer above",
                     c->outbound ? "to" : "from", c->who);
            in_table = false;
        }
    } else if (old) {
        t->stats.dup_closed++;
        if (!new_wins(t, old, c)) {
            ap_debug(MOD, "duplicate connection %s %s: keeping the existing one",
                     c->outbound ? "to" : "from", c->who);
            /* waiting dials get the surviving connection */
            while (c->reqs) {
                dial_req_t *r = c->reqs;
                c->reqs = r->next;
                complete_req(r, old->st == C_OPEN ? 0 : AP_ECLOSED, old);
            }
            conn_close(c, AP_EEXIST);
            return;
        }
        ap_debug(MOD, "duplicate connection %s %s: replacing the existing one",
                 c->outbound ? "to" : "from", c->who);
        conn_close(old, AP_EEXIST);
    }
    if (in_table && table_insert(t, c) != 0) {
        conn_close(c, AP_ENOMEM);
        return;
    }
    c->st = C_OPEN;
    t->stats.open++;
    c->announced = true;
    c->last_app = c->last_rx = c->last_tx = now_ms(t);
    ap_info(MOD, "connection %s %s open", c->outbound ? "to" : "from", c->who);
    if (t->cbs.on_conn) t->cbs.on_conn(t->arg, c);
    complete_conn_reqs(c, c->st == C_OPEN ? 0 : AP_ECLOSED);
}

static void hs_frame(ap_tcp_conn_t *c, const uint8_t *m, size_t n)
{
    int rc = ap__secure_read(c->hs, m, n);
    if (rc != 0) {
        const ap_peer_id_t *who = ap__secure_remote(c->hs);
        if (who) {
            c->peer = *who;
            set_who_peer(c);
        }
        if (rc == AP_EAUTH && who && c->has_expected) {
            char want[AP_PEER_ID_STR_MAX], got[AP_PEER_ID_STR_MAX];
            conn_fail(c, AP_EAUTH, "expected peer %s but it is %s",
                      ap_peer_id_str(&c->expected, want), ap_peer_id_str(who, got));
        } else {
            conn_fail(c, rc, "handshake message %d rejected", c->hs->noise.step + 1);
        }
        return;
    }
    if (ap__secure_remote(c->hs) && !c->has_peer) {
        c->peer = *ap__secure_remote(c->hs);
        c->has_peer = true;
        set_who_peer(c);
    }
    if (ap__secure_my_turn(c->hs) && (rc = hs_write(c)) != 0) {
        conn_fail(c, rc, "cannot write handshake message");
        return;
    }
    if (ap__secure_done(c->hs)) hs_finish(c);
}

/* ---- reading ---------------------------------------------------------------------- */

static void data_frame(ap_tcp_conn_t *c, uint8_t *m, size_t n)
{
    ap_tcp_t *t = c->t;
    int rc = ap__noise_cs_decrypt(&c->recv, NULL, 0, m, n, m);
    if (rc != 0) {
        conn_fail(c, rc == AP_ELIMIT ? AP_ELIMIT : AP_EAUTH,
                  "transport message %llu does not decrypt (altered, replayed or reordered)",
                  (unsigned long long)c->recv.n);
        return;
    }
    size_t plen = n - AP_NOISE_TAGLEN;
    if (plen == 0) return; /* keepalive */
    c->last_app = now_ms(t);
    if (t->cbs.on_data) t->cbs.on_data(t->arg, c, m, plen);
}

/* Checks a frame length as soon as its 2-byte header is known. */
static bool frame_len_ok(ap_tcp_conn_t *c, size_t len)
{
    if (c->st == C_HANDSHAKE) {
        if (len > AP_TCP_HS_MSG_MAX || len < AP_NOISE_DHLEN) {
            conn_fail(c, AP_EPROTO, "handshake message of %zu bytes", len);
            return false;
        }
        if (!ap__secure_my_turn(c->hs)) return true;
        conn_fail(c, AP_EPROTO, "handshake message out of turn");
        return false;
    }
    if (len < AP_NOISE_TAGLEN) {
        conn_fail(c, AP_EPROTO, "transport message of %zu bytes", len);
        return false;
    }
    return true;
}

static void frame(ap_tcp_conn_t *c, uint8_t *m, size_t n)
{
    if (c->st == C_HANDSHAKE)
        hs_frame(c, m, n);
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
    flush(c);
    c->in_read = true;
}

static void process(ap_tcp_conn_t *c, uint8_t *p, size_t n)
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
            conn_close(c, AP_ENOMEM);
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
            conn_fail(c, AP_EPROTO, "connection ended inside a %zu-byte message (truncated)",
                      c->plen >= 2 ? (size_t)ap__get_be16(c->part) : (size_t)0);
            return;
        }
        if (c->st == C_OPEN) {
            ap_info(MOD, "connection %s %s closed by peer", c->outbound ? "to" : "from", c->who);
        } else if (c->st == C_HANDSHAKE) {
            ap_debug(MOD, "%s closed during handshake", c->who);
            t->stats.handshakes_failed++;
        }
        conn_close(c, c->st == C_HANDSHAKE && c->outbound ? AP_EUNREACH : AP_ECLOSED);
        return;
    }
    t->stats.bytes_received += (uint64_t)nread;
    c->last_rx = now_ms(t);
    c->in_read = true;
    c->rx_unflushed = 0;
    process(c, t->rbuf, (size_t)nread);
    c->in_read = false;
    if (c->wq_unsub) flush(c); /* what was written while processing it */
}

static void start_reading(ap_tcp_conn_t *c)
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
        c->last_rx = now_ms(c->t);
        start_reading(c);
    }
}

/* ---- connections --------------------------------------------------------------- */

static ap_tcp_conn_t *conn_new(ap_tcp_t *t, bool outbound)
{
    ap_tcp_conn_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    if (uv_tcp_init(t->loop, &c->h) != 0) {
        free(c);
        return NULL;
    }
    c->t = t;
    c->h.data = c;
    c->wreq.data = c;
    c->creq.data = c;
    c->outbound = outbound;
    c->st = outbound ? C_CONNECTING : C_HANDSHAKE;
    c->next = t->conns;
    if (t->conns) t->conns->prev = c;
    t->conns = c;
    t->nconns++;
    t->handles++;
    return c;
}

static int conn_start_hs(ap_tcp_conn_t *c)
{
    ap_tcp_t *t = c->t;
    c->hs = malloc(sizeof *c->hs);
    if (!c->hs) return AP_ENOMEM;
    int rc = ap__secure_init_prologue(c->hs, &t->creds, c->outbound,
                                      c->has_expected ? &c->expected : NULL, NULL,
                                      (const uint8_t *)AP_TCP_PROLOGUE, strlen(AP_TCP_PROLOGUE));
    if (rc) return rc;
    c->st = C_HANDSHAKE;
    c->last_rx = c->last_tx = now_ms(t);
    uv_tcp_nodelay(&c->h, 1);
    start_reading(c);
    if (c->outbound) return hs_write(c);
    return 0;
}

static void on_connection(uv_stream_t *server, int status)
{
    ap_tcp_t *t = server->data;
    if (status < 0 || t->closing) return;
    ap_tcp_conn_t *c = conn_new(t, false);
    if (!c) return;
    if (uv_accept(server, (uv_stream_t *)&c->h) != 0) {
        conn_close(c, AP_EIO);
        return;
    }
    set_who_addr(c);
    /* Accept and drop over the caps, so the backlog never fills with
     * connections nobody will serve. */
    if (t->nconns > t->cfg.max_conns || t->nhandshaking >= t->cfg.max_handshakes) {
        ap_debug(MOD, "refusing connection from %s: %zu connections, %zu handshakes", c->who,
                 t->nconns - 1, t->nhandshaking);
        conn_close(c, AP_ELIMIT);
        return;
    }
    c->counted_hs = true;
    t->nhandshaking++;
    c->deadline = now_ms(t) + t->cfg.handshake_timeout_ms;
    int rc = conn_start_hs(c);
    if (rc) conn_close(c, rc);
}

static void on_connect(uv_connect_t *req, int status)
{
    ap_tcp_conn_t *c = req->data;
    if (c->st == C_CLOSING) return;
    if (status < 0) {
        ap_debug(MOD, "connect to %s failed: %s", c->who, uv_strerror(status));
        int e = ap_err_from_errno(status);
        conn_close(c, e == AP_ETIMEDOUT || e == AP_ECANCELED ? e : AP_EUNREACH);
        return;
    }
    int rc = conn_start_hs(c);
    if (rc) conn_close(c, rc);
}

static void start_connect(ap_tcp_t *t, dial_req_t *r, const ap_multiaddr_t *ma)
{
    ap_tcp_conn_t *c = conn_new(t, true);
    if (!c) {
        defer_req(t, r, AP_ENOMEM);
        return;
    }
    r->next = NULL;
    c->reqs = r;
    c->deadline = r->deadline;
    c->counted_hs = true;
    t->nhandshaking++;
    if (ma->has_peer) {
        c->has_expected = true;
        c->expected = ma->peer;
    }
    char text[AP_MA_TEXT_MAX];
    ap_multiaddr_t bare = *ma;
    bare.has_peer = false;
    ap_multiaddr_print(&bare, text, sizeof text);
    size_t wl = strnlen(text, sizeof c->who - 1);
    memcpy(c->who, text, wl);
    c->who[wl] = 0;
    struct sockaddr_storage ss;
    int rc = ap_multiaddr_to_sockaddr(ma, &ss, sizeof ss);
    if (rc == 0)
        rc = ap_err_from_errno(uv_tcp_connect(&c->creq, &c->h, (struct sockaddr *)&ss, on_connect));
    if (rc) conn_close(c, AP_EUNREACH);
}

static void on_resolved(void *arg, int status, const ap_multiaddr_t *addrs, size_t n)
{
    dial_req_t *r = arg;
    ap_tcp_t *t = r->t;
    list_remove(&t->resolving, r);
    r->res = NULL;
    t->handles--;
    if (t->closing)
        status = AP_ESHUTDOWN;
    else if (r->timed_out)
        status = AP_ETIMEDOUT;
    else if (status == AP_ENOTFOUND)
        status = AP_EUNREACH;
    if (status != 0 || n == 0) {
        complete_req(r, status ? status : AP_EUNREACH, NULL);
        maybe_finish(t);
        return;
    }
    start_connect(t, r, &addrs[0]);
}

static ap_tcp_conn_t *find_pending(ap_tcp_t *t, const ap_peer_id_t *peer)
{
    for (ap_tcp_conn_t *c = t->conns; c; c = c->next)
        if (c->outbound && c->has_expected && (c->st == C_CONNECTING || c->st == C_HANDSHAKE) &&
            ap_peer_id_eq(&c->expected, peer))
            return c;
    return NULL;
}

int ap__tcp_dial(ap_tcp_t *t, const char *addr, uint64_t timeout_ms, ap_tcp_dial_fn cb, void *arg)
{
    if (t->closing) return AP_ESHUTDOWN;
    if (!cb) return AP_EINVAL;
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) != 0 || !ma.has_tcp || ma.host == AP_MA_HOST_NONE)
        return AP_EADDR;
    if (ma.has_peer && ap_peer_id_eq(&ma.peer, &t->creds.id.id)) return AP_EINVAL;
    dial_req_t *r = calloc(1, sizeof *r);
    if (!r) return AP_ENOMEM;
    r->t = t;
    r->cb = cb;
    r->arg = arg;
    r->ma = ma;
    r->deadline = now_ms(t) + (timeout_ms ? timeout_ms : 30000);
    if (ma.has_peer) {
        if (ap__tcp_find(t, &ma.peer)) {
            defer_req(t, r, 0);
            return 0;
        }
        ap_tcp_conn_t *pc = find_pending(t, &ma.peer);
        if (pc) {
            r->next = pc->reqs;
            pc->reqs = r;
            return 0;
        }
    }
    if (t->nconns >= t->cfg.max_conns) {
        free(r);
        return AP_ELIMIT;
    }
    if (ma.host == AP_MA_HOST_DNS4 || ma.host == AP_MA_HOST_DNS6) {
        int rc = ap_multiaddr_resolve(t->loop, &ma, on_resolved, r, &r->res);
        if (rc) {
            free(r);
            return rc;
        }
        list_push(&t->resolving, r);
        t->handles++;
        return 0;
    }
    start_connect(t, r, &ma);
    return 0;
}

int ap__tcp_conn_inject(ap_tcp_t *t, const ap_peer_id_t *peer, const ap_noise_cs_t *send,
                        const ap_noise_cs_t *recv, bool outbound, ap_tcp_conn_t **out)
{
    if (t->closing) return AP_ESHUTDOWN;
    if (ap__tcp_find(t, peer)) return AP_EEXIST;
    ap_tcp_conn_t *c = conn_new(t, outbound);
    if (!c) return AP_ENOMEM;
    c->sink = true;
    c->peer = *peer;
    c->has_peer = true;
    c->send = *send;
    c->recv = *recv;
    set_who_peer(c);
    if (table_insert(t, c) != 0) {
        conn_close(c, AP_ENOMEM);
        return AP_ENOMEM;
    }
    c->st = C_OPEN;
    t->stats.open++;
    c->announced = true;
    c->last_app = c->last_rx = c->last_tx = now_ms(t);
    *out = c;
    if (t->cbs.on_conn) t->cbs.on_conn(t->arg, c);
    return 0;
}

void ap__tcp_conn_feed(ap_tcp_conn_t *c, const uint8_t *p, size_t n)
{
    if (c->st != C_OPEN) return;
    c->last_rx = now_ms(c->t);
    uint8_t *copy = malloc(n ? n : 1); /* process() decrypts in place */
    if (!copy) return;
    memcpy(copy, p, n);
    process(c, copy, n);
    free(copy);
}

bool ap__tcp_conn_is_open(const ap_tcp_conn_t *c)
{
    return c->st == C_OPEN;
}

void ap__tcp_conn_close(ap_tcp_conn_t *c)
{
    if (c->st == C_CLOSING) return;
    if (c->queued == 0 || c->st != C_OPEN) {
        conn_close(c, 0);
        return;
    }
    c->draining = true;
    c->drain_started = now_ms(c->t);
}

void ap__tcp_conn_abort(ap_tcp_conn_t *c, int err)
{
    conn_close(c, err);
}

const ap_peer_id_t *ap__tcp_conn_peer(const ap_tcp_conn_t *c)
{
    return &c->peer;
}
bool ap__tcp_conn_outbound(const ap_tcp_conn_t *c)
{
    return c->outbound;
}
void ap__tcp_conn_set_user(ap_tcp_conn_t *c, void *user)
{
    c->user = user;
}
void *ap__tcp_conn_user(const ap_tcp_conn_t *c)
{
    return c->user;
}
const ap_identity_t *ap__tcp_identity(const ap_tcp_t *t)
{
    return &t->creds.id;
}

/* ---- the sweep: deadlines, keepalive, dead peers, idle, buffers ----------------- */

static void sweep_conn(ap_tcp_t *t, ap_tcp_conn_t *c, uint64_t now)
{
    const ap_tcp_cfg_t *cfg = &t->cfg;
    if (c->st == C_CONNECTING || c->st == C_HANDSHAKE) {
        if (now >= c->deadline) {
            if (c->outbound) {
                ap_debug(MOD, "dial to %s timed out", c->who);
                conn_close(c, AP_ETIMEDOUT);
            } else {
                conn_fail(c, AP_ETIMEDOUT, "handshake not finished in %llu ms",
                          (unsigned long long)cfg->handshake_timeout_ms);
            }
        }
        return;
    }
    if (c->st != C_OPEN) return;
    if (c->draining && now - c->drain_started >= DRAIN_MS) {
        conn_close(c, 0);
        return;
    }
    if (c->inflight > 0 && now - c->write_started >= cfg->dead_ms) {
        conn_fail(c, AP_ETIMEDOUT, "peer read nothing for %llu ms",
                  (unsigned long long)(now - c->write_started));
        return;
    }
    if (!c->paused && now - c->last_rx >= cfg->dead_ms) {
        conn_fail(c, AP_ETIMEDOUT, "peer silent for %llu ms",
                  (unsigned long long)(now - c->last_rx));
        return;
    }
    if (cfg->idle_ms && now - c->last_app >= cfg->idle_ms) {
        ap_info(MOD, "closing idle connection %s %s", c->outbound ? "to" : "from", c->who);
        ap__tcp_conn_close(c);
        return;
    }
    if (now - c->last_tx >= cfg->keepalive_ms && c->queued == 0) {
        if (queue_sealed(c, NULL, 0, 0) == 0)
            flush(c);
        else
            conn_close(c, AP_ELIMIT);
        return;
    }
    /* release buffers of quiet connections (idle memory stays small) */
    if (c->inflight == 0 && c->queued == 0 && now - c->last_tx >= BUF_RELEASE_MS) wblocks_free(c);
    if (c->plen == 0 && c->part && now - c->last_rx >= BUF_RELEASE_MS) {
        free(c->part);
        c->part = NULL;
    }
}

static void sweep_cb(uv_timer_t *h)
{
    ap_tcp_t *t = h->data;
    uint64_t now = now_ms(t);
    for (ap_tcp_conn_t *c = t->conns, *nx; c; c = nx) {
        nx = c->next; /* c is only freed in a close callback, later */
        sweep_conn(t, c, now);
    }
    for (dial_req_t *r = t->resolving; r; r = r->next) {
        if (!r->timed_out && now >= r->deadline) {
            r->timed_out = true;
            ap_multiaddr_resolve_cancel(r->res);
        }
    }
}

/* ---- lifecycle ------------------------------------------------------------------- */

static uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

int ap__tcp_new(uv_loop_t *loop, const ap_identity_t *id, const ap_tcp_cfg_t *cfg,
                const ap_tcp_cbs_t *cbs, void *arg, ap_tcp_t **out)
{
    ap_tcp_t *t = calloc(1, sizeof *t);
    if (!t) return AP_ENOMEM;
    t->loop = loop;
    if (cfg) t->cfg = *cfg;
    ap_tcp_cfg_t *c = &t->cfg;
    if (!c->max_conns) c->max_conns = 1024;
    if (!c->max_handshakes) c->max_handshakes = 256;
    if (!c->handshake_timeout_ms) c->handshake_timeout_ms = 10000;
    if (!c->keepalive_ms) c->keepalive_ms = 15000;
    if (!c->dead_ms) c->dead_ms = c->keepalive_ms == UINT64_MAX ? UINT64_MAX : 3 * c->keepalive_ms;
    if (!c->write_queue_max) c->write_queue_max = 4u << 20;
    if (c->read_buf_size < 4096) c->read_buf_size = c->read_buf_size ? 4096 : 1024u * 1024u;
    if (cbs) t->cbs = *cbs;
    t->arg = arg;
    int rc = ap__secure_creds_init(&t->creds, id, c->hash, NULL);
    t->rbuf = malloc(c->read_buf_size);
    if (rc || !t->rbuf) {
        free(t->rbuf);
        ap__secure_creds_clear(&t->creds);
        free(t);
        return rc ? rc : AP_ENOMEM;
    }
    memset(t->rbuf, 0, c->read_buf_size); /* pre-fault once */
    uint64_t shortest = min_u64(min_u64(c->keepalive_ms, c->dead_ms), c->handshake_timeout_ms);
    if (c->idle_ms) shortest = min_u64(shortest, c->idle_ms);
    t->sweep_ms = shortest / 4;
    if (t->sweep_ms < 5) t->sweep_ms = 5;
    if (t->sweep_ms > 250) t->sweep_ms = 250;
    uv_timer_init(loop, &t->sweep);
    uv_timer_init(loop, &t->kick);
    t->sweep.data = t->kick.data = t;
    t->handles += 2;
    uv_timer_start(&t->sweep, sweep_cb, t->sweep_ms, t->sweep_ms);
    *out = t;
    return 0;
}

static void handle_closed(uv_handle_t *h)
{
    ap_tcp_t *t = h->data;
    t->handles--;
    maybe_finish(t);
}

static void listener_closed(uv_handle_t *h)
{
    ap_tcp_t *t = h->data;
    free(h);
    t->handles--;
    maybe_finish(t);
}

static void kick_closed(uv_handle_t *h)
{
    ap_tcp_t *t = h->data;
    while (t->deferred) {
        dial_req_t *r = t->deferred;
        list_remove(&t->deferred, r);
        complete_req(r, AP_ESHUTDOWN, NULL);
    }
    handle_closed(h);
}

void ap__tcp_close(ap_tcp_t *t, void (*done)(void *arg), void *arg)
{
    if (t->closing) return;
    t->closing = true;
    t->done = done;
    t->done_arg = arg;
    for (int i = 0; i < t->nlisteners; i++)
        uv_close((uv_handle_t *)t->listeners[i], listener_closed);
    uv_close((uv_handle_t *)&t->sweep, handle_closed);
    uv_close((uv_handle_t *)&t->kick, kick_closed);
    for (ap_tcp_conn_t *c = t->conns; c; c = c->next) conn_close(c, AP_ESHUTDOWN);
    for (dial_req_t *r = t->resolving; r; r = r->next) ap_multiaddr_resolve_cancel(r->res);
}

int ap__tcp_listen(ap_tcp_t *t, const char *multiaddr)
{
    if (t->closing) return AP_ESHUTDOWN;
    if (t->nlisteners >= AP_TCP_MAX_LISTENERS) return AP_ELIMIT;
    ap_multiaddr_t ma;
    struct sockaddr_storage ss;
    if (ap_multiaddr_parse(&ma, multiaddr) != 0 || ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss))
        return AP_EADDR;
    uv_tcp_t *l = malloc(sizeof *l);
    if (!l) return AP_ENOMEM;
    int rc = uv_tcp_init(t->loop, l);
    if (rc) {
        free(l);
        return ap_err_from_errno(rc);
    }
    l->data = t;
    t->handles++;
    rc = uv_tcp_bind(l, (struct sockaddr *)&ss, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)l, 511, on_connection);
    int len = sizeof ss;
    if (rc == 0) rc = uv_tcp_getsockname(l, (struct sockaddr *)&ss, &len);
    if (rc) {
        ap_error(MOD, "cannot listen on %s: %s", multiaddr, uv_strerror(rc));
        uv_close((uv_handle_t *)l, listener_closed);
        return ap_err_from_errno(rc);
    }
    t->listeners[t->nlisteners] = l;
    ap_multiaddr_from_sockaddr(&t->listen_ma[t->nlisteners], &ss);
    t->listen_ma[t->nlisteners].has_peer = true;
    t->listen_ma[t->nlisteners].peer = t->creds.id.id;
    t->nlisteners++;
    return 0;
}

int ap__tcp_listen_addrs(ap_tcp_t *t, ap_multiaddr_t *out, int max)
{
    for (int i = 0; i < t->nlisteners && i < max; i++) out[i] = t->listen_ma[i];
    return t->nlisteners;
}

void ap__tcp_get_stats(const ap_tcp_t *t, ap_tcp_stats_t *out)
{
    *out = t->stats;
    out->handshaking = (uint32_t)t->nhandshaking;
}
