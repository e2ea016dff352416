/* A step made by the caller (ap_collab_new_custom): 3 peers whose step
 * function runs the model kit's SGD with momentum on a state kept in the
 * collab's state buffer (state_count chosen by the caller, here n + 5 to
 * show the layout is the caller's) reach the parameters of one process with
 * the 3x batch; step_fn runs once per epoch with the epoch and step counter;
 * a newcomer downloads parameters, the caller's state and the step counter. */
#include "optim_harness.h"

#define NPEERS 3
#define B      16
#define EXTRA  5

typedef struct cstep {
    ap_nn_solver_t sgd; /* its state points into the collab's state buffer */
    float lr;
    uint64_t calls, last_epoch, last_step;
    int bad_epochs; /* calls whose epoch or step was not the expected one */
} cstep_t;

static cstep_t cs[NPEERS + 1];

static int custom_step(void *arg, float *params, float *grad, uint64_t epoch, uint64_t step)
{
    cstep_t *s = arg;
    if (s->calls && (epoch != s->last_epoch + 1 || step != s->last_step + 1)) s->bad_epochs++;
    s->calls++;
    s->last_epoch = epoch;
    s->last_step = step;
    s->sgd.step = step;
    s->sgd.state[s->sgd.state_count + EXTRA - 1] += 1.0f; /* the caller's own slot */
    return ap_nn_solver_step(&s->sgd, params, grad, s->lr);
}

static void make_custom(oh_env_t *e, int i)
{
    oh_peer_t *p = &e->p[i];
    ap_collab_free(p->collab);
    p->collab = NULL;
    ap_nn_params_t *pr = ap_nn_model_params(p->model);
    cstep_t *s = &cs[i];
    memset(s, 0, sizeof *s);
    s->sgd.cfg = e->cfg.solver;
    s->sgd.n = pr->count;
    s->sgd.state_count = pr->count;
    s->lr = 0.05f;
    s->sgd.segs = NULL; /* SGD does not read them */
    s->sgd.nsegs = 0;
    assert_ok(ap_collab_new_custom(ap_sim_node(e->sim, i), p->dht, p->svc, &e->cfg, pr->data,
                                   pr->count, pr->count + EXTRA, custom_step, s, &p->collab));
    float *shadow = (float *)1, *grad = NULL, *state = NULL;
    size_t count = 0;
    ap_collab_buffers(p->collab, &shadow, &grad, &state, &count);
    assert_null(shadow);
    assert_non_null(grad);
    assert_non_null(state);
    assert_int_equal(count, pr->count + EXTRA);
    for (size_t k = 0; k < count; k++) assert_true(state[k] == 0.0f);
    s->sgd.state = state;
}

static void test_custom_step(void **state)
{
    (void)state;
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "custom";
    cfg.target_batch_size = NPEERS * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_SGD); /* momentum 0.9 */
    cfg.lr.base = cfg.lr.min = 123.0f;             /* not read with a custom step */
    cfg.average_state_every = 2;
    cfg.averaging_timeout_us = 5000000;
    cfg.max_local_samples = B;
    uint64_t epochs = ap_test_sanitized() ? 4 : 8;
    oh_env_init(&e, NPEERS + 1, ap_test_seed(7), &cfg, B, NULL, NULL);
    e.data_slots = NPEERS;
    e.max_epochs = epochs;
    for (int i = 0; i < NPEERS; i++) {
        oh_peer_up(&e, i, i == 0 ? -1 : 0);
        make_custom(&e, i);
    }
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < NPEERS; i++) oh_peer_start(&e, i);
    oh_epoch_pred_t q = {&e, epochs, NPEERS};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 120000000));
    ap_sim_run_for(e.sim, 2000000);

    /* the single-process reference: SGD with momentum, lr 0.05, batch 3b */
    ap_nn_model_t *ref = oh_model(NPEERS * B, e.init_seed);
    ap_nn_params_t *rp = ap_nn_model_params(ref);
    ap_nn_solver_t *o = NULL;
    assert_ok(ap_nn_solver_new(&cfg.solver, rp->count, NULL, 0, &o));
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
        assert_ok(ap_nn_solver_step(o, rp->data, rp->grad, 0.05f));
    }
    assert_true(oh_eval(rp->data, rp->count) < 0.9 * loss0);
    for (int i = 0; i < NPEERS; i++) {
        ap_nn_params_t *pp = ap_nn_model_params(e.p[i].model);
        double d = oh_max_diff(pp->data, rp->data, rp->count);
        print_message("peer %d: max |dparam| %.2e, %llu steps\n", i, d,
                      (unsigned long long)cs[i].calls);
        assert_true(d < 1e-4);
        assert_int_equal(cs[i].calls, epochs);
        assert_int_equal(cs[i].bad_epochs, 0);
        assert_int_equal(cs[i].last_epoch, epochs - 1);
        assert_int_equal(ap_collab_optim_step(e.p[i].collab), epochs);
        /* the momentum buffer is the reference's */
        assert_true(oh_max_diff(cs[i].sgd.state, o->state, rp->count) < 1e-4);
        assert_true(fabsf(cs[i].sgd.state[rp->count + EXTRA - 1] - (float)epochs) < 1e-4f);
    }

    /* a newcomer downloads parameters, the caller's state and the step */
    oh_peer_up(&e, NPEERS, 0);
    make_custom(&e, NPEERS);
    ap_sim_run_for(e.sim, 500000);
    oh_peer_t *nw = &e.p[NPEERS];
    nw->stop = true; /* it only joins */
    oh_peer_start(&e, NPEERS);
    for (int k = 0; k < 100 && !nw->started; k++) ap_sim_run_for(e.sim, 100000);
    assert_true(nw->started);
    assert_false(nw->start_failed);
    assert_int_equal(ap_collab_epoch(nw->collab), epochs);
    assert_int_equal(ap_collab_optim_step(nw->collab), epochs);
    ap_nn_params_t *np = ap_nn_model_params(nw->model);
    assert_true(oh_max_diff(np->data, rp->data, rp->count) < 1e-4);
    assert_true(oh_max_diff(cs[NPEERS].sgd.state, o->state, rp->count) < 1e-4);
    assert_true(fabsf(cs[NPEERS].sgd.state[rp->count + EXTRA - 1] - (float)epochs) < 1e-4f);

    /* resume: epoch and step counter set by the caller */
    ap_collab_resume(nw->collab, 3, 11);
    assert_int_equal(ap_collab_epoch(nw->collab), 3);
    assert_int_equal(ap_collab_optim_step(nw->collab), 11);
    /* no step function: refused */
    ap_collab_t *bad = NULL;
    assert_int_equal(ap_collab_new_custom(ap_sim_node(e.sim, NPEERS), nw->dht, nw->svc, &cfg,
                                          np->data, np->count, 1, NULL, NULL, &bad),
                     AP_EINVAL);
    assert_null(bad);
    free(x);
    free(y);
    ap_nn_solver_free(o);
    ap_nn_model_free(ref);
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_custom_step)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
