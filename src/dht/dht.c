/* DHT node: RPC handlers, iterative traversal, get/store, caching,
 * coalescing, bootstrap, maintenance and hand-over. Sans-I/O: runtime.h only.
 * Design notes in docs/dht.md. */
#include "apiary/dht.h"

#include "apiary/log.h"
#include "dht/record.h"
#include "dht/routing.h"
#include "dht/storage.h"
#include "dht/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD                  "dht"
#define MAX_VALIDATORS       8
#define HANDOVER_MAX_RECORDS 256 /* per new contact */
#ifndef AP__DHT_JOIN_PASSES
#define AP__DHT_JOIN_PASSES 1
#endif

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
};

/* ---- small helpers --------------------------------------------------------- */

static void contact_failed(ap_dht_t *dht, const ap_peer_id_t *peer, uint64_t now);
static void republish_postpone(ap_dht_t *dht, const uint8_t id[AP_DHT_ID_LEN]);
static void republish_after_failure(ap_dht_t *dht, const uint8_t dead[AP_DHT_ID_LEN], uint64_t now);

void ap_dht_config_default(ap_dht_config_t *c)
{
    memset(c, 0, sizeof *c);
    c->k = 20;
    c->alpha = 3;
    c->depth_mod = 5;
    c->num_replicas = 5;
    c->rpc_timeout_us = 3000000;
    c->refresh_period_us = 600ull * 1000000;
    c->backoff_base_us = 1000000;
    c->backoff_max_us = 300ull * 1000000;
    c->max_failures = 3;
    c->max_records = 100000;
    c->max_bytes = 64u << 20;
    c->max_stores_per_peer_per_min = 2000;
    c->max_ttl_ms = 24 * 3600 * 1000;
    c->cache_max_records = 10000;
    c->cache_max_bytes = 8u << 20;
    c->cache_remote = true;
    c->client_mode = false;
    c->republish_period_us = 600ull * 1000000;
}

static const char *short_id(const ap_peer_id_t *p, char buf[AP_PEER_SHORT_LEN])
{
    return ap_peer_id_short(p, buf);
}

static int validate(ap_dht_t *dht, const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig,
                    const ap_peer_id_t *from)
{
    int rc = ap__dht_check_sizes(rec);
    if (!rc) rc = ap__dht_check_owner(rec, sig, has_sig);
    for (int i = 0; !rc && i < dht->nvalidators; i++) {
        rc = dht->validators[i].fn(dht->validators[i].arg, rec, from);
        if (rc > 0) rc = AP_EINVAL;
    }
    return rc;
}

/* Packs a Request with this node's sender info and the given body. */
static int pack_request(ap_dht_t *dht, Apiary__Dht__Request *q, uint8_t **out, size_t *len)
{
    char addrs[AP__DHT_MAX_ADDRS][AP_RT_ADDR_MAX];
    char *ptrs[AP__DHT_MAX_ADDRS];
    if (dht->cfg.client_mode) {
        q->client = true;
    } else {
        int n;
        if (dht->nannounce > 0) {
            n = dht->nannounce;
            for (int i = 0; i < n; i++) ptrs[i] = dht->announce[i];
        } else {
            n = ap_rt_listen_addrs(dht->rt, addrs, AP__DHT_MAX_ADDRS, false);
            if (n > AP__DHT_MAX_ADDRS) n = AP__DHT_MAX_ADDRS;
            for (int i = 0; i < n; i++) ptrs[i] = addrs[i];
        }
        q->n_sender_addrs = n > 0 ? (size_t)n : 0;
        q->sender_addrs = ptrs;
    }
    size_t sz = apiary__dht__request__get_packed_size(q);
    uint8_t *buf = malloc(sz ? sz : 1);
    if (!buf) return AP_ENOMEM;
    apiary__dht__request__pack(q, buf);
    q->sender_addrs = NULL;
    q->n_sender_addrs = 0;
    *out = buf;
    *len = sz;
    return 0;
}

static uint64_t send_request(ap_dht_t *dht, const ap_peer_id_t *peer, Apiary__Dht__Request *q,
                             ap_rpc_done_fn done, void *arg)
{
    uint8_t *buf;
    size_t len;
    if (pack_request(dht, q, &buf, &len)) return 0;
    ap_rpc_opts_t o = {.timeout_us = dht->cfg.rpc_timeout_us, .max_resp = AP__DHT_MSG_MAX};
    uint64_t id = ap_rt_rpc_call(dht->rt, peer, AP_DHT_PROTO, buf, len, &o, done, arg);
    free(buf);
    if (id) dht->stats.rpcs_sent++;
    return id;
}

static void learn_addrs(ap_dht_t *dht, const ap_peer_id_t *peer, char **addrs, size_t n)
{
    for (size_t i = 0; i < n; i++) ap_rt_add_addr(dht->rt, peer, addrs[i]);
}

/* ---- background calls: pings, cache stores, hand-over ---------------------- */

enum { BG_PING = 1, BG_STORE = 2 };

struct bgcall {
    ap_dht_t *dht;
    bgcall_t *prev, *next;
    uint64_t id;
    int kind;
    ap_peer_id_t peer;
};

static void bg_unlink(ap_dht_t *dht, bgcall_t *b)
{
    if (b->prev)
        b->prev->next = b->next;
    else
        dht->bgcalls = b->next;
    if (b->next) b->next->prev = b->prev;
}

static void peer_seen(ap_dht_t *dht, const ap_peer_id_t *peer, const char *addr);

static void bg_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    bgcall_t *b = arg;
    ap_dht_t *dht = b->dht;
    bg_unlink(dht, b);
    if (status == AP_ECANCELED) {
        free(b);
        return;
    }
    uint64_t now = ap_rt_now_us(rt);
    if (status == 0 || status == AP_ELIMIT || status == AP_EPROTO) {
        /* the peer answered (even a refusal proves liveness) */
        peer_seen(dht, &b->peer, NULL);
    } else {
        char s[AP_PEER_SHORT_LEN];
        ap_debug(MOD, "peer %s: %s rpc failed: %s", short_id(&b->peer, s),
                 b->kind == BG_PING ? "ping" : "store", ap_err_name(status));
        contact_failed(dht, &b->peer, now);
    }
    free(b);
}

static void bg_send(ap_dht_t *dht, const ap_peer_id_t *peer, int kind, Apiary__Dht__Request *q)
{
    bgcall_t *b = calloc(1, sizeof *b);
    if (!b) return;
    b->dht = dht;
    b->kind = kind;
    b->peer = *peer;
    b->next = dht->bgcalls;
    if (b->next) b->next->prev = b;
    dht->bgcalls = b;
    b->id = send_request(dht, peer, q, bg_done, b);
    if (!b->id) {
        bg_unlink(dht, b);
        free(b);
    }
}

static void ping_peer(ap_dht_t *dht, const ap_peer_id_t *peer)
{
    Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
    Apiary__Dht__PingRequest p = APIARY__DHT__PING_REQUEST__INIT;
    q.body_case = APIARY__DHT__REQUEST__BODY_PING;
    q.ping = &p;
    bg_send(dht, peer, BG_PING, &q);
}

/* Sends records (views + signatures) to peer in STORE batches. */
static void store_records_bg(ap_dht_t *dht, const ap_peer_id_t *peer, const ap_dht_record_t *recs,
                             const uint8_t (*sigs)[AP_ED25519_SIG_LEN], const bool *has_sig,
                             size_t n)
{
    size_t i = 0;
    while (i < n) {
        Apiary__Dht__Record pbs[AP__DHT_MAX_BATCH];
        Apiary__Dht__Record *ptrs[AP__DHT_MAX_BATCH];
        size_t cnt = 0, bytes = 0;
        while (i < n && cnt < AP__DHT_MAX_BATCH) {
            size_t sz = recs[i].key_len + recs[i].subkey_len + recs[i].value_len + 96;
            if (cnt && bytes + sz > AP__DHT_RESP_BUDGET) break;
            ap__dht_record_to_pb(&recs[i], sigs[i], has_sig[i], &pbs[cnt]);
            ptrs[cnt] = &pbs[cnt];
            bytes += sz;
            cnt++;
            i++;
        }
        Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
        Apiary__Dht__StoreRequest sr = APIARY__DHT__STORE_REQUEST__INIT;
        sr.records = ptrs;
        sr.n_records = cnt;
        q.body_case = APIARY__DHT__REQUEST__BODY_STORE;
        q.store = &sr;
        bg_send(dht, peer, BG_STORE, &q);
    }
}

/* ---- hand-over --------------------------------------------------------------
 * When a new contact enters the table, every record this node holds whose key
 * is nearer to the newcomer than to this node is sent to it: the newcomer is
 * now among the key's nearest nodes. */

typedef struct handover {
    ap_dht_t *dht;
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_record_t *recs;
    uint8_t (*sigs)[AP_ED25519_SIG_LEN];
    bool *has_sig;
    size_t n;
} handover_t;

static void handover_entry(void *arg, ap__dht_sentry_t *e)
{
    handover_t *h = arg;
    if (h->n >= HANDOVER_MAX_RECORDS) return;
    if (ap__dht_cmp_dist(e->id, h->id, h->dht->self_id) >= 0) return;
    for (size_t i = 0; i < e->nrecs && h->n < HANDOVER_MAX_RECORDS; i++) {
        ap__dht_srec_view(e, e->recs[i], &h->recs[h->n]);
        memcpy(h->sigs[h->n], e->recs[i]->sig, AP_ED25519_SIG_LEN);
        h->has_sig[h->n] = e->recs[i]->has_sig;
        h->n++;
    }
}

static void handover(ap_dht_t *dht, const ap_peer_id_t *peer)
{
    if (dht->cfg.client_mode || ap__dht_storage_records(&dht->store) == 0) return;
    ap__dht_storage_expire(&dht->store, ap_rt_wall_ms(dht->rt));
    handover_t h = {.dht = dht};
    ap_dht_peer_node_id(peer, h.id);
    h.recs = malloc(HANDOVER_MAX_RECORDS * sizeof *h.recs);
    h.sigs = malloc(HANDOVER_MAX_RECORDS * sizeof *h.sigs);
    h.has_sig = malloc(HANDOVER_MAX_RECORDS * sizeof *h.has_sig);
    if (h.recs && h.sigs && h.has_sig) {
        ap__dht_storage_foreach(&dht->store, handover_entry, &h);
        if (h.n) {
            char s[AP_PEER_SHORT_LEN];
            ap_debug(MOD, "peer %s: handing over %zu records", short_id(peer, s), h.n);
            store_records_bg(dht, peer, h.recs, (const uint8_t(*)[AP_ED25519_SIG_LEN])h.sigs,
                             h.has_sig, h.n);
        }
    }
    free(h.recs);
    free(h.sigs);
    free(h.has_sig);
}

/* A peer answered us or contacted us (not in client mode). */
static void peer_seen(ap_dht_t *dht, const ap_peer_id_t *peer, const char *addr)
{
    ap__dht_contact_t *check = NULL;
    int r = ap__dht_routing_seen(&dht->table, peer, addr, ap_rt_now_us(dht->rt), &check);
    if (r == AP__RT_ADDED) {
        handover(dht, peer);
    } else if (r == AP__RT_PENDING && check) {
        ap_peer_id_t c = check->peer; /* liveness check of the least recently seen */
        ping_peer(dht, &c);
    }
}

/* ---- lookups ----------------------------------------------------------------- */

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

/* How many of the nearest live candidates must answer before a key is
 * settled: k for gets and node lookups; 2 * num_replicas for stores, whose
 * record goes to the num_replicas nearest of those. (With every node's id
 * wrong — fixed in 2a608ee — stores needed a beam of k at N = 3,000; with
 * correct ids 2 * num_replicas places every record on its key's true nearest
 * nodes: test_store_get, bench dht at N = 1,000 and 10,000, docs/dht.md.) */
static int lk_beam(const lookup_t *lk)
{
    int k = lk->dht->cfg.k;
    if (lk->kind == LK_STORE && 2 * lk->dht->cfg.num_replicas < k)
        return 2 * lk->dht->cfg.num_replicas;
    return k;
}

static int cand_cap(const ap_dht_t *dht)
{
    return 3 * dht->cfg.k;
}

static void add_cand(lookup_t *lk, lk_key_t *kk, const ap__dht_contact_t *c, int depth)
{
    ap_dht_t *dht = lk->dht;
    if (ap_peer_id_eq(&c->peer, ap_rt_self(dht->rt))) return;
    for (int i = 0; i < kk->ncands; i++)
        if (memcmp(kk->cands[i].c.id, c->id, AP_DHT_ID_LEN) == 0) return;
    int cap = cand_cap(dht);
    if (kk->ncands == cap && ap__dht_cmp_dist(kk->id, c->id, kk->cands[cap - 1].c.id) >= 0) return;
    int pos = kk->ncands < cap ? kk->ncands : cap - 1;
    if (kk->ncands == cap && kk->cands[pos].state == C_INFLIGHT) return; /* keep in-flight ones */
    while (pos > 0 && ap__dht_cmp_dist(kk->id, c->id, kk->cands[pos - 1].c.id) < 0) {
        kk->cands[pos] = kk->cands[pos - 1];
        pos--;
    }
    memset(&kk->cands[pos], 0, sizeof kk->cands[pos]);
    kk->cands[pos].c = *c;
    kk->cands[pos].depth = depth;
    if (kk->ncands < cap) kk->ncands++;
}

static cand_t *find_cand(lk_key_t *kk, const ap_peer_id_t *peer)
{
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_peer_node_id(peer, id);
    for (int i = 0; i < kk->ncands; i++)
        if (memcmp(kk->cands[i].c.id, id, AP_DHT_ID_LEN) == 0) return &kk->cands[i];
    return NULL;
}

static void lk_unlink(ap_dht_t *dht, lookup_t *lk)
{
    if (lk->prev)
        lk->prev->next = lk->next;
    else if (dht->lookups == lk)
        dht->lookups = lk->next;
    if (lk->next) lk->next->prev = lk->prev;
    lk->prev = lk->next = NULL;
}

static void lk_free(lookup_t *lk)
{
    for (size_t i = 0; i < lk->nkeys; i++) {
        free(lk->keys[i].key);
        free(lk->keys[i].cands);
        free(lk->keys[i].recs);
        ap__dht_storage_close(&lk->keys[i].merged);
    }
    free(lk->keys);
    for (size_t i = 0; i < lk->nsrecs; i++) free(lk->srecs[i].data);
    free(lk->srecs);
    free(lk->status);
    free(lk->nstored);
    while (lk->waiters) {
        waiter_t *w = lk->waiters;
        lk->waiters = w->next;
        free(w);
    }
    free(lk);
}

static void cancel_calls(lookup_t *lk)
{
    while (lk->calls) {
        call_t *c = lk->calls;
        lk->calls = c->next;
        c->lk = NULL; /* orphan: its done callback frees it */
        ap_rt_rpc_cancel(lk->dht->rt, c->id);
    }
}

/* Builds the API view of a key's merged records. *arr is malloc'd. */
static void key_result(lookup_t *lk, lk_key_t *kk, ap_dht_result_t *res, ap_dht_record_t **arr)
{
    memset(res, 0, sizeof *res);
    res->key = kk->key;
    res->key_len = kk->key_len;
    res->hops = kk->hops;
    *arr = NULL;
    ap__dht_sentry_t *e = ap__dht_storage_find(&kk->merged, kk->id, ap_rt_wall_ms(lk->dht->rt));
    if (!e || e->nrecs == 0) return;
    *arr = calloc(e->nrecs, sizeof **arr);
    if (!*arr) return;
    for (size_t i = 0; i < e->nrecs; i++) ap__dht_srec_view(e, e->recs[i], &(*arr)[i]);
    res->found = true;
    res->is_dict = e->is_dict;
    res->nrecords = e->nrecs;
    res->records = *arr;
}

/* Caches a found key locally and at the nearest visited node that lacked it
 * (Kademlia: "the closest node it observed to the key that did not return
 * the value"; nearer nodes that returned it are skipped). */
static void cache_found(lookup_t *lk, lk_key_t *kk)
{
    ap_dht_t *dht = lk->dht;
    int64_t now = ap_rt_wall_ms(dht->rt);
    ap__dht_sentry_t *e = ap__dht_storage_find(&kk->merged, kk->id, now);
    if (!e || !e->nrecs) return;
    size_t n = e->nrecs < AP__DHT_MAX_BATCH ? e->nrecs : AP__DHT_MAX_BATCH;
    ap_dht_record_t recs[AP__DHT_MAX_BATCH];
    uint8_t sigs[AP__DHT_MAX_BATCH][AP_ED25519_SIG_LEN];
    bool has_sig[AP__DHT_MAX_BATCH];
    for (size_t i = 0; i < n; i++) {
        ap__dht_srec_view(e, e->recs[i], &recs[i]);
        memcpy(sigs[i], e->recs[i]->sig, AP_ED25519_SIG_LEN);
        has_sig[i] = e->recs[i]->has_sig;
        (void)ap__dht_storage_put(&dht->cache, &recs[i], sigs[i], has_sig[i], now);
    }
    if (!dht->cfg.cache_remote) return;
    for (int i = 0; i < kk->ncands; i++) {
        cand_t *c = &kk->cands[i];
        if (c->state == C_DONE && !c->had_value) {
            store_records_bg(dht, &c->c.peer, recs, (const uint8_t(*)[AP_ED25519_SIG_LEN])sigs,
                             has_sig, n);
            break;
        }
    }
}

static void lk_finish(lookup_t *lk)
{
    ap_dht_t *dht = lk->dht;
    lk->finished = true;
    lk_unlink(dht, lk);
    if (lk->start_timer) ap_rt_timer_stop(dht->rt, lk->start_timer);
    cancel_calls(lk);
    if (lk->kind == LK_GET) {
        size_t n = lk->nkeys;
        ap_dht_result_t *res = calloc(n, sizeof *res);
        ap_dht_record_t **arrs = calloc(n, sizeof *arrs);
        int status = res && arrs ? 0 : AP_ENOMEM;
        for (size_t i = 0; !status && i < n; i++) {
            key_result(lk, &lk->keys[i], &res[i], &arrs[i]);
            if (res[i].found && lk->keys[i].hops > 0) cache_found(lk, &lk->keys[i]);
        }
        for (waiter_t *w = lk->waiters; w; w = w->next)
            w->cb(dht, w->arg, status, status ? NULL : &res[0]);
        if (lk->many_cb) lk->many_cb(dht, lk->many_arg, status, status ? NULL : res, n);
        for (size_t i = 0; arrs && i < n; i++) free(arrs[i]);
        free(arrs);
        free(res);
    } else if (lk->kind == LK_STORE) {
        for (size_t i = 0; i < lk->nsrecs; i++) {
            if (lk->nstored[i] > 0)
                lk->status[i] = 0;
            else if (lk->status[i] == 0)
                lk->status[i] = AP_EUNREACH;
        }
        if (lk->store_cb) lk->store_cb(dht, lk->store_arg, lk->status, lk->nstored, lk->nsrecs);
    } else if (lk->done_cb) {
        lk->done_cb(dht, lk->done_arg, 0);
    }
    lk_free(lk);
}

static void lk_cancel(lookup_t *lk, int err)
{
    ap_dht_t *dht = lk->dht;
    lk->finished = true;
    lk_unlink(dht, lk);
    if (lk->start_timer) ap_rt_timer_stop(dht->rt, lk->start_timer);
    cancel_calls(lk);
    for (waiter_t *w = lk->waiters; w; w = w->next) w->cb(dht, w->arg, err, NULL);
    if (lk->many_cb) lk->many_cb(dht, lk->many_arg, err, NULL, 0);
    if (lk->store_cb) {
        for (size_t i = 0; i < lk->nsrecs; i++) lk->status[i] = err;
        lk->store_cb(dht, lk->store_arg, lk->status, lk->nstored, lk->nsrecs);
    }
    if (lk->done_cb) lk->done_cb(dht, lk->done_arg, err);
    lk_free(lk);
}

static void on_call_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                         const char *errmsg);

static call_t *call_new(lookup_t *lk, const ap_peer_id_t *peer, size_t nidx, int depth)
{
    call_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->idx = malloc((nidx ? nidx : 1) * sizeof *c->idx);
    if (!c->idx) {
        free(c);
        return NULL;
    }
    c->lk = lk;
    c->peer = *peer;
    c->depth = depth;
    return c;
}

static void call_free(call_t *c)
{
    free(c->idx);
    free(c);
}

static void call_unlink(lookup_t *lk, call_t *c)
{
    for (call_t **pp = &lk->calls; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            return;
        }
}

/* Sends one FIND to peer with the keys in idx. */
static bool send_find(lookup_t *lk, const ap_peer_id_t *peer, const char *addr, const size_t *idx,
                      size_t n, int depth)
{
    ap_dht_t *dht = lk->dht;
    call_t *c = call_new(lk, peer, n, depth);
    if (!c) return false;
    if (addr) snprintf(c->addr, sizeof c->addr, "%s", addr);
    ProtobufCBinaryData ids[AP__DHT_MAX_BATCH];
    for (size_t i = 0; i < n; i++) {
        c->idx[i] = idx[i];
        ids[i].data = lk->keys[idx[i]].id;
        ids[i].len = AP_DHT_ID_LEN;
    }
    c->n = n;
    Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
    Apiary__Dht__FindRequest f = APIARY__DHT__FIND_REQUEST__INIT;
    f.key_ids = ids;
    f.n_key_ids = n;
    q.body_case = APIARY__DHT__REQUEST__BODY_FIND;
    q.find = &f;
    c->next = lk->calls;
    lk->calls = c;
    c->id = send_request(dht, peer, &q, on_call_done, c);
    if (!c->id) {
        call_unlink(lk, c);
        call_free(c);
        return false;
    }
    dht->stats.finds_sent++;
    return true;
}

/* Whether a key's traversal is over: the beam's nearest live candidates all
 * answered. */
static bool key_settled(lookup_t *lk, lk_key_t *kk)
{
    if (kk->done) return true;
    if (lk->kind == LK_GET && !lk->latest && kk->found) return true;
    int seen = 0;
    for (int i = 0; i < kk->ncands && seen < lk_beam(lk); i++) {
        cand_t *c = &kk->cands[i];
        if (c->state == C_FAILED) continue;
        if (c->state != C_DONE) return false;
        seen++;
    }
    return true;
}

static void start_store_phase(lookup_t *lk);

static void lk_pump(lookup_t *lk)
{
    ap_dht_t *dht = lk->dht;
    uint64_t now = ap_rt_now_us(dht->rt);
    /* Choose peers: per key, up to alpha in flight among the beam's NEW ones. */
    typedef struct pick {
        ap_peer_id_t peer;
        const char *addr;
        size_t idx[AP__DHT_MAX_BATCH];
        size_t n;
        int depth;
    } pick_t;
    size_t maxpicks = lk->nkeys * (size_t)dht->cfg.alpha;
    pick_t *picks = calloc(maxpicks ? maxpicks : 1, sizeof *picks);
    size_t npicks = 0;
    if (!picks) {
        lk_cancel(lk, AP_ENOMEM);
        return;
    }
    for (size_t ki = 0; ki < lk->nkeys; ki++) {
        lk_key_t *kk = &lk->keys[ki];
        if (kk->done) continue;
        if (key_settled(lk, kk)) {
            kk->done = true;
            continue;
        }
        int slots = dht->cfg.alpha - kk->inflight;
        int seen = 0;
        for (int i = 0; i < kk->ncands && seen < lk_beam(lk) && slots > 0; i++) {
            cand_t *c = &kk->cands[i];
            if (c->state == C_FAILED) continue;
            seen++;
            if (c->state != C_NEW) continue;
            /* pack with an existing pick for the same peer */
            size_t p = 0;
            while (p < npicks && !ap_peer_id_eq(&picks[p].peer, &c->c.peer)) p++;
            if (p == npicks) {
                if (npicks == maxpicks) break;
                picks[p].peer = c->c.peer;
                picks[p].addr = c->c.addr;
                picks[p].n = 0;
                picks[p].depth = c->depth;
                npicks++;
            }
            if (picks[p].n == AP__DHT_MAX_BATCH) continue;
            picks[p].idx[picks[p].n++] = ki;
            if (c->depth > picks[p].depth) picks[p].depth = c->depth;
            c->state = C_INFLIGHT;
            kk->inflight++;
            slots--;
        }
    }
    /* Packing: a picked peer that is also a NEW beam candidate of another key
     * gets that key in the same RPC. */
    for (size_t p = 0; p < npicks; p++) {
        for (size_t ki = 0; ki < lk->nkeys && picks[p].n < AP__DHT_MAX_BATCH; ki++) {
            lk_key_t *kk = &lk->keys[ki];
            if (kk->done) continue;
            int seen = 0;
            for (int i = 0; i < kk->ncands && seen < lk_beam(lk); i++) {
                cand_t *c = &kk->cands[i];
                if (c->state == C_FAILED) continue;
                seen++;
                if (c->state == C_NEW && ap_peer_id_eq(&c->c.peer, &picks[p].peer)) {
                    picks[p].idx[picks[p].n++] = ki;
                    c->state = C_INFLIGHT;
                    kk->inflight++;
                    break;
                }
            }
        }
    }
    for (size_t p = 0; p < npicks; p++) {
        if (!send_find(lk, &picks[p].peer, picks[p].addr, picks[p].idx, picks[p].n,
                       picks[p].depth)) {
            for (size_t i = 0; i < picks[p].n; i++) {
                lk_key_t *kk = &lk->keys[picks[p].idx[i]];
                cand_t *c = find_cand(kk, &picks[p].peer);
                if (c) c->state = C_FAILED;
                kk->inflight--;
            }
        }
    }
    free(picks);
    (void)now;
    /* Done when every key settled and nothing it still needs is in flight. */
    bool all = true;
    for (size_t ki = 0; ki < lk->nkeys; ki++) {
        lk_key_t *kk = &lk->keys[ki];
        if (!kk->done && key_settled(lk, kk)) kk->done = true;
        if (!kk->done) all = false;
    }
    if (all) {
        if (lk->kind == LK_STORE)
            start_store_phase(lk);
        else
            lk_finish(lk);
    } else if (!lk->calls) {
        /* nothing in flight and nothing to send: every key is settled by now */
        for (size_t ki = 0; ki < lk->nkeys; ki++) lk->keys[ki].done = true;
        if (lk->kind == LK_STORE)
            start_store_phase(lk);
        else
            lk_finish(lk);
    }
}

static void handle_find_result(lookup_t *lk, call_t *c, lk_key_t *kk,
                               const Apiary__Dht__FindResult *fr)
{
    ap_dht_t *dht = lk->dht;
    cand_t *cd = find_cand(kk, &c->peer);
    bool had = false;
    if (lk->kind == LK_GET) {
        int64_t now = ap_rt_wall_ms(dht->rt);
        for (size_t j = 0; j < fr->n_records; j++) {
            ap_dht_record_t r;
            const uint8_t *sig;
            bool has_sig;
            if (ap__dht_record_from_pb(fr->records[j], &r, &sig, &has_sig)) continue;
            if (r.key_len != kk->key_len || memcmp(r.key, kk->key, r.key_len) != 0) continue;
            int rc = validate(dht, &r, sig, has_sig, &c->peer);
            if (rc) {
                char s[AP_PEER_SHORT_LEN];
                ap_warn(MOD, "peer %s: refused a record it returned: %s", short_id(&c->peer, s),
                        ap_err_name(rc));
                continue;
            }
            rc = ap__dht_storage_put(&kk->merged, &r, sig, has_sig, now);
            if (rc == 0 || rc == AP_ESTALE) had = true;
        }
        if (had && !kk->found) {
            kk->found = true;
            kk->hops = c->depth;
        }
        if (had && lk->latest && c->depth > kk->hops) kk->hops = c->depth;
    }
    if (cd) {
        cd->had_value = had;
        cd->state = C_DONE;
    }
    for (size_t j = 0; j < fr->n_nearest; j++) {
        ap__dht_contact_t nc;
        memset(&nc, 0, sizeof nc);
        if (ap__dht_peerinfo_check(fr->nearest[j], &nc.peer)) continue;
        ap_dht_peer_node_id(&nc.peer, nc.id);
        if (fr->nearest[j]->n_addrs) {
            learn_addrs(dht, &nc.peer, fr->nearest[j]->addrs, fr->nearest[j]->n_addrs);
            if (strlen(fr->nearest[j]->addrs[0]) < sizeof nc.addr)
                strcpy(nc.addr, fr->nearest[j]->addrs[0]);
        }
        /* a peer we know is backed off is not worth asking now */
        ap__dht_contact_t *known = ap__dht_routing_lookup(&dht->table, &nc.peer);
        if (known && known->backoff_until_us > ap_rt_now_us(dht->rt)) continue;
        add_cand(lk, kk, &nc, c->depth + 1);
    }
}

static void store_call_done(lookup_t *lk, call_t *c, int status, const Apiary__Dht__Response *r)
{
    for (size_t i = 0; i < c->n; i++) {
        size_t ri = c->idx[i];
        int st = status;
        if (!st) st = i < r->store->n_status ? r->store->status[i] : AP_EPROTO;
        if (st > 0) st = AP_EPROTO;
        if (st == 0)
            lk->nstored[ri]++;
        else if (lk->status[ri] == 0 || lk->status[ri] == AP_EUNREACH)
            lk->status[ri] = st;
    }
}

static void on_call_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                         const char *errmsg)
{
    call_t *c = arg;
    lookup_t *lk = c->lk;
    if (!lk || lk->finished) { /* orphaned by cancel */
        call_free(c);
        return;
    }
    ap_dht_t *dht = lk->dht;
    call_unlink(lk, c);
    char s[AP_PEER_SHORT_LEN];
    Apiary__Dht__Response *r = NULL;
    if (status == 0) {
        int rc = ap__dht_decode_response(resp, len, &r);
        int want = c->store ? APIARY__DHT__RESPONSE__BODY_STORE : APIARY__DHT__RESPONSE__BODY_FIND;
        if (rc == 0 && (int)r->body_case != want) rc = AP_EPROTO;
        if (rc == 0 && !c->store && r->find->n_results != c->n) rc = AP_EPROTO;
        if (rc) {
            ap_warn(MOD, "peer %s: malformed response: %s", short_id(&c->peer, s), ap_err_name(rc));
            if (r) apiary__dht__response__free_unpacked(r, NULL);
            r = NULL;
            status = rc;
        }
    }
    uint64_t now = ap_rt_now_us(rt);
    if (status == 0 ||
        (c->store && status != AP_ETIMEDOUT && status != AP_EUNREACH && status != AP_ECLOSED))
        peer_seen(dht, &c->peer, c->addr);
    else if (status != AP_ECANCELED)
        contact_failed(dht, &c->peer, now);
    if (c->store) {
        store_call_done(lk, c, status, r);
    } else {
        for (size_t i = 0; i < c->n; i++) {
            lk_key_t *kk = &lk->keys[c->idx[i]];
            kk->inflight--;
            if (status == 0) {
                handle_find_result(lk, c, kk, r->find->results[i]);
            } else {
                cand_t *cd = find_cand(kk, &c->peer);
                if (cd) cd->state = C_FAILED;
            }
        }
    }
    if (r) apiary__dht__response__free_unpacked(r, NULL);
    call_free(c);
    if (lk->storing) {
        if (!lk->calls) lk_finish(lk);
    } else {
        lk_pump(lk);
    }
}

/* STORE phase 2: every record goes to the num_replicas nearest nodes that
 * answered the traversal (and to this node when it is one of them). */
static void start_store_phase(lookup_t *lk)
{
    ap_dht_t *dht = lk->dht;
    lk->storing = true;
    int64_t now = ap_rt_wall_ms(dht->rt);
    int nrep = dht->cfg.num_replicas;
    typedef struct target {
        ap_peer_id_t peer;
        size_t *idx;
        size_t n, cap;
    } target_t;
    target_t *tg = NULL;
    size_t ntg = 0, captg = 0;
    for (size_t ki = 0; ki < lk->nkeys; ki++) {
        lk_key_t *kk = &lk->keys[ki];
        int taken = 0;
        bool self_in = false;
        for (int i = 0; i < kk->ncands && taken < nrep; i++) {
            cand_t *c = &kk->cands[i];
            if (c->state != C_DONE) continue;
            if (!self_in && !dht->cfg.client_mode &&
                ap__dht_cmp_dist(kk->id, dht->self_id, c->c.id) < 0) {
                self_in = true;
                taken++;
                if (taken == nrep) break;
            }
            size_t t = 0;
            while (t < ntg && !ap_peer_id_eq(&tg[t].peer, &c->c.peer)) t++;
            if (t == ntg) {
                if (ntg == captg) {
                    size_t nc = captg ? captg * 2 : 8;
                    target_t *n2 = realloc(tg, nc * sizeof *n2);
                    if (!n2) continue;
                    tg = n2;
                    captg = nc;
                }
                memset(&tg[ntg], 0, sizeof tg[ntg]);
                tg[ntg].peer = c->c.peer;
                ntg++;
            }
            for (size_t j = 0; j < kk->nrecs; j++) {
                if (tg[t].n == tg[t].cap) {
                    size_t nc = tg[t].cap ? tg[t].cap * 2 : 8;
                    size_t *n2 = realloc(tg[t].idx, nc * sizeof *n2);
                    if (!n2) break;
                    tg[t].idx = n2;
                    tg[t].cap = nc;
                }
                tg[t].idx[tg[t].n++] = kk->recs[j];
            }
            taken++;
        }
        if (taken < nrep && !dht->cfg.client_mode) self_in = true;
        if (self_in) {
            for (size_t j = 0; j < kk->nrecs; j++) {
                srec_t *sr = &lk->srecs[kk->recs[j]];
                int rc = ap__dht_storage_put(&dht->store, &sr->r, sr->sig, sr->has_sig, now);
                if (rc == 0) republish_postpone(dht, kk->id);
                if (rc == 0)
                    lk->nstored[kk->recs[j]]++;
                else if (lk->status[kk->recs[j]] == 0)
                    lk->status[kk->recs[j]] = rc;
            }
        }
    }
    for (size_t t = 0; t < ntg; t++) {
        size_t i = 0;
        while (i < tg[t].n) {
            Apiary__Dht__Record pbs[AP__DHT_MAX_BATCH];
            Apiary__Dht__Record *ptrs[AP__DHT_MAX_BATCH];
            call_t *c = call_new(lk, &tg[t].peer, AP__DHT_MAX_BATCH, 0);
            if (!c) break;
            c->store = true;
            size_t bytes = 0;
            while (i < tg[t].n && c->n < AP__DHT_MAX_BATCH) {
                srec_t *sr = &lk->srecs[tg[t].idx[i]];
                size_t sz = sr->r.key_len + sr->r.subkey_len + sr->r.value_len + 96;
                if (c->n && bytes + sz > AP__DHT_RESP_BUDGET) break;
                ap__dht_record_to_pb(&sr->r, sr->sig, sr->has_sig, &pbs[c->n]);
                ptrs[c->n] = &pbs[c->n];
                c->idx[c->n++] = tg[t].idx[i];
                bytes += sz;
                i++;
            }
            Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
            Apiary__Dht__StoreRequest sreq = APIARY__DHT__STORE_REQUEST__INIT;
            sreq.records = ptrs;
            sreq.n_records = c->n;
            q.body_case = APIARY__DHT__REQUEST__BODY_STORE;
            q.store = &sreq;
            c->next = lk->calls;
            lk->calls = c;
            c->id = send_request(dht, &tg[t].peer, &q, on_call_done, c);
            if (!c->id) {
                call_unlink(lk, c);
                call_free(c);
            }
        }
        free(tg[t].idx);
    }
    free(tg);
    if (!lk->calls) lk_finish(lk);
}

static void lk_start_cb(ap_rt_t *rt, void *arg)
{
    lookup_t *lk = arg;
    lk->start_timer = 0;
    lk_pump(lk);
}

static lookup_t *lk_new(ap_dht_t *dht, int kind, size_t nkeys)
{
    lookup_t *lk = calloc(1, sizeof *lk);
    if (!lk) return NULL;
    lk->dht = dht;
    lk->kind = kind;
    lk->keys = calloc(nkeys ? nkeys : 1, sizeof *lk->keys);
    if (!lk->keys) {
        free(lk);
        return NULL;
    }
    lk->nkeys = nkeys;
    for (size_t i = 0; i < nkeys; i++) {
        lk->keys[i].cands = calloc((size_t)cand_cap(dht), sizeof *lk->keys[i].cands);
        ap__dht_storage_init(&lk->keys[i].merged, SIZE_MAX, SIZE_MAX, dht->cfg.max_ttl_ms, 0);
        if (!lk->keys[i].cands) {
            lk_free(lk);
            return NULL;
        }
    }
    return lk;
}

/* Seeds candidates from the routing table and schedules the first round. */
static int lk_launch(lookup_t *lk)
{
    ap_dht_t *dht = lk->dht;
    uint64_t now = ap_rt_now_us(dht->rt);
    ap__dht_contact_t *near = malloc((size_t)dht->cfg.k * sizeof *near);
    if (!near) return AP_ENOMEM;
    for (size_t i = 0; i < lk->nkeys; i++) {
        lk_key_t *kk = &lk->keys[i];
        int n = ap__dht_routing_nearest(&dht->table, kk->id, dht->cfg.k, now, false, near);
        if (n == 0) /* everyone backed off: try them anyway */
            n = ap__dht_routing_nearest(&dht->table, kk->id, dht->cfg.k, now, true, near);
        for (int j = 0; j < n; j++) add_cand(lk, kk, &near[j], 1);
    }
    free(near);
    lk->start_timer = ap_rt_timer_start(dht->rt, 0, 0, lk_start_cb, lk);
    if (!lk->start_timer) return AP_ENOMEM;
    lk->next = dht->lookups;
    if (lk->next) lk->next->prev = lk;
    dht->lookups = lk;
    return 0;
}

/* Local records of a key (storage and cache) go into the merge first. */
static void merge_local(ap_dht_t *dht, lk_key_t *kk)
{
    int64_t now = ap_rt_wall_ms(dht->rt);
    ap__dht_storage_t *srcs[2] = {&dht->store, &dht->cache};
    for (int s = 0; s < 2; s++) {
        ap__dht_sentry_t *e = ap__dht_storage_find(srcs[s], kk->id, now);
        if (!e || e->key_len != kk->key_len || memcmp(e->key, kk->key, kk->key_len)) continue;
        for (size_t i = 0; i < e->nrecs; i++) {
            ap_dht_record_t r;
            ap__dht_srec_view(e, e->recs[i], &r);
            if (validate(dht, &r, e->recs[i]->sig, e->recs[i]->has_sig, NULL)) continue;
            if (ap__dht_storage_put(&kk->merged, &r, e->recs[i]->sig, e->recs[i]->has_sig, now) ==
                0)
                kk->found = true;
        }
    }
}

static int get_common(ap_dht_t *dht, const uint8_t *const *keys, const size_t *lens, size_t n,
                      bool latest, lookup_t **out)
{
    if (n == 0) return AP_EINVAL;
    for (size_t i = 0; i < n; i++)
        if (!keys[i] || lens[i] == 0 || lens[i] > AP_DHT_KEY_MAX) return AP_EINVAL;
    lookup_t *lk = lk_new(dht, LK_GET, n);
    if (!lk) return AP_ENOMEM;
    lk->latest = latest;
    for (size_t i = 0; i < n; i++) {
        lk_key_t *kk = &lk->keys[i];
        kk->key = malloc(lens[i]);
        if (!kk->key) {
            lk_free(lk);
            return AP_ENOMEM;
        }
        memcpy(kk->key, keys[i], lens[i]);
        kk->key_len = lens[i];
        ap_dht_key_id(keys[i], lens[i], kk->id);
        merge_local(dht, kk);
        if (kk->found && !latest) kk->done = true; /* answered locally, hops 0 */
    }
    *out = lk;
    return 0;
}

int ap_dht_get(ap_dht_t *dht, const uint8_t *key, size_t key_len, bool latest, ap_dht_get_fn cb,
               void *arg)
{
    if (!dht || !cb || !key || key_len == 0 || key_len > AP_DHT_KEY_MAX) return AP_EINVAL;
    waiter_t *w = calloc(1, sizeof *w);
    if (!w) return AP_ENOMEM;
    w->cb = cb;
    w->arg = arg;
    /* Coalesce with a running traversal of the same key. */
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_key_id(key, key_len, id);
    for (lookup_t *lk = dht->lookups; lk; lk = lk->next) {
        if (lk->kind != LK_GET || lk->nkeys != 1 || lk->finished || lk->many_cb) continue;
        if (memcmp(lk->keys[0].id, id, AP_DHT_ID_LEN) != 0) continue;
        if (latest && !lk->latest) continue;
        if (lk->keys[0].key_len != key_len || memcmp(lk->keys[0].key, key, key_len)) continue;
        w->next = lk->waiters;
        lk->waiters = w;
        return 0;
    }
    lookup_t *lk;
    int rc = get_common(dht, &key, &key_len, 1, latest, &lk);
    if (rc) {
        free(w);
        return rc;
    }
    lk->waiters = w;
    if ((rc = lk_launch(lk))) {
        lk_free(lk);
        return rc;
    }
    return 0;
}

int ap_dht_get_many(ap_dht_t *dht, const uint8_t *const *keys, const size_t *key_lens, size_t nkeys,
                    bool latest, ap_dht_get_many_fn cb, void *arg)
{
    if (!dht || !cb || !keys || !key_lens) return AP_EINVAL;
    lookup_t *lk;
    int rc = get_common(dht, keys, key_lens, nkeys, latest, &lk);
    if (rc) return rc;
    lk->many_cb = cb;
    lk->many_arg = arg;
    if ((rc = lk_launch(lk))) {
        lk_free(lk);
        return rc;
    }
    return 0;
}

static int store_launch(ap_dht_t *dht, srec_t *sr, size_t n, ap_dht_store_many_fn cb, void *arg);

int ap_dht_store_many(ap_dht_t *dht, const ap_dht_record_t *recs, size_t n, ap_dht_store_many_fn cb,
                      void *arg)
{
    if (!dht || !cb || !recs || n == 0) return AP_EINVAL;
    int64_t now = ap_rt_wall_ms(dht->rt);
    /* Validate and sign everything first. */
    srec_t *sr = calloc(n, sizeof *sr);
    if (!sr) return AP_ENOMEM;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        rc = ap__dht_check_sizes(&recs[i]);
        if (!rc && recs[i].expiration_ms <= now) rc = AP_EEXPIRED;
        if (!rc && recs[i].expiration_ms - now > dht->cfg.max_ttl_ms) rc = AP_ERANGE;
        if (!rc) rc = ap__dht_sign(dht->rt, &recs[i], sr[i].sig, &sr[i].has_sig);
        if (!rc) {
            size_t tot = recs[i].key_len + recs[i].subkey_len + recs[i].value_len;
            sr[i].data = malloc(tot ? tot : 1);
            if (!sr[i].data) rc = AP_ENOMEM;
        }
        if (!rc) {
            uint8_t *p = sr[i].data;
            sr[i].r = recs[i];
            memcpy(p, recs[i].key, recs[i].key_len);
            sr[i].r.key = p;
            p += recs[i].key_len;
            if (recs[i].subkey_len) memcpy(p, recs[i].subkey, recs[i].subkey_len);
            sr[i].r.subkey = recs[i].subkey_len ? p : NULL;
            p += recs[i].subkey_len;
            if (recs[i].value_len) memcpy(p, recs[i].value, recs[i].value_len);
            sr[i].r.value = p;
            rc = validate(dht, &sr[i].r, sr[i].sig, sr[i].has_sig, NULL);
        }
    }
    if (rc) {
        for (size_t i = 0; i < n; i++) free(sr[i].data);
        free(sr);
        return rc;
    }
    return store_launch(dht, sr, n, cb, arg);
}

/* Starts the traversal of a store of n prepared (validated, signed) records;
 * takes ownership of sr (freed on error too). */
static int store_launch(ap_dht_t *dht, srec_t *sr, size_t n, ap_dht_store_many_fn cb, void *arg)
{
    int rc = 0;
    /* Group the records by key. */
    uint8_t(*ids)[AP_DHT_ID_LEN] = malloc(n * sizeof *ids);
    size_t *keyof = malloc(n * sizeof *keyof);
    size_t nk = 0;
    if (!ids || !keyof) {
        free(ids);
        free(keyof);
        for (size_t i = 0; i < n; i++) free(sr[i].data);
        free(sr);
        return AP_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        uint8_t id[AP_DHT_ID_LEN];
        ap_dht_key_id(sr[i].r.key, sr[i].r.key_len, id);
        size_t k = 0;
        while (k < nk && memcmp(ids[k], id, AP_DHT_ID_LEN) != 0) k++;
        if (k == nk) memcpy(ids[nk++], id, AP_DHT_ID_LEN);
        keyof[i] = k;
    }
    lookup_t *lk = lk_new(dht, LK_STORE, nk);
    if (!lk) rc = AP_ENOMEM;
    if (!rc) {
        lk->srecs = sr;
        lk->nsrecs = n;
        sr = NULL;
        lk->status = calloc(n, sizeof *lk->status);
        lk->nstored = calloc(n, sizeof *lk->nstored);
        if (!lk->status || !lk->nstored) rc = AP_ENOMEM;
    }
    for (size_t k = 0; !rc && k < nk; k++) {
        lk_key_t *kk = &lk->keys[k];
        memcpy(kk->id, ids[k], AP_DHT_ID_LEN);
        kk->recs = malloc(n * sizeof *kk->recs);
        if (!kk->recs) {
            rc = AP_ENOMEM;
            break;
        }
        for (size_t i = 0; i < n; i++)
            if (keyof[i] == k) kk->recs[kk->nrecs++] = i;
    }
    free(ids);
    free(keyof);
    if (!rc) {
        lk->store_cb = cb;
        lk->store_arg = arg;
        rc = lk_launch(lk);
    }
    if (rc) {
        if (sr) {
            for (size_t i = 0; i < n; i++) free(sr[i].data);
            free(sr);
        }
        if (lk) lk_free(lk);
    }
    return rc;
}

typedef struct store1 {
    ap_dht_store_fn cb;
    void *arg;
} store1_t;

static void store1_done(ap_dht_t *dht, void *arg, const int *status, const int *nstored, size_t n)
{
    store1_t *s = arg;
    s->cb(dht, s->arg, n ? status[0] : AP_ECANCELED, n ? nstored[0] : 0);
    free(s);
}

int ap_dht_store(ap_dht_t *dht, const ap_dht_record_t *rec, ap_dht_store_fn cb, void *arg)
{
    if (!cb || !rec) return AP_EINVAL;
    store1_t *s = malloc(sizeof *s);
    if (!s) return AP_ENOMEM;
    s->cb = cb;
    s->arg = arg;
    int rc = ap_dht_store_many(dht, rec, 1, store1_done, s);
    if (rc) free(s);
    return rc;
}

/* ---- lookup of node ids (bootstrap, refresh) ------------------------------- */

static int find_nodes(ap_dht_t *dht, const uint8_t id[AP_DHT_ID_LEN], ap_dht_done_fn cb, void *arg)
{
    lookup_t *lk = lk_new(dht, LK_NODES, 1);
    if (!lk) return AP_ENOMEM;
    memcpy(lk->keys[0].id, id, AP_DHT_ID_LEN);
    lk->done_cb = cb;
    lk->done_arg = arg;
    int rc = lk_launch(lk);
    if (rc) lk_free(lk);
    return rc;
}

/* ---- RPC handler --------------------------------------------------------------- */

static void respond(ap_rpc_req_t *req, Apiary__Dht__Response *r)
{
    size_t sz = apiary__dht__response__get_packed_size(r);
    uint8_t *buf = malloc(sz ? sz : 1);
    if (!buf) {
        ap_rpc_respond_error(req, AP_ENOMEM, "out of memory");
        return;
    }
    apiary__dht__response__pack(r, buf);
    ap_rpc_respond(req, buf, sz);
    free(buf);
}

static void handle_store(ap_dht_t *dht, ap_rpc_req_t *req, const ap_peer_id_t *from,
                         const Apiary__Dht__StoreRequest *s)
{
    int32_t status[AP__DHT_MAX_BATCH];
    int64_t now = ap_rt_wall_ms(dht->rt);
    uint64_t mono = ap_rt_now_us(dht->rt);
    char sid[AP_PEER_SHORT_LEN];
    for (size_t i = 0; i < s->n_records; i++) {
        ap_dht_record_t r;
        const uint8_t *sig;
        bool has_sig;
        int rc = ap__dht_record_from_pb(s->records[i], &r, &sig, &has_sig);
        if (!rc) rc = ap__dht_storage_charge(&dht->store, from, mono);
        if (!rc) rc = validate(dht, &r, sig, has_sig, from);
        if (!rc) rc = ap__dht_storage_put(&dht->store, &r, sig, has_sig, now);
        if (rc == 0 || rc == AP_ESTALE) {
            /* a peer just stored this key here: it is the one republishing
             * it now (Kademlia's republish optimization) */
            uint8_t kid[AP_DHT_ID_LEN];
            ap_dht_key_id(r.key, r.key_len, kid);
            republish_postpone(dht, kid);
        }
        if (rc && rc != AP_ESTALE) {
            dht->stats.stores_refused++;
            ap_info(MOD, "peer %s: store refused: %s", short_id(from, sid), ap_err_name(rc));
        }
        status[i] = rc;
    }
    Apiary__Dht__Response r = APIARY__DHT__RESPONSE__INIT;
    Apiary__Dht__StoreResponse sr = APIARY__DHT__STORE_RESPONSE__INIT;
    sr.status = status;
    sr.n_status = s->n_records;
    r.body_case = APIARY__DHT__RESPONSE__BODY_STORE;
    r.store = &sr;
    respond(req, &r);
}

static void handle_find(ap_dht_t *dht, ap_rpc_req_t *req, const ap_peer_id_t *from,
                        const Apiary__Dht__FindRequest *f)
{
    size_t n = f->n_key_ids;
    int k = dht->cfg.k < AP__DHT_MAX_NEAREST ? dht->cfg.k : AP__DHT_MAX_NEAREST;
    int64_t now = ap_rt_wall_ms(dht->rt);
    uint64_t mono = ap_rt_now_us(dht->rt);
    Apiary__Dht__FindResult *res = calloc(n, sizeof *res);
    Apiary__Dht__FindResult **rptr = calloc(n, sizeof *rptr);
    ap__dht_contact_t *near = calloc(n * (size_t)(k + 1), sizeof *near);
    Apiary__Dht__PeerInfo *pis = calloc(n * (size_t)(k + 1), sizeof *pis);
    Apiary__Dht__PeerInfo **piptr = calloc(n * (size_t)(k + 1), sizeof *piptr);
    ProtobufCBinaryData *pids = calloc(n * (size_t)(k + 1), sizeof *pids);
    char **addrp = calloc(n * (size_t)(k + 1), sizeof *addrp);
    /* records: views into storage, valid until we respond */
    Apiary__Dht__Record *recs = NULL, **recptr = NULL;
    size_t nrec_total = 0, recs_cap = 0;
    size_t *rec_start = calloc(n, sizeof *rec_start), *rec_n = calloc(n, sizeof *rec_n);
    bool ok = res && rptr && near && pis && piptr && pids && addrp && rec_start && rec_n;
    size_t budget = AP__DHT_RESP_BUDGET, used = 0;
    for (size_t i = 0; ok && i < n; i++) {
        const uint8_t *id = f->key_ids[i].data;
        ap__dht_sentry_t *e = ap__dht_storage_find(&dht->store, id, now);
        if (!e) e = ap__dht_storage_find(&dht->cache, id, now);
        rec_start[i] = nrec_total;
        for (size_t j = 0; e && j < e->nrecs; j++) {
            ap__dht_srec_t *sr = e->recs[j];
            size_t sz = e->key_len + sr->subkey_len + sr->value_len + 96;
            if (used + sz > budget || rec_n[i] >= AP__DHT_MAX_RESULT_RECS) break;
            if (nrec_total == recs_cap) {
                size_t nc = recs_cap ? recs_cap * 2 : 16;
                Apiary__Dht__Record *n2 = realloc(recs, nc * sizeof *n2);
                if (!n2) {
                    ok = false;
                    break;
                }
                recs = n2;
                recs_cap = nc;
            }
            ap_dht_record_t v;
            ap__dht_srec_view(e, sr, &v);
            ap__dht_record_to_pb(&v, sr->sig, sr->has_sig, &recs[nrec_total++]);
            rec_n[i]++;
            used += sz;
        }
    }
    if (ok && nrec_total) {
        recptr = calloc(nrec_total, sizeof *recptr);
        if (!recptr) ok = false;
        for (size_t j = 0; ok && j < nrec_total; j++) recptr[j] = &recs[j];
    }
    for (size_t i = 0; ok && i < n; i++) {
        apiary__dht__find_result__init(&res[i]);
        rptr[i] = &res[i];
        res[i].records = rec_n[i] ? &recptr[rec_start[i]] : NULL;
        res[i].n_records = rec_n[i];
        ap__dht_contact_t *nb = &near[i * (size_t)(k + 1)];
        int m = ap__dht_routing_nearest(&dht->table, f->key_ids[i].data, k + 1, mono, false, nb);
        size_t base = i * (size_t)(k + 1), cnt = 0;
        for (int j = 0; j < m && (int)cnt < k; j++) {
            if (ap_peer_id_eq(&nb[j].peer, from)) continue;
            Apiary__Dht__PeerInfo *pi = &pis[base + cnt];
            apiary__dht__peer_info__init(pi);
            pids[base + cnt].data = nb[j].peer.b;
            pids[base + cnt].len = AP_PEER_ID_LEN;
            pi->id = pids[base + cnt];
            if (nb[j].addr[0]) {
                addrp[base + cnt] = nb[j].addr;
                pi->addrs = &addrp[base + cnt];
                pi->n_addrs = 1;
            }
            piptr[base + cnt] = pi;
            cnt++;
        }
        res[i].nearest = &piptr[base];
        res[i].n_nearest = cnt;
    }
    if (ok) {
        Apiary__Dht__Response r = APIARY__DHT__RESPONSE__INIT;
        Apiary__Dht__FindResponse fr = APIARY__DHT__FIND_RESPONSE__INIT;
        fr.results = rptr;
        fr.n_results = n;
        r.body_case = APIARY__DHT__RESPONSE__BODY_FIND;
        r.find = &fr;
        respond(req, &r);
    } else {
        ap_rpc_respond_error(req, AP_ENOMEM, "out of memory");
    }
    free(res);
    free(rptr);
    free(near);
    free(pis);
    free(piptr);
    free(pids);
    free(addrp);
    free(recs);
    free(recptr);
    free(rec_start);
    free(rec_n);
}

static void on_request(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_dht_t *dht = arg;
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    ap_peer_id_t from = *ap_rpc_req_peer(req);
    char s[AP_PEER_SHORT_LEN];
    Apiary__Dht__Request *q;
    int rc = ap__dht_decode_request(data, len, &q);
    if (rc) {
        ap_warn(MOD, "peer %s: malformed request (%zu bytes): %s", short_id(&from, s), len,
                ap_err_name(rc));
        ap_rpc_respond_error(req, rc, "malformed dht request");
        return;
    }
    dht->stats.rpcs_served++;
    if (!q->client) {
        learn_addrs(dht, &from, q->sender_addrs, q->n_sender_addrs);
        peer_seen(dht, &from, q->n_sender_addrs ? q->sender_addrs[0] : NULL);
    }
    switch (q->body_case) {
    case APIARY__DHT__REQUEST__BODY_PING: {
        Apiary__Dht__Response r = APIARY__DHT__RESPONSE__INIT;
        Apiary__Dht__PingResponse p = APIARY__DHT__PING_RESPONSE__INIT;
        r.body_case = APIARY__DHT__RESPONSE__BODY_PING;
        r.ping = &p;
        respond(req, &r);
        break;
    }
    case APIARY__DHT__REQUEST__BODY_STORE:
        handle_store(dht, req, &from, q->store);
        break;
    case APIARY__DHT__REQUEST__BODY_FIND:
        handle_find(dht, req, &from, q->find);
        break;
    default:
        ap_rpc_respond_error(req, AP_EPROTO, "no body");
        break;
    }
    apiary__dht__request__free_unpacked(q, NULL);
}

/* ---- maintenance ------------------------------------------------------------- */

static void refresh_done(ap_dht_t *dht, void *arg, int status) {}

/* An RPC to peer failed. Besides the back-off, when the peer was a live
 * contact of a bucket (its first failure), that bucket's region is refreshed
 * now with a lookup of a random id in it, at most once per bucket per
 * refresh_period / 20 (30 s by default). A crashed contact may be this
 * table's only one for a region (after crashes, other nodes' tables often
 * are in the same state); the lookup finds the region's live nodes, and
 * every node it asks learns this node, so it also spreads liveness. Without
 * it the region stays covered by the dead contact until the next periodic
 * refresh (10 min), and gets of keys there miss their nearest live holders
 * (docs/dht.md, "Crashes"). */
static void contact_failed(ap_dht_t *dht, const ap_peer_id_t *peer, uint64_t now)
{
    const ap__dht_contact_t *c = ap__dht_routing_lookup(&dht->table, peer);
    bool first = c && c->failures == 0;
    uint8_t cid[AP_DHT_ID_LEN];
    if (c) memcpy(cid, c->id, sizeof cid); /* c may move in the call below */
    (void)ap__dht_routing_failed(&dht->table, peer, now);
    if (!first) return;
    republish_after_failure(dht, cid, now);
    int i = ap__dht_routing_bucket_of(&dht->table, cid);
    ap__dht_bucket_t *bk = &dht->table.buckets[i];
    uint64_t gap = dht->cfg.refresh_period_us / 20;
    if (bk->fail_refresh_us && now - bk->fail_refresh_us < gap) return;
    bk->fail_refresh_us = now;
    bk->last_touched_us = now;
    uint8_t rnd[AP_DHT_ID_LEN], id[AP_DHT_ID_LEN];
    ap_rt_rand_bytes(dht->rt, rnd, sizeof rnd);
    ap__dht_routing_random_id(&dht->table, i, rnd, id);
    dht->stats.fail_refreshes++;
    (void)find_nodes(dht, id, refresh_done, NULL);
}

static void maintenance(ap_rt_t *rt, void *arg)
{
    ap_dht_t *dht = arg;
    int64_t now_ms = ap_rt_wall_ms(rt);
    uint64_t now = ap_rt_now_us(rt);
    ap__dht_storage_expire(&dht->store, now_ms);
    ap__dht_storage_expire(&dht->cache, now_ms);
    if (ap__dht_routing_size(&dht->table) == 0) return;
    for (int i = 0; i < dht->table.nbuckets; i++) {
        ap__dht_bucket_t *bk = &dht->table.buckets[i];
        if (now - bk->last_touched_us < dht->cfg.refresh_period_us) continue;
        bk->last_touched_us = now;
        uint8_t rnd[AP_DHT_ID_LEN], id[AP_DHT_ID_LEN];
        ap_rt_rand_bytes(rt, rnd, sizeof rnd);
        ap__dht_routing_random_id(&dht->table, i, rnd, id);
        (void)find_nodes(dht, id, refresh_done, NULL);
    }
}

/* ---- republishing -------------------------------------------------------------
 * Kademlia's hourly republish, scaled (republish_period_us, 10 min): every key
 * this node holds for the network is re-stored, each record exactly as it
 * arrived (an owner's signature travels with it, so storers and readers still
 * verify it), to the key's current nearest nodes: a normal store traversal,
 * which skips dead replicas and reaches nodes that joined nearer to the key.
 * Each key's turn comes after a random [3/4, 1] of the period; a STORE of the
 * key from a peer postpones it (that peer is republishing it, Kademlia's
 * optimization, so the replicas do not all republish each period). A key
 * whose replica is found dead (an RPC to it failed) is republished about a
 * second later. Records expiring within 2 * rpc_timeout are left to expire. */

#define REPUBLISH_MAX_KEYS      1024 /* per scan; the rest waits for the next one */
#define REPUBLISH_KEYS_PER_WALK 64   /* keys per store traversal */

static uint64_t republish_delay(ap_dht_t *dht)
{
    uint64_t p = dht->cfg.republish_period_us;
    return p - p / 4 + ap_rt_rand_below(dht->rt, p / 4 + 1);
}

/* A peer stored the key here (or the node stored it itself): its next
 * republish is a full period away. */
static void republish_postpone(ap_dht_t *dht, const uint8_t id[AP_DHT_ID_LEN])
{
    if (!dht->cfg.republish_period_us) return;
    ap__dht_sentry_t *e = ap__dht_storage_find(&dht->store, id, ap_rt_wall_ms(dht->rt));
    if (e) e->republish_at_us = ap_rt_now_us(dht->rt) + republish_delay(dht);
}

typedef struct repub {
    ap_dht_t *dht;
    uint64_t now;
    int64_t now_ms, margin_ms;
    srec_t *sr;
    size_t n, cap;
    size_t *key_start; /* first record of each collected key */
    size_t nkeys;
    ap__dht_contact_t *near; /* k contacts of scratch */
} repub_t;

static void repub_entry(void *arg, ap__dht_sentry_t *e)
{
    repub_t *rp = arg;
    ap_dht_t *dht = rp->dht;
    if (e->republish_at_us == 0) { /* stored before republishing was scheduled */
        e->republish_at_us = rp->now + republish_delay(dht);
        return;
    }
    if (e->republish_at_us > rp->now || rp->nkeys == REPUBLISH_MAX_KEYS) return;
    e->republish_at_us = rp->now + republish_delay(dht);
    /* Only a node among the k nearest it knows of the key republishes it: a
     * copy cached far from the key by a get just expires. */
    int k = dht->cfg.k,
        m = ap__dht_routing_nearest(&dht->table, e->id, k, rp->now, false, rp->near);
    if (m == k && ap__dht_cmp_dist(e->id, rp->near[k - 1].id, dht->self_id) < 0) return;
    size_t first = rp->n;
    for (size_t i = 0; i < e->nrecs; i++) {
        ap__dht_srec_t *r = e->recs[i];
        if (r->exp - rp->now_ms <= rp->margin_ms) continue; /* about to expire: let it */
        if (rp->n == rp->cap) {
            size_t nc = rp->cap ? rp->cap * 2 : 16;
            srec_t *n2 = realloc(rp->sr, nc * sizeof *n2);
            if (!n2) break;
            rp->sr = n2;
            rp->cap = nc;
        }
        srec_t *o = &rp->sr[rp->n];
        memset(o, 0, sizeof *o);
        size_t tot = e->key_len + r->subkey_len + r->value_len;
        o->data = malloc(tot ? tot : 1);
        if (!o->data) break;
        uint8_t *p = o->data;
        memcpy(p, e->key, e->key_len);
        o->r.key = p;
        o->r.key_len = e->key_len;
        p += e->key_len;
        if (r->subkey_len) memcpy(p, r->subkey, r->subkey_len);
        o->r.subkey = r->subkey_len ? p : NULL;
        o->r.subkey_len = r->subkey_len;
        p += r->subkey_len;
        if (r->value_len) memcpy(p, r->value, r->value_len);
        o->r.value = p;
        o->r.value_len = r->value_len;
        o->r.expiration_ms = r->exp;
        memcpy(o->sig, r->sig, AP_ED25519_SIG_LEN);
        o->has_sig = r->has_sig;
        rp->n++;
    }
    if (rp->n > first) rp->key_start[rp->nkeys++] = first;
}

static void republish_done(ap_dht_t *dht, void *arg, const int *status, const int *nstored,
                           size_t n)
{
    (void)dht, (void)arg, (void)status, (void)nstored, (void)n;
}

/* Republishes every held key whose turn has come. */
static void republish_scan(ap_dht_t *dht)
{
    if (!dht->cfg.republish_period_us || dht->cfg.client_mode) return;
    int64_t now_ms = ap_rt_wall_ms(dht->rt);
    ap__dht_storage_expire(&dht->store, now_ms);
    if (ap__dht_storage_records(&dht->store) == 0) return;
    repub_t rp = {.dht = dht, .now = ap_rt_now_us(dht->rt), .now_ms = now_ms};
    rp.margin_ms = (int64_t)(2 * dht->cfg.rpc_timeout_us / 1000);
    rp.key_start = malloc(REPUBLISH_MAX_KEYS * sizeof *rp.key_start);
    rp.near = malloc((size_t)dht->cfg.k * sizeof *rp.near);
    if (!rp.key_start || !rp.near) {
        free(rp.key_start);
        free(rp.near);
        return;
    }
    ap__dht_storage_foreach(&dht->store, repub_entry, &rp);
    free(rp.near);
    /* one store traversal per REPUBLISH_KEYS_PER_WALK keys */
    for (size_t k = 0; k < rp.nkeys; k += REPUBLISH_KEYS_PER_WALK) {
        size_t kend =
            k + REPUBLISH_KEYS_PER_WALK < rp.nkeys ? k + REPUBLISH_KEYS_PER_WALK : rp.nkeys;
        size_t a = rp.key_start[k], b = kend < rp.nkeys ? rp.key_start[kend] : rp.n;
        srec_t *chunk = malloc((b - a) * sizeof *chunk);
        if (!chunk) {
            for (size_t i = a; i < b; i++) free(rp.sr[i].data);
            continue;
        }
        memcpy(chunk, &rp.sr[a], (b - a) * sizeof *chunk);
        dht->stats.republished += b - a;
        (void)store_launch(dht, chunk, b - a, republish_done, NULL); /* frees chunk on error */
    }
    free(rp.sr);
    free(rp.key_start);
}

static void republish_tick(ap_rt_t *rt, void *arg)
{
    (void)rt;
    republish_scan(arg);
}

static void republish_soon_cb(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_dht_t *dht = arg;
    dht->repub_soon_timer = 0;
    republish_scan(dht);
}

typedef struct dead_scan {
    ap_dht_t *dht;
    uint8_t dead[AP_DHT_ID_LEN];
    uint64_t now;
    ap__dht_contact_t *near;
    int marked;
} dead_scan_t;

/* Whether the dead contact was one of the num_replicas nearest nodes this
 * node knows (itself included) for the entry's key: then a replica is gone. */
static void dead_entry(void *arg, ap__dht_sentry_t *e)
{
    dead_scan_t *d = arg;
    ap_dht_t *dht = d->dht;
    /* cheap filter: the dead node is not much farther from the key than us */
    if (ap__dht_common_prefix(e->id, d->dead) + 2 < ap__dht_common_prefix(e->id, dht->self_id))
        return;
    int nrep = dht->cfg.num_replicas, nearer = 0;
    if (ap__dht_cmp_dist(e->id, dht->self_id, d->dead) < 0) nearer++;
    int m = ap__dht_routing_nearest(&dht->table, e->id, nrep + 1, d->now, true, d->near);
    for (int i = 0; i < m && nearer < nrep; i++) {
        if (memcmp(d->near[i].id, d->dead, AP_DHT_ID_LEN) == 0) continue;
        if (ap__dht_cmp_dist(e->id, d->near[i].id, d->dead) < 0) nearer++;
    }
    if (nearer >= nrep) return;
    e->republish_at_us = d->now; /* due now */
    d->marked++;
}

/* An RPC to the contact with node id `dead` failed for the first time. */
static void republish_after_failure(ap_dht_t *dht, const uint8_t dead[AP_DHT_ID_LEN], uint64_t now)
{
    if (!dht->cfg.republish_period_us || dht->cfg.client_mode) return;
    if (ap__dht_storage_records(&dht->store) == 0) return;
    dead_scan_t d = {.dht = dht, .now = now};
    memcpy(d.dead, dead, AP_DHT_ID_LEN);
    d.near = malloc((size_t)(dht->cfg.num_replicas + 1) * sizeof *d.near);
    if (!d.near) return;
    ap__dht_storage_foreach(&dht->store, dead_entry, &d);
    free(d.near);
    if (!d.marked) return;
    dht->stats.republish_triggers += (uint64_t)d.marked;
    /* a second's delay batches the failures of one burst into one scan */
    if (!dht->repub_soon_timer)
        dht->repub_soon_timer = ap_rt_timer_start(dht->rt, 1000000, 0, republish_soon_cb, dht);
}

/* ---- bootstrap ------------------------------------------------------------------ */

struct boot {
    ap_dht_t *dht; /* NULL once the DHT is freed (orphan) */
    boot_t *next;
    ap_dht_done_fn cb;
    void *arg;
    size_t pending;
    size_t ok;
    size_t n;
    char **addrs;
    uint64_t *ping_ids;
    ap_peer_id_t *peers;
    bool looking; /* self-lookup / bucket refreshes running */
    int lookups;  /* of those, still running */
    int pass;     /* bucket-refresh passes started */
    int pass_end; /* buckets that existed when the last pass started */
};

static void boot_free(boot_t *b)
{
    for (size_t i = 0; i < b->n; i++) free(b->addrs[i]);
    free(b->addrs);
    free(b->ping_ids);
    free(b->peers);
    free(b);
}

static void boot_unlink(ap_dht_t *dht, boot_t *b)
{
    for (boot_t **pp = &dht->boots; *pp; pp = &(*pp)->next)
        if (*pp == b) {
            *pp = b->next;
            return;
        }
}

/* Joining: after the self-lookup, every bucket is refreshed once (a lookup of
 * a random id in its range), then the buckets those refreshes created by
 * splitting, up to three passes. This fills the table the relaxed split rule
 * allows, which is what makes lookups take few round trips. */
static void boot_lookup_done(ap_dht_t *dht, void *arg, int status)
{
    boot_t *b = arg;
    if (--b->lookups > 0) return;
    int start = b->pass == 0 ? 0 : b->pass_end, end = dht->table.nbuckets;
    if (b->pass < AP__DHT_JOIN_PASSES && start < end) {
        b->pass++;
        b->pass_end = end;
        for (int i = start; i < end; i++) {
            ap__dht_bucket_t *bk = &dht->table.buckets[i];
            if (ap__dht_common_prefix(bk->prefix, dht->self_id) >= bk->depth) continue;
            uint8_t rnd[AP_DHT_ID_LEN], id[AP_DHT_ID_LEN];
            ap_rt_rand_bytes(dht->rt, rnd, sizeof rnd);
            ap__dht_routing_random_id(&dht->table, i, rnd, id);
            b->lookups++;
            if (find_nodes(dht, id, boot_lookup_done, b)) b->lookups--;
        }
        if (b->lookups > 0) return;
    }
    boot_unlink(dht, b);
    size_t rt_size = ap__dht_routing_size(&dht->table);
    ap_info(MOD, "bootstrap: %zu of %zu initial peers answered, %zu peers in the table", b->ok,
            b->n, rt_size);
    b->cb(dht, b->arg, 0);
    boot_free(b);
}

static void boot_step(boot_t *b)
{
    if (b->pending) return;
    ap_dht_t *dht = b->dht;
    if (!dht) {
        boot_free(b);
        return;
    }
    if (b->ok == 0) {
        boot_unlink(dht, b);
        ap_warn(MOD, "bootstrap failed: none of the %zu initial peers answered", b->n);
        b->cb(dht, b->arg, AP_EUNREACH);
        boot_free(b);
        return;
    }
    b->looking = true;
    b->lookups = 1;
    if (find_nodes(dht, dht->self_id, boot_lookup_done, b)) {
        boot_unlink(dht, b);
        b->cb(dht, b->arg, AP_ENOMEM);
        boot_free(b);
    }
}

typedef struct boot_ping {
    boot_t *b;
    size_t i;
} boot_ping_t;

static void boot_ping_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                           const char *errmsg)
{
    boot_ping_t *bp = arg;
    boot_t *b = bp->b;
    size_t i = bp->i;
    free(bp);
    b->ping_ids[i] = 0;
    b->pending--;
    if (b->dht) {
        if (status == 0) {
            b->ok++;
            peer_seen(b->dht, &b->peers[i], b->addrs[i]);
        } else if (status != AP_ECANCELED) {
            ap_warn(MOD, "bootstrap: %s did not answer: %s", b->addrs[i], ap_err_name(status));
        }
    }
    boot_step(b);
}

static void boot_dialed(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    boot_ping_t *bp = arg;
    boot_t *b = bp->b;
    size_t i = bp->i;
    ap_dht_t *dht = b->dht;
    if (status != 0 || !dht) {
        if (dht) ap_warn(MOD, "bootstrap: cannot reach %s: %s", b->addrs[i], ap_err_name(status));
        free(bp);
        b->pending--;
        boot_step(b);
        return;
    }
    b->peers[i] = *peer;
    ap_rt_add_addr(rt, peer, b->addrs[i]);
    Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
    Apiary__Dht__PingRequest p = APIARY__DHT__PING_REQUEST__INIT;
    q.body_case = APIARY__DHT__REQUEST__BODY_PING;
    q.ping = &p;
    b->ping_ids[i] = send_request(dht, peer, &q, boot_ping_done, bp);
    if (!b->ping_ids[i]) {
        free(bp);
        b->pending--;
        boot_step(b);
    }
}

int ap_dht_bootstrap(ap_dht_t *dht, const char *const *addrs, size_t naddrs, ap_dht_done_fn cb,
                     void *arg)
{
    if (!dht || !cb || (naddrs && !addrs)) return AP_EINVAL;
    boot_t *b = calloc(1, sizeof *b);
    if (!b) return AP_ENOMEM;
    b->dht = dht;
    b->cb = cb;
    b->arg = arg;
    b->n = naddrs;
    b->addrs = calloc(naddrs ? naddrs : 1, sizeof *b->addrs);
    b->ping_ids = calloc(naddrs ? naddrs : 1, sizeof *b->ping_ids);
    b->peers = calloc(naddrs ? naddrs : 1, sizeof *b->peers);
    if (!b->addrs || !b->ping_ids || !b->peers) {
        boot_free(b);
        return AP_ENOMEM;
    }
    for (size_t i = 0; i < naddrs; i++) {
        if (!addrs[i] || strlen(addrs[i]) >= AP_RT_ADDR_MAX || !(b->addrs[i] = strdup(addrs[i]))) {
            boot_free(b);
            return addrs[i] ? AP_ENOMEM : AP_EINVAL;
        }
    }
    b->next = dht->boots;
    dht->boots = b;
    b->pending = naddrs + 1; /* +1 held until every dial is issued */
    for (size_t i = 0; i < naddrs; i++) {
        boot_ping_t *bp = malloc(sizeof *bp);
        int rc = bp ? 0 : AP_ENOMEM;
        if (bp) {
            bp->b = b;
            bp->i = i;
            rc = ap_rt_dial(dht->rt, b->addrs[i], dht->cfg.rpc_timeout_us, boot_dialed, bp);
        }
        if (rc) {
            ap_warn(MOD, "bootstrap: cannot dial %s: %s", b->addrs[i], ap_err_name(rc));
            free(bp);
            b->pending--;
        }
    }
    b->pending--; /* dial callbacks never run inside ap_rt_dial: no step yet */
    if (b->pending == 0) {
        /* every dial failed synchronously */
        boot_unlink(dht, b);
        ap_warn(MOD, "bootstrap failed: none of the %zu initial peers could be dialed", naddrs);
        boot_free(b);
        return AP_EUNREACH;
    }
    return 0;
}

int ap_dht_add_peer(ap_dht_t *dht, const ap_peer_id_t *peer, const char *addr)
{
    if (!dht || !peer) return AP_EINVAL;
    if (addr && *addr) {
        int rc = ap_rt_add_addr(dht->rt, peer, addr);
        if (rc) return rc;
    }
    peer_seen(dht, peer, addr);
    return 0;
}

/* ---- lifetime ---------------------------------------------------------------- */

int ap_dht_new(ap_rt_t *rt, const ap_dht_config_t *cfg, ap_dht_t **out)
{
    if (!rt || !out) return AP_EINVAL;
    ap_dht_t *dht = calloc(1, sizeof *dht);
    if (!dht) return AP_ENOMEM;
    if (cfg)
        dht->cfg = *cfg;
    else
        ap_dht_config_default(&dht->cfg);
    ap_dht_config_t *c = &dht->cfg;
    if (c->k < 1 || c->k > AP__DHT_MAX_NEAREST || c->alpha < 1 || c->depth_mod < 1 ||
        c->num_replicas < 1 || c->max_ttl_ms <= 0) {
        free(dht);
        return AP_EINVAL;
    }
    dht->rt = rt;
    ap_dht_peer_node_id(ap_rt_self(rt), dht->self_id);
    if (c->nannounce < 0 || c->nannounce > AP_DHT_MAX_ANNOUNCE) {
        free(dht);
        return AP_EINVAL;
    }
    for (int i = 0; i < c->nannounce; i++) {
        if (!c->announce[i] || !*c->announce[i] || strlen(c->announce[i]) >= AP_RT_ADDR_MAX) {
            free(dht);
            return AP_EINVAL;
        }
        strcpy(dht->announce[dht->nannounce++], c->announce[i]);
        c->announce[i] = NULL; /* the copy in dht->cfg must not keep the caller's pointers */
    }
    c->nannounce = 0;
    int rc = ap__dht_routing_init(&dht->table, dht->self_id, c->k, c->depth_mod, c->max_failures,
                                  c->backoff_base_us, c->backoff_max_us);
    if (rc) {
        free(dht);
        return rc;
    }
    ap__dht_storage_init(&dht->store, c->max_records, c->max_bytes, c->max_ttl_ms,
                         c->max_stores_per_peer_per_min);
    ap__dht_storage_init(&dht->cache, c->cache_max_records, c->cache_max_bytes, c->max_ttl_ms, 0);
    if (!c->client_mode) {
        rc = ap_rt_rpc_register(rt, AP_DHT_PROTO, AP__DHT_MSG_MAX, on_request, dht);
        if (rc) {
            ap__dht_routing_close(&dht->table);
            free(dht);
            return rc;
        }
        dht->registered = true;
    }
    uint64_t period = c->refresh_period_us / 4;
    if (period < 1000000) period = 1000000;
    dht->maint_timer = ap_rt_timer_start(rt, period, period, maintenance, dht);
    if (c->republish_period_us && !c->client_mode) {
        uint64_t rp = c->republish_period_us / 8;
        if (rp < 1000000) rp = 1000000;
        dht->repub_timer = ap_rt_timer_start(rt, rp, rp, republish_tick, dht);
    }
    *out = dht;
    return 0;
}

void ap_dht_free(ap_dht_t *dht)
{
    if (!dht) return;
    if (dht->maint_timer) ap_rt_timer_stop(dht->rt, dht->maint_timer);
    if (dht->repub_timer) ap_rt_timer_stop(dht->rt, dht->repub_timer);
    if (dht->repub_soon_timer) ap_rt_timer_stop(dht->rt, dht->repub_soon_timer);
    if (dht->registered) ap_rt_rpc_unregister(dht->rt, AP_DHT_PROTO);
    /* bootstraps: orphan them (pending dials call back later) */
    while (dht->boots) {
        boot_t *b = dht->boots;
        dht->boots = b->next;
        b->cb(dht, b->arg, AP_ECANCELED);
        b->dht = NULL;
        if (b->looking) { /* its lookup is cancelled below without it */
            boot_free(b);
            continue;
        }
        b->pending++; /* hold b while the pings are cancelled */
        for (size_t i = 0; i < b->n; i++)
            if (b->ping_ids[i]) ap_rt_rpc_cancel(dht->rt, b->ping_ids[i]);
        if (--b->pending == 0) boot_free(b); /* else the pending dials free it */
    }
    while (dht->lookups) {
        lookup_t *lk = dht->lookups;
        if (lk->kind == LK_NODES && lk->done_cb == boot_lookup_done) lk->done_cb = NULL;
        lk_cancel(lk, AP_ECANCELED);
    }
    while (dht->bgcalls) {
        bgcall_t *b = dht->bgcalls;
        ap_rt_rpc_cancel(dht->rt, b->id); /* bg_done unlinks and frees */
        if (dht->bgcalls == b) {          /* not cancellable (already done?): drop it */
            bg_unlink(dht, b);
            free(b);
        }
    }
    ap__dht_storage_close(&dht->store);
    ap__dht_storage_close(&dht->cache);
    ap__dht_routing_close(&dht->table);
    free(dht);
}

int ap_dht_add_validator(ap_dht_t *dht, ap_dht_validator_fn fn, void *arg)
{
    if (!dht || !fn) return AP_EINVAL;
    if (dht->nvalidators == MAX_VALIDATORS) return AP_ELIMIT;
    dht->validators[dht->nvalidators].fn = fn;
    dht->validators[dht->nvalidators].arg = arg;
    dht->nvalidators++;
    return 0;
}

ap_rt_t *ap_dht_runtime(ap_dht_t *dht)
{
    return dht->rt;
}

void ap_dht_get_stats(ap_dht_t *dht, ap_dht_stats_t *out)
{
    *out = dht->stats;
    out->routing_peers = ap__dht_routing_size(&dht->table);
    out->routing_buckets = (size_t)dht->table.nbuckets;
    out->replacement_peers = ap__dht_routing_replacements(&dht->table);
    out->stored_keys = dht->store.nentries;
    out->stored_records = ap__dht_storage_records(&dht->store);
    out->stored_bytes = dht->store.bytes;
    out->cached_records = ap__dht_storage_records(&dht->cache);
    out->stores_refused = dht->stats.stores_refused;
}
