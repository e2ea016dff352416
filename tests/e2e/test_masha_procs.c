/* MASHA as real processes on loopback: `apiary masha server` and M = 10
 * `apiary masha worker` processes (the built CLI, $APIARY_CLI) talk TCP +
 * Noise on 127.0.0.1. The run must equal the in-process solver's run of the
 * same config (iterations, refreshes, floats and bytes per worker, final
 * distance). Negative cases: a worker given a wrong server PeerID fails with
 * a clear error (and the server is unharmed); a worker killed with SIGKILL
 * mid-run makes the server fail instead of hanging. Every child is killed by
 * the teardown if a check fails. --announce replaces the printed address. */
#include "aptest.h"

#include "apiary/identity.h"
#include "apiary/masha.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAXKIDS 16
#define OUTCAP  8192

typedef struct child {
    pid_t pid;
    int out, err; /* read ends (-1 if inherited) */
    bool reaped;
    int status;
    char obuf[OUTCAP], ebuf[OUTCAP];
    size_t olen, elen;
} child_t;

static child_t kids[MAXKIDS];
static int nkids;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Generous bounds: the machine is shared, and the sanitizer pass is slow. */
static double budget_s(void)
{
    return ap_test_sanitized() ? 300 : 60;
}

static const char *cli(void)
{
    const char *p = getenv("APIARY_CLI");
    if (!p || !*p) fail_msg("APIARY_CLI is not set (ctest sets it to the built apiary)");
    return p;
}

static child_t *spawn(const char *const *args)
{
    assert_true(nkids < MAXKIDS);
    int po[2], pe[2];
    assert_int_equal(pipe2(po, O_CLOEXEC), 0);
    assert_int_equal(pipe2(pe, O_CLOEXEC), 0);
    char *argv[48];
    int n = 0;
    argv[n++] = (char *)cli();
    for (; args[n - 1]; n++) {
        assert_true(n < 47);
        argv[n] = (char *)args[n - 1];
    }
    argv[n] = NULL;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(po[1], 1);
        dup2(pe[1], 2);
        execv(argv[0], argv);
        _exit(127);
    }
    close(po[1]);
    close(pe[1]);
    child_t *c = &kids[nkids++];
    memset(c, 0, sizeof *c);
    c->pid = pid;
    c->out = po[0];
    c->err = pe[0];
    fcntl(c->out, F_SETFL, O_NONBLOCK);
    fcntl(c->err, F_SETFL, O_NONBLOCK);
    return c;
}

/* Reads what is available from fd into buf; closes fd at EOF. */
static void drain(int *fd, char *buf, size_t *len)
{
    while (*fd >= 0) {
        char tmp[1024];
        ssize_t r = read(*fd, tmp, sizeof tmp);
        if (r > 0) {
            size_t k = (size_t)r;
            if (k > OUTCAP - 1 - *len) k = OUTCAP - 1 - *len;
            memcpy(buf + *len, tmp, k);
            *len += k;
            buf[*len] = '\0';
            continue;
        }
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
        close(*fd);
        *fd = -1;
    }
}

static void pump(void)
{
    for (int i = 0; i < nkids; i++) {
        drain(&kids[i].out, kids[i].obuf, &kids[i].olen);
        drain(&kids[i].err, kids[i].ebuf, &kids[i].elen);
        if (!kids[i].reaped && waitpid(kids[i].pid, &kids[i].status, WNOHANG) == kids[i].pid)
            kids[i].reaped = true;
    }
}

/* Waits until pred(c) or the deadline; pumps every child meanwhile. */
static bool wait_for(child_t *c, bool (*pred)(child_t *c, const void *arg), const void *arg,
                     double secs)
{
    double end = now_s() + secs;
    for (;;) {
        pump();
        if (pred(c, arg)) return true;
        if (now_s() > end) return false;
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static bool has_line(child_t *c, const void *arg)
{
    (void)arg;
    return strchr(c->obuf, '\n') != NULL || c->reaped;
}
static bool exited(child_t *c, const void *arg)
{
    (void)arg;
    if (!c->reaped) return false;
    pump(); /* collect the rest of its output */
    return true;
}
static bool err_has(child_t *c, const void *arg)
{
    return strstr(c->ebuf, arg) != NULL || c->reaped;
}

static int exit_code(const child_t *c)
{
    return WIFEXITED(c->status) ? WEXITSTATUS(c->status) : 128 + WTERMSIG(c->status);
}

static void expect_exit(child_t *c, int code)
{
    if (!wait_for(c, exited, NULL, budget_s()))
        fail_msg("child %d did not exit within %g s; stderr:\n%s", (int)c->pid, budget_s(),
                 c->ebuf);
    for (int i = 0; i < 50 && (c->out >= 0 || c->err >= 0); i++) pump();
    if (exit_code(c) != code)
        fail_msg("child %d exited %d, expected %d; stdout:\n%s\nstderr:\n%s", (int)c->pid,
                 exit_code(c), code, c->obuf, c->ebuf);
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < nkids; i++) {
        if (!kids[i].reaped) {
            kill(kids[i].pid, SIGKILL);
            waitpid(kids[i].pid, &kids[i].status, 0);
        }
        if (kids[i].out >= 0) close(kids[i].out);
        if (kids[i].err >= 0) close(kids[i].err);
    }
    nkids = 0;
    return 0;
}

/* The server's first stdout line: its multiaddr. */
static void server_addr(child_t *s, char *addr, size_t cap)
{
    if (!wait_for(s, has_line, NULL, budget_s()) || s->reaped)
        fail_msg("server printed no address; stderr:\n%s", s->ebuf);
    const char *nl = strchr(s->obuf, '\n');
    size_t n = (size_t)(nl - s->obuf);
    assert_true(n < cap);
    memcpy(addr, s->obuf, n);
    addr[n] = '\0';
    assert_non_null(strstr(addr, "/ip4/127.0.0.1/tcp/"));
    assert_non_null(strstr(addr, "/p2p/12D3KooW"));
}

/* The JSON summary: the last non-empty line of stdout. */
static const char *summary(const child_t *c)
{
    const char *p = strrchr(c->obuf, '{');
    if (!p) fail_msg("no JSON summary in:\n%s", c->obuf);
    return p;
}

static uint64_t jnum(const char *js, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(js, k);
    if (!p) fail_msg("no %s in %s", key, js);
    return strtoull(p + strlen(k), NULL, 10);
}

static double jdouble(const char *js, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(js, k);
    if (!p) fail_msg("no %s in %s", key, js);
    return strtod(p + strlen(k), NULL);
}

static void check_summary(const char *js, const ap_masha_result_t *ref)
{
    assert_non_null(strstr(js, "\"converged\":true"));
    assert_int_equal(jnum(js, "iterations"), ref->iters);
    assert_int_equal(jnum(js, "refreshes"), ref->refreshes);
    assert_int_equal(jnum(js, "floats_per_worker"), ref->floats_up);
    assert_int_equal(jnum(js, "bytes_per_worker"), ref->bytes_up);
    assert_int_equal(jnum(js, "bytes_down_per_worker"), ref->bytes_down);
    double d = jdouble(js, "rel_dist2");
    assert_true(d <= 1e-6);
    assert_true(d >= ref->rel_dist2 * (1 - 1e-5) && d <= ref->rel_dist2 * (1 + 1e-5));
}

#define M 10

/* server_wire 1 or 2: the server serves only /apiary/masha/1 (as one built
 * before version 2), or versions up to 2 (built before version 3); the
 * workers step down to it over TCP + Noise and the run is that version's
 * run. */
static void run_ten(const char *method, double gamma, double frac, double sfrac, int server_wire)
{
    uint64_t cseed = ap_test_seed(7);
    ap_masha_bilinear_cfg_t pc = {.n = 50, .workers = M, .lambda = 0.05, .h = 0.1, .seed = 2021};
    ap_masha_opts_t o = {.method = !strcmp(method, "masha1")   ? AP_MASHA_1
                                   : !strcmp(method, "masha2") ? AP_MASHA_2
                                                               : AP_MASHA_EXTRAGRADIENT,
                         .gamma = gamma,
                         .fraction = frac,
                         .server_fraction = sfrac,
                         .seed = cseed,
                         .max_iters = 100000,
                         .target = 1e-6,
                         .wire = server_wire};
    ap_masha_problem_t *p = ap_masha_bilinear_new(&pc);
    assert_non_null(p);
    ap_masha_result_t ref;
    assert_ok(ap_masha_run(p, &o, &ref));
    assert_true(ref.converged);
    assert_int_equal(ref.bytes_up, ap_masha_upload_bytes(p, &o, ref.iters, ref.refreshes));
    ap_masha_problem_free(p);

    char g[32], f[32], sf[32], cs[32], to[32], idx[M][8], wv[8];
    snprintf(wv, sizeof wv, "%d", server_wire);
    snprintf(g, sizeof g, "%.17g", gamma);
    snprintf(f, sizeof f, "%.17g", frac);
    snprintf(sf, sizeof sf, "%.17g", sfrac);
    snprintf(cs, sizeof cs, "%llu", (unsigned long long)cseed);
    snprintf(to, sizeof to, "%g", budget_s());
#define COMMON                                                                                     \
    "--workers", "10", "--dim", "50", "--lambda", "0.05", "--h", "0.1", "--seed", "2021",          \
        "--method", method, "--gamma", g, "--fraction", f, "--server-fraction", sf,                \
        "--compress-seed", cs, "--timeout", to
    const char *sargs[] = {"masha",    "server",
                           "--listen", "/ip4/127.0.0.1/tcp/0",
                           COMMON,     server_wire ? "--wire" : NULL,
                           wv,         NULL};
    child_t *s = spawn(sargs);
    char addr[512];
    server_addr(s, addr, sizeof addr);
    child_t *w[M];
    for (int m = 0; m < M; m++) {
        snprintf(idx[m], sizeof idx[m], "%d", m);
        const char *wargs[] = {"masha",   "worker", "--server", addr,
                               "--index", idx[m],   COMMON,     NULL};
        w[m] = spawn(wargs);
    }
#undef COMMON
    for (int m = 0; m < M; m++) {
        expect_exit(w[m], 0);
        const char *js = summary(w[m]);
        assert_int_equal(jnum(js, "index"), m);
        check_summary(js, &ref);
    }
    expect_exit(s, 0);
    check_summary(summary(s), &ref);
    assert_non_null(strstr(summary(s), "\"role\":\"server\""));
}

static void test_masha1_ten_processes(void **state)
{
    (void)state;
    run_ten("masha1", 0.686, 0.1, 0, 0);
}

static void test_masha1_old_server(void **state)
{
    (void)state;
    run_ten("masha1", 0.686, 0.1, 0, 1);
}

static void test_masha1_v2_server(void **state)
{
    (void)state;
    run_ten("masha1", 0.686, 0.1, 0, 2);
}

static void test_masha2_server_compressed(void **state)
{
    (void)state;
    run_ten("masha2", 0.403, 0.1, 0.5, 0);
}

/* M = 2 small runs for the failure cases. */
static const char *const two[] = {"--workers", "2",      "--method", "masha1", "--gamma",
                                  "0.15",      "--seed", "2021",     NULL};

static void push_args(const char **dst, int *n, const char *const *src)
{
    for (int i = 0; src[i]; i++) dst[(*n)++] = src[i];
}

static void test_wrong_server_id(void **state)
{
    (void)state;
    const char *sargs[24];
    int n = 0;
    const char *const head[] = {"masha", "server", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    push_args(sargs, &n, head);
    push_args(sargs, &n, two);
    sargs[n] = NULL;
    child_t *s = spawn(sargs);
    char addr[512];
    server_addr(s, addr, sizeof addr);

    /* same host and port, another PeerID */
    ap_identity_t other;
    assert_ok(ap_identity_generate(&other));
    char oid[AP_PEER_ID_STR_MAX], bad[600];
    ap_peer_id_str(&other.id, oid);
    *strstr(addr, "/p2p/") = '\0';
    snprintf(bad, sizeof bad, "%s/p2p/%s", addr, oid);
    const char *wargs[24];
    n = 0;
    const char *const whead[] = {"masha", "worker", "--server", bad, "--index", "0", NULL};
    push_args(wargs, &n, whead);
    push_args(wargs, &n, two);
    wargs[n] = NULL;
    child_t *wb = spawn(wargs);
    expect_exit(wb, 1);
    assert_non_null(strstr(wb->ebuf, "EAUTH"));
    assert_non_null(strstr(wb->ebuf, oid));
    assert_non_null(strstr(wb->ebuf, "--server"));
    assert_int_equal(wb->olen, 0); /* no summary */

    /* the server is unharmed: the right workers complete the run */
    char good[512];
    server_addr(s, good, sizeof good);
    child_t *w[2];
    for (int m = 0; m < 2; m++) {
        n = 0;
        const char *const h2[] = {"masha",   "worker",      "--server", good,
                                  "--index", m ? "1" : "0", NULL};
        push_args(wargs, &n, h2);
        push_args(wargs, &n, two);
        wargs[n] = NULL;
        w[m] = spawn(wargs);
    }
    expect_exit(w[0], 0);
    expect_exit(w[1], 0);
    expect_exit(s, 0);
    assert_non_null(strstr(summary(s), "\"converged\":true"));
    assert_int_equal(jnum(summary(s), "iterations"), jnum(summary(w[0]), "iterations"));
}

static void test_worker_killed_midrun(void **state)
{
    (void)state;
    const char *sargs[24];
    int n = 0;
    const char *const head[] = {"masha",       "server", "--listen", "/ip4/127.0.0.1/tcp/0",
                                "--log-level", "info",   NULL};
    push_args(sargs, &n, head);
    push_args(sargs, &n, two);
    sargs[n] = NULL;
    child_t *s = spawn(sargs);
    char addr[512];
    server_addr(s, addr, sizeof addr);
    const char *wargs[24];
    n = 0;
    const char *const whead[] = {"masha", "worker", "--server", addr, "--index", "0", NULL};
    push_args(wargs, &n, whead);
    push_args(wargs, &n, two);
    wargs[n] = NULL;
    child_t *w = spawn(wargs);
    /* worker 0's first request is held until worker 1 comes: the run is in
     * progress once the server says worker 0 joined */
    assert_true(wait_for(s, err_has, "worker 0 joined", budget_s()));
    assert_false(s->reaped);
    kill(w->pid, SIGKILL);
    expect_exit(w, 128 + SIGKILL);
    expect_exit(s, 1);
    assert_non_null(strstr(s->ebuf, "worker 0"));
    assert_non_null(strstr(s->ebuf, "disconnected"));
    assert_non_null(strstr(s->ebuf, "the run failed"));
}

/* A free TCP port on the wildcard address (the kernel's pick, released). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    socklen_t len = sizeof sa;
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
    close(fd);
    return ntohs(sa.sin_port);
}

/* --announce: the server listens on the wildcard address and prints the
 * announced address (127.0.0.2, which its listener also answers), not the
 * listen address; workers given that address complete the run. A malformed
 * --announce is a usage error naming the expected form. */
static void test_server_announce(void **state)
{
    (void)state;
    const char *bargs[] = {
        "masha", "server", "--listen", "/ip4/127.0.0.1/tcp/0", "--announce", "/ip4/127.0.0.2/tcp/0",
        NULL};
    child_t *b = spawn(bargs);
    expect_exit(b, 2);
    assert_non_null(strstr(b->ebuf, "--announce needs an address peers can dial"));

    int port = free_port();
    char listen[64], announce[64];
    snprintf(listen, sizeof listen, "/ip4/0.0.0.0/tcp/%d", port);
    snprintf(announce, sizeof announce, "/ip4/127.0.0.2/tcp/%d", port);
    const char *sargs[24];
    int n = 0;
    const char *const head[] = {"masha",      "server", "--listen", listen,
                                "--announce", announce, NULL};
    push_args(sargs, &n, head);
    push_args(sargs, &n, two);
    sargs[n] = NULL;
    child_t *s = spawn(sargs);
    if (!wait_for(s, has_line, NULL, budget_s()) || s->reaped)
        fail_msg("server printed no address; stderr:\n%s", s->ebuf);
    char addr[512], want[80];
    size_t len = (size_t)(strchr(s->obuf, '\n') - s->obuf);
    assert_true(len < sizeof addr);
    memcpy(addr, s->obuf, len);
    addr[len] = '\0';
    snprintf(want, sizeof want, "%s/p2p/12D3KooW", announce);
    if (strncmp(addr, want, strlen(want)) != 0)
        fail_msg("server printed %s, expected the announced %s/p2p/...", addr, announce);
    child_t *w[2];
    for (int m = 0; m < 2; m++) {
        const char *wargs[24];
        n = 0;
        const char *const h2[] = {"masha",   "worker",      "--server", addr,
                                  "--index", m ? "1" : "0", NULL};
        push_args(wargs, &n, h2);
        push_args(wargs, &n, two);
        wargs[n] = NULL;
        w[m] = spawn(wargs);
    }
    expect_exit(w[0], 0);
    expect_exit(w[1], 0);
    expect_exit(s, 0);
    assert_non_null(strstr(summary(s), "\"converged\":true"));
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_masha1_ten_processes, teardown),
        cmocka_unit_test_teardown(test_masha1_old_server, teardown),
        cmocka_unit_test_teardown(test_masha1_v2_server, teardown),
        cmocka_unit_test_teardown(test_masha2_server_compressed, teardown),
        cmocka_unit_test_teardown(test_wrong_server_id, teardown),
        cmocka_unit_test_teardown(test_worker_killed_midrun, teardown),
        cmocka_unit_test_teardown(test_server_announce, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
