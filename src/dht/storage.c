/* DHT record storage. See storage.h. */
#include "dht/storage.h"

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
    if (slot->count >= st->per_peer_per_min) return AP_ELIMIT;
    slot->count++;
    return 0;
}

/* ---- heap on expiration --------------------------------------------------- */

static void heap_swap(ap__dht_storage_t *st, size_t a, size_t b)
{
    ap__dht_srec_t *t = st->heap[a];
    st->heap[a] = st->heap[b];
    st->heap[b] = t;
    st->heap[a]->heap_idx = a;
    st->heap[b]->heap_idx = b;
}

static void heap_up(ap__dht_storage_t *st, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (st->heap[p]->exp <= st->heap[i]->exp) break;
        heap_swap(st, p, i);
        i = p;
    }
}

static void heap_down(ap__dht_storage_t *st, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < st->nheap && st->heap[l]->exp < st->heap[m]->exp) m = l;
        if (r < st->nheap && st->heap[r]->exp < st->heap[m]->exp) m = r;
        if (m == i) return;
        heap_swap(st, i, m);
        i = m;
    }
}

static int heap_push(ap__dht_storage_t *st, ap__dht_srec_t *r)
{
    if (st->nheap == st->heap_cap) {
        size_t nc = st->heap_cap ? st->heap_cap * 2 : 64;
        ap__dht_srec_t **nh = realloc(st->heap, nc * sizeof *nh);
        if (!nh) return AP_ENOMEM;
        st->heap = nh;
        st->heap_cap = nc;
    }
    r->heap_idx = st->nheap;
    st->heap[st->nheap++] = r;
    heap_up(st, r->heap_idx);
    return 0;
}

static void heap_remove(ap__dht_storage_t *st, ap__dht_srec_t *r)
{
    size_t i = r->heap_idx;
    st->nheap--;
    if (i != st->nheap) {
        st->heap[i] = st->heap[st->nheap];
        st->heap[i]->heap_idx = i;
        heap_down(st, i);
        heap_up(st, i);
    }
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

/* Removes record i of e; frees e when it becomes empty (returns true then). */
static bool drop_rec(ap__dht_storage_t *st, ap__dht_sentry_t *e, size_t i)
{
    ap__dht_srec_t *r = e->recs[i];
    heap_remove(st, r);
    st->bytes -= r->bytes;
    free(r);
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

static void evict_one(ap__dht_storage_t *st)
{
    ap__dht_srec_t *r = st->heap[0];
    drop_rec(st, r->entry, rec_index(r->entry, r));
    st->evicted++;
}

int ap__dht_storage_put(ap__dht_storage_t *st, const ap_dht_record_t *rec, const uint8_t *sig,
                        bool has_sig, int64_t now_ms)
{
    if (rec->expiration_ms <= now_ms) return AP_EEXPIRED;
    if (rec->expiration_ms - now_ms > st->max_ttl_ms) return AP_ERANGE;
    ap__dht_storage_expire(st, now_ms);

    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_key_id(rec->key, rec->key_len, id);
    ap__dht_sentry_t **pp = slot_of(st, id);
    ap__dht_sentry_t *e = pp ? *pp : NULL;
    bool want_dict = rec->subkey_len > 0;
    size_t replace = SIZE_MAX; /* index of the record the new one replaces */
    bool clear_all = false;    /* kind change: drop everything the key holds */
    if (e) {
        if (e->key_len != rec->key_len || memcmp(e->key, rec->key, rec->key_len) != 0)
            return AP_EEXIST; /* BLAKE2b-160 collision: refuse rather than mix keys */
        if (e->is_dict != want_dict) {
            for (size_t i = 0; i < e->nrecs; i++)
                if (e->recs[i]->exp >= rec->expiration_ms) return AP_ESTALE;
            clear_all = true;
        } else {
            for (size_t i = 0; i < e->nrecs; i++) {
                ap__dht_srec_t *r = e->recs[i];
                if (r->subkey_len == rec->subkey_len &&
                    (rec->subkey_len == 0 ||
                     memcmp(r->subkey, rec->subkey, rec->subkey_len) == 0)) {
                    if (r->exp >= rec->expiration_ms) return AP_ESTALE;
                    replace = i;
                    break;
                }
            }
        }
    }

    size_t need = ENTRY_OVERHEAD + rec->subkey_len + rec->value_len + (e ? 0 : rec->key_len);
    if (need > st->max_bytes || st->max_records == 0) return AP_ELIMIT;
    /* Make room by evicting the earliest-expiring records, but never for a
     * record that would itself be the first to go. */
    size_t freed_by_replace = 0, recs_by_replace = 0;
    if (replace != SIZE_MAX) {
        freed_by_replace = e->recs[replace]->bytes;
        recs_by_replace = 1;
    } else if (clear_all) {
        for (size_t i = 0; i < e->nrecs; i++) freed_by_replace += e->recs[i]->bytes;
        recs_by_replace = e->nrecs;
    }
    while (st->nheap - recs_by_replace + 1 > st->max_records ||
           st->bytes - freed_by_replace + need > st->max_bytes) {
        ap__dht_srec_t *first = st->heap[0];
        if (first->exp >= rec->expiration_ms) return AP_ELIMIT;
        if (e && first->entry == e) {
            /* Evicting from the key being written: restart the bookkeeping. */
            evict_one(st);
            return ap__dht_storage_put(st, rec, sig, has_sig, now_ms);
        }
        evict_one(st);
    }

    ap__dht_srec_t *r = malloc(sizeof *r + rec->subkey_len + rec->value_len);
    if (!r) return AP_ENOMEM;
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

    if (!e) {
        if (!st->tab_cap || (st->nentries + 1) * 4 > st->tab_cap * 3) {
            if (grow_tab(st)) {
                free(r);
                return AP_ENOMEM;
            }
        }
        e = calloc(1, sizeof *e);
        if (e) e->key = malloc(rec->key_len);
        if (!e || !e->key) {
            if (e) free(e);
            free(r);
            return AP_ENOMEM;
        }
        memcpy(e->id, id, AP_DHT_ID_LEN);
        memcpy(e->key, rec->key, rec->key_len);
        e->key_len = rec->key_len;
        e->is_dict = want_dict;
        pp = slot_of(st, id);
        e->next = *pp;
        *pp = e;
        st->nentries++;
        st->bytes += rec->key_len;
    } else if (clear_all) {
        while (e->nrecs > 1) drop_rec(st, e, e->nrecs - 1);
        /* keep the entry alive: replace its last record in place below */
        replace = 0;
        e->is_dict = want_dict;
    }
    if (replace != SIZE_MAX) {
        ap__dht_srec_t *old = e->recs[replace];
        heap_remove(st, old);
        st->bytes -= old->bytes;
        free(old);
        e->recs[replace] = r;
    } else {
        if (e->nrecs == e->cap) {
            size_t nc = e->cap ? e->cap * 2 : 1;
            ap__dht_srec_t **nr = realloc(e->recs, nc * sizeof *nr);
            if (!nr) {
                free(r);
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
    if (heap_push(st, r)) {
        /* cannot happen after a replace (the heap shrank first) */
        e->recs[rec_index(e, r)] = e->recs[--e->nrecs];
        free(r);
        if (e->nrecs == 0) {
            st->bytes -= e->key_len;
            unlink_entry(st, e);
        }
        return AP_ENOMEM;
    }
    st->bytes += r->bytes;
    return 0;
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
