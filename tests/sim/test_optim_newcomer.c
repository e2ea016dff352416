/* State sharing on the simulator: a newcomer catches up by downloading
 * parameters, optimizer state and epoch from several donors; a download
 * survives a donor crashing mid-transfer; wrong-shaped and corrupt parts from
 * malicious donors are refused and fetched from honest donors instead; dead
 * donors are backed off from instead of hammered; a state request of another
 * run configuration is refused. */
#include "optim_harness.h"

#include "optim/collab_impl.h" /* to see which donors a download uses */

#define B 16

static void base_cfg(ap_collab_config_t *cfg)
{
    ap_collab_config_default(cfg);
    cfg->run_id = "newcomer";
    cfg->target_batch_size = 3 * B;
    cfg->solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg->lr.base = cfg->lr.min = 1e-2f;
    cfg->average_state_every = 0;
    cfg->averaging_timeout_us = 5000000;
    cfg->stale_ms = 8000;
}

/* Three peers train; node 3 stays down until `join_epoch`, then starts from a
 * fresh (different) initialisation and must load the others' state. */
static void start_three(oh_env_t *e, uint64_t join_epoch, int n, const double *flops)
{
    ap_collab_config_t cfg;
    base_cfg(&cfg);
    oh_env_init(e, n, ap_test_seed(7), &cfg, B, flops, NULL);
    e->data_slots = n;
    for (int i = 0; i < 3; i++) oh_peer_up(e, i, i == 0 ? -1 : 0);
    for (int i = 3; i < n; i++) assert_ok(ap_sim_crash(e->sim, i));
    ap_sim_run_for(e->sim, 500000);
    for (int i = 0; i < 3; i++) oh_peer_start(e, i);
    oh_epoch_pred_t q = {e, join_epoch, 3};
    assert_true(ap_sim_run_until(e->sim, oh_reached, &q, ap_sim_now_us(e->sim) + 120000000));
}

static bool started3(void *arg)
{
    oh_env_t *e = arg;
    return e->p[3].started;
}

static void test_newcomer_catches_up(void **state)
{
    (void)state;
    oh_env_t e;
    start_three(&e, 5, 4, NULL);
    e.init_seed = 999; /* the newcomer's own initialisation differs */
    /* 64 kbit/s down: the state (params + Adam m, v) takes ~1 s on the link */
    assert_ok(ap_sim_set_node_bw(e.sim, 3, 0, 64000));
    uint64_t t_join = ap_sim_now_us(e.sim);
    assert_ok(ap_sim_restart(e.sim, 3));
    assert_true(ap_sim_run_until(e.sim, started3, &e, ap_sim_now_us(e.sim) + 30000000));
    {
        const ap_nn_solver_t *o3 = ap_collab_solver(e.p[3].collab);
        double link_s = (double)((o3->n + o3->state_count) * sizeof(float)) * 8 / 64000.0;
        double took_s = (double)(ap_sim_now_us(e.sim) - t_join) / 1e6;
        print_message("newcomer in sync %.2f s after joining; its link needs %.2f s for the "
                      "state: ratio %.2f (target <= 2)\n",
                      took_s, link_s, took_s / link_s);
        assert_true(took_s <= 2 * link_s);
    }
    assert_ok(ap_sim_set_node_bw(e.sim, 3, 0, 0)); /* then a normal link */
    assert_false(e.p[3].start_failed);
    ap_collab_stats_t st;
    ap_collab_get_stats(e.p[3].collab, &st);
    assert_int_equal(st.state_loads, 1);
    uint64_t ep3 = ap_collab_epoch(e.p[3].collab);
    assert_true(ep3 >= 5);
    /* in sync right after the download: same epoch and parameters as a donor
     * in that epoch (donors are replicas of each other) */
    ap_nn_params_t *p3 = ap_nn_model_params(e.p[3].model);
    int same = 0;
    for (int i = 0; i < 3; i++) {
        if (ap_collab_epoch(e.p[i].collab) != ep3) continue;
        ap_nn_params_t *pi = ap_nn_model_params(e.p[i].model);
        if (oh_max_diff(pi->data, p3->data, pi->count) == 0.0) same++;
        assert_int_equal(ap_collab_solver(e.p[i].collab)->step,
                         ap_collab_solver(e.p[3].collab)->step);
    }
    assert_true(same >= 1);

    /* then it trains along: four peers in the next epochs */
    oh_epoch_pred_t q = {&e, ep3 + 3, 4};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 60000000));
    ap_collab_get_stats(e.p[3].collab, &st);
    assert_int_equal(st.last_group_size, 4);
    ap_nn_params_t *p0 = ap_nn_model_params(e.p[0].model);
    if (ap_collab_epoch(e.p[0].collab) == ap_collab_epoch(e.p[3].collab))
        assert_true(oh_max_diff(p0->data, p3->data, p0->count) < 1e-5);
    oh_env_free(&e);
}

static bool dl_active(void *arg)
{
    oh_env_t *e = arg;
    return e->p[3].collab && e->p[3].collab->dl.active;
}

/* Donor crash mid-transfer: the newcomer's download link is slow so the
 * transfer takes seconds; one donor crashes a second in. */
static void test_donor_leaves_mid_transfer(void **state)
{
    (void)state;
    oh_env_t e;
    start_three(&e, 3, 4, NULL);
    for (int i = 0; i < 3; i++) e.p[i].stop = true; /* freeze the state */
    ap_sim_run_for(e.sim, 3000000);
    assert_ok(ap_sim_set_node_bw(e.sim, 3, 0, 64000)); /* 8 kB/s down: ~1 s */
    assert_ok(ap_sim_restart(e.sim, 3));
    /* crash a donor the newcomer streams from, one second into the download */
    assert_true(ap_sim_run_until(e.sim, dl_active, &e, ap_sim_now_us(e.sim) + 30000000));
    ap_sim_run_for(e.sim, 300000);
    assert_false(e.p[3].started);
    int victim = -1;
    const dl_state_t *dl = &e.p[3].collab->dl;
    for (int r = 0; r < dl->nranges && victim < 0; r++)
        if (dl->ranges[r].s && dl->ranges[r].donor >= 0)
            victim = ap_sim_find_peer(e.sim, &dl->donors[dl->ranges[r].donor]);
    assert_true(victim >= 0 && victim < 3);
    assert_ok(ap_sim_crash(e.sim, victim));
    assert_true(ap_sim_run_until(e.sim, started3, &e, ap_sim_now_us(e.sim) + 60000000));
    assert_false(e.p[3].start_failed);
    ap_collab_stats_t st;
    ap_collab_get_stats(e.p[3].collab, &st);
    assert_int_equal(st.state_loads, 1);
    ap_nn_params_t *p0 = ap_nn_model_params(e.p[0].model);
    ap_nn_params_t *p3 = ap_nn_model_params(e.p[3].model);
    int ref = victim == 0 ? 1 : 0;
    p0 = ap_nn_model_params(e.p[ref].model);
    assert_int_equal(ap_collab_epoch(e.p[3].collab), ap_collab_epoch(e.p[ref].collab));
    assert_true(oh_max_diff(p0->data, p3->data, p0->count) == 0.0);
    assert_true(memcmp(ap_collab_solver(e.p[ref].collab)->state,
                       ap_collab_solver(e.p[3].collab)->state,
                       ap_collab_solver(e.p[ref].collab)->state_count * sizeof(float)) == 0);
    oh_env_free(&e);
}

/* ---- dead donors ----------------------------------------------------------------- */

/* A dead donor among live ones: the newcomer's part from it fails once, the
 * donor is dropped for that download and the part comes from the others. */
static void test_dead_donor_dropped(void **state)
{
    (void)state;
    oh_env_t e;
    start_three(&e, 3, 4, NULL);
    for (int i = 0; i < 3; i++) e.p[i].stop = true;
    ap_sim_run_for(e.sim, 3000000);
    assert_ok(ap_sim_crash(e.sim, 2)); /* its record stays fresh for stale_ms */
    assert_ok(ap_sim_restart(e.sim, 3));
    assert_true(ap_sim_run_until(e.sim, started3, &e, ap_sim_now_us(e.sim) + 60000000));
    ap_collab_stats_t st;
    ap_collab_get_stats(e.p[3].collab, &st);
    print_message("dead donor among 3: loads %llu, donor failures %llu\n",
                  (unsigned long long)st.state_loads, (unsigned long long)st.state_donor_failures);
    assert_false(e.p[3].start_failed);
    assert_int_equal(st.state_loads, 1);
    assert_int_equal(st.state_donor_failures, 1);
    ap_nn_params_t *p0 = ap_nn_model_params(e.p[0].model);
    ap_nn_params_t *p3 = ap_nn_model_params(e.p[3].model);
    assert_true(oh_max_diff(p0->data, p3->data, p0->count) == 0.0);
    oh_env_free(&e);
}

/* Every donor ahead is dead while their records stay fresh: the newcomer's
 * download cannot finish; it trains on and retries each donor after a
 * back-off (1, 2, 4, 8, 16 s) instead of at every batch. */
static void test_dead_donors_backed_off(void **state)
{
    (void)state;
    oh_env_t e;
    ap_collab_config_t cfg;
    base_cfg(&cfg);
    cfg.stale_ms = 60000;
    cfg.progress_ttl_ms = 120000;
    oh_env_init(&e, 4, ap_test_seed(11), &cfg, B, NULL, NULL);
    for (int i = 0; i < 3; i++) oh_peer_up(&e, i, i == 0 ? -1 : 0);
    assert_ok(ap_sim_crash(e.sim, 3));
    ap_sim_run_for(e.sim, 500000);
    for (int i = 0; i < 3; i++) oh_peer_start(&e, i);
    oh_epoch_pred_t q = {&e, 3, 3};
    assert_true(ap_sim_run_until(e.sim, oh_reached, &q, ap_sim_now_us(e.sim) + 120000000));
    for (int i = 0; i < 3; i++) e.p[i].stop = true;
    ap_sim_run_for(e.sim, 3000000);
    /* peer 0 quits training (its DHT node stays: the newcomer joins through
     * it); peers 1 and 2 crash */
    ap_collab_free(e.p[0].collab);
    e.p[0].collab = NULL;
    assert_ok(ap_sim_crash(e.sim, 1));
    assert_ok(ap_sim_crash(e.sim, 2));
    e.init_seed = 999;
    assert_ok(ap_sim_restart(e.sim, 3));
    e.p[3].batch_cost = 2e7; /* 20 ms per batch, each submit reads the view */
    assert_true(ap_sim_run_until(e.sim, started3, &e, ap_sim_now_us(e.sim) + 60000000));
    ap_sim_run_for(e.sim, 30000000);
    ap_collab_stats_t st;
    ap_collab_get_stats(e.p[3].collab, &st);
    print_message("3 dead donors, 30 s: donor failures %llu, loads %llu, batches %llu\n",
                  (unsigned long long)st.state_donor_failures, (unsigned long long)st.state_loads,
                  (unsigned long long)e.p[3].batches);
    assert_true(e.p[3].start_failed); /* the start's download could not finish */
    assert_int_equal(st.state_loads, 0);
    assert_true(e.p[3].batches > 10); /* it trained on meanwhile */
    /* at most ~6 tries per donor in 31 s with back-off; without, one per batch */
    assert_true(st.state_donor_failures >= 3);
    assert_true(st.state_donor_failures <= 3 * 7);
    oh_env_free(&e);
}

/* ---- malicious donors ---------------------------------------------------------- */

typedef struct evil {
    int mode; /* 0 wrong shape, 1 corrupt payload (bad checksum), 2 NaN values */
    ap_collab_t *honest_twin;
} evil_t;

static size_t put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

static size_t put_field(uint8_t *p, int field, uint64_t v)
{
    size_t n = put_varint(p, (uint64_t)field << 3);
    return n + put_varint(p + n, v);
}

/* The hello is a StateRequest; we only need its offset (2) and count (3). */
static void parse_req(const uint8_t *h, size_t len, uint64_t *off, uint64_t *cnt)
{
    size_t i = 0;
    *off = *cnt = 0;
    while (i < len) {
        uint64_t tag = 0;
        int sh = 0;
        while (i < len) {
            tag |= (uint64_t)(h[i] & 0x7f) << sh;
            sh += 7;
            if (!(h[i++] & 0x80)) break;
        }
        if ((tag & 7) == 2) {
            uint64_t l = h[i++];
            i += l;
            continue;
        }
        uint64_t v = 0;
        sh = 0;
        while (i < len) {
            v |= (uint64_t)(h[i] & 0x7f) << sh;
            sh += 7;
            if (!(h[i++] & 0x80)) break;
        }
        if ((tag >> 3) == 2) *off = v;
        if ((tag >> 3) == 3) *cnt = v;
    }
}

static void evil_close(ap_stream_t *s, void *arg, int status) {}
static const ap_stream_cbs_t evil_cbs = {.on_close = evil_close};

static int evil_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                       const uint8_t *hello, size_t len)
{
    evil_t *ev = arg;
    uint64_t off, cnt;
    parse_req(hello, len, &off, &cnt);
    const ap_nn_solver_t *o = ap_collab_solver(ev->honest_twin);
    ap_stream_set_cbs(s, &evil_cbs, NULL);
    uint8_t hb[128];
    size_t hl = 0;
    hl += put_field(hb + hl, 1, ap_collab_epoch(ev->honest_twin));
    hl += put_field(hb + hl, 2, o->n + (ev->mode == 0 ? 7 : 0));
    hl += put_field(hb + hl, 3, o->state_count);
    hl += put_field(hb + hl, 4, o->step);
    hl += put_field(hb + hl, 5, (uint64_t)o->cfg.kind);
    hl += put_field(hb + hl, 6, off);
    hl += put_field(hb + hl, 7, cnt);
    ap_stream_send(s, hb, hl);
    float *v = calloc(cnt, sizeof(float));
    for (uint64_t i = 0; i < cnt; i++) v[i] = ev->mode == 2 && i == cnt / 2 ? NAN : 0.5f;
    ap_stream_send(s, (const uint8_t *)v, cnt * sizeof(float));
    uint8_t bad[32] = {1};
    ap_stream_send(s, bad, 32);
    ap_stream_close(s);
    free(v);
    return 0;
}

static void evil_store_done(ap_dht_t *dht, void *arg, int status, int nstored)
{
    *(int *)arg = status;
}

static void test_bad_donors_refused(void **state)
{
    (void)state;
    oh_env_t e;
    /* nodes: 0-2 honest, 3 newcomer, 4-6 malicious donors */
    start_three(&e, 3, 7, NULL);
    for (int i = 0; i < 3; i++) e.p[i].stop = true;
    ap_sim_run_for(e.sim, 3000000);
    evil_t ev[3];
    ap_dht_t *edht[3];
    for (int k = 0; k < 3; k++) {
        int node = 4 + k;
        assert_ok(ap_sim_restart(e.sim, node));
        /* the restart hook built a real peer there: replace it by the evil one */
        ap_sim_run_for(e.sim, 100);
        oh_peer_down(&e, node);
        ap_rt_t *rt = ap_sim_node(e.sim, node);
        ev[k].mode = k;
        ev[k].honest_twin = e.p[0].collab;
        ap_dht_config_t dc;
        ap_dht_config_default(&dc);
        assert_ok(ap_dht_new(rt, &dc, &edht[k]));
        const char *ad[1] = {"/sim/0"};
        assert_ok(ap_dht_bootstrap(edht[k], ad, 1, oh_boot_done, NULL));
        assert_ok(ap_rt_stream_listen(rt, AP_COLLAB_STATE_PROTO, NULL, evil_accept, &ev[k]));
    }
    ap_sim_run_for(e.sim, 500000);
    for (int k = 0; k < 3; k++) {
        ap_rt_t *rt = ap_sim_node(e.sim, 4 + k);
        ap_progress_t p = {.epoch = ap_collab_epoch(e.p[0].collab),
                           .samples = 0,
                           .samples_per_s = 10,
                           .role = AP_AVG_NORMAL,
                           .donor = true};
        p.time_ms = p.epoch_start_ms = ap_rt_wall_ms(rt);
        p.has_config = true; /* the run's configuration: only the parts are evil */
        ap_collab_run_config(e.p[0].collab, &p.config);
        uint8_t val[512];
        int len = ap_progress_encode(&p, val, sizeof val);
        assert_true(len > 0);
        char pid[AP_PEER_ID_STR_MAX], sub[AP_PEER_ID_STR_MAX + 16];
        snprintf(sub, sizeof sub, "[owner:%s]", ap_peer_id_str(ap_rt_self(rt), pid));
        ap_dht_record_t rec = {.key = (const uint8_t *)"newcomer_progress",
                               .key_len = strlen("newcomer_progress"),
                               .subkey = (const uint8_t *)sub,
                               .subkey_len = strlen(sub),
                               .value = val,
                               .value_len = (size_t)len,
                               .expiration_ms = p.time_ms + 600000};
        static int st;
        assert_ok(ap_dht_store(edht[k], &rec, evil_store_done, &st));
    }
    ap_sim_run_for(e.sim, 500000);
    e.cfg.max_donors = 6; /* one part from each of the 6 donors: 3 are evil */
    assert_ok(ap_sim_restart(e.sim, 3));
    assert_true(ap_sim_run_until(e.sim, started3, &e, ap_sim_now_us(e.sim) + 60000000));
    ap_collab_stats_t st;
    ap_collab_get_stats(e.p[3].collab, &st);
    print_message("state loads %llu, parts refused %llu\n", (unsigned long long)st.state_loads,
                  (unsigned long long)st.state_parts_refused);
    assert_int_equal(st.state_loads, 1);
    assert_true(st.state_parts_refused >= 3);
    ap_nn_params_t *p0 = ap_nn_model_params(e.p[0].model);
    ap_nn_params_t *p3 = ap_nn_model_params(e.p[3].model);
    assert_true(oh_max_diff(p0->data, p3->data, p0->count) == 0.0);
    for (int k = 0; k < 3; k++) {
        ap_rt_stream_unlisten(ap_sim_node(e.sim, 4 + k), AP_COLLAB_STATE_PROTO);
        ap_dht_free(edht[k]);
    }
    oh_env_free(&e);
}

/* ---- state requests carry the run configuration -------------------------------- */

typedef struct probe {
    int msgs, status;
    bool closed;
} probe_t;

static void probe_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t len)
{
    ((probe_t *)arg)->msgs++;
}
static void probe_close(ap_stream_t *s, void *arg, int status)
{
    probe_t *p = arg;
    p->closed = true;
    p->status = status;
}
static void probe_end(ap_stream_t *s, void *arg)
{
    ap_stream_close(s);
}
static const ap_stream_cbs_t probe_cbs = {
    .on_msg = probe_msg, .on_end = probe_end, .on_close = probe_close};

static char last_warn[512];
static void warn_sink(void *arg, ap_log_level_t level, const char *module, const char *msg)
{
    if (level >= AP_LOG_WARN && strstr(msg, "state request")) {
        snprintf(last_warn, sizeof last_warn, "%s", msg);
    }
}

static bool probe_done(void *arg)
{
    return ((probe_t *)arg)->closed;
}

/* Asks donor node 0 for 4 floats with run configuration cfg (NULL: none). */
static void probe_state(oh_env_t *e, const ap_run_config_t *cfg, probe_t *pr)
{
    ap_collab_t *c = e->p[0].collab;
    Apiary__Optim__StateRequest rq = APIARY__OPTIM__STATE_REQUEST__INIT;
    rq.run_hash.data = c->run_hash;
    rq.run_hash.len = 32;
    rq.offset = 0;
    rq.count = 4;
    rq.n_params = c->n;
    rq.state_count = c->opt->state_count;
    Apiary__Optim__RunConfig m;
    if (cfg) {
        ap__run_config_to_pb(cfg, &m);
        rq.config = &m;
    }
    uint8_t hello[1024];
    size_t hl = apiary__optim__state_request__pack(&rq, hello);
    memset(pr, 0, sizeof *pr);
    last_warn[0] = 0;
    ap_stream_t *s;
    assert_ok(ap_rt_stream_open(ap_sim_node(e->sim, 4), ap_rt_self(ap_sim_node(e->sim, 0)),
                                AP_COLLAB_STATE_PROTO, hello, hl, NULL, &probe_cbs, pr, &s));
    assert_true(ap_sim_run_until(e->sim, probe_done, pr, ap_sim_now_us(e->sim) + 30000000));
}

/* A donor serves a state request only with its own run configuration: one of
 * another codec or none is refused, the donor logging the differing field. */
static void test_state_request_config(void **state)
{
    (void)state;
    oh_env_t e;
    start_three(&e, 2, 5, NULL);
    assert_ok(ap_sim_restart(e.sim, 4));
    ap_sim_run_for(e.sim, 100);
    oh_peer_down(&e, 4); /* a bare node: it only opens streams */
    ap_log_set_sink(warn_sink, NULL);
    ap_run_config_t cfg;
    ap_collab_run_config(e.p[0].collab, &cfg);
    probe_t pr;
    probe_state(&e, &cfg, &pr); /* the run's own: served */
    assert_int_equal(pr.status, 0);
    assert_true(pr.msgs >= 3); /* header, the floats, the checksum */
    ap_run_config_t other = cfg;
    other.codec = cfg.codec == AP_AVG_CODEC_F32 ? AP_AVG_CODEC_FP16 : AP_AVG_CODEC_F32;
    probe_state(&e, &other, &pr);
    print_message("refused: %s\n", last_warn);
    assert_int_not_equal(pr.status, 0);
    assert_int_equal(pr.msgs, 0);
    assert_non_null(strstr(last_warn, "run configuration differs"));
    assert_non_null(strstr(last_warn, "compression: "));
    probe_state(&e, NULL, &pr);
    assert_int_not_equal(pr.status, 0);
    assert_int_equal(pr.msgs, 0);
    assert_non_null(strstr(last_warn, "none at"));
    ap_log_set_sink(NULL, NULL);
    oh_env_free(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_newcomer_catches_up),
        cmocka_unit_test(test_donor_leaves_mid_transfer),
        cmocka_unit_test(test_bad_donors_refused),
        cmocka_unit_test(test_dead_donor_dropped),
        cmocka_unit_test(test_dead_donors_backed_off),
        cmocka_unit_test(test_state_request_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
