/* Training steps checked by the verified step: 6 nodes minimise a quadratic
 * loss 0.5 |p - y|^2 over public examples; every step is a ButterflyClip
 * all-reduce of the members' gradients (each on a minibatch drawn from a
 * seed of the run and the step), then the verified step with every member a
 * validator. One node sends its gradient times -1000: every honest node
 * bans it. Another withholds its MPRNG reveal: it is excluded from that
 * step (an absence proves nothing, so nobody bans it) and sits out the next
 * SIT_OUT steps. No honest node bans anyone honest, and the honest nodes
 * keep training. */
#include "btard_verified_suite.h"

#include "aptest.h"

#include "apiary/allreduce.h"
#include "apiary/btard.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N         6
#define D         2000
#define NEX       32
#define BATCH     4
#define MAX_STEPS 14
#define POISONER  1
#define WITHHOLD  4
#define SIT_OUT   2 /* steps a node excluded for a missed deadline sits out */

static const ap_testbed_ops_t *T;
static const uint8_t RUN[32] = {0x42, 1};

typedef struct node {
    ap_avg_service_t *avg;
    ap_btard_svc_t *mprng;
    ap_btard_step_svc_t *step;
    ap_btard_vclip_t vc;
    float p[D];    /* parameters */
    float sent[D]; /* what it sent this step */
    float data[D]; /* the round's vector, in place */
    bool ar_done, v_done, apply;
    int ar_status;
    bool banned[N];   /* its own ban list */
    bool excluded[N]; /* excluded from this step for a missed deadline */
} node_t;

typedef struct world {
    ap_testbed_t *tb;
    node_t nd[N];
    ap_peer_id_t ids[N];
    float Y[NEX][D];
    /* the current step's group (node indices) */
    int grp[N];
    size_t ng;
    uint64_t step;
    int sit_out[N]; /* steps node i still sits out */
    /* an aggregator that sends the second half of each group its aggregate
     * + 0.5 per element and signs a matching commitment to each half
     * (AP_BTARD_STEP_EQUIVOCATE; -1: none) */
    int equiv;
} world_t;

static world_t W;

static bool honest(int i)
{
    return i != POISONER && i != WITHHOLD && i != W.equiv;
}

/* The gradient of node `who` at parameters p for the current step. */
static void gradient(const float *p, int who, float *out)
{
    uint8_t seed[32];
    uint64_t idx[BATCH];
    ap_btard_round_ctx(RUN, W.step, 2, seed);
    ap_btard_minibatch(seed, (uint32_t)who, NEX, BATCH, idx);
    for (size_t k = 0; k < D; k++) {
        double acc = 0;
        for (int b = 0; b < BATCH; b++) acc += W.Y[idx[b]][k];
        out[k] = (float)(p[k] - acc / BATCH);
    }
}

/* The verified step's recomputation: member m of the group, at this node's
 * parameters (the public state every honest member holds). */
static int grad_cb(void *arg, uint32_t m, float *out)
{
    node_t *self = arg;
    if (m >= W.ng) return AP_EINVAL;
    gradient(self->p, W.grp[m], out);
    return 0;
}

static double loss(const float *p)
{
    double l = 0;
    for (int x = 0; x < NEX; x++)
        for (size_t k = 0; k < D; k++) {
            double d = p[k] - W.Y[x][k];
            l += 0.5 * d * d;
        }
    return l / NEX;
}

static void ar_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    node_t *d = arg;
    d->ar_done = true;
    d->ar_status = res->status;
}

static void on_verdict(void *arg, const ap_btard_verdict_t *v)
{
    node_t *d = arg;
    d->v_done = true;
    d->apply = v->apply;
    memset(d->excluded, 0, sizeof d->excluded);
    for (size_t i = 0; i < v->nexcluded; i++)
        for (int j = 0; j < N; j++)
            if (ap_peer_id_eq(&v->excluded[i], &W.ids[j])) d->excluded[j] = true;
    for (size_t i = 0; i < v->nconvicted; i++)
        for (int j = 0; j < N; j++)
            if (ap_peer_id_eq(&v->bans[i].peer, &W.ids[j])) d->banned[j] = true;
}

static bool all_ar(void *arg)
{
    (void)arg;
    for (size_t g = 0; g < W.ng; g++)
        if (!W.nd[W.grp[g]].ar_done) return false;
    return true;
}

static bool honest_verdicts(void *arg)
{
    (void)arg;
    for (size_t g = 0; g < W.ng; g++)
        if (honest(W.grp[g]) && !W.nd[W.grp[g]].v_done) return false;
    return true;
}

static bool in_group(int i)
{
    for (size_t g = 0; g < W.ng; g++)
        if (W.grp[g] == i) return true;
    return false;
}

/* One step among the nodes that honest node 0 has not banned and that do
 * not sit out. Returns whether the honest nodes applied it. */
static bool one_step(void)
{
    W.ng = 0;
    for (int i = 0; i < N; i++)
        if (!W.nd[0].banned[i] && !W.sit_out[i])
            W.grp[W.ng++] = i;
        else if (W.sit_out[i])
            W.sit_out[i]--;
    ap_avg_member_t mem[N];
    ap_peer_id_t ids[N];
    for (size_t g = 0; g < W.ng; g++) {
        mem[g] = (ap_avg_member_t){W.ids[W.grp[g]], AP_AVG_NORMAL, 12.5e6, 12.5e6};
        ids[g] = W.ids[W.grp[g]];
    }
    ap_avg_group_t grp = {.members = mem, .n = W.ng};
    memset(grp.id, 0x77, sizeof grp.id);
    memcpy(grp.id, &W.step, sizeof W.step);
    for (size_t g = 0; g < W.ng; g++) {
        node_t *d = &W.nd[W.grp[g]];
        gradient(d->p, W.grp[g], d->sent);
        if (W.grp[g] == POISONER)
            for (size_t k = 0; k < D; k++) d->sent[k] *= -1000;
        memcpy(d->data, d->sent, sizeof d->data);
        d->ar_done = d->v_done = d->apply = false;
        ap_btard_vclip_reset(&d->vc);
        ap_allreduce_opts_t o = {
            .chunk_elems = 250, .reduce = ap_btard_verified_clip, .reduce_arg = &d->vc};
        assert_ok(ap_allreduce_start(d->avg, &grp, d->data, D, 1.0, &o, ar_done, d, NULL));
    }
    assert_true(T->run_until(W.tb, all_ar, NULL, 120000000));
    uint64_t counts[N];
    assert_ok(ap_btard_split(mem, W.ng, D, counts));
    for (size_t g = 0, off = 0; g < W.ng; off += counts[g], g++) {
        if (W.grp[g] != W.equiv) continue;
        /* what the second half of the group received of its part */
        for (size_t h = W.ng / 2; h < W.ng; h++)
            for (size_t k = 0; h != g && k < counts[g]; k++) W.nd[W.grp[h]].data[off + k] += 0.5f;
    }
    for (size_t g = 0; g < W.ng; g++) {
        node_t *d = &W.nd[W.grp[g]];
        assert_int_equal(d->ar_status, 0);
        ap_btard_step_cfg_t c = {.step = W.step,
                                 .peers = ids,
                                 .n = W.ng,
                                 .counts = counts,
                                 .sent = d->sent,
                                 .result = d->data,
                                 .weight = 1.0,
                                 .vclip = &d->vc,
                                 .tau = 40,
                                 .phase_timeout_us = 2000000,
                                 .attack = W.grp[g] == WITHHOLD  ? AP_BTARD_STEP_WITHHOLD_REVEAL
                                           : W.grp[g] == W.equiv ? AP_BTARD_STEP_EQUIVOCATE
                                                                 : AP_BTARD_STEP_HONEST,
                                 .done = on_verdict,
                                 .arg = d,
                                 .validators = (uint32_t)W.ng,
                                 .grad = grad_cb,
                                 .grad_arg = d};
        memcpy(c.run, RUN, 32);
        assert_ok(ap_btard_step_start(d->step, &c));
    }
    assert_true(T->run_until(W.tb, honest_verdicts, NULL, 120000000));
    bool applied = W.nd[0].apply;
    for (size_t g = 0; g < W.ng; g++) {
        int i = W.grp[g];
        if (!honest(i)) continue;
        node_t *d = &W.nd[i];
        assert_int_equal(d->apply, applied); /* the honest agree */
        assert_memory_equal(d->banned, W.nd[0].banned, sizeof d->banned);
        assert_memory_equal(d->excluded, W.nd[0].excluded, sizeof d->excluded);
        if (d->apply)
            for (size_t k = 0; k < D; k++) d->p[k] -= 0.5f * d->data[k];
    }
    /* the nodes that sat out or did not apply it (the withholder) catch up
     * as a returning peer does, by downloading the state: each step's
     * gradient is taken at the public parameters */
    for (int i = 0; i < N; i++)
        if (!W.nd[0].banned[i] && (!honest(i) || !in_group(i)))
            memcpy(W.nd[i].p, W.nd[0].p, sizeof W.nd[i].p);
    for (int i = 0; i < N; i++)
        if (W.nd[0].excluded[i]) W.sit_out[i] = SIT_OUT;
    W.step++;
    return applied;
}

static void world_up(int equiv)
{
    memset(&W, 0, sizeof W);
    W.equiv = equiv;
    W.tb = T->create(N, 31);
    assert_non_null(W.tb);
    uint64_t r = 12345;
    for (int x = 0; x < NEX; x++)
        for (size_t k = 0; k < D; k++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            double u = (double)(r >> 11) / 9007199254740992.0;
            W.Y[x][k] = (float)(10 * sin((double)k * 0.01) + 2 * u - 1);
        }
    for (int i = 0; i < N; i++) {
        ap_rt_t *rt = T->node(W.tb, i);
        node_t *d = &W.nd[i];
        W.ids[i] = *ap_rt_self(rt);
        d->vc.clip.cfg = ap_btard_clip_cfg_default();
        d->vc.clip.cfg.tau = 40;
        d->vc.clip.ws = ap_btard_clip_ws_new();
        assert_non_null(d->vc.clip.ws);
        assert_ok(ap_avg_service_new(rt, &d->avg));
        assert_ok(ap_btard_svc_new(rt, &d->mprng));
        assert_ok(ap_btard_step_svc_new(rt, d->mprng, &d->step));
    }
}

static void world_down(void)
{
    for (int i = 0; i < N; i++) {
        node_t *d = &W.nd[i];
        ap_btard_step_svc_free(d->step);
        ap_btard_svc_free(d->mprng);
        assert_ok(ap_avg_service_free(d->avg));
        ap_btard_clip_ws_free(d->vc.clip.ws);
        ap_btard_vclip_close(&d->vc);
    }
    T->destroy(W.tb);
}

static void test_attackers_banned_training_continues(void **st)
{
    (void)st;
    world_up(-1);
    const double loss0 = loss(W.nd[0].p);
    int applied_after = 0, steps = 0, excl_steps = 0;
    while (steps < MAX_STEPS &&
           !(W.nd[0].banned[POISONER] && excl_steps >= 2 && applied_after >= 3)) {
        bool banned = W.nd[0].banned[POISONER];
        bool a = one_step();
        if (banned && a) applied_after++;
        excl_steps += W.nd[0].excluded[WITHHOLD];
        steps++;
        for (int i = 0; i < N; i++)
            if (honest(i))
                for (int j = 0; j < N; j++)
                    if (j != POISONER && W.nd[i].banned[j])
                        fail_msg("step %d: honest node %d banned node %d", steps, i, j);
    }
    const double loss1 = loss(W.nd[0].p);
    printf("%s: %d steps, loss %.3f -> %.3f, applied after the ban %d, withholder excluded in %d\n",
           T->name, steps, loss0, loss1, applied_after, excl_steps);
    for (int i = 0; i < N; i++) {
        if (!honest(i)) continue;
        assert_true(W.nd[i].banned[POISONER]);
        assert_false(W.nd[i].banned[WITHHOLD]);
        assert_memory_equal(W.nd[i].p, W.nd[0].p, sizeof W.nd[0].p);
    }
    /* excluded again after sitting out, never banned */
    assert_true(excl_steps >= 2);
    assert_true(applied_after >= 3);
    /* the optimum's loss is the examples' variance, ~1/3 per element */
    assert_true(loss1 < 0.05 * loss0);
    world_down();
}

/* Node EQUIV aggregates its part honestly but sends the second half of the
 * group its aggregate + 0.5 per element, with a signed commitment naming
 * that copy, and the first half one naming the real one: every honest node
 * bans it in that step (step_equivocation: both signed commitments reach
 * every member, which relays each once), bans nobody honest, and does not
 * apply the step; after the bans the honest nodes train on. */
#define EQUIV 2
static void test_equivocating_aggregator_banned(void **st)
{
    (void)st;
    world_up(EQUIV);
    const double loss0 = loss(W.nd[0].p);
    bool applied0 = one_step();
    assert_false(applied0);
    for (int i = 0; i < N; i++)
        if (honest(i)) assert_true(W.nd[i].banned[EQUIV]); /* in the step it cheats */
    int applied_after = 0, steps = 1;
    while (steps < MAX_STEPS && applied_after < 2) {
        applied_after += one_step();
        steps++;
    }
    const double loss1 = loss(W.nd[0].p);
    printf("%s: equivocator banned in step 0; %d steps, loss %.3f -> %.3f, applied after %d\n",
           T->name, steps, loss0, loss1, applied_after);
    for (int i = 0; i < N; i++) {
        if (!honest(i)) continue;
        assert_true(W.nd[i].banned[EQUIV]);
        for (int j = 0; j < N; j++)
            if (j != POISONER && j != EQUIV && W.nd[i].banned[j])
                fail_msg("honest node %d banned node %d", i, j);
    }
    assert_true(applied_after >= 2);
    assert_true(loss1 < loss0);
    world_down();
}

int ap_btard_verified_suite_run(const ap_testbed_ops_t *ops)
{
    T = ops;
    printf("driver: %s\n", ops->name);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attackers_banned_training_continues),
        cmocka_unit_test(test_equivocating_aggregator_banned),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
