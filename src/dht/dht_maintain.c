/* DHT: keeping the table and the records healthy. Background calls (pings,
 * cache stores), hand-over of records to new close contacts, failed contacts,
 * bucket refresh, and republishing (periodic, and after a replica died). */
#include "dht/dht_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HANDOVER_MAX_RECORDS 256 /* per new contact */

static void republish_after_failure(ap_dht_t *dht, const uint8_t dead[AP_DHT_ID_LEN], uint64_t now);

/* ---- background calls: pings, cache stores, hand-over ---------------------- */

enum { BG_PING = 1, BG_STORE = 2 };

struct bgcall {
    ap_dht_t *dht;
    bgcall_t *prev, *next;
    uint64_t id;
    int kind;
    ap_peer_id_t peer;
    size_t held;   /* bytes reserved with ap_rt_mem_reserve until the call ends */
    bool handover; /* held counts in dht->ho_inflight too */
};

static void bg_unlink(ap_dht_t *dht, bgcall_t *b)
{
    if (b->prev)
        b->prev->next = b->next;
    else
        dht->bgcalls = b->next;
    if (b->next) b->next->prev = b->prev;
}

/* Unlinks b, gives back what it held and frees it. */
static void bg_free(ap_dht_t *dht, bgcall_t *b)
{
    bg_unlink(dht, b);
    if (b->held) ap_rt_mem_release(dht->rt, &b->peer, b->held);
    if (b->handover) dht->ho_inflight -= b->held <= dht->ho_inflight ? b->held : dht->ho_inflight;
    free(b);
}

static void bg_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    bgcall_t *b = arg;
    ap_dht_t *dht = b->dht;
    if (status == AP_ECANCELED) {
        bg_free(dht, b);
        return;
    }
    uint64_t now = ap_rt_now_us(rt);
    if (status == 0 || status == AP_ELIMIT || status == AP_EPROTO) {
        /* the peer answered (even a refusal proves liveness) */
        ap__dht_peer_seen(dht, &b->peer, NULL);
    } else {
        char s[AP_PEER_SHORT_LEN];
        ap_debug(MOD, "peer %s: %s rpc failed: %s", ap__dht_short_id(&b->peer, s),
                 b->kind == BG_PING ? "ping" : "store", ap_err_name(status));
        ap__dht_contact_failed(dht, &b->peer, now);
    }
    bg_free(dht, b);
}

/* Sends q; held: bytes already reserved for it (given back when it ends).
 * false if it could not be sent (held given back). */
static bool bg_send(ap_dht_t *dht, const ap_peer_id_t *peer, int kind, Apiary__Dht__Request *q,
                    size_t held, bool handover)
{
    bgcall_t *b = calloc(1, sizeof *b);
    if (!b) {
        if (held) ap_rt_mem_release(dht->rt, peer, held);
        return false;
    }
    b->dht = dht;
    b->kind = kind;
    b->peer = *peer;
    b->held = held;
    b->handover = handover;
    if (handover) dht->ho_inflight += held;
    b->next = dht->bgcalls;
    if (b->next) b->next->prev = b;
    dht->bgcalls = b;
    b->id = ap__dht_send_request(dht, peer, q, bg_done, b);
    if (!b->id) bg_free(dht, b);
    return b->id != 0;
}

static void ping_peer(ap_dht_t *dht, const ap_peer_id_t *peer)
{
    Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
    Apiary__Dht__PingRequest p = APIARY__DHT__PING_REQUEST__INIT;
    q.body_case = APIARY__DHT__REQUEST__BODY_PING;
    q.ping = &p;
    (void)bg_send(dht, peer, BG_PING, &q, 0, false);
}

/* Sends records (views + signatures) to peer in STORE batches, each
 * reserved in the node's memory budget first (dht_impl.h). */
size_t ap__dht_store_records_bg(ap_dht_t *dht, const ap_peer_id_t *peer,
                                const ap_dht_record_t *recs,
                                const uint8_t (*sigs)[AP_ED25519_SIG_LEN], const bool *has_sig,
                                size_t n, bool handover)
{
    size_t i = 0;
    while (i < n) {
        size_t first = i;
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
        /* bytes is at least the packed request's size (96 per record
         * covers the fields' tags and lengths, signature, TTL) */
        if ((handover && dht->ho_inflight + bytes > HANDOVER_INFLIGHT) ||
            ap_rt_mem_reserve(dht->rt, peer, bytes) != 0 ||
            !bg_send(dht, peer, BG_STORE, &q, bytes, handover)) {
            dht->stats.bg_stores_skipped++;
            return first;
        }
    }
    return n;
}

/* ---- hand-over --------------------------------------------------------------
 * When a new contact enters the table, every record this node holds whose key
 * is nearer to the newcomer than to this node is sent to it: the newcomer is
 * now among the key's nearest nodes. Bounded, since a fresh identity costs an
 * attacker nothing: only a contact still in the table HANDOVER_DELAY_US
 * later gets it (one that pings and leaves gets nothing), each peer at most
 * once per HANDOVER_PEER_US, and all hand-overs together within a byte
 * budget (HANDOVER_RATE per second, HANDOVER_BURST at once). What is in
 * flight is bounded too, since a newcomer that stays but never answers
 * (or reads) keeps its STOREs pending until their deadline: at most
 * HANDOVER_INFLIGHT bytes of hand-over calls at once, each batch reserved
 * in the node's memory budget on the newcomer's account (ap_rt_mem_reserve,
 * so also within the peer's and the node's limits) until its call ends. A
 * hand-over the budget cannot start is deferred (tried again
 * HANDOVER_DELAY_US later, HANDOVER_TRIES times); one cut short keeps what
 * was sent (republishing covers the rest). */

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

static bool ho_recent(ap_dht_t *dht, const ap_peer_id_t *peer, uint64_t now)
{
    for (size_t i = 0; i < HANDOVER_RECENT; i++)
        if (dht->ho_recent[i].at_us && now - dht->ho_recent[i].at_us < HANDOVER_PEER_US &&
            ap_peer_id_eq(&dht->ho_recent[i].peer, peer))
            return true;
    return false;
}

static double ho_bytes(const ap_dht_record_t *r)
{
    return (double)(r->key_len + r->subkey_len + r->value_len + 64);
}

/* Keeps the first records that fit the node's byte budget. */
static size_t ho_budget(ap_dht_t *dht, const handover_t *h, uint64_t now)
{
    double dt = (double)(now - dht->ho_tokens_us) / 1e6;
    dht->ho_tokens_us = now;
    dht->ho_tokens += dt * HANDOVER_RATE;
    if (dht->ho_tokens > HANDOVER_BURST) dht->ho_tokens = HANDOVER_BURST;
    size_t n = 0;
    for (; n < h->n; n++) {
        double b = ho_bytes(&h->recs[n]);
        if (b > dht->ho_tokens) break;
        dht->ho_tokens -= b;
    }
    return n;
}

static void handover_later(ap_dht_t *dht, const ap_peer_id_t *peer, uint8_t tries);

/* Hands over to peer; tries: how often it was deferred already. */
static void handover(ap_dht_t *dht, const ap_peer_id_t *peer, uint8_t tries)
{
    if (dht->cfg.client_mode || ap__dht_storage_records(&dht->store) == 0) return;
    uint64_t now = ap_rt_now_us(dht->rt);
    if (ho_recent(dht, peer, now)) return;
    ap__dht_storage_expire(&dht->store, ap_rt_wall_ms(dht->rt));
    handover_t h = {.dht = dht};
    ap_dht_peer_node_id(peer, h.id);
    h.recs = malloc(HANDOVER_MAX_RECORDS * sizeof *h.recs);
    h.sigs = malloc(HANDOVER_MAX_RECORDS * sizeof *h.sigs);
    h.has_sig = malloc(HANDOVER_MAX_RECORDS * sizeof *h.has_sig);
    if (h.recs && h.sigs && h.has_sig) {
        ap__dht_storage_foreach(&dht->store, handover_entry, &h);
        size_t all = h.n;
        h.n = ho_budget(dht, &h, now);
        if (h.n < all) {
            static ap_log_limit_t lim;
            char s[AP_PEER_SHORT_LEN];
            ap_log_limited(&lim, AP_LOG_INFO, MOD,
                           "peer %s: handing over %zu of %zu records (node hand-over budget)",
                           ap__dht_short_id(peer, s), h.n, all);
        }
        size_t sent = 0;
        if (h.n)
            sent = ap__dht_store_records_bg(dht, peer, h.recs,
                                            (const uint8_t(*)[AP_ED25519_SIG_LEN])h.sigs, h.has_sig,
                                            h.n, true);
        for (size_t i = sent; i < h.n; i++) dht->ho_tokens += ho_bytes(&h.recs[i]); /* unsent */
        if (dht->ho_tokens > HANDOVER_BURST) dht->ho_tokens = HANDOVER_BURST;
        char s[AP_PEER_SHORT_LEN];
        if (sent) {
            dht->ho_recent[dht->ho_recent_next].peer = *peer;
            dht->ho_recent[dht->ho_recent_next].at_us = now;
            dht->ho_recent_next = (dht->ho_recent_next + 1) % HANDOVER_RECENT;
            ap_debug(MOD, "peer %s: handing over %zu records", ap__dht_short_id(peer, s), sent);
        }
        if (sent < h.n) {
            static ap_log_limit_t lim2;
            ap_log_limited(&lim2, AP_LOG_INFO, MOD,
                           "peer %s: hand-over %s after %zu of %zu records (memory budget full: "
                           "%zu bytes of hand-over in flight)",
                           ap__dht_short_id(peer, s), sent ? "cut short" : "deferred", sent, h.n,
                           dht->ho_inflight);
            if (!sent && tries + 1 < HANDOVER_TRIES) {
                dht->stats.handovers_deferred++;
                handover_later(dht, peer, (uint8_t)(tries + 1));
            }
        }
    }
    free(h.recs);
    free(h.sigs);
    free(h.has_sig);
}

static void ho_arm(ap_dht_t *dht);

static void ho_timer_cb(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_dht_t *dht = arg;
    dht->ho_timer = 0;
    uint64_t now = ap_rt_now_us(dht->rt);
    for (size_t i = 0; i < HANDOVER_PENDING_MAX; i++) {
        if (!dht->ho_pending[i].used || dht->ho_pending[i].due_us > now) continue;
        dht->ho_pending[i].used = false;
        ap_peer_id_t p = dht->ho_pending[i].peer;
        const ap__dht_contact_t *c = ap__dht_routing_lookup(&dht->table, &p);
        if (c && c->failures == 0 && ap_rt_is_connected(dht->rt, &p))
            handover(dht, &p, dht->ho_pending[i].tries);
    }
    ho_arm(dht);
}

static void ho_arm(ap_dht_t *dht)
{
    if (dht->ho_timer) return;
    uint64_t now = ap_rt_now_us(dht->rt), first = UINT64_MAX;
    for (size_t i = 0; i < HANDOVER_PENDING_MAX; i++)
        if (dht->ho_pending[i].used && dht->ho_pending[i].due_us < first)
            first = dht->ho_pending[i].due_us;
    if (first == UINT64_MAX) return;
    dht->ho_timer = ap_rt_timer_start(dht->rt, first > now ? first - now : 0, 0, ho_timer_cb, dht);
}

/* A new contact: its hand-over waits to see whether it stays (or, tries >
 * 0, for room in the budget). */
static void handover_later(ap_dht_t *dht, const ap_peer_id_t *peer, uint8_t tries)
{
    if (dht->cfg.client_mode || ap__dht_storage_records(&dht->store) == 0) return;
    size_t freeslot = HANDOVER_PENDING_MAX;
    for (size_t i = 0; i < HANDOVER_PENDING_MAX; i++) {
        if (dht->ho_pending[i].used && ap_peer_id_eq(&dht->ho_pending[i].peer, peer)) return;
        if (!dht->ho_pending[i].used && freeslot == HANDOVER_PENDING_MAX) freeslot = i;
    }
    if (freeslot == HANDOVER_PENDING_MAX)
        return; /* many newcomers at once: republishing
                    covers the rest */
    dht->ho_pending[freeslot].used = true;
    dht->ho_pending[freeslot].peer = *peer;
    dht->ho_pending[freeslot].tries = tries;
    dht->ho_pending[freeslot].due_us = ap_rt_now_us(dht->rt) + HANDOVER_DELAY_US;
    ho_arm(dht);
}

/* A peer answered us or contacted us (not in client mode). */
void ap__dht_peer_seen(ap_dht_t *dht, const ap_peer_id_t *peer, const char *addr)
{
    ap__dht_contact_t *check = NULL;
    int r = ap__dht_routing_seen(&dht->table, peer, addr, ap_rt_now_us(dht->rt), &check);
    if (r == AP__RT_ADDED) {
        handover_later(dht, peer, 0);
    } else if (r == AP__RT_PENDING && check) {
        ap_peer_id_t c = check->peer; /* liveness check of the least recently seen */
        ping_peer(dht, &c);
    }
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
void ap__dht_contact_failed(ap_dht_t *dht, const ap_peer_id_t *peer, uint64_t now)
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
    (void)ap__dht_find_nodes(dht, id, refresh_done, NULL);
}

void ap__dht_maintenance(ap_rt_t *rt, void *arg)
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
        (void)ap__dht_find_nodes(dht, id, refresh_done, NULL);
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
void ap__dht_republish_postpone(ap_dht_t *dht, const uint8_t id[AP_DHT_ID_LEN])
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
        (void)ap__dht_store_launch(dht, chunk, b - a, republish_done,
                                   NULL); /* frees chunk on error */
    }
    free(rp.sr);
    free(rp.key_start);
}

void ap__dht_republish_tick(ap_rt_t *rt, void *arg)
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

/* DHT teardown: background calls are cancelled (or dropped). */
void ap__dht_bg_cancel_all(ap_dht_t *dht)
{
    while (dht->bgcalls) {
        bgcall_t *b = dht->bgcalls;
        ap_rt_rpc_cancel(dht->rt, b->id);       /* bg_done unlinks and frees */
        if (dht->bgcalls == b) bg_free(dht, b); /* not cancellable (already done?): drop it */
    }
}
