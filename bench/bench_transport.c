/* `apiary bench transport`: the secure TCP transport against its ceilings.
 *
 * Two processes (fork): the parent sends, the child runs a sink/echo server
 * with its own libuv loop and its own transport, on 127.0.0.1. Measured in
 * one run:
 *   aead_seal_MBps            (c) single-core ChaCha20-Poly1305 seal of 64 KiB
 *                                 messages (the implementation in use, field
 *                                 "impl") per CPU-second: the AEAD ceiling
 *   aead_seal_libsodium_MBps      the same with libsodium's (the fallback)
 *   aead_open_MBps                the same for open (verify + decrypt)
 *   encrypted_stream_bound_MBps   the best wall rate two cores allow: 1 / the
 *                                 larger of (seal + the sender's raw-TCP CPU
 *                                 per byte) and (open + the receiver's)
 *   encrypted_stream_wall_s       with each process's CPU seconds and their
 *                                 sum per byte moved (cpu_ns_per_byte)
 *   *_cpu_MBps                    the same transfers per CPU-second of the
 *                                 busier process (robust on a shared machine)
 *   raw_tcp_MBps              (b) one plain TCP stream parent -> child
 *   encrypted_stream_MBps     (a) one Noise-encrypted transport connection
 *                                 parent -> child, vs (c) and vs (b)
 *   transport_echo_rtt_p50_us / _p99_us: round trip of a 64-byte message
 *                                 echoed by the child over the encrypted
 *                                 connection, with 1 and 64 in flight
 *                                 (field "callers")
 *   idle_conn_bytes           heap bytes per idle authenticated connection in
 *                                 the parent (N connections to the child)
 * and through runtime/uv's mux over this transport (a node per process):
 *   encrypted_stream_MBps     (a) with "layer":"mux": one stream, 64 KiB messages
 *                             and with "layer":"yamux": the same stream from a
 *                             node dialling with AP_NODE_WIRE_YAMUX (libp2p
 *                             Noise, one yamux stream carrying the mux frames)
 *   rpc_rtt_p50_us / _p99_us  (d) unary RPC, 64-byte request, 1 and 64 callers
 *   streams1000_MBps / streams1000_fairness (e) 1,000 concurrent streams of
 *                                 equal size; fairness = slowest / fastest
 *                                 per-stream rate (completion time based) */
#include "bench.h"

#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "net/aead.h"
#include "net/noise.h"
#include "net/tcp.h"

#include <malloc.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHUNK    (256u * 1024u)
#define ECHO_MSG 64

static uint8_t chunk_buf[CHUNK];

/* ---- the child: sink / echo protocol -----------------------------------------
 * Commands: 'B' u64 n -> swallow n bytes then answer 'K';
 *           'E' u64 n -> echo the next n bytes back; 'Q' -> exit. */

typedef struct proto {
    int mode; /* 0 command, 1 sink, 2 echo */
    uint8_t hdr[9];
    size_t hlen;
    uint64_t left;
    void (*send)(void *ctx, const uint8_t *p, size_t n);
    void *ctx;
} proto_t;

static bool child_quit;

static void proto_feed(proto_t *s, const uint8_t *p, size_t n)
{
    while (n > 0) {
        if (s->mode == 0) {
            s->hdr[s->hlen++] = *p++;
            n--;
            if (s->hdr[0] == 'Q') {
                child_quit = true;
                s->hlen = 0;
                continue;
            }
            if (s->hlen < 9) continue;
            uint64_t v = 0;
            for (int i = 0; i < 8; i++) v = (v << 8) | s->hdr[1 + i];
            s->left = v;
            s->mode = s->hdr[0] == 'B' ? 1 : 2;
            s->hlen = 0;
            if (s->left == 0) s->mode = 0;
            continue;
        }
        size_t take = n < s->left ? n : (size_t)s->left;
        if (s->mode == 2) s->send(s->ctx, p, take);
        p += take;
        n -= take;
        s->left -= take;
        if (s->left == 0) {
            if (s->mode == 1) s->send(s->ctx, (const uint8_t *)"K", 1);
            s->mode = 0;
        }
    }
}

typedef struct child {
    uv_loop_t loop;
    ap_tcp_t *t;
    uv_tcp_t raw_listener;
    uv_timer_t quit_check;
} child_t;

static void secure_send(void *ctx, const uint8_t *p, size_t n)
{
    (void)ap__tcp_send(ctx, p, n); /* echo replies are small; the queue never fills */
}

static void child_on_conn(void *arg, ap_tcp_conn_t *c)
{
    (void)arg;
    proto_t *s = calloc(1, sizeof *s);
    s->send = secure_send;
    s->ctx = c;
    ap__tcp_conn_set_user(c, s);
}

static void child_on_data(void *arg, ap_tcp_conn_t *c, const uint8_t *d, size_t n)
{
    (void)arg;
    proto_feed(ap__tcp_conn_user(c), d, n);
}

static void child_on_close(void *arg, ap_tcp_conn_t *c, int st)
{
    (void)arg;
    (void)st;
    free(ap__tcp_conn_user(c));
}

typedef struct raw_conn {
    uv_tcp_t h;
    proto_t p;
} raw_conn_t;

static void free_write_req(uv_write_t *w, int status)
{
    (void)status;
    free(w);
}

static void raw_send(void *ctx, const uint8_t *p, size_t n)
{
    raw_conn_t *r = ctx;
    uv_write_t *w = malloc(sizeof *w + n);
    memcpy(w + 1, p, n);
    uv_buf_t b = uv_buf_init((char *)(w + 1), (unsigned)n);
    if (uv_write(w, (uv_stream_t *)&r->h, &b, 1, free_write_req) != 0) free(w);
}

static void big_alloc(uv_handle_t *h, size_t s, uv_buf_t *b)
{
    static char buf[CHUNK];
    (void)h;
    (void)s;
    *b = uv_buf_init(buf, sizeof buf);
}

static void raw_closed(uv_handle_t *h)
{
    free(h->data);
}

static void raw_read(uv_stream_t *st, ssize_t n, const uv_buf_t *b)
{
    raw_conn_t *r = st->data;
    if (n < 0) {
        uv_close((uv_handle_t *)st, raw_closed);
        return;
    }
    proto_feed(&r->p, (const uint8_t *)b->base, (size_t)n);
}

static void raw_accept(uv_stream_t *srv, int status)
{
    if (status < 0) return;
    raw_conn_t *r = calloc(1, sizeof *r);
    uv_tcp_init(srv->loop, &r->h);
    r->h.data = r;
    r->p.send = raw_send;
    r->p.ctx = r;
    if (uv_accept(srv, (uv_stream_t *)&r->h) != 0) {
        uv_close((uv_handle_t *)&r->h, raw_closed);
        return;
    }
    uv_tcp_nodelay(&r->h, 1);
    uv_read_start((uv_stream_t *)&r->h, big_alloc, raw_read);
}

static void quit_check(uv_timer_t *t)
{
    if (child_quit) uv_stop(t->loop);
}

static void run_child(int fd, size_t max_conns)
{
    child_t ch;
    memset(&ch, 0, sizeof ch);
    uv_loop_init(&ch.loop);
    ap_identity_t id;
    if (ap_identity_generate(&id) != 0) _exit(1);
    ap_tcp_cfg_t cfg = {.max_conns = max_conns + 16,
                        .max_handshakes = max_conns + 16,
                        .conns_per_ip = max_conns + 16};
    ap_tcp_cbs_t cbs = {child_on_conn, child_on_data, NULL, child_on_close, NULL};
    if (ap__tcp_new(&ch.loop, &id, &cfg, &cbs, NULL, &ch.t) != 0) _exit(1);
    if (ap__tcp_listen(ch.t, "/ip4/127.0.0.1/tcp/0") != 0) _exit(1);
    ap_multiaddr_t ma;
    ap__tcp_listen_addrs(ch.t, &ma, 1);
    char text[AP_MA_TEXT_MAX];
    ap_multiaddr_print(&ma, text, sizeof text);
    uv_tcp_init(&ch.loop, &ch.raw_listener);
    struct sockaddr_in sin;
    uv_ip4_addr("127.0.0.1", 0, &sin);
    uv_tcp_bind(&ch.raw_listener, (struct sockaddr *)&sin, 0);
    uv_listen((uv_stream_t *)&ch.raw_listener, 128, raw_accept);
    struct sockaddr_storage ss;
    int len = sizeof ss;
    uv_tcp_getsockname(&ch.raw_listener, (struct sockaddr *)&ss, &len);
    char line[AP_MA_TEXT_MAX + 16];
    int n =
        snprintf(line, sizeof line, "%s %d\n", text, ntohs(((struct sockaddr_in *)&ss)->sin_port));
    if (write(fd, line, (size_t)n) != n) _exit(1);
    close(fd);
    uv_timer_init(&ch.loop, &ch.quit_check);
    uv_timer_start(&ch.quit_check, quit_check, 20, 20);
    uv_run(&ch.loop, UV_RUN_DEFAULT);
    _exit(0);
}

/* ---- the parent ---------------------------------------------------------------- */

typedef struct parent {
    uv_loop_t loop;
    ap_tcp_t *t;
    ap_tcp_conn_t *conn;
    int dial_status;
    int dials_done;
    /* bulk */
    uint64_t to_send, sent;
    bool got_k;
    /* echo */
    uint64_t echo_rx;
    /* raw */
    uv_tcp_t raw;
    uv_connect_t raw_creq;
    bool raw_connected;
    int raw_inflight;
} parent_t;

static void p_on_data(void *arg, ap_tcp_conn_t *c, const uint8_t *d, size_t n)
{
    parent_t *p = arg;
    (void)c;
    (void)d;
    if (n == 1 && d[0] == 'K')
        p->got_k = true;
    else
        p->echo_rx += n;
}

static void secure_pump(parent_t *p)
{
    while (p->sent < p->to_send) {
        size_t n = p->to_send - p->sent < CHUNK ? (size_t)(p->to_send - p->sent) : CHUNK;
        int rc = ap__tcp_send(p->conn, chunk_buf, n);
        if (rc != 0) return; /* AP_EAGAIN: on_writable resumes */
        p->sent += n;
    }
}

static void p_on_writable(void *arg, ap_tcp_conn_t *c)
{
    (void)c;
    secure_pump(arg);
}

static void p_dial_cb(void *arg, int status, ap_tcp_conn_t *c)
{
    parent_t *p = arg;
    p->dial_status = status;
    p->dials_done++;
    if (status == 0 && !p->conn) p->conn = c;
}

static void cmd(uint8_t out[9], char op, uint64_t n)
{
    out[0] = (uint8_t)op;
    for (int i = 0; i < 8; i++) out[1 + i] = (uint8_t)(n >> (56 - 8 * i));
}

static void raw_pump(parent_t *p);
static void raw_wrote(uv_write_t *w, int status)
{
    parent_t *p = w->data;
    free(w);
    p->raw_inflight--;
    if (status == 0) raw_pump(p);
}

static void raw_pump(parent_t *p)
{
    while (p->sent < p->to_send && p->raw_inflight < 16) {
        size_t n = p->to_send - p->sent < CHUNK ? (size_t)(p->to_send - p->sent) : CHUNK;
        uv_write_t *w = malloc(sizeof *w);
        w->data = p;
        uv_buf_t b = uv_buf_init((char *)chunk_buf, (unsigned)n);
        if (uv_write(w, (uv_stream_t *)&p->raw, &b, 1, raw_wrote) != 0) {
            free(w);
            return;
        }
        p->raw_inflight++;
        p->sent += n;
    }
}

static void raw_p_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
    parent_t *p = s->data;
    if (n > 0 && b->base[0] == 'K') p->got_k = true;
}

static void raw_p_connected(uv_connect_t *c, int status)
{
    parent_t *p = c->data;
    p->raw_connected = status == 0;
    if (status == 0) uv_read_start((uv_stream_t *)&p->raw, big_alloc, raw_p_read);
}

/* CPU seconds used so far by process pid (this process if 0), from /proc:
 * throughput per CPU-second of the busier side does not depend on how many
 * other jobs share the machine, unlike wall-clock throughput. */
static double cpu_seconds(pid_t pid)
{
    if (pid == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    }
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    unsigned long ut = 0, st = 0;
    /* fields after the command: state(3) ... utime(14) stime(15) */
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return 0;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Seconds the main thread of pid (this process if 0) ran and waited on a
 * run queue, from /proc/PID/schedstat; false if unavailable. */
static bool sched_seconds(pid_t pid, double *run, double *wait)
{
    char path[64];
    if (pid == 0)
        snprintf(path, sizeof path, "/proc/self/schedstat");
    else
        snprintf(path, sizeof path, "/proc/%d/schedstat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    unsigned long long r = 0, w = 0;
    int k = fscanf(f, "%llu %llu", &r, &w);
    fclose(f);
    if (k != 2) return false;
    *run = (double)r * 1e-9;
    *wait = (double)w * 1e-9;
    return true;
}

typedef struct cpu_mark {
    double self, peer;
    double wall;
    bool sched; /* the fields below are valid */
    double self_run, self_wait, peer_run, peer_wait;
} cpu_mark_t;

static cpu_mark_t cpu_mark(pid_t peer)
{
    cpu_mark_t m = {cpu_seconds(0), cpu_seconds(peer), ap_bench_now(), false, 0, 0, 0, 0};
    m.sched = sched_seconds(0, &m.self_run, &m.self_wait) &&
              sched_seconds(peer, &m.peer_run, &m.peer_wait);
    return m;
}

/* The share of the wall time between a and b that each process's loop
 * thread slept (neither ran nor waited for a core): time spent waiting for
 * the other side (a pipelining gap), independent of how loaded the machine
 * is. Two processes in a perfect pipeline leave the slower one near 0. */
static void idle_fields(char *out, size_t cap, cpu_mark_t a, cpu_mark_t b)
{
    double wall = b.wall - a.wall;
    if (!a.sched || !b.sched || wall <= 0) {
        out[0] = 0;
        return;
    }
    double si = (wall - (b.self_run - a.self_run) - (b.self_wait - a.self_wait)) / wall;
    double pi = (wall - (b.peer_run - a.peer_run) - (b.peer_wait - a.peer_wait)) / wall;
    snprintf(out, cap, ",\"sender_idle_per_wall\":%.2f,\"receiver_idle_per_wall\":%.2f",
             si < 0 ? 0 : si, pi < 0 ? 0 : pi);
}

/* CPU seconds of each process between a and b, and their sum per byte
 * moved: the cost of the transfer, whatever the load on the machine. */
static void cpu_fields(char *out, size_t cap, uint64_t bytes, cpu_mark_t a, cpu_mark_t b)
{
    double s = b.self - a.self, q = b.peer - a.peer;
    snprintf(out, cap, ",\"sender_cpu_s\":%.3f,\"receiver_cpu_s\":%.3f,\"cpu_ns_per_byte\":%.3f", s,
             q, bytes ? (s + q) * 1e9 / (double)bytes : 0);
}

/* bytes per CPU-second of the busier of the two processes, in MB/s */
static double cpu_mbps(uint64_t bytes, cpu_mark_t a, cpu_mark_t b)
{
    double s = b.self - a.self, q = b.peer - a.peer;
    double busy = s > q ? s : q;
    return busy > 0 ? (double)bytes / busy / 1e6 : 0;
}

static double bench_raw(parent_t *p, int port, uint64_t bytes)
{
    struct sockaddr_in sin;
    uv_ip4_addr("127.0.0.1", port, &sin);
    uv_tcp_init(&p->loop, &p->raw);
    p->raw.data = p;
    p->raw_creq.data = p;
    uv_tcp_connect(&p->raw_creq, &p->raw, (struct sockaddr *)&sin, raw_p_connected);
    while (!p->raw_connected) uv_run(&p->loop, UV_RUN_ONCE);
    uv_tcp_nodelay(&p->raw, 1);
    uint8_t hdr[9];
    cmd(hdr, 'B', bytes);
    double t0 = ap_bench_now();
    uv_write_t *w = malloc(sizeof *w);
    w->data = p;
    uv_buf_t b = uv_buf_init((char *)hdr, 9);
    uv_write(w, (uv_stream_t *)&p->raw, &b, 1, raw_wrote);
    p->raw_inflight++;
    p->to_send = bytes;
    p->sent = 0;
    p->got_k = false;
    raw_pump(p);
    while (!p->got_k) uv_run(&p->loop, UV_RUN_ONCE);
    double dt = ap_bench_now() - t0;
    uv_close((uv_handle_t *)&p->raw, NULL);
    uv_run(&p->loop, UV_RUN_NOWAIT);
    return (double)bytes / dt / 1e6;
}

static double bench_secure(parent_t *p, uint64_t bytes)
{
    uint8_t hdr[9];
    cmd(hdr, 'B', bytes);
    double t0 = ap_bench_now();
    if (ap__tcp_send(p->conn, hdr, 9) != 0) return 0;
    p->to_send = bytes;
    p->sent = 0;
    p->got_k = false;
    secure_pump(p);
    while (!p->got_k) uv_run(&p->loop, UV_RUN_ONCE);
    return (double)bytes / (ap_bench_now() - t0) / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* n round trips with `inflight` messages outstanding; percentiles in us */
static void bench_echo(parent_t *p, int n, int inflight, double *p50, double *p99)
{
    uint8_t hdr[9], msg[ECHO_MSG];
    memset(msg, 'e', sizeof msg);
    cmd(hdr, 'E', (uint64_t)n * ECHO_MSG);
    (void)ap__tcp_send(p->conn, hdr, 9);
    double *lat = malloc(sizeof(double) * (size_t)n);
    double *start = malloc(sizeof(double) * (size_t)n);
    p->echo_rx = 0;
    int issued = 0, done = 0;
    while (done < n) {
        while (issued < n && issued - done < inflight) {
            start[issued] = ap_bench_now();
            (void)ap__tcp_send(p->conn, msg, sizeof msg);
            issued++;
        }
        uv_run(&p->loop, UV_RUN_ONCE);
        double now = ap_bench_now();
        while (done < n && p->echo_rx >= (uint64_t)(done + 1) * ECHO_MSG) {
            lat[done] = (now - start[done]) * 1e6;
            done++;
        }
    }
    qsort(lat, (size_t)n, sizeof *lat, cmp_double);
    *p50 = lat[n / 2];
    *p99 = lat[(size_t)((double)n * 0.99)];
    free(lat);
    free(start);
}

static double thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Single-core seal throughput per CPU-second of this thread (so other jobs
 * on the machine do not lower the ceiling). */
static double aead_ceiling(double seconds)
{
    static uint8_t buf[65536 + AP_NOISE_TAGLEN];
    ap_noise_cs_t cs = {.has_key = true};
    randombytes_buf(cs.k, sizeof cs.k);
    uint64_t bytes = 0;
    double t0 = thread_cpu(), t;
    do {
        for (int i = 0; i < 16; i++) {
            (void)ap__noise_cs_encrypt(&cs, NULL, 0, buf, 65536, buf);
            bytes += 65536;
        }
        t = thread_cpu();
    } while (t - t0 < seconds);
    return (double)bytes / (t - t0) / 1e6;
}

/* Single-core open (verify + decrypt) of 64 KiB messages per CPU-second of
 * this thread: the receiver's share of the crypto. */
static double aead_open_rate(double seconds)
{
    static uint8_t ct[65536 + AP_NOISE_TAGLEN], out[65536];
    ap_noise_cs_t tx = {.has_key = true};
    randombytes_buf(tx.k, sizeof tx.k);
    ap_noise_cs_t rx = tx;
    (void)ap__noise_cs_encrypt(&tx, NULL, 0, ct, 65536, ct);
    uint64_t bytes = 0;
    double t0 = thread_cpu(), t;
    do {
        for (int i = 0; i < 16; i++) {
            rx.n = 0; /* the same message again: out of place, ct stays valid */
            if (ap__noise_cs_decrypt(&rx, NULL, 0, ct, sizeof ct, out) != 0) return 0;
            bytes += 65536;
        }
        t = thread_cpu();
    } while (t - t0 < seconds);
    return (double)bytes / (t - t0) / 1e6;
}

static size_t heap_used(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

static void idle_child(const char *addr, size_t n)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    ap_tcp_cfg_t cfg = {.max_conns = 2, .read_buf_size = 4096};
    ap_tcp_cbs_t cbs = {0};
    parent_t q;
    memset(&q, 0, sizeof q);
    for (size_t i = 0; i < n; i++) {
        ap_identity_t idi;
        ap_tcp_t *t;
        if (ap_identity_generate(&idi) != 0 || ap__tcp_new(&loop, &idi, &cfg, &cbs, &q, &t) != 0)
            _exit(1);
        int rc = ap__tcp_dial(t, addr, 30000, p_dial_cb, &q);
        if (rc) { /* refused before dialing: no callback comes */
            q.dials_done++;
            q.dial_status = rc;
        }
        /* a few at a time: the listener admits at most 16 handshakes in
         * progress per remote IP (base/admit.c hs_per_ip) and drops the rest */
        if (i % 8 == 7)
            while (q.dials_done < (int)i + 1) uv_run(&loop, UV_RUN_ONCE);
        if (q.dial_status) { /* say why the bench will miss connections */
            fprintf(stderr, "bench transport: idle dialer: connection %zu failed: %s\n", i + 1,
                    ap_strerror(q.dial_status));
            break;
        }
    }
    uv_run(&loop, UV_RUN_DEFAULT); /* until killed */
    _exit(0);
}

static double idle_bench(uv_loop_t *loop, const ap_identity_t *id, size_t n)
{
    /* room beyond the admission's slots reserved for outbound and known
     * peers (64 + 64), or it evicts idle connections for the last newcomers */
    ap_tcp_cfg_t cfg = {.max_conns = n + 256, .max_handshakes = n + 16, .conns_per_ip = n + 256};
    ap_tcp_cbs_t cbs = {0};
    ap_tcp_t *t;
    if (ap__tcp_new(loop, id, &cfg, &cbs, NULL, &t) != 0) return -1;
    if (ap__tcp_listen(t, "/ip4/127.0.0.1/tcp/0") != 0) return -1;
    ap_multiaddr_t ma;
    ap__tcp_listen_addrs(t, &ma, 1);
    char addr[AP_MA_TEXT_MAX];
    ap_multiaddr_print(&ma, addr, sizeof addr);
    uv_run(loop, UV_RUN_NOWAIT);
    size_t h0 = heap_used();
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) idle_child(addr, n);
    ap_tcp_stats_t st;
    double deadline = ap_bench_now() + 120;
    do {
        uv_run(loop, UV_RUN_ONCE);
        ap__tcp_get_stats(t, &st);
    } while (st.open < n && ap_bench_now() < deadline);
    /* let quiet buffers be released */
    double until = ap_bench_now() + 1.5;
    while (ap_bench_now() < until) uv_run(loop, UV_RUN_ONCE);
    size_t h1 = heap_used();
    ap__tcp_get_stats(t, &st);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ap__tcp_close(t, NULL, NULL);
    uv_run(loop, UV_RUN_DEFAULT);
    if (st.open < n) {
        struct rlimit rl = {0};
        getrlimit(RLIMIT_NOFILE, &rl);
        fprintf(stderr,
                "bench transport: only %u of %zu idle connections opened (handshaking %u, "
                "handshakes ok %llu, failed %llu, refused by limits %llu, evicted %llu, "
                "duplicates closed %llu; open files limit %llu)\n",
                st.open, n, st.handshaking, (unsigned long long)st.handshakes_ok,
                (unsigned long long)st.handshakes_failed, (unsigned long long)st.refused_open,
                (unsigned long long)st.evicted_idle, (unsigned long long)st.dup_closed,
                (unsigned long long)rl.rlim_cur);
        return -1;
    }
    return ((double)h1 - (double)h0) / (double)n;
}

/* ---- the mux over TCP between two processes ------------------------------------
 * The child runs a node (host + node listening on 127.0.0.1 TCP) with an RPC
 * echo and a stream sink; the parent's node dials it. Everything travels
 * through runtime/uv's mux over this transport: what a protocol sees. */

#define MUX_ECHO "/bench/echo/1"
#define MUX_SINK "/bench/sink/1"

static void m_echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    ap_rpc_respond(req, d, n);
}

static void m_sink_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    (void)arg;
    (void)d;
    (void)n;
}

static void m_sink_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}

static int m_sink_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                         const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)arg;
    (void)peer;
    (void)hello;
    (void)len;
    static const ap_stream_cbs_t cbs = {.on_msg = m_sink_msg, .on_end = m_sink_end};
    ap_stream_set_cbs(s, &cbs, NULL);
    return 0;
}

static void mux_child(int fd)
{
    ap_host_t *h = ap_host_new();
    ap_rt_t *n;
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
    if (!h || ap_node_new(h, &o, &n) < 0) _exit(1);
    ap_rt_rpc_register(n, MUX_ECHO, 0, m_echo, NULL);
    ap_stream_opts_t so = {.window = 1u << 20};
    ap_rt_stream_listen(n, MUX_SINK, &so, m_sink_accept, NULL);
    char a[1][AP_RT_ADDR_MAX];
    ap_rt_listen_addrs(n, a, 1, true);
    size_t len = strlen(a[0]);
    a[0][len] = '\n';
    if (write(fd, a[0], len + 1) != (ssize_t)(len + 1)) _exit(1);
    close(fd);
    for (;;) ap_host_run_until(h, NULL, NULL, 1000000); /* until killed */
}

typedef struct mb {
    ap_rt_t *rt;
    ap_peer_id_t peer;
    int dial_status, dialed;
    /* bulk */
    size_t total, sent, msg;
    bool closed;
    int close_status;
    /* rpc */
    int left, inflight, done;
    double *lat, *start;
    int *slot_of;
    /* streams */
    int nclosed;
    double t0, *close_at;
} mb_t;

static uint8_t mux_msg_buf[1u << 20];

static void mb_dialed(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    (void)rt;
    mb_t *m = arg;
    m->dial_status = status;
    m->dialed = 1;
    if (status == 0) m->peer = *peer;
}

static bool mb_dialed_p(void *arg)
{
    return ((mb_t *)arg)->dialed;
}

static void mb_fill(ap_stream_t *s, void *arg)
{
    mb_t *m = arg;
    while (m->sent < m->total) {
        if (ap_stream_send(s, mux_msg_buf, m->msg) != 0) return;
        m->sent += m->msg;
    }
    ap_stream_close(s);
}

static void mb_closed(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    mb_t *m = arg;
    m->closed = true;
    m->close_status = st;
}

static bool mb_closed_p(void *arg)
{
    return ((mb_t *)arg)->closed;
}

typedef struct mcall {
    mb_t *m;
    int idx;
} mcall_t;

static void mb_issue(mb_t *m, mcall_t *slot);
static void mb_rpc_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                        const char *errmsg)
{
    (void)rt;
    (void)resp;
    (void)len;
    (void)errmsg;
    mcall_t *c = arg;
    mb_t *m = c->m;
    m->inflight--;
    if (status == 0) m->lat[m->done++] = (ap_bench_now() - m->start[c->idx]) * 1e6;
    if (m->left > 0) mb_issue(m, c);
}

static void mb_issue(mb_t *m, mcall_t *slot)
{
    m->left--;
    m->inflight++;
    m->start[slot->idx] = ap_bench_now();
    static const uint8_t req[64] = {1};
    ap_rpc_opts_t o = {.timeout_us = 10000000};
    if (!ap_rt_rpc_call(m->rt, &m->peer, MUX_ECHO, req, sizeof req, &o, mb_rpc_done, slot))
        m->inflight--;
}

static bool mb_rpc_p(void *arg)
{
    mb_t *m = arg;
    return m->left == 0 && m->inflight == 0;
}

static void mux_rpc(ap_host_t *h, mb_t *m, int n, int callers, double *p50, double *p99)
{
    m->lat = calloc((size_t)n, sizeof *m->lat);
    m->start = calloc((size_t)callers, sizeof *m->start);
    mcall_t *slots = calloc((size_t)callers, sizeof *slots);
    m->left = n;
    m->done = 0;
    for (int i = 0; i < callers; i++) {
        slots[i] = (mcall_t){m, i};
        mb_issue(m, &slots[i]);
    }
    ap_host_run_until(h, mb_rpc_p, m, 60000000);
    qsort(m->lat, (size_t)m->done, sizeof *m->lat, cmp_double);
    *p50 = m->done ? m->lat[m->done / 2] : 0;
    *p99 = m->done ? m->lat[(size_t)((double)m->done * 0.99)] : 0;
    free(m->lat);
    free(m->start);
    free(slots);
}

typedef struct sfair {
    mb_t *m;
    int idx;
    size_t sent, total;
} sfair_t;

static void sf_fill(ap_stream_t *s, void *arg)
{
    sfair_t *f = arg;
    while (f->sent < f->total) {
        size_t n = f->total - f->sent < 16384 ? f->total - f->sent : 16384;
        if (ap_stream_send(s, mux_msg_buf, n) != 0) return;
        f->sent += n;
    }
    ap_stream_close(s);
}

static void sf_closed(ap_stream_t *s, void *arg, int st)
{
    (void)s;
    (void)st;
    sfair_t *f = arg;
    f->m->close_at[f->idx] = ap_bench_now();
    f->m->nclosed++;
}

static bool sf_all_p(void *arg)
{
    return ((mb_t *)arg)->nclosed >= 1000;
}

/* One runtime.h stream of m->total bytes in 64 KiB messages from this
 * process to the child's sink over m's connection; reported with "layer". */
static void one_stream(ap_bench_ctx_t *ctx, ap_host_t *h, mb_t *m, pid_t pid, const char *layer,
                       double aead, double raw, double bound)
{
    m->total = ctx->quick ? (64u << 20) : (512u << 20);
    m->sent = 0;
    m->closed = false;
    m->msg = 64u << 10;
    static const ap_stream_cbs_t cbs = {.on_writable = mb_fill, .on_close = mb_closed};
    ap_stream_opts_t so = {.window = 4u << 20};
    ap_stream_t *s;
    double t0 = ap_bench_now();
    cpu_mark_t c0 = cpu_mark(pid);
    if (ap_rt_stream_open(m->rt, &m->peer, MUX_SINK, NULL, 0, &so, &cbs, m, &s) != 0) return;
    mb_fill(s, m);
    ap_host_run_until(h, mb_closed_p, m, 120000000);
    double wall = ap_bench_now() - t0;
    if (!m->closed || m->close_status != 0) {
        fprintf(stderr, "bench transport: the %s stream did not finish: %s\n", layer,
                m->closed ? ap_strerror(m->close_status) : "timed out");
        return;
    }
    double mbps = (double)m->total / wall / 1e6;
    cpu_mark_t c1 = cpu_mark(pid);
    double mcpu = cpu_mbps(m->total, c0, c1);
    char f[384], idle[128], cpuf[128], base[192];
    idle_fields(idle, sizeof idle, c0, c1);
    cpu_fields(cpuf, sizeof cpuf, m->total, c0, c1);
    snprintf(f, sizeof f,
             "\"layer\":\"%s\",\"sender_cpu_per_wall\":%.2f,"
             "\"receiver_cpu_per_wall\":%.2f%s%s",
             layer, (c1.self - c0.self) / wall, (c1.peer - c0.peer) / wall, idle, cpuf);
    ap_bench_report(ctx, "encrypted_stream_wall_s", wall, "s", f);
    snprintf(base, sizeof base,
             "\"baseline_metric\":\"aead_seal_MBps\",\"layer\":\"%s\","
             "\"per\":\"cpu_second_of_busier_process\"",
             layer);
    ap_bench_report_vs(ctx, "encrypted_stream_cpu_MBps", mcpu, "MB/s", aead, base);
    static const char *const bases[3] = {"aead_seal_MBps", "raw_tcp_MBps",
                                         "encrypted_stream_bound_MBps"};
    const double vals[3] = {aead, raw, bound};
    for (int i = 0; i < 3; i++) {
        snprintf(base, sizeof base,
                 "\"baseline_metric\":\"%s\",\"layer\":\"%s\",\"procs\":2,"
                 "\"msg_bytes\":65536",
                 bases[i], layer);
        ap_bench_report_vs(ctx, "encrypted_stream_MBps", mbps, "MB/s", vals[i], base);
    }
}

static void bench_mux_tcp(ap_bench_ctx_t *ctx, double aead, double raw, double bound)
{
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_t pid = fork();
    if (pid < 0) return;
    if (pid == 0) {
        close(fds[0]);
        mux_child(fds[1]);
    }
    close(fds[1]);
    char addr[AP_RT_ADDR_MAX + 1] = {0};
    size_t got = 0;
    while (got < sizeof addr - 1) {
        ssize_t r = read(fds[0], addr + got, sizeof addr - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        if (memchr(addr, '\n', got)) break;
    }
    close(fds[0]);
    char *nl = strchr(addr, '\n');
    if (nl) *nl = 0;
    ap_host_t *h = ap_host_new();
    mb_t m;
    memset(&m, 0, sizeof m);
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
    if (!nl || !h || ap_node_new(h, &o, &m.rt) < 0) goto out;
    ap_rt_dial(m.rt, addr, 10000000, mb_dialed, &m);
    ap_host_run_until(h, mb_dialed_p, &m, 15000000);
    if (m.dial_status != 0) {
        fprintf(stderr, "bench transport: node dial failed: %s\n", ap_strerror(m.dial_status));
        goto out;
    }
    /* (a) one stream through the mux */
    one_stream(ctx, h, &m, pid, "mux", aead, raw, bound);
    /* (a') the same runtime.h stream over a libp2p connection with yamux
     * (a second, dial-only node: libp2p Noise, each stream a yamux stream) */
    {
        mb_t y;
        memset(&y, 0, sizeof y);
        ap_node_opts_t yo = {.dial_only = true};
        if (ap_node_new(h, &yo, &y.rt) == 0 && ap_node_set_wire(y.rt, AP_NODE_WIRE_YAMUX) == 0) {
            ap_rt_dial(y.rt, addr, 10000000, mb_dialed, &y);
            ap_host_run_until(h, mb_dialed_p, &y, 15000000);
            if (y.dial_status == 0)
                one_stream(ctx, h, &y, pid, "yamux", aead, raw, bound);
            else
                fprintf(stderr, "bench transport: yamux dial failed: %s\n",
                        ap_strerror(y.dial_status));
        }
        if (y.rt) ap_node_free(y.rt);
    }
    /* (d) unary RPC round trips */
    double p50, p99;
    int n = ctx->quick ? 2000 : 20000;
    mux_rpc(h, &m, n / 10, 1, &p50, &p99); /* warm-up */
    mux_rpc(h, &m, n, 1, &p50, &p99);
    ap_bench_report(ctx, "rpc_rtt_p50_us", p50, "us", "\"callers\":1,\"req_bytes\":64");
    ap_bench_report(ctx, "rpc_rtt_p99_us", p99, "us", "\"callers\":1,\"req_bytes\":64");
    mux_rpc(h, &m, n, 64, &p50, &p99);
    ap_bench_report(ctx, "rpc_rtt_p50_us", p50, "us", "\"callers\":64,\"req_bytes\":64");
    ap_bench_report(ctx, "rpc_rtt_p99_us", p99, "us", "\"callers\":64,\"req_bytes\":64");
    /* (e) 1,000 concurrent streams, each the same number of bytes: total
     * throughput, and fairness = slowest / fastest per-stream rate */
    size_t per = ctx->quick ? (32u << 10) : (256u << 10);
    sfair_t *fs = calloc(1000, sizeof *fs);
    m.close_at = calloc(1000, sizeof *m.close_at);
    m.nclosed = 0;
    static const ap_stream_cbs_t fcbs = {.on_writable = sf_fill, .on_close = sf_closed};
    ap_stream_opts_t fo = {.window = 64u << 10};
    double t0 = ap_bench_now();
    int opened = 0;
    for (int i = 0; i < 1000; i++) {
        fs[i] = (sfair_t){&m, i, 0, per};
        ap_stream_t *fsx;
        if (ap_rt_stream_open(m.rt, &m.peer, MUX_SINK, NULL, 0, &fo, &fcbs, &fs[i], &fsx) != 0)
            break;
        opened++;
        sf_fill(fsx, &fs[i]);
    }
    if (opened == 1000 && ap_host_run_until(h, sf_all_p, &m, 120000000)) {
        double tmax = 0, rmin = 1e300, rmax = 0;
        for (int i = 0; i < 1000; i++) {
            double dt = m.close_at[i] - t0;
            double r = (double)per / dt;
            if (dt > tmax) tmax = dt;
            if (r < rmin) rmin = r;
            if (r > rmax) rmax = r;
        }
        char fields[96];
        snprintf(fields, sizeof fields, "\"streams\":1000,\"bytes_per_stream\":%zu", per);
        ap_bench_report(ctx, "streams1000_MBps", 1000.0 * (double)per / tmax / 1e6, "MB/s", fields);
        ap_bench_report(ctx, "streams1000_fairness", rmin / rmax, "ratio", fields);
    } else {
        fprintf(stderr, "bench transport: 1000 streams did not finish (%d opened, %d closed)\n",
                opened, m.nclosed);
    }
    free(fs);
    free(m.close_at);
out:
    if (h) ap_host_free(h);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

static void report_idle(ap_bench_ctx_t *ctx, double per_conn, size_t n)
{
    if (per_conn < 0) return;
    char fields[96];
    snprintf(fields, sizeof fields, "\"connections\":%zu", n);
    ap_bench_report(ctx, "idle_conn_bytes", per_conn, "B", fields);
}

static int bench_transport(ap_bench_ctx_t *ctx, int argc, char **argv)
{
    if (sodium_init() < 0) return 1;
    /* the idle part holds one descriptor per connection in each process */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
    uint64_t bulk = ctx->quick ? (32u << 20) : (512u << 20);
    int echo_n = ctx->quick ? 2000 : 20000;
    size_t idle_n = ctx->quick ? 200 : 10000;
    bool idle_only = false;
    for (int k = 1; k < argc; k++) { /* argv[0] is the bench name */
        if (!strcmp(argv[k], "--idle-only"))
            idle_only = true;
        else if (!strcmp(argv[k], "--connections") && k + 1 < argc && atol(argv[k + 1]) > 0)
            idle_n = (size_t)atol(argv[++k]);
        else {
            fprintf(stderr, "bench transport: unknown option %s (--idle-only, --connections N)\n",
                    argv[k]);
            return 2;
        }
    }
    if (idle_only) {
        uv_loop_t loop;
        uv_loop_init(&loop);
        ap_identity_t id;
        ap_identity_generate(&id);
        double per_conn = idle_bench(&loop, &id, idle_n);
        uv_loop_close(&loop);
        report_idle(ctx, per_conn, idle_n);
        return per_conn < 0 ? 1 : 0;
    }
    int fds[2];
    if (pipe(fds) != 0) return 1;
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        close(fds[0]);
        run_child(fds[1], idle_n);
    }
    close(fds[1]);
    char line[AP_MA_TEXT_MAX + 16] = {0};
    size_t got = 0;
    while (got < sizeof line - 1) {
        ssize_t r = read(fds[0], line + got, sizeof line - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        if (memchr(line, '\n', got)) break;
    }
    close(fds[0]);
    char addr[AP_MA_TEXT_MAX];
    int raw_port = 0;
    if (sscanf(line, "%383s %d", addr, &raw_port) != 2) {
        fprintf(stderr, "bench transport: child did not start\n");
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return 1;
    }

    /* (c) first, on an otherwise idle process */
    double aead = aead_ceiling(ctx->quick ? 0.2 : 1.0);
    char impl_extra[128];
    snprintf(impl_extra, sizeof impl_extra,
             "\"msg_bytes\":65536,\"cores\":1,\"per\":\"cpu_second\",\"impl\":\"%s\"",
             ap__aead_impl());
    ap_bench_report(ctx, "aead_seal_MBps", aead, "MB/s", impl_extra);
    if (strcmp(ap__aead_impl(), "libsodium") != 0 && ap__aead_use_openssl(false)) {
        /* The fallback implementation, for reference; then back to the default. */
        double sodium = aead_ceiling(ctx->quick ? 0.2 : 1.0);
        (void)ap__aead_use_openssl(true);
        ap_bench_report_vs(ctx, "aead_seal_libsodium_MBps", sodium, "MB/s", aead,
                           "\"msg_bytes\":65536,\"cores\":1,\"per\":\"cpu_second\","
                           "\"baseline_metric\":\"aead_seal_MBps\"");
    }

    parent_t p;
    memset(&p, 0, sizeof p);
    uv_loop_init(&p.loop);
    ap_identity_t id;
    ap_identity_generate(&id);
    ap_tcp_cfg_t cfg = {
        .max_conns = idle_n + 16, .conns_per_ip = idle_n + 16, .write_queue_max = 8u << 20};
    ap_tcp_cbs_t cbs = {NULL, p_on_data, p_on_writable, NULL, NULL};
    if (ap__tcp_new(&p.loop, &id, &cfg, &cbs, &p, &p.t) != 0) return 1;

    double open_rate = aead_open_rate(ctx->quick ? 0.2 : 1.0);
    ap_bench_report(ctx, "aead_open_MBps", open_rate, "MB/s",
                    "\"msg_bytes\":65536,\"cores\":1,\"per\":\"cpu_second\"");

    cpu_mark_t c0 = cpu_mark(pid);
    double raw = bench_raw(&p, raw_port, bulk);
    cpu_mark_t c1 = cpu_mark(pid);
    ap_bench_report(ctx, "raw_tcp_MBps", raw, "MB/s", "\"procs\":2");
    double raw_cpu = cpu_mbps(bulk, c0, c1);
    ap_bench_report(ctx, "raw_tcp_cpu_MBps", raw_cpu, "MB/s",
                    "\"procs\":2,\"per\":\"cpu_second_of_busier_process\"");

    /* The ceiling two cores allow: the sender seals every byte and sends it
     * over TCP, the receiver receives and opens it; each side on its own
     * core, the stream can go no faster than the slower side's CPU cost per
     * byte (crypto + that side's TCP cost, measured just above). */
    double seal_ns = aead > 0 ? 1e3 / aead : 0, open_ns = open_rate > 0 ? 1e3 / open_rate : 0;
    double tx_ns = (c1.self - c0.self) * 1e9 / (double)bulk;
    double rx_ns = (c1.peer - c0.peer) * 1e9 / (double)bulk;
    double side_tx = seal_ns + tx_ns, side_rx = open_ns + rx_ns;
    double bound = 1e3 / (side_tx > side_rx ? side_tx : side_rx);
    char bfields[320];
    snprintf(bfields, sizeof bfields,
             "\"cores\":2,\"seal_ns_per_byte\":%.3f,\"open_ns_per_byte\":%.3f,"
             "\"tcp_send_ns_per_byte\":%.3f,\"tcp_recv_ns_per_byte\":%.3f,"
             "\"ratio_to_aead\":%.3f,\"ratio_to_raw_tcp\":%.3f",
             seal_ns, open_ns, tx_ns, rx_ns, bound / aead, raw > 0 ? bound / raw : 0);
    ap_bench_report(ctx, "encrypted_stream_bound_MBps", bound, "MB/s", bfields);

    ap__tcp_dial(p.t, addr, 5000, p_dial_cb, &p);
    while (!p.dials_done) uv_run(&p.loop, UV_RUN_ONCE);
    if (p.dial_status != 0) {
        fprintf(stderr, "bench transport: dial failed: %s\n", ap_strerror(p.dial_status));
        return 1;
    }
    c0 = cpu_mark(pid);
    double enc = bench_secure(&p, bulk);
    c1 = cpu_mark(pid);
    double enc_cpu = cpu_mbps(bulk, c0, c1);
    {
        /* how much of the wall time each process was on a core: near 1.0
         * for both means the two cores were ours; less means other jobs (or
         * waiting for the other side) held the stream back */
        double wall = enc > 0 ? (double)bulk / (enc * 1e6) : 0;
        char f[384], idle[128], cpuf[128];
        idle_fields(idle, sizeof idle, c0, c1);
        cpu_fields(cpuf, sizeof cpuf, bulk, c0, c1);
        snprintf(f, sizeof f,
                 "\"layer\":\"transport\",\"sender_cpu_per_wall\":%.2f,"
                 "\"receiver_cpu_per_wall\":%.2f%s%s",
                 wall > 0 ? (c1.self - c0.self) / wall : 0,
                 wall > 0 ? (c1.peer - c0.peer) / wall : 0, idle, cpuf);
        ap_bench_report(ctx, "encrypted_stream_wall_s", wall, "s", f);
    }
    ap_bench_report_vs(ctx, "encrypted_stream_MBps", enc, "MB/s", aead,
                       "\"baseline_metric\":\"aead_seal_MBps\",\"layer\":\"transport\"");
    ap_bench_report_vs(ctx, "encrypted_stream_MBps", enc, "MB/s", raw,
                       "\"baseline_metric\":\"raw_tcp_MBps\",\"layer\":\"transport\"");
    ap_bench_report_vs(
        ctx, "encrypted_stream_MBps", enc, "MB/s", bound,
        "\"baseline_metric\":\"encrypted_stream_bound_MBps\",\"layer\":\"transport\"");
    ap_bench_report_vs(ctx, "encrypted_stream_cpu_MBps", enc_cpu, "MB/s", aead,
                       "\"baseline_metric\":\"aead_seal_MBps\",\"layer\":\"transport\","
                       "\"per\":\"cpu_second_of_busier_process\"");
    ap_bench_report_vs(ctx, "encrypted_stream_cpu_MBps", enc_cpu, "MB/s", raw_cpu,
                       "\"baseline_metric\":\"raw_tcp_cpu_MBps\",\"layer\":\"transport\","
                       "\"per\":\"cpu_second_of_busier_process\"");

    double p50, p99;
    bench_echo(&p, echo_n / 10, 1, &p50, &p99); /* warm-up */
    bench_echo(&p, echo_n, 1, &p50, &p99);
    ap_bench_report(ctx, "transport_echo_rtt_p50_us", p50, "us", "\"callers\":1,\"msg_bytes\":64");
    ap_bench_report(ctx, "transport_echo_rtt_p99_us", p99, "us", "\"callers\":1,\"msg_bytes\":64");
    bench_echo(&p, echo_n, 64, &p50, &p99);
    ap_bench_report(ctx, "transport_echo_rtt_p50_us", p50, "us", "\"callers\":64,\"msg_bytes\":64");
    ap_bench_report(ctx, "transport_echo_rtt_p99_us", p99, "us", "\"callers\":64,\"msg_bytes\":64");

    bench_mux_tcp(ctx, aead, raw, bound);

    /* idle connections: a second child process dials idle_n connections,
     * each from its own identity (one connection per peer), into one
     * listening transport here; the heap growth of this process per
     * connection, once quiet buffers were released, is reported (kernel
     * socket memory is not included). */
    ap__tcp_close(p.t, NULL, NULL);
    uv_run(&p.loop, UV_RUN_DEFAULT);
    report_idle(ctx, idle_bench(&p.loop, &id, idle_n), idle_n);

    /* tell the child to exit over a fresh connection */
    p.conn = NULL;
    ap__tcp_new(&p.loop, &id, &cfg, &cbs, &p, &p.t);
    p.dials_done = 0;
    ap__tcp_dial(p.t, addr, 5000, p_dial_cb, &p);
    while (!p.dials_done) uv_run(&p.loop, UV_RUN_ONCE);
    if (p.dial_status == 0) {
        (void)ap__tcp_send(p.conn, (const uint8_t *)"Q", 1);
        ap__tcp_conn_close(p.conn);
    }
    ap__tcp_close(p.t, NULL, NULL);
    uv_run(&p.loop, UV_RUN_DEFAULT);
    uv_loop_close(&p.loop);
    int status;
    for (int i = 0; i < 100 && waitpid(pid, &status, WNOHANG) == 0; i++) usleep(20000);
    if (waitpid(pid, &status, WNOHANG) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    return 0;
}

AP_BENCH(bench_transport_def, "transport", bench_transport,
         "secure TCP transport: AEAD ceiling, raw TCP, encrypted stream, echo RTT, idle memory")
