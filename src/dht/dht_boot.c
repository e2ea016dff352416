/* DHT: bootstrap. Dial the given addresses, ping them, look up our own id,
 * then refresh the buckets. */
#include "dht/dht_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef AP__DHT_JOIN_PASSES
#define AP__DHT_JOIN_PASSES 1
#endif

/* An initial peer whose node is up but serves no DHT yet (it answers
 * AP_ENOPROTO: a process that has just started, or a program whose threads
 * create their DHTs in any order) is asked again after 100, 200, 400, 800,
 * 800, ... ms, BOOT_NOPROTO_TRIES times in all (about 5 s). */
#define BOOT_NOPROTO_TRIES    8
#define BOOT_NOPROTO_FIRST_US 100000
#define BOOT_NOPROTO_MAX_US   800000

typedef struct boot_ping {
    boot_t *b;
    size_t i;
} boot_ping_t;

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
    uint8_t *tries;           /* per address: pings that found no DHT */
    uint64_t *retry_timers;   /* per address: a pending retry, or 0 */
    boot_ping_t **retry_args; /* per address: that retry's argument */
    bool looking;             /* self-lookup / bucket refreshes running */
    int lookups;              /* of those, still running */
    int pass;                 /* bucket-refresh passes started */
    int pass_end;             /* buckets that existed when the last pass started */
};

static void boot_free(boot_t *b)
{
    for (size_t i = 0; i < b->n; i++) free(b->addrs[i]);
    free(b->addrs);
    free(b->ping_ids);
    free(b->peers);
    free(b->tries);
    free(b->retry_timers);
    free(b->retry_args);
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
void ap__dht_boot_lookup_done(ap_dht_t *dht, void *arg, int status)
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
            if (ap__dht_find_nodes(dht, id, ap__dht_boot_lookup_done, b)) b->lookups--;
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
    if (ap__dht_find_nodes(dht, dht->self_id, ap__dht_boot_lookup_done, b)) {
        boot_unlink(dht, b);
        b->cb(dht, b->arg, AP_ENOMEM);
        boot_free(b);
    }
}

static void boot_send_ping(boot_ping_t *bp);

static void boot_retry_fire(ap_rt_t *rt, void *arg)
{
    (void)rt;
    boot_ping_t *bp = arg;
    bp->b->retry_timers[bp->i] = 0;
    bp->b->retry_args[bp->i] = NULL;
    boot_send_ping(bp);
}

static void boot_ping_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                           const char *errmsg)
{
    boot_ping_t *bp = arg;
    boot_t *b = bp->b;
    size_t i = bp->i;
    b->ping_ids[i] = 0;
    if (b->dht && status == AP_ENOPROTO && b->tries[i] + 1 < BOOT_NOPROTO_TRIES) {
        uint64_t delay = (uint64_t)BOOT_NOPROTO_FIRST_US << (b->tries[i] < 3 ? b->tries[i] : 3);
        if (delay > BOOT_NOPROTO_MAX_US) delay = BOOT_NOPROTO_MAX_US;
        if (b->tries[i]++ == 0)
            ap_info(MOD, "bootstrap: %s serves no DHT yet; asking again", b->addrs[i]);
        uint64_t t = ap_rt_timer_start(rt, delay, 0, boot_retry_fire, bp);
        if (t) {
            b->retry_timers[i] = t;
            b->retry_args[i] = bp;
            return; /* still pending */
        }
    }
    free(bp);
    b->pending--;
    if (b->dht) {
        if (status == 0) {
            b->ok++;
            ap__dht_peer_seen(b->dht, &b->peers[i], b->addrs[i]);
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
    boot_send_ping(bp);
}

static void boot_send_ping(boot_ping_t *bp)
{
    boot_t *b = bp->b;
    size_t i = bp->i;
    Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
    Apiary__Dht__PingRequest p = APIARY__DHT__PING_REQUEST__INIT;
    q.body_case = APIARY__DHT__REQUEST__BODY_PING;
    q.ping = &p;
    b->ping_ids[i] =
        b->dht ? ap__dht_send_request(b->dht, &b->peers[i], &q, boot_ping_done, bp) : 0;
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
    b->tries = calloc(naddrs ? naddrs : 1, sizeof *b->tries);
    b->retry_timers = calloc(naddrs ? naddrs : 1, sizeof *b->retry_timers);
    b->retry_args = calloc(naddrs ? naddrs : 1, sizeof *b->retry_args);
    if (!b->addrs || !b->ping_ids || !b->peers || !b->tries || !b->retry_timers || !b->retry_args) {
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
    ap__dht_peer_seen(dht, peer, addr);
    return 0;
}

/* DHT teardown: bootstraps are orphaned (pending dials call back later). */
void ap__dht_boot_cancel_all(ap_dht_t *dht)
{
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
        for (size_t i = 0; i < b->n; i++) {
            if (b->ping_ids[i]) ap_rt_rpc_cancel(dht->rt, b->ping_ids[i]);
            if (b->retry_timers[i] && ap_rt_timer_stop(dht->rt, b->retry_timers[i])) {
                free(b->retry_args[i]);
                b->retry_timers[i] = 0;
                b->retry_args[i] = NULL;
                b->pending--;
            }
        }
        if (--b->pending == 0) boot_free(b); /* else the pending dials free it */
    }
}
