/* The NAT topology of testing/natns.h behaves as the routers it imitates,
 * checked with plain TCP sockets from processes inside the namespaces:
 * - a home host reaches public nodes; they see the router's address, with
 *   the host's own source port behind the port-preserving kinds and with a
 *   different port for each destination behind the symmetric one;
 * - an unsolicited connection to a router is dropped (drop, symmetric) or
 *   refused with a RST (rst);
 * - a simultaneous TCP open between two hosts behind port-preserving NATs,
 *   each dialling the other's public address from its own fixed port,
 *   connects; with one side behind the symmetric NAT it never does;
 * - every namespace is gone afterwards.
 * Skipped (cmocka skip, with the reason) when not root or without nftables. */
#include "aptest.h"

#include "natns.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define SERVE_PORT 7000
#define LOCAL_PORT 40000
#define PUNCH_PORT 41000

enum { H_DROP, H_RST, H_SYM, H_DROP2, NHOMES };

/* What a child reports: 0 and the address the far side saw, or -errno. */
typedef struct result {
    int err;
    char seen[48];
} result_t;

static int bound_socket(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (bind(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Non-blocking connect from local_port to ip:port, waiting up to ms. */
static int connect_within(int fd, const char *ip, int port, int ms)
{
    struct sockaddr_in d = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, ip, &d.sin_addr);
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    if (connect(fd, (struct sockaddr *)&d, sizeof d) == 0) return 0;
    if (errno != EINPROGRESS) return -errno;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int r = poll(&p, 1, ms);
    if (r == 0) return -ETIMEDOUT;
    if (r < 0) return -errno;
    int e = 0;
    socklen_t el = sizeof e;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
    fcntl(fd, F_SETFL, fl);
    return -e;
}

/* Public node: answers every connection with the address it came from. */
static void serve(void)
{
    int fd = bound_socket(SERVE_PORT);
    if (fd < 0 || listen(fd, 16)) _exit(2);
    for (;;) {
        struct sockaddr_in a;
        socklen_t al = sizeof a;
        int c = accept(fd, (struct sockaddr *)&a, &al);
        if (c < 0) continue;
        char ip[16], line[48];
        inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
        int n = snprintf(line, sizeof line, "%s:%d", ip, ntohs(a.sin_port));
        ssize_t w = write(c, line, (size_t)n);
        (void)w;
        close(c);
    }
}

/* Dials ip:port from local_port; the server's answer goes into r->seen. */
static void ask(int local_port, const char *ip, int port, int ms, result_t *r)
{
    memset(r, 0, sizeof *r);
    int fd = bound_socket(local_port);
    if (fd < 0) {
        r->err = -errno;
        return;
    }
    r->err = connect_within(fd, ip, port, ms);
    if (r->err == 0) {
        size_t got = 0;
        for (;;) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (poll(&p, 1, ms) <= 0) break;
            ssize_t n = read(fd, r->seen + got, sizeof r->seen - 1 - got);
            if (n <= 0) break;
            got += (size_t)n;
        }
    }
    close(fd);
}

typedef enum { AT_PUBLIC, AT_HOME } where_t;

/* Forks a child into a namespace; it runs fn and sends its results back. */
typedef void (*child_fn)(const void *arg, result_t *out, size_t nout);

static pid_t run_child(const ap_natns_t *ns, where_t w, size_t idx, child_fn fn, const void *arg,
                       size_t nout, int *rfd)
{
    int p[2];
    if (pipe(p)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        int rc = w == AT_PUBLIC ? ap_natns_enter_public(ns, idx) : ap_natns_enter_home(ns, idx);
        if (rc) _exit(3);
        result_t out[4];
        memset(out, 0, sizeof out);
        fn(arg, out, nout);
        ssize_t n = write(p[1], out, nout * sizeof out[0]);
        _exit(n == (ssize_t)(nout * sizeof out[0]) ? 0 : 4);
    }
    close(p[1]);
    *rfd = p[0];
    return pid;
}

static void collect(pid_t pid, int fd, result_t *out, size_t nout)
{
    size_t want = nout * sizeof out[0], got = 0;
    while (got < want) {
        ssize_t n = read(fd, (char *)out + got, want - got);
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    int st;
    waitpid(pid, &st, 0);
    if (got != want) fail_msg("child %d reported nothing (status %d)", (int)pid, st);
}

typedef struct ask_arg {
    const char *ip[2];
    int port;
    int local_port;
    int ms;
} ask_arg_t;

static void child_ask(const void *arg, result_t *out, size_t nout)
{
    const ask_arg_t *a = arg;
    for (size_t i = 0; i < nout; i++) ask(a->local_port, a->ip[i], a->port, a->ms, &out[i]);
}

static void child_serve(const void *arg, result_t *out, size_t nout)
{
    (void)arg, (void)out, (void)nout;
    serve();
}

typedef struct punch_arg {
    const char *peer_ip;
    int attempts;
} punch_arg_t;

/* Simultaneous open: dial the peer's public address from PUNCH_PORT until
 * it connects or the attempts run out; then exchange one byte. */
static void child_punch(const void *arg, result_t *out, size_t nout)
{
    const punch_arg_t *a = arg;
    (void)nout;
    out->err = -ETIMEDOUT;
    for (int i = 0; i < a->attempts; i++) {
        int fd = bound_socket(PUNCH_PORT);
        if (fd < 0) {
            out->err = -errno;
            usleep(200000);
            continue;
        }
        out->err = connect_within(fd, a->peer_ip, PUNCH_PORT, 2000);
        if (out->err == 0) {
            char b = 'x';
            ssize_t w = write(fd, &b, 1);
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (w != 1 || poll(&p, 1, 3000) != 1 || read(fd, &b, 1) != 1 || b != 'x')
                out->err = -EPROTO;
            snprintf(out->seen, sizeof out->seen, "attempt %d", i + 1);
            close(fd);
            return;
        }
        close(fd);
        usleep(100000);
    }
}

/* Started servers and the topology, released by the teardown also when an
 * assertion failed half-way. */
static pid_t g_srv[2];
static ap_natns_t *g_ns;

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < 2; i++)
        if (g_srv[i] > 0) {
            kill(g_srv[i], SIGKILL);
            waitpid(g_srv[i], NULL, 0);
            g_srv[i] = 0;
        }
    ap_natns_free(g_ns);
    g_ns = NULL;
    return 0;
}

static int port_of(const char *seen)
{
    const char *c = strrchr(seen, ':');
    return c ? atoi(c + 1) : -1;
}

static void test_nat_kinds(void **state)
{
    (void)state;
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    const ap_nat_kind_t kinds[NHOMES] = {AP_NAT_DROP, AP_NAT_RST, AP_NAT_SYMMETRIC, AP_NAT_DROP};
    ap_natns_t *ns;
    int rc = ap_natns_new(2, NHOMES, kinds, &ns, why, sizeof why);
    if (rc) fail_msg("topology: %s", why);
    g_ns = ns;
    char path[128];
    snprintf(path, sizeof path, "/var/run/netns/%s", ap_natns_router_name(ns, H_SYM));
    struct stat st;
    assert_int_equal(stat(path, &st), 0);

    int sfd[2];
    for (int i = 0; i < 2; i++)
        g_srv[i] = run_child(ns, AT_PUBLIC, (size_t)i, child_serve, NULL, 1, &sfd[i]);
    usleep(300000); /* the listeners; a dial that comes too early is retried below */

    /* Outbound: what the public nodes see. */
    for (size_t k = 0; k < NHOMES; k++) {
        ask_arg_t a = {
            {ap_natns_public_ip(ns, 0), ap_natns_public_ip(ns, 1)}, SERVE_PORT, LOCAL_PORT, 5000};
        result_t r[2];
        for (int tries = 0; tries < 5; tries++) {
            int fd;
            pid_t c = run_child(ns, AT_HOME, k, child_ask, &a, 2, &fd);
            collect(c, fd, r, 2);
            if (r[0].err != -ECONNREFUSED && r[1].err != -ECONNREFUSED) break;
            usleep(300000);
        }
        print_message("home %zu (%s): seen as %s and %s\n", k, ap_nat_kind_name(kinds[k]),
                      r[0].seen, r[1].seen);
        for (int i = 0; i < 2; i++) {
            assert_int_equal(r[i].err, 0);
            char want[24];
            snprintf(want, sizeof want, "%s:", ap_natns_router_ip(ns, k));
            assert_memory_equal(r[i].seen, want, strlen(want));
        }
        if (kinds[k] == AP_NAT_SYMMETRIC) {
            assert_int_not_equal(port_of(r[0].seen), port_of(r[1].seen));
        } else {
            assert_int_equal(port_of(r[0].seen), LOCAL_PORT);
            assert_int_equal(port_of(r[1].seen), LOCAL_PORT);
        }
    }

    /* Inbound, unsolicited: from public node 0 to each router's mapped port. */
    for (size_t k = 0; k < NHOMES; k++) {
        ask_arg_t a = {{ap_natns_router_ip(ns, k)}, LOCAL_PORT, 0, 3000};
        result_t r;
        int fd;
        pid_t c = run_child(ns, AT_PUBLIC, 0, child_ask, &a, 1, &fd);
        collect(c, fd, &r, 1);
        print_message("unsolicited to router %zu (%s): %s\n", k, ap_nat_kind_name(kinds[k]),
                      strerror(-r.err));
        assert_int_equal(r.err, kinds[k] == AP_NAT_RST ? -ECONNREFUSED : -ETIMEDOUT);
    }

    /* Simultaneous open: drop <-> drop connects, drop <-> symmetric never. */
    {
        punch_arg_t a0 = {ap_natns_router_ip(ns, H_DROP2), 5};
        punch_arg_t a1 = {ap_natns_router_ip(ns, H_DROP), 5};
        int f0, f1;
        pid_t c0 = run_child(ns, AT_HOME, H_DROP, child_punch, &a0, 1, &f0);
        pid_t c1 = run_child(ns, AT_HOME, H_DROP2, child_punch, &a1, 1, &f1);
        result_t r0, r1;
        collect(c0, f0, &r0, 1);
        collect(c1, f1, &r1, 1);
        print_message("punch drop<->drop: %s (%s), %s (%s)\n", strerror(-r0.err), r0.seen,
                      strerror(-r1.err), r1.seen);
        assert_int_equal(r0.err, 0);
        assert_int_equal(r1.err, 0);
    }
    {
        punch_arg_t a0 = {ap_natns_router_ip(ns, H_SYM), 2};
        punch_arg_t a1 = {ap_natns_router_ip(ns, H_DROP), 2};
        int f0, f1;
        pid_t c0 = run_child(ns, AT_HOME, H_DROP, child_punch, &a0, 1, &f0);
        pid_t c1 = run_child(ns, AT_HOME, H_SYM, child_punch, &a1, 1, &f1);
        result_t r0, r1;
        collect(c0, f0, &r0, 1);
        collect(c1, f1, &r1, 1);
        print_message("punch drop<->symmetric: %s, %s\n", strerror(-r0.err), strerror(-r1.err));
        assert_int_not_equal(r0.err, 0);
        assert_int_not_equal(r1.err, 0);
    }

    for (int i = 0; i < 2; i++) close(sfd[i]);
    teardown(NULL);
    assert_int_not_equal(stat(path, &st), 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_nat_kinds, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
