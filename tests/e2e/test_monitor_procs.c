/* The run monitor with real processes on loopback: an `apiary dht`
 * bootstrap node, three `apiary train` peers and an `apiary monitor`.
 * /api/state lists the three peers and a rising epoch; /metrics parses as
 * Prometheus text under a strict parser; the page is opened in headless
 * Chromium when it is installed (the DOM shows the peers' rows and the loss
 * plot grows without a reload; a screenshot is kept in the build dir). */
#include "aptest.h"
#include "procs.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

/* GET path; returns the malloc'd body (NULL on failure). */
static char *http_get(int port, const char *path)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return NULL;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return NULL;
    }
    char req[256];
    int n =
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", path);
    if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 20, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 20000) <= 0) break;
        ssize_t r = recv(fd, buf + len, cap - 1 - len, 0);
        if (r <= 0) break;
        len += (size_t)r;
        if (len + 1 >= cap) break;
    }
    close(fd);
    buf[len] = 0;
    char *body = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.1 200 ", 13) != 0 || !body) {
        free(buf);
        return NULL;
    }
    memmove(buf, body + 4, strlen(body + 4) + 1);
    return buf;
}

static int count(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

static bool metric_name(const char **p)
{
    const char *s = *p;
    if (!(isalpha((unsigned char)*s) || *s == '_' || *s == ':')) return false;
    while (isalnum((unsigned char)*s) || *s == '_' || *s == ':') s++;
    *p = s;
    return true;
}

/* The text exposition format 0.0.4, strictly: HELP and TYPE lines before
 * their samples, each family typed once, samples `name{l="v",...} value`,
 * every name prefixed apiary_. Returns the number of samples, -line on error. */
static int parse_prometheus(const char *text)
{
    char typed[128][96];
    int ntyped = 0, samples = 0, lineno = 0;
    const char *line = text;
    while (*line) {
        lineno++;
        const char *end = strchr(line, '\n');
        if (!end) return -lineno; /* the last line ends with \n too */
        const char *p = line;
        if (*p == '#') {
            bool help = strncmp(p, "# HELP ", 7) == 0, type = strncmp(p, "# TYPE ", 7) == 0;
            if (!help && !type) return -lineno;
            p += 7;
            const char *name = p;
            if (!metric_name(&p) || *p != ' ') return -lineno;
            size_t nl = (size_t)(p - name);
            if (strncmp(name, "apiary_", 7) != 0 || nl >= 96) return -lineno;
            if (type) {
                p++;
                size_t tl = (size_t)(end - p);
                const char *types[] = {"gauge", "counter", "untyped", "histogram", "summary"};
                bool ok = false;
                for (int i = 0; i < 5; i++)
                    if (tl == strlen(types[i]) && strncmp(p, types[i], tl) == 0) ok = true;
                if (!ok) return -lineno;
                for (int i = 0; i < ntyped; i++)
                    if (strlen(typed[i]) == nl && strncmp(typed[i], name, nl) == 0)
                        return -lineno; /* typed twice */
                if (ntyped == 128) return -lineno;
                memcpy(typed[ntyped], name, nl);
                typed[ntyped++][nl] = 0;
            }
        } else {
            const char *name = p;
            if (!metric_name(&p)) return -lineno;
            size_t nl = (size_t)(p - name);
            bool known = false;
            for (int i = 0; i < ntyped; i++)
                if (strlen(typed[i]) == nl && strncmp(typed[i], name, nl) == 0) known = true;
            if (!known) return -lineno;
            if (*p == '{') {
                p++;
                while (*p != '}') {
                    const char *l = p;
                    if (!metric_name(&p) || p == l || *p++ != '=' || *p++ != '"') return -lineno;
                    while (*p != '"') {
                        if (p >= end) return -lineno;
                        if (*p == '\\') {
                            p++;
                            if (*p != '\\' && *p != '"' && *p != 'n') return -lineno;
                        }
                        p++;
                    }
                    p++;
                    if (*p == ',')
                        p++;
                    else if (*p != '}')
                        return -lineno;
                }
                p++;
            }
            if (*p++ != ' ') return -lineno;
            char num[64];
            size_t vl = (size_t)(end - p);
            if (!vl || vl >= sizeof num) return -lineno;
            memcpy(num, p, vl);
            num[vl] = 0;
            if (strcmp(num, "NaN") && strcmp(num, "+Inf") && strcmp(num, "-Inf")) {
                char *e;
                double v = strtod(num, &e);
                if (*e || !isfinite(v)) return -lineno;
            }
            samples++;
        }
        line = end + 1;
    }
    return samples;
}

static void test_prometheus_parser_rejects(void **state)
{
    (void)state;
    /* the parser in this test must be able to fail */
    assert_true(parse_prometheus("# TYPE apiary_a gauge\napiary_a 1\n") == 1);
    assert_true(parse_prometheus("apiary_a 1\n") < 0);                          /* untyped */
    assert_true(parse_prometheus("# TYPE apiary_a gauge\napiary_a one\n") < 0); /* value */
    assert_true(parse_prometheus("# TYPE apiary_a gauge\napiary_a{x=1} 1\n") < 0);
    assert_true(parse_prometheus("# TYPE other gauge\nother 1\n") < 0); /* prefix */
    assert_true(parse_prometheus("# TYPE apiary_a gauge\n# TYPE apiary_a gauge\n") < 0);
}

static long top_epoch(const char *json)
{
    const char *e = strstr(json, "\"epoch\":");
    return e ? strtol(e + 8, NULL, 10) : -1;
}

static bool have(const char *exe)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", exe);
    return system(cmd) == 0;
}

/* Dumps the DOM of the page after `wait_ms` of virtual time; returns the
 * malloc'd output or NULL. */
static char *chromium_dom(const char *exe, const char *url, int wait_ms, const char *dir)
{
    char cmd[1024], out[256];
    snprintf(out, sizeof out, "%s/dom.html", dir);
    snprintf(cmd, sizeof cmd,
             "timeout 60 %s --no-sandbox --disable-gpu --virtual-time-budget=%d --dump-dom '%s' "
             "> '%s' 2>/dev/null",
             exe, wait_ms, url, out);
    if (system(cmd) != 0) return NULL;
    FILE *f = fopen(out, "rb");
    if (!f) return NULL;
    char *b = calloc(1, 1 << 20);
    size_t n = fread(b, 1, (1 << 20) - 1, f);
    fclose(f);
    b[n] = 0;
    return b;
}

/* An attribute of the loss plot's svg element (-1 if missing). */
static int loss_attr(const char *dom, const char *attr)
{
    const char *p = strstr(dom, "id=\"lossplot\"");
    if (!p) return -1;
    char pat[64];
    snprintf(pat, sizeof pat, " %s=\"", attr);
    const char *d = strstr(p, pat), *end = strchr(p, '>');
    if (!d || !end || d > end) return -1;
    return atoi(d + strlen(pat));
}

static void test_monitor_processes(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-e2e-monitor-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char blog[256], mlog[256], addr[512] = "", line[1024];
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
    snprintf(mlog, sizeof mlog, "%s/monitor.log", dir);
    char *bargv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    pid_t boot = ap_test_spawn_log(bargv, blog);
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        if (ap_proc_grep_file(blog, "  /ip4/127.0.0.1/tcp/", line, sizeof line)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(addr, sizeof addr, "%s", strstr(line, "/ip4/"));
        }
    }
    assert_true(addr[0]);
    char *margv[] = {
        (char *)ap_test_cli(), "monitor", "--run-id", "mon", "--initial-peers", addr, "--http",
        "127.0.0.1:0",         NULL};
    pid_t mon = ap_test_spawn_log(margv, mlog);
    int port = 0;
    for (int i = 0; i < 100 && !port; i++) {
        ap_proc_sleep_ms(100);
        if (ap_proc_grep_file(mlog, "dashboard at http://127.0.0.1:", line, sizeof line))
            port = atoi(strstr(line, "127.0.0.1:") + 10);
    }
    assert_true(port > 0);

    pid_t pids[3];
    for (int i = 0; i < 3; i++) {
        char log[256], seed[8];
        snprintf(log, sizeof log, "%s/peer%d.log", dir, i);
        snprintf(seed, sizeof seed, "%d", i + 1);
        char *av[] = {(char *)ap_test_cli(),
                      "train",
                      "--run-id",
                      "mon",
                      "--initial-peers",
                      addr,
                      "--listen",
                      "/ip4/127.0.0.1/tcp/0",
                      "--model",
                      "mlp",
                      "--target-batch-size",
                      "32",
                      "--batch-size",
                      "8",
                      "--max-epochs",
                      "40",
                      "--duration",
                      "90",
                      "--seed",
                      seed,
                      "--matchmaking-window",
                      "0.2",
                      "--slowdown",
                      "20",
                      NULL};
        pids[i] = ap_test_spawn_log(av, log);
    }
    /* three peers, then a rising epoch */
    long first = -1, last = -1;
    char *st = NULL;
    for (int i = 0; i < 600; i++) {
        ap_proc_sleep_ms(100);
        free(st);
        st = http_get(port, "/api/state");
        if (!st || count(st, "\"role\":\"trainer\"") < 3) continue;
        long e = top_epoch(st);
        if (first < 0) first = e;
        last = e;
        if (last >= first + 2) break;
    }
    assert_non_null(st);
    print_message("epoch %ld -> %ld; state: %.300s...\n", first, last, st);
    assert_int_equal(count(st, "\"role\":\"trainer\""), 3);
    assert_true(first >= 0 && last >= first + 2);
    assert_non_null(strstr(st, "\"run_id\":\"mon\""));
    assert_true(count(st, "\"loss\":[[") == 1); /* the loss plot has points */
    free(st);

    char *m = http_get(port, "/metrics");
    assert_non_null(m);
    int ns = parse_prometheus(m);
    if (ns < 0) print_message("metrics line %d is not Prometheus text:\n%s\n", -ns, m);
    assert_true(ns > 10);
    assert_non_null(strstr(m, "apiary_peers{role=\"trainer\"} 3\n"));
    assert_non_null(strstr(m, "\napiary_epoch "));
    if (have("promtool")) {
        char path[300], cmd[400];
        snprintf(path, sizeof path, "%s/metrics.txt", dir);
        FILE *f = fopen(path, "w");
        fputs(m, f);
        fclose(f);
        snprintf(cmd, sizeof cmd, "promtool check metrics < '%s'", path);
        assert_int_equal(system(cmd), 0);
    } else {
        print_message("promtool not installed: the metrics were checked by this test's parser\n");
    }
    free(m);

    const char *chrome = have("chromium-headless-shell") ? "chromium-headless-shell"
                         : have("chromium")              ? "chromium"
                                                         : NULL;
    if (!chrome) {
        print_message("skipped the browser part: chromium-headless-shell is not installed "
                      "(scripts/deps.sh installs it)\n");
    } else {
        /* ?poll: the page polls /api/state (an open event stream would hold
         * the browser's virtual time still); 600 polls take some seconds */
        char url[64];
        snprintf(url, sizeof url, "http://127.0.0.1:%d/?poll", port);
        char *d = chromium_dom(chrome, url, 600000, dir);
        assert_non_null(d);
        int rows = count(d, "<tr class=\"peer\">");
        int p0 = loss_attr(d, "data-first-points"), p1 = loss_attr(d, "data-points");
        print_message("chromium: %d peer rows, loss plot %d points at first render, %d at the "
                      "end of one page load\n",
                      rows, p0, p1);
        assert_int_equal(rows, 3);
        /* one page load: the plot gained points (live updates, no reload) */
        assert_true(p0 > 0 && p1 > p0);
        char cmd[1024];
        snprintf(cmd, sizeof cmd,
                 "timeout 60 %s --no-sandbox --disable-gpu --virtual-time-budget=3000 "
                 "--window-size=1280,900 --screenshot=monitor-e2e.png '%s' >/dev/null 2>&1",
                 chrome, url);
        if (system(cmd) == 0) print_message("screenshot kept: monitor-e2e.png in the build dir\n");
        free(d);
    }

    for (int i = 0; i < 3; i++) kill(pids[i], SIGTERM);
    for (int i = 0; i < 3; i++) ap_proc_wait_exit(pids[i], 30);
    kill(mon, SIGTERM);
    assert_int_equal(ap_proc_wait_exit(mon, 30), 0);
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 30);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) print_message("could not remove %s\n", dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prometheus_parser_rejects),
        cmocka_unit_test(test_monitor_processes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
