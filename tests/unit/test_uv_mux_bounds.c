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
#include "apiary/log.h"
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

static void small_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    ap_rpc_respond(req, (const uint8_t *)"ok", 2);
}

static char g_log[4096];

static void sink(void *arg, ap_log_level_t level, const char *module, const char *msg)
{
    (void)arg;
    (void)module;
    size_t k = strlen(g_log);
    if (level >= AP_LOG_WARN && k + strlen(msg) + 2 < sizeof g_log)
        snprintf(g_log + k, sizeof g_log - k, "%s\n", msg);
}

/* DATA frames in f's output (responses going out). */
static int datas(const ap_test_fake_conn_t *f)
{
    int n = 0;
    size_t off = 0;
    while (off + AP_FRAME_HDR <= f->len) {
        ap_frame_t fr;
        if (ap__frame_parse_hdr(f->out + off, &fr) || off + AP_FRAME_HDR + fr.len > f->len) break;
        if (fr.type == AP_FRAME_DATA) n++;
        off += AP_FRAME_HDR + fr.len;
    }
    return n;
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
        assert_true(c->resp_queued <= AP_MUX_CONN_MEM_MAX);
        assert_true(n->resp_queued <= AP_MUX_NODE_MEM_MAX);
    }
    /* the queue filled up to its cap, then further responses were refused */
    assert_int_equal(c->resp_queued, (AP_MUX_CONN_MEM_MAX / RESP_LEN) * RESP_LEN);
    /* (once the queue is full, even the 1-byte requests are refused) */
    assert_int_equal(n->refused_resp + n->refused_rx, 100 - AP_MUX_CONN_MEM_MAX / RESP_LEN);
    /* nothing is ever read: once stalled, the queued responses are reset and
     * their memory released */
    fk.len = 0;
    n->stall_us = 1;
    assert_true(ap_host_run_until(h, resp_released, n, 10000000));
    ap_host_run_until(h, NULL, NULL, 100000); /* the RESETs go out with the next flush */
    assert_int_equal(c->resp_queued, 0);
    assert_int_equal(n->resp_queued, 0);
    assert_true(n->stalled_reset >= AP_MUX_CONN_MEM_MAX / RESP_LEN);
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
            assert_true(c[p]->rx_buffered <= AP_MUX_CONN_MEM_MAX);
            assert_true(n->rx_buffered <= AP_MUX_NODE_MEM_MAX);
        }
    }
    assert_true(n->refused_rx > 0);
    /* each connection got at most half of what was free: room is left for
     * other peers' requests */
    assert_true(n->rx_buffered < AP_MUX_NODE_MEM_MAX);
    assert_true(n->rx_buffered >= AP_MUX_NODE_MEM_MAX / 2);
    assert_true(c[0]->rx_buffered > c[5]->rx_buffered);
    /* another peer's small request on the same protocol still gets in (on
     * the protocol too, a reservation takes at most half of what is free) */
    uint64_t served = n->stats.rpc_served;
    ap_test_fake_conn_t fk7;
    ap_mconn_t *c7 = accept_fake(rt, &fk7, 30);
    assert_ok(ap__frame_put_open(&b, 1, true, 1024, "/big"));
    assert_ok(ap__frame_put_data(&b, 1, true, 1, (const uint8_t *)"q", 1));
    ap__mux_feed(c7, b.data, b.len);
    ap__buf_reset(&b);
    ap_host_run_once(h, 0); /* its serve turn */
    assert_int_equal(n->stats.rpc_served, served + 1);
    /* they stall: reset, memory back */
    n->stall_us = 1;
    assert_true(ap_host_run_until(h, rx_released, n, 10000000));
    assert_int_equal(n->rx_buffered, 0);
    for (int p = 0; p < 6; p++) assert_int_equal(c[p]->rx_buffered, 0);
    assert_true(n->stalled_reset >= AP_MUX_NODE_MEM_MAX / 2 / RESP_LEN);
    ap__buf_free(&b);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

/* One peer over 3 connections: its memory is bounded across all of them
 * (without the peer scope each connection would hold its own 64 MiB), one
 * WARN names it, and another peer's request is still served. */
static void test_peer_memory_across_connections(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    ap_node_t *n = (ap_node_t *)rt;
    assert_ok(ap_rt_rpc_register(rt, "/big", 0, big_handler, NULL));
    assert_ok(ap_rt_rpc_register(rt, "/small", 0, small_handler, NULL));
    n->stall_us = 3600000000ull;
    g_log[0] = 0;
    ap_log_set_sink(sink, NULL);
    ap_test_fake_conn_t fk[4];
    ap_mconn_t *c[4];
    ap_buf_t b;
    ap__buf_init(&b);
    static uint8_t part[16];
    for (int p = 0; p < 3; p++) {
        c[p] = accept_fake(rt, &fk[p], 42); /* the same identity */
        for (uint32_t i = 0; i < 40; i++) {
            uint32_t sid = 1 + 2 * i;
            assert_ok(ap__frame_put_open(&b, sid, true, 0, "/big"));
            assert_ok(ap__frame_put_data(&b, sid, true, RESP_LEN, part, sizeof part));
            ap__mux_feed(c[p], b.data, b.len);
            ap__buf_reset(&b);
        }
    }
    size_t held = c[0]->rx_buffered + c[1]->rx_buffered + c[2]->rx_buffered;
    assert_int_equal(held, (AP_MUX_PEER_MEM_MAX / RESP_LEN) * RESP_LEN);
    assert_int_equal(c[0]->rx_buffered, 40u * RESP_LEN);
    assert_int_equal(n->refused_rx, 3 * 40 - AP_MUX_PEER_MEM_MAX / RESP_LEN);
    assert_true(resets(&fk[1], AP_ELIMIT) + resets(&fk[2], AP_ELIMIT) == 0); /* not yet flushed */
    ap_host_run_until(h, NULL, NULL, 50000);
    assert_true(resets(&fk[2], AP_ELIMIT) > 0);
    /* one WARN per connection (2 refused), naming the peer and its scope */
    char who[AP_PEER_SHORT_LEN];
    ap_peer_id_short(&fk[0].conn.remote, who);
    assert_non_null(strstr(g_log, who));
    assert_non_null(strstr(g_log, "(peer "));
    int lines = 0;
    for (const char *q = g_log; (q = strstr(q, "refusing")); q++) lines++;
    assert_int_equal(lines, 2);
    /* another peer is served */
    c[3] = accept_fake(rt, &fk[3], 43);
    assert_ok(ap__frame_put_open(&b, 1, true, 1024, "/small"));
    assert_ok(ap__frame_put_data(&b, 1, true, 1, (const uint8_t *)"q", 1));
    fk[3].len = 0;
    ap__mux_feed(c[3], b.data, b.len);
    ap__buf_reset(&b);
    ap_host_run_until(h, NULL, NULL, 50000);
    assert_int_equal(datas(&fk[3]), 1);
    /* the report names the peer at its limit */
    char rep[2048];
    assert_true(ap_node_resources(rt, 4, rep, sizeof rep) > 0);
    char id[AP_PEER_ID_STR_MAX], want[AP_PEER_ID_STR_MAX + 40];
    snprintf(want, sizeof want, "peer %s: memory %u/%u", ap_peer_id_str(&fk[0].conn.remote, id),
             AP_MUX_PEER_MEM_MAX, AP_MUX_PEER_MEM_MAX);
    assert_non_null(strstr(rep, want));
    ap_log_set_sink(NULL, NULL);
    ap__buf_free(&b);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

/* Streams a peer opens are counted per peer and per node: past the limit
 * they are reset with AP_ELIMIT, and another peer still opens its own. */
static void test_stream_limits(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    ap_node_t *n = (ap_node_t *)rt;
    ap_node_limits_t lim;
    ap_node_limits_default(&lim);
    lim.peer_streams = 8;
    lim.node_streams = 12;
    assert_ok(ap_node_set_limits(rt, &lim));
    assert_ok(ap_rt_rpc_register(rt, "/small", 0, small_handler, NULL));
    ap_test_fake_conn_t fk[3];
    ap_mconn_t *c[3];
    ap_buf_t b;
    ap__buf_init(&b);
    /* peer A: 20 OPENs that never send their request (2 connections) */
    c[0] = accept_fake(rt, &fk[0], 50);
    c[1] = accept_fake(rt, &fk[1], 50);
    for (uint32_t i = 0; i < 10; i++)
        for (int p = 0; p < 2; p++) {
            assert_ok(ap__frame_put_open(&b, 1 + 2 * i, true, 0, "/small"));
            ap__mux_feed(c[p], b.data, b.len);
            ap__buf_reset(&b);
        }
    assert_int_equal(c[0]->nstreams + c[1]->nstreams, 8);
    assert_int_equal(n->refused_streams, 12);
    /* peer B: 8 more; the node takes 12 in all */
    c[2] = accept_fake(rt, &fk[2], 51);
    for (uint32_t i = 0; i < 8; i++) {
        assert_ok(ap__frame_put_open(&b, 1 + 2 * i, true, 1024, "/small"));
        ap__mux_feed(c[2], b.data, b.len);
        ap__buf_reset(&b);
    }
    assert_int_equal(c[2]->nstreams, 4);
    ap_host_run_until(h, NULL, NULL, 50000);
    assert_true(resets(&fk[0], AP_ELIMIT) + resets(&fk[1], AP_ELIMIT) == 12);
    assert_int_equal(resets(&fk[2], AP_ELIMIT), 4);
    /* B's requests complete: its streams end and the count goes down */
    for (uint32_t i = 0; i < 4; i++) {
        assert_ok(ap__frame_put_data(&b, 1 + 2 * i, true, 1, (const uint8_t *)"q", 1));
        ap__mux_feed(c[2], b.data, b.len);
        ap__buf_reset(&b);
    }
    ap_host_run_until(h, NULL, NULL, 50000);
    assert_int_equal(ap_rc_scope_use(ap_rcmgr_node(n->rc))->streams, 8);
    ap__buf_free(&b);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

/* ---- a request stays counted until its handler has answered ------------- */

#define HELD_MAX 8
static ap_rpc_req_t *g_held[HELD_MAX];
static int g_nheld;

static void hold_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    if (g_nheld < HELD_MAX)
        g_held[g_nheld++] = req;
    else
        ap_rpc_respond_error(req, AP_ELIMIT, "test holds enough");
}

static uint64_t node_mem(ap_node_t *n)
{
    return ap_rc_scope_use(ap_rcmgr_node(n->rc))->memory;
}

static bool node_mem_zero(void *arg)
{
    return node_mem(arg) == 0;
}

static void test_held_requests_counted(void **state)
{
    (void)state;
    enum { REQ = 100000, NREQ = 4 };
    static uint8_t q[REQ];
    g_nheld = 0;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    ap_node_t *n = (ap_node_t *)rt;
    assert_ok(ap_rt_rpc_register(rt, "/hold", 0, hold_handler, NULL));
    ap_test_fake_conn_t fk;
    ap_mconn_t *c = accept_fake(rt, &fk, 60);
    ap_buf_t b;
    ap__buf_init(&b);
    for (uint32_t i = 0; i < NREQ; i++) {
        uint32_t sid = 1 + 2 * i;
        assert_ok(ap__frame_put_open(&b, sid, true, 1024, "/hold"));
        for (uint32_t off = 0; off < REQ; off += AP_MUX_FRAG) {
            uint32_t k = REQ - off < AP_MUX_FRAG ? REQ - off : AP_MUX_FRAG;
            assert_ok(ap__frame_put_data(&b, sid, off == 0, REQ, q + off, k));
        }
        ap__mux_feed(c, b.data, b.len);
        ap__buf_reset(&b);
    }
    ap_host_run_until(h, NULL, NULL, 20000);
    assert_int_equal(g_nheld, NREQ);
    /* the handler holds them: still counted in the node and the peer */
    assert_int_equal(node_mem(n), (uint64_t)NREQ * REQ);
    char rep[2048];
    ap_node_resources(rt, 4, rep, sizeof rep);
    assert_non_null(strstr(rep, "memory 400000/"));
    /* the caller gives up on two of them: the handler still holds those */
    for (uint32_t i = 0; i < 2; i++)
        assert_ok(ap__frame_put_reset(&b, 1 + 2 * i, AP_ECANCELED, ""));
    ap__mux_feed(c, b.data, b.len);
    ap__buf_reset(&b);
    ap_host_run_until(h, NULL, NULL, 20000);
    assert_int_equal(node_mem(n), (uint64_t)NREQ * REQ);
    /* answered (the two orphans dropped): all of it released */
    for (int i = 0; i < g_nheld; i++) ap_rpc_respond(g_held[i], (const uint8_t *)"ok", 2);
    g_nheld = 0;
    assert_true(ap_host_run_until(h, node_mem_zero, n, 1000000));
    assert_int_equal(datas(&fk), 2);
    ap__buf_free(&b);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

/* ---- a response the limits cannot take is refused before it is built ------ */

static int g_built;

static void built_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    uint8_t *out = ap_rpc_respond_begin(req, RESP_LEN);
    if (!out) return;
    g_built++;
    memset(out, 'r', RESP_LEN);
    ap_rpc_respond_commit(req);
}

static void test_built_response_refused_first(void **state)
{
    (void)state;
    g_built = 0;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    ap_node_t *n = (ap_node_t *)rt;
    ap_node_limits_t lim;
    ap_node_limits_default(&lim);
    lim.peer_memory = 2 * RESP_LEN;
    assert_ok(ap_node_set_limits(rt, &lim));
    n->stall_us = 3600000000ull;
    assert_ok(ap_rt_rpc_register(rt, "/built", 0, built_handler, NULL));
    ap_test_fake_conn_t fk, fk2;
    ap_mconn_t *c = accept_fake(rt, &fk, 70);
    ap_buf_t b;
    ap__buf_init(&b);
    /* 5 zero-window calls: two responses fit the peer's 2 MiB, the rest are
     * refused without being built */
    for (uint32_t i = 0; i < 5; i++) {
        assert_ok(ap__frame_put_open(&b, 1 + 2 * i, true, 0, "/built"));
        assert_ok(ap__frame_put_data(&b, 1 + 2 * i, true, 1, (const uint8_t *)"q", 1));
    }
    ap__mux_feed(c, b.data, b.len);
    ap__buf_reset(&b);
    ap_host_run_until(h, NULL, NULL, 20000);
    assert_int_equal(g_built, 1); /* 1 MiB + the requests' bytes: the second does not fit */
    assert_int_equal(n->refused_resp, 4);
    assert_int_equal(resets(&fk, AP_ELIMIT), 4);
    assert_int_equal(datas(&fk), 0);
    /* another peer with a window is answered, the bytes built in place */
    ap_mconn_t *c2 = accept_fake(rt, &fk2, 71);
    assert_ok(ap__frame_put_open(&b, 1, true, 2 * RESP_LEN, "/built"));
    assert_ok(ap__frame_put_data(&b, 1, true, 1, (const uint8_t *)"q", 1));
    ap__mux_feed(c2, b.data, b.len);
    ap__buf_reset(&b);
    ap_host_run_until(h, NULL, NULL, 50000);
    assert_int_equal(g_built, 2);
    assert_true(datas(&fk2) > 0);
    assert_int_equal(resets(&fk2, AP_ELIMIT), 0);
    ap__buf_free(&b);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

/* ---- a burst from one peer does not hold up another's request ------------- */

static ap_peer_id_t g_b;
static int g_order_n, g_b_pos;

static void order_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    if (ap_peer_id_eq(ap_rpc_req_peer(req), &g_b)) g_b_pos = g_order_n;
    g_order_n++;
    ap_rpc_respond(req, (const uint8_t *)"ok", 2);
}

static bool all_served(void *arg)
{
    return g_order_n == *(int *)arg;
}

static void test_requests_served_in_turn(void **state)
{
    (void)state;
    enum { BURST = 200 };
    g_order_n = 0;
    g_b_pos = -1;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    assert_ok(ap_rt_rpc_register(rt, "/order", 0, order_handler, NULL));
    ap_test_fake_conn_t fa, fb;
    ap_mconn_t *a = accept_fake(rt, &fa, 80);
    ap_mconn_t *b = accept_fake(rt, &fb, 81);
    g_b = fb.conn.remote;
    ap_buf_t buf;
    ap__buf_init(&buf);
    /* A's burst arrives in one read, B's single request right after it */
    for (uint32_t i = 0; i < BURST; i++) {
        assert_ok(ap__frame_put_open(&buf, 1 + 2 * i, true, 1024, "/order"));
        assert_ok(ap__frame_put_data(&buf, 1 + 2 * i, true, 1, (const uint8_t *)"q", 1));
    }
    ap__mux_feed(a, buf.data, buf.len);
    ap__buf_reset(&buf);
    assert_ok(ap__frame_put_open(&buf, 1, true, 1024, "/order"));
    assert_ok(ap__frame_put_data(&buf, 1, true, 1, (const uint8_t *)"q", 1));
    ap__mux_feed(b, buf.data, buf.len);
    int want = BURST + 1;
    assert_true(ap_host_run_until(h, all_served, &want, 5000000));
    /* B was served in the first turn, not after A's whole burst */
    assert_true(g_b_pos >= 0 && g_b_pos <= 1);
    ap_host_run_until(h, NULL, NULL, 20000);
    assert_int_equal(datas(&fa), BURST);
    assert_int_equal(datas(&fb), 1);
    ap__buf_free(&buf);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peer_memory_across_connections),
        cmocka_unit_test(test_stream_limits),
        cmocka_unit_test(test_zero_window_responses),
        cmocka_unit_test(test_partial_requests),
        cmocka_unit_test(test_held_requests_counted),
        cmocka_unit_test(test_built_response_refused_first),
        cmocka_unit_test(test_requests_served_in_turn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
