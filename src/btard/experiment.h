/* An in-process BTARD group for experiments, tests and `apiary bench btard`.
 * Internal.
 *
 * n peers train a logistic regression on one public synthetic data set. Each
 * step every peer computes the gradient on its seeded minibatch; the vector
 * is cut into one part per peer and each part aggregated by its owner (mean,
 * or CenteredClip: ButterflyClip); with BTARD the group then runs the checks
 * of docs/btard.md on the step's data (aggregate hashes, the projection
 * check, the gradient check by seeded validators, accusations) and bans whom
 * they convict. Byzantine peers run one of the attacks. Everything happens in
 * one process with no network: the step seeds come from a hash of the run
 * seed and the step, not from MPRNG rounds, and messages are function calls. */
#ifndef AP_BTARD_EXPERIMENT_H
#define AP_BTARD_EXPERIMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum ap__btard_attack {
    AP__ATK_NONE = 0,
    AP__ATK_SIGN_FLIP,  /* sends -1000 x its gradient */
    AP__ATK_RANDOM_DIR, /* all send one random direction from a shared seed, 1000x a gradient's norm
                         */
    AP__ATK_LABEL_FLIP, /* gradient on flipped labels */
    AP__ATK_DELAYED,    /* gradient at the parameters of 10 steps ago */
    AP__ATK_ALIE,       /* "a little is enough": honest mean - z_max * std, per coordinate */
    AP__ATK_IPM,        /* inner-product manipulation: -0.5 x the honest mean */
    AP__ATK_BAD_AGGREGATOR, /* honest gradient; as aggregator adds delta, or sends different results
                             */
    AP__ATK_FALSE_ACCUSER,  /* honest gradient; accuses an honest peer every step */
    AP__ATK__COUNT
} ap__btard_attack_t;

typedef enum ap__btard_agg {
    AP__AGG_MEAN = 0,
    AP__AGG_CCLIP,
    AP__AGG_BTARD,
    AP__AGG__COUNT
} ap__btard_agg_t;

const char *ap__btard_attack_name(ap__btard_attack_t a);
const char *ap__btard_agg_name(ap__btard_agg_t a);

typedef struct ap__btard_exp_cfg {
    int peers;     /* n, 2..64 */
    int byzantine; /* b < n: peers n-b..n-1 attack (from attack_from on) */
    ap__btard_attack_t attack;
    ap__btard_agg_t agg;
    int dim; /* model size d */
    int steps;
    int batch; /* examples per peer per step */
    double lr;
    double tau;      /* CenteredClip radius per part */
    int validators;  /* gradient checks per step */
    int train, test; /* examples */
    uint64_t seed;
} ap__btard_exp_cfg_t;

/* peers 16, byzantine 0, dim 100, steps 300, batch 32, lr 0.5, tau 0.25,
 * validators 2, train 8192, test 4096, seed 1. */
ap__btard_exp_cfg_t ap__btard_exp_default(void);

typedef struct ap__btard_exp_result {
    double accuracy;       /* on the test set after the last step */
    int attackers_banned;  /* by the end */
    int honest_banned;     /* by the end (0 in a correct run) */
    int steps_to_ban_all;  /* first step after which every attacker was banned, or -1 */
    int cheats;            /* steps in which a Byzantine aggregator cheated */
    int cheats_unpunished; /* of those, steps that ended without banning the cheater */
    int false_accusations; /* accusations made by false accusers */
} ap__btard_exp_result_t;

/* Runs one experiment. AP_EINVAL on a bad configuration, AP_ENOMEM. */
int ap__btard_exp_run(const ap__btard_exp_cfg_t *cfg, ap__btard_exp_result_t *res);

#endif
