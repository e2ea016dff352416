/* The DHT on the real driver (a libuv host on its own thread, in-process
 * transport), driven from this thread through the blocking wrappers. */
#include "aptest.h"

#include "apiary/dht.h"
#include "apiary/host.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 16

static void addr_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    char a[1][AP_RT_ADDR_MAX];
    int n = ap_rt_listen_addrs(rt, a, 1, false);
    if (n >= 1) memcpy(arg, a[0], AP_RT_ADDR_MAX);
    ap_sync_complete(done, n >= 1 ? 0 : AP_EADDR);
}

static void wall_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    *(int64_t *)arg = ap_rt_wall_ms(rt);
    ap_sync_complete(done, 0);
}

static void test_sync_api(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    assert_ok(ap_host_start(h));
    ap_rt_t *rt[N];
    ap_dht_t *dht[N];
    for (int i = 0; i < N; i++) {
        assert_ok(ap_node_new(h, NULL, &rt[i]));
        assert_ok(ap_dht_new_sync(rt[i], NULL, &dht[i]));
    }
    char addr0[AP_RT_ADDR_MAX];
    assert_ok(ap_node_call_sync(rt[0], addr_fn, addr0));
    const char *boot[1] = {addr0};
    for (int i = 1; i < N; i++) assert_ok(ap_dht_bootstrap_sync(dht[i], boot, 1));
    /* a bootstrap through an address nobody listens on fails clearly */
    const char *nobody[1] = {"/memory/999999"};
    int rc = ap_dht_bootstrap_sync(dht[1], nobody, 1);
    assert_true(rc == AP_EUNREACH || rc == AP_EADDR);

    int64_t now;
    assert_ok(ap_node_call_sync(rt[3], wall_fn, &now));
    char key[32], val[32];
    for (int k = 0; k < 20; k++) {
        snprintf(key, sizeof key, "uv-key-%d", k);
        snprintf(val, sizeof val, "uv-value-%d", k);
        ap_dht_record_t r = {.key = (const uint8_t *)key,
                             .key_len = strlen(key),
                             .value = (const uint8_t *)val,
                             .value_len = strlen(val),
                             .expiration_ms = now + 60000};
        int nstored = 0;
        assert_ok(ap_dht_store_sync(dht[k % N], &r, &nstored));
        assert_int_equal(nstored, 5);
    }
    for (int k = 0; k < 20; k++) {
        snprintf(key, sizeof key, "uv-key-%d", k);
        snprintf(val, sizeof val, "uv-value-%d", k);
        ap_dht_result_t *res = NULL;
        assert_ok(ap_dht_get_sync(dht[(k * 7 + 3) % N], (const uint8_t *)key, strlen(key),
                                  k % 2 == 0, &res));
        assert_non_null(res);
        assert_true(res->found);
        assert_int_equal(res->nrecords, 1);
        assert_int_equal(res->records[0].value_len, strlen(val));
        assert_memory_equal(res->records[0].value, val, strlen(val));
        assert_int_equal(res->key_len, strlen(key));
        ap_dht_result_free(res);
    }
    ap_dht_stats_t st;
    assert_ok(ap_dht_get_stats_sync(dht[5], &st));
    assert_true(st.routing_peers >= 1);
    /* a node that goes away mid-run: the others keep answering */
    assert_ok(ap_dht_free_sync(dht[7]));
    ap_node_free(rt[7]);
    dht[7] = NULL;
    ap_dht_result_t *res = NULL;
    assert_ok(ap_dht_get_sync(dht[8], (const uint8_t *)"uv-key-4", 8, true, &res));
    assert_true(res->found);
    ap_dht_result_free(res);
    for (int i = 0; i < N; i++)
        if (dht[i]) assert_ok(ap_dht_free_sync(dht[i]));
    assert_ok(ap_host_free(h));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sync_api),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
