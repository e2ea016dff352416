/* The libp2p host (see p2p_conn.h): identify, ping and echo served,
 * listening, adopting sockets, freeing. */
#include "apiary/error.h"
#include "apiary/log.h"
#include "net/tcp.h"
#include "p2p/p2p_impl.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define HS_SWEEP_MS 1000 /* how often handshake deadlines are checked */

static const char *const muxer_list[] = {AP_YAMUX_PROTO};
static const char *const node_muxer_list[] = {AP_P2P_NATIVE_MUX, AP_YAMUX_PROTO};

void ap__p2p_host_release(ap_p2p_host_t *h)
{
    void (*done)(void *) = h->done;
    void *arg = h->done_arg;
    ap_admit_close(&h->own_admit);
    ap__secure_creds_clear(&h->creds);
    ap__secure_creds_clear(&h->ycreds);
    free(h);
    if (done) done(arg);
}

/* Connections whose upgrade (multistream, Noise, muxer) is not done by
 * their deadline are closed: a stalled handshake holds nothing for long. */
static void hs_sweep(uv_timer_t *t)
{
    ap_p2p_host_t *h = t->data;
    uint64_t now = uv_now(h->loop);
    for (ap_p2p_conn_t *c = h->conns; c; c = c->next) {
        if (c->ready || c->closing || now < c->hs_deadline) continue;
        ap_debug("p2p", "closing a libp2p connection: its handshake is past its deadline (%llu ms)",
                 (unsigned long long)h->hs_timeout_ms);
        ap__p2p_conn_fail(c, AP_ETIMEDOUT);
    }
}

/* ---- identify and ping, served ---------------------------------------------- */

/* ping and echo: the bytes go back; credit returns as they leave the queue,
 * so a peer that does not read its answers stops being read */
static void echo_open(ap_p2p_stream_t *s)
{
    s->echo = true;
}

static void ping_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    if (ap__p2p_stream_queue(s, p, n) != 0) ap__p2p_stream_reset(s);
}

static void ping_fin(ap_p2p_stream_t *s)
{
    ap__p2p_stream_close(s);
}

static void id_open(ap_p2p_stream_t *s)
{
    ap_p2p_conn_t *c = s->c;
    ap_p2p_host_t *h = c->h;
    static ap_identify_t info;
    static uint8_t buf[AP_IDENTIFY_MSG_MAX + 16];
    memset(&info, 0, sizeof info);
    snprintf(info.protocol_version, sizeof info.protocol_version, "ipfs/0.1.0");
    snprintf(info.agent_version, sizeof info.agent_version, "%s", h->agent);
    info.nlisten = (size_t)ap__p2p_host_addrs(h, info.listen, AP_IDENTIFY_ADDRS_MAX);
    info.has_observed = c->remote.host != AP_MA_HOST_NONE && !c->relayed;
    info.observed = c->remote;
    for (size_t i = 0; i < h->nprotos; i++) info.protocols[i] = h->names[i];
    info.nprotocols = h->nprotos;
    int n = ap__identify_encode(&info, h->creds.id.pk, buf, sizeof buf);
    if (n > 0) ap__yamux_send(&c->y, s->id, buf, (size_t)n);
    ap__p2p_stream_close(s);
}

int ap__p2p_host_addrs(ap_p2p_host_t *h, ap_multiaddr_t *out, int max)
{
    int k = 0;
    if (h->addrs_fn) {
        k = h->addrs_fn(h->addrs_arg, out, max);
        k = k < 0 ? 0 : k > max ? max : k;
    } else if (h->listening && max > 0) {
        out[k++] = h->bound;
    }
    for (int i = 0; i < k; i++) /* a circuit keeps its relay's id */
        if (!out[i].circuit) out[i].has_peer = false;
    return k;
}

static const ap_p2p_proto_t ping_srv = {AP_PING_PROTO, echo_open, ping_data, ping_fin, NULL};
static const ap_p2p_proto_t echo_srv = {AP_P2P_ECHO_PROTO, echo_open, ping_data, ping_fin, NULL};
static const ap_p2p_proto_t id_srv = {AP_IDENTIFY_PROTO, id_open, NULL, NULL, NULL};

/* ---- host ---------------------------------------------------------------------- */

ap_p2p_host_t *ap__p2p_host_new(uv_loop_t *loop, const ap_identity_t *id, const char *agent)
{
    ap_p2p_host_t *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->loop = loop;
    if (ap__secure_creds_init_muxers(&h->creds, id, AP_NOISE_SHA256, NULL, muxer_list, 1) != 0) {
        free(h);
        return NULL;
    }
    /* a circuit carries libp2p streams only: a relayed connection lists yamux alone */
    if (ap__secure_creds_init_muxers(&h->ycreds, id, AP_NOISE_SHA256, NULL, muxer_list, 1) != 0) {
        ap__secure_creds_clear(&h->creds);
        free(h);
        return NULL;
    }
    snprintf(h->agent, sizeof h->agent, "%s", agent ? agent : "apiary");
    ap_admit_init(&h->own_admit, NULL);
    h->admit = &h->own_admit;
    h->hs_timeout_ms = AP_P2P_HS_TIMEOUT_MS;
    uv_timer_init(loop, &h->hs_timer);
    h->hs_timer.data = h;
    h->hs_timer_open = true;
    uv_timer_start(&h->hs_timer, hs_sweep, HS_SWEEP_MS, HS_SWEEP_MS);
    uv_unref((uv_handle_t *)&h->hs_timer); /* does not keep the loop alive */
    return h;
}

void ap__p2p_host_set_admit(ap_p2p_host_t *h, ap_admit_t *a, const ap_p2p_admit_hooks_t *hooks,
                            void *arg)
{
    h->admit = a ? a : &h->own_admit;
    memset(&h->admit_hooks, 0, sizeof h->admit_hooks);
    if (hooks) h->admit_hooks = *hooks;
    h->admit_arg = arg;
}

ap_admit_t *ap__p2p_host_admit(ap_p2p_host_t *h)
{
    return h->admit;
}

void ap__p2p_host_set_hs_timeout(ap_p2p_host_t *h, uint64_t ms)
{
    h->hs_timeout_ms = ms ? ms : AP_P2P_HS_TIMEOUT_MS;
    uint64_t every = h->hs_timeout_ms / 4 < HS_SWEEP_MS ? h->hs_timeout_ms / 4 : HS_SWEEP_MS;
    if (every < 5) every = 5;
    uv_timer_start(&h->hs_timer, hs_sweep, every, every);
}

/* ---- admission (base/admit.h) ----------------------------------------------- */

static uint64_t admit_id(const ap_p2p_conn_t *c)
{
    return (uint64_t)(uintptr_t)c | AP_P2P_ADMIT_TAG;
}

static void evict(ap_p2p_host_t *h, uint64_t id)
{
    if (id & AP_P2P_ADMIT_TAG)
        ap__p2p_host_evict(h, id);
    else if (h->admit_hooks.evict)
        h->admit_hooks.evict(h->admit_arg, id);
}

void ap__p2p_host_evict(ap_p2p_host_t *h, uint64_t id)
{
    (void)h;
    ap_p2p_conn_t *c = (ap_p2p_conn_t *)(uintptr_t)(id & ~(uint64_t)AP_P2P_ADMIT_TAG);
    ap_debug("p2p", "closing a libp2p connection (%s) to make room",
             c->ready ? "idle" : "stalled handshake");
    ap__p2p_conn_fail(c, AP_ELIMIT);
}

/* c's handshake from ip, pending in admission; false (c is closed) when
 * admission refuses it. */
static bool admit_inbound(ap_p2p_conn_t *c, const uint8_t ip[16])
{
    ap_p2p_host_t *h = c->h;
    uint64_t now = uv_now(h->loop), victim = 0;
    if (!ap_admit_has_room(h->admit, ip, now)) {
        ap_debug("p2p", "refusing a libp2p connection: %u connections open, none idle",
                 ap_admit_stats(h->admit)->open_in + ap_admit_stats(h->admit)->open_out);
        ap__p2p_conn_fail(c, AP_ELIMIT);
        return false;
    }
    ap_admit_verdict_t v =
        ap_admit_inbound(h->admit, admit_id(c), ip, now, randombytes_random(), &victim);
    if (v == AP_ADMIT_DROP) {
        ap_debug("p2p",
                 "refusing a libp2p connection: %u handshakes pending from its address, %u "
                 "in all",
                 ap_admit_pending_ip(h->admit, ip), ap_admit_stats(h->admit)->pending);
        ap__p2p_conn_fail(c, AP_ELIMIT);
        return false;
    }
    c->admit_id = admit_id(c);
    if (v == AP_ADMIT_EVICT) evict(h, victim);
    return true;
}

bool ap__p2p_admit_open(ap_p2p_conn_t *c)
{
    if (!c->admit_id) return true;
    ap_p2p_host_t *h = c->h;
    uint64_t victim = 0;
    bool known = h->admit_hooks.is_known && h->admit_hooks.is_known(h->admit_arg, &c->peer);
    ap_admit_verdict_t v = ap_admit_open(h->admit, c->admit_id, known, uv_now(h->loop), &victim);
    if (v == AP_ADMIT_DROP) {
        static ap_log_limit_t lim = {.burst = 8, .window_ms = 10000};
        ap_log_limited(&lim, AP_LOG_WARN, "p2p",
                       "refusing libp2p connection from %s: %u inbound connections open, none "
                       "idle to make room",
                       c->peer_short, ap_admit_stats(h->admit)->open_in);
        ap__p2p_conn_fail(c, AP_ELIMIT);
        return false;
    }
    if (v == AP_ADMIT_EVICT) evict(h, victim);
    return true;
}

void ap__p2p_admit_gone(ap_p2p_conn_t *c)
{
    if (!c->admit_id) return;
    ap_admit_gone(c->h->admit, c->admit_id);
    c->admit_id = 0;
}

void ap__p2p_admit_touch(ap_p2p_conn_t *c)
{
    if (c->admit_id) ap_admit_touch(c->h->admit, c->admit_id, uv_now(c->h->loop));
}

/* ---- resource manager (base/rcmgr.h) ----------------------------------------- */

void ap__p2p_rc_attach(ap_p2p_conn_t *c)
{
    ap_rcmgr_t *m = c->h->rc;
    if (!m || c->initiator || c->relayed || c->rc.conn) return;
    c->rc.conn = ap_rcmgr_conn(m);
    c->rc.peer = c->rc.conn ? ap_rcmgr_peer(m, &c->peer) : NULL;
    if (c->rc.conn && !c->rc.peer) {
        ap_rc_scope_unref(c->rc.conn);
        c->rc.conn = NULL;
    }
}

void ap__p2p_rc_detach(ap_p2p_conn_t *c)
{
    ap_rcmgr_t *m = c->h->rc;
    if (!c->rc.conn) return;
    size_t pos = 0;
    uint64_t k, v;
    while (ap__u64map_next(&c->streams, &pos, &k, &v)) {
        ap_p2p_stream_t *s = (ap_p2p_stream_t *)(uintptr_t)v;
        if (s->rc_stream) ap_rc_release_stream(m, &c->rc);
        s->rc_stream = false;
    }
    if (c->rc_mem) ap_rc_release_mem(m, &c->rc, c->rc_mem);
    c->rc_mem = 0;
    ap_rc_scope_unref(c->rc.conn);
    ap_rc_scope_unref(c->rc.peer);
    memset(&c->rc, 0, sizeof c->rc);
}

bool ap__p2p_rc_stream(ap_p2p_stream_t *s)
{
    ap_p2p_conn_t *c = s->c;
    if (!c->rc.conn) return true;
    ap_rc_scope_t *full = NULL;
    if (ap_rc_reserve_stream(c->h->rc, &c->rc, &full) != 0) {
        static ap_log_limit_t lim = {.burst = 8, .window_ms = 10000};
        char d[200];
        ap_rc_scope_describe(full, d, sizeof d);
        ap_log_limited(&lim, AP_LOG_WARN, "p2p", "peer %s: stream %u reset: %s", c->peer_short,
                       (unsigned)s->id, d);
        return false;
    }
    s->rc_stream = true;
    return true;
}

void ap__p2p_rc_stream_release(ap_p2p_stream_t *s)
{
    if (!s->rc_stream) return;
    s->rc_stream = false;
    ap_rc_release_stream(s->c->h->rc, &s->c->rc);
}

void ap__p2p_host_set_rcmgr(ap_p2p_host_t *h, ap_rcmgr_t *m)
{
    if (h->rc == m) return;
    for (ap_p2p_conn_t *c = h->conns; c; c = c->next) ap__p2p_rc_detach(c);
    h->rc = m;
    for (ap_p2p_conn_t *c = h->conns; c; c = c->next)
        if (c->ready && !c->closing) ap__p2p_rc_attach(c);
}

static void sock_ip16(uv_tcp_t *t, uint8_t ip[16])
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    if (uv_tcp_getpeername(t, (struct sockaddr *)&ss, &len) != 0) ss.ss_family = AF_UNSPEC;
    ap__tcp_ip16(&ss, ip);
}

const ap_identity_t *ap__p2p_host_identity(const ap_p2p_host_t *h)
{
    return &h->creds.id;
}

int ap__p2p_host_set_bridge(ap_p2p_host_t *h, const ap_p2p_bridge_t *b, void *arg)
{
    if (h->nconns) return AP_ESTATE;
    ap_identity_t id = h->creds.id;
    ap__secure_creds_clear(&h->creds);
    int rc = b && b->native ? ap__secure_creds_init_muxers(&h->creds, &id, AP_NOISE_SHA256, NULL,
                                                           node_muxer_list, 2)
                            : ap__secure_creds_init_muxers(&h->creds, &id, AP_NOISE_SHA256, NULL,
                                                           muxer_list, 1);
    ap_identity_wipe(&id);
    if (rc) return rc;
    h->bridge = b;
    h->bridge_arg = arg;
    return 0;
}

void *ap__p2p_host_bridge_arg(const ap_p2p_host_t *h)
{
    return h->bridge_arg;
}

void ap__p2p_host_set_addrs(ap_p2p_host_t *h, ap_p2p_addrs_fn fn, void *arg)
{
    h->addrs_fn = fn;
    h->addrs_arg = arg;
}

int ap__p2p_host_serve(ap_p2p_host_t *h, const ap_p2p_proto_t *proto)
{
    if (h->nprotos == PROTOS_MAX) return AP_ELIMIT;
    h->protos[h->nprotos] = proto;
    h->names[h->nprotos++] = proto->name;
    h->ctl_names[h->nctl++] = proto->name;
    return 0;
}

int ap__p2p_host_serve_bulk(ap_p2p_host_t *h, const ap_p2p_proto_t *proto)
{
    int rc = ap__p2p_host_serve(h, proto);
    if (rc == 0) h->nctl--;
    return rc;
}

int ap__p2p_host_serve_basics(ap_p2p_host_t *h)
{
    int rc = ap__p2p_host_serve(h, &id_srv);
    return rc ? rc : ap__p2p_host_serve(h, &ping_srv);
}

int ap__p2p_host_serve_echo(ap_p2p_host_t *h)
{
    return ap__p2p_host_serve_bulk(h, &echo_srv);
}

static void on_conn(uv_stream_t *srv, int status)
{
    ap_p2p_host_t *h = srv->data;
    if (status != 0) return;
    ap_p2p_conn_t *c = ap__p2p_conn_new(h, false, NULL);
    if (!c) return;
    if (uv_accept(srv, (uv_stream_t *)&c->tcp) != 0) {
        ap__p2p_conn_fail(c, AP_EIO);
        return;
    }
    uint8_t ip[16];
    sock_ip16(&c->tcp, ip);
    if (!admit_inbound(c, ip)) return;
    ap__p2p_conn_start(c);
}

int ap__p2p_host_listen(ap_p2p_host_t *h, const ap_multiaddr_t *ma, ap_multiaddr_t *bound)
{
    struct sockaddr_storage ss;
    int rc = ap_multiaddr_to_sockaddr(ma, &ss, sizeof ss);
    if (rc) return rc;
    if ((rc = uv_tcp_init(h->loop, &h->listener)) != 0) return ap_err_from_errno(rc);
    h->listener.data = h;
    h->listening = true;
    int one = 1, fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return AP_ESYS;
    /* SO_REUSEPORT: dials may leave from this port (hole punching) */
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    if ((rc = uv_tcp_open(&h->listener, fd)) != 0) {
        close(fd);
        return ap_err_from_errno(rc);
    }
    if ((rc = uv_tcp_bind(&h->listener, (struct sockaddr *)&ss, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&h->listener, 128, on_conn)) != 0)
        return ap_err_from_errno(rc);
    int len = sizeof ss;
    uv_tcp_getsockname(&h->listener, (struct sockaddr *)&ss, &len);
    ap_multiaddr_from_sockaddr(&h->bound, &ss);
    if (bound) *bound = h->bound;
    return 0;
}

static void listener_closed(uv_handle_t *hd)
{
    ap_p2p_host_t *h = hd->data;
    h->listening = false;
    if (h->nconns == 0 && !h->hs_timer_open) ap__p2p_host_release(h);
}

static void timer_closed(uv_handle_t *hd)
{
    ap_p2p_host_t *h = hd->data;
    h->hs_timer_open = false;
    if (h->nconns == 0 && !h->listening) ap__p2p_host_release(h);
}

void ap__p2p_host_free(ap_p2p_host_t *h)
{
    h->freeing = true;
    for (ap_p2p_conn_t *c = h->conns; c; c = c->next) ap__p2p_conn_fail(c, AP_ESHUTDOWN);
    if (h->hs_timer_open && !uv_is_closing((uv_handle_t *)&h->hs_timer))
        uv_close((uv_handle_t *)&h->hs_timer, timer_closed);
    if (h->listening) {
        uv_close((uv_handle_t *)&h->listener, listener_closed);
        return;
    }
}

void ap__p2p_host_free_then(ap_p2p_host_t *h, void (*done)(void *arg), void *arg)
{
    h->done = done;
    h->done_arg = arg;
    ap__p2p_host_free(h);
}

int ap__p2p_host_adopt(ap_p2p_host_t *h, uv_os_sock_t sock, const uint8_t *pre, size_t n,
                       uint64_t aid, uint64_t deadline)
{
    ap_p2p_conn_t *c = h->freeing ? NULL : ap__p2p_conn_new(h, false, NULL);
    if (!c) {
        if (aid) ap_admit_gone(h->admit, aid);
        close(sock);
        return h->freeing ? AP_ESHUTDOWN : AP_ENOMEM;
    }
    if (aid && !ap_admit_rekey(h->admit, aid, admit_id(c))) {
        ap_admit_gone(h->admit, aid);
        aid = 0;
    }
    if (aid) c->admit_id = admit_id(c);
    if (deadline) c->hs_deadline = deadline;
    if (uv_tcp_open(&c->tcp, sock) != 0) {
        close(sock);
        ap__p2p_conn_fail(c, AP_EIO);
        return AP_EIO;
    }
    uint8_t ip[16];
    sock_ip16(&c->tcp, ip);
    if (!c->admit_id && !admit_inbound(c, ip)) return AP_ELIMIT;
    if (n > 0 && ap__buf_reserve(&c->raw, n) != 0) {
        ap__p2p_conn_fail(c, AP_ENOMEM); /* closes sock with the handle */
        return AP_ENOMEM;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    memcpy(c->raw.data, pre, n);
    c->raw.len = n;
    c->batch++;
    ap__p2p_conn_start(c);
    if (n > 0 && !c->closing) ap__p2p_conn_process(c);
    c->batch--;
    ap__p2p_conn_submit(c);
    return 0;
}

/* ---- connections over a stream (relayed), lookup ------------------------------ */

int ap__p2p_conn_over(ap_p2p_stream_t *carrier, bool initiator, const ap_peer_id_t *expected,
                      const ap_multiaddr_t *remote, const uint8_t *pre, size_t n,
                      const ap_p2p_conn_cbs_t *cbs, void *arg, ap_p2p_conn_t **out)
{
    ap_p2p_host_t *h = carrier->c->h;
    if (h->freeing || carrier->inner || !carrier->ready) return AP_ESTATE;
    ap_p2p_conn_t *c = ap__p2p_conn_new(h, initiator, expected);
    if (!c) return AP_ENOMEM;
    c->cr = &h->ycreds;
    if (ap__secure_init(&c->hs, c->cr, initiator, expected, NULL) != 0) {
        ap__p2p_conn_fail(c, AP_ENOMEM);
        return AP_ENOMEM;
    }
    c->relayed = true;
    c->car = carrier;
    carrier->inner = c;
    c->remote = *remote;
    if (cbs) c->cbs = *cbs;
    c->arg = arg;
    if (out) *out = c;
    ap__p2p_conn_start(c);
    if (n > 0 && !c->closing) {
        if (ap__buf_append(&c->raw, pre, n) != 0)
            ap__p2p_conn_fail(c, AP_ENOMEM);
        else
            ap__p2p_conn_process(c);
    }
    return 0;
}

bool ap__p2p_conn_relayed(const ap_p2p_conn_t *c)
{
    return c->relayed;
}

void ap__p2p_host_relay_bulk(ap_p2p_host_t *h, bool allow)
{
    h->relay_bulk = allow;
}

ap_p2p_conn_t *ap__p2p_host_find(ap_p2p_host_t *h, const ap_peer_id_t *peer, int which)
{
    ap_p2p_conn_t *relayed = NULL;
    for (ap_p2p_conn_t *c = h->conns; c; c = c->next) {
        if (!c->ready || c->closing || memcmp(&c->peer, peer, sizeof *peer) != 0) continue;
        if (!c->relayed && which != AP_P2P_FIND_RELAYED) return c;
        if (c->relayed && !relayed) relayed = c;
    }
    return which == AP_P2P_FIND_DIRECT ? NULL : relayed;
}
