/* SWARM on the simulator: 2 stages x 2 servers and one trainer. Every
 * micro-batch completes while a server crashes mid-run (the trainer bans it
 * after its failed call and retries on the other server of that stage); the
 * loss falls; a server answering garbage is banned; the result with one
 * server per stage equals the same pipeline run in one process. */
#include "aptest.h"

#include "apiary/sim.h"
#include "apiary/swarm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NS   2
#define PER  2
#define CW   16
#define BB   2
#define TT   8
#define NODE (NS * PER) /* the trainer's index */

typedef struct world {
    ap_sim_t *sim;
    ap_nn_model_t *model[NS * PER];
    ap_swarm_server_t *srv[NS * PER];
    ap_swarm_trainer_t *tr;
    int done, failed, target;
    float loss[256];
} world_t;

static ap_nn_model_t *stage_model(int s)
{
    ap_nn_gpt_config_t c = ap_nn_gpt_config_default(TT, 2, 2, CW, BB);
    c.layer_begin = s;
    c.layer_end = s + 1;
    c.embed = s == 0;
    c.head = s == NS - 1;
    ap_nn_model_t *m;
    assert_ok(ap_nn_gpt_new(&c, &m));
    ap_nn_model_init(m, 11);
    return m;
}

static void on_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    (void)sim;
    (void)rt;
    world_t *w = arg;
    ap_swarm_server_free(w->srv[node]);
    w->srv[node] = NULL;
}

static void world_new(world_t *w, int servers_per_stage, const ap_codec_cfg_t *codec)
{
    memset(w, 0, sizeof *w);
    w->sim = ap_sim_new(ap_test_seed(21));
    assert_non_null(w->sim);
    ap_sim_node_opts_t o = {.on_crash = on_crash, .hook_arg = w};
    for (int i = 0; i <= NODE; i++) assert_int_equal(ap_sim_add_node(w->sim, &o), i);
    for (int s = 0; s < NS; s++)
        for (int k = 0; k < servers_per_stage; k++) {
            int i = s * PER + k;
            w->model[i] = stage_model(s);
            assert_ok(ap_swarm_server_new(ap_sim_node(w->sim, i), w->model[i], (uint32_t)s, codec,
                                          &w->srv[i]));
        }
    ap_rt_t *rt = ap_sim_node(w->sim, NODE);
    assert_ok(ap_swarm_trainer_new(rt, NS, CW, codec, 0, &w->tr));
    for (int s = 0; s < NS; s++)
        for (int k = 0; k < servers_per_stage; k++)
            assert_ok(ap_swarm_balancer_update(ap_swarm_trainer_balancer(w->tr, (uint32_t)s),
                                               ap_sim_peer_id(w->sim, s * PER + k), 0,
                                               ap_rt_now_us(rt) + 3600000000ull, ap_rt_now_us(rt)));
}

static void world_free(world_t *w)
{
    ap_swarm_trainer_free(w->tr);
    for (int i = 0; i < NS * PER; i++) {
        ap_swarm_server_free(w->srv[i]);
        ap_nn_model_free(w->model[i]);
    }
    ap_sim_free(w->sim);
}

static void on_batch(ap_rt_t *rt, void *arg, int status, float loss)
{
    (void)rt;
    world_t *w = arg;
    if (status) {
        w->failed++;
        return;
    }
    w->loss[w->done++ % 256] = loss;
}

static bool all_done(void *arg)
{
    world_t *w = arg;
    return w->done + w->failed >= w->target;
}

static void batch(int i, int32_t *tok, int32_t *tgt)
{
    for (int b = 0; b < BB; b++)
        for (int t = 0; t < TT; t++) {
            tok[b * TT + t] = 'a' + (b + t + i) % 4;
            tgt[b * TT + t] = 'a' + (b + t + i + 1) % 4;
        }
}

/* SGD on every live server's accumulated gradients (each server applies its
 * own; the stage's collaboration would average them). */
static void sgd_all(world_t *w)
{
    for (int i = 0; i < NS * PER; i++) {
        if (!w->model[i] || !w->srv[i]) continue;
        ap_nn_params_t *p = ap_nn_model_params(w->model[i]);
        for (size_t k = 0; k < p->count; k++) p->data[k] -= 0.2f * p->grad[k];
        ap_nn_model_zero_grad(w->model[i]);
    }
}

/* One micro-batch at a time for 40 steps; server 1 (stage 0) crashes at step
 * 10. No micro-batch is lost; after the crash stage 0 is served by server 0
 * alone; the loss falls. */
static void test_crash_midrun(void **state)
{
    (void)state;
    world_t w;
    world_new(&w, PER, NULL);
    int32_t tok[BB * TT], tgt[BB * TT];
    float first = 0, last = 0;
    ap_swarm_server_stats_t before;
    for (int step = 0; step < 40; step++) {
        if (step == 10) {
            ap_swarm_server_stats(w.srv[1], &before);
            assert_true(before.forwards + before.backwards > 0);
            assert_ok(ap_sim_crash(w.sim, 1));
        }
        batch(step % 3, tok, tgt);
        w.target = w.done + w.failed + 1;
        assert_ok(ap_swarm_trainer_submit(w.tr, BB, TT, tok, tgt, on_batch, &w));
        assert_true(ap_sim_run_until(w.sim, all_done, &w, ap_sim_now_us(w.sim) + 60000000));
        assert_int_equal(w.failed, 0);
        float l = w.loss[(w.done - 1) % 256];
        if (step == 0) first = l;
        last = l;
        sgd_all(&w);
    }
    print_message("loss %.4f -> %.4f over 40 micro-batches, server crashed at 10\n", first, last);
    assert_int_equal(w.done, 40);
    assert_true(last < 0.8f * first);
    ap_swarm_server_info_t info;
    ap_rt_t *rt = ap_sim_node(w.sim, NODE);
    assert_ok(ap_swarm_balancer_info(ap_swarm_trainer_balancer(w.tr, 0), ap_sim_peer_id(w.sim, 1),
                                     ap_rt_now_us(rt), &info));
    assert_true(info.banned);
    assert_int_equal(info.failed, 1);
    world_free(&w);
}

/* A peer that answers the stage protocol with garbage is banned and the
 * micro-batch completes on the honest server. */
static void garbage(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    static const uint8_t junk[24] = {0x54, 1, 1, 2, 0, 0, 0, 2, 0, 0, 0, 8, 0, 0, 0, 16};
    ap_rpc_respond(req, junk, sizeof junk);
}

static void test_garbage_banned(void **state)
{
    (void)state;
    world_t w;
    world_new(&w, 1, NULL);
    /* Node 1 (no server) answers stage calls with garbage. */
    assert_ok(ap_rt_rpc_register(ap_sim_node(w.sim, 1), AP_SWARM_PROTO_STAGE, 0, garbage, NULL));
    ap_rt_t *rt = ap_sim_node(w.sim, NODE);
    assert_ok(ap_swarm_balancer_update(ap_swarm_trainer_balancer(w.tr, 0), ap_sim_peer_id(w.sim, 1),
                                       1000, ap_rt_now_us(rt) + 3600000000ull, ap_rt_now_us(rt)));
    int32_t tok[BB * TT], tgt[BB * TT];
    for (int step = 0; step < 4; step++) {
        batch(step, tok, tgt);
        w.target = w.done + w.failed + 1;
        assert_ok(ap_swarm_trainer_submit(w.tr, BB, TT, tok, tgt, on_batch, &w));
        assert_true(ap_sim_run_until(w.sim, all_done, &w, ap_sim_now_us(w.sim) + 60000000));
        assert_int_equal(w.failed, 0);
    }
    ap_swarm_server_info_t info;
    assert_ok(ap_swarm_balancer_info(ap_swarm_trainer_balancer(w.tr, 0), ap_sim_peer_id(w.sim, 1),
                                     ap_rt_now_us(rt), &info));
    assert_true(info.banned);
    assert_int_equal(info.failed, 1);
    assert_true(ap_swarm_trainer_bytes(w.tr) > 0);
    world_free(&w);
}

/* Over the simulator with uncompressed calls, one server per stage gives
 * the same loss and gradients as the stage models called in one process. */
static void test_equals_in_process(void **state)
{
    (void)state;
    world_t w;
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    world_new(&w, 1, &none);
    ap_nn_gpt_config_t wc = ap_nn_gpt_config_default(TT, 2, 2, CW, BB);
    ap_nn_model_t *whole;
    assert_ok(ap_nn_gpt_new(&wc, &whole));
    for (int s = 0; s < NS; s++) {
        ap_nn_params_t *a = ap_nn_model_params(w.model[s * PER]), *b = ap_nn_model_params(whole);
        for (size_t i = 0; i < a->nviews; i++) {
            const ap_nn_view_t *v = ap_nn_params_find(b, a->views[i].name);
            assert_non_null(v);
            memcpy(b->data + v->offset, a->data + a->views[i].offset, v->count * sizeof(float));
        }
    }
    int32_t tok[BB * TT], tgt[BB * TT];
    batch(0, tok, tgt);
    w.target = 1;
    assert_ok(ap_swarm_trainer_submit(w.tr, BB, TT, tok, tgt, on_batch, &w));
    assert_true(ap_sim_run_until(w.sim, all_done, &w, ap_sim_now_us(w.sim) + 60000000));
    assert_int_equal(w.done, 1);
    float lw;
    ap_nn_model_zero_grad(whole);
    assert_ok(ap_nn_gpt_loss(whole, tok, tgt, BB, TT, &lw));
    assert_ok(ap_nn_gpt_backward(whole, NULL, NULL));
    print_message("whole %.6f over the simulator %.6f\n", lw, w.loss[0]);
    assert_true(fabsf(lw - w.loss[0]) <= 1e-5f * lw);
    for (int s = 0; s < NS; s++) {
        ap_nn_params_t *a = ap_nn_model_params(w.model[s * PER]), *b = ap_nn_model_params(whole);
        for (size_t i = 0; i < a->nviews; i++) {
            const ap_nn_view_t *v = ap_nn_params_find(b, a->views[i].name);
            for (size_t k = 0; k < v->count; k++) {
                float x = a->grad[a->views[i].offset + k], y = b->grad[v->offset + k];
                assert_true(fabsf(x - y) <= 1e-4f * (fabsf(y) + 1e-3f));
            }
        }
    }
    ap_nn_model_free(whole);
    world_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crash_midrun),
        cmocka_unit_test(test_garbage_banned),
        cmocka_unit_test(test_equals_in_process),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
