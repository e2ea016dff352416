/* Real processes on loopback: peers must agree on the run's configuration.
 * Two `apiary train` peers (MLP, default compression, no --seed) train; a
 * third with --compression fp16 joins: it exits non-zero naming the field
 * and both values, the others log the refusal the same way and finish their
 * epochs in complete groups. Without --seed the two peers see different
 * batches (seeds from their PeerIDs, different losses); --seed fixes it. */
#include "aptest.h"
#include "procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void start_boot(const char *dir, pid_t *boot, char *addr, size_t n)
{
    char blog[256], line[1024];
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
    char *bargv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    *boot = ap_test_spawn_log(bargv, blog);
    addr[0] = 0;
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        if (ap_proc_grep_file(blog, "  /ip4/127.0.0.1/tcp/", line, sizeof line)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(addr, n, "%s", strstr(line, "/ip4/"));
        }
    }
    assert_true(addr[0]);
}

static void test_odd_compression_exits(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-e2e-agree-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char addr[512], line[1024], logs[3][256];
    pid_t boot, pids[3];
    start_boot(dir, &boot, addr, sizeof addr);
    for (int i = 0; i < 3; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/peer%d.log", dir, i);
        char *av[] = {(char *)ap_test_cli(), "train", "--run-id", "agree", "--initial-peers", addr,
                      "--listen", "/ip4/127.0.0.1/tcp/0", "--model", "mlp", "--target-batch-size",
                      "16", "--batch-size", "8", "--max-epochs", "24", "--duration", "60",
                      "--matchmaking-window", "0.2", "--slowdown", "40",
                      /* the pair: default compression and no --seed */
                      i == 2 ? "--compression" : NULL, "fp16", "--seed", "7", NULL};
        if (i == 2) /* the odd one joins the running pair */
            for (int w = 0; w < 300 && !ap_proc_grep_file(logs[0], "epoch 2 ", NULL, 0); w++)
                ap_proc_sleep_ms(100);
        pids[i] = ap_test_spawn_log(av, logs[i]);
        if (i == 0) ap_proc_sleep_ms(500);
    }
    /* the odd one stops at once, non-zero, saying what differs */
    assert_int_equal(ap_proc_wait_exit(pids[2], 60), 1);
    assert_true(ap_proc_grep_file(logs[2], "refused by the run", line, sizeof line));
    print_message("odd peer: %s", line);
    assert_non_null(strstr(line, "compression: fp16 here, none at "));
    assert_true(ap_proc_grep_file(logs[2], "seed 7 (--seed)", NULL, 0));
    assert_false(ap_proc_grep_file(logs[2], "epoch 1 ", NULL, 0));
    for (int i = 0; i < 2; i++) {
        assert_int_equal(ap_proc_wait_exit(pids[i], 90), 0);
        assert_true(ap_proc_grep_file(logs[i], "refusing peer", line, sizeof line));
        print_message("peer%d: %s", i, line);
        assert_non_null(strstr(line, "compression: none here, fp16 at "));
        assert_true(ap_proc_grep_file(logs[i], "summary:", line, sizeof line));
        unsigned long long ep = 0, partial = 9;
        assert_int_equal(sscanf(strstr(line, "epochs"), "epochs %llu", &ep), 1);
        assert_int_equal(sscanf(strstr(line, "partial epochs"), "partial epochs %llu", &partial),
                         1);
        print_message("peer%d %s", i, line);
        assert_true(ep >= 24);
        assert_int_equal(partial, 0);
        assert_false(ap_proc_grep_file(logs[i], "(partial)", NULL, 0));
    }
    /* no --seed: each peer's data order comes from its PeerID */
    char s0[128] = "", s1[128] = "";
    assert_true(ap_proc_grep_file(logs[0], "data order: seed", s0, sizeof s0));
    assert_true(ap_proc_grep_file(logs[1], "data order: seed", s1, sizeof s1));
    assert_non_null(strstr(s0, "from the PeerID"));
    assert_string_not_equal(s0, s1);
    /* so the same model (same parameters after each step) sees other
     * batches: the losses printed for the first epochs differ */
    int differ = 0;
    for (int e = 1; e <= 4; e++) {
        char key[32], l0[1024], l1[1024];
        snprintf(key, sizeof key, "epoch %d | loss", e);
        if (!ap_proc_grep_file(logs[0], key, l0, sizeof l0) ||
            !ap_proc_grep_file(logs[1], key, l1, sizeof l1))
            continue;
        double a = -1, b = -1;
        sscanf(strstr(l0, "loss"), "loss %lf", &a);
        sscanf(strstr(l1, "loss"), "loss %lf", &b);
        differ += a != b;
    }
    assert_true(differ >= 1);
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_odd_compression_exits)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
