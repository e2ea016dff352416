/* Multi-process tests of the runtime over real TCP + Noise on loopback.
 *
 * The peers under test are separate processes: this binary re-executes
 * itself (/proc/self/exe) in "child mode" (argv[1] == "--child"). A child
 * loads or creates an identity key file, runs one TCP node on
 * 127.0.0.1:PORT (0 = any) and reports its full multiaddr on its stdout
 * pipe ("ADDR /ip4/127.0.0.1/tcp/N/p2p/12D3KooW...\n"); later lines report
 * events the parent waits for ("HANG" when a held RPC arrived). It serves:
 *   /t/echo/1     unary RPC: responds with the request
 *   /t/hang/1     unary RPC: never responds (the call stays in flight)
 *   /t/echo-s/1   stream: echoes every message; when its own send window is
 *                 full it pauses the incoming stream until on_writable, so
 *                 back-pressure propagates to the opener
 * Children die with the parent (PR_SET_PDEATHSIG) and after 120 s at most;
 * the teardown SIGKILLs every child still running, so a failed assertion
 * never leaves processes behind. Every wait is bounded. */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "apiary/runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define WAIT_US (20u * 1000u * 1000u) /* bound on any single wait */

/* ======================================================================
 * child mode
 * ====================================================================== */

typedef struct echo_state {
    uint8_t *pending; /* a message the window refused, sent on_writable */
    size_t plen;
} echo_state_t;

static void child_say(const char *line)
{
    size_t n = strlen(line);
    if (write(STDOUT_FILENO, line, n) != (ssize_t)n) _exit(3);
}

static void c_hang(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    (void)req; /* held until the process dies */
    child_say("HANG\n");
}

static void c_s_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    echo_state_t *e = arg;
    if (e->pending) { /* cannot happen while paused; be strict anyway */
        ap_stream_reset(s, AP_EPROTO);
        return;
    }
    int rc = ap_stream_send(s, d, n);
    if (rc == AP_EAGAIN) {
        e->pending = malloc(n ? n : 1);
        if (!e->pending) _exit(4);
        memcpy(e->pending, d, n);
        e->plen = n;
        ap_stream_pause(s, true);
    } else if (rc != 0) {
        ap_stream_reset(s, rc);
    }
}

static void c_s_writable(ap_stream_t *s, void *arg)
{
    echo_state_t *e = arg;
    if (!e->pending) return;
    int rc = ap_stream_send(s, e->pending, e->plen);
    if (rc == AP_EAGAIN) return;
    free(e->pending);
    e->pending = NULL;
    if (rc != 0) {
        ap_stream_reset(s, rc);
        return;
    }
    ap_stream_pause(s, false);
}

static void c_s_end(ap_stream_t *s, void *arg)
{
    (void)arg;
    ap_stream_close(s);
}

static void c_s_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    (void)status;
    echo_state_t *e = arg;
    free(e->pending);
    free(e);
}

static const ap_stream_cbs_t c_s_cbs = {c_s_msg, c_s_writable, c_s_end, c_s_close};

static int c_s_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                      const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)arg;
    (void)peer;
    (void)hello;
    (void)len;
    echo_state_t *e = calloc(1, sizeof *e);
    if (!e) return AP_ENOMEM;
    ap_stream_set_cbs(s, &c_s_cbs, e);
    return 0;
}

static int child_main(const char *keyfile, const char *port)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1) return 2;
    ap_log_set_level(AP_LOG_WARN);
    ap_identity_t id;
    bool created;
    if (ap_identity_load_or_create(&id, keyfile, &created) != 0) return 2;
    ap_host_t *h = ap_host_new();
    if (!h) return 2;
    char listen[64];
    snprintf(listen, sizeof listen, "/ip4/127.0.0.1/tcp/%s", port);
    ap_rt_t *rt;
    ap_node_opts_t o = {.ed25519_sk = id.sk, .listen = listen};
    if (ap_node_new(h, &o, &rt) != 0) return 2;
    ap_identity_wipe(&id);
    ap_stream_opts_t so = {.window = 64 * 1024, .max_msg = 1 << 20};
    if (ap_rt_rpc_register(rt, "/t/echo/1", 4u << 20, ap_test_rpc_echo, NULL) != 0 ||
        ap_rt_rpc_register(rt, "/t/hang/1", 0, c_hang, NULL) != 0 ||
        ap_rt_stream_listen(rt, "/t/echo-s/1", &so, c_s_accept, NULL) != 0)
        return 2;
    char addr[1][AP_RT_ADDR_MAX];
    if (ap_rt_listen_addrs(rt, addr, 1, true) != 1) return 2;
    char line[AP_RT_ADDR_MAX + 8];
    snprintf(line, sizeof line, "ADDR %s\n", addr[0]);
    child_say(line);
    ap_host_run_until(h, NULL, NULL, 120u * 1000u * 1000u);
    ap_host_free(h);
    return 0;
}

/* ======================================================================
 * parent side
 * ====================================================================== */

typedef struct child {
    pid_t pid;
    int out; /* read end of the child's stdout, non-blocking */
    char buf[1024];
    size_t len;
    char addr[AP_RT_ADDR_MAX];
    ap_peer_id_t id;
} child_t;

#define MAX_CHILDREN 8
static pid_t g_pids[MAX_CHILDREN];

static void track(pid_t p)
{
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (!g_pids[i]) {
            g_pids[i] = p;
            return;
        }
    fail_msg("too many children");
}

static void untrack(pid_t p)
{
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (g_pids[i] == p) g_pids[i] = 0;
}

static void kill_child(child_t *c)
{
    if (c->pid <= 0) return;
    kill(c->pid, SIGKILL);
    waitpid(c->pid, NULL, 0);
    untrack(c->pid);
    c->pid = 0;
    if (c->out >= 0) close(c->out);
    c->out = -1;
}

static int teardown_children(void **state)
{
    (void)state;
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (g_pids[i]) {
            kill(g_pids[i], SIGKILL);
            waitpid(g_pids[i], NULL, 0);
            g_pids[i] = 0;
        }
    ap_log_set_sink(NULL, NULL);
    return 0;
}

/* A complete line from the child, if one arrived: copied to out, true. */
static bool child_line(child_t *c, char *out, size_t cap)
{
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->len);
        if (nl) {
            size_t n = (size_t)(nl - c->buf);
            if (n >= cap) n = cap - 1;
            memcpy(out, c->buf, n);
            out[n] = 0;
            c->len -= (size_t)(nl - c->buf) + 1;
            memmove(c->buf, nl + 1, c->len);
            return true;
        }
        if (c->out < 0 || c->len == sizeof c->buf) return false;
        ssize_t r = read(c->out, c->buf + c->len, sizeof c->buf - c->len);
        if (r <= 0) return false;
        c->len += (size_t)r;
    }
}

typedef struct line_wait {
    child_t *c;
    const char *want;
} line_wait_t;

static bool got_line(void *arg)
{
    line_wait_t *w = arg;
    char l[512];
    while (child_line(w->c, l, sizeof l))
        if (strcmp(l, w->want) == 0) return true;
    return false;
}

static void spawn_child(child_t *c, const char *keyfile, const char *port)
{
    int p[2];
    assert_int_equal(pipe(p), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(p[1], STDOUT_FILENO);
        close(p[0]);
        close(p[1]);
        char *argv[] = {"test_tcp_multiproc", "--child", (char *)keyfile, (char *)port, NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(p[1]);
    track(pid);
    memset(c, 0, sizeof *c);
    c->pid = pid;
    c->out = p[0];
    fcntl(c->out, F_SETFL, fcntl(c->out, F_GETFL) | O_NONBLOCK);
    /* the address line: the child needs no loop of ours to get there */
    char l[512];
    for (int i = 0; i < 2000; i++) {
        if (child_line(c, l, sizeof l)) break;
        usleep(10 * 1000);
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            untrack(pid);
            c->pid = 0;
            fail_msg("child exited early (status %d)", st);
        }
    }
    assert_true(strncmp(l, "ADDR /ip4/127.0.0.1/tcp/", 24) == 0);
    size_t al = strnlen(l + 5, sizeof c->addr - 1);
    memcpy(c->addr, l + 5, al);
    c->addr[al] = 0;
    const char *p2p = strstr(c->addr, "/p2p/");
    assert_non_null(p2p);
    assert_ok(ap_peer_id_parse(&c->id, p2p + 5));
}

static int child_port(const child_t *c)
{
    return atoi(c->addr + strlen("/ip4/127.0.0.1/tcp/"));
}

/* ---- the parent's node ---- */

typedef struct fixture {
    ap_host_t *h;
    ap_rt_t *rt;
} fixture_t;

static void fx_init(fixture_t *f)
{
    f->h = ap_host_new();
    assert_non_null(f->h);
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0", .rng_seed = ap_test_seed(11)};
    assert_ok(ap_node_new(f->h, &o, &f->rt));
}

static void fx_free(fixture_t *f)
{
    ap_node_free(f->rt);
    assert_int_equal(ap_host_free(f->h), 0);
}

typedef struct dial_res {
    bool done;
    int status;
    ap_peer_id_t peer;
} dial_res_t;

static void on_dial(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    (void)rt;
    dial_res_t *d = arg;
    d->done = true;
    d->status = status;
    if (peer) d->peer = *peer;
}

static bool dial_done(void *arg)
{
    return ((dial_res_t *)arg)->done;
}

static void fx_dial(fixture_t *f, child_t *c)
{
    dial_res_t d = {0};
    assert_ok(ap_rt_dial(f->rt, c->addr, 10u * 1000u * 1000u, on_dial, &d));
    assert_true(ap_host_run_until(f->h, dial_done, &d, WAIT_US));
    assert_ok(d.status);
    assert_true(ap_peer_id_eq(&d.peer, &c->id));
}

typedef struct call_res {
    bool done;
    int status;
    size_t len;
    bool match;
    const uint8_t *expect;
} call_res_t;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt;
    (void)errmsg;
    call_res_t *r = arg;
    r->done = true;
    r->status = status;
    r->len = len;
    r->match = status == 0 && r->expect && memcmp(resp, r->expect, len) == 0;
}

static bool call_done(void *arg)
{
    return ((call_res_t *)arg)->done;
}

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

/* Unary echo of len bytes; asserts the round trip. */
static void echo_call(fixture_t *f, const child_t *c, size_t len, uint64_t seed)
{
    uint8_t *req = malloc(len ? len : 1);
    assert_non_null(req);
    fill(req, len, seed);
    call_res_t r = {.expect = req};
    ap_rpc_opts_t o = {.timeout_us = 10u * 1000u * 1000u, .max_resp = 4u << 20};
    assert_true(ap_rt_rpc_call(f->rt, &c->id, "/t/echo/1", req, len, &o, on_done, &r) != 0);
    assert_true(ap_host_run_until(f->h, call_done, &r, WAIT_US));
    assert_ok(r.status);
    assert_int_equal(r.len, len);
    assert_true(r.match);
    free(req);
}

/* ---- a checked echo stream ---- */

#define MSG 16384u

typedef struct estream {
    ap_stream_t *s;
    size_t window;
    uint64_t sent_msgs, recv_msgs, target_msgs, goal;
    bool paused, blocked, ended, closed, bad, max_buf_exceeded;
    int close_status;
} estream_t;

static void es_pump(estream_t *e)
{
    uint8_t m[MSG];
    while (!e->closed && (e->target_msgs == 0 || e->sent_msgs < e->target_msgs)) {
        fill(m, MSG, e->sent_msgs);
        int rc = ap_stream_send(e->s, m, MSG);
        if (rc == AP_EAGAIN) {
            e->blocked = true;
            return;
        }
        if (rc != 0) {
            e->bad = true;
            return;
        }
        if (ap_stream_buffered(e->s) > e->window) e->max_buf_exceeded = true;
        e->sent_msgs++;
    }
    if (e->target_msgs && e->sent_msgs == e->target_msgs && !e->ended) {
        e->ended = true;
        ap_stream_close(e->s);
    }
}

static void es_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    estream_t *e = arg;
    uint8_t m[MSG];
    fill(m, MSG, e->recv_msgs);
    if (n != MSG || memcmp(d, m, MSG) != 0) e->bad = true;
    e->recv_msgs++;
}

static void es_writable(ap_stream_t *s, void *arg)
{
    (void)s;
    estream_t *e = arg;
    e->blocked = false;
    es_pump(e);
}

static void es_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    estream_t *e = arg;
    e->closed = true;
    e->close_status = status;
    e->s = NULL;
}

static const ap_stream_cbs_t es_cbs = {es_msg, es_writable, NULL, es_close};

static void es_open(fixture_t *f, const child_t *c, estream_t *e, size_t window, uint64_t target)
{
    memset(e, 0, sizeof *e);
    e->window = window;
    e->target_msgs = target;
    ap_stream_opts_t o = {.window = window, .max_msg = 1 << 20};
    assert_ok(ap_rt_stream_open(f->rt, &c->id, "/t/echo-s/1", NULL, 0, &o, &es_cbs, e, &e->s));
}

static bool es_closed(void *arg)
{
    return ((estream_t *)arg)->closed;
}

static bool es_reached(void *arg)
{
    estream_t *e = arg;
    return e->closed || e->recv_msgs >= e->goal;
}

static bool es_got(void *arg)
{
    estream_t *e = arg;
    return e->closed || e->recv_msgs >= 8;
}

/* ---- log capture: lines naming one peer ---- */

typedef struct logcap {
    char needle[AP_PEER_SHORT_LEN];
    int lines;
    char last[512];
} logcap_t;

static void log_sink(void *arg, ap_log_level_t level, const char *module, const char *msg)
{
    logcap_t *lc = arg;
    if (level < AP_LOG_INFO) return;
    /* the short id is "…" + the last 8 characters: match those */
    const char *tail = lc->needle + strlen(lc->needle) - 8;
    if (strstr(msg, tail)) {
        lc->lines++;
        snprintf(lc->last, sizeof lc->last, "%s: %s", module, msg);
    }
}

static char g_dir[64];

static const char *keypath(const char *name)
{
    static char p[2][128];
    static int k;
    k ^= 1;
    snprintf(p[k], sizeof p[k], "%s/%s", g_dir, name);
    return p[k];
}

static int setup_dir(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/apiary-mp-XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    unlink(keypath("a.key"));
    unlink(keypath("b.key"));
    rmdir(g_dir);
    return 0;
}

/* ======================================================================
 * tests
 * ====================================================================== */

/* Unary RPC across processes: sizes from empty to 3 MiB (many Noise
 * messages), 64 calls in flight at once, an unknown protocol. */
static void test_unary_rpc(void **state)
{
    (void)state;
    fixture_t f;
    fx_init(&f);
    child_t a;
    spawn_child(&a, keypath("a.key"), "0");
    /* the key file was created private */
    struct stat st;
    assert_int_equal(stat(keypath("a.key"), &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_ok(ap_rt_add_addr(f.rt, &a.id, a.addr));
    static const size_t sizes[] = {0, 1, 100, 65519, 65520, 200000, 3u << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) echo_call(&f, &a, sizes[i], i);
    assert_true(ap_rt_is_connected(f.rt, &a.id));

    enum { N = 64 };
    call_res_t r[N];
    uint8_t req[N][300];
    ap_rpc_opts_t o = {.timeout_us = 10u * 1000u * 1000u};
    for (int i = 0; i < N; i++) {
        fill(req[i], sizeof req[i], 1000 + (uint64_t)i);
        r[i] = (call_res_t){.expect = req[i]};
        assert_true(ap_rt_rpc_call(f.rt, &a.id, "/t/echo/1", req[i], sizeof req[i], &o, on_done,
                                   &r[i]) != 0);
    }
    for (int i = 0; i < N; i++) {
        assert_true(ap_host_run_until(f.h, call_done, &r[i], WAIT_US));
        assert_ok(r[i].status);
        assert_true(r[i].match);
    }
    call_res_t nr = {0};
    assert_true(ap_rt_rpc_call(f.rt, &a.id, "/t/none/1", req[0], 10, &o, on_done, &nr) != 0);
    assert_true(ap_host_run_until(f.h, call_done, &nr, WAIT_US));
    assert_int_equal(nr.status, AP_ENOPROTO);

    ap_rt_stats_t s;
    ap_rt_get_stats(f.rt, &s);
    assert_int_equal(s.connections, 1); /* all calls shared one connection */
    kill_child(&a);
    fx_free(&f);
}

/* A stream through another process with flow control: the parent stops
 * reading, so the child's echo window fills, the child pauses its side, the
 * parent's window fills: the parent's sender is held at a bound whatever
 * the time allowed. Then everything arrives in order. */
static void test_stream_flow_control(void **state)
{
    (void)state;
    fixture_t f;
    fx_init(&f);
    child_t a;
    spawn_child(&a, keypath("a.key"), "0");
    fx_dial(&f, &a);
    const size_t W = 64 * 1024;
    uint64_t total = ap_test_sanitized() ? 256 : 2048; /* x 16 KiB: 4 or 32 MiB */
    estream_t e;
    es_open(&f, &a, &e, W, total);
    ap_stream_pause(e.s, true);
    es_pump(&e);
    /* let the pipeline fill; the sender must stall */
    ap_host_run_until(f.h, es_closed, &e, 500u * 1000u);
    assert_false(e.closed);
    assert_true(e.blocked);
    assert_int_equal(e.recv_msgs, 0);
    /* sent <= what the child consumed (at most its echo window + one
     * pending message) + our unacknowledged window */
    assert_true(e.sent_msgs * MSG <= W + W + MSG + W);
    uint64_t stalled_at = e.sent_msgs;
    ap_host_run_until(f.h, es_closed, &e, 300u * 1000u);
    assert_int_equal(e.sent_msgs, stalled_at); /* still held */
    ap_stream_pause(e.s, false);
    assert_true(ap_host_run_until(f.h, es_closed, &e, 60u * 1000u * 1000u));
    assert_ok(e.close_status);
    assert_false(e.bad);
    assert_false(e.max_buf_exceeded);
    assert_int_equal(e.sent_msgs, total);
    assert_int_equal(e.recv_msgs, total);
    kill_child(&a);
    fx_free(&f);
}

typedef struct kill_wait {
    call_res_t *call;
    estream_t *es;
} kill_wait_t;

static bool both_ended(void *arg)
{
    kill_wait_t *k = arg;
    return k->call->done && k->es->closed;
}

/* A peer killed with SIGKILL mid-call and mid-stream: the call ends with
 * AP_ECLOSED, the stream's on_close gets AP_ECLOSED, one log line names the
 * peer; a stream and calls to another process carry on. Then the killed
 * peer restarts from its key file on the same port and the same PeerID is
 * reached again through the address the runtime knows. */
static void test_kill_and_restart(void **state)
{
    (void)state;
    fixture_t f;
    fx_init(&f);
    child_t a, b;
    spawn_child(&a, keypath("a.key"), "0");
    spawn_child(&b, keypath("b.key"), "0");
    assert_false(ap_peer_id_eq(&a.id, &b.id));
    assert_ok(ap_rt_add_addr(f.rt, &a.id, a.addr));
    assert_ok(ap_rt_add_addr(f.rt, &b.id, b.addr));

    /* B: an unbounded echo stream that keeps flowing through the kill */
    estream_t eb;
    es_open(&f, &b, &eb, 64 * 1024, 0);
    es_pump(&eb);
    assert_true(ap_host_run_until(f.h, es_got, &eb, WAIT_US));
    assert_false(eb.closed);

    /* A: a stream with data flowing and a call its handler holds */
    estream_t ea;
    es_open(&f, &a, &ea, 64 * 1024, 0);
    es_pump(&ea);
    assert_true(ap_host_run_until(f.h, es_got, &ea, WAIT_US));
    assert_false(ea.closed);
    call_res_t hang = {0};
    ap_rpc_opts_t o = {.timeout_us = 60u * 1000u * 1000u};
    assert_true(
        ap_rt_rpc_call(f.rt, &a.id, "/t/hang/1", (const uint8_t *)"x", 1, &o, on_done, &hang) != 0);
    line_wait_t lw = {&a, "HANG"};
    assert_true(ap_host_run_until(f.h, got_line, &lw, WAIT_US));
    assert_false(hang.done);

    logcap_t lc = {0};
    ap_peer_id_short(&a.id, lc.needle);
    ap_log_level_t old = ap_log_get_level();
    ap_log_set_level(AP_LOG_INFO);
    ap_log_set_sink(log_sink, &lc);
    uint64_t b_before = eb.recv_msgs;
    int a_port = child_port(&a);
    kill_child(&a);
    kill_wait_t kw = {&hang, &ea};
    bool ended = ap_host_run_until(f.h, both_ended, &kw, WAIT_US);
    ap_log_set_sink(NULL, NULL);
    ap_log_set_level(old);
    assert_true(ended);
    assert_int_equal(hang.status, AP_ECLOSED);
    assert_int_equal(ea.close_status, AP_ECLOSED);
    if (lc.lines != 1) fail_msg("%d log lines name the killed peer (last: %s)", lc.lines, lc.last);
    assert_false(ap_rt_is_connected(f.rt, &a.id));

    /* B is untouched: its stream still flows, calls still work */
    assert_false(eb.closed);
    assert_true(ap_rt_is_connected(f.rt, &b.id));
    eb.goal = eb.recv_msgs + 64;
    assert_true(ap_host_run_until(f.h, es_reached, &eb, WAIT_US));
    assert_false(eb.closed);
    assert_true(eb.recv_msgs > b_before);
    assert_false(eb.bad);
    echo_call(&f, &b, 5000, 77);

    /* restart A from its key file on its old port: same PeerID, reached by
     * the address the runtime already knows */
    char port[16];
    snprintf(port, sizeof port, "%d", a_port);
    child_t a2;
    spawn_child(&a2, keypath("a.key"), port);
    assert_true(ap_peer_id_eq(&a2.id, &a.id));
    assert_int_equal(child_port(&a2), a_port);
    echo_call(&f, &a2, 100000, 78);
    assert_true(ap_rt_is_connected(f.rt, &a.id));

    /* finish B's stream gracefully */
    eb.target_msgs = eb.sent_msgs + 1;
    es_pump(&eb);
    assert_true(ap_host_run_until(f.h, es_closed, &eb, WAIT_US));
    assert_ok(eb.close_status);
    assert_false(eb.bad);
    assert_int_equal(eb.recv_msgs, eb.sent_msgs);
    kill_child(&a2);
    kill_child(&b);
    fx_free(&f);
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--child") == 0) return child_main(argv[2], argv[3]);
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_unary_rpc, teardown_children),
        cmocka_unit_test_teardown(test_stream_flow_control, teardown_children),
        cmocka_unit_test_teardown(test_kill_and_restart, teardown_children),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
