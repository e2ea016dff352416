/* Kademlia routing table: k-buckets with replacement lists, the relaxed split
 * rule (split a bucket that holds the own id, or whose depth is not a multiple
 * of b), liveness-checked eviction, exponential back-off of unresponsive
 * peers, stale-bucket detection. Pure data structure (time passed in).
 * Internal. */
#ifndef AP_DHT_ROUTING_H
#define AP_DHT_ROUTING_H

#include "apiary/dht.h"

/* Addresses longer than this are not kept in the table (the runtime still
 * knows them; they are just not relayed in FIND answers). Keeps a contact at
 * ~180 bytes so 10,000 simulated nodes with rich tables fit in memory. */
#define AP__DHT_CONTACT_ADDR_MAX 96

typedef struct ap__dht_contact {
    ap_peer_id_t peer;
    uint8_t id[AP_DHT_ID_LEN];
    char addr[AP__DHT_CONTACT_ADDR_MAX]; /* one dialable address ("" if unknown) */
    uint64_t last_seen_us;
    uint64_t backoff_until_us;
    int failures;
} ap__dht_contact_t;

typedef struct ap__dht_bucket {
    uint8_t prefix[AP_DHT_ID_LEN];
    int depth;
    ap__dht_contact_t *nodes; /* up to k, least recently seen first */
    int n, cap_nodes;
    ap__dht_contact_t *repl; /* up to k, most recently seen last */
    int nrepl, cap_repl;
    uint64_t last_touched_us;
    uint64_t fail_refresh_us; /* last refresh started because a contact here failed */
    bool checking;            /* a liveness ping of nodes[0] is in flight */
} ap__dht_bucket_t;

typedef struct ap__dht_routing {
    uint8_t self[AP_DHT_ID_LEN];
    int k, b, max_failures;
    uint64_t backoff_base_us, backoff_max_us;
    ap__dht_bucket_t *buckets;
    int nbuckets, cap;
} ap__dht_routing_t;

typedef enum {
    AP__RT_ADDED = 0,   /* new contact in a bucket */
    AP__RT_UPDATED = 1, /* already known: refreshed */
    AP__RT_PENDING = 2, /* bucket full: parked in the replacement list; ping *check */
    AP__RT_IGNORED = 3, /* own id */
} ap__rt_add_result_t;

int ap__dht_routing_init(ap__dht_routing_t *rt, const uint8_t self[AP_DHT_ID_LEN], int k, int b,
                         int max_failures, uint64_t backoff_base_us, uint64_t backoff_max_us);
void ap__dht_routing_close(ap__dht_routing_t *rt);

/* Records that peer answered us or sent us a request (now_us). addr may be
 * NULL or "" (keeps the known one). When the result is AP__RT_PENDING and
 * *check is non-NULL on return, the caller should ping *check (the bucket's
 * least recently seen contact) and report the outcome with
 * ap__dht_routing_seen / ap__dht_routing_failed. Negative AP_E* on error. */
int ap__dht_routing_seen(ap__dht_routing_t *rt, const ap_peer_id_t *peer, const char *addr,
                         uint64_t now_us, ap__dht_contact_t **check);

/* Records that an RPC to peer failed: backs it off exponentially; after
 * max_failures it is replaced by the freshest replacement (or dropped when
 * failures reach twice the limit and no replacement exists). Returns true if
 * the peer was removed from the buckets. */
bool ap__dht_routing_failed(ap__dht_routing_t *rt, const ap_peer_id_t *peer, uint64_t now_us);

/* Removes a peer from buckets and replacement lists. */
void ap__dht_routing_remove(ap__dht_routing_t *rt, const ap_peer_id_t *peer);

ap__dht_contact_t *ap__dht_routing_lookup(ap__dht_routing_t *rt, const ap_peer_id_t *peer);

/* Up to max contacts nearest to target (XOR), nearest first, skipping peers
 * backed off at now_us (unless include_backed_off). Copies into out. */
int ap__dht_routing_nearest(ap__dht_routing_t *rt, const uint8_t target[AP_DHT_ID_LEN], int max,
                            uint64_t now_us, bool include_backed_off, ap__dht_contact_t *out);

size_t ap__dht_routing_size(const ap__dht_routing_t *rt);
size_t ap__dht_routing_replacements(const ap__dht_routing_t *rt);

/* The bucket index holding id. */
int ap__dht_routing_bucket_of(const ap__dht_routing_t *rt, const uint8_t id[AP_DHT_ID_LEN]);

/* A uniformly random id within bucket i, from 20 random bytes rnd. */
void ap__dht_routing_random_id(const ap__dht_routing_t *rt, int i, const uint8_t rnd[AP_DHT_ID_LEN],
                               uint8_t out[AP_DHT_ID_LEN]);

#endif
