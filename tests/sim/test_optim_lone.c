/* A peer alone in its run does not wait for a group: with no other fresh
 * progress record (for as long as a silent peer takes to count as gone, from
 * its start) it steps as soon as the epoch is due, so an epoch takes
 * its batches' compute time, not the matchmaking window (checked in
 * simulated time, for the READY-window scheme and the DHT matchmaker, with
 * and without delayed updates). Peers that see each other still average in
 * groups: two peers from the start, and a second peer that joins a lone one
 * (it downloads the state, then every epoch is a round of two). */
#include "optim_harness.h"

#define B 16
/* far longer than an epoch's compute (2 batches of 1 s): waiting the window
 * would make each epoch at least this long */
#define WINDOW_US 6000000ull

static void base_cfg(ap_collab_config_t *cfg, bool mm, bool delayed)
{
    ap_collab_config_default(cfg);
    cfg->run_id = "lone";
    cfg->target_batch_size = 2 * B;
    cfg->solver = ap_nn_solver_defaults(AP_NN_SGD);
    cfg->lr.base = cfg->lr.min = 1e-2f;
    cfg->average_state_every = 0;
    cfg->averaging_timeout_us = 5000000;
    cfg->matchmaking_window_us = WINDOW_US;
    cfg->dht_matchmaking = mm;
    cfg->delayed_updates = delayed;
    cfg->model_desc = "mlp 16-32-4";
}

static void lone_peer(bool mm, bool delayed)
{
    enum { EPOCHS = 6 };
    oh_env_t e;
    ap_collab_config_t cfg;
    base_cfg(&cfg, mm, delayed);
    oh_env_init(&e, 1, ap_test_seed(41 + 2 * mm + delayed), &cfg, B, NULL, NULL);
    oh_peer_up(&e, 0, -1);
    ap_sim_run_for(e.sim, 500000);
    oh_peer_start(&e, 0);
    oh_epoch_pred_t q1 = {&e, 1, 1};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q1, ap_sim_now_us(e.sim) + 60000000));
    ap_collab_stats_t st1; /* the first epoch waited: a peer starting with it may not show yet */
    ap_collab_get_stats(e.p[0].collab, &st1);
    uint64_t t0 = ap_sim_now_us(e.sim);
    oh_epoch_pred_t q = {&e, 1 + EPOCHS, 1};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, t0 + 20 * EPOCHS * WINDOW_US));
    uint64_t per_epoch = (ap_sim_now_us(e.sim) - t0) / EPOCHS;
    ap_collab_stats_t st;
    ap_collab_get_stats(e.p[0].collab, &st);
    print_message("lone peer (%s%s): %.2f s of simulated time per epoch (window %.1f s), "
                  "%llu lone epochs, group wait %.2f s, group %u\n",
                  mm ? "DHT matchmaker" : "READY window", delayed ? ", delayed updates" : "",
                  (double)per_epoch / 1e6, (double)WINDOW_US / 1e6,
                  (unsigned long long)(st.lone_epochs - st1.lone_epochs),
                  (double)(st.group_wait_us - st1.group_wait_us) / 1e6, st.last_group_size);
    /* 2 batches of 1 s of compute per epoch; waiting the window would take
     * WINDOW_US (x1.5 in the READY scheme) on top */
    assert_true(per_epoch < WINDOW_US / 2);
    assert_true(st.lone_epochs - st1.lone_epochs >= EPOCHS);
    assert_int_equal(st.group_wait_us, st1.group_wait_us);
    assert_int_equal(st.last_group_size, 1);
    assert_int_equal(st.epochs_failed, 0);
    assert_int_equal(ap_collab_solver(e.p[0].collab)->step, ap_collab_epoch(e.p[0].collab));
    oh_env_free(&e);
}

static void test_lone_ready_window(void **state)
{
    (void)state;
    lone_peer(false, false);
}

static void test_lone_matchmaker(void **state)
{
    (void)state;
    lone_peer(true, false);
}

static void test_lone_delayed(void **state)
{
    (void)state;
    lone_peer(false, true);
    lone_peer(true, true);
}

/* Both peers' records are visible: every epoch is a round of two (none is
 * stepped alone), and both hold the same parameters. */
static void pair(bool mm, bool late)
{
    enum { EPOCHS = 5 };
    oh_env_t e;
    ap_collab_config_t cfg;
    base_cfg(&cfg, mm, false);
    cfg.target_batch_size = 4 * B;
    oh_env_init(&e, 2, ap_test_seed(51 + 2 * mm + late), &cfg, B, NULL, NULL);
    oh_peer_up(&e, 0, -1);
    oh_peer_up(&e, 1, 0);
    ap_sim_run_for(e.sim, 500000);
    oh_peer_start(&e, 0);
    uint64_t from = 0;
    if (late) {
        /* peer 0 trains alone first (no window per epoch), then peer 1 joins */
        oh_epoch_pred_t q0 = {&e, 2, 1};
        assert_true(ap_sim_run_until(e.sim, oh_reached, &q0, ap_sim_now_us(e.sim) + 60000000));
        ap_collab_stats_t st0, st2;
        ap_collab_get_stats(e.p[0].collab, &st0);
        q0.epoch = 5;
        assert_true(ap_sim_run_until(e.sim, oh_reached, &q0, ap_sim_now_us(e.sim) + 60000000));
        ap_collab_get_stats(e.p[0].collab, &st2);
        assert_true(st2.lone_epochs - st0.lone_epochs >= 3);
        assert_int_equal(st2.group_wait_us, st0.group_wait_us);
    }
    oh_peer_start(&e, 1);
    oh_epoch_pred_t q1 = {&e, ap_collab_epoch(e.p[0].collab) + 2, 2};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q1, ap_sim_now_us(e.sim) + 120000000));
    ap_collab_stats_t a0, a1;
    ap_collab_get_stats(e.p[0].collab, &a0);
    ap_collab_get_stats(e.p[1].collab, &a1);
    from = ap_collab_epoch(e.p[0].collab);
    oh_epoch_pred_t q = {&e, from + EPOCHS, 2};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 300000000));
    e.max_epochs = 0; /* trainers stop; the last rounds end */
    ap_sim_run_for(e.sim, 10000000);
    ap_collab_stats_t st[2];
    for (int i = 0; i < 2; i++) {
        ap_collab_get_stats(e.p[i].collab, &st[i]);
        print_message("pair (%s%s) peer %d: epoch %llu, rounds %llu, lone epochs %llu, group %u, "
                      "loads %llu\n",
                      mm ? "DHT matchmaker" : "READY window", late ? ", late joiner" : "", i,
                      (unsigned long long)st[i].epoch, (unsigned long long)st[i].rounds,
                      (unsigned long long)st[i].lone_epochs, st[i].last_group_size,
                      (unsigned long long)st[i].state_loads);
        assert_int_equal(st[i].last_group_size, 2);
        assert_int_equal(st[i].epochs_failed, 0);
    }
    /* the epochs since both saw each other were all rounds of two */
    assert_int_equal(st[0].lone_epochs, a0.lone_epochs);
    assert_int_equal(st[1].lone_epochs, a1.lone_epochs);
    assert_true(st[0].rounds - a0.rounds >= EPOCHS);
    assert_true(st[1].rounds - a1.rounds >= EPOCHS);
    if (!late) {
        assert_int_equal(st[0].lone_epochs, 0);
        assert_int_equal(st[1].lone_epochs, 0);
    } else {
        assert_true(st[1].state_loads >= 1); /* the joiner took the lone peer's state */
    }
    assert_int_equal(ap_collab_epoch(e.p[0].collab), ap_collab_epoch(e.p[1].collab));
    ap_nn_params_t *p0 = ap_nn_model_params(e.p[0].model), *p1 = ap_nn_model_params(e.p[1].model);
    assert_true(oh_max_diff(p0->data, p1->data, p0->count) < 1e-5);
    oh_env_free(&e);
}

static void test_pair_averages(void **state)
{
    (void)state;
    pair(false, false);
    pair(true, false);
}

static void test_joiner_averages_with_lone_peer(void **state)
{
    (void)state;
    pair(false, true);
    pair(true, true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lone_ready_window),
        cmocka_unit_test(test_lone_matchmaker),
        cmocka_unit_test(test_lone_delayed),
        cmocka_unit_test(test_pair_averages),
        cmocka_unit_test(test_joiner_averages_with_lone_peer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
