/* Apiary — Kademlia DHT with expiring, owner-signed records.
 *
 * RECORDS. A record is (key, subkey, value, expiration):
 *   - key:     1..AP_DHT_KEY_MAX bytes;
 *   - subkey:  0..AP_DHT_SUBKEY_MAX bytes; empty = a plain value, non-empty =
 *              one entry of the key's dictionary;
 *   - value:   0..AP_DHT_VALUE_MAX bytes;
 *   - expiration_ms: wall-clock milliseconds since the Unix epoch.
 * Per (key, subkey) the latest expiration wins: a store whose expiration is
 * not later than the stored one is refused (AP_ESTALE). Expired records are
 * never returned. A key holds either one plain value or a dictionary; a store
 * of the other kind replaces it only if it expires later than everything the
 * key holds.
 *
 * OWNERS. A key or subkey that contains "[owner:<PeerID>]" (base58 PeerID)
 * can only be written with that owner's Ed25519 signature over
 * (key, subkey, value, expiration) — see docs/dht.md for the exact bytes.
 * Storing nodes and readers both check. Key and subkey may not name different
 * owners. ap_dht_store() signs automatically when the owner is this node and
 * refuses (AP_EPERM) when it is someone else.
 *
 * IDS. Node ids and key ids are BLAKE2b-160 (20 bytes) of the PeerID bytes
 * (38-byte multihash) and of the key bytes respectively; distance is XOR.
 *
 * THREADING. An ap_dht_t belongs to the loop thread of its runtime. Every
 * function here must be called on that thread; every callback runs on it,
 * except the *_sync wrappers at the end, which are for OTHER threads (a user's
 * thread next to a node of the real driver, apiary/node.h): they post
 * the call to the loop with ap_node_call_sync and block until it completes.
 *
 * MEMORY. Input buffers are copied before the function returns; the caller
 * keeps ownership. Result structures passed to callbacks are owned by the DHT
 * and valid only during the callback: copy what you keep. */
#ifndef APIARY_DHT_H
#define APIARY_DHT_H

#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/peer.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_DHT_PROTO        "/apiary/dht/1"
#define AP_DHT_ID_LEN       20          /* BLAKE2b-160 */
#define AP_DHT_KEY_MAX      1024        /* bytes */
#define AP_DHT_SUBKEY_MAX   1024        /* bytes */
#define AP_DHT_VALUE_MAX    (64u << 10) /* bytes */
#define AP_DHT_MAX_ANNOUNCE 4           /* addresses in ap_dht_config_t.announce */

typedef struct ap_dht ap_dht_t;

typedef struct ap_dht_config {
    int k;                      /* bucket size and lookup width (20) */
    int alpha;                  /* parallel RPCs per lookup (3) */
    int depth_mod;              /* b: split a bucket off the own path if depth % b != 0 (5) */
    int num_replicas;           /* store to this many nearest nodes (5) */
    uint64_t rpc_timeout_us;    /* per RPC (3 s) */
    uint64_t refresh_period_us; /* refresh buckets not touched for this long (10 min) */
    uint64_t backoff_base_us;   /* first back-off of an unresponsive peer (1 s), doubles */
    uint64_t backoff_max_us;    /* cap on the back-off (5 min) */
    int max_failures;           /* drop a peer from the table after this many (3) */
    /* storage limits */
    size_t max_records;                   /* records held for others (100,000) */
    size_t max_bytes;                     /* bytes of keys+subkeys+values held (64 MiB) */
    uint32_t max_stores_per_peer_per_min; /* records a single peer may store per minute (2,000) */
    /* what one peer's stores may hold here (0 = a 32nd of max_bytes /
     * max_records: 2 MiB / 3,125 records by default, so one writer moves a
     * node's memory little); over it a store is refused with AP_EQUOTA. When full,
     * the largest contributor's records are evicted first. */
    size_t max_bytes_per_peer;
    size_t max_records_per_peer;
    int64_t max_ttl_ms; /* refuse expirations further than this in the future (1 day) */
    /* cache of values found by gets */
    size_t cache_max_records; /* (10,000) */
    size_t cache_max_bytes;   /* (8 MiB) */
    bool cache_remote;        /* store found values at the nearest node that lacked them (true) */
    bool client_mode;         /* ask, never answer, never enter routing tables (false) */
    /* Addresses other peers should dial (multiaddrs without /p2p/), e.g. a
     * public IP behind a port mapping; 0 = the runtime's listen addresses.
     * Copied by ap_dht_new. */
    const char *announce[AP_DHT_MAX_ANNOUNCE];
    int nannounce;
    /* Republishing (Kademlia's hourly republish, scaled): every record this
     * node holds for the network is re-stored, as received (signature
     * included), to the key's current nearest nodes once per
     * republish_period_us (10 min; randomized in [3/4, 1] of it), unless a
     * peer stored it here in the meantime (then that peer republished it).
     * A held key whose replica is found dead is republished within about a
     * second. Records that expire within 2 * rpc_timeout_us are never
     * republished. 0 = never republish. */
    uint64_t republish_period_us;
} ap_dht_config_t;

/* Fills cfg with the defaults above. */
AP_EXPORT void ap_dht_config_default(ap_dht_config_t *cfg);

/* A record as the API sees it. Pointers are borrowed (see each use). */
typedef struct ap_dht_record {
    const uint8_t *key;
    size_t key_len;
    const uint8_t *subkey; /* NULL or empty = plain value */
    size_t subkey_len;
    const uint8_t *value;
    size_t value_len;
    int64_t expiration_ms;
} ap_dht_record_t;

/* The result of a get of one key. found is false when nothing unexpired was
 * found (status of the whole get is still 0). A plain value has nrecords = 1
 * and subkey_len = 0; a dictionary lists its live entries (unordered). */
typedef struct ap_dht_result {
    const uint8_t *key;
    size_t key_len;
    bool found;
    bool is_dict;
    size_t nrecords;
    const ap_dht_record_t *records;
    int hops; /* sequential RPC rounds the traversal needed (0 = answered locally) */
} ap_dht_result_t;

/* Validators run on every store (local or from a peer) and on every record a
 * get receives, after the built-in size and owner-signature checks. Return 0
 * to accept, or a negative AP_E* code to refuse. rec is borrowed for the call.
 * from_peer is the peer that sent the record (NULL for local stores). */
typedef int (*ap_dht_validator_fn)(void *arg, const ap_dht_record_t *rec,
                                   const ap_peer_id_t *from_peer);

/* Creates a DHT node on rt (registers AP_DHT_PROTO unless client mode). cfg
 * may be NULL (defaults). *out receives the node. */
AP_EXPORT int ap_dht_new(ap_rt_t *rt, const ap_dht_config_t *cfg, ap_dht_t **out);
/* Stops timers, cancels every pending operation (their callbacks run with
 * AP_ECANCELED before this returns) and frees the node. Never call it from a
 * DHT callback; post it to the loop instead. NULL is a no-op. */
AP_EXPORT void ap_dht_free(ap_dht_t *dht);

/* Switches client mode (see ap_dht_config_t.client_mode) on a running node,
 * e.g. when the node learns it is behind a NAT (apiary/node.h,
 * ap_node_nat_start): a client stops answering and tells the peers it asks
 * not to add it to their routing tables; a node leaving client mode starts
 * answering and republishing. Loop thread. */
AP_EXPORT int ap_dht_set_client_mode(ap_dht_t *dht, bool client);

/* Adds a validator (appended; all must accept). At most 8. */
AP_EXPORT int ap_dht_add_validator(ap_dht_t *dht, ap_dht_validator_fn fn, void *arg);

typedef void (*ap_dht_done_fn)(ap_dht_t *dht, void *arg, int status);

/* Joins the network through initial peers given as multiaddrs (with or
 * without /p2p/). Dials them, pings each, then looks up the own id to fill the
 * routing table. status 0 if at least one answered, else AP_EUNREACH (a WARN
 * line names every address that failed). An initial peer whose node is up
 * but serves no DHT yet (it has just started) is asked again for about 5 s
 * before it counts as failed. addrs are copied. */
AP_EXPORT int ap_dht_bootstrap(ap_dht_t *dht, const char *const *addrs, size_t naddrs,
                               ap_dht_done_fn cb, void *arg);
/* Adds a known peer (id + its address) to the routing table directly, as if
 * it had just answered. Used by tests and by bootstrap. */
AP_EXPORT int ap_dht_add_peer(ap_dht_t *dht, const ap_peer_id_t *peer, const char *addr);

/* get: latest=false returns the first unexpired value found; latest=true
 * traverses until the k nearest nodes answered and returns the newest value,
 * merging dictionaries subkey by subkey. Concurrent gets of one key share one
 * traversal. res is valid only during the callback. */
typedef void (*ap_dht_get_fn)(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res);
AP_EXPORT int ap_dht_get(ap_dht_t *dht, const uint8_t *key, size_t key_len, bool latest,
                         ap_dht_get_fn cb, void *arg);

/* Batch get: one traversal for all keys, packing the keys meant for one peer
 * into one RPC. cb runs once with nkeys results in the order given. */
typedef void (*ap_dht_get_many_fn)(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res,
                                   size_t n);
AP_EXPORT int ap_dht_get_many(ap_dht_t *dht, const uint8_t *const *keys, const size_t *key_lens,
                              size_t nkeys, bool latest, ap_dht_get_many_fn cb, void *arg);

/* Invalid input (sizes, an owner that is not this node, a validator's
 * refusal) is returned at once as an error and cb is not called; otherwise
 * cb runs exactly once, later (never inside these calls). The same holds for
 * ap_dht_get / ap_dht_get_many with an invalid key.
 *
 * store: writes the record to the num_replicas nearest nodes (and locally
 * when this node is one of them). nstored = how many replicas accepted it;
 * status 0 if at least one did, else the first refusal's code (AP_ESTALE,
 * AP_EAUTH, ...) or AP_EUNREACH. */
typedef void (*ap_dht_store_fn)(ap_dht_t *dht, void *arg, int status, int nstored);
AP_EXPORT int ap_dht_store(ap_dht_t *dht, const ap_dht_record_t *rec, ap_dht_store_fn cb,
                           void *arg);

/* Batch store: one traversal for all records; per-record outcome in
 * status[i] / nstored[i] (arrays valid during the callback). */
typedef void (*ap_dht_store_many_fn)(ap_dht_t *dht, void *arg, const int *status,
                                     const int *nstored, size_t n);
AP_EXPORT int ap_dht_store_many(ap_dht_t *dht, const ap_dht_record_t *recs, size_t n,
                                ap_dht_store_many_fn cb, void *arg);

typedef struct ap_dht_stats {
    size_t routing_peers; /* peers in k-buckets */
    size_t routing_buckets;
    size_t replacement_peers;
    size_t stored_keys; /* keys held for the network */
    size_t stored_records;
    size_t stored_bytes;
    size_t cached_records;
    uint64_t rpcs_sent;
    uint64_t finds_sent; /* FIND requests of traversals (a subset of rpcs_sent) */
    uint64_t rpcs_served;
    uint64_t stores_refused;     /* records refused by this node as a storer */
    uint64_t fail_refreshes;     /* bucket refreshes started because a contact failed */
    uint64_t republished;        /* records this node re-stored by republishing */
    uint64_t republish_triggers; /* held keys republished early because a replica died */
    /* background stores (hand-over, cache stores) not sent because the
     * node's memory budget (ap_rt_mem_reserve) or the hand-over's own cap
     * on bytes in flight was full; a hand-over that sent nothing is retried
     * later (handovers_deferred) */
    uint64_t bg_stores_skipped;
    uint64_t handovers_deferred;
} ap_dht_stats_t;
AP_EXPORT void ap_dht_get_stats(ap_dht_t *dht, ap_dht_stats_t *out);

/* The runtime the node lives on. */
AP_EXPORT ap_rt_t *ap_dht_runtime(ap_dht_t *dht);

/* ---- blocking wrappers (user threads; real driver only) --------------------
 * Callable from any thread except the node's loop thread (and the thread
 * driving a caller-driven host): they return AP_ESTATE there. They return
 * AP_ESHUTDOWN if the node closes first. Arguments are borrowed until return. */

/* ap_dht_new / ap_dht_free on the loop thread. */
AP_EXPORT int ap_dht_new_sync(ap_rt_t *rt, const ap_dht_config_t *cfg, ap_dht_t **out);
AP_EXPORT int ap_dht_free_sync(ap_dht_t *dht);
AP_EXPORT int ap_dht_bootstrap_sync(ap_dht_t *dht, const char *const *addrs, size_t naddrs);
/* *nstored (may be NULL) receives the number of replicas that accepted. */
AP_EXPORT int ap_dht_store_sync(ap_dht_t *dht, const ap_dht_record_t *rec, int *nstored);
/* *out receives a deep copy of the result (one allocation, caller frees it
 * with ap_dht_result_free); NULL on error. */
AP_EXPORT int ap_dht_get_sync(ap_dht_t *dht, const uint8_t *key, size_t key_len, bool latest,
                              ap_dht_result_t **out);
AP_EXPORT void ap_dht_result_free(ap_dht_result_t *res);
AP_EXPORT int ap_dht_get_stats_sync(ap_dht_t *dht, ap_dht_stats_t *out);

/* The 20-byte id of a key / of a peer. */
AP_EXPORT void ap_dht_key_id(const uint8_t *key, size_t len, uint8_t id[AP_DHT_ID_LEN]);
AP_EXPORT void ap_dht_peer_node_id(const ap_peer_id_t *peer, uint8_t id[AP_DHT_ID_LEN]);

/* The exact bytes an owner signs for a record (see docs/dht.md). Appends to
 * a malloc'd buffer *out of *out_len bytes; the caller frees it. */
AP_EXPORT int ap_dht_record_sign_bytes(const ap_dht_record_t *rec, uint8_t **out, size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif
