/* DHT record storage: per (key, subkey) latest-expiration-wins, dictionary
 * values, expiry, limits (records, bytes, stores per peer per minute), per-peer
 * quotas (bytes and records each contributor may hold) and fair eviction:
 * when full, the earliest-expiring record of the largest contributor goes
 * first, so one writer cannot push out what others stored. Pure data
 * structure: the caller passes the time in and runs the validators. Internal. */
#ifndef AP_DHT_STORAGE_H
#define AP_DHT_STORAGE_H

#include "apiary/dht.h"

typedef struct ap__dht_srec ap__dht_srec_t;
typedef struct ap__dht_sentry ap__dht_sentry_t;

/* What one contributor (the peer that stored the records; the node itself
 * for local stores) holds here. */
typedef struct ap__dht_contrib {
    struct ap__dht_contrib *next; /* hash chain */
    ap_peer_id_t peer;
    bool local;
    bool pinned;           /* in use by a put: not freed when it empties */
    size_t idx;            /* in the storage's contributor array */
    size_t bytes;          /* accounted bytes of its records */
    ap__dht_srec_t **heap; /* its records, min-heap on exp */
    size_t nheap, heap_cap;
    /* eviction reports (one log line per minute per evicting contributor) */
    int64_t evict_log_ms;
    uint64_t evict_unlogged, evict_unlogged_bytes;
} ap__dht_contrib_t;

struct ap__dht_srec {
    ap__dht_sentry_t *entry;
    ap__dht_contrib_t *contrib;
    size_t heap_idx, cheap_idx; /* in the global and the contributor's heap */
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
    /* per-contributor quotas (SIZE_MAX = none; local stores never limited) */
    size_t peer_max_bytes, peer_max_records;
    ap__dht_contrib_t **ctab; /* hash table of contributors */
    size_t ctab_cap;
    ap__dht_contrib_t **contribs; /* dense, for the largest-contributor scan */
    size_t ncontribs, contribs_cap;
    uint64_t quota_refused;
} ap__dht_storage_t;

/* A store in three steps (check, make room, insert), filled by
 * ap__dht_storage_check. */
typedef struct ap__dht_put_plan {
    const ap_peer_id_t *from; /* NULL = local */
    uint8_t id[AP_DHT_ID_LEN];
    ap__dht_sentry_t *e; /* the key's entry, or NULL */
    size_t replace;      /* index of the record the new one replaces, or SIZE_MAX */
    bool clear_all;      /* kind change: drop everything the key holds */
    size_t need;         /* bytes the new record costs (+ the key for a new entry) */
    size_t freed, freed_recs;
} ap__dht_put_plan_t;

void ap__dht_storage_init(ap__dht_storage_t *st, size_t max_records, size_t max_bytes,
                          int64_t max_ttl_ms, uint32_t per_peer_per_min);
void ap__dht_storage_close(ap__dht_storage_t *st);

/* Per-contributor quotas: bytes and records one peer's stores may hold here
 * (SIZE_MAX = no quota). The default is an eighth of each total. */
void ap__dht_storage_set_quota(ap__dht_storage_t *st, size_t peer_max_bytes,
                               size_t peer_max_records);

/* Charges one store to from (NULL = local, never limited) at monotonic time
 * now_us. AP_ELIMIT when the peer is over its per-minute budget. */
int ap__dht_storage_charge(ap__dht_storage_t *st, const ap_peer_id_t *from, uint64_t now_us);

/* Stores a copy of rec on behalf of from (NULL = this node; sizes/owner
 * already validated by the caller). Returns 0, AP_EEXPIRED (exp <= now),
 * AP_ERANGE (exp beyond now + max_ttl), AP_ESTALE (not newer than what is
 * held), AP_EQUOTA (from would hold more than its quota), AP_EFULL (no room:
 * the record is larger than the storage, or only from's own records could
 * make room and they all expire later), AP_EEXIST (key id collision),
 * AP_ENOMEM. When room must be made, the earliest-expiring record of the
 * largest contributor goes first; each eviction is logged (at most one line
 * per minute per evicting contributor, with counts). */
int ap__dht_storage_put_from(ap__dht_storage_t *st, const ap_peer_id_t *from,
                             const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig,
                             int64_t now_ms);
/* ap__dht_storage_put_from(st, NULL, ...) */
int ap__dht_storage_put(ap__dht_storage_t *st, const ap_dht_record_t *rec, const uint8_t *sig,
                        bool has_sig, int64_t now_ms);

/* The three steps of a put (the caller holds no other mutation in between):
 * check validates and fills plan (no change to the storage); make_room
 * evicts until the record fits (AP_EAGAIN: it evicted from the record's own
 * key, check again); insert copies the record in. */
int ap__dht_storage_check(ap__dht_storage_t *st, const ap_peer_id_t *from,
                          const ap_dht_record_t *rec, int64_t now_ms, ap__dht_put_plan_t *plan);
int ap__dht_storage_make_room(ap__dht_storage_t *st, const ap__dht_put_plan_t *plan,
                              const ap_dht_record_t *rec, int64_t now_ms);
int ap__dht_storage_insert(ap__dht_storage_t *st, ap__dht_put_plan_t *plan,
                           const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig);

/* The contributor holding the most bytes here (NULL when empty). */
const ap__dht_contrib_t *ap__dht_storage_largest(const ap__dht_storage_t *st);
/* What from (NULL = local) holds here: records and bytes (0 when nothing). */
void ap__dht_storage_held(const ap__dht_storage_t *st, const ap_peer_id_t *from, size_t *records,
                          size_t *bytes);

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
