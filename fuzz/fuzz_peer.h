/* Shared by the connection-level fuzz targets (fuzz_mux_frame, fuzz_tcp_frames,
 * fuzz_rpc_envelope): a fake connection that swallows what the node writes,
 * and a node's test services — stream protocol "/s" and RPC protocol "/r" —
 * whose behaviour the fuzzer steers with the first byte of a message:
 *   stream message: 'p' pause, 'r' reset, 'e' echo; hello 'x' refuse, 'e' echo
 *   RPC request:    'x' error response, anything else echoed.
 * Also the host shared across inputs and a fresh node with the fake plugged in. */
#ifndef APIARY_FUZZ_PEER_H
#define APIARY_FUZZ_PEER_H

#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "runtime/uv/uv_impl.h"

#include <stdlib.h>

typedef struct fake {
    ap_conn_t conn;
    size_t written;
    bool closed;
} fake_t;

static inline int fake_write(ap_conn_t *c, const uint8_t *p, size_t n)
{
    (void)p;
    ((fake_t *)c)->written += n;
    return ((fake_t *)c)->written > (8u << 20) ? 1 : 0; /* then: back-pressure */
}

static inline void fake_close(ap_conn_t *c)
{
    ((fake_t *)c)->closed = true;
}

static const ap_conn_vt_t fake_vt
    __attribute__((unused)) = {.write = fake_write, .close = fake_close};

static inline void fuzz_on_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)arg;
    if (n && d[0] == 'p') ap_stream_pause(s, true);
    if (n && d[0] == 'r') ap_stream_reset(s, AP_ECANCELED);
    if (n && d[0] == 'e') ap_stream_send(s, d, n);
}

static inline void fuzz_on_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}

static const ap_stream_cbs_t fuzz_cbs
    __attribute__((unused)) = {.on_msg = fuzz_on_msg, .on_end = fuzz_on_end};

static inline int fuzz_on_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                                 const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)arg;
    (void)peer;
    if (len && hello[0] == 'x') return AP_EPERM;
    ap_stream_set_cbs(s, &fuzz_cbs, NULL);
    if (len && hello[0] == 'e') ap_stream_send(s, hello, len);
    return 0;
}

static inline void fuzz_answer(ap_rpc_req_t *req, const uint8_t *d, size_t n)
{
    if (n && d[0] == 'x')
        ap_rpc_respond_error(req, AP_ENOTFOUND, "nope");
    else
        ap_rpc_respond(req, d, n);
}

/* The host shared by all inputs (created at the first, logging off). */
static inline ap_host_t *fuzz_host(void)
{
    static ap_host_t *host;
    if (!host) {
        ap_log_set_level(AP_LOG_OFF);
        host = ap_host_new();
        if (!host) abort();
    }
    return host;
}

/* A fresh node (fixed key) on host with fk plugged in as its connection to a
 * fixed peer: dialed by us (dialer) or accepted. Returns the node. */
static inline ap_rt_t *fuzz_node_with_fake(ap_host_t *host, fake_t *fk, bool dialer)
{
    static const uint8_t seed[32] = {7}, pk[32] = {9};
    ap_rt_t *rt;
    if (ap_node_new(host, &(ap_node_opts_t){.ed25519_seed = seed, .rng_seed = 1}, &rt) < 0) abort();
    *fk = (fake_t){0};
    fk->conn.vt = &fake_vt;
    fk->conn.dialer = dialer;
    ap_peer_id_from_ed25519(&fk->conn.remote, pk);
    return rt;
}

#endif
