/* `apiary bench python`: the Python package's per-step cost (bench/python_bench.py,
 * run by Debian's python3 with torch). Metrics, as that script prints them:
 *   python_step_overhead  apiary.Optimizer.step() over the same libapiary step
 *                         called directly (ratio), ~1M-parameter torch model
 *   python_step_s         seconds per step (baseline: the direct call)
 *   samples_per_s         global samples/s of 1, 2, 4 Python peer processes
 *                         (torch Adam, delayed updates; field peers)
 *   scaling_efficiency    samples/s(N) / (N * samples/s(1)) (peers 2, 4)
 *   time_efficiency       the peers' share of wall time computing over the
 *                         single peer's (peers 2, 4)
 * `apiary bench python --no-scaling` measures the step overhead only.
 * Skipped with a reason when python3-torch is missing. */
#include "bench.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int run(ap_bench_ctx_t *c, int argc, char **argv)
{
    bool no_scaling = false;
    for (int i = 1; i < argc; i++) { /* argv[0] is the bench's name */
        if (strcmp(argv[i], "--no-scaling") == 0) {
            no_scaling = true;
        } else {
            fprintf(stderr, "bench python: unknown option %s (only --no-scaling)\n", argv[i]);
            return 2;
        }
    }
    const char *py = ap_bench_python("import torch, msgpack");
    const char *script = py ? ap_bench_script("python_bench.py") : NULL;
    if (!py || !script) {
        fprintf(stderr, "bench python: skipped: %s\n",
                py ? "bench/python_bench.py not found"
                   : "no python3 with torch and msgpack (python3-torch, python3-msgpack)");
        return 0;
    }
    if (strchr(script, '\'')) return 1;
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' '%s'%s%s%s", py, script, c->json ? " --json" : "",
             c->quick ? " --quick" : "", no_scaling ? " --no-scaling" : "");
    int rc = system(cmd);
    return rc == 0 ? 0 : 1;
}

AP_BENCH(bench_python, "python", run,
         "the Python package: step overhead over libapiary, scaling of Python peers")
