#include "bench.h"
#include "cli.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_BENCH 64
static const ap_bench_t *benches[MAX_BENCH];
static int nbenches;

void ap_bench_register(const ap_bench_t *b)
{
    if (nbenches < MAX_BENCH) benches[nbenches++] = b;
}

double ap_bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void emit(ap_bench_ctx_t *c, const char *metric, double value, const char *unit,
                 const double *baseline, const char *fields)
{
    if (c->json) {
        printf("{\"bench\":\"%s\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\"", c->name,
               metric, value, unit);
        if (baseline)
            printf(",\"baseline\":%.6g,\"ratio\":%.4f", *baseline,
                   *baseline != 0 ? value / *baseline : 0.0);
        if (fields && *fields) printf(",%s", fields);
        printf("}\n");
    } else {
        printf("%-28s %14.4g %-8s", metric, value, unit);
        if (baseline)
            printf(" baseline %.4g ratio %.3f", *baseline,
                   *baseline != 0 ? value / *baseline : 0.0);
        if (fields && *fields) printf("  %s", fields);
        printf("\n");
    }
    fflush(stdout);
}

void ap_bench_report(ap_bench_ctx_t *c, const char *metric, double value, const char *unit,
                     const char *fields)
{
    emit(c, metric, value, unit, NULL, fields);
}

void ap_bench_report_vs(ap_bench_ctx_t *c, const char *metric, double value, const char *unit,
                        double baseline, const char *fields)
{
    emit(c, metric, value, unit, &baseline, fields);
}

static int cmp_bench(const void *a, const void *b)
{
    return strcmp((*(const ap_bench_t *const *)a)->name, (*(const ap_bench_t *const *)b)->name);
}

static void usage(FILE *f)
{
    qsort(benches, (size_t)nbenches, sizeof benches[0], cmp_bench);
    fprintf(f, "usage: apiary bench NAME|all [--json] [--quick] [bench options]\n\nbenchmarks:\n");
    for (int i = 0; i < nbenches; i++)
        fprintf(f, "  %-12s %s\n", benches[i]->name, benches[i]->summary);
}

static int bench_main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *name = argv[1];
    ap_bench_ctx_t ctx = {.name = name};
    /* Strip the common flags; pass the rest to the benchmark. */
    char **rest = calloc((size_t)argc + 1, sizeof *rest);
    if (!rest) return 1;
    int nrest = 0;
    rest[nrest++] = argv[1];
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            ctx.json = true;
        else if (!strcmp(argv[i], "--quick"))
            ctx.quick = true;
        else
            rest[nrest++] = argv[i];
    }
    int rc = 0;
    bool found = false;
    for (int i = 0; i < nbenches; i++) {
        if (strcmp(name, "all") != 0 && strcmp(name, benches[i]->name) != 0) continue;
        found = true;
        ctx.name = benches[i]->name;
        if (!ctx.json) printf("== %s\n", benches[i]->name);
        optind = 1;
        int r = benches[i]->run(&ctx, nrest, rest);
        if (r != 0) {
            fprintf(stderr, "apiary bench %s: failed (%d)\n", benches[i]->name, r);
            rc = 1;
        }
    }
    free(rest);
    if (!found) {
        fprintf(stderr, "apiary bench: unknown benchmark '%s'\n\n", name);
        usage(stderr);
        return 2;
    }
    return rc;
}

AP_CLI_COMMAND(cmd_bench, "bench", bench_main, "run a benchmark (apiary bench --help)")

const char *ap_bench_python(const char *check)
{
    static char found[512];
    if (!check || strchr(check, '\'')) return NULL;
    const char *cands[] = {getenv("APIARY_PYTHON"), "python3", "/usr/bin/python3"};
    for (size_t i = 0; i < 3; i++) {
        if (!cands[i] || !*cands[i] || strchr(cands[i], '\'') || strlen(cands[i]) >= sizeof found)
            continue;
        char cmd[1200];
        snprintf(cmd, sizeof cmd, "'%s' -c '%s' >/dev/null 2>&1", cands[i], check);
        if (system(cmd) == 0) {
            snprintf(found, sizeof found, "%s", cands[i]);
            return found;
        }
    }
    return NULL;
}

const char *ap_bench_script(const char *name)
{
    static char path[4096];
    const char *src = getenv("APIARY_SRC");
    if (src && *src) {
        snprintf(path, sizeof path, "%s/bench/%s", src, name);
        if (access(path, R_OK) == 0) return path;
    }
    /* this file is tools/apiary/cmd_bench.c: the tree's bench/ is ../../bench */
    const char *self = __FILE__, *tail = "tools/apiary/cmd_bench.c";
    size_t n = strlen(self), k = strlen(tail);
    if (n >= k && !strcmp(self + n - k, tail)) {
        snprintf(path, sizeof path, "%.*sbench/%s", (int)(n - k), self, name);
        if (access(path, R_OK) == 0) return path;
    }
    snprintf(path, sizeof path, "bench/%s", name);
    return access(path, R_OK) == 0 ? path : NULL;
}

double ap_bench_load1(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}
