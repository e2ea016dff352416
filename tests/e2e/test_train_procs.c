/* Collaborative training with real processes on loopback (TCP + Noise):
 * an `apiary dht` bootstrap node and two `apiary train` peers (MLP) reach
 * the target epoch together; a third peer started later catches up by
 * downloading the state; a peer resumes from its checkpoint, and a
 * checkpoint of another model is refused while training goes on. */
#include "aptest.h"
#include "procs.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void test_train_processes(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-e2e-train-XXXXXX";
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

    char logs[4][256], ck[256];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    pid_t pids[4];
    for (int i = 0; i < 3; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/peer%d.log", dir, i);
        char seed[8];
        snprintf(seed, sizeof seed, "%d", i + 1);
        char *av[] = {(char *)ap_test_cli(),
                      "train",
                      "--run-id",
                      "e2e",
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
                      "12",
                      "--duration",
                      "60",
                      "--seed",
                      seed,
                      "--matchmaking-window",
                      "0.2",
                      "--slowdown",
                      "20",
                      i == 0 ? "--checkpoint-dir" : NULL,
                      ck,
                      NULL};
        if (i == 2) {
            /* the latecomer joins once the others are a few epochs in */
            for (int w = 0; w < 300 && !ap_proc_grep_file(logs[0], "epoch 3 ", NULL, 0); w++)
                ap_proc_sleep_ms(100);
        }
        pids[i] = ap_test_spawn_log(av, logs[i]);
        if (i == 0) ap_proc_sleep_ms(500);
    }
    for (int i = 0; i < 3; i++) assert_int_equal(ap_proc_wait_exit(pids[i], 90), 0);
    unsigned long long ep[3] = {0};
    for (int i = 0; i < 3; i++) {
        assert_true(ap_proc_grep_file(logs[i], "summary:", line, sizeof line));
        assert_int_equal(sscanf(strstr(line, "epochs"), "epochs %llu", &ep[i]), 1);
        print_message("peer%d %s", i, line);
    }
    assert_true(ep[0] >= 12 && ep[1] >= 12);
    /* The latecomer caught up by downloading state: at start-up ("caught up: loaded
     * epoch ...") or, when the donors were busy then, as a laggard later on. */
    unsigned long long loads = 0;
    assert_true(ap_proc_grep_file(logs[2], "summary:", line, sizeof line));
    assert_non_null(strstr(line, "state loads"));
    assert_int_equal(sscanf(strstr(line, "state loads"), "state loads %llu", &loads), 1);
    assert_true(loads >= 1);

    /* resume from the checkpoint */
    snprintf(logs[3], sizeof logs[3], "%s/resume.log", dir);
    char *rv[] = {(char *)ap_test_cli(),
                  "train",
                  "--run-id",
                  "e2e",
                  "--listen",
                  "/ip4/127.0.0.1/tcp/0",
                  "--model",
                  "mlp",
                  "--target-batch-size",
                  "8",
                  "--batch-size",
                  "8",
                  "--max-epochs",
                  "14",
                  "--duration",
                  "30",
                  "--checkpoint-dir",
                  ck,
                  NULL};
    pids[3] = ap_test_spawn_log(rv, logs[3]);
    assert_int_equal(ap_proc_wait_exit(pids[3], 60), 0);
    assert_true(ap_proc_grep_file(logs[3], "resumed from", line, sizeof line));
    /* a GPT reading the MLP's checkpoint refuses it and trains on */
    char *gv[] = {(char *)ap_test_cli(),
                  "train",
                  "--run-id",
                  "e2e",
                  "--listen",
                  "/ip4/127.0.0.1/tcp/0",
                  "--model",
                  "gpt",
                  "--target-batch-size",
                  "8",
                  "--batch-size",
                  "8",
                  "--max-epochs",
                  "1",
                  "--duration",
                  "30",
                  "--checkpoint-dir",
                  ck,
                  NULL};
    pids[3] = ap_test_spawn_log(gv, logs[3]);
    assert_int_equal(ap_proc_wait_exit(pids[3], 60), 0);
    assert_true(ap_proc_grep_file(logs[3], "refused", NULL, 0));
    assert_true(ap_proc_grep_file(logs[3], "summary: epochs 1", NULL, 0));
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_train_processes)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
