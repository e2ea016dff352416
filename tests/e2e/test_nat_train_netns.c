/* `apiary train` with a peer behind a NAT (testing/natns.h): three
 * `apiary dht` seeds on the bridge, a training peer on the bridge and one
 * behind a port-preserving NAT that drops unsolicited packets (no port
 * mapping there). The NATed peer learns from AutoNAT that it is private
 * and switches its DHT and its averaging to client-only; the public one
 * learns it is public. Both train for the whole run (25 s) and average
 * together.
 * Skipped (cmocka skip) when not root or without nftables. */
#include "aptest.h"
#include "procs.h"

#include "natns.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NSEED 3

static ap_natns_t *g_ns;
static pid_t g_pids[NSEED + 2];

static int teardown(void **state)
{
    (void)state;
    for (size_t i = 0; i < NSEED + 2; i++)
        if (g_pids[i] > 0) {
            kill(g_pids[i], SIGKILL);
            waitpid(g_pids[i], NULL, 0);
            g_pids[i] = 0;
        }
    ap_natns_free(g_ns);
    g_ns = NULL;
    return 0;
}

static pid_t spawn_in(bool home, size_t idx, char *const argv[], const char *log)
{
    const char *name = home ? ap_natns_home_name(g_ns, idx) : ap_natns_public_name(g_ns, idx);
    return ap_test_spawn_in_ns(name, argv, log);
}

static void test_train_behind_nat(void **state)
{
    (void)state;
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    const ap_nat_kind_t kinds[1] = {AP_NAT_DROP};
    if (ap_natns_new(NSEED + 1, 1, kinds, &g_ns, why, sizeof why)) fail_msg("topology: %s", why);
    char dir[] = "/tmp/apiary-e2e-nattrain-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char logs[NSEED + 2][300], line[1024], seeds[1024] = "";
    for (size_t i = 0; i < NSEED; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/seed%zu.log", dir, i);
        char *argv[] = {(char *)ap_test_cli(), "dht", "--initial-peers", seeds, NULL};
        if (i == 0) argv[2] = NULL;
        g_pids[i] = spawn_in(false, i, argv, logs[i]);
        char want[64];
        snprintf(want, sizeof want, "  /ip4/%s/tcp/", ap_natns_public_ip(g_ns, i));
        if (!ap_test_wait_line(logs[i], want, line, sizeof line, 20))
            fail_msg("seed %zu did not print its address %s", i, want);
        line[strcspn(line, "\n")] = 0;
        size_t at = strlen(seeds);
        snprintf(seeds + at, sizeof seeds - at, "%s%s", at ? "," : "", strstr(line, "/ip4/"));
    }
    const char *names[2] = {"public", "natted"};
    for (size_t k = 0; k < 2; k++) {
        snprintf(logs[NSEED + k], sizeof logs[0], "%s/%s.log", dir, names[k]);
        char seed[8];
        snprintf(seed, sizeof seed, "%zu", k + 1);
        char *av[] = {(char *)ap_test_cli(),
                      "train",
                      "--run-id",
                      "nat",
                      "--initial-peers",
                      seeds,
                      "--model",
                      "mlp",
                      "--target-batch-size",
                      "32",
                      "--batch-size",
                      "8",
                      "--duration",
                      "25",
                      "--seed",
                      seed,
                      "--matchmaking-window",
                      "0.3",
                      "--slowdown",
                      "10",
                      NULL};
        g_pids[NSEED + k] = spawn_in(k == 1, k == 0 ? NSEED : 0, av, logs[NSEED + k]);
    }
    int st[2];
    for (size_t k = 0; k < 2; k++) {
        st[k] = ap_proc_wait_exit(g_pids[NSEED + k], 180);
        g_pids[NSEED + k] = 0;
    }
    char got[2][1024], sum[2][1024];
    const char *want[2] = {"reachability public", "reachability private"};
    for (size_t k = 0; k < 2; k++) {
        assert_true(ap_proc_grep_file(logs[NSEED + k], want[k], got[k], sizeof got[k]));
        print_message("%s: %s", names[k], got[k]);
        assert_int_equal(st[k], 0);
        assert_true(ap_proc_grep_file(logs[NSEED + k], "summary:", sum[k], sizeof sum[k]));
        print_message("%s %s", names[k], sum[k]);
        unsigned long long ep = 0;
        assert_int_equal(sscanf(strstr(sum[k], "epochs"), "epochs %llu", &ep), 1);
        assert_true(ep >= 3);
        assert_true(ap_proc_grep_file(logs[NSEED + k], "| group 2 |", NULL, 0));
    }
    assert_non_null(strstr(got[1], "the DHT and averaging run client-only"));
    assert_false(ap_proc_grep_file(logs[NSEED + 0], "reachability private", NULL, 0));
    for (size_t i = 0; i < NSEED + 2; i++) unlink(logs[i]);
    rmdir(dir);
    teardown(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_train_behind_nat, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
