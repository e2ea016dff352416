/* runtime/uv mux: a dial resolved with a connection the mux already owns
 * (the transport reports the dialing connection closed with AP_EEXIST and the
 * peer's id, as tcp_conn.c does when a dial crosses an inbound connection).
 * The call queued on the dialing connection must be opened again on the
 * surviving one, under a stream id of that connection's parity, and complete
 * there. Deterministic: the surviving connection is a fake transport whose
 * written bytes the test parses and whose peer bytes the test writes. */
#include "aptest.h"
#include "fake_conn.h"

#include "apiary/host.h"
#include "apiary/node.h"
#include "runtime/uv/frame.h"
#include "runtime/uv/uv_impl.h"

#include <string.h>

typedef ap_test_fake_conn_t fake_t;

typedef struct res {
    bool done;
    int status;
    char resp[16];
} res_t;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt;
    (void)errmsg;
    res_t *r = arg;
    r->done = true;
    r->status = status;
    if (status == 0 && len < sizeof r->resp) memcpy(r->resp, resp, len);
}

static bool is_done(void *arg)
{
    return ((res_t *)arg)->done;
}

static void test_dial_adopts_existing_connection(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_rt_t *rt, *peer;
    assert_ok(ap_node_new(h, NULL, &rt));
    assert_ok(ap_node_new(h, NULL, &peer));
    const ap_peer_id_t *pid = ap_rt_self(peer);
    char addr[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(peer, addr, 1, true), 1);
    assert_ok(ap_rt_add_addr(rt, pid, addr[0]));

    /* a call with no connection: the mux dials and queues the call */
    res_t r = {0};
    assert_true(ap_rt_rpc_call(rt, pid, "/r", (const uint8_t *)"ping", 4, NULL, on_done, &r) != 0);
    ap_node_t *n = (ap_node_t *)rt;
    ap_mconn_t *dialing = n->conns;
    assert_non_null(dialing);
    assert_int_equal(dialing->state, MC_DIALING);
    assert_int_equal(dialing->nstreams, 1);

    /* meanwhile the peer's own connection arrives and is up */
    fake_t fk;
    ap_test_fake_conn_init(&fk);
    fk.conn.dialer = false; /* we accepted it: our stream ids are even */
    fk.conn.remote = *pid;
    ap__node_accept_conn(n, &fk.conn);
    ap_mconn_t *up = fk.conn.user;
    assert_non_null(up);
    assert_true(ap_rt_is_connected(rt, pid));

    /* the transport resolves the dial with that connection */
    ap_conn_t *t = dialing->t;
    t->remote = *pid;
    t->cbs.on_close(t->user, t, AP_EEXIST);
    assert_false(r.done);
    ap_host_run_once(h, 0);

    /* the call was opened on the surviving connection: OPEN(RPC, sid 2,
     * "/r"), the request, CLOSE */
    ap_frame_t f;
    size_t off = 0;
    assert_true(fk.len >= AP_FRAME_HDR);
    assert_ok(ap__frame_parse_hdr(fk.out, &f));
    assert_int_equal(f.type, AP_FRAME_OPEN);
    assert_int_equal(f.flags & AP_FRAME_F_RPC, AP_FRAME_F_RPC);
    assert_int_equal(f.sid, 2);
    f.payload = fk.out + AP_FRAME_HDR;
    uint32_t window;
    char proto[AP_RT_PROTO_MAX];
    assert_ok(ap__frame_parse_open(&f, &window, proto, sizeof proto));
    assert_string_equal(proto, "/r");
    off = AP_FRAME_HDR + f.len;
    assert_ok(ap__frame_parse_hdr(fk.out + off, &f));
    assert_int_equal(f.type, AP_FRAME_DATA);
    assert_int_equal(f.sid, 2);
    f.payload = fk.out + off + AP_FRAME_HDR;
    bool has_total;
    uint32_t total;
    const uint8_t *d;
    size_t dn;
    assert_ok(ap__frame_parse_data(&f, &has_total, &total, &d, &dn));
    assert_true(has_total);
    assert_int_equal(dn, 4);
    assert_memory_equal(d, "ping", 4);

    /* the peer answers on that connection */
    ap_buf_t b;
    ap__buf_init(&b);
    assert_ok(ap__frame_put_window(&b, 2, true, 0));
    assert_ok(ap__frame_put_data(&b, 2, true, 4, (const uint8_t *)"pong", 4));
    assert_ok(ap__frame_put_close(&b, 2));
    ap__mux_feed(up, b.data, b.len);
    ap__buf_free(&b);
    assert_true(ap_host_run_until(h, is_done, &r, 5u * 1000u * 1000u));
    assert_ok(r.status);
    assert_string_equal(r.resp, "pong");
    assert_false(fk.closed);

    ap_node_free(rt);
    ap_node_free(peer);
    assert_int_equal(ap_host_free(h), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dial_adopts_existing_connection),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
