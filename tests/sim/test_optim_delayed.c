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
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
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
            const ap_nn_solver_t *o0 = ap_collab_solver(e.p[0].collab);
            const ap_nn_solver_t *oi = ap_collab_solver(e.p[i].collab);
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
        if (ap_collab_solver(c)->step == ap_collab_solver(e.p[0].collab)->step) {
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
    /* checkpoints of peer 0 at each of its epoch changes (rounds run back to
     * back here, so most are taken while an update runs or waits) */
    uint64_t ckpts, ckpts_pending;
    uint8_t *last_ckpt;
    size_t last_len;
    uint64_t last_epoch;
} cap_watch_t;

/* A checkpoint from the optimizer's buffers, consistent with one epoch at
 * any moment: decoded into a fresh model + optimizer it holds exactly the
 * freshest parameters, the optimizer state and the epoch. */
static void cap_checkpoint(cap_watch_t *w)
{
    oh_peer_t *p = &w->e->p[0];
    uint8_t *buf = NULL;
    size_t len = 0;
    uint64_t epoch = 0;
    assert_ok(ap_collab_checkpoint_encode(p->collab, p->model, &buf, &len, &epoch));
    assert_int_equal(epoch, ap_collab_epoch(p->collab));
    ap_nn_model_t *m = oh_model(B, 99);
    ap_nn_params_t *pr = ap_nn_model_params(m);
    ap_nn_solver_t *o = NULL;
    assert_ok(ap_nn_solver_new(&w->e->cfg.solver, pr->count, pr->views, pr->nviews, &o));
    uint64_t step = 0;
    assert_ok(ap_nn_checkpoint_decode(buf, len, m, o, &step));
    assert_int_equal(step, epoch);
    const ap_nn_solver_t *mine = ap_collab_solver(p->collab);
    assert_int_equal(o->step, mine->step);
    assert_memory_equal(o->state, mine->state, mine->state_count * sizeof(float));
    assert_memory_equal(pr->data, ap_collab_current_params(p->collab), pr->count * sizeof(float));
    if (ap_collab_update_pending(p->collab)) w->ckpts_pending++;
    w->ckpts++;
    ap_nn_solver_free(o);
    ap_nn_model_free(m);
    free(w->last_ckpt);
    w->last_ckpt = buf;
    w->last_len = len;
    w->last_epoch = epoch;
}

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
            if (i == 0) cap_checkpoint(w);
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
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
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
    print_message("checkpoints: %llu taken, %llu while an update ran or waited\n",
                  (unsigned long long)w.ckpts, (unsigned long long)w.ckpts_pending);
    assert_true(w.ckpts >= epochs - 1);
    assert_true(w.ckpts_pending > 0);

    /* resume: peer 0 restarts from its last checkpoint (no download), at
     * the checkpoint's epoch, and trains on with the others */
    oh_peer_down(&e, 0);
    e.p[0].collab = NULL;
    ap_collab_config_t rc = cfg;
    rc.load_state_on_start = false;
    e.cfg = rc;
    e.max_epochs = epochs + 2;
    oh_peer_up(&e, 0, 1);
    ap_nn_solver_t *o = ap_collab_solver_mut(e.p[0].collab);
    uint64_t step = 0;
    assert_ok(ap_nn_checkpoint_decode(w.last_ckpt, w.last_len, e.p[0].model, o, &step));
    assert_int_equal(step, w.last_epoch);
    ap_collab_set_epoch(e.p[0].collab, step);
    ap_sim_run_for(e.sim, 1000000);
    oh_peer_start(&e, 0);
    for (int i = 1; i < NPEERS; i++) oh_next_batch(&e.p[i]); /* the others stopped at epochs */
    oh_epoch_pred_t q = {&e, epochs + 2, NPEERS};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 120000000));
    ap_collab_stats_t st0;
    ap_collab_get_stats(e.p[0].collab, &st0);
    print_message("resumed at epoch %llu, reached %llu with the others (state loads %llu)\n",
                  (unsigned long long)step, (unsigned long long)ap_collab_epoch(e.p[0].collab),
                  (unsigned long long)st0.state_loads);
    free(w.last_ckpt);
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_delayed_updates),
                                       cmocka_unit_test(test_delayed_with_state_averaging),
                                       cmocka_unit_test(test_delayed_cap)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
