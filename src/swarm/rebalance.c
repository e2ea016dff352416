/* SWARM adaptive rebalancing: the plan every server computes from the same
 * DHT view (apiary/swarm.h; the rule and why it converges: docs/swarm.md). */
#include "apiary/swarm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorted copy of the stage totals. */
static void sorted(const double *tot, uint32_t S, double *out)
{
    memcpy(out, tot, S * sizeof *out);
    qsort(out, S, sizeof *out, cmp_double);
}

/* Totals within TIE (relative) are equal: sums of the same throughputs in
 * another grouping differ in their last bits (two stages of 4 + 1 and
 * 2 + 2 + 1, say), and such rounding must not decide which stage is least
 * or where two vectors first differ. */
#define TIE 1e-9

static bool same(double a, double b)
{
    return fabs(a - b) <= TIE * fmax(fabs(a), fabs(b));
}

/* >0 if a is lexicographically above b, 0 if equal, <0 below. */
static int lex(const double *a, const double *b, uint32_t S)
{
    for (uint32_t k = 0; k < S; k++)
        if (!same(a[k], b[k])) return a[k] > b[k] ? 1 : -1;
    return 0;
}

/* Whether a improves on b by a clear margin at the first place they differ. */
static bool clear_gain(const double *a, const double *b, uint32_t S, double margin)
{
    for (uint32_t k = 0; k < S; k++) {
        if (same(a[k], b[k])) continue;
        if (a[k] < b[k]) return false;
        return b[k] <= 0 ? true : a[k] - b[k] >= margin * b[k];
    }
    return false;
}

typedef struct ord {
    const ap_peer_id_t *peer;
    size_t i;
} ord_t;

static int cmp_ord(const void *a, const void *b)
{
    const ord_t *x = a, *y = b;
    int c = ap_peer_id_cmp(x->peer, y->peer);
    return c ? c : (x->i > y->i) - (x->i < y->i);
}

/* A candidate move: server i to stage t, and with a swap server j (in t)
 * to i's stage. */
typedef struct cand {
    long i, j;
    uint32_t t;
} cand_t;

/* Whether candidate c (sorted totals cv) beats the best so far (bv): higher
 * sorted totals, then fewer movers, then lower peer ids, then lower stage. */
static bool better(const ap_swarm_member_t *m, const double *cv, const cand_t *c, const double *bv,
                   const cand_t *b, uint32_t S)
{
    if (b->i < 0) return true;
    int l = lex(cv, bv, S);
    if (l) return l > 0;
    if ((c->j < 0) != (b->j < 0)) return c->j < 0;
    int pc = ap_peer_id_cmp(&m[c->i].peer, &m[b->i].peer);
    if (pc) return pc < 0;
    if (c->j >= 0) {
        pc = ap_peer_id_cmp(&m[c->j].peer, &m[b->j].peer);
        if (pc) return pc < 0;
    }
    return c->t < b->t;
}

double ap_swarm_pipeline_throughput(const ap_swarm_member_t *m, const uint32_t *stage, size_t n,
                                    uint32_t nstages)
{
    if (!nstages || nstages > AP_SWARM_STAGES_MAX) return 0;
    double tot[AP_SWARM_STAGES_MAX] = {0};
    for (size_t i = 0; i < n; i++) {
        uint32_t s = stage ? stage[i] : m[i].stage;
        if (s < nstages) tot[s] += m[i].throughput;
    }
    double lo = tot[0];
    for (uint32_t s = 1; s < nstages; s++) lo = fmin(lo, tot[s]);
    return lo;
}

bool ap_swarm_member_stale(const ap_swarm_member_t *m, int64_t wall_ms, int64_t slack_ms)
{
    if (!m || m->made_ms <= 0 || !m->period_ms) return false;
    if (slack_ms < 0) slack_ms = 0;
    const int64_t age = wall_ms - m->made_ms;
    return age > (int64_t)m->period_ms * 3 / 2 + slack_ms;
}

uint64_t ap_swarm_rebalance_delay(uint64_t period_us, double u)
{
    if (!(u >= 0) || u >= 1) u = 0.5;
    return period_us / 2 + (uint64_t)(u * (double)period_us);
}

int ap_swarm_rebalance_plan(const ap_swarm_member_t *m, size_t n, uint32_t nstages, double margin,
                            uint32_t *to)
{
    if ((!m && n) || (!to && n) || !nstages || nstages > AP_SWARM_STAGES_MAX) return AP_EINVAL;
    if (!(margin >= 0) || !isfinite(margin)) return AP_EINVAL;
    const uint32_t S = nstages;
    double tot[AP_SWARM_STAGES_MAX] = {0}, cur[AP_SWARM_STAGES_MAX], cand[AP_SWARM_STAGES_MAX],
           best[AP_SWARM_STAGES_MAX];
    uint32_t cnt[AP_SWARM_STAGES_MAX] = {0};
    bool lost[AP_SWARM_STAGES_MAX] = {0};
    for (size_t i = 0; i < n; i++)
        if (m[i].stage >= S || !(m[i].throughput >= 0) || !isfinite(m[i].throughput))
            return AP_EINVAL;
    /* Sums in peer-id order, so every server gets the same bits whatever the
     * order it read the records in. */
    ord_t *idx = malloc((n ? n : 1) * sizeof *idx);
    bool *moved = calloc(n ? n : 1, sizeof *moved);
    if (!idx || !moved) {
        free(idx);
        free(moved);
        return AP_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) idx[i] = (ord_t){&m[i].peer, i};
    qsort(idx, n, sizeof *idx, cmp_ord);
    for (size_t k = 0; k < n; k++) {
        size_t i = idx[k].i;
        tot[m[i].stage] += m[i].throughput;
        cnt[m[i].stage]++;
        to[i] = m[i].stage;
    }
    free(idx);
    int movers = 0;
    for (uint32_t round = 0; round < S; round++) {
        sorted(tot, S, cur);
        /* Targets: the least stages, and those within the margin of the
         * least. With two stages near the minimum, a move into either alone
         * cannot raise the minimum by the margin; lifting the second one
         * first (a clear gain at the second place of the vector) lets the
         * next round lift the other. */
        const double lo = cur[0], near = lo * (1 + margin) * (1 + TIE);
        cand_t bc = {-1, -1, 0};
        for (size_t i = 0; i < n; i++) {
            const uint32_t from = to[i];
            const double v = m[i].throughput;
            if (moved[i] || lost[from] || !(v > 0)) continue;
            for (uint32_t t = 0; t < S; t++) {
                if (t == from || tot[t] > near || cnt[from] < 2)
                    continue; /* into a (near) least stage */
                tot[from] -= v;
                tot[t] += v;
                sorted(tot, S, cand);
                tot[from] += v;
                tot[t] -= v;
                if (!clear_gain(cand, cur, S, margin)) continue;
                cand_t c = {(long)i, -1, t};
                if (better(m, cand, &c, best, &bc, S)) bc = c, memcpy(best, cand, S * sizeof *best);
            }
            /* A swap with a slower server of a (near) least stage: both keep
             * their server count, each loses one server. */
            for (size_t j = 0; j < n; j++) {
                const uint32_t t = to[j];
                const double w = m[j].throughput;
                if (t == from || tot[t] > near || moved[j] || lost[t] || !(w < v)) continue;
                tot[from] += w - v;
                tot[t] += v - w;
                sorted(tot, S, cand);
                tot[from] -= w - v;
                tot[t] -= v - w;
                if (!clear_gain(cand, cur, S, margin)) continue;
                cand_t c = {(long)i, (long)j, t};
                if (better(m, cand, &c, best, &bc, S)) bc = c, memcpy(best, cand, S * sizeof *best);
            }
        }
        if (bc.i < 0) break;
        const size_t i = (size_t)bc.i;
        const uint32_t from = to[i], t = bc.t;
        tot[from] -= m[i].throughput;
        tot[t] += m[i].throughput;
        lost[from] = true;
        moved[i] = true;
        to[i] = t;
        movers++;
        if (bc.j >= 0) {
            const size_t j = (size_t)bc.j;
            tot[t] -= m[j].throughput;
            tot[from] += m[j].throughput;
            lost[t] = true;
            moved[j] = true;
            to[j] = from;
            movers++;
        } else {
            cnt[from]--;
            cnt[t]++;
        }
    }
    free(moved);
    return movers;
}
