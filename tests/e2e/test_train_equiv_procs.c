/* Collaborative training with real processes on loopback (TCP + Noise).
 *
 * 1. Equivalence (issue 8): 4 `apiary train` peers with target_batch_size =
 *    4·b, each contributing exactly one batch of b per epoch
 *    (--max-local-batches-per-epoch 1: a peer at its cap waits for the
 *    epoch's round) on its shard of the data (--data-shard i/4), trained for
 *    N epochs, reach the same parameters and loss as one process training
 *    with batch 4·b for N steps on the same samples (same initialisation,
 *    Adam, clipping). The only difference is the order of the fp32 sums in
 *    the all-reduce. Tolerance (stated in docs/training.md): max |Δparam|
 *    <= 1e-5 (parameters are O(0.1-1); measured 3e-8) and evaluation loss
 *    within 1e-5 relative. Every epoch of every peer must have averaged exactly 4·b
 *    samples in a group of 4, else the comparison would be meaningless.
 * 2. Delayed-mode checkpoints: two MLP peers with --delayed-updates and no
 *    slowdown (rounds back to back, the case where checkpoints used to
 *    starve) write a checkpoint every epoch; a peer resumes from one. */
#include "aptest.h"
#include "procs.h"

#include "apiary/nn.h"

#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NPEERS 4
#define B      8
#define EPOCHS 8

static pid_t start_boot(const char *dir, char *addr, size_t n)
{
    char blog[256], line[1024];
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
    char *bargv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    pid_t boot = ap_test_spawn_log(bargv, blog);
    addr[0] = 0;
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        if (ap_proc_grep_file(blog, "  /ip4/127.0.0.1/tcp/", line, sizeof line)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(addr, n, "%s", strstr(line, "/ip4/"));
        }
    }
    assert_true(addr[0]);
    return boot;
}

/* The MLP of `apiary train --model mlp` (16-64-4). */
static ap_nn_model_t *train_mlp(int max_batch)
{
    ap_nn_mlp_config_t mc = {
        .in_dim = 16, .n_hidden = 1, .hidden = {64}, .n_classes = 4, .max_batch = max_batch};
    ap_nn_model_t *m = NULL;
    assert_ok(ap_nn_mlp_new(&mc, &m));
    ap_nn_model_init(m, 42);
    return m;
}

/* Loads a checkpoint of `apiary train --model mlp` (with the state of its
 * default optimizer, LAMB). */
static ap_nn_model_t *load_ckpt(const char *path, uint64_t *epoch)
{
    ap_nn_model_t *m = train_mlp(512);
    ap_nn_params_t *pr = ap_nn_model_params(m);
    ap_nn_solver_config_t oc = ap_nn_solver_defaults(AP_NN_LAMB);
    ap_nn_solver_t *o = NULL;
    assert_ok(ap_nn_solver_new(&oc, pr->count, pr->views, pr->nviews, &o));
    assert_ok(ap_nn_checkpoint_load(path, m, o, epoch));
    ap_nn_solver_free(o);
    return m;
}

/* Mean loss on 512 samples of another stream than the training data. */
static double eval_loss(ap_nn_model_t *m)
{
    enum { NE = 512 };
    static float x[NE * 16];
    static int32_t y[NE];
    ap_nn_synth_classify(7, 0xe7a1, 0, NE, 16, 4, x, y);
    float loss = 0;
    assert_ok(ap_nn_mlp_forward(m, x, y, NE, &loss));
    return loss;
}

static void test_equivalence_processes(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-e2e-equiv-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char addr[512], line[1024];
    pid_t boot = start_boot(dir, addr, sizeof addr);

    char epochs[16], tbs[16], bs[16], big[16];
    snprintf(epochs, sizeof epochs, "%d", EPOCHS);
    snprintf(tbs, sizeof tbs, "%d", NPEERS * B);
    snprintf(bs, sizeof bs, "%d", B);
    snprintf(big, sizeof big, "%d", NPEERS * B);

    /* the reference: one process, batch 4·b, N steps (alone in its run) */
    char slog[256], sck[256];
    snprintf(slog, sizeof slog, "%s/single.log", dir);
    snprintf(sck, sizeof sck, "%s/single", dir);
    char *sv[] = {(char *)ap_test_cli(),
                  "train",
                  "--run-id",
                  "equiv-single",
                  "--initial-peers",
                  addr,
                  "--listen",
                  "/ip4/127.0.0.1/tcp/0",
                  "--model",
                  "mlp",
                  "--target-batch-size",
                  big,
                  "--batch-size",
                  big,
                  "--max-epochs",
                  epochs,
                  "--duration",
                  "90",
                  "--average-state-every",
                  "0",
                  "--checkpoint-dir",
                  sck,
                  "--seed", /* the shards' stream (their default seed) */
                  "1",
                  NULL};
    pid_t single = ap_test_spawn_log(sv, slog);

    /* the collaboration: 4 peers, one batch of b each per epoch */
    char logs[NPEERS][256], cks[NPEERS][256], shard[NPEERS][16];
    pid_t pids[NPEERS];
    for (int i = 0; i < NPEERS; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/peer%d.log", dir, i);
        snprintf(cks[i], sizeof cks[i], "%s/peer%d", dir, i);
        snprintf(shard[i], sizeof shard[i], "%d/%d", i, NPEERS);
        char *av[] = {(char *)ap_test_cli(),
                      "train",
                      "--run-id",
                      "equiv",
                      "--initial-peers",
                      addr,
                      "--listen",
                      "/ip4/127.0.0.1/tcp/0",
                      "--model",
                      "mlp",
                      "--target-batch-size",
                      tbs,
                      "--batch-size",
                      bs,
                      "--max-local-batches-per-epoch",
                      "1",
                      "--data-shard",
                      shard[i],
                      "--max-epochs",
                      epochs,
                      "--duration",
                      "90",
                      "--average-state-every",
                      "0",
                      "--matchmaking-window",
                      "1.0",
                      "--checkpoint-dir",
                      cks[i],
                      "--log-level",
                      "info",
                      NULL};
        pids[i] = ap_test_spawn_log(av, logs[i]);
    }
    assert_int_equal(ap_proc_wait_exit(single, 120), 0);
    for (int i = 0; i < NPEERS; i++) assert_int_equal(ap_proc_wait_exit(pids[i], 120), 0);
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);

    /* every epoch of every peer: a complete group of 4 averaging exactly 4·b */
    for (int i = 0; i < NPEERS; i++) {
        assert_true(ap_proc_grep_file(logs[i], "summary:", line, sizeof line));
        print_message("peer%d %s", i, line);
        assert_non_null(strstr(line, "partial epochs 0 "));
        /* a download at start-up (epoch 0: the same initialisation) is
         * harmless; none later (no peer fell behind or missed a group) */
        assert_false(ap_proc_grep_file(logs[i], "behind: epoch", NULL, 0));
        assert_false(ap_proc_grep_file(logs[i], "missed the averaging group", NULL, 0));
        for (int e = 1; e <= EPOCHS; e++) {
            char want[96];
            snprintf(want, sizeof want, "epoch %d reached (%d peers, %d samples)", e, NPEERS,
                     NPEERS * B);
            if (!ap_proc_grep_file(logs[i], want, NULL, 0)) {
                print_message("peer%d: no \"%s\" in %s\n", i, want, logs[i]);
                fail();
            }
        }
    }

    char path[512];
    uint64_t ep = 0;
    snprintf(path, sizeof path, "%s/equiv-single.ckpt", sck);
    ap_nn_model_t *ref = load_ckpt(path, &ep);
    assert_int_equal(ep, EPOCHS);
    double ref_loss = eval_loss(ref), init_loss;
    {
        ap_nn_model_t *m0 = train_mlp(512);
        init_loss = eval_loss(m0);
        ap_nn_model_free(m0);
    }
    ap_nn_params_t *rp = ap_nn_model_params(ref);
    double worst = 0, worst_rel_loss = 0;
    for (int i = 0; i < NPEERS; i++) {
        snprintf(path, sizeof path, "%s/equiv.ckpt", cks[i]);
        ap_nn_model_t *m = load_ckpt(path, &ep);
        assert_int_equal(ep, EPOCHS);
        ap_nn_params_t *pp = ap_nn_model_params(m);
        double d = 0;
        for (size_t k = 0; k < pp->count; k++) {
            double t = fabs((double)pp->data[k] - (double)rp->data[k]);
            if (t > d) d = t;
        }
        double l = eval_loss(m), rel = fabs(l - ref_loss) / ref_loss;
        print_message("peer%d: max |dparam| %.3e, eval loss %.6f (single process %.6f, rel %.2e)\n",
                      i, d, l, ref_loss, rel);
        if (d > worst) worst = d;
        if (rel > worst_rel_loss) worst_rel_loss = rel;
        ap_nn_model_free(m);
    }
    print_message("initial eval loss %.4f, after %d epochs %.4f\n", init_loss, EPOCHS, ref_loss);
    assert_true(ref_loss < init_loss); /* it trained: the comparison is not of two no-ops */
    assert_true(worst <= 1e-5);
    assert_true(worst_rel_loss <= 1e-5);
    ap_nn_model_free(ref);
}

static void test_delayed_checkpoints_processes(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-e2e-dckpt-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char addr[512], line[1024];
    pid_t boot = start_boot(dir, addr, sizeof addr);
    char logs[3][256], cks[2][256];
    pid_t pids[2];
    for (int i = 0; i < 2; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/peer%d.log", dir, i);
        snprintf(cks[i], sizeof cks[i], "%s/ck%d", dir, i);
        char seed[8];
        snprintf(seed, sizeof seed, "%d", i + 1);
        char *av[] = {(char *)ap_test_cli(),
                      "train",
                      "--run-id",
                      "dckpt",
                      "--initial-peers",
                      addr,
                      "--listen",
                      "/ip4/127.0.0.1/tcp/0",
                      "--model",
                      "mlp",
                      "--target-batch-size",
                      "64",
                      "--batch-size",
                      "8",
                      "--max-epochs",
                      "6",
                      "--duration",
                      "60",
                      "--seed",
                      seed,
                      "--matchmaking-window",
                      "0.2",
                      "--delayed-updates",
                      "--checkpoint-dir",
                      cks[i],
                      NULL};
        pids[i] = ap_test_spawn_log(av, logs[i]);
    }
    for (int i = 0; i < 2; i++) assert_int_equal(ap_proc_wait_exit(pids[i], 90), 0);
    unsigned long long saved = 0;
    for (int i = 0; i < 2; i++) {
        assert_true(ap_proc_grep_file(logs[i], "summary:", line, sizeof line));
        print_message("peer%d %s", i, line);
        /* a checkpoint per epoch (plus one at exit), not starved */
        int n = 0;
        for (int e = 1; e <= 6; e++) {
            char want[64];
            snprintf(want, sizeof want, "checkpoint: epoch %d saved", e);
            n += ap_proc_grep_file(logs[i], want, NULL, 0);
        }
        print_message("peer%d: %d of 6 epochs checkpointed\n", i, n);
        assert_true(n >= 5);
        assert_true(ap_proc_grep_file(logs[i], "(at exit)", line, sizeof line));
        assert_int_equal(sscanf(strstr(line, "epoch"), "epoch %llu", &saved), 1);
        assert_true(saved >= 6);
    }
    /* resume from peer 0's checkpoint, alone, two more epochs */
    snprintf(logs[2], sizeof logs[2], "%s/resume.log", dir);
    char *rv[] = {(char *)ap_test_cli(),
                  "train",
                  "--run-id",
                  "dckpt-resume",
                  "--initial-peers",
                  addr,
                  "--listen",
                  "/ip4/127.0.0.1/tcp/0",
                  "--model",
                  "mlp",
                  "--target-batch-size",
                  "64",
                  "--batch-size",
                  "8",
                  "--max-epochs",
                  "8",
                  "--duration",
                  "60",
                  "--delayed-updates",
                  "--checkpoint-dir",
                  cks[0],
                  NULL};
    /* the checkpoint file is named after the run: reuse peer 0's */
    char from[512], to[512];
    snprintf(from, sizeof from, "%s/dckpt.ckpt", cks[0]);
    snprintf(to, sizeof to, "%s/dckpt-resume.ckpt", cks[0]);
    assert_int_equal(link(from, to), 0);
    pid_t r = ap_test_spawn_log(rv, logs[2]);
    assert_int_equal(ap_proc_wait_exit(r, 90), 0);
    assert_true(ap_proc_grep_file(logs[2], "resumed from", line, sizeof line));
    print_message("%s", line);
    unsigned long long at = 0;
    assert_int_equal(sscanf(strstr(line, "at epoch"), "at epoch %llu", &at), 1);
    assert_int_equal(at, saved);
    assert_true(ap_proc_grep_file(logs[2], "summary: epochs 8", NULL, 0));
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_equivalence_processes),
                                       cmocka_unit_test(test_delayed_checkpoints_processes)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
