/* DHT on the simulator: clock-skew tolerance. Every node's wall clock is
 * offset by a uniform random amount in [-S, +S]; records live 30 s; keys are
 * stored from random nodes and read 2 s later from random nodes. The table
 * printed here is the measurement quoted in docs/dht.md. */
#include "aptest.h"

#include "dht_swarm.h"

#define TTL_MS 30000

static double run_skew(swarm_t *s, int64_t skew_ms, int nkeys, double *stored_frac)
{
    for (int i = 0; i < s->n; i++) {
        int64_t off = skew_ms ? (int64_t)sw_rand(s, (uint64_t)(2 * skew_ms + 1)) - skew_ms : 0;
        simnet_set_skew(s->net, i, off);
    }
    op_t *ops = calloc((size_t)nkeys, sizeof *ops);
    char key[64], val[64];
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "skew%lld-%d", (long long)skew_ms, i);
        snprintf(val, sizeof val, "v%d", i);
        assert_ok(sw_store(s, sw_random_live(s), key, NULL, val, TTL_MS, &ops[i]));
    }
    sw_run_idle(s, 60000000);
    int stored = 0;
    for (int i = 0; i < nkeys; i++) stored += ops[i].nstored;
    *stored_frac = (double)stored / (nkeys * s->cfg.num_replicas);
    simnet_run_until(s->net, NULL, NULL, 2000000);
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof key, "skew%lld-%d", (long long)skew_ms, i);
        assert_ok(sw_get(s, sw_random_live(s), key, false, &ops[i]));
    }
    sw_run_idle(s, 60000000);
    int found = 0;
    for (int i = 0; i < nkeys; i++) {
        snprintf(val, sizeof val, "v%d", i);
        if (ops[i].found && !strcmp(ops[i].value, val)) found++;
    }
    free(ops);
    return (double)found / nkeys;
}

static void test_skew_tolerance(void **state)
{
    (void)state;
    int n = ap_test_sanitized() ? 60 : 200;
    int nkeys = ap_test_sanitized() ? 20 : 100;
    swarm_t *s = sw_new(n, ap_test_seed(9), 50000, NULL, 20000);
    assert_non_null(s);
    const int64_t skews[] = {0, 1000, 2000, 5000, 10000, 13000, 20000, 30000};
    double res[8];
    print_message("skew +-S   replicas accepted   gets found   (TTL 30 s, get 2 s after store)\n");
    for (int k = 0; k < 8; k++) {
        double stored;
        res[k] = run_skew(s, skews[k], nkeys, &stored);
        print_message("%6.1f s   %8.1f %%          %6.1f %%\n", skews[k] / 1000.0, stored * 100,
                      res[k] * 100);
    }
    /* several seconds of skew (up to +-10 s: 20 s between two peers) keep the
     * semantics intact */
    for (int k = 0; k < 5; k++) assert_true(res[k] == 1.0);
    /* and the measurement is real: far beyond the TTL, records die early */
    assert_true(res[7] < 1.0);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_skew_tolerance),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
