/* Kademlia routing table. See routing.h. */
#include "dht/routing.h"

#include "dht/record.h"

#include <stdlib.h>
#include <string.h>

static bool prefix_match(const uint8_t *a, const uint8_t *b, int bits)
{
    int full = bits / 8, rem = bits % 8;
    if (full && memcmp(a, b, (size_t)full) != 0) return false;
    if (rem) {
        uint8_t mask = (uint8_t)(0xFF << (8 - rem));
        if ((a[full] & mask) != (b[full] & mask)) return false;
    }
    return true;
}

/* Grows a contact array (sized on demand: most buckets never fill). */
static int reserve(ap__dht_contact_t **arr, int *cap, int need, int k)
{
    if (need <= *cap) return 0;
    int nc = *cap ? *cap * 2 : 4;
    if (nc < need) nc = need;
    if (nc > k) nc = k;
    ap__dht_contact_t *na = realloc(*arr, (size_t)nc * sizeof *na);
    if (!na) return AP_ENOMEM;
    *arr = na;
    *cap = nc;
    return 0;
}

static int bucket_new(ap__dht_bucket_t *bk, int k, const uint8_t *prefix, int depth)
{
    (void)k;
    memset(bk, 0, sizeof *bk);
    memcpy(bk->prefix, prefix, AP_DHT_ID_LEN);
    bk->depth = depth;
    return 0;
}

int ap__dht_routing_init(ap__dht_routing_t *rt, const uint8_t self[AP_DHT_ID_LEN], int k, int b,
                         int max_failures, uint64_t backoff_base_us, uint64_t backoff_max_us)
{
    memset(rt, 0, sizeof *rt);
    if (k < 1 || b < 1) return AP_EINVAL;
    memcpy(rt->self, self, AP_DHT_ID_LEN);
    rt->k = k;
    rt->b = b;
    rt->max_failures = max_failures > 0 ? max_failures : 1;
    rt->backoff_base_us = backoff_base_us;
    rt->backoff_max_us = backoff_max_us;
    rt->cap = 16;
    rt->buckets = calloc((size_t)rt->cap, sizeof *rt->buckets);
    if (!rt->buckets) return AP_ENOMEM;
    uint8_t zero[AP_DHT_ID_LEN] = {0};
    if (bucket_new(&rt->buckets[0], k, zero, 0)) {
        free(rt->buckets);
        return AP_ENOMEM;
    }
    rt->nbuckets = 1;
    return 0;
}

void ap__dht_routing_close(ap__dht_routing_t *rt)
{
    for (int i = 0; i < rt->nbuckets; i++) {
        free(rt->buckets[i].nodes);
        free(rt->buckets[i].repl);
    }
    free(rt->buckets);
    memset(rt, 0, sizeof *rt);
}

int ap__dht_routing_bucket_of(const ap__dht_routing_t *rt, const uint8_t id[AP_DHT_ID_LEN])
{
    for (int i = 0; i < rt->nbuckets; i++)
        if (prefix_match(id, rt->buckets[i].prefix, rt->buckets[i].depth)) return i;
    return 0; /* unreachable: the buckets partition the id space */
}

static bool id_bit(const uint8_t *id, int bit)
{
    return (id[bit / 8] >> (7 - bit % 8)) & 1;
}

/* Splits bucket i into two at depth+1; the contacts and replacements are
 * redistributed. */
static int split(ap__dht_routing_t *rt, int i)
{
    if (rt->nbuckets == rt->cap) {
        int nc = rt->cap * 2;
        ap__dht_bucket_t *nb = realloc(rt->buckets, (size_t)nc * sizeof *nb);
        if (!nb) return AP_ENOMEM;
        rt->buckets = nb;
        rt->cap = nc;
    }
    ap__dht_bucket_t *old = &rt->buckets[i];
    int d = old->depth;
    uint8_t p1[AP_DHT_ID_LEN];
    memcpy(p1, old->prefix, AP_DHT_ID_LEN);
    p1[d / 8] |= (uint8_t)(0x80 >> (d % 8));
    ap__dht_bucket_t hi;
    if (bucket_new(&hi, rt->k, p1, d + 1)) return AP_ENOMEM;
    hi.last_touched_us = old->last_touched_us;
    hi.fail_refresh_us = old->fail_refresh_us;
    old->depth = d + 1;
    int n0 = 0, r0 = 0;
    if (reserve(&hi.nodes, &hi.cap_nodes, old->n, rt->k) ||
        (old->nrepl && reserve(&hi.repl, &hi.cap_repl, old->nrepl, rt->k))) {
        free(hi.nodes);
        free(hi.repl);
        old->depth = d;
        return AP_ENOMEM;
    }
    for (int j = 0; j < old->n; j++) {
        if (id_bit(old->nodes[j].id, d))
            hi.nodes[hi.n++] = old->nodes[j];
        else
            old->nodes[n0++] = old->nodes[j];
    }
    old->n = n0;
    for (int j = 0; j < old->nrepl; j++) {
        if (id_bit(old->repl[j].id, d))
            hi.repl[hi.nrepl++] = old->repl[j];
        else
            old->repl[r0++] = old->repl[j];
    }
    old->nrepl = r0;
    old->checking = false;
    rt->buckets[rt->nbuckets++] = hi;
    return 0;
}

/* Finds a contact by node id (a 160-bit hash of the PeerID: comparing it is
 * cheaper than the 38-byte id and equivalent). */
static int find_in(const ap__dht_contact_t *arr, int n, const uint8_t *id)
{
    for (int i = 0; i < n; i++)
        if (memcmp(arr[i].id, id, AP_DHT_ID_LEN) == 0) return i;
    return -1;
}

static void set_addr(ap__dht_contact_t *c, const char *addr)
{
    if (addr && *addr) {
        if (strlen(addr) < sizeof c->addr) strcpy(c->addr, addr);
    }
}

int ap__dht_routing_seen(ap__dht_routing_t *rt, const ap_peer_id_t *peer, const char *addr,
                         uint64_t now_us, ap__dht_contact_t **check)
{
    if (check) *check = NULL;
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_peer_node_id(peer, id);
    if (memcmp(id, rt->self, AP_DHT_ID_LEN) == 0) return AP__RT_IGNORED;
    for (;;) {
        int bi = ap__dht_routing_bucket_of(rt, id);
        ap__dht_bucket_t *bk = &rt->buckets[bi];
        int j = find_in(bk->nodes, bk->n, id);
        if (j >= 0) { /* move to the tail (most recently seen) */
            ap__dht_contact_t c = bk->nodes[j];
            memmove(&bk->nodes[j], &bk->nodes[j + 1], (size_t)(bk->n - j - 1) * sizeof c);
            c.last_seen_us = now_us;
            c.failures = 0;
            c.backoff_until_us = 0;
            set_addr(&c, addr);
            bk->nodes[bk->n - 1] = c;
            bk->last_touched_us = now_us;
            if (j == 0) bk->checking = false; /* the checked contact answered */
            return AP__RT_UPDATED;
        }
        if (bk->n < rt->k) {
            if (reserve(&bk->nodes, &bk->cap_nodes, bk->n + 1, rt->k)) return AP_ENOMEM;
            ap__dht_contact_t *c = &bk->nodes[bk->n++];
            memset(c, 0, sizeof *c);
            c->peer = *peer;
            memcpy(c->id, id, AP_DHT_ID_LEN);
            set_addr(c, addr);
            c->last_seen_us = now_us;
            bk->last_touched_us = now_us;
            int r = find_in(bk->repl, bk->nrepl, id);
            if (r >= 0) {
                memmove(&bk->repl[r], &bk->repl[r + 1], (size_t)(bk->nrepl - r - 1) * sizeof *c);
                bk->nrepl--;
            }
            return AP__RT_ADDED;
        }
        bool has_self = prefix_match(rt->self, bk->prefix, bk->depth);
        if (bk->depth < AP_DHT_ID_LEN * 8 && (has_self || bk->depth % rt->b != 0)) {
            int rc = split(rt, bi);
            if (rc) return rc;
            continue;
        }
        /* Full and not splittable: park in the replacement list (freshest last). */
        int r = find_in(bk->repl, bk->nrepl, id);
        ap__dht_contact_t c;
        if (r >= 0) {
            c = bk->repl[r];
            memmove(&bk->repl[r], &bk->repl[r + 1], (size_t)(bk->nrepl - r - 1) * sizeof c);
            bk->nrepl--;
        } else {
            memset(&c, 0, sizeof c);
            c.peer = *peer;
            memcpy(c.id, id, AP_DHT_ID_LEN);
        }
        set_addr(&c, addr);
        c.last_seen_us = now_us;
        if (bk->nrepl == rt->k) {
            memmove(&bk->repl[0], &bk->repl[1], (size_t)(rt->k - 1) * sizeof c);
            bk->nrepl--;
        }
        if (reserve(&bk->repl, &bk->cap_repl, bk->nrepl + 1, rt->k)) return AP_ENOMEM;
        bk->repl[bk->nrepl++] = c;
        if (check && !bk->checking) {
            bk->checking = true;
            *check = &bk->nodes[0];
        }
        return AP__RT_PENDING;
    }
}

static void promote(ap__dht_bucket_t *bk, int j)
{
    /* Replace nodes[j] by the freshest replacement. */
    memmove(&bk->nodes[j], &bk->nodes[j + 1], (size_t)(bk->n - j - 1) * sizeof *bk->nodes);
    bk->n--;
    if (bk->nrepl) bk->nodes[bk->n++] = bk->repl[--bk->nrepl];
}

bool ap__dht_routing_failed(ap__dht_routing_t *rt, const ap_peer_id_t *peer, uint64_t now_us)
{
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_peer_node_id(peer, id);
    ap__dht_bucket_t *bk = &rt->buckets[ap__dht_routing_bucket_of(rt, id)];
    int j = find_in(bk->nodes, bk->n, id);
    if (j < 0) {
        int r = find_in(bk->repl, bk->nrepl, id);
        if (r >= 0) {
            memmove(&bk->repl[r], &bk->repl[r + 1], (size_t)(bk->nrepl - r - 1) * sizeof *bk->repl);
            bk->nrepl--;
        }
        return false;
    }
    ap__dht_contact_t *c = &bk->nodes[j];
    c->failures++;
    uint64_t d = rt->backoff_base_us;
    for (int i = 1; i < c->failures && d < rt->backoff_max_us; i++) d *= 2;
    if (d > rt->backoff_max_us) d = rt->backoff_max_us;
    c->backoff_until_us = now_us + d;
    if (j == 0) bk->checking = false;
    if ((c->failures >= rt->max_failures && bk->nrepl > 0) || c->failures >= 2 * rt->max_failures) {
        promote(bk, j);
        return true;
    }
    return false;
}

void ap__dht_routing_remove(ap__dht_routing_t *rt, const ap_peer_id_t *peer)
{
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_peer_node_id(peer, id);
    ap__dht_bucket_t *bk = &rt->buckets[ap__dht_routing_bucket_of(rt, id)];
    int j = find_in(bk->nodes, bk->n, id);
    if (j >= 0) promote(bk, j);
    int r = find_in(bk->repl, bk->nrepl, id);
    if (r >= 0) {
        memmove(&bk->repl[r], &bk->repl[r + 1], (size_t)(bk->nrepl - r - 1) * sizeof *bk->repl);
        bk->nrepl--;
    }
}

ap__dht_contact_t *ap__dht_routing_lookup(ap__dht_routing_t *rt, const ap_peer_id_t *peer)
{
    uint8_t id[AP_DHT_ID_LEN];
    ap_dht_peer_node_id(peer, id);
    ap__dht_bucket_t *bk = &rt->buckets[ap__dht_routing_bucket_of(rt, id)];
    int j = find_in(bk->nodes, bk->n, id);
    return j >= 0 ? &bk->nodes[j] : NULL;
}

int ap__dht_routing_nearest(ap__dht_routing_t *rt, const uint8_t target[AP_DHT_ID_LEN], int max,
                            uint64_t now_us, bool include_backed_off, ap__dht_contact_t *out)
{
    /* Insertion of pointers into a sorted array of at most max entries; the
     * contacts are copied out once at the end. */
    enum { STACK_MAX = 128 };
    const ap__dht_contact_t *stackbuf[STACK_MAX];
    const ap__dht_contact_t **best = stackbuf;
    if (max > STACK_MAX) {
        best = malloc((size_t)max * sizeof *best);
        if (!best) return 0;
    }
    int n = 0;
    for (int i = 0; i < rt->nbuckets; i++) {
        ap__dht_bucket_t *bk = &rt->buckets[i];
        for (int j = 0; j < bk->n; j++) {
            const ap__dht_contact_t *c = &bk->nodes[j];
            if (!include_backed_off && c->backoff_until_us > now_us) continue;
            if (n == max && ap__dht_cmp_dist(target, c->id, best[n - 1]->id) >= 0) continue;
            int pos = n < max ? n : max - 1;
            while (pos > 0 && ap__dht_cmp_dist(target, c->id, best[pos - 1]->id) < 0) {
                best[pos] = best[pos - 1];
                pos--;
            }
            best[pos] = c;
            if (n < max) n++;
        }
    }
    for (int i = 0; i < n; i++) out[i] = *best[i];
    if (best != stackbuf) free(best);
    return n;
}

size_t ap__dht_routing_size(const ap__dht_routing_t *rt)
{
    size_t n = 0;
    for (int i = 0; i < rt->nbuckets; i++) n += (size_t)rt->buckets[i].n;
    return n;
}

size_t ap__dht_routing_replacements(const ap__dht_routing_t *rt)
{
    size_t n = 0;
    for (int i = 0; i < rt->nbuckets; i++) n += (size_t)rt->buckets[i].nrepl;
    return n;
}

void ap__dht_routing_random_id(const ap__dht_routing_t *rt, int i, const uint8_t rnd[AP_DHT_ID_LEN],
                               uint8_t out[AP_DHT_ID_LEN])
{
    const ap__dht_bucket_t *bk = &rt->buckets[i];
    for (int bit = 0; bit < AP_DHT_ID_LEN * 8; bit++) {
        bool v = bit < bk->depth ? id_bit(bk->prefix, bit) : id_bit(rnd, bit);
        if (v)
            out[bit / 8] |= (uint8_t)(0x80 >> (bit % 8));
        else
            out[bit / 8] &= (uint8_t) ~(0x80 >> (bit % 8));
    }
}
