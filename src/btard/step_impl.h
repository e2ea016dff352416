/* The verified step's state, shared by step.c and step_grad.c. Internal. */
#ifndef AP_BTARD_STEP_IMPL_H
#define AP_BTARD_STEP_IMPL_H

#include "apiary/btard.h"
#include "btard/step_wire.h"

#define H AP_BTARD_HASH_LEN

typedef struct spend {
    struct spend *next;
    ap_peer_id_t from;
    uint8_t ctx[H];
    size_t len;
    uint8_t *b;
} spend_t;

typedef struct step {
    ap_btard_step_svc_t *svc;
    struct step *next;
    ap_btard_step_cfg_t cfg;
    ap_peer_id_t *peers;
    uint64_t *counts, *off;
    size_t n, self;
    uint8_t ctx[H], mprng_ctx[H];
    uint8_t seed[H];
    bool has_state; /* cfg.state was given: state holds it */
    uint8_t state[H];
    bool have_seed, sent_check, sent_report, finished, mprng_running;
    int mprng_status;
    ap__step_commit_t **commit;
    uint8_t **commit_raw; /* each member's first signed StepCommit */
    size_t *commit_len;
    /* a member's second, different, signed StepCommit or AggCheck (the
     * evidence of a step_equivocation with its first, eq_first) */
    uint8_t **eq_raw;
    size_t *eq_len;
    const uint8_t **eq_first;
    size_t *eq_first_len;
    ap__agg_check_t **check;
    uint8_t **check_raw;
    size_t *check_len;
    bool *reported;
    uint32_t *disputes;         /* per part: members disputing it */
    uint8_t (*mine)[H];         /* hash of each part this node sent (zero: none) */
    float *z;                   /* scratch: a direction */
    ap__step_report_t **report; /* each member's report (NULL: none yet) */
    uint64_t *disputed_by;      /* per part: bit i = member i disputes it */
    uint8_t *mfault;            /* per member: its fault in the step's MPRNG round */
    uint8_t **mev;              /* per member: that fault's evidence, a then b */
    size_t *mev_a, *mev_b;      /* their lengths */
    float *grad;                /* scratch: a recomputed vector (total floats) */
    size_t total, grad_for;     /* grad holds member grad_for's (n: none) */
    uint64_t timer;
    int stage; /* 0: waiting for the seed, 1: checks, 2: reports */
} step_t;

struct ap_btard_step_svc {
    ap_rt_t *rt;
    ap_btard_svc_t *mprng;
    step_t *steps;
    spend_t *pend;
    size_t npend;
};

/* Whether member i committed this node's state (always true when this node
 * stated none). */
bool ap__btard_same_state(const step_t *s, size_t i);
/* Adds a conviction of member who (once per member). */
void ap__btard_convict(step_t *s, ap_btard_ban_t *bans, size_t *nb, size_t who,
                       ap_btard_fault_t fault, uint32_t round, const uint8_t *a, size_t alen,
                       const uint8_t *b, size_t blen);
/* A validator's accusations, into its report. */
void ap__btard_grad_accuse(step_t *s, ap__step_report_t *r);
/* Judges every accusation in the reports in hand, convicting into bans. */
void ap__btard_grad_judge(step_t *s, ap_btard_ban_t *bans, size_t *nb, uint32_t *accusations);

#endif
