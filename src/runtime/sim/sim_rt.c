/* The runtime operations (ap_rt_ops_t) of a simulated node. */
#include "runtime/sim/sim_impl.h"

#include "apiary/log.h"
#include "base/rcmgr.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int ap__sim_post(ap_sim_t *sim, uint32_t node, ap_post_fn fn, void *arg);
void ap__sim_on_req(ap_sim_t *sim, sim_node_t *n, uint32_t ci, uint32_t mi);
void ap__sim_on_resp(ap_sim_t *sim, uint32_t mi);
void ap__sim_on_open(ap_sim_t *sim, sim_node_t *n, uint32_t ci, uint32_t mi);
void ap__sim_on_dials_connected(ap_sim_t *sim, sim_node_t *n, uint32_t ci);

#define N(rt)   sim_node_of(rt)
#define SIM(rt) (sim_node_of(rt)->sim)

/* ---- time ----------------------------------------------------------------- */

static uint64_t op_now_us(ap_rt_t *rt)
{
    return SIM(rt)->now;
}

static int64_t op_wall_ms(ap_rt_t *rt)
{
    return SIM(rt)->epoch_ms + (int64_t)(SIM(rt)->now / 1000) + N(rt)->skew_ms;
}

/* ---- timers, post, work ------------------------------------------------------ */

static uint64_t op_timer_start(ap_rt_t *rt, uint64_t delay_us, uint64_t period_us, ap_timer_fn cb,
                               void *arg)
{
    sim_node_t *n = N(rt);
    ap_sim_t *sim = n->sim;
    if (!n->alive || !cb) return 0;
    uint32_t ti = ap__slab_alloc(&sim->timers);
    if (ti == SIM_NONE) return 0;
    sim_timer_t *t = slab_at(&sim->timers, ti);
    *t = (sim_timer_t){.node = n->idx, .inc = n->inc, .period = period_us, .cb = cb, .arg = arg};
    uint32_t gen = slab_gen(&sim->timers, ti);
    uint64_t at = sim->now + delay_us < sim->now ? UINT64_MAX : sim->now + delay_us;
    ap__sim_push(sim, at, EV_TIMER, ti, gen);
    return sim_mkid(ti, gen);
}

static bool op_timer_stop(ap_rt_t *rt, uint64_t id)
{
    ap_sim_t *sim = SIM(rt);
    uint32_t ti, gen;
    if (!sim_unid(id, &ti, &gen) || !slab_live(&sim->timers, ti, gen)) return false;
    sim_timer_t *t = slab_at(&sim->timers, ti);
    if (t->node != N(rt)->idx) return false;
    ap__slab_release(&sim->timers, ti);
    sim_stale(sim);
    return true;
}

static int op_post(ap_rt_t *rt, ap_post_fn fn, void *arg)
{
    if (!N(rt)->alive) return AP_ESHUTDOWN;
    if (!fn) return AP_EINVAL;
    return ap__sim_post(SIM(rt), N(rt)->idx, fn, arg);
}

static uint64_t compute_us(sim_node_t *n, double cost)
{
    double us = 0;
    if (n->cfn)
        us = n->cfn(n->carg, (int)n->idx, cost);
    else if (n->flops > 0)
        us = cost / n->flops * 1e6;
    if (!(us > 0)) return 0; /* also NaN */
    if (us > 1e15) return (uint64_t)1e15;
    return (uint64_t)ceil(us);
}

static int op_work(ap_rt_t *rt, double cost, ap_work_fn work, ap_after_work_fn after, void *arg)
{
    sim_node_t *n = N(rt);
    ap_sim_t *sim = n->sim;
    if (!n->alive) return AP_ESHUTDOWN;
    uint32_t wi = ap__slab_alloc(&sim->works);
    if (wi == SIM_NONE) return AP_ENOMEM;
    if (work) work(arg);
    /* One compute resource per node: jobs run one after another. */
    uint64_t start = n->busy_until > sim->now ? n->busy_until : sim->now;
    uint64_t done = start + compute_us(n, cost);
    n->busy_until = done;
    sim_work_t *w = slab_at(&sim->works, wi);
    w->node = n->idx;
    w->after = after;
    w->arg = arg;
    ap__list_push(&sim->works, offsetof(sim_work_t, prev), &n->works, wi);
    ap__sim_push(sim, done, EV_WORK, wi, slab_gen(&sim->works, wi));
    return 0;
}

/* ---- addresses ---------------------------------------------------------------- */

static int op_listen_addrs(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    if (max >= 1 && addrs) {
        char id[AP_PEER_ID_STR_MAX];
        if (with_id)
            snprintf(addrs[0], AP_RT_ADDR_MAX, "/sim/%u/p2p/%s", N(rt)->idx,
                     ap_peer_id_str(&rt->self, id));
        else
            snprintf(addrs[0], AP_RT_ADDR_MAX, "/sim/%u", N(rt)->idx);
    }
    return 1;
}

/* "/sim/<i>" or "/sim/<i>/p2p/<id>" */
static int parse_addr(const char *a, uint32_t *idx, ap_peer_id_t *id, bool *has_id)
{
    if (!a || strncmp(a, "/sim/", 5) != 0) return AP_EADDR;
    const char *p = a + 5;
    uint64_t v = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (uint64_t)(*p++ - '0');
        if (++digits > 9) return AP_EADDR;
    }
    if (!digits) return AP_EADDR;
    *idx = (uint32_t)v;
    *has_id = false;
    if (*p == 0) return 0;
    if (strncmp(p, "/p2p/", 5) != 0) return AP_EADDR;
    if (ap_peer_id_parse(id, p + 5) != 0) return AP_EADDR;
    *has_id = true;
    return 0;
}

static int op_add_addr(ap_rt_t *rt, const ap_peer_id_t *peer, const char *addr)
{
    uint32_t idx;
    ap_peer_id_t id;
    bool has;
    int rc = parse_addr(addr, &idx, &id, &has);
    if (rc != 0) return rc;
    if (has && peer && !ap_peer_id_eq(&id, peer)) return AP_EINVAL;
    /* Routing is by PeerID (global map); the address is only validated. */
    return 0;
}

/* ---- dial ---------------------------------------------------------------------- */

void ap__dial_complete(ap_sim_t *sim, uint32_t di, int status)
{
    sim_dial_t *d = slab_at(&sim->dials, di);
    sim_node_t *n = sim->nodes[d->node];
    ap_dial_fn cb = d->cb;
    void *arg = d->arg;
    uint32_t target = d->target;
    ap__conn_unhold(sim, d->conn, d->conn_gen);
    ap__list_remove(&sim->dials, offsetof(sim_dial_t, prev), &n->dials, di);
    ap__slab_release(&sim->dials, di);
    sim_stale(sim); /* its timeout */
    cb(&n->rt, arg, status, status == 0 ? &sim->nodes[target]->rt.self : NULL);
}

void ap__sim_on_dials_connected(ap_sim_t *sim, sim_node_t *n, uint32_t ci)
{
    uint32_t gen = slab_gen(&sim->conns, ci);
    for (uint32_t di = n->dials; di != SIM_NONE;) {
        sim_dial_t *d = slab_at(&sim->dials, di);
        uint32_t next = d->next;
        if (d->conn == ci && d->conn_gen == gen && d->status == 1) {
            const ap_peer_id_t *got = &sim->nodes[d->target]->rt.self;
            d->status = d->has_expect && !ap_peer_id_eq(&d->expect, got) ? AP_EAUTH : 0;
            ap__sim_push(sim, sim->now, EV_DIAL_DONE, di, slab_gen(&sim->dials, di));
        }
        di = next;
    }
}

static int op_dial(ap_rt_t *rt, const char *addr, uint64_t timeout_us, ap_dial_fn cb, void *arg)
{
    sim_node_t *n = N(rt);
    ap_sim_t *sim = n->sim;
    if (!n->alive) return AP_ESHUTDOWN;
    if (!cb) return AP_EINVAL;
    uint32_t idx;
    ap_peer_id_t id;
    bool has;
    int rc = parse_addr(addr, &idx, &id, &has);
    if (rc != 0) return rc;
    uint32_t di = ap__slab_alloc(&sim->dials);
    if (di == SIM_NONE) return AP_ENOMEM;
    sim_dial_t *d = slab_at(&sim->dials, di);
    uint32_t gen = slab_gen(&sim->dials, di);
    d->node = n->idx;
    d->cb = cb;
    d->arg = arg;
    d->target = idx;
    d->has_expect = has;
    d->expect = id;
    d->conn = SIM_NONE;
    d->status = 1; /* waiting */
    ap__list_push(&sim->dials, offsetof(sim_dial_t, prev), &n->dials, di);
    if (!timeout_us) timeout_us = 30u * 1000 * 1000;
    ap__sim_deadline(sim, timeout_us, EV_DIAL_TIMEOUT, di, gen);
    if (idx >= sim->nnodes || idx == n->idx) {
        d->status = AP_EUNREACH;
        ap__sim_push(sim, sim->now, EV_DIAL_DONE, di, gen);
        return 0;
    }
    uint32_t ci = ap__conn_get(sim, n->idx, idx);
    if (ci == SIM_NONE) {
        d->status = AP_ENOMEM;
        ap__sim_push(sim, sim->now, EV_DIAL_DONE, di, gen);
        return 0;
    }
    d = slab_at(&sim->dials, di);
    d->conn = ci;
    d->conn_gen = slab_gen(&sim->conns, ci);
    ap__conn_hold(sim, ci);
    sim_conn_t *c = slab_at(&sim->conns, ci);
    if (c->up[sim_side(c, n->idx)]) ap__sim_on_dials_connected(sim, n, ci);
    return 0;
}

static bool op_is_connected(ap_rt_t *rt, const ap_peer_id_t *peer)
{
    ap_sim_t *sim = SIM(rt);
    sim_node_t *n = N(rt);
    int p = ap__sim_lookup(sim, peer);
    if (p < 0 || !n->alive || (uint32_t)p == n->idx) return false;
    uint32_t a = n->idx, b = (uint32_t)p;
    uint64_t key = a < b ? ((uint64_t)a << 32) | b : ((uint64_t)b << 32) | a;
    uint32_t ci = ap__map_get(&sim->conn_map, key);
    if (ci == SIM_NONE) return false;
    sim_conn_t *c = slab_at(&sim->conns, ci);
    return c->up[sim_side(c, a)];
}

/* ---- RPC ------------------------------------------------------------------------ */

void ap__call_complete(ap_sim_t *sim, uint32_t ci, int status, const uint8_t *data, size_t len,
                       const char *errmsg)
{
    sim_call_t *c = slab_at(&sim->calls, ci);
    sim_node_t *n = sim->nodes[c->node];
    ap_rpc_done_fn done = c->done;
    void *arg = c->arg;
    ap__conn_unhold(sim, c->conn, c->conn_gen);
    ap__list_remove(&sim->calls, offsetof(sim_call_t, prev), &n->calls, ci);
    bool heap_deadline = c->heap_deadline;
    ap__slab_release(&sim->calls, ci);
    if (status != AP_ETIMEDOUT && heap_deadline) sim_stale(sim); /* its timeout */
    done(&n->rt, arg, status, data, len, errmsg);
}

static uint64_t op_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                            const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                            ap_rpc_done_fn done, void *arg)
{
    sim_node_t *n = N(rt);
    ap_sim_t *sim = n->sim;
    if (!n->alive) return 0;
    uint32_t ci = ap__slab_alloc(&sim->calls);
    if (ci == SIM_NONE) return 0;
    uint32_t gen = slab_gen(&sim->calls, ci);
    sim_call_t *c = slab_at(&sim->calls, ci);
    c->node = n->idx;
    c->done = done;
    c->arg = arg;
    c->max_resp = opts->max_resp;
    c->conn = SIM_NONE;
    ap__list_push(&sim->calls, offsetof(sim_call_t, prev), &n->calls, ci);
    bool in_heap = ap__sim_deadline(sim, opts->timeout_us, EV_CALL_TIMEOUT, ci, gen);
    c = slab_at(&sim->calls, ci);
    c->heap_deadline = in_heap;
    n->st.rpc_calls++;
    int p = peer ? ap__sim_lookup(sim, peer) : -1;
    int fail = 0;
    if (p < 0 || (uint32_t)p == n->idx)
        fail = AP_EUNREACH;
    else if (len > UINT32_MAX)
        fail = AP_EMSGSIZE;
    uint32_t conn = SIM_NONE, mi = SIM_NONE;
    if (!fail) {
        conn = ap__conn_get(sim, n->idx, (uint32_t)p);
        sim_msg_t *m = conn == SIM_NONE
                           ? NULL
                           : ap__msg_new(sim, M_REQ, proto, strlen(proto) + 1, req, len, &mi);
        if (!m) {
            fail = AP_ENOMEM;
        } else {
            m->src = ci;
            m->src_gen = gen;
        }
    }
    c = slab_at(&sim->calls, ci);
    if (fail) {
        c->status = fail;
        ap__sim_push(sim, sim->now, EV_CALL_FAIL, ci, gen);
        return sim_mkid(ci, gen);
    }
    c->peer = (uint32_t)p;
    c->conn = conn;
    c->conn_gen = slab_gen(&sim->conns, conn);
    ap__conn_hold(sim, conn);
    sim_conn_t *cn = slab_at(&sim->conns, conn);
    ap__conn_send(sim, conn, sim_side(cn, n->idx), mi);
    return sim_mkid(ci, gen);
}

static bool op_rpc_cancel(ap_rt_t *rt, uint64_t id)
{
    ap_sim_t *sim = SIM(rt);
    uint32_t ci, gen;
    if (!sim_unid(id, &ci, &gen) || !slab_live(&sim->calls, ci, gen)) return false;
    if (((sim_call_t *)slab_at(&sim->calls, ci))->node != N(rt)->idx) return false;
    ap__call_complete(sim, ci, AP_ECANCELED, NULL, 0, NULL);
    return true;
}

static void send_resp(ap_sim_t *sim, uint32_t conn, uint8_t side, uint32_t call, uint32_t call_gen,
                      int err, const char *errmsg, const uint8_t *data, size_t len)
{
    char em[128];
    size_t elen = 0;
    if (err && errmsg) {
        snprintf(em, sizeof em, "%s", errmsg);
        elen = strlen(em) + 1;
    }
    uint32_t mi;
    sim_msg_t *m = ap__msg_new(sim, M_RESP, em, elen, data, err ? 0 : len, &mi);
    if (!m) {
        ap_error("sim", "out of memory sending a response; the caller will time out");
        return;
    }
    m->dst = call;
    m->dst_gen = call_gen;
    m->status = err;
    ap__conn_send(sim, conn, side, mi);
}

void ap__sim_on_req(ap_sim_t *sim, sim_node_t *n, uint32_t ci, uint32_t mi)
{
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    const char *proto = (const char *)m->buf;
    uint8_t side = m->from ^ 1u;
    uint32_t call = m->src, call_gen = m->src_gen;
    const ap_rt_handler_t *h = ap__rt_find_handler(&n->rt, proto);
    int err = 0;
    if (!h)
        err = AP_ENOPROTO;
    else if (m->len > h->max_req)
        err = AP_EMSGSIZE;
    uint32_t ri = err ? SIM_NONE : ap__slab_alloc(&sim->reqs);
    if (!err && ri == SIM_NONE) err = AP_ENOMEM;
    if (err) {
        ap_debug("sim", "node %u: refusing request for %s: %s", n->idx, proto, ap_err_name(err));
        ap__msg_release(sim, mi);
        send_resp(sim, ci, side, call, call_gen, err, NULL, NULL, 0);
        return;
    }
    sim_conn_t *c = slab_at(&sim->conns, ci);
    sim_req_t *r = slab_at(&sim->reqs, ri);
    r->r.rt = &n->rt;
    r->r.peer = sim->nodes[c->node[side ^ 1]]->rt.self;
    r->r.data = m->buf + m->aux_len;
    r->r.len = m->len;
    r->r.resp_buf = NULL;
    r->r.resp_len = 0;
    r->self = ri;
    r->node = n->idx;
    r->inc = n->inc;
    r->conn = ci;
    r->conn_gen = slab_gen(&sim->conns, ci);
    ap__conn_hold(sim, ci);
    r->call = call;
    r->call_gen = call_gen;
    r->msg = mi;
    r->side = side;
    n->st.rpc_served++;
    ap_rpc_handler_fn fn = h->fn;
    void *harg = h->arg;
    fn(&n->rt, harg, &r->r);
}

static void op_rpc_respond(ap_rpc_req_t *req, int err, const char *errmsg, const uint8_t *data,
                           size_t len)
{
    sim_req_t *r = (sim_req_t *)req;
    sim_node_t *n = N(req->rt);
    ap_sim_t *sim = n->sim;
    if (n->alive && n->inc == r->inc && slab_live(&sim->conns, r->conn, r->conn_gen)) {
        if (!err && len > UINT32_MAX) err = AP_EMSGSIZE;
        send_resp(sim, r->conn, r->side, r->call, r->call_gen, err, errmsg, data, len);
    }
    ap__conn_unhold(sim, r->conn, r->conn_gen);
    ap__msg_release(sim, r->msg);
    ap__slab_release(&sim->reqs, r->self);
}

void ap__sim_on_resp(ap_sim_t *sim, uint32_t mi)
{
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    if (!slab_live(&sim->calls, m->dst, m->dst_gen)) return; /* cancelled or timed out */
    sim_call_t *c = slab_at(&sim->calls, m->dst);
    int st = m->status;
    if (st == 0 && m->len > c->max_resp) st = AP_EMSGSIZE;
    const char *em = (st && m->aux_len) ? (const char *)m->buf : NULL;
    ap__call_complete(sim, m->dst, st, st ? NULL : m->buf + m->aux_len, st ? 0 : m->len, em);
}

/* ---- streams -------------------------------------------------------------------- */

static inline sim_stream_t *st_of(ap_stream_t *s)
{
    return (sim_stream_t *)s;
}

/* Runs on_close (if the stream was ever visible to its node) and frees. */
void ap__stream_finish(ap_sim_t *sim, uint32_t si, int status)
{
    sim_stream_t *s = slab_at(&sim->streams, si);
    sim_node_t *n = sim->nodes[s->node];
    bool notify = s->visible;
    s->closed = true;
    if (!s->accepted) sim_stale(sim); /* open timeout */
    for (uint32_t mi = s->rq_head; mi != SIM_NONE;) {
        uint32_t next = ((sim_msg_t *)slab_at(&sim->msgs, mi))->next;
        ap__msg_release(sim, mi);
        mi = next;
    }
    s->rq_head = s->rq_tail = SIM_NONE;
    ap__conn_unhold(sim, s->conn, s->conn_gen);
    s->conn = SIM_NONE;
    ap__list_remove(&sim->streams, offsetof(sim_stream_t, prev), &n->streams, si);
    if (notify && s->s.cbs.on_close) s->s.cbs.on_close(&s->s, s->s.arg, status);
    ap__slab_release(&sim->streams, si);
}

static bool stream_conn_live(ap_sim_t *sim, const sim_stream_t *s)
{
    return s->conn != SIM_NONE && slab_live(&sim->conns, s->conn, s->conn_gen);
}

/* A control or data message of len bytes: the iovcnt pieces of iov (M_DATA;
 * else iov is NULL and nothing is copied). */
static int stream_send_ctl(ap_sim_t *sim, sim_stream_t *s, uint8_t kind, int status,
                           const ap_iovec_t *iov, int iovcnt, size_t len)
{
    if (!stream_conn_live(sim, s)) return AP_ECLOSED;
    uint32_t mi;
    sim_msg_t *m = ap__msg_new(sim, kind, NULL, 0, NULL, len, &mi);
    if (!m) return AP_ENOMEM;
    if (iov) ap__iov_gather(m->buf, iov, iovcnt);
    m->dst = s->peer_slot;
    m->dst_gen = s->peer_gen;
    m->src = s->self;
    m->src_gen = slab_gen(&sim->streams, s->self);
    m->status = status;
    if (kind == M_CREDIT) {
        m->len = len;
        ap__conn_send_ctrl(sim, s->conn, s->side, mi);
    } else {
        ap__conn_send(sim, s->conn, s->side, mi);
    }
    return 0;
}

void ap__stream_send_reset(ap_sim_t *sim, sim_stream_t *s, int status)
{
    stream_send_ctl(sim, s, M_RESET, status, NULL, 0, 0);
}

static void schedule_close(ap_sim_t *sim, sim_stream_t *s, int status)
{
    s->closed = true;
    s->close_status = status;
    ap__sim_push(sim, sim->now, EV_STREAM_CLOSE, s->self, slab_gen(&sim->streams, s->self));
}

static uint32_t stream_alloc(ap_sim_t *sim, sim_node_t *n)
{
    uint32_t si = ap__slab_alloc(&sim->streams);
    if (si == SIM_NONE) return SIM_NONE;
    sim_stream_t *s = slab_at(&sim->streams, si);
    s->self = si;
    s->node = n->idx;
    s->rq_head = s->rq_tail = SIM_NONE;
    s->conn = SIM_NONE;
    s->peer_slot = SIM_NONE;
    s->s.id = sim_mkid(si, slab_gen(&sim->streams, si));
    ap__list_push(&sim->streams, offsetof(sim_stream_t, prev), &n->streams, si);
    return si;
}

static void stream_release_silent(ap_sim_t *sim, uint32_t si)
{
    sim_stream_t *s = slab_at(&sim->streams, si);
    s->visible = false;
    s->accepted = true;
    ap__stream_finish(sim, si, 0);
}

static int op_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                          const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                          const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out)
{
    sim_node_t *n = N(rt);
    ap_sim_t *sim = n->sim;
    if (!n->alive) return AP_ESHUTDOWN;
    if (len > UINT32_MAX) return AP_EMSGSIZE;
    uint32_t ai = stream_alloc(sim, n);
    if (ai == SIM_NONE) return AP_ENOMEM;
    sim_stream_t *a = slab_at(&sim->streams, ai);
    a->s.rt = rt;
    a->s.peer = *peer;
    a->s.cbs = *cbs;
    a->s.arg = arg;
    a->s.window = opts->window;
    a->s.max_msg = opts->max_msg;
    a->visible = true;
    *out = &a->s;
    n->st.streams_opened++;
    uint32_t agen = slab_gen(&sim->streams, ai);
    ap__sim_deadline(sim, opts->open_timeout_us, EV_STREAM_TIMEOUT, ai, agen);
    int p = ap__sim_lookup(sim, peer);
    if (p < 0 || (uint32_t)p == n->idx) {
        schedule_close(sim, a, AP_EUNREACH);
        return 0;
    }
    uint32_t ci = ap__conn_get(sim, n->idx, (uint32_t)p);
    uint32_t bi = ci == SIM_NONE ? SIM_NONE : stream_alloc(sim, sim->nodes[p]);
    a = slab_at(&sim->streams, ai);
    if (bi == SIM_NONE) {
        schedule_close(sim, a, AP_ENOMEM);
        return 0;
    }
    sim_conn_t *c = slab_at(&sim->conns, ci);
    sim_stream_t *b = slab_at(&sim->streams, bi);
    uint32_t cgen = slab_gen(&sim->conns, ci);
    a->conn = b->conn = ci;
    a->conn_gen = b->conn_gen = cgen;
    ap__conn_hold(sim, ci);
    ap__conn_hold(sim, ci);
    a->side = sim_side(c, n->idx);
    b->side = a->side ^ 1u;
    a->peer_slot = bi;
    a->peer_gen = slab_gen(&sim->streams, bi);
    b->peer_slot = ai;
    b->peer_gen = agen;
    b->accepted = true; /* the acceptor has no open timeout */
    uint32_t mi;
    sim_msg_t *m = ap__msg_new(sim, M_OPEN, proto, strlen(proto) + 1, hello, len, &mi);
    if (!m) {
        stream_release_silent(sim, bi);
        a = slab_at(&sim->streams, ai);
        ap__conn_unhold(sim, a->conn, a->conn_gen);
        a->conn = SIM_NONE;
        schedule_close(sim, a, AP_ENOMEM);
        return 0;
    }
    m->dst = bi;
    m->dst_gen = a->peer_gen;
    m->src = ai;
    m->src_gen = agen;
    ap__conn_send(sim, ci, a->side, mi);
    return 0;
}

void ap__sim_on_open(ap_sim_t *sim, sim_node_t *n, uint32_t ci, uint32_t mi)
{
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    if (!slab_live(&sim->streams, m->dst, m->dst_gen)) return; /* opener gave up */
    uint32_t bi = m->dst;
    sim_stream_t *b = slab_at(&sim->streams, bi);
    const char *proto = (const char *)m->buf;
    const ap_rt_listener_t *l = ap__rt_find_listener(&n->rt, proto);
    int err = 0;
    if (!l)
        err = AP_ENOPROTO;
    else if (m->len > l->opts.max_msg)
        err = AP_EMSGSIZE;
    if (err) {
        ap_debug("sim", "node %u: refusing stream %s: %s", n->idx, proto, ap_err_name(err));
        stream_send_ctl(sim, b, M_REFUSE, err, NULL, 0, 0);
        stream_release_silent(sim, bi);
        return;
    }
    sim_conn_t *c = slab_at(&sim->conns, ci);
    b->s.rt = &n->rt;
    b->s.peer = sim->nodes[c->node[b->side ^ 1]]->rt.self;
    b->s.window = l->opts.window;
    b->s.max_msg = l->opts.max_msg;
    b->visible = true;
    n->st.streams_accepted++;
    /* ACCEPT goes first so that anything sent from inside accept follows it;
     * a refusal then travels as a reset (the opener sees AP_ERESET). */
    stream_send_ctl(sim, b, M_ACCEPT, 0, NULL, 0, 0);
    ap_stream_accept_fn fn = l->fn;
    void *larg = l->arg;
    uint32_t bgen = slab_gen(&sim->streams, bi);
    int rc = fn(&n->rt, larg, &b->s, &b->s.peer, m->buf + m->aux_len, m->len);
    if (rc != 0 && slab_live(&sim->streams, bi, bgen)) {
        b = slab_at(&sim->streams, bi);
        if (!b->closed) {
            n->st.streams_accepted--;
            stream_send_ctl(sim, b, M_RESET, AP_ERESET, NULL, 0, 0);
            stream_release_silent(sim, bi);
        }
    }
}

static void deliver_now(ap_sim_t *sim, uint32_t si, uint32_t mi)
{
    sim_stream_t *s = slab_at(&sim->streams, si);
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    if (m->kind == M_END) {
        ap__msg_release(sim, mi);
        ap__stream_on_end(sim, si);
        return;
    }
    uint64_t len = m->len;
    if (len > s->s.max_msg) {
        ap_warn("sim", "node %u: stream message of %llu bytes over the cap %zu; resetting", s->node,
                (unsigned long long)len, s->s.max_msg);
        ap__msg_release(sim, mi);
        ap__stream_send_reset(sim, s, AP_ERESET);
        ap__stream_finish(sim, si, AP_EMSGSIZE);
        return;
    }
    uint32_t gen = slab_gen(&sim->streams, si);
    if (s->s.cbs.on_msg) s->s.cbs.on_msg(&s->s, s->s.arg, m->buf + m->aux_len, (size_t)len);
    ap__msg_release(sim, mi);
    if (slab_live(&sim->streams, si, gen))
        stream_send_ctl(sim, slab_at(&sim->streams, si), M_CREDIT, 0, NULL, 0, (size_t)len);
}

void ap__stream_on_data(ap_sim_t *sim, uint32_t si, uint32_t mi)
{
    sim_stream_t *s = slab_at(&sim->streams, si);
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    if (s->closed || !s->visible) {
        ap__msg_release(sim, mi);
        return;
    }
    if (s->paused || s->rq_head != SIM_NONE) {
        m->next = SIM_NONE;
        if (s->rq_tail == SIM_NONE)
            s->rq_head = mi;
        else
            ((sim_msg_t *)slab_at(&sim->msgs, s->rq_tail))->next = mi;
        s->rq_tail = mi;
        return;
    }
    deliver_now(sim, si, mi);
}

void ap__stream_on_end(ap_sim_t *sim, uint32_t si)
{
    sim_stream_t *s = slab_at(&sim->streams, si);
    uint32_t gen = slab_gen(&sim->streams, si);
    s->remote_ended = true;
    if (s->s.cbs.on_end) s->s.cbs.on_end(&s->s, s->s.arg);
    if (!slab_live(&sim->streams, si, gen)) return;
    s = slab_at(&sim->streams, si);
    if (!s->closed && s->local_closed) ap__stream_finish(sim, si, 0);
}

void ap__stream_drain(ap_sim_t *sim, uint32_t si, uint32_t gen)
{
    ap__sim_trace(sim, EV_STREAM_DRAIN, ((sim_stream_t *)slab_at(&sim->streams, si))->node, 0);
    while (slab_live(&sim->streams, si, gen)) {
        sim_stream_t *s = slab_at(&sim->streams, si);
        if (s->paused || s->closed || s->rq_head == SIM_NONE) return;
        uint32_t mi = s->rq_head;
        sim_msg_t *m = slab_at(&sim->msgs, mi);
        s->rq_head = m->next;
        if (s->rq_head == SIM_NONE) s->rq_tail = SIM_NONE;
        deliver_now(sim, si, mi);
    }
}

static int op_stream_sendv(ap_stream_t *ps, const ap_iovec_t *iov, int iovcnt, size_t len)
{
    sim_stream_t *s = st_of(ps);
    ap_sim_t *sim = N(ps->rt)->sim;
    if (s->closed || s->local_closed || !N(ps->rt)->alive) return AP_ECLOSED;
    if (len > UINT32_MAX) return AP_EMSGSIZE;
    if (s->buffered > 0 && s->buffered + len > s->s.window) {
        s->want_writable = true;
        return AP_EAGAIN;
    }
    if (s->conn == SIM_NONE) return AP_ECLOSED;
    int rc = stream_send_ctl(sim, s, M_DATA, 0, iov, iovcnt, len);
    if (rc == 0) s->buffered += len;
    return rc;
}

static int op_stream_send(ap_stream_t *ps, const uint8_t *data, size_t len)
{
    ap_iovec_t one = {data, len};
    return op_stream_sendv(ps, &one, 1, len);
}

static size_t op_stream_buffered(const ap_stream_t *ps)
{
    return (size_t)((const sim_stream_t *)ps)->buffered;
}

static void op_stream_pause(ap_stream_t *ps, bool paused)
{
    sim_stream_t *s = st_of(ps);
    ap_sim_t *sim = N(ps->rt)->sim;
    bool was = s->paused;
    s->paused = paused;
    if (was && !paused && s->rq_head != SIM_NONE && !s->closed)
        ap__sim_push(sim, sim->now, EV_STREAM_DRAIN, s->self, slab_gen(&sim->streams, s->self));
}

static int op_stream_close(ap_stream_t *ps)
{
    sim_stream_t *s = st_of(ps);
    ap_sim_t *sim = N(ps->rt)->sim;
    if (s->closed) return AP_ECLOSED;
    if (s->local_closed) return 0;
    s->local_closed = true;
    s->want_writable = false;
    stream_send_ctl(sim, s, M_END, 0, NULL, 0, 0);
    if (s->remote_ended) schedule_close(sim, s, 0);
    return 0;
}

static void op_stream_reset(ap_stream_t *ps, int err)
{
    sim_stream_t *s = st_of(ps);
    ap_sim_t *sim = N(ps->rt)->sim;
    if (s->closed) return;
    ap__stream_send_reset(sim, s, AP_ERESET);
    /* The resetting side is closed at once: on_close runs before this returns. */
    ap__stream_finish(sim, s->self, err < 0 ? err : AP_ERESET);
}

static void op_get_stats(ap_rt_t *rt, ap_rt_stats_t *out)
{
    *out = N(rt)->st;
}

/* ---- memory held on a peer's account (runtime.h) -------------------------- */

void ap__sim_mem_reset(sim_node_t *n)
{
    ap_rcmgr_free(n->rc);
    n->rc = NULL;
    n->mem_held = 0;
}

static int op_mem_reserve(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes)
{
    sim_node_t *n = N(rt);
    if (!n->rc) {
        ap_rcmgr_config_t c = {
            .node = {n->mem_node, 0, 0}, .peer = {n->mem_peer, 0, 0}, .node_fair_share = true};
        if (!(n->rc = ap_rcmgr_new(&c))) return AP_ENOMEM;
    }
    ap_rc_span_t sp = {0};
    if (peer && !(sp.peer = ap_rcmgr_peer(n->rc, peer))) return AP_ENOMEM;
    int rc = ap_rc_reserve_mem(n->rc, &sp, bytes, NULL);
    ap_rc_scope_unref(sp.peer); /* a scope holding memory stays alive */
    if (rc == 0) n->mem_held += bytes;
    return rc;
}

static void op_mem_release(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes)
{
    sim_node_t *n = N(rt);
    if (!n->rc) return; /* reserved before a crash */
    ap_rc_span_t sp = {.peer = peer ? ap_rcmgr_peer(n->rc, peer) : NULL};
    ap_rc_release_mem(n->rc, &sp, bytes);
    ap_rc_scope_unref(sp.peer);
    n->mem_held -= bytes <= n->mem_held ? bytes : n->mem_held;
}

const ap_rt_ops_t ap__sim_ops = {
    .name = "sim",
    .now_us = op_now_us,
    .wall_ms = op_wall_ms,
    .timer_start = op_timer_start,
    .timer_stop = op_timer_stop,
    .post = op_post,
    .work = op_work,
    .listen_addrs = op_listen_addrs,
    .add_addr = op_add_addr,
    .dial = op_dial,
    .is_connected = op_is_connected,
    .rpc_call = op_rpc_call,
    .rpc_cancel = op_rpc_cancel,
    .rpc_respond = op_rpc_respond,
    .stream_open = op_stream_open,
    .stream_send = op_stream_send,
    .stream_sendv = op_stream_sendv,
    .stream_buffered = op_stream_buffered,
    .stream_pause = op_stream_pause,
    .stream_close = op_stream_close,
    .stream_reset = op_stream_reset,
    .get_stats = op_get_stats,
    .mem_reserve = op_mem_reserve,
    .mem_release = op_mem_release,
};
