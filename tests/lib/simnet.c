/* simnet: see simnet.h. */
#include "simnet.h"

#include "runtime/rt_impl.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WALL_EPOCH_MS 1800000000000LL /* virtual time 0 = this wall clock */

typedef struct snode {
    struct ap_rt rt; /* first: ap_rt_t * <-> snode * */
    simnet_t *net;
    int idx;
    bool alive;
    int group;
    int64_t skew_ms;
    uint32_t gen; /* incarnation: events of a dead incarnation are dropped */
} snode_t;

enum { EV_TIMER = 1, EV_DELIVER, EV_REPLY, EV_TIMEOUT, EV_DIAL, EV_POST, EV_WORK };

typedef struct timer {
    int node;
    uint32_t gen;
    ap_timer_fn cb;
    void *arg;
    uint64_t period;
    bool active;
} timer_t_;

typedef struct call {
    int caller, callee;
    uint32_t gen;
    ap_rpc_done_fn done;
    void *arg;
    bool pending;
    size_t max_resp;
    char proto[AP_RT_PROTO_MAX];
} call_t;

typedef struct sreq {
    struct ap_rpc_req base;
    uint64_t call_id;
} sreq_t;

typedef struct event {
    uint64_t t, seq;
    int type;
    uint64_t id; /* timer id or call id */
    int node;
    uint32_t gen;
    int status;
    uint8_t *data;
    size_t len;
    char *errmsg;
    void *fn, *arg;
    ap_peer_id_t peer;
} event_t;

struct simnet {
    snode_t **nodes;
    int n;
    uint64_t now, seq, latency, jitter;
    uint64_t rng[4];
    uint64_t seed;
    event_t *heap;
    size_t nheap, capheap;
    timer_t_ **timers; /* by id - 1 */
    size_t ntimers, captimers;
    call_t **calls; /* by id - 1 */
    size_t ncalls, capcalls;
    int *peer_tab; /* open addressing: peer hash -> node index + 1 */
    size_t peer_cap;
    uint64_t rpcs;
};

static simnet_t *net_of(ap_rt_t *rt)
{
    return ((snode_t *)rt)->net;
}

/* ---- event heap ------------------------------------------------------------ */

static bool ev_less(const event_t *a, const event_t *b)
{
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static void push(simnet_t *net, event_t ev)
{
    if (net->nheap == net->capheap) {
        net->capheap = net->capheap ? net->capheap * 2 : 1024;
        net->heap = realloc(net->heap, net->capheap * sizeof *net->heap);
        if (!net->heap) abort(); /* test helper: out of memory is fatal */
    }
    ev.seq = net->seq++;
    size_t i = net->nheap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!ev_less(&ev, &net->heap[p])) break;
        net->heap[i] = net->heap[p];
        i = p;
    }
    net->heap[i] = ev;
}

static event_t pop(simnet_t *net)
{
    event_t top = net->heap[0];
    event_t last = net->heap[--net->nheap];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const event_t *best = &last;
        if (l < net->nheap && ev_less(&net->heap[l], best)) {
            m = l;
            best = &net->heap[l];
        }
        if (r < net->nheap && ev_less(&net->heap[r], best)) m = r;
        if (m == i) break;
        net->heap[i] = net->heap[m];
        i = m;
    }
    if (net->nheap) net->heap[i] = last;
    return top;
}

static uint64_t link_delay(simnet_t *net)
{
    uint64_t d = net->latency;
    if (net->jitter) d += ap__rng_next(net->rng) % (net->jitter + 1);
    return d;
}

/* ---- ops -------------------------------------------------------------------- */

static uint64_t op_now_us(ap_rt_t *rt)
{
    return net_of(rt)->now;
}
static int64_t op_wall_ms(ap_rt_t *rt)
{
    snode_t *n = (snode_t *)rt;
    return WALL_EPOCH_MS + (int64_t)(n->net->now / 1000) + n->skew_ms;
}

static uint64_t op_timer_start(ap_rt_t *rt, uint64_t delay_us, uint64_t period_us, ap_timer_fn cb,
                               void *arg)
{
    simnet_t *net = net_of(rt);
    snode_t *sn = (snode_t *)rt;
    if (net->ntimers == net->captimers) {
        net->captimers = net->captimers ? net->captimers * 2 : 1024;
        net->timers = realloc(net->timers, net->captimers * sizeof *net->timers);
        if (!net->timers) abort();
    }
    timer_t_ *t = calloc(1, sizeof *t);
    if (!t) return 0;
    t->node = sn->idx;
    t->gen = sn->gen;
    t->cb = cb;
    t->arg = arg;
    t->period = period_us;
    t->active = true;
    net->timers[net->ntimers++] = t;
    uint64_t id = net->ntimers;
    push(net, (event_t){.t = net->now + delay_us, .type = EV_TIMER, .id = id});
    return id;
}

static bool op_timer_stop(ap_rt_t *rt, uint64_t id)
{
    simnet_t *net = net_of(rt);
    if (id == 0 || id > net->ntimers || !net->timers[id - 1]) return false;
    timer_t_ *t = net->timers[id - 1];
    bool was = t->active;
    t->active = false;
    return was;
}

static int op_post(ap_rt_t *rt, ap_post_fn fn, void *arg)
{
    simnet_t *net = net_of(rt);
    snode_t *sn = (snode_t *)rt;
    push(net, (event_t){.t = net->now,
                        .type = EV_POST,
                        .node = sn->idx,
                        .gen = sn->gen,
                        .fn = (void *)fn,
                        .arg = arg});
    return 0;
}

typedef struct workctx {
    ap_after_work_fn after;
} workctx_t;

static int op_work(ap_rt_t *rt, double cost, ap_work_fn work, ap_after_work_fn after, void *arg)
{
    simnet_t *net = net_of(rt);
    snode_t *sn = (snode_t *)rt;
    work(arg);
    push(net, (event_t){.t = net->now,
                        .type = EV_WORK,
                        .node = sn->idx,
                        .gen = sn->gen,
                        .fn = (void *)after,
                        .arg = arg});
    return 0;
}

static int op_listen_addrs(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    snode_t *sn = (snode_t *)rt;
    if (max >= 1) {
        if (with_id) {
            char id[AP_PEER_ID_STR_MAX];
            snprintf(addrs[0], AP_RT_ADDR_MAX, "/sim/%d/p2p/%s", sn->idx,
                     ap_peer_id_str(&rt->self, id));
        } else {
            snprintf(addrs[0], AP_RT_ADDR_MAX, "/sim/%d", sn->idx);
        }
    }
    return 1;
}

static int op_add_addr(ap_rt_t *rt, const ap_peer_id_t *peer, const char *addr)
{
    return 0;
}

static int find_node(simnet_t *net, const ap_peer_id_t *peer)
{
    size_t h = (size_t)ap_peer_id_hash(peer) & (net->peer_cap - 1);
    while (net->peer_tab[h]) {
        int i = net->peer_tab[h] - 1;
        if (ap_peer_id_eq(&net->nodes[i]->rt.self, peer)) return i;
        h = (h + 1) & (net->peer_cap - 1);
    }
    return -1;
}

static bool reachable(simnet_t *net, int a, int b)
{
    snode_t *x = net->nodes[a], *y = net->nodes[b];
    return y->alive && x->group == y->group;
}

static int op_dial(ap_rt_t *rt, const char *addr, uint64_t timeout_us, ap_dial_fn cb, void *arg)
{
    simnet_t *net = net_of(rt);
    snode_t *sn = (snode_t *)rt;
    int target = -1;
    if (sscanf(addr, "/sim/%d", &target) != 1 || target < 0 || target >= net->n) return AP_EADDR;
    event_t ev = {.type = EV_DIAL, .node = sn->idx, .gen = sn->gen, .fn = (void *)cb, .arg = arg};
    if (reachable(net, sn->idx, target)) {
        ev.t = net->now + 2 * link_delay(net);
        ev.peer = net->nodes[target]->rt.self;
        ev.status = 0;
    } else {
        ev.t = net->now + (net->nodes[target]->alive ? timeout_us : 2 * link_delay(net));
        ev.status = net->nodes[target]->alive ? AP_ETIMEDOUT : AP_EUNREACH;
    }
    push(net, ev);
    return 0;
}

static bool op_is_connected(ap_rt_t *rt, const ap_peer_id_t *peer)
{
    simnet_t *net = net_of(rt);
    int i = find_node(net, peer);
    return i >= 0 && reachable(net, ((snode_t *)rt)->idx, i);
}

static uint64_t op_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                            const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                            ap_rpc_done_fn done, void *arg)
{
    simnet_t *net = net_of(rt);
    snode_t *sn = (snode_t *)rt;
    if (net->ncalls == net->capcalls) {
        net->capcalls = net->capcalls ? net->capcalls * 2 : 1024;
        net->calls = realloc(net->calls, net->capcalls * sizeof *net->calls);
        if (!net->calls) abort();
    }
    call_t *c = calloc(1, sizeof *c);
    if (!c) return 0;
    c->caller = sn->idx;
    c->gen = sn->gen;
    c->callee = find_node(net, peer);
    c->done = done;
    c->arg = arg;
    c->pending = true;
    c->max_resp = opts->max_resp;
    snprintf(c->proto, sizeof c->proto, "%s", proto);
    net->calls[net->ncalls++] = c;
    uint64_t id = net->ncalls;
    push(net, (event_t){.t = net->now + opts->timeout_us, .type = EV_TIMEOUT, .id = id});
    if (c->callee < 0 || !net->nodes[c->callee]->alive) {
        /* connection refused after a round trip */
        push(net, (event_t){.t = net->now + 2 * link_delay(net),
                            .type = EV_REPLY,
                            .id = id,
                            .status = AP_EUNREACH});
    } else if (reachable(net, sn->idx, c->callee)) {
        event_t ev = {.t = net->now + link_delay(net),
                      .type = EV_DELIVER,
                      .id = id,
                      .node = c->callee,
                      .gen = net->nodes[c->callee]->gen};
        ev.data = malloc(len ? len : 1);
        if (!ev.data) abort();
        memcpy(ev.data, req, len);
        ev.len = len;
        push(net, ev);
    } /* else partitioned: silence, the caller times out */
    return id;
}

static call_t *get_call(simnet_t *net, uint64_t id)
{
    return id && id <= net->ncalls ? net->calls[id - 1] : NULL;
}

static void finish_call(simnet_t *net, uint64_t id)
{
    call_t *c = net->calls[id - 1];
    free(c);
    net->calls[id - 1] = NULL;
}

static bool op_rpc_cancel(ap_rt_t *rt, uint64_t id)
{
    simnet_t *net = net_of(rt);
    call_t *c = get_call(net, id);
    if (!c || !c->pending) return false;
    c->pending = false;
    c->done(rt, c->arg, AP_ECANCELED, NULL, 0, NULL);
    return true;
}

static void op_rpc_respond(ap_rpc_req_t *req, int err, const char *errmsg, const uint8_t *data,
                           size_t len)
{
    sreq_t *r = (sreq_t *)req;
    simnet_t *net = net_of(req->rt);
    call_t *c = get_call(net, r->call_id);
    if (c && c->pending && reachable(net, ((snode_t *)req->rt)->idx, c->caller)) {
        event_t ev = {
            .t = net->now + link_delay(net), .type = EV_REPLY, .id = r->call_id, .status = err};
        if (!err && len > c->max_resp) ev.status = AP_EMSGSIZE;
        if (!ev.status) {
            ev.data = malloc(len ? len : 1);
            if (!ev.data) abort();
            memcpy(ev.data, data, len);
            ev.len = len;
        } else if (errmsg) {
            ev.errmsg = strdup(errmsg);
        }
        push(net, ev);
    }
    free((void *)req->data);
    free(r);
}

static int op_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                          const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                          const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out)
{
    return AP_ENOTSUP;
}
static int op_stream_send(ap_stream_t *s, const uint8_t *d, size_t l)
{
    return AP_ENOTSUP;
}
static size_t op_stream_buffered(const ap_stream_t *s)
{
    return 0;
}
static void op_stream_pause(ap_stream_t *s, bool p) {}
static int op_stream_close(ap_stream_t *s)
{
    return AP_ENOTSUP;
}
static void op_stream_reset(ap_stream_t *s, int e) {}
static void op_get_stats(ap_rt_t *rt, ap_rt_stats_t *out)
{
    memset(out, 0, sizeof *out);
}

static const ap_rt_ops_t simnet_ops = {
    .name = "simnet",
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
    .stream_buffered = op_stream_buffered,
    .stream_pause = op_stream_pause,
    .stream_close = op_stream_close,
    .stream_reset = op_stream_reset,
    .get_stats = op_get_stats,
};

/* ---- nodes ------------------------------------------------------------------ */

static int node_init(simnet_t *net, int i)
{
    snode_t *sn = net->nodes[i];
    uint8_t seed[32] = {0};
    uint64_t s = net->seed * 1000003u + (uint64_t)i;
    memcpy(seed, &s, sizeof s);
    memcpy(seed + 8, &i, sizeof i);
    crypto_generichash(seed, 32, seed, 32, NULL, 0);
    int rc = ap__rt_init(&sn->rt, &simnet_ops, seed, s ^ 0x9e3779b97f4a7c15ull);
    sn->net = net;
    sn->idx = i;
    sn->alive = rc == 0;
    return rc;
}

simnet_t *simnet_new(int n, uint64_t seed, uint64_t latency_us, uint64_t jitter_us)
{
    simnet_t *net = calloc(1, sizeof *net);
    if (!net) return NULL;
    net->n = n;
    net->latency = latency_us;
    net->jitter = jitter_us;
    net->seed = seed;
    ap__rng_seed(net->rng, seed);
    net->nodes = calloc((size_t)n, sizeof *net->nodes);
    net->peer_cap = 16;
    while (net->peer_cap < (size_t)n * 2) net->peer_cap *= 2;
    net->peer_tab = calloc(net->peer_cap, sizeof *net->peer_tab);
    if (!net->nodes || !net->peer_tab) {
        simnet_free(net);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        net->nodes[i] = calloc(1, sizeof *net->nodes[i]);
        if (!net->nodes[i] || node_init(net, i)) {
            net->n = i + (net->nodes[i] ? 1 : 0);
            simnet_free(net);
            return NULL;
        }
        size_t h = (size_t)ap_peer_id_hash(&net->nodes[i]->rt.self) & (net->peer_cap - 1);
        while (net->peer_tab[h]) h = (h + 1) & (net->peer_cap - 1);
        net->peer_tab[h] = i + 1;
    }
    return net;
}

static void free_event(event_t *ev)
{
    if (ev->type == EV_DELIVER || ev->type == EV_REPLY) {
        free(ev->data);
        free(ev->errmsg);
    }
}

void simnet_free(simnet_t *net)
{
    if (!net) return;
    for (size_t i = 0; i < net->nheap; i++) free_event(&net->heap[i]);
    free(net->heap);
    for (size_t i = 0; i < net->ntimers; i++) free(net->timers[i]);
    free(net->timers);
    for (size_t i = 0; i < net->ncalls; i++) free(net->calls[i]);
    free(net->calls);
    for (int i = 0; i < net->n; i++) {
        if (!net->nodes[i]) continue;
        if (net->nodes[i]->alive) ap__rt_fini(&net->nodes[i]->rt);
        free(net->nodes[i]);
    }
    free(net->nodes);
    free(net->peer_tab);
    free(net);
}

int simnet_size(const simnet_t *net)
{
    return net->n;
}
ap_rt_t *simnet_rt(simnet_t *net, int i)
{
    return net->nodes[i]->alive ? &net->nodes[i]->rt : NULL;
}
const ap_peer_id_t *simnet_peer(simnet_t *net, int i)
{
    return &net->nodes[i]->rt.self;
}
uint64_t simnet_now_us(const simnet_t *net)
{
    return net->now;
}
uint64_t simnet_rpcs(const simnet_t *net)
{
    return net->rpcs;
}
void simnet_set_skew(simnet_t *net, int i, int64_t skew_ms)
{
    net->nodes[i]->skew_ms = skew_ms;
}
void simnet_set_group(simnet_t *net, int i, int group)
{
    net->nodes[i]->group = group;
}

void simnet_crash(simnet_t *net, int i)
{
    snode_t *sn = net->nodes[i];
    if (!sn->alive) return;
    sn->alive = false;
    sn->gen++;
    ap__rt_fini(&sn->rt);
}

void simnet_restart(simnet_t *net, int i)
{
    snode_t *sn = net->nodes[i];
    if (sn->alive) return;
    uint32_t gen = sn->gen;
    int group = sn->group;
    int64_t skew = sn->skew_ms;
    node_init(net, i);
    sn->gen = gen;
    sn->group = group;
    sn->skew_ms = skew;
}

static bool node_live(simnet_t *net, int i, uint32_t gen)
{
    return net->nodes[i]->alive && net->nodes[i]->gen == gen;
}

static void dispatch(simnet_t *net, event_t *ev)
{
    switch (ev->type) {
    case EV_TIMER: {
        timer_t_ *t = net->timers[ev->id - 1];
        if (!t) break;
        if (!t->active || !node_live(net, t->node, t->gen)) {
            free(t);
            net->timers[ev->id - 1] = NULL;
            break;
        }
        if (t->period) {
            push(net, (event_t){.t = net->now + t->period, .type = EV_TIMER, .id = ev->id});
        } else {
            t->active = false;
        }
        ap_timer_fn cb = t->cb;
        void *arg = t->arg;
        int node = t->node;
        if (!t->period) { /* one-shot: free before the callback (stop is then a no-op) */
            free(t);
            net->timers[ev->id - 1] = NULL;
        }
        cb(&net->nodes[node]->rt, arg);
        break;
    }
    case EV_DELIVER: {
        call_t *c = get_call(net, ev->id);
        snode_t *sn = net->nodes[ev->node];
        if (!node_live(net, ev->node, ev->gen)) {
            if (c && c->pending)
                push(net, (event_t){.t = net->now + link_delay(net),
                                    .type = EV_REPLY,
                                    .id = ev->id,
                                    .status = AP_ECLOSED});
            free(ev->data);
            break;
        }
        if (!c) { /* the caller gave up long ago and the call is gone */
            free(ev->data);
            break;
        }
        net->rpcs++;
        const ap_rt_handler_t *h = ap__rt_find_handler(&sn->rt, c->proto);
        sreq_t *r = calloc(1, sizeof *r);
        if (!r) abort();
        r->base.rt = &sn->rt;
        r->base.peer = net->nodes[c->caller]->rt.self;
        r->base.data = ev->data;
        r->base.len = ev->len;
        r->call_id = ev->id;
        if (!h) {
            op_rpc_respond(&r->base, AP_ENOPROTO, NULL, NULL, 0);
        } else if (ev->len > h->max_req) {
            op_rpc_respond(&r->base, AP_EMSGSIZE, NULL, NULL, 0);
        } else {
            h->fn(&sn->rt, h->arg, &r->base);
        }
        break;
    }
    case EV_REPLY: {
        call_t *c = get_call(net, ev->id);
        if (c && c->pending && node_live(net, c->caller, c->gen)) {
            c->pending = false;
            c->done(&net->nodes[c->caller]->rt, c->arg, ev->status, ev->data, ev->len, ev->errmsg);
        }
        free(ev->data);
        free(ev->errmsg);
        break;
    }
    case EV_TIMEOUT: {
        call_t *c = get_call(net, ev->id);
        if (c && c->pending && node_live(net, c->caller, c->gen)) {
            c->pending = false;
            c->done(&net->nodes[c->caller]->rt, c->arg, AP_ETIMEDOUT, NULL, 0, NULL);
        }
        if (c) finish_call(net, ev->id); /* the timeout is always the call's last event */
        break;
    }
    case EV_DIAL:
        if (node_live(net, ev->node, ev->gen))
            ((ap_dial_fn)ev->fn)(&net->nodes[ev->node]->rt, ev->arg, ev->status,
                                 ev->status ? NULL : &ev->peer);
        break;
    case EV_POST:
        if (node_live(net, ev->node, ev->gen))
            ((ap_post_fn)ev->fn)(&net->nodes[ev->node]->rt, ev->arg);
        break;
    case EV_WORK:
        if (node_live(net, ev->node, ev->gen))
            ((ap_after_work_fn)ev->fn)(&net->nodes[ev->node]->rt, ev->arg, 0);
        break;
    }
}

bool simnet_run_until(simnet_t *net, bool (*pred)(void *), void *arg, uint64_t timeout_us)
{
    uint64_t end = net->now + timeout_us;
    if (pred && pred(arg)) return true;
    while (net->nheap && net->heap[0].t <= end) {
        event_t ev = pop(net);
        net->now = ev.t;
        dispatch(net, &ev);
        if (pred && pred(arg)) return true;
    }
    if (net->now < end) net->now = end;
    return pred ? pred(arg) : false;
}
