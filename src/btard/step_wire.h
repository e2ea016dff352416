/* BTARD verified-step messages on the wire (proto/btard.proto, kinds 3..5
 * of Signed). Internal. */
#ifndef AP_BTARD_STEP_WIRE_H
#define AP_BTARD_STEP_WIRE_H

#include "apiary/btard.h"
#include "apiary/peer.h"

enum { AP__BTARD_STEP_COMMIT = 3, AP__BTARD_AGG_CHECK = 4, AP__BTARD_STEP_REPORT = 5 };

typedef struct ap__step_commit {
    uint8_t ctx[AP_BTARD_HASH_LEN];
    double weight;
    uint32_t n; /* parts (the group's size) */
    uint8_t part[AP_BTARD_STEP_MAX_PEERS][AP_BTARD_HASH_LEN];
    uint8_t recv[AP_BTARD_STEP_MAX_PEERS][AP_BTARD_HASH_LEN];
    bool has_agg;
    uint8_t agg[AP_BTARD_HASH_LEN];
    bool has_state;
    uint8_t state[AP_BTARD_HASH_LEN]; /* the public state it computed on */
} ap__step_commit_t;

typedef struct ap__agg_check {
    uint8_t ctx[AP_BTARD_HASH_LEN];
    uint32_t part;
    uint8_t seed[AP_BTARD_HASH_LEN];
    uint8_t agg[AP_BTARD_HASH_LEN];
    double tau;
    uint32_t n; /* entries */
    ap_btard_agg_entry_t e[AP_BTARD_STEP_MAX_PEERS];
} ap__agg_check_t;

typedef struct ap__step_report {
    uint8_t ctx[AP_BTARD_HASH_LEN];
    uint32_t n;
    uint32_t disputed[AP_BTARD_STEP_MAX_PEERS];
    uint32_t nacc; /* accusations: (acc_target[i], acc_part[i]) */
    uint32_t acc_target[AP_BTARD_STEP_MAX_PEERS];
    uint32_t acc_part[AP_BTARD_STEP_MAX_PEERS];
} ap__step_report_t;

/* One decoded, signature-checked step message. */
typedef struct ap__step_msg {
    uint32_t kind;
    ap_peer_id_t sender;
    union {
        ap__step_commit_t commit;
        ap__agg_check_t check;
        ap__step_report_t report;
    } u;
} ap__step_msg_t;

/* Encodes and signs m (as m->sender) into out (cap >= AP_BTARD_STEP_MSG_MAX).
 * Returns the length, 0 on failure. */
size_t ap__step_msg_encode(const ap__step_msg_t *m, ap_btard_sign_fn sign, void *sign_arg,
                           uint8_t *out, size_t cap);
/* Decodes b (at most AP_BTARD_STEP_MSG_MAX bytes), checks every length and
 * the signature. AP_EMSGSIZE, AP_ECORRUPT, AP_ENOTSUP (another kind), AP_EAUTH. */
int ap__step_msg_decode(const uint8_t *b, size_t len, ap__step_msg_t *m);

#endif
