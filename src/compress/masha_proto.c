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
    int M;
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

static void server_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_masha_node_t *n = arg;
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    char sid[AP_PEER_SHORT_LEN];
    if (len < AP__MASHA_HDR) {
        ap_peer_id_short(ap_rpc_req_peer(req), sid);
        ap_log(AP_LOG_WARN, "masha", "short request from %s", sid);
        ap_rpc_respond_error(req, AP_EPROTO, "short request");
        return;
    }
    unsigned m = (unsigned)data[2] | ((unsigned)data[3] << 8);
    int rc = ap__masha_server_add(n->srv, data, len);
    if (rc < 0) {
        ap_peer_id_short(ap_rpc_req_peer(req), sid);
        ap_log(AP_LOG_WARN, "masha", "bad request from %s: %s", sid, ap_err_name(rc));
        ap_rpc_respond_error(req, rc, "bad masha request");
        return;
    }
    n->pending[m] = req; /* add() checked m < M and no duplicate */
    if (rc == 0) return;
    size_t rlen;
    const uint8_t *rep = ap__masha_server_reply(n->srv, &rlen);
    for (int i = 0; i < n->M; i++) {
        ap_rpc_req_t *r = n->pending[i];
        n->pending[i] = NULL;
        if (r) ap_rpc_respond(r, rep, rlen);
    }
    (void)rt;
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
    n->pending = calloc((size_t)(pc->workers > 0 ? pc->workers : 1), sizeof *n->pending);
    if (!n->srv || !n->pending) {
        ap_masha_node_free(n);
        return AP_ENOMEM;
    }
    int rc = ap_rt_rpc_register(rt, AP_MASHA_PROTO, msg_cap(d), server_handler, n);
    if (rc) {
        ap__masha_server_free(n->srv);
        n->srv = NULL;
        ap_masha_node_free(n);
        return rc;
    }
    *out = n;
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
    n->call = ap_rt_rpc_call(n->rt, &n->server, AP_MASHA_PROTO, msg, len, &ro, worker_done, n);
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
        if (n->srv) ap_rt_rpc_unregister(n->rt, AP_MASHA_PROTO);
        for (int i = 0; n->pending && i < n->M; i++)
            if (n->pending[i]) ap_rpc_respond_error(n->pending[i], AP_ESHUTDOWN, "server stopped");
        ap__masha_server_free(n->srv);
        free(n->pending);
    } else {
        n->done = NULL;
        if (n->call) ap_rt_rpc_cancel(n->rt, n->call);
        ap__masha_worker_free(n->wk);
        ap_masha_problem_free(n->p);
    }
    free(n);
}
