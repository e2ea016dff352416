/* The simulator's core: storage, the event queue, the run loop, nodes,
 * topology settings and faults. */
#include "runtime/sim/sim_impl.h"

#include "apiary/log.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

/* ---- slab ----------------------------------------------------------------- */

void ap__slab_init(sim_slab_t *s, size_t esz)
{
    memset(s, 0, sizeof *s);
    s->esz = esz;
    s->zero = esz;
}

void ap__slab_free_all(sim_slab_t *s)
{
    for (uint32_t c = 0; c < s->nchunks; c++) {
        free(s->chunks[c]);
        free(s->gens[c]);
    }
    free(s->chunks);
    free(s->gens);
    free(s->freel);
    size_t esz = s->esz, zero = s->zero;
    ap__slab_init(s, esz);
    s->zero = zero;
}

static int slab_grow(sim_slab_t *s)
{
    uint32_t n = s->nchunks + 1;
    uint8_t **ch = realloc(s->chunks, n * sizeof *ch);
    if (!ch) return AP_ENOMEM;
    s->chunks = ch;
    uint32_t **g = realloc(s->gens, n * sizeof *g);
    if (!g) return AP_ENOMEM;
    s->gens = g;
    uint32_t *fl = realloc(s->freel, (size_t)n * SLAB_CHUNK * sizeof *fl);
    if (!fl) return AP_ENOMEM;
    s->freel = fl;
    uint8_t *chunk = malloc(SLAB_CHUNK * s->esz);
    uint32_t *gens = calloc(SLAB_CHUNK, sizeof *gens);
    if (!chunk || !gens) {
        free(chunk);
        free(gens);
        return AP_ENOMEM;
    }
    s->chunks[s->nchunks] = chunk;
    s->gens[s->nchunks] = gens;
    s->nchunks = n;
    return 0;
}

uint32_t ap__slab_alloc(sim_slab_t *s)
{
    uint32_t i;
    if (s->nfree) {
        i = s->freel[--s->nfree];
    } else {
        if (s->next >= (UINT32_MAX >> 2)) return SIM_NONE;
        if ((s->next >> SLAB_SHIFT) == s->nchunks && slab_grow(s) != 0) return SIM_NONE;
        i = s->next++;
    }
    s->gens[i >> SLAB_SHIFT][i & (SLAB_CHUNK - 1)]++;
    memset(slab_at(s, i), 0, s->zero);
    s->live++;
    return i;
}

void ap__slab_release(sim_slab_t *s, uint32_t i)
{
    s->gens[i >> SLAB_SHIFT][i & (SLAB_CHUNK - 1)]++;
    s->freel[s->nfree++] = i;
    s->live--;
}

/* ---- intrusive lists ---------------------------------------------------- */

static inline uint32_t *lnk(sim_slab_t *s, size_t off, uint32_t i)
{
    return (uint32_t *)((uint8_t *)slab_at(s, i) + off);
}

void ap__list_push(sim_slab_t *s, size_t off, uint32_t *head, uint32_t i)
{
    uint32_t *l = lnk(s, off, i);
    l[0] = SIM_NONE;
    l[1] = *head;
    if (*head != SIM_NONE) lnk(s, off, *head)[0] = i;
    *head = i;
}

void ap__list_remove(sim_slab_t *s, size_t off, uint32_t *head, uint32_t i)
{
    uint32_t *l = lnk(s, off, i);
    if (l[0] != SIM_NONE)
        lnk(s, off, l[0])[1] = l[1];
    else
        *head = l[1];
    if (l[1] != SIM_NONE) lnk(s, off, l[1])[0] = l[0];
    l[0] = l[1] = SIM_NONE;
}

/* ---- event queue: 4-ary min-heap on (t, seq) ------------------------------ */

static inline bool ev_less(const sim_ev_t *a, const sim_ev_t *b)
{
    return a->t < b->t || (a->t == b->t && a->seqk < b->seqk);
}

/* A 4-ary heap: half the depth of a binary one, and a node's children share
 * one or two cache lines. */
static void sift_down(sim_ev_t *h, size_t n, size_t i)
{
    sim_ev_t e = h[i];
    for (;;) {
        size_t c = 4 * i + 1;
        if (c >= n) break;
        size_t best = c;
        size_t end = c + 4 < n ? c + 4 : n;
        for (size_t k = c + 1; k < end; k++)
            if (ev_less(&h[k], &h[best])) best = k;
        if (!ev_less(&h[best], &e)) break;
        h[i] = h[best];
        i = best;
    }
    h[i] = e;
}

static bool ev_valid(ap_sim_t *sim, const sim_ev_t *e)
{
    switch (ev_kind(e)) {
    case EV_TIMER:
        return slab_live(&sim->timers, e->idx, e->gen);
    case EV_POST:
        return slab_live(&sim->posts, e->idx, e->gen);
    case EV_WORK:
        return slab_live(&sim->works, e->idx, e->gen);
    case EV_XMIT:
        return ap__xmit_valid(sim, e->idx, e->gen);
    case EV_CALL_TIMEOUT:
    case EV_CALL_FAIL:
        return slab_live(&sim->calls, e->idx, e->gen);
    case EV_STREAM_TIMEOUT: {
        if (!slab_live(&sim->streams, e->idx, e->gen)) return false;
        sim_stream_t *s = slab_at(&sim->streams, e->idx);
        return !s->accepted && !s->closed;
    }
    case EV_STREAM_CLOSE:
    case EV_STREAM_DRAIN:
        return slab_live(&sim->streams, e->idx, e->gen);
    case EV_DIAL_TIMEOUT:
    case EV_DIAL_DONE:
        return slab_live(&sim->dials, e->idx, e->gen);
    case EV_IDLE:
        return e->gen == sim->idle_gen;
    case EV_TQ:
        return e->idx < sim->ntqs && sim->tqs[e->idx].armed_gen == e->gen;
    case EV_CONN_TIMEOUT:
    case EV_SYN_RETRY:
        return ap__conn_timeout_valid(sim, e->idx, e->gen);
    default:
        return true; /* deliveries and notes always run */
    }
}

/* Drops cancelled events once they are the majority: amortised O(1) per
 * cancellation, and the queue stays within 2x of the live events. */
static void heap_compact(ap_sim_t *sim)
{
    size_t j = 0;
    for (size_t i = 0; i < sim->nheap; i++)
        if (ev_valid(sim, &sim->heap[i])) sim->heap[j++] = sim->heap[i];
    sim->nheap = j;
    for (size_t i = j / 4 + 1; i-- > 0;) sift_down(sim->heap, j, i);
    sim->nstale = 0;
}

void ap__sim_push(ap_sim_t *sim, uint64_t t, uint8_t kind, uint32_t idx, uint32_t gen)
{
    if (sim->nstale > 4096 && sim->nstale * 2 > sim->nheap) heap_compact(sim);
    if (sim->nheap == sim->capheap) {
        size_t cap = sim->capheap ? sim->capheap * 2 : 1024;
        sim_ev_t *h = realloc(sim->heap, cap * sizeof *h);
        if (!h) {
            /* Nothing sane is left to do: an event that cannot be queued
             * breaks the exactly-once contracts. */
            ap_error("sim", "out of memory growing the event queue (%zu events)", sim->nheap);
            abort();
        }
        sim->heap = h;
        sim->capheap = cap;
    }
    sim_ev_t e = {.t = t, .seqk = (sim->seq++ << 8) | kind, .idx = idx, .gen = gen};
    size_t i = sim->nheap++;
    sim_ev_t *h = sim->heap;
    while (i > 0) {
        size_t p = (i - 1) / 4;
        if (!ev_less(&e, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static sim_ev_t heap_pop(ap_sim_t *sim)
{
    sim_ev_t top = sim->heap[0];
    sim->heap[0] = sim->heap[--sim->nheap];
    if (sim->nheap) sift_down(sim->heap, sim->nheap, 0);
    return top;
}

/* ---- trace hash and randomness ------------------------------------------- */

uint64_t ap__sim_rand_below(ap_sim_t *sim, uint64_t n)
{
    return ap__rng_below(sim->rng, n);
}

/* ---- peer id table -------------------------------------------------------- */

int ap__sim_lookup(ap_sim_t *sim, const ap_peer_id_t *id)
{
    if (!sim->idcap) return -1;
    size_t mask = sim->idcap - 1;
    for (size_t i = ap_peer_id_hash(id) & mask;; i = (i + 1) & mask) {
        uint32_t v = sim->idtab[i];
        if (v == SIM_NONE) return -1;
        if (ap_peer_id_eq(&sim->nodes[v]->rt.self, id)) return (int)v;
    }
}

static int idtab_insert(ap_sim_t *sim, uint32_t node)
{
    if ((size_t)(sim->nnodes + 1) * 2 > sim->idcap) {
        size_t cap = sim->idcap ? sim->idcap * 2 : 64;
        uint32_t *t = malloc(cap * sizeof *t);
        if (!t) return AP_ENOMEM;
        memset(t, 0xff, cap * sizeof *t);
        for (uint32_t v = 0; v < sim->nnodes; v++) {
            size_t i = ap_peer_id_hash(&sim->nodes[v]->rt.self) & (cap - 1);
            while (t[i] != SIM_NONE) i = (i + 1) & (cap - 1);
            t[i] = v;
        }
        free(sim->idtab);
        sim->idtab = t;
        sim->idcap = cap;
    }
    size_t mask = sim->idcap - 1;
    size_t i = ap_peer_id_hash(&sim->nodes[node]->rt.self) & mask;
    while (sim->idtab[i] != SIM_NONE) i = (i + 1) & mask;
    sim->idtab[i] = node;
    return 0;
}

/* ---- lifecycle -------------------------------------------------------------- */

ap_sim_t *ap_sim_new(uint64_t seed)
{
    if (sodium_init() < 0) return NULL;
    ap_sim_t *sim = calloc(1, sizeof *sim);
    if (!sim) return NULL;
    sim->seed = seed;
    sim->hash = 0xcbf29ce484222325ull ^ ap__mix64(seed);
    ap__rng_seed(sim->rng, seed ^ 0x6e6574776f726b21ull); /* "network!" */
    ap__slab_init(&sim->timers, sizeof(sim_timer_t));
    ap__slab_init(&sim->posts, sizeof(sim_post_t));
    ap__slab_init(&sim->works, sizeof(sim_work_t));
    ap__slab_init(&sim->calls, sizeof(sim_call_t));
    ap__slab_init(&sim->reqs, sizeof(sim_req_t));
    ap__slab_init(&sim->streams, sizeof(sim_stream_t));
    ap__slab_init(&sim->dials, sizeof(sim_dial_t));
    ap__slab_init(&sim->conns, sizeof(sim_conn_t));
    ap__slab_init(&sim->msgs, sizeof(sim_msg_t));
    ap__slab_init(&sim->notes, sizeof(sim_note_t));
    sim->msgs.zero = offsetof(sim_msg_t, inl); /* the inline payload needs no zeroing */
    sim->deflink = (ap_sim_link_t){.bandwidth_bps = 0, .latency_us = 1000, .jitter_us = 0};
    sim->connect_timeout = 10u * 1000 * 1000;
    sim->epoch_ms = 1735689600000ll; /* 2025-01-01T00:00:00Z */
    pthread_mutex_init(&sim->inbox_mu, NULL);
    atomic_init(&sim->ninbox, 0);
    return sim;
}

void ap_sim_free(ap_sim_t *sim)
{
    if (!sim) return;
    for (uint32_t i = 0; i < sim->msgs.next; i++) {
        if (!slab_used(&sim->msgs, i)) continue;
        sim_msg_t *m = slab_at(&sim->msgs, i);
        if (m->cls != 0) free(m->buf);
    }
    for (int c = 0; c <= BUF_MAX_CLASS; c++) {
        for (uint32_t k = 0; k < sim->nbufs[c]; k++) free(sim->bufs[c][k]);
        free(sim->bufs[c]);
    }
    for (uint32_t i = 0; i < sim->nnodes; i++) {
        ap__rt_fini(&sim->nodes[i]->rt);
        ap__sim_mem_reset(sim->nodes[i]);
        free(sim->nodes[i]);
    }
    free(sim->nodes);
    free(sim->idtab);
    free(sim->heap);
    sim_slab_t *slabs[] = {&sim->timers,  &sim->posts, &sim->works, &sim->calls, &sim->reqs,
                           &sim->streams, &sim->dials, &sim->conns, &sim->msgs,  &sim->notes};
    for (size_t i = 0; i < sizeof slabs / sizeof slabs[0]; i++) ap__slab_free_all(slabs[i]);
    ap__map_free(&sim->conn_map);
    ap__map_free(&sim->link_map);
    free(sim->links);
    for (uint32_t q = 0; q < sim->ntqs; q++) free(sim->tqs[q].ring);
    free(sim->inbox);
    pthread_mutex_destroy(&sim->inbox_mu);
    free(sim);
}

static void node_key_seed(const ap_sim_t *sim, uint32_t idx, uint8_t out[32])
{
    uint8_t in[32] = "apiary-sim-node-key/v1";
    for (int i = 0; i < 8; i++) in[22 + i] = (uint8_t)(sim->seed >> (8 * i));
    in[30] = (uint8_t)idx;
    in[31] = (uint8_t)(idx >> 8);
    uint8_t key[8];
    for (int i = 0; i < 4; i++) key[i] = (uint8_t)(idx >> (8 * i));
    memcpy(key + 4, "node", 4);
    crypto_generichash(out, 32, in, sizeof in, key, sizeof key);
}

static uint64_t node_rng_seed(const ap_sim_t *sim, uint32_t idx, uint32_t inc)
{
    return ap__mix64(sim->seed ^ ap__mix64(((uint64_t)idx << 32) | inc) ^ 0x6e6f646572616e64ull);
}

static void node_reset_lists(sim_node_t *n)
{
    n->conns = n->calls = n->streams = n->dials = n->works = SIM_NONE;
    n->out_active = n->in_active = SIM_NONE;
    n->n_up = n->n_down = 0;
}

static int node_boot(ap_sim_t *sim, sim_node_t *n)
{
    uint8_t seed[32];
    node_key_seed(sim, n->idx, seed);
    int rc = ap__rt_init(&n->rt, &ap__sim_ops, seed, node_rng_seed(sim, n->idx, n->inc));
    sodium_memzero(seed, sizeof seed);
    return rc;
}

int ap_sim_add_node(ap_sim_t *sim, const ap_sim_node_opts_t *opts)
{
    if (sim->nnodes >= (1u << 24)) return AP_ELIMIT;
    if (sim->nnodes == sim->capnodes) {
        uint32_t cap = sim->capnodes ? sim->capnodes * 2 : 16;
        sim_node_t **nn = realloc(sim->nodes, cap * sizeof *nn);
        if (!nn) return AP_ENOMEM;
        sim->nodes = nn;
        sim->capnodes = cap;
    }
    sim_node_t *n = calloc(1, sizeof *n);
    if (!n) return AP_ENOMEM;
    n->sim = sim;
    n->idx = sim->nnodes;
    int rc = node_boot(sim, n);
    if (rc != 0) {
        free(n);
        return rc;
    }
    n->alive = true;
    node_reset_lists(n);
    n->mem_node = SIM_MEM_NODE;
    n->mem_peer = SIM_MEM_PEER;
    if (opts) {
        n->up_bps = opts->up_bps;
        n->down_bps = opts->down_bps;
        n->skew_ms = opts->skew_ms;
        n->flops = opts->flops;
        n->on_crash = opts->on_crash;
        n->on_restart = opts->on_restart;
        n->hook_arg = opts->hook_arg;
    }
    sim->nodes[sim->nnodes] = n;
    rc = idtab_insert(sim, n->idx);
    if (rc != 0) {
        ap__rt_fini(&n->rt);
        free(n);
        return rc;
    }
    sim->nnodes++;
    return (int)n->idx;
}

int ap_sim_node_count(const ap_sim_t *sim)
{
    return (int)sim->nnodes;
}

static sim_node_t *get_node(ap_sim_t *sim, int i)
{
    if (i < 0 || (uint32_t)i >= sim->nnodes) return NULL;
    return sim->nodes[i];
}

ap_rt_t *ap_sim_node(ap_sim_t *sim, int i)
{
    sim_node_t *n = get_node(sim, i);
    return n && n->alive ? &n->rt : NULL;
}

const ap_peer_id_t *ap_sim_peer_id(ap_sim_t *sim, int i)
{
    sim_node_t *n = get_node(sim, i);
    return n ? &n->rt.self : NULL;
}

int ap_sim_find_peer(ap_sim_t *sim, const ap_peer_id_t *id)
{
    return ap__sim_lookup(sim, id);
}

int ap_sim_node_index(ap_sim_t *sim, const ap_rt_t *rt)
{
    if (!rt || rt->ops != &ap__sim_ops) return -1;
    const sim_node_t *n = (const sim_node_t *)rt;
    return n->sim == sim ? (int)n->idx : -1;
}

bool ap_sim_is_up(ap_sim_t *sim, int i)
{
    sim_node_t *n = get_node(sim, i);
    return n && n->alive;
}

/* ---- topology --------------------------------------------------------------- */

void ap_sim_set_default_link(ap_sim_t *sim, const ap_sim_link_t *link)
{
    sim->deflink = *link;
    for (uint32_t i = 0; i < sim->nnodes; i++) ap__conn_rates_changed(sim, i);
}

int ap_sim_set_link(ap_sim_t *sim, int a, int b, const ap_sim_link_t *a_to_b)
{
    if (!get_node(sim, a) || !get_node(sim, b) || a == b || !a_to_b) return AP_EINVAL;
    uint64_t key = ((uint64_t)a << 32) | (uint32_t)b;
    uint32_t li = ap__map_get(&sim->link_map, key);
    if (li == SIM_NONE) {
        if (sim->nlinks == sim->caplinks) {
            uint32_t cap = sim->caplinks ? sim->caplinks * 2 : 16;
            ap_sim_link_t *l = realloc(sim->links, cap * sizeof *l);
            if (!l) return AP_ENOMEM;
            sim->links = l;
            sim->caplinks = cap;
        }
        li = sim->nlinks;
        if (ap__map_put(&sim->link_map, key, li) != 0) return AP_ENOMEM;
        sim->nlinks++;
    }
    sim->links[li] = *a_to_b;
    ap__conn_link_changed(sim, (uint32_t)a, (uint32_t)b, li);
    return 0;
}

int ap_sim_set_node_bw(ap_sim_t *sim, int i, uint64_t up_bps, uint64_t down_bps)
{
    sim_node_t *n = get_node(sim, i);
    if (!n) return AP_EINVAL;
    n->up_bps = up_bps;
    n->down_bps = down_bps;
    ap__conn_rates_changed(sim, (uint32_t)i);
    return 0;
}

int ap_sim_set_skew(ap_sim_t *sim, int i, int64_t skew_ms)
{
    sim_node_t *n = get_node(sim, i);
    if (!n) return AP_EINVAL;
    n->skew_ms = skew_ms;
    return 0;
}

int ap_sim_set_flops(ap_sim_t *sim, int i, double flops)
{
    sim_node_t *n = get_node(sim, i);
    if (!n || !(flops >= 0)) return AP_EINVAL;
    n->flops = flops;
    n->cfn = NULL;
    return 0;
}

int ap_sim_set_compute(ap_sim_t *sim, int i, ap_sim_compute_fn fn, void *arg)
{
    sim_node_t *n = get_node(sim, i);
    if (!n) return AP_EINVAL;
    n->cfn = fn;
    n->carg = arg;
    return 0;
}

int ap_sim_set_memory(ap_sim_t *sim, int i, uint64_t node_bytes, uint64_t peer_bytes)
{
    sim_node_t *n = get_node(sim, i);
    if (!n) return AP_EINVAL;
    if (n->mem_held) return AP_ESTATE;
    ap__sim_mem_reset(n);
    n->mem_node = node_bytes;
    n->mem_peer = peer_bytes;
    return 0;
}

uint64_t ap_sim_memory_held(ap_sim_t *sim, int i)
{
    sim_node_t *n = get_node(sim, i);
    return n ? n->mem_held : 0;
}

int ap_sim_set_hooks(ap_sim_t *sim, int i, ap_sim_node_fn on_crash, ap_sim_node_fn on_restart,
                     void *arg)
{
    sim_node_t *n = get_node(sim, i);
    if (!n) return AP_EINVAL;
    n->on_crash = on_crash;
    n->on_restart = on_restart;
    n->hook_arg = arg;
    return 0;
}

void ap_sim_set_connect_timeout(ap_sim_t *sim, uint64_t us)
{
    sim->connect_timeout = us ? us : 1;
}
void ap_sim_set_idle_timeout(ap_sim_t *sim, uint64_t us)
{
    sim->idle_timeout = us;
    sim->idle_gen = 0; /* cancels a pending sweep */
    if (!us) return;
    sim->idle_gen = ++sim->xgen ? sim->xgen : ++sim->xgen;
    ap__sim_push(sim, sim->now + us / 2 + 1, EV_IDLE, 0, sim->idle_gen);
}

void ap_sim_set_epoch_ms(ap_sim_t *sim, int64_t epoch_ms)
{
    sim->epoch_ms = epoch_ms;
}

/* ---- faults ----------------------------------------------------------------- */

int ap_sim_partition(ap_sim_t *sim, const int *group_of_node)
{
    if (!group_of_node) return AP_EINVAL;
    for (uint32_t i = 0; i < sim->nnodes; i++) sim->nodes[i]->group = group_of_node[i];
    for (uint32_t ci = 0; ci < sim->conns.next; ci++) {
        if (!slab_used(&sim->conns, ci)) continue;
        sim_conn_t *c = slab_at(&sim->conns, ci);
        if (sim->nodes[c->node[0]]->group != sim->nodes[c->node[1]]->group)
            ap__conn_teardown(sim, ci);
    }
    ap__sim_trace(sim, 0xf0, 0, 0);
    return 0;
}

void ap_sim_heal(ap_sim_t *sim)
{
    for (uint32_t i = 0; i < sim->nnodes; i++) sim->nodes[i]->group = 0;
    ap__sim_trace(sim, 0xf1, 0, 0);
}

int ap_sim_crash(ap_sim_t *sim, int i)
{
    sim_node_t *n = get_node(sim, i);
    if (!n) return AP_EINVAL;
    if (!n->alive) return AP_ESTATE;
    n->alive = false;
    n->inc++; /* timers and posts of the old incarnation are dropped when due */
    ap__sim_trace(sim, 0xf2, n->idx, 0);
    while (n->conns != SIM_NONE) ap__conn_teardown(sim, n->conns);
    ap__node_flush(sim, n);
    if (n->on_crash) n->on_crash(sim, i, &n->rt, n->hook_arg);
    ap__node_flush(sim, n); /* anything the hook left behind */
    ap__rt_fini(&n->rt);
    ap__sim_mem_reset(n);
    memset(&n->st, 0, sizeof n->st);
    n->busy_until = sim->now;
    ap_info("sim", "node %d crashed at %llu us", i, (unsigned long long)sim->now);
    return 0;
}

int ap_sim_restart(ap_sim_t *sim, int i)
{
    sim_node_t *n = get_node(sim, i);
    if (!n) return AP_EINVAL;
    if (n->alive) return AP_ESTATE;
    ap__node_flush(sim, n); /* e.g. streams reserved on it while it was down */
    ap__rt_fini(&n->rt);
    n->inc++;
    int rc = node_boot(sim, n);
    if (rc != 0) return rc;
    n->alive = true;
    n->busy_until = sim->now;
    ap__sim_trace(sim, 0xf3, n->idx, 0);
    ap_info("sim", "node %d restarted at %llu us", i, (unsigned long long)sim->now);
    if (n->on_restart) n->on_restart(sim, i, &n->rt, n->hook_arg);
    return 0;
}

int ap_sim_schedule(ap_sim_t *sim, int i, uint64_t at_us, bool restart)
{
    if (!get_node(sim, i)) return AP_EINVAL;
    if (at_us < sim->now) at_us = sim->now;
    ap__sim_push(sim, at_us, restart ? EV_RESTART : EV_CRASH, (uint32_t)i, 0);
    return 0;
}

/* ---- running -------------------------------------------------------------- */

static void drain_inbox(ap_sim_t *sim)
{
    if (atomic_load_explicit(&sim->ninbox, memory_order_acquire) == 0) return;
    pthread_mutex_lock(&sim->inbox_mu);
    size_t n = atomic_load(&sim->ninbox);
    for (size_t k = 0; k < n; k++) {
        sim_inbox_item_t *it = &sim->inbox[k];
        sim_node_t *node = sim->nodes[it->node];
        uint32_t pi = ap__slab_alloc(&sim->posts);
        if (pi == SIM_NONE) {
            ap_error("sim", "out of memory queueing a post; dropped");
            continue;
        }
        sim_post_t *p = slab_at(&sim->posts, pi);
        p->node = it->node;
        p->inc = node->inc;
        p->fn = it->fn;
        p->arg = it->arg;
        ap__sim_push(sim, sim->now, EV_POST, pi, slab_gen(&sim->posts, pi));
    }
    atomic_store(&sim->ninbox, 0);
    pthread_mutex_unlock(&sim->inbox_mu);
}

int ap__sim_post(ap_sim_t *sim, uint32_t node, ap_post_fn fn, void *arg);
int ap__sim_post(ap_sim_t *sim, uint32_t node, ap_post_fn fn, void *arg)
{
    pthread_mutex_lock(&sim->inbox_mu);
    size_t n = atomic_load(&sim->ninbox);
    if (n == sim->ninbox_cap) {
        size_t cap = n ? n * 2 : 64;
        sim_inbox_item_t *in = realloc(sim->inbox, cap * sizeof *in);
        if (!in) {
            pthread_mutex_unlock(&sim->inbox_mu);
            return AP_ENOMEM;
        }
        sim->inbox = in;
        sim->ninbox_cap = cap;
    }
    sim->inbox[n] = (sim_inbox_item_t){.node = node, .fn = fn, .arg = arg};
    atomic_store_explicit(&sim->ninbox, n + 1, memory_order_release);
    pthread_mutex_unlock(&sim->inbox_mu);
    return 0;
}

static void ev_timer(ap_sim_t *sim, const sim_ev_t *e)
{
    sim_timer_t *t = slab_at(&sim->timers, e->idx);
    sim_node_t *n = sim->nodes[t->node];
    ap__sim_trace(sim, EV_TIMER, t->node, 0);
    if (!n->alive || t->inc != n->inc) {
        ap__slab_release(&sim->timers, e->idx);
        return;
    }
    ap_timer_fn cb = t->cb;
    void *arg = t->arg;
    if (t->period)
        ap__sim_push(sim, sim->now + t->period, EV_TIMER, e->idx, e->gen);
    else
        ap__slab_release(&sim->timers, e->idx);
    cb(&n->rt, arg);
}

static void ev_post(ap_sim_t *sim, const sim_ev_t *e)
{
    sim_post_t *p = slab_at(&sim->posts, e->idx);
    sim_node_t *n = sim->nodes[p->node];
    ap_post_fn fn = p->fn;
    void *arg = p->arg;
    bool run = n->alive && p->inc == n->inc;
    ap__slab_release(&sim->posts, e->idx);
    ap__sim_trace(sim, EV_POST, n->idx, 0);
    if (run) fn(&n->rt, arg);
}

static void ev_work(ap_sim_t *sim, const sim_ev_t *e)
{
    sim_work_t *w = slab_at(&sim->works, e->idx);
    sim_node_t *n = sim->nodes[w->node];
    ap_after_work_fn after = w->after;
    void *arg = w->arg;
    ap__list_remove(&sim->works, offsetof(sim_work_t, prev), &n->works, e->idx);
    ap__slab_release(&sim->works, e->idx);
    ap__sim_trace(sim, EV_WORK, n->idx, 0);
    if (after) after(&n->rt, arg, 0);
}

/* ---- deadline queues ------------------------------------------------------ */

static void process(ap_sim_t *sim, const sim_ev_t *e);

static inline sim_ev_t tq_ev(const sim_tq_ent_t *x)
{
    return (sim_ev_t){.t = x->t, .seqk = x->kind, .idx = x->idx, .gen = x->gen};
}

/* Drops cancelled entries at the head, then arms an EV_TQ for the new head. */
static void tq_arm(ap_sim_t *sim, uint32_t q)
{
    sim_tq_t *tq = &sim->tqs[q];
    while (tq->len) {
        sim_ev_t e = tq_ev(&tq->ring[tq->head]);
        if (ev_valid(sim, &e)) break;
        tq->head = (tq->head + 1) & (tq->cap - 1);
        tq->len--;
    }
    tq->armed_gen = 0;
    if (!tq->len) return;
    tq->armed_gen = ++sim->tq_gen ? sim->tq_gen : ++sim->tq_gen;
    ap__sim_push(sim, tq->ring[tq->head].t, EV_TQ, q, tq->armed_gen);
}

static void tq_fire(ap_sim_t *sim, uint32_t q)
{
    sim_tq_t *tq = &sim->tqs[q];
    tq->armed_gen = 0;
    if (!tq->len || tq->ring[tq->head].t > sim->now) { /* head was cancelled: later one */
        tq_arm(sim, q);
        return;
    }
    sim_tq_ent_t x = tq->ring[tq->head];
    tq->head = (tq->head + 1) & (tq->cap - 1);
    tq->len--;
    tq->armed_gen = 0;
    sim_ev_t e = tq_ev(&x);
    bool live = ev_valid(sim, &e);
    if (live) process(sim, &e);
    if (!tq->armed_gen) tq_arm(sim, q); /* process may have armed it already */
}

/* Squeezes out cancelled entries; grows the ring if it stays over half full. */
static int tq_make_room(ap_sim_t *sim, sim_tq_t *tq)
{
    uint32_t n = 0;
    for (uint32_t k = 0; k < tq->len; k++) {
        sim_tq_ent_t x = tq->ring[(tq->head + k) & (tq->cap - 1)];
        sim_ev_t e = tq_ev(&x);
        if (ev_valid(sim, &e)) tq->ring[(tq->head + n++) & (tq->cap - 1)] = x;
    }
    tq->len = n;
    if (n * 2 <= tq->cap && tq->cap) return 0;
    uint32_t cap = tq->cap ? tq->cap * 2 : 256;
    sim_tq_ent_t *r = malloc((size_t)cap * sizeof *r);
    if (!r) return AP_ENOMEM;
    for (uint32_t k = 0; k < n; k++) r[k] = tq->ring[(tq->head + k) & (tq->cap - 1)];
    free(tq->ring);
    tq->ring = r;
    tq->cap = cap;
    tq->head = 0;
    return 0;
}

bool ap__sim_deadline(ap_sim_t *sim, uint64_t dur, uint8_t kind, uint32_t idx, uint32_t gen)
{
    uint64_t t = sim->now + dur < sim->now ? UINT64_MAX : sim->now + dur;
    uint32_t q = 0;
    while (q < sim->ntqs && sim->tqs[q].dur != dur) q++;
    if (q == sim->ntqs) {
        if (sim->ntqs == SIM_TQ_MAX) goto heap;
        sim->tqs[sim->ntqs++] = (sim_tq_t){.dur = dur};
    }
    sim_tq_t *tq = &sim->tqs[q];
    if (tq->len == tq->cap) {
        bool was_armed = tq->armed_gen != 0;
        if (tq_make_room(sim, tq) != 0) goto heap;
        if (was_armed && !tq->len) tq->armed_gen = 0; /* its head was cancelled */
        if (was_armed && tq->len) tq_arm(sim, q);     /* head may have moved */
    }
    tq->ring[(tq->head + tq->len) & (tq->cap - 1)] =
        (sim_tq_ent_t){.t = t, .idx = idx, .gen = gen, .kind = kind};
    tq->len++;
    if (!tq->armed_gen) tq_arm(sim, q);
    return false;
heap:
    ap__sim_push(sim, t, kind, idx, gen);
    return true;
}

static void process(ap_sim_t *sim, const sim_ev_t *e)
{
    switch (ev_kind(e)) {
    case EV_TIMER:
        ev_timer(sim, e);
        break;
    case EV_POST:
        ev_post(sim, e);
        break;
    case EV_WORK:
        ev_work(sim, e);
        break;
    case EV_DELIVER:
        ap__ev_deliver(sim, e->idx);
        break;
    case EV_XMIT:
        ap__ev_xmit(sim, e->idx, e->gen);
        break;
    case EV_CALL_TIMEOUT:
    case EV_CALL_FAIL: {
        sim_call_t *c = slab_at(&sim->calls, e->idx);
        ap__sim_trace(sim, ev_kind(e), c->node, 0);
        ap__call_complete(sim, e->idx, ev_kind(e) == EV_CALL_FAIL ? c->status : AP_ETIMEDOUT, NULL,
                          0, NULL);
        break;
    }
    case EV_STREAM_TIMEOUT: {
        sim_stream_t *s = slab_at(&sim->streams, e->idx);
        ap__sim_trace(sim, ev_kind(e), s->node, 0);
        ap__stream_send_reset(sim, s, AP_ERESET);
        ap__stream_finish(sim, e->idx, AP_ETIMEDOUT);
        break;
    }
    case EV_STREAM_CLOSE: {
        sim_stream_t *s = slab_at(&sim->streams, e->idx);
        ap__sim_trace(sim, ev_kind(e), s->node, 0);
        ap__stream_finish(sim, e->idx, s->close_status);
        break;
    }
    case EV_STREAM_DRAIN:
        ap__stream_drain(sim, e->idx, e->gen);
        break;
    case EV_DIAL_TIMEOUT:
    case EV_DIAL_DONE: {
        sim_dial_t *d = slab_at(&sim->dials, e->idx);
        ap__sim_trace(sim, ev_kind(e), d->node, 0);
        ap__dial_complete(sim, e->idx, ev_kind(e) == EV_DIAL_DONE ? d->status : AP_ETIMEDOUT);
        break;
    }
    case EV_CONN_TIMEOUT:
        ap__ev_conn_timeout(sim, e->idx, e->gen);
        break;
    case EV_NOTE:
        ap__ev_note(sim, e->idx);
        break;
    case EV_SYN_RETRY:
        ap__ev_syn_retry(sim, e->idx);
        break;
    case EV_TQ:
        tq_fire(sim, e->idx);
        break;
    case EV_CRASH:
        if (ap_sim_crash(sim, (int)e->idx) != 0)
            ap__sim_trace(sim, EV_CRASH, e->idx, 1); /* was down already */
        break;
    case EV_IDLE:
        ap__ev_idle(sim);
        break;
    case EV_RESTART:
        if (ap_sim_restart(sim, (int)e->idx) != 0) ap__sim_trace(sim, EV_RESTART, e->idx, 1);
        break;
    default:
        break;
    }
}

/* Processes the next live event due at or before limit. */
static bool step_limit(ap_sim_t *sim, uint64_t limit)
{
    drain_inbox(sim);
    while (sim->nheap) {
        if (sim->heap[0].t > limit) return false;
        sim_ev_t e = heap_pop(sim);
        if (!ev_valid(sim, &e)) {
            if (sim->nstale) sim->nstale--;
            continue;
        }
        if (e.t > sim->now) sim->now = e.t;
        sim->stats.events++;
        process(sim, &e);
        return true;
    }
    return false;
}

bool ap_sim_step(ap_sim_t *sim)
{
    return step_limit(sim, UINT64_MAX);
}

bool ap_sim_run_until(ap_sim_t *sim, ap_sim_pred_fn pred, void *arg, uint64_t deadline_us)
{
    if (pred && pred(arg)) return true;
    while (step_limit(sim, deadline_us))
        if (pred && pred(arg)) return true;
    if (sim->now < deadline_us && deadline_us != UINT64_MAX) sim->now = deadline_us;
    return false;
}

void ap_sim_run_for(ap_sim_t *sim, uint64_t us)
{
    uint64_t d = sim->now + us < sim->now ? UINT64_MAX : sim->now + us;
    ap_sim_run_until(sim, NULL, NULL, d);
}

uint64_t ap_sim_now_us(const ap_sim_t *sim)
{
    return sim->now;
}
uint64_t ap_sim_trace_hash(const ap_sim_t *sim)
{
    return sim->hash;
}

void ap_sim_get_stats(const ap_sim_t *sim, ap_sim_stats_t *out)
{
    *out = sim->stats;
    out->pending_events = sim->nheap;
    out->connections = sim->conns.live;
}
