/* libp2p connections over TCP (see p2p_conn.h). */
#include "p2p/p2p_conn.h"
#include "apiary/error.h"
#include "apiary/log.h"
#include "base/buf.h"
#include "base/u64map.h"
#include "net/secure.h"
#include "p2p/identify.h"
#include "p2p/multistream.h"
#include "p2p/yamux.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define PROTOS_MAX  32
#define NOISE_PROTO "/noise"

static const char *const noise_list[] = {NOISE_PROTO};
static const char *const muxer_list[] = {AP_YAMUX_PROTO};

struct ap_p2p_host {
    uv_loop_t *loop;
    ap_secure_creds_t creds;
    char agent[AP_IDENTIFY_STR_MAX + 1];
    const ap_p2p_proto_t *protos[PROTOS_MAX];
    const char *names[PROTOS_MAX];
    size_t nprotos;
    const char *ctl_names[PROTOS_MAX]; /* what a relayed connection may open */
    size_t nctl;
    bool relay_bulk; /* bulk protocols also over relayed connections */
    uv_tcp_t listener;
    bool listening, freeing;
    ap_multiaddr_t bound;
    size_t nconns;
    struct ap_p2p_conn *conns; /* every live connection */
    void (*done)(void *);      /* after the host is freed (ap__p2p_host_free_then) */
    void *done_arg;
    ap_p2p_addrs_fn addrs_fn; /* identify's listen addresses (ap__p2p_host_set_addrs) */
    void *addrs_arg;
};

enum { P_CONNECT, P_MSS, P_NOISE, P_MUXSEL, P_YAMUX, P_DEAD };

struct ap_p2p_conn {
    uv_tcp_t tcp;
    uv_connect_t creq;
    ap_p2p_host_t *h;
    bool initiator, ready, closing;
    int phase, status;
    ap_mss_t mss;
    ap_secure_hs_t hs;
    ap_noise_cs_t tx, rx;
    bool early;
    ap_buf_t raw; /* bytes not yet framed */
    ap_yamux_t y;
    bool y_init;
    ap_u64map_t streams; /* yamux id -> ap_p2p_stream_t * */
    ap_peer_id_t peer;
    char peer_short[AP_PEER_SHORT_LEN];
    ap_multiaddr_t remote; /* the address the peer is seen at */
    bool wq_blocked;       /* a stream waits for the socket's queue to drain */
    bool relayed;          /* over a circuit: car carries the bytes */
    ap_p2p_stream_t *car;
    ap_p2p_conn_cbs_t cbs;
    void *arg;
    struct ap_p2p_conn *next, *prev;
};

struct ap_p2p_stream {
    ap_p2p_conn_t *c;
    uint32_t id;
    ap_mss_t mss;
    bool ready;
    const ap_p2p_proto_t *proto;
    const char *want[1];
    void *udata;
    /* send queue: bytes past the peer's window (or the socket's queue) */
    ap_buf_t q;
    size_t qoff;        /* bytes of q already sent */
    bool fin_pending;   /* FIN once q is empty */
    bool lclosed;       /* ap__p2p_stream_close was called */
    bool want_writable; /* a write was refused: on_writable owed */
    bool echo;          /* the echo server: credit goes back as bytes leave q */
    bool manual;        /* ap__p2p_stream_set_flow: the protocol consumes */
    void (*on_writable)(ap_p2p_stream_t *s);
    ap_p2p_conn_t *inner; /* a connection carried by this stream */
};

static const char *who(ap_p2p_conn_t *c)
{
    return c->peer_short[0] ? c->peer_short : "(handshake)";
}

/* ---- raw and encrypted writes ------------------------------------------------ */

typedef struct wreq {
    uv_write_t req;
    size_t len;
    uint8_t data[];
} wreq_t;

static void conn_fail(ap_p2p_conn_t *c, int err);
static void conn_drained(ap_p2p_conn_t *c);
static void process(ap_p2p_conn_t *c);

static size_t queued(const ap_p2p_stream_t *s);
static int stream_queue(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
static void written(uv_write_t *req, int status);

static bool wq_full(const ap_p2p_conn_t *c)
{
    if (c->car) return queued(c->car) > AP_P2P_CONN_WQ_MAX || wq_full(c->car->c);
    return c->tcp.write_queue_size > AP_P2P_CONN_WQ_MAX;
}

/* Hands w to the socket, or to the carrier stream (which copies it). */
static void send_wreq(ap_p2p_conn_t *c, wreq_t *w)
{
    if (c->relayed) {
        int rc = c->car ? stream_queue(c->car, w->data, w->len) : AP_ECLOSED;
        free(w);
        if (rc) conn_fail(c, rc);
        return;
    }
    uv_buf_t b = uv_buf_init((char *)w->data, (unsigned)w->len);
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, written) != 0) {
        free(w);
        conn_fail(c, AP_ECLOSED);
    }
}

static void written(uv_write_t *req, int status)
{
    ap_p2p_conn_t *c = req->handle->data;
    free(req);
    (void)status; /* a failed write shows up as a read error */
    if (c && !c->closing && c->wq_blocked && c->tcp.write_queue_size <= AP_P2P_CONN_WQ_MAX / 2)
        conn_drained(c);
}

static void raw_write(ap_p2p_conn_t *c, const uint8_t *p, size_t n)
{
    if (c->closing || n == 0) return;
    wreq_t *w = malloc(sizeof *w + n);
    if (!w) {
        conn_fail(c, AP_ENOMEM);
        return;
    }
    memcpy(w->data, p, n);
    w->len = n;
    send_wreq(c, w);
}

/* Encrypts p into Noise transport messages (2-byte length, ciphertext). */
static void secure_write2(ap_p2p_conn_t *c, const uint8_t *a, size_t an, const uint8_t *b,
                          size_t bn)
{
    size_t total = an + bn;
    size_t nmsg = (total + AP_NOISE_PLAIN_MAX - 1) / AP_NOISE_PLAIN_MAX;
    if (c->closing || total == 0) return;
    size_t cap = total + nmsg * (2 + AP_NOISE_TAGLEN);
    wreq_t *w = malloc(sizeof *w + cap);
    if (!w) {
        conn_fail(c, AP_ENOMEM);
        return;
    }
    size_t o = 0, done = 0;
    while (done < total) {
        size_t n = total - done < AP_NOISE_PLAIN_MAX ? total - done : AP_NOISE_PLAIN_MAX;
        uint8_t *dst = w->data + o + 2;
        size_t from_a = done < an ? (an - done < n ? an - done : n) : 0; /* gather a, then b */
        if (from_a) memcpy(dst, a + done, from_a);
        if (n > from_a) memcpy(dst + from_a, b + (done + from_a - an), n - from_a);
        if (ap__noise_cs_encrypt(&c->tx, NULL, 0, dst, n, dst) != 0) {
            free(w);
            conn_fail(c, AP_ELIMIT);
            return;
        }
        ap__put_be16(w->data + o, (uint16_t)(n + AP_NOISE_TAGLEN));
        o += 2 + n + AP_NOISE_TAGLEN;
        done += n;
    }
    w->len = o;
    send_wreq(c, w);
}

static void flush_mss(ap_p2p_conn_t *c, bool secure)
{
    size_t n;
    const uint8_t *o = ap__mss_output(&c->mss, &n);
    if (secure)
        secure_write2(c, o, n, NULL, 0);
    else
        raw_write(c, o, n);
    ap__mss_output_done(&c->mss);
}

/* ---- streams --------------------------------------------------------------- */

static ap_p2p_stream_t *stream_of(ap_p2p_conn_t *c, uint32_t id)
{
    uint64_t v;
    return ap__u64map_get(&c->streams, id, &v) ? (ap_p2p_stream_t *)(uintptr_t)v : NULL;
}

static void stream_flush_mss(ap_p2p_stream_t *s)
{
    size_t n;
    const uint8_t *o = ap__mss_output(&s->mss, &n);
    if (n) ap__yamux_send(&s->c->y, s->id, o, n); /* a few bytes: within any window */
    ap__mss_output_done(&s->mss);
}

static ap_p2p_stream_t *stream_add(ap_p2p_conn_t *c, uint32_t id)
{
    ap_p2p_stream_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->c = c;
    s->id = id;
    if (ap__u64map_put(&c->streams, id, (uint64_t)(uintptr_t)s) != 0) {
        free(s);
        return NULL;
    }
    return s;
}

static void stream_free(ap_p2p_stream_t *s)
{
    if (s->inner) { /* the carried connection ends with its carrier */
        s->inner->car = NULL;
        conn_fail(s->inner, AP_ECLOSED);
    }
    ap__buf_free(&s->q);
    free(s);
}

static size_t queued(const ap_p2p_stream_t *s)
{
    return s->q.len - s->qoff;
}

/* Sends what the window and the socket take from s's queue; then a pending
 * FIN and an owed on_writable. Returns false if s is gone. */
static bool stream_flush(ap_p2p_stream_t *s)
{
    ap_p2p_conn_t *c = s->c;
    uint32_t id = s->id;
    while (queued(s) && !c->closing) {
        if (wq_full(c)) {
            c->wq_blocked = true;
            break;
        }
        size_t n = queued(s) < AP_P2P_CONN_WQ_MAX ? queued(s) : AP_P2P_CONN_WQ_MAX;
        long k = ap__yamux_send(&c->y, id, s->q.data + s->qoff, n);
        if (k < 0) { /* our direction or the stream is gone: drop the rest */
            s->qoff = s->q.len;
            break;
        }
        s->qoff += (size_t)k;
        if (s->echo && k > 0) ap__yamux_consume(&c->y, id, (size_t)k);
        if ((size_t)k < n) break; /* window full: on_writable from yamux */
    }
    if (s->qoff == s->q.len) {
        s->qoff = s->q.len = 0;
        if (s->q.cap > (256u << 10)) ap__buf_free(&s->q); /* bulk is over: give it back */
    } else if (s->qoff > (1u << 20) && s->qoff > s->q.len / 2) {
        ap__buf_consume(&s->q, s->qoff); /* compact */
        s->qoff = 0;
    }
    if (c->closing) return true;
    if (s->fin_pending && queued(s) == 0) {
        s->fin_pending = false;
        ap__yamux_close(&c->y, id); /* may finish s */
        if (stream_of(c, id) != s) return false;
    }
    if (s->inner && s->inner->wq_blocked && !wq_full(s->inner)) conn_drained(s->inner);
    if (stream_of(c, id) != s) return false;
    if (s->want_writable && queued(s) <= AP_P2P_STREAM_QUEUE_MAX / 2) {
        s->want_writable = false;
        if (s->on_writable) s->on_writable(s);
        if (stream_of(c, id) != s) return false;
    }
    return true;
}

/* The socket's queue drained: every stream with queued bytes goes on. */
static void conn_drained(ap_p2p_conn_t *c)
{
    c->wq_blocked = false;
    size_t pos = 0, n = 0;
    uint64_t k, v;
    uint32_t *ids = malloc((c->streams.n + 1) * sizeof *ids);
    if (!ids) {
        conn_fail(c, AP_ENOMEM);
        return;
    }
    while (ap__u64map_next(&c->streams, &pos, &k, &v))
        if (queued((ap_p2p_stream_t *)(uintptr_t)v)) ids[n++] = (uint32_t)k;
    for (size_t i = 0; i < n && !c->closing && !c->wq_blocked; i++) {
        ap_p2p_stream_t *s = stream_of(c, ids[i]);
        if (s) stream_flush(s);
    }
    free(ids);
}

/* Appends to s's queue and sends what can go. */
static int stream_queue(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    ap_p2p_conn_t *c = s->c;
    if (queued(s) == 0 && !wq_full(c)) {
        long k = ap__yamux_send(&c->y, s->id, p, n);
        if (k < 0) return (int)k;
        if (s->echo && k > 0) ap__yamux_consume(&c->y, s->id, (size_t)k);
        p += k;
        n -= (size_t)k;
        if (n == 0) return 0;
    }
    if (ap__buf_append(&s->q, p, n) != 0) return AP_ENOMEM;
    if (wq_full(c)) c->wq_blocked = true;
    return 0;
}

static void y_writable(void *arg, uint32_t id)
{
    ap_p2p_stream_t *s = stream_of(arg, id);
    if (s && queued(s)) stream_flush(s);
}

static void y_write(void *arg, const uint8_t hdr[AP_YAMUX_HDR_LEN], const uint8_t *p, size_t n)
{
    secure_write2(arg, hdr, AP_YAMUX_HDR_LEN, p, n);
}

static int y_open(void *arg, uint32_t id)
{
    ap_p2p_conn_t *c = arg;
    ap_p2p_stream_t *s = stream_add(c, id);
    if (!s) return AP_ENOMEM;
    bool all = !c->relayed || c->h->relay_bulk;
    ap__mss_init(&s->mss, false, all ? c->h->names : c->h->ctl_names,
                 all ? c->h->nprotos : c->h->nctl);
    stream_flush_mss(s);
    return 0;
}

static void y_data(void *arg, uint32_t id, const uint8_t *p, size_t n)
{
    ap_p2p_conn_t *c = arg;
    ap_p2p_stream_t *s = stream_of(c, id);
    if (!s) {
        ap__yamux_consume(&c->y, id, n);
        return;
    }
    if (!s->ready) {
        size_t used = 0;
        int rc = ap__mss_feed(&s->mss, p, n, &used);
        ap__yamux_consume(&c->y, id, rc ? n : used); /* negotiation bytes are read now */
        stream_flush_mss(s);
        if (rc) {
            ap_warn("p2p", "peer %s: stream %u negotiation failed: %s", who(c), (unsigned)id,
                    ap_err_name(rc));
            ap__yamux_reset(&c->y, id);
            ap__u64map_del(&c->streams, id, NULL);
            if (s->proto && s->proto->on_close) s->proto->on_close(s, rc);
            stream_free(s);
            return;
        }
        if (ap__mss_state(&s->mss) != AP_MSS_DONE) return;
        const char *sel = ap__mss_selected(&s->mss);
        if (!s->proto)
            for (size_t i = 0; i < c->h->nprotos; i++)
                if (strcmp(c->h->names[i], sel) == 0) s->proto = c->h->protos[i];
        s->ready = true;
        if (s->proto->on_open) s->proto->on_open(s);
        if (stream_of(c, id) != s) {
            ap__yamux_consume(&c->y, id, n - used);
            return;
        }
        p += used;
        n -= used;
    }
    if (n && !s->manual && !s->echo) ap__yamux_consume(&c->y, id, n);
    if (n && s->inner) {
        ap_p2p_conn_t *in = s->inner;
        if (ap__buf_append(&in->raw, p, n) != 0)
            conn_fail(in, AP_ENOMEM);
        else
            process(in);
    } else if (n && s->proto->on_data)
        s->proto->on_data(s, p, n);
}

static void y_fin(void *arg, uint32_t id)
{
    ap_p2p_stream_t *s = stream_of(arg, id);
    if (s && s->inner) conn_fail(s->inner, AP_ECLOSED);
    if (s && s->ready && s->proto->on_fin) s->proto->on_fin(s);
}

static void y_close(void *arg, uint32_t id, int st)
{
    ap_p2p_conn_t *c = arg;
    ap_p2p_stream_t *s = stream_of(c, id);
    if (!s) return;
    ap__u64map_del(&c->streams, id, NULL);
    if (s->proto && s->proto->on_close) s->proto->on_close(s, st);
    stream_free(s);
}

static const ap_yamux_cbs_t ycbs = {y_write,    y_open,  y_data, y_fin,
                                    y_writable, y_close, NULL,   NULL};

static bool host_bulk(const ap_p2p_host_t *h, const char *name)
{
    for (size_t i = 0; i < h->nprotos; i++)
        if (strcmp(h->names[i], name) == 0) {
            for (size_t j = 0; j < h->nctl; j++)
                if (h->ctl_names[j] == h->names[i]) return false;
            return true;
        }
    return false;
}

int ap__p2p_stream_open(ap_p2p_conn_t *c, const ap_p2p_proto_t *proto, void *udata,
                        ap_p2p_stream_t **out)
{
    if (!c->ready || c->closing) return AP_ESTATE;
    if (c->relayed && !c->h->relay_bulk && host_bulk(c->h, proto->name)) return AP_EPERM;
    uint32_t id;
    int rc = ap__yamux_open(&c->y, &id);
    if (rc) return rc;
    ap_p2p_stream_t *s = stream_add(c, id);
    if (!s) {
        ap__yamux_reset(&c->y, id);
        return AP_ENOMEM;
    }
    s->proto = proto;
    s->udata = udata;
    s->want[0] = proto->name;
    rc = ap__mss_init(&s->mss, true, s->want, 1);
    if (rc) {
        ap__yamux_reset(&c->y, id);
        ap__u64map_del(&c->streams, id, NULL);
        stream_free(s);
        return rc;
    }
    stream_flush_mss(s);
    if (out) *out = s;
    return 0;
}

int ap__p2p_stream_write(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    if (!s->ready || s->c->closing) return AP_ESTATE;
    if (s->lclosed) return AP_ECLOSED;
    if (n == 0) return 0;
    if (queued(s) && (n > AP_P2P_STREAM_QUEUE_MAX || queued(s) > AP_P2P_STREAM_QUEUE_MAX - n)) {
        s->want_writable = true;
        return AP_EAGAIN;
    }
    return stream_queue(s, p, n);
}

size_t ap__p2p_stream_queued(const ap_p2p_stream_t *s)
{
    return queued(s);
}

void ap__p2p_stream_set_flow(ap_p2p_stream_t *s, void (*on_writable)(ap_p2p_stream_t *s),
                             bool manual_consume)
{
    s->on_writable = on_writable;
    s->manual = manual_consume;
}

void ap__p2p_stream_consume(ap_p2p_stream_t *s, size_t n)
{
    ap__yamux_consume(&s->c->y, s->id, n);
}

int ap__p2p_stream_close(ap_p2p_stream_t *s)
{
    if (s->lclosed) return 0;
    s->lclosed = true;
    if (queued(s)) {
        s->fin_pending = true;
        return 0;
    }
    return ap__yamux_close(&s->c->y, s->id);
}

void ap__p2p_stream_reset(ap_p2p_stream_t *s)
{
    ap_p2p_conn_t *c = s->c;
    ap__yamux_reset(&c->y, s->id);
    ap__u64map_del(&c->streams, s->id, NULL);
    if (s->proto && s->proto->on_close) s->proto->on_close(s, AP_ECANCELED);
    stream_free(s);
}

void *ap__p2p_stream_udata(const ap_p2p_stream_t *s)
{
    return s->udata;
}

void ap__p2p_stream_set_udata(ap_p2p_stream_t *s, void *udata)
{
    s->udata = udata;
}

ap_p2p_conn_t *ap__p2p_stream_conn(const ap_p2p_stream_t *s)
{
    return s->c;
}

/* ---- the upgrade ------------------------------------------------------------- */

static void host_release(ap_p2p_host_t *h)
{
    void (*done)(void *) = h->done;
    void *arg = h->done_arg;
    ap__secure_creds_clear(&h->creds);
    free(h);
    if (done) done(arg);
}

static void conn_closed(uv_handle_t *hd)
{
    ap_p2p_conn_t *c = hd->data;
    ap_p2p_host_t *h = c->h;
    /* outside every callback chain: the streams end, then the connection */
    if (c->y_init) ap__yamux_free(&c->y, c->status ? c->status : AP_ECLOSED);
    c->y_init = false;
    ap__u64map_free(&c->streams);
    if (c->next) c->next->prev = c->prev;
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->cbs.on_close) c->cbs.on_close(c, c->arg, c->status);
    ap__secure_clear(&c->hs);
    ap__noise_cs_clear(&c->tx);
    ap__noise_cs_clear(&c->rx);
    ap__buf_free(&c->raw);
    free(c);
    h->nconns--;
    if (h->freeing && h->nconns == 0 && !h->listening) host_release(h);
}

static void conn_fail(ap_p2p_conn_t *c, int err)
{
    if (c->closing) return;
    c->closing = true;
    c->status = err;
    c->phase = P_DEAD;
    if (c->car) { /* the carrier ends once what we sent has left */
        ap_p2p_stream_t *car = c->car;
        c->car = NULL;
        car->inner = NULL;
        ap__p2p_stream_close(car);
    }
    uv_read_stop((uv_stream_t *)&c->tcp);
    uv_close((uv_handle_t *)&c->tcp, conn_closed);
}

void ap__p2p_conn_close(ap_p2p_conn_t *c)
{
    if (c->y_init && !c->closing) ap__yamux_goaway(&c->y, AP_YAMUX_GOAWAY_NORMAL);
    conn_fail(c, 0);
}

const ap_peer_id_t *ap__p2p_conn_peer(const ap_p2p_conn_t *c)
{
    return c->ready ? &c->peer : NULL;
}

const ap_multiaddr_t *ap__p2p_conn_remote(const ap_p2p_conn_t *c)
{
    return &c->remote;
}

ap_p2p_host_t *ap__p2p_conn_host(const ap_p2p_conn_t *c)
{
    return c->h;
}

uv_loop_t *ap__p2p_host_loop(const ap_p2p_host_t *h)
{
    return h->loop;
}

const ap_p2p_proto_t *ap__p2p_stream_proto(const ap_p2p_stream_t *s)
{
    return s->proto;
}

const char *ap__p2p_conn_muxer(const ap_p2p_conn_t *c, bool *early)
{
    if (early) *early = c->early;
    return c->ready ? AP_YAMUX_PROTO : NULL;
}

static void feed_plain(ap_p2p_conn_t *c, const uint8_t *p, size_t n);

static void start_yamux(ap_p2p_conn_t *c)
{
    ap__yamux_init(&c->y, c->initiator, &ycbs, c, 0);
    c->y_init = true;
    c->phase = P_YAMUX;
    c->ready = true;
    ap_debug("p2p", "peer %s: connected (yamux%s)", who(c), c->early ? ", early" : "");
    if (c->cbs.on_ready) c->cbs.on_ready(c, c->arg);
}

static void noise_step(ap_p2p_conn_t *c)
{
    if (ap__secure_my_turn(&c->hs)) {
        static uint8_t msg[2 + AP_NOISE_MSG_MAX];
        size_t n;
        int rc = ap__secure_write(&c->hs, msg + 2, AP_NOISE_MSG_MAX, &n);
        if (rc) {
            conn_fail(c, rc);
            return;
        }
        ap__put_be16(msg, (uint16_t)n);
        raw_write(c, msg, n + 2);
    }
    if (!ap__noise_hs_done(&c->hs.noise)) return;
    c->peer = *ap__secure_remote(&c->hs);
    ap_peer_id_short(&c->peer, c->peer_short);
    int mux = c->hs.info.muxer;
    if (ap__secure_split(&c->hs, &c->tx, &c->rx) != 0) {
        conn_fail(c, AP_ESTATE);
        return;
    }
    if (mux >= 0) {
        c->early = true;
        start_yamux(c);
        return;
    }
    c->phase = P_MUXSEL;
    ap__mss_init(&c->mss, c->initiator, muxer_list, 1);
    flush_mss(c, true);
}

static void feed_plain(ap_p2p_conn_t *c, const uint8_t *p, size_t n)
{
    if (c->phase == P_MUXSEL) {
        size_t used;
        int rc = ap__mss_feed(&c->mss, p, n, &used);
        flush_mss(c, true);
        if (rc) {
            ap_warn("p2p", "peer %s: muxer negotiation failed: %s", who(c), ap_err_name(rc));
            conn_fail(c, rc);
            return;
        }
        if (ap__mss_state(&c->mss) != AP_MSS_DONE) return;
        start_yamux(c);
        p += used;
        n -= used;
    }
    if (c->phase == P_YAMUX && n) {
        int rc = ap__yamux_feed(&c->y, p, n);
        if (rc) {
            ap_warn("p2p", "peer %s: yamux: %s", who(c), ap_err_name(rc));
            conn_fail(c, rc);
        }
    }
}

/* Handles the bytes in c->raw as far as they go. */
static void process(ap_p2p_conn_t *c)
{
    size_t off = 0;
    while (!c->closing && off < c->raw.len) {
        const uint8_t *p = c->raw.data + off;
        size_t left = c->raw.len - off;
        if (c->phase == P_MSS) {
            size_t used;
            int rc = ap__mss_feed(&c->mss, p, left, &used);
            flush_mss(c, false);
            off += used;
            if (rc) {
                ap_warn("p2p", "peer %s: security negotiation failed: %s", who(c), ap_err_name(rc));
                conn_fail(c, rc);
                break;
            }
            if (ap__mss_state(&c->mss) != AP_MSS_DONE) break;
            c->phase = P_NOISE;
            noise_step(c); /* the initiator writes message 1 */
            continue;
        }
        if (left < 2) break;
        size_t flen = ap__get_be16(p);
        if (left < 2 + flen) break;
        off += 2 + flen;
        if (c->phase == P_NOISE) {
            int rc = ap__secure_read(&c->hs, p + 2, flen);
            if (rc) {
                const ap_peer_id_t *got = ap__secure_remote(&c->hs);
                char a[AP_PEER_SHORT_LEN], b[AP_PEER_SHORT_LEN];
                if (rc == AP_ENOTSUP)
                    ap_warn("p2p", "peer %s: refused: its identity key is %s, not Ed25519", who(c),
                            ap__secure_key_type_name(c->hs.info.key_type));
                else if (rc == AP_EAUTH && got && c->hs.has_expected)
                    ap_warn("p2p", "peer %s: refused: dialled %s, reached another peer",
                            ap_peer_id_short(got, a), ap_peer_id_short(&c->hs.expected, b));
                else
                    ap_warn("p2p", "peer %s: Noise handshake failed: %s", who(c), ap_err_name(rc));
                conn_fail(c, rc);
                break;
            }
            noise_step(c);
            continue;
        }
        /* transport message: decrypt in place */
        uint8_t *m = c->raw.data + off - flen;
        if (flen < AP_NOISE_TAGLEN || ap__noise_cs_decrypt(&c->rx, NULL, 0, m, flen, m) != 0) {
            ap_warn("p2p", "peer %s: bad transport message", who(c));
            conn_fail(c, AP_EAUTH);
            break;
        }
        feed_plain(c, m, flen - AP_NOISE_TAGLEN);
    }
    if (!c->closing) ap__buf_consume(&c->raw, off);
}

static void alloc_cb(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    ap_p2p_conn_t *c = hd->data;
    if (ap__buf_reserve(&c->raw, 65536) != 0) {
        buf->base = NULL;
        buf->len = 0;
        return;
    }
    buf->base = (char *)c->raw.data + c->raw.len;
    buf->len = c->raw.cap - c->raw.len;
}

static void read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    ap_p2p_conn_t *c = st->data;
    if (nread < 0) {
        conn_fail(c, nread == UV_EOF ? AP_ECLOSED : ap_err_from_errno((int)nread));
        return;
    }
    c->raw.len += (size_t)nread;
    process(c);
}

static void start(ap_p2p_conn_t *c)
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    if (!c->relayed && uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) == 0)
        ap_multiaddr_from_sockaddr(&c->remote, &ss);
    c->phase = P_MSS;
    ap__mss_init(&c->mss, c->initiator, noise_list, 1);
    flush_mss(c, false);
    if (!c->relayed) uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb);
}

static ap_p2p_conn_t *conn_new(ap_p2p_host_t *h, bool initiator, const ap_peer_id_t *expected)
{
    ap_p2p_conn_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->h = h;
    c->initiator = initiator;
    if (ap__secure_init(&c->hs, &h->creds, initiator, expected, NULL) != 0 ||
        uv_tcp_init(h->loop, &c->tcp) != 0) {
        free(c);
        return NULL;
    }
    c->tcp.data = c;
    uv_tcp_nodelay(&c->tcp, 1);
    h->nconns++;
    c->next = h->conns;
    if (h->conns) h->conns->prev = c;
    h->conns = c;
    return c;
}

static void connected(uv_connect_t *req, int status)
{
    ap_p2p_conn_t *c = req->data;
    if (status != 0) {
        conn_fail(c, AP_EUNREACH);
        return;
    }
    if (c->closing) return;
    start(c);
}

/* A TCP socket with SO_REUSEADDR and SO_REUSEPORT bound to port (the
 * listen port, so that a dial leaves from it: hole punching). */
static int reuse_socket(int family, uint16_t port, uv_os_sock_t *out)
{
    int one = 1, fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return AP_ESYS;
    struct sockaddr_storage a = {.ss_family = (sa_family_t)family};
    if (family == AF_INET)
        ((struct sockaddr_in *)&a)->sin_port = htons(port);
    else
        ((struct sockaddr_in6 *)&a)->sin6_port = htons(port);
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0 ||
        bind(fd, (struct sockaddr *)&a,
             family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6)) != 0) {
        int e = errno;
        close(fd);
        return e == EADDRINUSE ? AP_EBUSY : AP_ESYS;
    }
    *out = fd;
    return 0;
}

int ap__p2p_dial(ap_p2p_host_t *h, const ap_multiaddr_t *ma, const ap_p2p_conn_cbs_t *cbs,
                 void *arg, ap_p2p_conn_t **out)
{
    return ap__p2p_dial_from(h, ma, 0, true, cbs, arg, out);
}

int ap__p2p_dial_from(ap_p2p_host_t *h, const ap_multiaddr_t *ma, uint16_t port, bool initiator,
                      const ap_p2p_conn_cbs_t *cbs, void *arg, ap_p2p_conn_t **out)
{
    struct sockaddr_storage ss;
    int rc = ap_multiaddr_to_sockaddr(ma, &ss, sizeof ss);
    if (rc) return rc;
    if (h->freeing) return AP_ESHUTDOWN;
    uv_os_sock_t fd = -1;
    if (port && (rc = reuse_socket(ss.ss_family, port, &fd)) != 0) return rc;
    ap_p2p_conn_t *c = conn_new(h, initiator, ma->has_peer ? &ma->peer : NULL);
    if (!c) {
        if (fd >= 0) close(fd);
        return AP_ENOMEM;
    }
    c->cbs = *cbs;
    c->arg = arg;
    c->creq.data = c;
    if (fd >= 0 && uv_tcp_open(&c->tcp, fd) != 0) {
        close(fd);
        conn_fail(c, AP_ESYS);
        return 0;
    }
    rc = uv_tcp_connect(&c->creq, &c->tcp, (struct sockaddr *)&ss, connected);
    if (rc) {
        conn_fail(c, ap_err_from_errno(rc));
        return 0; /* on_close reports it */
    }
    if (out) *out = c;
    return 0;
}

/* ---- identify and ping, served ---------------------------------------------- */

/* ping and echo: the bytes go back; credit returns as they leave the queue,
 * so a peer that does not read its answers stops being read */
static void echo_open(ap_p2p_stream_t *s)
{
    s->echo = true;
}

static void ping_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    if (stream_queue(s, p, n) != 0) ap__p2p_stream_reset(s);
}

static void ping_fin(ap_p2p_stream_t *s)
{
    ap__p2p_stream_close(s);
}

static void id_open(ap_p2p_stream_t *s)
{
    ap_p2p_conn_t *c = s->c;
    ap_p2p_host_t *h = c->h;
    static ap_identify_t info;
    static uint8_t buf[AP_IDENTIFY_MSG_MAX + 16];
    memset(&info, 0, sizeof info);
    snprintf(info.protocol_version, sizeof info.protocol_version, "ipfs/0.1.0");
    snprintf(info.agent_version, sizeof info.agent_version, "%s", h->agent);
    info.nlisten = (size_t)ap__p2p_host_addrs(h, info.listen, AP_IDENTIFY_ADDRS_MAX);
    info.has_observed = c->remote.host != AP_MA_HOST_NONE && !c->relayed;
    info.observed = c->remote;
    for (size_t i = 0; i < h->nprotos; i++) info.protocols[i] = h->names[i];
    info.nprotocols = h->nprotos;
    int n = ap__identify_encode(&info, h->creds.id.pk, buf, sizeof buf);
    if (n > 0) ap__yamux_send(&c->y, s->id, buf, (size_t)n);
    ap__p2p_stream_close(s);
}

int ap__p2p_host_addrs(ap_p2p_host_t *h, ap_multiaddr_t *out, int max)
{
    int k = 0;
    if (h->addrs_fn) {
        k = h->addrs_fn(h->addrs_arg, out, max);
        k = k < 0 ? 0 : k > max ? max : k;
    } else if (h->listening && max > 0) {
        out[k++] = h->bound;
    }
    for (int i = 0; i < k; i++) /* a circuit keeps its relay's id */
        if (!out[i].circuit) out[i].has_peer = false;
    return k;
}

static const ap_p2p_proto_t ping_srv = {AP_PING_PROTO, echo_open, ping_data, ping_fin, NULL};
static const ap_p2p_proto_t echo_srv = {AP_P2P_ECHO_PROTO, echo_open, ping_data, ping_fin, NULL};
static const ap_p2p_proto_t id_srv = {AP_IDENTIFY_PROTO, id_open, NULL, NULL, NULL};

/* ---- host ---------------------------------------------------------------------- */

ap_p2p_host_t *ap__p2p_host_new(uv_loop_t *loop, const ap_identity_t *id, const char *agent)
{
    ap_p2p_host_t *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->loop = loop;
    if (ap__secure_creds_init_muxers(&h->creds, id, AP_NOISE_SHA256, NULL, muxer_list, 1) != 0) {
        free(h);
        return NULL;
    }
    snprintf(h->agent, sizeof h->agent, "%s", agent ? agent : "apiary");
    return h;
}

const ap_identity_t *ap__p2p_host_identity(const ap_p2p_host_t *h)
{
    return &h->creds.id;
}

void ap__p2p_host_set_addrs(ap_p2p_host_t *h, ap_p2p_addrs_fn fn, void *arg)
{
    h->addrs_fn = fn;
    h->addrs_arg = arg;
}

int ap__p2p_host_serve(ap_p2p_host_t *h, const ap_p2p_proto_t *proto)
{
    if (h->nprotos == PROTOS_MAX) return AP_ELIMIT;
    h->protos[h->nprotos] = proto;
    h->names[h->nprotos++] = proto->name;
    h->ctl_names[h->nctl++] = proto->name;
    return 0;
}

int ap__p2p_host_serve_bulk(ap_p2p_host_t *h, const ap_p2p_proto_t *proto)
{
    int rc = ap__p2p_host_serve(h, proto);
    if (rc == 0) h->nctl--;
    return rc;
}

int ap__p2p_host_serve_basics(ap_p2p_host_t *h)
{
    int rc = ap__p2p_host_serve(h, &id_srv);
    return rc ? rc : ap__p2p_host_serve(h, &ping_srv);
}

int ap__p2p_host_serve_echo(ap_p2p_host_t *h)
{
    return ap__p2p_host_serve_bulk(h, &echo_srv);
}

static void on_conn(uv_stream_t *srv, int status)
{
    ap_p2p_host_t *h = srv->data;
    if (status != 0) return;
    ap_p2p_conn_t *c = conn_new(h, false, NULL);
    if (!c) return;
    if (uv_accept(srv, (uv_stream_t *)&c->tcp) != 0) {
        conn_fail(c, AP_EIO);
        return;
    }
    start(c);
}

int ap__p2p_host_listen(ap_p2p_host_t *h, const ap_multiaddr_t *ma, ap_multiaddr_t *bound)
{
    struct sockaddr_storage ss;
    int rc = ap_multiaddr_to_sockaddr(ma, &ss, sizeof ss);
    if (rc) return rc;
    if ((rc = uv_tcp_init(h->loop, &h->listener)) != 0) return ap_err_from_errno(rc);
    h->listener.data = h;
    h->listening = true;
    int one = 1, fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return AP_ESYS;
    /* SO_REUSEPORT: dials may leave from this port (hole punching) */
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    if ((rc = uv_tcp_open(&h->listener, fd)) != 0) {
        close(fd);
        return ap_err_from_errno(rc);
    }
    if ((rc = uv_tcp_bind(&h->listener, (struct sockaddr *)&ss, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&h->listener, 128, on_conn)) != 0)
        return ap_err_from_errno(rc);
    int len = sizeof ss;
    uv_tcp_getsockname(&h->listener, (struct sockaddr *)&ss, &len);
    ap_multiaddr_from_sockaddr(&h->bound, &ss);
    if (bound) *bound = h->bound;
    return 0;
}

static void listener_closed(uv_handle_t *hd)
{
    ap_p2p_host_t *h = hd->data;
    h->listening = false;
    if (h->nconns == 0) host_release(h);
}

void ap__p2p_host_free(ap_p2p_host_t *h)
{
    h->freeing = true;
    for (ap_p2p_conn_t *c = h->conns; c; c = c->next) conn_fail(c, AP_ESHUTDOWN);
    if (h->listening) {
        uv_close((uv_handle_t *)&h->listener, listener_closed);
        return;
    }
    if (h->nconns == 0) host_release(h);
}

void ap__p2p_host_free_then(ap_p2p_host_t *h, void (*done)(void *arg), void *arg)
{
    h->done = done;
    h->done_arg = arg;
    ap__p2p_host_free(h);
}

int ap__p2p_host_adopt(ap_p2p_host_t *h, uv_os_sock_t sock, const uint8_t *pre, size_t n)
{
    if (h->freeing) return AP_ESHUTDOWN;
    ap_p2p_conn_t *c = conn_new(h, false, NULL);
    if (!c) return AP_ENOMEM;
    if (uv_tcp_open(&c->tcp, sock) != 0) {
        close(sock);
        conn_fail(c, AP_EIO);
        return AP_EIO;
    }
    if (n > 0 && ap__buf_reserve(&c->raw, n) != 0) {
        conn_fail(c, AP_ENOMEM); /* closes sock with the handle */
        return AP_ENOMEM;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    memcpy(c->raw.data, pre, n);
    c->raw.len = n;
    start(c);
    if (n > 0 && !c->closing) process(c);
    return 0;
}

/* ---- connections over a stream (relayed), lookup ------------------------------ */

int ap__p2p_conn_over(ap_p2p_stream_t *carrier, bool initiator, const ap_peer_id_t *expected,
                      const ap_multiaddr_t *remote, const uint8_t *pre, size_t n,
                      const ap_p2p_conn_cbs_t *cbs, void *arg, ap_p2p_conn_t **out)
{
    ap_p2p_host_t *h = carrier->c->h;
    if (h->freeing || carrier->inner || !carrier->ready) return AP_ESTATE;
    ap_p2p_conn_t *c = conn_new(h, initiator, expected);
    if (!c) return AP_ENOMEM;
    c->relayed = true;
    c->car = carrier;
    carrier->inner = c;
    c->remote = *remote;
    if (cbs) c->cbs = *cbs;
    c->arg = arg;
    if (out) *out = c;
    start(c);
    if (n > 0 && !c->closing) {
        if (ap__buf_append(&c->raw, pre, n) != 0)
            conn_fail(c, AP_ENOMEM);
        else
            process(c);
    }
    return 0;
}

bool ap__p2p_conn_relayed(const ap_p2p_conn_t *c)
{
    return c->relayed;
}

void ap__p2p_host_relay_bulk(ap_p2p_host_t *h, bool allow)
{
    h->relay_bulk = allow;
}

ap_p2p_conn_t *ap__p2p_host_find(ap_p2p_host_t *h, const ap_peer_id_t *peer, int which)
{
    ap_p2p_conn_t *relayed = NULL;
    for (ap_p2p_conn_t *c = h->conns; c; c = c->next) {
        if (!c->ready || c->closing || memcmp(&c->peer, peer, sizeof *peer) != 0) continue;
        if (!c->relayed && which != AP_P2P_FIND_RELAYED) return c;
        if (c->relayed && !relayed) relayed = c;
    }
    return which == AP_P2P_FIND_DIRECT ? NULL : relayed;
}
