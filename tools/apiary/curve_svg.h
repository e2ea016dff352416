/* The loss curves of a run's peers as one SVG image (apiary demo). */
#ifndef AP_CLI_CURVE_SVG_H
#define AP_CLI_CURVE_SVG_H

#include <stdbool.h>
#include <stddef.h>

#define AP_CURVE_MAX_POINTS 4096

typedef struct ap_cli_curve {
    const char *name;
    int n;
    double epoch[AP_CURVE_MAX_POINTS], loss[AP_CURVE_MAX_POINTS];
} ap_cli_curve_t;

/* Reads the "epoch N | loss X | ..." lines of an `apiary train` log into c
 * (lines with loss "-" are skipped). False if the file cannot be read. */
bool ap_cli_curve_read(const char *log, ap_cli_curve_t *c);
/* Writes the curves (loss over global epoch, one colour per peer, a dashed
 * line at `ref` if ref > 0, labelled ref_label) to path. False on I/O error. */
bool ap_cli_curve_svg(const char *path, const ap_cli_curve_t *curves, int n, double ref,
                      const char *ref_label);

#endif
