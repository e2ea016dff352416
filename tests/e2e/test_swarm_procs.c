/* SWARM as real processes over TCP on loopback: a DHT bootstrap node, 2
 * stages x 2 `apiary swarm server` processes (each stage trains through the
 * collaborative optimizer) and 2 `apiary swarm trainer` processes that find
 * the servers in the DHT. A stage-1 server is SIGKILLed mid-run: the trainers
 * lose no micro-batch and their loss falls. A server restarted for that stage
 * rejoins and gets work from a third trainer. */
#include "aptest.h"
#include "procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define NSRV 4

static char dir[64];

static pid_t spawn(const char *name, char *const argv[], char *log, size_t n)
{
    snprintf(log, n, "%s/%s.log", dir, name);
    return ap_test_spawn_log(argv, log);
}

static pid_t server(int i, const char *addr, const char *stage, char *log, size_t n)
{
    char name[32];
    snprintf(name, sizeof name, "server%d", i);
    char *av[] = {(char *)ap_test_cli(),
                  "swarm",
                  "server",
                  "--run-id",
                  "e2e",
                  "--initial-peers",
                  (char *)addr,
                  "--listen",
                  "/ip4/127.0.0.1/tcp/0",
                  "--stage",
                  (char *)stage,
                  "--announce-period",
                  "1",
                  "--rebalance-period",
                  "0", /* this test keeps its stages; test_swarm_netns moves */
                  NULL};
    return spawn(name, av, log, n);
}

static pid_t trainer(int i, const char *addr, const char *steps, char *log, size_t n)
{
    char name[32], seed[16];
    snprintf(name, sizeof name, "trainer%d", i);
    snprintf(seed, sizeof seed, "%d", 5 + i);
    char *av[] = {
        (char *)ap_test_cli(), "swarm",   "trainer",     "--run-id", "e2e", "--initial-peers",
        (char *)addr,          "--steps", (char *)steps, "--seed",   seed,  NULL};
    return spawn(name, av, log, n);
}

/* The value after key in the trainer's summary line. */
static double field(const char *line, const char *key)
{
    const char *p = strstr(line, key);
    return p ? atof(p + strlen(key)) : -1;
}

static void test_swarm_procs(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/apiary-swarm-e2e-%d", (int)getpid());
    assert_int_equal(mkdir(dir, 0700) == 0 || access(dir, W_OK) == 0, 1);
    char blog[256], slog[NSRV + 1][256], tlog[3][256];
    char *bav[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    pid_t boot = spawn("bootstrap", bav, blog, sizeof blog);
    assert_true(boot > 0);
    char addr[512] = "";
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        char line[512];
        if (ap_proc_last_line(blog, "  /ip4/127.0.0.1/tcp/", line, sizeof line))
            snprintf(addr, sizeof addr, "%s", line + 2);
    }
    assert_true(addr[0]);
    pid_t srv[NSRV + 1];
    const char *stage[NSRV + 1] = {"0", "0", "1", "1", "1"};
    for (int i = 0; i < NSRV; i++) {
        srv[i] = server(i, addr, stage[i], slog[i], sizeof slog[i]);
        assert_true(srv[i] > 0);
    }
    for (int i = 0; i < NSRV; i++)
        for (int k = 0; k < 300 && !ap_proc_grep_file(slog[i], "swarm server ", NULL, 0); k++)
            ap_proc_sleep_ms(100);
    ap_proc_sleep_ms(1500); /* announced */
    pid_t tr[3];
    for (int i = 0; i < 2; i++) tr[i] = trainer(i, addr, "150", tlog[i], sizeof tlog[i]);
    /* kill server 3 (stage 1) once trainer 0 has done some micro-batches */
    bool killed = false;
    for (int k = 0; k < 1200 && !killed; k++) {
        ap_proc_sleep_ms(100);
        char line[512];
        if (ap_proc_last_line(tlog[0], "t ", line, sizeof line) && field(line, "batches ") >= 30) {
            kill(srv[3], SIGKILL);
            waitpid(srv[3], NULL, 0);
            killed = true;
        }
    }
    assert_true(killed);
    for (int i = 0; i < 2; i++) {
        int st = ap_proc_wait_exit(tr[i], 300);
        char line[512] = "";
        assert_true(ap_proc_last_line(tlog[i], "summary:", line, sizeof line));
        print_message("trainer%d: %s\n", i, line);
        assert_int_equal(st, 0);
        assert_int_equal((int)field(line, "batches "), 150);
        assert_int_equal((int)field(line, " failed "), 0);
        const double first = field(line, "loss first "), last = field(line, " last ");
        assert_true(last < 0.9 * first);
    }
    /* a restarted stage-1 server rejoins */
    srv[NSRV] = server(NSRV, addr, "1", slog[NSRV], sizeof slog[NSRV]);
    for (int k = 0; k < 300 && !ap_proc_grep_file(slog[NSRV], "swarm server ", NULL, 0); k++)
        ap_proc_sleep_ms(100);
    ap_proc_sleep_ms(2500);
    tr[2] = trainer(2, addr, "60", tlog[2], sizeof tlog[2]);
    assert_int_equal(ap_proc_wait_exit(tr[2], 300), 0);
    kill(srv[NSRV], SIGTERM);
    assert_int_equal(ap_proc_wait_exit(srv[NSRV], 60), 0);
    char line[512] = "";
    assert_true(ap_proc_last_line(slog[NSRV], "stage 1 summary:", line, sizeof line));
    print_message("restarted server: %s\n", line);
    assert_true(field(line, "forwards, ") > 0); /* backwards answered */
    for (int i = 0; i < NSRV; i++)
        if (i != 3) {
            kill(srv[i], SIGTERM);
            ap_proc_wait_exit(srv[i], 60);
        }
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 30);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_swarm_procs)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
