/* A clean stop for every long-running command: `apiary dht` (node),
 * `apiary masha server` and `apiary masha worker` get SIGTERM or SIGINT
 * while they run (the worker while it waits for a server that is not there,
 * and again in the middle of a run) and must exit 0 on their own path with
 * the line saying why. Under the sanitizers (make asan-test) the same exit
 * also means nothing leaked: LeakSanitizer fails the process otherwise. */
#include "aptest.h"
#include "procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64];

static void logpath(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/%s.log", dir, name);
}

/* Waits up to 30 s for a line containing needle in log; copies it. */
static bool wait_line(const char *log, const char *needle, char *out, size_t n)
{
    for (int i = 0; i < 300; i++) {
        if (ap_proc_grep_file(log, needle, out, n)) return true;
        ap_proc_sleep_ms(100);
    }
    return false;
}

static void stop_and_check(pid_t pid, int sig, const char *log, const char *said)
{
    assert_int_equal(kill(pid, sig), 0);
    int st = ap_proc_wait_exit(pid, 20);
    char line[512];
    bool found = ap_proc_grep_file(log, said, line, sizeof line);
    if (st != 0 || !found) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "tail -n 20 %s", log);
        if (system(cmd) < 0) print_message("cannot show %s\n", log);
    }
    assert_int_equal(st, 0);
    assert_true(found);
}

static void test_dht_node(void **state)
{
    (void)state;
    const int sigs[2] = {SIGTERM, SIGINT};
    const char *said[2] = {"SIGTERM, shutting down", "SIGINT, shutting down"};
    for (int i = 0; i < 2; i++) {
        char log[128], line[512];
        logpath(log, sizeof log, i ? "dht-int" : "dht-term");
        char *argv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
        pid_t pid = ap_test_spawn_log(argv, log);
        assert_true(pid > 0);
        assert_true(wait_line(log, "share one of these", line, sizeof line));
        stop_and_check(pid, sigs[i], log, said[i]);
    }
}

static void test_masha(void **state)
{
    (void)state;
    char slog[128], wlog[128], line[512], addr[512];
    /* a server and a worker in the middle of a run that cannot finish (the
     * second worker never comes) */
    logpath(slog, sizeof slog, "masha-server");
    char *sargv[] = {
        (char *)ap_test_cli(), "masha", "server",    "--listen", "/ip4/127.0.0.1/tcp/0",
        "--workers",           "2",     "--timeout", "120",      NULL};
    pid_t s = ap_test_spawn_log(sargv, slog);
    assert_true(s > 0);
    assert_true(wait_line(slog, "/p2p/", line, sizeof line));
    line[strcspn(line, "\r\n")] = 0;
    snprintf(addr, sizeof addr, "%s", line);
    /* a worker waiting for a server that is not there (port 9, the
     * server's identity) */
    char nowhere[600];
    snprintf(nowhere, sizeof nowhere, "/ip4/127.0.0.1/tcp/9%s", strstr(addr, "/p2p/"));
    logpath(wlog, sizeof wlog, "masha-worker-alone");
    char *wargv0[] = {
        (char *)ap_test_cli(), "masha", "worker",    "--server", nowhere, "--index", "0",
        "--workers",           "2",     "--timeout", "120",      NULL};
    pid_t w0 = ap_test_spawn_log(wargv0, wlog);
    assert_true(w0 > 0);
    ap_proc_sleep_ms(1000);
    stop_and_check(w0, SIGINT, wlog, "masha worker: SIGINT, stopping");
    logpath(wlog, sizeof wlog, "masha-worker");
    char *wargv[] = {(char *)ap_test_cli(), "masha", "worker",    "--server", addr, "--index", "0",
                     "--workers",           "2",     "--timeout", "120",      NULL};
    pid_t w = ap_test_spawn_log(wargv, wlog);
    assert_true(w > 0);
    ap_proc_sleep_ms(1500);
    stop_and_check(w, SIGTERM, wlog, "masha worker: SIGTERM, stopping");
    /* the server sees a worker leave mid-run: it ends by itself, saying so */
    assert_int_equal(ap_proc_wait_exit(s, 20), 1);
    assert_true(ap_proc_grep_file(slog, "the run failed", line, sizeof line));
    /* a server waiting for workers that never come */
    logpath(slog, sizeof slog, "masha-server-alone");
    pid_t s2 = ap_test_spawn_log(sargv, slog);
    assert_true(s2 > 0);
    assert_true(wait_line(slog, "waiting for them", line, sizeof line));
    stop_and_check(s2, SIGTERM, slog, "masha server: SIGTERM, stopping");
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/apiary-stop-%d", (int)getpid());
    if (mkdir(dir, 0700) != 0) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dht_node),
        cmocka_unit_test(test_masha),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
