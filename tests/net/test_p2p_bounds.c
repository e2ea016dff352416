/* What a libp2p peer can make a host hold, over real loopback sockets, with
 * the host's connections counted in a resource manager (p2p_conn.h,
 * ap__p2p_host_set_rcmgr):
 *   - a peer that opens streams and never finishes them holds at most its
 *     stream limit; the rest are reset; they are released as they end;
 *   - a peer that never reads while it sends pings (each answered) is
 *     closed once its unsent answers pass its connection's memory; the
 *     node's scopes are empty again, and another peer is still served;
 *   - detaching the manager releases every reservation at once;
 *   - the WARN lines of sessions that fail on a protocol error are
 *     rate-limited (fresh identities cost nothing). */
#include "aptest.h"

#include "apiary/identity.h"
#include "base/rcmgr.h"
#include "p2p/p2p_conn.h"
#include "p2p/p2p_impl.h"

#include "apiary/log.h"

#include <string.h>
#include <uv.h>

typedef struct ctx {
    uv_loop_t loop;
    ap_p2p_conn_t *conn, *conn2;
    bool ready, closed, ready2, closed2;
} ctx_t;

static void ready(ap_p2p_conn_t *c, void *arg)
{
    ctx_t *x = arg;
    if (c == x->conn2)
        x->ready2 = true;
    else
        x->ready = true;
}
static void closed(ap_p2p_conn_t *c, void *arg, int st)
{
    (void)st;
    ctx_t *x = arg;
    if (c == x->conn2)
        x->closed2 = true;
    else
        x->closed = true;
}
static const ap_p2p_conn_cbs_t cbs = {ready, closed};

#define RUN_UNTIL(x, cond)                                                                         \
    do {                                                                                           \
        for (int ap__i = 0; !(cond) && ap__i < 200000; ap__i++) uv_run(&(x)->loop, UV_RUN_ONCE);   \
        assert_true(cond);                                                                         \
    } while (0)

static void ident(ap_identity_t *id, uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    assert_ok(ap_identity_from_seed(id, seed));
}

/* One raw yamux frame on c (no payload). */
static void yframe(ap_p2p_conn_t *c, uint8_t type, uint16_t flags, uint32_t id, uint32_t len)
{
    uint8_t hdr[AP_YAMUX_HDR_LEN];
    ap_yamux_hdr_t h = {0, type, flags, id, len};
    ap__yamux_hdr_put(hdr, &h);
    ap__p2p_secure_write(c, hdr, sizeof hdr, NULL, 0);
}

typedef struct setup {
    ap_identity_t ida, idb;
    ap_p2p_host_t *a, *b;
    ap_rcmgr_t *m;
    ap_multiaddr_t bound;
} setup_t;

static void setup(ctx_t *x, setup_t *s, uint64_t conn_memory, uint32_t streams)
{
    memset(x, 0, sizeof *x);
    uv_loop_init(&x->loop);
    ident(&s->ida, 21);
    ident(&s->idb, 22);
    ap_rcmgr_config_t rc;
    ap_rcmgr_config_default(&rc);
    rc.conn.memory = rc.peer.memory = conn_memory;
    rc.conn.streams = rc.peer.streams = streams;
    s->m = ap_rcmgr_new(&rc);
    assert_non_null(s->m);
    s->a = ap__p2p_host_new(&x->loop, &s->ida, "apiary-test/a");
    s->b = ap__p2p_host_new(&x->loop, &s->idb, "apiary-test/b");
    assert_non_null(s->a);
    assert_non_null(s->b);
    ap__p2p_host_set_rcmgr(s->a, s->m);
    assert_ok(ap__p2p_host_serve_basics(s->a));
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(s->a, &ma, &s->bound));
    s->bound.has_peer = true;
    s->bound.peer = s->ida.id;
    assert_ok(ap__p2p_dial(s->b, &s->bound, &cbs, x, &x->conn));
    RUN_UNTIL(x, x->ready || x->closed);
    assert_true(x->ready);
}

static void teardown(ctx_t *x, setup_t *s)
{
    ap__p2p_host_free(s->b);
    ap__p2p_host_free(s->a);
    uv_run(&x->loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x->loop), 0);
    const ap_rc_use_t *u = ap_rc_scope_use(ap_rcmgr_node(s->m));
    assert_int_equal(u->memory, 0);
    assert_int_equal(u->streams, 0);
    assert_int_equal(ap_rcmgr_npeers(s->m), 0);
    ap_rcmgr_free(s->m);
}

static void test_stream_flood(void **state)
{
    (void)state;
    static ctx_t x;
    setup_t s;
    enum { LIMIT = 64, OPENED = 500 };
    setup(&x, &s, 8u << 20, LIMIT);
    const ap_rc_use_t *node = ap_rc_scope_use(ap_rcmgr_node(s.m));
    /* streams opened and never negotiated (odd ids: we dialled) */
    for (uint32_t i = 0; i < OPENED; i++)
        yframe(x.conn, AP_YAMUX_WINDOW, AP_YAMUX_SYN, 1 + 2 * i, 0);
    ap__p2p_conn_submit(x.conn);
    RUN_UNTIL(&x, ap_rcmgr_refusals(s.m) >= OPENED - LIMIT);
    assert_int_equal(node->streams, LIMIT);
    assert_int_equal(ap_rcmgr_refusals(s.m), OPENED - LIMIT);
    assert_false(x.closed); /* the connection stays; the extra streams are reset */
    /* they end: released */
    for (uint32_t i = 0; i < OPENED; i++)
        yframe(x.conn, AP_YAMUX_WINDOW, AP_YAMUX_RST, 1 + 2 * i, 0);
    ap__p2p_conn_submit(x.conn);
    RUN_UNTIL(&x, node->streams == 0);
    /* and the peer can open streams again */
    for (uint32_t i = 0; i < 8; i++) yframe(x.conn, AP_YAMUX_WINDOW, AP_YAMUX_SYN, 2001 + 2 * i, 0);
    ap__p2p_conn_submit(x.conn);
    RUN_UNTIL(&x, node->streams == 8);
    /* detaching releases them at once */
    ap__p2p_host_set_rcmgr(s.a, NULL);
    assert_int_equal(node->streams, 0);
    assert_int_equal(ap_rcmgr_npeers(s.m), 0);
    teardown(&x, &s);
}

static void test_never_reads(void **state)
{
    (void)state;
    static ctx_t x;
    setup_t s;
    const uint64_t conn_mem = 1u << 20;
    setup(&x, &s, conn_mem, 256);
    /* the peer stops reading: the host's answers pile up */
    uv_read_stop((uv_stream_t *)&x.conn->tcp);
    uint64_t refusals = ap_rcmgr_refusals(s.m);
    const ap_rc_use_t *node = ap_rc_scope_use(ap_rcmgr_node(s.m));
    uint64_t peak = 0;
    for (int round = 0; round < 4000 && ap_rcmgr_refusals(s.m) == refusals && !x.closed; round++) {
        for (int i = 0; i < 4096; i++) yframe(x.conn, AP_YAMUX_PING, AP_YAMUX_SYN, 0, (uint32_t)i);
        ap__p2p_conn_submit(x.conn);
        for (int k = 0; k < 20; k++) uv_run(&x.loop, UV_RUN_NOWAIT);
        if (node->memory > peak) peak = node->memory;
    }
    RUN_UNTIL(&x, ap_rcmgr_refusals(s.m) > refusals && s.a->nconns == 0);
    assert_true(peak > 0);             /* the answers were counted ... */
    assert_true(peak <= conn_mem);     /* ... within the connection's memory */
    assert_int_equal(node->memory, 0); /* and released with it */
    /* another peer is served */
    assert_ok(ap__p2p_dial(s.b, &s.bound, &cbs, &x, &x.conn2));
    RUN_UNTIL(&x, x.ready2 || x.closed2);
    assert_true(x.ready2);
    teardown(&x, &s);
}

static int g_yamux_warns;

static void count_sink(void *arg, ap_log_level_t level, const char *module, const char *msg)
{
    (void)arg;
    if (level >= AP_LOG_WARN && !strcmp(module, "p2p") && strstr(msg, ": yamux: ")) g_yamux_warns++;
}

/* 48 sessions in a row, each failed by a window update past 2^32 - 1: at
 * most the limiter's burst of 32 lines, not one per session. */
static void test_warns_limited(void **state)
{
    (void)state;
    static ctx_t x;
    setup_t s;
    setup(&x, &s, 8u << 20, 256);
    ap_log_set_sink(count_sink, NULL);
    g_yamux_warns = 0;
    enum { SESSIONS = 48 };
    for (int i = 0; i < SESSIONS; i++) {
        x.conn2 = NULL;
        x.ready2 = x.closed2 = false;
        assert_ok(ap__p2p_dial(s.b, &s.bound, &cbs, &x, &x.conn2));
        RUN_UNTIL(&x, x.ready2 || x.closed2);
        assert_true(x.ready2);
        yframe(x.conn2, AP_YAMUX_WINDOW, AP_YAMUX_SYN, 1, 0);
        yframe(x.conn2, AP_YAMUX_WINDOW, 0, 1, UINT32_MAX);
        ap__p2p_conn_submit(x.conn2);
        RUN_UNTIL(&x, x.closed2);
    }
    ap_log_set_sink(NULL, NULL);
    print_message("%d yamux WARN lines for %d failed sessions\n", g_yamux_warns, SESSIONS);
    assert_true(g_yamux_warns >= 1);
    assert_true(g_yamux_warns <= 32);
    teardown(&x, &s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_warns_limited),
        cmocka_unit_test(test_stream_flood),
        cmocka_unit_test(test_never_reads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
