/* libuv driver: streams and RPC over the in-process transport — bounded
 * memory against a flooding sender, fairness between streams, large
 * fragmented messages, dialing, and two nodes on two hosts (threads). */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/node.h"
#include "apiary/sync.h"
#include "runtime/uv/uv_impl.h"

#include <stdlib.h>
#include <string.h>

#define MS  1000ull
#define SEC (1000ull * MS)

typedef struct pair {
    ap_host_t *h;
    ap_rt_t *a, *b;
} pair_t;

static void pair_up(pair_t *p)
{
    p->h = ap_host_new();
    assert_non_null(p->h);
    assert_ok(ap_node_new(p->h, &(ap_node_opts_t){.rng_seed = 1}, &p->a));
    assert_ok(ap_node_new(p->h, &(ap_node_opts_t){.rng_seed = 2}, &p->b));
    char addr[1][AP_RT_ADDR_MAX];
    ap_rt_listen_addrs(p->b, addr, 1, false);
    assert_ok(ap_rt_add_addr(p->a, ap_rt_self(p->b), addr[0]));
    ap_rt_listen_addrs(p->a, addr, 1, false);
    assert_ok(ap_rt_add_addr(p->b, ap_rt_self(p->a), addr[0]));
}

static void pair_down(pair_t *p)
{
    assert_ok(ap_host_free(p->h));
}

static ap_mconn_t *conn_of(ap_rt_t *rt)
{
    return ((ap_node_t *)rt)->conns;
}

/* ---- a flooding sender against a paused receiver ------------------------------------- */

typedef struct flood {
    ap_stream_t *tx, *rx;
    uint64_t sent_msgs, recv_msgs, recv_bytes;
    uint64_t next_expected;
    bool order_ok;
    int eagain;
    size_t max_tx_buffered, max_rx_buffered;
    bool closed_rx, closed_tx;
    int status_rx, status_tx;
    ap_rt_t *b;
} flood_t;

static uint8_t fmsg[16384];

static void fl_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    flood_t *f = arg;
    uint64_t seq;
    memcpy(&seq, d, 8);
    if (n != sizeof fmsg || seq != f->next_expected) f->order_ok = false;
    f->next_expected++;
    f->recv_msgs++;
    f->recv_bytes += n;
}

static void fl_close_rx(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    flood_t *f = arg;
    f->closed_rx = true;
    f->status_rx = st;
}

static void fl_close_tx(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    flood_t *f = arg;
    f->closed_tx = true;
    f->status_tx = st;
}

static void fl_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}

static int fl_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)peer;
    (void)hello;
    (void)len;
    flood_t *f = arg;
    static const ap_stream_cbs_t cbs = {
        .on_msg = fl_msg, .on_end = fl_end, .on_close = fl_close_rx};
    ap_stream_set_cbs(s, &cbs, f);
    ap_stream_pause(s, true);
    f->rx = s;
    return 0;
}

/* Sends until EAGAIN, every millisecond: a sender that never stops. */
static void fl_tick(ap_rt_t *rt, void *arg)
{
    (void)rt;
    flood_t *f = arg;
    for (;;) {
        memcpy(fmsg, &f->sent_msgs, 8);
        int rc = ap_stream_send(f->tx, fmsg, sizeof fmsg);
        if (rc == AP_EAGAIN) {
            f->eagain++;
            break;
        }
        assert_ok(rc);
        f->sent_msgs++;
    }
    size_t tb = ap_stream_buffered(f->tx);
    if (tb > f->max_tx_buffered) f->max_tx_buffered = tb;
    ap_mconn_t *c = conn_of(f->b);
    if (c && c->rx_buffered > f->max_rx_buffered) f->max_rx_buffered = c->rx_buffered;
}

static bool fl_all(void *arg)
{
    flood_t *f = arg;
    return f->recv_msgs == f->sent_msgs;
}

static bool fl_pushed_long(void *arg)
{
    return ((flood_t *)arg)->eagain > 50;
}

static bool fl_closed(void *arg)
{
    flood_t *f = arg;
    return f->closed_rx && f->closed_tx;
}

static void test_flood_bounded(void **state)
{
    (void)state;
    pair_t p;
    pair_up(&p);
    flood_t f = {.order_ok = true, .b = p.b};
    const size_t rxw = 256 * 1024, txw = 128 * 1024;
    ap_stream_opts_t lo = {.window = rxw};
    assert_ok(ap_rt_stream_listen(p.b, "/t/flood", &lo, fl_accept, &f));
    ap_stream_opts_t so = {.window = txw};
    static const ap_stream_cbs_t cbs = {.on_close = fl_close_tx};
    assert_ok(ap_rt_stream_open(p.a, ap_rt_self(p.b), "/t/flood", NULL, 0, &so, &cbs, &f, &f.tx));
    uint64_t tick = ap_rt_timer_start(p.a, 1 * MS, 1 * MS, fl_tick, &f);
    /* more than 50 ticks (however slowly they come on a loaded machine),
     * each pushing until EAGAIN; nothing got through */
    assert_true(ap_host_run_until(p.h, fl_pushed_long, &f, 30 * SEC));
    assert_int_equal(f.recv_msgs, 0);
    /* memory stayed bounded on both sides */
    assert_true(f.max_tx_buffered <= txw);
    assert_true(f.max_rx_buffered <= rxw + sizeof fmsg);
    assert_true(f.sent_msgs * sizeof fmsg <= txw + rxw + sizeof fmsg);
    assert_true(ap_stream_buffered(f.tx) > 0);
    /* resume: everything arrives, in order */
    ap_rt_timer_stop(p.a, tick);
    ap_stream_pause(f.rx, false);
    assert_true(ap_host_run_until(p.h, fl_all, &f, 20 * SEC));
    assert_true(f.order_ok);
    assert_ok(ap_stream_close(f.tx));
    assert_true(ap_host_run_until(p.h, fl_closed, &f, 20 * SEC));
    assert_int_equal(f.status_rx, 0);
    assert_int_equal(f.status_tx, 0);
    assert_int_equal(conn_of(p.b)->rx_buffered, 0);
    pair_down(&p);
}

/* ---- fairness between streams ------------------------------------------------------------ */

enum { NS = 3 };
typedef struct fair {
    ap_stream_t *tx[NS];
    uint64_t bytes[NS];
    uint64_t total, target;
    int accepted;
} fair_t;

typedef struct fair_arg {
    fair_t *f;
    int i;
} fair_arg_t;

static fair_arg_t fargs[NS];
static uint8_t big[64 * 1024];

static void fa_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    fair_arg_t *a = arg;
    (void)d;
    a->f->bytes[a->i] += n;
    a->f->total += n;
}

static int fa_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)peer;
    fair_t *f = arg;
    if (len != 1 || hello[0] >= NS) return AP_EINVAL;
    static const ap_stream_cbs_t cbs = {.on_msg = fa_msg};
    ap_stream_set_cbs(s, &cbs, &fargs[hello[0]]);
    f->accepted++;
    return 0;
}

static void fa_fill(ap_stream_t *s, void *arg)
{
    fair_arg_t *a = arg;
    if (a->f->total >= a->f->target) return;
    while (ap_stream_send(s, big, sizeof big) == 0) {
    }
}

static bool fa_enough(void *arg)
{
    fair_t *f = arg;
    return f->total >= f->target;
}

static void test_fairness(void **state)
{
    (void)state;
    pair_t p;
    pair_up(&p);
    fair_t f = {.target = (ap_test_sanitized() ? 16u : 96u) << 20};
    assert_ok(ap_rt_stream_listen(p.b, "/t/fair", NULL, fa_accept, &f));
    static const ap_stream_cbs_t cbs = {.on_writable = fa_fill};
    for (int i = 0; i < NS; i++) {
        fargs[i] = (fair_arg_t){&f, i};
        uint8_t hello = (uint8_t)i;
        assert_ok(ap_rt_stream_open(p.a, ap_rt_self(p.b), "/t/fair", &hello, 1, NULL, &cbs,
                                    &fargs[i], &f.tx[i]));
        fa_fill(f.tx[i], &fargs[i]);
    }
    double t0 = (double)ap_rt_now_us(p.a);
    assert_true(ap_host_run_until(p.h, fa_enough, &f, 60 * SEC));
    double secs = ((double)ap_rt_now_us(p.a) - t0) / 1e6;
    assert_int_equal(f.accepted, NS);
    uint64_t mn = f.bytes[0], mx = f.bytes[0];
    for (int i = 1; i < NS; i++) {
        if (f.bytes[i] < mn) mn = f.bytes[i];
        if (f.bytes[i] > mx) mx = f.bytes[i];
    }
    print_message("fairness: %.1f / %.1f / %.1f MiB in %.2f s\n", f.bytes[0] / 1048576.0,
                  f.bytes[1] / 1048576.0, f.bytes[2] / 1048576.0, secs);
    /* round robin by frame: the streams stay within a window of each other */
    assert_true((double)mn >= 0.8 * (double)mx);
    for (int i = 0; i < NS; i++) ap_stream_reset(f.tx[i], AP_ECANCELED);
    pair_down(&p);
}

/* ---- RPC: large fragmented messages, both directions at once ------------------------------- */

typedef struct rctx {
    int done;
    int status;
    size_t len;
    bool ok;
} rctx_t;

static void big_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    uint8_t *out = malloc(n);
    for (size_t i = 0; i < n; i++) out[i] = (uint8_t)(d[i] ^ 0x5a);
    ap_rpc_respond(req, out, n);
    free(out);
}

static void big_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                     const char *errmsg)
{
    (void)rt;
    (void)errmsg;
    rctx_t *c = arg;
    c->done++;
    c->status = status;
    c->len = len;
    c->ok = true;
    for (size_t i = 0; i < len; i++)
        if (resp[i] != (uint8_t)((uint8_t)(i * 13) ^ 0x5a)) {
            c->ok = false;
            break;
        }
}

static bool both_done(void *arg)
{
    rctx_t *c = arg;
    return c[0].done && c[1].done;
}

static void test_big_rpc_both_ways(void **state)
{
    (void)state;
    pair_t p;
    pair_up(&p);
    size_t n = 3u << 20;
    uint8_t *req = malloc(n);
    for (size_t i = 0; i < n; i++) req[i] = (uint8_t)(i * 13);
    assert_ok(ap_rt_rpc_register(p.a, "/t/big", 4u << 20, big_handler, NULL));
    assert_ok(ap_rt_rpc_register(p.b, "/t/big", 4u << 20, big_handler, NULL));
    rctx_t c[2] = {0};
    ap_rpc_opts_t o = {.max_resp = 4u << 20};
    /* both dial each other at once */
    assert_true(ap_rt_rpc_call(p.a, ap_rt_self(p.b), "/t/big", req, n, &o, big_done, &c[0]));
    assert_true(ap_rt_rpc_call(p.b, ap_rt_self(p.a), "/t/big", req, n, &o, big_done, &c[1]));
    assert_true(ap_host_run_until(p.h, both_done, c, 30 * SEC));
    for (int i = 0; i < 2; i++) {
        assert_int_equal(c[i].status, 0);
        assert_int_equal(c[i].len, n);
        assert_true(c[i].ok);
        assert_int_equal(c[i].done, 1);
    }
    free(req);
    pair_down(&p);
}

/* ---- dialing and peer events ------------------------------------------------------------------
 */

typedef struct dctx {
    int calls;
    int status;
    ap_peer_id_t peer;
    int connected, disconnected;
} dctx_t;

static void dial_cb(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    (void)rt;
    dctx_t *d = arg;
    d->calls++;
    d->status = status;
    if (peer) d->peer = *peer;
}

static void watch_cb(ap_rt_t *rt, void *arg, const ap_peer_id_t *peer, ap_peer_event_t ev)
{
    (void)rt;
    (void)peer;
    dctx_t *d = arg;
    if (ev == AP_PEER_CONNECTED) d->connected++;
    if (ev == AP_PEER_DISCONNECTED) d->disconnected++;
}

static bool dialed(void *arg)
{
    return ((dctx_t *)arg)->calls > 0;
}

static void test_dial(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *a, *b, *c;
    assert_ok(ap_node_new(h, NULL, &a));
    assert_ok(ap_node_new(h, NULL, &b));
    assert_ok(ap_node_new(h, NULL, &c));
    dctx_t wa = {0}, wb = {0};
    assert_true(ap_rt_peer_watch(a, watch_cb, &wa));
    assert_true(ap_rt_peer_watch(b, watch_cb, &wb));
    char baddr[1][AP_RT_ADDR_MAX], caddr[1][AP_RT_ADDR_MAX];
    ap_rt_listen_addrs(b, baddr, 1, true);
    ap_rt_listen_addrs(c, caddr, 1, false);

    assert_int_equal(ap_rt_dial(a, "garbage", 0, dial_cb, NULL), AP_EADDR);
    assert_int_equal(ap_rt_dial(a, "/ip4/127.0.0.1/tcp/1", 0, dial_cb, NULL), AP_ENOTSUP);
    dctx_t d1 = {0};
    assert_ok(ap_rt_dial(a, baddr[0], SEC, dial_cb, &d1));
    assert_int_equal(d1.calls, 0);
    assert_true(ap_host_run_until(h, dialed, &d1, 10 * SEC));
    assert_int_equal(d1.status, 0);
    assert_true(ap_peer_id_eq(&d1.peer, ap_rt_self(b)));
    assert_true(ap_rt_is_connected(a, ap_rt_self(b)));
    ap_host_run_until(h, NULL, NULL, 5 * MS);
    assert_int_equal(wa.connected, 1);
    assert_int_equal(wb.connected, 1);
    /* dialing again reuses the connection */
    dctx_t d2 = {0};
    assert_ok(ap_rt_dial(a, baddr[0], SEC, dial_cb, &d2));
    assert_true(ap_host_run_until(h, dialed, &d2, 10 * SEC));
    assert_int_equal(d2.status, 0);
    ap_rt_stats_t st;
    ap_rt_get_stats(a, &st);
    assert_int_equal(st.connections, 1);
    /* c's address with b's id: the remote is not who we asked for */
    char wrong[AP_RT_ADDR_MAX * 2];
    char bid[AP_PEER_ID_STR_MAX];
    ap_rt_t *x;
    assert_ok(ap_node_new(h, NULL, &x)); /* an id nobody is connected to */
    snprintf(wrong, sizeof wrong, "%s/p2p/%s", caddr[0], ap_peer_id_str(ap_rt_self(x), bid));
    dctx_t d3 = {0};
    assert_ok(ap_rt_dial(a, wrong, SEC, dial_cb, &d3));
    assert_true(ap_host_run_until(h, dialed, &d3, 10 * SEC));
    assert_int_equal(d3.status, AP_EAUTH);
    /* nobody listens there */
    dctx_t d4 = {0};
    assert_ok(ap_rt_dial(a, "/memory/65000", SEC, dial_cb, &d4));
    assert_int_equal(d4.calls, 0);
    assert_true(ap_host_run_until(h, dialed, &d4, 10 * SEC));
    assert_int_equal(d4.status, AP_EUNREACH);
    /* calls to a peer with no known address */
    rctx_t r = {0};
    assert_true(ap_rt_rpc_call(a, ap_rt_self(c), "/t/x", NULL, 0, NULL, big_done, &r));
    assert_int_equal(r.done, 0);
    ap_host_run_until(h, NULL, NULL, 5 * MS);
    assert_int_equal(r.status, AP_EUNREACH);
    /* b goes away: a sees the disconnect */
    ap_node_free(b);
    ap_host_run_until(h, NULL, NULL, 10 * MS);
    assert_int_equal(wa.disconnected, 1);
    assert_false(ap_rt_is_connected(a, ap_rt_self(c)));
    assert_ok(ap_host_free(h));
}

/* ---- two hosts, two threads ------------------------------------------------------------------ */

typedef struct xfer {
    uint64_t sum_rx;
    uint64_t bytes_rx;
    int rx_status;
    bool rx_closed;
    ap_stream_t *tx;
    size_t total, sent;
    uint64_t sum_tx;
    ap_sync_t *done;
} xfer_t;

static void x_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    xfer_t *x = arg;
    for (size_t i = 0; i < n; i++) x->sum_rx = x->sum_rx * 31 + d[i];
    x->bytes_rx += n;
}

static void x_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}

static void x_close_rx(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    xfer_t *x = arg;
    x->rx_status = st;
    x->rx_closed = true;
}

static int x_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                    const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)peer;
    (void)hello;
    (void)len;
    static const ap_stream_cbs_t cbs = {.on_msg = x_msg, .on_end = x_end, .on_close = x_close_rx};
    ap_stream_set_cbs(s, &cbs, arg);
    return 0;
}

static void x_fill(ap_stream_t *s, void *arg)
{
    xfer_t *x = arg;
    uint8_t chunk[50000];
    while (x->sent < x->total) {
        size_t n = x->total - x->sent < sizeof chunk ? x->total - x->sent : sizeof chunk;
        for (size_t i = 0; i < n; i++) chunk[i] = (uint8_t)((x->sent + i) * 2654435761u >> 13);
        int rc = ap_stream_send(s, chunk, n);
        if (rc == AP_EAGAIN) return;
        assert_ok(rc);
        for (size_t i = 0; i < n; i++) x->sum_tx = x->sum_tx * 31 + chunk[i];
        x->sent += n;
    }
    ap_stream_close(s);
}

static void x_close_tx(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    xfer_t *x = arg;
    ap_sync_complete(x->done, st);
}

static void x_start(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    xfer_t *x = arg;
    x->done = done;
    static const ap_stream_cbs_t cbs = {.on_writable = x_fill, .on_close = x_close_tx};
    const ap_peer_id_t *peer = ((ap_peer_id_t *)((xfer_t *)arg + 1));
    int rc = ap_rt_stream_open(rt, peer, "/t/xfer", NULL, 0, NULL, &cbs, x, &x->tx);
    if (rc < 0) {
        ap_sync_complete(done, rc);
        return;
    }
    x_fill(x->tx, x);
}

typedef struct echo_call {
    ap_peer_id_t peer;
    ap_sync_t *done;
    uint8_t resp[16];
    size_t len;
} echo_call_t;

static void echo_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    (void)rt;
    (void)errmsg;
    echo_call_t *e = arg;
    e->len = len < sizeof e->resp ? len : sizeof e->resp;
    if (resp) memcpy(e->resp, resp, e->len);
    ap_sync_complete(e->done, status);
}

static void echo_start(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    echo_call_t *e = arg;
    e->done = done;
    ap_rt_rpc_call(rt, &e->peer, "/t/echo", (const uint8_t *)"ping", 4, NULL, echo_done, e);
}

static void test_two_hosts(void **state)
{
    (void)state;
    ap_host_t *h1 = ap_host_new(), *h2 = ap_host_new();
    ap_rt_t *a, *b;
    assert_ok(ap_node_new(h1, NULL, &a));
    assert_ok(ap_node_new(h2, NULL, &b));
    char addr[1][AP_RT_ADDR_MAX];
    ap_rt_listen_addrs(b, addr, 1, false);
    assert_ok(ap_rt_add_addr(a, ap_rt_self(b), addr[0]));
    struct {
        xfer_t x;
        ap_peer_id_t peer;
    } xp = {.x = {.total = ap_test_sanitized() ? (2u << 20) : (16u << 20)}, .peer = *ap_rt_self(b)};
    assert_ok(ap_rt_stream_listen(b, "/t/xfer", NULL, x_accept, &xp.x));
    assert_ok(ap_rt_rpc_register(b, "/t/echo", 0, ap_test_rpc_echo, NULL));
    assert_ok(ap_host_start(h1));
    assert_ok(ap_host_start(h2));
    echo_call_t e = {.peer = *ap_rt_self(b)};
    assert_ok(ap_node_call_sync(a, echo_start, &e));
    assert_int_equal(e.len, 4);
    assert_memory_equal(e.resp, "ping", 4);
    assert_ok(ap_node_call_sync(a, x_start, &xp.x));
    ap_host_stop(h1);
    ap_host_stop(h2);
    /* the receiver closed before the sender's on_close(0) could run */
    assert_true(xp.x.rx_closed);
    assert_int_equal(xp.x.rx_status, 0);
    assert_int_equal(xp.x.bytes_rx, xp.x.total);
    assert_true(xp.x.sum_rx == xp.x.sum_tx);
    assert_ok(ap_host_free(h1));
    assert_ok(ap_host_free(h2));
}

/* ---- teardown owes every callback; a stalled receiver bounds the sender --------------------- */

typedef struct owed {
    int done_calls, done_status;
    int close_calls, close_status;
} owed_t;

static void owed_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    (void)rt;
    (void)resp;
    (void)len;
    (void)errmsg;
    owed_t *o = arg;
    o->done_calls++;
    o->done_status = status;
}

static void owed_close(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    owed_t *o = arg;
    o->close_calls++;
    o->close_status = st;
}

static void hold_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    *(ap_rpc_req_t **)arg = req;
}

static int plain_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                        const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)peer;
    (void)hello;
    (void)len;
    static const ap_stream_cbs_t cbs = {.on_close = owed_close};
    ap_stream_set_cbs(s, &cbs, arg);
    return 0;
}

static bool req_held(void *arg)
{
    return *(ap_rpc_req_t **)arg != NULL;
}

static void test_free_owes_callbacks(void **state)
{
    (void)state;
    pair_t p;
    pair_up(&p);
    ap_rpc_req_t *held = NULL;
    owed_t srv = {0}, cli = {0};
    assert_ok(ap_rt_rpc_register(p.b, "/t/hold", 0, hold_handler, &held));
    assert_ok(ap_rt_stream_listen(p.b, "/t/plain", NULL, plain_accept, &srv));
    assert_true(ap_rt_rpc_call(p.a, ap_rt_self(p.b), "/t/hold", NULL, 0, NULL, owed_done, &cli));
    ap_stream_t *s;
    static const ap_stream_cbs_t cbs = {.on_close = owed_close};
    assert_ok(ap_rt_stream_open(p.a, ap_rt_self(p.b), "/t/plain", NULL, 0, NULL, &cbs, &cli, &s));
    assert_true(ap_host_run_until(p.h, req_held, &held, 10 * SEC));
    ap_host_run_until(p.h, NULL, NULL, 5 * MS);
    /* the caller's node goes away: its own callbacks run inside ap_node_free */
    ap_node_free(p.a);
    assert_int_equal(cli.done_calls, 1);
    assert_int_equal(cli.done_status, AP_ECANCELED);
    assert_int_equal(cli.close_calls, 1);
    assert_int_equal(cli.close_status, AP_ECLOSED);
    assert_int_equal(ap_rt_post(p.b, NULL, NULL), AP_EINVAL);
    /* the peer sees the connection drop on its side of the stream */
    ap_host_run_until(p.h, NULL, NULL, 10 * MS);
    assert_int_equal(srv.close_calls, 1);
    assert_int_equal(srv.close_status, AP_ECLOSED);
    /* the held request is answered late: dropped, no crash */
    ap_rpc_respond(held, (const uint8_t *)"late", 4);
    pair_down(&p);
}

typedef struct stall {
    ap_stream_t *tx;
    uint64_t sent, recv;
    bool closed;
} stall_t;

static void st_fill(ap_stream_t *s, void *arg)
{
    stall_t *x = arg;
    while (ap_stream_send(s, big, sizeof big) == 0) x->sent += sizeof big;
}

static void st_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    (void)d;
    ((stall_t *)arg)->recv += n;
}

static int st_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)peer;
    (void)hello;
    (void)len;
    static const ap_stream_cbs_t cbs = {.on_msg = st_msg};
    ap_stream_set_cbs(s, &cbs, arg);
    return 0;
}

static void test_stalled_receiver_host(void **state)
{
    (void)state;
    /* two caller-driven hosts: the test runs the receiver's loop or not */
    ap_host_t *h1 = ap_host_new(), *h2 = ap_host_new();
    ap_rt_t *a, *b;
    assert_ok(ap_node_new(h1, NULL, &a));
    assert_ok(ap_node_new(h2, NULL, &b));
    char addr[1][AP_RT_ADDR_MAX];
    ap_rt_listen_addrs(b, addr, 1, false);
    assert_ok(ap_rt_add_addr(a, ap_rt_self(b), addr[0]));
    stall_t x = {0};
    const size_t win = 64u << 20; /* windows far above the connection window */
    assert_ok(
        ap_rt_stream_listen(b, "/t/stall", &(ap_stream_opts_t){.window = win}, st_accept, &x));
    static const ap_stream_cbs_t cbs = {.on_writable = st_fill};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/t/stall", NULL, 0,
                                &(ap_stream_opts_t){.window = win}, &cbs, &x, &x.tx));
    for (int i = 0; i < 50 && x.recv == 0; i++) {
        ap_host_run_once(h1, 1000);
        ap_host_run_once(h2, 1000);
        if (x.sent == 0) st_fill(x.tx, &x);
    }
    assert_true(x.recv > 0);
    /* now only the sender runs: the receiver's loop is stalled */
    ap_rt_stats_t s0, s1;
    ap_rt_get_stats(a, &s0);
    for (int i = 0; i < 200; i++) {
        st_fill(x.tx, &x);
        ap_host_run_once(h1, 0);
    }
    ap_rt_get_stats(a, &s1);
    /* bytes handed to the transport while the peer read nothing: at most the
     * connection window plus one flush batch and framing */
    uint64_t written = s1.bytes_sent - s0.bytes_sent;
    print_message("stalled receiver: %.1f MiB written, %.1f MiB accepted by send\n",
                  written / 1048576.0, x.sent / 1048576.0);
    assert_true(written <= AP_MUX_CONN_WINDOW + AP_MUX_FLUSH_BYTES + (1u << 20));
    assert_true(ap_stream_buffered(x.tx) <= win);
    /* the receiver resumes: the flow continues */
    uint64_t before = x.recv;
    for (int i = 0; i < 200 && x.recv < before + (32u << 20); i++) {
        st_fill(x.tx, &x);
        ap_host_run_once(h1, 0);
        ap_host_run_once(h2, 1000);
    }
    assert_true(x.recv >= before + (32u << 20));
    ap_stream_reset(x.tx, AP_ECANCELED);
    ap_node_free(a);
    ap_node_free(b);
    assert_ok(ap_host_free(h1));
    assert_ok(ap_host_free(h2));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flood_bounded),
        cmocka_unit_test(test_fairness),
        cmocka_unit_test(test_big_rpc_both_ways),
        cmocka_unit_test(test_dial),
        cmocka_unit_test(test_two_hosts),
        cmocka_unit_test(test_free_owes_callbacks),
        cmocka_unit_test(test_stalled_receiver_host),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
