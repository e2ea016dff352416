/* Simulator internals shared by sim_core.c (event loop, slabs, topology,
 * faults), sim_net.c (connections, flows, messages) and sim_rt.c (the
 * ap_rt_ops_t of a sim node). See docs/simulator.md. */
#ifndef AP_RUNTIME_SIM_IMPL_H
#define AP_RUNTIME_SIM_IMPL_H

#include "apiary/sim.h"
#include "base/u64map.h"
#include "runtime/rt_impl.h"

#include <pthread.h>
#include <stdatomic.h>

#define SIM_NONE UINT32_MAX
/* An unanswered SYN is sent again after this long (TCP's initial RTO). */
#define SIM_SYN_RETRY_US 1000000u
/* ap_rt_mem_reserve's default limits, as ap_node_limits_default's */
#define SIM_MEM_NODE (256ull << 20)
#define SIM_MEM_PEER (64ull << 20)

/* ---- slab: stable storage with generation-checked indexes ---------------
 * Elements never move (chunked), so pointers handed to users (ap_stream_t,
 * ap_rpc_req_t) stay valid until freed. gen is odd while a slot is in use;
 * (index, gen) names one allocation forever. Free slots are reused LIFO,
 * which is deterministic. */
#define SLAB_SHIFT 9
#define SLAB_CHUNK (1u << SLAB_SHIFT)

typedef struct sim_slab {
    size_t esz;
    size_t zero; /* bytes zeroed on allocation (a prefix of the element) */
    uint8_t **chunks;
    uint32_t **gens;
    uint32_t nchunks;
    uint32_t *freel;
    uint32_t nfree;
    uint32_t next; /* first never-used index */
    uint32_t live;
} sim_slab_t;

static inline void *slab_at(const sim_slab_t *s, uint32_t i)
{
    return s->chunks[i >> SLAB_SHIFT] + (size_t)(i & (SLAB_CHUNK - 1)) * s->esz;
}
static inline uint32_t slab_gen(const sim_slab_t *s, uint32_t i)
{
    return s->gens[i >> SLAB_SHIFT][i & (SLAB_CHUNK - 1)];
}
static inline bool slab_live(const sim_slab_t *s, uint32_t i, uint32_t gen)
{
    return i < s->next && slab_gen(s, i) == gen && (gen & 1u);
}
static inline bool slab_used(const sim_slab_t *s, uint32_t i)
{
    return i < s->next && (slab_gen(s, i) & 1u);
}
void ap__slab_init(sim_slab_t *s, size_t esz);
void ap__slab_free_all(sim_slab_t *s);
/* Returns a zeroed slot's index, or SIM_NONE if out of memory. */
uint32_t ap__slab_alloc(sim_slab_t *s);
void ap__slab_release(sim_slab_t *s, uint32_t i);

/* Handle ids: generation in the high half, index + 1 in the low half. */
static inline uint64_t sim_mkid(uint32_t idx, uint32_t gen)
{
    return ((uint64_t)gen << 32) | (uint64_t)(idx + 1u);
}
static inline bool sim_unid(uint64_t id, uint32_t *idx, uint32_t *gen)
{
    uint32_t lo = (uint32_t)id;
    if (lo == 0) return false;
    *idx = lo - 1;
    *gen = (uint32_t)(id >> 32);
    return true;
}

/* ---- u64 -> index map (base/u64map.h); SIM_NONE when absent ------------- */
typedef ap_u64map_t sim_map_t;

static inline uint32_t ap__map_get(const sim_map_t *m, uint64_t key)
{
    uint64_t v;
    return ap__u64map_get(m, key, &v) ? (uint32_t)v : SIM_NONE;
}
static inline int ap__map_put(sim_map_t *m, uint64_t key, uint32_t val)
{
    return ap__u64map_put(m, key, val);
}
static inline void ap__map_del(sim_map_t *m, uint64_t key)
{
    ap__u64map_del(m, key, NULL);
}
static inline void ap__map_free(sim_map_t *m)
{
    ap__u64map_free(m);
}

/* ---- events ------------------------------------------------------------- */
enum {
    EV_TIMER = 1,
    EV_POST,
    EV_WORK,
    EV_DELIVER,
    EV_XMIT,
    EV_CALL_TIMEOUT,
    EV_CALL_FAIL,
    EV_STREAM_TIMEOUT,
    EV_STREAM_CLOSE,
    EV_STREAM_DRAIN,
    EV_DIAL_TIMEOUT,
    EV_DIAL_DONE,
    EV_CONN_TIMEOUT,
    EV_NOTE,
    EV_SYN_RETRY,
    EV_TQ,      /* head of a deadline queue is due */
    EV_CRASH,   /* scheduled ap_sim_crash (idx = node) */
    EV_RESTART, /* scheduled ap_sim_restart (idx = node) */
    EV_IDLE,    /* idle-connection sweep */
};

typedef struct sim_ev {
    uint64_t t;
    uint64_t seqk; /* insertion order << 8 | kind: ties at equal t are FIFO */
    uint32_t idx;
    uint32_t gen;
} sim_ev_t; /* 24 bytes */

static inline uint8_t ev_kind(const sim_ev_t *e)
{
    return (uint8_t)e->seqk;
}

/* ---- messages ------------------------------------------------------------ */
enum {
    M_SYN = 1,
    M_SYNACK,
    M_REFUSED,
    M_REQ,
    M_RESP,
    M_OPEN,
    M_ACCEPT,
    M_REFUSE,
    M_DATA,
    M_END,
    M_RESET,
    M_CREDIT,
};

#define MSG_INLINE 80

typedef struct sim_msg {
    uint32_t next; /* FIFO link */
    uint8_t kind;
    uint8_t from; /* sending side of the connection (0/1) */
    uint8_t cls;  /* buffer class: 0 inline, 255 plain malloc, else pool class */
    uint8_t pad;
    uint32_t conn, conn_gen;
    uint32_t dst, dst_gen; /* target call / stream */
    uint32_t src, src_gen; /* originating call / stream */
    int32_t status;
    uint32_t aux_len; /* bytes of aux text (proto or errmsg, incl. NUL) */
    uint64_t len;     /* payload bytes (after aux); credit amount for M_CREDIT */
    uint8_t *buf;     /* aux || payload */
    uint8_t inl[MSG_INLINE];
} sim_msg_t;

#define BUF_MIN_CLASS 7           /* 128 B */
#define BUF_MAX_CLASS 23          /* 8 MiB */
#define BUF_CACHE_MAX (64u << 20) /* bytes of free buffers kept for reuse */

/* ---- connections and flows --------------------------------------------- */
typedef struct sim_dir {
    uint32_t qh, qt;       /* messages waiting to be transmitted */
    uint32_t oprev, onext; /* sender's active out-flow list */
    uint32_t iprev, inext; /* receiver's active in-flow list */
    uint32_t link;         /* index into sim->links, SIM_NONE = default */
    uint32_t xgen;         /* generation of the pending EV_XMIT */
    uint64_t rate;         /* bits/s while active */
    uint64_t rem;          /* head message: bits * 1e6 still to send */
    uint64_t last;         /* when rem was last settled */
    uint64_t last_arrival; /* FIFO: no message may arrive before this */
    uint8_t active;        /* transmitting under the bandwidth model */
    uint8_t scheduled;     /* an EV_XMIT is pending */
} sim_dir_t;

typedef struct sim_conn {
    uint32_t node[2];            /* node[0] < node[1]; dir[d] carries node[d] -> node[d^1] */
    uint32_t lprev[2], lnext[2]; /* per-node connection lists */
    uint32_t users;              /* calls, requests, streams, dials bound to it */
    uint64_t last_used;          /* last send or delivery */
    uint8_t up[2];               /* side s has completed the handshake */
    uint8_t syn_side;            /* side that started the handshake */
    sim_dir_t dir[2];
} sim_conn_t;

/* ---- per-node operations ------------------------------------------------- */
typedef struct sim_timer {
    uint32_t node, inc;
    uint64_t period;
    ap_timer_fn cb;
    void *arg;
} sim_timer_t;

typedef struct sim_post {
    uint32_t node, inc;
    ap_post_fn fn;
    void *arg;
} sim_post_t;

typedef struct sim_work {
    uint32_t node, prev, next;
    ap_after_work_fn after;
    void *arg;
} sim_work_t;

typedef struct sim_call {
    uint32_t node, prev, next;
    uint32_t peer, conn, conn_gen;
    int status; /* for EV_CALL_FAIL */
    bool heap_deadline;
    size_t max_resp;
    ap_rpc_done_fn done;
    void *arg;
} sim_call_t;

typedef struct sim_req {
    struct ap_rpc_req r; /* must be first */
    uint32_t self, node, inc;
    uint32_t conn, conn_gen;
    uint32_t call, call_gen;
    uint32_t msg;
    uint8_t side;
} sim_req_t;

typedef struct sim_stream {
    struct ap_stream s; /* must be first */
    uint32_t self, node, prev, next;
    uint32_t conn, conn_gen;
    uint32_t peer_slot, peer_gen;
    uint32_t rq_head, rq_tail; /* received messages held while paused */
    uint64_t buffered;         /* sent, not yet credited by the receiver */
    int close_status;
    uint8_t side;
    bool visible;  /* acceptor: the OPEN was delivered */
    bool accepted; /* opener: ACCEPT received; acceptor: always */
    bool local_closed, remote_ended, closed, paused, want_writable;
} sim_stream_t;

typedef struct sim_dial {
    uint32_t node, prev, next;
    uint32_t target, conn, conn_gen;
    int status;
    bool has_expect;
    ap_peer_id_t expect;
    ap_dial_fn cb;
    void *arg;
} sim_dial_t;

/* Deferred "connection gone" notice for one side. */
typedef struct sim_note {
    uint32_t node, inc, conn, conn_gen, peer;
    bool was_up;
} sim_note_t;

/* ---- nodes ------------------------------------------------------------- */
typedef struct sim_node {
    struct ap_rt rt; /* must be first */
    ap_sim_t *sim;
    uint32_t idx, inc;
    bool alive;
    int group;
    int64_t skew_ms;
    uint64_t up_bps, down_bps;
    double flops;
    ap_sim_compute_fn cfn;
    void *carg;
    uint64_t busy_until;
    ap_sim_node_fn on_crash, on_restart;
    void *hook_arg;
    uint32_t conns; /* list heads */
    uint32_t calls, streams, dials, works;
    uint32_t out_active, in_active; /* flow ids (conn * 2 + dir) */
    uint32_t n_up, n_down;
    ap_rt_stats_t st;
    /* ap_rt_mem_reserve (sim_rt.c): limits, the manager (made on first use,
     * dropped at a crash with the process's memory), bytes held */
    uint64_t mem_node, mem_peer, mem_held;
    struct ap_rcmgr *rc;
} sim_node_t;

/* Deadline queues. Most deadlines (call timeouts, connect timeouts) use a
 * handful of fixed durations, and now + d is non-decreasing for a fixed d:
 * so one FIFO per duration is already sorted, and only its head needs a
 * place in the heap. Cancelled entries are skipped when they reach the head
 * and squeezed out when the ring fills. */
#define SIM_TQ_MAX 8

typedef struct sim_tq_ent {
    uint64_t t;
    uint32_t idx, gen;
    uint8_t kind;
} sim_tq_ent_t;

typedef struct sim_tq {
    uint64_t dur;
    sim_tq_ent_t *ring;
    uint32_t cap, head, len; /* cap is a power of two */
    uint32_t armed_gen;      /* gen of the pending EV_TQ, 0 = none */
} sim_tq_t;

typedef struct sim_inbox_item {
    uint32_t node;
    ap_post_fn fn;
    void *arg;
} sim_inbox_item_t;

struct ap_sim {
    uint64_t seed;
    uint64_t now;
    uint64_t seq;
    uint64_t hash;
    uint64_t rng[4]; /* network randomness (jitter) */
    uint32_t xgen;
    sim_ev_t *heap;
    size_t nheap, capheap, nstale;
    sim_node_t **nodes;
    uint32_t nnodes, capnodes;
    uint32_t *idtab; /* PeerID -> node, open addressing */
    size_t idcap;
    sim_slab_t timers, posts, works, calls, reqs, streams, dials, conns, msgs, notes;
    sim_map_t conn_map; /* (lo << 32 | hi) -> conn */
    sim_map_t link_map; /* (a << 32 | b) -> links[] */
    ap_sim_link_t *links;
    uint32_t nlinks, caplinks;
    ap_sim_link_t deflink;
    uint64_t connect_timeout;
    uint64_t idle_timeout; /* 0 = connections are never closed for idleness */
    uint32_t idle_gen;     /* gen of the pending EV_IDLE, 0 = none */
    int64_t epoch_ms;
    void **bufs[BUF_MAX_CLASS + 1]; /* free buffers per size class */
    uint32_t nbufs[BUF_MAX_CLASS + 1], capbufs[BUF_MAX_CLASS + 1];
    size_t buf_cached;
    ap_sim_stats_t stats;
    sim_tq_t tqs[SIM_TQ_MAX];
    uint32_t ntqs, tq_gen;
    pthread_mutex_t inbox_mu;
    sim_inbox_item_t *inbox;
    size_t ninbox_cap;
    atomic_size_t ninbox;
};

extern const ap_rt_ops_t ap__sim_ops;
/* Drops node n's memory reservations (crash, restart, free). */
void ap__sim_mem_reset(sim_node_t *n);

static inline sim_node_t *sim_node_of(ap_rt_t *rt)
{
    return (sim_node_t *)rt;
}

/* core */
void ap__sim_push(ap_sim_t *sim, uint64_t t, uint8_t kind, uint32_t idx, uint32_t gen);
static inline void sim_stale(ap_sim_t *sim)
{
    sim->nstale++;
}
/* Schedules a cancellable deadline event (kind, idx, gen) at now + dur,
 * through a deadline queue when possible. Returns true if it went to the
 * heap instead (then cancelling it should count as stale). */
bool ap__sim_deadline(ap_sim_t *sim, uint64_t dur, uint8_t kind, uint32_t idx, uint32_t gen);
uint64_t ap__sim_rand_below(ap_sim_t *sim, uint64_t n);
int ap__sim_lookup(ap_sim_t *sim, const ap_peer_id_t *id); /* node index or -1 */
/* Folds one processed event into the trace hash. */
static inline void ap__sim_trace(ap_sim_t *sim, uint8_t kind, uint32_t node, uint64_t size)
{
    uint64_t h = sim->hash;
    h = (h ^ sim->now) * 0x100000001b3ull;
    h = (h ^ ((uint64_t)kind | (uint64_t)node << 8)) * 0x9e3779b97f4a7c15ull;
    h = (h ^ size) * 0x100000001b3ull;
    sim->hash = h ^ (h >> 29);
}

/* intrusive lists over slab elements: links at byte offset off (prev, next) */
void ap__list_push(sim_slab_t *s, size_t off, uint32_t *head, uint32_t i);
void ap__list_remove(sim_slab_t *s, size_t off, uint32_t *head, uint32_t i);

/* net */
sim_msg_t *ap__msg_new(ap_sim_t *sim, uint8_t kind, const void *aux, size_t aux_len,
                       const void *data, size_t len, uint32_t *idx_out);
void ap__msg_release(ap_sim_t *sim, uint32_t idx);
/* Connection from a to b, created (handshake started) if needed. SIM_NONE on
 * out of memory. */
uint32_t ap__conn_get(ap_sim_t *sim, uint32_t a, uint32_t b);
static inline uint8_t sim_side(const sim_conn_t *c, uint32_t node)
{
    return c->node[1] == node;
}
/* Queues msg on connection ci from side; takes ownership of the message. */
void ap__conn_send(ap_sim_t *sim, uint32_t ci, uint8_t side, uint32_t mi);
/* Sends a latency-only control message (credits); not ordered. */
void ap__conn_send_ctrl(ap_sim_t *sim, uint32_t ci, uint8_t side, uint32_t mi);
void ap__conn_teardown(ap_sim_t *sim, uint32_t ci);
/* A call, request, stream or dial starts / stops using connection ci. */
static inline void ap__conn_hold(ap_sim_t *sim, uint32_t ci)
{
    ((sim_conn_t *)slab_at(&sim->conns, ci))->users++;
}
static inline void ap__conn_unhold(ap_sim_t *sim, uint32_t ci, uint32_t gen)
{
    if (ci != SIM_NONE && slab_live(&sim->conns, ci, gen))
        ((sim_conn_t *)slab_at(&sim->conns, ci))->users--;
}
void ap__ev_idle(ap_sim_t *sim);
void ap__conn_rates_changed(ap_sim_t *sim, uint32_t node);
void ap__conn_link_changed(ap_sim_t *sim, uint32_t a, uint32_t b, uint32_t link);
void ap__ev_xmit(ap_sim_t *sim, uint32_t flow, uint32_t xgen);
bool ap__xmit_valid(ap_sim_t *sim, uint32_t flow, uint32_t xgen);
void ap__ev_deliver(ap_sim_t *sim, uint32_t mi);
void ap__ev_note(ap_sim_t *sim, uint32_t ni);
void ap__ev_conn_timeout(ap_sim_t *sim, uint32_t ci, uint32_t gen);
bool ap__conn_timeout_valid(ap_sim_t *sim, uint32_t ci, uint32_t gen);
void ap__ev_syn_retry(ap_sim_t *sim, uint32_t ci);

/* rt */
void ap__call_complete(ap_sim_t *sim, uint32_t ci, int status, const uint8_t *data, size_t len,
                       const char *errmsg);
void ap__dial_complete(ap_sim_t *sim, uint32_t di, int status);
void ap__stream_finish(ap_sim_t *sim, uint32_t si, int status);
void ap__stream_drain(ap_sim_t *sim, uint32_t si, uint32_t gen);
void ap__stream_on_data(ap_sim_t *sim, uint32_t si, uint32_t mi);
void ap__stream_on_end(ap_sim_t *sim, uint32_t si);
void ap__stream_send_reset(ap_sim_t *sim, sim_stream_t *s, int status);
void ap__node_flush(ap_sim_t *sim, sim_node_t *n);

#endif
