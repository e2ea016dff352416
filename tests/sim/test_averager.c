/* The Averager: owned tensors averaged in place by async steps (stage,
 * callback, cancel), the blocking form from a user thread, and the measured
 * bandwidth estimate. */
#include "avg_harness.h"
#include "apiary/averager.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define NT 3
static const size_t sizes[NT] = {5, 1000, 37};

typedef struct fixture {
    avg_env_t e;
    ap_averager_t *av[4];
    ap_averager_step_t *st[4];
    int cb_calls[4];
    float *orig[4];
    double w[4];
} fixture_t;

static void fx_init(fixture_t *f, const ap_avg_role_t *roles, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    avg_env_init(&f->e, 4, 1, seed);
    for (int i = 0; i < 4; i++) {
        ap_averager_opts_t o = {.role = roles[i], .round = {.chunk_elems = 64}};
        assert_ok(ap_averager_new(f->e.nd[i].svc, sizes, NT, &o, &f->av[i]));
        size_t total = 0;
        for (int t = 0; t < NT; t++) total += sizes[t];
        f->orig[i] = malloc(total * sizeof(float));
        size_t at = 0;
        for (size_t t = 0; t < NT; t++) {
            size_t n;
            float *x = ap_averager_tensor(f->av[i], t, &n);
            assert_int_equal(n, sizes[t]);
            for (size_t k = 0; k < n; k++)
                f->orig[i][at++] = x[k] = (float)(avg_rnd01(&f->e) - 0.5);
        }
        f->w[i] = 1 + (double)i;
    }
    assert_null(ap_averager_tensor(f->av[0], NT, NULL));
}

static void fx_free(fixture_t *f)
{
    for (int i = 0; i < 4; i++) {
        assert_ok(ap_averager_free(f->av[i]));
        free(f->orig[i]);
    }
    avg_env_free(&f->e);
}

static void group_of(fixture_t *f, ap_avg_member_t *mem, ap_avg_group_t *g, uint8_t tag)
{
    for (int i = 0; i < 4; i++) ap_averager_member(f->av[i], &mem[i]);
    g->members = mem;
    g->n = 4;
    memset(g->id, tag, sizeof g->id);
}

static void check_mean(fixture_t *f, const ap_avg_role_t *roles)
{
    size_t at = 0;
    for (size_t t = 0; t < NT; t++) {
        for (size_t k = 0; k < sizes[t]; k++, at++) {
            double s = 0, w = 0;
            for (int j = 0; j < 4; j++)
                if (roles[j] != AP_AVG_AUX) {
                    s += f->w[j] * f->orig[j][at];
                    w += f->w[j];
                }
            for (int i = 0; i < 4; i++) {
                if (roles[i] == AP_AVG_AUX) continue;
                float got = ap_averager_tensor(f->av[i], t, NULL)[k];
                if (!close_rel(got, s / w, 1e-6))
                    fail_msg("peer %d tensor %zu elem %zu: %g want %g", i, t, k, got, s / w);
            }
        }
    }
}

static void on_step(ap_rt_t *rt, void *arg, ap_averager_step_t *st)
{
    (void)rt;
    (void)st;
    (*(int *)arg)++;
}

static bool steps_over(void *arg)
{
    fixture_t *f = arg;
    for (int i = 0; i < 4; i++)
        if (f->st[i] && ap_averager_step_stage(f->st[i]) == AP_AVERAGER_STAGE_RUNNING) return false;
    return true;
}

static void test_async_steps(void **state)
{
    (void)state;
    const ap_avg_role_t roles[4] = {AP_AVG_NORMAL, AP_AVG_CLIENT, AP_AVG_NORMAL, AP_AVG_AUX};
    fixture_t f;
    fx_init(&f, roles, ap_test_seed(101));
    double up0, down0;
    ap_averager_bandwidth(f.av[0], &up0, &down0);
    ap_avg_member_t mem[4];
    ap_avg_group_t g;
    group_of(&f, mem, &g, 0x11);
    for (int i = 0; i < 4; i++) {
        assert_ok(
            ap_averager_step_group(f.av[i], &g, f.w[i], 0, on_step, &f.cb_calls[i], &f.st[i]));
        assert_int_equal(ap_averager_step_stage(f.st[i]), AP_AVERAGER_STAGE_RUNNING);
        assert_null(ap_averager_step_result(f.st[i]));
        ap_averager_step_t *other;
        assert_int_equal(ap_averager_step_group(f.av[i], &g, 1, 0, NULL, NULL, &other), AP_EBUSY);
        assert_int_equal(ap_averager_free(f.av[i]), AP_EBUSY);
    }
    assert_true(avg_run_until(&f.e, steps_over, &f, 60000000ull));
    for (int i = 0; i < 4; i++) {
        assert_int_equal(ap_averager_step_stage(f.st[i]), AP_AVERAGER_STAGE_DONE);
        assert_int_equal(f.cb_calls[i], 1);
        assert_true(ap_averager_step_result(f.st[i])->averaged_fraction == 1.0);
        ap_averager_step_free(f.st[i]);
        f.st[i] = NULL;
    }
    check_mean(&f, roles);
    /* declared bandwidth follows what the round measured */
    double up1, down1;
    ap_averager_bandwidth(f.av[0], &up1, &down1);
    assert_true(up1 != up0 && down1 != down0);
    fx_free(&f);
}

static void test_cancel_step(void **state)
{
    (void)state;
    const ap_avg_role_t roles[4] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL};
    fixture_t f;
    fx_init(&f, roles, ap_test_seed(102));
    for (int i = 0; i < 4; i++) avg_set_bw(&f.e, i, 1e4, 1e4); /* slow: cancel mid-round */
    ap_avg_member_t mem[4];
    ap_avg_group_t g;
    group_of(&f, mem, &g, 0x22);
    for (int i = 0; i < 4; i++)
        assert_ok(
            ap_averager_step_group(f.av[i], &g, f.w[i], 0, on_step, &f.cb_calls[i], &f.st[i]));
    avg_run_for(&f.e, 5000);
    ap_averager_step_cancel(f.st[0]);
    ap_averager_step_free(f.st[3]); /* freed while running: canceled, freed at its end */
    f.st[3] = NULL;
    assert_true(avg_run_until(&f.e, steps_over, &f, 600000000ull));
    avg_run_for(&f.e, 1000000);
    assert_int_equal(ap_averager_step_stage(f.st[0]), AP_AVERAGER_STAGE_FAILED);
    assert_int_equal(ap_averager_step_result(f.st[0])->status, AP_ECANCELED);
    assert_int_equal(f.cb_calls[0], 1);
    assert_int_equal(f.cb_calls[3], 0); /* freed: no callback */
    for (int i = 1; i < 3; i++) {
        assert_int_equal(ap_averager_step_stage(f.st[i]), AP_AVERAGER_STAGE_DONE);
        assert_true(ap_averager_step_result(f.st[i])->averaged_fraction < 1.0);
    }
    for (int i = 0; i < 3; i++) ap_averager_step_free(f.st[i]);
    fx_free(&f);
}

/* ---- the blocking form from a user thread --------------------------------------- */

typedef struct user {
    fixture_t *f;
    ap_avg_group_t g;
    int rc;
    ap_allreduce_result_t res;
    atomic_int finished;
} user_t;

static void *user_thread(void *arg)
{
    user_t *u = arg;
    u->rc = ap_averager_step_group_wait(u->f->av[3], &u->g, u->f->w[3], 0, &u->res);
    atomic_store(&u->finished, 1);
    return NULL;
}

static void test_blocking_form(void **state)
{
    (void)state;
    const ap_avg_role_t roles[4] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL};
    fixture_t f;
    fx_init(&f, roles, ap_test_seed(103));
    ap_avg_member_t mem[4];
    user_t u = {.f = &f};
    group_of(&f, mem, &u.g, 0x33);
    for (int i = 0; i < 3; i++)
        assert_ok(ap_averager_step_group(f.av[i], &u.g, f.w[i], 0, NULL, NULL, &f.st[i]));
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, user_thread, &u), 0);
    /* this thread is the loop thread. Virtual time must not run ahead of the
     * user thread: hold it until the step was posted, then run to the end */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (!ap_averager_running(f.av[3])) {
        avg_run_for(&f.e, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (t1.tv_sec - t0.tv_sec > 60) fail_msg("blocking step never posted");
    }
    for (;;) {
        avg_run_for(&f.e, 1000);
        if (atomic_load(&u.finished) && steps_over(&f)) break;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (t1.tv_sec - t0.tv_sec > 60) fail_msg("blocking step never returned");
    }
    pthread_join(th, NULL);
    assert_int_equal(u.rc, 0);
    assert_true(u.res.averaged_fraction == 1.0);
    for (int i = 0; i < 3; i++) ap_averager_step_free(f.st[i]);
    check_mean(&f, roles);
    fx_free(&f);
}

int main(void)
{
    ap_log_set_level(AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_async_steps),
        cmocka_unit_test(test_cancel_step),
        cmocka_unit_test(test_blocking_form),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
