#include "curve.h"

#include <math.h>
#include <stdio.h>

int ap_test_curve_check(const double *loss, int n, int window, char *why, size_t cap)
{
    if (n < 1) {
        snprintf(why, cap, "no epoch");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (!isfinite(loss[i])) {
            snprintf(why, cap, "epoch %d: loss %g is not finite", i, loss[i]);
            return -1;
        }
        if (loss[i] > loss[0]) {
            snprintf(why, cap, "epoch %d: loss %.4f above the first epoch's %.4f", i, loss[i],
                     loss[0]);
            return -1;
        }
    }
    for (int i = 0; window > 0 && i + window < n; i++)
        if (!(loss[i + window] < loss[i])) {
            snprintf(why, cap, "epochs %d..%d: loss %.4f -> %.4f, not lower", i, i + window,
                     loss[i], loss[i + window]);
            return -1;
        }
    return 0;
}

static double mean(const double *v, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += v[i];
    return s / n;
}

int ap_test_curve_check_late(const double *loss, int n, int from, int window, double tol, char *why,
                             size_t cap)
{
    if (window < 1 || n < from + 2 * window) {
        snprintf(why, cap, "%d epochs, fewer than %d", n, from + 2 * window);
        return -1;
    }
    for (int i = from; i + 2 * window <= n; i++) {
        double a = mean(loss + i, window), b = mean(loss + i + window, window);
        if (!isfinite(b) || b > a + tol) {
            snprintf(why, cap,
                     "epochs %d..%d: mean loss %.4f, then %.4f over epochs %d..%d: up by more "
                     "than %.3f",
                     i, i + window - 1, a, b, i + window, i + 2 * window - 1, tol);
            return -1;
        }
    }
    return 0;
}

int ap_test_curve_check_trend(const double *loss, int n, int from, int width, char *why, size_t cap)
{
    if (width < 1 || n < from + 2 * width) {
        snprintf(why, cap, "%d epochs, fewer than %d", n, from + 2 * width);
        return -1;
    }
    const double early = mean(loss + from, width), late = mean(loss + n - width, width);
    if (!(late < early)) {
        snprintf(why, cap, "mean loss of epochs %d..%d is %.4f, not below %.4f of epochs %d..%d",
                 n - width, n - 1, late, early, from, from + width - 1);
        return -1;
    }
    return 0;
}

void ap_test_curve_print(const char *label, const double *loss, int n)
{
    fprintf(stderr, "%s:", label);
    for (int i = 0; i < n; i++) fprintf(stderr, " %.4f", loss[i]);
    fprintf(stderr, "\n");
}
