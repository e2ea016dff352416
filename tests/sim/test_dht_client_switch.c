/* A running DHT node switches to client mode and back
 * (ap_dht_set_client_mode, what a node does when AutoNAT finds it behind a
 * NAT): as a client it answers nobody, while its own stores and gets still
 * work; back in server mode it answers again. On the simulator. */
#include "aptest.h"
#include "dht_swarm.h"

static uint64_t served(swarm_t *s, int i)
{
    ap_dht_stats_t st;
    ap_dht_get_stats(s->dht[i], &st);
    return st.rpcs_served;
}

static void traffic(swarm_t *s, int n, const char *tag)
{
    for (int k = 0; k < 40; k++) {
        char key[32];
        snprintf(key, sizeof key, "%s-%d", tag, k);
        op_t st;
        assert_ok(sw_store(s, k % (n - 1), key, NULL, "v", 600000, &st));
        sw_run_idle(s, 60000000);
    }
}

static void test_switch(void **state)
{
    (void)state;
    int n = 24;
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    swarm_t *s = sw_new(n, ap_test_seed(31), 20000, &cfg, 20000);
    assert_non_null(s);
    int me = n - 1;
    traffic(s, n, "before");
    uint64_t a = served(s, me);
    assert_true(a > 0); /* a normal node answers */

    assert_ok(ap_dht_set_client_mode(s->dht[me], true));
    assert_ok(ap_dht_set_client_mode(s->dht[me], true)); /* idempotent */
    traffic(s, n, "client");
    uint64_t b = served(s, me);
    print_message("rpcs served: %llu as a server, %llu more as a client\n", (unsigned long long)a,
                  (unsigned long long)(b - a));
    assert_int_equal(b, a); /* a client answers nobody */
    op_t st, g;
    assert_ok(sw_store(s, me, "mine", NULL, "x", 600000, &st));
    sw_run_idle(s, 60000000);
    assert_ok(st.status);
    assert_ok(sw_get(s, me, "mine", true, &g));
    sw_run_idle(s, 60000000);
    assert_true(g.found);

    assert_ok(ap_dht_set_client_mode(s->dht[me], false));
    /* it announces itself again with its next requests; peers look it up */
    traffic(s, n, "after");
    assert_ok(sw_get(s, me, "before-1", false, &g));
    sw_run_idle(s, 60000000);
    traffic(s, n, "after2");
    uint64_t c = served(s, me);
    print_message("rpcs served after switching back: %llu\n", (unsigned long long)(c - b));
    assert_true(c > b);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_switch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
