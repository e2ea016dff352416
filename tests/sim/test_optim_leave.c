/* Peers that leave, on the simulator: every record says how often its peer
 * reports (report_ms), and a reader counts a peer whose record stops changing
 * for a few of those intervals as gone, long before stale_ms.
 *
 * Four peers, stale_ms 60 s (the stale rule alone would count a dead peer for
 * a minute). One peer is four times slower than the others (a batch takes
 * about 6 s of compute, more than the silence a reader tolerates), so it only
 * stays counted because it reports between batches too.
 *   1. While all four train, no peer ever counts fewer than four (sampled
 *      every 0.5 s of virtual time over 40 s): the slow peer is never taken
 *      for gone.
 *   2. A fast peer crashes. Each survivor's peer count drops to three well
 *      before stale_ms (bound: 20 s; measured about 6 s), and the survivors
 *      go on training in groups of three. */
#include "optim_harness.h"

#define B 16
#define N 4

typedef struct count_pred {
    oh_env_t *e;
    int skip; /* the crashed peer */
    uint32_t want;
} count_pred_t;

static bool peers_counted(void *arg)
{
    count_pred_t *q = arg;
    for (int i = 0; i < q->e->n; i++) {
        if (i == q->skip) continue;
        ap_collab_stats_t st;
        ap_collab_get_stats(q->e->p[i].collab, &st);
        if (st.peers != q->want) return false;
    }
    return true;
}

static void test_dead_peer_leaves_count(void **state)
{
    (void)state;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "leave";
    cfg.target_batch_size = 8 * B;
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = 1e-2f;
    cfg.average_state_every = 0;
    cfg.averaging_timeout_us = 5000000;
    cfg.stale_ms = 60000;
    cfg.progress_ttl_ms = 120000;
    static const double flops[N] = {1e9, 1e9, 1e9, 0.16e9}; /* ~1 s and ~6 s per batch */
    oh_env_t e;
    oh_env_init(&e, N, ap_test_seed(47), &cfg, B, flops, NULL);
    for (int i = 0; i < N; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < N; i++) oh_peer_start(&e, i);
    /* everyone sees everyone */
    count_pred_t all = {&e, -1, N};
    assert_true(ap_sim_run_until(e.sim, peers_counted, &all, ap_sim_now_us(e.sim) + 30000000));

    /* 1. nobody is dropped while alive, the slow peer included */
    uint32_t low = N;
    for (int k = 0; k < 80; k++) {
        ap_sim_run_for(e.sim, 500000);
        for (int i = 0; i < N; i++) {
            ap_collab_stats_t st;
            ap_collab_get_stats(e.p[i].collab, &st);
            if (st.peers < low) low = st.peers;
        }
    }
    print_message("lowest peer count over 40 s with all alive: %u\n", low);
    assert_int_equal(low, N);
    uint64_t ep0 = ap_collab_epoch(e.p[0].collab);
    assert_true(ep0 >= 2);

    /* 2. a fast peer dies: the others stop counting it before stale_ms */
    const int dead = 2;
    uint64_t t_crash = ap_sim_now_us(e.sim);
    assert_ok(ap_sim_crash(e.sim, dead));
    count_pred_t three = {&e, dead, N - 1};
    bool dropped =
        ap_sim_run_until(e.sim, peers_counted, &three, t_crash + 20000000); /* stale: 60 s */
    double took = (double)(ap_sim_now_us(e.sim) - t_crash) / 1e6;
    print_message("dead peer out of every survivor's count after %.1f s (stale_ms %.0f s)\n", took,
                  (double)cfg.stale_ms / 1000);
    assert_true(dropped);

    /* training goes on without it, in groups of the three survivors */
    oh_epoch_pred_t q = {&e, ap_collab_epoch(e.p[0].collab) + 2, N - 1};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 60000000));
    for (int i = 0; i < N; i++) {
        if (i == dead) continue;
        ap_collab_stats_t st;
        ap_collab_get_stats(e.p[i].collab, &st);
        assert_true(st.last_group_size <= N - 1);
    }
    oh_env_free(&e);
}

/* A record of an older peer (no report interval) keeps the stale rule: its
 * encoding has no field 23 and decodes with report_ms 0; a record with one
 * round-trips it. */
static void test_report_interval_codec(void **state)
{
    (void)state;
    ap_progress_t p = {0}, q;
    p.epoch = 3;
    p.time_ms = 100000;
    p.epoch_start_ms = 99000;
    uint8_t buf[512], buf2[512];
    int len = ap_progress_encode(&p, buf, sizeof buf);
    assert_true(len > 0);
    memset(&q, 0xff, sizeof q);
    assert_ok(ap_progress_decode(buf, (size_t)len, 100000, 5000, &q));
    assert_int_equal(q.report_ms, 0);
    p.report_ms = 1000;
    int len2 = ap_progress_encode(&p, buf2, sizeof buf2);
    assert_int_equal(len2, len + 4); /* tag 23 (2 bytes) + varint 1000 (2 bytes) */
    assert_ok(ap_progress_decode(buf2, (size_t)len2, 100000, 5000, &q));
    assert_int_equal(q.report_ms, 1000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_report_interval_codec),
        cmocka_unit_test(test_dead_peer_leaves_count),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
