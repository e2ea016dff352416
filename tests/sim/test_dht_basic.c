/* DHT on the simulator: bootstrap of a swarm through 1-3 initial peers,
 * stores then gets from random nodes, dictionaries, batches, coalescing,
 * caching, client mode, bootstrap errors. */
#include "aptest.h"

#include "dht_swarm.h"

static int swarm_size(void)
{
    return ap_test_sanitized() ? 150 : 1000;
}

static void test_store_get(void **state)
{
    (void)state;
    int n = swarm_size();
    swarm_t *s = sw_new(n, ap_test_seed(1), 50000, NULL, 20000);
    assert_non_null(s);
    assert_int_equal(s->boot_fail, 0);
    assert_int_equal(s->boot_ok, n - 1);
    /* every node knows a healthy share of the swarm */
    size_t minrt = (size_t)-1;
    for (int i = 0; i < n; i++) {
        ap_dht_stats_t st;
        ap_dht_get_stats(s->dht[i], &st);
        if (st.routing_peers < minrt) minrt = st.routing_peers;
    }
    assert_true(minrt >= 20);

    int nkeys = ap_test_sanitized() ? 20 : 100;
    op_t *ops = calloc((size_t)nkeys, sizeof *ops);
    char key[64], val[64];
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "key-%d", i);
        snprintf(val, sizeof val, "value-%d", i);
        assert_ok(sw_store(s, sw_random_live(s), key, NULL, val, 600000, &ops[i]));
    }
    sw_run_idle(s, 60000000);
    for (int i = 0; i < nkeys; i++) {
        assert_true(ops[i].done);
        assert_ok(ops[i].status);
        assert_int_equal(ops[i].nstored, s->cfg.num_replicas);
    }
    int found = 0;
    double hops = 0;
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "key-%d", i);
        assert_ok(sw_get(s, sw_random_live(s), key, i % 2 == 0, &ops[i]));
    }
    sw_run_idle(s, 60000000);
    for (int i = 0; i < nkeys; i++) {
        snprintf(val, sizeof val, "value-%d", i);
        assert_true(ops[i].done);
        assert_ok(ops[i].status);
        if (ops[i].found && !strcmp(ops[i].value, val)) found++;
        hops += ops[i].hops;
    }
    print_message("stores+gets: %d/%d found, mean hops %.2f\n", found, nkeys, hops / nkeys);
    assert_int_equal(found, nkeys);
    /* an absent key: found = false, status 0 */
    op_t o;
    assert_ok(sw_get(s, 3, "no-such-key", false, &o));
    sw_run_idle(s, 60000000);
    assert_true(o.done);
    assert_ok(o.status);
    assert_false(o.found);
    free(ops);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_store_get),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
