/* `apiary train`'s model-shape and optimizer flags: every bad value is
 * refused before the peer joins anything, with a message naming the flag;
 * the optimizer and schedule names round-trip through the model kit. */
#include "aptest.h"

#include "apiary/nn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[64];

static int run(const char *args)
{
    const char *cli = getenv("APIARY_CLI");
    if (!cli) fail_msg("APIARY_CLI not set (run through ctest)");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' train %s >%s/out.txt 2>%s/err.txt", cli, args, dir, dir);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static bool file_contains(const char *name, const char *needle)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t len;
    char *s = ap_test_read_file(path, &len);
    bool ok = s && strstr(s, needle);
    free(s);
    return ok;
}

static void test_bad_flags(void **state)
{
    (void)state;
    static const struct {
        const char *args, *needle;
    } bad[] = {
        {"--lr nan", "--lr"},
        {"--lr inf", "--lr"},
        {"--lr 0", "--lr"},
        {"--lr -1", "--lr"},
        {"--clip -1", "--clip"},
        {"--clip nan", "--clip"},
        {"--warmup -2", "--warmup"},
        {"--warmup x", "--warmup"},
        {"--layers 0", "--layers"},
        {"--heads 0", "--heads"},
        {"--embd 100000", "--embd"},
        {"--ctx 0", "--ctx"},
        {"--embd 100 --heads 3", "not a multiple of --heads"},
        {"--optim rmsprop", "use lamb, adamw, adam or sgd"},
        {"--schedule step", "use rsqrt, constant, linear or cosine"},
        {"--schedule cosine", "--decay-epochs"},
        {"--schedule linear --warmup 10 --decay-epochs 5", "within the 10 warm-up epochs"},
        {"--decay-epochs 0", "--decay-epochs"},
        {"--byzantine-tolerant --btard-validators -1", "--btard-validators"},
        {"--byzantine-tolerant --btard-validators 65", "--btard-validators"},
        {"--byzantine-tolerant --btard-validators two", "--btard-validators"},
        {"--btard-validators 2", "--btard-validators needs --byzantine-tolerant"},
        {"--attack alie", "the attacks are sign-flip, random-direction"},
        {"--attack false-accuser", "--attack false-accuser needs --byzantine-tolerant"},
        {"--attack bad-aggregator", "--attack bad-aggregator needs --byzantine-tolerant"},
        {"--byzantine-tolerant --btard-validators 2 --delayed-updates",
         "--btard-validators and --delayed-updates exclude each other"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = run(bad[i].args);
        if (rc != 2 || !file_contains("err.txt", bad[i].needle))
            fail_msg("apiary train %s: exit %d, stderr lacks '%s'", bad[i].args, rc, bad[i].needle);
    }
}

/* A valid shape and recipe are used: the model built has that shape's
 * parameter count and the optimizer line names what was asked. */
static void test_good_flags(void **state)
{
    (void)state;
    int rc = run("--listen /ip4/127.0.0.1/tcp/0 --duration 1 --batch-size 2 --layers 1 "
                 "--embd 32 --heads 2 --ctx 16 --share-layers --optim adamw --warmup 2 "
                 "--schedule cosine --decay-epochs 10 --clip 0.5");
    assert_int_equal(rc, 0);
    ap_nn_gpt_config_t gc = ap_nn_gpt_config_default(16, 1, 2, 32, 2);
    gc.share_layers = true;
    ap_nn_model_t *m = NULL;
    assert_int_equal(ap_nn_gpt_new(&gc, &m), 0);
    char want[128];
    snprintf(want, sizeof want, ": %zu parameters,", ap_nn_model_params(m)->count);
    ap_nn_model_free(m);
    if (!file_contains("out.txt", want)) fail_msg("output lacks '%s'", want);
    const char *line =
        "optimizer adamw, lr 0.002, warm-up 2 epochs, schedule cosine to 0.0002 at epoch 10, "
        "clip 0.5";
    if (!file_contains("out.txt", line)) fail_msg("output lacks '%s'", line);
    assert_int_equal(run("--help"), 0);
    assert_true(file_contains("out.txt", "--share-layers"));
    assert_true(file_contains("out.txt", "--btard-validators N"));
}

/* --btard-validators reaches the run: a peer alone trains with the gradient
 * check configured (its run configuration carries the count). */
static void test_validators(void **state)
{
    (void)state;
    int rc = run("--listen /ip4/127.0.0.1/tcp/0 --duration 1 --model mlp --batch-size 8 "
                 "--byzantine-tolerant --btard-validators 3");
    if (rc != 0) fail_msg("exit %d", rc);
    if (!file_contains("out.txt", "byzantine-tolerant: tau 1, 3 validators per step\n"))
        fail_msg("output lacks the validators line");
    assert_int_equal(run("--listen /ip4/127.0.0.1/tcp/0 --duration 1 --model mlp --batch-size 8 "
                         "--byzantine-tolerant"),
                     0);
    assert_true(file_contains("out.txt", "0 validators per step (no gradient check)"));
}

static void test_names(void **state)
{
    (void)state;
    const ap_nn_solver_kind_t kinds[] = {AP_NN_SGD, AP_NN_ADAM, AP_NN_ADAMW, AP_NN_LAMB};
    for (size_t i = 0; i < 4; i++) {
        ap_nn_solver_kind_t k = 0;
        assert_int_equal(ap_nn_solver_kind_from_name(ap_nn_solver_kind_name(kinds[i]), &k), 0);
        assert_int_equal(k, kinds[i]);
    }
    ap_nn_solver_kind_t k = AP_NN_ADAM;
    assert_int_equal(ap_nn_solver_kind_from_name("Adam", &k), AP_EINVAL);
    assert_int_equal(ap_nn_solver_kind_from_name(NULL, &k), AP_EINVAL);
    assert_int_equal(k, AP_NN_ADAM);
    assert_string_equal(ap_nn_solver_kind_name((ap_nn_solver_kind_t)99), "?");
    const ap_nn_lr_kind_t lk[] = {AP_NN_LR_CONSTANT, AP_NN_LR_LINEAR, AP_NN_LR_COSINE,
                                  AP_NN_LR_RSQRT};
    for (size_t i = 0; i < 4; i++) {
        ap_nn_lr_kind_t l = 99;
        assert_int_equal(ap_nn_lr_kind_from_name(ap_nn_lr_kind_name(lk[i]), &l), 0);
        assert_int_equal(l, lk[i]);
    }
    ap_nn_lr_kind_t l = AP_NN_LR_LINEAR;
    assert_int_equal(ap_nn_lr_kind_from_name("step", &l), AP_EINVAL);
    assert_int_equal(l, AP_NN_LR_LINEAR);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/apiary_train_cli_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_flags),
        cmocka_unit_test(test_good_flags),
        cmocka_unit_test(test_validators),
        cmocka_unit_test(test_names),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char p[128];
    snprintf(p, sizeof p, "%s/out.txt", dir), unlink(p);
    snprintf(p, sizeof p, "%s/err.txt", dir), unlink(p);
    rmdir(dir);
    return rc;
}
