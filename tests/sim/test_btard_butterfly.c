/* ButterflyClip: the butterfly all-reduce with CenteredClip as each part's
 * reducer (ap_allreduce_opts_t.reduce = ap_btard_butterfly_clip), on the
 * simulator. A malicious peer's poisoned copy is clipped on every part and
 * the result stays within CenteredClip's bound of the honest mean, where the
 * plain mean is thrown far off; with tau = INFINITY the result is the mean;
 * a sender that dies mid-round is left out and the round still finishes. */
#include "avg_harness.h"

#include "apiary/btard.h"

enum { N = 8, ELEMS = 6000, CHUNK = 500 };

/* Honest peers: centre + noise in [-1, 1]; the attackers: centre + poison. */
static void fill(avg_env_t *e, const bool *bad, double poison)
{
    for (uint64_t k = 0; k < e->elems; k++) {
        double c = 10 * sin((double)k * 0.01);
        for (int i = 0; i < e->n; i++) {
            avg_node_t *d = &e->nd[i];
            double v = bad[i] ? c + poison : c + 2 * avg_rnd01(e) - 1;
            d->orig[k] = d->data[k] = (float)v;
            d->weight = 1.0;
        }
    }
}

/* |a - b| (L2) over the whole vector */
static double dist(const float *a, const double *b, uint64_t n)
{
    double s = 0;
    for (uint64_t k = 0; k < n; k++) s += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
    return sqrt(s);
}

typedef struct crash_watch {
    avg_env_t *e;
    int victim;
} crash_watch_t;

/* the reducers have some of the victim's chunks, not half of them */
static bool crash_point(void *arg)
{
    crash_watch_t *w = arg;
    uint32_t got = 0, total = 0;
    for (int r = 0; r < w->e->n; r++) {
        if (r == w->victim || !w->e->nd[r].ar) continue;
        uint32_t g, t;
        ap__allreduce_sender_progress(w->e->nd[r].ar, w->victim, &g, &t);
        got += g;
        total += t;
    }
    return got > 0 && got < total / 2;
}

typedef struct outcome {
    double err;           /* |result - honest mean| at an honest peer */
    uint32_t clipped_min; /* fewest inputs clipped on a reducer */
    uint32_t reduced_min; /* fewest inputs aggregated on a reducer */
    bool agree;           /* every honest peer holds the same vector */
    double mean_err;      /* the plain mean's distance from the honest mean */
} outcome_t;

static outcome_t run(int nbad, double poison, double tau, bool robust, int crash, uint64_t seed)
{
    avg_env_t e;
    avg_env_init(&e, N, ELEMS, seed);
    bool bad[N] = {0};
    for (int i = 0; i < nbad; i++) bad[N - 1 - i] = true;
    fill(&e, bad, poison);
    int idx[N];
    for (int i = 0; i < N; i++) {
        idx[i] = i;
        e.nd[i].role = AP_AVG_NORMAL;
        avg_set_bw(&e, i, 12.5e6, 12.5e6); /* 100 Mbit/s */
    }
    ap_btard_bclip_t bc[N];
    for (int i = 0; i < N; i++) {
        bc[i] = (ap_btard_bclip_t){.cfg = ap_btard_clip_cfg_default()};
        bc[i].cfg.tau = tau;
        bc[i].ws = ap_btard_clip_ws_new();
        assert_non_null(bc[i].ws);
    }
    uint8_t gid[32];
    memset(gid, 0x5c, sizeof gid);
    /* one opts per node: each has its own reducer state */
    ap_avg_member_t mem[N];
    for (int k = 0; k < N; k++)
        mem[k] = (ap_avg_member_t){*avg_peer_id(&e, k), k == crash ? AP_AVG_CLIENT : AP_AVG_NORMAL,
                                   e.up[k], e.down[k]};
    ap_avg_group_t g = {.members = mem, .n = N};
    memcpy(g.id, gid, 32);
    for (int k = 0; k < N; k++) {
        ap_allreduce_opts_t o = {.chunk_elems = CHUNK};
        if (robust) {
            o.reduce = ap_btard_butterfly_clip;
            o.reduce_arg = &bc[k];
        }
        avg_node_t *d = &e.nd[k];
        d->in_round = true;
        assert_ok(ap_allreduce_start(d->svc, &g, d->data, ELEMS, 1.0, &o, avg_on_done, d, &d->ar));
    }
    if (crash >= 0) {
        /* a client (sends, reduces nothing): dies with some of its chunks out */
        crash_watch_t cw = {&e, crash};
        assert_true(avg_run_until(&e, crash_point, &cw, 600000000ull));
        avg_crash(&e, crash);
    }
    assert_true(avg_run_until(&e, avg_all_done, &e, 600000000ull));

    bool honest[N];
    for (int i = 0; i < N; i++) honest[i] = !bad[i] && i != crash;
    double *hm = malloc(ELEMS * sizeof *hm), *all = malloc(ELEMS * sizeof *all);
    avg_reference(&e, idx, N, honest, hm);
    avg_reference(&e, idx, N, NULL, all);
    outcome_t out = {.clipped_min = UINT32_MAX, .reduced_min = UINT32_MAX, .agree = true};
    float *allf = malloc(ELEMS * sizeof *allf);
    for (uint64_t k = 0; k < ELEMS; k++) allf[k] = (float)all[k];
    out.mean_err = dist(allf, hm, ELEMS);
    int first = -1;
    for (int i = 0; i < N; i++) {
        if (i == crash) continue;
        avg_node_t *d = &e.nd[i];
        assert_true(d->done);
        assert_int_equal(d->res.status, 0);
        if (robust && d->res.my_part_elems) {
            if (d->res.inputs_clipped < out.clipped_min) out.clipped_min = d->res.inputs_clipped;
            if (d->res.inputs_reduced < out.reduced_min) out.reduced_min = d->res.inputs_reduced;
        }
        if (!honest[i]) continue;
        if (first < 0) {
            first = i;
            out.err = dist(d->data, hm, ELEMS);
            if (crash < 0) assert_true(d->res.averaged_fraction == 1.0);
        } else if (memcmp(d->data, e.nd[first].data, ELEMS * sizeof(float)) != 0) {
            out.agree = false;
        }
    }
    if (getenv("AVG_VERBOSE"))
        printf("bad %d tau %g robust %d crash %d: err %.4g (plain mean %.4g) clipped>=%u "
               "inputs>=%u\n",
               nbad, tau, robust, crash, out.err, out.mean_err, out.clipped_min, out.reduced_min);
    for (int i = 0; i < N; i++) ap_btard_clip_ws_free(bc[i].ws);
    free(hm);
    free(all);
    free(allf);
    avg_env_free(&e);
    return out;
}

/* One poisoner of 8, tau above the honest spread of a part: every reducer
 * clips it; |v - honest mean| per part <= b tau / (n - b), so over the
 * P = 8 parts <= sqrt(P) b tau / (n - b). The plain mean is 1000/8 per
 * element off. */
static void test_poisoned_part_clipped(void **state)
{
    (void)state;
    const double tau = 40;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        outcome_t r = run(1, 1000, tau, true, -1, seed);
        outcome_t m = run(1, 1000, tau, false, -1, seed);
        double bound = 1.01 * sqrt(8.0) * 1 * tau / (N - 1); /* tight: honest within tau */
        assert_true(r.agree);
        assert_true(m.agree);
        assert_int_equal(r.reduced_min, N);
        assert_true(r.clipped_min >= 1);
        if (!(r.err <= bound))
            fail_msg("seed %llu: err %g > bound %g", (unsigned long long)seed, r.err, bound);
        /* the same run with the plain mean is far off: the test can fail */
        assert_true(m.err > 100 * bound);
        assert_true(fabs(m.err - m.mean_err) < 1e-3 * m.mean_err);
    }
}

/* Three poisoners of 8 pulling the same way: still bounded by 3 tau / 5
 * per part. */
static void test_three_poisoners(void **state)
{
    (void)state;
    const double tau = 40;
    outcome_t r = run(3, -5000, tau, true, -1, 7);
    assert_true(r.agree);
    assert_true(r.clipped_min >= 3);
    double bound = 1.01 * sqrt(8.0) * 3 * tau / (N - 3);
    if (!(r.err <= bound)) fail_msg("err %g > bound %g", r.err, bound);
}

/* tau = INFINITY clips nothing: the weighted mean of all copies. */
static void test_no_clip_is_mean(void **state)
{
    (void)state;
    outcome_t r = run(1, 1000, INFINITY, true, -1, 4);
    assert_true(r.agree);
    assert_int_equal(r.clipped_min, 0);
    /* the distance to the honest mean is the plain mean's */
    assert_true(fabs(r.err - r.mean_err) < 1e-3 * r.mean_err);
}

/* A sender that dies mid-round is left out of every part (the stall and
 * connection rules still apply while results wait for the whole part); the
 * round ends and the honest survivors agree. */
static void test_dead_sender(void **state)
{
    (void)state;
    outcome_t r = run(1, 1000, 40, true, 2, 5);
    assert_true(r.agree);
    assert_int_equal(r.reduced_min, N - 1);
    double bound = 1.01 * sqrt(8.0) * 1 * 40 / (N - 2);
    if (!(r.err <= bound)) fail_msg("err %g > bound %g", r.err, bound);
}

int main(void)
{
    ap_log_set_level(AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_poisoned_part_clipped),
        cmocka_unit_test(test_three_poisoners),
        cmocka_unit_test(test_no_clip_is_mean),
        cmocka_unit_test(test_dead_sender),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
