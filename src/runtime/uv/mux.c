/* libuv driver: the stream multiplexer and RPC over one connection per peer.
 * Frame format, flow control and the RPC envelope: docs/protocol.md. */
#include "runtime/uv/uv_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NODE(rt) ((ap_node_t *)(rt))
#define MS(s)    ((ap_mstream_t *)(s))

static void msg_free(ap_node_t *n, ap_msg_t *m);

typedef struct ap_uv_req {
    struct ap_rpc_req pub;
    ap_mstream_t *s;               /* NULL once the caller is gone */
    ap_msg_t *msg;                 /* the request bytes */
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

/* Node teardown: requests the handlers still hold die with the node. */
void ap__mux_free_reqs(ap_node_t *n)
{
    while (n->reqs) {
        ap_uv_req_t *r = n->reqs;
        n->reqs = r->next;
        if (r->s) r->s->req = NULL;
        msg_free(n, r->msg);
        free(r);
    }
}

typedef struct ap_dial {
    struct ap_dial *next;
    ap_mconn_t *conn;
    ap_node_t *node;
    ap_dial_fn cb;
    void *arg;
    bool has_id;
    ap_peer_id_t id;
    uint64_t timer;
} ap_dial_t;

static void conn_fail(ap_mconn_t *c, int status, const char *why);
static void ms_finish(ap_mstream_t *s, int status);
static void ms_schedule(ap_mstream_t *s);
static void ms_try_close(ap_mstream_t *s);

/* ---- small helpers ---------------------------------------------------------- */

static void want_flush(ap_mconn_t *c)
{
    if (c->flush_queued || c->state == MC_DEAD) return;
    c->flush_queued = true;
    c->flush_next = c->node->flushq;
    c->node->flushq = c;
    ap__host_kick(c->node->host);
}

static void ctl_rc(ap_mconn_t *c, int rc)
{
    if (rc < 0)
        conn_fail(c, AP_ENOMEM, "out of memory queueing a frame");
    else
        want_flush(c);
}

static void send_reset(ap_mconn_t *c, uint32_t sid, int code, const char *msg)
{
    if (c && c->state != MC_DEAD) ctl_rc(c, ap__frame_put_reset(&c->obuf, sid, code, msg));
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

static ap_msg_t *msg_alloc(ap_node_t *n, size_t len)
{
    size_t cap = msg_cap(len);
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

static void msg_free(ap_node_t *n, ap_msg_t *m)
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

static ap_msg_t *msg_new(ap_node_t *n, const uint8_t *data, size_t len)
{
    ap_msg_t *m = msg_alloc(n, len);
    if (m && len) memcpy(m->data, data, len);
    return m;
}

static void msgs_free(ap_node_t *n, ap_msg_t *m)
{
    while (m) {
        ap_msg_t *next = m->next;
        msg_free(n, m);
        m = next;
    }
}

static ap_mstream_t *ms_new(ap_node_t *n, int kind)
{
    ap_mstream_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->pub.rt = &n->rt;
    s->node = n;
    s->kind = (uint8_t)kind;
    return s;
}

/* ---- connections -------------------------------------------------------------- */

static bool conn_up_to(ap_node_t *n, const ap_peer_id_t *peer, const ap_mconn_t *except)
{
    for (ap_mconn_t *c = n->conns; c; c = c->next)
        if (c != except && c->state == MC_UP && ap_peer_id_eq(&c->peer, peer)) return true;
    return false;
}

static ap_mconn_t *find_conn(ap_node_t *n, const ap_peer_id_t *peer)
{
    ap_mconn_t *dialing = NULL;
    for (ap_mconn_t *c = n->conns; c; c = c->next) {
        if (!c->known_peer || !ap_peer_id_eq(&c->peer, peer)) continue;
        if (c->goaway_sent || c->goaway_rcvd) continue; /* draining: no new streams */
        if (c->state == MC_UP) return c;
        if (c->state == MC_DIALING && !dialing) dialing = c;
    }
    return dialing;
}

static void on_up(void *user, ap_conn_t *t, const ap_peer_id_t *remote);
static void on_read(void *user, ap_conn_t *t, const uint8_t *p, size_t n);
static void on_drain(void *user, ap_conn_t *t);
static void on_close(void *user, ap_conn_t *t, int status);

static void conn_set_peer(ap_mconn_t *c, const ap_peer_id_t *peer)
{
    c->peer = *peer;
    c->known_peer = true;
    ap_peer_id_short(peer, c->short_id);
}

static void drain_timeout(ap_rt_t *rt, void *arg)
{
    ap_mconn_t *c = arg;
    (void)rt;
    c->drain_timer = 0;
    ap_info("mux", "connection to %s did not drain within %u s after GOAWAY: closing it",
            c->short_id, AP_MUX_DRAIN_US / 1000000u);
    conn_fail(c, AP_ECLOSED, NULL);
}

/* Stops opening streams on c: sends GOAWAY (once). Streams already on c run
 * to their end; c is closed once both sides sent GOAWAY and no stream is
 * left (ap__mconn_flush), or after AP_MUX_DRAIN_US. */
static void conn_goaway(ap_mconn_t *c)
{
    if (c->goaway_sent || c->state != MC_UP) return;
    c->goaway_sent = true;
    ap_debug("mux", "GOAWAY on a connection to %s (%u streams to drain)", c->short_id, c->nstreams);
    c->drain_timer = ap_rt_timer_start(&c->node->rt, AP_MUX_DRAIN_US, 0, drain_timeout, c);
    ctl_rc(c, ap__frame_put_goaway(&c->obuf));
}

/* Whether connection x to the peer was dialled by the smaller PeerID. */
static bool dialled_by_smaller(const ap_mconn_t *x)
{
    bool self_smaller = ap_peer_id_cmp(&x->node->rt.self, &x->peer) < 0;
    return x->t->dialer == self_smaller;
}

/* c just came up: if another live connection to the same peer exists (both
 * sides dialled at once, or the same side dialled twice), one of the two
 * goes away. Both ends pick the same loser: between connections dialled by
 * different sides, the one dialled by the larger PeerID; between two dialled
 * by us, the newer (c). Two we accepted: the peer dialled both and decides;
 * we answer its GOAWAY (on_goaway). */
static void conn_resolve_dup(ap_mconn_t *c)
{
    ap_node_t *n = c->node;
    for (ap_mconn_t *o = n->conns; o; o = o->next) {
        if (o == c || o->state != MC_UP || o->goaway_sent || o->goaway_rcvd || !o->t ||
            !ap_peer_id_eq(&o->peer, &c->peer))
            continue;
        ap_mconn_t *loser;
        if (o->t->dialer != c->t->dialer)
            loser = dialled_by_smaller(c) ? o : c;
        else if (c->t->dialer)
            loser = c;
        else
            continue;
        n->stats.goaways++;
        conn_goaway(loser);
        if (loser == c) return;
    }
}

static void conn_became_up(ap_mconn_t *c)
{
    ap_node_t *n = c->node;
    c->state = MC_UP;
    bool first = !conn_up_to(n, &c->peer, c);
    ap_debug("mux", "connection to %s up", c->short_id);
    want_flush(c);
    if (first) ap__rt_peer_event(&n->rt, &c->peer, AP_PEER_CONNECTED);
    if (!first && c->state == MC_UP) conn_resolve_dup(c);
}

ap_mconn_t *ap__mconn_new(ap_node_t *n, ap_conn_t *t, bool up)
{
    ap_mconn_t *c = calloc(1, sizeof *c);
    ap_frame_dec_t *dec = malloc(sizeof *dec);
    if (!c || !dec) {
        free(c);
        free(dec);
        return NULL;
    }
    ap__frame_dec_init(dec);
    c->node = n;
    c->t = t;
    c->dec = dec;
    c->state = MC_DIALING;
    c->book_next = -1;
    c->next_sid = t->dialer ? 1 : 2;
    c->credit = AP_MUX_CONN_WINDOW;
    c->rx_credit = AP_MUX_CONN_WINDOW;
    t->user = c;
    t->cbs = (ap_conn_cbs_t){
        .on_up = on_up, .on_read = on_read, .on_drain = on_drain, .on_close = on_close};
    c->next = n->conns;
    n->conns = c;
    if (up) {
        conn_set_peer(c, &t->remote);
        conn_became_up(c);
    }
    return c;
}

void ap__node_accept_conn(ap_node_t *n, ap_conn_t *t)
{
    if (atomic_load(&n->closing) || !ap__mconn_new(n, t, true)) t->vt->close(t);
}

static void free_conn(ap_node_t *n, void *arg, int status)
{
    (void)n;
    (void)status;
    ap_mconn_t *c = arg;
    ap__idmap_free(&c->streams);
    ap__buf_free(&c->obuf);
    free(c->dec);
    free(c);
}

static void dial_done(ap_dial_t *d, int status, const ap_peer_id_t *peer)
{
    ap_node_t *n = d->node;
    if (d->timer) ap_rt_timer_stop(&n->rt, d->timer);
    d->cb(&n->rt, d->arg, status, status == 0 ? peer : NULL);
    free(d);
}

static void dial_timeout(ap_rt_t *rt, void *arg);

/* An implicit dial whose address failed before the connection came up moves
 * on to the peer's next older address: a peer may advertise several (one
 * per interface) of which only some are reachable from here. Streams and
 * calls waiting on c stay queued. Returns whether a new dial started. */
static bool conn_redial(ap_mconn_t *c, int status)
{
    ap_node_t *n = c->node;
    if (c->state != MC_DIALING || !c->known_peer || c->book_next < 0 || status == AP_EEXIST ||
        atomic_load(&n->closing))
        return false;
    ap_book_t *b = NULL;
    for (size_t i = 0; i < n->nbook && !b; i++)
        if (ap_peer_id_eq(&n->book[i].peer, &c->peer)) b = &n->book[i];
    if (!b) return false;
    for (int k = c->book_next < b->n ? c->book_next : b->n - 1; k >= 0; k--) {
        ap_conn_t *t;
        if (ap__addr_dial(n, b->addrs[k], &t) < 0) continue;
        ap_debug("mux", "dial to %s failed (%s): trying %s", c->short_id, ap_err_name(status),
                 b->addrs[k]);
        c->t->vt->close(c->t);
        c->t = t;
        c->next_sid = t->dialer ? 1 : 2;
        t->user = c;
        t->cbs = (ap_conn_cbs_t){
            .on_up = on_up, .on_read = on_read, .on_drain = on_drain, .on_close = on_close};
        c->book_next = k - 1;
        if (c->dial_timer) ap_rt_timer_stop(&n->rt, c->dial_timer);
        c->dial_timer = ap_rt_timer_start(&n->rt, AP_MUX_DIAL_TIMEOUT_US, 0, dial_timeout, c);
        return true;
    }
    return false;
}

static void conn_fail(ap_mconn_t *c, int status, const char *why)
{
    if (c->state == MC_DEAD) return;
    if (c->t && conn_redial(c, status)) return;
    ap_node_t *n = c->node;
    bool was_up = c->state == MC_UP;
    c->state = MC_DEAD;
    if (why)
        ap_warn("mux", "closing connection to %s: %s", c->known_peer ? c->short_id : "?", why);
    else
        ap_debug("mux", "connection to %s closed (%s)", c->known_peer ? c->short_id : "?",
                 ap_err_name(status));
    if (c->t) {
        c->t->vt->close(c->t);
        c->t = NULL;
    }
    if (c->dial_timer) ap_rt_timer_stop(&n->rt, c->dial_timer);
    c->dial_timer = 0;
    if (c->drain_timer) ap_rt_timer_stop(&n->rt, c->drain_timer);
    c->drain_timer = 0;
    for (ap_mconn_t **pp = &n->conns; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    if (c->flush_queued)
        for (ap_mconn_t **pp = &n->flushq; *pp; pp = &(*pp)->flush_next)
            if (*pp == c) {
                *pp = c->flush_next;
                break;
            }
    c->flush_queued = false;
    bool closing = atomic_load(&n->closing);
    int st = was_up ? AP_ECLOSED : status;
    /* Every stream and call on it finishes (callbacks are queued, FIFO). */
    ap_mstream_t *s;
    for (size_t pos = 0; (s = ap__idmap_next(&c->streams, &pos));) {
        int sst = st;
        if (closing && s->kind == MS_CALL) sst = AP_ECANCELED;
        s->conn = NULL; /* detached below */
        ms_finish(s, sst);
    }
    ap__idmap_free(&c->streams);
    c->nstreams = 0;
    while (c->dials) {
        ap_dial_t *d = c->dials;
        c->dials = d->next;
        dial_done(d, closing ? AP_ECANCELED : (was_up ? AP_ECLOSED : status), NULL);
    }
    if (was_up && !closing && !conn_up_to(n, &c->peer, c))
        ap__rt_peer_event(&n->rt, &c->peer, AP_PEER_DISCONNECTED);
    if (ap__node_defer(n, free_conn, c, 0) < 0) free_conn(n, c, 0);
}

void ap__mux_close_all(ap_node_t *n)
{
    while (n->conns) conn_fail(n->conns, AP_ECLOSED, NULL);
}

static void dial_timeout(ap_rt_t *rt, void *arg)
{
    ap_mconn_t *c = arg;
    (void)rt;
    c->dial_timer = 0;
    conn_fail(c, AP_EUNREACH, NULL);
}

static void on_up(void *user, ap_conn_t *t, const ap_peer_id_t *remote)
{
    ap_mconn_t *c = user;
    (void)t;
    if (c->state != MC_DIALING) return;
    if (c->known_peer && !ap_peer_id_eq(&c->peer, remote)) {
        char got[AP_PEER_SHORT_LEN];
        ap_warn("mux", "dialed %s but reached %s", c->short_id, ap_peer_id_short(remote, got));
        conn_fail(c, AP_EAUTH, NULL);
        return;
    }
    if (c->dial_timer) ap_rt_timer_stop(&c->node->rt, c->dial_timer);
    c->dial_timer = 0;
    conn_set_peer(c, remote);
    while (c->dials) {
        ap_dial_t *d = c->dials;
        c->dials = d->next;
        if (d->has_id && !ap_peer_id_eq(&d->id, remote)) {
            dial_done(d, AP_EAUTH, NULL);
        } else {
            dial_done(d, 0, remote);
        }
        if (c->state == MC_DEAD) return;
    }
    conn_became_up(c);
}

static void on_drain(void *user, ap_conn_t *t)
{
    ap_mconn_t *c = user;
    (void)t;
    c->blocked = false;
    want_flush(c);
}

static int sid_cmp(const void *a, const void *b)
{
    uint32_t x = (*(ap_mstream_t *const *)a)->sid, y = (*(ap_mstream_t *const *)b)->sid;
    return x < y ? -1 : x > y;
}

/* A dial of ours lost the race to a connection the same peer opened to us
 * (the transport resolved the dial with a connection this mux already owns,
 * AP_EEXIST): the dial succeeds with that connection, and the calls and
 * streams queued on the dialing connection move to it. Nothing was sent on
 * the dialing connection (it never came up), so each stream is simply
 * opened again on the survivor, in its original order, under a stream id of
 * the survivor's parity. */
static void conn_adopt(ap_mconn_t *c, ap_mconn_t *up)
{
    ap_debug("mux", "dial to %s crossed an inbound connection: using that one", up->short_id);
    size_t k = 0;
    ap_mstream_t **v = c->nstreams ? malloc(c->nstreams * sizeof *v) : NULL;
    if (c->nstreams && !v) {
        conn_fail(c, AP_ENOMEM, NULL);
        return;
    }
    ap_mstream_t *it;
    for (size_t pos = 0; k < c->nstreams && (it = ap__idmap_next(&c->streams, &pos));) v[k++] = it;
    if (k > 1) qsort(v, k, sizeof *v, sid_cmp);
    ap__idmap_free(&c->streams);
    c->nstreams = 0;
    c->sched_head = c->sched_tail = NULL;
    ap_dial_t *dials = c->dials;
    c->dials = NULL;
    conn_fail(c, AP_EEXIST, NULL); /* nothing left on it: just released */
    for (size_t i = 0; i < k; i++) {
        ap_mstream_t *s = v[i];
        s->conn = NULL;
        s->in_sched = false;
        s->sched_next = NULL;
        int rc = up->state == MC_UP ? AP_ELIMIT : AP_ECLOSED;
        uint32_t sid = up->next_sid;
        if (up->state == MC_UP && up->nstreams < AP_MUX_MAX_STREAMS &&
            up->next_sid <= UINT32_MAX - 2)
            rc = ap__idmap_put(&up->streams, sid, s);
        if (rc < 0) {
            ms_finish(s, rc == AP_ENOMEM ? AP_EUNREACH : rc);
            continue;
        }
        up->next_sid += 2;
        up->nstreams++;
        s->conn = up;
        s->sid = sid;
        ctl_rc(up, ap__frame_put_open(&up->obuf, sid, s->kind == MS_CALL, s->rx_window, s->proto));
        ms_schedule(s);
    }
    free(v);
    want_flush(up);
    while (dials) {
        ap_dial_t *d = dials;
        dials = d->next;
        if (d->has_id && !ap_peer_id_eq(&d->id, &up->peer))
            dial_done(d, AP_EAUTH, NULL);
        else
            dial_done(d, 0, &up->peer);
    }
}

static void on_close(void *user, ap_conn_t *t, int status)
{
    ap_mconn_t *c = user;
    if (status == AP_EEXIST && c->state == MC_DIALING &&
        (!c->known_peer || ap_peer_id_eq(&c->peer, &t->remote))) {
        ap_mconn_t *up = find_conn(c->node, &t->remote);
        if (up && up != c && up->state == MC_UP) {
            conn_adopt(c, up);
            return;
        }
    }
    conn_fail(c, status, NULL);
}

/* Dials peer if no connection exists. */
static int get_conn(ap_node_t *n, const ap_peer_id_t *peer, ap_mconn_t **out)
{
    if (ap_peer_id_eq(peer, &n->rt.self)) return AP_EUNREACH;
    ap_mconn_t *c = find_conn(n, peer);
    if (c) {
        *out = c;
        return 0;
    }
    for (size_t i = 0; i < n->nbook; i++) {
        ap_book_t *b = &n->book[i];
        if (!ap_peer_id_eq(&b->peer, peer)) continue;
        for (int k = b->n - 1; k >= 0; k--) {
            ap_conn_t *t;
            if (ap__addr_dial(n, b->addrs[k], &t) < 0) continue;
            c = ap__mconn_new(n, t, false);
            if (!c) {
                t->vt->close(t);
                return AP_ENOMEM;
            }
            conn_set_peer(c, peer);
            c->book_next = k - 1;
            c->dial_timer = ap_rt_timer_start(&n->rt, AP_MUX_DIAL_TIMEOUT_US, 0, dial_timeout, c);
            *out = c;
            return 0;
        }
    }
    return AP_EUNREACH;
}

/* ---- addresses and dialing ------------------------------------------------------- */

int ap__mux_add_addr(ap_rt_t *rt, const ap_peer_id_t *peer, const char *addr)
{
    ap_node_t *n = NODE(rt);
    bool has_id;
    ap_peer_id_t id;
    if (!peer || !addr) return AP_EINVAL;
    if (strlen(addr) >= AP_RT_ADDR_MAX) return AP_EADDR;
    int rc = ap__addr_parse(n, addr, &has_id, &id);
    if (rc < 0) return rc;
    if (has_id && !ap_peer_id_eq(&id, peer)) return AP_EADDR;
    ap_book_t *b = NULL;
    for (size_t i = 0; i < n->nbook && !b; i++)
        if (ap_peer_id_eq(&n->book[i].peer, peer)) b = &n->book[i];
    if (!b) {
        if (n->nbook == n->book_cap) {
            size_t cap = n->book_cap ? n->book_cap * 2 : 16;
            ap_book_t *nb = realloc(n->book, cap * sizeof *nb);
            if (!nb) return AP_ENOMEM;
            n->book = nb;
            n->book_cap = cap;
        }
        b = &n->book[n->nbook++];
        memset(b, 0, sizeof *b);
        b->peer = *peer;
    }
    for (int i = 0; i < b->n; i++) {
        if (strcmp(b->addrs[i], addr) != 0) continue;
        /* most recent last */
        memmove(&b->addrs[i], &b->addrs[i + 1], (size_t)(b->n - i - 1) * AP_RT_ADDR_MAX);
        b->n--;
        break;
    }
    if (b->n == AP_NODE_MAX_ADDRS) {
        memmove(&b->addrs[0], &b->addrs[1], (size_t)(b->n - 1) * AP_RT_ADDR_MAX);
        b->n--;
    }
    strcpy(b->addrs[b->n++], addr);
    return 0;
}

static void dial_timer_cb(ap_rt_t *rt, void *arg)
{
    ap_dial_t *d = arg;
    (void)rt;
    d->timer = 0;
    for (ap_dial_t **pp = &d->conn->dials; *pp; pp = &(*pp)->next)
        if (*pp == d) {
            *pp = d->next;
            break;
        }
    dial_done(d, AP_ETIMEDOUT, NULL);
}

typedef struct dial_now {
    ap_dial_fn cb;
    void *arg;
    ap_peer_id_t peer;
} dial_now_t;

static void dial_deferred(ap_node_t *n, void *arg, int status)
{
    dial_now_t *d = arg;
    d->cb(&n->rt, d->arg, status, status == 0 ? &d->peer : NULL);
    free(d);
}

int ap__mux_dial(ap_rt_t *rt, const char *addr, uint64_t timeout_us, ap_dial_fn cb, void *arg)
{
    ap_node_t *n = NODE(rt);
    bool has_id;
    ap_peer_id_t id;
    if (!cb || !addr) return AP_EINVAL;
    if (atomic_load(&n->closing)) return AP_ESHUTDOWN;
    int rc = ap__addr_parse(n, addr, &has_id, &id);
    if (rc < 0) return rc;
    ap_mconn_t *c = has_id ? find_conn(n, &id) : NULL;
    if (c && c->state == MC_UP) {
        dial_now_t *d = malloc(sizeof *d);
        if (!d) return AP_ENOMEM;
        *d = (dial_now_t){.cb = cb, .arg = arg, .peer = id};
        if (ap__node_defer(n, dial_deferred, d, 0) < 0) {
            free(d);
            return AP_ENOMEM;
        }
        return 0;
    }
    ap_dial_t *d = calloc(1, sizeof *d);
    if (!d) return AP_ENOMEM;
    if (!c) {
        ap_conn_t *t;
        rc = ap__addr_dial(n, addr, &t);
        if (rc < 0) { /* nobody there: report from the loop, never re-entrantly */
            free(d);
            dial_now_t *dn = malloc(sizeof *dn);
            if (!dn) return AP_ENOMEM;
            *dn = (dial_now_t){.cb = cb, .arg = arg};
            if (ap__node_defer(n, dial_deferred, dn, AP_EUNREACH) < 0) {
                free(dn);
                return AP_ENOMEM;
            }
            return 0;
        }
        c = ap__mconn_new(n, t, false);
        if (!c) {
            t->vt->close(t);
            free(d);
            return AP_ENOMEM;
        }
        if (has_id) conn_set_peer(c, &id);
        c->dial_timer = ap_rt_timer_start(rt, AP_MUX_DIAL_TIMEOUT_US, 0, dial_timeout, c);
    }
    d->conn = c;
    d->node = n;
    d->cb = cb;
    d->arg = arg;
    d->has_id = has_id;
    d->id = id;
    d->timer = ap_rt_timer_start(rt, timeout_us ? timeout_us : 30000000u, 0, dial_timer_cb, d);
    d->next = c->dials;
    c->dials = d;
    return 0;
}

bool ap__mux_is_connected(ap_rt_t *rt, const ap_peer_id_t *peer)
{
    return conn_up_to(NODE(rt), peer, NULL);
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

static void ms_finish(ap_mstream_t *s, int status)
{
    if (s->finished) return;
    ap_node_t *n = s->node;
    s->finished = true;
    s->status = status;
    ap_mconn_t *c = s->conn;
    if (c) {
        ms_unsched(s);
        ap__idmap_del(&c->streams, s->sid);
        c->nstreams--;
        s->conn = NULL;
        if (c->goaway_sent && c->nstreams == 0) want_flush(c); /* may be drained */
    }
    if (c) c->rx_buffered -= s->rx_charged;
    s->rx_charged = 0;
    if (s->kind == MS_CALL) ap__idmap_del(&n->calls, s->call_id);
    if (s->open_timer) ap_rt_timer_stop(&n->rt, s->open_timer);
    s->open_timer = 0;
    msgs_free(n, s->sq);
    msgs_free(n, s->rq);
    msg_free(n, (ap_msg_t *)s->rx);
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
    if (s->kind == MS_STREAM && s->end_fired && s->close_sent) ms_finish(s, 0);
    if (s->kind == MS_SERVE && s->close_sent) ms_finish(s, 0);
}

static bool ms_eligible(const ap_mstream_t *s)
{
    if (s->finished || !s->conn || !s->sq) return false;
    const ap_msg_t *m = s->sq;
    if (m->exempt) return true;
    if (!s->accepted) return false;
    return s->credit > 0 || m->off == m->len;
}

static void ms_schedule(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    if (!c || s->in_sched || !ms_eligible(s)) return;
    s->sched_next = NULL;
    if (c->sched_tail)
        c->sched_tail->sched_next = s;
    else
        c->sched_head = s;
    c->sched_tail = s;
    s->in_sched = true;
    want_flush(c);
}

static void ms_try_close(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    if (!c || s->finished || !s->lclose || s->close_sent || s->sq) return;
    if (!s->opener && !s->accepted) return; /* CLOSE may not precede ACCEPT */
    s->close_sent = true;
    ctl_rc(c, ap__frame_put_close(&c->obuf, s->sid));
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

/* Hands the frame buffer to the transport. */
static void conn_write_obuf(ap_mconn_t *c)
{
    if (c->state != MC_UP || !c->t || c->obuf.len == 0) return;
    c->credit_owed = false;
    int rc = c->t->vt->write(c->t, c->obuf.data, c->obuf.len);
    c->node->stats.bytes_sent += c->obuf.len;
    ap__buf_reset(&c->obuf);
    if (rc == 1) c->blocked = true; /* rc < 0: on_close follows */
}

/* Frames one DATA frame of s. Returns whether s can send more now. */
static bool ms_frame_one(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    ap_msg_t *m = s->sq;
    size_t left = m->len - m->off;
    size_t k = left < AP_MUX_FRAG ? left : AP_MUX_FRAG;
    if (!m->exempt && (int64_t)k > s->credit) k = (size_t)s->credit;
    if ((int64_t)k > c->credit) k = (size_t)c->credit;
    if (k == 0 && left > 0) return false;
    bool start = !m->started;
    if (k >= AP_MUX_DIRECT_MIN) {
        /* Big fragment: the header goes right before the bytes (into the
         * head room, or over bytes already written), and the frame goes to
         * the transport from the message itself: one transport write per
         * frame, so over TCP each frame is one whole Noise message (sealed
         * straight from here; the receiver never reassembles it either). */
        size_t hl = AP_FRAME_HDR + (start ? 4u : 0u);
        uint8_t *h = m->data + m->off - hl;
        h[0] = AP_FRAME_DATA;
        h[1] = start ? AP_FRAME_F_START : 0;
        ap__put_be32(h + 2, s->sid);
        ap__put_be16(h + 6, (uint16_t)(k + hl - AP_FRAME_HDR));
        if (start) ap__put_be32(h + 8, (uint32_t)m->len);
        conn_write_obuf(c); /* frames queued before this one go first */
        if (c->state == MC_UP && c->t) {
            int rc = c->t->vt->write(c->t, h, hl + k);
            c->node->stats.bytes_sent += hl + k;
            c->direct_bytes += hl + k;
            if (rc == 1) c->blocked = true;
        }
    } else {
        int rc = ap__frame_put_data(&c->obuf, s->sid, start, (uint32_t)m->len, m->data + m->off, k);
        if (rc < 0) {
            conn_fail(c, AP_ENOMEM, "out of memory framing data");
            return false;
        }
    }
    m->started = true;
    m->off += k;
    if (!m->exempt) s->credit -= (int64_t)k;
    c->credit -= (int64_t)k;
    s->sbuf -= k;
    if (!m->exempt) s->inflight += k; /* until the receiver acknowledges it */
    if (m->off == m->len) {
        s->sq = m->next;
        if (!s->sq) s->sq_tail = NULL;
        msg_free(s->node, m);
    }
    if (s->want_writable && !s->writable_queued && below_half(s)) {
        s->writable_queued = true;
        if (ap__node_defer(s->node, writable_cb, s, 0) < 0) s->writable_queued = false;
    }
    if (!s->sq) ms_try_close(s);
    return ms_eligible(s);
}

void ap__mconn_flush(ap_mconn_t *c)
{
    if (c->state != MC_UP || !c->t) return;
    ap_node_t *n = c->node;
    if (c->goaway_sent && c->goaway_rcvd && c->nstreams == 0) {
        /* drained: both sides stopped opening streams and none is left */
        if (c->obuf.len) {
            c->t->vt->write(c->t, c->obuf.data, c->obuf.len);
            n->stats.bytes_sent += c->obuf.len;
            ap__buf_reset(&c->obuf);
        }
        ap_debug("mux", "connection to %s drained after GOAWAY: closing it", c->short_id);
        conn_fail(c, AP_ECLOSED, NULL);
        return;
    }
    for (int round = 0; round < 8; round++) {
        c->direct_bytes = 0;
        while (!c->blocked && c->sched_head && c->credit > 0 &&
               c->obuf.len + c->direct_bytes < AP_MUX_FLUSH_BYTES && c->state == MC_UP) {
            ap_mstream_t *s = c->sched_head;
            c->sched_head = s->sched_next;
            if (!c->sched_head) c->sched_tail = NULL;
            s->in_sched = false;
            s->sched_next = NULL;
            if (ms_frame_one(s) && s->conn == c) {
                /* round robin: back to the tail */
                s->in_sched = true;
                if (c->sched_tail)
                    c->sched_tail->sched_next = s;
                else
                    c->sched_head = s;
                c->sched_tail = s;
            }
        }
        if (c->state != MC_UP) return;
        conn_write_obuf(c);
        if (c->state != MC_UP || !c->t) return; /* on_close follows */
        if (c->blocked || !c->sched_head || c->credit <= 0) return;
    }
    want_flush(c); /* more to send: yield to the loop first */
}

/* ---- receive side -------------------------------------------------------------------- */

static void ms_ack(ap_mstream_t *s, bool force)
{
    ap_mconn_t *c = s->conn;
    if (!c || s->finished || s->paused || s->unacked == 0 || s->rclosed || s->kind == MS_CALL)
        return;
    uint32_t w = s->rx_window < s->peer_window ? s->rx_window : s->peer_window;
    uint32_t thr = w / 4 ? w / 4 : 1;
    if (!force && s->unacked < thr) return;
    ctl_rc(c, ap__frame_put_window(&c->obuf, s->sid, false, s->unacked));
    c->credit_owed = true;
    s->rx_credit += s->unacked;
    s->unacked = 0;
}

static void ms_maybe_end(ap_mstream_t *s)
{
    if (s->finished || !s->rclosed || s->end_fired || s->rq || s->rx_active || s->paused) return;
    if (s->kind == MS_CALL) { /* the server closed without answering */
        ms_finish(s, AP_ECLOSED);
        return;
    }
    if (s->kind != MS_STREAM) return;
    s->end_fired = true;
    if (s->pub.cbs.on_end) s->pub.cbs.on_end(&s->pub, s->pub.arg);
    ms_check_done(s);
}

/* Delivers one complete message m (taken off the stream) to the user. */
static void ms_deliver(ap_mstream_t *s, ap_msg_t *m)
{
    ap_node_t *n = s->node;
    if (s->kind == MS_CALL) {
        ap_rpc_done_fn done = s->done;
        s->done = NULL;
        ms_finish(s, 0);
        done(&n->rt, s->done_arg, 0, m->data, m->len, NULL);
        msg_free(n, m);
        return;
    }
    if (s->pub.cbs.on_msg) s->pub.cbs.on_msg(&s->pub, s->pub.arg, m->data, m->len);
    if (!s->finished && s->conn) {
        s->rx_charged -= m->len;
        s->conn->rx_buffered -= m->len;
    }
    msg_free(n, m);
}

static void drain_cb(ap_node_t *n, void *arg, int status);

static void ms_drain(ap_mstream_t *s)
{
    while (s->rq && !s->paused && !s->finished) {
        ap_msg_t *m = s->rq;
        s->rq = m->next;
        if (!s->rq) s->rq_tail = NULL;
        s->rq_bytes -= m->len;
        ms_deliver(s, m);
    }
    ms_ack(s, true);
    ms_maybe_end(s);
}

/* Hello complete on an incoming stream: ask the listener. */
static void ms_accept(ap_mstream_t *s, ap_msg_t *hello)
{
    ap_node_t *n = s->node;
    ap_mconn_t *c = s->conn;
    const ap_rt_listener_t *l = ap__rt_find_listener(&n->rt, s->proto);
    if (!l) {
        send_reset(c, s->sid, AP_ENOPROTO, "no listener");
        ms_finish(s, AP_ENOPROTO);
        msg_free(n, hello);
        return;
    }
    s->pub.id = n->next_id++;
    ap_stream_accept_fn fn = l->fn;
    void *larg = l->arg;
    s->rx_charged -= hello->len;
    c->rx_buffered -= hello->len;
    s->accepting = true;
    int rc = fn(&n->rt, larg, &s->pub, &s->pub.peer, hello->data, hello->len);
    s->accepting = false;
    msg_free(n, hello);
    if (s->finished) return; /* reset inside accept */
    if (rc != 0) {
        send_reset(s->conn, s->sid, rc < 0 ? rc : AP_ERESET, "refused");
        ms_finish(s, AP_ERESET);
        return;
    }
    s->accepted = true;
    s->accepted_by_user = true;
    n->stats.streams_accepted++;
    s->rx_credit = s->rx_window;
    ctl_rc(s->conn, ap__frame_put_window(&s->conn->obuf, s->sid, true, s->rx_window));
    if (s->finished) return;
    ms_schedule(s);
    ms_try_close(s);
    if (s->rclosed && !s->finished) {
        /* the opener may have closed right after its hello */
        if (s->paused) return;
        ms_maybe_end(s);
    }
}

static void ms_serve(ap_mstream_t *s, ap_msg_t *req)
{
    ap_node_t *n = s->node;
    const ap_rt_handler_t *h = ap__rt_find_handler(&n->rt, s->proto);
    if (!h) {
        send_reset(s->conn, s->sid, AP_ENOPROTO, "no handler");
        ms_finish(s, AP_ENOPROTO);
        msg_free(n, req);
        return;
    }
    ap_uv_req_t *r = calloc(1, sizeof *r);
    if (!r) {
        send_reset(s->conn, s->sid, AP_ENOMEM, "out of memory");
        ms_finish(s, AP_ENOMEM);
        msg_free(n, req);
        return;
    }
    s->rx_charged -= req->len;
    s->conn->rx_buffered -= req->len;
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

void ap__mux_rpc_respond(ap_rpc_req_t *req, int err, const char *errmsg, const uint8_t *data,
                         size_t len)
{
    ap_uv_req_t *r = (ap_uv_req_t *)req;
    ap_mstream_t *s = r->s;
    ap_node_t *n = NODE(req->rt);
    req_unlink(n, r);
    /* data may point into the request itself: copy before freeing it */
    ap_msg_t *m = NULL;
    bool live = s && !s->finished && s->conn;
    if (live && !err && len <= UINT32_MAX) m = msg_new(n, data, len);
    msg_free(n, r->msg);
    free(r);
    if (!live) return;
    s->req = NULL;
    ap_mconn_t *c = s->conn;
    if (err) {
        send_reset(c, s->sid, err, errmsg);
        ms_finish(s, err);
        return;
    }
    if (!m) {
        send_reset(c, s->sid, AP_ENOMEM, "response not queued");
        ms_finish(s, AP_ENOMEM);
        return;
    }
    s->accepted = true;
    ctl_rc(c, ap__frame_put_window(&c->obuf, s->sid, true, 0));
    if (s->finished) {
        msg_free(n, m);
        return;
    }
    s->sq = s->sq_tail = m;
    s->sbuf = len;
    s->lclose = true;
    ms_schedule(s);
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

/* ---- frame handlers -------------------------------------------------------------------- */

#define PROTO_ERR(c, ...)                                                                          \
    do {                                                                                           \
        char why_[160];                                                                            \
        snprintf(why_, sizeof why_, __VA_ARGS__);                                                  \
        conn_fail(c, AP_EPROTO, why_);                                                             \
        return 1;                                                                                  \
    } while (0)

static bool remote_sid(const ap_mconn_t *c, uint32_t sid)
{
    return (sid & 1u) == (c->t && c->t->dialer ? 0u : 1u);
}

/* A frame for a stream we do not have: fine if the id was used before (the
 * stream ended while the frame was in flight), a violation otherwise. */
static bool stale_sid(const ap_mconn_t *c, uint32_t sid)
{
    return remote_sid(c, sid) ? sid <= c->last_remote_sid : sid < c->next_sid;
}

static int on_open(ap_mconn_t *c, const ap_frame_t *f)
{
    ap_node_t *n = c->node;
    uint32_t window;
    char proto[AP_RT_PROTO_MAX];
    if (ap__frame_parse_open(f, &window, proto, sizeof proto) < 0) PROTO_ERR(c, "malformed OPEN");
    if (!remote_sid(c, f->sid) || f->sid <= c->last_remote_sid)
        PROTO_ERR(c, "OPEN reuses or misnumbers stream %u", f->sid);
    c->last_remote_sid = f->sid;
    bool rpc = f->flags & AP_FRAME_F_RPC;
    if (c->goaway_rcvd) {
        /* the peer said it would open no more streams here */
        ap_debug("mux", "peer %s opened %s after its GOAWAY: refused", c->short_id, proto);
        c->node->stats.goaway_refused++;
        send_reset(c, f->sid, AP_ECLOSED, "connection going away");
        return 0;
    }
    if (c->nstreams >= AP_MUX_MAX_STREAMS) {
        /* one warning per connection; a flood of refusals stays quiet */
        if (!c->warned_streams)
            ap_warn("mux", "peer %s exceeds %d streams; refusing %s", c->short_id,
                    AP_MUX_MAX_STREAMS, proto);
        else
            ap_debug("mux", "peer %s: refusing %s (stream cap)", c->short_id, proto);
        c->warned_streams = true;
        send_reset(c, f->sid, AP_ELIMIT, "too many streams");
        return 0;
    }
    size_t max_msg, rxw, sendw = 0;
    if (rpc) {
        const ap_rt_handler_t *h = ap__rt_find_handler(&n->rt, proto);
        if (!h) {
            send_reset(c, f->sid, AP_ENOPROTO, "no handler");
            return 0;
        }
        max_msg = h->max_req;
        rxw = 0;
    } else {
        const ap_rt_listener_t *l = ap__rt_find_listener(&n->rt, proto);
        if (!l) {
            send_reset(c, f->sid, AP_ENOPROTO, "no listener");
            return 0;
        }
        max_msg = l->opts.max_msg;
        rxw = l->opts.window;
        sendw = l->opts.window;
    }
    ap_mstream_t *s = ms_new(n, rpc ? MS_SERVE : MS_STREAM);
    if (!s || ap__idmap_put(&c->streams, f->sid, s) < 0) {
        free(s);
        send_reset(c, f->sid, AP_ENOMEM, "out of memory");
        return 0;
    }
    c->nstreams++;
    s->conn = c;
    s->sid = f->sid;
    s->pub.peer = c->peer;
    s->pub.window = sendw;
    s->pub.max_msg = max_msg;
    s->rx_window = rxw > INT32_MAX ? INT32_MAX : (uint32_t)rxw;
    s->credit = window;
    s->peer_window = window;
    strcpy(s->proto, proto);
    return 0;
}

static int on_data(ap_mconn_t *c, const ap_frame_t *f)
{
    bool has_total;
    uint32_t total;
    const uint8_t *data;
    size_t nb;
    if (ap__frame_parse_data(f, &has_total, &total, &data, &nb) < 0) PROTO_ERR(c, "malformed DATA");
    /* connection-level credit covers every DATA byte */
    if ((int64_t)nb > c->rx_credit) PROTO_ERR(c, "connection window overflow");
    c->rx_credit -= (int64_t)nb;
    c->unacked += (uint32_t)nb;
    if (c->unacked >= AP_MUX_CONN_WINDOW / 4) {
        ctl_rc(c, ap__frame_put_window(&c->obuf, 0, false, c->unacked));
        if (c->state == MC_DEAD) return 1;
        c->credit_owed = true;
        c->rx_credit += c->unacked;
        c->unacked = 0;
    }
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "DATA on unknown stream %u", f->sid);
    }
    if (s->rclosed) PROTO_ERR(c, "DATA after CLOSE on stream %u", f->sid);
    if (s->opener && !s->accepted) PROTO_ERR(c, "DATA before ACCEPT on stream %u", f->sid);
    if (has_total) {
        if (s->rx_active) PROTO_ERR(c, "DATA START inside a message on stream %u", f->sid);
        bool exempt = !s->opener && !s->got_hello;
        if (total > s->pub.max_msg) {
            ap_info("mux", "peer %s sent a %u-byte message over the %zu cap on %s", c->short_id,
                    total, s->pub.max_msg, s->proto);
            send_reset(c, f->sid, AP_EMSGSIZE, "message too large");
            ms_finish(s, AP_EMSGSIZE);
            return c->state == MC_DEAD;
        }
        if (c->rx_buffered + total > AP_MUX_PEER_BUF_MAX) {
            ap_warn("mux", "peer %s exceeds the receive buffer cap; resetting stream", c->short_id);
            send_reset(c, f->sid, AP_ELIMIT, "receive buffer full");
            ms_finish(s, AP_ELIMIT);
            return c->state == MC_DEAD;
        }
        ap_msg_t *m = msg_alloc(c->node, total);
        if (!m) {
            send_reset(c, f->sid, AP_ENOMEM, "out of memory");
            ms_finish(s, AP_ENOMEM);
            return c->state == MC_DEAD;
        }
        m->len = total;
        s->rx = (uint8_t *)m;
        s->rx_total = total;
        s->rx_have = 0;
        s->rx_active = true;
        s->rx_exempt = exempt;
        s->rx_charged += total;
        c->rx_buffered += total;
    } else if (!s->rx_active) {
        PROTO_ERR(c, "DATA continuation without START on stream %u", f->sid);
    }
    if (nb > (size_t)(s->rx_total - s->rx_have)) PROTO_ERR(c, "DATA overruns its message");
    if (!s->rx_exempt) {
        if ((int64_t)nb > s->rx_credit) PROTO_ERR(c, "stream %u window overflow", f->sid);
        s->rx_credit -= (int64_t)nb;
        s->unacked += (uint32_t)nb;
    }
    ap_msg_t *m = (ap_msg_t *)s->rx;
    if (nb) memcpy(m->data + s->rx_have, data, nb);
    s->rx_have += (uint32_t)nb;
    if (s->rx_have < s->rx_total) {
        ms_ack(s, false);
        return c->state == MC_DEAD;
    }
    /* message complete */
    s->rx = NULL;
    s->rx_active = false;
    if (s->rx_exempt) {
        s->got_hello = true;
        if (s->kind == MS_SERVE)
            ms_serve(s, m);
        else
            ms_accept(s, m);
        return c->state == MC_DEAD;
    }
    if (s->paused || s->rq) {
        if (s->rq_tail)
            s->rq_tail->next = m;
        else
            s->rq = m;
        s->rq_tail = m;
        s->rq_bytes += m->len;
        return 0;
    }
    ms_deliver(s, m);
    if (c->state == MC_DEAD) return 1;
    if (!s->finished) {
        ms_ack(s, false);
        ms_maybe_end(s);
    }
    return c->state == MC_DEAD;
}

static int on_close_frame(ap_mconn_t *c, const ap_frame_t *f)
{
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "CLOSE on unknown stream %u", f->sid);
    }
    if (s->rclosed) PROTO_ERR(c, "second CLOSE on stream %u", f->sid);
    if (s->rx_active) PROTO_ERR(c, "CLOSE inside a message on stream %u", f->sid);
    if (s->opener && !s->accepted) PROTO_ERR(c, "CLOSE before ACCEPT on stream %u", f->sid);
    if (!s->opener && !s->got_hello) PROTO_ERR(c, "CLOSE before the first message");
    s->rclosed = true;
    if (s->kind == MS_STREAM && !s->accepted_by_user) return 0; /* accept() not run yet */
    ms_maybe_end(s);
    return c->state == MC_DEAD;
}

static int on_reset(ap_mconn_t *c, const ap_frame_t *f)
{
    int code;
    char msg[AP_FRAME_RESET_MSG_MAX + 1];
    if (ap__frame_parse_reset(f, &code, msg, sizeof msg) < 0) PROTO_ERR(c, "malformed RESET");
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "RESET on unknown stream %u", f->sid);
    }
    if (s->kind == MS_CALL) {
        snprintf(s->errmsg, sizeof s->errmsg, "%s", msg);
        s->has_errmsg = msg[0] != 0;
        ms_finish(s, code);
    } else {
        ms_finish(s, AP_ERESET);
    }
    return c->state == MC_DEAD;
}

static int on_window(ap_mconn_t *c, const ap_frame_t *f)
{
    uint32_t delta;
    if (ap__frame_parse_window(f, &delta) < 0) PROTO_ERR(c, "malformed WINDOW");
    if (f->sid == 0) {
        if (c->credit + delta > INT32_MAX) PROTO_ERR(c, "connection window overflow");
        c->credit += delta;
        want_flush(c);
        return 0;
    }
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "WINDOW on unknown stream %u", f->sid);
    }
    if (f->flags & AP_FRAME_F_ACCEPT) {
        if (!s->opener || s->accepted) PROTO_ERR(c, "unexpected ACCEPT on stream %u", f->sid);
        s->accepted = true;
        if (s->open_timer && s->kind == MS_STREAM) {
            ap_rt_timer_stop(&s->node->rt, s->open_timer);
            s->open_timer = 0;
        }
    } else if (!s->accepted && s->opener) {
        PROTO_ERR(c, "WINDOW before ACCEPT on stream %u", f->sid);
    }
    if (s->credit + delta > INT32_MAX) PROTO_ERR(c, "stream %u window overflow", f->sid);
    s->credit += delta;
    if (f->flags & AP_FRAME_F_ACCEPT) {
        s->peer_window = delta;
    } else {
        s->inflight -= delta < s->inflight ? delta : s->inflight;
        if (s->want_writable && !s->writable_queued && below_half(s)) {
            s->writable_queued = true;
            if (ap__node_defer(s->node, writable_cb, s, 0) < 0) s->writable_queued = false;
        }
    }
    ms_schedule(s);
    ms_try_close(s);
    return c->state == MC_DEAD;
}

static int on_goaway(ap_mconn_t *c)
{
    if (c->goaway_rcvd) PROTO_ERR(c, "second GOAWAY");
    c->goaway_rcvd = true;
    ap_debug("mux", "GOAWAY from %s (%u streams to drain)", c->short_id, c->nstreams);
    conn_goaway(c); /* answer it: we open nothing more here either */
    want_flush(c);  /* closes it if nothing is left */
    return c->state == MC_DEAD;
}

static int on_frame(void *arg, const ap_frame_t *f)
{
    ap_mconn_t *c = arg;
    if (c->state != MC_UP) return 1;
    switch (f->type) {
    case AP_FRAME_OPEN:
        return on_open(c, f);
    case AP_FRAME_DATA:
        return on_data(c, f);
    case AP_FRAME_CLOSE:
        return on_close_frame(c, f);
    case AP_FRAME_RESET:
        return on_reset(c, f);
    case AP_FRAME_WINDOW:
        return on_window(c, f);
    case AP_FRAME_GOAWAY:
        return on_goaway(c);
    default:
        PROTO_ERR(c, "unknown frame type %u", f->type);
    }
}

static void on_read(void *user, ap_conn_t *t, const uint8_t *p, size_t n)
{
    ap_mconn_t *c = user;
    (void)t;
    if (c->state != MC_UP) return;
    c->node->stats.bytes_received += n;
    int rc = ap__frame_dec_feed(c->dec, p, n, on_frame, c);
    if (rc < 0 && c->state != MC_DEAD) conn_fail(c, AP_EPROTO, "malformed frame header");
    /* Credit goes back now, not at the next flush: that runs a loop turn
     * later, after the transport has delivered everything it read in this
     * burst (up to a whole window), so the sender would idle until the
     * receiver had drained it all (stop-and-wait on the window; see
     * docs/runtime-uv.md, "Credit return"). The transport batches these small
     * writes with anything else written while it processes the read. */
    if (c->credit_owed) conn_write_obuf(c);
}

void ap__mux_feed(ap_mconn_t *c, const uint8_t *p, size_t n)
{
    on_read(c, c->t, p, n);
}

/* ---- public operations ------------------------------------------------------------------ */

static int ms_attach(ap_mstream_t *s, ap_mconn_t *c, bool rpc, const char *proto,
                     const uint8_t *first, size_t len)
{
    if (c->nstreams >= AP_MUX_MAX_STREAMS) return AP_ELIMIT;
    if (c->next_sid > UINT32_MAX - 2) return AP_ELIMIT; /* ids exhausted: a new connection is due */
    ap_msg_t *m = msg_new(s->node, first, len);
    if (!m) return AP_ENOMEM;
    uint32_t sid = c->next_sid;
    if (ap__idmap_put(&c->streams, sid, s) < 0) {
        msg_free(s->node, m);
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
    ctl_rc(c, ap__frame_put_open(&c->obuf, sid, rpc, s->rx_window, proto));
    ms_schedule(s);
    return 0;
}

static void call_timeout(ap_rt_t *rt, void *arg)
{
    ap_mstream_t *s = arg;
    (void)rt;
    s->open_timer = 0;
    if (s->conn) send_reset(s->conn, s->sid, AP_ETIMEDOUT, "deadline exceeded");
    ms_finish(s, AP_ETIMEDOUT);
}

uint64_t ap__mux_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                          const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                          ap_rpc_done_fn done, void *arg)
{
    ap_node_t *n = NODE(rt);
    if (atomic_load(&n->closing)) return 0;
    ap_mstream_t *s = ms_new(n, MS_CALL);
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
    int rc = len > UINT32_MAX ? AP_EMSGSIZE : get_conn(n, peer, &c);
    if (rc == 0) rc = ms_attach(s, c, true, proto, req, len);
    if (rc < 0) {
        ms_finish(s, rc == AP_ENOMEM ? AP_EUNREACH : rc);
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
    if (s->conn) send_reset(s->conn, s->sid, AP_ECANCELED, "canceled");
    ap_rpc_done_fn done = s->done;
    s->done = NULL;
    ms_finish(s, AP_ECANCELED);
    done(rt, s->done_arg, AP_ECANCELED, NULL, 0, NULL);
    return true;
}

static void open_timeout(ap_rt_t *rt, void *arg)
{
    ap_mstream_t *s = arg;
    (void)rt;
    s->open_timer = 0;
    if (s->conn) send_reset(s->conn, s->sid, AP_ETIMEDOUT, "open timed out");
    ms_finish(s, AP_ETIMEDOUT);
}

int ap__mux_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                        const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                        const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out)
{
    ap_node_t *n = NODE(rt);
    if (atomic_load(&n->closing)) return AP_ESHUTDOWN;
    if (len > UINT32_MAX) return AP_EMSGSIZE;
    ap_mstream_t *s = ms_new(n, MS_STREAM);
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
    int rc = get_conn(n, peer, &c);
    if (rc == 0) rc = ms_attach(s, c, false, proto, hello, len);
    if (rc < 0) {
        ms_finish(s, rc);
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
    ap_msg_t *m = msg_alloc(s->node, len);
    if (!m) return AP_ENOMEM;
    ap__iov_gather(m->data, iov, iovcnt);
    if (s->sq_tail)
        s->sq_tail->next = m;
    else
        s->sq = m;
    s->sq_tail = m;
    s->sbuf += len;
    ms_schedule(s);
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
    ms_try_close(s);
    return 0;
}

void ap__mux_stream_reset(ap_stream_t *ps, int err)
{
    ap_mstream_t *s = MS(ps);
    if (s->finished) return;
    int st = err < 0 ? err : AP_ERESET;
    if (s->conn) send_reset(s->conn, s->sid, st, "reset");
    ms_finish(s, st);
    /* The resetting side learns at once: on_close runs before this returns
     * (the memory is freed later, from the loop). */
    if (s->accepted_by_user && !s->close_fired) {
        s->close_fired = true;
        if (s->pub.cbs.on_close) s->pub.cbs.on_close(&s->pub, s->pub.arg, st);
    }
}
