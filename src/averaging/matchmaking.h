/* Matchmaking over the DHT: internal wire helpers (fuzzed in
 * fuzz/fuzz_avg_match.c) and the crash hook for tests. */
#ifndef AP_AVERAGING_MATCHMAKING_H
#define AP_AVERAGING_MATCHMAKING_H

#include "apiary/avg.h"

#define AP__MM_ADDRS_MAX  4
#define AP__MM_MSG_MAX    (256u << 10) /* cap on a request / response / declaration */
#define AP__MM_KEY_MAX    256
#define AP__MM_GROUP_MAX  256 /* members in a matched group */
#define AP__MM_BEGIN      1
#define AP__MM_REJECTED   2
#define AP__MM_REDIRECT   3
#define AP__MM_FULL       4
#define AP__MM_REASON_MAX 128
#define AP__MM_GATHER_MAX AP_AVG_GATHER_MAX

typedef struct ap__mm_member {
    ap_peer_id_t id; /* zero in a declaration */
    ap_avg_role_t role;
    double up, down;
    int64_t exp_ms;
    bool closed;
    int naddrs;
    char addrs[AP__MM_ADDRS_MAX][AP_RT_ADDR_MAX];
    size_t gather_len; /* never in a declaration */
    uint8_t gather[AP__MM_GATHER_MAX];
} ap__mm_member_t;

typedef struct ap__mm_resp {
    uint32_t code;
    char reason[AP__MM_REASON_MAX];
    ap__mm_member_t redirect;
    uint8_t group_id[AP_AVG_GROUP_ID_LEN];
    ap__mm_member_t *members; /* malloc'd (begin only); caller frees */
    size_t n;
} ap__mm_resp_t;

/* Encoders: malloc'd *out of *len bytes (caller frees); AP_EMSGSIZE above
 * AP__MM_MSG_MAX. Decoders validate everything (sizes, finite positive
 * bandwidths, roles, PeerIDs, the code's fields) and return AP_ECORRUPT /
 * AP_EMSGSIZE on bad bytes. */
int ap__mm_decl_encode(const ap__mm_member_t *m, uint8_t **out, size_t *len);
int ap__mm_decl_decode(const uint8_t *b, size_t len, ap__mm_member_t *out);
/* leave: a LEAVE (the asker gives up its held join) instead of a join. */
int ap__mm_req_encode(const uint8_t *key, size_t key_len, const ap__mm_member_t *self, bool leave,
                      uint8_t **out, size_t *len);
/* key_out must hold AP__MM_KEY_MAX bytes; *leave tells a LEAVE from a join. */
int ap__mm_req_decode(const uint8_t *b, size_t len, uint8_t *key_out, size_t *key_len,
                      ap__mm_member_t *self, bool *leave);
int ap__mm_resp_encode(const ap__mm_resp_t *r, uint8_t **out, size_t *len);
int ap__mm_resp_decode(const uint8_t *b, size_t len, ap__mm_resp_t *out);

/* The strict total order of searchers: earlier expiration first, ties by
 * PeerID bytes. < 0 if a comes first. */
int ap__mm_order(int64_t a_exp, const ap_peer_id_t *a, int64_t b_exp, const ap_peer_id_t *b);

/* Crash hook for the simulator: frees the matchmaker and every search
 * without any callback or network call (the node's runtime is gone). Free
 * the DHT first. */
void ap__avg_matchmaker_abandon(ap_avg_matchmaker_t *mm);

#endif
