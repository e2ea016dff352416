/* `apiary bench masha [--svg PATH]`: the bilinear experiment of the MASHA
 * paper. For h = 0.1 and h = 1: floats and bytes uploaded per worker to reach
 * |z - z*|^2 <= 1e-6 |z0 - z*|^2 for extragradient, MASHA1 (rand-k 2%, 10%)
 * and MASHA2 (top-k 2%, 10%), each at its best step size from a grid search
 * (as in the paper, step sizes are tuned per method). --svg writes the
 * relative distance against bytes sent for the best runs. */
#include "bench.h"

#include "apiary/masha.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct method_def {
    const char *name;
    ap_masha_method_t method;
    double fraction;
} method_def_t;

static const method_def_t methods[] = {
    {"extragradient", AP_MASHA_EXTRAGRADIENT, 0}, {"masha1_randk2", AP_MASHA_1, 0.02},
    {"masha1_randk10", AP_MASHA_1, 0.10},         {"masha2_topk2", AP_MASHA_2, 0.02},
    {"masha2_topk10", AP_MASHA_2, 0.10},
};
#define NMETHODS (sizeof methods / sizeof methods[0])

typedef struct trace_buf {
    double *bytes, *rel;
    size_t n, cap, stride;
} trace_buf_t;

static void on_trace(void *arg, uint64_t iter, uint64_t floats, uint64_t bytes, double rel2)
{
    (void)floats;
    trace_buf_t *t = arg;
    if (iter % t->stride) return;
    if (t->n == t->cap) {
        size_t nc = t->cap ? 2 * t->cap : 1024;
        double *b = realloc(t->bytes, nc * sizeof *b), *r = realloc(t->rel, nc * sizeof *r);
        if (!b || !r) {
            free(b ? b : t->bytes);
            free(r ? r : t->rel);
            t->bytes = t->rel = NULL;
            t->n = t->cap = 0;
            return;
        }
        t->bytes = b;
        t->rel = r;
        t->cap = nc;
    }
    t->bytes[t->n] = (double)bytes;
    t->rel[t->n] = rel2;
    t->n++;
}

typedef struct best_run {
    double gamma;
    ap_masha_result_t r;
    bool ok;
} best_run_t;

/* Runs at gamma; updates best if it converged with fewer floats. */
static void try_gamma(const ap_masha_problem_t *p, const method_def_t *m, double gamma,
                      uint64_t seed, best_run_t *best, bool quick)
{
    size_t d = ap_masha_dim(p);
    ap_masha_opts_t o = {.method = m->method,
                         .gamma = gamma,
                         .fraction = m->fraction,
                         .seed = seed,
                         .target = 1e-6,
                         .max_iters = 200000};
    if (best->ok) { /* no need to run past the best so far */
        double per_iter = m->method == AP_MASHA_EXTRAGRADIENT ? 2.0 * d : fmax(1, m->fraction * d);
        o.max_iters = (uint64_t)(best->r.floats_up / per_iter) + 1;
    }
    ap_masha_result_t r;
    if (ap_masha_run(p, &o, &r) != 0 || !r.converged) return;
    if (!best->ok || r.floats_up < best->r.floats_up) {
        best->ok = true;
        best->gamma = gamma;
        best->r = r;
    }
}

static best_run_t tune(const ap_masha_problem_t *p, const method_def_t *m, bool quick,
                       uint64_t seed)
{
    best_run_t best = {0};
    double coarse = quick ? 2.2 : 1.35;
    /* from large steps down: large ones diverge fast, and the first that
     * converges caps the iterations of the smaller ones */
    for (double g = 4; g > 0.01; g /= coarse) try_gamma(p, m, g, seed, &best, quick);
    if (best.ok && !quick) {
        double g0 = best.gamma;
        for (double f = 1 / coarse; f < coarse; f *= 1.07)
            if (fabs(f - 1) > 1e-9) try_gamma(p, m, g0 * f, seed, &best, quick);
    }
    return best;
}

static const char *colors[] = {"#000000", "#1f77b4", "#6baed6", "#d62728", "#fc9272"};

static void svg_panel(FILE *f, int x0, int y0, int w, int h, double hval, trace_buf_t *tr,
                      double xmin, double xmax)
{
    double ymin = -6.5, ymax = 0.5; /* log10 of relative squared distance */
    double lx0 = log10(xmin), lx1 = log10(xmax);
    fprintf(f, "<rect x='%d' y='%d' width='%d' height='%d' fill='none' stroke='#444'/>\n", x0, y0,
            w, h);
    fprintf(f, "<text x='%d' y='%d' font-size='14' text-anchor='middle'>h = %g</text>\n",
            x0 + w / 2, y0 - 8, hval);
    for (int e = (int)ceil(lx0); e <= (int)floor(lx1); e++) {
        double px = x0 + (e - lx0) / (lx1 - lx0) * w;
        fprintf(f, "<line x1='%.1f' y1='%d' x2='%.1f' y2='%d' stroke='#ddd'/>\n", px, y0, px,
                y0 + h);
        fprintf(f, "<text x='%.1f' y='%d' font-size='11' text-anchor='middle'>1e%d</text>\n", px,
                y0 + h + 14, e);
    }
    for (int e = -6; e <= 0; e++) {
        double py = y0 + (ymax - e) / (ymax - ymin) * h;
        fprintf(f, "<line x1='%d' y1='%.1f' x2='%d' y2='%.1f' stroke='#ddd'/>\n", x0, py, x0 + w,
                py);
        fprintf(f, "<text x='%d' y='%.1f' font-size='11' text-anchor='end'>1e%d</text>\n", x0 - 4,
                py + 4, e);
    }
    fprintf(f,
            "<text x='%d' y='%d' font-size='12' text-anchor='middle'>bytes uploaded per "
            "worker</text>\n",
            x0 + w / 2, y0 + h + 30);
    for (size_t m = 0; m < NMETHODS; m++) {
        if (!tr[m].n) continue;
        fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='1.5' points='", colors[m]);
        for (size_t i = 0; i < tr[m].n; i++) {
            double bx = tr[m].bytes[i], ry = tr[m].rel[i];
            if (bx < xmin || !(ry > 0)) continue;
            double px = x0 + (log10(bx) - lx0) / (lx1 - lx0) * w;
            double ly = log10(ry);
            if (ly > ymax) ly = ymax;
            if (ly < ymin) ly = ymin;
            double py = y0 + (ymax - ly) / (ymax - ymin) * h;
            fprintf(f, "%.1f,%.1f ", px, py);
        }
        fprintf(f, "'/>\n");
    }
}

static int run(ap_bench_ctx_t *ctx, int argc, char **argv)
{
    const char *svg = NULL;
    static const struct option lo[] = {{"svg", required_argument, NULL, 's'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c == 's')
            svg = optarg;
        else {
            fprintf(stderr, "usage: apiary bench masha [--json] [--quick] [--svg PATH]\n");
            return 2;
        }
    }
    const double hs[2] = {0.1, 1.0};
    trace_buf_t tr[2][NMETHODS];
    memset(tr, 0, sizeof tr);
    double eg_floats[2] = {0}, eg_bytes[2] = {0};
    for (int hi = 0; hi < 2; hi++) {
        ap_masha_bilinear_cfg_t pc = {
            .n = 50, .workers = 10, .lambda = 0.05, .h = hs[hi], .seed = 2021};
        ap_masha_problem_t *p = ap_masha_bilinear_new(&pc);
        if (!p) return 1;
        for (size_t m = 0; m < NMETHODS; m++) {
            best_run_t b = tune(p, &methods[m], ctx->quick, 77);
            char fields[160];
            snprintf(fields, sizeof fields, "\"method\":\"%s\",\"h\":%g,\"gamma\":%.4g",
                     methods[m].name, hs[hi], b.ok ? b.gamma : 0.0);
            if (!b.ok) {
                fprintf(stderr, "bench masha: %s at h=%g did not converge\n", methods[m].name,
                        hs[hi]);
                ap_masha_problem_free(p);
                return 1;
            }
            if (m == 0) eg_floats[hi] = (double)b.r.floats_up;
            if (m == 0)
                ap_bench_report(ctx, "floats_per_worker", (double)b.r.floats_up, "floats", fields);
            else
                ap_bench_report_vs(ctx, "floats_per_worker", (double)b.r.floats_up, "floats",
                                   eg_floats[hi], fields);
            /* bytes_per_worker: wire version 3 (what runs send); the same run
             * framed in versions 1 and 2 (analytic: the values are the same) */
            if (m == 0) {
                eg_bytes[hi] = (double)b.r.bytes_up;
                ap_bench_report(ctx, "bytes_per_worker", (double)b.r.bytes_up, "B", fields);
            } else
                ap_bench_report_vs(ctx, "bytes_per_worker", (double)b.r.bytes_up, "B", eg_bytes[hi],
                                   fields);
            ap_masha_opts_t o1 = {
                .method = methods[m].method, .fraction = methods[m].fraction, .wire = 1};
            ap_bench_report(ctx, "bytes_per_worker_wire1",
                            (double)ap_masha_upload_bytes(p, &o1, b.r.iters, b.r.refreshes), "B",
                            fields);
            o1.wire = 2;
            ap_bench_report(ctx, "bytes_per_worker_wire2",
                            (double)ap_masha_upload_bytes(p, &o1, b.r.iters, b.r.refreshes), "B",
                            fields);
            /* values + indices only (no protocol/codec headers, no rand-k seed) */
            double idx = methods[m].method == AP_MASHA_2 ? 1 : 0;
            size_t d = ap_masha_dim(p);
            uint64_t full_msgs =
                methods[m].method == AP_MASHA_EXTRAGRADIENT ? 0 : 1 + b.r.refreshes;
            double sparse_vals = (double)b.r.floats_up - (double)full_msgs * d;
            double payload = methods[m].method == AP_MASHA_EXTRAGRADIENT
                                 ? 4.0 * b.r.floats_up
                                 : 4.0 * full_msgs * d + 4.0 * (1 + idx) * sparse_vals;
            ap_bench_report(ctx, "payload_bytes_per_worker", payload, "B", fields);
            ap_bench_report(ctx, "iterations", (double)b.r.iters, "", fields);
            if (svg) { /* re-run the best to record its curve */
                trace_buf_t *t = &tr[hi][m];
                t->stride = b.r.iters > 4000 ? b.r.iters / 2000 : 1;
                ap_masha_opts_t o = {.method = methods[m].method,
                                     .gamma = b.gamma,
                                     .fraction = methods[m].fraction,
                                     .seed = 77,
                                     .target = 1e-6,
                                     .max_iters = 200000,
                                     .trace = on_trace,
                                     .trace_arg = t};
                ap_masha_result_t r;
                ap_masha_run(p, &o, &r);
            }
        }
        ap_masha_problem_free(p);
    }
    int rc = 0;
    if (svg) {
        FILE *f = fopen(svg, "w");
        if (!f) {
            perror(svg);
            rc = 1;
        } else {
            double xmin = 1e30, xmax = 0;
            for (int hi = 0; hi < 2; hi++)
                for (size_t m = 0; m < NMETHODS; m++)
                    for (size_t i = 0; i < tr[hi][m].n; i++) {
                        xmin = fmin(xmin, tr[hi][m].bytes[i]);
                        xmax = fmax(xmax, tr[hi][m].bytes[i]);
                    }
            xmin = pow(10, floor(log10(xmin)));
            xmax = pow(10, ceil(log10(xmax)));
            int W = 980, H = 420;
            fprintf(
                f,
                "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' "
                "font-family='sans-serif'>\n<rect width='100%%' height='100%%' fill='white'/>\n",
                W, H);
            fprintf(f,
                    "<text x='%d' y='20' font-size='15' text-anchor='middle'>Bilinear min-max "
                    "(d=100, M=10, lambda=0.05): |z-z*|^2/|z0-z*|^2 vs bytes uploaded per "
                    "worker</text>\n",
                    W / 2);
            svg_panel(f, 70, 60, 380, 280, 0.1, tr[0], xmin, xmax);
            svg_panel(f, 540, 60, 380, 280, 1.0, tr[1], xmin, xmax);
            for (size_t m = 0; m < NMETHODS; m++) {
                int lx = 70 + (int)m * 180;
                fprintf(f,
                        "<line x1='%d' y1='395' x2='%d' y2='395' stroke='%s' stroke-width='2'/>"
                        "<text x='%d' y='399' font-size='12'>%s</text>\n",
                        lx, lx + 20, colors[m], lx + 24, methods[m].name);
            }
            fprintf(f, "</svg>\n");
            fclose(f);
            if (!ctx->json) printf("wrote %s\n", svg);
        }
    }
    for (int hi = 0; hi < 2; hi++)
        for (size_t m = 0; m < NMETHODS; m++) {
            free(tr[hi][m].bytes);
            free(tr[hi][m].rel);
        }
    return rc;
}

AP_BENCH(bench_masha, "masha", run,
         "MASHA bilinear experiment: floats/bytes per worker to 1e-6 [--svg PATH]")
