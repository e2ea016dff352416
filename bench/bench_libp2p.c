/* `apiary bench libp2p`: one-stream throughput and connection set-up time
 * over loopback. Rows (JSON fields pair, muxer, via):
 *   apiary-apiary / native        the node's own transport: TCP, Noise
 *                                 (BLAKE2b), the native mux, a runtime.h
 *                                 stream (ap_rt_stream_open); the baseline
 *                                 of every apiary-apiary row
 *   apiary-apiary / yamux         a libp2p connection (src/p2p/p2p_conn.c):
 *                                 TCP, multistream-select, libp2p Noise,
 *                                 yamux, one yamux stream (ap__p2p_stream_*)
 *                                 to the host's echo protocol
 *   ... / native, via libp2p      the runtime.h stream of the native row
 *                                 over a libp2p connection with the native
 *                                 mux agreed as /apiary/mux/2
 *                                 (runtime/uv/p2p_bridge.c)
 *   ... / yamux, via runtime      the runtime.h stream of the native row
 *                                 over a libp2p connection with yamux
 *                                 forced: a yamux stream carrying the mux's
 *                                 frames (same API and payload as the
 *                                 native row: the like-for-like row of the
 *                                 "yamux >= 0.8 x native" target)
 *   apiary-js / yamux             Apiary dialling js-libp2p's echo
 *   js-js / yamux                 js-libp2p dialling js-libp2p (the
 *                                 baseline of the apiary-js pair)
 * Throughput: SIZE bytes (64 MiB; 8 MiB for the js pairs, since js-libp2p
 * fails a 64 MiB echo between two js peers) sent through one stream in
 * 64 KiB writes and echoed back by the other side (each byte crosses twice);
 * MB/s = SIZE / elapsed. Every row sends the same bytes (ap_echo_fill of
 * stream 0) and checks every byte that comes back (ap_echo_check; js: its
 * SHA-256). The server runs on its own thread (js: its own process).
 * stream_cpu_MBps: SIZE per CPU-second this process spent in the transfer
 * (both ends are in it for the apiary pairs): what the path costs, less
 * sensitive than MB/s to a busy machine. Set-up: the median of DIALS dials,
 * from the dial call to a usable connection (TCP + negotiation + Noise +
 * muxer), a fresh connection each time.
 * The apiary rows run ROUNDS times (3; --rounds N), one row after the other
 * in each round, and report their medians. --pair ROW runs one row only
 * (native, yamux, native-libp2p, yamux-runtime, js), for profiling.
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
#include <sys/resource.h>
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

/* CPU seconds of this process (every thread) so far. */
static double cpu_now(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

/* One measurement of a row. */
typedef struct fig {
    double conn_ms, mbps, cpu_mbps;
} fig_t;

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
static int p2p_pair(const ap_multiaddr_t *ma, int dials, size_t size, fig_t *f)
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
    if (rc == 0 && v) f->conn_ms = median(v, dials);
    free(v);
    if (rc == 0) rc = cl_dial(&c, ma, NULL);
    if (rc == 0) {
        static ap_echo_run_t r;
        double t0 = ap_bench_now(), c0 = cpu_now();
        rc = ap_echo_start(c.conn, &r, 1, size);
        while (rc == 0 && !ap_echo_done(&r) && !c.closed) uv_run(&c.loop, UV_RUN_ONCE);
        double dt = ap_bench_now() - t0, dc = cpu_now() - c0;
        if (rc == 0 && r.ok != 1) rc = -1;
        if (rc == 0) {
            f->mbps = (double)size / 1e6 / dt;
            f->cpu_mbps = dc > 0 ? (double)size / 1e6 / dc : 0;
        }
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
    size_t total, sent, back, filled; /* filled: buf holds the bytes from sent */
    uint8_t *buf;
    bool closed, dialed, bad;
    int status;
} nc_t;

/* Sends the bytes of ap_echo_fill (stream 0), as the yamux row's client. */
static void nc_fill(ap_stream_t *s, void *arg)
{
    nc_t *x = arg;
    while (x->sent < x->total) {
        size_t n = x->total - x->sent < MSG ? x->total - x->sent : MSG;
        if (x->filled != x->sent + 1) {
            ap_echo_fill(0, x->sent, x->buf, n);
            x->filled = x->sent + 1;
        }
        if (ap_stream_send(s, x->buf, n) != 0) return;
        x->sent += n;
    }
}
static void nc_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    nc_t *x = arg;
    if (!x->bad) x->bad = !ap_echo_check(0, x->back, d, n);
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

static int native_pair(int dials, size_t size, ap_node_wire_t wire, fig_t *f)
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
            double c0 = cpu_now();
            if (!x.buf || ap_rt_stream_open(cli, ap_rt_self(srv), ECHO_PROTO, NULL, 0, &o, &cbs, &x,
                                            &s) != 0) {
                rc = -1;
            } else {
                nc_fill(s, &x);
                ap_host_run_until(hc, nc_is_closed, &x, 300000000);
                if (x.back != size || x.status != 0 || x.bad) rc = -1;
                double dc = cpu_now() - c0;
                f->mbps = (double)size / 1e6 / (ap_bench_now() - t0);
                f->cpu_mbps = dc > 0 ? (double)size / 1e6 / dc : 0;
            }
            free(x.buf);
        }
        ap_node_free(cli);
    }
    if (rc == 0) f->conn_ms = median(v, dials);
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
                       const fig_t *f, const fig_t *base)
{
    char fields[160];
    int k = snprintf(fields, sizeof fields, "\"pair\":\"%s\",\"muxer\":\"%s\"", pair, muxer);
    if (via && k > 0 && (size_t)k < sizeof fields)
        snprintf(fields + k, sizeof fields - (size_t)k, ",\"via\":\"%s\"", via);
    if (base && base->mbps > 0)
        ap_bench_report_vs(c, "stream_MBps", f->mbps, "MB/s", base->mbps, fields);
    else
        ap_bench_report(c, "stream_MBps", f->mbps, "MB/s", fields);
    if (f->cpu_mbps > 0 && base && base->cpu_mbps > 0)
        ap_bench_report_vs(c, "stream_cpu_MBps", f->cpu_mbps, "MB/cpu-s", base->cpu_mbps, fields);
    else if (f->cpu_mbps > 0)
        ap_bench_report(c, "stream_cpu_MBps", f->cpu_mbps, "MB/cpu-s", fields);
    if (base && base->conn_ms > 0)
        ap_bench_report_vs(c, "connect_ms_p50", f->conn_ms, "ms", base->conn_ms, fields);
    else
        ap_bench_report(c, "connect_ms_p50", f->conn_ms, "ms", fields);
}

enum { R_NATIVE, R_YAMUX, R_LIBP2P, R_RUNTIME, R_ROWS };
static const char *const row_names[R_ROWS] = {"native", "yamux", "native-libp2p", "yamux-runtime"};

/* One measurement of row r. */
static int run_row(int r, int dials, size_t size, fig_t *f)
{
    if (r == R_NATIVE) return native_pair(dials, size, AP_NODE_WIRE_NATIVE, f);
    if (r == R_LIBP2P) return native_pair(dials, size, AP_NODE_WIRE_LIBP2P, f);
    if (r == R_RUNTIME) return native_pair(dials, size, AP_NODE_WIRE_YAMUX, f);
    srv_t s;
    memset(&s, 0, sizeof s);
    if (srv_start(&s) != 0) return -1;
    int rc = p2p_pair(&s.addr, dials, size, f);
    srv_stop(&s);
    return rc;
}

static fig_t fig_median(fig_t *v, int n)
{
    double a[64], b[64], d[64];
    for (int i = 0; i < n; i++) a[i] = v[i].mbps, b[i] = v[i].cpu_mbps, d[i] = v[i].conn_ms;
    return (fig_t){median(d, n), median(a, n), median(b, n)};
}

static int js_rows(ap_bench_ctx_t *c, int dials, const fig_t *yamux);

static int run(ap_bench_ctx_t *c, int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    size_t size = c->quick ? (8u << 20) : (64u << 20);
    int dials = c->quick ? 3 : 11, rounds = c->quick ? 1 : 3;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) { /* argv[0] is the bench's name */
        if (!strcmp(argv[i], "--pair") && i + 1 < argc) {
            only = argv[++i];
        } else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: apiary bench libp2p [--json] [--quick] [--rounds N (1..64)] "
                            "[--pair native|yamux|native-libp2p|yamux-runtime|js]\n");
            return 2;
        }
    }
    if (rounds < 1 || rounds > 64) {
        fprintf(stderr, "bench libp2p: --rounds takes 1..64\n");
        return 2;
    }
    bool want[R_ROWS], js = !only || !strcmp(only, "js");
    for (int r = 0; r < R_ROWS; r++) want[r] = !only || !strcmp(only, row_names[r]);
    if (only && !js && !want[0] && !want[1] && !want[2] && !want[3]) {
        fprintf(stderr, "bench libp2p: unknown --pair %s\n", only);
        return 2;
    }
    static fig_t figs[R_ROWS][64];
    fig_t med[R_ROWS];
    memset(med, 0, sizeof med);
    for (int k = 0; k < rounds; k++)
        for (int r = 0; r < R_ROWS; r++) {
            if (!want[r]) continue;
            if (run_row(r, dials, size, &figs[r][k]) != 0) {
                fprintf(stderr, "bench libp2p: the %s row failed\n", row_names[r]);
                return 1;
            }
        }
    for (int r = 0; r < R_ROWS; r++)
        if (want[r]) med[r] = fig_median(figs[r], rounds);
    const fig_t *base = want[R_NATIVE] ? &med[R_NATIVE] : NULL;
    if (want[R_NATIVE]) report_via(c, "apiary-apiary", "native", NULL, &med[R_NATIVE], NULL);
    if (want[R_YAMUX]) report_via(c, "apiary-apiary", "yamux", NULL, &med[R_YAMUX], base);
    if (want[R_LIBP2P]) report_via(c, "apiary-apiary", "native", "libp2p", &med[R_LIBP2P], base);
    if (want[R_RUNTIME]) report_via(c, "apiary-apiary", "yamux", "runtime", &med[R_RUNTIME], base);
    if (!js) return 0;
    return js_rows(c, dials, want[R_YAMUX] ? &med[R_YAMUX] : NULL);
}

static int js_rows(ap_bench_ctx_t *c, int dials, const fig_t *yamux)
{
    const char *dir = js_dir();
    if (!dir || system("command -v node >/dev/null 2>&1") != 0) {
        printf("js pairs skipped: node or the js-libp2p packages are missing (run "
               "net/test_p2p_js once, or set APIARY_JS_DIR)\n");
        return 0;
    }
    jsl_t j;
    fig_t jj = {0}, aj = {0};
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
        rc = js_js(dir, j.addr, dials, jsize, &jj.conn_ms, &jj.mbps);
    const char *failed = rc ? "js-js" : NULL;
    if (rc == 0 && p2p_pair(&ma, dials, jsize, &aj) != 0) failed = "apiary-js";
    js_stop(&j);
    if (failed) {
        fprintf(stderr, "bench libp2p: the %s pair failed\n", failed);
        return 1;
    }
    aj.cpu_mbps = 0; /* the js side's CPU is not counted: no like-for-like figure */
    report_via(c, "js-js", "yamux", NULL, &jj, NULL);
    report_via(c, "apiary-js", "yamux", NULL, &aj, &jj);
    if (!yamux) return 0;
    /* the set-up target compares Apiary<->Apiary with js<->js */
    char fields[128];
    snprintf(fields, sizeof fields, "\"pair\":\"apiary-apiary\",\"muxer\":\"yamux\"");
    ap_bench_report_vs(c, "connect_ms_p50_vs_js", yamux->conn_ms, "ms", jj.conn_ms, fields);
    return 0;
}

AP_BENCH(bench_libp2p, "libp2p", run,
         "libp2p: one-stream echo throughput and connection set-up, yamux vs the native mux, "
         "Apiary vs js-libp2p");
