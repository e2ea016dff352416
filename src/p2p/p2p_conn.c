/* libp2p connections over TCP (see p2p_conn.h): writes, streams, the
 * upgrade, reading. */
#include "apiary/error.h"
#include "apiary/log.h"
#include "p2p/p2p_impl.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A peer's protocol errors that end its connection or stream: a fresh
 * identity costs nothing, so these lines are rate-limited together (32 per
 * 10 s, then a count), as the native transport's unauthenticated ones. */
static ap_log_limit_t peer_warns = {.burst = 32, .window_ms = 10000};
#define PEER_WARN(...) ap_log_limited(&peer_warns, AP_LOG_WARN, "p2p", __VA_ARGS__)

static const char *const noise_list[] = {NOISE_PROTO};

static const char *who(ap_p2p_conn_t *c)
{
    return c->peer_short[0] ? c->peer_short : "(handshake)";
}

static size_t queued(const ap_p2p_stream_t *s);

static void flush_mss(ap_p2p_conn_t *c, bool secure)
{
    size_t n;
    const uint8_t *o = ap__mss_output(&c->mss, &n);
    if (secure)
        ap__p2p_secure_write(c, o, n, NULL, 0);
    else
        ap__p2p_raw_write(c, o, n);
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
    ap__p2p_rc_stream_release(s);
    if (s->inner) { /* the carried connection ends with its carrier */
        s->inner->car = NULL;
        ap__p2p_conn_fail(s->inner, AP_ECLOSED);
    }
    s->c->qbytes -= queued(s);
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
        if (ap__p2p_wq_full(c)) {
            c->wq_blocked = true;
            break;
        }
        size_t n = queued(s) < AP_P2P_CONN_WQ_MAX ? queued(s) : AP_P2P_CONN_WQ_MAX;
        long k = ap__yamux_send(&c->y, id, s->q.data + s->qoff, n);
        if (k < 0) { /* our direction or the stream is gone: drop the rest */
            c->qbytes -= queued(s);
            s->qoff = s->q.len;
            break;
        }
        s->qoff += (size_t)k;
        c->qbytes -= (size_t)k;
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
    if (s->inner && s->inner->wq_blocked && !ap__p2p_wq_full(s->inner)) {
        ap__p2p_conn_drained(s->inner);
        if (stream_of(c, id) != s) return false;
    }
    if (s->want_writable && queued(s) <= AP_P2P_STREAM_QUEUE_MAX / 2) {
        s->want_writable = false;
        if (s->on_writable) s->on_writable(s);
        if (stream_of(c, id) != s) return false;
    }
    return true;
}

/* The socket's queue drained: every stream with queued bytes goes on. */
void ap__p2p_conn_drained(ap_p2p_conn_t *c)
{
    c->wq_blocked = false;
    size_t pos = 0, n = 0;
    uint64_t k, v;
    uint32_t *ids = malloc((c->streams.n + 1) * sizeof *ids);
    if (!ids) {
        ap__p2p_conn_fail(c, AP_ENOMEM);
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
int ap__p2p_stream_queue(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    ap_p2p_conn_t *c = s->c;
    if (queued(s) == 0 && !ap__p2p_wq_full(c)) {
        long k = ap__yamux_send(&c->y, s->id, p, n);
        if (k < 0) return (int)k;
        if (s->echo && k > 0) ap__yamux_consume(&c->y, s->id, (size_t)k);
        p += k;
        n -= (size_t)k;
        if (n == 0) return 0;
    }
    if (ap__buf_append(&s->q, p, n) != 0) return AP_ENOMEM;
    c->qbytes += n;
    if (ap__p2p_wq_full(c)) c->wq_blocked = true;
    return 0;
}

static void y_writable(void *arg, uint32_t id)
{
    ap_p2p_stream_t *s = stream_of(arg, id);
    if (s && queued(s)) stream_flush(s);
}

static void y_write(void *arg, const uint8_t hdr[AP_YAMUX_HDR_LEN], const uint8_t *p, size_t n)
{
    ap__p2p_secure_write(arg, hdr, AP_YAMUX_HDR_LEN, p, n);
}

static int y_open(void *arg, uint32_t id)
{
    ap_p2p_conn_t *c = arg;
    ap_p2p_stream_t *s = stream_add(c, id);
    if (!s) return AP_ENOMEM;
    if (!ap__p2p_rc_stream(s)) { /* over a stream limit: yamux resets it */
        ap__u64map_del(&c->streams, id, NULL);
        stream_free(s);
        return AP_ELIMIT;
    }
    bool all = !c->relayed || c->h->relay_bulk;
    ap__mss_init(&s->mss, false, all ? c->h->names : c->h->ctl_names,
                 all ? c->h->nprotos : c->h->nctl);
    const ap_p2p_bridge_t *b = c->h->bridge;
    if (b && !c->relayed)
        ap__mss_set_accept(&s->mss, b->serves, c->h->bridge_arg);
    else if (b && b->serves_relayed) /* the node's control protocols only */
        ap__mss_set_accept(&s->mss, b->serves_relayed, c->h->bridge_arg);
    stream_flush_mss(s);
    return 0;
}

static void y_data(void *arg, uint32_t id, const uint8_t *p, size_t n)
{
    ap_p2p_conn_t *c = arg;
    ap_p2p_stream_t *s = stream_of(c, id);
    ap__p2p_admit_touch(c);
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
            if (rc == AP_ENOPROTO) /* "na": the peer does not speak it */
                ap_debug("p2p", "peer %s: stream %u: protocol not served", who(c), (unsigned)id);
            else
                PEER_WARN("peer %s: stream %u negotiation failed: %s", who(c), (unsigned)id,
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
        if (!s->proto) { /* a name the node serves: its mux counts the stream now */
            s->proto = c->h->bridge->proto;
            ap__p2p_rc_stream_release(s);
        }
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
            ap__p2p_conn_fail(in, AP_ENOMEM);
        else
            ap__p2p_conn_process(in);
    } else if (n && s->proto->on_data) {
        s->proto->on_data(s, p, n);
    }
}

static void y_fin(void *arg, uint32_t id)
{
    ap_p2p_stream_t *s = stream_of(arg, id);
    if (!s) return;
    if (s->inner) { /* the carried connection ends, and closing it may free s */
        ap__p2p_conn_fail(s->inner, AP_ECLOSED);
        return;
    }
    if (s->ready && s->proto->on_fin) s->proto->on_fin(s);
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

static void y_goaway(void *arg, uint32_t code)
{
    ap_p2p_conn_t *c = arg;
    (void)code;
    if (c->x.on_goaway) c->x.on_goaway(c, c->arg);
}

static const ap_yamux_cbs_t ycbs = {y_write,    y_open,  y_data, y_fin,
                                    y_writable, y_close, NULL,   y_goaway};

/* Whether name is one of h's bulk protocols (ap__p2p_host_serve_bulk). */
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
    if (!c->y_init) return AP_ENOTSUP; /* the native muxer carries no libp2p streams */
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
    return ap__p2p_stream_queue(s, p, n);
}

int ap__p2p_stream_write_all(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    if (!s->ready || s->c->closing) return AP_ESTATE;
    if (s->lclosed) return AP_ECLOSED;
    return n ? ap__p2p_stream_queue(s, p, n) : 0;
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

const char *ap__p2p_stream_name(const ap_p2p_stream_t *s)
{
    const char *sel = ap__mss_selected(&s->mss);
    return sel ? sel : s->proto ? s->proto->name : "";
}

uint32_t ap__p2p_stream_id(const ap_p2p_stream_t *s)
{
    return s->id;
}

ap_p2p_conn_t *ap__p2p_stream_conn(const ap_p2p_stream_t *s)
{
    return s->c;
}

/* ---- the upgrade ------------------------------------------------------------- */

static void conn_closed(uv_handle_t *hd)
{
    ap_p2p_conn_t *c = hd->data;
    ap_p2p_host_t *h = c->h;
    /* outside every callback chain: the streams end, then the connection */
    if (c->y_init) ap__yamux_free(&c->y, c->status ? c->status : AP_ECLOSED);
    c->y_init = false;
    ap__u64map_free(&c->streams);
    ap__p2p_admit_gone(c);
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
    ap__p2p_wblocks_free(c);
    free(c);
    h->nconns--;
    if (h->freeing && h->nconns == 0 && !h->listening && !h->hs_timer_open) ap__p2p_host_release(h);
}

void ap__p2p_conn_fail(ap_p2p_conn_t *c, int err)
{
    if (c->closing) return;
    c->closing = true;
    c->status = err;
    c->phase = P_DEAD;
    ap__p2p_admit_gone(c); /* its slot is free for whoever it was closed for */
    ap__p2p_rc_detach(c);  /* and what it held in the node's scopes */
    if (c->car) {          /* the carrier ends once what we sent has left */
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
    ap__p2p_conn_submit(c);
    ap__p2p_conn_fail(c, 0);
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
    if (!c->ready) return NULL;
    return c->phase == P_NATIVE || (c->closing && !c->y_init) ? AP_P2P_NATIVE_MUX : AP_YAMUX_PROTO;
}

bool ap__p2p_conn_native(const ap_p2p_conn_t *c)
{
    return c->ready && !c->y_init;
}

int ap__p2p_conn_write(ap_p2p_conn_t *c, const uint8_t *p, size_t n)
{
    if (c->closing || c->phase != P_NATIVE) return AP_ECLOSED;
    ap__p2p_secure_write(c, p, n, NULL, 0);
    return c->closing ? AP_ECLOSED : 0;
}

void ap__p2p_conn_goaway(ap_p2p_conn_t *c)
{
    if (c->y_init && !c->closing) ap__yamux_goaway(&c->y, AP_YAMUX_GOAWAY_NORMAL);
    if (!c->batch) ap__p2p_conn_submit(c);
}

void ap__p2p_conn_set_cbs(ap_p2p_conn_t *c, const ap_p2p_conn_cbs_t *cbs,
                          const ap_p2p_conn_xcbs_t *x, void *arg)
{
    c->cbs = *cbs;
    if (x) c->x = *x;
    c->arg = arg;
}

void *ap__p2p_conn_arg(const ap_p2p_conn_t *c)
{
    return c->arg;
}

void ap__p2p_conn_set_user(ap_p2p_conn_t *c, void *user)
{
    c->user = user;
}

void *ap__p2p_conn_user(const ap_p2p_conn_t *c)
{
    return c->user;
}

bool ap__p2p_conn_initiator(const ap_p2p_conn_t *c)
{
    return c->initiator;
}

static void feed_plain(ap_p2p_conn_t *c, const uint8_t *p, size_t n);

/* The muxer is agreed: muxer is its name (one of the host's list). */
static void start_mux(ap_p2p_conn_t *c, const char *muxer)
{
    ap_p2p_host_t *h = c->h;
    bool native = strcmp(muxer, AP_P2P_NATIVE_MUX) == 0;
    if (native && c->relayed) { /* a circuit carries libp2p streams only */
        PEER_WARN("peer %s: the native muxer over a circuit is not supported", who(c));
        ap__p2p_conn_fail(c, AP_ENOTSUP);
        return;
    }
    if (native) {
        c->phase = P_NATIVE;
    } else {
        ap__yamux_init(&c->y, c->initiator, &ycbs, c, 0);
        c->y_init = true;
        c->phase = P_YAMUX;
    }
    c->ready = true;
    if (!ap__p2p_admit_open(c)) return;
    ap__p2p_rc_attach(c);
    ap_debug("p2p", "peer %s: connected (%s%s)", who(c), muxer, c->early ? ", early" : "");
    if (!c->initiator && !c->relayed && h->bridge && h->bridge->on_conn)
        h->bridge->on_conn(h->bridge_arg, c);
    if (c->closing) return;
    if (c->cbs.on_ready) c->cbs.on_ready(c, c->arg);
}

static void noise_step(ap_p2p_conn_t *c)
{
    if (ap__secure_my_turn(&c->hs)) {
        static uint8_t msg[2 + AP_NOISE_MSG_MAX];
        size_t n;
        int rc = ap__secure_write(&c->hs, msg + 2, AP_NOISE_MSG_MAX, &n);
        if (rc) {
            ap__p2p_conn_fail(c, rc);
            return;
        }
        ap__put_be16(msg, (uint16_t)n);
        ap__p2p_raw_write(c, msg, n + 2);
    }
    if (!ap__noise_hs_done(&c->hs.noise)) return;
    c->peer = *ap__secure_remote(&c->hs);
    ap_peer_id_short(&c->peer, c->peer_short);
    int mux = c->hs.info.muxer;
    if (ap__secure_split(&c->hs, &c->tx, &c->rx) != 0) {
        ap__p2p_conn_fail(c, AP_ESTATE);
        return;
    }
    if (mux >= 0 && (size_t)mux < c->cr->nmuxers) {
        c->early = true;
        start_mux(c, c->cr->muxers[mux]);
        return;
    }
    c->phase = P_MUXSEL;
    ap__mss_init(&c->mss, c->initiator, c->cr->muxers, c->cr->nmuxers);
    flush_mss(c, true);
}

static void feed_plain(ap_p2p_conn_t *c, const uint8_t *p, size_t n)
{
    if (c->phase == P_MUXSEL) {
        size_t used;
        int rc = ap__mss_feed(&c->mss, p, n, &used);
        flush_mss(c, true);
        if (rc) {
            PEER_WARN("peer %s: muxer negotiation failed: %s", who(c), ap_err_name(rc));
            ap__p2p_conn_fail(c, rc);
            return;
        }
        if (ap__mss_state(&c->mss) != AP_MSS_DONE) return;
        start_mux(c, ap__mss_selected(&c->mss));
        p += used;
        n -= used;
    }
    if (c->phase == P_NATIVE && n && !c->closing) {
        ap__p2p_admit_touch(c);
        if (c->x.on_data) c->x.on_data(c, c->arg, p, n);
        return;
    }
    if (c->phase == P_YAMUX && n) {
        int rc = ap__yamux_feed(&c->y, p, n);
        if (rc) {
            PEER_WARN("peer %s: yamux: %s", who(c), ap_err_name(rc));
            ap__p2p_conn_fail(c, rc);
        }
    }
}

/* Handles the bytes in c->raw as far as they go. */
void ap__p2p_conn_process(ap_p2p_conn_t *c)
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
                PEER_WARN("peer %s: security negotiation failed: %s", who(c), ap_err_name(rc));
                ap__p2p_conn_fail(c, rc);
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
                    PEER_WARN("peer %s: refused: its identity key is %s, not Ed25519", who(c),
                              ap__secure_key_type_name(c->hs.info.key_type));
                else if (rc == AP_EAUTH && got && c->hs.has_expected)
                    PEER_WARN("peer %s: refused: dialled %s, reached another peer",
                              ap_peer_id_short(got, a), ap_peer_id_short(&c->hs.expected, b));
                else
                    PEER_WARN("peer %s: Noise handshake failed: %s", who(c), ap_err_name(rc));
                ap__p2p_conn_fail(c, rc);
                break;
            }
            noise_step(c);
            continue;
        }
        /* transport message: decrypt in place */
        uint8_t *m = c->raw.data + off - flen;
        if (flen < AP_NOISE_TAGLEN || ap__noise_cs_decrypt(&c->rx, NULL, 0, m, flen, m) != 0) {
            PEER_WARN("peer %s: bad transport message", who(c));
            ap__p2p_conn_fail(c, AP_EAUTH);
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
        ap__p2p_conn_fail(c, nread == UV_EOF ? AP_ECLOSED : ap_err_from_errno((int)nread));
        return;
    }
    c->raw.len += (size_t)nread;
    c->batch++;
    ap__p2p_conn_process(c);
    c->batch--;
    ap__p2p_conn_submit(c);
    ap__p2p_drain_check(c);
}

void ap__p2p_conn_start(ap_p2p_conn_t *c)
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

ap_p2p_conn_t *ap__p2p_conn_new(ap_p2p_host_t *h, bool initiator, const ap_peer_id_t *expected)
{
    ap_p2p_conn_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->h = h;
    c->initiator = initiator;
    c->cr = &h->creds;
    if (ap__secure_init(&c->hs, c->cr, initiator, expected, NULL) != 0 ||
        uv_tcp_init(h->loop, &c->tcp) != 0) {
        free(c);
        return NULL;
    }
    c->tcp.data = c;
    uv_tcp_nodelay(&c->tcp, 1);
    c->hs_deadline = uv_now(h->loop) + h->hs_timeout_ms;
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
        ap__p2p_conn_fail(c, AP_EUNREACH);
        return;
    }
    if (c->closing) return;
    ap__p2p_conn_start(c);
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

int ap__p2p_dial_streams(ap_p2p_host_t *h, const ap_multiaddr_t *ma, const ap_p2p_conn_cbs_t *cbs,
                         void *arg, ap_p2p_conn_t **out)
{
    ap_p2p_conn_t *c = NULL;
    int rc = ap__p2p_dial_from(h, ma, 0, true, cbs, arg, &c);
    if (rc || !c) return rc;
    c->cr = &h->ycreds; /* nothing was sent yet: the handshake starts once connected */
    if (ap__secure_init(&c->hs, c->cr, true, ma->has_peer ? &ma->peer : NULL, NULL) != 0) {
        ap__p2p_conn_fail(c, AP_ENOMEM);
        return 0; /* on_close reports it */
    }
    if (out) *out = c;
    return 0;
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
    ap_p2p_conn_t *c = ap__p2p_conn_new(h, initiator, ma->has_peer ? &ma->peer : NULL);
    if (!c) {
        if (fd >= 0) close(fd);
        return AP_ENOMEM;
    }
    c->cbs = *cbs;
    c->arg = arg;
    c->creq.data = c;
    if (fd >= 0 && uv_tcp_open(&c->tcp, fd) != 0) {
        close(fd);
        ap__p2p_conn_fail(c, AP_ESYS);
        return 0;
    }
    rc = uv_tcp_connect(&c->creq, &c->tcp, (struct sockaddr *)&ss, connected);
    if (rc) {
        ap__p2p_conn_fail(c, ap_err_from_errno(rc));
        return 0; /* on_close reports it */
    }
    if (out) *out = c;
    return 0;
}
