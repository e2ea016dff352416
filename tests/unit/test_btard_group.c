/* The in-process BTARD group (src/btard/experiment.c): 16 peers, logistic
 * regression, d = 100. Every attack with 7 and with 3 Byzantine peers under
 * BTARD: final accuracy within 0.01 of the clean run, every attacker banned,
 * no honest peer banned, a cheating aggregator banned in every step it
 * cheats, false accusers banned; several seeds for the clean and the banning
 * runs. Baselines show the attacks bite: the plain mean with 7 sign-flippers
 * does not learn. */
#include "aptest.h"

#include "btard/experiment.h"

#include <math.h>
#include <stdio.h>

static ap__btard_exp_result_t run(ap__btard_attack_t atk, ap__btard_agg_t agg, int b, uint64_t seed)
{
    ap__btard_exp_cfg_t c = ap__btard_exp_default();
    c.attack = atk;
    c.agg = agg;
    c.byzantine = atk == AP__ATK_NONE ? 0 : b;
    c.seed = seed;
    ap__btard_exp_result_t r;
    assert_ok(ap__btard_exp_run(&c, &r));
    printf("%-16s %-13s b=%d seed=%llu: accuracy %.4f banned %d attackers %d honest, all by "
           "step %d, cheats %d unpunished %d\n",
           ap__btard_attack_name(atk), ap__btard_agg_name(agg), c.byzantine,
           (unsigned long long)seed, r.accuracy, r.attackers_banned, r.honest_banned,
           r.steps_to_ban_all, r.cheats, r.cheats_unpunished);
    return r;
}

static void test_every_attack_banned(void **st)
{
    (void)st;
    const int bs[] = {7, 3};
    const uint64_t seeds[] = {1, 2, 3};
    int nseeds = ap_test_sanitized() ? 1 : 3; /* the sanitizers make each run ~10x slower */
    for (int si = 0; si < nseeds; si++) {
        ap__btard_exp_result_t clean = run(AP__ATK_NONE, AP__AGG_BTARD, 0, seeds[si]);
        assert_int_equal(clean.honest_banned, 0);
        assert_true(clean.accuracy > 0.95);
        for (int bi = 0; bi < 2; bi++)
            for (int a = AP__ATK_SIGN_FLIP; a < AP__ATK__COUNT; a++) {
                ap__btard_exp_result_t r = run(a, AP__AGG_BTARD, bs[bi], seeds[si]);
                assert_int_equal(r.honest_banned, 0);
                assert_int_equal(r.attackers_banned, bs[bi]);
                assert_true(r.steps_to_ban_all > 0);
                if (fabs(r.accuracy - clean.accuracy) > 0.01)
                    fail_msg("%s b=%d: accuracy %.4f vs clean %.4f", ap__btard_attack_name(a),
                             bs[bi], r.accuracy, clean.accuracy);
                if (a == AP__ATK_BAD_AGGREGATOR) {
                    assert_true(r.cheats > 0);
                    assert_int_equal(r.cheats_unpunished, 0);
                }
                if (a == AP__ATK_FALSE_ACCUSER) assert_int_equal(r.false_accusations, bs[bi]);
            }
    }
}

static void test_attacks_bite_without_btard(void **st)
{
    (void)st;
    ap__btard_exp_result_t clean = run(AP__ATK_NONE, AP__AGG_MEAN, 0, 1);
    assert_true(clean.accuracy > 0.95);
    ap__btard_exp_result_t r = run(AP__ATK_SIGN_FLIP, AP__AGG_MEAN, 7, 1);
    assert_true(r.accuracy < 0.7);
    assert_int_equal(r.attackers_banned, 0);
    run(AP__ATK_SIGN_FLIP, AP__AGG_CCLIP, 7, 1);
    ap__btard_exp_result_t bad = run(AP__ATK_BAD_AGGREGATOR, AP__AGG_CCLIP, 7, 1);
    assert_true(bad.cheats > 0 && bad.cheats_unpunished == bad.cheats);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_attack_banned),
        cmocka_unit_test(test_attacks_bite_without_btard),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
