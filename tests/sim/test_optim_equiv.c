/* Equivalence: 4 peers with target_batch_size = 4*b, each computing batches
 * of b, reach after N global epochs the same parameters and loss as one
 * process training with batch 4*b for N steps (same samples, same seeds,
 * same Adam). Tolerance: the all-reduce sums the four means in another order
 * than one big batch, so results agree to float rounding: parameters within
 * 1e-4 absolute, evaluation loss within 1e-3 relative. */
#include "optim_harness.h"

#define NPEERS 4
#define B      16

static bool use_dht_mm;     /* groups from the averaging module's DHT matchmaker */
static uint8_t state_codec; /* the state rounds' codec */
static double max_dparam;   /* the last run's largest parameter difference */

static void run_equiv2(uint64_t epochs, uint32_t state_every, uint8_t codec, double tol_param,
                       double tol_loss, const double *flops)
{
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "equiv";
    cfg.target_batch_size = NPEERS * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = 1e-2f;
    cfg.average_state_every = state_every;
    cfg.averaging_timeout_us = 5000000;
    cfg.load_state_on_start = true;
    cfg.codec = codec;
    cfg.state_codec = state_codec;
    /* speeds differ: exact mode (one batch per peer per epoch, then wait) */
    if (flops) cfg.max_local_samples = B;
    cfg.dht_matchmaking = use_dht_mm;
    oh_env_init(&e, NPEERS, ap_test_seed(42), &cfg, B, flops, NULL);
    e.max_epochs = epochs;
    for (int i = 0; i < NPEERS; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 500000); /* DHT bootstrap */
    for (int i = 0; i < NPEERS; i++) oh_peer_start(&e, i);

    /* every epoch must average exactly the 4*b samples of the big batch */
    for (uint64_t ep = 1; ep <= epochs; ep++) {
        oh_epoch_pred_t q = {&e, ep, NPEERS};
        assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 60000000));
        for (int i = 0; i < NPEERS; i++) {
            ap_collab_stats_t st;
            ap_collab_get_stats(e.p[i].collab, &st);
            assert_int_equal(st.last_epoch_samples, NPEERS * B);
            assert_int_equal(st.last_group_size, NPEERS);
            assert_true(st.last_averaged_fraction >= 1.0);
            assert_int_equal(st.epochs_failed, 0);
            assert_int_equal(e.p[i].batches, ep); /* one batch per peer per epoch */
        }
    }
    ap_sim_run_for(e.sim, 3000000); /* let state rounds and reports finish */

    /* the single-process reference */
    ap_nn_model_t *ref = oh_model(NPEERS * B, e.init_seed);
    ap_nn_params_t *rp = ap_nn_model_params(ref);
    ap_nn_solver_t *o = NULL;
    assert_ok(ap_nn_solver_new(&cfg.solver, rp->count, rp->views, rp->nviews, &o));
    float *x = malloc(sizeof(float) * NPEERS * B * OH_DIM);
    int32_t *y = malloc(sizeof(int32_t) * NPEERS * B);
    double loss0 = oh_eval(rp->data, rp->count);
    for (uint64_t k = 0; k < epochs; k++) {
        ap_nn_synth_classify(OH_TASK, OH_STREAM, k * NPEERS * B, NPEERS * B, OH_DIM, OH_CLASSES, x,
                             y);
        ap_nn_model_zero_grad(ref);
        float l;
        assert_ok(ap_nn_mlp_forward(ref, x, y, NPEERS * B, &l));
        assert_ok(ap_nn_mlp_backward(ref));
        assert_ok(ap_nn_solver_step(o, rp->data, rp->grad, ap_nn_lr_at(&cfg.lr, k)));
    }
    double lref = oh_eval(rp->data, rp->count);
    for (int i = 0; i < NPEERS; i++) {
        ap_nn_params_t *pp = ap_nn_model_params(e.p[i].model);
        double d = oh_max_diff(pp->data, rp->data, rp->count);
        if (d > max_dparam) max_dparam = d;
        double l = oh_eval(pp->data, pp->count);
        print_message("peer %d: loss %.6f vs reference %.6f (initial %.6f), max |dparam| %.2e\n", i,
                      l, lref, loss0, d);
        assert_true(d < tol_param);
        assert_true(fabs(l - lref) <= tol_loss * lref);
        assert_int_equal(ap_collab_epoch(e.p[i].collab), epochs);
        assert_int_equal(ap_collab_solver(e.p[i].collab)->step, epochs);
    }
    /* it trained: the test cannot pass with a collaboration that does nothing */
    assert_true(lref < 0.7 * loss0);
    free(x);
    free(y);
    ap_nn_solver_free(o);
    ap_nn_model_free(ref);
    oh_env_free(&e);
}

static void run_equiv(uint64_t epochs, uint32_t state_every, uint8_t codec, double tol_param,
                      double tol_loss)
{
    run_equiv2(epochs, state_every, codec, tol_param, tol_loss, NULL);
}

static void test_equivalence(void **state)
{
    (void)state;
    run_equiv(ap_test_sanitized() ? 6 : 20, 0, AP_AVG_CODEC_F32, 1e-4, 1e-3);
}

/* Exact mode (max_local_samples = b) with compute speeds spread 6x: the
 * fast peers wait at their cap instead of contributing more batches, so
 * every epoch is still one batch of each peer and the run equals the
 * single process. */
static void test_equivalence_exact_hetero(void **state)
{
    (void)state;
    static const double flops[NPEERS] = {3e9, 1e9, 2e9, 0.5e9};
    run_equiv2(ap_test_sanitized() ? 6 : 12, 0, AP_AVG_CODEC_F32, 1e-4, 1e-3, flops);
}

/* The same with groups formed by the averaging module's DHT matchmaker
 * (dht_matchmaking) instead of the READY window over the progress records:
 * equal speeds, then exact mode with speeds spread 6x. */
static void test_equivalence_dht_matchmaking(void **state)
{
    (void)state;
    static const double flops[NPEERS] = {3e9, 1e9, 2e9, 0.5e9};
    use_dht_mm = true;
    run_equiv(ap_test_sanitized() ? 6 : 12, 0, AP_AVG_CODEC_F32, 1e-4, 1e-3);
    run_equiv2(ap_test_sanitized() ? 6 : 12, 3, AP_AVG_CODEC_F32, 1e-4, 1e-3, flops);
    use_dht_mm = false;
}

/* State averaging of identical replicas must keep them equivalent. */
static void test_equivalence_with_state_averaging(void **state)
{
    (void)state;
    run_equiv(ap_test_sanitized() ? 6 : 12, 3, AP_AVG_CODEC_F32, 1e-4, 1e-3);
}

/* fp16 gradients: the same run within the codec's rounding (Adam normalises
 * the step, so parameters move by at most lr per step whatever the error):
 * parameters within 2e-2, loss within 10% of the float32 reference. */
static void test_equivalence_fp16(void **state)
{
    (void)state;
    run_equiv(ap_test_sanitized() ? 6 : 12, 0, AP_AVG_CODEC_FP16, 2e-2, 0.10);
}

/* bf16 state rounds (state_codec) every epoch: the parameters and Adam's
 * moments travel as bfloat16, so the run stays within its rounding of the
 * reference, and no closer than float32 state rounds (the codec is applied).
 * fp16 would flush Adam's small second moments to zero (a few parameters
 * then jump). */
static void test_state_compression(void **state)
{
    (void)state;
    uint64_t epochs = ap_test_sanitized() ? 4 : 8;
    max_dparam = 0;
    run_equiv(epochs, 1, AP_AVG_CODEC_F32, 1e-4, 1e-3);
    double f32 = max_dparam;
    max_dparam = 0;
    state_codec = AP_AVG_CODEC_BF16;
    run_equiv(epochs, 1, AP_AVG_CODEC_F32, 2e-2, 0.02);
    state_codec = AP_AVG_CODEC_F32;
    print_message("max |dparam|: %.2e with float32 state rounds, %.2e with bf16\n", f32,
                  max_dparam);
    assert_true(max_dparam > 10 * f32 && max_dparam > 1e-4);
}

/* Three trainers and one auxiliary peer (averages, trains nothing): the aux
 * joins every group (size 4) and the result is still exactly one 3*b batch
 * per epoch. */
static void test_auxiliary_peer(void **state)
{
    (void)state;
    const uint64_t epochs = ap_test_sanitized() ? 4 : 8;
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "aux";
    cfg.target_batch_size = 3 * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = 1e-2f;
    cfg.average_state_every = 0;
    cfg.averaging_timeout_us = 5000000;
    const ap_avg_role_t roles[4] = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_CLIENT, AP_AVG_AUX};
    oh_env_init(&e, 4, ap_test_seed(43), &cfg, B, NULL, roles);
    e.data_slots = 3;
    e.max_epochs = epochs;
    for (int i = 0; i < 4; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < 4; i++) oh_peer_start(&e, i);
    for (uint64_t ep = 1; ep <= epochs; ep++) {
        oh_epoch_pred_t q = {&e, ep, 3};
        assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 60000000));
        for (int i = 0; i < 3; i++) {
            ap_collab_stats_t st;
            ap_collab_get_stats(e.p[i].collab, &st);
            assert_int_equal(st.last_epoch_samples, 3 * B);
            assert_int_equal(st.last_group_size, 4); /* the aux is in every group */
            assert_true(st.last_averaged_fraction >= 1.0);
        }
    }
    ap_sim_run_for(e.sim, 3000000);
    assert_true(ap_collab_epoch(e.p[3].collab) >= epochs); /* the aux followed */
    assert_int_equal(e.p[3].batches, 0);                   /* and trained nothing */
    ap_nn_model_t *ref = oh_model(3 * B, e.init_seed);
    ap_nn_params_t *rp = ap_nn_model_params(ref);
    ap_nn_solver_t *o = NULL;
    assert_ok(ap_nn_solver_new(&cfg.solver, rp->count, rp->views, rp->nviews, &o));
    float *x = malloc(sizeof(float) * 3 * B * OH_DIM);
    int32_t *y = malloc(sizeof(int32_t) * 3 * B);
    for (uint64_t k = 0; k < epochs; k++) {
        ap_nn_synth_classify(OH_TASK, OH_STREAM, k * 3 * B, 3 * B, OH_DIM, OH_CLASSES, x, y);
        ap_nn_model_zero_grad(ref);
        float l;
        assert_ok(ap_nn_mlp_forward(ref, x, y, 3 * B, &l));
        assert_ok(ap_nn_mlp_backward(ref));
        assert_ok(ap_nn_solver_step(o, rp->data, rp->grad, ap_nn_lr_at(&cfg.lr, k)));
    }
    for (int i = 0; i < 3; i++)
        assert_true(oh_max_diff(ap_nn_model_params(e.p[i].model)->data, rp->data, rp->count) <
                    1e-4);
    free(x);
    free(y);
    ap_nn_solver_free(o);
    ap_nn_model_free(ref);
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equivalence),
        cmocka_unit_test(test_equivalence_exact_hetero),
        cmocka_unit_test(test_equivalence_dht_matchmaking),
        cmocka_unit_test(test_equivalence_with_state_averaging),
        cmocka_unit_test(test_equivalence_fp16),
        cmocka_unit_test(test_state_compression),
        cmocka_unit_test(test_auxiliary_peer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
