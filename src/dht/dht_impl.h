/* Internals of the DHT node, shared by its files:
 *   dht.c           public entry points, configuration, lifetime, common helpers
 *   dht_lookup.c    the iterative traversal, get, store, node lookups
 *   dht_serve.c     requests from peers
 *   dht_maintain.c  background calls, hand-over, refresh, republishing
 *   dht_boot.c      bootstrap
 * The API is apiary/dht.h. */
#ifndef AP_DHT_IMPL_H
#define AP_DHT_IMPL_H

#include "apiary/dht.h"
#include "dht/record.h"
#include "dht/routing.h"
#include "dht/storage.h"
#include "dht/wire.h"

#define MOD                  "dht"
#define MAX_VALIDATORS       8
#define HANDOVER_MAX_RECORDS 256                /* per new contact */
#define HANDOVER_DELAY_US    2000000ull         /* a new contact must stay this long */
#define HANDOVER_PENDING_MAX 64                 /* new contacts waiting for their hand-over */
#define HANDOVER_RECENT      256                /* peers handed to recently (per-peer limit) */
#define HANDOVER_PEER_US     (600ull * 1000000) /* one hand-over per peer per 10 min */
#define HANDOVER_RATE        (4.0 * 1048576)    /* bytes per second, node-wide */
#define HANDOVER_BURST       (16.0 * 1048576)   /* bytes */
#define HANDOVER_INFLIGHT    (32u << 20)        /* bytes of hand-over calls in flight */
#define HANDOVER_TRIES       4                  /* a deferred hand-over is tried this often */

typedef struct lookup lookup_t;
typedef struct call call_t;
typedef struct bgcall bgcall_t;
typedef struct boot boot_t;

typedef struct validator {
    ap_dht_validator_fn fn;
    void *arg;
} validator_t;

struct ap_dht {
    ap_rt_t *rt;
    ap_dht_config_t cfg;
    uint8_t self_id[AP_DHT_ID_LEN];
    ap__dht_routing_t table;
    ap__dht_storage_t store;
    ap__dht_storage_t cache;
    ap__dht_sigcache_t sigcache; /* signatures verified already */
    validator_t validators[MAX_VALIDATORS];
    int nvalidators;
    uint64_t maint_timer;
    lookup_t *lookups;
    bgcall_t *bgcalls;
    boot_t *boots;
    bool registered;
    ap_dht_stats_t stats;
    char announce[AP_DHT_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int nannounce;
    uint64_t repub_timer;      /* periodic republish scan */
    uint64_t repub_soon_timer; /* one-shot scan after a replica was found dead */
    /* hand-over (dht_maintain.c): only to contacts that stay, within a byte
     * budget for the node, at most once per peer per HANDOVER_PEER_US */
    struct {
        ap_peer_id_t peer;
        uint64_t due_us;
        bool used;
        uint8_t tries; /* deferred this often (budget full) */
    } ho_pending[HANDOVER_PENDING_MAX];
    struct {
        ap_peer_id_t peer;
        uint64_t at_us;
    } ho_recent[HANDOVER_RECENT];
    size_t ho_recent_next;
    uint64_t ho_timer;
    double ho_tokens; /* bytes */
    uint64_t ho_tokens_us;
    size_t ho_inflight; /* bytes of hand-over STOREs not yet answered */
    /* circuit addresses (through a relay) of peers that sent us requests,
     * passed on in FIND answers next to the contact's one direct address:
     * a peer behind NAT is reached by them. Allocated on first use (only
     * NATed peers have them), at most AP__DHT_CIRCUITS_MAX, oldest evicted
     * (dht_circuits.c). */
    struct ap__dht_circuit *circ;
    size_t ncirc, cap_circ;
};

/* ---- circuit addresses (dht_circuits.c) ---- */

#define AP__DHT_CIRCUITS_MAX 512

typedef struct ap__dht_circuit {
    ap_peer_id_t peer;
    uint64_t seen_us;
    char addr[AP_RT_ADDR_MAX];
} ap__dht_circuit_t;

/* Learns from a request's sender addresses (n of them): the first circuit
 * address among them is kept for peer; none forgets the one kept (the peer
 * lost its reservation or no longer needs one). */
void ap__dht_circuit_note(ap_dht_t *dht, const ap_peer_id_t *peer, char **addrs, size_t n);
/* The circuit address kept for peer, or NULL. */
const char *ap__dht_circuit_of(const ap_dht_t *dht, const ap_peer_id_t *peer);
void ap__dht_circuits_free(ap_dht_t *dht);

/* ---- lookups (dht_lookup.c) ---- */

enum { LK_GET = 1, LK_STORE = 2, LK_NODES = 3 };
enum { C_NEW = 0, C_INFLIGHT = 1, C_DONE = 2, C_FAILED = 3 };

typedef struct cand {
    ap__dht_contact_t c;
    uint8_t state;
    bool had_value;
    int depth;
} cand_t;

typedef struct lk_key {
    uint8_t id[AP_DHT_ID_LEN];
    uint8_t *key;
    size_t key_len;
    cand_t *cands;
    int ncands;
    int inflight;
    bool done, found;
    int hops;
    ap__dht_storage_t merged; /* GET: records found so far (latest wins) */
    size_t *recs;             /* STORE: indexes into lk->srecs */
    size_t nrecs;
} lk_key_t;

struct call {
    lookup_t *lk;
    call_t *next;
    uint64_t id;
    ap_peer_id_t peer;
    char addr[AP_RT_ADDR_MAX];
    int depth;
    size_t n;
    size_t *idx; /* key indexes (FIND) or record indexes (STORE) */
    bool store;
};

typedef struct waiter {
    ap_dht_get_fn cb;
    void *arg;
    struct waiter *next;
} waiter_t;

typedef struct srec {
    ap_dht_record_t r; /* points into data */
    uint8_t sig[AP_ED25519_SIG_LEN];
    bool has_sig;
    uint8_t *data;
} srec_t;

struct lookup {
    ap_dht_t *dht;
    lookup_t *prev, *next;
    int kind;
    bool latest;
    bool finished;
    bool storing; /* STORE: phase 2 */
    lk_key_t *keys;
    size_t nkeys;
    call_t *calls;
    uint64_t start_timer;
    waiter_t *waiters;
    ap_dht_get_many_fn many_cb;
    void *many_arg;
    ap_dht_store_many_fn store_cb;
    void *store_arg;
    ap_dht_done_fn done_cb;
    void *done_arg;
    srec_t *srecs;
    size_t nsrecs;
    int *status;
    int *nstored;
};

/* dht.c */
const char *ap__dht_short_id(const ap_peer_id_t *p, char buf[AP_PEER_SHORT_LEN]);
/* Size and owner checks, then the registered validators: 0 or an AP_E* code. */
int ap__dht_validate(ap_dht_t *dht, const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig,
                     const ap_peer_id_t *from);
/* Sends q (with this node's sender info) to peer; the call id or 0. */
uint64_t ap__dht_send_request(ap_dht_t *dht, const ap_peer_id_t *peer, Apiary__Dht__Request *q,
                              ap_rpc_done_fn done, void *arg);
void ap__dht_learn_addrs(ap_dht_t *dht, const ap_peer_id_t *peer, char **addrs, size_t n);

/* dht_lookup.c */
int ap__dht_find_nodes(ap_dht_t *dht, const uint8_t id[AP_DHT_ID_LEN], ap_dht_done_fn cb,
                       void *arg);
void ap__dht_lookup_cancel(lookup_t *lk, int err);
/* Stores the n records of sr (taken over) on their keys' nearest nodes. */
int ap__dht_store_launch(ap_dht_t *dht, srec_t *sr, size_t n, ap_dht_store_many_fn cb, void *arg);
void ap__dht_lookup_cancel_all(ap_dht_t *dht);

/* dht_serve.c: the RPC handler */
void ap__dht_on_request(ap_rt_t *rt, void *arg, ap_rpc_req_t *req);

/* dht_maintain.c */
void ap__dht_peer_seen(ap_dht_t *dht, const ap_peer_id_t *peer, const char *addr);
void ap__dht_contact_failed(ap_dht_t *dht, const ap_peer_id_t *peer, uint64_t now);
/* Stores recs on peer in the background (cache stores, hand-over), in
 * STORE batches whose bytes are reserved in the node's memory budget on the
 * peer's account (ap_rt_mem_reserve) until each call completes. Stops at
 * the first batch the budget cannot hold, or (handover) that would take
 * the hand-over's bytes in flight past HANDOVER_INFLIGHT. Returns the
 * number of records sent (the first ones). */
size_t ap__dht_store_records_bg(ap_dht_t *dht, const ap_peer_id_t *peer,
                                const ap_dht_record_t *recs,
                                const uint8_t (*sigs)[AP_ED25519_SIG_LEN], const bool *has_sig,
                                size_t n, bool handover);
void ap__dht_republish_postpone(ap_dht_t *dht, const uint8_t id[AP_DHT_ID_LEN]);
void ap__dht_maintenance(ap_rt_t *rt, void *arg);
void ap__dht_republish_tick(ap_rt_t *rt, void *arg);
void ap__dht_bg_cancel_all(ap_dht_t *dht);

/* dht_boot.c */
void ap__dht_boot_lookup_done(ap_dht_t *dht, void *arg, int status);
void ap__dht_boot_cancel_all(ap_dht_t *dht);

#endif
