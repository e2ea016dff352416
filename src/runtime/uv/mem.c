/* In-process transport: nodes of one process reach each other at
 * "/memory/<n>" through an in-memory byte pipe. Each direction is a queue of
 * chunks guarded by the pipe's mutex; the receiving end's host delivers them
 * from its loop (its task queue + uv_async), so ends on different hosts (and
 * threads) work the same as ends on one host, and no callback ever runs from
 * inside write() or close(). See conn.h for the contract. */
#include "runtime/uv/uv_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MEM_HIGH      (4u << 20) /* write queue high-water mark */
#define MEM_LOW       (1u << 20) /* low-water mark: on_drain */
#define MEM_MAX_NODES 65536

typedef struct mem_chunk {
    struct mem_chunk *next;
    size_t len, cap;
    uint8_t data[];
} mem_chunk_t;

/* Chunks are recycled per pipe: a fresh 256 KiB malloc per write would be
 * served by mmap and page-faulted every time (DESIGN.md §7). */
#define MEM_SPARE_MAX 32

typedef struct mem_pipe mem_pipe_t;

typedef struct mem_end {
    ap_conn_t conn; /* must be first */
    mem_pipe_t *pipe;
    int idx;
    ap_task_t task; /* posted to host when scheduled */
    /* guarded by pipe->mu */
    ap_host_t *host; /* NULL once the end is dead (closed or never accepted) */
    bool open;       /* owned by a node's mux */
    bool scheduled;
    bool accept_pending;
    unsigned accept_no;
    bool up_pending, drain_pending;
    bool eof;
    int eof_status;
    mem_chunk_t *in_head, *in_tail; /* bytes for this end */
    size_t wq;                      /* bytes this end wrote, not yet consumed */
    bool blocked;
} mem_end_t;

struct mem_pipe {
    uv_mutex_t mu;
    int refs;
    mem_end_t e[2];
    mem_chunk_t *spare; /* recycled chunks (guarded by mu) */
    int nspare;
};

static mem_chunk_t *chunk_get(mem_pipe_t *pp, size_t n) /* pp->mu held */
{
    for (mem_chunk_t **cp = &pp->spare; *cp; cp = &(*cp)->next) {
        if ((*cp)->cap < n) continue;
        mem_chunk_t *c = *cp;
        *cp = c->next;
        pp->nspare--;
        return c;
    }
    return NULL;
}

static void chunk_put(mem_pipe_t *pp, mem_chunk_t *c) /* pp->mu held */
{
    if (pp->nspare < MEM_SPARE_MAX && c->cap <= (1u << 20)) {
        c->next = pp->spare;
        pp->spare = c;
        pp->nspare++;
    } else {
        free(c);
    }
}

/* ---- registry of listening nodes ------------------------------------------------ */

static uv_once_t reg_once = UV_ONCE_INIT;
static uv_mutex_t reg_mu;
static ap_node_t **reg; /* reg[no] */
static unsigned reg_cap, reg_next = 1;

static void reg_init(void)
{
    uv_mutex_init(&reg_mu);
}

/* Parses "/memory/<n>[/p2p/<id>]". */
static int mem_parse(const char *addr, unsigned *no, bool *has_id, ap_peer_id_t *id)
{
    static const char pfx[] = "/memory/";
    if (!addr || strncmp(addr, pfx, sizeof pfx - 1) != 0) return AP_EADDR;
    const char *p = addr + sizeof pfx - 1;
    unsigned long v = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 6) v = v * 10 + (unsigned long)(*p++ - '0'), digits++;
    if (digits == 0 || v == 0 || v >= MEM_MAX_NODES) return AP_EADDR;
    *no = (unsigned)v;
    *has_id = false;
    if (*p == 0) return 0;
    if (strncmp(p, "/p2p/", 5) != 0) return AP_EADDR;
    if (ap_peer_id_parse(id, p + 5) < 0) return AP_EADDR;
    *has_id = true;
    return 0;
}

static int mem_listen(ap_node_t *n, const char *listen)
{
    uv_once(&reg_once, reg_init);
    unsigned no = 0;
    if (listen) {
        bool has_id;
        ap_peer_id_t id;
        if (mem_parse(listen, &no, &has_id, &id) < 0 || has_id) return AP_EADDR;
    }
    uv_mutex_lock(&reg_mu);
    if (!no) {
        for (unsigned i = 0; i < MEM_MAX_NODES - 1 && !no; i++) {
            unsigned c = reg_next;
            reg_next = reg_next + 1 >= MEM_MAX_NODES ? 1 : reg_next + 1;
            if (c >= reg_cap || !reg[c]) no = c;
        }
        if (!no) {
            uv_mutex_unlock(&reg_mu);
            return AP_ELIMIT;
        }
    }
    if (no >= reg_cap) {
        unsigned cap = reg_cap ? reg_cap : 64;
        while (cap <= no) cap *= 2;
        ap_node_t **r = realloc(reg, cap * sizeof *r);
        if (!r) {
            uv_mutex_unlock(&reg_mu);
            return AP_ENOMEM;
        }
        memset(r + reg_cap, 0, (cap - reg_cap) * sizeof *r);
        reg = r;
        reg_cap = cap;
    }
    if (reg[no]) {
        uv_mutex_unlock(&reg_mu);
        return AP_EEXIST;
    }
    reg[no] = n;
    uv_mutex_unlock(&reg_mu);
    n->mem_no = no;
    snprintf(n->addr, sizeof n->addr, "/memory/%u", no);
    return 0;
}

static void mem_stop(ap_node_t *n)
{
    uv_once(&reg_once, reg_init);
    uv_mutex_lock(&reg_mu);
    if (n->mem_no < reg_cap && reg[n->mem_no] == n) reg[n->mem_no] = NULL;
    uv_mutex_unlock(&reg_mu);
}

ap_node_t *ap__node_by_mem(unsigned no)
{
    uv_once(&reg_once, reg_init);
    uv_mutex_lock(&reg_mu);
    ap_node_t *n = no < reg_cap ? reg[no] : NULL;
    uv_mutex_unlock(&reg_mu);
    return n;
}

/* ---- pipe ------------------------------------------------------------------------- */

static void unref(mem_pipe_t *p) /* pipe->mu held; unlocks */
{
    bool last = --p->refs == 0;
    uv_mutex_unlock(&p->mu);
    if (!last) return;
    for (int i = 0; i < 3; i++) {
        mem_chunk_t *c = i < 2 ? p->e[i].in_head : p->spare;
        while (c) {
            mem_chunk_t *next = c->next;
            free(c);
            c = next;
        }
    }
    uv_mutex_destroy(&p->mu);
    free(p);
}

static void drop_inbox(mem_end_t *e)
{
    mem_chunk_t *c = e->in_head;
    while (c) {
        mem_chunk_t *next = c->next;
        free(c);
        c = next;
    }
    e->in_head = e->in_tail = NULL;
}

static void kick(mem_end_t *e) /* pipe->mu held */
{
    if (e->scheduled || !e->host) return;
    e->scheduled = true;
    e->pipe->refs++;
    e->task.node = NULL;
    if (ap__host_post(e->host, &e->task) < 0) { /* cannot happen: node NULL */
        e->scheduled = false;
        e->pipe->refs--;
    }
}

static void end_run(ap_task_t *t, bool discard);

static int mem_write(ap_conn_t *c, const uint8_t *p, size_t n)
{
    mem_end_t *e = (mem_end_t *)c;
    mem_pipe_t *pp = e->pipe;
    mem_end_t *o = &pp->e[1 - e->idx];
    uv_mutex_lock(&pp->mu);
    mem_chunk_t *ch = chunk_get(pp, n);
    uv_mutex_unlock(&pp->mu);
    if (!ch) {
        size_t cap = n < 65536 ? 65536 : n;
        ch = malloc(sizeof *ch + cap);
        if (!ch) return AP_ENOMEM;
        ch->cap = cap;
    }
    ch->next = NULL;
    ch->len = n;
    memcpy(ch->data, p, n);
    uv_mutex_lock(&pp->mu);
    if (!o->host) { /* peer gone: on_close is on its way */
        uv_mutex_unlock(&pp->mu);
        free(ch);
        return AP_ECLOSED;
    }
    if (o->in_tail)
        o->in_tail->next = ch;
    else
        o->in_head = ch;
    o->in_tail = ch;
    e->wq += n;
    if (e->wq > MEM_HIGH) e->blocked = true;
    int rc = e->blocked ? 1 : 0;
    kick(o);
    uv_mutex_unlock(&pp->mu);
    return rc;
}

static void mem_close(ap_conn_t *c)
{
    mem_end_t *e = (mem_end_t *)c;
    mem_pipe_t *pp = e->pipe;
    mem_end_t *o = &pp->e[1 - e->idx];
    uv_mutex_lock(&pp->mu);
    e->open = false;
    e->host = NULL;
    drop_inbox(e);
    if (!o->eof) {
        o->eof = true;
        o->eof_status = AP_ECLOSED;
    }
    kick(o);
    unref(pp); /* the owner's reference */
}

static const ap_conn_vt_t mem_vt = {.write = mem_write, .close = mem_close};

static void end_run(ap_task_t *t, bool discard)
{
    mem_end_t *e = (mem_end_t *)((char *)t - offsetof(mem_end_t, task));
    mem_pipe_t *pp = e->pipe;
    mem_end_t *o = &pp->e[1 - e->idx];
    uv_mutex_lock(&pp->mu);
    e->scheduled = false;
    if (discard) { /* the host is going away */
        bool owned = e->accept_pending || e->open;
        e->accept_pending = false;
        e->open = false;
        e->host = NULL;
        drop_inbox(e);
        if (!o->eof) {
            o->eof = true;
            o->eof_status = AP_EUNREACH;
        }
        kick(o);
        if (owned) pp->refs--; /* refs > 0: the task's own reference remains */
        unref(pp);
        return;
    }
    if (e->accept_pending) {
        e->accept_pending = false;
        bool eof = e->eof;
        uv_mutex_unlock(&pp->mu);
        ap_node_t *n = eof ? NULL : ap__node_by_mem(e->accept_no);
        uv_mutex_lock(&pp->mu);
        if (n && n->host == e->host && !atomic_load(&n->closing)) {
            e->open = true;
            o->conn.remote = n->rt.self;
            o->up_pending = true;
            kick(o);
            uv_mutex_unlock(&pp->mu);
            ap__node_accept_conn(n, &e->conn);
            uv_mutex_lock(&pp->mu);
        } else {
            e->host = NULL;
            drop_inbox(e);
            if (!o->eof) {
                o->eof = true;
                o->eof_status = AP_EUNREACH;
            }
            kick(o);
            pp->refs--; /* the would-be owner's reference (task ref remains) */
            unref(pp);
            return;
        }
    }
    /* Deliver: up, then bytes in order, then drain, then eof. */
    for (;;) {
        if (!e->open) break;
        if (e->up_pending) {
            e->up_pending = false;
            uv_mutex_unlock(&pp->mu);
            e->conn.cbs.on_up(e->conn.user, &e->conn, &e->conn.remote);
            uv_mutex_lock(&pp->mu);
            continue;
        }
        if (e->in_head) {
            mem_chunk_t *ch = e->in_head;
            e->in_head = ch->next;
            if (!e->in_head) e->in_tail = NULL;
            uv_mutex_unlock(&pp->mu);
            e->conn.cbs.on_read(e->conn.user, &e->conn, ch->data, ch->len);
            uv_mutex_lock(&pp->mu);
            o->wq -= ch->len;
            if (o->blocked && o->wq < MEM_LOW) {
                o->blocked = false;
                o->drain_pending = true;
                kick(o);
            }
            chunk_put(pp, ch);
            continue;
        }
        if (e->drain_pending) {
            e->drain_pending = false;
            uv_mutex_unlock(&pp->mu);
            e->conn.cbs.on_drain(e->conn.user, &e->conn);
            uv_mutex_lock(&pp->mu);
            continue;
        }
        if (e->eof && e->eof_status) {
            int st = e->eof_status;
            e->eof_status = 0; /* deliver once */
            uv_mutex_unlock(&pp->mu);
            e->conn.cbs.on_close(e->conn.user, &e->conn, st);
            uv_mutex_lock(&pp->mu);
            continue;
        }
        break;
    }
    unref(pp); /* the task's reference */
}

static int mem_dial(ap_node_t *n, const char *addr, ap_conn_t **out)
{
    unsigned no;
    bool has_id;
    ap_peer_id_t id;
    if (mem_parse(addr, &no, &has_id, &id) < 0) return AP_EADDR;
    uv_once(&reg_once, reg_init);
    mem_pipe_t *pp = calloc(1, sizeof *pp);
    if (!pp) return AP_ENOMEM;
    uv_mutex_init(&pp->mu);
    pp->refs = 2; /* one per end owner */
    for (int i = 0; i < 2; i++) {
        pp->e[i].pipe = pp;
        pp->e[i].idx = i;
        pp->e[i].conn.vt = &mem_vt;
        pp->e[i].task.run = end_run;
    }
    mem_end_t *a = &pp->e[0], *b = &pp->e[1];
    a->host = n->host;
    a->open = true;
    a->conn.dialer = true;
    b->conn.dialer = false;
    b->conn.remote = n->rt.self;
    b->accept_pending = true;
    b->accept_no = no;
    /* The accept task is queued under the registry lock: the target cannot be
     * unregistered (hence its host cannot be freed) before the task is in the
     * host's queue, where host teardown discards it (-> AP_EUNREACH). */
    uv_mutex_lock(&reg_mu);
    ap_node_t *target = no < reg_cap ? reg[no] : NULL;
    if (!target || target == n) {
        uv_mutex_unlock(&reg_mu);
        uv_mutex_destroy(&pp->mu);
        free(pp);
        return AP_EUNREACH;
    }
    b->host = target->host;
    uv_mutex_lock(&pp->mu);
    kick(b);
    uv_mutex_unlock(&pp->mu);
    uv_mutex_unlock(&reg_mu);
    *out = &a->conn;
    return 0;
}

static int mem_parse_addr(ap_node_t *n, const char *addr, bool *has_id, ap_peer_id_t *id)
{
    unsigned no;
    (void)n; /* every node reaches in-process nodes */
    return mem_parse(addr, &no, has_id, id);
}

const ap_uv_transport_t ap__uv_mem_transport = {
    .scheme = "memory",
    .parse = mem_parse_addr,
    .dial = mem_dial,
    .listen = mem_listen,
    .stop = mem_stop,
};
