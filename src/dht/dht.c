/* DHT node: the public entry points (configuration, lifetime, validators,
 * stats) and the helpers every part uses. Sans-I/O: runtime.h only. The parts:
 * dht_lookup.c (traversal, get/store), dht_serve.c (requests from peers),
 * dht_maintain.c (hand-over, refresh, republishing), dht_boot.c (bootstrap).
 * Design notes in docs/dht.md. */
#include "dht/dht_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- small helpers --------------------------------------------------------- */

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

const char *ap__dht_short_id(const ap_peer_id_t *p, char buf[AP_PEER_SHORT_LEN])
{
    return ap_peer_id_short(p, buf);
}

int ap__dht_validate(ap_dht_t *dht, const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig,
                     const ap_peer_id_t *from)
{
    int rc = ap__dht_check_sizes(rec);
    if (!rc) rc = ap__dht_check_owner_cached(&dht->sigcache, rec, sig, has_sig);
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

uint64_t ap__dht_send_request(ap_dht_t *dht, const ap_peer_id_t *peer, Apiary__Dht__Request *q,
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

void ap__dht_learn_addrs(ap_dht_t *dht, const ap_peer_id_t *peer, char **addrs, size_t n)
{
    for (size_t i = 0; i < n; i++) ap_rt_add_addr(dht->rt, peer, addrs[i]);
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
    ap__dht_storage_set_quota(
        &dht->store, c->max_bytes_per_peer ? c->max_bytes_per_peer : c->max_bytes / 32,
        c->max_records_per_peer ? c->max_records_per_peer : c->max_records / 32);
    dht->ho_tokens = HANDOVER_BURST;
    dht->ho_tokens_us = ap_rt_now_us(rt);
    ap__dht_storage_init(&dht->cache, c->cache_max_records, c->cache_max_bytes, c->max_ttl_ms, 0);
    if (!c->client_mode) {
        rc = ap_rt_rpc_register(rt, AP_DHT_PROTO, AP__DHT_MSG_MAX, ap__dht_on_request, dht);
        if (rc) {
            ap__dht_routing_close(&dht->table);
            free(dht);
            return rc;
        }
        dht->registered = true;
    }
    uint64_t period = c->refresh_period_us / 4;
    if (period < 1000000) period = 1000000;
    dht->maint_timer = ap_rt_timer_start(rt, period, period, ap__dht_maintenance, dht);
    if (c->republish_period_us && !c->client_mode) {
        uint64_t rp = c->republish_period_us / 8;
        if (rp < 1000000) rp = 1000000;
        dht->repub_timer = ap_rt_timer_start(rt, rp, rp, ap__dht_republish_tick, dht);
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
    if (dht->ho_timer) ap_rt_timer_stop(dht->rt, dht->ho_timer);
    dht->ho_timer = 0;
    if (dht->registered) ap_rt_rpc_unregister(dht->rt, AP_DHT_PROTO);
    ap__dht_boot_cancel_all(dht);
    ap__dht_lookup_cancel_all(dht);
    ap__dht_bg_cancel_all(dht);
    ap__dht_storage_close(&dht->store);
    ap__dht_storage_close(&dht->cache);
    ap__dht_routing_close(&dht->table);
    ap__dht_circuits_free(dht);
    free(dht);
}

int ap_dht_set_client_mode(ap_dht_t *dht, bool client)
{
    if (!dht) return AP_EINVAL;
    if (dht->cfg.client_mode == client) return 0;
    if (!client && !dht->registered) {
        int rc =
            ap_rt_rpc_register(dht->rt, AP_DHT_PROTO, AP__DHT_MSG_MAX, ap__dht_on_request, dht);
        if (rc) return rc;
        dht->registered = true;
    } else if (client && dht->registered) {
        ap_rt_rpc_unregister(dht->rt, AP_DHT_PROTO);
        dht->registered = false;
    }
    dht->cfg.client_mode = client;
    if (!client && dht->cfg.republish_period_us && !dht->repub_timer) {
        uint64_t rp = dht->cfg.republish_period_us / 8;
        if (rp < 1000000) rp = 1000000;
        dht->repub_timer = ap_rt_timer_start(dht->rt, rp, rp, ap__dht_republish_tick, dht);
    }
    return 0;
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
