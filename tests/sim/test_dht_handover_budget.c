/* DHT hand-over within the node's memory budget (ap_rt_mem_reserve). A
 * target holds 64 records of 16 KB; 16 fresh identities join through it at
 * once and stay, but answer every request only a second after it arrived,
 * so all their hand-overs are in flight together: about 8 MB, half the
 * records for each newcomer. With the target's budget at 4 MiB, what is in
 * flight must stay within it, the hand-overs that do not fit must be
 * deferred (not dropped), and every reservation must be given back. The
 * same scenario without a limit is the control: it must exceed 4 MiB (or
 * the test would prove nothing), and the bounded run must deliver nearly
 * all it delivered, only later. */
#include "aptest.h"

#include "dht/wire.h"
#include "dht_swarm.h"

#define NEWCOMERS 16
#define NRECS     64
#define VLEN      16000
#define HOLD_US   1000000
#define LIMIT     (4ull << 20)

typedef struct figures {
    swarm_t *s;
    size_t outstanding, peak; /* request bytes the newcomers hold unanswered */
    size_t records;           /* records received in STOREs */
    uint64_t target_peak;     /* the target's ap_rt_mem_reserve'd bytes */
    uint64_t held_after;
    ap_dht_stats_t st;
} figures_t;

typedef struct hold {
    figures_t *f;
    ap_rpc_req_t *req;
    size_t len;
} hold_t;

static void answer(ap_rt_t *rt, void *arg)
{
    (void)rt;
    hold_t *h = arg;
    h->f->outstanding -= h->len;
    ap_rpc_respond(h->req, NULL, 0);
    free(h);
}

/* A newcomer that stays but is slow: every request answered HOLD_US later. */
static void slow_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    figures_t *f = arg;
    size_t len;
    const uint8_t *d = ap_rpc_req_data(req, &len);
    Apiary__Dht__Request *q;
    if (ap__dht_decode_request(d, len, &q) == 0) {
        if (q->body_case == APIARY__DHT__REQUEST__BODY_STORE) f->records += q->store->n_records;
        apiary__dht__request__free_unpacked(q, NULL);
    }
    hold_t *h = malloc(sizeof *h);
    assert_non_null(h);
    *h = (hold_t){f, req, len};
    f->outstanding += len;
    if (f->outstanding > f->peak) f->peak = f->outstanding;
    assert_true(ap_rt_timer_start(rt, HOLD_US, 0, answer, h) != 0);
}

static void scenario(uint64_t limit, figures_t *f)
{
    memset(f, 0, sizeof *f);
    swarm_t *s = sw_new_n(2 + NEWCOMERS, 1, ap_test_seed(14), 5000, NULL, 0);
    assert_non_null(s);
    f->s = s;
    /* node 1 writes the records (client mode: only the target holds them) */
    ap_dht_config_t cc = s->cfg;
    cc.client_mode = true;
    assert_ok(ap_dht_new(sw_rt(s, 1), &cc, &s->dht[1]));
    sw_bootstrap(s, 1, 1);
    sw_run_idle(s, 10000000);
    static char val[VLEN + 1];
    memset(val, 'v', VLEN);
    op_t ops[NRECS];
    char key[32];
    for (int i = 0; i < NRECS; i++) {
        snprintf(key, sizeof key, "held-%d", i);
        assert_ok(sw_store(s, 1, key, NULL, val, 3600000, &ops[i]));
    }
    sw_run_idle(s, 30000000);
    for (int i = 0; i < NRECS; i++) assert_ok(ops[i].status);
    ap_dht_stats_t st;
    ap_dht_get_stats(s->dht[0], &st);
    assert_int_equal(st.stored_records, NRECS);

    assert_ok(ap_sim_set_memory(s->sim, 0, limit, 0));
    /* the newcomers join at once; hand-overs start 2 s after (HANDOVER_DELAY_US) */
    for (int i = 2; i < 2 + NEWCOMERS; i++) {
        assert_ok(sw_start_node(s, i));
        sw_bootstrap(s, i, 1);
    }
    sw_run_idle(s, 1500000);
    assert_int_equal(s->pending, 0);
    for (int i = 2; i < 2 + NEWCOMERS; i++) {
        ap_dht_free(s->dht[i]);
        s->dht[i] = NULL;
        assert_ok(ap_rt_rpc_register(sw_rt(s, i), AP_DHT_PROTO, AP__DHT_MSG_MAX, slow_handler, f));
    }
    for (int t = 0; t < 20000; t++) { /* 20 s in steps of 1 ms */
        ap_sim_run_for(s->sim, 1000);
        uint64_t held = ap_sim_memory_held(s->sim, 0);
        if (held > f->target_peak) f->target_peak = held;
    }
    assert_int_equal(f->outstanding, 0);
    f->held_after = ap_sim_memory_held(s->sim, 0);
    ap_dht_get_stats(s->dht[0], &f->st);
    sw_free(s);
}

static void test_handover_budget(void **state)
{
    (void)state;
    figures_t ctl, b;
    scenario(0, &ctl);
    scenario(LIMIT, &b);
    print_message("control: peak in flight %zu bytes, %zu records; budget %llu: peak %zu bytes "
                  "(reserved %llu), %zu records, %llu deferred, %llu skipped\n",
                  ctl.peak, ctl.records, (unsigned long long)LIMIT, b.peak,
                  (unsigned long long)b.target_peak, b.records,
                  (unsigned long long)b.st.handovers_deferred,
                  (unsigned long long)b.st.bg_stores_skipped);
    assert_true(ctl.peak > LIMIT); /* the scenario is heavy enough */
    assert_true(ctl.records >= NEWCOMERS * NRECS / 4);
    /* bounded: in flight within the budget, reserved while in flight */
    assert_true(b.peak <= LIMIT);
    assert_true(b.target_peak > 0 && b.target_peak <= LIMIT);
    assert_true(b.st.handovers_deferred > 0);
    /* deferred, not lost; every reservation given back */
    assert_true(b.records * 10 >= ctl.records * 9);
    assert_int_equal(b.held_after, 0);
    assert_int_equal(ctl.held_after, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handover_budget),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
