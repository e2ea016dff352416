/* libuv driver, stream multiplexer: streams and RPC calls (lifecycle, send
 * queue and credit, delivery to the user, listeners and handlers) and the
 * message buffers they use. Flow control: docs/protocol.md. */
#include "runtime/uv/mux_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ap_uv_req {
    struct ap_rpc_req pub;
    ap_mstream_t *s; /* NULL once the caller is gone */
    ap_msg_t *msg;   /* the request bytes */
    /* where msg stays counted until the handler has answered, even if the
     * caller is gone by then */
    ap_rc_span_t rc;
    uint64_t rc_mem;
    ap_msg_t *resp;                /* ap_rpc_respond_begin's buffer (counted in s) */
    struct ap_uv_req *next, *prev; /* node's unanswered requests */
} ap_uv_req_t;

static void req_unlink(ap_node_t *n, ap_uv_req_t *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        n->reqs = r->next;
    if (r->next) r->next->prev = r->prev;
}

static void req_free(ap_node_t *n, ap_uv_req_t *r)
{
    ap__rc_hold_drop(n, &r->rc, &r->rc_mem);
    ap__mux_msg_free(n, r->msg);
    ap__mux_msg_free(n, r->resp);
    free(r);
}

/* Node teardown: requests the handlers still hold die with the node. */
void ap__mux_free_reqs(ap_node_t *n)
{
    while (n->reqs) {
        ap_uv_req_t *r = n->reqs;
        n->reqs = r->next;
        if (r->s) r->s->req = NULL;
        req_free(n, r);
    }
}

/* Message buffers of 1 KiB and more are recycled per node: a fresh large
 * malloc per message is served from pages the kernel must fault in each
 * time (about 11 µs per 4 KiB here, DESIGN.md §7), which would cap a stream
 * at a few hundred MB/s. Sizes round up to a power of two so buffers fit
 * later messages; the cache keeps at most AP_MSG_CACHE_BYTES. */
#define MSG_POOL_MIN 1024u

static size_t msg_cap(size_t len)
{
    if (len < MSG_POOL_MIN) return len ? len : 1;
    size_t c = MSG_POOL_MIN;
    while (c < len && c < ((size_t)1 << 40)) c <<= 1;
    return c;
}

ap_msg_t *ap__mux_msg_alloc(ap_node_t *n, size_t len)
{
    size_t cap = msg_cap(len);
    n->msg_allocs++;
    ap_msg_t *m = NULL;
    if (cap >= MSG_POOL_MIN) {
        for (ap_msg_t **pp = &n->msg_cache; *pp; pp = &(*pp)->next) {
            if ((*pp)->cap != cap) continue;
            m = *pp;
            *pp = m->next;
            n->msg_cache_bytes -= cap;
            break;
        }
    }
    if (!m) {
        m = malloc(sizeof *m + cap);
        if (!m) return NULL;
    }
    memset(m, 0, sizeof *m);
    m->cap = cap;
    m->len = len;
    return m;
}

void ap__mux_msg_free(ap_node_t *n, ap_msg_t *m)
{
    if (!m) return;
    if (m->cap >= MSG_POOL_MIN && n->msg_cache_bytes + m->cap <= AP_MSG_CACHE_BYTES &&
        !atomic_load(&n->closing)) {
        m->next = n->msg_cache;
        n->msg_cache = m;
        n->msg_cache_bytes += m->cap;
        return;
    }
    free(m);
}

void ap__mux_free_cache(ap_node_t *n)
{
    while (n->msg_cache) {
        ap_msg_t *m = n->msg_cache;
        n->msg_cache = m->next;
        free(m);
    }
    n->msg_cache_bytes = 0;
}

ap_msg_t *ap__mux_msg_new(ap_node_t *n, const uint8_t *data, size_t len)
{
    ap_msg_t *m = ap__mux_msg_alloc(n, len);
    if (m && len) memcpy(m->data, data, len);
    return m;
}

static void msgs_free(ap_node_t *n, ap_msg_t *m)
{
    while (m) {
        ap_msg_t *next = m->next;
        ap__mux_msg_free(n, m);
        m = next;
    }
}

ap_mstream_t *ap__ms_new(ap_node_t *n, int kind)
{
    ap_mstream_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->pub.rt = &n->rt;
    s->node = n;
    s->kind = (uint8_t)kind;
    return s;
}

/* ---- stream lifecycle ------------------------------------------------------------ */

static void ms_unsched(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    if (!s->in_sched || !c) return;
    ap_mstream_t *prev = NULL;
    for (ap_mstream_t *x = c->sched_head; x; prev = x, x = x->sched_next) {
        if (x != s) continue;
        if (prev)
            prev->sched_next = x->sched_next;
        else
            c->sched_head = x->sched_next;
        if (c->sched_tail == x) c->sched_tail = prev;
        break;
    }
    s->in_sched = false;
    s->sched_next = NULL;
}

static void ms_closed_cb(ap_node_t *n, void *arg, int status)
{
    ap_mstream_t *s = arg;
    (void)status;
    if (s->kind == MS_CALL) {
        if (s->done)
            s->done(&n->rt, s->done_arg, s->status, NULL, 0, s->has_errmsg ? s->errmsg : NULL);
    } else if (s->kind == MS_STREAM && s->accepted_by_user && !s->close_fired) {
        if (s->pub.cbs.on_close) s->pub.cbs.on_close(&s->pub, s->pub.arg, s->status);
    }
    free(s);
}

void ap__ms_finish(ap_mstream_t *s, int status)
{
    if (s->finished) return;
    ap_node_t *n = s->node;
    s->finished = true;
    s->status = status;
    ap_mconn_t *c = s->conn;
    if (s->in_serveq) ap__ms_serve_unqueue(s);
    if (c) {
        ms_unsched(s);
        ap__idmap_del(&c->streams, s->sid);
        c->nstreams--;
        s->conn = NULL;
        if (c->goaway_sent && c->nstreams == 0) ap__mconn_want_flush(c); /* may be drained */
    }
    if (c) c->rx_buffered -= s->rx_charged;
    n->rx_buffered -= s->rx_charged;
    s->rx_charged = 0;
    if (s->resp_charged) {
        s->conn = c; /* the connection's share too */
        ap__ms_resp_release(s, s->resp_charged);
        s->conn = NULL;
    }
    ap__ms_rc_end(s); /* everything it still holds, and its stream count */
    if (s->kind == MS_CALL) ap__idmap_del(&n->calls, s->call_id);
    if (s->open_timer) ap_rt_timer_stop(&n->rt, s->open_timer);
    s->open_timer = 0;
    msgs_free(n, s->sq);
    msgs_free(n, s->rq);
    ap__mux_msg_free(n, (ap_msg_t *)s->rx);
    s->sq = s->sq_tail = s->rq = s->rq_tail = NULL;
    s->rx = NULL;
    s->sbuf = 0;
    if (s->req) {
        s->req->s = NULL;
        s->req = NULL;
    }
    if (ap__node_defer(n, ms_closed_cb, s, 0) < 0) {
        /* Out of memory for the queue item: run it now rather than leak. */
        ms_closed_cb(n, s, 0);
    }
}

static void ms_check_done(ap_mstream_t *s)
{
    if (s->finished) return;
    if (s->kind == MS_STREAM && s->end_fired && s->close_sent) ap__ms_finish(s, 0);
    if (s->kind == MS_SERVE && s->close_sent) ap__ms_finish(s, 0);
}

bool ap__ms_eligible(const ap_mstream_t *s)
{
    if (s->finished || !s->conn || !s->sq) return false;
    const ap_msg_t *m = s->sq;
    if (m->exempt) return true;
    if (!s->accepted) return false;
    return s->credit > 0 || m->off == m->len;
}

void ap__ms_schedule(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    if (!c || s->in_sched || !ap__ms_eligible(s)) return;
    s->sched_next = NULL;
    if (c->sched_tail)
        c->sched_tail->sched_next = s;
    else
        c->sched_head = s;
    c->sched_tail = s;
    s->in_sched = true;
    ap__mconn_want_flush(c);
}

void ap__ms_try_close(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    if (!c || s->finished || !s->lclose || s->close_sent || s->sq) return;
    if (!s->opener && !s->accepted) return; /* CLOSE may not precede ACCEPT */
    s->close_sent = true;
    ap__mconn_ctl_rc(c, ap__frame_put_close(&c->obuf, s->sid));
    ms_check_done(s);
}

static bool below_half(const ap_mstream_t *s)
{
    size_t b = s->sbuf + s->inflight;
    return b == 0 || b * 2 < s->pub.window;
}

static void writable_cb(ap_node_t *n, void *arg, int status)
{
    ap_mstream_t *s = arg;
    (void)n;
    (void)status;
    s->writable_queued = false;
    if (s->finished || !s->want_writable || !below_half(s)) return;
    s->want_writable = false;
    if (s->pub.cbs.on_writable) s->pub.cbs.on_writable(&s->pub, s->pub.arg);
}

/* Queues on_writable once s's send buffer has fallen below half its window,
 * if the user waits for that. */
void ap__ms_check_writable(ap_mstream_t *s)
{
    if (s->want_writable && !s->writable_queued && below_half(s)) {
        s->writable_queued = true;
        if (ap__node_defer(s->node, writable_cb, s, 0) < 0) s->writable_queued = false;
    }
}

/* ---- receive side -------------------------------------------------------------------- */

void ap__ms_ack(ap_mstream_t *s, bool force)
{
    ap_mconn_t *c = s->conn;
    if (!c || s->finished || s->paused || s->unacked == 0 || s->rclosed || s->kind == MS_CALL)
        return;
    uint32_t w = s->rx_window < s->peer_window ? s->rx_window : s->peer_window;
    uint32_t thr = w / 4 ? w / 4 : 1;
    if (!force && s->unacked < thr) return;
    ap__mconn_ctl_rc(c, ap__frame_put_window(&c->obuf, s->sid, false, s->unacked));
    c->credit_owed = true;
    s->rx_credit += s->unacked;
    s->unacked = 0;
}

void ap__ms_maybe_end(ap_mstream_t *s)
{
    if (s->finished || !s->rclosed || s->end_fired || s->rq || s->rx_active || s->paused) return;
    if (s->kind == MS_CALL) { /* the server closed without answering */
        ap__ms_finish(s, AP_ECLOSED);
        return;
    }
    if (s->kind != MS_STREAM) return;
    s->end_fired = true;
    if (s->pub.cbs.on_end) s->pub.cbs.on_end(&s->pub, s->pub.arg);
    ms_check_done(s);
}

/* Delivers one complete message m (taken off the stream) to the user. */
void ap__ms_deliver(ap_mstream_t *s, ap_msg_t *m)
{
    ap_node_t *n = s->node;
    if (s->kind == MS_CALL) {
        ap_rpc_done_fn done = s->done;
        s->done = NULL;
        ap__ms_finish(s, 0);
        done(&n->rt, s->done_arg, 0, m->data, m->len, NULL);
        ap__mux_msg_free(n, m);
        return;
    }
    if (s->pub.cbs.on_msg) s->pub.cbs.on_msg(&s->pub, s->pub.arg, m->data, m->len);
    if (!s->finished && s->conn) {
        s->rx_charged -= m->len;
        s->conn->rx_buffered -= m->len;
        n->rx_buffered -= m->len;
        ap__ms_rc_release(s, m->len);
    }
    ap__mux_msg_free(n, m);
}

static void drain_cb(ap_node_t *n, void *arg, int status);

static void ms_drain(ap_mstream_t *s)
{
    while (s->rq && !s->paused && !s->finished) {
        ap_msg_t *m = s->rq;
        s->rq = m->next;
        if (!s->rq) s->rq_tail = NULL;
        s->rq_bytes -= m->len;
        ap__ms_deliver(s, m);
    }
    ap__ms_ack(s, true);
    ap__ms_maybe_end(s);
}

/* Hello complete on an incoming stream: ask the listener. */
void ap__ms_accept(ap_mstream_t *s, ap_msg_t *hello)
{
    ap_node_t *n = s->node;
    ap_mconn_t *c = s->conn;
    const ap_rt_listener_t *l = ap__rt_find_listener(&n->rt, s->proto);
    if (!l) {
        ap__mconn_send_reset(c, s->sid, AP_ENOPROTO, "no listener");
        ap__ms_finish(s, AP_ENOPROTO);
        ap__mux_msg_free(n, hello);
        return;
    }
    s->pub.id = n->next_id++;
    ap_stream_accept_fn fn = l->fn;
    void *larg = l->arg;
    s->rx_charged -= hello->len;
    c->rx_buffered -= hello->len;
    c->node->rx_buffered -= hello->len;
    ap__ms_rc_release(s, hello->len);
    s->accepting = true;
    int rc = fn(&n->rt, larg, &s->pub, &s->pub.peer, hello->data, hello->len);
    s->accepting = false;
    ap__mux_msg_free(n, hello);
    if (s->finished) return; /* reset inside accept */
    if (rc != 0) {
        ap__mconn_send_reset(s->conn, s->sid, rc < 0 ? rc : AP_ERESET, "refused");
        ap__ms_finish(s, AP_ERESET);
        return;
    }
    s->accepted = true;
    s->accepted_by_user = true;
    n->stats.streams_accepted++;
    s->rx_credit = s->rx_window;
    ap__mconn_ctl_rc(s->conn, ap__frame_put_window(&s->conn->obuf, s->sid, true, s->rx_window));
    if (s->finished) return;
    ap__ms_schedule(s);
    ap__ms_try_close(s);
    if (s->rclosed && !s->finished) {
        /* the opener may have closed right after its hello */
        if (s->paused) return;
        ap__ms_maybe_end(s);
    }
}

void ap__ms_serve_now(ap_mstream_t *s, ap_msg_t *req)
{
    ap_node_t *n = s->node;
    const ap_rt_handler_t *h = ap__rt_find_handler(&n->rt, s->proto);
    if (!h) {
        ap__mconn_send_reset(s->conn, s->sid, AP_ENOPROTO, "no handler");
        ap__ms_finish(s, AP_ENOPROTO);
        ap__mux_msg_free(n, req);
        return;
    }
    ap_uv_req_t *r = calloc(1, sizeof *r);
    if (!r) {
        ap__mconn_send_reset(s->conn, s->sid, AP_ENOMEM, "out of memory");
        ap__ms_finish(s, AP_ENOMEM);
        ap__mux_msg_free(n, req);
        return;
    }
    s->rx_charged -= req->len;
    s->conn->rx_buffered -= req->len;
    n->rx_buffered -= req->len;
    /* counted until the handler has answered, not only until it has it */
    ap__ms_rc_move(s, req->len, &r->rc, &r->rc_mem);
    r->pub.rt = &n->rt;
    r->pub.peer = s->pub.peer;
    r->pub.data = req->data;
    r->pub.len = req->len;
    r->msg = req;
    r->s = s;
    s->req = r;
    r->next = n->reqs;
    if (r->next) r->next->prev = r;
    n->reqs = r;
    n->stats.rpc_served++;
    h->fn(&n->rt, h->arg, &r->pub);
}

/* m (len bytes, already counted in s) becomes s's response. */
static void queue_response(ap_mstream_t *s, ap_msg_t *m, size_t len)
{
    ap_node_t *n = s->node;
    ap_mconn_t *c = s->conn;
    s->req = NULL;
    s->accepted = true;
    ap__mconn_ctl_rc(c, ap__frame_put_window(&c->obuf, s->sid, true, 0));
    if (s->finished) {
        ap__mux_msg_free(n, m);
        return;
    }
    s->sq = s->sq_tail = m;
    s->sbuf = len;
    s->resp_charged = len;
    c->resp_queued += len;
    n->resp_queued += len;
    s->progress_us = ap__host_now_us(n->host);
    if (len) ap__mux_sweep_start(n);
    s->lclose = true;
    ap__ms_schedule(s);
}

static void fail_stream(ap_mstream_t *s, int err, const char *why)
{
    s->req = NULL;
    ap__mconn_send_reset(s->conn, s->sid, err, why);
    ap__ms_finish(s, err);
}

static bool req_live(const ap_uv_req_t *r)
{
    return r->s && !r->s->finished && r->s->conn;
}

void ap__mux_rpc_respond(ap_rpc_req_t *req, int err, const char *errmsg, const uint8_t *data,
                         size_t len)
{
    ap_uv_req_t *r = (ap_uv_req_t *)req;
    ap_mstream_t *s = r->s;
    ap_node_t *n = NODE(req->rt);
    req_unlink(n, r);
    bool live = req_live(r);
    if (r->resp) { /* a begun response, dropped */
        if (live) ap__ms_rc_release(s, r->resp->len);
        ap__mux_msg_free(n, r->resp);
        r->resp = NULL;
    }
    /* A response waits for the caller's credit: what a peer that reads
     * nothing can make us hold is counted in the stream's, connection's,
     * peer's, protocol's and node's memory -- reserved before it is copied. */
    char why[64];
    bool refused = false;
    /* the handler is done with the request: its count gives way to the
     * response's (the bytes are freed once data is copied) */
    ap__rc_hold_drop(n, &r->rc, &r->rc_mem);
    if (live && !err && len <= UINT32_MAX) {
        if (ap__ms_rc_reserve(s, len, "a response", why, sizeof why) < 0) {
            n->refused_resp++;
            refused = true;
        }
    }
    /* data may point into the request itself: copy before freeing it */
    ap_msg_t *m = NULL;
    if (live && !err && !refused && len <= UINT32_MAX) m = ap__mux_msg_new(n, data, len);
    req_free(n, r);
    if (!live) return;
    if (refused)
        fail_stream(s, AP_ELIMIT, why);
    else if (err)
        fail_stream(s, err, errmsg);
    else if (!m)
        fail_stream(s, len > UINT32_MAX ? AP_EMSGSIZE : AP_ENOMEM, "response not queued");
    else
        queue_response(s, m, len);
}

uint8_t *ap__mux_rpc_respond_begin(ap_rpc_req_t *req, size_t len)
{
    ap_uv_req_t *r = (ap_uv_req_t *)req;
    ap_mstream_t *s = r->s;
    ap_node_t *n = NODE(req->rt);
    if (r->resp) return r->resp->data; /* begun twice: the same buffer */
    char why[64];
    int err = 0;
    if (!req_live(r))
        err = AP_ECLOSED;
    else if (len > UINT32_MAX)
        err = AP_EMSGSIZE;
    else if (ap__ms_rc_reserve(s, len, "a response", why, sizeof why) < 0) {
        n->refused_resp++;
        err = AP_ELIMIT;
    } else if (!(r->resp = ap__mux_msg_alloc(n, len))) {
        ap__ms_rc_release(s, len);
        err = AP_ENOMEM;
    }
    if (!err) return r->resp->data;
    bool live = req_live(r);
    req_unlink(n, r);
    req_free(n, r);
    if (live)
        fail_stream(s, err,
                    err == AP_ELIMIT   ? why
                    : err == AP_ENOMEM ? "out of memory"
                                       : "response too large");
    return NULL;
}

void ap__mux_rpc_respond_commit(ap_rpc_req_t *req)
{
    ap_uv_req_t *r = (ap_uv_req_t *)req;
    ap_mstream_t *s = r->s;
    ap_node_t *n = NODE(req->rt);
    req_unlink(n, r);
    ap_msg_t *m = r->resp;
    r->resp = NULL;
    bool live = req_live(r);
    req_free(n, r);
    if (!m) { /* never begun: an empty response */
        if (live) fail_stream(s, AP_ESTATE, "response not begun");
        return;
    }
    if (!live) {
        ap__mux_msg_free(n, m); /* its count went with the stream */
        return;
    }
    queue_response(s, m, m->len);
}

void ap__ms_resp_release(ap_mstream_t *s, size_t k)
{
    if (k > s->resp_charged) k = s->resp_charged;
    s->resp_charged -= k;
    if (s->conn) s->conn->resp_queued -= k;
    s->node->resp_queued -= k;
    ap__ms_rc_release(s, k);
    s->progress_us = ap__host_now_us(s->node->host);
}

/* ---- stall sweep ---------------------------------------------------------------- */

static uint64_t stall_us(const ap_node_t *n)
{
    return n->stall_us ? n->stall_us : AP_MUX_STALL_US;
}

static bool stalled(const ap_mstream_t *s, uint64_t now)
{
    /* a paused receiver withholds credit on purpose: its partial message is
     * not the peer's stall */
    bool waiting = (s->rx_active && !s->paused) || s->resp_charged;
    return waiting && now - s->progress_us >= stall_us(s->node);
}

static void sweep_cb(ap_rt_t *rt, void *arg)
{
    (void)arg;
    ap_node_t *n = NODE(rt);
    uint64_t now = ap__host_now_us(n->host);
    n->sweep_timer = 0; /* one-shot: re-armed below while anything is held */
    for (ap_mconn_t *c = n->conns; c; c = c->next) {
        if (c->state == MC_DEAD) continue;
        ap_mstream_t *v[64];
        size_t k = 0;
        ap_mstream_t *it;
        for (size_t pos = 0; k < 64 && (it = ap__idmap_next(&c->streams, &pos));)
            if (stalled(it, now)) v[k++] = it;
        for (size_t i = 0; i < k; i++) {
            ap_mstream_t *s = v[i];
            static ap_log_limit_t lim;
            ap_log_limited(&lim, AP_LOG_INFO, "mux",
                           "peer %s: %s on %s made no progress for %u s; resetting it", c->short_id,
                           s->rx_active ? "a partial message" : "a queued response", s->proto,
                           (unsigned)(stall_us(n) / 1000000u));
            n->stalled_reset++;
            ap__mconn_send_reset(c, s->sid, AP_ETIMEDOUT,
                                 s->rx_active ? "message stalled" : "response not read");
            ap__ms_finish(s, AP_ETIMEDOUT);
            if (c->state == MC_DEAD) break;
        }
    }
    if (n->rx_buffered || n->resp_queued) ap__mux_sweep_start(n);
}

void ap__mux_sweep_start(ap_node_t *n)
{
    if (n->sweep_timer) return;
    uint64_t period = stall_us(n) / 4 < AP_MUX_SWEEP_US ? stall_us(n) / 4 : AP_MUX_SWEEP_US;
    n->sweep_timer = ap_rt_timer_start(&n->rt, period, 0, sweep_cb, NULL);
}

static void drain_cb(ap_node_t *n, void *arg, int status)
{
    (void)n;
    (void)status;
    ap_mstream_t *s = arg;
    s->drain_queued = false;
    if (s->finished) return;
    ms_drain(s);
}

/* ---- public operations ------------------------------------------------------------------ */

static int ms_attach(ap_mstream_t *s, ap_mconn_t *c, bool rpc, const char *proto,
                     const uint8_t *first, size_t len)
{
    if (c->nstreams >= AP_MUX_MAX_STREAMS) return AP_ELIMIT;
    if (c->next_sid > UINT32_MAX - 2) return AP_ELIMIT; /* ids exhausted: a new connection is due */
    ap_msg_t *m = ap__mux_msg_new(s->node, first, len);
    if (!m) return AP_ENOMEM;
    uint32_t sid = c->next_sid;
    if (ap__idmap_put(&c->streams, sid, s) < 0) {
        ap__mux_msg_free(s->node, m);
        return AP_ENOMEM;
    }
    c->next_sid += 2;
    c->nstreams++;
    s->conn = c;
    s->sid = sid;
    s->opener = true;
    if (s->proto != proto) snprintf(s->proto, sizeof s->proto, "%s", proto); /* re-open */
    m->exempt = true;
    s->sq = s->sq_tail = m;
    s->sbuf = len;
    s->rx_credit = s->rx_window;
    ap__mconn_ctl_rc(c, ap__frame_put_open(&c->obuf, sid, rpc, s->rx_window, proto));
    ap__ms_schedule(s);
    return 0;
}

static void call_timeout(ap_rt_t *rt, void *arg)
{
    ap_mstream_t *s = arg;
    (void)rt;
    s->open_timer = 0;
    if (s->conn) ap__mconn_send_reset(s->conn, s->sid, AP_ETIMEDOUT, "deadline exceeded");
    ap__ms_finish(s, AP_ETIMEDOUT);
}

uint64_t ap__mux_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                          const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                          ap_rpc_done_fn done, void *arg)
{
    ap_node_t *n = NODE(rt);
    if (atomic_load(&n->closing)) return 0;
    ap_mstream_t *s = ap__ms_new(n, MS_CALL);
    if (!s) return 0;
    s->call_id = n->next_id++;
    s->done = done;
    s->done_arg = arg;
    s->pub.peer = *peer;
    s->pub.max_msg = opts->max_resp;
    s->rx_window = opts->max_resp > INT32_MAX ? INT32_MAX : (uint32_t)opts->max_resp;
    if (ap__idmap_put(&n->calls, s->call_id, s) < 0) {
        free(s);
        return 0;
    }
    n->stats.rpc_calls++;
    ap_mconn_t *c = NULL;
    int rc = len > UINT32_MAX ? AP_EMSGSIZE : ap__mconn_get(n, peer, &c);
    if (rc == 0) rc = ms_attach(s, c, true, proto, req, len);
    if (rc < 0) {
        ap__ms_finish(s, rc == AP_ENOMEM ? AP_EUNREACH : rc);
        return s->call_id;
    }
    s->lclose = true; /* the request is all the caller sends */
    s->open_timer = ap_rt_timer_start(rt, opts->timeout_us, 0, call_timeout, s);
    return s->call_id;
}

bool ap__mux_rpc_cancel(ap_rt_t *rt, uint64_t call_id)
{
    ap_node_t *n = NODE(rt);
    ap_mstream_t *s = ap__idmap_get(&n->calls, call_id);
    if (!s || s->finished || !s->done) return false;
    if (s->conn) ap__mconn_send_reset(s->conn, s->sid, AP_ECANCELED, "canceled");
    ap_rpc_done_fn done = s->done;
    s->done = NULL;
    ap__ms_finish(s, AP_ECANCELED);
    done(rt, s->done_arg, AP_ECANCELED, NULL, 0, NULL);
    return true;
}

static void open_timeout(ap_rt_t *rt, void *arg)
{
    ap_mstream_t *s = arg;
    (void)rt;
    s->open_timer = 0;
    if (s->conn) ap__mconn_send_reset(s->conn, s->sid, AP_ETIMEDOUT, "open timed out");
    ap__ms_finish(s, AP_ETIMEDOUT);
}

int ap__mux_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                        const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                        const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out)
{
    ap_node_t *n = NODE(rt);
    if (atomic_load(&n->closing)) return AP_ESHUTDOWN;
    if (len > UINT32_MAX) return AP_EMSGSIZE;
    ap_mstream_t *s = ap__ms_new(n, MS_STREAM);
    if (!s) return AP_ENOMEM;
    s->pub.peer = *peer;
    s->pub.id = n->next_id++;
    s->pub.cbs = *cbs;
    s->pub.arg = arg;
    s->pub.window = opts->window;
    s->pub.max_msg = opts->max_msg;
    s->rx_window = opts->window > INT32_MAX ? INT32_MAX : (uint32_t)opts->window;
    s->accepted_by_user = true;
    strcpy(s->proto, proto);
    n->stats.streams_opened++;
    *out = &s->pub;
    ap_mconn_t *c = NULL;
    int rc = ap__mconn_get(n, peer, &c);
    if (rc == 0) rc = ms_attach(s, c, false, proto, hello, len);
    if (rc < 0) {
        ap__ms_finish(s, rc);
        return 0;
    }
    s->open_timer = ap_rt_timer_start(rt, opts->open_timeout_us, 0, open_timeout, s);
    return 0;
}

int ap__mux_stream_send(ap_stream_t *ps, const uint8_t *data, size_t len)
{
    ap_iovec_t one = {data, len};
    return ap__mux_stream_sendv(ps, &one, 1, len);
}

int ap__mux_stream_sendv(ap_stream_t *ps, const ap_iovec_t *iov, int iovcnt, size_t len)
{
    ap_mstream_t *s = MS(ps);
    if (s->finished) return AP_ECLOSED;
    if (s->lclose) return AP_ESTATE;
    if (len > UINT32_MAX) return AP_EMSGSIZE;
    size_t held = s->sbuf + s->inflight;
    if (held > 0 && held + len > s->pub.window) {
        s->want_writable = true;
        return AP_EAGAIN;
    }
    ap_msg_t *m = ap__mux_msg_alloc(s->node, len);
    if (!m) return AP_ENOMEM;
    ap__iov_gather(m->data, iov, iovcnt);
    if (s->sq_tail)
        s->sq_tail->next = m;
    else
        s->sq = m;
    s->sq_tail = m;
    s->sbuf += len;
    ap__ms_schedule(s);
    return 0;
}

size_t ap__mux_stream_buffered(const ap_stream_t *ps)
{
    return MS(ps)->sbuf + MS(ps)->inflight;
}

void ap__mux_stream_pause(ap_stream_t *ps, bool paused)
{
    ap_mstream_t *s = MS(ps);
    if (s->finished || s->paused == paused) return;
    s->paused = paused;
    if (!paused && !s->drain_queued) {
        s->drain_queued = true;
        if (ap__node_defer(s->node, drain_cb, s, 0) < 0) s->drain_queued = false;
    }
}

int ap__mux_stream_close(ap_stream_t *ps)
{
    ap_mstream_t *s = MS(ps);
    if (s->finished) return AP_ECLOSED;
    if (s->lclose) return 0;
    s->lclose = true;
    ap__ms_try_close(s);
    return 0;
}

void ap__mux_stream_reset(ap_stream_t *ps, int err)
{
    ap_mstream_t *s = MS(ps);
    if (s->finished) return;
    int st = err < 0 ? err : AP_ERESET;
    if (s->conn) ap__mconn_send_reset(s->conn, s->sid, st, "reset");
    ap__ms_finish(s, st);
    /* The resetting side learns at once: on_close runs before this returns
     * (the memory is freed later, from the loop). */
    if (s->accepted_by_user && !s->close_fired) {
        s->close_fired = true;
        if (s->pub.cbs.on_close) s->pub.cbs.on_close(&s->pub, s->pub.arg, st);
    }
}
