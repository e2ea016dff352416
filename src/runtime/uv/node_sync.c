/* Blocking forms of runtime.h queries for user threads of the real driver. */
#include "apiary/node.h"
#include "apiary/sync.h"

typedef struct addrs_ctx {
    char (*addrs)[AP_RT_ADDR_MAX];
    int max;
    bool with_id;
    int n;
} addrs_ctx_t;

static void addrs_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    addrs_ctx_t *c = arg;
    c->n = ap_rt_listen_addrs(rt, c->addrs, c->max, c->with_id);
    ap_sync_complete(done, 0);
}

int ap_node_listen_addrs_sync(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    if (!rt || (max > 0 && !addrs) || max < 0) return AP_EINVAL;
    addrs_ctx_t c = {.addrs = addrs, .max = max, .with_id = with_id};
    int rc = ap_node_call_sync(rt, addrs_fn, &c);
    return rc ? rc : c.n;
}
