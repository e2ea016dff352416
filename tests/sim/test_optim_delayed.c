/* Delayed updates (issue 8): averaging and the optimizer step run in the
 * background while the peers compute their next batches (one step stale).
 * 4 peers on slow links: compute goes on during the rounds (samples
 * submitted during rounds > 0; the synchronous run on the same links: 0),
 * the peers step in sync (same parameters after each step, within 1e-4: the
 * all-reduce gives every member the same average) and the loss falls. */
#include "optim_harness.h"

#define NPEERS 4
#define B      16

typedef struct result {
    uint64_t during; /* samples submitted during background rounds, all peers */
    uint64_t compared;
    uint64_t state_rounds; /* completed, all peers */
    double worst;
    double loss0, loss;
} result_t;

static void run(bool delayed, uint32_t state_every, uint64_t epochs, result_t *r)
{
    memset(r, 0, sizeof *r);
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "delayed";
    cfg.target_batch_size = NPEERS * B * 2;
    cfg.optim = ap_nn_optim_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = 1e-2f;
    cfg.average_state_every = state_every;
    cfg.averaging_timeout_us = 20000000;
    cfg.delayed_updates = delayed;
    oh_env_init(&e, NPEERS, ap_test_seed(7), &cfg, B, NULL, NULL);
    e.max_epochs = epochs;
    /* slow network: 2 Mbit/s each way (a round takes longer than a batch) */
    for (int i = 0; i < NPEERS; i++) assert_ok(ap_sim_set_node_bw(e.sim, i, 2000000, 2000000));
    for (int i = 0; i < NPEERS; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < NPEERS; i++) oh_peer_start(&e, i);
    {
        ap_nn_params_t *pp = ap_nn_model_params(e.p[0].model);
        r->loss0 = oh_eval(pp->data, pp->count);
    }
    for (uint64_t ep = 1; ep <= epochs; ep++) {
        oh_epoch_pred_t q = {&e, ep, NPEERS};
        assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 120000000));
        /* peers that applied the same number of steps hold the same parameters */
        for (int i = 1; i < NPEERS; i++) {
            const ap_nn_optim_t *o0 = ap_collab_optim(e.p[0].collab);
            const ap_nn_optim_t *oi = ap_collab_optim(e.p[i].collab);
            if (o0->step != oi->step) continue;
            size_t n = ap_nn_model_params(e.p[0].model)->count;
            double d = oh_max_diff(ap_collab_current_params(e.p[0].collab),
                                   ap_collab_current_params(e.p[i].collab), n);
            if (d > r->worst) r->worst = d;
            r->compared++;
        }
    }
    ap_sim_run_for(e.sim, 10000000); /* the last rounds end; trainers stopped */
    for (int i = 0; i < NPEERS; i++) {
        ap_collab_t *c = e.p[i].collab;
        assert_false(ap_collab_update_pending(c) && ap_collab_apply_update(c) < 0);
        ap_collab_apply_update(c);
        assert_false(ap_collab_update_pending(c));
        ap_collab_stats_t st;
        ap_collab_get_stats(c, &st);
        r->during += st.samples_during_rounds;
        r->state_rounds += st.state_rounds;
        assert_int_equal(st.epochs_failed, 0);
        assert_true(ap_collab_epoch(c) >= epochs);
        ap_nn_params_t *pp = ap_nn_model_params(e.p[i].model);
        ap_nn_params_t *p0 = ap_nn_model_params(e.p[0].model);
        if (ap_collab_optim(c)->step == ap_collab_optim(e.p[0].collab)->step) {
            double d = oh_max_diff(pp->data, p0->data, pp->count);
            if (d > r->worst) r->worst = d;
            r->compared++;
        }
    }
    ap_nn_params_t *pp = ap_nn_model_params(e.p[0].model);
    r->loss = oh_eval(pp->data, pp->count);
    oh_env_free(&e);
}

static void test_delayed_updates(void **state)
{
    (void)state;
    const uint64_t epochs = ap_test_sanitized() ? 4 : 10;
    result_t sync, del;
    run(false, 0, epochs, &sync);
    run(true, 0, epochs, &del);
    print_message("synchronous: %llu samples during rounds, loss %.4f -> %.4f, worst |dparam| "
                  "%.2e over %llu comparisons\n",
                  (unsigned long long)sync.during, sync.loss0, sync.loss, sync.worst,
                  (unsigned long long)sync.compared);
    print_message("delayed:     %llu samples during rounds, loss %.4f -> %.4f, worst |dparam| "
                  "%.2e over %llu comparisons\n",
                  (unsigned long long)del.during, del.loss0, del.loss, del.worst,
                  (unsigned long long)del.compared);
    assert_int_equal(sync.during, 0); /* the counter counts only background rounds */
    assert_true(del.during > 0);      /* compute went on during the rounds */
    assert_true(del.compared >= epochs);
    assert_true(del.worst < 1e-4);           /* in sync after each applied step */
    assert_true(del.loss < 0.8 * del.loss0); /* converges */
}

/* State averaging every 3 epochs runs in the background too (it reads and
 * writes the optimizer's copy of the parameters): still in sync, converging. */
static void test_delayed_with_state_averaging(void **state)
{
    (void)state;
    const uint64_t epochs = ap_test_sanitized() ? 4 : 9;
    result_t del;
    run(true, 3, epochs, &del);
    print_message("delayed + state averaging: %llu samples during rounds, loss %.4f -> %.4f, "
                  "worst |dparam| %.2e over %llu comparisons, %llu state rounds\n",
                  (unsigned long long)del.during, del.loss0, del.loss, del.worst,
                  (unsigned long long)del.compared, (unsigned long long)del.state_rounds);
    assert_true(del.during > 0);
    assert_true(del.state_rounds >= NPEERS); /* every peer completed a state round */
    assert_true(del.compared >= epochs);
    assert_true(del.worst < 1e-4);
    assert_true(del.loss < 0.8 * del.loss0);
}

typedef struct cap_watch {
    oh_env_t *e;
    uint64_t epochs;
    uint64_t seen[NPEERS];
    uint64_t worst; /* largest sample count a step of epoch >= 1 averaged */
    uint64_t steps; /* (peer, epoch) steps of epoch >= 1 observed */
} cap_watch_t;

/* Called by the simulator between events: records every peer's
 * last_epoch_samples as soon as its epoch moves; true when all reached
 * the last epoch. */
static bool cap_pred(void *arg)
{
    cap_watch_t *w = arg;
    int done = 0;
    for (int i = 0; i < NPEERS; i++) {
        ap_collab_t *c = w->e->p[i].collab;
        uint64_t ep = ap_collab_epoch(c);
        if (ep != w->seen[i]) {
            ap_collab_stats_t st;
            ap_collab_get_stats(c, &st);
            /* epoch 0 is synchronous start-up (no background round before
             * it): its overshoot comes from views that do not yet list the
             * other peers (docs/training.md), not from the cap */
            if (ep >= 2) {
                if (st.last_epoch_samples > w->worst) w->worst = st.last_epoch_samples;
                w->steps++;
            }
            w->seen[i] = ep;
        }
        if (ep >= w->epochs) done++;
    }
    return done == NPEERS;
}

/* Delayed updates with peers much faster than a round (a batch takes 0.1 s,
 * a round on 2 Mbit/s links with the 1 s matchmaking window about 2 s):
 * during a round each peer accumulates for the next epoch at most its share
 * of the target and then waits, so no epoch averages more than
 * target + one local batch per peer (without the cap: every batch of the
 * round, ~10x the target). */
static void test_delayed_cap(void **state)
{
    (void)state;
    const uint64_t epochs = ap_test_sanitized() ? 4 : 8;
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "delayed-cap";
    cfg.target_batch_size = NPEERS * B * 2;
    cfg.optim = ap_nn_optim_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = 1e-2f;
    cfg.average_state_every = 0;
    cfg.averaging_timeout_us = 20000000;
    cfg.delayed_updates = true;
    double flops[NPEERS];
    for (int i = 0; i < NPEERS; i++) flops[i] = i == 0 ? 2e10 : 1e10; /* 0.05 and 0.1 s */
    oh_env_init(&e, NPEERS, ap_test_seed(11), &cfg, B, flops, NULL);
    e.max_epochs = epochs;
    for (int i = 0; i < NPEERS; i++) assert_ok(ap_sim_set_node_bw(e.sim, i, 2000000, 2000000));
    for (int i = 0; i < NPEERS; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < NPEERS; i++) oh_peer_start(&e, i);
    cap_watch_t w = {.e = &e, .epochs = epochs};
    assert_true(ap_sim_run_until(e.sim, cap_pred, &w, ap_sim_now_us(e.sim) + 300000000));
    uint64_t during = 0, held = 0, failed = 0;
    for (int i = 0; i < NPEERS; i++) {
        ap_collab_stats_t st;
        ap_collab_get_stats(e.p[i].collab, &st);
        during += st.samples_during_rounds;
        held += st.submits_held;
        failed += st.epochs_failed;
    }
    const uint64_t bound = cfg.target_batch_size + NPEERS * B;
    print_message("cap: worst epoch averaged %llu samples (target %llu, bound %llu) over %llu "
                  "steps; %llu samples during rounds, %llu submits held\n",
                  (unsigned long long)w.worst, (unsigned long long)cfg.target_batch_size,
                  (unsigned long long)bound, (unsigned long long)w.steps,
                  (unsigned long long)during, (unsigned long long)held);
    assert_int_equal(failed, 0);
    assert_true(w.steps >= NPEERS * (epochs - 1));
    assert_true(during > 0); /* compute still overlaps the rounds */
    assert_true(held > 0);   /* and the cap stopped it */
    assert_true(w.worst >= cfg.target_batch_size);
    assert_true(w.worst <= bound);
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_delayed_updates),
                                       cmocka_unit_test(test_delayed_with_state_averaging),
                                       cmocka_unit_test(test_delayed_cap)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
