/* libp2p connections over real loopback sockets, Apiary to Apiary: the
 * upgrade (multistream-select /noise, Noise SHA-256, yamux chosen in the
 * handshake), ping and identify (every field), an unknown protocol answered
 * "na", a wrong expected PeerID refused; then `apiary ping` and
 * `apiary identify --json` against a host in this process; and a libp2p
 * dialer served ping and identify on an Apiary transport's own TCP port,
 * identify there announcing the node's addresses; a reader that stops
 * consuming stops the writer (back-pressure through the echo server). */
#include "aptest.h"

#include "apiary/identity.h"
#include "apiary/node.h"
#include "runtime/uv/uv_impl.h"
#include "p2p/identify.h"
#include "net/tcp.h"
#include "p2p/p2p_conn.h"
#include "p2p/yamux.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <uv.h>

typedef struct ctx {
    uv_loop_t loop;
    ap_p2p_conn_t *conn;
    bool ready, closed;
    int close_status;
    int stream_status, stream_closed;
    uint8_t buf[AP_IDENTIFY_MSG_MAX + 16];
    size_t len;
    bool fin;
} ctx_t;

static void ready(ap_p2p_conn_t *c, void *arg)
{
    ((ctx_t *)arg)->ready = true;
}
static void closed(ap_p2p_conn_t *c, void *arg, int st)
{
    ctx_t *x = arg;
    x->closed = true;
    x->close_status = st;
}
static const ap_p2p_conn_cbs_t cbs = {ready, closed};

static void s_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    ctx_t *x = ap__p2p_stream_udata(s);
    assert_true(n <= sizeof x->buf - x->len);
    memcpy(x->buf + x->len, p, n);
    x->len += n;
}
static void s_fin(ap_p2p_stream_t *s)
{
    ((ctx_t *)ap__p2p_stream_udata(s))->fin = true;
}
static void s_close(ap_p2p_stream_t *s, int st)
{
    ctx_t *x = ap__p2p_stream_udata(s);
    x->stream_closed++;
    x->stream_status = st;
}
static void ping_open(ap_p2p_stream_t *s)
{
    assert_ok(ap__p2p_stream_write(s, (const uint8_t *)"0123456789abcdef0123456789ABCDEF", 32));
}

static const ap_p2p_proto_t ping_c = {AP_PING_PROTO, ping_open, s_data, s_fin, s_close};
static const ap_p2p_proto_t id_c = {AP_IDENTIFY_PROTO, NULL, s_data, s_fin, s_close};
static const ap_p2p_proto_t nope_c = {"/nope/1.0.0", NULL, s_data, s_fin, s_close};

#define RUN_UNTIL(x, cond)                                                                         \
    do {                                                                                           \
        for (int ap__i = 0; !(cond) && ap__i < 100000; ap__i++) uv_run(&(x)->loop, UV_RUN_ONCE);   \
        assert_true(cond);                                                                         \
    } while (0)

static void ident(ap_identity_t *id, uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    assert_ok(ap_identity_from_seed(id, seed));
}

static void test_apiary_to_apiary(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t ida, idb;
    ident(&ida, 1);
    ident(&idb, 2);
    ap_p2p_host_t *a = ap__p2p_host_new(&x.loop, &ida, "apiary-test/1");
    ap_p2p_host_t *b = ap__p2p_host_new(&x.loop, &idb, "apiary-test/2");
    assert_non_null(a);
    assert_non_null(b);
    assert_ok(ap__p2p_host_serve_basics(a));
    ap_multiaddr_t ma, bound;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(a, &ma, &bound));
    assert_true(bound.port != 0);
    bound.has_peer = true;
    bound.peer = ida.id;
    assert_ok(ap__p2p_dial(b, &bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    assert_true(x.ready);
    assert_true(ap_peer_id_eq(ap__p2p_conn_peer(x.conn), &ida.id));
    bool early = false;
    assert_string_equal(ap__p2p_conn_muxer(x.conn, &early), "/yamux/1.0.0");
    assert_true(early); /* both listed yamux in the Noise handshake */

    /* ping: 32 bytes echoed */
    assert_ok(ap__p2p_stream_open(x.conn, &ping_c, &x, NULL));
    RUN_UNTIL(&x, x.len == 32);
    assert_memory_equal(x.buf, "0123456789abcdef0123456789ABCDEF", 32);

    /* identify */
    x.len = 0;
    x.fin = false;
    assert_ok(ap__p2p_stream_open(x.conn, &id_c, &x, NULL));
    RUN_UNTIL(&x, x.fin);
    size_t hl, bl;
    assert_int_equal(ap__identify_frame(x.buf, x.len, &hl, &bl), 1);
    assert_int_equal(hl + bl, x.len);
    static ap_identify_t info;
    assert_ok(ap__identify_decode(x.buf + hl, bl, &info));
    assert_string_equal(info.agent_version, "apiary-test/1");
    assert_string_equal(info.protocol_version, "ipfs/0.1.0");
    assert_true(info.has_id && ap_peer_id_eq(&info.id, &ida.id));
    assert_int_equal(info.key_type, 1);
    assert_int_equal(info.nlisten, 1);
    assert_int_equal(info.listen[0].port, bound.port);
    assert_true(info.has_observed);
    assert_memory_equal(info.observed.ip, "\x7f\x00\x00\x01", 4);
    assert_int_equal(info.nprotocols, 2);
    assert_string_equal(info.protocols[0], "/ipfs/id/1.0.0");
    assert_string_equal(info.protocols[1], "/ipfs/ping/1.0.0");

    /* an unknown protocol: na, that stream fails, the connection lives */
    int before = x.stream_closed;
    assert_ok(ap__p2p_stream_open(x.conn, &nope_c, &x, NULL));
    RUN_UNTIL(&x, x.stream_closed > before && x.stream_status == AP_ENOPROTO);
    assert_false(x.closed);
    x.len = 0;
    assert_ok(ap__p2p_stream_open(x.conn, &ping_c, &x, NULL));
    RUN_UNTIL(&x, x.len == 32);

    ap__p2p_conn_close(x.conn);
    RUN_UNTIL(&x, x.closed);
    assert_int_equal(x.close_status, 0);

    /* a wrong expected PeerID is refused */
    memset(&x.ready, 0, sizeof x - offsetof(ctx_t, ready));
    bound.peer = idb.id;
    assert_ok(ap__p2p_dial(b, &bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.closed);
    assert_false(x.ready);
    assert_int_equal(x.close_status, AP_EAUTH);

    ap__p2p_host_free(a);
    ap__p2p_host_free(b);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

/* ---- the CLI against a host served from a thread ---------------------------- */

typedef struct srv {
    uv_loop_t loop;
    uv_async_t stop;
    ap_p2p_host_t *h;
    ap_multiaddr_t bound;
    pthread_t th;
} srv_t;

static void stop_cb(uv_async_t *a)
{
    srv_t *s = a->data;
    ap__p2p_host_free(s->h);
    uv_close((uv_handle_t *)a, NULL);
}

static void *serve(void *arg)
{
    srv_t *s = arg;
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return NULL;
}

static char *run_cli(const char *args, int *status)
{
    const char *cli = getenv("APIARY_CLI");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", cli, args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    static char out[8192];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    int st = pclose(f);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return out;
}

static void test_cli(void **state)
{
    (void)state;
    if (!getenv("APIARY_CLI")) {
        print_message("skipped: APIARY_CLI is not set\n");
        return;
    }
    static srv_t s;
    uv_loop_init(&s.loop);
    ap_identity_t id, other;
    ident(&id, 7);
    ident(&other, 8);
    s.h = ap__p2p_host_new(&s.loop, &id, "apiary-test/cli");
    assert_ok(ap__p2p_host_serve_basics(s.h));
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(s.h, &ma, &s.bound));
    uv_async_init(&s.loop, &s.stop, stop_cb);
    s.stop.data = &s;
    assert_int_equal(pthread_create(&s.th, NULL, serve, &s), 0);

    char addr[AP_MA_TEXT_MAX], pid[AP_PEER_ID_STR_MAX], args[1024];
    s.bound.has_peer = true;
    s.bound.peer = id.id;
    ap_multiaddr_print(&s.bound, addr, sizeof addr);
    ap_peer_id_str(&id.id, pid);
    int st;
    snprintf(args, sizeof args, "ping %s --count 3", addr);
    char *out = run_cli(args, &st);
    if (st != 0) fail_msg("apiary ping: status %d: %s", st, out);
    int lines = 0;
    for (char *p = out; (p = strstr(p, "bytes from ")); p++) lines++;
    assert_int_equal(lines, 3);
    assert_non_null(strstr(out, pid));

    snprintf(args, sizeof args, "identify %s --json", addr);
    out = run_cli(args, &st);
    if (st != 0) fail_msg("apiary identify: status %d: %s", st, out);
    assert_non_null(strstr(out, "\"agent_version\":\"apiary-test/cli\""));
    assert_non_null(strstr(out, "\"key_type\":\"Ed25519\",\"key_matches_peer\":true"));
    assert_non_null(strstr(out, "\"protocols\":[\"/ipfs/id/1.0.0\",\"/ipfs/ping/1.0.0\"]"));
    assert_non_null(strstr(out, "\"observed_addr\":\"/ip4/127.0.0.1/tcp/"));
    assert_non_null(strstr(out, pid));

    /* the wrong PeerID: refused, exit status 1 */
    s.bound.peer = other.id;
    ap_multiaddr_print(&s.bound, addr, sizeof addr);
    snprintf(args, sizeof args, "ping %s --count 1", addr);
    out = run_cli(args, &st);
    assert_int_equal(st, 1);
    assert_null(strstr(out, "bytes from"));
    /* nobody listening */
    snprintf(args, sizeof args, "ping /ip4/127.0.0.1/tcp/1 --count 1");
    out = run_cli(args, &st);
    assert_int_equal(st, 1);
    /* usage errors */
    out = run_cli("ping /dns4/example.org", &st);
    assert_int_equal(st, 2);

    uv_async_send(&s.stop);
    pthread_join(s.th, NULL);
    assert_int_equal(uv_loop_close(&s.loop), 0);
}

static void tcp_done(void *arg)
{
    *(bool *)arg = true;
}

/* The transport's listener hands a connection starting with 0x13 to libp2p. */
static void test_tcp_port(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t ida, idb;
    ident(&ida, 3);
    ident(&idb, 4);
    ap_tcp_t *t = NULL;
    assert_ok(ap__tcp_new(&x.loop, &ida, NULL, NULL, NULL, &t));
    assert_ok(ap__tcp_listen(t, "/ip4/127.0.0.1/tcp/0"));
    ap_multiaddr_t bound;
    assert_int_equal(ap__tcp_listen_addrs(t, &bound, 1), 1);
    bound.has_peer = true;
    bound.peer = ida.id;
    ap_p2p_host_t *b = ap__p2p_host_new(&x.loop, &idb, "apiary-test/2");
    assert_non_null(b);
    assert_ok(ap__p2p_dial(b, &bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    assert_true(x.ready);
    assert_true(ap_peer_id_eq(ap__p2p_conn_peer(x.conn), &ida.id));
    assert_ok(ap__p2p_stream_open(x.conn, &ping_c, &x, NULL));
    RUN_UNTIL(&x, x.len == 32);
    assert_memory_equal(x.buf, "0123456789abcdef0123456789ABCDEF", 32);
    x.len = 0;
    x.fin = false;
    assert_ok(ap__p2p_stream_open(x.conn, &id_c, &x, NULL));
    RUN_UNTIL(&x, x.fin);
    size_t hl, bl;
    assert_int_equal(ap__identify_frame(x.buf, x.len, &hl, &bl), 1);
    static ap_identify_t info;
    assert_ok(ap__identify_decode(x.buf + hl, bl, &info));
    assert_string_equal(info.agent_version, "apiary");
    /* a bare transport announces its concrete bound address */
    assert_int_equal(info.nlisten, 1);
    assert_int_equal(info.listen[0].port, bound.port);
    assert_memory_equal(info.listen[0].ip, "\x7f\x00\x00\x01", 4);

    bool done = false;
    ap__p2p_host_free(b);
    ap__tcp_close(t, tcp_done, &done);
    RUN_UNTIL(&x, done && x.closed);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

/* identify on a node's own TCP port announces the node's addresses: the
 * announced ones when it has any, else its listen address (a wildcard one
 * replaced by interface addresses with the bound port). */
typedef struct nctx {
    ctx_t x;
    ap_host_t *host;
} nctx_t;

static bool node_cond(void *arg)
{
    ctx_t *x = arg;
    return x->ready || x->closed;
}
static bool node_fin(void *arg)
{
    return ((ctx_t *)arg)->fin;
}
static bool node_gone(void *arg)
{
    return ((ctx_t *)arg)->closed;
}

static void identify_node(const char *listen, const char *announce, ap_identify_t *info,
                          ap_multiaddr_t *bound_out)
{
    static ctx_t x;
    memset(&x, 0, sizeof x);
    ap_host_t *host = ap_host_new();
    assert_non_null(host);
    uint8_t seed[32];
    memset(seed, 9, sizeof seed);
    ap_node_opts_t o = {.ed25519_seed = seed, .listen = listen};
    const char *ann[1] = {announce};
    if (announce) {
        o.announce = ann;
        o.nannounce = 1;
    }
    ap_rt_t *rt = NULL;
    assert_ok(ap_node_new(host, &o, &rt));
    char addrs[2][AP_RT_ADDR_MAX];
    assert_true(ap_rt_listen_addrs(rt, addrs, 2, false) >= 1);
    /* dial the bound port on loopback, whatever the node advertises */
    ap_tcp_t *t = ap__tcpc_transport((ap_node_t *)rt);
    assert_non_null(t);
    ap_multiaddr_t bound;
    assert_int_equal(ap__tcp_listen_addrs(t, &bound, 1), 1);
    *bound_out = bound;
    ap_multiaddr_t dial;
    assert_ok(ap_multiaddr_parse(&dial, "/ip4/127.0.0.1/tcp/1"));
    dial.port = bound.port;
    dial.has_peer = true;
    dial.peer = *ap_rt_self(rt);
    ap_identity_t idb;
    ident(&idb, 5);
    ap_p2p_host_t *b = ap__p2p_host_new(&((ap_host_t *)host)->loop, &idb, "apiary-test/3");
    assert_non_null(b);
    assert_ok(ap__p2p_dial(b, &dial, &cbs, &x, &x.conn));
    assert_true(ap_host_run_until(host, node_cond, &x, 30000000));
    assert_true(x.ready);
    assert_ok(ap__p2p_stream_open(x.conn, &id_c, &x, NULL));
    assert_true(ap_host_run_until(host, node_fin, &x, 30000000));
    size_t hl, bl;
    assert_int_equal(ap__identify_frame(x.buf, x.len, &hl, &bl), 1);
    assert_ok(ap__identify_decode(x.buf + hl, bl, info));
    ap__p2p_host_free(b);
    assert_true(ap_host_run_until(host, node_gone, &x, 30000000));
    ap_node_free(rt);
    assert_int_equal(ap_host_free(host), 0);
}

static void test_node_port(void **state)
{
    (void)state;
    static ap_identify_t info;
    ap_multiaddr_t bound, want;
    identify_node("/ip4/127.0.0.1/tcp/0", "/ip4/192.0.2.7/tcp/4242", &info, &bound);
    assert_int_equal(info.nlisten, 1);
    assert_ok(ap_multiaddr_parse(&want, "/ip4/192.0.2.7/tcp/4242"));
    assert_memory_equal(info.listen[0].ip, want.ip, 4);
    assert_int_equal(info.listen[0].port, 4242);

    identify_node("/ip4/127.0.0.1/tcp/0", NULL, &info, &bound);
    assert_int_equal(info.nlisten, 1);
    assert_memory_equal(info.listen[0].ip, "\x7f\x00\x00\x01", 4);
    assert_int_equal(info.listen[0].port, bound.port);

    /* a wildcard: interface addresses (loopback only if there is no other)
     * with the bound port, never 0.0.0.0 */
    identify_node("/ip4/0.0.0.0/tcp/0", NULL, &info, &bound);
    assert_true(info.nlisten >= 1);
    for (size_t i = 0; i < info.nlisten; i++) {
        assert_int_equal(info.listen[i].port, bound.port);
        assert_memory_not_equal(info.listen[i].ip, "\0\0\0\0", 4);
    }
}

/* Back-pressure: a reader that stops consuming its echo stops the writer. The
 * client writes 8 MiB into an echo stream but does not consume what comes
 * back: the echo server's window to it fills, so the server stops echoing,
 * so it stops consuming, so the client's window fills and its queue stays
 * full. Then the client consumes again and every byte comes back. */
#define BP_TOTAL (8u << 20)
typedef struct bp {
    uint64_t sent, back, consumed;
    bool eagain, consuming, closed;
    int status;
    ap_p2p_stream_t *s;
    uint8_t chunk[65536];
} bp_t;
static bp_t bp;

static void bp_pump(ap_p2p_stream_t *s)
{
    while (bp.sent < BP_TOTAL) {
        int rc = ap__p2p_stream_write(s, bp.chunk, sizeof bp.chunk);
        if (rc == AP_EAGAIN) {
            bp.eagain = true;
            return;
        }
        assert_ok(rc);
        bp.sent += sizeof bp.chunk;
    }
    ap__p2p_stream_close(s);
}
static void bp_open(ap_p2p_stream_t *s)
{
    ap__p2p_stream_set_flow(s, bp_pump, true);
    bp_pump(s);
}
static void bp_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    (void)p;
    bp.back += n;
    if (bp.consuming) {
        ap__p2p_stream_consume(s, bp.back - bp.consumed);
        bp.consumed = bp.back;
    }
}
static void bp_close(ap_p2p_stream_t *s, int st)
{
    (void)s;
    bp.closed = true;
    bp.status = st;
}
static const ap_p2p_proto_t bp_c = {AP_P2P_ECHO_PROTO, bp_open, bp_data, NULL, bp_close};

static void tick(uv_timer_t *t)
{
    (*(int *)t->data)++;
}

/* Runs the loop until the client's progress stops for several 50 ms ticks. */
static uint64_t settle(ctx_t *x)
{
    uv_timer_t t;
    int ticks = 0, still = 0;
    uint64_t last = UINT64_MAX;
    uv_timer_init(&x->loop, &t);
    t.data = &ticks;
    uv_timer_start(&t, tick, 50, 50);
    while (still < 6) {
        int before = ticks;
        uv_run(&x->loop, UV_RUN_ONCE);
        if (ticks == before) continue;
        uint64_t now = bp.sent - ap__p2p_stream_queued(bp.s) + bp.back;
        still = now == last ? still + 1 : 0;
        last = now;
    }
    uv_close((uv_handle_t *)&t, NULL);
    uv_run(&x->loop, UV_RUN_NOWAIT);
    return last;
}

static void test_backpressure(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    memset(&bp, 0, sizeof bp);
    uv_loop_init(&x.loop);
    ap_identity_t ida, idb;
    ident(&ida, 6);
    ident(&idb, 7);
    ap_p2p_host_t *a = ap__p2p_host_new(&x.loop, &ida, "apiary-test/1");
    ap_p2p_host_t *b = ap__p2p_host_new(&x.loop, &idb, "apiary-test/2");
    assert_ok(ap__p2p_host_serve_echo(a));
    ap_multiaddr_t ma, bound;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(a, &ma, &bound));
    bound.has_peer = true;
    bound.peer = ida.id;
    assert_ok(ap__p2p_dial(b, &bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    assert_true(x.ready);
    assert_ok(ap__p2p_stream_open(x.conn, &bp_c, NULL, &bp.s));
    settle(&x);
    /* stuck: the writer was refused, and what left it is bounded by the two
     * 256 KiB windows (plus one window growth), far below what it wanted */
    assert_true(bp.eagain);
    assert_false(bp.closed);
    uint64_t left = bp.sent - ap__p2p_stream_queued(bp.s);
    print_message("not reading: %llu bytes left the writer, %llu came back, %zu queued\n",
                  (unsigned long long)left, (unsigned long long)bp.back,
                  ap__p2p_stream_queued(bp.s));
    assert_true(left <= (2u << 20));
    assert_true(bp.back <= AP_YAMUX_WINDOW_INIT * 2);
    assert_true(bp.sent < BP_TOTAL);
    /* reading again: everything flows */
    bp.consuming = true;
    ap__p2p_stream_consume(bp.s, bp.back - bp.consumed);
    bp.consumed = bp.back;
    RUN_UNTIL(&x, bp.closed);
    assert_int_equal(bp.status, 0);
    assert_int_equal(bp.back, BP_TOTAL);

    ap__p2p_host_free(b);
    ap__p2p_host_free(a);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_apiary_to_apiary), cmocka_unit_test(test_cli),
        cmocka_unit_test(test_tcp_port),         cmocka_unit_test(test_node_port),
        cmocka_unit_test(test_backpressure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
