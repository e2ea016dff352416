/* libuv driver, stream multiplexer: connections (one per peer, duplicates
 * resolved, GOAWAY and draining), the address book and dialing.
 * Frame format and connection rules: docs/protocol.md. */
#include "runtime/uv/mux_impl.h"

#include "apiary/log.h"
#include "apiary/multiaddr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- small helpers ---------------------------------------------------------- */

void ap__mconn_want_flush(ap_mconn_t *c)
{
    if (c->flush_queued || c->state == MC_DEAD) return;
    c->flush_queued = true;
    c->flush_next = c->node->flushq;
    c->node->flushq = c;
    ap__host_kick(c->node->host);
}

void ap__mconn_ctl_rc(ap_mconn_t *c, int rc)
{
    if (rc < 0)
        ap__mconn_fail(c, AP_ENOMEM, "out of memory queueing a frame");
    else
        ap__mconn_want_flush(c);
}

void ap__mconn_send_reset(ap_mconn_t *c, uint32_t sid, int code, const char *msg)
{
    if (c && c->state != MC_DEAD)
        ap__mconn_ctl_rc(c, ap__frame_put_reset(&c->obuf, sid, code, msg));
}

/* ---- connections -------------------------------------------------------------- */

static bool conn_up_to(ap_node_t *n, const ap_peer_id_t *peer, const ap_mconn_t *except)
{
    for (ap_mconn_t *c = n->conns; c; c = c->next)
        if (c != except && c->state == MC_UP && ap_peer_id_eq(&c->peer, peer)) return true;
    return false;
}

bool ap__node_knows(const ap_node_t *n, const ap_peer_id_t *peer)
{
    for (size_t i = 0; i < n->nbook; i++)
        if (ap_peer_id_eq(&n->book[i].peer, peer)) return true;
    return false;
}

/* The connection new streams to peer go on: a direct one up, else a
 * relayed one up, else one being dialled. */
static ap_mconn_t *find_conn(ap_node_t *n, const ap_peer_id_t *peer)
{
    ap_mconn_t *dialing = NULL, *relayed = NULL;
    for (ap_mconn_t *c = n->conns; c; c = c->next) {
        if (!c->known_peer || !ap_peer_id_eq(&c->peer, peer)) continue;
        if (c->goaway_sent || c->goaway_rcvd) continue; /* draining: no new streams */
        if (c->state == MC_UP && !(c->t && c->t->relayed)) return c;
        if (c->state == MC_UP && !relayed) relayed = c;
        if (c->state == MC_DIALING && !dialing) dialing = c;
    }
    return relayed ? relayed : dialing;
}

static void on_up(void *user, ap_conn_t *t, const ap_peer_id_t *remote);
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
    ap__mconn_fail(c, AP_ECLOSED, NULL);
}

/* Stops opening streams on c: sends GOAWAY (once). Streams already on c run
 * to their end; c is closed once both sides sent GOAWAY and no stream is
 * left (ap__mconn_flush), or after AP_MUX_DRAIN_US. */
void ap__mconn_goaway(ap_mconn_t *c)
{
    if (c->goaway_sent || c->state != MC_UP) return;
    c->goaway_sent = true;
    ap_debug("mux", "GOAWAY on a connection to %s (%u streams to drain)", c->short_id, c->nstreams);
    c->drain_timer = ap_rt_timer_start(&c->node->rt, AP_MUX_DRAIN_US, 0, drain_timeout, c);
    ap__mconn_ctl_rc(c, ap__frame_put_goaway(&c->obuf));
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
        if (o->t->relayed != c->t->relayed) /* a direct connection replaces a relayed one */
            loser = o->t->relayed ? o : c;
        else if (o->t->dialer != c->t->dialer)
            loser = dialled_by_smaller(c) ? o : c;
        else if (c->t->dialer)
            loser = c;
        else
            continue;
        n->stats.goaways++;
        ap__mconn_goaway(loser);
        if (loser == c) return;
    }
}

static void conn_became_up(ap_mconn_t *c)
{
    ap_node_t *n = c->node;
    if (ap__mc_rc_up(c) < 0) {
        c->book_next = -1; /* no other address: it is the peer that is over its limit */
        ap__mconn_fail(c, AP_ELIMIT, NULL); /* the WARN is written */
        return;
    }
    c->state = MC_UP;
    bool first = !conn_up_to(n, &c->peer, c);
    ap_debug("mux", "connection to %s up", c->short_id);
    ap__mconn_want_flush(c);
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
    c->rc_conn = ap_rcmgr_conn(n->rc); /* NULL on out of memory: counted in the others only */
    t->user = c;
    t->cbs = (ap_conn_cbs_t){
        .on_up = on_up, .on_read = ap__mconn_on_read, .on_drain = on_drain, .on_close = on_close};
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

/* The order in which b's addresses are dialled: direct ones first, newest
 * first, then circuit addresses (through a relay), newest first. Writes
 * indices into order; returns how many. */
static int book_order(const ap_book_t *b, int order[AP_NODE_MAX_ADDRS])
{
    int k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = b->n - 1; i >= 0; i--)
            if ((strstr(b->addrs[i], "/p2p-circuit") != NULL) == (pass == 1)) order[k++] = i;
    return k;
}

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
    int order[AP_NODE_MAX_ADDRS];
    int no = book_order(b, order);
    for (int k = c->book_next; k < no; k++) {
        ap_conn_t *t;
        const char *addr = b->addrs[order[k]];
        if (ap__addr_dial(n, addr, &t) < 0) continue;
        ap_debug("mux", "dial to %s failed (%s): trying %s", c->short_id, ap_err_name(status),
                 addr);
        c->t->vt->close(c->t);
        c->t = t;
        c->next_sid = t->dialer ? 1 : 2;
        t->user = c;
        t->cbs = (ap_conn_cbs_t){.on_up = on_up,
                                 .on_read = ap__mconn_on_read,
                                 .on_drain = on_drain,
                                 .on_close = on_close};
        c->book_next = k + 1;
        if (c->dial_timer) ap_rt_timer_stop(&n->rt, c->dial_timer);
        c->dial_timer = ap_rt_timer_start(&n->rt, AP_MUX_DIAL_TIMEOUT_US, 0, dial_timeout, c);
        return true;
    }
    return false;
}

void ap__mconn_fail(ap_mconn_t *c, int status, const char *why)
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
    ap__mc_serve_drop(c);
    /* Every stream and call on it finishes (callbacks are queued, FIFO). */
    ap_mstream_t *s;
    for (size_t pos = 0; (s = ap__idmap_next(&c->streams, &pos));) {
        int sst = st;
        if (closing && s->kind == MS_CALL) sst = AP_ECANCELED;
        s->conn = NULL; /* detached below */
        ap__ms_finish(s, sst);
    }
    ap__idmap_free(&c->streams);
    c->nstreams = 0;
    ap__mc_rc_down(c);
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
    while (n->conns) ap__mconn_fail(n->conns, AP_ECLOSED, NULL);
}

static void dial_timeout(ap_rt_t *rt, void *arg)
{
    ap_mconn_t *c = arg;
    (void)rt;
    c->dial_timer = 0;
    ap__mconn_fail(c, AP_EUNREACH, NULL);
}

static void on_up(void *user, ap_conn_t *t, const ap_peer_id_t *remote)
{
    ap_mconn_t *c = user;
    (void)t;
    if (c->state != MC_DIALING) return;
    if (c->known_peer && !ap_peer_id_eq(&c->peer, remote)) {
        char got[AP_PEER_SHORT_LEN];
        ap_warn("mux", "dialed %s but reached %s", c->short_id, ap_peer_id_short(remote, got));
        ap__mconn_fail(c, AP_EAUTH, NULL);
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
    ap__mconn_want_flush(c);
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
        ap__mconn_fail(c, AP_ENOMEM, NULL);
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
    ap__mconn_fail(c, AP_EEXIST, NULL); /* nothing left on it: just released */
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
            ap__ms_finish(s, rc == AP_ENOMEM ? AP_EUNREACH : rc);
            continue;
        }
        up->next_sid += 2;
        up->nstreams++;
        s->conn = up;
        s->sid = sid;
        ap__mconn_ctl_rc(
            up, ap__frame_put_open(&up->obuf, sid, s->kind == MS_CALL, s->rx_window, s->proto));
        ap__ms_schedule(s);
    }
    free(v);
    ap__mconn_want_flush(up);
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
    ap__mconn_fail(c, status, NULL);
}

/* Dials peer if no connection exists. */
int ap__mconn_get(ap_node_t *n, const ap_peer_id_t *peer, ap_mconn_t **out)
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
        int order[AP_NODE_MAX_ADDRS];
        int no = book_order(b, order);
        for (int k = 0; k < no; k++) {
            ap_conn_t *t;
            if (ap__addr_dial(n, b->addrs[order[k]], &t) < 0) continue;
            c = ap__mconn_new(n, t, false);
            if (!c) {
                t->vt->close(t);
                return AP_ENOMEM;
            }
            conn_set_peer(c, peer);
            c->book_next = k + 1;
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
    char full[AP_RT_ADDR_MAX];
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) == 0 && ma.circuit && !ma.has_dst) {
        /* a circuit address as its owner announces it: through the relay to peer */
        ma.has_dst = true;
        ma.dst = *peer;
        if (ap_multiaddr_print(&ma, full, sizeof full) < 0) return AP_EADDR;
        addr = full;
    }
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
