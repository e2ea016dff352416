/* libFuzzer target: the CALLER side of the RPC envelope and of streams
 * (src/runtime/uv/mux_*.c). fuzz_mux_frame.c plays a peer that opens streams
 * and calls us; here our node is the one that called, so the fuzzer's bytes
 * are responses: WINDOW ACCEPT, response DATA (START with a total checked
 * against max_resp, continuations), CLOSE, and RESET carrying an error code
 * and message, plus a stream's ACCEPT / data / end / reset.
 *
 * Set-up per input: a fresh node with one fake connection (we dialed it: our
 * streams are 1, 3, 5, 7), then
 *   sid 1  RPC "/r" request "ping", max_resp 1000
 *   sid 3  RPC "/r" request "big",  max_resp 16 (cap exercised)
 *   sid 5  stream "/s" hello "hi", window 4096 (echoes 'e' messages)
 *   sid 7  RPC "/r", cancelled half-way through the input if byte 0 is odd
 * Input: byte 0 = split step and the cancel bit, the rest = peer bytes. Each
 * completion is checked for consistency (a status and the response cap); a
 * violation aborts (a bug). Teardown must free everything (ASan). */
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "fuzz_peer.h"

#include <stdlib.h>
#include <string.h>

typedef struct call {
    size_t max_resp;
    int done;
} call_t;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt;
    call_t *c = arg;
    if (c->done++) abort();                        /* exactly once */
    if (status == 0 && len > c->max_resp) abort(); /* the cap held */
    if (status == 0 && len && !resp) abort();
    if (status > 0) abort();
    if (errmsg && strlen(errmsg) > AP_FRAME_RESET_MSG_MAX) abort();
}

static int stream_closed;

static void s_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)arg;
    if (n > 4096 * 4) abort(); /* max_msg */
    if (n && d[0] == 'e') ap_stream_send(s, d, n);
    if (n && d[0] == 'p') ap_stream_pause(s, true);
    if (n && d[0] == 'c') ap_stream_close(s);
}

static void s_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}

static void s_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    (void)arg;
    (void)status;
    if (stream_closed++) abort();
}

static const ap_stream_cbs_t scbs = {.on_msg = s_msg, .on_end = s_end, .on_close = s_close};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap_host_t *host = fuzz_host();
    if (size < 1) return 0;
    fake_t fk;
    ap_rt_t *rt = fuzz_node_with_fake(host, &fk, true);
    ap__node_accept_conn((ap_node_t *)rt, &fk.conn);
    ap_mconn_t *c = fk.conn.user;
    const ap_peer_id_t *peer = &fk.conn.remote;

    call_t calls[3] = {{.max_resp = 1000}, {.max_resp = 16}, {.max_resp = 1000}};
    stream_closed = 0;
    ap_rpc_opts_t o1 = {.timeout_us = 3600u * 1000000u, .max_resp = 1000};
    ap_rpc_opts_t o2 = {.timeout_us = 3600u * 1000000u, .max_resp = 16};
    if (!ap_rt_rpc_call(rt, peer, "/r", (const uint8_t *)"ping", 4, &o1, on_done, &calls[0]))
        abort();
    if (!ap_rt_rpc_call(rt, peer, "/r", (const uint8_t *)"big", 3, &o2, on_done, &calls[1]))
        abort();
    ap_stream_t *s;
    ap_stream_opts_t so = {.window = 4096, .max_msg = 4096 * 4, .open_timeout_us = 3600000000u};
    if (ap_rt_stream_open(rt, peer, "/s", (const uint8_t *)"hi", 2, &so, &scbs, NULL, &s) != 0)
        abort();
    uint64_t id3 = ap_rt_rpc_call(rt, peer, "/r", (const uint8_t *)"x", 1, &o1, on_done, &calls[2]);
    if (!id3) abort();
    ap_host_run_once(host, 0); /* OPENs go out */

    bool cancel = data[0] & 1;
    size_t step = (size_t)(data[0] >> 1) * 5 + 1;
    data++;
    size--;
    for (size_t off = 0; off < size && !fk.closed; off += step) {
        size_t n = size - off < step ? size - off : step;
        ap__mux_feed(c, data + off, n);
        ap_host_run_once(host, 0);
        if (cancel && off >= size / 2) {
            ap_rt_rpc_cancel(rt, id3);
            cancel = false;
        }
    }
    ap_host_run_once(host, 0);
    ap_node_free(rt);
    ap_host_run_once(host, 0);
    for (int i = 0; i < 3; i++)
        if (calls[i].done != 1) abort(); /* every call completed exactly once */
    if (stream_closed != 1) abort();
    return 0;
}
