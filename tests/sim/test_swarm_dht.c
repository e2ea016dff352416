/* SWARM routed by the DHT on the simulator: stage servers announce
 * themselves on a timer, the trainer knows no server in advance and finds
 * them by reading the stage records; a server crashed mid-run is rerouted
 * around (no micro-batch lost), banned, and dropped once its record expires;
 * restarted, it announces again and gets work again. The servers' compute
 * takes virtual time (ap_rt_work), and each measures and announces its own
 * throughput. */
#include "aptest.h"

#include "apiary/dht.h"
#include "apiary/sim.h"
#include "apiary/swarm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NS       2
#define PER      2
#define NSRV     (NS * PER)
#define TRAINER  (NSRV + 1) /* node 0 is the bootstrap DHT node */
#define NNODE    (TRAINER + 1)
#define CW       16
#define BB       2
#define TT       8
#define RUN      "simrun"
#define PERIOD   1000000ull /* announce period; records live 3 of them */
#define WATCH_US 500000ull
#define VICTIM   3 /* a stage-1 server (nodes 1,2: stage 0; 3,4: stage 1) */

typedef struct world {
    ap_sim_t *sim;
    ap_dht_t *dht[NNODE];
    ap_nn_model_t *model[NNODE];
    ap_swarm_server_t *srv[NNODE];
    ap_swarm_trainer_t *tr;
    int booted, done, failed, inflight;
    float first, last;
} world_t;

static int stage_of(int node)
{
    return (node - 1) / PER;
}

static ap_nn_model_t *stage_model(int s)
{
    ap_nn_gpt_config_t c = ap_nn_gpt_config_default(TT, NS, 2, CW, BB);
    c.layer_begin = s;
    c.layer_end = s + 1;
    c.embed = s == 0;
    c.head = s == NS - 1;
    ap_nn_model_t *m;
    assert_ok(ap_nn_gpt_new(&c, &m));
    ap_nn_model_init(m, 11);
    return m;
}

/* Each backward's gradients are applied at once (plain SGD per server). */
static void on_bwd(ap_swarm_server_t *s, void *arg, uint64_t samples)
{
    (void)s;
    (void)samples;
    ap_nn_params_t *p = ap_nn_model_params(arg);
    for (size_t k = 0; k < p->count; k++) p->data[k] -= 0.1f * p->grad[k];
    ap_nn_model_zero_grad(arg);
}

static void on_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    (void)sim;
    (void)rt;
    world_t *w = arg;
    ap_swarm_server_free(w->srv[node]);
    w->srv[node] = NULL;
    ap_dht_free(w->dht[node]);
    w->dht[node] = NULL;
}

static void on_boot(ap_dht_t *dht, void *arg, int status)
{
    (void)dht;
    world_t *w = arg;
    if (status == 0) w->booted++;
}

static bool all_booted(void *arg)
{
    return ((world_t *)arg)->booted == NNODE - 1;
}

static void start_node(world_t *w, int i)
{
    ap_rt_t *rt = ap_sim_node(w->sim, i);
    assert_ok(ap_dht_new(rt, NULL, &w->dht[i]));
    if (i > 0) {
        const char *boot = "/sim/0";
        assert_ok(ap_dht_bootstrap(w->dht[i], &boot, 1, on_boot, w));
    }
    if (i >= 1 && i <= NSRV) {
        const int s = stage_of(i);
        if (!w->model[i]) w->model[i] = stage_model(s);
        assert_ok(ap_swarm_server_new(rt, w->model[i], (uint32_t)s, NULL, &w->srv[i]));
        ap_swarm_server_on_backward(w->srv[i], on_bwd, w->model[i]);
        assert_ok(ap_swarm_server_announce(w->srv[i], w->dht[i], RUN, PERIOD, 0));
    }
}

static void world_new(world_t *w)
{
    memset(w, 0, sizeof *w);
    w->sim = ap_sim_new(ap_test_seed(33));
    assert_non_null(w->sim);
    ap_sim_link_t link = {.latency_us = 5000, .jitter_us = 1000};
    ap_sim_set_default_link(w->sim, &link);
    for (int i = 0; i < NNODE; i++) {
        /* servers: ~20 ms per forward of a micro-batch */
        ap_sim_node_opts_t o = {.on_crash = on_crash, .hook_arg = w, .flops = 0};
        assert_int_equal(ap_sim_add_node(w->sim, &o), i);
    }
    for (int i = 0; i < NNODE; i++) start_node(w, i);
    for (int i = 1; i <= NSRV; i++) {
        const double cost = 2.0 * BB * TT * (double)ap_nn_model_params(w->model[i])->count;
        ap_sim_set_flops(w->sim, i, cost / 0.02 * (i % 2 ? 1.0 : 2.0));
    }
    assert_true(ap_sim_run_until(w->sim, all_booted, w, ap_sim_now_us(w->sim) + 30000000));
    assert_ok(ap_swarm_trainer_new(ap_sim_node(w->sim, TRAINER), NS, CW, NULL, 0, &w->tr));
    assert_ok(ap_swarm_trainer_watch(w->tr, w->dht[TRAINER], RUN, WATCH_US));
}

static void world_free(world_t *w)
{
    ap_swarm_trainer_free(w->tr);
    for (int i = 0; i < NNODE; i++) {
        ap_swarm_server_free(w->srv[i]);
        ap_dht_free(w->dht[i]);
    }
    ap_sim_free(w->sim);
    for (int i = 0; i < NNODE; i++) ap_nn_model_free(w->model[i]);
}

static void batch(int i, int32_t *tok, int32_t *tgt)
{
    for (int b = 0; b < BB; b++)
        for (int t = 0; t < TT; t++) {
            tok[b * TT + t] = 'a' + (b + t + i) % 4;
            tgt[b * TT + t] = 'a' + (b + t + i + 1) % 4;
        }
}

static void on_batch(ap_rt_t *rt, void *arg, int status, float loss)
{
    (void)rt;
    world_t *w = arg;
    w->inflight--;
    if (status) {
        w->failed++;
        return;
    }
    if (w->done == 0) w->first = loss;
    w->last = loss;
    w->done++;
}

static bool below(void *arg)
{
    world_t *w = arg;
    return w->inflight < 3;
}

/* Keeps 3 micro-batches in flight until `until` are done. */
static void train(world_t *w, int until)
{
    int32_t tok[BB * TT], tgt[BB * TT];
    while (w->done + w->failed + w->inflight < until) {
        batch(w->done + w->inflight, tok, tgt);
        assert_ok(ap_swarm_trainer_submit(w->tr, BB, TT, tok, tgt, on_batch, w));
        w->inflight++;
        assert_true(ap_sim_run_until(w->sim, below, w, ap_sim_now_us(w->sim) + 120000000));
    }
    while (w->inflight) assert_true(ap_sim_step(w->sim));
}

static size_t tracked(world_t *w, uint32_t s)
{
    return ap_swarm_balancer_count(ap_swarm_trainer_balancer(w->tr, s));
}

static uint64_t tasks_of(world_t *w, int node)
{
    ap_swarm_server_info_t info;
    ap_rt_t *rt = ap_sim_node(w->sim, TRAINER);
    if (ap_swarm_balancer_info(ap_swarm_trainer_balancer(w->tr, (uint32_t)stage_of(node)),
                               ap_sim_peer_id(w->sim, node), ap_rt_now_us(rt), &info))
        return 0;
    return info.ok;
}

static void test_dht_routing(void **state)
{
    (void)state;
    world_t w;
    world_new(&w);
    /* The trainer starts with nothing and finds all four servers. */
    assert_int_equal(tracked(&w, 0) + tracked(&w, 1), 0);
    train(&w, 20);
    assert_int_equal(w.failed, 0);
    assert_int_equal(tracked(&w, 0), PER);
    assert_int_equal(tracked(&w, 1), PER);
    for (int i = 1; i <= NSRV; i++) {
        ap_swarm_server_stats_t st;
        ap_swarm_server_stats(w.srv[i], &st);
        print_message("server %d (stage %d): %llu fwd, %llu bwd, throughput %.0f, %llu announces\n",
                      i, stage_of(i), (unsigned long long)st.forwards,
                      (unsigned long long)st.backwards, st.throughput,
                      (unsigned long long)st.announces);
        ap_swarm_server_info_t in;
        ap_rt_t *trt0 = ap_sim_node(w.sim, TRAINER);
        if (!ap_swarm_balancer_info(ap_swarm_trainer_balancer(w.tr, (uint32_t)stage_of(i)),
                                    ap_sim_peer_id(w.sim, i), ap_rt_now_us(trt0), &in))
            print_message("  trainer's view: %.1f units/s, %llu ok, %llu failed, %llu timed out\n",
                          in.throughput, (unsigned long long)in.ok, (unsigned long long)in.failed,
                          (unsigned long long)in.timed_out);
        assert_true(st.forwards + st.backwards > 0);
        assert_true(st.throughput > 0);
        assert_true(st.announces >= 2); /* refreshed on the timer */
    }
    /* The faster server of a stage (even node: twice the flops) gets more. */
    assert_true(tasks_of(&w, 2) > tasks_of(&w, 1));

    /* Crash a stage-1 server with micro-batches in flight. */
    const uint64_t before = tasks_of(&w, VICTIM);
    int32_t tok[BB * TT], tgt[BB * TT];
    for (int k = 0; k < 3; k++) {
        batch(k, tok, tgt);
        assert_ok(ap_swarm_trainer_submit(w.tr, BB, TT, tok, tgt, on_batch, &w));
        w.inflight++;
    }
    ap_sim_run_for(w.sim, 30000);
    assert_ok(ap_sim_crash(w.sim, VICTIM));
    train(&w, 60);
    assert_int_equal(w.failed, 0); /* rerouted: no micro-batch lost */
    ap_swarm_server_info_t info;
    ap_rt_t *trt = ap_sim_node(w.sim, TRAINER);
    int rc = ap_swarm_balancer_info(ap_swarm_trainer_balancer(w.tr, 1),
                                    ap_sim_peer_id(w.sim, VICTIM), ap_rt_now_us(trt), &info);
    if (rc == 0) {
        assert_true(info.failed + info.timed_out >= 1);
        assert_true(info.ok <= before + 3);
    }
    /* Its record expires (3 periods) and it is dropped. */
    ap_sim_run_for(w.sim, 4 * PERIOD);
    train(&w, 70);
    assert_int_equal(tracked(&w, 1), 1);
    assert_int_equal(w.failed, 0);
    print_message("loss %.4f -> %.4f over %d micro-batches\n", w.first, w.last, w.done);
    assert_true(w.last < 0.8f * w.first);

    /* Restarted, it announces again and gets work again. */
    assert_ok(ap_sim_restart(w.sim, VICTIM));
    start_node(&w, VICTIM);
    const double cost = 2.0 * BB * TT * (double)ap_nn_model_params(w.model[VICTIM])->count;
    ap_sim_set_flops(w.sim, VICTIM, cost / 0.02);
    ap_sim_run_for(w.sim, 2 * PERIOD);
    train(&w, 100);
    assert_int_equal(tracked(&w, 1), PER);
    ap_swarm_server_stats_t st;
    ap_swarm_server_stats(w.srv[VICTIM], &st);
    print_message("restarted server: %llu backwards\n", (unsigned long long)st.backwards);
    assert_true(st.backwards > 0);
    assert_int_equal(w.failed, 0);
    world_free(&w);
}

/* A one-shot read, as `apiary swarm server --stage auto` makes it: the
 * callback frees its watch (which used to free it twice). */
typedef struct once {
    ap_swarm_watch_t *w;
    int calls, members;
} once_t;

static void on_once(ap_rt_t *rt, void *arg, int status, const ap_dht_result_t *res, uint32_t n)
{
    once_t *o = arg;
    o->calls++;
    if (!status) {
        ap_swarm_member_t m[16];
        int64_t exp[16];
        o->members = ap_swarm_members_from(res, n, ap_rt_wall_ms(rt), m, exp, 16);
    }
    ap_swarm_watch_free(o->w);
}

static bool once_done(void *arg)
{
    return ((once_t *)arg)->calls > 0;
}

static void test_watch_free_in_callback(void **state)
{
    (void)state;
    world_t w;
    world_new(&w);
    ap_sim_run_for(w.sim, 2 * PERIOD); /* every server has announced */
    once_t o = {0};
    assert_ok(ap_swarm_watch_new(ap_sim_node(w.sim, TRAINER), w.dht[TRAINER], RUN, NS, WATCH_US,
                                 on_once, &o, &o.w));
    assert_true(ap_sim_run_until(w.sim, once_done, &o, ap_sim_now_us(w.sim) + 10000000));
    ap_sim_run_for(w.sim, 4 * WATCH_US); /* no second call after the free */
    assert_int_equal(o.calls, 1);
    assert_int_equal(o.members, NSRV);
    world_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_dht_routing),
                                       cmocka_unit_test(test_watch_free_in_callback)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
