/* Circuit relay v2, client side: reservations, the stop protocol, and
 * dialling through a relay (see relay_svc.h). */
#include "apiary/error.h"
#include "apiary/log.h"
#include "base/buf.h"
#include "p2p/identify.h"
#include "p2p/relay_svc.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RETRY_MS        2000
#define RESV_TIMEOUT_MS 10000
#define DIAL_TIMEOUT_MS 10000

static ap_relay_msg_t msg; /* loop thread only */
static uint8_t obuf[AP_RELAY_MSG_MAX + 16];

static void send_msg(ap_p2p_stream_t *s, const ap_relay_msg_t *m)
{
    int n = ap__relay_encode(m, obuf, sizeof obuf);
    if (n > 0) ap__p2p_stream_write(s, obuf, (size_t)n);
}

/* ---- reservations ---------------------------------------------------------------- */

typedef struct relay_ent {
    struct ap_relay_client *cl;
    ap_multiaddr_t ma; /* the relay, with /p2p/RELAY */
    ap_p2p_conn_t *conn;
    bool live;
    uint64_t expire_ms; /* loop time */
    ap_multiaddr_t raddrs[AP_RELAY_ADDRS_MAX];
    size_t nraddrs;
    ap_relay_rd_t rd;
    uv_timer_t timer; /* refresh, retry */
    /* what the relay sees of us (identify on the relay connection) */
    bool id_asked, has_obs;
    ap_multiaddr_t obs;
    ap_buf_t idb;
} relay_ent_t;

struct ap_relay_client {
    ap_p2p_proto_t stop; /* first: a stream's proto leads back here */
    ap_p2p_host_t *h;
    relay_ent_t r[AP_RELAY_CLIENT_MAX];
    size_t n, nclosing;
    unsigned reservations;
    ap_relay_inbound_fn on_inbound;
    void *arg;
};

static void ent_tick(uv_timer_t *t);
static void ent_identify(relay_ent_t *e);

static void ent_later(relay_ent_t *e, uint64_t ms)
{
    uv_timer_start(&e->timer, ent_tick, ms, 0);
}

static void resv_open(ap_p2p_stream_t *s)
{
    memset(&msg, 0, sizeof msg);
    msg.type = AP_RELAY_HOP_RESERVE;
    send_msg(s, &msg);
}

static void resv_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    relay_ent_t *e = ap__p2p_stream_udata(s);
    char b[AP_PEER_SHORT_LEN];
    if (!e) return;
    size_t used;
    int rc = ap__relay_rd_feed(&e->rd, false, p, n, &msg, &used);
    if (rc == 0) return;
    ap__p2p_stream_set_udata(s, NULL);
    ap__p2p_stream_close(s);
    uv_loop_t *loop = ap__p2p_host_loop(e->cl->h);
    if (rc < 0 || msg.type != AP_RELAY_HOP_STATUS || msg.status != AP_RELAY_OK ||
        !msg.has_reservation) {
        ap_warn("relay", "relay %s: reservation refused: %s", ap_peer_id_short(&e->ma.peer, b),
                rc < 0 ? ap_err_name(rc) : ap__relay_status_name(msg.status));
        if (e->live && uv_now(loop) >= e->expire_ms) e->live = false;
        ent_later(e, RETRY_MS);
        return;
    }
    int64_t ttl = (int64_t)msg.expire - (int64_t)time(NULL);
    if (ttl < 1) ttl = 1;
    e->live = true;
    e->expire_ms = uv_now(loop) + (uint64_t)ttl * 1000u;
    e->nraddrs = 0;
    for (size_t i = 0; i < msg.nraddrs; i++)
        if (msg.raddrs[i].has_tcp && msg.raddrs[i].host != AP_MA_HOST_NONE)
            e->raddrs[e->nraddrs++] = msg.raddrs[i];
    e->cl->reservations++;
    ap_debug("relay", "relay %s: reserved for %lld s", ap_peer_id_short(&e->ma.peer, b),
             (long long)ttl);
    uint64_t refresh = (uint64_t)ttl * 750u; /* at 3/4 of its lifetime */
    ent_later(e, refresh < 1000 ? 1000 : refresh);
    ent_identify(e);
}

/* identify on the relay connection: the address the relay sees us at */
static void rid_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    relay_ent_t *e = ap__p2p_stream_udata(s);
    if (!e) return;
    size_t hl, bl;
    int f = 0;
    if (e->idb.len + n > AP_IDENTIFY_MSG_MAX + 16 || ap__buf_append(&e->idb, p, n) != 0 ||
        (f = ap__identify_frame(e->idb.data, e->idb.len, &hl, &bl)) < 0) {
        f = -1;
    } else if (f == 0 || e->idb.len < hl + bl) {
        return;
    } else {
        static ap_identify_t id; /* large; the loop thread is the only user */
        if (ap__identify_decode(e->idb.data + hl, bl, &id) == 0 && id.has_observed &&
            !id.observed.circuit &&
            (id.observed.host == AP_MA_HOST_IP4 || id.observed.host == AP_MA_HOST_IP6)) {
            e->obs = id.observed;
            e->obs.has_tcp = e->obs.has_peer = false;
            e->has_obs = true;
        }
    }
    ap__buf_free(&e->idb);
    ap__p2p_stream_set_udata(s, NULL);
    ap__p2p_stream_close(s);
}

static void rid_close(ap_p2p_stream_t *s, int st)
{
    relay_ent_t *e = ap__p2p_stream_udata(s);
    (void)st;
    if (e) ap__buf_free(&e->idb);
}

static const ap_p2p_proto_t rid_proto = {AP_IDENTIFY_PROTO, NULL, rid_data, NULL, rid_close};

static void ent_identify(relay_ent_t *e)
{
    ap_p2p_stream_t *s;
    if (e->id_asked || !e->conn) return;
    e->id_asked = true;
    e->idb.len = 0;
    if (ap__p2p_stream_open(e->conn, &rid_proto, e, &s) != 0) e->id_asked = false;
}

static void resv_close(ap_p2p_stream_t *s, int st)
{
    relay_ent_t *e = ap__p2p_stream_udata(s);
    (void)st;
    if (e) ent_later(e, RETRY_MS); /* no answer */
}

static const ap_p2p_proto_t resv_proto = {AP_RELAY_HOP_PROTO, resv_open, resv_data, NULL,
                                          resv_close};

static void ent_reserve(relay_ent_t *e)
{
    ap_p2p_stream_t *s;
    e->rd.len = 0;
    if (ap__p2p_stream_open(e->conn, &resv_proto, e, &s) != 0) {
        ent_later(e, RETRY_MS);
        return;
    }
    ent_later(e, RESV_TIMEOUT_MS); /* the answer's deadline */
}

static void ent_ready(ap_p2p_conn_t *c, void *arg)
{
    relay_ent_t *e = arg;
    e->conn = c;
    ent_reserve(e);
}

static void ent_closed(ap_p2p_conn_t *c, void *arg, int status)
{
    relay_ent_t *e = arg;
    char b[AP_PEER_SHORT_LEN];
    (void)c;
    e->conn = NULL;
    e->live = false;
    e->id_asked = false;
    if (status == AP_ESHUTDOWN) {
        uv_timer_stop(&e->timer);
        return;
    }
    ap_info("relay", "relay %s: connection lost (%s)", ap_peer_id_short(&e->ma.peer, b),
            ap_err_name(status));
    ent_later(e, RETRY_MS);
}

static const ap_p2p_conn_cbs_t ent_cbs = {ent_ready, ent_closed};

static void ent_tick(uv_timer_t *t)
{
    relay_ent_t *e = t->data;
    if (e->conn) {
        ent_reserve(e);
        return;
    }
    if (ap__p2p_dial_streams(e->cl->h, &e->ma, &ent_cbs, e, NULL) != 0) ent_later(e, RETRY_MS);
}

/* ---- the stop protocol (a relay brings us a circuit) ------------------------------ */

typedef struct stop_st {
    ap_relay_client_t *cl;
    ap_relay_rd_t rd;
    bool done;
} stop_st_t;

static void in_ready(ap_p2p_conn_t *c, void *arg)
{
    ap_relay_client_t *cl = arg;
    if (cl->on_inbound) cl->on_inbound(cl->arg, c);
}

static const ap_p2p_conn_cbs_t in_cbs = {in_ready, NULL};

static void stop_open(ap_p2p_stream_t *s)
{
    stop_st_t *st = calloc(1, sizeof *st);
    if (!st) {
        ap__p2p_stream_reset(s);
        return;
    }
    st->cl = (ap_relay_client_t *)ap__p2p_stream_proto(s);
    ap__p2p_stream_set_udata(s, st);
}

static void stop_answer(ap_p2p_stream_t *s, int status)
{
    memset(&msg, 0, sizeof msg);
    msg.stop = true;
    msg.type = AP_RELAY_STOP_STATUS;
    msg.has_status = true;
    msg.status = status;
    send_msg(s, &msg);
}

static void stop_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    stop_st_t *st = ap__p2p_stream_udata(s);
    char b[AP_PEER_SHORT_LEN];
    if (!st || st->done) return;
    size_t used;
    int rc = ap__relay_rd_feed(&st->rd, true, p, n, &msg, &used);
    if (rc == 0) return;
    st->done = true;
    ap_p2p_conn_t *rc_conn = ap__p2p_stream_conn(s);
    const ap_peer_id_t *relay = ap__p2p_conn_peer(rc_conn);
    if (rc < 0 || msg.type != AP_RELAY_STOP_CONNECT || !msg.has_peer || msg.peer_other) {
        ap_warn("relay", "relay %s: malformed stop message", ap_peer_id_short(relay, b));
        stop_answer(s, rc < 0 ? AP_RELAY_MALFORMED_MESSAGE : AP_RELAY_UNEXPECTED_MESSAGE);
        ap__p2p_stream_close(s);
        return;
    }
    const relay_ent_t *e = NULL;
    for (size_t i = 0; i < st->cl->n; i++)
        if (st->cl->r[i].live && ap_peer_id_eq(&st->cl->r[i].ma.peer, relay)) e = &st->cl->r[i];
    if (!e || ap__p2p_conn_relayed(rc_conn)) {
        ap_warn("relay", "peer %s: circuit refused: we hold no reservation there",
                ap_peer_id_short(relay, b));
        stop_answer(s, AP_RELAY_PERMISSION_DENIED);
        ap__p2p_stream_close(s);
        return;
    }
    ap_peer_id_t src = msg.peer;
    ap_multiaddr_t remote = *ap__p2p_conn_remote(rc_conn);
    remote.has_peer = true;
    remote.peer = *relay;
    remote.circuit = remote.has_dst = true;
    remote.dst = src;
    stop_answer(s, AP_RELAY_OK);
    if (ap__p2p_conn_over(s, false, &src, &remote, p + used, n - used, &in_cbs, st->cl, NULL) != 0)
        ap__p2p_stream_reset(s);
}

static void stop_close(ap_p2p_stream_t *s, int status)
{
    (void)status;
    free(ap__p2p_stream_udata(s));
}

ap_relay_client_t *ap__relay_client_new(ap_p2p_host_t *h, const ap_multiaddr_t *relays, size_t n,
                                        ap_relay_inbound_fn on_inbound, void *arg)
{
    if (n > AP_RELAY_CLIENT_MAX) return NULL;
    for (size_t i = 0; i < n; i++)
        if (!relays[i].has_peer || relays[i].circuit) return NULL;
    ap_relay_client_t *cl = calloc(1, sizeof *cl);
    if (!cl) return NULL;
    cl->h = h;
    cl->on_inbound = on_inbound;
    cl->arg = arg;
    cl->stop = (ap_p2p_proto_t){AP_RELAY_STOP_PROTO, stop_open, stop_data, NULL, stop_close};
    if (ap__p2p_host_serve(h, &cl->stop) != 0) {
        free(cl);
        return NULL;
    }
    cl->n = n;
    for (size_t i = 0; i < n; i++) {
        relay_ent_t *e = &cl->r[i];
        e->cl = cl;
        e->ma = relays[i];
        uv_timer_init(ap__p2p_host_loop(h), &e->timer);
        e->timer.data = e;
        ent_later(e, 0);
    }
    return cl;
}

static void ent_timer_closed(uv_handle_t *hd)
{
    relay_ent_t *e = hd->data;
    ap_relay_client_t *cl = e->cl;
    ap__buf_free(&e->idb);
    if (--cl->nclosing == 0) free(cl);
}

void ap__relay_client_free(ap_relay_client_t *cl)
{
    if (!cl) return;
    if (cl->n == 0) {
        free(cl);
        return;
    }
    cl->nclosing = cl->n;
    for (size_t i = 0; i < cl->n; i++) uv_close((uv_handle_t *)&cl->r[i].timer, ent_timer_closed);
}

int ap__relay_client_addrs(const ap_relay_client_t *cl, ap_multiaddr_t *out, int max)
{
    int k = 0;
    for (size_t i = 0; i < cl->n; i++) {
        const relay_ent_t *e = &cl->r[i];
        if (!e->live) continue;
        size_t na = e->nraddrs ? e->nraddrs : 1;
        for (size_t j = 0; j < na && k < max; j++) {
            ap_multiaddr_t a = e->nraddrs ? e->raddrs[j] : e->ma;
            a.has_peer = true;
            a.peer = e->ma.peer;
            a.circuit = true;
            a.has_dst = false;
            out[k++] = a;
        }
    }
    return k;
}

int ap__relay_client_observed(const ap_relay_client_t *cl, ap_multiaddr_t *out, int max)
{
    int k = 0;
    for (size_t i = 0; i < cl->n && k < max; i++) {
        const relay_ent_t *e = &cl->r[i];
        if (!e->has_obs) continue;
        bool dup = false;
        for (int j = 0; j < k && !dup; j++) dup = ap_multiaddr_eq(&out[j], &e->obs);
        if (!dup) out[k++] = e->obs;
    }
    return k;
}

unsigned ap__relay_client_reservations(const ap_relay_client_t *cl, unsigned *live)
{
    unsigned l = 0;
    for (size_t i = 0; i < cl->n; i++) l += cl->r[i].live;
    if (live) *live = l;
    return cl->reservations;
}

/* ---- dialling through a relay ------------------------------------------------------ */

typedef struct cdial {
    ap_p2p_host_t *h;
    ap_multiaddr_t relay, target;
    ap_p2p_conn_cbs_t cbs;
    void *arg;
    ap_relay_rd_t rd;
    ap_p2p_stream_t *s;
    struct rconn *rc; /* the relay connection we dialled, while we wait */
    uv_timer_t timer;
    bool over;
} cdial_t;

typedef struct rconn {
    cdial_t *d;
} rconn_t;

static void d_closed(uv_handle_t *hd)
{
    free(hd->data);
}

/* Reports status to the caller (unless 0: the connection took over), then
 * frees d. */
static void d_finish(cdial_t *d, int status)
{
    if (d->over) return;
    d->over = true;
    if (d->rc) d->rc->d = NULL;
    if (d->s) {
        ap_p2p_stream_t *s = d->s;
        d->s = NULL;
        ap__p2p_stream_set_udata(s, NULL);
        if (status) ap__p2p_stream_reset(s);
    }
    if (status && d->cbs.on_close) d->cbs.on_close(NULL, d->arg, status);
    uv_close((uv_handle_t *)&d->timer, d_closed);
}

static int status_err(int st)
{
    switch (st) {
    case AP_RELAY_NO_RESERVATION:
        return AP_ENOTFOUND;
    case AP_RELAY_RESOURCE_LIMIT_EXCEEDED:
        return AP_ELIMIT;
    case AP_RELAY_PERMISSION_DENIED:
        return AP_EPERM;
    default:
        return AP_EUNREACH;
    }
}

static void dh_open(ap_p2p_stream_t *s)
{
    cdial_t *d = ap__p2p_stream_udata(s);
    if (!d) return;
    memset(&msg, 0, sizeof msg);
    msg.type = AP_RELAY_HOP_CONNECT;
    msg.has_peer = true;
    msg.peer = d->target.dst;
    send_msg(s, &msg);
}

static void dh_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    cdial_t *d = ap__p2p_stream_udata(s);
    char b[AP_PEER_SHORT_LEN];
    if (!d) return;
    size_t used;
    int rc = ap__relay_rd_feed(&d->rd, false, p, n, &msg, &used);
    if (rc == 0) return;
    if (rc < 0 || msg.type != AP_RELAY_HOP_STATUS || msg.status != AP_RELAY_OK) {
        ap_info("relay", "relay %s: circuit to %s refused: %s", ap_peer_id_short(&d->relay.peer, b),
                "peer", rc < 0 ? ap_err_name(rc) : ap__relay_status_name(msg.status));
        d_finish(d, rc < 0 ? AP_EPROTO : status_err(msg.status));
        return;
    }
    d->s = NULL;
    ap__p2p_stream_set_udata(s, NULL);
    rc = ap__p2p_conn_over(s, true, &d->target.dst, &d->target, p + used, n - used, &d->cbs, d->arg,
                           NULL);
    if (rc) {
        ap__p2p_stream_reset(s);
        d_finish(d, rc);
        return;
    }
    d_finish(d, 0);
}

static void dh_close(ap_p2p_stream_t *s, int st)
{
    cdial_t *d = ap__p2p_stream_udata(s);
    if (!d) return;
    d->s = NULL;
    d_finish(d, st == AP_ENOPROTO ? AP_ENOTSUP : AP_EUNREACH);
}

static const ap_p2p_proto_t dial_proto = {AP_RELAY_HOP_PROTO, dh_open, dh_data, NULL, dh_close};

static void d_open_hop(cdial_t *d, ap_p2p_conn_t *c)
{
    int rc = ap__p2p_stream_open(c, &dial_proto, d, &d->s);
    if (rc) {
        d->s = NULL;
        d_finish(d, rc);
    }
}

static void rc_ready(ap_p2p_conn_t *c, void *arg)
{
    rconn_t *r = arg;
    if (!r->d) return;
    r->d->rc = NULL;
    cdial_t *d = r->d;
    r->d = NULL;
    d_open_hop(d, c);
}

static void rc_closed(ap_p2p_conn_t *c, void *arg, int status)
{
    rconn_t *r = arg;
    (void)c;
    (void)status;
    if (r->d) {
        r->d->rc = NULL;
        d_finish(r->d, AP_EUNREACH);
    }
    free(r);
}

static const ap_p2p_conn_cbs_t rc_cbs = {rc_ready, rc_closed};

static void d_timeout(uv_timer_t *t)
{
    d_finish(t->data, AP_ETIMEDOUT);
}

int ap__circuit_dial(ap_p2p_host_t *h, const ap_multiaddr_t *ma, const ap_p2p_conn_cbs_t *cbs,
                     void *arg)
{
    if (!ma->circuit || !ma->has_peer || !ma->has_dst || ma->host == AP_MA_HOST_NONE)
        return AP_EADDR;
    cdial_t *d = calloc(1, sizeof *d);
    if (!d) return AP_ENOMEM;
    d->h = h;
    d->target = *ma;
    d->relay = *ma;
    d->relay.circuit = d->relay.has_dst = false;
    d->cbs = *cbs;
    d->arg = arg;
    uv_timer_init(ap__p2p_host_loop(h), &d->timer);
    d->timer.data = d;
    uv_timer_start(&d->timer, d_timeout, DIAL_TIMEOUT_MS, 0);
    ap_p2p_conn_t *c = ap__p2p_host_find(h, &ma->peer, AP_P2P_FIND_DIRECT);
    if (c && !ap__p2p_conn_native(c)) { /* a connection with yamux streams */
        d_open_hop(d, c);
        return 0;
    }
    rconn_t *r = calloc(1, sizeof *r);
    if (!r) {
        d->over = true;
        uv_close((uv_handle_t *)&d->timer, d_closed);
        return AP_ENOMEM;
    }
    r->d = d;
    d->rc = r;
    int rc = ap__p2p_dial_streams(h, &d->relay, &rc_cbs, r, NULL);
    if (rc) {
        free(r);
        d->rc = NULL;
        d->over = true;
        uv_close((uv_handle_t *)&d->timer, d_closed);
        return rc;
    }
    return 0;
}
