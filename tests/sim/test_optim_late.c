/* Late peers and bad progress on the simulator (issue 8).
 *
 * 1. Late peer: three peers compute a batch per second, a fourth one every
 *    5 s. By the time its batch is in, the others' round of that epoch is
 *    over: its gradients belong to an old epoch and are DISCARDED (DeDLOC /
 *    hivemind semantics) with a log line ("dropping N local samples ...
 *    gradients of an old epoch are discarded", stats.samples_dropped), and
 *    it downloads the state and goes on. The others' rounds stay complete.
 * 2. Impossible progress: two extra DHT nodes keep writing owner-signed
 *    records into the run's progress key — one claiming a million samples at
 *    1 sample/s, one negative samples — both READY in the current epoch.
 *    Honest peers refuse them (stats.records_refused, a WARN "impossible
 *    progress"); trusting them would make every epoch due at once and put a
 *    peer that never answers into every group. Training goes on: every
 *    epoch complete, each averaging between the target and the target plus
 *    one batch per peer, and the loss falls. */
#include "optim_harness.h"

#define B 16

typedef struct log_watch {
    int dropped_lines;
    int refused_lines;
} log_watch_t;

static void sink(void *arg, ap_log_level_t level, const char *module, const char *msg)
{
    log_watch_t *w = arg;
    (void)level;
    if (strcmp(module, "optim") != 0) return;
    if (strstr(msg, "dropping") && strstr(msg, "gradients of an old epoch are discarded"))
        w->dropped_lines++;
    if (strstr(msg, "impossible progress")) w->refused_lines++;
}

static void test_late_peer_drops(void **state)
{
    (void)state;
    enum { N = 4 };
    const uint64_t epochs = ap_test_sanitized() ? 4 : 8;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "late";
    cfg.target_batch_size = 6 * B; /* two batches of each fast peer */
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = 1e-2f;
    cfg.average_state_every = 0;
    cfg.averaging_timeout_us = 5000000;
    static const double flops[N] = {1e9, 1e9, 1e9, 0.2e9}; /* 1 s and 5 s per batch */
    oh_env_t e;
    oh_env_init(&e, N, ap_test_seed(31), &cfg, B, flops, NULL);
    e.max_epochs = epochs;
    log_watch_t w = {0};
    ap_log_level_t level = ap_log_get_level();
    ap_log_set_level(AP_LOG_INFO); /* the drop is logged at INFO */
    ap_log_set_sink(sink, &w);
    for (int i = 0; i < N; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < N; i++) oh_peer_start(&e, i);
    double loss0;
    {
        ap_nn_params_t *pp = ap_nn_model_params(e.p[0].model);
        loss0 = oh_eval(pp->data, pp->count);
    }
    oh_epoch_pred_t q = {&e, epochs, N - 1};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 300000000));
    ap_log_set_sink(NULL, NULL);
    ap_log_set_level(level);
    ap_collab_stats_t slow;
    ap_collab_get_stats(e.p[N - 1].collab, &slow);
    print_message("slow peer: %llu samples dropped, %llu state loads, %d log lines; epoch %llu\n",
                  (unsigned long long)slow.samples_dropped, (unsigned long long)slow.state_loads,
                  w.dropped_lines, (unsigned long long)ap_collab_epoch(e.p[N - 1].collab));
    assert_true(slow.samples_dropped >= B);
    assert_true(slow.state_loads >= 1);
    assert_true(w.dropped_lines >= 1);
    for (int i = 0; i < N - 1; i++) {
        ap_collab_stats_t st;
        ap_collab_get_stats(e.p[i].collab, &st);
        assert_int_equal(st.epochs_failed, 0);
        assert_int_equal(st.samples_dropped, 0); /* the fast peers never lag */
    }
    ap_nn_params_t *pp = ap_nn_model_params(e.p[0].model);
    double loss = oh_eval(pp->data, pp->count);
    print_message("loss %.4f -> %.4f\n", loss0, loss);
    assert_true(loss < 0.8 * loss0);
    oh_env_free(&e);
}

typedef struct liar {
    ap_sim_t *sim;
    int node;
    ap_dht_t *dht;
    oh_env_t *e;
    int kind; /* 0 too many samples for its speed, 1 negative samples */
    uint64_t timer;
    char subkey[AP_PEER_ID_STR_MAX + 16];
} liar_t;

static void liar_stored(ap_dht_t *dht, void *arg, int status, int nstored)
{
    (void)dht;
    (void)arg;
    (void)status;
    (void)nstored;
}

static void liar_joined(ap_dht_t *dht, void *arg, int status)
{
    (void)dht;
    (void)arg;
    (void)status;
}

static void liar_tick(ap_rt_t *rt, void *arg)
{
    liar_t *l = arg;
    ap_progress_t p = {0};
    int64_t now = ap_rt_wall_ms(rt);
    p.epoch = ap_collab_epoch(l->e->p[0].collab); /* always the current epoch */
    p.samples = l->kind == 0 ? 1000000 : -5000;
    p.samples_per_s = 1.0;
    p.time_ms = now;
    p.epoch_start_ms = now - 1000;
    p.ready_ms = now;
    p.role = AP_AVG_NORMAL;
    uint8_t val[256];
    int len = ap_progress_encode(&p, val, sizeof val);
    assert_true(len > 0);
    ap_dht_record_t rec = {.key = (const uint8_t *)"bad_progress",
                           .key_len = strlen("bad_progress"),
                           .subkey = (const uint8_t *)l->subkey,
                           .subkey_len = strlen(l->subkey),
                           .value = val,
                           .value_len = (size_t)len,
                           .expiration_ms = now + 30000};
    ap_dht_store(l->dht, &rec, liar_stored, NULL);
}

typedef struct fault_watch {
    oh_env_t *e;
    uint64_t epochs;
    uint64_t seen[4];
    uint64_t lo, hi; /* averaged samples per step, min and max */
} fault_watch_t;

static bool fault_pred(void *arg)
{
    fault_watch_t *w = arg;
    int done = 0;
    for (int i = 0; i < 4; i++) {
        ap_collab_t *c = w->e->p[i].collab;
        uint64_t ep = ap_collab_epoch(c);
        if (ep != w->seen[i]) {
            ap_collab_stats_t st;
            ap_collab_get_stats(c, &st);
            if (st.last_epoch_samples < w->lo) w->lo = st.last_epoch_samples;
            if (st.last_epoch_samples > w->hi) w->hi = st.last_epoch_samples;
            w->seen[i] = ep;
        }
        if (ep >= w->epochs) done++;
    }
    return done == 4;
}

static void test_impossible_progress_refused(void **state)
{
    (void)state;
    enum { N = 4 };
    const uint64_t epochs = ap_test_sanitized() ? 3 : 6;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "bad";
    cfg.target_batch_size = 2 * N * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = 1e-2f;
    cfg.average_state_every = 0;
    cfg.averaging_timeout_us = 5000000;
    oh_env_t e;
    oh_env_init(&e, N, ap_test_seed(37), &cfg, B, NULL, NULL);
    e.max_epochs = epochs;
    log_watch_t w = {0};
    ap_log_set_sink(sink, &w);
    for (int i = 0; i < N; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    liar_t liars[2];
    for (int k = 0; k < 2; k++) {
        liar_t *l = &liars[k];
        memset(l, 0, sizeof *l);
        l->sim = e.sim;
        l->e = &e;
        l->kind = k;
        ap_sim_node_opts_t o = {.flops = 1e9};
        l->node = ap_sim_add_node(e.sim, &o);
        ap_rt_t *rt = ap_sim_node(e.sim, l->node);
        ap_dht_config_t dc;
        ap_dht_config_default(&dc);
        dc.rpc_timeout_us = 1000000;
        assert_ok(ap_dht_new(rt, &dc, &l->dht));
        const char *ad[1] = {"/sim/0"};
        assert_ok(ap_dht_bootstrap(l->dht, ad, 1, liar_joined, NULL));
        char pid[AP_PEER_ID_STR_MAX];
        ap_peer_id_str(ap_rt_self(rt), pid);
        snprintf(l->subkey, sizeof l->subkey, "[owner:%s]", pid);
    }
    ap_sim_run_for(e.sim, 500000);
    for (int k = 0; k < 2; k++)
        liars[k].timer = ap_rt_timer_start(ap_sim_node(e.sim, liars[k].node), 300000, 300000,
                                           liar_tick, &liars[k]);
    for (int i = 0; i < N; i++) oh_peer_start(&e, i);
    double loss0;
    {
        ap_nn_params_t *pp = ap_nn_model_params(e.p[0].model);
        loss0 = oh_eval(pp->data, pp->count);
    }
    fault_watch_t fw = {.e = &e, .epochs = epochs, .lo = UINT64_MAX};
    assert_true(ap_sim_run_until(e.sim, fault_pred, &fw, ap_sim_now_us(e.sim) + 300000000));
    ap_log_set_sink(NULL, NULL);
    uint64_t refused = 0;
    for (int i = 0; i < N; i++) {
        ap_collab_stats_t st;
        ap_collab_get_stats(e.p[i].collab, &st);
        refused += st.records_refused;
        assert_int_equal(st.epochs_failed, 0);
    }
    ap_nn_params_t *pp = ap_nn_model_params(e.p[0].model);
    double loss = oh_eval(pp->data, pp->count);
    print_message("records refused %llu (%d log lines); samples per step %llu..%llu (target "
                  "%llu); loss %.4f -> %.4f\n",
                  (unsigned long long)refused, w.refused_lines, (unsigned long long)fw.lo,
                  (unsigned long long)fw.hi, (unsigned long long)cfg.target_batch_size, loss0,
                  loss);
    assert_true(refused >= 2);
    assert_true(w.refused_lines >= 2);
    assert_true(fw.lo >= cfg.target_batch_size);
    assert_true(fw.hi <= cfg.target_batch_size + N * B);
    assert_true(loss < 0.8 * loss0);
    for (int k = 0; k < 2; k++) {
        ap_rt_timer_stop(ap_sim_node(e.sim, liars[k].node), liars[k].timer);
        ap_dht_free(liars[k].dht);
    }
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_late_peer_drops),
                                       cmocka_unit_test(test_impossible_progress_refused)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
