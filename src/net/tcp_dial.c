/* Secure TCP transport: dialing. Resolving, connecting, joining a dial to a
 * pending or open connection to the same peer, and completing dials. */
#include "net/tcp_impl.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- dial completion ------------------------------------------------------- */

void ap__tcp_dial_done(dial_req_t *r, int status, ap_tcp_conn_t *c)
{
    r->cb(r->arg, status, status == 0 ? c : NULL);
    free(r);
}

void ap__tcp_dials_done(ap_tcp_conn_t *c, int status)
{
    while (c->reqs) {
        dial_req_t *r = c->reqs;
        c->reqs = r->next;
        ap__tcp_dial_done(r, status, c);
        /* a callback may have closed c: the rest then fail */
        if (status == 0 && c->st != C_OPEN) status = AP_ECLOSED;
    }
}

static void kick_cb(uv_timer_t *h)
{
    ap_tcp_t *t = h->data;
    while (t->deferred) {
        dial_req_t *r = t->deferred;
        ap__tcp_list_remove(&t->deferred, r);
        ap_tcp_conn_t *c = NULL;
        int status = r->status;
        if (status == 0) {
            c = r->ma.has_peer ? ap__tcp_find(t, &r->ma.peer) : NULL;
            if (!c) status = AP_ECLOSED;
        }
        ap__tcp_dial_done(r, status, c);
    }
}

static void defer_req(ap_tcp_t *t, dial_req_t *r, int status)
{
    r->status = status;
    ap__tcp_list_push(&t->deferred, r);
    uv_timer_start(&t->kick, kick_cb, 0, 0);
}

static void on_connect(uv_connect_t *req, int status)
{
    ap_tcp_conn_t *c = req->data;
    if (c->st == C_CLOSING) return;
    if (status < 0) {
        ap_debug(MOD, "connect to %s failed: %s", c->who, uv_strerror(status));
        int e = ap_err_from_errno(status);
        ap__tcp_conn_abort(c, e == AP_ETIMEDOUT || e == AP_ECANCELED ? e : AP_EUNREACH);
        return;
    }
    int rc = ap__tcp_hs_start(c);
    if (rc) ap__tcp_conn_abort(c, rc);
}

static void start_connect(ap_tcp_t *t, dial_req_t *r, const ap_multiaddr_t *ma)
{
    ap_tcp_conn_t *c = ap__tcp_conn_new(t, true);
    if (!c) {
        defer_req(t, r, AP_ENOMEM);
        return;
    }
    r->next = NULL;
    c->reqs = r;
    c->deadline = r->deadline;
    c->counted_hs = true;
    t->nhandshaking++;
    if (ma->has_peer) {
        c->has_expected = true;
        c->expected = ma->peer;
    }
    char text[AP_MA_TEXT_MAX];
    ap_multiaddr_t bare = *ma;
    bare.has_peer = false;
    ap_multiaddr_print(&bare, text, sizeof text);
    size_t wl = strnlen(text, sizeof c->who - 1);
    memcpy(c->who, text, wl);
    c->who[wl] = 0;
    struct sockaddr_storage ss;
    int rc = ap_multiaddr_to_sockaddr(ma, &ss, sizeof ss);
    if (rc == 0) {
        /* the node's own dials have slots of their own (base/admit.h) */
        uint8_t ip[16];
        ap__tcp_ip16(&ss, ip);
        if (!ap_admit_outbound(&t->admit, (uint64_t)(uintptr_t)c, ip)) {
            ap_debug(MOD, "not dialling %s: %u connections open", c->who,
                     ap_admit_stats(&t->admit)->open_in + ap_admit_stats(&t->admit)->open_out);
            ap__tcp_conn_abort(c, AP_ELIMIT);
            return;
        }
        c->admitted = true;
    }
    if (rc == 0)
        rc = ap_err_from_errno(uv_tcp_connect(&c->creq, &c->h, (struct sockaddr *)&ss, on_connect));
    if (rc) ap__tcp_conn_abort(c, AP_EUNREACH);
}

static void on_resolved(void *arg, int status, const ap_multiaddr_t *addrs, size_t n)
{
    dial_req_t *r = arg;
    ap_tcp_t *t = r->t;
    ap__tcp_list_remove(&t->resolving, r);
    r->res = NULL;
    t->handles--;
    if (t->closing)
        status = AP_ESHUTDOWN;
    else if (r->timed_out)
        status = AP_ETIMEDOUT;
    else if (status == AP_ENOTFOUND)
        status = AP_EUNREACH;
    if (status != 0 || n == 0) {
        ap__tcp_dial_done(r, status ? status : AP_EUNREACH, NULL);
        ap__tcp_maybe_finish(t);
        return;
    }
    start_connect(t, r, &addrs[0]);
}

static ap_tcp_conn_t *find_pending(ap_tcp_t *t, const ap_peer_id_t *peer)
{
    for (ap_tcp_conn_t *c = t->conns; c; c = c->next)
        if (c->outbound && c->has_expected && (c->st == C_CONNECTING || c->st == C_HANDSHAKE) &&
            ap_peer_id_eq(&c->expected, peer))
            return c;
    return NULL;
}

int ap__tcp_dial(ap_tcp_t *t, const char *addr, uint64_t timeout_ms, ap_tcp_dial_fn cb, void *arg)
{
    if (t->closing) return AP_ESHUTDOWN;
    if (!cb) return AP_EINVAL;
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) != 0 || !ma.has_tcp || ma.host == AP_MA_HOST_NONE)
        return AP_EADDR;
    if (ma.has_peer && ap_peer_id_eq(&ma.peer, &t->creds.id.id)) return AP_EINVAL;
    dial_req_t *r = calloc(1, sizeof *r);
    if (!r) return AP_ENOMEM;
    r->t = t;
    r->cb = cb;
    r->arg = arg;
    r->ma = ma;
    r->deadline = ap__tcp_now_ms(t) + (timeout_ms ? timeout_ms : 30000);
    if (ma.has_peer) {
        if (ap__tcp_find(t, &ma.peer)) {
            defer_req(t, r, 0);
            return 0;
        }
        ap_tcp_conn_t *pc = find_pending(t, &ma.peer);
        if (pc) {
            r->next = pc->reqs;
            pc->reqs = r;
            return 0;
        }
    }
    const ap_admit_stats_t *as = ap_admit_stats(&t->admit);
    if (t->nconns >= t->cfg.max_conns + t->cfg.max_handshakes ||
        as->open_in + as->open_out >= t->cfg.max_conns) {
        free(r);
        return AP_ELIMIT;
    }
    if (ma.host == AP_MA_HOST_DNS4 || ma.host == AP_MA_HOST_DNS6) {
        int rc = ap_multiaddr_resolve(t->loop, &ma, on_resolved, r, &r->res);
        if (rc) {
            free(r);
            return rc;
        }
        ap__tcp_list_push(&t->resolving, r);
        t->handles++;
        return 0;
    }
    start_connect(t, r, &ma);
    return 0;
}
