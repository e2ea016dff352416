/* The monitor's HTTP server (src/http) over real loopback sockets: good,
 * malformed, oversized, slow and idle requests, event streams, a client that
 * never reads, and 1,000 connections at once. */
#include "aptest.h"

#include "http/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

typedef struct srv {
    uv_loop_t loop;
    uv_async_t stop, bcast;
    uv_thread_t th;
    ap_http_server_t *http;
    int port;
    int bcast_n;
    ap_http_stats_t last;
    uint64_t asked, copied; /* srv_stats' request count, and the last one served */
    uv_mutex_t mu;
    uv_cond_t cv;
} srv_t;

static void handler(void *arg, const char *path, ap_http_resp_t *r)
{
    (void)arg;
    if (strcmp(path, "/ev") == 0) {
        r->stream = true;
        r->body = strdup("{\"hello\":1}");
        r->len = strlen(r->body);
        return;
    }
    if (strcmp(path, "/") != 0) {
        r->status = 404;
        return;
    }
    r->body = strdup("hello\n");
    r->len = 6;
}

static void on_stop(uv_async_t *a)
{
    srv_t *s = a->data;
    ap__http_close(s->http);
    uv_close((uv_handle_t *)&s->stop, NULL);
    uv_close((uv_handle_t *)&s->bcast, NULL);
}

static void on_bcast(uv_async_t *a)
{
    srv_t *s = a->data;
    static char big[65536];
    memset(big, 'x', sizeof big - 1);
    uv_mutex_lock(&s->mu);
    int n = s->bcast_n;
    uv_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) ap__http_broadcast(s->http, big, sizeof big - 1);
    uv_mutex_lock(&s->mu);
    ap__http_stats(s->http, &s->last);
    s->copied = s->asked;
    uv_cond_broadcast(&s->cv);
    uv_mutex_unlock(&s->mu);
}

static void run(void *arg)
{
    srv_t *s = arg;
    uv_run(&s->loop, UV_RUN_DEFAULT);
}

static srv_t *srv_start(const ap_http_limits_t *lim)
{
    srv_t *s = calloc(1, sizeof *s);
    assert_non_null(s);
    assert_int_equal(uv_loop_init(&s->loop), 0);
    uv_mutex_init(&s->mu);
    uv_cond_init(&s->cv);
    uv_async_init(&s->loop, &s->stop, on_stop);
    uv_async_init(&s->loop, &s->bcast, on_bcast);
    s->stop.data = s->bcast.data = s;
    assert_ok(ap__http_start(&s->loop, "127.0.0.1:0", lim, handler, s, &s->http));
    s->port = ap__http_port(s->http);
    assert_true(s->port > 0);
    assert_int_equal(uv_thread_create(&s->th, run, s), 0);
    return s;
}

static void srv_stats(srv_t *s, ap_http_stats_t *st)
{
    /* The loop thread copies the stats when it runs on_bcast; wait until it
     * has done so for this request (a fixed sleep was not always enough on a
     * loaded machine). */
    uv_mutex_lock(&s->mu);
    s->bcast_n = 0;
    uint64_t want = ++s->asked;
    uv_mutex_unlock(&s->mu);
    uv_async_send(&s->bcast);
    uv_mutex_lock(&s->mu);
    while (s->copied < want)
        assert_int_equal(uv_cond_timedwait(&s->cv, &s->mu, 60ull * 1000000000ull), 0);
    *st = s->last;
    uv_mutex_unlock(&s->mu);
}

static void srv_stop(srv_t *s)
{
    uv_async_send(&s->stop);
    uv_thread_join(&s->th);
    assert_int_equal(uv_loop_close(&s->loop), 0);
    uv_cond_destroy(&s->cv);
    uv_mutex_destroy(&s->mu);
    free(s);
}

static int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

/* Reads until the peer closes (or 20 s pass: then the test fails on the
 * missing answer, not on the time). Returns the bytes read. */
static size_t read_all(int fd, char *buf, size_t cap)
{
    size_t n = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 20000) <= 0) break;
        ssize_t r = recv(fd, buf + n, cap - 1 - n, 0);
        if (r <= 0) break;
        n += (size_t)r;
        if (n + 1 >= cap) break;
    }
    buf[n] = 0;
    return n;
}

static void exchange(int port, const char *req, size_t len, char *out, size_t cap)
{
    int fd = dial(port);
    assert_int_equal(send(fd, req, len, MSG_NOSIGNAL), (ssize_t)len);
    read_all(fd, out, cap);
    close(fd);
}

static void test_requests(void **state)
{
    (void)state;
    srv_t *s = srv_start(NULL);
    char out[65536];
    const char *get = "GET /?x=1 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    exchange(s->port, get, strlen(get), out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 200 OK\r\n"));
    assert_non_null(strstr(out, "\r\n\r\nhello\n"));

    const char *nf = "GET /nope HTTP/1.0\r\n\r\n";
    exchange(s->port, nf, strlen(nf), out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 404"));

    const char *bad = "GARBAGE\r\n\r\n";
    exchange(s->port, bad, strlen(bad), out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 400"));

    const char *bin = "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 tls hello";
    exchange(s->port, bin, strlen(bin), out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 400"));

    const char *post = "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello";
    exchange(s->port, post, strlen(post), out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 405"));

    const char *body = "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello";
    exchange(s->port, body, strlen(body), out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 413"));

    /* oversized: one huge header, many headers, a huge target */
    static char big[40000];
    int n = snprintf(big, sizeof big, "GET / HTTP/1.1\r\nX-Big: ");
    memset(big + n, 'a', 20000);
    memcpy(big + n + 20000, "\r\n\r\n", 4);
    exchange(s->port, big, (size_t)n + 20004, out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 431"));
    n = snprintf(big, sizeof big, "GET / HTTP/1.1\r\n");
    for (int i = 0; i < 200; i++) n += snprintf(big + n, sizeof big - (size_t)n, "X%d: y\r\n", i);
    n += snprintf(big + n, sizeof big - (size_t)n, "\r\n");
    exchange(s->port, big, (size_t)n, out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 431"));
    n = snprintf(big, sizeof big, "GET /");
    memset(big + n, 'b', 5000);
    n += 5000;
    n += snprintf(big + n, sizeof big - (size_t)n, " HTTP/1.1\r\n\r\n");
    exchange(s->port, big, (size_t)n, out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 414"));

    /* keep-alive: two requests on one connection, pipelined */
    const char *two = "GET / HTTP/1.1\r\nHost: a\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n"
                      "Connection: close\r\n\r\n";
    exchange(s->port, two, strlen(two), out, sizeof out);
    char *first = strstr(out, "hello\n");
    assert_non_null(first);
    assert_non_null(strstr(first + 6, "hello\n"));

    ap_http_stats_t st;
    srv_stats(s, &st);
    assert_true(st.bad_requests >= 7);
    assert_int_equal(st.conns, 0);
    srv_stop(s);
}

static void test_slow_and_idle(void **state)
{
    (void)state;
    ap_http_limits_t lim = {.request_ms = 300, .idle_ms = 300};
    srv_t *s = srv_start(&lim);
    char out[4096];
    /* slow: a request that never completes gets 408 and the connection closes */
    int fd = dial(s->port);
    const char *part = "GET / HTTP/1.1\r\nHost: a\r\n";
    assert_int_equal(send(fd, part, strlen(part), MSG_NOSIGNAL), (ssize_t)strlen(part));
    read_all(fd, out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 408"));
    close(fd);
    /* idle: nothing sent; closed without an answer */
    fd = dial(s->port);
    assert_int_equal(read_all(fd, out, sizeof out), 0);
    close(fd);
    ap_http_stats_t st;
    srv_stats(s, &st);
    assert_true(st.timeouts >= 1);
    assert_int_equal(st.conns, 0);
    srv_stop(s);
}

static void test_stream_and_slow_reader(void **state)
{
    (void)state;
    ap_http_limits_t lim = {.max_queued = 256 * 1024, .max_streams = 2};
    srv_t *s = srv_start(&lim);
    char out[4096];
    int fd = dial(s->port);
    /* a small receive buffer so the queue fills on the server */
    const char *ev = "GET /ev HTTP/1.1\r\nHost: a\r\n\r\n";
    assert_int_equal(send(fd, ev, strlen(ev), MSG_NOSIGNAL), (ssize_t)strlen(ev));
    struct pollfd p = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 20000), 1);
    ssize_t r = recv(fd, out, sizeof out - 1, 0);
    assert_true(r > 0);
    out[r] = 0;
    assert_non_null(strstr(out, "text/event-stream"));
    /* a third stream beyond max_streams = 2 is refused */
    int fd2 = dial(s->port), fd3 = dial(s->port);
    assert_int_equal(send(fd2, ev, strlen(ev), MSG_NOSIGNAL), (ssize_t)strlen(ev));
    assert_int_equal(poll(&(struct pollfd){.fd = fd2, .events = POLLIN}, 1, 20000), 1);
    assert_int_equal(send(fd3, ev, strlen(ev), MSG_NOSIGNAL), (ssize_t)strlen(ev));
    read_all(fd3, out, sizeof out);
    assert_non_null(strstr(out, "HTTP/1.1 503"));
    close(fd3);
    /* fd never reads again: 64 events of 64 KiB overflow its queue */
    uv_mutex_lock(&s->mu);
    s->bcast_n = 64;
    uv_mutex_unlock(&s->mu);
    uv_async_send(&s->bcast);
    ap_http_stats_t st = {0};
    for (int i = 0; i < 100 && st.slow_closed == 0; i++) {
        usleep(100000);
        uv_mutex_lock(&s->mu);
        st = s->last;
        uv_mutex_unlock(&s->mu);
    }
    assert_true(st.slow_closed >= 1);
    close(fd);
    close(fd2);
    srv_stop(s);
}

static void test_thousand_connections(void **state)
{
    (void)state;
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_cur < 2300) {
        rl.rlim_cur = rl.rlim_max < 2300 ? rl.rlim_max : 2300;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur < 2300) {
        printf("skipped: needs 2300 open files, the limit is %llu\n",
               (unsigned long long)rl.rlim_cur);
        skip();
    }
    ap_http_limits_t lim = {.max_conns = 256};
    srv_t *s = srv_start(&lim);
    enum { N = 1000 };
    static int fds[N];
    for (int i = 0; i < N; i++) fds[i] = dial(s->port);
    /* those over the cap get a 503 and a close; the others are held open */
    int refused = 0;
    char out[1024];
    for (int i = 0; i < N; i++) {
        struct pollfd p = {.fd = fds[i], .events = POLLIN};
        if (poll(&p, 1, i < 256 ? 0 : 20000) == 1) {
            ssize_t r = recv(fds[i], out, sizeof out - 1, 0);
            if (r > 0) {
                out[r] = 0;
                assert_non_null(strstr(out, "HTTP/1.1 503"));
                refused++;
            }
        }
    }
    assert_true(refused >= N - 256);
    ap_http_stats_t st;
    srv_stats(s, &st);
    assert_true(st.conns <= 256);
    assert_true(st.refused_conns >= N - 256);
    /* the held connections can still be served */
    const char *get = "GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    assert_int_equal(send(fds[0], get, strlen(get), MSG_NOSIGNAL), (ssize_t)strlen(get));
    read_all(fds[0], out, sizeof out);
    assert_non_null(strstr(out, "hello\n"));
    for (int i = 0; i < N; i++) close(fds[i]);
    srv_stop(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_requests),
        cmocka_unit_test(test_slow_and_idle),
        cmocka_unit_test(test_stream_and_slow_reader),
        cmocka_unit_test(test_thousand_connections),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
