/* DHT: lookups. The iterative traversal (candidates, calls, beam), get
 * with caching and coalescing, store and its replica phase, node lookups. */
#include "dht/dht_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- lookups ----------------------------------------------------------------- */

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
            (void)ap__dht_store_records_bg(dht, &c->c.peer, recs,
                                           (const uint8_t(*)[AP_ED25519_SIG_LEN])sigs, has_sig, n,
                                           false);
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

void ap__dht_lookup_cancel(lookup_t *lk, int err)
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
    c->id = ap__dht_send_request(dht, peer, &q, on_call_done, c);
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
        ap__dht_lookup_cancel(lk, AP_ENOMEM);
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
            int rc = ap__dht_validate(dht, &r, sig, has_sig, &c->peer);
            if (rc) {
                char s[AP_PEER_SHORT_LEN];
                ap_warn(MOD, "peer %s: refused a record it returned: %s",
                        ap__dht_short_id(&c->peer, s), ap_err_name(rc));
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
            ap__dht_learn_addrs(dht, &nc.peer, fr->nearest[j]->addrs, fr->nearest[j]->n_addrs);
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
            ap_warn(MOD, "peer %s: malformed response: %s", ap__dht_short_id(&c->peer, s),
                    ap_err_name(rc));
            if (r) apiary__dht__response__free_unpacked(r, NULL);
            r = NULL;
            status = rc;
        }
    }
    uint64_t now = ap_rt_now_us(rt);
    if (status == 0 ||
        (c->store && status != AP_ETIMEDOUT && status != AP_EUNREACH && status != AP_ECLOSED))
        ap__dht_peer_seen(dht, &c->peer, c->addr);
    else if (status != AP_ECANCELED)
        ap__dht_contact_failed(dht, &c->peer, now);
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
                if (rc == 0) ap__dht_republish_postpone(dht, kk->id);
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
            c->id = ap__dht_send_request(dht, &tg[t].peer, &q, on_call_done, c);
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
            if (ap__dht_validate(dht, &r, e->recs[i]->sig, e->recs[i]->has_sig, NULL)) continue;
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
        if (!rc)
            rc = ap__dht_sign_cached(dht->rt, &dht->sigcache, &recs[i], sr[i].sig, &sr[i].has_sig);
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
            rc = ap__dht_validate(dht, &sr[i].r, sr[i].sig, sr[i].has_sig, NULL);
        }
    }
    if (rc) {
        for (size_t i = 0; i < n; i++) free(sr[i].data);
        free(sr);
        return rc;
    }
    return ap__dht_store_launch(dht, sr, n, cb, arg);
}

/* Starts the traversal of a store of n prepared (validated, signed) records;
 * takes ownership of sr (freed on error too). */
int ap__dht_store_launch(ap_dht_t *dht, srec_t *sr, size_t n, ap_dht_store_many_fn cb, void *arg)
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

int ap__dht_find_nodes(ap_dht_t *dht, const uint8_t id[AP_DHT_ID_LEN], ap_dht_done_fn cb, void *arg)
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

/* DHT teardown: every lookup ends with AP_ECANCELED (a bootstrap's without its callback). */
void ap__dht_lookup_cancel_all(ap_dht_t *dht)
{
    while (dht->lookups) {
        lookup_t *lk = dht->lookups;
        if (lk->kind == LK_NODES && lk->done_cb == ap__dht_boot_lookup_done) lk->done_cb = NULL;
        ap__dht_lookup_cancel(lk, AP_ECANCELED);
    }
}
