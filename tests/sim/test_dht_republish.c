/* Record republishing on the simulator: holders re-store the records they
 * hold to the key's current nearest nodes, so a record outlives the crash of
 * every one of its original replicas; expired records are never
 * republished. */
#include "aptest.h"

#include "dht_swarm.h"

#define PERIOD_US (20ull * 1000000) /* republish period in these tests */

static int swarm_size(void)
{
    return ap_test_sanitized() ? 80 : 200;
}

/* Live nodes that hold key records for the network (the only key stored). */
static int holders(swarm_t *s, int *out)
{
    int m = 0;
    for (int i = 0; i < s->n; i++) {
        if (!s->dht[i]) continue;
        ap_dht_stats_t st;
        ap_dht_get_stats(s->dht[i], &st);
        if (st.stored_records > 0) out[m++] = i;
    }
    return m;
}

/* Stores one owner-signed record from node w, then crashes its original
 * replicas one by one, PERIOD_US * 3 / 2 apart; returns how many of 10 gets
 * from random live nodes found the value afterwards. */
static int crash_replicas(uint64_t period_us, uint64_t *republished)
{
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    cfg.republish_period_us = period_us;
    int n = swarm_size();
    swarm_t *s = sw_new(n, ap_test_seed(41), 50000, &cfg, 20000);
    assert_non_null(s);
    int w = (int)sw_rand(s, (uint64_t)n);
    char ido[AP_PEER_ID_STR_MAX], key[160];
    ap_peer_id_str(sw_peer(s, w), ido);
    snprintf(key, sizeof key, "model-state[owner:%s]", ido);
    op_t o;
    assert_ok(sw_store(s, w, key, NULL, "v-signed", 3600000, &o));
    sw_run_idle(s, 60000000);
    assert_true(o.done);
    assert_ok(o.status);
    assert_int_equal(o.nstored, 5);
    int *orig = calloc((size_t)n, sizeof *orig), *now = calloc((size_t)n, sizeof *now);
    int norig = holders(s, orig);
    assert_int_equal(norig, 5);
    for (int r = 0; r < norig; r++) {
        sw_crash(s, orig[r]);
        sw_run(s, NULL, NULL, PERIOD_US * 3 / 2);
        int m = holders(s, now);
        print_message("republish %s: replica %d of %d crashed, %d live holders\n",
                      period_us ? "on" : "off", r + 1, norig, m);
    }
    int found = 0;
    for (int t = 0; t < 10; t++) {
        assert_ok(sw_get(s, sw_random_live(s), key, t % 2 == 0, &o));
        sw_run_idle(s, 60000000);
        assert_true(o.done);
        if (o.status == 0 && o.found && !strcmp(o.value, "v-signed")) found++;
    }
    *republished = 0;
    uint64_t triggers = 0;
    for (int i = 0; i < n; i++) {
        if (!s->dht[i]) continue;
        ap_dht_stats_t st;
        ap_dht_get_stats(s->dht[i], &st);
        *republished += st.republished;
        triggers += st.republish_triggers;
    }
    print_message("republish %s: %d/10 gets found the signed record; %llu records republished, "
                  "%llu early republishes after a dead replica\n",
                  period_us ? "on" : "off", found, (unsigned long long)*republished,
                  (unsigned long long)triggers);
    free(orig);
    free(now);
    sw_free(s);
    return found;
}

static void test_survives_replica_crashes(void **state)
{
    (void)state;
    uint64_t rep;
    /* with republishing every surviving holder re-stores the record (signed
     * as the owner wrote it: readers verify it) to the current nearest */
    assert_int_equal(crash_replicas(PERIOD_US, &rep), 10);
    assert_true(rep > 0);
    /* control: without it the record dies with its last original replica */
    assert_int_equal(crash_replicas(0, &rep), 0);
    assert_int_equal(rep, 0);
}

/* Every STORE a node receives for the test key: when, and the record's
 * expiration. */
typedef struct seen {
    swarm_t *s;
    int node;
    int64_t *min_left_ms; /* smallest expiration - arrival seen */
    int *after_first;     /* stores received after the initial store finished */
    bool *counting;
} seen_t;

static int watch_stores(void *arg, const ap_dht_record_t *rec, const ap_peer_id_t *from)
{
    seen_t *v = arg;
    if (!from || !*v->counting) return 0;
    if (rec->key_len != 7 || memcmp(rec->key, "expires", 7)) return 0;
    int64_t left = rec->expiration_ms - ap_rt_wall_ms(sw_rt(v->s, v->node));
    if (left < *v->min_left_ms) *v->min_left_ms = left;
    (*v->after_first)++;
    return 0;
}

static void test_expired_never_republished(void **state)
{
    (void)state;
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    cfg.republish_period_us = 2000000; /* scans every second */
    cfg.cache_remote = false;
    int n = ap_test_sanitized() ? 40 : 80;
    swarm_t *s = sw_new(n, ap_test_seed(42), 50000, &cfg, 20000);
    assert_non_null(s);
    int64_t min_left = INT64_MAX;
    int after = 0;
    bool counting = false;
    seen_t *v = calloc((size_t)n, sizeof *v);
    for (int i = 0; i < n; i++) {
        v[i] = (seen_t){.s = s,
                        .node = i,
                        .min_left_ms = &min_left,
                        .after_first = &after,
                        .counting = &counting};
        assert_ok(ap_dht_add_validator(s->dht[i], watch_stores, &v[i]));
    }
    int w = sw_random_live(s);
    op_t o;
    const int64_t ttl_ms = 20000;
    assert_ok(sw_store(s, w, "expires", NULL, "soon", ttl_ms, &o));
    sw_run_idle(s, 10000000);
    assert_ok(o.status);
    counting = true;
    /* live for 20 s, republished every ~2 s, then 60 s past its expiration */
    sw_run(s, NULL, NULL, 80000000);
    print_message("expiring record: %d republish stores received, least lifetime left at "
                  "arrival %lld ms\n",
                  after, (long long)min_left);
    assert_true(after > 0); /* it was republished while alive */
    /* never after it expired */
    assert_true(min_left > 0);
    int hold[128];
    assert_int_equal(holders(s, hold), 0);
    op_t g;
    assert_ok(sw_get(s, sw_random_live(s), "expires", false, &g));
    sw_run_idle(s, 10000000);
    assert_true(g.done);
    assert_false(g.found);
    free(v);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_survives_replica_crashes),
        cmocka_unit_test(test_expired_never_republished),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
