/* runtime/uv mux: what a peer can make a node hold is bounded. A peer that
 * opens RPCs with a zero receive window and never reads gets its responses
 * refused (RESET ELIMIT) once its connection's queue is full, instead of the
 * node copying every response whole; partial requests (declared, never
 * finished) count against the connection's and the node's receive budget
 * and are reset once they stall. Deterministic: a fake transport, frames fed
 * by hand, the stall time shortened. */
#include "aptest.h"
#include "fake_conn.h"

#include "apiary/host.h"
#include "apiary/node.h"
#include "runtime/uv/frame.h"
#include "runtime/uv/uv_impl.h"

#include <string.h>

#define RESP_LEN (1u << 20)

static uint8_t resp[RESP_LEN];

static void big_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    ap_rpc_respond(req, resp, sizeof resp);
}

/* RESET frames with code for any stream in f's output. */
static int resets(const ap_test_fake_conn_t *f, int code)
{
    int n = 0;
    size_t off = 0;
    while (off + AP_FRAME_HDR <= f->len) {
        ap_frame_t fr;
        if (ap__frame_parse_hdr(f->out + off, &fr) || off + AP_FRAME_HDR + fr.len > f->len) break;
        fr.payload = f->out + off + AP_FRAME_HDR;
        int c;
        char msg[AP_FRAME_RESET_MSG_MAX + 1];
        if (fr.type == AP_FRAME_RESET && ap__frame_parse_reset(&fr, &c, msg, sizeof msg) == 0 &&
            c == code)
            n++;
        off += AP_FRAME_HDR + fr.len;
    }
    return n;
}

static bool resp_released(void *arg)
{
    return ((ap_node_t *)arg)->resp_queued == 0;
}

static bool rx_released(void *arg)
{
    return ((ap_node_t *)arg)->rx_buffered == 0;
}

static ap_mconn_t *accept_fake(ap_rt_t *rt, ap_test_fake_conn_t *fk, uint8_t who)
{
    ap_test_fake_conn_init(fk);
    fk->conn.dialer = false;
    uint8_t pk[32] = {who};
    ap_peer_id_from_ed25519(&fk->conn.remote, pk);
    ap__node_accept_conn((ap_node_t *)rt, &fk->conn);
    return fk->conn.user;
}

static void test_zero_window_responses(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    ap_node_t *n = (ap_node_t *)rt;
    assert_ok(ap_rt_rpc_register(rt, "/big", 0, big_handler, NULL));
    n->stall_us = 3600000000ull; /* nothing stalls while the calls come in */
    ap_test_fake_conn_t fk;
    ap_mconn_t *c = accept_fake(rt, &fk, 7);
    ap_buf_t b;
    ap__buf_init(&b);
    /* 100 calls with a zero window, each answered with 1 MiB */
    for (uint32_t i = 0; i < 100; i++) {
        uint32_t sid = 1 + 2 * i;
        assert_ok(ap__frame_put_open(&b, sid, true, 0, "/big"));
        assert_ok(ap__frame_put_data(&b, sid, true, 1, (const uint8_t *)"q", 1));
        ap__mux_feed(c, b.data, b.len);
        ap__buf_reset(&b);
        fk.len = 0; /* keep only this call's frames */
        ap_host_run_once(h, 0);
        assert_true(c->resp_queued <= AP_MUX_CONN_RESP_MAX);
        assert_true(n->resp_queued <= AP_MUX_NODE_RESP_MAX);
    }
    /* the queue filled up to its cap, then further responses were refused */
    assert_int_equal(c->resp_queued, (AP_MUX_CONN_RESP_MAX / RESP_LEN) * RESP_LEN);
    assert_int_equal(n->refused_resp, 100 - AP_MUX_CONN_RESP_MAX / RESP_LEN);
    /* nothing is ever read: once stalled, the queued responses are reset and
     * their memory released */
    fk.len = 0;
    n->stall_us = 1;
    assert_true(ap_host_run_until(h, resp_released, n, 10000000));
    ap_host_run_until(h, NULL, NULL, 100000); /* the RESETs go out with the next flush */
    assert_int_equal(c->resp_queued, 0);
    assert_int_equal(n->resp_queued, 0);
    assert_true(n->stalled_reset >= AP_MUX_CONN_RESP_MAX / RESP_LEN);
    assert_true(resets(&fk, AP_ETIMEDOUT) > 0);
    ap__buf_free(&b);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

static void test_partial_requests(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    ap_node_t *n = (ap_node_t *)rt;
    assert_ok(ap_rt_rpc_register(rt, "/big", 0, big_handler, NULL));
    n->stall_us = 3600000000ull;
    ap_test_fake_conn_t fk[6];
    ap_mconn_t *c[6];
    ap_buf_t b;
    ap__buf_init(&b);
    static uint8_t part[RESP_LEN];
    /* 6 peers, 64 requests each declaring 1 MiB and sending 1 MiB - 1: the
     * node holds at most its cap, refusing the rest */
    for (int p = 0; p < 6; p++) {
        c[p] = accept_fake(rt, &fk[p], (uint8_t)(10 + p));
        for (uint32_t i = 0; i < 64; i++) {
            uint32_t sid = 1 + 2 * i;
            assert_ok(ap__frame_put_open(&b, sid, true, 0, "/big"));
            assert_ok(ap__frame_put_data(&b, sid, true, RESP_LEN, part, 16));
            ap__mux_feed(c[p], b.data, b.len);
            ap__buf_reset(&b);
            assert_true(c[p]->rx_buffered <= AP_MUX_PEER_BUF_MAX);
            assert_true(n->rx_buffered <= AP_MUX_NODE_BUF_MAX);
        }
    }
    assert_true(n->refused_rx > 0);
    /* each connection got at most half of what was free: room is left for
     * other peers' requests */
    assert_true(n->rx_buffered < AP_MUX_NODE_BUF_MAX);
    assert_true(n->rx_buffered >= AP_MUX_NODE_BUF_MAX / 2);
    assert_true(c[0]->rx_buffered > c[5]->rx_buffered);
    /* they stall: reset, memory back */
    n->stall_us = 1;
    assert_true(ap_host_run_until(h, rx_released, n, 10000000));
    assert_int_equal(n->rx_buffered, 0);
    for (int p = 0; p < 6; p++) assert_int_equal(c[p]->rx_buffered, 0);
    assert_true(n->stalled_reset >= AP_MUX_NODE_BUF_MAX / 2 / RESP_LEN);
    ap__buf_free(&b);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zero_window_responses),
        cmocka_unit_test(test_partial_requests),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
