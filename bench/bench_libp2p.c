/* `apiary bench libp2p`: one-stream throughput and connection set-up time
 * over loopback, for
 *   apiary-apiary / yamux   libp2p connections (src/p2p/p2p_conn.c): TCP,
 *                           multistream-select, libp2p Noise, yamux
 *   apiary-apiary / native  the node's own transport: TCP, Noise, the native
 *                           mux under runtime.h's streams (the baseline of
 *                           the yamux pair)
 *   ... / native, via libp2p   the same runtime.h stream over a libp2p
 *                           connection with the native mux agreed as
 *                           /apiary/mux/2 (runtime/uv/p2p_bridge.c)
 *   ... / yamux, via runtime   the same runtime.h stream over a libp2p
 *                           connection with yamux forced: a yamux stream
 *                           carrying the mux's frames
 *   apiary-js / yamux       Apiary dialling js-libp2p
 *   js-js / yamux           js-libp2p dialling js-libp2p (the baseline of the
 *                           apiary-js pair)
 * Throughput: SIZE bytes (64 MiB; 8 MiB for the js pairs, since js-libp2p
 * fails a 64 MiB echo between two js peers) sent through one stream and
 * echoed back by the other side (each byte crosses twice), MB/s = SIZE /
 * elapsed; the server
 * runs on its own thread (js: its own process). Set-up: the median of
 * DIALS dials, from the dial call to a usable connection (TCP + negotiation
 * + Noise + muxer), a fresh connection each time.
 * The js pairs need node and the packages tests/net/test_p2p_js.c installs
 * (build/interop-js, or $APIARY_JS_DIR); without them they are skipped with
 * the reason printed. */
#include "bench.h"

#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/node.h"
#include "apiary/sync.h"
#include "p2p/p2p_conn.h"
#include "p2p_echo.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

#define ECHO_PROTO "/apiary/bench-echo/1"
#define MSG        (64u << 10)

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- libp2p (yamux): an echo server on its own thread ------------------------- */

typedef struct srv {
    uv_loop_t loop;
    uv_async_t stop;
    ap_p2p_host_t *h;
    pthread_t th;
    ap_multiaddr_t addr;
} srv_t;

static void srv_stop_cb(uv_async_t *a)
{
    srv_t *s = a->data;
    ap__p2p_host_free(s->h);
    uv_close((uv_handle_t *)a, NULL);
}

static void *srv_main(void *arg)
{
    uv_run(&((srv_t *)arg)->loop, UV_RUN_DEFAULT);
    return NULL;
}

static int srv_start(srv_t *s)
{
    ap_identity_t id;
    ap_multiaddr_t ma;
    if (ap_identity_generate(&id) != 0 || uv_loop_init(&s->loop) != 0) return -1;
    s->h = ap__p2p_host_new(&s->loop, &id, "apiary-bench");
    if (!s->h || ap__p2p_host_serve_basics(s->h) != 0 || ap__p2p_host_serve_echo(s->h) != 0 ||
        ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0") != 0 ||
        ap__p2p_host_listen(s->h, &ma, &s->addr) != 0)
        return -1;
    s->addr.has_peer = true;
    s->addr.peer = id.id;
    uv_async_init(&s->loop, &s->stop, srv_stop_cb);
    s->stop.data = s;
    return pthread_create(&s->th, NULL, srv_main, s) == 0 ? 0 : -1;
}

static void srv_stop(srv_t *s)
{
    uv_async_send(&s->stop);
    pthread_join(s->th, NULL);
    uv_loop_close(&s->loop);
}

/* ---- libp2p dialer on this thread ----------------------------------------------- */

typedef struct cl {
    uv_loop_t loop;
    ap_p2p_host_t *h;
    ap_p2p_conn_t *conn;
    bool ready, closed;
    int status;
} cl_t;

static void cl_ready(ap_p2p_conn_t *c, void *arg)
{
    (void)c;
    ((cl_t *)arg)->ready = true;
}
static void cl_closed(ap_p2p_conn_t *c, void *arg, int st)
{
    (void)c;
    cl_t *x = arg;
    x->closed = true;
    x->status = st;
}
static const ap_p2p_conn_cbs_t cl_cbs = {cl_ready, cl_closed};

static int cl_dial(cl_t *c, const ap_multiaddr_t *ma, double *ms)
{
    c->ready = c->closed = false;
    double t0 = ap_bench_now();
    if (ap__p2p_dial(c->h, ma, &cl_cbs, c, &c->conn) != 0) return -1;
    while (!c->ready && !c->closed) uv_run(&c->loop, UV_RUN_ONCE);
    if (ms) *ms = (ap_bench_now() - t0) * 1e3;
    return c->ready ? 0 : -1;
}

static void cl_hangup(cl_t *c)
{
    ap__p2p_conn_close(c->conn);
    while (!c->closed) uv_run(&c->loop, UV_RUN_ONCE);
}

/* Connect p50 (ms) and echo MB/s against a libp2p listener at ma. */
static int p2p_pair(const ap_multiaddr_t *ma, int dials, size_t size, double *conn_ms, double *mbps)
{
    static cl_t c;
    memset(&c, 0, sizeof c);
    ap_identity_t id;
    if (ap_identity_generate(&id) != 0 || uv_loop_init(&c.loop) != 0) return -1;
    c.h = ap__p2p_host_new(&c.loop, &id, "apiary-bench");
    int rc = c.h ? 0 : -1;
    double *v = calloc((size_t)dials, sizeof *v);
    for (int i = 0; i < dials && rc == 0 && v; i++) {
        rc = cl_dial(&c, ma, &v[i]);
        if (rc == 0) cl_hangup(&c);
    }
    if (rc == 0 && v) *conn_ms = median(v, dials);
    free(v);
    if (rc == 0) rc = cl_dial(&c, ma, NULL);
    if (rc == 0) {
        static ap_echo_run_t r;
        double t0 = ap_bench_now();
        rc = ap_echo_start(c.conn, &r, 1, size);
        while (rc == 0 && !ap_echo_done(&r) && !c.closed) uv_run(&c.loop, UV_RUN_ONCE);
        double dt = ap_bench_now() - t0;
        if (rc == 0 && r.ok != 1) rc = -1;
        if (rc == 0) *mbps = (double)size / 1e6 / dt;
        ap_echo_free(&r);
        if (!c.closed) cl_hangup(&c);
    }
    if (c.h) ap__p2p_host_free(c.h);
    uv_run(&c.loop, UV_RUN_DEFAULT);
    uv_loop_close(&c.loop);
    return rc;
}

/* ---- native: two nodes, an echo listener under runtime.h's streams ---------------- */

typedef struct necho {
    uint8_t *pending; /* a message the send window refused, resent on on_writable */
    size_t plen;
} necho_t;

static void ne_writable(ap_stream_t *s, void *arg)
{
    necho_t *e = arg;
    if (!e->plen || ap_stream_send(s, e->pending, e->plen) != 0) return;
    e->plen = 0;
    ap_stream_pause(s, false);
}
static void ne_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    necho_t *e = arg;
    if (ap_stream_send(s, d, n) == 0) return;
    memcpy(e->pending, d, n); /* n <= MSG: the client sends MSG-byte messages */
    e->plen = n;
    ap_stream_pause(s, true);
}
static void ne_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}
static void ne_close(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    (void)st;
    necho_t *e = arg;
    free(e->pending);
    free(e);
}
static int ne_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt, (void)arg, (void)peer, (void)hello, (void)len;
    static const ap_stream_cbs_t cbs = {ne_msg, ne_writable, ne_end, ne_close};
    necho_t *e = calloc(1, sizeof *e);
    if (!e || !(e->pending = malloc(MSG))) {
        free(e);
        return AP_ENOMEM;
    }
    ap_stream_set_cbs(s, &cbs, e);
    return 0;
}
static void ne_listen(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)arg;
    ap_stream_opts_t o = {.window = 4u << 20, .max_msg = MSG};
    ap_sync_complete(done, ap_rt_stream_listen(rt, ECHO_PROTO, &o, ne_accept, NULL));
}

typedef struct nc {
    size_t total, sent, back;
    uint8_t *buf;
    bool closed, dialed;
    int status;
} nc_t;

static void nc_fill(ap_stream_t *s, void *arg)
{
    nc_t *x = arg;
    while (x->sent < x->total) {
        size_t n = x->total - x->sent < MSG ? x->total - x->sent : MSG;
        if (ap_stream_send(s, x->buf, n) != 0) return;
        x->sent += n;
    }
}
static void nc_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)d;
    nc_t *x = arg;
    x->back += n;
    if (x->back == x->total) ap_stream_close(s);
}
static void nc_close(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    nc_t *x = arg;
    x->closed = true;
    x->status = st;
}
static void nc_dialed(ap_rt_t *rt, void *arg, int st, const ap_peer_id_t *peer)
{
    (void)rt, (void)peer;
    nc_t *x = arg;
    x->dialed = true;
    x->status = st;
}
static bool nc_is_dialed(void *arg)
{
    return ((nc_t *)arg)->dialed;
}
static bool nc_is_closed(void *arg)
{
    return ((nc_t *)arg)->closed;
}

static int native_pair(int dials, size_t size, ap_node_wire_t wire, double *conn_ms, double *mbps)
{
    ap_host_t *hs = ap_host_new(), *hc = ap_host_new();
    ap_rt_t *srv = NULL;
    int rc = -1;
    char addr[AP_RT_ADDR_MAX];
    ap_node_opts_t so = {.listen = "/ip4/127.0.0.1/tcp/0"};
    if (!hs || !hc || ap_host_start(hs) != 0 || ap_node_new(hs, &so, &srv) != 0 ||
        ap_node_call_sync(srv, ne_listen, NULL) != 0 ||
        ap_node_listen_addrs_sync(srv, &addr, 1, true) < 1)
        goto out;
    double *v = calloc((size_t)dials + 1, sizeof *v);
    if (!v) goto out;
    rc = 0;
    for (int i = 0; i <= dials && rc == 0; i++) {
        ap_rt_t *cli = NULL;
        ap_node_opts_t co = {.dial_only = true};
        static nc_t x;
        memset(&x, 0, sizeof x);
        if (ap_node_new(hc, &co, &cli) != 0) {
            rc = -1;
            break;
        }
        if (wire != AP_NODE_WIRE_NATIVE && ap_node_set_wire(cli, wire) != 0) {
            ap_node_free(cli);
            rc = -1;
            break;
        }
        double t0 = ap_bench_now();
        if (ap_rt_dial(cli, addr, 10000000, nc_dialed, &x) != 0 ||
            !ap_host_run_until(hc, nc_is_dialed, &x, 30000000) || x.status != 0)
            rc = -1;
        if (i < dials) v[i] = (ap_bench_now() - t0) * 1e3;
        if (rc == 0 && i == dials) { /* the last connection carries the echo */
            static const ap_stream_cbs_t cbs = {nc_msg, nc_fill, NULL, nc_close};
            ap_stream_opts_t o = {.window = 4u << 20, .max_msg = MSG};
            ap_stream_t *s;
            x.total = size;
            x.buf = calloc(1, MSG);
            t0 = ap_bench_now();
            if (!x.buf || ap_rt_stream_open(cli, ap_rt_self(srv), ECHO_PROTO, NULL, 0, &o, &cbs, &x,
                                            &s) != 0) {
                rc = -1;
            } else {
                nc_fill(s, &x);
                ap_host_run_until(hc, nc_is_closed, &x, 300000000);
                if (x.back != size || x.status != 0) rc = -1;
                *mbps = (double)size / 1e6 / (ap_bench_now() - t0);
            }
            free(x.buf);
        }
        ap_node_free(cli);
    }
    if (rc == 0) *conn_ms = median(v, dials);
    free(v);
out:
    if (srv) ap_node_free(srv);
    if (hs) ap_host_free(hs);
    if (hc) ap_host_free(hc);
    return rc;
}

/* ---- js-libp2p -------------------------------------------------------------------- */

static const char *js_dir(void)
{
    static char d[2048];
    const char *cands[] = {getenv("APIARY_JS_DIR"), "interop-js", "build/interop-js"};
    for (size_t i = 0; i < sizeof cands / sizeof cands[0]; i++) {
        if (!cands[i]) continue;
        snprintf(d, sizeof d, "%s/node_modules/libp2p/package.json", cands[i]);
        if (access(d, R_OK) != 0) continue;
        /* this tree's peer.mjs (the installed copy may be older) */
        const char *self = __FILE__, *tail = "bench/bench_libp2p.c";
        size_t n = strlen(self), k = strlen(tail);
        if (n >= k && !strcmp(self + n - k, tail)) {
            char cmd[4096];
            snprintf(cmd, sizeof cmd, "cp '%.*stests/interop/js/peer.mjs' '%s/' 2>/dev/null",
                     (int)(n - k), self, cands[i]);
            if (system(cmd) != 0) { /* keep the installed one */
            }
        }
        snprintf(d, sizeof d, "%s/peer.mjs", cands[i]);
        if (access(d, R_OK) != 0) continue;
        snprintf(d, sizeof d, "%s", cands[i]);
        return d;
    }
    return NULL;
}

typedef struct jsl {
    pid_t pid;
    int in;
    char addr[AP_MA_TEXT_MAX];
} jsl_t;

/* node peer.mjs listen: its address from its first output line */
static int js_listen(const char *dir, jsl_t *j)
{
    int pin[2], pout[2];
    if (pipe(pin) != 0) return -1;
    if (pipe(pout) != 0) {
        close(pin[0]);
        close(pin[1]);
        return -1;
    }
    j->pid = fork();
    if (j->pid < 0) return -1;
    if (j->pid == 0) {
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        close(pin[1]);
        close(pout[0]);
        if (chdir(dir) != 0) _exit(127);
        execlp("node", "node", "peer.mjs", "listen", (char *)NULL);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    j->in = pin[1];
    FILE *f = fdopen(pout[0], "r");
    char line[2048] = "";
    if (!f || !fgets(line, sizeof line, f)) line[0] = 0;
    if (f) fclose(f);
    char *a = strstr(line, "\"addr\":\"");
    if (!a || sscanf(a + 8, "%383[^\"]", j->addr) != 1) return -1;
    return 0;
}

static void js_stop(jsl_t *j)
{
    int st;
    close(j->in);
    for (int i = 0; i < 50 && waitpid(j->pid, &st, WNOHANG) == 0; i++) usleep(100000);
    kill(j->pid, SIGKILL);
    waitpid(j->pid, &st, 0);
}

static double json_num(const char *s, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(s, k);
    return p ? strtod(p + strlen(k), NULL) : -1;
}

/* js dials js: node peer.mjs echo ADDR SIZE 1 DIALS */
static int js_js(const char *dir, const char *addr, int dials, size_t size, double *conn_ms,
                 double *mbps)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd '%s' && node peer.mjs echo '%s' %zu 1 %d 2>&1", dir, addr, size,
             dials);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    static char out[16384];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    int st = pclose(f);
    if (st != 0 || !strstr(out, "\"ok\":true")) {
        fprintf(stderr, "bench libp2p: js echo failed: %s\n", out);
        return -1;
    }
    *conn_ms = json_num(out, "connect_ms_p50");
    *mbps = json_num(out, "MBps");
    if (*conn_ms < 0 || *mbps < 0) {
        fprintf(stderr, "bench libp2p: js printed no figures (an old peer.mjs?): %s\n", out);
        return -1;
    }
    return 0;
}

/* ---- the benchmark ------------------------------------------------------------------- */

static void report_via(ap_bench_ctx_t *c, const char *pair, const char *muxer, const char *via,
                       double mbps, double base_mbps, double ms, double base_ms)
{
    char fields[160];
    int k = snprintf(fields, sizeof fields, "\"pair\":\"%s\",\"muxer\":\"%s\"", pair, muxer);
    if (via && k > 0 && (size_t)k < sizeof fields)
        snprintf(fields + k, sizeof fields - (size_t)k, ",\"via\":\"%s\"", via);
    if (base_mbps > 0)
        ap_bench_report_vs(c, "stream_MBps", mbps, "MB/s", base_mbps, fields);
    else
        ap_bench_report(c, "stream_MBps", mbps, "MB/s", fields);
    if (base_ms > 0)
        ap_bench_report_vs(c, "connect_ms_p50", ms, "ms", base_ms, fields);
    else
        ap_bench_report(c, "connect_ms_p50", ms, "ms", fields);
}

static void report(ap_bench_ctx_t *c, const char *pair, const char *muxer, double mbps,
                   double base_mbps, double ms, double base_ms)
{
    report_via(c, pair, muxer, NULL, mbps, base_mbps, ms, base_ms);
}

static int run(ap_bench_ctx_t *c, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    signal(SIGPIPE, SIG_IGN);
    size_t size = c->quick ? (8u << 20) : (64u << 20);
    int dials = c->quick ? 3 : 11;
    double nat_ms = 0, nat_mbps = 0, y_ms = 0, y_mbps = 0;
    double l_ms = 0, l_mbps = 0, ry_ms = 0, ry_mbps = 0;
    if (native_pair(dials, size, AP_NODE_WIRE_NATIVE, &nat_ms, &nat_mbps) != 0) {
        fprintf(stderr, "bench libp2p: the native pair failed\n");
        return 1;
    }
    /* the same runtime.h stream over libp2p connections: the native mux
     * agreed as /apiary/mux/2, and yamux forced (runtime/uv/p2p_bridge.c) */
    if (native_pair(dials, size, AP_NODE_WIRE_LIBP2P, &l_ms, &l_mbps) != 0 ||
        native_pair(dials, size, AP_NODE_WIRE_YAMUX, &ry_ms, &ry_mbps) != 0) {
        fprintf(stderr, "bench libp2p: a runtime pair over libp2p failed\n");
        return 1;
    }
    srv_t s;
    memset(&s, 0, sizeof s);
    if (srv_start(&s) != 0 || p2p_pair(&s.addr, dials, size, &y_ms, &y_mbps) != 0) {
        fprintf(stderr, "bench libp2p: the yamux pair failed\n");
        return 1;
    }
    srv_stop(&s);
    report(c, "apiary-apiary", "native", nat_mbps, 0, nat_ms, 0);
    report(c, "apiary-apiary", "yamux", y_mbps, nat_mbps, y_ms, nat_ms);
    report_via(c, "apiary-apiary", "native", "libp2p", l_mbps, nat_mbps, l_ms, nat_ms);
    report_via(c, "apiary-apiary", "yamux", "runtime", ry_mbps, nat_mbps, ry_ms, nat_ms);

    const char *dir = js_dir();
    if (!dir || system("command -v node >/dev/null 2>&1") != 0) {
        printf("js pairs skipped: node or the js-libp2p packages are missing (run "
               "net/test_p2p_js once, or set APIARY_JS_DIR)\n");
        return 0;
    }
    jsl_t j;
    double jj_ms = 0, jj_mbps = 0, aj_ms = 0, aj_mbps = 0;
    ap_multiaddr_t ma;
    if (js_listen(dir, &j) != 0 || ap_multiaddr_parse(&ma, j.addr) != 0) {
        fprintf(stderr, "bench libp2p: the js peer did not start\n");
        return 1;
    }
    /* js-libp2p 2.9.0 fails its own 64 MiB echo between two js peers ("Cannot
     * push value onto an ended pushable"; smaller ones now and then): the js
     * pairs move less, and js-js is tried up to three times */
    size_t jsize = c->quick ? (2u << 20) : (8u << 20);
    int rc = -1;
    for (int t = 0; t < 3 && rc != 0; t++) /* js's own echo fails now and then */
        rc = js_js(dir, j.addr, dials, jsize, &jj_ms, &jj_mbps);
    const char *failed = rc ? "js-js" : NULL;
    if (rc == 0 && p2p_pair(&ma, dials, jsize, &aj_ms, &aj_mbps) != 0) failed = "apiary-js";
    js_stop(&j);
    if (failed) {
        fprintf(stderr, "bench libp2p: the %s pair failed\n", failed);
        return 1;
    }
    report(c, "js-js", "yamux", jj_mbps, 0, jj_ms, 0);
    report(c, "apiary-js", "yamux", aj_mbps, jj_mbps, aj_ms, jj_ms);
    /* the set-up target compares Apiary<->Apiary with js<->js */
    char fields[128];
    snprintf(fields, sizeof fields, "\"pair\":\"apiary-apiary\",\"muxer\":\"yamux\"");
    ap_bench_report_vs(c, "connect_ms_p50_vs_js", y_ms, "ms", jj_ms, fields);
    return 0;
}

AP_BENCH(bench_libp2p, "libp2p", run,
         "libp2p: one-stream echo throughput and connection set-up, yamux vs the native mux, "
         "Apiary vs js-libp2p");
