/* The stage servers' plain SGD step: global-norm clipping, and a non-finite
 * gradient refused without touching the parameters. */
#include "aptest.h"

#include "apiary/swarm.h"

#include <math.h>
#include <string.h>

#define N 5

static void fill(ap_nn_params_t *p, float *data, float *grad, const float *g)
{
    for (int k = 0; k < N; k++) {
        data[k] = 1.0f + (float)k;
        grad[k] = g[k];
    }
    *p = (ap_nn_params_t){.data = data, .grad = grad, .count = N};
}

static void test_unclipped(void **state)
{
    (void)state;
    float data[N], grad[N];
    const float g[N] = {0.1f, -0.2f, 0.0f, 0.3f, 0.1f}; /* norm 0.387 < 1 */
    ap_nn_params_t p;
    fill(&p, data, grad, g);
    double norm = -1;
    assert_ok(ap_swarm_sgd_step(&p, 0.5f, 1.0f, &norm));
    assert_true(fabs(norm - sqrt(0.15)) < 1e-6);
    for (int k = 0; k < N; k++) {
        assert_true(fabsf(data[k] - (1.0f + (float)k - 0.5f * g[k])) < 1e-6f);
        assert_true(grad[k] == 0.0f);
    }
}

static void test_clipped(void **state)
{
    (void)state;
    float data[N], grad[N];
    const float g[N] = {30.0f, 0.0f, -40.0f, 0.0f, 0.0f}; /* norm 50 */
    ap_nn_params_t p;
    fill(&p, data, grad, g);
    double norm = 0;
    assert_ok(ap_swarm_sgd_step(&p, 0.1f, 2.0f, &norm));
    assert_true(fabs(norm - 50.0) < 1e-9);
    /* the applied gradient has norm 2: (1.2, 0, -1.6, 0, 0) */
    assert_true(fabsf(data[0] - (1.0f - 0.1f * 1.2f)) < 1e-6f);
    assert_true(fabsf(data[1] - 2.0f) < 1e-6f);
    assert_true(fabsf(data[2] - (3.0f + 0.1f * 1.6f)) < 1e-6f);
    /* clip 0: no clipping */
    fill(&p, data, grad, g);
    assert_ok(ap_swarm_sgd_step(&p, 0.1f, 0.0f, NULL));
    assert_true(fabsf(data[0] - (1.0f - 3.0f)) < 1e-5f);
    assert_true(fabsf(data[2] - (3.0f + 4.0f)) < 1e-5f);
}

static void test_nonfinite(void **state)
{
    (void)state;
    float data[N], grad[N];
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int b = 0; b < 3; b++) {
        const float g[N] = {0.1f, bad[b], 0.2f, 0.0f, 0.0f};
        ap_nn_params_t p;
        fill(&p, data, grad, g);
        assert_int_equal(ap_swarm_sgd_step(&p, 0.1f, 1.0f, NULL), AP_EINVAL);
        for (int k = 0; k < N; k++) {
            assert_true(data[k] == 1.0f + (float)k); /* not applied */
            assert_true(grad[k] == 0.0f);            /* and dropped */
        }
    }
    /* finite values whose squared sum overflows a float still clip */
    const float big[N] = {3e38f, 3e38f, 0, 0, 0};
    ap_nn_params_t p;
    fill(&p, data, grad, big);
    assert_ok(ap_swarm_sgd_step(&p, 1.0f, 1.0f, NULL));
    for (int k = 0; k < N; k++) assert_true(isfinite(data[k]));
    assert_true(fabsf(data[0] - (1.0f - (float)M_SQRT1_2)) < 1e-5f);
    /* bad arguments */
    fill(&p, data, grad, big);
    assert_int_equal(ap_swarm_sgd_step(&p, NAN, 1.0f, NULL), AP_EINVAL);
    assert_int_equal(ap_swarm_sgd_step(&p, 0.1f, -1.0f, NULL), AP_EINVAL);
    assert_int_equal(ap_swarm_sgd_step(NULL, 0.1f, 1.0f, NULL), AP_EINVAL);
    assert_true(data[0] == 1.0f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unclipped),
        cmocka_unit_test(test_clipped),
        cmocka_unit_test(test_nonfinite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
