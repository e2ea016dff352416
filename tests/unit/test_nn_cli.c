/* `apiary nn-train` end to end: a few steps on the shipped corpus, save,
 * resume, and clear failures for bad data or a mismatched checkpoint. */
#include "aptest.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[64];

static int run(const char *args)
{
    const char *cli = getenv("APIARY_CLI");
    if (!cli) fail_msg("APIARY_CLI not set (run through ctest)");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' nn-train %s >%s/out.txt 2>%s/err.txt", cli, args, dir, dir);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static bool err_contains(const char *needle)
{
    char path[128];
    snprintf(path, sizeof path, "%s/err.txt", dir);
    size_t len;
    char *s = ap_test_read_file(path, &len);
    bool ok = s && strstr(s, needle);
    free(s);
    return ok;
}

static void test_train_save_resume(void **state)
{
    (void)state;
    const char *small = "--layers 1 --embd 16 --heads 2 --ctx 16 --batch 2 --sample 10";
    char args[1024], ck[128];
    snprintf(ck, sizeof ck, "%s/model.ckpt", dir);
    snprintf(args, sizeof args, "%s --steps 4 --save %s", small, ck);
    assert_int_equal(run(args), 0);
    struct stat st;
    assert_int_equal(stat(ck, &st), 0);
    assert_true(st.st_size > 160);
    assert_true(err_contains("step 4/4"));
    snprintf(args, sizeof args, "%s --steps 6 --resume %s", small, ck);
    assert_int_equal(run(args), 0);
    assert_true(err_contains("step 6/6"));
    assert_false(err_contains("step 1/6")); /* resumed at step 4 */
    /* another shape: a clear refusal */
    snprintf(args, sizeof args, "--layers 2 --embd 16 --heads 2 --ctx 16 --batch 2 --resume %s",
             ck);
    assert_int_equal(run(args), 1);
    assert_true(err_contains("cannot resume"));
    unlink(ck);
}

static void test_bad_data(void **state)
{
    (void)state;
    assert_int_equal(run("--data /nonexistent/file.txt --steps 1"), 1);
    assert_true(err_contains("/nonexistent/file.txt"));
    char empty[128], args[256];
    snprintf(empty, sizeof empty, "%s/empty.txt", dir);
    FILE *f = fopen(empty, "w");
    assert_non_null(f);
    fclose(f);
    snprintf(args, sizeof args, "--data %s --steps 1", empty);
    assert_int_equal(run(args), 1);
    assert_true(err_contains("invalid argument"));
    unlink(empty);
    assert_int_equal(run("--optim nope"), 2);
    assert_int_equal(run("--help"), 0);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/apiary_nn_cli_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_train_save_resume),
        cmocka_unit_test(test_bad_data),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char p[128];
    snprintf(p, sizeof p, "%s/out.txt", dir), unlink(p);
    snprintf(p, sizeof p, "%s/err.txt", dir), unlink(p);
    rmdir(dir);
    return rc;
}
