/* The in-process BTARD group (see experiment.h). */
#include "btard/experiment.h"

#include "apiary/btard.h"
#include "apiary/error.h"

#include <math.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PEERS 64
#define DELAY     10

static const char *const attack_names[AP__ATK__COUNT] = {
    "none", "sign_flip", "random_direction", "label_flip",   "delayed",
    "alie", "ipm",       "bad_aggregator",   "false_accuser"};
static const char *const agg_names[AP__AGG__COUNT] = {"mean", "centered_clip", "btard"};

const char *ap__btard_attack_name(ap__btard_attack_t a)
{
    return (unsigned)a < AP__ATK__COUNT ? attack_names[a] : "unknown";
}

const char *ap__btard_agg_name(ap__btard_agg_t a)
{
    return (unsigned)a < AP__AGG__COUNT ? agg_names[a] : "unknown";
}

ap__btard_exp_cfg_t ap__btard_exp_default(void)
{
    return (ap__btard_exp_cfg_t){.peers = 16,
                                 .byzantine = 0,
                                 .attack = AP__ATK_NONE,
                                 .agg = AP__AGG_BTARD,
                                 .dim = 100,
                                 .steps = 300,
                                 .batch = 32,
                                 .lr = 0.5,
                                 .tau = 0.25,
                                 .validators = 2,
                                 .train = 8192,
                                 .test = 4096,
                                 .seed = 1};
}

/* ---- deterministic randomness for the data and the attacks ------------------- */

typedef struct rng {
    uint64_t s;
} rng_t;

static uint64_t rng_u64(rng_t *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unif(rng_t *r)
{
    return ((double)(rng_u64(r) >> 11) + 0.5) / 9007199254740992.0;
}

static double rng_gauss(rng_t *r)
{
    return sqrt(-2 * log(rng_unif(r))) * cos(6.283185307179586 * rng_unif(r));
}

/* ---- the group ---------------------------------------------------------------- */

typedef struct exp {
    ap__btard_exp_cfg_t c;
    int n, b, d;
    float *xtr, *ytr, *xte, *yte; /* (train, d), (train), (test, d), (test) */
    float *w;                     /* (d) */
    float *hist;                  /* (DELAY, d): w of the last DELAY steps */
    float *g;                     /* (n, d) honest gradients */
    float *s;                     /* (n, d) what each peer sends */
    float *v;                     /* (d) the aggregate */
    float *tmp, *z, *v2;          /* (d) */
    double *proj;                 /* (n) */
    bool banned[MAX_PEERS];
    int active[MAX_PEERS], m; /* peers not banned, in index order */
    ap_btard_clip_ws_t *ws;
} exp_t;

static bool byz(const exp_t *e, int i)
{
    return i >= e->n - e->b;
}

static int make_data(exp_t *e)
{
    int d = e->d;
    rng_t r = {e->c.seed * 7919 + 17};
    float *wstar = malloc((size_t)d * sizeof(float));
    if (!wstar) return AP_ENOMEM;
    for (int k = 0; k < d; k++) wstar[k] = (float)rng_gauss(&r);
    for (int set = 0; set < 2; set++) {
        int cnt = set ? e->c.test : e->c.train;
        float *x = set ? e->xte : e->xtr, *y = set ? e->yte : e->ytr;
        for (int j = 0; j < cnt; j++) {
            double dot = 0;
            for (int k = 0; k < d; k++) {
                x[(size_t)j * d + k] = (float)rng_gauss(&r);
                dot += (double)wstar[k] * x[(size_t)j * d + k];
            }
            y[j] = dot + 0.5 * rng_gauss(&r) > 0 ? 1.0f : 0.0f;
        }
    }
    free(wstar);
    return 0;
}

static void step_seed(const exp_t *e, int t, const char *what, uint8_t out[32])
{
    uint8_t in[16];
    for (int i = 0; i < 8; i++) in[i] = (uint8_t)(e->c.seed >> (8 * i));
    for (int i = 0; i < 8; i++) in[8 + i] = (uint8_t)((uint64_t)t >> (8 * i));
    crypto_generichash(out, 32, in, sizeof in, (const uint8_t *)what, strlen(what));
}

/* The logistic-regression gradient of peer i's minibatch for the step at
 * parameters w (labels flipped if flip). Public data and seed: anyone can
 * recompute it. */
static void gradient(const exp_t *e, const uint8_t seed[32], int i, const float *w, bool flip,
                     float *out)
{
    int d = e->d, B = e->c.batch;
    uint64_t idx[256];
    ap_btard_minibatch(seed, (uint32_t)i, (uint64_t)e->c.train, (size_t)B, idx);
    double acc[1024] = {0};
    for (int j = 0; j < B; j++) {
        const float *x = e->xtr + idx[j] * (size_t)d;
        double dot = 0;
        for (int k = 0; k < d; k++) dot += (double)w[k] * x[k];
        double y = e->ytr[idx[j]];
        if (flip) y = 1 - y;
        double err = 1.0 / (1.0 + exp(-dot)) - y;
        for (int k = 0; k < d; k++) acc[k] += err * x[k];
    }
    for (int k = 0; k < d; k++) out[k] = (float)(acc[k] / B);
}

static double accuracy(const exp_t *e)
{
    int ok = 0;
    for (int j = 0; j < e->c.test; j++) {
        double dot = 0;
        for (int k = 0; k < e->d; k++) dot += (double)e->w[k] * e->xte[(size_t)j * e->d + k];
        ok += (dot > 0) == (e->yte[j] > 0.5f);
    }
    return (double)ok / e->c.test;
}

/* z_max of ALIE for n peers with b attackers: Phi^-1((n - s) / n), s =
 * floor(n/2 + 1) - b (at least 1), by bisection on the normal CDF. */
static double alie_z(int n, int b)
{
    int s = n / 2 + 1 - b;
    if (s < 1) s = 1;
    double p = (double)(n - s) / n, lo = -10, hi = 10;
    for (int it = 0; it < 100; it++) {
        double mid = 0.5 * (lo + hi);
        if (0.5 * erfc(-mid / sqrt(2.0)) < p)
            lo = mid;
        else
            hi = mid;
    }
    return 0.5 * (lo + hi);
}

/* What each active peer sends this step. */
static void make_sends(exp_t *e, int t, const uint8_t seed[32])
{
    int d = e->d;
    for (int a = 0; a < e->m; a++) {
        int i = e->active[a];
        gradient(e, seed, i, e->w, false, e->g + (size_t)i * d);
    }
    /* honest mean and std, per coordinate (for the omniscient attacks) */
    double mu[1024] = {0}, sd[1024] = {0};
    int h = 0;
    for (int a = 0; a < e->m; a++) {
        int i = e->active[a];
        if (byz(e, i)) continue;
        h++;
        for (int k = 0; k < d; k++) mu[k] += e->g[(size_t)i * d + k];
    }
    for (int k = 0; k < d; k++) mu[k] /= h ? h : 1;
    for (int a = 0; a < e->m; a++) {
        int i = e->active[a];
        if (byz(e, i)) continue;
        for (int k = 0; k < d; k++) {
            double t2 = e->g[(size_t)i * d + k] - mu[k];
            sd[k] += t2 * t2;
        }
    }
    for (int k = 0; k < d; k++) sd[k] = sqrt(sd[k] / (h ? h : 1));
    uint8_t as[32];
    step_seed(e, t, "attack", as);
    rng_t r;
    memcpy(&r.s, as, 8);
    for (int k = 0; k < d; k++) e->z[k] = (float)rng_gauss(&r);
    double zn = 0;
    for (int k = 0; k < d; k++) zn += (double)e->z[k] * e->z[k];
    zn = sqrt(zn);
    double zmax = alie_z(e->n, e->b);
    for (int a = 0; a < e->m; a++) {
        int i = e->active[a];
        float *g = e->g + (size_t)i * d, *s = e->s + (size_t)i * d;
        memcpy(s, g, (size_t)d * sizeof(float));
        if (!byz(e, i)) continue;
        double gn = 0;
        for (int k = 0; k < d; k++) gn += (double)g[k] * g[k];
        gn = sqrt(gn);
        switch (e->c.attack) {
        case AP__ATK_SIGN_FLIP:
            for (int k = 0; k < d; k++) s[k] = -1000.0f * g[k];
            break;
        case AP__ATK_RANDOM_DIR:
            for (int k = 0; k < d; k++) s[k] = (float)(1000.0 * gn * e->z[k] / zn);
            break;
        case AP__ATK_LABEL_FLIP:
            gradient(e, seed, i, e->w, true, s);
            break;
        case AP__ATK_DELAYED:
            gradient(e, seed, i, e->hist + (size_t)(t % DELAY) * d, false, s);
            break;
        case AP__ATK_ALIE:
            for (int k = 0; k < d; k++) s[k] = (float)(mu[k] - zmax * sd[k]);
            break;
        case AP__ATK_IPM:
            for (int k = 0; k < d; k++) s[k] = (float)(-0.5 * mu[k]);
            break;
        default:
            break;
        }
    }
}

/* ---- one step ----------------------------------------------------------------- */

typedef struct step_out {
    bool ban[MAX_PEERS];
    bool skip;    /* an aggregate was rejected: no update this step */
    bool cheated; /* a Byzantine aggregator cheated */
    int cheater_caught, cheaters;
    int accusations;
} step_out_t;

static int aggregate_part(exp_t *e, int j, size_t o, size_t len, const ap_btard_clip_cfg_t *cc)
{
    const float *xs[MAX_PEERS];
    for (int a = 0; a < e->m; a++) xs[a] = e->s + (size_t)e->active[a] * e->d + o;
    if (e->c.agg == AP__AGG_MEAN) {
        for (size_t k = 0; k < len; k++) {
            double acc = 0;
            for (int a = 0; a < e->m; a++) acc += xs[a][k];
            e->v[o + k] = (float)(acc / e->m);
        }
        return 0;
    }
    (void)j;
    return ap_btard_clip(e->ws, xs, NULL, (size_t)e->m, len, cc, e->v + o, NULL);
}

/* The checks of one part's aggregate; returns whether the aggregator is
 * convicted. got = the copy peer r received (v2 for the second half of the
 * receivers when the aggregator equivocates). */
static bool check_part(exp_t *e, int j, size_t o, size_t len, bool equivocated, double tol,
                       const uint8_t pseed[32])
{
    /* 1. every receiver compares its copy with the aggregator's signed hash */
    uint8_t bh[32], rh[32];
    ap_btard_hash_floats(e->v + o, len, bh);
    for (int a = 0; a < e->m; a++) {
        const float *got = (equivocated && a >= e->m / 2) ? e->v2 + o : e->v + o;
        ap_btard_hash_floats(got, len, rh);
        if (memcmp(bh, rh, 32) != 0) return true; /* signed copy vs signed hash: proof */
    }
    /* 2. the projection check on a fresh direction */
    ap_btard_direction(pseed, (uint32_t)j, len, e->z);
    for (int a = 0; a < e->m; a++) {
        double dist;
        ap_btard_clip_proj(e->s + (size_t)e->active[a] * e->d + o, e->v + o, e->z, len, e->c.tau,
                           &dist, &e->proj[a]);
    }
    return !ap_btard_proj_sum_ok(e->proj, NULL, (size_t)e->m, tol);
}

static void run_step(exp_t *e, int t, step_out_t *so)
{
    int d = e->d;
    memset(so, 0, sizeof *so);
    uint8_t seed[32], pseed[32], vseed[32];
    step_seed(e, t, "batch", seed);
    make_sends(e, t, seed);
    ap_btard_clip_cfg_t cc = {.tau = e->c.tau, .max_iter = 1000, .eps = 1e-6 * e->c.tau};
    double tol = 1e-4 * e->c.tau;
    bool btard = e->c.agg == AP__AGG_BTARD;
    step_seed(e, t, "projection", pseed);
    for (int j = 0; j < e->m; j++) {
        size_t o = (size_t)d * j / e->m, len = (size_t)d * (j + 1) / e->m - o;
        if (len == 0) continue;
        (void)aggregate_part(e, j, o, len, &cc);
        int agg = e->active[j];
        bool cheat = byz(e, agg) && e->c.attack == AP__ATK_BAD_AGGREGATOR;
        bool equiv = false;
        if (cheat) {
            rng_t r = {(uint64_t)t * 1000003 + (uint64_t)j};
            memcpy(e->v2 + o, e->v + o, len * sizeof(float));
            for (size_t k = 0; k < len; k++) e->v[o + k] += (float)(e->c.tau * rng_gauss(&r));
            equiv = btard && t % 2 == 1; /* odd steps: the honest value to half the group */
            so->cheated = true;
            so->cheaters++;
        }
        if (!btard) continue;
        if (check_part(e, j, o, len, equiv, tol, pseed)) {
            so->ban[agg] = true;
            so->skip = true;
            if (cheat) so->cheater_caught++;
        }
    }
    if (!btard) return;
    /* the gradient check: seeded validators recompute their targets' gradients */
    step_seed(e, t, "validators", vseed);
    uint32_t va[MAX_PEERS], ta[MAX_PEERS];
    int k = e->c.validators < e->m ? e->c.validators : e->m;
    if (e->m >= 2 && ap_btard_pick_validators(vseed, (size_t)e->m, (size_t)k, va, ta) == 0) {
        for (int q = 0; q < k; q++) {
            int vi = e->active[va[q]], ti = e->active[ta[q]];
            if (byz(e, vi)) continue; /* Byzantine validators keep quiet about their own */
            gradient(e, seed, ti, e->w, false, e->tmp);
            if (!ap_btard_grad_match(e->s + (size_t)ti * d, e->tmp, (size_t)d, 1e-4, 1e-6))
                so->ban[ti] = true; /* accusation checkable by anyone: same recomputation */
        }
    }
    /* false accusers accuse an honest peer; everyone recomputes and bans the liar */
    if (e->c.attack == AP__ATK_FALSE_ACCUSER) {
        rng_t r = {(uint64_t)t * 7 + 3};
        for (int a = 0; a < e->m; a++) {
            int i = e->active[a];
            if (!byz(e, i)) continue;
            int target;
            do target = e->active[rng_u64(&r) % (uint64_t)e->m];
            while (byz(e, target));
            so->accusations++;
            gradient(e, seed, target, e->w, false, e->tmp);
            if (ap_btard_grad_match(e->s + (size_t)target * d, e->tmp, (size_t)d, 1e-4, 1e-6))
                so->ban[i] = true;
            else
                so->ban[target] = true;
        }
    }
}

static void exp_free(exp_t *e)
{
    free(e->xtr);
    free(e->ytr);
    free(e->xte);
    free(e->yte);
    free(e->w);
    free(e->hist);
    free(e->g);
    free(e->s);
    free(e->v);
    free(e->tmp);
    free(e->z);
    free(e->v2);
    free(e->proj);
    ap_btard_clip_ws_free(e->ws);
}

static int exp_alloc(exp_t *e)
{
    size_t d = (size_t)e->d, n = (size_t)e->n;
    e->xtr = malloc((size_t)e->c.train * d * sizeof(float));
    e->ytr = malloc((size_t)e->c.train * sizeof(float));
    e->xte = malloc((size_t)e->c.test * d * sizeof(float));
    e->yte = malloc((size_t)e->c.test * sizeof(float));
    e->w = calloc(d, sizeof(float));
    e->hist = calloc(DELAY * d, sizeof(float));
    e->g = calloc(n * d, sizeof(float));
    e->s = calloc(n * d, sizeof(float));
    e->v = calloc(d, sizeof(float));
    e->tmp = calloc(d, sizeof(float));
    e->z = calloc(d, sizeof(float));
    e->v2 = calloc(d, sizeof(float));
    e->proj = calloc(n, sizeof(double));
    e->ws = ap_btard_clip_ws_new();
    if (!e->xtr || !e->ytr || !e->xte || !e->yte || !e->w || !e->hist || !e->g || !e->s || !e->v ||
        !e->tmp || !e->z || !e->v2 || !e->proj || !e->ws)
        return AP_ENOMEM;
    return 0;
}

int ap__btard_exp_run(const ap__btard_exp_cfg_t *cfg, ap__btard_exp_result_t *res)
{
    if (!cfg || !res || cfg->peers < 2 || cfg->peers > MAX_PEERS || cfg->byzantine < 0 ||
        cfg->byzantine >= cfg->peers || cfg->dim < 1 || cfg->dim > 1024 || cfg->batch < 1 ||
        cfg->batch > 256 || cfg->train < 1 || cfg->test < 1 || !(cfg->tau > 0) || cfg->steps < 0 ||
        cfg->validators < 0 || (unsigned)cfg->attack >= AP__ATK__COUNT ||
        (unsigned)cfg->agg >= AP__AGG__COUNT)
        return AP_EINVAL;
    if (sodium_init() < 0) return AP_ESYS;
    exp_t e = {.c = *cfg, .n = cfg->peers, .b = cfg->byzantine, .d = cfg->dim};
    int rc = exp_alloc(&e);
    if (rc == 0) rc = make_data(&e);
    if (rc) {
        exp_free(&e);
        return rc;
    }
    memset(res, 0, sizeof *res);
    res->steps_to_ban_all = e.b == 0 ? 0 : -1;
    for (int t = 0; t < cfg->steps; t++) {
        e.m = 0;
        for (int i = 0; i < e.n; i++)
            if (!e.banned[i]) e.active[e.m++] = i;
        step_out_t so;
        run_step(&e, t, &so);
        for (int i = 0; i < e.n; i++) {
            if (so.ban[i] && !e.banned[i]) e.banned[i] = true;
        }
        res->cheats += so.cheated;
        res->cheats_unpunished += so.cheated && so.cheater_caught < so.cheaters;
        res->false_accusations += so.accusations;
        memcpy(e.hist + (size_t)(t % DELAY) * e.d, e.w, (size_t)e.d * sizeof(float));
        if (!so.skip)
            for (int k = 0; k < e.d; k++) e.w[k] -= (float)(cfg->lr * e.v[k]);
        if (res->steps_to_ban_all < 0) {
            int nb = 0;
            for (int i = e.n - e.b; i < e.n; i++) nb += e.banned[i];
            if (nb == e.b) res->steps_to_ban_all = t + 1;
        }
    }
    for (int i = 0; i < e.n; i++) {
        if (!e.banned[i]) continue;
        if (byz(&e, i))
            res->attackers_banned++;
        else
            res->honest_banned++;
    }
    res->accuracy = accuracy(&e);
    exp_free(&e);
    return 0;
}
