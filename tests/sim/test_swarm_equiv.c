/* Several servers per stage with gradient averaging equal one process at
 * the global batch. Two stages, each served by two servers that train the
 * stage together through the collaborative optimizer (one collaboration per
 * stage, target batch = 2 micro-batches, one micro-batch per server per
 * epoch: the optimizer's exact mode, Adam, float32 averaging); two trainers
 * each drive one micro-batch per epoch through their own server of each
 * stage. After N epochs every server's parameters equal the whole model's
 * trained in one process on both micro-batches at once (the mean gradient
 * of the global batch, the same Adam), within float rounding: the
 * all-reduce adds the two means in another order. */
#include "aptest.h"

#include "apiary/avg.h"
#include "apiary/collab.h"
#include "apiary/dht.h"
#include "apiary/sim.h"
#include "apiary/swarm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NS     2
#define PER    2
#define NSRV   (NS * PER)
#define NTRN   PER
#define NNODE  (1 + NSRV + NTRN)
#define CW     16
#define BB     2
#define TT     8
#define NL     2
#define EPOCHS 6
#define LR     1e-2f

typedef struct srv {
    ap_dht_t *dht;
    ap_avg_service_t *svc;
    ap_nn_model_t *m;
    ap_swarm_server_t *s;
    ap_collab_t *c;
    int submits, steps_done;
} srv_t;

typedef struct world {
    ap_sim_t *sim;
    ap_dht_t *boot, *tdht[NTRN];
    srv_t srv[NSRV];
    ap_swarm_trainer_t *tr[NTRN];
    int booted, done, failed;
    float loss[EPOCHS][NTRN];
} world_t;

static world_t W;

static ap_nn_gpt_config_t whole_cfg(void)
{
    return ap_nn_gpt_config_default(TT, NL, 2, CW, 2 * BB);
}

static void copy_params(ap_nn_model_t *from, ap_nn_model_t *to)
{
    ap_nn_params_t *a = ap_nn_model_params(from), *b = ap_nn_model_params(to);
    for (size_t i = 0; i < b->nviews; i++) {
        const ap_nn_view_t *v = &b->views[i];
        const ap_nn_view_t *w = ap_nn_params_find(a, v->name);
        assert_non_null(w);
        assert_int_equal(w->count, v->count);
        memcpy(b->data + v->offset, a->data + w->offset, v->count * sizeof(float));
    }
}

static double max_diff(ap_nn_model_t *whole, ap_nn_model_t *st)
{
    ap_nn_params_t *a = ap_nn_model_params(whole), *b = ap_nn_model_params(st);
    double worst = 0;
    for (size_t i = 0; i < b->nviews; i++) {
        const ap_nn_view_t *v = &b->views[i];
        const ap_nn_view_t *w = ap_nn_params_find(a, v->name);
        for (size_t k = 0; k < v->count; k++)
            worst = fmax(worst, fabs((double)a->data[w->offset + k] - b->data[v->offset + k]));
    }
    return worst;
}

static void batch(int epoch, int lane, int32_t *tok, int32_t *tgt)
{
    uint64_t x = (uint64_t)(epoch * NTRN + lane) * 0x9e3779b97f4a7c15ull + 1;
    int32_t w[BB * (TT + 1)];
    for (int i = 0; i < BB * (TT + 1); i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        w[i] = (int32_t)(x % 8) + 'a';
    }
    for (int b = 0; b < BB; b++)
        for (int t = 0; t < TT; t++) {
            tok[b * TT + t] = w[b * (TT + 1) + t];
            tgt[b * TT + t] = w[b * (TT + 1) + t + 1];
        }
}

static void on_submitted(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    srv_t *v = arg;
    if (status == AP_ECANCELED) return;
    assert_int_equal(status, 0);
    v->steps_done++;
    ap_swarm_server_pause(v->s, false);
}

/* Each backward's gradient (the mean over its micro-batch) goes to the
 * stage's collaboration; the server holds its queue until the epoch's step. */
static void on_bwd(ap_swarm_server_t *s, void *arg, uint64_t samples)
{
    srv_t *v = arg;
    ap_nn_params_t *p = ap_nn_model_params(v->m);
    ap_swarm_server_pause(s, true);
    v->submits++;
    assert_ok(ap_collab_submit(v->c, p->grad, (uint32_t)samples, 0, on_submitted, v));
    ap_nn_model_zero_grad(v->m);
}

static void on_boot(ap_dht_t *dht, void *arg, int status)
{
    (void)dht;
    (void)arg;
    if (status == 0) W.booted++;
}

static bool all_booted(void *arg)
{
    (void)arg;
    return W.booted == NSRV + NTRN;
}

static void on_started(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    (void)arg;
    assert_int_equal(status, 0);
}

static void on_batch(ap_rt_t *rt, void *arg, int status, float loss)
{
    (void)rt;
    float *slot = arg;
    if (status) {
        W.failed++;
        return;
    }
    *slot = loss;
    W.done++;
}

typedef struct epoch_pred {
    int want_done, want_steps;
} epoch_pred_t;

static bool epoch_over(void *arg)
{
    epoch_pred_t *q = arg;
    if (W.done + W.failed < q->want_done) return false;
    for (int i = 0; i < NSRV; i++)
        if (W.srv[i].steps_done < q->want_steps) return false;
    return true;
}

static void test_stage_averaging_equals_global_batch(void **state)
{
    (void)state;
    memset(&W, 0, sizeof W);
    W.sim = ap_sim_new(ap_test_seed(5));
    assert_non_null(W.sim);
    ap_sim_link_t link = {.latency_us = 3000, .jitter_us = 500};
    ap_sim_set_default_link(W.sim, &link);
    for (int i = 0; i < NNODE; i++) {
        ap_sim_node_opts_t o = {0};
        assert_int_equal(ap_sim_add_node(W.sim, &o), i);
    }
    assert_ok(ap_dht_new(ap_sim_node(W.sim, 0), NULL, &W.boot));
    const char *boot = "/sim/0";
    ap_nn_gpt_config_t wc = whole_cfg();
    ap_nn_model_t *whole;
    assert_ok(ap_nn_gpt_new(&wc, &whole));
    ap_nn_model_init(whole, 21);
    const ap_codec_cfg_t raw = {.id = AP_CODEC_NONE};
    for (int i = 0; i < NSRV; i++) {
        srv_t *v = &W.srv[i];
        ap_rt_t *rt = ap_sim_node(W.sim, 1 + i);
        const int s = i / PER;
        ap_nn_gpt_config_t c = whole_cfg();
        c.max_batch = BB;
        c.layer_begin = s;
        c.layer_end = s + 1;
        c.embed = s == 0;
        c.head = s == NS - 1;
        assert_ok(ap_nn_gpt_new(&c, &v->m));
        copy_params(whole, v->m);
        assert_ok(ap_dht_new(rt, NULL, &v->dht));
        assert_ok(ap_dht_bootstrap(v->dht, &boot, 1, on_boot, NULL));
        assert_ok(ap_avg_service_new(rt, &v->svc));
        assert_ok(ap_swarm_server_new(rt, v->m, (uint32_t)s, &raw, &v->s));
        ap_swarm_server_on_backward(v->s, on_bwd, v);
    }
    for (int k = 0; k < NTRN; k++) {
        ap_rt_t *rt = ap_sim_node(W.sim, 1 + NSRV + k);
        assert_ok(ap_dht_new(rt, NULL, &W.tdht[k]));
        assert_ok(ap_dht_bootstrap(W.tdht[k], &boot, 1, on_boot, NULL));
        assert_ok(ap_swarm_trainer_new(rt, NS, CW, &raw, 0, &W.tr[k]));
        /* lane k: server k of every stage */
        for (int s = 0; s < NS; s++)
            assert_ok(ap_swarm_balancer_update(ap_swarm_trainer_balancer(W.tr[k], (uint32_t)s),
                                               ap_sim_peer_id(W.sim, 1 + s * PER + k), 1.0,
                                               UINT64_MAX / 2, ap_rt_now_us(rt)));
    }
    assert_true(ap_sim_run_until(W.sim, all_booted, NULL, ap_sim_now_us(W.sim) + 30000000));

    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.target_batch_size = PER * BB;
    cfg.max_local_samples = BB; /* exact: one micro-batch per server per epoch */
    cfg.solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg.lr.base = cfg.lr.min = LR;
    cfg.average_state_every = 0;
    cfg.averaging_timeout_us = 5000000;
    cfg.codec = AP_AVG_CODEC_F32;
    char runs[NS][32];
    for (int i = 0; i < NSRV; i++) {
        srv_t *v = &W.srv[i];
        snprintf(runs[i / PER], sizeof runs[0], "equiv_stage%d", i / PER);
        cfg.run_id = runs[i / PER];
        ap_nn_params_t *p = ap_nn_model_params(v->m);
        assert_ok(ap_collab_new(ap_sim_node(W.sim, 1 + i), v->dht, v->svc, &cfg, p->data, p->count,
                                p->views, p->nviews, &v->c));
        assert_ok(ap_collab_start(v->c, on_started, v));
    }
    ap_sim_run_for(W.sim, 2000000);

    int32_t tok[BB * TT], tgt[BB * TT];
    for (int e = 0; e < EPOCHS; e++) {
        for (int k = 0; k < NTRN; k++) {
            batch(e, k, tok, tgt);
            assert_ok(ap_swarm_trainer_submit(W.tr[k], BB, TT, tok, tgt, on_batch, &W.loss[e][k]));
        }
        epoch_pred_t q = {.want_done = (e + 1) * NTRN, .want_steps = e + 1};
        assert_true(ap_sim_run_until(W.sim, epoch_over, &q, ap_sim_now_us(W.sim) + 60000000));
        assert_int_equal(W.failed, 0);
    }
    for (int i = 0; i < NSRV; i++) {
        assert_int_equal(W.srv[i].submits, EPOCHS); /* one micro-batch per server per epoch */
        assert_int_equal(ap_collab_epoch(W.srv[i].c), EPOCHS);
        ap_collab_stats_t st;
        ap_collab_get_stats(W.srv[i].c, &st);
        assert_int_equal(st.last_epoch_samples, PER * BB);
        assert_int_equal(st.last_group_size, PER);
    }

    /* one process, the global batch of both micro-batches */
    ap_nn_params_t *wp = ap_nn_model_params(whole);
    ap_nn_solver_t *o = NULL;
    assert_ok(ap_nn_solver_new(&cfg.solver, wp->count, wp->views, wp->nviews, &o));
    float first = 0, last = 0;
    for (int e = 0; e < EPOCHS; e++) {
        int32_t gt[2 * BB * TT], gg[2 * BB * TT];
        for (int k = 0; k < NTRN; k++) batch(e, k, gt + k * BB * TT, gg + k * BB * TT);
        ap_nn_model_zero_grad(whole);
        float l;
        assert_ok(ap_nn_gpt_loss(whole, gt, gg, 2 * BB, TT, &l));
        assert_ok(ap_nn_gpt_backward(whole, NULL, NULL));
        assert_ok(ap_nn_solver_step(o, wp->data, wp->grad, ap_nn_lr_at(&cfg.lr, (uint64_t)e)));
        const float swarm_loss = 0.5f * (W.loss[e][0] + W.loss[e][1]);
        print_message("epoch %d: global-batch loss %.6f, SWARM (mean of the two micro-batches) "
                      "%.6f\n",
                      e, l, swarm_loss);
        assert_true(fabsf(l - swarm_loss) <= 1e-4f * fabsf(l) + 1e-5f);
        if (e == 0) first = l;
        last = l;
    }
    assert_true(last < first);
    for (int i = 0; i < NSRV; i++) {
        const double d = max_diff(whole, W.srv[i].m);
        print_message("server %d (stage %d): max |param - reference| %.2e\n", i, i / PER, d);
        assert_true(d < 1e-4);
    }
    ap_nn_solver_free(o);
    for (int k = 0; k < NTRN; k++) ap_swarm_trainer_free(W.tr[k]);
    for (int i = 0; i < NSRV; i++) {
        ap_collab_free(W.srv[i].c);
        ap_swarm_server_free(W.srv[i].s);
        ap_avg_service_free(W.srv[i].svc);
    }
    for (int i = 0; i < NSRV; i++) ap_dht_free(W.srv[i].dht);
    for (int k = 0; k < NTRN; k++) ap_dht_free(W.tdht[k]);
    ap_dht_free(W.boot);
    ap_sim_free(W.sim);
    for (int i = 0; i < NSRV; i++) ap_nn_model_free(W.srv[i].m);
    ap_nn_model_free(whole);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_stage_averaging_equals_global_batch)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
