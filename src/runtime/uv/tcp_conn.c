/* The secure TCP transport (src/net/tcp.h: TCP + Noise XX) behind the
 * connection seam (conn.h), so the node's mux runs over it exactly as over
 * any other transport of the table (node.c).
 *
 * One ap_tcp_t per TCP node, on the node's host loop. Each authenticated
 * connection gets a wrapper (tconn_t, an ap_conn_t): inbound ones are handed
 * to the node with ap__node_accept_conn, outbound ones are created by
 * its dial in the dialing state and fire on_up when the handshake is
 * done (or on_close with the dial error).
 *
 * Lifetimes: the mux releases a wrapper with vt->close; after that no
 * callback reaches it. A wrapper whose dial is still running is kept until
 * the dial completes (the transport has no dial cancellation) and freed then.
 * The per-node state (tcpc_t) outlives the node until the transport has
 * closed every handle (ap__tcp_close's done callback). */
#include "runtime/uv/uv_impl.h"

#include "apiary/log.h"
#include "apiary/multiaddr.h"
#include "net/tcp.h"
#include "p2p/dcutr_uv.h"
#include "p2p/relay_svc.h"
#include "runtime/uv/p2p_bridge.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

typedef struct ap_tcpc {
    ap_node_t *node; /* NULL once the node is gone */
    ap_tcp_t *t;
    ap_p2pb_t b; /* the node's protocols over libp2p (p2p_bridge.c) */
    ap_node_wire_t wire;
} tcpc_t;

typedef struct tconn {
    ap_conn_t conn; /* must be first */
    tcpc_t *tc;
    ap_tcp_conn_t *tcp; /* NULL while dialing or after the transport closed it */
    bool dialing;
    bool released; /* vt->close was called */
    bool closed;   /* on_close delivered */
} tconn_t;

static int t_write(ap_conn_t *c, const uint8_t *p, size_t n);
static void t_close(ap_conn_t *c);
static const ap_conn_vt_t tcp_vt = {.write = t_write, .close = t_close};

static tconn_t *tconn_new(tcpc_t *tc, bool dialer)
{
    tconn_t *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->conn.vt = &tcp_vt;
    w->conn.dialer = dialer;
    w->tc = tc;
    return w;
}

static void deliver_close(tconn_t *w, int status)
{
    if (w->closed || w->released) return;
    w->closed = true;
    if (w->conn.cbs.on_close) w->conn.cbs.on_close(w->conn.user, &w->conn, status);
}

static int t_write(ap_conn_t *c, const uint8_t *p, size_t n)
{
    tconn_t *w = (tconn_t *)c;
    if (!w->tcp) return AP_ECLOSED;
    return ap__tcp_write(w->tcp, p, n);
}

static void t_close(ap_conn_t *c)
{
    tconn_t *w = (tconn_t *)c;
    w->released = true;
    if (w->tcp) {
        ap__tcp_conn_set_user(w->tcp, NULL);
        ap__tcp_conn_close(w->tcp); /* queued bytes still go out */
        w->tcp = NULL;
    }
    if (!w->dialing) free(w);
}

/* ---- transport callbacks ------------------------------------------------------ */

static void on_conn(void *arg, ap_tcp_conn_t *c)
{
    tcpc_t *tc = arg;
    if (ap__tcp_conn_outbound(c)) return; /* the dial callback takes it */
    if (!tc->node || atomic_load(&tc->node->closing)) {
        ap__tcp_conn_abort(c, AP_ESHUTDOWN);
        return;
    }
    tconn_t *w = tconn_new(tc, false);
    if (!w) {
        ap__tcp_conn_abort(c, AP_ENOMEM);
        return;
    }
    w->tcp = c;
    w->conn.remote = *ap__tcp_conn_peer(c);
    ap__tcp_conn_set_user(c, w);
    ap__node_accept_conn(tc->node, &w->conn);
}

static void on_data(void *arg, ap_tcp_conn_t *c, const uint8_t *p, size_t n)
{
    (void)arg;
    tconn_t *w = ap__tcp_conn_user(c);
    if (w && !w->released && w->conn.cbs.on_read) w->conn.cbs.on_read(w->conn.user, &w->conn, p, n);
}

static void on_writable(void *arg, ap_tcp_conn_t *c)
{
    (void)arg;
    tconn_t *w = ap__tcp_conn_user(c);
    if (w && !w->released && w->conn.cbs.on_drain) w->conn.cbs.on_drain(w->conn.user, &w->conn);
}

static void on_close(void *arg, ap_tcp_conn_t *c, int status)
{
    (void)arg;
    tconn_t *w = ap__tcp_conn_user(c);
    if (!w) return;
    w->tcp = NULL;
    deliver_close(w, status == 0 ? AP_ECLOSED : status);
}

static void dial_cb(void *arg, int status, ap_tcp_conn_t *c)
{
    tconn_t *w = arg;
    w->dialing = false;
    if (w->released) {
        /* the mux gave up on this dial; a connection nobody uses is closed */
        if (status == 0 && !ap__tcp_conn_user(c)) ap__tcp_conn_close(c);
        free(w);
        return;
    }
    if (status == 0 && ap__tcp_conn_user(c)) {
        /* The dial crossed a connection the peer opened to us, which the
         * mux already owns: on_close(AP_EEXIST) with the peer's id lets the
         * mux finish the dial on that connection (mux_conn.c, conn_adopt). */
        w->conn.remote = *ap__tcp_conn_peer(c);
        status = AP_EEXIST;
    }
    if (status != 0) {
        deliver_close(w, status);
        return;
    }
    w->tcp = c;
    w->conn.remote = *ap__tcp_conn_peer(c);
    ap__tcp_conn_set_user(c, w);
    if (w->conn.cbs.on_up) w->conn.cbs.on_up(w->conn.user, &w->conn, &w->conn.remote);
}

/* ---- node hooks -------------------------------------------------------------------- */

/* What libp2p peers on the node's port are told (identify): the node's own
 * addresses, as ap_rt_listen_addrs gives them. */
static int node_announce(void *arg, ap_multiaddr_t *out, int max)
{
    tcpc_t *tc = arg;
    if (!tc->node) return 0;
    char a[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int k = ap__node_addrs(tc->node, a, AP_NODE_MAX_ANNOUNCE, false);
    int got = 0;
    for (int i = 0; i < k && i < AP_NODE_MAX_ANNOUNCE && got < max; i++)
        if (ap_multiaddr_parse(&out[got], a[i]) == 0) got++;
    return got;
}

static bool is_known(void *arg, const ap_peer_id_t *peer)
{
    tcpc_t *tc = arg;
    return tc->node && ap__node_knows(tc->node, peer);
}

static int tcpc_start(ap_node_t *n, const char *listen)
{
    tcpc_t *tc = calloc(1, sizeof *tc);
    if (!tc) return AP_ENOMEM;
    ap_identity_t id;
    memcpy(id.sk, n->rt.sk, AP_ED25519_SK_LEN);
    crypto_sign_ed25519_sk_to_pk(id.pk, id.sk);
    id.id = n->rt.self;
    ap_tcp_cbs_t cbs = {on_conn, on_data, on_writable, on_close, is_known};
    /* duplicates after a simultaneous dial stay open: the mux retires the
     * loser with GOAWAY once its streams are done (mux_conn.c, conn_resolve_dup) */
    const ap_node_admission_t *ad = &n->admission;
    ap_tcp_cfg_t cfg = {.keep_duplicates = true,
                        .max_handshakes = ad->handshakes,
                        .hs_per_ip = ad->handshakes_per_ip,
                        .handshake_timeout_ms = ad->handshake_timeout_ms,
                        .max_conns = ad->conns,
                        .conns_per_ip = ad->conns_per_ip,
                        .reuse_port = n->hole_punch};
    int rc = ap__tcp_new(&n->host->loop, &id, &cfg, &cbs, tc, &tc->t);
    ap_identity_wipe(&id);
    if (rc < 0) {
        free(tc);
        return rc;
    }
    n->addr[0] = 0; /* listen NULL: dial-only (no listener, no address) */
    if (listen) {
        rc = ap__tcp_listen(tc->t, listen);
        if (rc < 0) {
            ap__tcp_close(tc->t, free, tc);
            return rc;
        }
        ap_multiaddr_t ma;
        ap__tcp_listen_addrs(tc->t, &ma, 1);
        ma.has_peer = false;
        if (ap_multiaddr_print(&ma, n->addr, sizeof n->addr) < 0) n->addr[0] = 0;
    }
    tc->node = n;
    n->tcpc = tc;
    ap__tcp_set_announce(tc->t, node_announce, tc);
    ap__p2pb_init(&tc->b, n, &n->host->loop, true);
    ap__tcp_set_bridge(tc->t, &tc->b.ops, &tc->b);
    /* libp2p connections' buffers and streams count in the node's scopes */
    ap__tcp_set_rcmgr(tc->t, n->rc);
    return 0;
}

static void tcpc_stop(ap_node_t *n)
{
    tcpc_t *tc = n->tcpc;
    if (!tc) return;
    n->tcpc = NULL;
    tc->node = NULL;
    tc->b.node = NULL;
    ap__tcp_set_rcmgr(tc->t, NULL); /* the node's manager goes with the node */
    ap__tcp_close(tc->t, free, tc); /* tc freed once every handle is closed */
}

void ap__tcpc_set_rcmgr(ap_node_t *n, ap_rcmgr_t *m)
{
    if (n->tcpc) ap__tcp_set_rcmgr(n->tcpc->t, m);
}

struct ap_tcp *ap__tcpc_transport(ap_node_t *n)
{
    return n->tcpc ? n->tcpc->t : NULL;
}

static int tcpc_dial(ap_node_t *n, const char *addr, ap_conn_t **out)
{
    tcpc_t *tc = n->tcpc;
    if (!tc) return AP_ENOTSUP; /* the node does not run TCP */
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) == 0 && ma.circuit) {
        ap_p2p_host_t *h = ap__tcp_p2p_host(tc->t);
        return h ? ap__p2pb_dial_circuit(&tc->b, h, &ma, out) : AP_ENOMEM;
    }
    if (tc->wire != AP_NODE_WIRE_NATIVE) {
        ap_p2p_host_t *h = ap__tcp_p2p_host(tc->t);
        return h ? ap__p2pb_dial(&tc->b, h, addr, out) : AP_ENOMEM;
    }
    tconn_t *w = tconn_new(tc, true);
    if (!w) return AP_ENOMEM;
    w->dialing = true;
    int rc = ap__tcp_dial(tc->t, addr, AP_MUX_DIAL_TIMEOUT_US / 1000, dial_cb, w);
    if (rc < 0) {
        free(w);
        return rc;
    }
    *out = &w->conn;
    return 0;
}

static int tcpc_parse(ap_node_t *n, const char *addr, bool *has_id, ap_peer_id_t *id)
{
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) != 0 || !ma.has_tcp || ma.host == AP_MA_HOST_NONE)
        return AP_EADDR;
    if (ma.circuit && (!ma.has_peer || !ma.has_dst)) return AP_EADDR; /* relay and target */
    if (n && !n->tcpc) return AP_ENOTSUP; /* a node without TCP cannot reach it */
    *has_id = ma.circuit ? ma.has_dst : ma.has_peer;
    if (*has_id) *id = ma.circuit ? ma.dst : ma.peer;
    return 0;
}

const ap_uv_transport_t ap__uv_tcp_transport = {
    .scheme = "tcp",
    .parse = tcpc_parse,
    .dial = tcpc_dial,
    .listen = tcpc_start,
    .stop = tcpc_stop,
};

int ap__tcpc_serve_relay(ap_node_t *n, const ap_node_relay_limits_t *l)
{
    tcpc_t *tc = n->tcpc;
    if (!tc || !n->addr[0]) return AP_EINVAL; /* in-process or dial-only */
    ap_relay_limits_t lim;
    ap__relay_limits_default(&lim);
    if (l->max_reservations) lim.max_reservations = l->max_reservations;
    if (l->circuits_per_peer) lim.circuits_per_peer = l->circuits_per_peer;
    if (l->circuit_duration_us) lim.circuit_duration_us = l->circuit_duration_us;
    if (l->circuit_bytes) lim.circuit_bytes = l->circuit_bytes;
    if (lim.max_reservations > AP_RELAY_TABLE_MAX) return AP_EINVAL;
    return ap__tcp_serve_relay(tc->t, &lim);
}

/* ---- relays and hole punching ------------------------------------------------------ */

#define PUNCH_GRACE_MS 30000 /* the mux drains the relayed connection (GOAWAY) before this */

/* A peer reached us through one of our relays: the B side of DCUtR. */
static void on_relayed(void *arg, ap_p2p_conn_t *c)
{
    tcpc_t *tc = arg;
    ap_dcutr_t *d = ap__tcp_dcutr(tc->t);
    if (!tc->node || atomic_load(&tc->node->closing) || !d) return;
    char b[AP_PEER_SHORT_LEN];
    int rc = ap__dcutr_start(d, c);
    if (rc)
        ap_info("relay", "peer %s: cannot start hole punching: %s",
                ap_peer_id_short(ap__p2p_conn_peer(c), b), ap_err_name(rc));
}

static void on_punch(void *arg, const ap_peer_id_t *peer, bool b_side, int status, int attempts,
                     double ms, ap_p2p_conn_t *direct)
{
    tcpc_t *tc = arg;
    (void)peer;
    (void)b_side;
    (void)attempts;
    (void)ms;
    if (status == 0 && direct && tc->node && !atomic_load(&tc->node->closing))
        ap__p2pb_take(&tc->b, direct);
}

/* What DCUtR offers the peer: the IPs our relays see us at with our listen
 * port (a port-preserving NAT maps it there), then our direct addresses. */
static int punch_addrs(void *arg, ap_multiaddr_t *out, int max)
{
    tcpc_t *tc = arg;
    ap_node_t *n = tc->node;
    ap_relay_client_t *cl = ap__tcp_relay_client(tc->t);
    ap_multiaddr_t bound;
    if (!n || ap_multiaddr_parse(&bound, n->addr) != 0) return 0;
    int k = cl ? ap__relay_client_observed(cl, out, max) : 0;
    for (int i = 0; i < k; i++) {
        out[i].has_tcp = true;
        out[i].port = bound.port;
    }
    char a[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int na = ap__node_addrs(n, a, AP_NODE_MAX_ANNOUNCE, false);
    for (int i = 0; i < na && i < AP_NODE_MAX_ANNOUNCE && k < max; i++) {
        ap_multiaddr_t ma;
        if (ap_multiaddr_parse(&ma, a[i]) != 0 || ma.circuit) continue;
        bool dup = false;
        for (int j = 0; j < k && !dup; j++) dup = ap_multiaddr_eq(&out[j], &ma);
        if (!dup) out[k++] = ma;
    }
    return k;
}

int ap__tcpc_use_relays(ap_node_t *n, const ap_node_opts_t *o)
{
    tcpc_t *tc = n->tcpc;
    if (o->relay_bulk && tc) {
        ap_p2p_host_t *h = ap__tcp_p2p_host(tc->t);
        if (!h) return AP_ENOMEM;
        ap__p2p_host_relay_bulk(h, true);
        tc->b.relay_bulk = true;
    }
    if (o->nrelays <= 0) return 0;
    if (!tc || !n->addr[0]) return AP_EINVAL; /* in-process or dial-only */
    if (!o->relays || o->nrelays > AP_NODE_MAX_RELAYS) return AP_EINVAL;
    ap_multiaddr_t r[AP_NODE_MAX_RELAYS];
    for (int i = 0; i < o->nrelays; i++)
        if (!o->relays[i] || ap_multiaddr_parse(&r[i], o->relays[i]) != 0 || r[i].circuit ||
            !r[i].has_peer || !r[i].has_tcp || r[i].port == 0 || r[i].host == AP_MA_HOST_NONE ||
            ap_peer_id_eq(&r[i].peer, &n->rt.self))
            return AP_EADDR;
    if (n->hole_punch) {
        ap_multiaddr_t bound;
        if (ap_multiaddr_parse(&bound, n->addr) != 0) return AP_EINVAL;
        ap_dcutr_opts_t d = {
            .port = bound.port, .grace_ms = PUNCH_GRACE_MS, .addrs = punch_addrs, .addrs_arg = tc};
        if (!ap__tcp_serve_dcutr(tc->t, &d, on_punch, tc)) return AP_ENOMEM;
    }
    if (!ap__tcp_use_relays(tc->t, r, (size_t)o->nrelays, on_relayed, tc)) return AP_ENOMEM;
    return 0;
}

int ap__tcpc_circuit_addrs(ap_node_t *n, char (*out)[AP_RT_ADDR_MAX], int max)
{
    ap_relay_client_t *cl = n->tcpc ? ap__tcp_relay_client(n->tcpc->t) : NULL;
    if (!cl || max <= 0 || ap_node_reachability(&n->rt, NULL, 0) == AP_NODE_REACH_PUBLIC) return 0;
    ap_multiaddr_t ma[AP_NODE_MAX_CIRCUITS];
    int k = ap__relay_client_addrs(cl, ma, max < AP_NODE_MAX_CIRCUITS ? max : AP_NODE_MAX_CIRCUITS);
    int got = 0;
    for (int i = 0; i < k; i++)
        if (ap_multiaddr_print(&ma[i], out[got], AP_RT_ADDR_MAX) > 0) got++;
    return got;
}

void ap_node_relay_stats(ap_rt_t *rt, ap_node_relay_stats_t *out)
{
    ap_node_t *n = (ap_node_t *)rt;
    memset(out, 0, sizeof *out);
    tcpc_t *tc = n->tcpc;
    if (!tc) return;
    ap_relay_client_t *cl = ap__tcp_relay_client(tc->t);
    if (cl) out->reservations = ap__relay_client_reservations(cl, &out->live_reservations);
    ap_dcutr_t *d = ap__tcp_dcutr(tc->t);
    if (d) {
        ap_dcutr_stats_t st = ap__dcutr_stats(d);
        out->punch_started = st.started;
        out->punch_direct = st.direct;
        out->punch_failed = st.failed;
    }
    out->relayed_in = tc->b.stats.relayed_in;
    out->relayed_out = tc->b.stats.relayed_out;
    out->bulk_refused = tc->b.stats.bulk_refused;
    out->direct_taken = tc->b.stats.direct_taken;
}

static void relay_stats_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_node_relay_stats(rt, arg);
    ap_sync_complete(done, 0);
}

int ap_node_relay_stats_sync(ap_rt_t *rt, ap_node_relay_stats_t *out)
{
    return ap_node_call_sync(rt, relay_stats_fn, out);
}

const ap_p2pb_t *ap__tcpc_bridge(ap_node_t *n)
{
    return n->tcpc ? &n->tcpc->b : NULL;
}

int ap_node_set_wire(ap_rt_t *rt, ap_node_wire_t wire)
{
    ap_node_t *n = (ap_node_t *)rt;
    tcpc_t *tc = n->tcpc;
    if (!tc) return AP_ENOTSUP;
    if (wire != AP_NODE_WIRE_NATIVE && wire != AP_NODE_WIRE_LIBP2P && wire != AP_NODE_WIRE_YAMUX)
        return AP_EINVAL;
    if (n->conns) return AP_ESTATE;
    tc->wire = wire;
    tc->b.ops.native = wire != AP_NODE_WIRE_YAMUX;
    ap__tcp_set_bridge(tc->t, &tc->b.ops, &tc->b); /* the host's muxer list follows */
    return 0;
}
