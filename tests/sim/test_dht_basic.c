/* DHT on the simulator: bootstrap of a swarm through 1-3 initial peers,
 * stores then gets from random nodes, dictionaries, batches, coalescing,
 * caching, client mode, bootstrap errors; bootstrapping through a node whose
 * DHT starts later. */
#include "aptest.h"

#include "dht_swarm.h"

/* Whether a is nearer to target than b (XOR distance). */
static bool xor_less(const uint8_t *target, const uint8_t *a, const uint8_t *b)
{
    for (int i = 0; i < AP_DHT_ID_LEN; i++) {
        uint8_t x = target[i] ^ a[i], y = target[i] ^ b[i];
        if (x != y) return x < y;
    }
    return false;
}

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
    /* Each record sits at its key's true num_replicas nearest nodes (by XOR
     * over every node's id): they answer a get of it locally (hops 0; no get
     * ran yet, so nothing is cached). Fails when nodes misplace themselves in
     * the id space (a node once used id 0 for itself: 0 of 300 keys reached
     * all 5 at N = 2,000). */
    uint8_t(*ids)[AP_DHT_ID_LEN] = malloc((size_t)n * sizeof *ids);
    for (int i = 0; i < n; i++) ap_dht_peer_node_id(sw_peer(s, i), ids[i]);
    int at_nearest = 0, checked = 0;
    for (int i = 0; i < nkeys && i < 20; i++) {
        snprintf(key, sizeof key, "key-%d", i);
        uint8_t kid[AP_DHT_ID_LEN];
        ap_dht_key_id((const uint8_t *)key, strlen(key), kid);
        bool taken[2000] = {false};
        assert_true(n <= 2000);
        for (int r = 0; r < s->cfg.num_replicas; r++) {
            int best = -1;
            for (int j = 0; j < n; j++) {
                if (taken[j]) continue;
                if (best < 0 || xor_less(kid, ids[j], ids[best])) best = j;
            }
            taken[best] = true;
            op_t g;
            assert_ok(sw_get(s, best, key, false, &g));
            sw_run_idle(s, 10000000);
            checked++;
            if (g.found && g.hops == 0) at_nearest++;
        }
    }
    free(ids);
    print_message("records at their keys' true nearest nodes: %d/%d\n", at_nearest, checked);
    assert_int_equal(at_nearest, checked);
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

typedef struct boot_op {
    bool done;
    int status;
    uint64_t at_us;
    ap_sim_t *sim;
} boot_op_t;

static void boot_op_done(ap_dht_t *dht, void *arg, int status)
{
    (void)dht;
    boot_op_t *o = arg;
    o->done = true;
    o->status = status;
    o->at_us = ap_sim_now_us(o->sim);
}

static bool boot_op_finished(void *arg)
{
    return ((boot_op_t *)arg)->done;
}

/* An initial peer whose node is up but whose DHT starts 1.5 s later (it
 * answers "protocol not served" meanwhile): the bootstrap asks again and
 * joins once it is there. One that never starts a DHT fails the bootstrap
 * after the retries (about 5 s), with AP_EUNREACH. Before the retries, the
 * first case failed at once (examples/collab failed so on a loaded machine:
 * its second peer's thread asked before the first peer's thread had made its
 * DHT). */
static void test_bootstrap_before_dht(void **state)
{
    (void)state;
    swarm_t *s = sw_new_n(4, 1, ap_test_seed(7), 20000, NULL, 0);
    assert_non_null(s);
    /* node 2 joins through node 1, whose node is up but has no DHT yet */
    assert_ok(sw_start_node(s, 2));
    boot_op_t late = {.sim = s->sim};
    const char *a1 = "/sim/1";
    uint64_t t0 = ap_sim_now_us(s->sim);
    assert_ok(ap_dht_bootstrap(s->dht[2], &a1, 1, boot_op_done, &late));
    sw_run(s, NULL, NULL, 1500000);
    assert_false(late.done);
    assert_ok(sw_start_node(s, 1));
    const char *a0 = "/sim/0";
    boot_op_t b1 = {.sim = s->sim};
    assert_ok(ap_dht_bootstrap(s->dht[1], &a0, 1, boot_op_done, &b1));
    assert_true(sw_run(s, boot_op_finished, &late, 10000000));
    assert_ok(late.status);
    print_message("joined through a DHT that started 1.5 s late, after %.2f s\n",
                  (double)(late.at_us - t0) / 1e6);
    assert_true(late.at_us - t0 < 3000000);
    assert_true(sw_run(s, boot_op_finished, &b1, 10000000));
    assert_ok(b1.status);
    /* node 1's DHT is freed (its node stays up): a bootstrap through it
     * ends with AP_EUNREACH after the retries */
    assert_ok(sw_start_node(s, 3));
    ap_dht_free(s->dht[1]);
    s->dht[1] = NULL;
    boot_op_t never = {.sim = s->sim};
    t0 = ap_sim_now_us(s->sim);
    assert_ok(ap_dht_bootstrap(s->dht[3], &a1, 1, boot_op_done, &never));
    assert_true(sw_run(s, boot_op_finished, &never, 30000000));
    assert_int_equal(never.status, AP_EUNREACH);
    print_message("a node that serves no DHT: the bootstrap failed after %.2f s\n",
                  (double)(never.at_us - t0) / 1e6);
    assert_true(never.at_us - t0 >= 4000000 && never.at_us - t0 < 10000000);
    /* a DHT freed while a retry waits: the retry is dropped, the bootstrap
     * reports AP_ECANCELED, nothing leaks */
    boot_op_t freed = {.sim = s->sim};
    assert_ok(ap_dht_bootstrap(s->dht[3], &a1, 1, boot_op_done, &freed));
    sw_run(s, NULL, NULL, 500000);
    assert_false(freed.done);
    ap_dht_free(s->dht[3]);
    s->dht[3] = NULL;
    assert_true(freed.done);
    assert_int_equal(freed.status, AP_ECANCELED);
    sw_run(s, NULL, NULL, 5000000);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_store_get),
        cmocka_unit_test(test_bootstrap_before_dht),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
