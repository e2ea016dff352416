/* DHT on the simulator: owner-signed subkeys against a hostile writer, bad
 * input (forged, expired, far-future, oversize, malformed, floods), client
 * mode, dictionaries, batches, coalesced gets, caching, bootstrap errors. */
#include "aptest.h"

#include "dht/record.h"
#include "dht/wire.h"
#include "dht_swarm.h"

typedef struct raw {
    swarm_t *s;
    bool done;
    int status;
    int32_t st[AP__DHT_MAX_BATCH];
    size_t nst;
} raw_t;

static void raw_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                     const char *errmsg)
{
    raw_t *r = arg;
    r->done = true;
    r->status = status;
    r->s->pending--;
    if (status == 0) {
        Apiary__Dht__Response *m;
        if (ap__dht_decode_response(resp, len, &m) == 0) {
            if (m->body_case == APIARY__DHT__RESPONSE__BODY_STORE) {
                r->nst = m->store->n_status;
                for (size_t i = 0; i < r->nst; i++) r->st[i] = m->store->status[i];
            }
            apiary__dht__response__free_unpacked(m, NULL);
        }
    }
}

/* Sends a raw STORE of recs from node `from` to node `to`. */
static void raw_store(swarm_t *s, int from, int to, Apiary__Dht__Record **recs, size_t n, raw_t *r)
{
    memset(r, 0, sizeof *r);
    r->s = s;
    Apiary__Dht__StoreRequest sr = APIARY__DHT__STORE_REQUEST__INIT;
    sr.records = recs;
    sr.n_records = n;
    Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
    q.body_case = APIARY__DHT__REQUEST__BODY_STORE;
    q.store = &sr;
    q.client = true;
    size_t len = apiary__dht__request__get_packed_size(&q);
    uint8_t *buf = malloc(len);
    apiary__dht__request__pack(&q, buf);
    s->pending++;
    ap_rpc_opts_t o = {.timeout_us = 5000000};
    uint64_t id =
        ap_rt_rpc_call(sw_rt(s, from), sw_peer(s, to), AP_DHT_PROTO, buf, len, &o, raw_done, r);
    assert_true(id != 0);
    free(buf);
}

static void raw_bytes(swarm_t *s, int from, int to, const uint8_t *buf, size_t len, raw_t *r)
{
    memset(r, 0, sizeof *r);
    r->s = s;
    s->pending++;
    ap_rpc_opts_t o = {.timeout_us = 5000000};
    assert_true(ap_rt_rpc_call(sw_rt(s, from), sw_peer(s, to), AP_DHT_PROTO, buf, len, &o, raw_done,
                               r) != 0);
}

/* Indexes of the nodes that hold key (by asking every node's storage through
 * a local get with latest=false on a one-node view is not possible, so use
 * XOR distance: the num_replicas nearest live nodes). */
static int nearest_nodes(swarm_t *s, const char *key, int *out, int m)
{
    uint8_t kid[AP_DHT_ID_LEN];
    ap_dht_key_id((const uint8_t *)key, strlen(key), kid);
    int cnt = 0;
    for (int i = 0; i < s->n; i++) {
        if (!s->dht[i]) continue;
        uint8_t id[AP_DHT_ID_LEN];
        ap_dht_peer_node_id(sw_peer(s, i), id);
        int pos = cnt < m ? cnt : m - 1;
        if (cnt == m) {
            uint8_t last[AP_DHT_ID_LEN];
            ap_dht_peer_node_id(sw_peer(s, out[m - 1]), last);
            if (ap__dht_cmp_dist(kid, id, last) >= 0) continue;
        }
        while (pos > 0) {
            uint8_t prev[AP_DHT_ID_LEN];
            ap_dht_peer_node_id(sw_peer(s, out[pos - 1]), prev);
            if (ap__dht_cmp_dist(kid, id, prev) >= 0) break;
            out[pos] = out[pos - 1];
            pos--;
        }
        out[pos] = i;
        if (cnt < m) cnt++;
    }
    return cnt;
}

static void test_hostile_writer(void **state)
{
    (void)state;
    int n = ap_test_sanitized() ? 60 : 200;
    swarm_t *s = sw_new(n, ap_test_seed(5), 50000, NULL, 20000);
    assert_non_null(s);
    int owner = 7, thief = 9;
    char ido[AP_PEER_ID_STR_MAX], sub[128];
    ap_peer_id_str(sw_peer(s, owner), ido);
    snprintf(sub, sizeof sub, "[owner:%s]", ido);
    const char *key = "training-progress";
    op_t st;
    assert_ok(sw_store(s, owner, key, sub, "epoch=3", 600000, &st));
    sw_run_idle(s, 60000000);
    assert_ok(st.status);
    assert_int_equal(st.nstored, s->cfg.num_replicas);

    /* the API refuses to sign for someone else */
    ap_dht_record_t r = {.key = (const uint8_t *)key,
                         .key_len = strlen(key),
                         .subkey = (const uint8_t *)sub,
                         .subkey_len = strlen(sub),
                         .value = (const uint8_t *)"epoch=999",
                         .value_len = 9,
                         .expiration_ms = ap_rt_wall_ms(sw_rt(s, thief)) + 700000};
    assert_int_equal(ap_dht_store(s->dht[thief], &r, sw_store_cb, &st), AP_EPERM);

    /* raw STOREs to the holders: forged signature, no signature */
    uint8_t *msg;
    size_t mlen;
    uint8_t sig[AP_ED25519_SIG_LEN];
    assert_ok(ap_dht_record_sign_bytes(&r, &msg, &mlen));
    ap_rt_sign(sw_rt(s, thief), msg, mlen, sig); /* thief's own key */
    free(msg);
    Apiary__Dht__Record forged, unsigned_;
    ap__dht_record_to_pb(&r, sig, true, &forged);
    ap__dht_record_to_pb(&r, NULL, false, &unsigned_);
    Apiary__Dht__Record *recs[2] = {&forged, &unsigned_};
    int holders[5];
    int nh = nearest_nodes(s, key, holders, 5);
    raw_t raws[5];
    for (int i = 0; i < nh; i++) raw_store(s, thief, holders[i], recs, 2, &raws[i]);
    sw_run_idle(s, 60000000);
    for (int i = 0; i < nh; i++) {
        assert_ok(raws[i].status);
        assert_int_equal(raws[i].nst, 2);
        assert_int_equal(raws[i].st[0], AP_EAUTH);
        assert_int_equal(raws[i].st[1], AP_EAUTH);
    }
    /* readers still get the owner's value */
    op_t g;
    ap_dht_t *reader = s->dht[20];
    s->pending++;
    memset(&g, 0, sizeof g);
    g.s = s;
    assert_ok(ap_dht_get(reader, (const uint8_t *)key, strlen(key), true, sw_get_cb, &g));
    sw_run_idle(s, 60000000);
    assert_true(g.found);
    assert_true(g.is_dict);
    assert_int_equal(g.nrecords, 1);
    sw_free(s);
}

static void test_bad_input(void **state)
{
    (void)state;
    int n = 30;
    swarm_t *s = sw_new(n, ap_test_seed(6), 20000, NULL, 20000);
    assert_non_null(s);
    ap_rt_t *rt = sw_rt(s, 3);
    int64_t now = ap_rt_wall_ms(rt);
    op_t st;
    assert_ok(sw_store(s, 3, "victim", NULL, "good", 600000, &st));
    sw_run_idle(s, 60000000);
    assert_ok(st.status);
    int holders[5];
    nearest_nodes(s, "victim", holders, 5);
    int h = holders[0];

    ap_dht_record_t recs[4] = {
        {.key = (const uint8_t *)"victim",
         .key_len = 6,
         .value = (const uint8_t *)"bad",
         .value_len = 3,
         .expiration_ms = now - 1000}, /* expired */
        {.key = (const uint8_t *)"victim",
         .key_len = 6,
         .value = (const uint8_t *)"bad",
         .value_len = 3,
         .expiration_ms = now + 400LL * 24 * 3600 * 1000}, /* far future */
        {.key = (const uint8_t *)"victim",
         .key_len = 6,
         .value = (const uint8_t *)"old",
         .value_len = 3,
         .expiration_ms = now + 1000}, /* not newer */
        {.key = (const uint8_t *)"victim[owner:12D3KooWnotapeer]",
         .key_len = 30,
         .value = (const uint8_t *)"x",
         .value_len = 1,
         .expiration_ms = now + 1000}, /* bad owner */
    };
    Apiary__Dht__Record pbs[4];
    Apiary__Dht__Record *pp[4];
    for (int i = 0; i < 4; i++) {
        ap__dht_record_to_pb(&recs[i], NULL, false, &pbs[i]);
        pp[i] = &pbs[i];
    }
    raw_t r;
    raw_store(s, 5, h, pp, 4, &r);
    sw_run_idle(s, 60000000);
    assert_ok(r.status);
    assert_int_equal(r.st[0], AP_EEXPIRED);
    assert_int_equal(r.st[1], AP_ERANGE);
    assert_int_equal(r.st[2], AP_ESTALE);
    assert_int_equal(r.st[3], AP_EAUTH);

    /* oversize value: the whole request is refused as malformed */
    static uint8_t big[AP_DHT_VALUE_MAX + 1];
    ap_dht_record_t huge = {.key = (const uint8_t *)"victim",
                            .key_len = 6,
                            .value = big,
                            .value_len = sizeof big,
                            .expiration_ms = now + 900000};
    ap__dht_record_to_pb(&huge, NULL, false, &pbs[0]);
    raw_store(s, 5, h, pp, 1, &r);
    sw_run_idle(s, 60000000);
    assert_int_equal(r.status, AP_EMSGSIZE);

    /* malformed bytes */
    uint8_t junk[40];
    for (int i = 0; i < 40; i++) junk[i] = (uint8_t)(0xF7 ^ (i * 13));
    raw_bytes(s, 5, h, junk, sizeof junk, &r);
    sw_run_idle(s, 60000000);
    assert_true(r.status == AP_EPROTO);

    /* a flood from one peer: the per-minute budget holds */
    ap_dht_config_t c;
    ap_dht_config_default(&c);
    int budget = (int)c.max_stores_per_peer_per_min;
    int sent = 0, refused = 0, accepted = 0;
    char keys[64][32];
    raw_t fr[40];
    int rounds = (budget + 600) / 64 + 1;
    for (int round = 0; round < rounds; round++) {
        for (int i = 0; i < 64; i++) snprintf(keys[i], sizeof keys[i], "flood-%d-%d", round, i);
        Apiary__Dht__Record fp[64];
        Apiary__Dht__Record *fpp[64];
        for (int i = 0; i < 64; i++) {
            ap_dht_record_t fr1 = {.key = (const uint8_t *)keys[i],
                                   .key_len = strlen(keys[i]),
                                   .value = (const uint8_t *)"x",
                                   .value_len = 1,
                                   .expiration_ms = now + 600000};
            ap__dht_record_to_pb(&fr1, NULL, false, &fp[i]);
            fpp[i] = &fp[i];
        }
        raw_store(s, 6, h, fpp, 64, &fr[round % 40]);
        sw_run_idle(s, 60000000);
        sent += 64;
        for (size_t i = 0; i < fr[round % 40].nst; i++) {
            if (fr[round % 40].st[i] == AP_ERATE) refused++;
            if (fr[round % 40].st[i] == 0) accepted++;
        }
    }
    print_message("flood: %d sent, %d accepted, %d refused\n", sent, accepted, refused);
    assert_int_equal(accepted, budget);
    assert_int_equal(refused, sent - budget);
    /* stored data unaffected by all of it */
    op_t g;
    assert_ok(sw_get(s, 11, "victim", true, &g));
    sw_run_idle(s, 60000000);
    assert_true(g.found);
    assert_string_equal(g.value, "good");
    sw_free(s);
}

typedef struct sm {
    swarm_t *s;
    bool done;
    int ok;
} sm_t;

static void store_many_cb(ap_dht_t *dht, void *arg, const int *status, const int *nstored, size_t n)
{
    sm_t *m = arg;
    m->done = true;
    for (size_t i = 0; i < n; i++)
        if (status[i] == 0 && nstored[i] > 0) m->ok++;
    m->s->pending--;
}

typedef struct many {
    swarm_t *s;
    bool done;
    int status;
    size_t n, found;
    size_t dict_entries;
} many_t;

static void many_cb(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res, size_t n)
{
    many_t *m = arg;
    m->done = true;
    m->status = status;
    m->n = n;
    for (size_t i = 0; i < n; i++) {
        if (res[i].found) m->found++;
        if (res[i].is_dict) m->dict_entries += res[i].nrecords;
    }
    m->s->pending--;
}

static void test_dict_batch_coalesce(void **state)
{
    (void)state;
    int n = ap_test_sanitized()
                ? 200
                : 300; /* remote caching needs a swarm where gets pass non-holders */
    swarm_t *s = sw_new(n, ap_test_seed(7), 50000, NULL, 20000);
    assert_non_null(s);
    /* ten writers each add their subkey to one dictionary */
    op_t w[10];
    char sub[32];
    for (int i = 0; i < 10; i++) {
        snprintf(sub, sizeof sub, "peer-%d", i);
        assert_ok(sw_store(s, 10 + i * 7, "group", sub, "ready", 600000 + i, &w[i]));
    }
    sw_run_idle(s, 60000000);
    for (int i = 0; i < 10; i++) assert_ok(w[i].status);
    op_t g;
    assert_ok(sw_get(s, n - 3, "group", true, &g));
    sw_run_idle(s, 60000000);
    assert_true(g.found);
    assert_true(g.is_dict);
    assert_int_equal(g.nrecords, 10);

    /* batch store and batch get of 40 keys */
    ap_dht_record_t recs[40];
    char keys[40][16];
    const uint8_t *kp[41];
    size_t kl[41];
    int64_t now = ap_rt_wall_ms(sw_rt(s, 5));
    for (int i = 0; i < 40; i++) {
        snprintf(keys[i], sizeof keys[i], "batch-%d", i);
        recs[i] = (ap_dht_record_t){.key = (const uint8_t *)keys[i],
                                    .key_len = strlen(keys[i]),
                                    .value = (const uint8_t *)"b",
                                    .value_len = 1,
                                    .expiration_ms = now + 600000};
        kp[i] = recs[i].key;
        kl[i] = recs[i].key_len;
    }
    kp[40] = (const uint8_t *)"absent";
    kl[40] = 6;
    sm_t sm = {.s = s};
    s->pending++;
    ap_dht_stats_t st0, st1;
    ap_dht_get_stats(s->dht[5], &st0);
    assert_ok(ap_dht_store_many(s->dht[5], recs, 40, store_many_cb, &sm));
    sw_run_idle(s, 60000000);
    assert_true(sm.done);
    assert_int_equal(sm.ok, 40);
    ap_dht_get_stats(s->dht[5], &st1);
    uint64_t batch_rpcs = st1.rpcs_sent - st0.rpcs_sent;
    many_t m = {.s = s};
    s->pending++;
    ap_dht_get_stats(s->dht[n - 5], &st0);
    assert_ok(ap_dht_get_many(s->dht[n - 5], kp, kl, 41, false, many_cb, &m));
    sw_run_idle(s, 60000000);
    ap_dht_get_stats(s->dht[n - 5], &st1);
    assert_true(m.done);
    assert_ok(m.status);
    assert_int_equal(m.n, 41);
    assert_int_equal(m.found, 40);
    uint64_t get_finds = st1.finds_sent - st0.finds_sent;
    /* 40 other keys, stored the same way, fetched one by one from another node:
     * their traversals send more FIND requests than the packed batch did.
     * (Other keys, so neither side profits from values the other cached; FIND
     * requests only, so background pings and cache stores do not count.) */
    ap_dht_record_t recs2[40];
    char keys2[40][16];
    for (int i = 0; i < 40; i++) {
        snprintf(keys2[i], sizeof keys2[i], "single-%d", i);
        recs2[i] = (ap_dht_record_t){.key = (const uint8_t *)keys2[i],
                                     .key_len = strlen(keys2[i]),
                                     .value = (const uint8_t *)"s",
                                     .value_len = 1,
                                     .expiration_ms = now + 600000};
    }
    sm_t sm2 = {.s = s};
    s->pending++;
    assert_ok(ap_dht_store_many(s->dht[5], recs2, 40, store_many_cb, &sm2));
    sw_run_idle(s, 60000000);
    assert_true(sm2.done);
    assert_int_equal(sm2.ok, 40);
    op_t one[40];
    ap_dht_get_stats(s->dht[n - 6], &st0);
    for (int i = 0; i < 40; i++) assert_ok(sw_get(s, n - 6, keys2[i], false, &one[i]));
    sw_run_idle(s, 60000000);
    ap_dht_get_stats(s->dht[n - 6], &st1);
    uint64_t single_finds = st1.finds_sent - st0.finds_sent;
    for (int i = 0; i < 40; i++) assert_true(one[i].found);
    print_message(
        "batch store of 40: %llu rpcs; batch get: %llu finds; 40 single gets: %llu finds\n",
        (unsigned long long)batch_rpcs, (unsigned long long)get_finds,
        (unsigned long long)single_finds);
    assert_true(get_finds * 3 < single_finds * 2);

    /* coalescing: 10 concurrent gets of one key on one node = one traversal */
    op_t c[10];
    ap_dht_t *d = s->dht[n - 7];
    ap_dht_get_stats(d, &st0);
    assert_ok(sw_get(s, n - 7, "batch-3", true, &c[0]));
    sw_run_idle(s, 60000000);
    ap_dht_get_stats(d, &st1);
    uint64_t one_traversal = st1.rpcs_sent - st0.rpcs_sent;
    ap_dht_t *d2 = s->dht[n - 8];
    ap_dht_get_stats(d2, &st0);
    for (int i = 0; i < 10; i++) assert_ok(sw_get(s, n - 8, "batch-3", i % 2 == 0, &c[i]));
    sw_run_idle(s, 60000000);
    ap_dht_get_stats(d2, &st1);
    for (int i = 0; i < 10; i++) assert_true(c[i].found);
    print_message("one latest get: %llu rpcs; 10 concurrent gets: %llu rpcs\n",
                  (unsigned long long)one_traversal,
                  (unsigned long long)(st1.rpcs_sent - st0.rpcs_sent));
    assert_true(st1.rpcs_sent - st0.rpcs_sent <= one_traversal + 2);

    /* remote caching: gets leave copies at visited nodes that lacked the value */
    op_t cs;
    assert_ok(sw_store(s, 2, "cache-me", NULL, "c", 600000, &cs));
    sw_run_idle(s, 60000000);
    assert_ok(cs.status);
    size_t before = 0, after = 0;
    for (int i = 0; i < n; i++) {
        ap_dht_stats_t x;
        ap_dht_get_stats(s->dht[i], &x);
        before += x.stored_records;
    }
    op_t cg[10];
    for (int i = 0; i < 10; i++) {
        assert_ok(sw_get(s, (20 + 13 * i) % n, "cache-me", false, &cg[i]));
        sw_run_idle(s, 60000000);
        assert_true(cg[i].found);
    }
    for (int i = 0; i < n; i++) {
        ap_dht_stats_t x;
        ap_dht_get_stats(s->dht[i], &x);
        after += x.stored_records;
    }
    print_message("remote caching: %zu -> %zu stored records after 10 gets\n", before, after);
    assert_true(after > before);

    /* caching: a second get on the same node is answered locally (0 hops) */
    op_t again;
    assert_ok(sw_get(s, n - 8, "batch-3", false, &again));
    sw_run_idle(s, 60000000);
    assert_true(again.found);
    assert_int_equal(again.hops, 0);
    sw_free(s);
}

static void test_client_and_bootstrap_errors(void **state)
{
    (void)state;
    int n = 30;
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    swarm_t *s = sw_new_n(n, n - 1, ap_test_seed(8), 20000, &cfg, 20000);
    assert_non_null(s);
    /* node n-1 joins as a client */
    ap_dht_config_t cc = cfg;
    cc.client_mode = true;
    assert_ok(ap_dht_new(sw_rt(s, n - 1), &cc, &s->dht[n - 1]));
    sw_run(s, NULL, NULL, 20000000);
    sw_bootstrap(s, n - 1, n - 1);
    sw_run_idle(s, 60000000);
    op_t st, g;
    assert_ok(sw_store(s, n - 1, "from-client", NULL, "hi", 600000, &st));
    sw_run_idle(s, 60000000);
    assert_ok(st.status);
    assert_int_equal(st.nstored, 5); /* all remote: a client stores nothing itself */
    assert_ok(sw_get(s, n - 1, "from-client", true, &g));
    sw_run_idle(s, 60000000);
    assert_true(g.found);
    /* nobody put the client in its routing table: the others still hold at
     * most the other n - 2 nodes */
    for (int i = 0; i < n - 1; i++) {
        ap_dht_stats_t ds;
        ap_dht_get_stats(s->dht[i], &ds);
        assert_true(ds.routing_peers <= (size_t)(n - 2));
    }
    ap_dht_stats_t cs;
    ap_dht_get_stats(s->dht[n - 1], &cs);
    assert_true(cs.routing_peers > 0);
    assert_int_equal(cs.rpcs_served, 0);

    /* bootstrap errors: nobody answers -> AP_EUNREACH via the callback */
    sw_crash(s, 0);
    sw_crash(s, 1);
    assert_ok(sw_restart(s, 1));
    assert_ok(sw_start_node(s, 1));
    int fails = s->boot_fail;
    const char *dead[2] = {"/sim/0", "/sim/0"};
    s->pending++;
    assert_ok(ap_dht_bootstrap(s->dht[1], dead, 2, sw_boot_done, s));
    sw_run_idle(s, 60000000);
    assert_int_equal(s->boot_fail, fails + 1);
    /* an address that cannot even be dialed fails at once */
    const char *bad[1] = {"/nonsense"};
    assert_int_equal(ap_dht_bootstrap(s->dht[1], bad, 1, sw_boot_done, s), AP_EUNREACH);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostile_writer),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_dict_batch_coalesce),
        cmocka_unit_test(test_client_and_bootstrap_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
