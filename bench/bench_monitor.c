/* `apiary bench monitor`: the run monitor with 100 peers' records.
 *   metrics_ms           GET /metrics over loopback (render + HTTP), median of
 *                        runs; baseline: GET of a 404 on the same server
 *   metrics_render_ms    rendering /metrics alone; baseline: /api/state
 *   page_first_render_ms headless Chromium loading the page until its first
 *                        render with the state (--dump-dom), minus the same
 *                        browser loading about:blank (the baseline); skipped,
 *                        saying so, without chromium-headless-shell */
#include "bench.h"
#include "monitor.h"

#include "http/http.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#define NPEERS 100

typedef struct bsrv {
    uv_loop_t loop;
    uv_async_t stop;
    uv_thread_t th;
    ap_http_server_t *http;
    mon_state_t *st;
} bsrv_t;

static void handler(void *arg, const char *path, ap_http_resp_t *r)
{
    bsrv_t *s = arg;
    if (strcmp(path, "/") == 0) {
        r->type = "text/html; charset=utf-8";
        r->body = malloc(ap_web_monitor_html_len);
        memcpy(r->body, ap_web_monitor_html, ap_web_monitor_html_len);
        r->len = ap_web_monitor_html_len;
    } else if (strcmp(path, "/api/state") == 0) {
        r->type = "application/json";
        r->body = mon_render_json(s->st, &r->len);
    } else if (strcmp(path, "/metrics") == 0) {
        r->body = mon_render_metrics(s->st, NULL, &r->len);
    } else {
        r->status = 404;
    }
}

static void on_stop(uv_async_t *a)
{
    bsrv_t *s = a->data;
    ap__http_close(s->http);
    uv_close((uv_handle_t *)&s->stop, NULL);
}

static void loop_main(void *arg)
{
    uv_run(&((bsrv_t *)arg)->loop, UV_RUN_DEFAULT);
}

static double get_ms(int port, const char *path)
{
    double t0 = ap_bench_now();
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0) close(fd);
        return NAN;
    }
    char req[128], buf[65536];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nConnection: close\r\n\r\n", path);
    if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n) {
        close(fd);
        return NAN;
    }
    while (recv(fd, buf, sizeof buf, 0) > 0) {
    }
    close(fd);
    return (ap_bench_now() - t0) * 1e3;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[n / 2];
}

static void fill(mon_state_t *st)
{
    int64_t now = 1700000000000;
    st->now_ms = now;
    for (int i = 0; i < NPEERS; i++) {
        ap_progress_t p;
        memset(&p, 0, sizeof p);
        p.epoch = 100 + (i % 3 == 0);
        p.samples = 100 + i;
        p.samples_per_s = 50 + i;
        p.time_ms = now - i * 10;
        p.epoch_start_ms = now - 10000;
        p.up = p.down = 1e7;
        p.loss = 2.0f + (float)i / 100;
        p.rounds = 100;
        p.bytes_sent = p.bytes_received = 1000000ull * (uint64_t)i;
        p.has_config = true;
        p.config.target_batch_size = 4096;
        char id[AP_PEER_ID_STR_MAX];
        snprintf(id, sizeof id, "12D3KooWBenchPeer%04dxxxxxxxxxxxxxxxxxxxxxxxxxxxx", i);
        mon_state_put(st, id, &p);
    }
    for (int k = 0; k < 200; k++) {
        st->now_ms += 1000;
        mon_state_update(st);
    }
    st->now_ms = now;
}

static double chromium_ms(const char *exe, const char *url)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "timeout 60 %s --no-sandbox --disable-gpu --virtual-time-budget=100 --dump-dom '%s' "
             ">/dev/null 2>&1",
             exe, url);
    double t0 = ap_bench_now();
    int rc = system(cmd);
    return rc == 0 ? (ap_bench_now() - t0) * 1e3 : NAN;
}

static int run(ap_bench_ctx_t *ctx, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    mon_state_t st;
    if (mon_state_init(&st, "bench")) return 1;
    fill(&st);
    int reps = ctx->quick ? 20 : 200;
    double *a = calloc((size_t)reps, sizeof *a), *b = calloc((size_t)reps, sizeof *b);
    for (int i = 0; i < reps; i++) {
        size_t len;
        double t0 = ap_bench_now();
        free(mon_render_metrics(&st, NULL, &len));
        double t1 = ap_bench_now();
        free(mon_render_json(&st, &len));
        a[i] = (t1 - t0) * 1e3;
        b[i] = (ap_bench_now() - t1) * 1e3;
    }
    char fields[64];
    snprintf(fields, sizeof fields, "\"peers\":%d", NPEERS);
    ap_bench_report_vs(ctx, "metrics_render_ms", median(a, reps), "ms", median(b, reps), fields);

    bsrv_t s;
    memset(&s, 0, sizeof s);
    s.st = &st;
    uv_loop_init(&s.loop);
    uv_async_init(&s.loop, &s.stop, on_stop);
    s.stop.data = &s;
    if (ap__http_start(&s.loop, "127.0.0.1:0", NULL, handler, &s, &s.http) != 0) {
        fprintf(stderr, "bench monitor: cannot listen on 127.0.0.1\n");
        return 1;
    }
    int port = ap__http_port(s.http);
    uv_thread_create(&s.th, loop_main, &s);
    for (int i = 0; i < reps; i++) {
        a[i] = get_ms(port, "/metrics");
        b[i] = get_ms(port, "/nothing");
    }
    ap_bench_report_vs(ctx, "metrics_ms", median(a, reps), "ms", median(b, reps), fields);

    const char *exe = system("command -v chromium-headless-shell >/dev/null 2>&1") == 0
                          ? "chromium-headless-shell"
                          : NULL;
    if (!exe) {
        printf("page_first_render_ms: skipped (chromium-headless-shell is not installed)\n");
    } else {
        char url[64];
        snprintf(url, sizeof url, "http://127.0.0.1:%d/?poll", port);
        int n = ctx->quick ? 1 : 5;
        double pg[5], bl[5];
        for (int i = 0; i < n; i++) {
            bl[i] = chromium_ms(exe, "about:blank");
            pg[i] = chromium_ms(exe, url);
        }
        double p = median(pg, n), q = median(bl, n);
        ap_bench_report_vs(ctx, "page_first_render_ms", p - q, "ms", q, fields);
    }
    uv_async_send(&s.stop);
    uv_thread_join(&s.th);
    uv_loop_close(&s.loop);
    free(a);
    free(b);
    mon_state_free(&st);
    return 0;
}

AP_BENCH(bench_monitor, "monitor", run,
         "run monitor with 100 peers: /metrics latency, page first render in headless Chromium")
