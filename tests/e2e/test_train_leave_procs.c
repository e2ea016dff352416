/* A peer that dies leaves the others' count quickly, with real processes on
 * loopback: an `apiary dht` bootstrap node and three `apiary train` peers
 * (MLP). Once every peer prints "peers 3", one is killed with SIGKILL (no
 * goodbye: its record simply stops changing). Each survivor must print an
 * epoch line with "peers 2" within 15 s of the kill; the stale rule alone
 * (20 s) could not. The survivors go on training and stop cleanly. */
#include "aptest.h"
#include "procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NPEERS 3

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static long file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : 0;
}

/* Whether the file holds needle at or after byte offset from. */
static bool grep_after(const char *path, long from, const char *needle)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    bool found = false;
    char line[1024];
    if (fseek(f, from, SEEK_SET) == 0)
        while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

static void test_killed_peer_leaves_count(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-e2e-leave-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char blog[256], addr[512] = "", line[1024];
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
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

    char logs[NPEERS][256];
    pid_t pids[NPEERS];
    for (int i = 0; i < NPEERS; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/peer%d.log", dir, i);
        char seed[8];
        snprintf(seed, sizeof seed, "%d", i + 1);
        char *av[] = {(char *)ap_test_cli(),
                      "train",
                      "--run-id",
                      "leave",
                      "--initial-peers",
                      addr,
                      "--listen",
                      "/ip4/127.0.0.1/tcp/0",
                      "--model",
                      "mlp",
                      "--target-batch-size",
                      "48",
                      "--batch-size",
                      "8",
                      "--duration",
                      "120",
                      "--seed",
                      seed,
                      "--matchmaking-window",
                      "0.2",
                      "--slowdown",
                      "20",
                      NULL};
        pids[i] = ap_test_spawn_log(av, logs[i]);
    }
    /* every peer counts all three */
    bool all = false;
    for (int w = 0; w < 600 && !all; w++) {
        ap_proc_sleep_ms(100);
        all = true;
        for (int i = 0; i < NPEERS; i++)
            all = all && ap_proc_grep_file(logs[i], "| peers 3 |", NULL, 0);
    }
    assert_true(all);

    const int dead = NPEERS - 1;
    long from[NPEERS];
    for (int i = 0; i < NPEERS; i++) from[i] = file_size(logs[i]);
    double t_kill = now_s();
    kill(pids[dead], SIGKILL);
    waitpid(pids[dead], NULL, 0);
    bool seen[NPEERS] = {false};
    double took[NPEERS] = {0};
    int nseen = 0;
    while (nseen < NPEERS - 1 && now_s() - t_kill < 15.0) {
        ap_proc_sleep_ms(100);
        for (int i = 0; i < NPEERS; i++)
            if (i != dead && !seen[i] && grep_after(logs[i], from[i], "| peers 2 |")) {
                seen[i] = true;
                took[i] = now_s() - t_kill;
                nseen++;
            }
    }
    for (int i = 0; i < NPEERS; i++)
        if (i != dead)
            print_message("peer %d: %s after the kill\n", i,
                          seen[i] ? "counts 2 peers" : "still counts 3 peers 15 s");
    for (int i = 0; i < NPEERS; i++)
        if (i != dead && seen[i]) print_message("peer %d: %.1f s\n", i, took[i]);
    /* the survivors still train: a further epoch line after the drop */
    for (int i = 0; i < NPEERS; i++) from[i] = file_size(logs[i]);
    bool more = false;
    for (int w = 0; w < 300 && !more; w++) {
        ap_proc_sleep_ms(100);
        more = grep_after(logs[0], from[0], "epoch ");
    }
    for (int i = 0; i < NPEERS; i++)
        if (i != dead) {
            kill(pids[i], SIGTERM);
            assert_int_equal(ap_proc_wait_exit(pids[i], 30), 0);
        }
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);
    for (int i = 0; i < NPEERS; i++)
        if (i != dead) assert_true(seen[i]);
    assert_true(more);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_killed_peer_leaves_count),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
