/* MASHA on the paper's bilinear problem: z* solves F(z*) = 0; extragradient,
 * MASHA1 and MASHA2 converge linearly; MASHA1 rand-k 2% needs at most half
 * the uploaded floats of extragradient at h = 0.1; byte counters equal the
 * analytic count; the server refuses malformed or duplicate requests. */
#include "aptest.h"

#include "apiary/masha.h"
#include "compress/masha_core.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static ap_masha_problem_t *make(double h)
{
    ap_masha_bilinear_cfg_t pc = {.n = 50, .workers = 10, .lambda = 0.05, .h = h, .seed = 2021};
    ap_masha_problem_t *p = ap_masha_bilinear_new(&pc);
    assert_non_null(p);
    return p;
}

static void test_solution(void **state)
{
    (void)state;
    ap_masha_problem_t *p = make(1.0);
    size_t d = ap_masha_dim(p);
    assert_int_equal(d, 100);
    double *F = calloc(d, sizeof *F), *Fm = calloc(d, sizeof *Fm);
    for (int m = 0; m < ap_masha_workers(p); m++) {
        ap_masha_operator(p, m, ap_masha_solution(p), Fm);
        for (size_t i = 0; i < d; i++) F[i] += Fm[i] / ap_masha_workers(p);
    }
    double r = 0, zs = 0;
    for (size_t i = 0; i < d; i++) {
        r += F[i] * F[i];
        zs += ap_masha_solution(p)[i] * ap_masha_solution(p)[i];
    }
    assert_true(sqrt(r) < 1e-9);
    assert_true(zs > 1); /* non-trivial solution */
    /* operator is strongly monotone with modulus lambda: <F(z)-F(z*), z-z*> = lambda |z-z*|^2 */
    double *z = calloc(d, sizeof *z);
    for (size_t i = 0; i < d; i++) z[i] = sin((double)i);
    memset(F, 0, d * sizeof *F);
    for (int m = 0; m < ap_masha_workers(p); m++) {
        ap_masha_operator(p, m, z, Fm);
        for (size_t i = 0; i < d; i++) F[i] += Fm[i] / ap_masha_workers(p);
    }
    double ip = 0, dz = 0;
    for (size_t i = 0; i < d; i++) {
        double e = z[i] - ap_masha_solution(p)[i];
        ip += F[i] * e;
        dz += e * e;
    }
    assert_true(fabs(ip - 0.05 * dz) < 1e-9 * dz);
    free(z);
    free(F);
    free(Fm);
    ap_masha_problem_free(p);
}

typedef struct rates {
    double rel[200001];
    uint64_t last;
} rates_t;

static void rec(void *arg, uint64_t it, uint64_t f, uint64_t b, double rel2)
{
    (void)f;
    (void)b;
    rates_t *r = arg;
    if (it <= 200000) r->rel[it] = rel2;
    r->last = it;
}

/* Linear convergence: reaches 1e-6 and log(rel) falls at a steady rate: the
 * distance at a quarter, half and three quarters of the run is within a
 * factor 30 of the geometric interpolation. */
static void check_linear(const ap_masha_problem_t *p, const ap_masha_opts_t *o0,
                         ap_masha_result_t *out)
{
    static rates_t tr;
    memset(&tr, 0, sizeof tr);
    ap_masha_opts_t o = *o0;
    o.trace = rec;
    o.trace_arg = &tr;
    ap_masha_result_t r;
    assert_ok(ap_masha_run(p, &o, &r));
    assert_true(r.converged);
    assert_true(r.rel_dist2 <= 1e-6);
    assert_int_equal(tr.last, r.iters);
    for (int q = 1; q <= 3; q++) {
        uint64_t t = r.iters * (uint64_t)q / 4;
        double expect = pow(1e-6, (double)q / 4);
        assert_true(tr.rel[t] < 30 * expect);
        assert_true(tr.rel[t] > expect / 30);
    }
    /* analytic byte count */
    assert_int_equal(r.bytes_up, ap_masha_upload_bytes(p, &o, r.iters, r.refreshes));
    *out = r;
}

static void test_convergence_and_target(void **state)
{
    (void)state;
    for (int hi = 0; hi < 2; hi++) {
        ap_masha_problem_t *p = make(hi ? 1.0 : 0.1);
        ap_masha_result_t eg, m1, m2;
        ap_masha_opts_t o = {.method = AP_MASHA_EXTRAGRADIENT,
                             .gamma = 1.8,
                             .seed = 77,
                             .target = 1e-6,
                             .max_iters = 100000};
        check_linear(p, &o, &eg);
        assert_int_equal(eg.floats_up, eg.iters * 200);
        /* MASHA2 (top-k 2%, error feedback) converges linearly at both h */
        o = (ap_masha_opts_t){.method = AP_MASHA_2,
                              .gamma = 0.09,
                              .fraction = 0.02,
                              .seed = 77,
                              .target = 1e-6,
                              .max_iters = 100000};
        check_linear(p, &o, &m2);
        assert_true(m2.refreshes > 0);
        if (hi == 0) {
            /* MASHA1 rand-k 2%: at most half the floats of extragradient */
            o = (ap_masha_opts_t){.method = AP_MASHA_1,
                                  .gamma = 0.177,
                                  .fraction = 0.02,
                                  .seed = 77,
                                  .target = 1e-6,
                                  .max_iters = 100000};
            check_linear(p, &o, &m1);
            print_message("h=0.1: extragradient %llu floats, MASHA1 rand-k 2%% %llu (ratio %.3f)\n",
                          (unsigned long long)eg.floats_up, (unsigned long long)m1.floats_up,
                          (double)m1.floats_up / eg.floats_up);
            assert_true(m1.floats_up <= eg.floats_up / 2);
        }
        ap_masha_problem_free(p);
    }
}

static void test_server_compression(void **state)
{
    (void)state;
    ap_masha_problem_t *p = make(0.1);
    /* bidirectional compression: MASHA1 with rand-k at the server too, and
     * MASHA2 with top-k + server error feedback; both still converge */
    ap_masha_opts_t o = {.method = AP_MASHA_1,
                         .gamma = 0.1,
                         .fraction = 0.1,
                         .server_fraction = 0.5,
                         .seed = 3,
                         .target = 1e-6,
                         .max_iters = 200000};
    ap_masha_result_t r;
    assert_ok(ap_masha_run(p, &o, &r));
    assert_true(r.converged);
    ap_masha_opts_t o2 = {.method = AP_MASHA_2,
                          .gamma = 0.2,
                          .fraction = 0.1,
                          .server_fraction = 0.5,
                          .seed = 3,
                          .target = 1e-6,
                          .max_iters = 200000};
    ap_masha_result_t r2;
    assert_ok(ap_masha_run(p, &o2, &r2));
    assert_true(r2.converged);
    /* replies are compressed: fewer download bytes per iteration than dense */
    ap_masha_opts_t o3 = o2;
    o3.server_fraction = 0;
    ap_masha_result_t r3;
    assert_ok(ap_masha_run(p, &o3, &r3));
    assert_true((double)r2.bytes_down / r2.iters < (double)r3.bytes_down / r3.iters);
    ap_masha_problem_free(p);
}

static void test_server_rejects(void **state)
{
    (void)state;
    ap_masha_problem_t *p = make(0.1);
    ap_masha_opts_t o = {.method = AP_MASHA_1,
                         .gamma = 0.1,
                         .fraction = 0.1,
                         .seed = 3,
                         .target = 1e-6,
                         .max_iters = 10};
    ap__masha_server_t *s = ap__masha_server_new(ap_masha_dim(p), 10, &o);
    ap__masha_worker_t *w0 = ap__masha_worker_new(p, &o, 0), *w1 = ap__masha_worker_new(p, &o, 1);
    assert_ok(ap__masha_worker_start(w0));
    assert_ok(ap__masha_worker_start(w1));
    size_t l0, l1;
    const uint8_t *m0 = ap__masha_worker_msg(w0, &l0), *m1 = ap__masha_worker_msg(w1, &l1);
    assert_int_equal(ap__masha_server_add(s, m0, l0), 0);
    assert_int_equal(ap__masha_server_add(s, m0, l0), AP_EPROTO); /* duplicate */
    uint8_t bad[1024];
    assert_true(l1 <= sizeof bad);
    memcpy(bad, m1, l1);
    bad[1] = 2; /* other phase */
    assert_int_equal(ap__masha_server_add(s, bad, l1), AP_EPROTO);
    memcpy(bad, m1, l1);
    bad[2] = 99; /* worker index out of range */
    assert_int_equal(ap__masha_server_add(s, bad, l1), AP_EPROTO);
    for (size_t cut = 0; cut < l1; cut += 7) assert_true(ap__masha_server_add(s, m1, cut) < 0);
    assert_int_equal(ap__masha_server_add(s, m1, l1), 0);
    /* worker rejects a reply for another phase/iteration */
    bool done;
    uint8_t rep[16] = {1, 9, 0, 0, 0, 0, 0, 0};
    assert_int_equal(ap__masha_worker_on_reply(w0, rep, sizeof rep, &done), AP_EPROTO);
    ap__masha_worker_free(w0);
    ap__masha_worker_free(w1);
    ap__masha_server_free(s);
    ap_masha_problem_free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_solution),
        cmocka_unit_test(test_convergence_and_target),
        cmocka_unit_test(test_server_compression),
        cmocka_unit_test(test_server_rejects),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
