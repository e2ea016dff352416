/* The verified step's gradient check: validators picked by the step's seed
 * recompute their targets' vectors and accuse on a mismatch; every member
 * judges every accusation from the same signed messages and the public
 * state (see apiary/btard.h and docs/btard.md). */
#include "apiary/log.h"
#include "btard/step_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const uint8_t zero_hash[H];

void ap__btard_convict(step_t *s, ap_btard_ban_t *bans, size_t *nb, size_t who,
                       ap_btard_fault_t fault, uint32_t round, const uint8_t *a, size_t alen,
                       const uint8_t *b, size_t blen)
{
    if (who >= s->n) return;
    for (size_t i = 0; i < *nb; i++)
        if (ap_peer_id_eq(&bans[i].peer, &s->peers[who])) return;
    ap_btard_ban_t *x = &bans[(*nb)++];
    memset(x, 0, sizeof *x);
    memcpy(x->run, s->cfg.run, H);
    x->step = s->cfg.step;
    x->round = round;
    x->peer = s->peers[who];
    x->fault = fault;
    x->ev_a = a;
    x->ev_a_len = alen;
    x->ev_b = b;
    x->ev_b_len = blen;
}

/* Member t's recomputed vector, or NULL. */
static const float *grad_of(step_t *s, size_t t)
{
    if (!s->grad || t >= s->n) return NULL;
    if (s->grad_for == t) return s->grad;
    s->grad_for = s->n;
    if (s->cfg.grad(s->cfg.grad_arg, (uint32_t)t, s->grad) != 0) return NULL;
    for (size_t k = 0; k < s->total; k++)
        if (!isfinite(s->grad[k])) return NULL;
    s->grad_for = t;
    return s->grad;
}

/* Whether member t's entry in part j's check matches g: 1 mismatch, 0
 * match, -1 not decidable (no commitment or check, another aggregate than
 * this node holds, no entry for t's committed input, or t disputes j). */
static int compare(step_t *s, size_t t, size_t j, const float *g)
{
    if (t >= s->n || j >= s->n || !s->counts[j]) return -1;
    const ap__step_commit_t *ct = s->commit[t];
    const ap__agg_check_t *k = s->check[j];
    if (!ct || !k || memcmp(k->seed, s->seed, H) != 0 || !memcmp(ct->part[j], zero_hash, H))
        return -1;
    if (s->disputed_by[j] >> t & 1) return -1;
    if (!ap__btard_same_state(s, t)) return -1; /* its gradient is of another state */
    size_t d = (size_t)s->counts[j];
    const float *v = s->cfg.result + s->off[j];
    uint8_t hv[H];
    ap_btard_hash_floats(v, d, hv);
    if (memcmp(hv, k->agg, H) != 0) return -1;
    const ap_btard_agg_entry_t *e = NULL;
    for (uint32_t q = 0; q < k->n && !e; q++)
        if (!memcmp(k->e[q].hash, ct->part[j], H) && k->e[q].weight == ct->weight) e = &k->e[q];
    if (!e) return -1;
    double dist, proj;
    ap_btard_direction(s->seed, (uint32_t)j, d, s->z);
    ap_btard_clip_proj(g + s->off[j], v, s->z, d, k->tau, &dist, &proj);
    /* |x - v| and the clipped projection are 1-Lipschitz in x: both move by
     * at most |x - g| when the target sent x instead of g */
    double tol = AP_BTARD_GRAD_ATOL + AP_BTARD_GRAD_RTOL * dist;
    if (fabs(e->dist - dist) <= tol && fabs(e->proj - proj) <= 2 * tol) return 0;
    return 1;
}

static bool validates(const step_t *s, size_t a, size_t t)
{
    if (!s->cfg.validators) return false;
    uint32_t val[AP_BTARD_STEP_MAX_PEERS], tgt[AP_BTARD_STEP_MAX_PEERS];
    size_t k = s->cfg.validators < s->n ? s->cfg.validators : s->n;
    if (ap_btard_pick_validators(s->seed, s->n, k, val, tgt) != 0) return false;
    for (size_t q = 0; q < k; q++)
        if (val[q] == a && tgt[q] == t) return true;
    return false;
}

void ap__btard_grad_accuse(step_t *s, ap__step_report_t *r)
{
    if (s->cfg.attack == AP_BTARD_STEP_FALSE_ACCUSE) {
        size_t t = (s->self + 1) % s->n;
        for (size_t j = 0; j < s->n; j++)
            if (s->counts[j] && r->nacc < AP_BTARD_STEP_MAX_PEERS) {
                r->acc_target[r->nacc] = (uint32_t)t;
                r->acc_part[r->nacc++] = (uint32_t)j;
                return;
            }
        return;
    }
    if (!s->grad || !s->cfg.validators) return;
    for (size_t t = 0; t < s->n; t++) {
        if (t == s->self || !validates(s, s->self, t)) continue;
        const float *g = grad_of(s, t);
        if (!g) continue;
        for (size_t j = 0; j < s->n; j++) {
            if (compare(s, t, j, g) != 1 || r->nacc >= AP_BTARD_STEP_MAX_PEERS) continue;
            char sh[AP_PEER_SHORT_LEN];
            ap_log(AP_LOG_WARN, "btard", "step %llu: accusing %s: its part %zu is not its gradient",
                   (unsigned long long)s->cfg.step, ap_peer_id_short(&s->peers[t], sh), j);
            r->acc_target[r->nacc] = (uint32_t)t;
            r->acc_part[r->nacc++] = (uint32_t)j;
            break; /* one proven part is enough */
        }
    }
}

void ap__btard_grad_judge(step_t *s, ap_btard_ban_t *bans, size_t *nb, uint32_t *accusations)
{
    for (size_t a = 0; a < s->n; a++) {
        /* a member left out of the step's MPRNG round (a missed deadline)
         * drew its validators from another seed: its accusations are not
         * judged, so a slow honest validator is never a false accuser */
        if (s->mfault[a] != AP_BTARD_FAULT_NONE) continue;
        /* an accuser on another state recomputed from other parameters */
        if (!ap__btard_same_state(s, a)) continue;
        const ap__step_report_t *r = s->report[a];
        for (uint32_t q = 0; r && q < r->nacc; q++) {
            size_t t = r->acc_target[q], j = r->acc_part[q];
            (*accusations)++;
            /* judged only on a check of this node's seed: an honest accuser
             * accuses only on a check of its own seed, so it then drew its
             * validators from this one too (a member that ended the MPRNG
             * round on another seed judges nobody) */
            bool judgeable =
                j < s->n && s->counts[j] && s->check[j] && !memcmp(s->check[j]->seed, s->seed, H);
            if (t < s->n && t != a && !judgeable) continue;
            if (t >= s->n || t == a || !validates(s, a, t)) {
                ap__btard_convict(s, bans, nb, a, AP_BTARD_FAULT_FALSE_ACCUSATION, 0, NULL, 0, NULL,
                                  0);
                continue;
            }
            const float *g = grad_of(s, t);
            if (!g) continue; /* this node cannot judge it */
            int rc = compare(s, t, j, g);
            if (rc == 1)
                ap__btard_convict(s, bans, nb, t, AP_BTARD_FAULT_BAD_GRADIENT, 0, NULL, 0, NULL, 0);
            else if (rc == 0)
                ap__btard_convict(s, bans, nb, a, AP_BTARD_FAULT_FALSE_ACCUSATION, 0, NULL, 0, NULL,
                                  0);
        }
    }
}
