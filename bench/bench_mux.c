/* `apiary bench mux`: the libuv driver's stream multiplexer over the
 * in-process transport. Reports stream throughput (one host, and two hosts on
 * two threads) against a memcpy of the same bytes in the same run, and small
 * RPC round trips per second. */
#include "bench.h"

#include "apiary/host.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct bx {
    ap_stream_t *tx;
    size_t total, sent, recv;
    size_t msg;
    uint8_t *buf;
    bool closed;
    ap_sync_t *done;
} bx_t;

static void bx_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    (void)d;
    ((bx_t *)arg)->recv += n;
}

static void bx_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}

static int bx_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)peer;
    (void)hello;
    (void)len;
    static const ap_stream_cbs_t cbs = {.on_msg = bx_msg, .on_end = bx_end};
    ap_stream_set_cbs(s, &cbs, arg);
    return 0;
}

static void bx_fill(ap_stream_t *s, void *arg)
{
    bx_t *x = arg;
    while (x->sent < x->total) {
        if (ap_stream_send(s, x->buf, x->msg) != 0) return;
        x->sent += x->msg;
    }
    ap_stream_close(s);
}

static void bx_closed(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    bx_t *x = arg;
    x->closed = true;
    if (x->done) ap_sync_complete(x->done, st);
}

static bool bx_is_closed(void *arg)
{
    return ((bx_t *)arg)->closed;
}

typedef struct {
    bx_t x;
    ap_peer_id_t peer;
} bx_start_t;

static void bx_start(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    bx_start_t *b = arg;
    b->x.done = done;
    static const ap_stream_cbs_t cbs = {.on_writable = bx_fill, .on_close = bx_closed};
    ap_stream_opts_t o = {.window = 4u << 20};
    if (ap_rt_stream_open(rt, &b->peer, "/bench/x", NULL, 0, &o, &cbs, &b->x, &b->x.tx) < 0) {
        ap_sync_complete(done, -1);
        return;
    }
    bx_fill(b->x.tx, &b->x);
}

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Baseline: memcpy of the same bytes in messages of the same size, from and to
 * a 64 MiB ring (out of cache, like a real transfer). */
static double memcpy_gbps(size_t total, size_t msg)
{
    size_t ring = 64u << 20;
    uint8_t *a = malloc(ring), *b = malloc(ring);
    memset(a, 1, ring);
    memset(b, 2, ring);
    double t0 = cpu_now(); /* CPU time: the machines are shared (DESIGN.md §6) */
    size_t off = 0;
    for (size_t done = 0; done < total; done += msg) {
        memcpy(b + off, a + off, msg);
        off = (off + msg) % (ring - msg);
    }
    double dt = cpu_now() - t0;
    volatile uint8_t sink = b[off];
    (void)sink;
    free(a);
    free(b);
    return (double)total / dt / 1e9;
}

static void rpc_echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    ap_rpc_respond(req, d, n);
}

typedef struct {
    ap_rt_t *a;
    ap_peer_id_t b;
    int left, inflight;
} rpcb_t;

static void rpc_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                     const char *errmsg)
{
    (void)status;
    (void)resp;
    (void)len;
    (void)errmsg;
    rpcb_t *r = arg;
    r->inflight--;
    if (r->left > 0) {
        r->left--;
        r->inflight++;
        ap_rt_rpc_call(rt, &r->b, "/bench/echo", (const uint8_t *)"0123456789abcdef", 16, NULL,
                       rpc_done, r);
    }
}

static bool rpc_finished(void *arg)
{
    rpcb_t *r = arg;
    return r->left == 0 && r->inflight == 0;
}

static int run(ap_bench_ctx_t *c, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    size_t total = c->quick ? (64u << 20) : (1u << 30), msg = 64 * 1024;
    char fields[128];
    snprintf(fields, sizeof fields, "\"bytes\":%zu,\"msg\":%zu", total, msg);
    double base = memcpy_gbps(total, msg);

    /* one host: two nodes on the caller-driven loop */
    ap_host_t *h = ap_host_new();
    ap_rt_t *a, *b;
    if (!h || ap_node_new(h, NULL, &a) < 0 || ap_node_new(h, NULL, &b) < 0) return 1;
    char addr[1][AP_RT_ADDR_MAX];
    ap_rt_listen_addrs(b, addr, 1, false);
    ap_rt_add_addr(a, ap_rt_self(b), addr[0]);
    bx_start_t s1 = {.x = {.total = total, .msg = msg}, .peer = *ap_rt_self(b)};
    s1.x.buf = calloc(1, msg);
    ap_rt_stream_listen(b, "/bench/x", &(ap_stream_opts_t){.window = 4u << 20}, bx_accept, &s1.x);
    static const ap_stream_cbs_t cbs = {.on_writable = bx_fill, .on_close = bx_closed};
    double t0 = ap_bench_now(), c0 = cpu_now();
    ap_rt_stream_open(a, ap_rt_self(b), "/bench/x", NULL, 0,
                      &(ap_stream_opts_t){.window = 4u << 20}, &cbs, &s1.x, &s1.x.tx);
    bx_fill(s1.x.tx, &s1.x);
    ap_host_run_until(h, bx_is_closed, &s1.x, 600u * 1000 * 1000);
    double dt = ap_bench_now() - t0, dc = cpu_now() - c0;
    /* one thread runs both nodes: CPU time is the fair measure on a shared machine */
    ap_bench_report_vs(c, "stream_1host_cpu", (double)s1.x.recv / dc / 1e9, "GB/s", base, fields);
    ap_bench_report(c, "stream_1host_wall", (double)s1.x.recv / dt / 1e9, "GB/s", fields);

    /* small RPCs, 64 in flight */
    ap_rt_rpc_register(b, "/bench/echo", 0, rpc_echo, NULL);
    rpcb_t r = {.a = a, .b = *ap_rt_self(b), .left = c->quick ? 20000 : 200000};
    int n = r.left;
    t0 = ap_bench_now();
    c0 = cpu_now();
    for (int i = 0; i < 64; i++) {
        r.left--;
        r.inflight++;
        ap_rt_rpc_call(a, &r.b, "/bench/echo", (const uint8_t *)"0123456789abcdef", 16, NULL,
                       rpc_done, &r);
    }
    ap_host_run_until(h, rpc_finished, &r, 600u * 1000 * 1000);
    dt = ap_bench_now() - t0;
    ap_bench_report(c, "rpc_16B_64inflight_cpu", n / (cpu_now() - c0), "calls/s", NULL);
    ap_bench_report(c, "rpc_16B_64inflight_wall", n / dt, "calls/s", NULL);
    free(s1.x.buf);
    ap_host_free(h);

    /* two hosts on two threads */
    ap_host_t *h1 = ap_host_new(), *h2 = ap_host_new();
    if (!h1 || !h2 || ap_node_new(h1, NULL, &a) < 0 || ap_node_new(h2, NULL, &b) < 0) return 1;
    ap_rt_listen_addrs(b, addr, 1, false);
    ap_rt_add_addr(a, ap_rt_self(b), addr[0]);
    bx_start_t s2 = {.x = {.total = total, .msg = msg}, .peer = *ap_rt_self(b)};
    s2.x.buf = calloc(1, msg);
    bx_t rx = {0};
    ap_rt_stream_listen(b, "/bench/x", &(ap_stream_opts_t){.window = 4u << 20}, bx_accept, &rx);
    ap_host_start(h1);
    ap_host_start(h2);
    t0 = ap_bench_now();
    int rc = ap_node_call_sync(a, bx_start, &s2);
    dt = ap_bench_now() - t0;
    ap_host_stop(h1);
    ap_host_stop(h2);
    if (rc == 0)
        ap_bench_report(c, "stream_2threads_wall", (double)rx.recv / dt / 1e9, "GB/s", fields);
    free(s2.x.buf);
    ap_host_free(h1);
    ap_host_free(h2);
    return rc == 0 ? 0 : 1;
}

AP_BENCH(bench_mux, "mux", run,
         "stream mux + RPC over the in-process transport vs memcpy (1 host, 2 threads)")
