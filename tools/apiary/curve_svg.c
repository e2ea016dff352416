#include "curve_svg.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool ap_cli_curve_read(const char *log, ap_cli_curve_t *c)
{
    c->n = 0;
    FILE *f = fopen(log, "r");
    if (!f) return false;
    char line[1024];
    while (fgets(line, sizeof line, f) && c->n < AP_CURVE_MAX_POINTS) {
        unsigned long long e;
        double l;
        if (sscanf(line, "epoch %llu | loss %lf |", &e, &l) == 2 && isfinite(l)) {
            c->epoch[c->n] = (double)e;
            c->loss[c->n] = l;
            c->n++;
        }
    }
    fclose(f);
    return true;
}

bool ap_cli_curve_svg(const char *path, const ap_cli_curve_t *curves, int n, double ref,
                      const char *ref_label)
{
    static const char *colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                   "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};
    const double W = 720, H = 420, L = 60, R = 150, T = 30, B = 50;
    double emax = 1, lmin = ref > 0 ? ref : INFINITY, lmax = ref > 0 ? ref : -INFINITY;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < curves[i].n; k++) {
            if (curves[i].epoch[k] > emax) emax = curves[i].epoch[k];
            if (curves[i].loss[k] < lmin) lmin = curves[i].loss[k];
            if (curves[i].loss[k] > lmax) lmax = curves[i].loss[k];
        }
    if (!isfinite(lmin) || !isfinite(lmax)) lmin = 0, lmax = 1;
    lmin = floor(lmin * 2) / 2;
    lmax = ceil(lmax * 2) / 2;
    if (lmax <= lmin) lmax = lmin + 1;
    FILE *f = fopen(path, "w");
    if (!f) return false;
#define X(e) (L + (e) / emax * (W - L - R))
#define Y(l) (T + (lmax - (l)) / (lmax - lmin) * (H - T - B))
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
            "font-family=\"sans-serif\" font-size=\"12\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
            "<text x=\"%.0f\" y=\"18\" font-size=\"14\">training loss per global epoch "
            "(mean over each peer's batches)</text>\n",
            W, H, L);
    /* axes and ticks */
    fprintf(f,
            "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n"
            "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
            L, H - B, W - R, H - B, L, T, L, H - B);
    for (double l = lmin; l <= lmax + 1e-9; l += 0.5)
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.1f</text>\n",
                L, Y(l), W - R, Y(l), L - 6, Y(l) + 4, l);
    double step = emax <= 10 ? 1 : emax <= 50 ? 5 : emax <= 200 ? 20 : 100;
    for (double e = 0; e <= emax + 1e-9; e += step)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n", X(e),
                H - B + 16, e);
    fprintf(f,
            "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">global epoch</text>\n"
            "<text x=\"16\" y=\"%.1f\" transform=\"rotate(-90 16 %.1f)\" "
            "text-anchor=\"middle\">loss (nats)</text>\n",
            (L + W - R) / 2, H - 12, (T + H - B) / 2, (T + H - B) / 2);
    if (ref > 0)
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" "
                "stroke-dasharray=\"6 4\"/><text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                L, Y(ref), W - R, Y(ref), W - R + 6, Y(ref) + 4, ref_label ? ref_label : "");
    for (int i = 0; i < n; i++) {
        const char *col = colors[i % 8];
        if (curves[i].n == 0) continue;
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"", col);
        for (int k = 0; k < curves[i].n; k++)
            fprintf(f, "%.1f,%.1f ", X(curves[i].epoch[k]), Y(curves[i].loss[k]));
        fprintf(f, "\"/>\n");
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-width=\"2\"/><text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                W - R + 6, T + 30 + 18.0 * i, W - R + 26, T + 30 + 18.0 * i, col, W - R + 30,
                T + 34 + 18.0 * i, curves[i].name ? curves[i].name : "");
    }
#undef X
#undef Y
    fprintf(f, "</svg>\n");
    return fclose(f) == 0;
}
