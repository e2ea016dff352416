/* The DHT over real sockets: 32 `apiary dht` node processes on loopback (TCP
 * + Noise), stores and gets through the one-shot CLI tools, one node killed
 * with SIGKILL mid-run, clean shutdown of the rest on SIGTERM. */
#include "aptest.h"
#include "procs.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXN 32

typedef struct proc {
    pid_t pid;
    char addr[256];
} proc_t;

/* Starts `apiary dht` with extra args; reads its stdout until the shared
 * multiaddr line appears (or the process dies). */
static int start_node(proc_t *p, const char *initial)
{
    int fds[2];
    if (pipe(fds)) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        dup2(fds[1], 1);
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 2);
        close(fds[0]);
        close(fds[1]);
        if (initial)
            execl(ap_test_cli(), ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0",
                  "--initial-peers", initial, (char *)NULL);
        else
            execl(ap_test_cli(), ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0",
                  (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    p->pid = pid;
    p->addr[0] = 0;
    FILE *f = fdopen(fds[0], "r");
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *s = strstr(line, "/ip4/");
        if (s && strstr(s, "/p2p/")) {
            s[strcspn(s, "\r\n")] = 0;
            snprintf(p->addr, sizeof p->addr, "%s", s);
            break;
        }
    }
    fclose(f); /* the node keeps running; later writes to stdout go nowhere */
    return p->addr[0] ? 0 : -1;
}

/* Runs `apiary dht ARGS...`; captures stdout into out; returns the exit code. */
static int run_tool(char *out, size_t cap, const char *const *args)
{
    int fds[2];
    if (pipe(fds)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 1);
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 2);
        close(fds[0]);
        close(fds[1]);
        const char *argv[16];
        int n = 0;
        argv[n++] = ap_test_cli();
        argv[n++] = "dht";
        for (int i = 0; args[i] && n < 15; i++) argv[n++] = args[i];
        argv[n] = NULL;
        execv(ap_test_cli(), (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t r;
    while ((r = read(fds[0], out + len, cap - 1 - len)) > 0) len += (size_t)r;
    out[len] = 0;
    close(fds[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_32_processes(void **state)
{
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    int n = ap_test_sanitized() ? 10 : MAXN;
    proc_t p[MAXN];
    memset(p, 0, sizeof p);
    assert_int_equal(start_node(&p[0], NULL), 0);
    for (int i = 1; i < n; i++) {
        /* join through one of the earlier nodes */
        assert_int_equal(start_node(&p[i], p[(i * 7) % i].addr), 0);
    }
    int nkeys = ap_test_sanitized() ? 6 : 16;
    char key[32], val[32], out[4096];
    for (int k = 0; k < nkeys; k++) {
        snprintf(key, sizeof key, "e2e-%d", k);
        snprintf(val, sizeof val, "value-%d", k);
        const char *args[] = {
            "store", key, val, "--ttl", "300", "--initial-peers", p[(k * 5) % n].addr, NULL};
        assert_int_equal(run_tool(out, sizeof out, args), 0);
        assert_non_null(strstr(out, "stored on"));
    }
    /* one node dies without warning */
    int victim = n / 2;
    kill(p[victim].pid, SIGKILL);
    waitpid(p[victim].pid, NULL, 0);
    p[victim].pid = 0;
    int found = 0;
    for (int k = 0; k < nkeys; k++) {
        snprintf(key, sizeof key, "e2e-%d", k);
        snprintf(val, sizeof val, "value-%d", k);
        int via = (k * 3 + 1) % n;
        if (via == victim) via = (via + 1) % n;
        const char *args[] = {"get", key, "--initial-peers", p[via].addr, NULL};
        int rc = run_tool(out, sizeof out, args);
        if (rc == 0 && !strncmp(out, val, strlen(val)) && out[strlen(val)] == '\t') found++;
    }
    print_message("%d processes, one SIGKILLed: %d/%d keys found\n", n, found, nkeys);
    assert_int_equal(found, nkeys);
    /* a get through the dead node's address fails with a clear exit code */
    const char *dead[] = {"get", "e2e-0", "--initial-peers", p[victim].addr, NULL};
    assert_int_equal(run_tool(out, sizeof out, dead), 1);
    /* the rest shut down cleanly on SIGTERM */
    for (int i = 0; i < n; i++)
        if (p[i].pid) kill(p[i].pid, SIGTERM);
    for (int i = 0; i < n; i++) {
        if (!p[i].pid) continue;
        int st;
        assert_int_equal(waitpid(p[i].pid, &st, 0), p[i].pid);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_32_processes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
