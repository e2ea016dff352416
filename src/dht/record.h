/* DHT records: ids, owner markers, signatures, static checks. Internal. */
#ifndef AP_DHT_RECORD_H
#define AP_DHT_RECORD_H

#include "apiary/dht.h"

#define AP__DHT_OWNER_TAG   "[owner:"
#define AP__DHT_SIGN_DOMAIN "apiary/dht/record/v1"

/* Finds the owner named by key and subkey. Returns 0 and *has_owner=false
 * when neither names one; 0 and the owner when they name one (possibly
 * several times, always the same); AP_EAUTH when a marker is malformed or
 * key and subkey name different owners. */
int ap__dht_find_owner(const ap_dht_record_t *rec, bool *has_owner, ap_peer_id_t *owner);

/* Size checks only (key 1..1024, subkey <= 1024, value <= 64 KiB).
 * AP_EMSGSIZE / AP_EINVAL. */
int ap__dht_check_sizes(const ap_dht_record_t *rec);

/* Owner check: when the record names an owner, sig must be present (has_sig)
 * and valid. When it names none, a signature must be absent. */
int ap__dht_check_owner(const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig);

/* Signatures verified already (ap__dht_check_owner_cached): a ring of
 * BLAKE2b-256 digests of (owner, signed bytes, signature). A digest found
 * means exactly those bytes carried exactly that valid signature, so the
 * ed25519 verification (the DHT's largest CPU cost: every get re-reads the
 * same records from several replicas and from its own store) is skipped. */
#define AP__DHT_SIGCACHE 256
typedef struct ap__dht_sigcache {
    uint8_t d[AP__DHT_SIGCACHE][32];
    uint32_t n, next;
    uint64_t hits, misses;
} ap__dht_sigcache_t;

/* As ap__dht_check_owner, with the cache (NULL = none); a valid signature is
 * remembered, an invalid one never. */
int ap__dht_check_owner_cached(ap__dht_sigcache_t *sc, const ap_dht_record_t *rec,
                               const uint8_t *sig, bool has_sig);

/* Signs rec with rt's key into sig; AP_EPERM unless rt is the owner named by
 * rec (has_sig=false and 0 when it names none). */
int ap__dht_sign(ap_rt_t *rt, const ap_dht_record_t *rec, uint8_t sig[AP_ED25519_SIG_LEN],
                 bool *has_sig);

/* As ap__dht_sign, and remembers the signature as verified in sc. */
int ap__dht_sign_cached(ap_rt_t *rt, ap__dht_sigcache_t *sc, const ap_dht_record_t *rec,
                        uint8_t sig[AP_ED25519_SIG_LEN], bool *has_sig);

/* XOR distance comparison of a and b to target: <0 if a is nearer. */
int ap__dht_cmp_dist(const uint8_t *target, const uint8_t *a, const uint8_t *b);
/* Index (0 = most significant) of the first differing bit, or 160. */
int ap__dht_common_prefix(const uint8_t *a, const uint8_t *b);

#endif
