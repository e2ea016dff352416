/* DHT hand-over within the node's memory budget, over real TCP + Noise on
 * 127.0.0.1 (libuv host on its own thread; the simulator's form, with a
 * control run, is sim/test_dht_handover_budget). A target whose node memory
 * is 4 MiB holds 64 records of 16 KB; 16 newcomers join through it and stay,
 * but answer every request only 2.5 s after it arrived (the target's calls
 * wait up to 3 s). Their hand-overs together are about 8 MB: what the
 * newcomers hold unanswered, and what the target has reserved, stay within
 * the 4 MiB, hand-overs that do not fit are deferred, and every reservation
 * is given back. */
#include "aptest.h"

#include "apiary/dht.h"
#include "apiary/host.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NEWCOMERS 16
#define NRECS     64
#define VLEN      16000
#define HOLD_US   2500000
#define LIMIT     (4ull << 20)

static atomic_size_t g_outstanding, g_peak, g_requests;

typedef struct hold {
    ap_rpc_req_t *req;
    size_t len;
} hold_t;

static void answer(ap_rt_t *rt, void *arg)
{
    (void)rt;
    hold_t *h = arg;
    atomic_fetch_sub(&g_outstanding, h->len);
    ap_rpc_respond(h->req, NULL, 0);
    free(h);
}

static void slow_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)arg;
    size_t len;
    (void)ap_rpc_req_data(req, &len);
    hold_t *h = malloc(sizeof *h);
    if (!h) {
        ap_rpc_respond_error(req, AP_ENOMEM, NULL);
        return;
    }
    *h = (hold_t){req, len};
    atomic_fetch_add(&g_requests, 1);
    size_t now = atomic_fetch_add(&g_outstanding, len) + len;
    size_t p = atomic_load(&g_peak);
    while (now > p && !atomic_compare_exchange_weak(&g_peak, &p, now)) {
    }
    if (!ap_rt_timer_start(rt, HOLD_US, 0, answer, h)) answer(rt, h);
}

static void register_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)arg;
    ap_sync_complete(done, ap_rt_rpc_register(rt, AP_DHT_PROTO, 1u << 20, slow_handler, NULL));
}

static void addr_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    char a[1][AP_RT_ADDR_MAX];
    int n = ap_rt_listen_addrs(rt, a, 1, true);
    if (n >= 1) memcpy(arg, a[0], AP_RT_ADDR_MAX);
    ap_sync_complete(done, n >= 1 ? 0 : AP_EADDR);
}

static void wall_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    *(int64_t *)arg = ap_rt_wall_ms(rt);
    ap_sync_complete(done, 0);
}

/* The target's reserved bytes, from its report. */
static uint64_t held(ap_rt_t *rt)
{
    char out[4096];
    int n = ap_node_resources_sync(rt, 0, out, sizeof out);
    const char *p = n > 0 ? strstr(out, "held for peers by protocols ") : NULL;
    assert_non_null(p);
    return strtoull(p + strlen("held for peers by protocols "), NULL, 10);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void test_handover_budget_tcp(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    assert_ok(ap_host_start(h));
    ap_node_opts_t no = {.listen = "/ip4/127.0.0.1/tcp/0"};
    ap_rt_t *target, *writer, *nc[NEWCOMERS];
    assert_ok(ap_node_new(h, &no, &target));
    ap_node_limits_t lim;
    ap_node_limits_default(&lim);
    lim.node_memory = LIMIT;
    assert_ok(ap_node_set_limits_sync(target, &lim));
    ap_dht_t *tdht, *wdht;
    assert_ok(ap_dht_new_sync(target, NULL, &tdht));
    char taddr[AP_RT_ADDR_MAX];
    assert_ok(ap_node_call_sync(target, addr_fn, taddr));
    const char *boot[1] = {taddr};

    /* the records, from a client-mode writer: only the target holds them */
    assert_ok(ap_node_new(h, &no, &writer));
    ap_dht_config_t cc;
    ap_dht_config_default(&cc);
    cc.client_mode = true;
    assert_ok(ap_dht_new_sync(writer, &cc, &wdht));
    assert_ok(ap_dht_bootstrap_sync(wdht, boot, 1));
    int64_t now;
    assert_ok(ap_node_call_sync(writer, wall_fn, &now));
    static char val[VLEN];
    memset(val, 'v', sizeof val);
    char key[32];
    for (int i = 0; i < NRECS; i++) {
        snprintf(key, sizeof key, "held-%d", i);
        ap_dht_record_t r = {.key = (const uint8_t *)key,
                             .key_len = strlen(key),
                             .value = (const uint8_t *)val,
                             .value_len = sizeof val,
                             .expiration_ms = now + 3600000};
        int nstored = 0;
        assert_ok(ap_dht_store_sync(wdht, &r, &nstored));
        assert_int_equal(nstored, 1);
    }
    assert_ok(ap_dht_free_sync(wdht));

    /* newcomers join (a real DHT each), then all turn slow, before their
     * hand-overs come (2 s after joining; a late one is answered at once,
     * which only makes the load lighter) */
    ap_dht_t *d[NEWCOMERS];
    for (int i = 0; i < NEWCOMERS; i++) {
        assert_ok(ap_node_new(h, &no, &nc[i]));
        assert_ok(ap_dht_new_sync(nc[i], NULL, &d[i]));
        assert_ok(ap_dht_bootstrap_sync(d[i], boot, 1));
    }
    for (int i = 0; i < NEWCOMERS; i++) {
        assert_ok(ap_dht_free_sync(d[i]));
        assert_ok(ap_node_call_sync(nc[i], register_fn, NULL));
    }
    uint64_t tpeak = 0;
    for (int t = 0; t < 1500; t++) { /* up to 15 s: until all is answered */
        uint64_t b = held(target);
        if (b > tpeak) tpeak = b;
        if (t > 1000 && b == 0 && atomic_load(&g_outstanding) == 0) break;
        sleep_ms(10);
    }
    ap_dht_stats_t st;
    assert_ok(ap_dht_get_stats_sync(tdht, &st));
    print_message("peak in flight at the newcomers %zu bytes, reserved at the target %llu (limit "
                  "%llu), %zu requests, %llu deferred, %llu skipped\n",
                  atomic_load(&g_peak), (unsigned long long)tpeak, (unsigned long long)LIMIT,
                  atomic_load(&g_requests), (unsigned long long)st.handovers_deferred,
                  (unsigned long long)st.bg_stores_skipped);
    assert_true(atomic_load(&g_requests) > 0);
    assert_true(atomic_load(&g_peak) <= LIMIT);
    assert_true(tpeak > 0 && tpeak <= LIMIT);
    assert_int_equal(atomic_load(&g_outstanding), 0);
    assert_int_equal(held(target), 0);
    assert_ok(ap_dht_free_sync(tdht));
    for (int i = 0; i < NEWCOMERS; i++) ap_node_free(nc[i]);
    ap_node_free(writer);
    ap_node_free(target);
    assert_ok(ap_host_free(h));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handover_budget_tcp),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
