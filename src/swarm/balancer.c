/* The trainer's per-stage server choice: interleaved weighted round-robin on
 * a min-heap of accumulated expected time (apiary/swarm.h). A plain data
 * structure: no I/O, no clock; the caller passes the time. */
#include "apiary/swarm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct srv {
    ap_peer_id_t peer;
    uint64_t hash;
    uint64_t seq;     /* order first seen: tie-break */
    double key;       /* accumulated expected time, seconds */
    double announced; /* units/s, 0 = none */
    double mean, dev; /* smoothed seconds per unit and its deviation */
    bool measured;
    bool banned;                   /* until a newer record (stamp > ban_stamp) */
    double guess_key, guess_units; /* key charged, and work, before the first measurement */
    uint64_t stamp, ban_stamp;     /* newest record's stamp; and the one known at the ban */
    uint64_t expires_us;           /* record expiry */
    long heap_pos;                 /* -1 when not in the heap */
    uint64_t tasks, ok, failed, timed_out;
} srv_t;

struct ap_swarm_balancer {
    ap_swarm_balancer_opts_t o;
    srv_t *s;
    size_t n, cap;
    size_t *heap; /* indices into s */
    size_t hn;
    double vclock; /* key of the last pick: the minimum when the heap is empty */
    uint64_t seq;
    size_t nbanned;
    uint64_t next_expiry; /* earliest record expiry among banned servers */
};

/* ---- heap of eligible servers, least (key, seq) on top ------------------ */

static bool less(const ap_swarm_balancer_t *b, size_t x, size_t y)
{
    const srv_t *a = &b->s[x], *c = &b->s[y];
    /* Keys within 1e-9 (relative, or absolute near 0) tie: they differ only
     * by the rounding of sums of size / throughput. A tie goes to the server
     * known longest, so equal servers take turns in a fixed order instead of
     * one of them taking two tasks in a row on rounding noise. */
    const double tol = 1e-9 * fmax(1.0, fmax(fabs(a->key), fabs(c->key)));
    if (fabs(a->key - c->key) > tol) return a->key < c->key;
    return a->seq < c->seq;
}

static void heap_set(ap_swarm_balancer_t *b, size_t pos, size_t idx)
{
    b->heap[pos] = idx;
    b->s[idx].heap_pos = (long)pos;
}

static void sift_up(ap_swarm_balancer_t *b, size_t pos)
{
    size_t idx = b->heap[pos];
    while (pos > 0) {
        size_t up = (pos - 1) / 2;
        if (!less(b, idx, b->heap[up])) break;
        heap_set(b, pos, b->heap[up]);
        pos = up;
    }
    heap_set(b, pos, idx);
}

static void sift_down(ap_swarm_balancer_t *b, size_t pos)
{
    size_t idx = b->heap[pos];
    for (;;) {
        size_t l = 2 * pos + 1, r = l + 1, m = pos;
        size_t best = idx;
        if (l < b->hn && less(b, b->heap[l], best)) m = l, best = b->heap[l];
        if (r < b->hn && less(b, b->heap[r], best)) m = r, best = b->heap[r];
        if (m == pos) break;
        heap_set(b, pos, b->heap[m]);
        pos = m;
    }
    heap_set(b, pos, idx);
}

static double heap_min_key(const ap_swarm_balancer_t *b)
{
    return b->hn ? b->s[b->heap[0]].key : b->vclock;
}

static void heap_push(ap_swarm_balancer_t *b, size_t idx)
{
    b->heap[b->hn] = idx;
    b->s[idx].heap_pos = (long)b->hn;
    b->hn++;
    sift_up(b, b->hn - 1);
}

static void heap_del(ap_swarm_balancer_t *b, size_t idx)
{
    long p = b->s[idx].heap_pos;
    if (p < 0) return;
    b->s[idx].heap_pos = -1;
    size_t pos = (size_t)p, last = b->heap[--b->hn];
    if (pos == b->hn) return;
    heap_set(b, pos, last);
    sift_up(b, pos);
    sift_down(b, (size_t)b->s[last].heap_pos);
}

/* ---- servers ------------------------------------------------------------ */

static long find(const ap_swarm_balancer_t *b, const ap_peer_id_t *peer)
{
    uint64_t h = ap_peer_id_hash(peer);
    for (size_t i = 0; i < b->n; i++)
        if (b->s[i].hash == h && ap_peer_id_eq(&b->s[i].peer, peer)) return (long)i;
    return -1;
}

static void drop(ap_swarm_balancer_t *b, size_t idx)
{
    heap_del(b, idx);
    if (b->s[idx].banned) b->nbanned--;
    size_t last = b->n - 1;
    if (idx != last) {
        b->s[idx] = b->s[last];
        if (b->s[idx].heap_pos >= 0) b->heap[b->s[idx].heap_pos] = idx;
    }
    b->n--;
}

static double throughput(const ap_swarm_balancer_t *b, const srv_t *s)
{
    if (s->measured && s->mean > 0) return 1.0 / s->mean;
    if (s->announced > 0) return s->announced;
    /* Neither measured nor announced: as fast as the fastest measured one,
     * so its first task is not charged at a pessimistic guess that would
     * keep it waiting behind the others for long. */
    double best = 0;
    for (size_t i = 0; i < b->n; i++)
        if (b->s[i].measured && b->s[i].mean > 0 && 1.0 / b->s[i].mean > best)
            best = 1.0 / b->s[i].mean;
    return best > 0 ? best : b->o.default_throughput;
}

static void set_defaults(ap_swarm_balancer_opts_t *o)
{
    if (!(o->ema > 0 && o->ema <= 1)) o->ema = 0.25;
    if (!(o->deadline_sigmas > 0)) o->deadline_sigmas = 4;
    if (!(o->deadline_factor > 0)) o->deadline_factor = 3;
    if (!o->deadline_min_us) o->deadline_min_us = 100000;
    if (!o->deadline_max_us) o->deadline_max_us = 60000000;
    if (o->deadline_max_us < o->deadline_min_us) o->deadline_max_us = o->deadline_min_us;
    if (!(o->default_throughput > 0) || !isfinite(o->default_throughput)) o->default_throughput = 1;
}

ap_swarm_balancer_t *ap_swarm_balancer_new(const ap_swarm_balancer_opts_t *opts)
{
    ap_swarm_balancer_t *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    if (opts) b->o = *opts;
    set_defaults(&b->o);
    return b;
}

void ap_swarm_balancer_free(ap_swarm_balancer_t *b)
{
    if (!b) return;
    free(b->s);
    free(b->heap);
    free(b);
}

static int grow(ap_swarm_balancer_t *b)
{
    if (b->n < b->cap) return 0;
    if (b->n >= AP_SWARM_BALANCER_MAX) return AP_ELIMIT;
    size_t nc = b->cap ? b->cap * 2 : 8;
    if (nc > AP_SWARM_BALANCER_MAX) nc = AP_SWARM_BALANCER_MAX;
    srv_t *s = realloc(b->s, nc * sizeof *s);
    if (!s) return AP_ENOMEM;
    b->s = s;
    size_t *h = realloc(b->heap, nc * sizeof *h);
    if (!h) return AP_ENOMEM;
    b->heap = h;
    b->cap = nc;
    return 0;
}

int ap_swarm_balancer_update(ap_swarm_balancer_t *b, const ap_peer_id_t *peer, double announced,
                             uint64_t expires_us, uint64_t now_us)
{
    return ap_swarm_balancer_update_record(b, peer, announced, expires_us, expires_us, now_us);
}

static void unban(ap_swarm_balancer_t *b, size_t idx)
{
    srv_t *s = &b->s[idx];
    s->banned = false;
    b->nbanned--;
    s->key = heap_min_key(b);
    heap_push(b, idx);
}

int ap_swarm_balancer_update_record(ap_swarm_balancer_t *b, const ap_peer_id_t *peer,
                                    double announced, uint64_t expires_us, uint64_t stamp,
                                    uint64_t now_us)
{
    if (!b || !peer) return AP_EINVAL;
    if (!(announced > 0) || !isfinite(announced)) announced = 0;
    long i = find(b, peer);
    if (i >= 0) {
        srv_t *s = &b->s[i];
        if (stamp < s->stamp) return 0; /* an older record than one seen: nothing new */
        if (expires_us > s->expires_us) s->expires_us = expires_us;
        s->announced = announced;
        s->stamp = stamp;
        /* A record the server published after the one known when it was
         * banned says it is (back) up: it re-enters at the minimum key. */
        if (s->banned && stamp > s->ban_stamp && s->expires_us > now_us) unban(b, (size_t)i);
        return 0;
    }
    if (expires_us <= now_us) return 0; /* an expired record names no server */
    int rc = grow(b);
    if (rc) return rc;
    srv_t *s = &b->s[b->n];
    memset(s, 0, sizeof *s);
    s->peer = *peer;
    s->hash = ap_peer_id_hash(peer);
    s->seq = b->seq++;
    s->announced = announced;
    s->expires_us = expires_us;
    s->stamp = stamp;
    s->key = heap_min_key(b);
    s->heap_pos = -1;
    heap_push(b, b->n++);
    return 0;
}

void ap_swarm_balancer_remove(ap_swarm_balancer_t *b, const ap_peer_id_t *peer)
{
    if (!b || !peer) return;
    long i = find(b, peer);
    if (i >= 0) drop(b, (size_t)i);
}

/* Forgets the banned servers whose record expired with no newer one seen
 * (a newer record lifts a ban: ap_swarm_balancer_update_record). */
static void drop_expired_banned(ap_swarm_balancer_t *b, uint64_t now_us)
{
    if (!b->nbanned || now_us < b->next_expiry) return;
    uint64_t next = UINT64_MAX;
    for (size_t i = 0; i < b->n;) {
        srv_t *s = &b->s[i];
        if (s->banned && s->expires_us <= now_us) {
            drop(b, i); /* moves another server into slot i */
            continue;
        }
        if (s->banned && s->expires_us < next) next = s->expires_us;
        i++;
    }
    b->next_expiry = next;
}

static uint64_t deadline_for(const ap_swarm_balancer_t *b, const srv_t *s, double size)
{
    if (!s->measured) return b->o.deadline_max_us;
    double per = fmax(s->mean * b->o.deadline_factor, s->mean + b->o.deadline_sigmas * s->dev);
    double us = per * size * 1e6;
    if (!(us >= (double)b->o.deadline_min_us)) return b->o.deadline_min_us;
    if (us >= (double)b->o.deadline_max_us) return b->o.deadline_max_us;
    return (uint64_t)us;
}

int ap_swarm_balancer_pick(ap_swarm_balancer_t *b, double size, uint64_t now_us, ap_peer_id_t *peer,
                           uint64_t *deadline_us)
{
    if (!b || !peer || !(size > 0) || !isfinite(size)) return AP_EINVAL;
    drop_expired_banned(b, now_us);
    while (b->hn) {
        size_t idx = b->heap[0];
        srv_t *s = &b->s[idx];
        if (s->expires_us <= now_us) {
            drop(b, idx);
            continue;
        }
        b->vclock = s->key;
        const double adv = size / throughput(b, s);
        s->key += adv;
        if (!s->measured) {
            s->guess_key += adv;
            s->guess_units += size;
        }
        s->tasks++;
        sift_down(b, 0);
        *peer = s->peer;
        if (deadline_us) *deadline_us = deadline_for(b, s, size);
        return 0;
    }
    return AP_ENOTFOUND;
}

static void measure(ap_swarm_balancer_t *b, srv_t *s, double size, uint64_t elapsed_us,
                    bool success)
{
    if (!(size > 0) || !isfinite(size)) return;
    double x = (double)(elapsed_us ? elapsed_us : 1) * 1e-6 / size;
    if (!s->measured) {
        s->mean = x;
        s->dev = x / 2;
        s->measured = true;
        /* Re-charge the tasks picked on a guess at the measured speed, so a
         * pessimistic guess does not keep the server waiting. */
        if (success && s->heap_pos >= 0 && s->guess_units > 0) {
            const size_t idx = (size_t)(s - b->s);
            heap_del(b, idx);
            s->key += s->guess_units * x - s->guess_key;
            heap_push(b, idx);
        }
        return;
    }
    double a = b->o.ema;
    s->dev = (1 - a) * s->dev + a * fabs(x - s->mean);
    s->mean = (1 - a) * s->mean + a * x;
}

void ap_swarm_balancer_report(ap_swarm_balancer_t *b, const ap_peer_id_t *peer, int status,
                              double size, uint64_t elapsed_us, uint64_t now_us)
{
    if (!b || !peer) return;
    long i = find(b, peer);
    if (i < 0) return;
    srv_t *s = &b->s[i];
    if (status == 0) {
        s->ok++;
        measure(b, s, size, elapsed_us, true);
        return;
    }
    if (status == AP_ETIMEDOUT) {
        s->timed_out++;
        measure(b, s, size, elapsed_us, false);
        return;
    }
    s->failed++;
    if (s->banned) return;
    heap_del(b, (size_t)i);
    s->banned = true;
    s->ban_stamp = s->stamp;
    if (!b->nbanned || s->expires_us < b->next_expiry) b->next_expiry = s->expires_us;
    b->nbanned++;
    (void)now_us;
}

size_t ap_swarm_balancer_count(const ap_swarm_balancer_t *b)
{
    return b ? b->n : 0;
}

static bool eligible(const srv_t *s, uint64_t now_us)
{
    return s->expires_us > now_us && !s->banned;
}

size_t ap_swarm_balancer_eligible(const ap_swarm_balancer_t *b, uint64_t now_us)
{
    size_t k = 0;
    for (size_t i = 0; b && i < b->n; i++) k += eligible(&b->s[i], now_us);
    return k;
}

double ap_swarm_balancer_throughput(const ap_swarm_balancer_t *b, uint64_t now_us)
{
    double t = 0;
    for (size_t i = 0; b && i < b->n; i++)
        if (eligible(&b->s[i], now_us)) t += throughput(b, &b->s[i]);
    return t;
}

int ap_swarm_balancer_info(const ap_swarm_balancer_t *b, const ap_peer_id_t *peer, uint64_t now_us,
                           ap_swarm_server_info_t *out)
{
    if (!b || !peer || !out) return AP_EINVAL;
    long i = find(b, peer);
    if (i < 0) return AP_ENOTFOUND;
    (void)now_us;
    const srv_t *s = &b->s[i];
    memset(out, 0, sizeof *out);
    out->peer = s->peer;
    out->throughput = throughput(b, s);
    out->measured = s->measured;
    out->banned = s->banned;
    out->expires_us = s->expires_us;
    out->tasks = s->tasks;
    out->ok = s->ok;
    out->failed = s->failed;
    out->timed_out = s->timed_out;
    return 0;
}
