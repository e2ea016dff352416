/* libuv driver, stream multiplexer: what peers make the node hold, counted in
 * the node's resource manager (base/rcmgr.h). A stream's memory (received
 * messages, queued responses) is reserved in its span -- connection, peer,
 * protocol, node -- plus the per-stream limit; streams a peer opens and
 * connections per peer are counted the same way. A refusal is one
 * rate-limited WARN naming the peer and the scope that was full, and the
 * caller answers with RESET AP_ELIMIT. */
#include "runtime/uv/mux_impl.h"

#include "apiary/log.h"
#include "apiary/sync.h"

#include <stdio.h>
#include <string.h>

#define RC_WARN_US 10000000u /* refusal WARNs: one per connection per 10 s */

void ap_node_limits_default(ap_node_limits_t *l)
{
    *l = (ap_node_limits_t){.node_memory = AP_MUX_NODE_MEM_MAX,
                            .proto_memory = AP_MUX_PROTO_MEM_MAX,
                            .peer_memory = AP_MUX_PEER_MEM_MAX,
                            .conn_memory = AP_MUX_CONN_MEM_MAX,
                            .stream_memory = AP_MUX_STREAM_MEM_MAX,
                            .node_streams = AP_MUX_NODE_STREAMS,
                            .peer_streams = AP_MUX_PEER_STREAMS,
                            .conn_streams = AP_MUX_MAX_STREAMS,
                            .peer_conns = AP_MUX_PEER_CONNS};
}

static void to_config(const ap_node_limits_t *l, ap_rcmgr_config_t *c)
{
    *c = (ap_rcmgr_config_t){
        .node = {l->node_memory, l->node_streams, 0},
        .peer = {l->peer_memory, l->peer_streams, l->peer_conns},
        .proto = {l->proto_memory, 0, 0},
        .conn = {l->conn_memory, l->conn_streams, 1},
        .stream_memory = l->stream_memory,
        .node_fair_share = true,
    };
}

int ap__mux_rc_init(ap_node_t *n)
{
    ap_node_limits_t l;
    ap_node_limits_default(&l);
    ap_rcmgr_config_t c;
    to_config(&l, &c);
    n->rc = ap_rcmgr_new(&c);
    return n->rc ? 0 : AP_ENOMEM;
}

void ap__mux_rc_free(ap_node_t *n)
{
    ap_rcmgr_free(n->rc);
    n->rc = NULL;
}

int ap_node_set_limits(ap_rt_t *rt, const ap_node_limits_t *l)
{
    if (!rt || !l) return AP_EINVAL;
    ap_node_t *n = NODE(rt);
    if (n->conns || n->reqs || n->rt_mem_held) return AP_ESTATE;
    ap_rcmgr_config_t c;
    to_config(l, &c);
    ap_rcmgr_t *m = ap_rcmgr_new(&c);
    if (!m) return AP_ENOMEM;
    ap__tcpc_set_rcmgr(n, m); /* releases what libp2p connections held in the old one */
    ap_rcmgr_free(n->rc);
    n->rc = m;
    return 0;
}

size_t ap_node_resources(ap_rt_t *rt, int max_peers, char *out, size_t n)
{
    if (!rt || !out || !n) return 0;
    ap_node_t *nd = NODE(rt);
    size_t off = ap_rcmgr_report(nd->rc, max_peers, out, n);
    if (off + 1 < n) {
        int w = snprintf(
            out + off, n - off,
            "held for peers by protocols %llu bytes\n"
            "refused %llu (memory: %llu received, %llu responses; %llu streams, "
            "%llu connections)\n",
            (unsigned long long)nd->rt_mem_held, (unsigned long long)ap_rcmgr_refusals(nd->rc),
            (unsigned long long)nd->refused_rx, (unsigned long long)nd->refused_resp,
            (unsigned long long)nd->refused_streams, (unsigned long long)nd->refused_conns);
        if (w > 0) off = (size_t)w >= n - off ? n - 1 : off + (size_t)w;
    }
    return off;
}

/* Protocol code's own reservations (runtime.h): the peer's scope and the
 * node's. */
int ap__mux_mem_reserve(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes)
{
    ap_node_t *n = NODE(rt);
    ap_rc_span_t sp = {0};
    if (peer && !(sp.peer = ap_rcmgr_peer(n->rc, peer))) return AP_ENOMEM;
    int rc = ap_rc_reserve_mem(n->rc, &sp, bytes, NULL);
    ap_rc_scope_unref(sp.peer); /* a scope holding memory stays alive */
    if (rc == 0) n->rt_mem_held += bytes;
    return rc;
}

void ap__mux_mem_release(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes)
{
    ap_node_t *n = NODE(rt);
    ap_rc_span_t sp = {.peer = peer ? ap_rcmgr_peer(n->rc, peer) : NULL};
    ap_rc_release_mem(n->rc, &sp, bytes);
    ap_rc_scope_unref(sp.peer);
    n->rt_mem_held -= bytes <= n->rt_mem_held ? bytes : n->rt_mem_held;
}

typedef struct limits_ctx {
    const ap_node_limits_t *l;
    int max_peers;
    char *out;
    size_t n, len;
} limits_ctx_t;

static void set_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    limits_ctx_t *c = arg;
    ap_sync_complete(done, ap_node_set_limits(rt, c->l));
}

static void report_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    limits_ctx_t *c = arg;
    c->len = ap_node_resources(rt, c->max_peers, c->out, c->n);
    ap_sync_complete(done, 0);
}

int ap_node_set_limits_sync(ap_rt_t *rt, const ap_node_limits_t *l)
{
    if (!rt || !l) return AP_EINVAL;
    limits_ctx_t c = {.l = l};
    return ap_node_call_sync(rt, set_fn, &c);
}

int ap_node_resources_sync(ap_rt_t *rt, int max_peers, char *out, size_t n)
{
    if (!rt || !out || !n || n > INT32_MAX) return AP_EINVAL;
    limits_ctx_t c = {.max_peers = max_peers, .out = out, .n = n};
    int rc = ap_node_call_sync(rt, report_fn, &c);
    return rc ? rc : (int)c.len;
}

/* ---- connections ------------------------------------------------------------ */

int ap__mc_rc_up(ap_mconn_t *c)
{
    ap_node_t *n = c->node;
    if (c->rc_counted) return 0;
    if (!c->rc_peer) c->rc_peer = ap_rcmgr_peer(n->rc, &c->peer);
    ap_rc_span_t sp = {.conn = c->rc_conn, .peer = c->rc_peer};
    ap_rc_scope_t *full = NULL;
    if (ap_rc_reserve_conn(n->rc, &sp, &full) < 0) {
        char d[256];
        ap_rc_scope_describe(full, d, sizeof d);
        static ap_log_limit_t lim;
        ap_log_limited(&lim, AP_LOG_WARN, "mux", "peer %s: refusing a connection (%s)", c->short_id,
                       d);
        n->refused_conns++;
        return AP_ELIMIT;
    }
    c->rc_counted = true;
    return 0;
}

void ap__mc_rc_down(ap_mconn_t *c)
{
    ap_node_t *n = c->node;
    if (c->rc_counted) {
        ap_rc_span_t sp = {.conn = c->rc_conn, .peer = c->rc_peer};
        ap_rc_release_conn(n->rc, &sp);
        c->rc_counted = false;
    }
    ap_rc_scope_unref(c->rc_peer);
    ap_rc_scope_unref(c->rc_conn);
    c->rc_peer = c->rc_conn = NULL;
}

/* ---- streams ----------------------------------------------------------------- */

static void ms_span(ap_mstream_t *s)
{
    if (s->rc_set || !s->conn) return;
    /* references: the stream may outlive its connection's scopes */
    s->rc.conn = ap_rc_scope_ref(s->conn->rc_conn);
    s->rc.peer = ap_rc_scope_ref(s->conn->rc_peer);
    s->rc.proto = ap_rcmgr_proto(s->node->rc, s->proto); /* a reference, dropped at the end */
    s->rc_set = true;
}

static const char *kind_name(const ap_rc_scope_t *full)
{
    if (!full) return "stream";
    switch (ap_rc_scope_kind(full)) {
    case AP_RC_NODE:
        return "node";
    case AP_RC_PEER:
        return "peer";
    case AP_RC_PROTO:
        return "protocol";
    default:
        return "connection";
    }
}

static void refused(ap_mstream_t *s, const ap_rc_scope_t *full, const char *what, size_t bytes,
                    char *why, size_t nwhy)
{
    char d[256];
    if (full)
        ap_rc_scope_describe(full, d, sizeof d);
    else
        snprintf(d, sizeof d, "stream: memory %llu/%llu", (unsigned long long)s->rc_mem,
                 (unsigned long long)ap_rcmgr_config(s->node->rc)->stream_memory);
    /* one WARN per connection per 10 s (the rest at debug level), and few
     * in all: a flood of refusals, or of peers, stays quiet */
    static ap_log_limit_t lim;
    ap_mconn_t *c = s->conn;
    const char *peer = c ? c->short_id : "?";
    uint64_t now = ap__host_now_us(s->node->host);
    bool warn = !c || !c->rc_warned_us || now - c->rc_warned_us >= RC_WARN_US;
    if (warn && c) c->rc_warned_us = now ? now : 1;
    char line[512];
    if (bytes)
        snprintf(line, sizeof line, "peer %s: refusing %s of %zu bytes on %s (%s)", peer, what,
                 bytes, s->proto, d);
    else
        snprintf(line, sizeof line, "peer %s: refusing %s on %s (%s)", peer, what, s->proto, d);
    if (warn)
        ap_log_limited(&lim, AP_LOG_WARN, "mux", "%s", line);
    else
        ap_debug("mux", "%s", line);
    if (why) snprintf(why, nwhy, "%s %s full", kind_name(full), bytes ? "memory" : "streams");
}

int ap__ms_rc_reserve(ap_mstream_t *s, size_t bytes, const char *what, char *why, size_t nwhy)
{
    ap_rcmgr_t *m = s->node->rc;
    ms_span(s);
    if (!ap_rc_stream_fits(m, s->rc_mem, bytes)) {
        refused(s, NULL, what, bytes, why, nwhy);
        return AP_ELIMIT;
    }
    ap_rc_scope_t *full = NULL;
    if (ap_rc_reserve_mem(m, &s->rc, bytes, &full) < 0) {
        refused(s, full, what, bytes, why, nwhy);
        return AP_ELIMIT;
    }
    s->rc_mem += bytes;
    return 0;
}

void ap__ms_rc_release(ap_mstream_t *s, size_t bytes)
{
    if (bytes > s->rc_mem) bytes = (size_t)s->rc_mem;
    if (!bytes) return;
    ap_rc_release_mem(s->node->rc, &s->rc, bytes);
    s->rc_mem -= bytes;
}

int ap__ms_rc_open(ap_mstream_t *s, char *why, size_t nwhy)
{
    ms_span(s);
    ap_rc_scope_t *full = NULL;
    if (ap_rc_reserve_stream(s->node->rc, &s->rc, &full) < 0) {
        refused(s, full, "a stream", 0, why, nwhy);
        s->node->refused_streams++;
        return AP_ELIMIT;
    }
    s->rc_stream = true;
    return 0;
}

void ap__ms_rc_end(ap_mstream_t *s)
{
    ap_rcmgr_t *m = s->node->rc;
    if (!s->rc_set) return;
    ap__ms_rc_release(s, (size_t)s->rc_mem);
    if (s->rc_stream) ap_rc_release_stream(m, &s->rc);
    s->rc_stream = false;
    ap_rc_scope_unref(s->rc.proto);
    ap_rc_scope_unref(s->rc.peer);
    ap_rc_scope_unref(s->rc.conn);
    s->rc = (ap_rc_span_t){0};
    s->rc_set = false;
}

void ap__ms_rc_move(ap_mstream_t *s, size_t bytes, ap_rc_span_t *to, uint64_t *to_mem)
{
    *to = (ap_rc_span_t){0};
    *to_mem = 0;
    if (!s->rc_set) return;
    if (bytes > s->rc_mem) bytes = (size_t)s->rc_mem;
    *to = (ap_rc_span_t){.conn = ap_rc_scope_ref(s->rc.conn),
                         .peer = ap_rc_scope_ref(s->rc.peer),
                         .proto = ap_rc_scope_ref(s->rc.proto)};
    s->rc_mem -= bytes;
    *to_mem = bytes;
}

void ap__rc_hold_drop(ap_node_t *n, ap_rc_span_t *sp, uint64_t *mem)
{
    if (*mem) ap_rc_release_mem(n->rc, sp, *mem);
    *mem = 0;
    ap_rc_scope_unref(sp->proto);
    ap_rc_scope_unref(sp->peer);
    ap_rc_scope_unref(sp->conn);
    *sp = (ap_rc_span_t){0};
}
