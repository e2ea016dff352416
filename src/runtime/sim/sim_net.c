/* Simulated network: messages, connections (handshake, teardown), and the
 * bandwidth model (flows sharing link / upload / download capacity). */
#include "runtime/sim/sim_impl.h"

#include "apiary/log.h"

#include <stdlib.h>
#include <string.h>

/* ---- message buffers ------------------------------------------------------- */

static int size_class(size_t n)
{
    int c = BUF_MIN_CLASS;
    while (((size_t)1 << c) < n) c++;
    return c;
}

sim_msg_t *ap__msg_new(ap_sim_t *sim, uint8_t kind, const void *aux, size_t aux_len,
                       const void *data, size_t len, uint32_t *idx_out)
{
    uint32_t mi = ap__slab_alloc(&sim->msgs);
    if (mi == SIM_NONE) return NULL;
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    size_t total = aux_len + len;
    if (total <= MSG_INLINE) {
        m->buf = m->inl;
        m->cls = 0;
    } else {
        int c = size_class(total);
        if (c <= BUF_MAX_CLASS && sim->nbufs[c]) {
            m->buf = sim->bufs[c][--sim->nbufs[c]];
            sim->buf_cached -= (size_t)1 << c;
            m->cls = (uint8_t)c;
        } else if (c <= BUF_MAX_CLASS) {
            m->buf = malloc((size_t)1 << c);
            m->cls = (uint8_t)c;
        } else {
            m->buf = malloc(total);
            m->cls = 255;
        }
        if (!m->buf) {
            ap__slab_release(&sim->msgs, mi);
            return NULL;
        }
    }
    m->kind = kind;
    m->aux_len = (uint32_t)aux_len;
    m->len = len;
    m->next = SIM_NONE;
    if (aux_len) memcpy(m->buf, aux, aux_len);
    if (len && data) memcpy(m->buf + aux_len, data, len);
    *idx_out = mi;
    return m;
}

void ap__msg_release(ap_sim_t *sim, uint32_t mi)
{
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    if (m->cls == 255) {
        free(m->buf);
    } else if (m->cls != 0) {
        int c = m->cls;
        size_t sz = (size_t)1 << c;
        if (sim->buf_cached + sz <= BUF_CACHE_MAX && sim->nbufs[c] == sim->capbufs[c]) {
            uint32_t cap = sim->capbufs[c] ? sim->capbufs[c] * 2 : 16;
            void **nb = realloc(sim->bufs[c], cap * sizeof *nb);
            if (nb) {
                sim->bufs[c] = nb;
                sim->capbufs[c] = cap;
            }
        }
        if (sim->buf_cached + sz <= BUF_CACHE_MAX && sim->nbufs[c] < sim->capbufs[c]) {
            sim->bufs[c][sim->nbufs[c]++] = m->buf;
            sim->buf_cached += sz;
        } else {
            free(m->buf);
        }
    }
    m->buf = NULL;
    m->cls = 0;
    ap__slab_release(&sim->msgs, mi);
}

static inline uint64_t msg_wire(const sim_msg_t *m)
{
    if (m->kind == M_CREDIT) return AP_SIM_FRAME_OVERHEAD;
    return m->aux_len + m->len + AP_SIM_FRAME_OVERHEAD;
}

/* ---- links and flows ------------------------------------------------------ */

static inline const ap_sim_link_t *dir_link(const ap_sim_t *sim, const sim_dir_t *d)
{
    return d->link == SIM_NONE ? &sim->deflink : &sim->links[d->link];
}

static inline sim_conn_t *conn_at(ap_sim_t *sim, uint32_t ci)
{
    return slab_at(&sim->conns, ci);
}

static inline sim_dir_t *flow_dir(ap_sim_t *sim, uint32_t f)
{
    return &conn_at(sim, f >> 1)->dir[f & 1];
}

static uint64_t jittered_arrival(ap_sim_t *sim, const ap_sim_link_t *l, uint64_t t)
{
    uint64_t a = t + l->latency_us;
    if (l->jitter_us) a += ap__sim_rand_below(sim, l->jitter_us + 1);
    return a;
}

/* Bottleneck fair share: each resource (the link direction, the sender's
 * upload, the receiver's download) splits its capacity equally among the
 * flows active on it; a flow runs at the smallest of its shares. */
static uint64_t flow_rate(ap_sim_t *sim, const sim_conn_t *c, unsigned d)
{
    const sim_dir_t *dir = &c->dir[d];
    const sim_node_t *snd = sim->nodes[c->node[d]];
    const sim_node_t *rcv = sim->nodes[c->node[d ^ 1]];
    uint64_t r = UINT64_MAX;
    uint64_t lb = dir_link(sim, dir)->bandwidth_bps;
    if (lb && lb < r) r = lb;
    if (snd->up_bps && snd->n_up && snd->up_bps / snd->n_up < r) r = snd->up_bps / snd->n_up;
    if (rcv->down_bps && rcv->n_down && rcv->down_bps / rcv->n_down < r)
        r = rcv->down_bps / rcv->n_down;
    return r ? r : 1;
}

static bool path_limited(ap_sim_t *sim, const sim_conn_t *c, unsigned d)
{
    return dir_link(sim, &c->dir[d])->bandwidth_bps || sim->nodes[c->node[d]]->up_bps ||
           sim->nodes[c->node[d ^ 1]]->down_bps;
}

static void settle(ap_sim_t *sim, sim_dir_t *d)
{
    uint64_t dt = sim->now - d->last;
    if (dt && d->rate) {
        __uint128_t used = (__uint128_t)d->rate * dt;
        d->rem = used >= d->rem ? 0 : d->rem - (uint64_t)used;
    }
    d->last = sim->now;
}

/* Recomputes flow f's rate; reschedules its completion if it changed (or
 * if force). */
static void resched(ap_sim_t *sim, uint32_t f, bool force)
{
    sim_conn_t *c = conn_at(sim, f >> 1);
    sim_dir_t *d = &c->dir[f & 1];
    settle(sim, d);
    uint64_t r = flow_rate(sim, c, f & 1);
    if (!force && d->scheduled && r == d->rate) return;
    d->rate = r;
    if (d->scheduled) sim_stale(sim);
    d->xgen = ++sim->xgen;
    d->scheduled = 1;
    uint64_t dt = d->rem / r + (d->rem % r != 0);
    ap__sim_push(sim, sim->now + dt, EV_XMIT, f, d->xgen);
}

static void resched_node(ap_sim_t *sim, uint32_t node, uint32_t skip)
{
    sim_node_t *n = sim->nodes[node];
    for (uint32_t f = n->out_active; f != SIM_NONE; f = flow_dir(sim, f)->onext)
        if (f != skip) resched(sim, f, false);
    for (uint32_t f = n->in_active; f != SIM_NONE; f = flow_dir(sim, f)->inext)
        if (f != skip) resched(sim, f, false);
}

static void flow_activate(ap_sim_t *sim, uint32_t f)
{
    sim_conn_t *c = conn_at(sim, f >> 1);
    unsigned dd = f & 1;
    sim_dir_t *d = &c->dir[dd];
    sim_node_t *snd = sim->nodes[c->node[dd]], *rcv = sim->nodes[c->node[dd ^ 1]];
    d->active = 1;
    d->scheduled = 0;
    d->rate = 0;
    d->last = sim->now;
    d->oprev = SIM_NONE;
    d->onext = snd->out_active;
    if (snd->out_active != SIM_NONE) flow_dir(sim, snd->out_active)->oprev = f;
    snd->out_active = f;
    d->iprev = SIM_NONE;
    d->inext = rcv->in_active;
    if (rcv->in_active != SIM_NONE) flow_dir(sim, rcv->in_active)->iprev = f;
    rcv->in_active = f;
    snd->n_up++;
    rcv->n_down++;
    resched(sim, f, true);
    resched_node(sim, snd->idx, f);
    resched_node(sim, rcv->idx, f);
}

static void flow_deactivate(ap_sim_t *sim, uint32_t f)
{
    sim_conn_t *c = conn_at(sim, f >> 1);
    unsigned dd = f & 1;
    sim_dir_t *d = &c->dir[dd];
    sim_node_t *snd = sim->nodes[c->node[dd]], *rcv = sim->nodes[c->node[dd ^ 1]];
    if (d->oprev != SIM_NONE)
        flow_dir(sim, d->oprev)->onext = d->onext;
    else
        snd->out_active = d->onext;
    if (d->onext != SIM_NONE) flow_dir(sim, d->onext)->oprev = d->oprev;
    if (d->iprev != SIM_NONE)
        flow_dir(sim, d->iprev)->inext = d->inext;
    else
        rcv->in_active = d->inext;
    if (d->inext != SIM_NONE) flow_dir(sim, d->inext)->iprev = d->iprev;
    snd->n_up--;
    rcv->n_down--;
    if (d->scheduled) sim_stale(sim);
    d->active = 0;
    d->scheduled = 0;
    d->rate = 0;
    resched_node(sim, snd->idx, SIM_NONE);
    resched_node(sim, rcv->idx, SIM_NONE);
}

void ap__conn_rates_changed(ap_sim_t *sim, uint32_t node)
{
    resched_node(sim, node, SIM_NONE);
}

void ap__conn_link_changed(ap_sim_t *sim, uint32_t a, uint32_t b, uint32_t link)
{
    uint32_t lo = a < b ? a : b, hi = a < b ? b : a;
    uint32_t ci = ap__map_get(&sim->conn_map, ((uint64_t)lo << 32) | hi);
    if (ci == SIM_NONE) return;
    sim_conn_t *c = conn_at(sim, ci);
    unsigned d = c->node[0] == a ? 0 : 1;
    c->dir[d].link = link;
    if (c->dir[d].active) resched(sim, ci * 2 + d, false);
}

/* Puts a message on the wire now: it arrives after latency + jitter, but
 * never before an earlier message of the same direction (TCP ordering). */
static void launch(ap_sim_t *sim, sim_conn_t *c, unsigned d, uint32_t mi)
{
    sim_dir_t *dir = &c->dir[d];
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    uint64_t arr = jittered_arrival(sim, dir_link(sim, dir), sim->now);
    if (arr < dir->last_arrival) arr = dir->last_arrival;
    dir->last_arrival = arr;
    sim->nodes[c->node[d]]->st.bytes_sent += msg_wire(m);
    ap__sim_push(sim, arr, EV_DELIVER, mi, slab_gen(&sim->msgs, mi));
}

static void dir_start_head(ap_sim_t *sim, uint32_t f)
{
    sim_dir_t *d = flow_dir(sim, f);
    const sim_msg_t *m = slab_at(&sim->msgs, d->qh);
    d->rem = msg_wire(m) * 8u * 1000000u;
    d->last = sim->now;
}

static void pump(ap_sim_t *sim, uint32_t ci, unsigned d)
{
    sim_conn_t *c = conn_at(sim, ci);
    sim_dir_t *dir = &c->dir[d];
    if (!c->up[d] || dir->active || dir->qh == SIM_NONE) return;
    if (path_limited(sim, c, d)) {
        dir_start_head(sim, ci * 2 + d);
        flow_activate(sim, ci * 2 + d);
        return;
    }
    while (dir->qh != SIM_NONE) {
        uint32_t mi = dir->qh;
        sim_msg_t *m = slab_at(&sim->msgs, mi);
        dir->qh = m->next;
        if (dir->qh == SIM_NONE) dir->qt = SIM_NONE;
        launch(sim, c, d, mi);
    }
}

bool ap__xmit_valid(ap_sim_t *sim, uint32_t f, uint32_t xgen)
{
    uint32_t ci = f >> 1;
    if (!slab_used(&sim->conns, ci)) return false;
    sim_dir_t *d = flow_dir(sim, f);
    return d->active && d->scheduled && d->xgen == xgen;
}

void ap__ev_xmit(ap_sim_t *sim, uint32_t f, uint32_t xgen)
{
    uint32_t ci = f >> 1;
    sim_conn_t *c = conn_at(sim, ci);
    unsigned dd = f & 1;
    sim_dir_t *d = &c->dir[dd];
    d->scheduled = 0;
    uint32_t mi = d->qh;
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    d->qh = m->next;
    if (d->qh == SIM_NONE) d->qt = SIM_NONE;
    ap__sim_trace(sim, EV_XMIT, c->node[dd], msg_wire(m));
    launch(sim, c, dd, mi);
    if (d->qh != SIM_NONE && path_limited(sim, c, dd)) {
        dir_start_head(sim, f);
        resched(sim, f, true);
    } else {
        flow_deactivate(sim, f);
        pump(sim, ci, dd); /* the path may have become unlimited */
    }
}

/* ---- connections ----------------------------------------------------------- */

static inline uint64_t pair_key(uint32_t a, uint32_t b)
{
    return a < b ? ((uint64_t)a << 32) | b : ((uint64_t)b << 32) | a;
}

static void send_handshake(ap_sim_t *sim, uint32_t ci, unsigned side, uint8_t kind)
{
    uint32_t mi;
    sim_msg_t *m = ap__msg_new(sim, kind, NULL, 0, NULL, 0, &mi);
    if (!m) {
        ap_error("sim", "out of memory sending a handshake; connection will time out");
        return;
    }
    sim_conn_t *c = conn_at(sim, ci);
    m->conn = ci;
    m->conn_gen = slab_gen(&sim->conns, ci);
    m->from = (uint8_t)side;
    launch(sim, c, side, mi);
}

uint32_t ap__conn_get(ap_sim_t *sim, uint32_t a, uint32_t b)
{
    uint64_t key = pair_key(a, b);
    uint32_t ci = ap__map_get(&sim->conn_map, key);
    if (ci != SIM_NONE) return ci;
    ci = ap__slab_alloc(&sim->conns);
    if (ci == SIM_NONE) return SIM_NONE;
    if (ap__map_put(&sim->conn_map, key, ci) != 0) {
        ap__slab_release(&sim->conns, ci);
        return SIM_NONE;
    }
    sim_conn_t *c = conn_at(sim, ci);
    c->node[0] = a < b ? a : b;
    c->node[1] = a < b ? b : a;
    for (unsigned d = 0; d < 2; d++) {
        sim_dir_t *dir = &c->dir[d];
        dir->qh = dir->qt = SIM_NONE;
        dir->oprev = dir->onext = dir->iprev = dir->inext = SIM_NONE;
        dir->link = ap__map_get(&sim->link_map, ((uint64_t)c->node[d] << 32) | c->node[d ^ 1]);
    }
    for (unsigned s = 0; s < 2; s++) {
        sim_node_t *n = sim->nodes[c->node[s]];
        c->lprev[s] = SIM_NONE;
        c->lnext[s] = n->conns;
        if (n->conns != SIM_NONE) {
            sim_conn_t *h = conn_at(sim, n->conns);
            h->lprev[sim_side(h, n->idx)] = ci;
        }
        n->conns = ci;
    }
    c->syn_side = sim_side(c, a);
    send_handshake(sim, ci, c->syn_side, M_SYN);
    ap__sim_deadline(sim, sim->connect_timeout, EV_CONN_TIMEOUT, ci, slab_gen(&sim->conns, ci));
    return ci;
}

void ap__conn_send(ap_sim_t *sim, uint32_t ci, uint8_t side, uint32_t mi)
{
    sim_conn_t *c = conn_at(sim, ci);
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    m->conn = ci;
    m->conn_gen = slab_gen(&sim->conns, ci);
    m->from = side;
    m->next = SIM_NONE;
    c->last_used = sim->now;
    sim_dir_t *d = &c->dir[side];
    if (d->qt == SIM_NONE)
        d->qh = mi;
    else
        ((sim_msg_t *)slab_at(&sim->msgs, d->qt))->next = mi;
    d->qt = mi;
    pump(sim, ci, side);
}

void ap__conn_send_ctrl(ap_sim_t *sim, uint32_t ci, uint8_t side, uint32_t mi)
{
    sim_conn_t *c = conn_at(sim, ci);
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    m->conn = ci;
    m->conn_gen = slab_gen(&sim->conns, ci);
    m->from = side;
    c->last_used = sim->now;
    sim->nodes[c->node[side]]->st.bytes_sent += msg_wire(m);
    uint64_t arr = jittered_arrival(sim, dir_link(sim, &c->dir[side]), sim->now);
    ap__sim_push(sim, arr, EV_DELIVER, mi, slab_gen(&sim->msgs, mi));
}

void ap__conn_teardown(ap_sim_t *sim, uint32_t ci)
{
    sim_conn_t *c = conn_at(sim, ci);
    uint32_t gen = slab_gen(&sim->conns, ci);
    for (unsigned s = 0; s < 2; s++) {
        sim_node_t *n = sim->nodes[c->node[s]];
        if (n->alive) {
            if (c->up[s]) n->st.connections--;
            uint32_t ni = ap__slab_alloc(&sim->notes);
            if (ni == SIM_NONE) {
                ap_error("sim", "out of memory recording a disconnect; node %u misses it", n->idx);
            } else {
                sim_note_t *note = slab_at(&sim->notes, ni);
                *note = (sim_note_t){.node = n->idx,
                                     .inc = n->inc,
                                     .conn = ci,
                                     .conn_gen = gen,
                                     .peer = c->node[s ^ 1],
                                     .was_up = c->up[s]};
                ap__sim_push(sim, sim->now, EV_NOTE, ni, slab_gen(&sim->notes, ni));
            }
        }
        /* unlink from the node's connection list */
        if (c->lprev[s] != SIM_NONE) {
            sim_conn_t *p = conn_at(sim, c->lprev[s]);
            p->lnext[sim_side(p, n->idx)] = c->lnext[s];
        } else {
            n->conns = c->lnext[s];
        }
        if (c->lnext[s] != SIM_NONE) {
            sim_conn_t *q = conn_at(sim, c->lnext[s]);
            q->lprev[sim_side(q, n->idx)] = c->lprev[s];
        }
    }
    for (unsigned d = 0; d < 2; d++) {
        if (c->dir[d].active) flow_deactivate(sim, ci * 2 + d);
        for (uint32_t mi = c->dir[d].qh; mi != SIM_NONE;) {
            uint32_t next = ((sim_msg_t *)slab_at(&sim->msgs, mi))->next;
            ap__msg_release(sim, mi);
            mi = next;
        }
        c->dir[d].qh = c->dir[d].qt = SIM_NONE;
    }
    if (!(c->up[0] && c->up[1])) sim_stale(sim); /* its connect timeout */
    ap__map_del(&sim->conn_map, pair_key(c->node[0], c->node[1]));
    ap__slab_release(&sim->conns, ci);
}

bool ap__conn_timeout_valid(ap_sim_t *sim, uint32_t ci, uint32_t gen)
{
    if (!slab_live(&sim->conns, ci, gen)) return false;
    sim_conn_t *c = conn_at(sim, ci);
    return !(c->up[0] && c->up[1]);
}

void ap__ev_conn_timeout(ap_sim_t *sim, uint32_t ci, uint32_t gen)
{
    sim_conn_t *c = conn_at(sim, ci);
    ap__sim_trace(sim, EV_CONN_TIMEOUT, c->node[0], c->node[1]);
    ap_debug("sim", "connection %u<->%u timed out connecting", c->node[0], c->node[1]);
    ap__conn_teardown(sim, ci);
}

void ap__ev_syn_retry(ap_sim_t *sim, uint32_t ci)
{
    sim_conn_t *c = conn_at(sim, ci);
    ap__sim_trace(sim, EV_SYN_RETRY, c->node[c->syn_side], 0);
    if (!c->up[c->syn_side ^ 1]) send_handshake(sim, ci, c->syn_side, M_SYN);
}

/* Closes established connections that nothing uses and that carried no
 * message for idle_timeout; both sides see AP_PEER_DISCONNECTED. */
void ap__ev_idle(ap_sim_t *sim)
{
    sim->idle_gen = 0;
    if (!sim->idle_timeout) return;
    for (uint32_t ci = 0; ci < sim->conns.next; ci++) {
        if (!slab_used(&sim->conns, ci)) continue;
        sim_conn_t *c = conn_at(sim, ci);
        if (c->users || !c->up[0] || !c->up[1] || sim->now - c->last_used < sim->idle_timeout)
            continue;
        if (c->dir[0].qh != SIM_NONE || c->dir[1].qh != SIM_NONE) continue;
        if (c->dir[0].active || c->dir[1].active) continue;
        ap__sim_trace(sim, EV_IDLE, c->node[0], c->node[1]);
        ap__conn_teardown(sim, ci);
    }
    sim->idle_gen = ++sim->xgen ? sim->xgen : ++sim->xgen;
    ap__sim_push(sim, sim->now + sim->idle_timeout / 2 + 1, EV_IDLE, 0, sim->idle_gen);
}

/* ---- connection-loss notices ----------------------------------------------- */

typedef struct idgen {
    uint32_t idx, gen;
} idgen_t;

/* Collects (index, gen) of list members matching conn; the caller then
 * completes each one that is still live (callbacks may change the list). */
static size_t collect(sim_slab_t *sl, size_t link_off, size_t conn_off, uint32_t head,
                      uint32_t conn, uint32_t conn_gen, idgen_t **out)
{
    size_t n = 0, cap = 0;
    idgen_t *v = NULL;
    for (uint32_t i = head; i != SIM_NONE;) {
        uint8_t *e = slab_at(sl, i);
        const uint32_t *cg = (const uint32_t *)(e + conn_off);
        if (conn == SIM_NONE || (cg[0] == conn && cg[1] == conn_gen)) {
            if (n == cap) {
                cap = cap ? cap * 2 : 16;
                idgen_t *nv = realloc(v, cap * sizeof *nv);
                if (!nv) break;
                v = nv;
            }
            v[n++] = (idgen_t){i, slab_gen(sl, i)};
        }
        i = ((const uint32_t *)(e + link_off))[1];
    }
    *out = v;
    return n;
}

/* Completes, on node n, everything bound to connection (conn, gen): or
 * everything at all when conn == SIM_NONE (crash). Oldest first. */
static void fail_bound(ap_sim_t *sim, sim_node_t *n, uint32_t conn, uint32_t gen, int call_st,
                       int stream_st, int dial_st)
{
    idgen_t *v;
    size_t k = collect(&sim->calls, offsetof(sim_call_t, prev), offsetof(sim_call_t, conn),
                       n->calls, conn, gen, &v);
    while (k--)
        if (slab_live(&sim->calls, v[k].idx, v[k].gen))
            ap__call_complete(sim, v[k].idx, call_st, NULL, 0, NULL);
    free(v);
    k = collect(&sim->dials, offsetof(sim_dial_t, prev), offsetof(sim_dial_t, conn), n->dials, conn,
                gen, &v);
    while (k--)
        if (slab_live(&sim->dials, v[k].idx, v[k].gen)) ap__dial_complete(sim, v[k].idx, dial_st);
    free(v);
    k = collect(&sim->streams, offsetof(sim_stream_t, prev), offsetof(sim_stream_t, conn),
                n->streams, conn, gen, &v);
    while (k--) {
        if (!slab_live(&sim->streams, v[k].idx, v[k].gen)) continue;
        sim_stream_t *s = slab_at(&sim->streams, v[k].idx);
        int st = s->closed ? s->close_status : stream_st;
        ap__stream_finish(sim, v[k].idx, st);
    }
    free(v);
}

void ap__node_flush(ap_sim_t *sim, sim_node_t *n)
{
    fail_bound(sim, n, SIM_NONE, 0, AP_ECANCELED, AP_ECANCELED, AP_ECANCELED);
    while (n->works != SIM_NONE) {
        uint32_t wi = n->works;
        sim_work_t *w = slab_at(&sim->works, wi);
        /* oldest first: walk to the tail */
        while (w->next != SIM_NONE) {
            wi = w->next;
            w = slab_at(&sim->works, wi);
        }
        ap_after_work_fn after = w->after;
        void *arg = w->arg;
        ap__list_remove(&sim->works, offsetof(sim_work_t, prev), &n->works, wi);
        ap__slab_release(&sim->works, wi);
        sim_stale(sim);
        if (after) after(&n->rt, arg, AP_ECANCELED);
    }
}

void ap__ev_note(ap_sim_t *sim, uint32_t ni)
{
    sim_note_t note = *(sim_note_t *)slab_at(&sim->notes, ni);
    ap__slab_release(&sim->notes, ni);
    sim_node_t *n = sim->nodes[note.node];
    ap__sim_trace(sim, EV_NOTE, note.node, note.peer);
    if (!n->alive || n->inc != note.inc) return;
    ap_debug("sim", "node %u: connection to %u %s", note.node, note.peer,
             note.was_up ? "lost" : "failed");
    int st = note.was_up ? AP_ECLOSED : AP_EUNREACH;
    fail_bound(sim, n, note.conn, note.conn_gen, st, st, AP_EUNREACH);
    if (note.was_up && n->alive && n->inc == note.inc)
        ap__rt_peer_event(&n->rt, &sim->nodes[note.peer]->rt.self, AP_PEER_DISCONNECTED);
}

/* ---- delivery ------------------------------------------------------------ */

void ap__sim_on_req(ap_sim_t *sim, sim_node_t *n, uint32_t ci, uint32_t mi);
void ap__sim_on_resp(ap_sim_t *sim, uint32_t mi);
void ap__sim_on_open(ap_sim_t *sim, sim_node_t *n, uint32_t ci, uint32_t mi);
void ap__sim_on_dials_connected(ap_sim_t *sim, sim_node_t *n, uint32_t ci);

static void on_syn(ap_sim_t *sim, sim_conn_t *c, uint32_t ci, unsigned rs)
{
    sim_node_t *b = sim->nodes[c->node[rs]], *a = sim->nodes[c->node[rs ^ 1]];
    if (!b->alive) {
        send_handshake(sim, ci, rs, M_REFUSED); /* host up, process gone: RST */
        return;
    }
    if (a->group != b->group) {
        /* dropped by the partition: the initiator sends it again later */
        ap__sim_push(sim, sim->now + SIM_SYN_RETRY_US, EV_SYN_RETRY, ci, slab_gen(&sim->conns, ci));
        return;
    }
    c->up[rs] = 1;
    b->st.connections++;
    send_handshake(sim, ci, rs, M_SYNACK);
    pump(sim, ci, rs);
    ap__rt_peer_event(&b->rt, &a->rt.self, AP_PEER_CONNECTED);
}

static void on_synack(ap_sim_t *sim, sim_conn_t *c, uint32_t ci, unsigned rs)
{
    sim_node_t *a = sim->nodes[c->node[rs]], *b = sim->nodes[c->node[rs ^ 1]];
    c->up[rs] = 1;
    a->st.connections++;
    sim_stale(sim); /* the connect timeout */
    pump(sim, ci, rs);
    ap__rt_peer_event(&a->rt, &b->rt.self, AP_PEER_CONNECTED);
    if (slab_used(&sim->conns, ci) && a->alive) ap__sim_on_dials_connected(sim, a, ci);
}

void ap__ev_deliver(ap_sim_t *sim, uint32_t mi)
{
    sim_msg_t *m = slab_at(&sim->msgs, mi);
    uint64_t wire = msg_wire(m);
    if (!slab_live(&sim->conns, m->conn, m->conn_gen)) {
        ap__sim_trace(sim, EV_DELIVER, SIM_NONE, wire);
        ap__msg_release(sim, mi);
        return;
    }
    uint32_t ci = m->conn;
    sim_conn_t *c = conn_at(sim, ci);
    unsigned rs = m->from ^ 1u;
    sim_node_t *n = sim->nodes[c->node[rs]];
    c->last_used = sim->now;
    ap__sim_trace(sim, (uint8_t)(0x40 | m->kind), n->idx, wire);
    sim->stats.bytes += wire;
    n->st.bytes_received += wire;
    switch (m->kind) {
    case M_SYN:
        on_syn(sim, c, ci, rs);
        break;
    case M_SYNACK:
        on_synack(sim, c, ci, rs);
        break;
    case M_REFUSED:
        ap__conn_teardown(sim, ci);
        break;
    case M_REQ:
        sim->stats.messages++;
        ap__sim_on_req(sim, n, ci, mi);
        return; /* the request owns the message now */
    case M_RESP:
        sim->stats.messages++;
        ap__sim_on_resp(sim, mi);
        break;
    case M_OPEN:
        ap__sim_on_open(sim, n, ci, mi);
        break;
    case M_ACCEPT:
        if (slab_live(&sim->streams, m->dst, m->dst_gen)) {
            sim_stream_t *s = slab_at(&sim->streams, m->dst);
            if (!s->accepted) sim_stale(sim); /* its open timeout */
            s->accepted = true;
        }
        break;
    case M_REFUSE:
    case M_RESET:
        if (slab_live(&sim->streams, m->dst, m->dst_gen)) {
            sim_stream_t *s = slab_at(&sim->streams, m->dst);
            if (!s->closed) ap__stream_finish(sim, m->dst, m->status);
        }
        break;
    case M_DATA:
        sim->stats.messages++;
        if (slab_live(&sim->streams, m->dst, m->dst_gen)) {
            ap__stream_on_data(sim, m->dst, mi);
            return; /* consumed or queued by the stream */
        }
        break;
    case M_END:
        if (slab_live(&sim->streams, m->dst, m->dst_gen)) {
            ap__stream_on_data(sim, m->dst, mi);
            return;
        }
        break;
    case M_CREDIT:
        if (slab_live(&sim->streams, m->dst, m->dst_gen)) {
            sim_stream_t *s = slab_at(&sim->streams, m->dst);
            s->buffered = s->buffered > m->len ? s->buffered - m->len : 0;
            if (s->want_writable && !s->closed && !s->local_closed &&
                s->buffered < s->s.window / 2) {
                s->want_writable = false;
                if (s->s.cbs.on_writable) s->s.cbs.on_writable(&s->s, s->s.arg);
            }
        }
        break;
    default:
        break;
    }
    ap__msg_release(sim, mi);
}
