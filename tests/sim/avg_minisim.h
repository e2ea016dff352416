/* A minimal deterministic runtime driver for the averaging tests, used until
 * the project simulator (runtime/sim) lands on main. It implements the parts
 * of runtime.h the all-reduce uses (timers, streams with flow control, work)
 * on one virtual clock, behind the testbed interface (testbed.h), so the
 * tests switch to the real simulator by swapping the ops table.
 *
 * Link model: each node has an uplink (up bytes/s) and a downlink (down
 * bytes/s), each a FIFO serialiser; a message leaves the sender's uplink
 * after len/up, crosses a fixed latency, then takes len/down on the
 * receiver's downlink (store and forward). Crash: the node's streams close
 * with AP_ECLOSED at their peers after one latency; its timers die.
 *
 * Header-only, test-only: every function is static. */
#ifndef AP_AVG_MINISIM_H
#define AP_AVG_MINISIM_H

#include "runtime/rt_impl.h"
#include "testbed.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ms_world ms_world_t;
typedef struct ms_stream ms_stream_t;

typedef struct ms_node {
    struct ap_rt rt; /* first: ap_rt_t * casts to the node */
    ms_world_t *w;
    int idx;
    bool alive;
    double up, down;             /* bytes/s */
    uint64_t up_free, down_free; /* when the links are next idle */
    double up_busy_s, down_busy_s;
    uint64_t up_last_us, down_last_us; /* end of the last transfer */
} ms_node_t;

struct ms_stream {
    struct ap_stream base; /* first */
    ms_stream_t *other;
    ms_node_t *node;
    char proto[AP_RT_PROTO_MAX];
    bool opener, accepted, refused;
    bool sent_end, got_end, closed, finished, want_writable, paused;
    size_t buffered; /* sent, not yet consumed by the peer */
    /* messages that arrived while paused or before acceptance */
    struct ms_msg *inbox, *inbox_tail;
    ms_stream_t *all_next;
};

typedef struct ms_msg {
    struct ms_msg *next;
    size_t len;
    bool end;
    uint8_t data[];
} ms_msg_t;

enum {
    EV_DISCONNECT,
    EV_TIMER,
    EV_OPEN,
    EV_MSG,
    EV_RESET,
    EV_CLOSE,
    EV_WRITABLE,
    EV_CREDIT,
    EV_POST,
    EV_WORK
};

typedef struct ms_ev {
    uint64_t t, seq;
    int type;
    ms_node_t *node;
    ms_stream_t *s;
    ms_msg_t *msg;
    uint64_t id;
    int err;
    size_t len;
    void *fn, *arg;
    size_t wire;  /* bytes on the wire: first the event is the arrival at */
    bool arrived; /* the receiver's downlink, then the delivery after it */
} ms_ev_t;

typedef struct ms_timer {
    ms_node_t *node;
    uint64_t period;
    ap_timer_fn cb;
    void *arg;
    bool active;
} ms_timer_t;

struct ms_world {
    uint64_t now, seq;
    ms_ev_t *heap;
    size_t nheap, capheap;
    ms_timer_t *timers;
    size_t ntimers, captimers;
    ms_node_t **nodes;
    int n;
    uint64_t latency_us;
    ms_stream_t *all;
    uint64_t next_stream_id;
    /* ap_rt_post from other threads */
    pthread_mutex_t post_mu;
    struct ms_post *posts;
    uint64_t posts_run; /* posted functions that ran */
};

typedef struct ms_post {
    struct ms_post *next;
    ms_node_t *node;
    ap_post_fn fn;
    void *arg;
} ms_post_t;

static ms_world_t *ms_current; /* one world per test process */

static bool ev_less(const ms_ev_t *a, const ms_ev_t *b)
{
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static void ms_push(ms_world_t *w, ms_ev_t ev)
{
    if (w->nheap == w->capheap) {
        w->capheap = w->capheap ? w->capheap * 2 : 1024;
        w->heap = realloc(w->heap, w->capheap * sizeof *w->heap);
        if (!w->heap) abort();
    }
    ev.seq = w->seq++;
    size_t i = w->nheap++;
    while (i > 0 && ev_less(&ev, &w->heap[(i - 1) / 2])) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = ev;
}

static ms_ev_t ms_pop(ms_world_t *w)
{
    ms_ev_t top = w->heap[0], last = w->heap[--w->nheap];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= w->nheap) break;
        if (c + 1 < w->nheap && ev_less(&w->heap[c + 1], &w->heap[c])) c++;
        if (!ev_less(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (w->nheap) w->heap[i] = last;
    return top;
}

#define MS_NODE(rt)  ((ms_node_t *)(rt))
#define MS_STREAM(s) ((ms_stream_t *)(s))

static uint64_t ms_now(ap_rt_t *rt)
{
    return MS_NODE(rt)->w->now;
}
static int64_t ms_wall(ap_rt_t *rt)
{
    return 1700000000000ll + (int64_t)(MS_NODE(rt)->w->now / 1000);
}

static uint64_t ms_timer_start(ap_rt_t *rt, uint64_t delay, uint64_t period, ap_timer_fn cb,
                               void *arg)
{
    ms_world_t *w = MS_NODE(rt)->w;
    if (w->ntimers == w->captimers) {
        w->captimers = w->captimers ? w->captimers * 2 : 256;
        w->timers = realloc(w->timers, w->captimers * sizeof *w->timers);
        if (!w->timers) abort();
    }
    w->timers[w->ntimers] = (ms_timer_t){MS_NODE(rt), period, cb, arg, true};
    uint64_t id = ++w->ntimers;
    ms_push(w, (ms_ev_t){.t = w->now + delay, .type = EV_TIMER, .node = MS_NODE(rt), .id = id});
    return id;
}

static bool ms_timer_stop(ap_rt_t *rt, uint64_t id)
{
    ms_world_t *w = MS_NODE(rt)->w;
    if (id == 0 || id > w->ntimers || !w->timers[id - 1].active) return false;
    w->timers[id - 1].active = false;
    return true;
}

/* Any thread: queued under a lock, moved into the event heap by the loop. */
static int ms_post(ap_rt_t *rt, ap_post_fn fn, void *arg)
{
    ms_world_t *w = MS_NODE(rt)->w;
    ms_post_t *p = malloc(sizeof *p);
    if (!p) return AP_ENOMEM;
    p->node = MS_NODE(rt);
    p->fn = fn;
    p->arg = arg;
    pthread_mutex_lock(&w->post_mu);
    ms_post_t **tail = &w->posts;
    while (*tail) tail = &(*tail)->next;
    p->next = NULL;
    *tail = p;
    pthread_mutex_unlock(&w->post_mu);
    return 0;
}

static void ms_take_posts(ms_world_t *w)
{
    pthread_mutex_lock(&w->post_mu);
    ms_post_t *p = w->posts;
    w->posts = NULL;
    pthread_mutex_unlock(&w->post_mu);
    while (p) {
        ms_post_t *next = p->next;
        ms_push(
            w,
            (ms_ev_t){
                .t = w->now, .type = EV_POST, .node = p->node, .fn = (void *)p->fn, .arg = p->arg});
        free(p);
        p = next;
    }
}

typedef struct ms_work {
    ap_after_work_fn after;
    void *arg;
} ms_work_t;

static int ms_work(ap_rt_t *rt, double cost, ap_work_fn work, ap_after_work_fn after, void *arg)
{
    (void)cost;
    work(arg);
    ms_world_t *w = MS_NODE(rt)->w;
    ms_push(
        w, (ms_ev_t){
               .t = w->now, .type = EV_WORK, .node = MS_NODE(rt), .fn = (void *)after, .arg = arg});
    return 0;
}

static int ms_listen_addrs(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    (void)with_id;
    if (max > 0) snprintf(addrs[0], AP_RT_ADDR_MAX, "/sim/%d", MS_NODE(rt)->idx);
    return 1;
}
static int ms_add_addr(ap_rt_t *rt, const ap_peer_id_t *p, const char *a)
{
    (void)rt, (void)p, (void)a;
    return 0;
}
static int ms_dial(ap_rt_t *rt, const char *a, uint64_t t, ap_dial_fn cb, void *arg)
{
    (void)rt, (void)a, (void)t, (void)cb, (void)arg;
    return AP_ENOTSUP;
}
static bool ms_is_connected(ap_rt_t *rt, const ap_peer_id_t *p)
{
    (void)rt, (void)p;
    return true;
}
static uint64_t ms_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                            const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                            ap_rpc_done_fn done, void *arg)
{
    (void)rt, (void)peer, (void)proto, (void)req, (void)len, (void)opts, (void)done, (void)arg;
    return 0; /* not supported: "could not be queued" */
}
static bool ms_rpc_cancel(ap_rt_t *rt, uint64_t id)
{
    (void)rt, (void)id;
    return false;
}
static void ms_rpc_respond(ap_rpc_req_t *req, int err, const char *m, const uint8_t *d, size_t l)
{
    (void)req, (void)err, (void)m, (void)d, (void)l;
}

static ms_node_t *ms_find(ms_world_t *w, const ap_peer_id_t *id)
{
    for (int i = 0; i < w->n; i++)
        if (w->nodes[i] && w->nodes[i]->alive && ap_peer_id_eq(&w->nodes[i]->rt.self, id))
            return w->nodes[i];
    return NULL;
}

/* Time at which a message of len bytes from a reaches b's downlink: a's
 * uplink is a FIFO serialiser, then a fixed latency. The downlink is a FIFO
 * in arrival order (ms_dispatch queues the message there on arrival). */
static uint64_t ms_transfer(ms_world_t *w, ms_node_t *a, ms_node_t *b, size_t len)
{
    (void)b;
    uint64_t t = w->now > a->up_free ? w->now : a->up_free;
    t += (uint64_t)((double)len / a->up * 1e6);
    a->up_free = t;
    a->up_busy_s += (double)len / a->up;
    a->up_last_us = t;
    return t + w->latency_us;
}

static ms_stream_t *ms_new_stream(ms_world_t *w, ms_node_t *node, const ap_peer_id_t *peer,
                                  const char *proto, size_t window, size_t max_msg)
{
    ms_stream_t *s = calloc(1, sizeof *s);
    if (!s) abort();
    s->base.rt = &node->rt;
    s->base.peer = *peer;
    s->base.id = ++w->next_stream_id;
    s->base.window = window;
    s->base.max_msg = max_msg;
    s->node = node;
    snprintf(s->proto, sizeof s->proto, "%s", proto);
    s->all_next = w->all;
    w->all = s;
    return s;
}

static void ms_close_now(ms_stream_t *s, int status)
{
    if (s->finished) return;
    s->finished = s->closed = true;
    if (s->node->alive && s->base.cbs.on_close) s->base.cbs.on_close(&s->base, s->base.arg, status);
}

static int ms_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                          const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                          const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out)
{
    ms_node_t *a = MS_NODE(rt);
    ms_world_t *w = a->w;
    ms_stream_t *s = ms_new_stream(w, a, peer, proto, opts->window, opts->max_msg);
    s->opener = true;
    s->base.cbs = *cbs;
    s->base.arg = arg;
    ms_msg_t *m = malloc(sizeof *m + len);
    if (!m) abort();
    m->next = NULL;
    m->len = len;
    m->end = false;
    if (len) memcpy(m->data, hello, len);
    ms_node_t *b = ms_find(w, peer);
    uint64_t t = ms_transfer(w, a, b, len + 64);
    ms_push(w, (ms_ev_t){.t = t, .type = EV_OPEN, .node = b, .s = s, .msg = m, .wire = len + 64});
    *out = &s->base;
    return 0;
}

static void ms_deliver(ms_stream_t *r, ms_msg_t *m);

static int ms_stream_send(ap_stream_t *bs, const uint8_t *data, size_t len)
{
    ms_stream_t *s = MS_STREAM(bs);
    if (s->closed || s->sent_end) return AP_ECLOSED;
    if (s->buffered > 0 && s->buffered + len > s->base.window) {
        s->want_writable = true;
        return AP_EAGAIN;
    }
    ms_world_t *w = s->node->w;
    ms_msg_t *m = malloc(sizeof *m + len);
    if (!m) abort();
    m->next = NULL;
    m->len = len;
    m->end = false;
    memcpy(m->data, data, len);
    s->buffered += len;
    ms_node_t *b = s->other ? s->other->node : ms_find(w, &s->base.peer);
    if (s->other && !s->other->node->alive) b = NULL;
    uint64_t t = ms_transfer(w, s->node, b, len + 16);
    ms_push(w, (ms_ev_t){.t = t, .type = EV_MSG, .node = b, .s = s, .msg = m, .wire = len + 16});
    return 0;
}

static size_t ms_stream_buffered(const ap_stream_t *s)
{
    return MS_STREAM(s)->buffered;
}

static void ms_drain(ms_stream_t *r)
{
    while (r->inbox && !r->paused && !r->closed) {
        ms_msg_t *m = r->inbox;
        r->inbox = m->next;
        if (!r->inbox) r->inbox_tail = NULL;
        ms_deliver(r, m);
    }
}

static void ms_stream_pause(ap_stream_t *bs, bool paused)
{
    ms_stream_t *s = MS_STREAM(bs);
    s->paused = paused;
    if (!paused && s->inbox) {
        ms_world_t *w = s->node->w;
        ms_push(
            w, (ms_ev_t){
                   .t = w->now, .type = EV_MSG, .node = s->node, .s = NULL, .msg = NULL, .arg = s});
    }
}

static int ms_stream_close(ap_stream_t *bs)
{
    ms_stream_t *s = MS_STREAM(bs);
    if (s->closed || s->sent_end) return 0;
    s->sent_end = true;
    ms_world_t *w = s->node->w;
    ms_msg_t *m = calloc(1, sizeof *m);
    if (!m) abort();
    m->end = true;
    ms_node_t *b = s->other ? s->other->node : ms_find(w, &s->base.peer);
    uint64_t t = ms_transfer(w, s->node, b, 16);
    ms_push(w, (ms_ev_t){.t = t, .type = EV_MSG, .node = b, .s = s, .msg = m, .wire = 16});
    return 0;
}

static void ms_stream_reset(ap_stream_t *bs, int err)
{
    ms_stream_t *s = MS_STREAM(bs);
    if (s->closed) return;
    ms_world_t *w = s->node->w;
    ms_push(w, (ms_ev_t){.t = w->now, .type = EV_CLOSE, .node = s->node, .s = s, .err = err});
    s->sent_end = true;
    ms_push(w, (ms_ev_t){.t = w->now + w->latency_us, .type = EV_RESET, .s = s, .err = AP_ERESET});
    s->closed = true; /* no more callbacks except the scheduled on_close */
}

static void ms_get_stats(ap_rt_t *rt, ap_rt_stats_t *out)
{
    (void)rt;
    (void)out;
}

static const ap_rt_ops_t ms_ops = {
    .name = "minisim",
    .now_us = ms_now,
    .wall_ms = ms_wall,
    .timer_start = ms_timer_start,
    .timer_stop = ms_timer_stop,
    .post = ms_post,
    .work = ms_work,
    .listen_addrs = ms_listen_addrs,
    .add_addr = ms_add_addr,
    .dial = ms_dial,
    .is_connected = ms_is_connected,
    .rpc_call = ms_rpc_call,
    .rpc_cancel = ms_rpc_cancel,
    .rpc_respond = ms_rpc_respond,
    .stream_open = ms_stream_open,
    .stream_send = ms_stream_send,
    .stream_buffered = ms_stream_buffered,
    .stream_pause = ms_stream_pause,
    .stream_close = ms_stream_close,
    .stream_reset = ms_stream_reset,
    .get_stats = ms_get_stats,
};

/* Delivers one message (or the end marker) to receiving side r. */
static void ms_deliver(ms_stream_t *r, ms_msg_t *m)
{
    ms_world_t *w = r->node->w;
    ms_stream_t *snd = r->other;
    if (m->end) {
        r->got_end = true;
        if (r->base.cbs.on_end) r->base.cbs.on_end(&r->base, r->base.arg);
        if (!r->closed && r->got_end && r->sent_end && snd && snd->got_end) {
            ms_close_now(r, 0);
            ms_close_now(snd, 0);
        } else if (!r->closed && r->sent_end && snd && !snd->closed) {
            /* wait for our own end marker to arrive at the other side */
        }
        free(m);
        return;
    }
    if (m->len > r->base.max_msg) {
        free(m);
        ms_stream_reset(&r->base, AP_EMSGSIZE);
        return;
    }
    r->base.cbs.on_msg(&r->base, r->base.arg, m->data, m->len);
    /* credit back to the sender after on_msg returns */
    if (snd)
        ms_push(w,
                (ms_ev_t){.t = w->now + w->latency_us, .type = EV_CREDIT, .s = snd, .len = m->len});
    free(m);
}

static void ms_enqueue(ms_stream_t *r, ms_msg_t *m)
{
    m->next = NULL;
    if (r->inbox_tail)
        r->inbox_tail->next = m;
    else
        r->inbox = m;
    r->inbox_tail = m;
}

static void ms_dispatch(ms_world_t *w, ms_ev_t *ev)
{
    if (ev->wire && !ev->arrived && ev->node && ev->node->alive) {
        ms_node_t *b = ev->node;
        uint64_t t = w->now > b->down_free ? w->now : b->down_free;
        t += (uint64_t)((double)ev->wire / b->down * 1e6);
        b->down_free = t;
        b->down_busy_s += (double)ev->wire / b->down;
        b->down_last_us = t;
        ms_ev_t next = *ev;
        next.t = t;
        next.arrived = true;
        ms_push(w, next);
        return;
    }
    switch (ev->type) {
    case EV_TIMER: {
        ms_timer_t *tm = &w->timers[ev->id - 1];
        if (!tm->active || !tm->node->alive) return;
        if (tm->period) {
            ms_push(
                w, (ms_ev_t){
                       .t = w->now + tm->period, .type = EV_TIMER, .node = tm->node, .id = ev->id});
        } else {
            tm->active = false;
        }
        tm->cb(&tm->node->rt, tm->arg);
        return;
    }
    case EV_DISCONNECT:
        for (int i = 0; i < w->n; i++)
            if (w->nodes[i]->alive)
                ap__rt_peer_event(&w->nodes[i]->rt, &ev->node->rt.self, AP_PEER_DISCONNECTED);
        return;
    case EV_POST:
        w->posts_run++;
        if (ev->node->alive) ((ap_post_fn)ev->fn)(&ev->node->rt, ev->arg);
        return;
    case EV_WORK:
        if (ev->node->alive) ((ap_after_work_fn)ev->fn)(&ev->node->rt, ev->arg, 0);
        return;
    case EV_OPEN: {
        ms_stream_t *s = ev->s;
        ms_node_t *b = ev->node;
        ms_msg_t *m = ev->msg;
        if (s->closed || !s->node->alive) {
            free(m);
            return;
        }
        const ap_rt_listener_t *l = b && b->alive ? ap__rt_find_listener(&b->rt, s->proto) : NULL;
        if (!l) {
            free(m);
            s->refused = true;
            ms_push(w, (ms_ev_t){.t = w->now + w->latency_us,
                                 .type = EV_CLOSE,
                                 .node = s->node,
                                 .s = s,
                                 .err = b ? AP_ERESET : AP_EUNREACH});
            return;
        }
        ms_stream_t *r =
            ms_new_stream(w, b, &s->node->rt.self, s->proto, l->opts.window, l->opts.max_msg);
        r->other = s;
        s->other = r;
        int rc = l->fn(&b->rt, l->arg, &r->base, &s->node->rt.self, m->data, m->len);
        free(m);
        if (rc) {
            r->closed = r->finished = true;
            s->refused = true;
            ms_push(w, (ms_ev_t){.t = w->now + w->latency_us,
                                 .type = EV_CLOSE,
                                 .node = s->node,
                                 .s = s,
                                 .err = AP_ERESET});
            return;
        }
        r->accepted = s->accepted = true;
        ms_drain(r);
        return;
    }
    case EV_MSG: {
        if (!ev->s && ev->arg) { /* unpause */
            ms_drain((ms_stream_t *)ev->arg);
            return;
        }
        ms_stream_t *s = ev->s;
        ms_stream_t *r = s->other;
        if (!r || r->closed || !r->node->alive || !r->accepted) {
            /* opener's messages before acceptance wait in the peer's inbox */
            if (r && !r->closed && r->node->alive && !r->accepted)
                ms_enqueue(r, ev->msg);
            else
                free(ev->msg);
            return;
        }
        if (r->paused || r->inbox) {
            ms_enqueue(r, ev->msg);
            return;
        }
        ms_deliver(r, ev->msg);
        return;
    }
    case EV_CREDIT: {
        ms_stream_t *s = ev->s;
        s->buffered -= ev->len < s->buffered ? ev->len : s->buffered;
        if (!s->closed && s->want_writable && s->buffered <= s->base.window / 2 && s->node->alive) {
            s->want_writable = false;
            if (s->base.cbs.on_writable) s->base.cbs.on_writable(&s->base, s->base.arg);
        }
        return;
    }
    case EV_RESET: {
        ms_stream_t *r = ev->s->other;
        if (r && r->node->alive) ms_close_now(r, ev->err);
        return;
    }
    case EV_CLOSE:
        ms_close_now(ev->s, ev->err);
        return;
    }
}

/* Messages that arrive at a peer that never accepted (the opener's data
 * queued before the hello was processed) are covered by ms_enqueue; an
 * opener whose peer is unknown gets AP_EUNREACH. */

/* ---- testbed ops ---------------------------------------------------------------- */

static ap_testbed_t *ms_create(int n, uint64_t seed)
{
    ms_world_t *w = calloc(1, sizeof *w);
    w->nodes = calloc((size_t)n, sizeof *w->nodes);
    w->n = n;
    w->latency_us = 1000;
    pthread_mutex_init(&w->post_mu, NULL);
    for (int i = 0; i < n; i++) {
        ms_node_t *nd = calloc(1, sizeof *nd);
        uint8_t key[32] = {0};
        memcpy(key, &i, sizeof i);
        memcpy(key + 8, &seed, sizeof seed);
        ap__rt_init(&nd->rt, &ms_ops, key, seed * 1000003u + (uint64_t)i);
        nd->w = w;
        nd->idx = i;
        nd->alive = true;
        nd->up = nd->down = 125e6; /* 1 Gbit/s */
        w->nodes[i] = nd;
    }
    ms_current = w;
    return (ap_testbed_t *)w;
}

static void ms_destroy(ap_testbed_t *tb)
{
    ms_world_t *w = (ms_world_t *)tb;
    while (w->nheap) {
        ms_ev_t ev = ms_pop(w);
        if (ev.msg) free(ev.msg);
    }
    while (w->all) {
        ms_stream_t *s = w->all;
        w->all = s->all_next;
        while (s->inbox) {
            ms_msg_t *m = s->inbox;
            s->inbox = m->next;
            free(m);
        }
        free(s);
    }
    for (int i = 0; i < w->n; i++) {
        if (w->nodes[i]->alive) ap__rt_fini(&w->nodes[i]->rt);
        free(w->nodes[i]);
    }
    free(w->nodes);
    free(w->timers);
    ms_take_posts(w);
    while (w->nheap) {
        ms_ev_t ev = ms_pop(w);
        if (ev.msg) free(ev.msg);
    }
    free(w->heap);
    pthread_mutex_destroy(&w->post_mu);
    free(w);
    ms_current = NULL;
}

static ap_rt_t *ms_node_rt(ap_testbed_t *tb, int i)
{
    ms_world_t *w = (ms_world_t *)tb;
    return w->nodes[i]->alive ? &w->nodes[i]->rt : NULL;
}

static bool ms_run_until(ap_testbed_t *tb, ap_tb_pred_fn pred, void *arg, uint64_t timeout_us)
{
    ms_world_t *w = (ms_world_t *)tb;
    uint64_t end = w->now + timeout_us;
    if (pred && pred(arg)) return true;
    for (;;) {
        ms_take_posts(w);
        if (!w->nheap || w->heap[0].t > end) break;
        ms_ev_t ev = ms_pop(w);
        w->now = ev.t;
        ms_dispatch(w, &ev);
        if (pred && pred(arg)) return true;
    }
    w->now = end;
    return pred ? pred(arg) : false;
}

static void ms_crash(ap_testbed_t *tb, int i)
{
    ms_world_t *w = (ms_world_t *)tb;
    ms_node_t *nd = w->nodes[i];
    if (!nd->alive) return;
    nd->alive = false;
    for (ms_stream_t *s = w->all; s; s = s->all_next) {
        if (s->node != nd) continue;
        s->closed = s->finished = true;
        ms_stream_t *o = s->other;
        if (o && !o->finished)
            ms_push(w, (ms_ev_t){.t = w->now + w->latency_us,
                                 .type = EV_CLOSE,
                                 .node = o->node,
                                 .s = o,
                                 .err = AP_ECLOSED});
        if (!o && s->opener) s->refused = true;
    }
    /* openers elsewhere whose EV_OPEN to this node is still in flight get
     * refused in EV_OPEN (the node is not alive); everyone sees the
     * connection drop one latency later */
    ms_push(w, (ms_ev_t){.t = w->now + w->latency_us, .type = EV_DISCONNECT, .node = nd});
    ap__rt_fini(&nd->rt);
}

static void ms_restart(ap_testbed_t *tb, int i)
{
    (void)tb;
    (void)i; /* not needed by the averaging tests */
}

static const ap_testbed_ops_t ms_testbed = {
    .name = "minisim",
    .create = ms_create,
    .destroy = ms_destroy,
    .node = ms_node_rt,
    .run_until = ms_run_until,
    .crash = ms_crash,
    .restart = ms_restart,
    .virtual_time = true,
};

static inline void ms_set_bw(ap_testbed_t *tb, int i, double up, double down)
{
    ms_world_t *w = (ms_world_t *)tb;
    w->nodes[i]->up = up;
    w->nodes[i]->down = down;
}

#endif
