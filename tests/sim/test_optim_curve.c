/* The loss curve of the default recipe (apiary train: LAMB, lr 5e-2, 3
 * warm-up epochs, clip 1) on the simulator, over many seeds: 4 peers train
 * the kit's MLP (16-32-4, batch 32, about two batches per peer per epoch;
 * the seed picks the initialisation, the data stream and each peer's speed,
 * 0.5-1.5 batches/s) for 12
 * global epochs; the epoch's loss (mean over every peer's batches of that
 * epoch) never rises above the first epoch's and every 3 epochs end lower
 * than they began (tests/lib/curve.h). A recipe that overshoots (SGD at a
 * rate 100x too high) is caught by the same check, so the check can fail. */
#include "curve.h"
#include "optim_harness.h"

#define B      32
#define EPOCHS 12
#define WINDOW 3

static void recipe_default(ap_collab_config_t *cfg)
{
    cfg->solver = ap_nn_solver_defaults(AP_NN_LAMB);
    cfg->lr = (ap_nn_lr_schedule_t){
        .kind = AP_NN_LR_CONSTANT, .base = 5e-2f, .min = 5e-2f, .warmup = 3, .total = 0};
    cfg->max_grad_norm = 1.0;
}

/* Runs 4 peers for EPOCHS epochs; fills curve[EPOCHS]; returns the epochs
 * reached by every peer. */
static int run_curve(uint64_t seed, const ap_collab_config_t *recipe, double *curve)
{
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "curve";
    cfg.solver = recipe->solver;
    cfg.lr = recipe->lr;
    cfg.max_grad_norm = recipe->max_grad_norm;
    cfg.target_batch_size = 4 * 2 * B;
    cfg.average_state_every = 4;
    cfg.averaging_timeout_us = 8000000;
    const int n = 4;
    double flops[4];
    uint64_t r = seed;
    for (int i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        flops[i] = 1e9 * (0.5 + (double)(r >> 11) / 9007199254740992.0);
    }
    oh_env_t e;
    oh_env_init(&e, n, seed, &cfg, B, flops, NULL);
    e.max_epochs = EPOCHS;
    e.init_seed = seed;
    e.data_stream = seed ^ 0x5eedull;
    for (int i = 0; i < n; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 2000000);
    for (int i = 0; i < n; i++) oh_peer_start(&e, i);
    oh_epoch_pred_t q = {&e, EPOCHS, n};
    ap_sim_run_until(e.sim, oh_reached, &q, 600000000);
    int reached = EPOCHS;
    for (int i = 0; i < n; i++)
        if ((int)ap_collab_epoch(e.p[i].collab) < reached)
            reached = (int)ap_collab_epoch(e.p[i].collab);
    for (int k = 0; k < EPOCHS; k++) {
        double s = 0;
        uint32_t b = 0;
        for (int i = 0; i < n; i++) {
            s += e.p[i].ep_loss[k];
            b += e.p[i].ep_batches[k];
        }
        curve[k] = b ? s / b : NAN;
    }
    /* a round may be in flight: the collabs finish their teardown (the
     * round's callbacks run) before the services and the simulator go */
    for (int i = 0; i < n; i++) {
        ap_collab_free(e.p[i].collab);
        e.p[i].collab = NULL;
    }
    ap_sim_run_for(e.sim, 60000000);
    oh_env_free(&e);
    return reached;
}

static void test_curve_many_seeds(void **state)
{
    (void)state;
    const int seeds = ap_test_sanitized() ? 3 : 12;
    ap_collab_config_t r;
    recipe_default(&r);
    for (int s = 0; s < seeds; s++) {
        uint64_t seed = ap_test_seed(7000) + (uint64_t)s;
        double curve[EPOCHS];
        assert_int_equal(run_curve(seed, &r, curve), EPOCHS);
        char label[64], why[160];
        snprintf(label, sizeof label, "seed %llu", (unsigned long long)seed);
        ap_test_curve_print(label, curve, EPOCHS);
        if (ap_test_curve_check(curve, EPOCHS, WINDOW, why, sizeof why))
            fail_msg("seed %llu: %s", (unsigned long long)seed, why);
        /* and it learns: the last epoch well below the first */
        assert_true(curve[EPOCHS - 1] < 0.5 * curve[0]);
    }
}

static void test_curve_catches_overshoot(void **state)
{
    (void)state;
    ap_collab_config_t r;
    recipe_default(&r);
    r.solver = ap_nn_solver_defaults(AP_NN_SGD);
    r.lr = (ap_nn_lr_schedule_t){.kind = AP_NN_LR_CONSTANT, .base = 30.0f, .min = 30.0f};
    r.max_grad_norm = 0;
    double curve[EPOCHS];
    run_curve(ap_test_seed(7000), &r, curve);
    ap_test_curve_print("sgd lr 30", curve, EPOCHS);
    char why[160];
    assert_int_equal(ap_test_curve_check(curve, EPOCHS, WINDOW, why, sizeof why), -1);
    fprintf(stderr, "caught: %s\n", why);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_curve_many_seeds),
        cmocka_unit_test(test_curve_catches_overshoot),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
