/* The collaboration's byte counters: bytes_sent and bytes_received cover
 * every averaging round, the gradient rounds and the state rounds
 * (average_state_every). Two peers on equal links with raw float32 on the
 * wire: in a round of V floats each peer sends the other's half of its vector
 * and the mean of its own half, and receives as much, so every round adds at
 * least 4·V bytes each way (frame headers on top); gradient rounds move the
 * parameters (n floats), state rounds the parameters and the optimizer state
 * (n + state_count). */
#include "optim_harness.h"

#define NPEERS 2
#define B      16

static void test_state_rounds_counted(void **state)
{
    (void)state;
    oh_env_t e;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "bytes";
    cfg.target_batch_size = NPEERS * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg.codec = AP_AVG_CODEC_F32;
    cfg.state_codec = AP_AVG_CODEC_F32;
    cfg.average_state_every = 1;
    cfg.averaging_timeout_us = 20000000;
    const uint64_t epochs = 4;
    oh_env_init(&e, NPEERS, ap_test_seed(13), &cfg, B, NULL, NULL);
    e.max_epochs = epochs;
    for (int i = 0; i < NPEERS; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < NPEERS; i++) oh_peer_start(&e, i);
    oh_epoch_pred_t q = {&e, epochs, NPEERS};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 300000000));
    ap_sim_run_for(e.sim, 10000000); /* the last rounds end; trainers stopped */
    for (int i = 0; i < NPEERS; i++) {
        ap_collab_t *c = e.p[i].collab;
        ap_collab_stats_t st;
        ap_collab_get_stats(c, &st);
        size_t sc = 0;
        ap_collab_buffers(c, NULL, NULL, NULL, &sc);
        uint64_t n = ap_nn_model_params(e.p[i].model)->count;
        assert_true(sc > 0); /* Adam: the moments are averaged too */
        assert_int_equal(st.epochs_failed, 0);
        assert_true(st.rounds >= 1);
        assert_true(st.state_rounds >= 1);
        uint64_t floor = 4 * (st.rounds * n + st.state_rounds * (n + sc));
        printf("peer %d: %llu gradient + %llu state rounds of %llu / %llu floats: sent %llu, "
               "received %llu bytes (at least %llu each)\n",
               i, (unsigned long long)st.rounds, (unsigned long long)st.state_rounds,
               (unsigned long long)n, (unsigned long long)(n + sc),
               (unsigned long long)st.bytes_sent, (unsigned long long)st.bytes_received,
               (unsigned long long)floor);
        assert_true(st.bytes_sent >= floor);
        assert_true(st.bytes_received >= floor);
        /* and the headers are a small part: no round counted twice */
        assert_true(st.bytes_sent < floor + floor / 10);
        assert_true(st.bytes_received < floor + floor / 10);
    }
    oh_env_free(&e);
}

int main(void)
{
    ap_log_set_level(AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_state_rounds_counted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
