/* DHT record storage: per (key, subkey) latest-expiration-wins, dictionary
 * values, expiry, limits (records, bytes, stores per peer per minute) and
 * eviction of the earliest-expiring record first. Pure data structure: the
 * caller passes the time in and runs the validators. Internal. */
#ifndef AP_DHT_STORAGE_H
#define AP_DHT_STORAGE_H

#include "apiary/dht.h"

typedef struct ap__dht_srec ap__dht_srec_t;
typedef struct ap__dht_sentry ap__dht_sentry_t;

struct ap__dht_srec {
    ap__dht_sentry_t *entry;
    size_t heap_idx;
    int64_t exp;
    bool has_sig;
    uint8_t sig[AP_ED25519_SIG_LEN];
    uint8_t *subkey, *value; /* into data[] */
    size_t subkey_len, value_len;
    size_t bytes; /* accounted size */
    uint8_t data[];
};

struct ap__dht_sentry {
    ap__dht_sentry_t *next; /* hash chain */
    uint8_t id[AP_DHT_ID_LEN];
    uint8_t *key;
    size_t key_len;
    bool is_dict;
    ap__dht_srec_t **recs; /* plain: one record with an empty subkey */
    size_t nrecs, cap;
    /* Owned by the DHT node (storage only zeroes it): monotonic time at
     * which this node republishes the key's records (0 = not scheduled). */
    uint64_t republish_at_us;
};

#define AP__DHT_RATE_SLOTS 1024

typedef struct ap__dht_rate {
    ap_peer_id_t peer;
    uint64_t window_start_us;
    uint32_t count;
    bool used;
} ap__dht_rate_t;

typedef struct ap__dht_storage {
    ap__dht_sentry_t **tab;
    size_t tab_cap, nentries;
    ap__dht_srec_t **heap; /* min-heap on exp */
    size_t nheap, heap_cap;
    size_t bytes;
    size_t max_records, max_bytes;
    int64_t max_ttl_ms;
    uint32_t per_peer_per_min; /* 0 = unlimited */
    ap__dht_rate_t *rate;      /* AP__DHT_RATE_SLOTS, allocated on first use */
    uint64_t evicted, refused;
} ap__dht_storage_t;

void ap__dht_storage_init(ap__dht_storage_t *st, size_t max_records, size_t max_bytes,
                          int64_t max_ttl_ms, uint32_t per_peer_per_min);
void ap__dht_storage_close(ap__dht_storage_t *st);

/* Charges one store to from (NULL = local, never limited) at monotonic time
 * now_us. AP_ELIMIT when the peer is over its per-minute budget. */
int ap__dht_storage_charge(ap__dht_storage_t *st, const ap_peer_id_t *from, uint64_t now_us);

/* Stores a copy of rec (sizes/owner already validated by the caller).
 * Returns 0, AP_EEXPIRED (exp <= now), AP_ERANGE (exp beyond now + max_ttl),
 * AP_ESTALE (not newer than what is held), AP_ELIMIT (full of records that
 * all expire later), AP_ENOMEM. */
int ap__dht_storage_put(ap__dht_storage_t *st, const ap_dht_record_t *rec, const uint8_t *sig,
                        bool has_sig, int64_t now_ms);

/* Drops every record with exp <= now_ms. */
void ap__dht_storage_expire(ap__dht_storage_t *st, int64_t now_ms);

/* The entry of a key id after expiring old records, or NULL. Valid until the
 * next mutation. */
ap__dht_sentry_t *ap__dht_storage_find(ap__dht_storage_t *st, const uint8_t id[AP_DHT_ID_LEN],
                                       int64_t now_ms);

static inline size_t ap__dht_storage_records(const ap__dht_storage_t *st)
{
    return st->nheap;
}

/* Calls fn for every entry (do not mutate the storage inside). */
void ap__dht_storage_foreach(ap__dht_storage_t *st, void (*fn)(void *arg, ap__dht_sentry_t *e),
                             void *arg);

/* Views a stored record as an API record. */
void ap__dht_srec_view(const ap__dht_sentry_t *e, const ap__dht_srec_t *r, ap_dht_record_t *out);

#endif
