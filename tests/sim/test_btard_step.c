/* The verified step on the simulator: 8 peers run a ButterflyClip all-reduce
 * with the recording reducer (ap_btard_verified_clip), then the check
 * (commitments, the step's MPRNG seed, the aggregators' checks, the
 * members' reports). A clean round and a round with a poisoned sender
 * convict nobody and apply; an aggregator that shifts its part is convicted
 * by every honest peer with evidence that proves it (and nobody else); a
 * member that disputes every part stops the step without convicting
 * anyone. */
#include "avg_harness.h"

#include "apiary/btard.h"

enum { N = 8, ELEMS = 6000, CHUNK = 500 };

typedef struct peer {
    ap_btard_svc_t *mprng;
    ap_btard_step_svc_t *step;
    ap_btard_vclip_t vc;
    bool done;
    ap_btard_verdict_t v;
    ap_peer_id_t convicted[N];
    uint8_t ban[N][AP_BTARD_BAN_MAX];
    size_t ban_len[N];
} peer_t;

static peer_t P[N];

static void on_verdict(void *arg, const ap_btard_verdict_t *v)
{
    peer_t *p = arg;
    p->done = true;
    p->v = *v;
    p->v.bans = NULL;
    for (size_t i = 0; i < v->nconvicted && i < N; i++) {
        p->convicted[i] = v->bans[i].peer;
        assert_ok(ap_btard_ban_encode(&v->bans[i], p->ban[i], sizeof p->ban[i], &p->ban_len[i]));
    }
}

static bool all_verdicts(void *arg)
{
    (void)arg;
    for (int i = 0; i < N; i++)
        if (!P[i].done) return false;
    return true;
}

typedef struct scenario {
    int shifter;  /* aggregator adding a shift to its part (-1: none) */
    int poisoner; /* sender of a poisoned vector (-1: none) */
    int disputer; /* member that disputes every part (-1: none) */
    double tau;
    uint64_t seed;
} scenario_t;

static const uint8_t RUN[32] = {7, 7, 7};

static void run(const scenario_t *sc, avg_env_t *e)
{
    avg_env_init(e, N, ELEMS, sc->seed);
    for (uint64_t k = 0; k < ELEMS; k++) {
        double c = 10 * sin((double)k * 0.01);
        for (int i = 0; i < N; i++) {
            double v = i == sc->poisoner ? c + 1000 : c + 2 * avg_rnd01(e) - 1;
            e->nd[i].orig[k] = e->nd[i].data[k] = (float)v;
        }
    }
    ap_avg_member_t mem[N];
    for (int i = 0; i < N; i++) {
        e->nd[i].weight = 1.0;
        avg_set_bw(e, i, 12.5e6, 12.5e6); /* 100 Mbit/s */
        mem[i] = (ap_avg_member_t){*avg_peer_id(e, i), AP_AVG_NORMAL, e->up[i], e->down[i]};
    }
    memset(P, 0, sizeof P);
    for (int i = 0; i < N; i++) {
        peer_t *p = &P[i];
        p->vc.clip.cfg = ap_btard_clip_cfg_default();
        p->vc.clip.cfg.tau = sc->tau;
        p->vc.clip.ws = ap_btard_clip_ws_new();
        assert_non_null(p->vc.clip.ws);
        p->vc.shift = i == sc->shifter ? 0.5f : 0.0f;
        assert_ok(ap_btard_svc_new(avg_rt(e, i), &p->mprng));
        assert_ok(ap_btard_step_svc_new(avg_rt(e, i), p->mprng, &p->step));
    }
    ap_avg_group_t g = {.members = mem, .n = N};
    memset(g.id, 0x3c, sizeof g.id);
    for (int i = 0; i < N; i++) {
        ap_allreduce_opts_t o = {
            .chunk_elems = CHUNK, .reduce = ap_btard_verified_clip, .reduce_arg = &P[i].vc};
        avg_node_t *d = &e->nd[i];
        d->in_round = true;
        assert_ok(ap_allreduce_start(d->svc, &g, d->data, ELEMS, 1.0, &o, avg_on_done, d, &d->ar));
    }
    assert_true(avg_run_until(e, avg_all_done, e, 600000000ull));
    uint64_t counts[N];
    assert_ok(ap_btard_split(mem, N, ELEMS, counts));
    ap_peer_id_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = mem[i].id;
    for (int i = 0; i < N; i++) {
        avg_node_t *d = &e->nd[i];
        assert_int_equal(d->res.status, 0);
        assert_int_equal(d->res.my_part_elems, counts[i]);
        ap_btard_step_cfg_t c = {.step = 42,
                                 .peers = ids,
                                 .n = N,
                                 .counts = counts,
                                 .sent = d->orig,
                                 .result = d->data,
                                 .weight = 1.0,
                                 .vclip = &P[i].vc,
                                 .tau = sc->tau,
                                 .phase_timeout_us = 2000000,
                                 .attack = i == sc->disputer ? AP_BTARD_STEP_FALSE_DISPUTE
                                                             : AP_BTARD_STEP_HONEST,
                                 .done = on_verdict,
                                 .arg = &P[i]};
        memcpy(c.run, RUN, 32);
        assert_ok(ap_btard_step_start(P[i].step, &c));
    }
    assert_true(avg_run_until(e, all_verdicts, NULL, 60000000ull));
    if (getenv("BTARD_VERBOSE"))
        for (int i = 0; i < N; i++)
            printf("peer %d: status %d apply %d ok %u failed %u disputes %u convicted %zu\n", i,
                   P[i].v.status, P[i].v.apply, P[i].v.parts_ok, P[i].v.parts_failed,
                   P[i].v.disputes, P[i].v.nconvicted);
}

static void finish(avg_env_t *e)
{
    for (int i = 0; i < N; i++) {
        ap_btard_step_svc_free(P[i].step);
        ap_btard_svc_free(P[i].mprng);
        ap_btard_clip_ws_free(P[i].vc.clip.ws);
        ap_btard_vclip_close(&P[i].vc);
    }
    avg_env_free(e);
}

static void test_clean_round_applies(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        avg_env_t e;
        scenario_t sc = {-1, -1, -1, 40, seed};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            assert_true(P[i].v.apply);
            assert_int_equal(P[i].v.parts_ok, N);
            assert_int_equal(P[i].v.nconvicted, 0);
        }
        finish(&e);
    }
}

/* A poisoned sender is clipped; the honest aggregators' checks still hold
 * (nobody is convicted, every part passes), also with every input clipped. */
static void test_poisoned_sender_no_false_conviction(void **state)
{
    (void)state;
    const double taus[] = {40, 2};
    for (int t = 0; t < 2; t++) {
        avg_env_t e;
        scenario_t sc = {-1, 6, -1, taus[t], 4 + (uint64_t)t};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.nconvicted, 0);
            assert_true(P[i].v.apply);
        }
        finish(&e);
    }
}

/* An aggregator shifts its part by 0.5 per element: every peer convicts it,
 * its evidence proves it and nobody else, and the step is not applied. */
static void test_shifting_aggregator_convicted(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        avg_env_t e;
        const int bad = (int)(seed % N);
        scenario_t sc = {bad, -1, -1, 40, seed};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            assert_false(P[i].v.apply);
            assert_int_equal(P[i].v.nconvicted, 1);
            assert_int_equal(P[i].v.parts_failed, 1);
            assert_true(ap_peer_id_eq(&P[i].convicted[0], avg_peer_id(&e, bad)));
            ap_btard_ban_t b;
            assert_ok(
                ap_btard_ban_check(P[i].ban[0], P[i].ban_len[0], avg_peer_id(&e, bad), RUN, &b));
            assert_int_equal(b.fault, AP_BTARD_FAULT_BAD_AGGREGATE);
            assert_int_equal(b.step, 42);
            /* not against another peer, not for another run, not tampered */
            assert_int_equal(ap_btard_ban_check(P[i].ban[0], P[i].ban_len[0],
                                                avg_peer_id(&e, (bad + 1) % N), RUN, &b),
                             AP_EINVAL);
            uint8_t other[32] = {8};
            assert_int_equal(
                ap_btard_ban_check(P[i].ban[0], P[i].ban_len[0], avg_peer_id(&e, bad), other, &b),
                AP_EINVAL);
            P[i].ban[0][P[i].ban_len[0] / 2] ^= 1;
            assert_true(ap_btard_ban_check(P[i].ban[0], P[i].ban_len[0], avg_peer_id(&e, bad), RUN,
                                           &b) != 0);
        }
        finish(&e);
    }
}

/* A member disputing every part stops the step; nobody is convicted. */
static void test_false_disputer(void **state)
{
    (void)state;
    avg_env_t e;
    scenario_t sc = {-1, -1, 2, 40, 9};
    run(&sc, &e);
    for (int i = 0; i < N; i++) {
        assert_int_equal(P[i].v.nconvicted, 0);
        assert_false(P[i].v.apply);
        assert_int_equal(P[i].v.disputes, N - 1);
    }
    finish(&e);
}

int main(void)
{
    ap_log_set_level(getenv("BTARD_VERBOSE") ? AP_LOG_INFO : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clean_round_applies),
        cmocka_unit_test(test_poisoned_sender_no_false_conviction),
        cmocka_unit_test(test_shifting_aggregator_convicted),
        cmocka_unit_test(test_false_disputer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
