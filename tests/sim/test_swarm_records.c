/* SWARM server records in the DHT, on the simulator: the record TTL is
 * settable and refused below 3 announcement periods; a slow DHT store (a
 * server far from the DHT) does not make the server skip refreshes so that
 * its record lapses while it lives; and a trainer's ban of a failed server
 * lasts until that server publishes a newer record: a dead server whose
 * record still lives stays banned, the same server restarted gets work again
 * at its first new record, long before its old record would expire. */
#include "aptest.h"

#include "apiary/dht.h"
#include "apiary/sim.h"
#include "apiary/swarm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CW     16
#define BB     2
#define TT     8
#define RUN    "simrec"
#define PERIOD 1000000ull /* announce period */

static ap_nn_model_t *one_stage_model(void)
{
    ap_nn_gpt_config_t c = ap_nn_gpt_config_default(TT, 1, 2, CW, BB);
    c.layer_begin = 0;
    c.layer_end = 1;
    c.embed = true;
    c.head = true;
    ap_nn_model_t *m;
    assert_ok(ap_nn_gpt_new(&c, &m));
    ap_nn_model_init(m, 5);
    return m;
}

static void on_boot(ap_dht_t *dht, void *arg, int status)
{
    (void)dht;
    if (status == 0) ++*(int *)arg;
}

static bool booted_n(void *arg)
{
    return ((int *)arg)[0] >= ((int *)arg)[1];
}

/* ---- a slow store ------------------------------------------------------------ */

/* What the bootstrap node receives of the server's record: every store runs
 * the validator. held_until is the latest expiration received; a store
 * arriving after it means the record had lapsed. */
typedef struct watch {
    ap_rt_t *rt;
    int64_t held_until, first_ms, last_ttl_ms;
    int arrivals, lapses;
    ap_swarm_announce_t last; /* the value last received */
} watch_t;

static int on_store(void *arg, const ap_dht_record_t *rec, const ap_peer_id_t *from)
{
    watch_t *w = arg;
    if (!from || rec->value_len != AP_SWARM_ANNOUNCE_LEN) return 0;
    const int64_t now = ap_rt_wall_ms(w->rt);
    if (w->held_until && now > w->held_until) w->lapses++;
    if (!w->first_ms) w->first_ms = now;
    if (rec->expiration_ms > w->held_until) w->held_until = rec->expiration_ms;
    w->last_ttl_ms = rec->expiration_ms - now;
    w->arrivals++;
    assert_ok(ap_swarm_announce_decode(rec->value, rec->value_len, &w->last));
    return 0;
}

typedef struct slow {
    ap_sim_t *sim;
    ap_dht_t *dht[2];
    ap_nn_model_t *m;
    ap_swarm_server_t *s;
    watch_t wt;
    int boot[2];
} slow_t;

/* Node 0: the DHT's bootstrap node, watching; node 1: a stage server whose
 * every message to or from node 0 takes latency_us. */
static void slow_new(slow_t *w, uint64_t latency_us)
{
    memset(w, 0, sizeof *w);
    w->sim = ap_sim_new(ap_test_seed(71));
    assert_non_null(w->sim);
    for (int i = 0; i < 2; i++) assert_int_equal(ap_sim_add_node(w->sim, NULL), i);
    ap_sim_link_t l = {.latency_us = latency_us};
    assert_ok(ap_sim_set_link(w->sim, 0, 1, &l));
    assert_ok(ap_sim_set_link(w->sim, 1, 0, &l));
    for (int i = 0; i < 2; i++) assert_ok(ap_dht_new(ap_sim_node(w->sim, i), NULL, &w->dht[i]));
    w->wt.rt = ap_sim_node(w->sim, 0);
    assert_ok(ap_dht_add_validator(w->dht[0], on_store, &w->wt));
    const char *boot = "/sim/0";
    w->boot[1] = 1;
    assert_ok(ap_dht_bootstrap(w->dht[1], &boot, 1, on_boot, w->boot));
    assert_true(ap_sim_run_until(w->sim, booted_n, w->boot, ap_sim_now_us(w->sim) + 60000000));
    w->m = one_stage_model();
    assert_ok(ap_swarm_server_new(ap_sim_node(w->sim, 1), w->m, 0, NULL, &w->s));
}

static void slow_free(slow_t *w)
{
    ap_swarm_server_free(w->s);
    for (int i = 0; i < 2; i++) ap_dht_free(w->dht[i]);
    ap_sim_free(w->sim);
    ap_nn_model_free(w->m);
}

/* A store reaches the DHT node 1.8 s after it starts and completes 2.4 s
 * after (a lookup and a store over a one-way latency of 600 ms), so each
 * record lands with 1.2 s to live. A server that waits for each store to
 * complete before the next refresh stores every 3 periods and its record
 * lapses between stores; refreshing every period keeps it. */
static void test_slow_store_keeps_record(void **state)
{
    (void)state;
    slow_t w;
    slow_new(&w, 600000);
    assert_ok(ap_swarm_server_announce(w.s, w.dht[1], RUN, PERIOD, 1));
    assert_int_equal(ap_swarm_server_record_ttl(w.s), 3 * PERIOD);
    ap_sim_run_for(w.sim, 30 * PERIOD);
    ap_swarm_server_stats_t st;
    ap_swarm_server_stats(w.s, &st);
    print_message("stores arrived %d (first after %lld ms), lapses %d, announces %llu (%llu "
                  "failed), last record arrived with %lld ms to live\n",
                  w.wt.arrivals, (long long)(w.wt.first_ms ? w.wt.first_ms : 0), w.wt.lapses,
                  (unsigned long long)st.announces, (unsigned long long)st.announce_failures,
                  (long long)w.wt.last_ttl_ms);
    assert_true(w.wt.arrivals >= 25); /* one per period, none skipped */
    assert_int_equal(w.wt.lapses, 0);
    assert_true(w.wt.held_until > ap_rt_wall_ms(w.wt.rt));
    assert_int_equal(st.announce_failures, 0);
    slow_free(&w);
}

/* The TTL: settable, at least 3 periods, at most AP_SWARM_RECORD_TTL_MAX_US;
 * the records carry it. */
static void test_record_ttl(void **state)
{
    (void)state;
    slow_t w;
    slow_new(&w, 5000);
    assert_int_equal(ap_swarm_server_announce_ttl(NULL, 0), AP_EINVAL);
    assert_int_equal(ap_swarm_server_announce_ttl(w.s, AP_SWARM_RECORD_TTL_MAX_US + 1), AP_EINVAL);
    /* set before announcing: checked against the period by _announce */
    assert_ok(ap_swarm_server_announce_ttl(w.s, 2 * PERIOD));
    assert_int_equal(ap_swarm_server_announce(w.s, w.dht[1], RUN, PERIOD, 1), AP_EINVAL);
    assert_ok(ap_swarm_server_announce_ttl(w.s, 10 * PERIOD));
    assert_ok(ap_swarm_server_announce(w.s, w.dht[1], RUN, PERIOD, 1));
    assert_int_equal(ap_swarm_server_record_ttl(w.s), 10 * PERIOD);
    ap_sim_run_for(w.sim, 3 * PERIOD);
    assert_true(w.wt.arrivals >= 3);
    assert_true(w.wt.last_ttl_ms > 9900 && w.wt.last_ttl_ms <= 10000);
    /* while announcing: checked at once, the old TTL kept */
    assert_int_equal(ap_swarm_server_announce_ttl(w.s, 3 * PERIOD - 1), AP_EINVAL);
    assert_int_equal(ap_swarm_server_record_ttl(w.s), 10 * PERIOD);
    assert_ok(ap_swarm_server_announce_ttl(w.s, 3 * PERIOD));
    ap_sim_run_for(w.sim, 2 * PERIOD);
    assert_true(w.wt.last_ttl_ms > 2900 && w.wt.last_ttl_ms <= 3000);
    assert_ok(ap_swarm_server_announce_ttl(w.s, 0)); /* the default */
    assert_int_equal(ap_swarm_server_record_ttl(w.s), 3 * PERIOD);
    slow_free(&w);
}

/* ---- estimates ------------------------------------------------------------------ */

static void grad_pattern(ap_nn_model_t *m)
{
    ap_nn_params_t *p = ap_nn_model_params(m);
    for (size_t k = 0; k < p->count; k++) p->grad[k] = (float)(k % 97) * 1e-3f;
}

static bool grad_is_pattern(ap_nn_model_t *m)
{
    ap_nn_params_t *p = ap_nn_model_params(m);
    for (size_t k = 0; k < p->count; k++)
        if (p->grad[k] != (float)(k % 97) * 1e-3f) return false;
    return true;
}

/* A server announcing with no initial figure measures a synthetic backward
 * of its stage first and announces that estimate at once, marked as one;
 * so does a server switched to another stage. The synthetic call leaves the
 * stage's gradients as they were (they may hold a served backward's part
 * of a step). Records carry the period and the TTL. */
static void test_estimate(void **state)
{
    (void)state;
    slow_t w;
    slow_new(&w, 5000);
    grad_pattern(w.m);
    assert_ok(ap_swarm_server_announce(w.s, w.dht[1], RUN, PERIOD, 0));
    assert_true(ap_swarm_server_throughput(w.s) == 0); /* not computed yet */
    assert_false(ap_swarm_server_estimated(w.s));
    ap_sim_run_for(w.sim, PERIOD / 2); /* before the first refresh */
    const double est = ap_swarm_server_throughput(w.s);
    ap_swarm_server_stats_t st;
    ap_swarm_server_stats(w.s, &st);
    print_message("estimate %.1f tokens/s after %llu stores; %llu calls served\n", est,
                  (unsigned long long)st.announces,
                  (unsigned long long)(st.forwards + st.backwards));
    assert_true(est > 0);
    assert_true(ap_swarm_server_estimated(w.s));
    assert_int_equal(st.forwards + st.backwards, 0);
    assert_true(grad_is_pattern(w.m));
    assert_int_equal(w.wt.arrivals, 2); /* 0 at once, then the estimate at once */
    assert_true(w.wt.last.estimate && w.wt.last.throughput == est);
    assert_int_equal(w.wt.last.period_ms, PERIOD / 1000);
    assert_int_equal(w.wt.last.ttl_ms, 3 * PERIOD / 1000);
    /* another stage (here: another model of the same shape) */
    ap_nn_model_t *m2 = one_stage_model();
    grad_pattern(m2);
    assert_ok(ap_swarm_server_set_stage(w.s, m2, 0));
    ap_nn_model_free(w.m);
    w.m = m2;
    assert_true(ap_swarm_server_throughput(w.s) == 0);
    ap_sim_run_for(w.sim, PERIOD / 4);
    assert_true(ap_swarm_server_estimated(w.s));
    assert_true(fabs(ap_swarm_server_throughput(w.s) - est) <= 1e-6 * est);
    assert_true(grad_is_pattern(m2));
    assert_true(w.wt.last.estimate && w.wt.last.throughput == ap_swarm_server_throughput(w.s));
    slow_free(&w);
}

/* ---- calls whose caller gave up ------------------------------------------------- */

typedef struct answers {
    int n, ok, status[4];
} answers_t;

static void on_answer(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    (void)rt;
    (void)resp;
    (void)len;
    (void)errmsg;
    answers_t *a = arg;
    if (a->n < 4) a->status[a->n] = status;
    a->n++;
    a->ok += status == 0;
}

static bool answered3(void *arg)
{
    return ((answers_t *)arg)->n >= 3;
}

/* Three forwards of 100 ms of compute each, sent at once, each saying its
 * caller waits 150 ms: the first two start within that (after 0 and 100 ms
 * in the queue), the third would start after 200 ms, when its caller has
 * given up, so the server answers it AP_ETIMEDOUT without computing it.
 * The budget travels in the request. */
static void test_expired_calls(void **state)
{
    (void)state;
    slow_t w;
    slow_new(&w, 5000);
    const double cost = 2.0 * BB * TT * (double)ap_nn_model_params(w.m)->count;
    assert_ok(ap_sim_set_flops(w.sim, 1, cost / 0.1));
    int32_t tok[BB * TT] = {0};
    ap_swarm_req_t q = {.op = AP_SWARM_FORWARD,
                        .B = BB,
                        .T = TT,
                        .C = CW,
                        .tokens = tok,
                        .budget_us = 150000},
                   d;
    uint8_t *buf;
    size_t len;
    const char *why;
    assert_ok(ap_swarm_req_encode(&q, NULL, &buf, &len));
    assert_ok(ap_swarm_req_decode(buf, len, &d, &why));
    assert_int_equal(d.budget_us, 150000);
    ap_swarm_req_clear(&d);
    answers_t a = {0};
    ap_rt_t *rt = ap_sim_node(w.sim, 0);
    ap_rpc_opts_t o = {.timeout_us = 10000000}; /* the test waits for every answer */
    for (int i = 0; i < 3; i++)
        assert_true(ap_rt_rpc_call(rt, ap_rt_self(ap_sim_node(w.sim, 1)), AP_SWARM_PROTO_STAGE, buf,
                                   len, &o, on_answer, &a) != 0);
    free(buf);
    assert_true(ap_sim_run_until(w.sim, answered3, &a, ap_sim_now_us(w.sim) + 5000000));
    ap_swarm_server_stats_t st;
    ap_swarm_server_stats(w.s, &st);
    print_message("answers: %d %d %d; forwards computed %llu, expired %llu\n", a.status[0],
                  a.status[1], a.status[2], (unsigned long long)st.forwards,
                  (unsigned long long)st.expired);
    assert_int_equal(a.ok, 2);
    assert_int_equal(a.status[2], AP_ETIMEDOUT);
    assert_int_equal(st.forwards, 2);
    assert_int_equal(st.expired, 1);
    slow_free(&w);
}

/* ---- bans last until a newer record ---------------------------------------- */

#define NSRV    2
#define TRAINER (NSRV + 1)
#define NNODE   (TRAINER + 1)
#define VICTIM  2
#define LONGTTL (30 * PERIOD)

typedef struct bw {
    ap_sim_t *sim;
    ap_dht_t *dht[NNODE];
    ap_nn_model_t *m[NNODE];
    ap_swarm_server_t *srv[NNODE];
    ap_swarm_trainer_t *tr;
    int boot[2];
    int done, failed, inflight, next;
} bw_t;

static void bw_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    (void)sim;
    (void)rt;
    bw_t *w = arg;
    ap_swarm_server_free(w->srv[node]);
    w->srv[node] = NULL;
    ap_dht_free(w->dht[node]);
    w->dht[node] = NULL;
}

static void on_bwd(ap_swarm_server_t *s, void *arg, uint64_t samples)
{
    (void)s;
    (void)samples;
    assert_ok(ap_swarm_sgd_step(ap_nn_model_params(arg), 0.05f, 1.0f, NULL));
}

static void bw_start(bw_t *w, int i)
{
    ap_rt_t *rt = ap_sim_node(w->sim, i);
    assert_ok(ap_dht_new(rt, NULL, &w->dht[i]));
    const char *boot = "/sim/0";
    assert_ok(ap_dht_bootstrap(w->dht[i], &boot, 1, on_boot, w->boot));
    if (i > NSRV) return;
    if (!w->m[i]) w->m[i] = one_stage_model();
    assert_ok(ap_swarm_server_new(rt, w->m[i], 0, NULL, &w->srv[i]));
    ap_swarm_server_on_backward(w->srv[i], on_bwd, w->m[i]);
    assert_ok(ap_swarm_server_announce_ttl(w->srv[i], LONGTTL));
    assert_ok(ap_swarm_server_announce(w->srv[i], w->dht[i], RUN, PERIOD, 0));
}

static void on_batch(ap_rt_t *rt, void *arg, int status, float loss)
{
    (void)rt;
    (void)loss;
    bw_t *w = arg;
    w->inflight--;
    if (status == AP_ECANCELED) return;
    if (status)
        w->failed++;
    else
        w->done++;
}

/* Runs for us, keeping 3 micro-batches in flight. */
static void bw_train(bw_t *w, uint64_t us)
{
    const uint64_t end = ap_sim_now_us(w->sim) + us;
    while (ap_sim_now_us(w->sim) < end) {
        while (w->inflight < 3) {
            int32_t tok[BB * TT], tgt[BB * TT];
            for (int k = 0; k < BB * TT; k++) {
                tok[k] = 'a' + (k + w->next) % 4;
                tgt[k] = 'a' + (k + w->next + 1) % 4;
            }
            w->next++;
            assert_ok(ap_swarm_trainer_submit(w->tr, BB, TT, tok, tgt, on_batch, w));
            w->inflight++;
        }
        ap_sim_run_for(w->sim, 20000);
    }
}

static ap_swarm_server_info_t victim_info(bw_t *w)
{
    ap_swarm_server_info_t in;
    memset(&in, 0, sizeof in);
    int rc =
        ap_swarm_balancer_info(ap_swarm_trainer_balancer(w->tr, 0), ap_sim_peer_id(w->sim, VICTIM),
                               ap_rt_now_us(ap_sim_node(w->sim, TRAINER)), &in);
    assert_ok(rc);
    return in;
}

static void test_ban_until_newer_record(void **state)
{
    (void)state;
    bw_t w;
    memset(&w, 0, sizeof w);
    w.sim = ap_sim_new(ap_test_seed(72));
    assert_non_null(w.sim);
    ap_sim_link_t link = {.latency_us = 5000, .jitter_us = 1000};
    ap_sim_set_default_link(w.sim, &link);
    for (int i = 0; i < NNODE; i++) {
        ap_sim_node_opts_t o = {.on_crash = bw_crash, .hook_arg = &w};
        assert_int_equal(ap_sim_add_node(w.sim, &o), i);
    }
    assert_ok(ap_dht_new(ap_sim_node(w.sim, 0), NULL, &w.dht[0]));
    w.boot[1] = NNODE - 1;
    for (int i = 1; i < NNODE; i++) bw_start(&w, i);
    for (int i = 1; i <= NSRV; i++) {
        const double cost = 6.0 * BB * TT * (double)ap_nn_model_params(w.m[i])->count;
        ap_sim_set_flops(w.sim, i, cost / 0.02);
    }
    assert_true(ap_sim_run_until(w.sim, booted_n, w.boot, ap_sim_now_us(w.sim) + 60000000));
    assert_ok(ap_swarm_trainer_new(ap_sim_node(w.sim, TRAINER), 1, CW, NULL, 0, &w.tr));
    assert_ok(ap_swarm_trainer_watch(w.tr, w.dht[TRAINER], RUN, PERIOD / 2));
    bw_train(&w, 5 * PERIOD);
    ap_swarm_server_info_t in = victim_info(&w);
    assert_true(in.ok > 0);
    assert_false(in.banned);

    /* Crashed: its calls fail and it is banned. Its record lives 30 s and
     * is not refreshed: for the next 5 s it stays banned and gets nothing
     * (a refresh published just before the crash but read after the ban
     * may lift the ban once, for one more failed call). */
    assert_ok(ap_sim_crash(w.sim, VICTIM));
    bw_train(&w, PERIOD);
    in = victim_info(&w);
    assert_true(in.banned);
    const uint64_t ok_dead = in.ok, failed_dead = in.failed;
    assert_true(failed_dead >= 1);
    bw_train(&w, 4 * PERIOD);
    in = victim_info(&w);
    print_message("dead server: %llu ok, %llu failed calls, banned %d\n", (unsigned long long)in.ok,
                  (unsigned long long)in.failed, in.banned);
    assert_true(in.banned);
    assert_int_equal(in.ok, ok_dead);
    assert_true(in.failed <= failed_dead + 1);

    /* Restarted (same identity), it announces a newer record: the ban
     * lifts at the trainer's next read, 25 s before the old record would
     * expire. */
    assert_ok(ap_sim_restart(w.sim, VICTIM));
    bw_start(&w, VICTIM);
    const double cost = 6.0 * BB * TT * (double)ap_nn_model_params(w.m[VICTIM])->count;
    ap_sim_set_flops(w.sim, VICTIM, cost / 0.02);
    bw_train(&w, 3 * PERIOD);
    in = victim_info(&w);
    ap_swarm_server_stats_t st;
    ap_swarm_server_stats(w.srv[VICTIM], &st);
    print_message("restarted: %llu ok (%llu backwards served), banned %d\n",
                  (unsigned long long)in.ok, (unsigned long long)st.backwards, in.banned);
    assert_false(in.banned);
    assert_true(in.ok > ok_dead);
    assert_true(st.backwards > 0);
    print_message("micro-batches: %d done, %d failed\n", w.done, w.failed);
    assert_int_equal(w.failed, 0); /* every failed call was retried elsewhere */
    assert_true(w.done > 50);

    ap_swarm_trainer_free(w.tr);
    /* A server freed mid-compute is destroyed when the compute ends. */
    for (int i = 0; i < NNODE; i++) ap_swarm_server_free(w.srv[i]);
    ap_sim_run_for(w.sim, PERIOD);
    for (int i = 0; i < NNODE; i++) ap_dht_free(w.dht[i]);
    ap_sim_free(w.sim);
    for (int i = 0; i < NNODE; i++) ap_nn_model_free(w.m[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slow_store_keeps_record),
        cmocka_unit_test(test_record_ttl),
        cmocka_unit_test(test_estimate),
        cmocka_unit_test(test_expired_calls),
        cmocka_unit_test(test_ban_until_newer_record),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
