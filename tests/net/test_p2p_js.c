/* Interoperability with js-libp2p (an independent implementation from the
 * npm registry, pinned by tests/interop/js/package-lock.json), both ways:
 * Apiary dials js (handshake, yamux, ping, identify with every field
 * checked, a wrong expected PeerID refused, the peer killed mid-stream) and
 * js dials Apiary (ping and identify from js's side, also on a node's own
 * TCP port, where identify announces the node's addresses); and echo both
 * ways: 64 MiB through one stream, 256 concurrent streams, a stream reset.
 * Skipped, with the reason printed, when node or npm is missing or the
 * packages cannot be installed. */
#include "aptest.h"

#include "apiary/identity.h"
#include "apiary/node.h"
#include "runtime/uv/uv_impl.h"
#include "p2p/identify.h"
#include "net/tcp.h"
#include "p2p/p2p_conn.h"
#include "p2p_echo.h"
#include "runtime/uv/p2p_bridge.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

static char dir[1024]; /* the install directory, in the build tree */
static const char *skip_reason;

static int sh(const char *cmd)
{
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int setup(void **state)
{
    (void)state;
    const char *src = getenv("APIARY_SRC");
    if (!src) {
        skip_reason = "APIARY_SRC is not set";
        return 0;
    }
    if (sh("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1") != 0) {
        skip_reason = "node or npm is not installed (scripts/deps.sh installs nodejs)";
        return 0;
    }
    char cwd[512];
    if (!getcwd(cwd, sizeof cwd)) return -1;
    snprintf(dir, sizeof dir, "%s/interop-js", cwd);
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "mkdir -p '%s' && cp '%s/tests/interop/js/package.json' "
             "'%s/tests/interop/js/package-lock.json' '%s/tests/interop/js/peer.mjs' '%s'/",
             dir, src, src, src, dir);
    if (sh(cmd) != 0) return -1;
    /* install once per build tree, again when the lock file changed */
    snprintf(cmd, sizeof cmd,
             "cd '%s' && (cmp -s package-lock.json node_modules/.apiary-lock 2>/dev/null || "
             "(npm ci --no-audit --no-fund --loglevel=error >npm.log 2>&1 && "
             "cp package-lock.json node_modules/.apiary-lock))",
             dir);
    if (sh(cmd) != 0) {
        skip_reason = "npm ci failed (no registry?); see build/interop-js/npm.log";
        return 0;
    }
    return 0;
}

#define SKIP_IF_NEEDED()                                                                           \
    do {                                                                                           \
        if (skip_reason) {                                                                         \
            print_message("skipped: %s\n", skip_reason);                                           \
            return;                                                                                \
        }                                                                                          \
    } while (0)

/* ---- a js peer in listen mode ------------------------------------------------ */

typedef struct js {
    pid_t pid;
    int in; /* its stdin: closing it stops the peer */
    char log[1100];
    char addr[AP_MA_TEXT_MAX], peer[AP_PEER_ID_STR_MAX];
} js_t;

static void js_listen(js_t *j)
{
    static int runs; /* a fresh file each time: never read an earlier peer's address */
    snprintf(j->log, sizeof j->log, "%s/listen-%d-%d.log", dir, (int)getpid(), runs++);
    unlink(j->log);
    int p[2];
    assert_int_equal(pipe(p), 0);
    j->pid = fork();
    assert_true(j->pid >= 0);
    if (j->pid == 0) {
        dup2(p[0], 0);
        close(p[1]);
        int fd = open(j->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 1);
        dup2(fd, 2);
        if (chdir(dir) != 0) _exit(127);
        execlp("node", "node", "peer.mjs", "listen", (char *)NULL);
        _exit(127);
    }
    close(p[0]);
    j->in = p[1];
    for (int i = 0; i < 600; i++) { /* up to 60 s on a busy machine */
        FILE *f = fopen(j->log, "r");
        char line[2048] = "";
        if (f) {
            if (!fgets(line, sizeof line, f)) line[0] = 0;
            fclose(f);
        }
        char *a = strstr(line, "\"addr\":\""), *pe = strstr(line, "\"peer\":\"");
        if (a && pe) {
            sscanf(a + 8, "%383[^\"]", j->addr);
            sscanf(pe + 8, "%63[^\"]", j->peer);
            return;
        }
        usleep(100000);
    }
    fail_msg("the js peer did not start; see %s", j->log);
}

static void js_stop(js_t *j, bool kill9)
{
    if (kill9) kill(j->pid, SIGKILL);
    close(j->in);
    int st;
    for (int i = 0; i < 100 && waitpid(j->pid, &st, WNOHANG) == 0; i++) usleep(100000);
    kill(j->pid, SIGKILL);
    waitpid(j->pid, &st, 0);
}

/* ---- Apiary dials js ---------------------------------------------------------- */

typedef struct ctx {
    uv_loop_t loop;
    ap_p2p_conn_t *conn;
    bool ready, closed, fin;
    int close_status, stream_closed, stream_status;
    uint8_t buf[AP_IDENTIFY_MSG_MAX + 16];
    size_t len;
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
static uint8_t ping_bytes[32];
static void ping_open(ap_p2p_stream_t *s)
{
    for (int i = 0; i < 32; i++) ping_bytes[i] = (uint8_t)(rand() & 0xff);
    assert_ok(ap__p2p_stream_write(s, ping_bytes, 32));
}
static const ap_p2p_proto_t ping_c = {AP_PING_PROTO, ping_open, s_data, s_fin, s_close};
static const ap_p2p_proto_t id_c = {AP_IDENTIFY_PROTO, NULL, s_data, s_fin, s_close};

#define RUN_UNTIL(x, cond)                                                                         \
    do {                                                                                           \
        for (int ap__i = 0; !(cond) && ap__i < 1000000; ap__i++) uv_run(&(x)->loop, UV_RUN_ONCE);  \
        assert_true(cond);                                                                         \
    } while (0)

static void test_apiary_dials_js(void **state)
{
    (void)state;
    SKIP_IF_NEEDED();
    js_t j;
    js_listen(&j);
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t me, other;
    assert_ok(ap_identity_generate(&me));
    assert_ok(ap_identity_generate(&other));
    ap_p2p_host_t *h = ap__p2p_host_new(&x.loop, &me, "apiary-test/js");
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, j.addr) != 0) fail_msg("js printed %s", j.addr);
    ap_peer_id_t jsid;
    assert_ok(ap_peer_id_parse(&jsid, j.peer));
    assert_true(ma.has_peer && ap_peer_id_eq(&ma.peer, &jsid));

    /* handshake and yamux */
    assert_ok(ap__p2p_dial(h, &ma, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    if (!x.ready) fail_msg("dial failed: %s", ap_err_name(x.close_status));
    assert_true(ap_peer_id_eq(ap__p2p_conn_peer(x.conn), &jsid));
    bool early;
    assert_string_equal(ap__p2p_conn_muxer(x.conn, &early), "/yamux/1.0.0");
    print_message("js-libp2p muxer: yamux (%s)\n",
                  early ? "agreed in the Noise handshake" : "multistream-select");

    /* ping, three rounds on one stream */
    ap_p2p_stream_t *ps;
    assert_ok(ap__p2p_stream_open(x.conn, &ping_c, &x, &ps));
    for (int r = 0; r < 3; r++) {
        RUN_UNTIL(&x, x.len == 32);
        assert_memory_equal(x.buf, ping_bytes, 32);
        x.len = 0;
        if (r < 2) {
            for (int i = 0; i < 32; i++) ping_bytes[i] = (uint8_t)(rand() & 0xff);
            assert_ok(ap__p2p_stream_write(ps, ping_bytes, 32));
        }
    }

    /* identify: every field */
    x.fin = false;
    assert_ok(ap__p2p_stream_open(x.conn, &id_c, &x, NULL));
    RUN_UNTIL(&x, x.fin);
    size_t hl, bl;
    assert_int_equal(ap__identify_frame(x.buf, x.len, &hl, &bl), 1);
    static ap_identify_t info;
    assert_ok(ap__identify_decode(x.buf + hl, bl, &info));
    assert_string_equal(info.protocol_version, "ipfs/0.1.0");
    assert_non_null(strstr(info.agent_version, "js-libp2p/"));
    assert_true(info.has_key && info.has_id && info.key_type == 1);
    assert_true(ap_peer_id_eq(&info.id, &jsid));
    assert_true(info.nlisten >= 1);
    bool found = false;
    for (size_t i = 0; i < info.nlisten; i++) found = found || info.listen[i].port == ma.port;
    assert_true(found);
    assert_true(info.has_observed);
    assert_memory_equal(info.observed.ip, "\x7f\x00\x00\x01", 4);
    bool has_ping = false, has_id = false;
    for (size_t i = 0; i < info.nprotocols; i++) {
        has_ping = has_ping || strcmp(info.protocols[i], "/ipfs/ping/1.0.0") == 0;
        has_id = has_id || strcmp(info.protocols[i], "/ipfs/id/1.0.0") == 0;
    }
    assert_true(has_ping && has_id);
    ap__p2p_conn_close(x.conn);
    RUN_UNTIL(&x, x.closed);

    /* a wrong expected PeerID */
    memset(&x.ready, 0, sizeof x - offsetof(ctx_t, ready));
    ma.peer = other.id;
    assert_ok(ap__p2p_dial(h, &ma, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.closed);
    assert_false(x.ready);
    assert_int_equal(x.close_status, AP_EAUTH);

    /* the peer killed mid-stream: the stream and connection end, with an error */
    memset(&x.ready, 0, sizeof x - offsetof(ctx_t, ready));
    ma.peer = jsid;
    assert_ok(ap__p2p_dial(h, &ma, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    assert_true(x.ready);
    assert_ok(ap__p2p_stream_open(x.conn, &ping_c, &x, NULL));
    RUN_UNTIL(&x, x.len == 32);
    js_stop(&j, true);
    RUN_UNTIL(&x, x.closed);
    assert_int_not_equal(x.close_status, 0);
    assert_int_equal(x.stream_closed, 1);

    ap__p2p_host_free(h);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

/* ---- js dials Apiary ------------------------------------------------------------ */

typedef struct srv {
    uv_loop_t loop;
    uv_async_t stop;
    ap_p2p_host_t *h;
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
    uv_run(&((srv_t *)arg)->loop, UV_RUN_DEFAULT);
    return NULL;
}

static char *js_dial(const char *addr, int *status)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd '%s' && node peer.mjs dial '%s' 2>&1", dir, addr);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    static char out[16384];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    int st = pclose(f);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return out;
}

static void test_js_dials_apiary(void **state)
{
    (void)state;
    SKIP_IF_NEEDED();
    static srv_t s;
    uv_loop_init(&s.loop);
    ap_identity_t me, other;
    assert_ok(ap_identity_generate(&me));
    assert_ok(ap_identity_generate(&other));
    s.h = ap__p2p_host_new(&s.loop, &me, "apiary-test/js");
    assert_ok(ap__p2p_host_serve_basics(s.h));
    ap_multiaddr_t ma, bound;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(s.h, &ma, &bound));
    uv_async_init(&s.loop, &s.stop, stop_cb);
    s.stop.data = &s;
    assert_int_equal(pthread_create(&s.th, NULL, serve, &s), 0);

    char addr[AP_MA_TEXT_MAX], pid[AP_PEER_ID_STR_MAX], want[600];
    bound.has_peer = true;
    bound.peer = me.id;
    ap_multiaddr_print(&bound, addr, sizeof addr);
    ap_peer_id_str(&me.id, pid);
    int st;
    char *out = js_dial(addr, &st);
    if (st != 0 || !strstr(out, "\"ok\":true")) fail_msg("js dial: status %d: %s", st, out);
    snprintf(want, sizeof want, "\"peer\":\"%s\"", pid);
    assert_non_null(strstr(out, want));
    assert_non_null(strstr(out, "\"muxer\":\"/yamux/1.0.0\""));
    assert_non_null(strstr(out, "\"encryption\":\"/noise\""));
    assert_non_null(strstr(out, "\"agent\":\"apiary-test/js\""));
    assert_non_null(strstr(out, "\"protocol_version\":\"ipfs/0.1.0\""));
    assert_non_null(strstr(out, "\"/ipfs/id/1.0.0\""));
    assert_non_null(strstr(out, "\"/ipfs/ping/1.0.0\""));
    assert_non_null(strstr(out, "\"key_matches\":true"));
    snprintf(want, sizeof want, "\"/ip4/127.0.0.1/tcp/%u", (unsigned)bound.port);
    assert_non_null(strstr(out, want));
    assert_non_null(strstr(out, "\"observed_addr\":\"/ip4/127.0.0.1/tcp/"));
    print_message("js -> apiary: %s", out);

    /* js expecting another PeerID: js-libp2p 2.9.0 does not refuse (it does
     * not between two js peers either), but it learns who we really are */
    bound.peer = other.id;
    ap_multiaddr_print(&bound, addr, sizeof addr);
    out = js_dial(addr, &st);
    snprintf(want, sizeof want, "\"peer\":\"%s\"", pid);
    if (st == 0) assert_non_null(strstr(out, want));
    print_message("js dialling a wrong PeerID: %s", st == 0 ? "connected to the real one\n" : out);

    uv_async_send(&s.stop);
    pthread_join(s.th, NULL);
    assert_int_equal(uv_loop_close(&s.loop), 0);
}

/* ---- js dials an Apiary transport's own TCP port ---------------------------- */

typedef struct tsrv {
    uv_loop_t loop;
    uv_async_t stop;
    ap_tcp_t *t;
} tsrv_t;

static void tstop_cb(uv_async_t *a)
{
    tsrv_t *s = a->data;
    ap__tcp_close(s->t, NULL, NULL);
    uv_close((uv_handle_t *)a, NULL);
}

static void *tserve(void *arg)
{
    uv_run(&((tsrv_t *)arg)->loop, UV_RUN_DEFAULT);
    return NULL;
}

static void test_js_dials_tcp_port(void **state)
{
    (void)state;
    SKIP_IF_NEEDED();
    static tsrv_t s;
    uv_loop_init(&s.loop);
    ap_identity_t me;
    assert_ok(ap_identity_generate(&me));
    assert_ok(ap__tcp_new(&s.loop, &me, NULL, NULL, NULL, &s.t));
    assert_ok(ap__tcp_listen(s.t, "/ip4/127.0.0.1/tcp/0"));
    ap_multiaddr_t bound;
    assert_int_equal(ap__tcp_listen_addrs(s.t, &bound, 1), 1);
    uv_async_init(&s.loop, &s.stop, tstop_cb);
    s.stop.data = &s;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, tserve, &s), 0);

    char addr[AP_MA_TEXT_MAX], pid[AP_PEER_ID_STR_MAX], want[600];
    bound.has_peer = true;
    bound.peer = me.id;
    ap_multiaddr_print(&bound, addr, sizeof addr);
    ap_peer_id_str(&me.id, pid);
    int st;
    char *out = js_dial(addr, &st);
    if (st != 0 || !strstr(out, "\"ok\":true")) fail_msg("js dial: status %d: %s", st, out);
    snprintf(want, sizeof want, "\"peer\":\"%s\"", pid);
    assert_non_null(strstr(out, want));
    assert_non_null(strstr(out, "\"muxer\":\"/yamux/1.0.0\""));
    assert_non_null(strstr(out, "\"/ipfs/ping/1.0.0\""));
    assert_non_null(strstr(out, "\"key_matches\":true"));
    /* identify's listen addresses: the bound one (a bare transport) */
    snprintf(want, sizeof want, "\"listen_addrs\":[\"/ip4/127.0.0.1/tcp/%u", (unsigned)bound.port);
    assert_non_null(strstr(out, want));
    print_message("js -> apiary transport port: %s", out);

    uv_async_send(&s.stop);
    pthread_join(th, NULL);
    assert_int_equal(uv_loop_close(&s.loop), 0);
}

/* ---- js dials a node's port: identify announces the node's addresses ------- */

static void test_js_dials_node(void **state)
{
    (void)state;
    SKIP_IF_NEEDED();
    ap_host_t *host = ap_host_new();
    assert_non_null(host);
    assert_ok(ap_host_start(host));
    const char *ann[1] = {"/ip4/192.0.2.7/tcp/4242"};
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0", .announce = ann, .nannounce = 1};
    ap_rt_t *rt = NULL;
    assert_ok(ap_node_new(host, &o, &rt));
    /* the bound address (it advertises the announced one); set by ap_node_new */
    const char *bound = ((ap_node_t *)rt)->addr;
    assert_true(bound[0] != 0);
    char addr[AP_RT_ADDR_MAX + AP_PEER_ID_STR_MAX + 8], pid[AP_PEER_ID_STR_MAX], want[600];
    ap_peer_id_str(ap_rt_self(rt), pid);
    snprintf(addr, sizeof addr, "%s/p2p/%s", bound, pid);
    int st;
    char *out = js_dial(addr, &st);
    if (st != 0 || !strstr(out, "\"ok\":true")) fail_msg("js dial: status %d: %s", st, out);
    snprintf(want, sizeof want, "\"peer\":\"%s\"", pid);
    assert_non_null(strstr(out, want));
    assert_non_null(strstr(out, "\"listen_addrs\":[\"/ip4/192.0.2.7/tcp/4242\"]"));
    assert_non_null(strstr(out, "\"observed_addr\":\"/ip4/127.0.0.1/tcp/"));
    print_message("js -> apiary node port: %s", out);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(host), 0);
}

/* ---- a node forced to yamux dials js: Apiary protocols by name ------------------ */

typedef struct nd {
    bool dialed, called;
    int dial_st, call_st;
} nd_t;

static void nd_dialed(ap_rt_t *rt, void *arg, int st, const ap_peer_id_t *peer)
{
    (void)rt;
    (void)peer;
    nd_t *x = arg;
    x->dialed = true;
    x->dial_st = st;
}

static void nd_done(ap_rt_t *rt, void *arg, int st, const uint8_t *d, size_t n, const char *msg)
{
    (void)rt;
    (void)msg;
    (void)d;
    (void)n;
    nd_t *x = arg;
    x->called = true;
    x->call_st = st;
}

static bool nd_is_dialed(void *arg)
{
    return ((nd_t *)arg)->dialed;
}

static bool nd_is_called(void *arg)
{
    return ((nd_t *)arg)->called;
}

/* The node's runtime.h calls reach js-libp2p as yamux streams negotiated by
 * protocol name: js answers "na" to an Apiary protocol, the call fails with
 * AP_ENOPROTO, and the connection (on which js runs its own identify and
 * ping) carries the next call. */
static void test_node_yamux_dials_js(void **state)
{
    (void)state;
    SKIP_IF_NEEDED();
    js_t j;
    js_listen(&j);
    ap_host_t *host = ap_host_new();
    assert_non_null(host);
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
    ap_rt_t *rt = NULL;
    assert_ok(ap_node_new(host, &o, &rt));
    assert_ok(ap_node_set_wire(rt, AP_NODE_WIRE_YAMUX));
    char addr[AP_MA_TEXT_MAX + AP_PEER_ID_STR_MAX + 8];
    if (strstr(j.addr, "/p2p/"))
        snprintf(addr, sizeof addr, "%s", j.addr);
    else
        snprintf(addr, sizeof addr, "%s/p2p/%s", j.addr, j.peer);
    ap_peer_id_t jsid;
    assert_ok(ap_peer_id_parse(&jsid, j.peer));
    nd_t x = {0};
    assert_ok(ap_rt_dial(rt, addr, 30000000, nd_dialed, &x));
    assert_true(ap_host_run_until(host, nd_is_dialed, &x, 60000000));
    assert_int_equal(x.dial_st, 0);
    for (int k = 0; k < 2; k++) {
        x.called = false;
        ap_rpc_opts_t ro = {.timeout_us = 30000000};
        assert_true(ap_rt_rpc_call(rt, &jsid, "/apiary/dht/1", (const uint8_t *)"q", 1, &ro,
                                   nd_done, &x) != 0);
        assert_true(ap_host_run_until(host, nd_is_called, &x, 60000000));
        assert_int_equal(x.call_st, AP_ENOPROTO);
        assert_true(ap_rt_is_connected(rt, &jsid));
    }
    const ap_p2pb_t *b = ap__tcpc_bridge((ap_node_t *)rt);
    assert_int_equal(b->stats.conns_yamux, 1); /* both calls on one connection */
    assert_int_equal(b->stats.conns_native, 0);
    assert_int_equal(b->stats.streams_out, 2);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(host), 0);
    js_stop(&j, false);
}

/* ---- echo: 64 MiB through one stream, 256 concurrent streams ---------------- */

#define BIG   (64u << 20)
#define SMALL (64u << 10)
#define MANY  256

static void echo_run(ctx_t *x, int n, size_t size)
{
    static ap_echo_run_t r;
    assert_ok(ap_echo_start(x->conn, &r, n, size));
    RUN_UNTIL(x, ap_echo_done(&r) || x->closed);
    if (r.ok != n)
        fail_msg("echo %d x %zu: %d ok of %d closed, first error %s", n, size, r.ok, r.closed,
                 ap_err_name(r.first_error));
    /* flow control: the writer never queued past the stream's cap */
    assert_true(r.max_queued <= AP_P2P_STREAM_QUEUE_MAX);
    assert_int_equal(r.bytes_back, (uint64_t)n * size);
    print_message("echo %d x %zu bytes: ok (largest send queue %zu bytes)\n", n, size,
                  r.max_queued);
    ap_echo_free(&r);
}

static void r_close(ap_p2p_stream_t *s, int st)
{
    s_close(s, st);
}
static const ap_p2p_proto_t echo_reset_c = {AP_P2P_ECHO_PROTO, NULL, NULL, NULL, r_close};

static void test_echo_apiary_dials_js(void **state)
{
    (void)state;
    SKIP_IF_NEEDED();
    js_t j;
    js_listen(&j);
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t me;
    assert_ok(ap_identity_generate(&me));
    ap_p2p_host_t *h = ap__p2p_host_new(&x.loop, &me, "apiary-test/js");
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, j.addr) != 0) fail_msg("js printed %s", j.addr);
    assert_ok(ap__p2p_dial(h, &ma, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    if (!x.ready) fail_msg("dial failed: %s", ap_err_name(x.close_status));

    echo_run(&x, 1, BIG);
    echo_run(&x, MANY, SMALL);

    /* a stream reset mid-transfer: that stream ends, the connection lives */
    ap_p2p_stream_t *rs = NULL;
    assert_ok(ap__p2p_stream_open(x.conn, &echo_reset_c, &x, &rs));
    RUN_UNTIL(&x, ap__p2p_stream_queued(rs) == 0); /* negotiated request sent */
    int before = x.stream_closed;
    ap__p2p_stream_reset(rs);
    assert_int_equal(x.stream_closed, before + 1);
    assert_int_equal(x.stream_status, AP_ECANCELED);
    echo_run(&x, 4, SMALL);
    assert_false(x.closed);

    ap__p2p_conn_close(x.conn);
    RUN_UNTIL(&x, x.closed);
    js_stop(&j, false);
    ap__p2p_host_free(h);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

static char *js_echo(const char *addr, size_t size, int n, int *status)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd '%s' && node peer.mjs echo '%s' %zu %d 2>&1", dir, addr, size, n);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    static char out[16384];
    size_t k = fread(out, 1, sizeof out - 1, f);
    out[k] = 0;
    int st = pclose(f);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return out;
}

static void test_echo_js_dials_apiary(void **state)
{
    (void)state;
    SKIP_IF_NEEDED();
    static srv_t s;
    uv_loop_init(&s.loop);
    ap_identity_t me;
    assert_ok(ap_identity_generate(&me));
    s.h = ap__p2p_host_new(&s.loop, &me, "apiary-test/js");
    assert_ok(ap__p2p_host_serve_basics(s.h));
    assert_ok(ap__p2p_host_serve_echo(s.h));
    ap_multiaddr_t ma, bound;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(s.h, &ma, &bound));
    uv_async_init(&s.loop, &s.stop, stop_cb);
    s.stop.data = &s;
    assert_int_equal(pthread_create(&s.th, NULL, serve, &s), 0);
    char addr[AP_MA_TEXT_MAX], want[64];
    bound.has_peer = true;
    bound.peer = me.id;
    ap_multiaddr_print(&bound, addr, sizeof addr);
    int st;
    char *out = js_echo(addr, BIG, 1, &st);
    if (st != 0 || !strstr(out, "\"ok\":true")) fail_msg("js echo 1 x 64 MiB: %d: %s", st, out);
    print_message("js -> apiary echo 1 x 64 MiB: %s", out);
    out = js_echo(addr, SMALL, MANY, &st);
    snprintf(want, sizeof want, "\"streams_ok\":%d", MANY);
    if (st != 0 || !strstr(out, want)) fail_msg("js echo 256 x 64 KiB: %d: %s", st, out);
    print_message("js -> apiary echo 256 x 64 KiB: %s", out);
    uv_async_send(&s.stop);
    pthread_join(s.th, NULL);
    assert_int_equal(uv_loop_close(&s.loop), 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_apiary_dials_js),      cmocka_unit_test(test_js_dials_apiary),
        cmocka_unit_test(test_js_dials_tcp_port),    cmocka_unit_test(test_js_dials_node),
        cmocka_unit_test(test_node_yamux_dials_js),  cmocka_unit_test(test_echo_apiary_dials_js),
        cmocka_unit_test(test_echo_js_dials_apiary),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
