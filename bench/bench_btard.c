/* `apiary bench btard`: the in-process BTARD group (src/btard/experiment.c:
 * 16 peers, logistic regression, d = 100, SGD) under every attack with each
 * aggregation (mean, centered_clip = ButterflyClip alone, btard = with the
 * checks and bans): final accuracy, the gap to the clean run of the same
 * aggregation, attackers and honest peers banned, steps until every attacker
 * was banned; then the round overhead of ButterflyClip against the plain
 * all-reduce (bench_btard_round.c). Options: --byzantine B (default 7), --peers N (16), --steps S
 * (300; 100 with --quick), --seed S. */
#include "bench.h"

#include "btard/experiment.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>

int ap__bench_btard_round(ap_bench_ctx_t *ctx); /* bench_btard_round.c */

static int run(ap_bench_ctx_t *ctx, int argc, char **argv)
{
    ap__btard_exp_cfg_t base = ap__btard_exp_default();
    base.byzantine = 7;
    if (ctx->quick) base.steps = 100;
    static const struct option lo[] = {{"byzantine", required_argument, NULL, 'b'},
                                       {"peers", required_argument, NULL, 'n'},
                                       {"steps", required_argument, NULL, 's'},
                                       {"seed", required_argument, NULL, 'r'},
                                       {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'b':
            base.byzantine = atoi(optarg);
            break;
        case 'n':
            base.peers = atoi(optarg);
            break;
        case 's':
            base.steps = atoi(optarg);
            break;
        case 'r':
            base.seed = strtoull(optarg, NULL, 10);
            break;
        default:
            fprintf(stderr, "usage: apiary bench btard [--json] [--quick] [--byzantine B] "
                            "[--peers N] [--steps S] [--seed S]\n");
            return 2;
        }
    }
    for (int g = 0; g < AP__AGG__COUNT; g++) {
        ap__btard_exp_cfg_t cc = base;
        cc.agg = (ap__btard_agg_t)g;
        cc.attack = AP__ATK_NONE;
        cc.byzantine = 0;
        ap__btard_exp_result_t clean;
        if (ap__btard_exp_run(&cc, &clean) != 0) {
            fprintf(stderr, "apiary bench btard: bad configuration\n");
            return 2;
        }
        char f[200];
        snprintf(f, sizeof f,
                 "\"attack\":\"none\",\"aggregation\":\"%s\",\"byzantine\":0,\"peers\":%d",
                 ap__btard_agg_name(cc.agg), cc.peers);
        ap_bench_report(ctx, "accuracy", clean.accuracy, "fraction", f);
        for (int a = AP__ATK_SIGN_FLIP; a < AP__ATK__COUNT; a++) {
            ap__btard_exp_cfg_t ac = base;
            ac.agg = cc.agg;
            ac.attack = (ap__btard_attack_t)a;
            ap__btard_exp_result_t r;
            if (ap__btard_exp_run(&ac, &r) != 0) return 2;
            snprintf(f, sizeof f,
                     "\"attack\":\"%s\",\"aggregation\":\"%s\",\"byzantine\":%d,\"peers\":%d",
                     ap__btard_attack_name(ac.attack), ap__btard_agg_name(ac.agg), ac.byzantine,
                     ac.peers);
            ap_bench_report_vs(ctx, "accuracy", r.accuracy, "fraction", clean.accuracy, f);
            ap_bench_report(ctx, "accuracy_gap", clean.accuracy - r.accuracy, "fraction", f);
            ap_bench_report(ctx, "attackers_banned", r.attackers_banned, "peers", f);
            ap_bench_report(ctx, "honest_banned", r.honest_banned, "peers", f);
            ap_bench_report(ctx, "steps_to_ban_all", r.steps_to_ban_all, "steps", f);
        }
    }
    /* one round, plain mean against ButterflyClip, on simulated links */
    return ap__bench_btard_round(ctx);
}

AP_BENCH(bench_btard, "btard", run,
         "BTARD group in process: accuracy and bans per attack x aggregation")
