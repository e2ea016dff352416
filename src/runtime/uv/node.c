/* libuv driver: nodes (ap_rt_t) on a host — identity, timers, post, work,
 * deferred callbacks, teardown. The mux (mux_*.c) moves the bytes. */
#include "runtime/uv/uv_impl.h"

#include "runtime/uv/natmon.h"

#include "apiary/log.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

uint64_t ap__host_timer_start(ap_node_t *n, uint64_t delay_us, uint64_t period_us, ap_timer_fn cb,
                              void *arg);
bool ap__host_timer_stop(ap_node_t *n, uint64_t id);
void ap__host_drop_timers(ap_node_t *n);
void ap__host_drop_tasks(ap_node_t *n);

/* ---- time, timers ----------------------------------------------------------- */

static uint64_t uv_now_us(ap_rt_t *rt)
{
    return ap__host_now_us(((ap_node_t *)rt)->host);
}

static int64_t uv_wall_ms(ap_rt_t *rt)
{
    (void)rt;
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

static uint64_t uv_timer_start_op(ap_rt_t *rt, uint64_t delay_us, uint64_t period_us,
                                  ap_timer_fn cb, void *arg)
{
    return ap__host_timer_start((ap_node_t *)rt, delay_us, period_us, cb, arg);
}

static bool uv_timer_stop_op(ap_rt_t *rt, uint64_t id)
{
    return ap__host_timer_stop((ap_node_t *)rt, id);
}

/* ---- post ----------------------------------------------------------------------- */

typedef struct post_task {
    ap_task_t t;
    ap_post_fn fn;
    void *arg;
} post_task_t;

static void post_run(ap_task_t *t, bool discard)
{
    post_task_t *p = (post_task_t *)t;
    if (!discard) p->fn(&p->t.node->rt, p->arg);
    free(p);
}

static int uv_post(ap_rt_t *rt, ap_post_fn fn, void *arg)
{
    ap_node_t *n = (ap_node_t *)rt;
    if (!fn) return AP_EINVAL;
    if (atomic_load(&n->closing)) return AP_ESHUTDOWN;
    post_task_t *p = malloc(sizeof *p);
    if (!p) return AP_ENOMEM;
    p->t.run = post_run;
    p->t.node = n;
    p->fn = fn;
    p->arg = arg;
    int rc = ap__host_post(n->host, &p->t);
    if (rc < 0) free(p);
    return rc;
}

/* ---- work --------------------------------------------------------------------------- */

typedef struct ap_uv_work {
    uv_work_t req;
    ap_node_t *node; /* NULL once orphaned by ap_node_free */
    ap_host_t *host;
    ap_work_fn work;
    ap_after_work_fn after;
    void *arg;
    bool ran; /* work() returned (guarded by host->work_mu) */
    struct ap_uv_work *next, *prev;
} ap_uv_work_t;

static void work_cb(uv_work_t *req)
{
    ap_uv_work_t *w = req->data;
    w->work(w->arg);
    uv_mutex_lock(&w->host->work_mu);
    w->ran = true;
    uv_cond_broadcast(&w->host->work_cv);
    uv_mutex_unlock(&w->host->work_mu);
}

static void after_work_cb(uv_work_t *req, int status)
{
    ap_uv_work_t *w = req->data;
    ap_node_t *n = w->node;
    if (n) {
        if (w->prev)
            w->prev->next = w->next;
        else
            n->works = w->next;
        if (w->next) w->next->prev = w->prev;
        w->after(&n->rt, w->arg, status == UV_ECANCELED ? AP_ECANCELED : 0);
    }
    free(w);
}

static int uv_work_op(ap_rt_t *rt, double cost, ap_work_fn work, ap_after_work_fn after, void *arg)
{
    (void)cost;
    ap_node_t *n = (ap_node_t *)rt;
    if (!work || !after) return AP_EINVAL;
    if (atomic_load(&n->closing)) return AP_ESHUTDOWN;
    ap_uv_work_t *w = calloc(1, sizeof *w);
    if (!w) return AP_ENOMEM;
    w->req.data = w;
    w->node = n;
    w->host = n->host;
    w->work = work;
    w->after = after;
    w->arg = arg;
    int rc = uv_queue_work(&n->host->loop, &w->req, work_cb, after_work_cb);
    if (rc < 0) {
        free(w);
        return ap_err_from_errno(rc);
    }
    w->next = n->works;
    if (w->next) w->next->prev = w;
    n->works = w;
    return 0;
}

/* ---- deferred callbacks ---------------------------------------------------------------- */

int ap__node_defer(ap_node_t *n, void (*fn)(ap_node_t *, void *, int), void *arg, int status)
{
    ap_defer_t *d = malloc(sizeof *d);
    if (!d) return AP_ENOMEM;
    d->next = NULL;
    d->fn = fn;
    d->arg = arg;
    d->status = status;
    if (n->dq_tail)
        n->dq_tail->next = d;
    else
        n->dq = d;
    n->dq_tail = d;
    ap__host_kick(n->host);
    return 0;
}

bool ap__node_has_soon(const ap_node_t *n)
{
    return n->dq || n->flushq;
}

void ap__node_run_soon(ap_node_t *n)
{
    /* FIFO: a stream's on_close (queued when it finished) runs after every
     * callback queued for it before. Items queued while running wait. */
    ap_defer_t *d = n->dq;
    n->dq = n->dq_tail = NULL;
    while (d) {
        ap_defer_t *next = d->next;
        d->fn(n, d->arg, d->status);
        free(d);
        d = next;
    }
    while (n->flushq) {
        ap_mconn_t *c = n->flushq;
        n->flushq = c->flush_next;
        c->flush_queued = false;
        ap__mconn_flush(c);
    }
}

/* ---- addresses, stats ------------------------------------------------------------------- */

static int uv_listen_addrs(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    return ap__node_addrs((ap_node_t *)rt, addrs, max, with_id);
}

static void uv_get_stats(ap_rt_t *rt, ap_rt_stats_t *out)
{
    ap_node_t *n = (ap_node_t *)rt;
    *out = n->stats;
    out->connections = 0;
    for (ap_mconn_t *c = n->conns; c; c = c->next)
        if (c->state == MC_UP) out->connections++;
}

static const ap_rt_ops_t uv_ops = {
    .name = "uv",
    .now_us = uv_now_us,
    .wall_ms = uv_wall_ms,
    .timer_start = uv_timer_start_op,
    .timer_stop = uv_timer_stop_op,
    .post = uv_post,
    .work = uv_work_op,
    .listen_addrs = uv_listen_addrs,
    .add_addr = ap__mux_add_addr,
    .dial = ap__mux_dial,
    .is_connected = ap__mux_is_connected,
    .rpc_call = ap__mux_rpc_call,
    .rpc_cancel = ap__mux_rpc_cancel,
    .rpc_respond = ap__mux_rpc_respond,
    .rpc_respond_begin = ap__mux_rpc_respond_begin,
    .rpc_respond_commit = ap__mux_rpc_respond_commit,
    .stream_open = ap__mux_stream_open,
    .stream_send = ap__mux_stream_send,
    .stream_sendv = ap__mux_stream_sendv,
    .stream_buffered = ap__mux_stream_buffered,
    .stream_pause = ap__mux_stream_pause,
    .stream_close = ap__mux_stream_close,
    .stream_reset = ap__mux_stream_reset,
    .get_stats = uv_get_stats,
    .mem_reserve = ap__mux_mem_reserve,
    .mem_release = ap__mux_mem_release,
};

/* ---- transports ----------------------------------------------------------------------------- */

/* Every transport a node can run, tried in this order for an address. */
static const ap_uv_transport_t *const transports[] = {&ap__uv_mem_transport, &ap__uv_tcp_transport};

/* The entry that knows addr; parse's result in *rc (AP_EADDR: none does). */
static const ap_uv_transport_t *addr_transport(ap_node_t *n, const char *addr, bool *has_id,
                                               ap_peer_id_t *id, int *rc)
{
    *rc = AP_EADDR;
    if (!addr) return NULL;
    for (size_t i = 0; i < sizeof transports / sizeof transports[0]; i++) {
        *rc = transports[i]->parse(n, addr, has_id, id);
        if (*rc != AP_EADDR) return transports[i];
    }
    return NULL;
}

int ap__addr_parse(ap_node_t *n, const char *addr, bool *has_id, ap_peer_id_t *id)
{
    int rc;
    addr_transport(n, addr, has_id, id, &rc);
    return rc;
}

int ap__addr_dial(ap_node_t *n, const char *addr, ap_conn_t **out)
{
    bool has_id;
    ap_peer_id_t id;
    int rc;
    const ap_uv_transport_t *tp = addr_transport(n, addr, &has_id, &id, &rc);
    return rc < 0 ? rc : tp->dial(n, addr, out);
}

/* The transport a new node runs: the one its listen address names; without
 * one, in-process (the first entry), or TCP for a dial-only node. NULL if
 * none fits. */
static const ap_uv_transport_t *listen_transport(const ap_node_opts_t *o)
{
    if (o->dial_only) return o->listen ? NULL : &ap__uv_tcp_transport;
    if (!o->listen) return transports[0];
    bool has_id;
    ap_peer_id_t id;
    int rc;
    return addr_transport(NULL, o->listen, &has_id, &id, &rc);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */

static int node_new(ap_host_t *h, const ap_node_opts_t *opts, ap_rt_t **out)
{
    if (!h || !out) return AP_EINVAL;
    ap_node_opts_t o = {0};
    if (opts) o = *opts;
    ap_node_t *n = calloc(1, sizeof *n);
    if (!n) return AP_ENOMEM;
    if (sodium_init() < 0) {
        free(n);
        return AP_ESYS;
    }
    uint64_t seed = o.rng_seed;
    if (!seed) randombytes_buf(&seed, sizeof seed);
    int rc = o.ed25519_sk ? ap__rt_init_sk(&n->rt, &uv_ops, o.ed25519_sk, seed)
                          : ap__rt_init(&n->rt, &uv_ops, o.ed25519_seed, seed);
    if (rc < 0) {
        free(n);
        return rc;
    }
    n->host = h;
    n->next_id = 1;
    n->admission = o.admission;
    if (ap__mux_rc_init(n) < 0) {
        ap__rt_fini(&n->rt);
        free(n);
        return AP_ENOMEM;
    }
    const ap_uv_transport_t *tp = listen_transport(&o);
    n->hole_punch = o.nrelays > 0 && !o.no_hole_punch && !o.dial_only;
    if (!tp)
        rc = o.dial_only ? AP_EINVAL : AP_EADDR;
    else
        rc = tp->listen(n, o.listen);
    if (rc >= 0 && o.nannounce) {
        rc = ap__node_set_announce(n, o.announce, o.nannounce);
        if (rc < 0) tp->stop(n);
    }
    if (rc >= 0 && o.relay_service) {
        rc = tp == &ap__uv_tcp_transport ? ap__tcpc_serve_relay(n, &o.relay_limits) : AP_EINVAL;
        if (rc < 0) tp->stop(n);
    }
    if (rc >= 0 && (o.nrelays || (o.relay_bulk && tp == &ap__uv_tcp_transport))) {
        rc = tp == &ap__uv_tcp_transport ? ap__tcpc_use_relays(n, &o) : AP_EINVAL;
        if (rc < 0) tp->stop(n);
    }
    if (rc < 0) {
        ap__mux_rc_free(n);
        ap__rt_fini(&n->rt);
        free(n);
        return rc;
    }
    n->transport = tp;
    n->next = h->nodes;
    h->nodes = n;
    *out = &n->rt;
    ap_debug("uv", "node %s up at %s", n->rt.short_id, n->addr);
    return 0;
}

ap_host_t *ap_node_host(ap_rt_t *rt)
{
    return ((ap_node_t *)rt)->host;
}

static void node_free(ap_rt_t *rt)
{
    ap_node_t *n = (ap_node_t *)rt;
    ap_host_t *h = n->host;
    uv_mutex_lock(&h->mu);
    atomic_store(&n->closing, true);
    uv_mutex_unlock(&h->mu);
    ap__host_drop_tasks(n); /* posts dropped; call_sync waiters get AP_ESHUTDOWN */
    ap__host_drop_timers(n);
    ap__natmon_free(n);
    ap__mux_close_all(n);  /* conns drop; streams and calls finish (queued callbacks) */
    n->transport->stop(n); /* after the mux released its connections */
    /* Work: wait for what already runs, cancel the rest; after() gets ECANCELED. */
    while (n->works) {
        ap_uv_work_t *w = n->works;
        n->works = w->next;
        if (uv_cancel((uv_req_t *)&w->req) != 0) {
            uv_mutex_lock(&h->work_mu);
            while (!w->ran) uv_cond_wait(&h->work_cv, &h->work_mu);
            uv_mutex_unlock(&h->work_mu);
        }
        w->node = NULL; /* freed by after_work_cb, which the loop still runs */
        w->after(rt, w->arg, AP_ECANCELED);
    }
    /* Every owed callback runs now (they may queue more; new requests fail
     * with AP_ESHUTDOWN since closing is set). */
    while (n->dq || n->flushq) {
        n->flushq = NULL; /* connections are gone */
        ap__node_run_soon(n);
    }
    ap__host_drop_timers(n); /* callbacks above may not start timers, but be sure */
    ap__mux_free_reqs(n);
    ap__mux_free_cache(n);
    for (ap_node_t **pp = &h->nodes; *pp; pp = &(*pp)->next) {
        if (*pp == n) {
            *pp = n->next;
            h->nodes_gen++;
            break;
        }
    }
    ap__idmap_free(&n->calls);
    free(n->book);
    ap__mux_rc_free(n);
    ap_debug("uv", "node %s down", n->rt.short_id);
    ap__rt_fini(&n->rt);
    free(n);
}

typedef struct new_args {
    ap_host_t *h;
    const ap_node_opts_t *opts;
    ap_rt_t **out;
    int rc;
} new_args_t;

static void new_on_loop(void *arg)
{
    new_args_t *a = arg;
    a->rc = node_new(a->h, a->opts, a->out);
}

int ap_node_new(ap_host_t *h, const ap_node_opts_t *opts, ap_rt_t **out)
{
    if (!h || !out) return AP_EINVAL;
    new_args_t a = {h, opts, out, 0};
    int rc = ap__host_on_loop(h, new_on_loop, &a);
    return rc < 0 ? rc : a.rc;
}

static void free_on_loop(void *arg)
{
    node_free(arg);
}

void ap_node_free(ap_rt_t *rt)
{
    if (!rt) return;
    ap__natmon_unmap((ap_node_t *)rt); /* waits for the gateway here, not on the loop */
    ap__host_on_loop(((ap_node_t *)rt)->host, free_on_loop, rt);
}
