/* Bandwidth-aware parts on simulated links: with 10x bandwidth differences
 * the parts follow the LP and the round time is near the LP's lower bound,
 * and clearly shorter than with equal parts on the same links. Virtual time:
 * deterministic, not a wall-clock timing assertion. */
#include "avg_harness.h"

typedef struct outcome {
    double round_s, bound_s;
} outcome_t;

/* Runs one round on links up/down (bytes/s); declared bandwidths decl_* (what
 * the LP sees). Returns the slowest peer's round time and the LP bound of the
 * true links. */
static outcome_t run(int n, const ap_avg_role_t *roles, const double *up, const double *down,
                     const double *decl_up, const double *decl_down, uint64_t elems, uint64_t seed)
{
    avg_env_t e;
    avg_env_init(&e, n, elems, seed);
    int idx[16];
    for (int i = 0; i < n; i++) {
        idx[i] = i;
        e.nd[i].role = roles[i];
        avg_set_bw(&e, i, up[i], down[i]);
    }
    uint8_t gid[32] = {1, 2, 3};
    ap_allreduce_opts_t o = {.chunk_elems = (uint32_t)(elems / 64)}; /* tail = 1/64 part */
    avg_start(&e, idx, n, gid, decl_up, decl_down, &o);
    assert_true(avg_run_until(&e, avg_all_done, &e, 3600000000ull));
    outcome_t r = {0, 0};
    ap_avg_bw_t bw[16];
    double sh[16], t;
    for (int i = 0; i < n; i++) bw[i] = (ap_avg_bw_t){roles[i], up[i], down[i]};
    assert_ok(ap_avg_balance(bw, (size_t)n, NULL, sh, &t));
    r.bound_s = t * (double)elems * 4;
    for (int i = 0; i < n; i++) {
        assert_int_equal(e.nd[i].res.status, 0);
        assert_true(e.nd[i].res.averaged_fraction == 1.0);
        double s = (double)e.nd[i].res.elapsed_us / 1e6;
        if (s > r.round_s) r.round_s = s;
    }
    avg_env_free(&e);
    return r;
}

static void test_equal_links(void **state)
{
    (void)state;
    const ap_avg_role_t roles[4] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL};
    const double b[4] = {12.5e6, 12.5e6, 12.5e6, 12.5e6}; /* 100 Mbit/s */
    uint64_t elems = ap_test_sanitized() ? 1u << 18 : 1u << 20;
    outcome_t r = run(4, roles, b, b, b, b, elems, ap_test_seed(91));
    printf("equal links: round %.3f s, bound %.3f s, ratio %.3f\n", r.round_s, r.bound_s,
           r.round_s / r.bound_s);
    assert_true(r.round_s >= r.bound_s * 0.999); /* nothing beats the bound */
    assert_true(r.round_s <= r.bound_s * 1.1);
}

static void test_hetero_links(void **state)
{
    (void)state;
    /* 1000/100/100/20 Mbit/s and a client-only peer on 100 Mbit/s */
    const ap_avg_role_t roles[5] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL,
                                    AP_AVG_CLIENT};
    const double b[5] = {125e6, 12.5e6, 12.5e6, 2.5e6, 12.5e6};
    const double same[5] = {12.5e6, 12.5e6, 12.5e6, 12.5e6, 12.5e6};
    uint64_t elems = ap_test_sanitized() ? 1u << 17 : 1u << 19;
    outcome_t bal = run(5, roles, b, b, b, b, elems, ap_test_seed(92));
    outcome_t eq = run(5, roles, b, b, same, same, elems, ap_test_seed(92));
    printf("hetero links: balanced %.3f s, bound %.3f s, ratio %.3f; equal parts %.3f s, "
           "speedup %.2f\n",
           bal.round_s, bal.bound_s, bal.round_s / bal.bound_s, eq.round_s,
           eq.round_s / bal.round_s);
    assert_true(bal.round_s >= bal.bound_s * 0.999);
    assert_true(bal.round_s <= bal.bound_s * 1.15);
    assert_true(eq.round_s / bal.round_s >= 1.5);
}

/* Asymmetric links (home uplinks): up = down / 10 for two peers. */
static void test_asymmetric_links(void **state)
{
    (void)state;
    const ap_avg_role_t roles[4] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_AUX};
    const double up[4] = {12.5e6, 1.25e6, 1.25e6, 25e6};
    const double down[4] = {12.5e6, 12.5e6, 12.5e6, 25e6};
    uint64_t elems = ap_test_sanitized() ? 1u << 16 : 1u << 18;
    outcome_t r = run(4, roles, up, down, up, down, elems, ap_test_seed(93));
    printf("asymmetric links: round %.3f s, bound %.3f s, ratio %.3f\n", r.round_s, r.bound_s,
           r.round_s / r.bound_s);
    assert_true(r.round_s >= r.bound_s * 0.999);
    assert_true(r.round_s <= r.bound_s * 1.15);
}

int main(void)
{
    ap_log_set_level(AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equal_links),
        cmocka_unit_test(test_hetero_links),
        cmocka_unit_test(test_asymmetric_links),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
