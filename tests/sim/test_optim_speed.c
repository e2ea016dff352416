/* A peer whose submits come in bursts (one large batch, then small ones)
 * has a moving-average speed far below its mean rate over the epoch; its
 * progress records must still pass the readers' plausibility check
 * (samples <= 2·speed·(epoch time + 1 s) + 1): the other peer counts it and
 * neither refuses its records as impossible progress. */
#include "optim_harness.h"

#define B 8

typedef struct flag {
    bool done;
    int status;
} flag_t;

static void submitted(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    flag_t *f = arg;
    f->done = true;
    f->status = status;
}

static bool is_done(void *arg)
{
    return ((flag_t *)arg)->done;
}

static bool both_started(void *arg)
{
    oh_env_t *e = arg;
    return e->p[0].started && e->p[1].started;
}

static void submit(oh_env_t *e, int i, uint32_t samples)
{
    flag_t f = {0};
    ap_nn_params_t *pr = ap_nn_model_params(e->p[i].model);
    for (size_t k = 0; k < pr->count; k++) pr->grad[k] = 0.01f;
    assert_ok(ap_collab_submit(e->p[i].collab, pr->grad, samples, 1.0f, submitted, &f));
    assert_true(ap_sim_run_until(e->sim, is_done, &f, ap_sim_now_us(e->sim) + 30000000));
    assert_ok(f.status);
}

static void test_burst_records_accepted(void **state)
{
    (void)state;
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "speed";
    cfg.target_batch_size = 1u << 30; /* the epoch never ends here */
    cfg.solver = ap_nn_solver_defaults(AP_NN_SGD);
    cfg.average_state_every = 0;
    cfg.model_desc = "mlp 16-32-4";
    oh_env_init(&e, 2, ap_test_seed(61), &cfg, B, NULL, NULL);
    oh_peer_up(&e, 0, -1);
    oh_peer_up(&e, 1, 0);
    ap_sim_run_for(e.sim, 500000);
    /* no trainers: peer 1's submits are made here, peer 0 only watches */
    e.p[0].stop = e.p[1].stop = true;
    oh_peer_start(&e, 0);
    oh_peer_start(&e, 1);
    assert_true(ap_sim_run_until(e.sim, both_started, &e, ap_sim_now_us(e.sim) + 30000000));
    ap_sim_run_for(e.sim, 1000000);
    submit(&e, 1, 1000); /* ~1000 samples/s */
    for (int k = 0; k < 12; k++) {
        ap_sim_run_for(e.sim, 100000);
        submit(&e, 1, 1); /* ~10 samples/s: the average falls by 0.7 per submit */
    }
    ap_sim_run_for(e.sim, 12000000); /* reports and reads of the view (every 10 s at most) */
    ap_collab_stats_t s0, s1;
    ap_collab_get_stats(e.p[0].collab, &s0);
    ap_collab_get_stats(e.p[1].collab, &s1);
    print_message("watcher: %u peers, %llu records refused; bursty peer: %llu samples, "
                  "%llu records refused\n",
                  s0.peers, (unsigned long long)s0.records_refused,
                  (unsigned long long)s1.local_samples, (unsigned long long)s1.records_refused);
    assert_int_equal(s1.local_samples, 1012);
    assert_int_equal(s0.records_refused, 0);
    assert_int_equal(s1.records_refused, 0); /* its own record, read back */
    assert_int_equal(s0.peers, 2);
    assert_true(s0.global_samples >= 1000.0); /* the watcher counts the bursty peer's samples */
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_burst_records_accepted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
