/* DHT on the simulator under faults: 20% of nodes crash between store and
 * get; 10% churn per simulated minute; a partition that heals. */
#include "aptest.h"

#include "dht_swarm.h"

static int swarm_size(void)
{
    return ap_test_sanitized() ? 150 : 500;
}

static void store_keys(swarm_t *s, const char *prefix, int nkeys, int64_t ttl_ms)
{
    op_t *ops = calloc((size_t)nkeys, sizeof *ops);
    char key[64], val[64];
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        snprintf(val, sizeof val, "v-%s-%d", prefix, i);
        assert_ok(sw_store(s, sw_random_live(s), key, NULL, val, ttl_ms, &ops[i]));
    }
    sw_run_idle(s, 120000000);
    for (int i = 0; i < nkeys; i++) {
        assert_true(ops[i].done);
        assert_ok(ops[i].status);
    }
    free(ops);
}

/* Gets every key from a random live node; returns how many were found. */
static int get_keys(swarm_t *s, const char *prefix, int nkeys, bool latest)
{
    op_t *ops = calloc((size_t)nkeys, sizeof *ops);
    char key[64], val[64];
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        assert_ok(sw_get(s, sw_random_live(s), key, latest, &ops[i]));
    }
    sw_run_idle(s, 120000000);
    int found = 0;
    for (int i = 0; i < nkeys; i++) {
        snprintf(val, sizeof val, "v-%s-%d", prefix, i);
        assert_true(ops[i].done);
        if (ops[i].status == 0 && ops[i].found && !strcmp(ops[i].value, val)) found++;
    }
    free(ops);
    return found;
}

static void test_crash_20pct(void **state)
{
    (void)state;
    int n = ap_test_sanitized() ? 150 : 1000;
    swarm_t *s = sw_new(n, ap_test_seed(2), 50000, NULL, 20000);
    assert_non_null(s);
    int nkeys = ap_test_sanitized() ? 100 : 400;
    store_keys(s, "c", nkeys, 3600000);
    /* 20% of the nodes crash */
    int crashed = 0;
    while (crashed < n / 5) {
        int i = sw_random_live(s);
        sw_crash(s, i);
        crashed++;
    }
    int found = get_keys(s, "c", nkeys, false);
    print_message("20%% crashed: %d/%d found\n", found, nkeys);
    /* the target: >= 99.5% (this seed finds 400/400; 399/400 while
     * every node used id 0 for itself) */
    assert_true(found * 1000 >= nkeys * 995);
    /* getters that met crashed contacts refreshed those buckets' regions, at
     * most once per bucket per refresh_period / 20 (the gets above took far
     * less than 30 s of virtual time): a few per live node at most */
    uint64_t refreshes = 0, max_node = 0;
    for (int i = 0; i < n; i++) {
        if (!s->dht[i]) continue;
        ap_dht_stats_t st;
        ap_dht_get_stats(s->dht[i], &st);
        refreshes += st.fail_refreshes;
        if (st.fail_refreshes > max_node) max_node = st.fail_refreshes;
        assert_true(st.fail_refreshes <= st.routing_buckets);
    }
    print_message("20%% crashed: %llu region refreshes after failures (max %llu on a node)\n",
                  (unsigned long long)refreshes, (unsigned long long)max_node);
    assert_true(refreshes > 0);
    /* and again with latest=true (must still terminate and find) */
    found = get_keys(s, "c", nkeys, true);
    print_message("20%% crashed, latest: %d/%d found\n", found, nkeys);
    assert_true(found * 1000 >= nkeys * 995);
    sw_free(s);
}

static void test_churn(void **state)
{
    (void)state;
    int n = swarm_size();
    swarm_t *s = sw_new(n, ap_test_seed(3), 50000, NULL, 20000);
    assert_non_null(s);
    int nkeys = ap_test_sanitized() ? 50 : 200;
    store_keys(s, "ch", nkeys, 3600000);
    /* 10% churn per simulated minute for 3 minutes: every 6 s, 1% of the
     * nodes crash and as many crashed ones come back with a fresh state. */
    int per_tick = n / 100 > 0 ? n / 100 : 1;
    int total_found = 0, total = 0;
    for (int tick = 0; tick < 30; tick++) {
        for (int c = 0; c < per_tick; c++) sw_crash(s, sw_random_live(s));
        for (int c = 0, tries = 0; c < per_tick && tries < 10 * n; tries++) {
            int i = (int)sw_rand(s, (uint64_t)n);
            if (s->dht[i]) continue;
            assert_ok(sw_restart(s, i));
            assert_ok(sw_start_node(s, i));
            sw_bootstrap(s, i, 0);
            c++;
        }
        sw_run(s, NULL, NULL, 6000000);
        if (tick % 10 == 9) {
            int f = get_keys(s, "ch", nkeys, false);
            print_message("churn minute %d: %d/%d found\n", tick / 10 + 1, f, nkeys);
            total_found += f;
            total += nkeys;
        }
    }
    assert_true(total_found * 100 >= total * 99); /* >= 99% through 30% turnover */
    sw_free(s);
}

static void test_partition_heals(void **state)
{
    (void)state;
    int n = ap_test_sanitized() ? 100 : 400;
    swarm_t *s = sw_new(n, ap_test_seed(4), 50000, NULL, 20000);
    assert_non_null(s);
    int *group = calloc((size_t)n, sizeof *group);
    for (int i = 0; i < n; i++) group[i] = i < n / 2 ? 1 : 2;
    assert_ok(ap_sim_partition(s->sim, group));
    free(group);
    /* the same key written on both sides, B's expiring later */
    op_t a, b;
    assert_ok(sw_store(s, 1, "split", NULL, "from-A", 100000, &a));
    assert_ok(sw_store(s, n - 1, "split", NULL, "from-B", 200000, &b));
    sw_run_idle(s, 60000000);
    assert_ok(a.status);
    assert_ok(b.status);
    /* each side sees its own value */
    op_t ga, gb;
    assert_ok(sw_get(s, 2, "split", true, &ga));
    assert_ok(sw_get(s, n - 2, "split", true, &gb));
    sw_run_idle(s, 60000000);
    assert_string_equal(ga.value, "from-A");
    assert_string_equal(gb.value, "from-B");
    sw_run(s, NULL, NULL, 20000000);
    /* heal; a minute later the newest value wins everywhere */
    ap_sim_heal(s->sim);
    sw_run(s, NULL, NULL, 60000000);
    int ok = 0, tries = 20;
    op_t g[20];
    for (int t = 0; t < tries; t++) assert_ok(sw_get(s, sw_random_live(s), "split", true, &g[t]));
    sw_run_idle(s, 60000000);
    for (int t = 0; t < tries; t++)
        if (g[t].found && !strcmp(g[t].value, "from-B")) ok++;
    print_message("after heal: %d/%d latest gets return the newest value\n", ok, tries);
    assert_int_equal(ok, tries);
    sw_free(s);
}

/* Records move to new nodes that become their nearest: 20 nodes hold the
 * records, 200 newcomers join, then all 20 original nodes crash. Without
 * hand-over (no republishing exists) every record would be gone. */
static void test_handover(void **state)
{
    (void)state;
    int old = 20, fresh = ap_test_sanitized() ? 80 : 200;
    swarm_t *s = sw_new_n(old + fresh, old, ap_test_seed(10), 50000, NULL, 20000);
    assert_non_null(s);
    int nkeys = 50;
    store_keys(s, "ho", nkeys, 3600000);
    for (int i = old; i < old + fresh; i++) {
        assert_ok(sw_start_node(s, i));
        sw_bootstrap(s, i, i);
        sw_run(s, NULL, NULL, 20000);
    }
    sw_run_idle(s, 120000000);
    sw_run(s, NULL, NULL, 10000000);
    for (int i = 0; i < old; i++) sw_crash(s, i);
    int found = get_keys(s, "ho", nkeys, false);
    print_message("hand-over: %d/%d found after every original holder crashed\n", found, nkeys);
    assert_true(found * 100 >= nkeys * 98);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crash_20pct),
        cmocka_unit_test(test_churn),
        cmocka_unit_test(test_partition_heals),
        cmocka_unit_test(test_handover),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
