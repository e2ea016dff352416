/* The shape a training curve must have (docs/training.md, "The recipe"):
 * no epoch's loss above the first epoch's, and every window of `window`
 * epochs ends lower than it began. Shared by the simulator and the
 * multi-process curve tests. */
#ifndef AP_TEST_CURVE_H
#define AP_TEST_CURVE_H

#include <stddef.h>

/* loss[0..n): one value per epoch. Returns 0 if the curve has the shape,
 * else -1 with the first violation described in why (cap bytes). */
int ap_test_curve_check(const double *loss, int n, int window, char *why, size_t cap);
/* The late part of a long run: from epoch `from` on, the mean of no
 * `window` epochs is more than `tol` above the mean of the `window` epochs
 * before them (a loss that climbs back fails; one epoch's mean, which varies
 * by a few hundredths on a plateau, does not). Returns 0 or -1 with why as
 * above. */
int ap_test_curve_check_late(const double *loss, int n, int from, int window, double tol, char *why,
                             size_t cap);
/* The trend of a long run, robust to one epoch's noise: the mean of the last
 * `width` epochs is below the mean of the `width` epochs from `from`.
 * Returns 0 or -1 with why as above. */
int ap_test_curve_check_trend(const double *loss, int n, int from, int width, char *why,
                              size_t cap);
/* Prints the curve on one line ("label: a b c ...") to stderr. */
void ap_test_curve_print(const char *label, const double *loss, int n);

#endif
