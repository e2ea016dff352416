/* libuv driver, stream multiplexer: complete RPC requests wait here for their
 * handler. Each connection has a FIFO; the connections that have requests
 * waiting form a ring, and a pass serves one request of each in turn, at
 * most SERVE_BUDGET in all, then yields to the loop (I/O, timers, other
 * peers' handshakes) before the next pass. A peer that sends a thousand
 * requests in one read therefore delays another peer's request by at most
 * one request of its own per turn, not by a thousand handlers. A waiting
 * request stays counted in its stream's scopes. */
#include "runtime/uv/mux_impl.h"

#include "apiary/log.h"

#define SERVE_BUDGET 32

static void ring_push(ap_node_t *n, ap_mconn_t *c)
{
    c->serve_next = NULL;
    if (n->serve_ring_tail)
        n->serve_ring_tail->serve_next = c;
    else
        n->serve_ring = c;
    n->serve_ring_tail = c;
    c->in_serve_ring = true;
}

static void ring_remove(ap_node_t *n, ap_mconn_t *c)
{
    if (!c->in_serve_ring) return;
    ap_mconn_t *prev = NULL;
    for (ap_mconn_t *x = n->serve_ring; x; prev = x, x = x->serve_next) {
        if (x != c) continue;
        if (prev)
            prev->serve_next = x->serve_next;
        else
            n->serve_ring = x->serve_next;
        if (n->serve_ring_tail == x) n->serve_ring_tail = prev;
        break;
    }
    c->in_serve_ring = false;
    c->serve_next = NULL;
}

static void serve_pass(ap_node_t *n, void *arg, int status);

static void want_pass(ap_node_t *n)
{
    if (n->serve_pass_queued || !n->serve_ring) return;
    if (ap__node_defer(n, serve_pass, NULL, 0) == 0) n->serve_pass_queued = true;
}

/* The next waiting request of c's queue, taken off it. */
static ap_mstream_t *pop(ap_mconn_t *c)
{
    ap_mstream_t *s = c->serveq_head;
    if (!s) return NULL;
    c->serveq_head = s->serve_next;
    if (!c->serveq_head) c->serveq_tail = NULL;
    s->serve_next = NULL;
    s->in_serveq = false;
    return s;
}

static void serve_pass(ap_node_t *n, void *arg, int status)
{
    (void)arg;
    (void)status;
    n->serve_pass_queued = false;
    for (int k = 0; k < SERVE_BUDGET && n->serve_ring; k++) {
        ap_mconn_t *c = n->serve_ring;
        ring_remove(n, c);
        ap_mstream_t *s = pop(c);
        if (c->serveq_head) ring_push(n, c); /* its next one waits for the others */
        if (!s) continue;
        ap_msg_t *m = s->serve_msg;
        s->serve_msg = NULL;
        if (s->finished || !s->conn) {
            ap__mux_msg_free(n, m);
            continue;
        }
        ap__ms_serve_now(s, m);
    }
    want_pass(n);
}

void ap__ms_serve(ap_mstream_t *s, ap_msg_t *req)
{
    ap_mconn_t *c = s->conn;
    ap_node_t *n = s->node;
    if (!c) {
        ap__mux_msg_free(n, req);
        return;
    }
    s->serve_msg = req;
    s->serve_next = NULL;
    if (c->serveq_tail)
        c->serveq_tail->serve_next = s;
    else
        c->serveq_head = s;
    c->serveq_tail = s;
    s->in_serveq = true;
    if (!c->in_serve_ring) ring_push(n, c);
    want_pass(n);
}

void ap__ms_serve_unqueue(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    ap_node_t *n = s->node;
    s->in_serveq = false;
    ap__mux_msg_free(n, s->serve_msg);
    s->serve_msg = NULL;
    if (!c) return;
    ap_mstream_t *prev = NULL;
    for (ap_mstream_t *x = c->serveq_head; x; prev = x, x = x->serve_next) {
        if (x != s) continue;
        if (prev)
            prev->serve_next = x->serve_next;
        else
            c->serveq_head = x->serve_next;
        if (c->serveq_tail == x) c->serveq_tail = prev;
        break;
    }
    s->serve_next = NULL;
    if (!c->serveq_head) ring_remove(n, c);
}

void ap__mc_serve_drop(ap_mconn_t *c)
{
    ap_mstream_t *s;
    while ((s = pop(c))) {
        ap__mux_msg_free(c->node, s->serve_msg);
        s->serve_msg = NULL;
    }
    ring_remove(c->node, c);
}
