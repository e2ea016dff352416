/* SWARM's live rebalancing on the network simulator, routed by the DHT
 * alone (testing/swarm_world.h): servers announce themselves, trainers keep
 * micro-batches in flight, and every server runs its rebalancing loop.
 *   - Two of the three servers of one stage die: that stage becomes the
 *     bottleneck, one server of the most served stage moves there (exactly
 *     one: no herding), trainers route it to its new stage, and the
 *     pipeline's throughput comes back to the new optimum; without the loop
 *     it stays at the bottleneck.
 *   - 4 stages, 12 servers of speeds drawn from {1, 2, 4}, heterogeneous
 *     links, 8 trainers, from a bad initial assignment: rebalancing reaches
 *     >= 0.9 x the optimum of the least stage total, and the trainers
 *     deliver >= 0.9 x that; without rebalancing the bad assignment stays. */
#include "aptest.h"

#include "swarm_world.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SEC 1000000ull

static ap_test_sw_t *world(uint32_t stages, uint32_t slots, uint32_t trainers, uint32_t inflight,
                           bool rebalance, bool hetero, uint64_t seed)
{
    ap_test_sw_cfg_t c = {.stages = stages,
                          .slots = slots,
                          .trainers = trainers,
                          .inflight = inflight,
                          .unit = 20,
                          .rebalance = rebalance,
                          .rebalance_us = 2 * SEC,
                          .announce_us = SEC,
                          .hetero_links = hetero,
                          .seed = ap_test_seed(seed)};
    ap_test_sw_t *w = ap_test_sw_new(&c);
    assert_non_null(w);
    return w;
}

static void print_stages(ap_test_sw_t *w, uint32_t slots, const char *when)
{
    print_message("%s:", when);
    for (uint32_t i = 0; i < slots; i++)
        if (ap_test_sw_up(w, i))
            print_message(" %u@%u(v%.0f%s)", i, ap_test_sw_stage(w, i), ap_test_sw_speed(w, i),
                          ap_test_sw_moves(w, i) ? ",moved" : "");
    print_message("\n");
    for (uint32_t i = 0; getenv("SWARM_DEBUG") && i < slots; i++) {
        ap_swarm_rebalance_stats_t st;
        if (ap_test_sw_rebalance_stats(w, i, &st)) continue;
        print_message("  %u: announced %.0f, %llu checks, %llu skipped, %llu moves, view min %.0f "
                      "-> %.0f\n",
                      i, ap_test_sw_announced(w, i), (unsigned long long)st.checks,
                      (unsigned long long)st.skipped, (unsigned long long)st.moves, st.last_min,
                      st.last_planned);
    }
}

/* Stages 0,1,2 served by 4, 3 and 3 servers of speed 1; two stage-2
 * servers die. */
static double deaths(bool rebalance, uint32_t *moves_out, uint32_t *moved_from0)
{
    static const uint32_t stage[] = {0, 0, 0, 0, 1, 1, 1, 2, 2, 2};
    const uint32_t n = 10;
    ap_test_sw_t *w = world(3, n, 2, 10, rebalance, false, 71);
    for (uint32_t i = 0; i < n; i++) assert_ok(ap_test_sw_start(w, i, stage[i], 1));
    ap_test_sw_run(w, 3 * SEC);
    assert_ok(ap_test_sw_train(w));
    ap_test_sw_run(w, 6 * SEC);
    const double before = ap_test_sw_rate(w, 6 * SEC);
    const double ideal_before = ap_test_sw_assigned(w);
    ap_test_sw_crash(w, 8);
    ap_test_sw_crash(w, 9);
    const double optimum = ap_test_sw_optimum(w);
    const double dip = ap_test_sw_rate(w, 2 * SEC);
    ap_test_sw_run(w, 14 * SEC);
    const double after = ap_test_sw_rate(w, 8 * SEC);
    print_stages(w, n, rebalance ? "with rebalancing" : "without");
    print_message("%s: %.1f samples/s before (ideal %.0f), %.1f just after the deaths, %.1f at "
                  "the end; new optimum %.0f; failed micro-batches %llu\n",
                  rebalance ? "with rebalancing" : "without", before, ideal_before, dip, after,
                  optimum, (unsigned long long)ap_test_sw_failed(w));
    assert_true(before >= 0.85 * ideal_before); /* the trainers keep the pipeline full */
    assert_true(dip < 0.75 * optimum);          /* the bottleneck bites */
    assert_int_equal(ap_test_sw_failed(w), 0);  /* no micro-batch lost */
    uint32_t moves = 0, from0 = 0;
    for (uint32_t i = 0; i < n; i++) {
        moves += ap_test_sw_moves(w, i);
        if (ap_test_sw_moves(w, i) && i < 4) from0++;
        if (ap_test_sw_moves(w, i)) assert_true(ap_test_sw_backwards(w, i) > 0);
    }
    *moves_out = moves;
    *moved_from0 = from0;
    ap_test_sw_free(w);
    return after / optimum;
}

static void test_move_after_deaths(void **state)
{
    (void)state;
    uint32_t moves, from0;
    const double with = deaths(true, &moves, &from0);
    assert_int_equal(moves, 1); /* exactly one mover, from the most served stage */
    assert_int_equal(from0, 1);
    assert_true(with >= 0.9);
    const double without = deaths(false, &moves, &from0);
    assert_int_equal(moves, 0);
    assert_true(without < 0.75);
    print_message("end throughput over the new optimum: %.3f with rebalancing, %.3f without\n",
                  with, without);
}

/* 4 stages, 12 servers of speeds drawn from {1, 2, 4}; stages 1..3 start
 * with one server each, stage 0 with the other nine. */
static void hetero(bool rebalance, double *over_opt, double *efficiency)
{
    const uint32_t n = 12;
    ap_test_sw_t *w = world(4, n, 8, 8, rebalance, true, 72);
    uint64_t r = ap_test_seed(72) * 2654435761u + 7;
    for (uint32_t i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        const double v = (double)(1u << ((r >> 33) % 3));
        assert_ok(ap_test_sw_start(w, i, i < 3 ? i + 1 : 0, v));
    }
    ap_test_sw_run(w, 3 * SEC);
    assert_ok(ap_test_sw_train(w));
    print_stages(w, n, "initial");
    const double start = ap_test_sw_assigned(w);
    ap_test_sw_run(w, 40 * SEC);
    const double rate = ap_test_sw_rate(w, 10 * SEC);
    const double assigned = ap_test_sw_assigned(w), opt = ap_test_sw_optimum(w);
    print_stages(w, n, rebalance ? "after rebalancing" : "without rebalancing");
    print_message("%s: ideal %.0f -> %.0f samples/s (optimum %.0f); trainers deliver %.1f; "
                  "failed %llu\n",
                  rebalance ? "with" : "without", start, assigned, opt, rate,
                  (unsigned long long)ap_test_sw_failed(w));
    assert_true(opt > 0);
    assert_int_equal(ap_test_sw_failed(w), 0);
    *over_opt = rate / opt;
    *efficiency = rate / assigned;
    ap_test_sw_free(w);
}

static void test_eight_trainers(void **state)
{
    (void)state;
    double with, eff, without, eff0;
    hetero(true, &with, &eff);
    hetero(false, &without, &eff0);
    print_message("throughput over the optimum: %.3f with rebalancing (%.3f of its assignment), "
                  "%.3f without\n",
                  with, eff, without);
    assert_true(with >= 0.9);
    assert_true(eff >= 0.9);
    assert_true(without < 0.75);
}

/* Records living 20 s: two of stage 2's three servers die, and their
 * records stay in the DHT long after. They stop being refreshed, so every
 * server's view leaves them out once they are 1.5 announcement periods old,
 * and one stage-0 server moves to stage 2 while the dead records still
 * live (counted, they made stage 2 look served by three). */
static void test_stale_records(void **state)
{
    (void)state;
    static const uint32_t stage[] = {0, 0, 0, 0, 1, 1, 1, 2, 2, 2};
    const uint32_t n = 10;
    ap_test_sw_cfg_t c = {.stages = 3,
                          .slots = n,
                          .trainers = 2,
                          .inflight = 10,
                          .unit = 20,
                          .rebalance = true,
                          .rebalance_us = 2 * SEC,
                          .announce_us = SEC,
                          .record_ttl_us = 20 * SEC,
                          .seed = ap_test_seed(73)};
    ap_test_sw_t *w = ap_test_sw_new(&c);
    assert_non_null(w);
    for (uint32_t i = 0; i < n; i++) assert_ok(ap_test_sw_start(w, i, stage[i], 1));
    ap_test_sw_run(w, 3 * SEC);
    assert_ok(ap_test_sw_train(w));
    ap_test_sw_run(w, 6 * SEC);
    ap_test_sw_crash(w, 8);
    ap_test_sw_crash(w, 9);
    ap_test_sw_run(w, 9 * SEC); /* the dead records have 10 s or more to live */
    print_stages(w, n, "9 s after the deaths");
    uint32_t moves = 0, from0 = 0;
    uint64_t stale = 0;
    for (uint32_t i = 0; i < 8; i++) {
        moves += ap_test_sw_moves(w, i);
        if (ap_test_sw_moves(w, i) && i < 4 && ap_test_sw_stage(w, i) == 2) from0++;
        ap_swarm_rebalance_stats_t st;
        assert_ok(ap_test_sw_rebalance_stats(w, i, &st));
        stale += st.stale;
    }
    const double rate = ap_test_sw_rate(w, 4 * SEC), opt = ap_test_sw_optimum(w);
    print_message("moves %u (from stage 0 to 2: %u), stale records left out %llu; %.1f samples/s "
                  "(optimum %.0f)\n",
                  moves, from0, (unsigned long long)stale, rate, opt);
    assert_int_equal(moves, 1);
    assert_int_equal(from0, 1);
    assert_true(stale > 0);
    assert_true(rate >= 0.9 * opt);
    assert_int_equal(ap_test_sw_failed(w), 0);
    ap_test_sw_free(w);
}

/* A newly started server announces an estimate of its throughput at once,
 * from its compute of a synthetic call, before any trainer calls it: the
 * rebalancing loops need not wait for it to be measured. In the simulator
 * the estimate is exact: speed x unit micro-batches/s, in tokens. */
static void test_newcomer_estimate(void **state)
{
    (void)state;
    ap_test_sw_cfg_t c = {.stages = 2,
                          .slots = 3,
                          .trainers = 1,
                          .inflight = 1,
                          .unit = 20,
                          .rebalance = true,
                          .seed = ap_test_seed(74)};
    ap_test_sw_t *w = ap_test_sw_new(&c);
    assert_non_null(w);
    static const double speed[] = {1, 2, 4};
    for (uint32_t i = 0; i < 3; i++) assert_ok(ap_test_sw_start(w, i, i % 2, speed[i]));
    ap_test_sw_run(w, SEC / 2); /* no trainer */
    for (uint32_t i = 0; i < 3; i++) {
        const double want = speed[i] * c.unit * ap_test_sw_tokens(),
                     got = ap_test_sw_announced(w, i);
        print_message("server %u (stage %u, speed %.0f): announces %.1f tokens/s (estimate %d), "
                      "exact %.1f\n",
                      i, i % 2, speed[i], got, ap_test_sw_estimated(w, i), want);
        assert_true(ap_test_sw_estimated(w, i));
        assert_true(fabs(got - want) <= 1e-6 * want);
        assert_int_equal(ap_test_sw_backwards(w, i), 0);
    }
    ap_test_sw_free(w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_move_after_deaths), cmocka_unit_test(test_eight_trainers),
        cmocka_unit_test(test_stale_records), cmocka_unit_test(test_newcomer_estimate)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
