/* `apiary bench NAME [--json]`: benchmark registry and reporting.
 *
 * Each benchmark file registers itself with AP_BENCH. Results are reported
 * one metric at a time; with --json each is one JSON object per line:
 *   {"bench":NAME,"metric":M,"value":V,"unit":U[,"baseline":B,"ratio":R][,fields...]}
 * Report ratios against a baseline measured in the same run (DESIGN.md §6). */
#ifndef AP_BENCH_H
#define AP_BENCH_H

#include <stdbool.h>

typedef struct ap_bench_ctx {
    const char *name;
    bool json;
    bool quick; /* --quick: smaller sizes, for smoke tests */
} ap_bench_ctx_t;

typedef struct ap_bench {
    const char *name;
    int (*run)(ap_bench_ctx_t *ctx, int argc, char **argv); /* extra args after NAME */
    const char *summary;
} ap_bench_t;

void ap_bench_register(const ap_bench_t *b);

#define AP_BENCH(ident, bname, fn, text)                                                           \
    static const ap_bench_t ident = {.name = bname, .run = fn, .summary = text};                   \
    __attribute__((constructor)) static void ident##_register(void)                                \
    {                                                                                              \
        ap_bench_register(&ident);                                                                 \
    }

/* fields: extra JSON members without braces, e.g. "\"nodes\":1000,\"codec\":\"fp16\"",
 * or NULL. */
void ap_bench_report(ap_bench_ctx_t *c, const char *metric, double value, const char *unit,
                     const char *fields);
/* Same, with a baseline measured in this run; adds "baseline" and "ratio" = value/baseline. */
void ap_bench_report_vs(ap_bench_ctx_t *c, const char *metric, double value, const char *unit,
                        double baseline, const char *fields);

/* Monotonic seconds, for timing. */
double ap_bench_now(void);

/* The 1-minute load average (/proc/loadavg), or -1. */
double ap_bench_load1(void);

/* A python3 for a baseline: the first of $APIARY_PYTHON, python3,
 * /usr/bin/python3 for which `python -c check` succeeds (check: Python code
 * without single quotes, e.g. "import torch"). NULL if none; the result is a
 * static buffer shared by all callers. */
const char *ap_bench_python(const char *check);

/* Path of a script shipped in bench/ (name, e.g. "nn_torch.py"): under
 * $APIARY_SRC/bench, beside this source tree's bench/, or ./bench. NULL if
 * not found; a static buffer shared by all callers. */
const char *ap_bench_script(const char *name);

#endif
