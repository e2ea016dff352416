/* MPRNG over the runtime: 8 nodes agree on one seed; a node that withholds
 * its reveal is excluded by every honest node, which still agree (attempt
 * 1); a node that starts late gets the messages sent before it started. */
#include "btard_mprng_suite.h"

#include "aptest.h"

#include "apiary/btard.h"

#include <stdio.h>
#include <string.h>

#define N 8

static const ap_testbed_ops_t *T;

typedef struct node_res {
    bool done;
    int status;
    uint8_t seed[AP_BTARD_HASH_LEN];
    ap_btard_fault_t faults[N];
} node_res_t;

typedef struct world {
    ap_testbed_t *tb;
    ap_btard_svc_t *svc[N];
    ap_peer_id_t peers[N];
    node_res_t res[N];
    bool honest[N];
} world_t;

static void on_done(void *arg, int status, const uint8_t seed[AP_BTARD_HASH_LEN],
                    const ap_btard_mprng_t *m)
{
    node_res_t *r = arg;
    r->done = true;
    r->status = status;
    if (seed) memcpy(r->seed, seed, AP_BTARD_HASH_LEN);
    for (size_t i = 0; i < N; i++) r->faults[i] = ap_btard_mprng_fault(m, i);
}

static bool honest_done(void *arg)
{
    world_t *w = arg;
    for (int i = 0; i < N; i++)
        if (w->honest[i] && !w->res[i].done) return false;
    return true;
}

static void world_up(world_t *w, uint64_t seed)
{
    memset(w, 0, sizeof *w);
    w->tb = T->create(N, seed);
    assert_non_null(w->tb);
    for (int i = 0; i < N; i++) {
        ap_rt_t *rt = T->node(w->tb, i);
        w->peers[i] = *ap_rt_self(rt);
        assert_ok(ap_btard_svc_new(rt, &w->svc[i]));
        w->honest[i] = true;
    }
    assert_int_equal(ap_btard_svc_new(T->node(w->tb, 0), &(ap_btard_svc_t *){NULL}), AP_EEXIST);
}

static void world_down(world_t *w)
{
    for (int i = 0; i < N; i++) ap_btard_svc_free(w->svc[i]);
    T->destroy(w->tb);
}

static void start(world_t *w, int i, ap_btard_mprng_attack_t atk)
{
    ap_btard_round_cfg_t c = {.peers = w->peers, .n = N, .attack = atk, .done = on_done};
    memset(c.ctx, 0x5a, sizeof c.ctx);
    c.phase_timeout_us = 2000000;
    c.arg = &w->res[i];
    assert_ok(ap_btard_round_start(w->svc[i], &c));
    assert_int_equal(ap_btard_round_start(w->svc[i], &c), AP_EEXIST);
}

static void expect(world_t *w, int culprit, ap_btard_fault_t f)
{
    int first = -1;
    for (int i = 0; i < N; i++) {
        if (!w->honest[i]) continue;
        node_res_t *r = &w->res[i];
        assert_true(r->done);
        assert_ok(r->status);
        if (first < 0) first = i;
        assert_memory_equal(r->seed, w->res[first].seed, AP_BTARD_HASH_LEN);
        for (int j = 0; j < N; j++)
            if (r->faults[j] != (j == culprit ? f : AP_BTARD_FAULT_NONE))
                fail_msg("node %d sees node %d as %s", i, j, ap_btard_fault_name(r->faults[j]));
    }
}

static void test_agree(void **st)
{
    (void)st;
    world_t w;
    world_up(&w, 11);
    for (int i = 0; i < N; i++) start(&w, i, AP_BTARD_MPRNG_HONEST);
    assert_true(T->run_until(w.tb, honest_done, &w, 60000000));
    expect(&w, -1, AP_BTARD_FAULT_NONE);
    world_down(&w);
}

static void test_withheld_reveal(void **st)
{
    (void)st;
    world_t w;
    world_up(&w, 12);
    w.honest[3] = false;
    for (int i = 0; i < N; i++)
        start(&w, i, i == 3 ? AP_BTARD_MPRNG_WITHHOLD_REVEAL : AP_BTARD_MPRNG_HONEST);
    assert_true(T->run_until(w.tb, honest_done, &w, 60000000));
    expect(&w, 3, AP_BTARD_FAULT_NO_REVEAL);
    world_down(&w);
}

static void test_late_starter(void **st)
{
    (void)st;
    world_t w;
    world_up(&w, 13);
    for (int i = 0; i < N - 1; i++) start(&w, i, AP_BTARD_MPRNG_HONEST);
    ap_tb_run_for(T, w.tb, 200000); /* the others' commitments reach node 7 first */
    assert_false(w.res[0].done);
    start(&w, N - 1, AP_BTARD_MPRNG_HONEST);
    assert_true(T->run_until(w.tb, honest_done, &w, 60000000));
    expect(&w, -1, AP_BTARD_FAULT_NONE);
    world_down(&w);
}

int ap_btard_mprng_suite_run(const ap_testbed_ops_t *ops)
{
    T = ops;
    printf("driver: %s\n", ops->name);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_agree),
        cmocka_unit_test(test_withheld_reveal),
        cmocka_unit_test(test_late_starter),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
