/* Peers must agree on the run's configuration: a peer whose configuration
 * differs (here: the gradient codec, then the target batch size) is refused
 * by the running peers before any round, with the field and both values
 * named, and stops itself (start fails with AP_ECONFIG); the others train
 * on in complete groups without it. */
#include "optim_harness.h"

#define B 16

static void base_cfg(ap_collab_config_t *cfg)
{
    ap_collab_config_default(cfg);
    cfg->run_id = "agree";
    cfg->target_batch_size = 2 * B;
    cfg->solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg->lr.base = cfg->lr.min = 1e-2f;
    cfg->average_state_every = 0;
    cfg->averaging_timeout_us = 5000000;
    cfg->model_desc = "mlp 16-32-4";
}

static bool started2(void *arg)
{
    return ((oh_env_t *)arg)->p[2].started;
}

static void odd_peer(uint64_t seed, void (*change)(ap_collab_config_t *), const char *want)
{
    oh_env_t e;
    ap_collab_config_t cfg;
    base_cfg(&cfg);
    oh_env_init(&e, 3, seed, &cfg, B, NULL, NULL);
    oh_peer_up(&e, 0, -1);
    oh_peer_up(&e, 1, 0);
    assert_ok(ap_sim_crash(e.sim, 2));
    ap_sim_run_for(e.sim, 500000);
    oh_peer_start(&e, 0);
    oh_peer_start(&e, 1);
    oh_epoch_pred_t q = {&e, 2, 2};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 60000000));
    /* the odd one joins the running pair */
    change(&e.cfg);
    assert_ok(ap_sim_restart(e.sim, 2)); /* the restart hook builds and starts it */
    assert_true(ap_sim_run_until(e.sim, started2, &e, ap_sim_now_us(e.sim) + 30000000));
    e.cfg = cfg;
    assert_true(e.p[2].start_failed);
    const char *why = ap_collab_refusal(e.p[2].collab);
    assert_non_null(why);
    print_message("odd peer: %s\n", why);
    assert_non_null(strstr(why, want));
    ap_collab_stats_t st;
    ap_collab_get_stats(e.p[2].collab, &st);
    assert_true(st.refused);
    assert_int_equal(ap_collab_epoch(e.p[2].collab), 0); /* it never trained nor loaded */
    assert_int_equal(st.state_loads, 0);
    /* a submit is refused too */
    ap_nn_params_t *pr = ap_nn_model_params(e.p[2].model);
    assert_int_equal(ap_collab_submit(e.p[2].collab, pr->grad, B, 1.0f, oh_submitted, &e.p[2]),
                     AP_ECONFIG);
    /* the pair trains on in complete groups of two, having refused it */
    uint64_t from = ap_collab_epoch(e.p[0].collab);
    oh_epoch_pred_t q2 = {&e, from + 4, 2};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q2, ap_sim_now_us(e.sim) + 60000000));
    for (int i = 0; i < 2; i++) {
        ap_collab_get_stats(e.p[i].collab, &st);
        print_message("peer %d: epoch %llu, peers refused %llu, partial epochs %llu, group %u\n", i,
                      (unsigned long long)st.epoch, (unsigned long long)st.peers_refused,
                      (unsigned long long)st.epochs_failed, st.last_group_size);
        assert_true(st.peers_refused >= 1);
        assert_int_equal(st.epochs_failed, 0);
        assert_int_equal(st.last_group_size, 2);
        assert_false(st.refused);
    }
    oh_env_free(&e);
}

static void to_fp16(ap_collab_config_t *c)
{
    c->codec = AP_AVG_CODEC_FP16;
}

static void to_big_target(ap_collab_config_t *c)
{
    c->target_batch_size = 4 * B;
}

static void to_other_model(ap_collab_config_t *c)
{
    c->model_desc = "mlp 16-32-4 wide";
}

static void test_other_codec_refused(void **state)
{
    (void)state;
    odd_peer(ap_test_seed(3), to_fp16, "compression: fp16 here, none at ");
}

static void test_other_target_refused(void **state)
{
    (void)state;
    odd_peer(ap_test_seed(4), to_big_target, "target batch size: 64 here, 32 at ");
}

static void test_other_model_refused(void **state)
{
    (void)state;
    odd_peer(ap_test_seed(5), to_other_model, "model: 'mlp 16-32-4 wide' here, 'mlp 16-32-4' at ");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_other_codec_refused),
        cmocka_unit_test(test_other_target_refused),
        cmocka_unit_test(test_other_model_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
