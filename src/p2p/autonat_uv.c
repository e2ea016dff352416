/* AutoNAT v1 server and client, one-shot identify, on libuv (see
 * autonat_uv.h). */
#include "p2p/autonat_uv.h"

#include "apiary/error.h"
#include "apiary/log.h"
#include "base/buf.h"

#include <stdlib.h>
#include <string.h>

#define IN_MAX (AP_IDENTIFY_MSG_MAX + 16)

static void short_of(const ap_p2p_conn_t *c, char out[AP_PEER_SHORT_LEN])
{
    const ap_peer_id_t *p = ap__p2p_conn_peer(c);
    if (p)
        ap_peer_id_short(p, out);
    else
        snprintf(out, AP_PEER_SHORT_LEN, "(unknown)");
}

/* ---- client: one request, one answer ---------------------------------------------- */

typedef struct oneshot {
    ap_p2p_host_t *h;
    uv_timer_t timer;
    bool timer_live, conn_live, reported, is_identify;
    ap_p2p_conn_t *c;
    uint8_t req[AP_AUTONAT_MSG_MAX + 16];
    size_t reqn;
    ap_buf_t in;
    ap_autonat_probe_cb acb;
    ap_identify_cb icb;
    void *arg;
} oneshot_t;

static void os_maybe_free(oneshot_t *o)
{
    if (o->timer_live || o->conn_live) return;
    ap__buf_free(&o->in);
    free(o);
}

static void os_timer_closed(uv_handle_t *hd)
{
    oneshot_t *o = hd->data;
    o->timer_live = false;
    os_maybe_free(o);
}

/* Reports once (status < 0: an AP_E* failure), then winds down. */
static void os_report(oneshot_t *o, int status, const ap_autonat_msg_t *am, const ap_identify_t *id)
{
    if (o->reported) return;
    o->reported = true;
    if (o->is_identify)
        o->icb(o->arg, status, status == 0 ? id : NULL);
    else if (status < 0)
        o->acb(o->arg, status, NULL, NULL);
    else
        o->acb(o->arg, am->status, am->has_addr ? &am->addr : NULL, am->text);
    if (o->conn_live && o->c) ap__p2p_conn_close(o->c);
    if (o->timer_live && !uv_is_closing((uv_handle_t *)&o->timer))
        uv_close((uv_handle_t *)&o->timer, os_timer_closed);
}

static void os_on_open(ap_p2p_stream_t *s)
{
    oneshot_t *o = ap__p2p_stream_udata(s);
    if (o->reqn && ap__p2p_stream_write(s, o->req, o->reqn) != 0) os_report(o, AP_EIO, NULL, NULL);
}

static void os_on_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    oneshot_t *o = ap__p2p_stream_udata(s);
    if (o->reported) return;
    if (o->in.len + n > IN_MAX || ap__buf_append(&o->in, p, n) != 0) {
        os_report(o, AP_EMSGSIZE, NULL, NULL);
        return;
    }
    size_t hl, bl;
    int f = o->is_identify ? ap__identify_frame(o->in.data, o->in.len, &hl, &bl)
                           : ap__autonat_frame(o->in.data, o->in.len, &hl, &bl);
    if (f < 0) {
        os_report(o, f, NULL, NULL);
        return;
    }
    if (f == 0 || o->in.len < hl + bl) return;
    if (o->is_identify) {
        static ap_identify_t id; /* large; the loop thread is the only user */
        int rc = ap__identify_decode(o->in.data + hl, bl, &id);
        os_report(o, rc, NULL, &id);
        return;
    }
    ap_autonat_msg_t m;
    int rc = ap__autonat_decode(o->in.data + hl, bl, &m);
    if (rc == 0 && (m.type != AP_AUTONAT_DIAL_RESPONSE || !m.has_response || m.status < 0))
        rc = AP_ECORRUPT;
    os_report(o, rc, &m, NULL);
}

static void os_on_fin(ap_p2p_stream_t *s)
{
    os_report(ap__p2p_stream_udata(s), AP_ECLOSED, NULL, NULL);
}

static void os_on_close(ap_p2p_stream_t *s, int status)
{
    os_report(ap__p2p_stream_udata(s), status ? status : AP_ECLOSED, NULL, NULL);
}

static const ap_p2p_proto_t autonat_client = {AP_AUTONAT_PROTO, os_on_open, os_on_data, os_on_fin,
                                              os_on_close};
static const ap_p2p_proto_t identify_client = {AP_IDENTIFY_PROTO, os_on_open, os_on_data, os_on_fin,
                                               os_on_close};

static void os_ready(ap_p2p_conn_t *c, void *arg)
{
    oneshot_t *o = arg;
    int rc = ap__p2p_stream_open(c, o->is_identify ? &identify_client : &autonat_client, o, NULL);
    if (rc) os_report(o, rc, NULL, NULL);
}

static void os_closed(ap_p2p_conn_t *c, void *arg, int status)
{
    oneshot_t *o = arg;
    o->conn_live = false;
    o->c = NULL;
    os_report(o, status ? status : AP_ECLOSED, NULL, NULL);
    os_maybe_free(o);
}

static void os_timeout(uv_timer_t *t)
{
    os_report(t->data, AP_ETIMEDOUT, NULL, NULL);
}

static int os_start(oneshot_t *o, const ap_multiaddr_t *ma, uint64_t timeout_ms)
{
    uv_loop_t *loop = ap__p2p_host_loop(o->h);
    if (uv_timer_init(loop, &o->timer) != 0) {
        free(o);
        return AP_EIO;
    }
    o->timer.data = o;
    o->timer_live = true;
    uv_timer_start(&o->timer, os_timeout, timeout_ms, 0);
    static const ap_p2p_conn_cbs_t cbs = {os_ready, os_closed};
    o->conn_live = true;
    int rc = ap__p2p_dial(o->h, ma, &cbs, o, &o->c);
    if (rc) {
        o->conn_live = false;
        o->reported = true; /* the caller gets rc, not a callback */
        uv_close((uv_handle_t *)&o->timer, os_timer_closed);
    }
    return rc;
}

int ap__autonat_probe(ap_p2p_host_t *h, const ap_multiaddr_t *server, const ap_multiaddr_t *addrs,
                      size_t n, uint64_t timeout_ms, ap_autonat_probe_cb cb, void *arg)
{
    oneshot_t *o = calloc(1, sizeof *o);
    if (!o) return AP_ENOMEM;
    o->h = h;
    o->acb = cb;
    o->arg = arg;
    const ap_identity_t *me = ap__p2p_host_identity(h);
    int w = ap__autonat_encode_dial(&me->id, addrs, n, o->req, sizeof o->req);
    if (w < 0) {
        free(o);
        return w;
    }
    o->reqn = (size_t)w;
    return os_start(o, server, timeout_ms);
}

int ap__p2p_identify_peer(ap_p2p_host_t *h, const ap_multiaddr_t *peer, uint64_t timeout_ms,
                          ap_identify_cb cb, void *arg)
{
    oneshot_t *o = calloc(1, sizeof *o);
    if (!o) return AP_ENOMEM;
    o->h = h;
    o->icb = cb;
    o->arg = arg;
    o->is_identify = true;
    return os_start(o, peer, timeout_ms);
}

/* ---- server ------------------------------------------------------------------------ */

struct ap_autonat_service {
    ap_p2p_proto_t proto; /* first: a stream's proto leads back here */
    ap_p2p_host_t *h;
    ap_autonat_srv_t pol;
    uint64_t timeout_ms;
    ap_autonat_stats_t st;
};

typedef struct sreq {
    ap_autonat_service_t *svc;
    ap_p2p_stream_t *s;
    ap_buf_t in;
    bool decided, answered;
    ap_multiaddr_t dial[AP_AUTONAT_DIAL_MAX];
    size_t ndial, at;
    ap_p2p_conn_t *back;
    bool back_live, timer_init, timer_live;
    uv_timer_t timer;
    char who[AP_PEER_SHORT_LEN];
} sreq_t;

static void sr_maybe_free(sreq_t *r)
{
    if (r->s || r->back_live || r->timer_live) return;
    ap__buf_free(&r->in);
    free(r);
}

static void sr_timer_closed(uv_handle_t *hd)
{
    sreq_t *r = hd->data;
    r->timer_live = false;
    sr_maybe_free(r);
}

static void sr_answer(sreq_t *r, int status, const char *text, const ap_multiaddr_t *addr)
{
    if (r->answered) return;
    r->answered = true;
    ap_autonat_stats_t *st = &r->svc->st;
    if (status == AP_AUTONAT_OK)
        st->ok++;
    else if (status == AP_AUTONAT_E_DIAL_ERROR)
        st->dial_error++;
    else if (status == AP_AUTONAT_E_DIAL_REFUSED)
        st->refused++;
    else
        st->bad++;
    if (r->s) {
        uint8_t buf[AP_AUTONAT_MSG_MAX + 16];
        int n = ap__autonat_encode_response(status, text, addr, buf, sizeof buf);
        if (n > 0) ap__p2p_stream_write(r->s, buf, (size_t)n);
        ap__p2p_stream_close(r->s);
    }
    if (r->timer_live && !uv_is_closing((uv_handle_t *)&r->timer))
        uv_close((uv_handle_t *)&r->timer, sr_timer_closed);
}

static void sr_dial_next(sreq_t *r);

static void back_ready(ap_p2p_conn_t *c, void *arg)
{
    sreq_t *r = arg;
    char a[AP_MA_TEXT_MAX];
    ap_multiaddr_print(&r->dial[r->at], a, sizeof a);
    ap_debug("autonat", "peer %s: dialled back at %s", r->who, a);
    ap_multiaddr_t reached = r->dial[r->at];
    reached.has_peer = false;
    sr_answer(r, AP_AUTONAT_OK, "dialled back", &reached);
    ap__p2p_conn_close(c);
}

static void back_closed(ap_p2p_conn_t *c, void *arg, int status)
{
    sreq_t *r = arg;
    r->back_live = false;
    r->back = NULL;
    if (!r->answered && r->s) {
        r->at++;
        sr_dial_next(r);
    }
    sr_maybe_free(r);
}

static void sr_timeout(uv_timer_t *t)
{
    sreq_t *r = t->data;
    if (r->back_live && r->back) ap__p2p_conn_close(r->back);
}

static void sr_dial_next(sreq_t *r)
{
    static const ap_p2p_conn_cbs_t cbs = {back_ready, back_closed};
    while (r->at < r->ndial) {
        r->back_live = true;
        int rc = ap__p2p_dial(r->svc->h, &r->dial[r->at], &cbs, r, &r->back);
        if (rc == 0) {
            uv_timer_start(&r->timer, sr_timeout, r->svc->timeout_ms, 0);
            return;
        }
        r->back_live = false;
        r->at++;
    }
    sr_answer(r, AP_AUTONAT_E_DIAL_ERROR, "no address answered", NULL);
}

static void sr_refuse(sreq_t *r, int status, const char *why)
{
    ap_warn("autonat", "peer %s: request refused (%s): %s", r->who, ap__autonat_status_name(status),
            why);
    sr_answer(r, status, why, NULL);
}

static void sr_on_open(ap_p2p_stream_t *s)
{
    sreq_t *r = calloc(1, sizeof *r);
    if (!r) {
        ap__p2p_stream_reset(s);
        return;
    }
    r->svc = (ap_autonat_service_t *)ap__p2p_stream_proto(s);
    r->s = s;
    short_of(ap__p2p_stream_conn(s), r->who);
    ap__p2p_stream_set_udata(s, r);
}

static void sr_on_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    sreq_t *r = ap__p2p_stream_udata(s);
    if (!r || r->decided) return; /* one request per stream */
    if (r->in.len + n > AP_AUTONAT_MSG_MAX + 16 || ap__buf_append(&r->in, p, n) != 0) {
        r->decided = true;
        sr_refuse(r, AP_AUTONAT_E_BAD_REQUEST, "request too large");
        return;
    }
    size_t hl, bl;
    int f = ap__autonat_frame(r->in.data, r->in.len, &hl, &bl);
    if (f == 0 || (f == 1 && r->in.len < hl + bl)) return;
    r->decided = true;
    ap_autonat_msg_t m;
    int rc = f < 0 ? f : ap__autonat_decode(r->in.data + hl, bl, &m);
    if (rc) {
        char why[64];
        snprintf(why, sizeof why, "malformed request: %s", ap_err_name(rc));
        sr_refuse(r, AP_AUTONAT_E_BAD_REQUEST, why);
        return;
    }
    ap_p2p_conn_t *c = ap__p2p_stream_conn(s);
    const ap_peer_id_t *from = ap__p2p_conn_peer(c);
    char why[160];
    uint64_t now_us = uv_now(ap__p2p_host_loop(r->svc->h)) * 1000ull;
    int st = from ? ap__autonat_srv_check(&r->svc->pol, &m, from, ap__p2p_conn_remote(c), false,
                                          now_us, r->dial, &r->ndial, why, sizeof why)
                  : AP_AUTONAT_E_INTERNAL;
    if (st != AP_AUTONAT_OK) {
        sr_refuse(r, st, from ? why : "no peer");
        return;
    }
    if (uv_timer_init(ap__p2p_host_loop(r->svc->h), &r->timer) != 0) {
        sr_answer(r, AP_AUTONAT_E_INTERNAL, "no timer", NULL);
        return;
    }
    r->timer.data = r;
    r->timer_init = r->timer_live = true;
    sr_dial_next(r);
}

static void sr_on_close(ap_p2p_stream_t *s, int status)
{
    sreq_t *r = ap__p2p_stream_udata(s);
    if (!r) return;
    r->s = NULL;
    if (!r->answered) {
        r->answered = true; /* nobody to answer */
        if (r->back_live && r->back) ap__p2p_conn_close(r->back);
        if (r->timer_live && !uv_is_closing((uv_handle_t *)&r->timer))
            uv_close((uv_handle_t *)&r->timer, sr_timer_closed);
    }
    sr_maybe_free(r);
}

ap_autonat_service_t *ap__autonat_serve(ap_p2p_host_t *h, uint64_t dial_timeout_ms)
{
    ap_autonat_service_t *svc = calloc(1, sizeof *svc);
    if (!svc) return NULL;
    svc->proto = (ap_p2p_proto_t){AP_AUTONAT_PROTO, sr_on_open, sr_on_data, NULL, sr_on_close};
    svc->h = h;
    svc->timeout_ms = dial_timeout_ms;
    ap__autonat_srv_init(&svc->pol);
    if (ap__p2p_host_serve(h, &svc->proto) != 0) {
        free(svc);
        return NULL;
    }
    return svc;
}

void ap__autonat_service_free(ap_autonat_service_t *svc)
{
    free(svc);
}

ap_autonat_stats_t ap__autonat_service_stats(const ap_autonat_service_t *svc)
{
    return svc->st;
}
