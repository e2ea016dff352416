/* Internals of the DeDLOC load balancer shared with the all-reduce. */
#ifndef AP_AVERAGING_BALANCE_H
#define AP_AVERAGING_BALANCE_H

#include "apiary/avg.h"

/* One peer's constraints, P = 1: α + β·a ≤ up·T and α + β·a ≤ down·T
 * (upload and download have the same α and β because S = R). */
typedef struct ap__avg_row {
    bool s; /* sends (and receives) */
    bool a; /* accepts, may reduce */
    double alpha, beta, up, down;
} ap__avg_row_t;

/* Validates peers and fills rows; excluded[i] (may be NULL) removes i from A. */
int ap__avg_model(const ap_avg_bw_t *peers, size_t n, const bool *excluded, ap__avg_row_t *rows);
/* The canonical split at time t (every acceptor at the same fraction θ of
 * its feasible interval). AP_ERANGE if t is infeasible. */
int ap__avg_canonical(const ap__avg_row_t *rows, size_t n, double t, double *shares);

#endif
