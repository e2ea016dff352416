/* libFuzzer target: bytes from a peer fed to a live connection's frame
 * decoder and stream/RPC state machine (src/runtime/uv/mux_frame.c, mux_stream.c).
 *
 * Input: byte 0 picks how the rest is split into reads (so frames straddle
 * read boundaries); the rest is what the peer "sent". The node listens on a
 * stream protocol and an RPC protocol so OPEN/DATA/CLOSE/RESET/WINDOW reach
 * every state. Each input gets a fresh node; teardown must free everything. */
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "fuzz_peer.h"

#include <stdlib.h>
#include <string.h>

static void on_rpc(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    if (n && d[0] == 'h') return; /* held: freed with the node */
    fuzz_answer(req, d, n);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap_host_t *host = fuzz_host();
    if (size < 1) return 0;
    fake_t fk;
    ap_rt_t *rt = fuzz_node_with_fake(host, &fk, false);
    ap_stream_opts_t o = {.window = 4096, .max_msg = 100000};
    ap_rt_stream_listen(rt, "/s", &o, fuzz_on_accept, NULL);
    ap_rt_rpc_register(rt, "/r", 50000, on_rpc, NULL);
    ap__node_accept_conn((ap_node_t *)rt, &fk.conn);
    ap_mconn_t *c = fk.conn.user;
    size_t step = (size_t)data[0] * 3 + 1;
    data++;
    size--;
    for (size_t off = 0; off < size && !fk.closed; off += step) {
        size_t n = size - off < step ? size - off : step;
        ap__mux_feed(c, data + off, n);
        ap_host_run_once(host, 0); /* deferred callbacks and flushes */
    }
    ap_host_run_once(host, 0);
    ap_node_free(rt);
    ap_host_run_once(host, 0);
    return 0;
}
