/* Connection admission (see admit.h). */
#include "base/admit.h"

#include <stdlib.h>
#include <string.h>

enum { E_PENDING, E_OPEN_IN, E_OPEN_OUT };

typedef struct ap_admit_ent {
    uint64_t id, iph;
    uint64_t t_ms;    /* arrival */
    uint64_t last_ms; /* last activity (ap_admit_touch) */
    uint8_t state;
    bool known;
} ent_t;

typedef struct ap_admit_ip {
    uint64_t iph;
    uint32_t pending, open_in, open_out;
} ipc_t;

void ap_admit_config_default(ap_admit_config_t *c)
{
    memset(c, 0, sizeof *c);
    c->hs_start = 64;
    c->hs_rate_pct = 30;
    c->hs_full = 256;
    c->hs_per_ip = 16;
    c->hs_min_age_ms = 500;
    c->max_conns = 1024;
    c->conns_per_ip = 64;
    c->reserved_out = 64;
    c->reserved_known = 64;
    c->evict_idle_ms = 200;
}

void ap_admit_init(ap_admit_t *a, const ap_admit_config_t *cfg)
{
    memset(a, 0, sizeof *a);
    ap_admit_config_t d;
    ap_admit_config_default(&d);
    a->cfg = d;
    if (cfg) {
#define TAKE(f)                                                                                    \
    if (cfg->f) a->cfg.f = cfg->f
        TAKE(hs_start);
        TAKE(hs_rate_pct);
        TAKE(hs_full);
        TAKE(hs_per_ip);
        TAKE(hs_min_age_ms);
        TAKE(max_conns);
        TAKE(conns_per_ip);
        TAKE(reserved_out);
        TAKE(reserved_known);
        TAKE(evict_idle_ms);
#undef TAKE
    }
    if (a->cfg.hs_start > a->cfg.hs_full) a->cfg.hs_start = a->cfg.hs_full;
    if (a->cfg.hs_rate_pct > 100) a->cfg.hs_rate_pct = 100;
    if (a->cfg.reserved_out + a->cfg.reserved_known >= a->cfg.max_conns)
        a->cfg.reserved_out = a->cfg.reserved_known = a->cfg.max_conns / 8;
}

void ap_admit_close(ap_admit_t *a)
{
    ap__u64map_free(&a->conns);
    ap__u64map_free(&a->ips);
    free(a->ents);
    free(a->ipc);
    memset(a, 0, sizeof *a);
}

static uint64_t ip_hash(const uint8_t ip[16])
{
    uint64_t lo, hi;
    memcpy(&lo, ip, 8);
    memcpy(&hi, ip + 8, 8);
    uint64_t h = ap__mix64(lo ^ ap__mix64(hi));
    return h == AP_U64MAP_EMPTY ? 0 : h;
}

static ipc_t *ip_find(ap_admit_t *a, uint64_t iph)
{
    uint64_t i;
    return ap__u64map_get(&a->ips, iph, &i) ? &a->ipc[i] : NULL;
}

static ipc_t *ip_get(ap_admit_t *a, uint64_t iph)
{
    ipc_t *c = ip_find(a, iph);
    if (c) return c;
    if (a->nipc == a->ipc_cap) {
        size_t nc = a->ipc_cap ? a->ipc_cap * 2 : 64;
        ipc_t *n = realloc(a->ipc, nc * sizeof *n);
        if (!n) return NULL;
        a->ipc = n;
        a->ipc_cap = nc;
    }
    if (ap__u64map_put(&a->ips, iph, a->nipc)) return NULL;
    c = &a->ipc[a->nipc++];
    memset(c, 0, sizeof *c);
    c->iph = iph;
    return c;
}

static void ip_maybe_drop(ap_admit_t *a, ipc_t *c)
{
    if (c->pending || c->open_in || c->open_out) return;
    size_t i = (size_t)(c - a->ipc);
    ap__u64map_del(&a->ips, c->iph, NULL);
    if (i != --a->nipc) {
        a->ipc[i] = a->ipc[a->nipc];
        ap__u64map_put(&a->ips, a->ipc[i].iph, i); /* replaces: cannot fail */
    }
}

static ent_t *ent_find(ap_admit_t *a, uint64_t id)
{
    uint64_t i;
    return ap__u64map_get(&a->conns, id, &i) ? &a->ents[i] : NULL;
}

static ent_t *ent_add(ap_admit_t *a, uint64_t id, uint64_t iph, uint8_t state, uint64_t now)
{
    if (a->nents == a->ents_cap) {
        size_t nc = a->ents_cap ? a->ents_cap * 2 : 64;
        ent_t *n = realloc(a->ents, nc * sizeof *n);
        if (!n) return NULL;
        a->ents = n;
        a->ents_cap = nc;
    }
    if (ap__u64map_put(&a->conns, id, a->nents)) return NULL;
    ent_t *e = &a->ents[a->nents++];
    *e = (ent_t){.id = id, .iph = iph, .t_ms = now, .last_ms = now, .state = state};
    return e;
}

static uint32_t open_total(const ap_admit_t *a)
{
    return a->st.open_in + a->st.open_out;
}

/* The oldest pending handshake of the source holding the most of them. */
static const ent_t *pending_victim(const ap_admit_t *a, uint32_t *its_count)
{
    const ipc_t *busiest = NULL;
    for (size_t i = 0; i < a->nipc; i++)
        if (!busiest || a->ipc[i].pending > busiest->pending) busiest = &a->ipc[i];
    if (!busiest || !busiest->pending) return NULL;
    const ent_t *old = NULL;
    for (size_t i = 0; i < a->nents; i++) {
        const ent_t *e = &a->ents[i];
        if (e->state == E_PENDING && e->iph == busiest->iph && (!old || e->t_ms < old->t_ms))
            old = e;
    }
    *its_count = busiest->pending;
    return old;
}

/* The oldest pending handshake, if it has waited hs_min_age_ms. */
static const ent_t *oldest_pending(const ap_admit_t *a, uint64_t now_ms)
{
    const ent_t *old = NULL;
    for (size_t i = 0; i < a->nents; i++) {
        const ent_t *e = &a->ents[i];
        if (e->state == E_PENDING && (!old || e->t_ms < old->t_ms)) old = e;
    }
    return old && now_ms - old->t_ms >= a->cfg.hs_min_age_ms ? old : NULL;
}

ap_admit_verdict_t ap_admit_inbound(ap_admit_t *a, uint64_t id, const uint8_t ip[16],
                                    uint64_t now_ms, uint32_t rnd, uint64_t *victim)
{
    if (!id || ent_find(a, id)) return AP_ADMIT_DROP;
    uint64_t iph = ip_hash(ip);
    ipc_t *src = ip_find(a, iph);
    uint32_t mine = src ? src->pending : 0;
    if (mine >= a->cfg.hs_per_ip) {
        a->st.dropped_per_ip++;
        return AP_ADMIT_DROP;
    }
    ap_admit_verdict_t v = AP_ADMIT_OK;
    uint32_t p = a->st.pending;
    if (p >= a->cfg.hs_full) {
        uint32_t theirs = 0;
        const ent_t *old = pending_victim(a, &theirs);
        /* make room at the expense of a busier source, else of a handshake
         * that has stalled long enough */
        if (old && theirs <= mine + 1) old = oldest_pending(a, now_ms);
        if (!old) {
            a->st.dropped_full++;
            return AP_ADMIT_DROP;
        }
        *victim = old->id;
        v = AP_ADMIT_EVICT;
    } else if (p >= a->cfg.hs_start && mine > 0) {
        /* random early drop, for sources that already have a handshake in
         * progress: a first handshake from a new source always gets a slot */
        uint32_t span = a->cfg.hs_full - a->cfg.hs_start;
        uint32_t pct = a->cfg.hs_rate_pct +
                       (span ? (100 - a->cfg.hs_rate_pct) * (p - a->cfg.hs_start) / span : 100);
        if (rnd % 100 < pct) {
            a->st.dropped_random++;
            return AP_ADMIT_DROP;
        }
    }
    src = ip_get(a, iph);
    if (!src || !ent_add(a, id, iph, E_PENDING, now_ms)) {
        if (src) ip_maybe_drop(a, src);
        a->st.dropped_full++;
        return AP_ADMIT_DROP;
    }
    src->pending++;
    a->st.pending++;
    if (v == AP_ADMIT_EVICT) a->st.evicted_pending++;
    return v;
}

/* The least useful open inbound connection to close for a newcomer: not
 * known, idle for min_idle_ms; from iph only when only_ip, else from the
 * source holding the most open connections; the longest idle first. */
static const ent_t *idle_victim(const ap_admit_t *a, uint64_t iph, bool only_ip,
                                uint64_t min_idle_ms, uint64_t now_ms)
{
    const ent_t *best = NULL;
    uint32_t best_n = 0;
    for (size_t i = 0; i < a->nents; i++) {
        const ent_t *e = &a->ents[i];
        if (e->state != E_OPEN_IN || e->known) continue;
        if (only_ip && e->iph != iph) continue;
        if (now_ms < e->last_ms + min_idle_ms) continue;
        uint32_t n = ip_find((ap_admit_t *)a, e->iph)->open_in;
        if (!best || n > best_n || (n == best_n && e->last_ms < best->last_ms)) {
            best = e;
            best_n = n;
        }
    }
    return best;
}

ap_admit_verdict_t ap_admit_open(ap_admit_t *a, uint64_t id, bool known, uint64_t now_ms,
                                 uint64_t *victim)
{
    ent_t *e = ent_find(a, id);
    if (!e || e->state != E_PENDING) return AP_ADMIT_DROP;
    ipc_t *src = ip_find(a, e->iph);
    uint32_t cap = a->cfg.max_conns - a->cfg.reserved_out - (known ? 0 : a->cfg.reserved_known);
    const ent_t *old = NULL;
    if (src->open_in >= a->cfg.conns_per_ip) {
        old = idle_victim(a, e->iph, true, 0, now_ms);
        if (!old) {
            a->st.refused_conns_per_ip++;
            return AP_ADMIT_DROP;
        }
    } else if (open_total(a) >= cap) {
        old = idle_victim(a, e->iph, false, a->cfg.evict_idle_ms, now_ms);
        if (!old) {
            a->st.refused_conns++;
            return AP_ADMIT_DROP;
        }
    }
    src->pending--;
    a->st.pending--;
    src->open_in++;
    a->st.open_in++;
    e->state = E_OPEN_IN;
    e->known = known;
    e->last_ms = now_ms;
    if (known) a->st.open_known++;
    if (!old) return AP_ADMIT_OK;
    *victim = old->id;
    a->st.evicted_idle++;
    return AP_ADMIT_EVICT;
}

bool ap_admit_has_room(const ap_admit_t *a, const uint8_t ip[16], uint64_t now_ms)
{
    uint64_t iph = ip_hash(ip);
    const ipc_t *src = ip_find((ap_admit_t *)a, iph);
    /* the peer is not identified yet: it may turn out known, so the known
     * slots count here; ap_admit_open decides once it is */
    uint32_t cap = a->cfg.max_conns - a->cfg.reserved_out;
    if (src && src->open_in >= a->cfg.conns_per_ip) return idle_victim(a, iph, true, 0, now_ms);
    if (open_total(a) >= cap) return idle_victim(a, iph, false, a->cfg.evict_idle_ms, now_ms);
    return true;
}

void ap_admit_touch(ap_admit_t *a, uint64_t id, uint64_t now_ms)
{
    ent_t *e = ent_find(a, id);
    if (e && now_ms > e->last_ms) e->last_ms = now_ms;
}

void ap_admit_set_known(ap_admit_t *a, uint64_t id, bool known)
{
    ent_t *e = ent_find(a, id);
    if (!e || e->state != E_OPEN_IN || e->known == known) return;
    e->known = known;
    if (known)
        a->st.open_known++;
    else
        a->st.open_known--;
}

bool ap_admit_outbound(ap_admit_t *a, uint64_t id, const uint8_t ip[16])
{
    if (!id || ent_find(a, id) || open_total(a) >= a->cfg.max_conns) {
        a->st.refused_conns++;
        return false;
    }
    uint64_t iph = ip_hash(ip);
    ipc_t *src = ip_get(a, iph);
    if (!src || !ent_add(a, id, iph, E_OPEN_OUT, 0)) {
        if (src) ip_maybe_drop(a, src);
        return false;
    }
    src->open_out++;
    a->st.open_out++;
    return true;
}

void ap_admit_gone(ap_admit_t *a, uint64_t id)
{
    uint64_t i;
    if (!ap__u64map_get(&a->conns, id, &i)) return;
    ent_t *e = &a->ents[i];
    ipc_t *src = ip_find(a, e->iph);
    if (e->state == E_PENDING) {
        src->pending--;
        a->st.pending--;
    } else if (e->state == E_OPEN_IN) {
        src->open_in--;
        a->st.open_in--;
        if (e->known) a->st.open_known--;
    } else {
        src->open_out--;
        a->st.open_out--;
    }
    ip_maybe_drop(a, src);
    ap__u64map_del(&a->conns, id, NULL);
    if (i != --a->nents) {
        a->ents[i] = a->ents[a->nents];
        ap__u64map_put(&a->conns, a->ents[i].id, i);
    }
}

bool ap_admit_rekey(ap_admit_t *a, uint64_t id, uint64_t new_id)
{
    uint64_t i;
    if (!new_id || ent_find(a, new_id) || !ap__u64map_get(&a->conns, id, &i)) return false;
    if (ap__u64map_put(&a->conns, new_id, i) != 0) return false;
    ap__u64map_del(&a->conns, id, NULL);
    a->ents[i].id = new_id;
    return true;
}

uint32_t ap_admit_pending_ip(const ap_admit_t *a, const uint8_t ip[16])
{
    const ipc_t *c = ip_find((ap_admit_t *)a, ip_hash(ip));
    return c ? c->pending : 0;
}
