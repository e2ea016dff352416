/* DeDLOC load balancing: the LP (lp_solve), its closed form when up == down,
 * the canonical split among optima, and largest-remainder rounding.
 * See docs/averaging.md for the derivation and the tie-break rule. */
#include "averaging/balance.h"

#include "apiary/log.h"

#include <lp_lib.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MOD "avg"

int ap__avg_model(const ap_avg_bw_t *peers, size_t n, const bool *excluded, ap__avg_row_t *rows)
{
    if (!peers || !rows || n == 0 || n > AP_AVG_MAX_PEERS) return AP_EINVAL;
    size_t ns = 0, na = 0;
    for (size_t i = 0; i < n; i++) {
        const ap_avg_bw_t *p = &peers[i];
        if (p->role != AP_AVG_NORMAL && p->role != AP_AVG_CLIENT && p->role != AP_AVG_AUX)
            return AP_EINVAL;
        if (!isfinite(p->up) || !isfinite(p->down) || !(p->up > 0) || !(p->down > 0))
            return AP_EINVAL;
        bool s = p->role != AP_AVG_AUX;
        bool a = p->role != AP_AVG_CLIENT && !(excluded && excluded[i]);
        rows[i].s = s;
        rows[i].a = a;
        ns += s;
        na += a;
    }
    if (ns == 0 || na == 0) return AP_EINVAL;
    /* S = R: every sender receives, nobody else does. */
    for (size_t i = 0; i < n; i++) {
        double s = rows[i].s ? 1.0 : 0.0;
        rows[i].alpha = s;                   /* same for upload and download */
        rows[i].beta = ((double)ns - s) - s; /* |R∖{i}| − [i∈S] = |S∖{i}| − [i∈R] */
        rows[i].up = peers[i].up;
        rows[i].down = peers[i].down;
    }
    return 0;
}

/* Rounds t up to 24 significant bits so that solver noise in the last bits
 * maps to the same value on every peer. */
static double quantise_up(double t)
{
    if (!(t > 0)) return t;
    int e;
    double m = frexp(t * (1.0 + 1e-9), &e);
    m = ceil(m * 16777216.0) / 16777216.0;
    return ldexp(m, e);
}

/* The feasible box [lo, hi] of a_i at time t (per-peer constraints are
 * separable: each involves only a_i and t). */
static void box_at(const ap__avg_row_t *r, double t, bool snap, double *lo, double *hi)
{
    if (!r->a) {
        *lo = *hi = 0;
        return;
    }
    double l = 0, h = 1;
    const double b[2] = {r->up, r->down};
    for (int k = 0; k < 2; k++) {
        double slack = b[k] * t - r->alpha;
        /* slack within the quantisation of t is noise: no share from it */
        if (snap && slack < 1e-6 * b[k] * t) slack = 0;
        if (r->beta > 0) {
            double c = slack / r->beta;
            if (c < h) h = c;
        } else if (r->beta < 0) {
            double c = -slack / -r->beta;
            if (c > l) l = c;
        }
    }
    if (h < 0) h = 0;
    if (l > 1) l = 1;
    *lo = l;
    *hi = h;
}

static int canonical(const ap__avg_row_t *rows, size_t n, double t, bool snap, double *shares)
{
    double slo = 0, shi = 0;
    for (size_t i = 0; i < n; i++) {
        double lo, hi;
        box_at(&rows[i], t, snap, &lo, &hi);
        if (lo > hi + 1e-12) return AP_ERANGE;
        if (lo > hi) hi = lo;
        shares[i] = lo;
        slo += lo;
        shi += hi;
    }
    if (slo > 1 + 1e-9 || shi < 1 - 1e-9) return AP_ERANGE;
    double theta = shi > slo ? (1 - slo) / (shi - slo) : 0;
    if (theta < 0) theta = 0;
    if (theta > 1) theta = 1;
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        double lo, hi;
        box_at(&rows[i], t, snap, &lo, &hi);
        if (hi < lo) hi = lo;
        shares[i] = lo + theta * (hi - lo);
        sum += shares[i];
    }
    if (!(sum > 0)) return AP_ERANGE;
    for (size_t i = 0; i < n; i++) shares[i] /= sum; /* exact Σ = 1 up to rounding */
    return 0;
}

int ap__avg_canonical(const ap__avg_row_t *rows, size_t n, double t, double *shares)
{
    int rc = canonical(rows, n, t, true, shares);
    if (rc == AP_ERANGE) rc = canonical(rows, n, t, false, shares);
    return rc;
}

/* min T over (T, a_A) with lp_solve; bandwidths scaled by their maximum. */
static int solve_lp(const ap__avg_row_t *rows, size_t n, double *t_out)
{
    double bmax = 0;
    for (size_t i = 0; i < n; i++) {
        if (rows[i].up > bmax) bmax = rows[i].up;
        if (rows[i].down > bmax) bmax = rows[i].down;
    }
    int *col_of = calloc(n, sizeof *col_of);
    REAL *row = malloc((n + 2) * sizeof *row);
    int *colno = malloc((n + 2) * sizeof *colno);
    if (!col_of || !row || !colno) {
        free(col_of);
        free(row);
        free(colno);
        return AP_ENOMEM;
    }
    int ncols = 1; /* column 1 is T */
    for (size_t i = 0; i < n; i++) col_of[i] = rows[i].a ? ++ncols : 0;
    int rc = AP_EIO;
    lprec *lp = make_lp(0, ncols);
    if (!lp) {
        rc = AP_ENOMEM;
        goto out;
    }
    set_verbose(lp, NEUTRAL);
    set_add_rowmode(lp, TRUE);
    /* objective: minimise T */
    row[0] = 1;
    colno[0] = 1;
    if (!set_obj_fnex(lp, 1, row, colno)) goto out;
    set_minim(lp);
    /* Σ a_i = 1 */
    int k = 0;
    for (size_t i = 0; i < n; i++)
        if (col_of[i]) {
            row[k] = 1;
            colno[k++] = col_of[i];
        }
    if (!add_constraintex(lp, k, row, colno, EQ, 1)) goto out;
    /* α + β a_i − b·T ≤ 0 for upload and download (b scaled) */
    for (size_t i = 0; i < n; i++) {
        const double b[2] = {rows[i].up / bmax, rows[i].down / bmax};
        for (int d = 0; d < 2; d++) {
            if (rows[i].alpha == 0 && (!col_of[i] || rows[i].beta == 0)) continue;
            k = 0;
            row[k] = -b[d];
            colno[k++] = 1;
            if (col_of[i] && rows[i].beta != 0) {
                row[k] = rows[i].beta;
                colno[k++] = col_of[i];
            }
            if (!add_constraintex(lp, k, row, colno, LE, -rows[i].alpha)) goto out;
        }
    }
    set_add_rowmode(lp, FALSE);
    for (size_t i = 0; i < n; i++)
        if (col_of[i]) set_bounds(lp, col_of[i], 0, 1);
    int res = solve(lp);
    if (res != OPTIMAL && res != PRESOLVED) {
        ap_warn(MOD, "lp_solve failed: %d", res);
        goto out;
    }
    REAL *vars;
    if (!get_ptr_variables(lp, &vars)) goto out;
    *t_out = vars[0] / bmax;
    if (*t_out < 0 && *t_out > -1e-12) *t_out = 0; /* lone sender: nothing to move */
    rc = isfinite(*t_out) && *t_out >= 0 ? 0 : AP_EIO;
out:
    if (lp) delete_lp(lp);
    free(col_of);
    free(row);
    free(colno);
    return rc;
}

static int balance_once(const ap__avg_row_t *rows, size_t n, double *shares, double *t_out)
{
    double t;
    int rc = solve_lp(rows, n, &t);
    if (rc) return rc;
    double tq = quantise_up(t);
    rc = ap__avg_canonical(rows, n, tq, shares);
    for (int tries = 0; rc == AP_ERANGE && tries < 8; tries++) { /* solver tolerance */
        tq = quantise_up(tq * (1 + 1e-7));
        rc = ap__avg_canonical(rows, n, tq, shares);
    }
    if (rc) return AP_EIO;
    *t_out = tq;
    return 0;
}

int ap_avg_balance(const ap_avg_bw_t *peers, size_t n, const ap_avg_balance_opts_t *opts,
                   double *shares, double *t)
{
    if (!shares) return AP_EINVAL;
    double min_share = opts ? opts->min_share : 0;
    if (!isfinite(min_share) || min_share < 0 || min_share >= 1) return AP_EINVAL;
    ap__avg_row_t *rows = calloc(n ? n : 1, sizeof *rows);
    bool *excl = calloc(n ? n : 1, sizeof *excl);
    if (!rows || !excl) {
        free(rows);
        free(excl);
        return AP_ENOMEM;
    }
    double tt = 0;
    int rc = ap__avg_model(peers, n, excl, rows);
    if (rc == 0) rc = balance_once(rows, n, shares, &tt);
    while (rc == 0 && min_share > 0) {
        /* drop the smallest positive share below min_share (lowest index on ties) */
        size_t worst = n;
        for (size_t i = 0; i < n; i++)
            if (rows[i].a && shares[i] < min_share && (worst == n || shares[i] < shares[worst]))
                worst = i;
        if (worst == n) break;
        size_t left = 0;
        for (size_t i = 0; i < n; i++) left += rows[i].a;
        if (left <= 1) break;
        excl[worst] = true;
        rc = ap__avg_model(peers, n, excl, rows);
        if (rc == 0) rc = balance_once(rows, n, shares, &tt);
    }
    if (rc == 0 && t) *t = tt;
    free(rows);
    free(excl);
    return rc;
}

int ap_avg_balance_closed_form(const ap_avg_bw_t *peers, size_t n, double *shares, double *t)
{
    if (!shares) return AP_EINVAL;
    ap__avg_row_t *rows = calloc(n ? n : 1, sizeof *rows);
    if (!rows) return AP_ENOMEM;
    int rc = ap__avg_model(peers, n, NULL, rows);
    if (rc) goto out;
    size_t ns = 0;
    for (size_t i = 0; i < n; i++) {
        ns += rows[i].s;
        if (peers[i].up != peers[i].down) rc = AP_ENOTSUP;
    }
    if (rc || ns < 2) {
        rc = AP_ENOTSUP;
        goto out;
    }
    /* Every sender needs b_i·T ≥ 1 (its upload at a_i = 0); each acceptor's
     * cap a_i ≤ (b_i T − α_i)/β_i grows linearly with T (β_i ≥ 0 as |S| ≥ 2).
     * T* is the lowest level where the caps fill Σ a_i = 1. */
    double t_lb = 0, num = 1, den = 0;
    bool free_acceptor = false;
    for (size_t i = 0; i < n; i++) {
        double b = peers[i].up;
        if (rows[i].s && 1.0 / b > t_lb) t_lb = 1.0 / b;
        if (!rows[i].a) continue;
        if (rows[i].beta == 0) {
            free_acceptor = true;
            continue;
        }
        num += rows[i].alpha / rows[i].beta;
        den += b / rows[i].beta;
    }
    double tt = t_lb;
    if (!free_acceptor && num / den > tt) tt = num / den;
    tt = quantise_up(tt);
    rc = ap__avg_canonical(rows, n, tt, shares);
    if (rc) {
        rc = AP_EIO;
        goto out;
    }
    if (t) *t = tt;
out:
    free(rows);
    return rc;
}

int ap_avg_split_time(const ap_avg_bw_t *peers, size_t n, const double *shares, double *t)
{
    if (!shares || !t) return AP_EINVAL;
    ap__avg_row_t *rows = calloc(n ? n : 1, sizeof *rows);
    if (!rows) return AP_ENOMEM;
    int rc = ap__avg_model(peers, n, NULL, rows);
    if (rc == 0) {
        double worst = 0;
        for (size_t i = 0; i < n; i++) {
            double a = shares[i];
            if (!isfinite(a) || a < 0 || (!rows[i].a && a != 0)) {
                rc = AP_EINVAL;
                break;
            }
            double load = rows[i].alpha + rows[i].beta * a;
            double tu = load / rows[i].up, td = load / rows[i].down;
            if (tu > worst) worst = tu;
            if (td > worst) worst = td;
        }
        *t = worst;
    }
    free(rows);
    return rc;
}

int ap_avg_round_counts(const double *shares, size_t n, uint64_t total, uint64_t *counts)
{
    if (!shares || !counts || n == 0) return AP_EINVAL;
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(shares[i]) || shares[i] < 0) return AP_EINVAL;
        sum += shares[i];
    }
    if (!(sum > 0)) return AP_EINVAL;
    double *rem = malloc(n * sizeof *rem);
    if (!rem) return AP_ENOMEM;
    uint64_t given = 0;
    for (size_t i = 0; i < n; i++) {
        long double q = (long double)shares[i] / sum * (long double)total;
        uint64_t f = (uint64_t)floorl(q);
        if (f > total) f = total;
        counts[i] = f;
        rem[i] = shares[i] > 0 ? (double)(q - (long double)f) : -1.0;
        given += f;
    }
    /* floors can overshoot only by rounding of q; trim from the largest
     * counts' ends first (never happens for sane inputs) */
    while (given > total) {
        size_t j = 0;
        for (size_t i = 1; i < n; i++)
            if (counts[i] > counts[j]) j = i;
        counts[j]--;
        given--;
    }
    while (given < total) {
        size_t j = n;
        for (size_t i = 0; i < n; i++)
            if (rem[i] >= 0 && (j == n || rem[i] > rem[j])) j = i;
        if (j == n) break; /* unreachable: some share is positive */
        counts[j]++;
        rem[j] = -0.5; /* each peer gets at most one extra per pass */
        given++;
        bool any = false;
        for (size_t i = 0; i < n; i++) any |= rem[i] >= 0;
        if (!any && given < total) /* more than n remainders (rounding): restart */
            for (size_t i = 0; i < n; i++) rem[i] = shares[i] > 0 ? 0 : -1.0;
    }
    free(rem);
    return 0;
}
