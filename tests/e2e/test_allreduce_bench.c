/* The real-process all-reduce bench path, small: `apiary bench allreduce`
 * spawns `apiary avg-worker` processes over TCP + Noise on loopback (3
 * processes, 1M elements, 2 measured rounds after a warm-up, codecs none
 * and fp16 (and uniform8: identical bytes at every receiver); then a group of a normal peer, a
 * client that never listens and an aux). The test does not trust the bench's own check: each worker
 * dumps its final vector, and the test recomputes the weighted mean of the inputs (the data formula
 * of testing/allreduce_procs.h, weights 1 + index) and holds every element to it: exact to the
 * float rounding for none, within fp16's error bound (data and result rounded) for fp16; every
 * receiver must hold the same bytes. No timing is asserted. */
#include "aptest.h"
#include "procs.h"

#include "allreduce_procs.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t elems(void)
{
    return ap_test_sanitized() ? (1u << 17) : (1u << 20);
}

/* Runs the bench; returns how many lines said "verified":true, and counts
 * the metric lines seen. */
static int run_bench(const char *args, const char *dump, int *nlines)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' bench allreduce --json --no-gloo --elems %llu --rounds 2 --warmup 1 "
             "--dump-dir '%s' --timeout 240 %s",
             ap_test_cli(), (unsigned long long)elems(), dump, args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char line[2048];
    int verified = 0;
    *nlines = 0;
    while (fgets(line, sizeof line, p)) {
        printf("%s", line);
        if (!strstr(line, "\"bench\":\"allreduce\"")) continue;
        (*nlines)++;
        if (strstr(line, "\"verified\":true")) verified++;
        if (strstr(line, "\"metric\":\"busbw_MBps\"")) {
            const char *v = strstr(line, "\"value\":");
            assert_non_null(v);
            assert_true(atof(v + 8) > 0);
        }
    }
    assert_int_equal(pclose(p), 0);
    return verified;
}

static float *load(const char *path, uint64_t n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    float *x = malloc(n * sizeof *x);
    assert_non_null(x);
    size_t got = fread(x, sizeof *x, n, f);
    int extra = fgetc(f);
    fclose(f);
    assert_int_equal(got, n);
    assert_int_equal(extra, EOF); /* exactly n floats */
    return x;
}

/* Checks the dumps of one case: senders[i] says whether member i has data. */
static void check_case(const char *dir, const char *codec, int P, const bool *senders)
{
    uint64_t n = elems();
    float *x[AP_ARP_MAX_PEERS] = {0};
    double wsum = 0;
    for (int i = 0; i < P; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s-p%d-e%llu/result-%d.f32", dir, codec, P,
                 (unsigned long long)n, i);
        x[i] = load(path, n);
        if (senders[i]) {
            assert_non_null(x[i]);
            wsum += 1.0 + i;
        } else {
            assert_null(x[i]); /* an aux has no vector to dump */
        }
    }
    bool fp16 = !strcmp(codec, "fp16");
    bool same_only = !strcmp(codec, "uniform8"); /* its bound needs chunk statistics: the
                                                    bench checks it; here: same bytes */
    uint64_t bad = 0;
    double worst = 0;
    for (uint64_t k = 0; k < n; k++) {
        double s = 0, sa = 0;
        for (int j = 0; j < P; j++) {
            if (!senders[j]) continue;
            double v = ap_arp_value(1, j, k);
            s += (1.0 + j) * v;
            sa += (1.0 + j) * fabs(v);
        }
        double m = s / wsum;
        double tol;
        if (fp16) {
            tol = ldexp(1, -11) * (sa / wsum + fabs(m)) * 1.001 + ldexp(1, -24);
        } else {
            float f = (float)m; /* the double mean rounded once to float */
            tol = (double)nextafterf(fabsf(f), INFINITY) - (double)fabsf(f) + fabs(m - (double)f);
        }
        for (int i = 0; i < P; i++) {
            if (!x[i]) continue;
            double e = fabs((double)x[i][k] - m);
            if (e > worst) worst = e;
            if (!same_only && !(e <= tol)) bad++;
            if (i > 0 && x[0] && memcmp(&x[i][k], &x[0][k], 4) != 0) bad++;
        }
        if (!fp16 && !same_only) { /* and it must actually be the mean, not some near value */
            float f = (float)m;
            for (int i = 0; i < P; i++)
                if (x[i] && fabsf(x[i][k] - f) > fabsf(nextafterf(f, INFINITY) - f)) bad++;
        }
    }
    printf("%s P=%d: worst error %.3g over %llu elements, %llu bad\n", codec, P, worst,
           (unsigned long long)n, (unsigned long long)bad);
    assert_int_equal(bad, 0);
    /* the inputs were not the mean already: a missing average would fail */
    for (int i = 0; i < P; i++)
        if (x[i]) {
            uint64_t local = 0;
            for (uint64_t k = 0; k < n; k++) local += x[i][k] == ap_arp_value(1, i, k);
            assert_true(local < n / 10);
        }
    for (int i = 0; i < P; i++) free(x[i]);
}

static void test_three_processes(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-test-arbench-XXXXXX";
    assert_non_null(mkdtemp(dir));
    int lines = 0;
    int verified = run_bench("--peers 3 --codec none,fp16,uniform8", dir, &lines);
    assert_int_equal(lines, 9); /* round_s, busbw_MBps, cpu_s_per_round per codec */
    assert_int_equal(verified, 9);
    bool all[3] = {true, true, true};
    check_case(dir, "none", 3, all);
    check_case(dir, "fp16", 3, all);
    check_case(dir, "uniform8", 3, all); /* every receiver holds the same vector */
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* A client (dial-only node: it has no listen address in the group) and an
 * aux (reduces a part, contributes and receives nothing). */
static void test_client_and_aux(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-test-arbench-XXXXXX";
    assert_non_null(mkdtemp(dir));
    int lines = 0;
    int verified = run_bench("--peers 3 --roles normal,client,aux --codec none", dir, &lines);
    assert_int_equal(lines, 3);
    assert_int_equal(verified, 3);
    bool senders[3] = {true, true, false};
    check_case(dir, "none", 3, senders);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_three_processes),
        cmocka_unit_test(test_client_and_aux),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
