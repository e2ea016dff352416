/* SWARM across hosts: every process in its own network namespace on a
 * bridge (testing/netns.h), with its own address, all listening on the
 * wildcard address, so servers must announce their host address and
 * trainers must reach them through it. A bootstrap `apiary dht` (host 0),
 * four `apiary swarm server` processes of 2 stages started 3 + 1 (hosts
 * 1-4) with rebalancing every 3 s, and an `apiary swarm trainer` (host 5).
 * Stage 1 is the bottleneck: a stage-0 server moves there, joining stage
 * 1's collaboration (its state download) before it serves; the servers end
 * 2 per stage, the trainer routes 2 servers per stage, finishes every
 * micro-batch and its loss falls. (Throughputs measured on a loaded shared
 * machine are noisy, so the test does not insist on a single move; the
 * simulator tests do.) Skipped (cmocka skip) when not root or without
 * netns/veth. */
#include "aptest.h"
#include "procs.h"

#include "netns.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NH   6
#define NSRV 4

/* Runs the CLI with argv in host i's namespace, output to log. */
static pid_t spawn_in(const ap_netns_t *ns, size_t host, char *const argv[], const char *log)
{
    return ap_test_spawn_in_ns(ap_netns_name(ns, host), argv, log);
}

static double field(const char *line, const char *key)
{
    const char *p = strstr(line, key);
    return p ? atof(p + strlen(key)) : -1;
}

/* SIGTERM, then its exit status (128: ended by a signal, as by a crash
 * before the SIGTERM; -1: killed after 30 s). */
static int stop(pid_t pid)
{
    if (pid <= 0) return -1;
    kill(pid, SIGTERM);
    const int st = ap_proc_wait_exit(pid, 30);
    if (st < 0) print_message("pid %d killed after 30 s\n", (int)pid);
    return st;
}

static void test_swarm_across_hosts(void **state)
{
    (void)state;
    char why[300];
    if (ap_netns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    ap_netns_t *ns;
    if (ap_netns_new(NH, NULL, &ns, why, sizeof why)) fail_msg("namespaces: %s", why);
    char dir[] = "/tmp/apiary-e2e-swarm-netns-XXXXXX";
    assert_non_null(mkdtemp(dir));

    char blog[300], line[1024], addr[512] = "";
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
    char *bargv[] = {(char *)ap_test_cli(), "dht", NULL};
    pid_t boot = spawn_in(ns, 0, bargv, blog);
    char want[64];
    snprintf(want, sizeof want, "  /ip4/%s/tcp/", ap_netns_ip(ns, 0));
    for (int i = 0; i < 100 && !addr[0]; i++) {
        if (ap_proc_grep_file(blog, want, line, sizeof line)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(addr, sizeof addr, "%s", strstr(line, "/ip4/"));
        }
        ap_proc_sleep_ms(100);
    }
    if (!addr[0]) {
        kill(boot, SIGKILL);
        ap_netns_free(ns);
        fail_msg("the bootstrap did not print its host address %s", want);
    }

    char slog[NSRV][300], tlog[300];
    pid_t srv[NSRV];
    const char *stage[NSRV] = {"0", "0", "0", "1"};
    for (int i = 0; i < NSRV; i++) {
        snprintf(slog[i], sizeof slog[i], "%s/server%d.log", dir, i);
        char *av[] = {(char *)ap_test_cli(),
                      "swarm",
                      "server",
                      "--run-id",
                      "netns",
                      "--initial-peers",
                      addr,
                      "--stage",
                      (char *)stage[i],
                      "--announce-period",
                      "1",
                      "--rebalance-period",
                      "3",
                      NULL};
        srv[i] = spawn_in(ns, 1 + (size_t)i, av, slog[i]);
        assert_true(srv[i] > 0);
    }
    for (int i = 0; i < NSRV; i++)
        for (int k = 0; k < 300 && !ap_proc_grep_file(slog[i], "swarm server ", NULL, 0); k++)
            ap_proc_sleep_ms(100);
    ap_proc_sleep_ms(1500); /* announced */
    snprintf(tlog, sizeof tlog, "%s/trainer.log", dir);
    char *tav[] = {(char *)ap_test_cli(), "swarm", "trainer", "--run-id", "netns",
                   "--initial-peers",     addr,    "--steps", "200",      NULL};
    pid_t tr = spawn_in(ns, 5, tav, tlog);
    const int st = ap_proc_wait_exit(tr, 400);
    char sum[1024] = "", last[1024] = "";
    const bool have_sum = ap_proc_last_line(tlog, "summary:", sum, sizeof sum);
    ap_proc_last_line(tlog, "t ", last, sizeof last);
    print_message("trainer: %s\n  last status: %s\n", sum, last);
    int sst[NSRV];
    for (int i = 0; i < NSRV; i++) sst[i] = stop(srv[i]);
    /* who moved, and where every server ended (its summary line) */
    int moves = 0, first_mover = -1, per_stage[2] = {0, 0}, undownloaded = 0;
    for (int i = 0; i < NSRV; i++) {
        FILE *f = fopen(slog[i], "r");
        assert_non_null(f);
        int n = 0;
        while (fgets(line, sizeof line, f)) {
            if (strncmp(line, "rebalancing: moved", 18)) continue;
            if (n++ == 0 && !strncmp(line, "rebalancing: moved from stage 0 to stage 1", 42) &&
                first_mover < 0)
                first_mover = i;
            print_message("server%d: %s", i, line);
            /* no stage is ever left empty, so every move finds a donor */
            if (strstr(line, "no state downloaded")) undownloaded++;
        }
        fclose(f);
        moves += n;
        unsigned at = 9;
        if (ap_proc_last_line(slog[i], "stage ", line, sizeof line) &&
            sscanf(line, "stage %u", &at) == 1 && at < 2)
            per_stage[at]++;
    }
    stop(boot);
    ap_netns_free(ns);
    const bool ok = have_sum && st == 0 && (int)field(sum, "batches ") == 200 &&
                    (int)field(sum, " failed ") == 0 &&
                    field(sum, " last ") < 0.9 * field(sum, "loss first ") && first_mover >= 0 &&
                    first_mover < 3 && per_stage[0] == 2 && per_stage[1] == 2 &&
                    strstr(last, "servers per stage 2 2") && undownloaded == 0;
    if (!ok) {
        /* what a failure needs to be understood: the trainer's progress and
         * the servers' moves, steps and warnings */
        print_message("logs in %s\n", dir);
        ap_proc_print_tail(tlog, NULL, 40, "  trainer| ");
        for (int i = 0; i < NSRV; i++) {
            char tag[32];
            snprintf(tag, sizeof tag, "  server%d| ", i);
            ap_proc_print_tail(slog[i], NULL, 30, tag);
        }
    }
    /* every server lived to the end, whether its moves succeeded or not (a
     * move begun while an optimizer step was in flight once resumed serving
     * the old stage during the state download, failed with EBUSY and freed
     * the parameters the new stage's collaboration still used: the server
     * died before the SIGTERM) */
    for (int i = 0; i < NSRV; i++) {
        if (sst[i] != 0 || !ap_proc_grep_file(slog[i], "summary:", NULL, 0))
            fail_msg("server%d exited with status %d (log %s)", i, sst[i], slog[i]);
        if (ap_proc_grep_file(slog[i], "cannot move", line, sizeof line))
            fail_msg("server%d: %s(log %s)", i, line, slog[i]);
    }
    assert_int_equal(undownloaded, 0);
    assert_true(have_sum);
    assert_int_equal(st, 0);
    assert_int_equal((int)field(sum, "batches "), 200);
    assert_int_equal((int)field(sum, " failed "), 0);
    assert_true(field(sum, " last ") < 0.9 * field(sum, "loss first "));
    assert_true(first_mover >= 0 && first_mover < 3); /* a stage-0 server moved to stage 1 */
    assert_int_equal(per_stage[0], 2);
    assert_int_equal(per_stage[1], 2);
    print_message("moves in all: %d\n", moves);
    assert_non_null(strstr(last, "servers per stage 2 2"));
    for (int i = 0; i < NSRV; i++) unlink(slog[i]);
    unlink(tlog);
    unlink(blog);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_swarm_across_hosts)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
