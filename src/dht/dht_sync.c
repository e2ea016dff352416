/* Blocking wrappers of the DHT API for user threads, through the real
 * driver's ap_node_call_sync (include/apiary/node.h). */
#include "apiary/dht.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include <stdlib.h>
#include <string.h>

/* ---- new / free ------------------------------------------------------------ */

typedef struct new_ctx {
    const ap_dht_config_t *cfg;
    ap_dht_t *out;
} new_ctx_t;

static void new_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    new_ctx_t *c = arg;
    ap_sync_complete(done, ap_dht_new(rt, c->cfg, &c->out));
}

int ap_dht_new_sync(ap_rt_t *rt, const ap_dht_config_t *cfg, ap_dht_t **out)
{
    if (!rt || !out) return AP_EINVAL;
    new_ctx_t c = {.cfg = cfg};
    int rc = ap_node_call_sync(rt, new_fn, &c);
    if (rc == 0) *out = c.out;
    return rc;
}

static void free_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_dht_free(arg);
    ap_sync_complete(done, 0);
}

int ap_dht_free_sync(ap_dht_t *dht)
{
    if (!dht) return 0;
    return ap_node_call_sync(ap_dht_runtime(dht), free_fn, dht);
}

/* ---- bootstrap --------------------------------------------------------------- */

typedef struct boot_ctx {
    const char *const *addrs;
    size_t n;
    ap_dht_t *dht;
    ap_sync_t *done;
} boot_ctx_t;

static void boot_cb(ap_dht_t *dht, void *arg, int status)
{
    boot_ctx_t *c = arg;
    ap_sync_complete(c->done, status);
}

static void boot_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    boot_ctx_t *c = arg;
    c->done = done;
    int rc = ap_dht_bootstrap(c->dht, c->addrs, c->n, boot_cb, c);
    if (rc) ap_sync_complete(done, rc);
}

int ap_dht_bootstrap_sync(ap_dht_t *dht, const char *const *addrs, size_t naddrs)
{
    if (!dht) return AP_EINVAL;
    boot_ctx_t c = {.addrs = addrs, .n = naddrs, .dht = dht};
    return ap_node_call_sync(ap_dht_runtime(dht), boot_fn, &c);
}

/* ---- store ------------------------------------------------------------------- */

typedef struct store_ctx {
    const ap_dht_record_t *rec;
    ap_dht_t *dht;
    int nstored;
    ap_sync_t *done;
} store_ctx_t;

static void store_cb(ap_dht_t *dht, void *arg, int status, int nstored)
{
    store_ctx_t *c = arg;
    c->nstored = nstored;
    ap_sync_complete(c->done, status);
}

static void store_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    store_ctx_t *c = arg;
    c->done = done;
    int rc = ap_dht_store(c->dht, c->rec, store_cb, c);
    if (rc) ap_sync_complete(done, rc);
}

int ap_dht_store_sync(ap_dht_t *dht, const ap_dht_record_t *rec, int *nstored)
{
    if (!dht || !rec) return AP_EINVAL;
    store_ctx_t c = {.rec = rec, .dht = dht};
    int rc = ap_node_call_sync(ap_dht_runtime(dht), store_fn, &c);
    if (nstored) *nstored = c.nstored;
    return rc;
}

/* ---- get --------------------------------------------------------------------- */

/* Deep copy of a result into one allocation. */
static ap_dht_result_t *copy_result(const ap_dht_result_t *r)
{
    size_t total = sizeof *r + r->nrecords * sizeof(ap_dht_record_t) + r->key_len;
    for (size_t i = 0; i < r->nrecords; i++)
        total += r->records[i].subkey_len + r->records[i].value_len;
    ap_dht_result_t *out = malloc(total);
    if (!out) return NULL;
    *out = *r;
    ap_dht_record_t *recs = (ap_dht_record_t *)(out + 1);
    uint8_t *p = (uint8_t *)(recs + r->nrecords);
    memcpy(p, r->key, r->key_len);
    out->key = p;
    p += r->key_len;
    for (size_t i = 0; i < r->nrecords; i++) {
        recs[i] = r->records[i];
        recs[i].key = out->key;
        if (r->records[i].subkey_len) memcpy(p, r->records[i].subkey, r->records[i].subkey_len);
        recs[i].subkey = r->records[i].subkey_len ? p : NULL;
        p += r->records[i].subkey_len;
        if (r->records[i].value_len) memcpy(p, r->records[i].value, r->records[i].value_len);
        recs[i].value = p;
        p += r->records[i].value_len;
    }
    out->records = recs;
    return out;
}

typedef struct get_ctx {
    const uint8_t *key;
    size_t len;
    bool latest;
    ap_dht_t *dht;
    ap_dht_result_t *res;
    ap_sync_t *done;
} get_ctx_t;

static void get_cb(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res)
{
    get_ctx_t *c = arg;
    if (status == 0 && res) {
        c->res = copy_result(res);
        if (!c->res) status = AP_ENOMEM;
    }
    ap_sync_complete(c->done, status);
}

static void get_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    get_ctx_t *c = arg;
    c->done = done;
    int rc = ap_dht_get(c->dht, c->key, c->len, c->latest, get_cb, c);
    if (rc) ap_sync_complete(done, rc);
}

int ap_dht_get_sync(ap_dht_t *dht, const uint8_t *key, size_t key_len, bool latest,
                    ap_dht_result_t **out)
{
    if (!dht || !key || !out) return AP_EINVAL;
    *out = NULL;
    get_ctx_t c = {.key = key, .len = key_len, .latest = latest, .dht = dht};
    int rc = ap_node_call_sync(ap_dht_runtime(dht), get_fn, &c);
    if (rc == 0)
        *out = c.res;
    else
        free(c.res);
    return rc;
}

void ap_dht_result_free(ap_dht_result_t *res)
{
    free(res);
}

/* ---- stats ------------------------------------------------------------------- */

typedef struct stats_ctx {
    ap_dht_t *dht;
    ap_dht_stats_t *out;
} stats_ctx_t;

static void stats_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    stats_ctx_t *c = arg;
    ap_dht_get_stats(c->dht, c->out);
    ap_sync_complete(done, 0);
}

int ap_dht_get_stats_sync(ap_dht_t *dht, ap_dht_stats_t *out)
{
    if (!dht || !out) return AP_EINVAL;
    stats_ctx_t c = {.dht = dht, .out = out};
    return ap_node_call_sync(ap_dht_runtime(dht), stats_fn, &c);
}
