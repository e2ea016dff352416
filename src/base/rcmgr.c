/* Resource manager (see rcmgr.h). */
#include "base/rcmgr.h"
#include "apiary/error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROTO_NAME_MAX 64

struct ap_rc_scope {
    ap_rcmgr_t *m;
    ap_rc_scope_t *next; /* peer / proto list */
    ap_rc_kind_t kind;
    ap_rc_limit_t lim;
    ap_rc_use_t use;
    uint32_t refs;
    ap_peer_id_t peer;
    char proto[PROTO_NAME_MAX];
};

struct ap_rcmgr {
    ap_rcmgr_config_t cfg;
    ap_rc_scope_t node;
    ap_rc_scope_t *peers, *protos; /* few enough for lists: a peer has at most
                                      a few connections, and its scope goes
                                      with its last one */
    uint64_t refusals;
};

void ap_rcmgr_config_default(ap_rcmgr_config_t *c)
{
    c->node = (ap_rc_limit_t){256u << 20, 8192, 1024};
    c->peer = (ap_rc_limit_t){16u << 20, 512, 8};
    c->proto = (ap_rc_limit_t){128u << 20, 4096, 0};
    c->conn = (ap_rc_limit_t){8u << 20, 256, 1};
    c->stream_memory = 0;
    c->node_fair_share = false;
}

ap_rcmgr_t *ap_rcmgr_new(const ap_rcmgr_config_t *cfg)
{
    ap_rcmgr_t *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    if (cfg)
        m->cfg = *cfg;
    else
        ap_rcmgr_config_default(&m->cfg);
    m->node.m = m;
    m->node.kind = AP_RC_NODE;
    m->node.lim = m->cfg.node;
    m->node.refs = 1;
    return m;
}

void ap_rcmgr_free(ap_rcmgr_t *m)
{
    if (!m) return;
    while (m->peers) {
        ap_rc_scope_t *n = m->peers->next;
        free(m->peers);
        m->peers = n;
    }
    while (m->protos) {
        ap_rc_scope_t *n = m->protos->next;
        free(m->protos);
        m->protos = n;
    }
    free(m);
}

static ap_rc_scope_t *scope_new(ap_rcmgr_t *m, ap_rc_kind_t k, const ap_rc_limit_t *lim)
{
    ap_rc_scope_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->m = m;
    s->kind = k;
    s->lim = *lim;
    s->refs = 1;
    return s;
}

ap_rc_scope_t *ap_rcmgr_peer(ap_rcmgr_t *m, const ap_peer_id_t *peer)
{
    for (ap_rc_scope_t *s = m->peers; s; s = s->next)
        if (ap_peer_id_eq(&s->peer, peer)) {
            s->refs++;
            return s;
        }
    ap_rc_scope_t *s = scope_new(m, AP_RC_PEER, &m->cfg.peer);
    if (!s) return NULL;
    s->peer = *peer;
    s->next = m->peers;
    m->peers = s;
    return s;
}

ap_rc_scope_t *ap_rcmgr_proto(ap_rcmgr_t *m, const char *proto)
{
    for (ap_rc_scope_t *s = m->protos; s; s = s->next)
        if (!strncmp(s->proto, proto, PROTO_NAME_MAX - 1)) {
            s->refs++;
            return s;
        }
    ap_rc_scope_t *s = scope_new(m, AP_RC_PROTO, &m->cfg.proto);
    if (!s) return NULL;
    snprintf(s->proto, sizeof s->proto, "%s", proto);
    s->next = m->protos;
    m->protos = s;
    return s;
}

ap_rc_scope_t *ap_rcmgr_conn(ap_rcmgr_t *m)
{
    return scope_new(m, AP_RC_CONN, &m->cfg.conn);
}

static bool in_use(const ap_rc_scope_t *s)
{
    return s->refs || s->use.memory || s->use.streams || s->use.conns;
}

static void unlink_from(ap_rc_scope_t **head, ap_rc_scope_t *s)
{
    while (*head && *head != s) head = &(*head)->next;
    if (*head) *head = s->next;
}

static void maybe_free(ap_rc_scope_t *s)
{
    if (!s || s->kind == AP_RC_NODE || in_use(s)) return;
    if (s->kind == AP_RC_PEER) unlink_from(&s->m->peers, s);
    if (s->kind == AP_RC_PROTO) unlink_from(&s->m->protos, s);
    free(s);
}

ap_rc_scope_t *ap_rc_scope_ref(ap_rc_scope_t *s)
{
    if (s && s->kind != AP_RC_NODE) s->refs++;
    return s;
}

void ap_rc_scope_unref(ap_rc_scope_t *s)
{
    if (!s || s->kind == AP_RC_NODE || !s->refs) return;
    s->refs--;
    maybe_free(s);
}

/* The span's scopes, most specific first, the node last. */
static int span_list(ap_rcmgr_t *m, const ap_rc_span_t *sp, ap_rc_scope_t *out[4])
{
    int n = 0;
    if (sp && sp->conn) out[n++] = sp->conn;
    if (sp && sp->peer) out[n++] = sp->peer;
    if (sp && sp->proto) out[n++] = sp->proto;
    out[n++] = &m->node;
    return n;
}

enum { R_MEM, R_STREAM, R_CONN };

static bool fits(const ap_rc_scope_t *s, int what, uint64_t n)
{
    switch (what) {
    case R_MEM:
        if (!s->lim.memory) return true;
        if (s->use.memory > s->lim.memory) return false;
        if ((s->kind == AP_RC_NODE || s->kind == AP_RC_PROTO) && s->m->cfg.node_fair_share)
            return n <= (s->lim.memory - s->use.memory) / 2;
        return n <= s->lim.memory - s->use.memory;
    case R_STREAM:
        return !s->lim.streams || s->use.streams < s->lim.streams;
    default:
        return !s->lim.conns || s->use.conns < s->lim.conns;
    }
}

static void add(ap_rc_scope_t *s, int what, uint64_t n, bool plus)
{
    switch (what) {
    case R_MEM:
        s->use.memory = plus ? s->use.memory + n : (s->use.memory >= n ? s->use.memory - n : 0);
        break;
    case R_STREAM:
        s->use.streams = plus ? s->use.streams + 1 : (s->use.streams ? s->use.streams - 1 : 0);
        break;
    default:
        s->use.conns = plus ? s->use.conns + 1 : (s->use.conns ? s->use.conns - 1 : 0);
        break;
    }
}

static int reserve(ap_rcmgr_t *m, const ap_rc_span_t *sp, int what, uint64_t n,
                   ap_rc_scope_t **full)
{
    ap_rc_scope_t *l[4];
    int k = span_list(m, sp, l);
    for (int i = 0; i < k; i++)
        if (!fits(l[i], what, n)) {
            if (full) *full = l[i];
            m->refusals++;
            return AP_ELIMIT;
        }
    for (int i = 0; i < k; i++) add(l[i], what, n, true);
    return 0;
}

static void release(ap_rcmgr_t *m, const ap_rc_span_t *sp, int what, uint64_t n)
{
    ap_rc_scope_t *l[4];
    int k = span_list(m, sp, l);
    for (int i = 0; i < k; i++) add(l[i], what, n, false);
    for (int i = 0; i < k; i++) maybe_free(l[i]);
}

int ap_rc_reserve_mem(ap_rcmgr_t *m, const ap_rc_span_t *sp, uint64_t bytes, ap_rc_scope_t **full)
{
    return reserve(m, sp, R_MEM, bytes, full);
}

void ap_rc_release_mem(ap_rcmgr_t *m, const ap_rc_span_t *sp, uint64_t bytes)
{
    release(m, sp, R_MEM, bytes);
}

int ap_rc_reserve_stream(ap_rcmgr_t *m, const ap_rc_span_t *sp, ap_rc_scope_t **full)
{
    return reserve(m, sp, R_STREAM, 1, full);
}

void ap_rc_release_stream(ap_rcmgr_t *m, const ap_rc_span_t *sp)
{
    release(m, sp, R_STREAM, 1);
}

int ap_rc_reserve_conn(ap_rcmgr_t *m, const ap_rc_span_t *sp, ap_rc_scope_t **full)
{
    return reserve(m, sp, R_CONN, 1, full);
}

void ap_rc_release_conn(ap_rcmgr_t *m, const ap_rc_span_t *sp)
{
    release(m, sp, R_CONN, 1);
}

void ap_rc_scope_describe(const ap_rc_scope_t *s, char *out, size_t n)
{
    char who[AP_PEER_ID_STR_MAX + 16];
    switch (s->kind) {
    case AP_RC_NODE:
        snprintf(who, sizeof who, "node");
        break;
    case AP_RC_PEER: {
        char id[AP_PEER_ID_STR_MAX];
        snprintf(who, sizeof who, "peer %s", ap_peer_id_str(&s->peer, id));
        break;
    }
    case AP_RC_PROTO:
        snprintf(who, sizeof who, "protocol %.40s", s->proto);
        break;
    default:
        snprintf(who, sizeof who, "connection");
        break;
    }
    /* a limit of 0 is none at this scope (e.g. the node's connections,
     * which admission bounds): "5/-", not "5/0" */
    char ml[24] = "-", sl[16] = "-", cl[16] = "-";
    if (s->lim.memory) snprintf(ml, sizeof ml, "%llu", (unsigned long long)s->lim.memory);
    if (s->lim.streams) snprintf(sl, sizeof sl, "%u", s->lim.streams);
    if (s->lim.conns) snprintf(cl, sizeof cl, "%u", s->lim.conns);
    snprintf(out, n, "%s: memory %llu/%s, streams %u/%s, conns %u/%s", who,
             (unsigned long long)s->use.memory, ml, s->use.streams, sl, s->use.conns, cl);
}

ap_rc_kind_t ap_rc_scope_kind(const ap_rc_scope_t *s)
{
    return s->kind;
}

const ap_rc_use_t *ap_rc_scope_use(const ap_rc_scope_t *s)
{
    return &s->use;
}

ap_rc_scope_t *ap_rcmgr_node(ap_rcmgr_t *m)
{
    return &m->node;
}

uint64_t ap_rcmgr_refusals(const ap_rcmgr_t *m)
{
    return m->refusals;
}

const ap_rcmgr_config_t *ap_rcmgr_config(const ap_rcmgr_t *m)
{
    return &m->cfg;
}

bool ap_rc_stream_fits(ap_rcmgr_t *m, uint64_t held, uint64_t bytes)
{
    uint64_t lim = m->cfg.stream_memory;
    if (!lim || (held <= lim && bytes <= lim - held)) return true;
    m->refusals++;
    return false;
}

size_t ap_rcmgr_npeers(const ap_rcmgr_t *m)
{
    size_t k = 0;
    for (const ap_rc_scope_t *s = m->peers; s; s = s->next) k++;
    return k;
}

static size_t put_line(const ap_rc_scope_t *s, char *out, size_t n, size_t off)
{
    if (off + 1 >= n) return off;
    char line[256];
    ap_rc_scope_describe(s, line, sizeof line);
    int w = snprintf(out + off, n - off, "%s\n", line);
    if (w < 0) return off;
    return (size_t)w >= n - off ? n - 1 : off + (size_t)w;
}

size_t ap_rcmgr_report(const ap_rcmgr_t *m, int max_peers, char *out, size_t n)
{
    if (!out || !n) return 0;
    out[0] = 0;
    size_t off = put_line(&m->node, out, n, 0);
    for (const ap_rc_scope_t *s = m->protos; s; s = s->next) off = put_line(s, out, n, off);
    /* the peers holding the most memory, largest first (a selection: lists
     * are short, and this runs on request) */
    const ap_rc_scope_t *last = NULL;
    for (int k = 0; k < max_peers; k++) {
        const ap_rc_scope_t *best = NULL;
        for (const ap_rc_scope_t *s = m->peers; s; s = s->next) {
            /* strictly after `last` in (memory desc, address) order */
            if (last && (s->use.memory > last->use.memory ||
                         (s->use.memory == last->use.memory && (uintptr_t)s >= (uintptr_t)last)))
                continue;
            if (!best || s->use.memory > best->use.memory ||
                (s->use.memory == best->use.memory && (uintptr_t)s > (uintptr_t)best))
                best = s;
        }
        if (!best) break;
        off = put_line(best, out, n, off);
        last = best;
    }
    size_t np = ap_rcmgr_npeers(m);
    if (np > (size_t)(max_peers > 0 ? max_peers : 0) && off + 1 < n) {
        int w = snprintf(out + off, n - off, "(%zu peers in all)\n", np);
        if (w > 0) off = (size_t)w >= n - off ? n - 1 : off + (size_t)w;
    }
    return off;
}
