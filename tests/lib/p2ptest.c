#include "p2ptest.h"

#include <string.h>

ap_identity_t ap_test_ident(uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    ap_identity_t id;
    assert_int_equal(ap_identity_from_seed(&id, seed), 0);
    return id;
}

static void d_ready(ap_p2p_conn_t *c, void *arg)
{
    ap_test_dialer_t *d = arg;
    d->ready = true;
    d->c = c;
}

static void d_closed(ap_p2p_conn_t *c, void *arg, int st)
{
    ap_test_dialer_t *d = arg;
    (void)c;
    d->closed = true;
    d->status = st;
    d->c = NULL;
}

const ap_p2p_conn_cbs_t ap_test_dialer_cbs = {d_ready, d_closed};
