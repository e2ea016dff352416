/* MASHA over runtime.h (sans-I/O): the server answers each phase's requests
 * once all M are in; workers call it once per phase. See masha.h. */
#include "apiary/log.h"
#include "apiary/masha.h"
#include "compress/masha_core.h"

#include <stdlib.h>
#include <string.h>

struct ap_masha_node {
    ap_rt_t *rt;
    bool is_server;
    ap_masha_problem_t *p;
    /* server */
    ap__masha_server_t *srv;
    ap_rpc_req_t **pending; /* per worker index */
    uint8_t *ver;           /* per worker index: wire version of the pending request */
    int M;
    const uint8_t **reqs; /* per worker index: pending request data */
    size_t *lens;
    ap_peer_id_t *owner; /* per worker index: the peer that first used it */
    bool *bound;
    ap_masha_bilinear_cfg_t pc;
    ap_masha_opts_t o;
    bool started;           /* a request was accepted */
    bool finished;          /* tracked run over: refuse further requests */
    ap__masha_worker_t *sh; /* tracking: shadow of worker 0 (needs p) */
    uint64_t watch;
    /* worker */
    ap__masha_worker_t *wk;
    ap_peer_id_t server;
    uint64_t call;
    size_t max_resp;
    ap_masha_done_fn done;
    void *done_arg;
};

static size_t msg_cap(size_t d)
{
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    return AP__MASHA_HDR + ap_compress_size(&none, d);
}

/* ---- server ---- */

/* Tracked run over (status 0) or broken (< 0): report once. */
static void server_finish(ap_masha_node_t *n, int status)
{
    if (n->finished) return;
    n->finished = true;
    if (n->watch) {
        ap_rt_peer_unwatch(n->rt, n->watch);
        n->watch = 0;
    }
    ap_masha_result_t r;
    ap__masha_worker_counts(n->sh, &r);
    if (n->done) n->done(n->done_arg, status, &r);
}

static void server_peer_event(ap_rt_t *rt, void *arg, const ap_peer_id_t *peer, ap_peer_event_t ev)
{
    (void)rt;
    ap_masha_node_t *n = arg;
    if (ev != AP_PEER_DISCONNECTED || n->finished) return;
    for (int i = 0; i < n->M; i++) {
        if (!n->bound[i] || !ap_peer_id_eq(&n->owner[i], peer)) continue;
        char sid[AP_PEER_SHORT_LEN];
        ap_peer_id_short(peer, sid);
        ap_log(AP_LOG_WARN, "masha",
               "worker %d (%s) disconnected at iteration %llu: the run cannot complete", i, sid,
               (unsigned long long)ap__masha_worker_iter(n->sh));
        server_finish(n, AP_ECLOSED);
        return;
    }
}

/* A request on the protocol of wire version `version` (1, 2 or 3). */
static void server_handle(ap_masha_node_t *n, ap_rpc_req_t *req, int version)
{
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    char sid[AP_PEER_SHORT_LEN];
    ap__masha_hdr_t mh;
    int prc = ap__masha_hdr_parse(data, len, false, &mh);
    if (prc || mh.version != version) {
        ap_peer_id_short(ap_rpc_req_peer(req), sid);
        ap_log(AP_LOG_WARN, "masha", "malformed request from %s: %s", sid,
               prc ? ap_err_name(prc) : "wrong version for the protocol");
        ap_rpc_respond_error(req, prc ? prc : AP_EPROTO, "malformed request");
        return;
    }
    unsigned m = mh.worker;
    const ap_peer_id_t *peer = ap_rpc_req_peer(req);
    if (n->finished) {
        ap_peer_id_short(peer, sid);
        ap_log(AP_LOG_WARN, "masha", "request from %s after the run ended", sid);
        ap_rpc_respond_error(req, AP_ESTATE, "run is over");
        return;
    }
    if (m < (unsigned)n->M && n->bound[m] && !ap_peer_id_eq(&n->owner[m], peer)) {
        ap_peer_id_short(peer, sid);
        ap_log(AP_LOG_WARN, "masha", "%s claims worker index %u held by another peer", sid, m);
        ap_rpc_respond_error(req, AP_EPERM, "worker index held by another peer");
        return;
    }
    int rc = ap__masha_server_check(n->srv, data, len);
    if (rc < 0) {
        ap_peer_id_short(ap_rpc_req_peer(req), sid);
        ap_log(AP_LOG_WARN, "masha", "bad request from %s: %s", sid, ap_err_name(rc));
        ap_rpc_respond_error(req, rc, "bad masha request");
        return;
    }
    n->pending[m] = req; /* check() checked m < M and no duplicate */
    n->ver[m] = (uint8_t)version;
    n->started = true;
    if (!n->bound[m]) {
        n->bound[m] = true;
        n->owner[m] = *peer;
        ap_peer_id_short(peer, sid);
        ap_log(AP_LOG_INFO, "masha", "worker %u joined from %s", m, sid);
    }
    if (rc == 0) return;
    /* all in: sum in index order (arrival order must not change the bits) */
    for (int i = 0; i < n->M; i++) n->reqs[i] = ap_rpc_req_data(n->pending[i], &n->lens[i]);
    rc = ap__masha_server_complete(n->srv, n->reqs, n->lens);
    if (rc < 0) {
        ap_log(AP_LOG_WARN, "masha", "server: cannot complete the phase: %s", ap_err_name(rc));
        for (int i = 0; i < n->M; i++) {
            ap_rpc_respond_error(n->pending[i], rc, "server failed");
            n->pending[i] = NULL;
        }
        if (n->sh) server_finish(n, rc);
        return;
    }
    size_t rlen;
    const uint8_t *rep;
    for (int i = 0; i < n->M; i++) {
        ap_rpc_req_t *r = n->pending[i];
        n->pending[i] = NULL;
        rep = ap__masha_server_reply(n->srv, n->ver[i], &rlen);
        if (r) ap_rpc_respond(r, rep, rlen);
    }
    if (!n->sh) return;
    rep = ap__masha_server_reply(n->srv, ap__masha_worker_wire(n->sh), &rlen);
    bool it_done;
    rc = ap__masha_worker_on_reply(n->sh, rep, rlen, &it_done);
    if (rc) {
        ap_log(AP_LOG_WARN, "masha", "server: workers out of step with the run: %s",
               ap_err_name(rc));
        server_finish(n, rc);
        return;
    }
    if (!ap__masha_worker_msg(n->sh, &rlen)) server_finish(n, 0);
}

static void server_handler_v1(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt, server_handle(arg, req, 1);
}
static void server_handler_v2(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt, server_handle(arg, req, 2);
}
static void server_handler_v3(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt, server_handle(arg, req, 3);
}

/* The wire versions a node speaks: 1 up to this. */
static int top_wire(const ap_masha_opts_t *o)
{
    return o->wire >= 1 && o->wire <= 3 ? o->wire : 3;
}

static const char *proto_of(int version)
{
    return version == 1 ? AP_MASHA_PROTO : version == 2 ? AP_MASHA_PROTO2 : AP_MASHA_PROTO3;
}

int ap_masha_server_start(ap_rt_t *rt, const ap_masha_bilinear_cfg_t *pc, const ap_masha_opts_t *o,
                          ap_masha_node_t **out)
{
    if (!rt || !pc || !o || !out) return AP_EINVAL;
    ap_masha_node_t *n = calloc(1, sizeof *n);
    if (!n) return AP_ENOMEM;
    n->rt = rt;
    n->is_server = true;
    n->M = pc->workers;
    size_t d = 2 * (size_t)pc->n;
    n->srv = ap__masha_server_new(d, pc->workers, o);
    n->pc = *pc;
    n->o = *o;
    size_t nw = (size_t)(pc->workers > 0 ? pc->workers : 1);
    n->pending = calloc(nw, sizeof *n->pending);
    n->owner = calloc(nw, sizeof *n->owner);
    n->reqs = calloc(nw, sizeof *n->reqs);
    n->lens = calloc(nw, sizeof *n->lens);
    n->bound = calloc(nw, sizeof *n->bound);
    n->ver = calloc(nw, sizeof *n->ver);
    if (!n->srv || !n->pending || !n->owner || !n->bound || !n->reqs || !n->lens || !n->ver) {
        ap_masha_node_free(n);
        return AP_ENOMEM;
    }
    /* versions 1 .. top_wire: workers of any share the run */
    static const ap_rpc_handler_fn handlers[3] = {server_handler_v1, server_handler_v2,
                                                  server_handler_v3};
    int rc = 0, v = 1;
    for (; v <= top_wire(o) && !rc; v++)
        rc = ap_rt_rpc_register(rt, proto_of(v), msg_cap(d), handlers[v - 1], n);
    if (rc)
        for (v -= 2; v >= 1; v--) ap_rt_rpc_unregister(rt, proto_of(v));
    if (rc) {
        ap__masha_server_free(n->srv);
        n->srv = NULL;
        ap_masha_node_free(n);
        return rc;
    }
    *out = n;
    return 0;
}

int ap_masha_server_track(ap_masha_node_t *n, ap_masha_done_fn done, void *arg)
{
    if (!n || !n->is_server || !done) return AP_EINVAL;
    if (n->started || n->sh) return AP_ESTATE;
    n->p = ap_masha_bilinear_new(&n->pc);
    if (!n->p) return AP_ENOMEM;
    n->sh = ap__masha_worker_new(n->p, &n->o, 0);
    int rc = n->sh ? ap__masha_worker_start(n->sh) : AP_ENOMEM;
    if (!rc) {
        n->watch = ap_rt_peer_watch(n->rt, server_peer_event, n);
        if (!n->watch) rc = AP_ENOMEM;
    }
    if (rc) {
        ap__masha_worker_free(n->sh);
        n->sh = NULL;
        ap_masha_problem_free(n->p);
        n->p = NULL;
        return rc;
    }
    n->done = done;
    n->done_arg = arg;
    return 0;
}

/* ---- worker ---- */

static void worker_send(ap_masha_node_t *n);

static void worker_finish(ap_masha_node_t *n, int status)
{
    ap_masha_result_t r;
    ap__masha_worker_counts(n->wk, &r);
    n->call = 0;
    if (n->done) n->done(n->done_arg, status, &r);
}

static void worker_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                        const char *errmsg)
{
    (void)rt;
    ap_masha_node_t *n = arg;
    n->call = 0;
    int wire = ap__masha_worker_wire(n->wk);
    if (status == AP_ENOPROTO && wire > 1 && ap__masha_worker_downgrade(n->wk) == 0) {
        ap_log(AP_LOG_INFO, "masha", "server does not serve %s: speaking %s", proto_of(wire),
               proto_of(wire - 1));
        worker_send(n); /* the same request one version down */
        return;
    }
    if (status) {
        ap_log(AP_LOG_WARN, "masha", "call to server failed: %s%s%s", ap_err_name(status),
               errmsg ? ": " : "", errmsg ? errmsg : "");
        worker_finish(n, status);
        return;
    }
    bool it_done;
    int rc = ap__masha_worker_on_reply(n->wk, resp, len, &it_done);
    if (rc) {
        ap_log(AP_LOG_WARN, "masha", "bad reply from server: %s", ap_err_name(rc));
        worker_finish(n, rc);
        return;
    }
    size_t l;
    if (!ap__masha_worker_msg(n->wk, &l)) {
        worker_finish(n, 0); /* converged or max_iters */
        return;
    }
    worker_send(n);
}

static void worker_send(ap_masha_node_t *n)
{
    size_t len;
    const uint8_t *msg = ap__masha_worker_msg(n->wk, &len);
    ap_rpc_opts_t ro = {.timeout_us = 120 * 1000000ull, .max_resp = n->max_resp};
    const char *proto = proto_of(ap__masha_worker_wire(n->wk));
    n->call = ap_rt_rpc_call(n->rt, &n->server, proto, msg, len, &ro, worker_done, n);
    if (!n->call) worker_finish(n, AP_ENOMEM);
}

int ap_masha_worker_start(ap_rt_t *rt, const ap_peer_id_t *server,
                          const ap_masha_bilinear_cfg_t *pc, const ap_masha_opts_t *o, int index,
                          ap_masha_done_fn done, void *arg, ap_masha_node_t **out)
{
    if (!rt || !server || !pc || !o || !out || index < 0 || index >= pc->workers) return AP_EINVAL;
    ap_masha_node_t *n = calloc(1, sizeof *n);
    if (!n) return AP_ENOMEM;
    n->rt = rt;
    n->server = *server;
    n->done = done;
    n->done_arg = arg;
    n->p = ap_masha_bilinear_new(pc);
    if (n->p) n->wk = ap__masha_worker_new(n->p, o, index);
    if (!n->p || !n->wk) {
        ap_masha_node_free(n);
        return AP_ENOMEM;
    }
    n->max_resp = msg_cap(ap_masha_dim(n->p));
    int rc = ap__masha_worker_start(n->wk);
    if (rc) {
        ap_masha_node_free(n);
        return rc;
    }
    *out = n;
    worker_send(n);
    return 0;
}

void ap_masha_node_free(ap_masha_node_t *n)
{
    if (!n) return;
    if (n->is_server) {
        if (n->srv)
            for (int v = 1; v <= top_wire(&n->o); v++) ap_rt_rpc_unregister(n->rt, proto_of(v));
        for (int i = 0; n->pending && i < n->M; i++)
            if (n->pending[i]) ap_rpc_respond_error(n->pending[i], AP_ESHUTDOWN, "server stopped");
        if (n->watch) ap_rt_peer_unwatch(n->rt, n->watch);
        ap__masha_server_free(n->srv);
        ap__masha_worker_free(n->sh);
        ap_masha_problem_free(n->p);
        free(n->pending);
        free(n->owner);
        free(n->reqs);
        free(n->lens);
        free(n->bound);
        free(n->ver);
    } else {
        n->done = NULL;
        if (n->call) ap_rt_rpc_cancel(n->rt, n->call);
        ap__masha_worker_free(n->wk);
        ap_masha_problem_free(n->p);
    }
    free(n);
}
