/* Smoke test of `apiary bench compress --quick --json` and `apiary bench
 * masha --quick --json`: every metric the issue names is present, once per
 * codec / method / h, with sane values. */
#include "aptest.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *run_cli(const char *args)
{
    const char *cli = getenv("APIARY_CLI");
    if (!cli) return NULL;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s", cli, args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while ((got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (len + 1 == cap) buf = realloc(buf, cap *= 2);
    }
    buf[len] = 0;
    assert_int_equal(pclose(f), 0);
    return buf;
}

/* Finds the line with metric m and the given extra field text; returns its value. */
static double value_of(const char *out, const char *metric, const char *field)
{
    char key[128];
    snprintf(key, sizeof key, "\"metric\":\"%s\"", metric);
    int found = 0;
    double v = 0;
    for (const char *l = out; l && *l;) {
        const char *e = strchr(l, '\n');
        size_t n = e ? (size_t)(e - l) : strlen(l);
        char line[1024];
        if (n >= sizeof line) n = sizeof line - 1;
        memcpy(line, l, n);
        line[n] = 0;
        if (strstr(line, key) && (!field || strstr(line, field))) {
            const char *p = strstr(line, "\"value\":");
            assert_non_null(p);
            v = strtod(p + 8, NULL);
            found++;
        }
        l = e ? e + 1 : NULL;
    }
    if (found != 1) fail_msg("metric %s %s found %d times", metric, field ? field : "", found);
    return v;
}

static void test_bench_compress(void **state)
{
    (void)state;
    if (!getenv("APIARY_CLI")) skip();
    char *out = run_cli("bench compress --quick --json");
    assert_true(value_of(out, "memcpy_MBps", NULL) > 0);
    const char *codecs[] = {"none",      "fp16",       "bf16", "meanstd16", "uniform8",
                            "quantile8", "blockwise8", "topk", "randk"};
    for (int i = 0; i < 9; i++) {
        char f[64];
        snprintf(f, sizeof f, "\"codec\":\"%s\"", codecs[i]);
        assert_true(value_of(out, "encode_MBps", f) > 0);
        assert_true(value_of(out, "decode_MBps", f) > 0);
        double ratio = value_of(out, "ratio", f), err = value_of(out, "rel_rms_error", f);
        assert_true(ratio > 0.99); /* headers */
        assert_true(err >= 0);
        if (i == 0) assert_true(err == 0 && ratio > 0.99 && ratio < 1.01);
        if (i == 6) assert_true(err <= 0.01); /* blockwise 8-bit target on N(0,1) */
        if (i >= 4 && i <= 6) assert_true(ratio > 3.9);
    }
    free(out);
}

static void test_bench_masha(void **state)
{
    (void)state;
    if (!getenv("APIARY_CLI") || ap_test_sanitized()) skip(); /* seconds of solver runs */
    char *out = run_cli("bench masha --quick --json");
    const char *methods[] = {"extragradient", "masha1_randk2", "masha1_randk10", "masha2_topk2",
                             "masha2_topk10"};
    for (int h = 0; h < 2; h++)
        for (int m = 0; m < 5; m++) {
            char f[96];
            snprintf(f, sizeof f, "\"method\":\"%s\",\"h\":%s", methods[m], h ? "1" : "0.1");
            assert_true(value_of(out, "floats_per_worker", f) > 0);
            assert_true(value_of(out, "bytes_per_worker", f) > 0);
        }
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_compress),
        cmocka_unit_test(test_bench_masha),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
