/* DHT record storage. See storage.h. */
#include "dht/storage.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ENTRY_OVERHEAD 64 /* bytes charged per record besides its payload */

void ap__dht_storage_init(ap__dht_storage_t *st, size_t max_records, size_t max_bytes,
                          int64_t max_ttl_ms, uint32_t per_peer_per_min)
{
    memset(st, 0, sizeof *st);
    st->max_records = max_records;
    st->max_bytes = max_bytes;
    st->max_ttl_ms = max_ttl_ms;
    st->per_peer_per_min = per_peer_per_min;
    st->peer_max_bytes = max_bytes / 32;
    st->peer_max_records = max_records / 32;
}

void ap__dht_storage_set_quota(ap__dht_storage_t *st, size_t peer_max_bytes,
                               size_t peer_max_records)
{
    st->peer_max_bytes = peer_max_bytes;
    st->peer_max_records = peer_max_records;
}

static void entry_free(ap__dht_sentry_t *e)
{
    for (size_t i = 0; i < e->nrecs; i++) free(e->recs[i]);
    free(e->recs);
    free(e->key);
    free(e);
}

void ap__dht_storage_close(ap__dht_storage_t *st)
{
    for (size_t i = 0; i < st->tab_cap; i++) {
        ap__dht_sentry_t *e = st->tab[i];
        while (e) {
            ap__dht_sentry_t *n = e->next;
            entry_free(e);
            e = n;
        }
    }
    for (size_t i = 0; i < st->ncontribs; i++) {
        free(st->contribs[i]->heap);
        free(st->contribs[i]);
    }
    free(st->contribs);
    free(st->ctab);
    free(st->tab);
    free(st->heap);
    free(st->rate);
    memset(st, 0, sizeof *st);
}

/* ---- rate limit ---------------------------------------------------------- */

int ap__dht_storage_charge(ap__dht_storage_t *st, const ap_peer_id_t *from, uint64_t now_us)
{
    if (!from || st->per_peer_per_min == 0) return 0;
    if (!st->rate) {
        st->rate = calloc(AP__DHT_RATE_SLOTS, sizeof *st->rate);
        if (!st->rate) return AP_ENOMEM;
    }
    const uint64_t window = 60ull * 1000000ull;
    size_t h = (size_t)ap_peer_id_hash(from) & (AP__DHT_RATE_SLOTS - 1);
    ap__dht_rate_t *slot = NULL, *oldest = NULL;
    for (int probe = 0; probe < 8; probe++) {
        ap__dht_rate_t *s = &st->rate[(h + (size_t)probe) & (AP__DHT_RATE_SLOTS - 1)];
        if (s->used && ap_peer_id_eq(&s->peer, from)) {
            slot = s;
            break;
        }
        bool stale = !s->used || now_us - s->window_start_us >= window;
        if (stale && !oldest) oldest = s;
        if (!oldest || (oldest->used && s->window_start_us < oldest->window_start_us)) oldest = s;
    }
    if (!slot) {
        slot = oldest;
        slot->used = true;
        slot->peer = *from;
        slot->window_start_us = now_us;
        slot->count = 0;
    }
    if (now_us - slot->window_start_us >= window) {
        slot->window_start_us = now_us;
        slot->count = 0;
    }
    if (slot->count >= st->per_peer_per_min) return AP_ERATE;
    slot->count++;
    return 0;
}

/* ---- heaps on expiration ---------------------------------------------------
 * One global min-heap (expiry) and one per contributor (fair eviction); the
 * same code serves both, picking the index field by `own`. */

typedef struct heap {
    ap__dht_srec_t ***a;
    size_t *n, *cap;
    bool own; /* the contributor's heap (cheap_idx) */
} heap_t;

static heap_t gheap(ap__dht_storage_t *st)
{
    return (heap_t){&st->heap, &st->nheap, &st->heap_cap, false};
}

static heap_t cheap(ap__dht_contrib_t *c)
{
    return (heap_t){&c->heap, &c->nheap, &c->heap_cap, true};
}

static size_t *hidx(const heap_t *h, ap__dht_srec_t *r)
{
    return h->own ? &r->cheap_idx : &r->heap_idx;
}

static void heap_swap(heap_t *h, size_t a, size_t b)
{
    ap__dht_srec_t **v = *h->a, *t = v[a];
    v[a] = v[b];
    v[b] = t;
    *hidx(h, v[a]) = a;
    *hidx(h, v[b]) = b;
}

static void heap_up(heap_t *h, size_t i)
{
    ap__dht_srec_t **v = *h->a;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (v[p]->exp <= v[i]->exp) break;
        heap_swap(h, p, i);
        i = p;
    }
}

static void heap_down(heap_t *h, size_t i)
{
    ap__dht_srec_t **v = *h->a;
    size_t n = *h->n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && v[l]->exp < v[m]->exp) m = l;
        if (r < n && v[r]->exp < v[m]->exp) m = r;
        if (m == i) return;
        heap_swap(h, i, m);
        i = m;
    }
}

static int heap_reserve(heap_t *h)
{
    if (*h->n < *h->cap) return 0;
    size_t nc = *h->cap ? *h->cap * 2 : 16;
    ap__dht_srec_t **nh = realloc(*h->a, nc * sizeof *nh);
    if (!nh) return AP_ENOMEM;
    *h->a = nh;
    *h->cap = nc;
    return 0;
}

static void heap_push(heap_t *h, ap__dht_srec_t *r) /* after heap_reserve */
{
    *hidx(h, r) = *h->n;
    (*h->a)[(*h->n)++] = r;
    heap_up(h, *hidx(h, r));
}

static void heap_remove(heap_t *h, ap__dht_srec_t *r)
{
    size_t i = *hidx(h, r);
    ap__dht_srec_t **v = *h->a;
    (*h->n)--;
    if (i != *h->n) {
        v[i] = v[*h->n];
        *hidx(h, v[i]) = i;
        heap_down(h, i);
        heap_up(h, i);
    }
}

/* ---- contributors ---------------------------------------------------------- */

static size_t contrib_hash(const ap_peer_id_t *from)
{
    return from ? (size_t)ap_peer_id_hash(from) : 0;
}

static ap__dht_contrib_t *contrib_find(const ap__dht_storage_t *st, const ap_peer_id_t *from)
{
    if (!st->ctab_cap) return NULL;
    ap__dht_contrib_t *c = st->ctab[contrib_hash(from) & (st->ctab_cap - 1)];
    for (; c; c = c->next)
        if (from ? !c->local && ap_peer_id_eq(&c->peer, from) : c->local) return c;
    return NULL;
}

static int ctab_grow(ap__dht_storage_t *st)
{
    size_t nc = st->ctab_cap ? st->ctab_cap * 2 : 64;
    ap__dht_contrib_t **nt = calloc(nc, sizeof *nt);
    if (!nt) return AP_ENOMEM;
    for (size_t i = 0; i < st->ncontribs; i++) {
        ap__dht_contrib_t *c = st->contribs[i];
        size_t h = contrib_hash(c->local ? NULL : &c->peer) & (nc - 1);
        c->next = nt[h];
        nt[h] = c;
    }
    free(st->ctab);
    st->ctab = nt;
    st->ctab_cap = nc;
    return 0;
}

/* Finds or creates from's contributor with room for one more record. */
static ap__dht_contrib_t *contrib_get(ap__dht_storage_t *st, const ap_peer_id_t *from)
{
    ap__dht_contrib_t *c = contrib_find(st, from);
    if (!c) {
        if ((st->ncontribs + 1) * 4 > st->ctab_cap * 3 && ctab_grow(st)) return NULL;
        if (st->ncontribs == st->contribs_cap) {
            size_t nc = st->contribs_cap ? st->contribs_cap * 2 : 16;
            ap__dht_contrib_t **na = realloc(st->contribs, nc * sizeof *na);
            if (!na) return NULL;
            st->contribs = na;
            st->contribs_cap = nc;
        }
        c = calloc(1, sizeof *c);
        if (!c) return NULL;
        c->local = from == NULL;
        if (from) c->peer = *from;
        c->evict_log_ms = INT64_MIN;
        size_t h = contrib_hash(from) & (st->ctab_cap - 1);
        c->next = st->ctab[h];
        st->ctab[h] = c;
        c->idx = st->ncontribs;
        st->contribs[st->ncontribs++] = c;
    }
    heap_t h = cheap(c);
    if (heap_reserve(&h)) return NULL;
    return c;
}

static void contrib_drop_if_empty(ap__dht_storage_t *st, ap__dht_contrib_t *c)
{
    if (c->nheap || c->pinned) return;
    ap__dht_contrib_t **pp =
        &st->ctab[contrib_hash(c->local ? NULL : &c->peer) & (st->ctab_cap - 1)];
    while (*pp != c) pp = &(*pp)->next;
    *pp = c->next;
    st->contribs[c->idx] = st->contribs[--st->ncontribs];
    st->contribs[c->idx]->idx = c->idx;
    free(c->heap);
    free(c);
}

const ap__dht_contrib_t *ap__dht_storage_largest(const ap__dht_storage_t *st)
{
    const ap__dht_contrib_t *best = NULL;
    for (size_t i = 0; i < st->ncontribs; i++) {
        const ap__dht_contrib_t *c = st->contribs[i];
        if (!c->nheap) continue;
        if (!best || c->bytes > best->bytes || (c->bytes == best->bytes && c->nheap > best->nheap))
            best = c;
    }
    return best;
}

void ap__dht_storage_held(const ap__dht_storage_t *st, const ap_peer_id_t *from, size_t *records,
                          size_t *bytes)
{
    const ap__dht_contrib_t *c = contrib_find(st, from);
    if (records) *records = c ? c->nheap : 0;
    if (bytes) *bytes = c ? c->bytes : 0;
}

/* ---- entries -------------------------------------------------------------- */

static size_t id_hash(const uint8_t *id)
{
    uint64_t h;
    memcpy(&h, id, sizeof h); /* ids are BLAKE2b output: already uniform */
    return (size_t)h;
}

static ap__dht_sentry_t **slot_of(ap__dht_storage_t *st, const uint8_t *id)
{
    if (!st->tab_cap) return NULL;
    ap__dht_sentry_t **pp = &st->tab[id_hash(id) & (st->tab_cap - 1)];
    while (*pp && memcmp((*pp)->id, id, AP_DHT_ID_LEN) != 0) pp = &(*pp)->next;
    return pp;
}

static int grow_tab(ap__dht_storage_t *st)
{
    size_t nc = st->tab_cap ? st->tab_cap * 2 : 256;
    ap__dht_sentry_t **nt = calloc(nc, sizeof *nt);
    if (!nt) return AP_ENOMEM;
    for (size_t i = 0; i < st->tab_cap; i++) {
        ap__dht_sentry_t *e = st->tab[i];
        while (e) {
            ap__dht_sentry_t *n = e->next;
            size_t h = id_hash(e->id) & (nc - 1);
            e->next = nt[h];
            nt[h] = e;
            e = n;
        }
    }
    free(st->tab);
    st->tab = nt;
    st->tab_cap = nc;
    return 0;
}

static void unlink_entry(ap__dht_storage_t *st, ap__dht_sentry_t *e)
{
    ap__dht_sentry_t **pp = slot_of(st, e->id);
    if (pp && *pp == e) {
        *pp = e->next;
        st->nentries--;
    }
    entry_free(e);
}

/* Takes r out of both heaps and the byte counts (r stays allocated). */
static void rec_unaccount(ap__dht_storage_t *st, ap__dht_srec_t *r)
{
    heap_t g = gheap(st), h = cheap(r->contrib);
    heap_remove(&g, r);
    heap_remove(&h, r);
    st->bytes -= r->bytes;
    r->contrib->bytes -= r->bytes;
}

/* Removes record i of e; frees e when it becomes empty (returns true then). */
static bool drop_rec(ap__dht_storage_t *st, ap__dht_sentry_t *e, size_t i)
{
    ap__dht_srec_t *r = e->recs[i];
    ap__dht_contrib_t *c = r->contrib;
    rec_unaccount(st, r);
    free(r);
    contrib_drop_if_empty(st, c);
    e->recs[i] = e->recs[--e->nrecs];
    if (e->nrecs == 0) {
        st->bytes -= e->key_len;
        unlink_entry(st, e);
        return true;
    }
    return false;
}

static size_t rec_index(const ap__dht_sentry_t *e, const ap__dht_srec_t *r)
{
    for (size_t i = 0; i < e->nrecs; i++)
        if (e->recs[i] == r) return i;
    return e->nrecs;
}

void ap__dht_storage_expire(ap__dht_storage_t *st, int64_t now_ms)
{
    while (st->nheap && st->heap[0]->exp <= now_ms) {
        ap__dht_srec_t *r = st->heap[0];
        drop_rec(st, r->entry, rec_index(r->entry, r));
    }
}

static const char *who(const ap__dht_contrib_t *c, char buf[AP_PEER_SHORT_LEN])
{
    if (!c || c->local) return "(this node)";
    return ap_peer_id_short(&c->peer, buf);
}

/* One line per minute per evicting contributor, with what it cost whom. */
static void report_evictions(ap__dht_storage_t *st, ap__dht_contrib_t *by,
                             const ap__dht_contrib_t *victim, int64_t now_ms)
{
    if (!by || !by->evict_unlogged) return;
    if (by->evict_log_ms != INT64_MIN && now_ms - by->evict_log_ms < 60000) return;
    char a[AP_PEER_SHORT_LEN], b[AP_PEER_SHORT_LEN];
    ap_warn("dht",
            "storage full (%zu records, %zu bytes): peer %s's stores evicted %llu records "
            "(%llu bytes) in the last minute, latest from %s, the largest contributor "
            "(%zu records, %zu bytes)",
            st->nheap, st->bytes, who(by, a), (unsigned long long)by->evict_unlogged,
            (unsigned long long)by->evict_unlogged_bytes, who(victim, b),
            victim ? victim->nheap : 0, victim ? victim->bytes : 0);
    by->evict_log_ms = now_ms;
    by->evict_unlogged = by->evict_unlogged_bytes = 0;
}

/* ---- put: check, make room, insert ------------------------------------------- */

int ap__dht_storage_check(ap__dht_storage_t *st, const ap_peer_id_t *from,
                          const ap_dht_record_t *rec, int64_t now_ms, ap__dht_put_plan_t *plan)
{
    memset(plan, 0, sizeof *plan);
    plan->from = from;
    plan->replace = SIZE_MAX;
    if (rec->expiration_ms <= now_ms) return AP_EEXPIRED;
    if (rec->expiration_ms - now_ms > st->max_ttl_ms) return AP_ERANGE;
    ap__dht_storage_expire(st, now_ms);

    ap_dht_key_id(rec->key, rec->key_len, plan->id);
    ap__dht_sentry_t **pp = slot_of(st, plan->id);
    ap__dht_sentry_t *e = pp ? *pp : NULL;
    plan->e = e;
    bool want_dict = rec->subkey_len > 0;
    if (e) {
        if (e->key_len != rec->key_len || memcmp(e->key, rec->key, rec->key_len) != 0)
            return AP_EEXIST; /* BLAKE2b-160 collision: refuse rather than mix keys */
        if (e->is_dict != want_dict) {
            for (size_t i = 0; i < e->nrecs; i++)
                if (e->recs[i]->exp >= rec->expiration_ms) return AP_ESTALE;
            plan->clear_all = true;
        } else {
            for (size_t i = 0; i < e->nrecs; i++) {
                ap__dht_srec_t *r = e->recs[i];
                if (r->subkey_len == rec->subkey_len &&
                    (rec->subkey_len == 0 ||
                     memcmp(r->subkey, rec->subkey, rec->subkey_len) == 0)) {
                    if (r->exp >= rec->expiration_ms) return AP_ESTALE;
                    plan->replace = i;
                    break;
                }
            }
        }
    }
    plan->need = ENTRY_OVERHEAD + rec->subkey_len + rec->value_len + (e ? 0 : rec->key_len);
    if (plan->need > st->max_bytes || st->max_records == 0) return AP_EFULL;
    /* what the write frees: in total, and of from's own holdings */
    const ap__dht_contrib_t *mine = contrib_find(st, from);
    size_t own_freed = 0, own_freed_recs = 0;
    for (size_t i = 0; e && i < e->nrecs; i++) {
        if (!plan->clear_all && i != plan->replace) continue;
        plan->freed += e->recs[i]->bytes;
        plan->freed_recs++;
        if (mine && e->recs[i]->contrib == mine) {
            own_freed += e->recs[i]->bytes;
            own_freed_recs++;
        }
    }
    if (from) {
        size_t held = mine ? mine->bytes : 0, nheld = mine ? mine->nheap : 0;
        size_t rbytes = ENTRY_OVERHEAD + rec->subkey_len + rec->value_len;
        if (held - own_freed + rbytes > st->peer_max_bytes ||
            nheld - own_freed_recs + 1 > st->peer_max_records) {
            st->quota_refused++;
            return AP_EQUOTA;
        }
    }
    return 0;
}

int ap__dht_storage_make_room(ap__dht_storage_t *st, const ap__dht_put_plan_t *plan,
                              const ap_dht_record_t *rec, int64_t now_ms)
{
    ap__dht_contrib_t *by = contrib_find(st, plan->from);
    const ap__dht_contrib_t *victim_c = NULL;
    int rc = 0;
    while (st->nheap - plan->freed_recs + 1 > st->max_records ||
           st->bytes - plan->freed + plan->need > st->max_bytes) {
        const ap__dht_contrib_t *big = ap__dht_storage_largest(st);
        if (!big) {
            rc = AP_EFULL;
            break;
        }
        ap__dht_srec_t *victim = big->heap[0];
        /* a contributor never loses its own records to a shorter-lived one */
        if (big == by && victim->exp >= rec->expiration_ms) {
            rc = AP_EFULL;
            break;
        }
        if (!by) {
            by = contrib_get(st, plan->from); /* to count the evictions it causes */
            if (!by) {
                rc = AP_ENOMEM;
                break;
            }
        }
        by->pinned = true;
        victim_c = big;
        by->evict_unlogged++;
        by->evict_unlogged_bytes += victim->bytes;
        st->evicted++;
        bool own_key = victim->entry == plan->e;
        drop_rec(st, victim->entry, rec_index(victim->entry, victim));
        if (own_key) { /* the plan's indices moved: check again */
            rc = AP_EAGAIN;
            break;
        }
    }
    if (victim_c) report_evictions(st, by, victim_c, now_ms);
    if (by) {
        by->pinned = false;
        if (rc && rc != AP_EAGAIN) contrib_drop_if_empty(st, by);
    }
    return rc;
}

int ap__dht_storage_insert(ap__dht_storage_t *st, ap__dht_put_plan_t *plan,
                           const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig)
{
    ap__dht_sentry_t *e = plan->e;
    size_t replace = plan->replace;
    heap_t g = gheap(st);
    if (heap_reserve(&g)) return AP_ENOMEM;
    ap__dht_contrib_t *c = contrib_get(st, plan->from);
    if (!c) return AP_ENOMEM;
    ap__dht_srec_t *r = malloc(sizeof *r + rec->subkey_len + rec->value_len);
    if (!r) {
        contrib_drop_if_empty(st, c);
        return AP_ENOMEM;
    }
    c->pinned = true; /* dropping the key's old records must not free it */
    r->exp = rec->expiration_ms;
    r->has_sig = has_sig;
    if (has_sig) memcpy(r->sig, sig, AP_ED25519_SIG_LEN);
    r->subkey = r->data;
    r->subkey_len = rec->subkey_len;
    if (rec->subkey_len) memcpy(r->subkey, rec->subkey, rec->subkey_len);
    r->value = r->data + rec->subkey_len;
    r->value_len = rec->value_len;
    if (rec->value_len) memcpy(r->value, rec->value, rec->value_len);
    r->bytes = ENTRY_OVERHEAD + rec->subkey_len + rec->value_len;
    r->contrib = c;

    if (!e) {
        if (!st->tab_cap || (st->nentries + 1) * 4 > st->tab_cap * 3) {
            if (grow_tab(st)) {
                free(r);
                c->pinned = false;
                contrib_drop_if_empty(st, c);
                return AP_ENOMEM;
            }
        }
        e = calloc(1, sizeof *e);
        if (e) e->key = malloc(rec->key_len);
        if (!e || !e->key) {
            if (e) free(e);
            free(r);
            c->pinned = false;
            contrib_drop_if_empty(st, c);
            return AP_ENOMEM;
        }
        memcpy(e->id, plan->id, AP_DHT_ID_LEN);
        memcpy(e->key, rec->key, rec->key_len);
        e->key_len = rec->key_len;
        e->is_dict = rec->subkey_len > 0;
        ap__dht_sentry_t **pp = slot_of(st, plan->id);
        e->next = *pp;
        *pp = e;
        st->nentries++;
        st->bytes += rec->key_len;
        plan->e = e;
    } else if (plan->clear_all) {
        while (e->nrecs > 1) drop_rec(st, e, e->nrecs - 1);
        /* keep the entry alive: replace its last record in place below */
        replace = 0;
        e->is_dict = rec->subkey_len > 0;
    }
    if (replace != SIZE_MAX) {
        ap__dht_srec_t *old = e->recs[replace];
        ap__dht_contrib_t *oc = old->contrib;
        rec_unaccount(st, old);
        free(old);
        contrib_drop_if_empty(st, oc);
        e->recs[replace] = r;
    } else {
        if (e->nrecs == e->cap) {
            size_t nc = e->cap ? e->cap * 2 : 1;
            ap__dht_srec_t **nr = realloc(e->recs, nc * sizeof *nr);
            if (!nr) {
                free(r);
                c->pinned = false;
                contrib_drop_if_empty(st, c);
                if (e->nrecs == 0) {
                    st->bytes -= e->key_len;
                    unlink_entry(st, e);
                }
                return AP_ENOMEM;
            }
            e->recs = nr;
            e->cap = nc;
        }
        e->recs[e->nrecs++] = r;
    }
    r->entry = e;
    heap_t h = cheap(c);
    heap_push(&g, r); /* both reserved above */
    heap_push(&h, r);
    st->bytes += r->bytes;
    c->bytes += r->bytes;
    c->pinned = false;
    return 0;
}

int ap__dht_storage_put_from(ap__dht_storage_t *st, const ap_peer_id_t *from,
                             const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig,
                             int64_t now_ms)
{
    ap__dht_put_plan_t plan;
    for (;;) {
        int rc = ap__dht_storage_check(st, from, rec, now_ms, &plan);
        if (!rc) rc = ap__dht_storage_make_room(st, &plan, rec, now_ms);
        if (rc == AP_EAGAIN) continue; /* evicted from this key: each pass drops a record */
        if (!rc) rc = ap__dht_storage_insert(st, &plan, rec, sig, has_sig);
        if (rc) { /* a contributor made for this put and left empty goes */
            ap__dht_contrib_t *c = contrib_find(st, from);
            if (c) contrib_drop_if_empty(st, c);
        }
        return rc;
    }
}

int ap__dht_storage_put(ap__dht_storage_t *st, const ap_dht_record_t *rec, const uint8_t *sig,
                        bool has_sig, int64_t now_ms)
{
    return ap__dht_storage_put_from(st, NULL, rec, sig, has_sig, now_ms);
}

ap__dht_sentry_t *ap__dht_storage_find(ap__dht_storage_t *st, const uint8_t id[AP_DHT_ID_LEN],
                                       int64_t now_ms)
{
    ap__dht_storage_expire(st, now_ms);
    ap__dht_sentry_t **pp = slot_of(st, id);
    return pp ? *pp : NULL;
}

void ap__dht_storage_foreach(ap__dht_storage_t *st, void (*fn)(void *arg, ap__dht_sentry_t *e),
                             void *arg)
{
    for (size_t i = 0; i < st->tab_cap; i++)
        for (ap__dht_sentry_t *e = st->tab[i]; e; e = e->next) fn(arg, e);
}

void ap__dht_srec_view(const ap__dht_sentry_t *e, const ap__dht_srec_t *r, ap_dht_record_t *out)
{
    out->key = e->key;
    out->key_len = e->key_len;
    out->subkey = r->subkey_len ? r->subkey : NULL;
    out->subkey_len = r->subkey_len;
    out->value = r->value;
    out->value_len = r->value_len;
    out->expiration_ms = r->exp;
}
