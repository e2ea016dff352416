/* Closed runs on the simulator: the owner (node 0) and two peers with its
 * tokens train; a fourth peer without a token, or with a forged, expired,
 * stolen or revoked one, tries to take part. The honest peers submit zero
 * gradients with plain SGD, the intruder a gradient of ones: if any of its
 * gradients (or, through state averaging, its parameters) reached an
 * average, the honest parameters would move away from their initial values.
 * The intruder runs as an open-run peer (no run_owner) so that it does not
 * stop itself: it includes the others in its groups and asks them for state.
 * A peer of the closed run without a valid token of its own is refused at
 * start with the line "run R is closed: ask its owner for a token". */
#include "optim_harness.h"

#include "apiary/run_token.h"
#include "optim/collab_impl.h" /* ap__run_token_message */

#define B       16
#define RUN     "closed"
#define NPEERS  4
#define INTRUDE 3

typedef struct trainer {
    oh_env_t *e;
    int i;
    float *grad;
    bool busy, stop;
    int last_status;
    int submits; /* accepted by ap_collab_submit */
} trainer_t;

static trainer_t tr[NPEERS];

static void train_next(ap_rt_t *rt, void *arg);

static void submitted(ap_rt_t *rt, void *arg, int status)
{
    trainer_t *t = arg;
    t->busy = false;
    t->last_status = status;
    if (status == 0 && !t->stop) ap_rt_timer_start(rt, 200000, 0, train_next, t);
}

static void train_next(ap_rt_t *rt, void *arg)
{
    trainer_t *t = arg;
    oh_peer_t *p = &t->e->p[t->i];
    if (t->stop || !p->collab || t->busy) return;
    t->busy = true;
    int rc = ap_collab_submit(p->collab, t->grad, B, 1.0f, submitted, t);
    if (rc == 0) t->submits++;
    if (rc) {
        t->busy = false;
        t->last_status = rc;
    }
}

static void started(ap_rt_t *rt, void *arg, int status)
{
    trainer_t *t = arg;
    t->e->p[t->i].started = true;
    t->last_status = status;
    /* a failed download still lets a peer train (the intruder's case) */
    if (status != AP_EPERM && status != AP_ECONFIG && status != AP_ECANCELED) train_next(rt, t);
}

/* A token signed by node `signer`'s key (the owner is node 0). */
static void make_token(oh_env_t *e, int signer, int peer, int64_t expires_ms, char *out)
{
    ap_run_token_t t;
    memset(&t, 0, sizeof t);
    t.peer = *ap_sim_peer_id(e->sim, peer);
    t.expires_ms = expires_ms;
    uint8_t msg[AP__TOKEN_MSG_MAX];
    size_t len = ap__run_token_message(RUN, &t.peer, expires_ms, msg);
    ap_rt_sign(ap_sim_node(e->sim, signer), msg, len, t.sig);
    assert_true(ap_run_token_format(&t, out, AP_RUN_TOKEN_TEXT_MAX) > 0);
    ap_run_token_t back;
    assert_ok(ap_run_token_parse(out, &back));
    assert_memory_equal(&back, &t, sizeof t);
}

typedef enum intruder {
    NO_TOKEN,
    FORGED,  /* signed by a key that is not the owner's */
    EXPIRED, /* the owner's, expired */
    STOLEN,  /* peer 1's token */
    REVOKED, /* the owner's, then revoked in the DHT */
} intruder_t;

static bool epochs_reached(void *arg)
{
    oh_env_t *e = arg;
    for (int i = 0; i < 3; i++)
        if (!e->p[i].collab || ap_collab_epoch(e->p[i].collab) < 6) return false;
    return true;
}

static void revoked_stored(ap_dht_t *dht, void *arg, int status, int nstored)
{
    *(int *)arg = status ? status : nstored > 0 ? 1 : AP_EUNREACH;
}

static void run_closed(intruder_t kind)
{
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = RUN;
    cfg.target_batch_size = 3 * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_SGD);
    cfg.solver.momentum = 0;
    cfg.solver.weight_decay = 0;
    cfg.lr.base = cfg.lr.min = 0.5f;
    cfg.max_grad_norm = 0;
    cfg.average_state_every = 2; /* parameters are averaged too */
    cfg.averaging_timeout_us = 3000000;
    cfg.stale_ms = 8000;
    oh_env_init(&e, NPEERS, ap_test_seed(31 + (uint64_t)kind), &cfg, B, NULL, NULL);
    int64_t now = ap_rt_wall_ms(ap_sim_node(e.sim, 0));
    char owner[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(ap_sim_peer_id(e.sim, 0), owner);
    static char tok[NPEERS][AP_RUN_TOKEN_TEXT_MAX];
    for (int i = 1; i < 3; i++) make_token(&e, 0, i, now + 3600000, tok[i]);
    bool has_tok = true;
    switch (kind) {
    case NO_TOKEN:
        has_tok = false;
        break;
    case FORGED:
        make_token(&e, 2, INTRUDE, now + 3600000, tok[INTRUDE]);
        break;
    case EXPIRED:
        make_token(&e, 0, INTRUDE, now - 1000, tok[INTRUDE]);
        break;
    case STOLEN:
        memcpy(tok[INTRUDE], tok[1], sizeof tok[1]);
        break;
    case REVOKED:
        make_token(&e, 0, INTRUDE, now + 3600000, tok[INTRUDE]);
        break;
    }
    if (kind == REVOKED) {
        /* the owner revokes the intruder before it shows up */
        e.cfg.run_owner = owner;
        oh_peer_up(&e, 0, -1);
        ap_sim_run_for(e.sim, 100000);
    }
    for (int i = 0; i < NPEERS; i++) {
        e.cfg.run_owner = i == INTRUDE ? NULL : owner;
        e.cfg.token = i == 0 || (i == INTRUDE && !has_tok) ? NULL : tok[i];
        if (!(kind == REVOKED && i == 0)) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    }
    ap_sim_run_for(e.sim, 500000);
    if (kind == REVOKED) {
        int st = 0;
        assert_ok(ap_run_token_revoke(e.p[0].dht, RUN, ap_sim_peer_id(e.sim, INTRUDE),
                                      now + 3600000, revoked_stored, &st));
        ap_sim_run_for(e.sim, 2000000);
        assert_int_equal(st, 1);
    }
    size_t n = ap_nn_model_params(e.p[0].model)->count;
    float *init = malloc(n * sizeof *init);
    memcpy(init, ap_nn_model_params(e.p[0].model)->data, n * sizeof *init);
    for (int i = 0; i < NPEERS; i++) {
        tr[i] = (trainer_t){.e = &e, .i = i, .grad = calloc(n, sizeof(float))};
        if (i == INTRUDE)
            for (size_t k = 0; k < n; k++) tr[i].grad[k] = 1.0f;
    }
    for (int i = 0; i < 3; i++) assert_ok(ap_collab_start(e.p[i].collab, started, &tr[i]));
    ap_sim_run_for(e.sim, 3000000);
    /* the intruder comes later: it sees donors and asks them for state */
    assert_ok(ap_collab_start(e.p[INTRUDE].collab, started, &tr[INTRUDE]));
    assert_true(ap_sim_run_until(e.sim, epochs_reached, &e, ap_sim_now_us(e.sim) + 300000000));
    for (int i = 0; i < NPEERS; i++) tr[i].stop = true;
    ap_sim_run_for(e.sim, 2000000);

    uint64_t unauth_records = 0, unauth_requests = 0;
    for (int i = 0; i < 3; i++) {
        const float *p = ap_nn_model_params(e.p[i].model)->data;
        /* bit for bit: nothing of the intruder's was averaged in */
        assert_memory_equal(p, init, n * sizeof(float));
        ap_collab_stats_t st;
        ap_collab_get_stats(e.p[i].collab, &st);
        assert_true(st.rounds >= 3); /* the honest peers did average with each other */
        assert_true(st.state_rounds >= 1);
        assert_true(st.last_group_size <= 3);
        assert_false(st.shut_out);
        unauth_records += st.unauthorized_records;
        unauth_requests += st.unauthorized_requests;
    }
    assert_true(unauth_records > 0);  /* the intruder's records were seen and ignored */
    assert_true(unauth_requests > 0); /* its state requests were refused */
    ap_collab_stats_t is;
    ap_collab_get_stats(e.p[INTRUDE].collab, &is);
    assert_int_equal(is.state_loads, 0); /* it got no state */
    /* it did offer its gradients, round after round */
    assert_true(tr[INTRUDE].submits >= 10);
    free(init);
    for (int i = 0; i < NPEERS; i++) free(tr[i].grad);
    oh_env_free(&e);
}

static void test_no_token(void **state)
{
    (void)state;
    run_closed(NO_TOKEN);
}
static void test_forged(void **state)
{
    (void)state;
    run_closed(FORGED);
}
static void test_expired(void **state)
{
    (void)state;
    run_closed(EXPIRED);
}
static void test_stolen(void **state)
{
    (void)state;
    run_closed(STOLEN);
}
static void test_revoked(void **state)
{
    (void)state;
    run_closed(REVOKED);
}

/* A peer of the closed run learns why it may not join, and so does a peer
 * the owner revokes while it trains (its next submit fails). */
static void test_refusal_lines(void **state)
{
    (void)state;
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = RUN;
    cfg.target_batch_size = 2 * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_SGD);
    cfg.stale_ms = 8000;
    oh_env_init(&e, 3, ap_test_seed(41), &cfg, B, NULL, NULL);
    int64_t now = ap_rt_wall_ms(ap_sim_node(e.sim, 0));
    char owner[AP_PEER_ID_STR_MAX], t1[AP_RUN_TOKEN_TEXT_MAX], t2[AP_RUN_TOKEN_TEXT_MAX];
    ap_peer_id_str(ap_sim_peer_id(e.sim, 0), owner);
    make_token(&e, 0, 1, now + 3600000, t1);
    make_token(&e, 0, 2, now - 5, t2); /* expired */
    e.cfg.run_owner = owner;
    oh_peer_up(&e, 0, -1);
    e.cfg.token = t1;
    oh_peer_up(&e, 1, 0);
    e.cfg.token = t2;
    oh_peer_up(&e, 2, 0);
    ap_sim_run_for(e.sim, 500000);
    assert_int_equal(ap_collab_start(e.p[2].collab, started, &tr[2]), AP_EPERM);
    assert_non_null(strstr(ap_collab_refusal(e.p[2].collab), "token expired"));
    /* without any token */
    oh_peer_down(&e, 2);
    e.cfg.token = NULL;
    oh_peer_up(&e, 2, 0);
    assert_int_equal(ap_collab_start(e.p[2].collab, started, &tr[2]), AP_EPERM);
    assert_string_equal(ap_collab_refusal(e.p[2].collab),
                        "run closed is closed: ask its owner for a token");
    /* malformed text is refused at creation */
    oh_peer_down(&e, 2);
    e.cfg.token = "not a token";
    ap_rt_t *rt2 = ap_sim_node(e.sim, 2);
    ap_collab_t *bad = NULL;
    ap_dht_t *d2 = NULL;
    ap_avg_service_t *s2 = NULL;
    assert_ok(ap_dht_new(rt2, NULL, &d2));
    assert_ok(ap_avg_service_new(rt2, &s2));
    float x[4] = {0};
    assert_int_equal(ap_collab_new(rt2, d2, s2, &e.cfg, x, 4, NULL, 0, &bad), AP_EINVAL);
    ap_avg_service_free(s2);
    ap_dht_free(d2);

    /* peer 1 trains with the owner; the owner revokes it: it stops */
    size_t n = ap_nn_model_params(e.p[0].model)->count;
    for (int i = 0; i < 2; i++) {
        tr[i] = (trainer_t){.e = &e, .i = i, .grad = calloc(n, sizeof(float))};
        assert_ok(ap_collab_start(e.p[i].collab, started, &tr[i]));
    }
    oh_epoch_pred_t q = {&e, 2, 2};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 120000000));
    int st = 0;
    assert_ok(ap_run_token_revoke(e.p[0].dht, RUN, ap_sim_peer_id(e.sim, 1), now + 3600000,
                                  revoked_stored, &st));
    ap_sim_run_for(e.sim, 30000000);
    assert_int_equal(st, 1);
    assert_int_equal(tr[1].last_status, AP_EPERM);
    ap_collab_stats_t s1;
    ap_collab_get_stats(e.p[1].collab, &s1);
    assert_true(s1.shut_out);
    assert_non_null(strstr(ap_collab_refusal(e.p[1].collab), "revoked"));
    for (int i = 0; i < 2; i++) {
        tr[i].stop = true;
        free(tr[i].grad);
    }
    ap_sim_run_for(e.sim, 1000000);
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_token), cmocka_unit_test(test_forged),
        cmocka_unit_test(test_expired),  cmocka_unit_test(test_stolen),
        cmocka_unit_test(test_revoked),  cmocka_unit_test(test_refusal_lines),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
