/* The verified step on the simulator: 8 peers run a ButterflyClip all-reduce
 * with the recording reducer (ap_btard_verified_clip), then the check
 * (commitments, the step's MPRNG seed, the aggregators' checks, the
 * members' reports). A clean round and a round with a poisoned sender
 * convict nobody and apply; an aggregator that shifts its part is convicted
 * by every honest peer with evidence that proves it (and nobody else); a
 * member that disputes every part stops the step without convicting
 * anyone; a member that misses a deadline (withholding its reveal, or
 * honest and slow) is left out of the step's MPRNG round, never convicted. */
#include "avg_harness.h"

#include "apiary/btard.h"

enum { N = 8, ELEMS = 6000, CHUNK = 500, NEX = 16, BATCH = 4 };

typedef struct peer {
    ap_btard_svc_t *mprng;
    ap_btard_step_svc_t *step;
    ap_btard_vclip_t vc;
    bool done;
    ap_btard_verdict_t v;
    ap_peer_id_t convicted[N];
    ap_btard_fault_t fault[N];
    uint8_t ban[N][AP_BTARD_BAN_MAX];
    size_t ban_len[N];
    ap_peer_id_t excluded[N];
} peer_t;

static peer_t P[N];

static void on_verdict(void *arg, const ap_btard_verdict_t *v)
{
    peer_t *p = arg;
    p->done = true;
    p->v = *v;
    p->v.bans = NULL;
    p->v.excluded = NULL;
    p->v.in_sync = NULL;
    for (size_t i = 0; i < v->nexcluded && i < N; i++) p->excluded[i] = v->excluded[i];
    for (size_t i = 0; i < v->nconvicted && i < N; i++) {
        p->convicted[i] = v->bans[i].peer;
        p->fault[i] = v->bans[i].fault;
        /* only these faults prove themselves */
        if (v->bans[i].fault == AP_BTARD_FAULT_BAD_AGGREGATE ||
            v->bans[i].fault == AP_BTARD_FAULT_BAD_REVEAL ||
            v->bans[i].fault == AP_BTARD_FAULT_STEP_EQUIVOCATION)
            assert_ok(
                ap_btard_ban_encode(&v->bans[i], p->ban[i], sizeof p->ban[i], &p->ban_len[i]));
        else
            assert_int_equal(
                ap_btard_ban_encode(&v->bans[i], p->ban[i], sizeof p->ban[i], &p->ban_len[i]),
                AP_EINVAL);
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
    uint32_t validators; /* gradient check: validators per step (0: off) */
    int accuser;         /* false accuser (-1: none) */
    int withholder;      /* withholds its MPRNG reveal (-1: none) */
    int slow;            /* honest, but its messages reach it late (-1: none) */
    /* 1 + an aggregator that sends its aggregate + 0.5 per element to the
     * second half of the group (0: none); equiv_data_only: with one
     * commitment to all (else AP_BTARD_STEP_EQUIVOCATE: a matching one to
     * each half) */
    int equivocator;
    bool equiv_data_only;
    /* every member states its public state (cfg.state); 1 + a member
     * whose parameters are another state's (0: none): its vector is the
     * gradient there, the others' minus 0.3 per element */
    bool states;
    int stale;
} scenario_t;

static const uint8_t RUN[32] = {7, 7, 7};

/* The public state: a quadratic loss 0.5 |p - y|^2 over NEX public examples
 * y_e, at parameters p = 0; member i's minibatch comes from a seed every
 * member knows before the round (the run, the step), so its gradient
 * -mean(y_b) can be recomputed by anyone. */
static float Y[NEX][ELEMS];
static uint8_t BATCH_SEED[32];

static int grad_of(void *arg, uint32_t member, float *out)
{
    (void)arg;
    uint64_t idx[BATCH];
    ap_btard_minibatch(BATCH_SEED, member, NEX, BATCH, idx);
    for (size_t k = 0; k < ELEMS; k++) {
        double acc = 0;
        for (int b = 0; b < BATCH; b++) acc += Y[idx[b]][k];
        out[k] = (float)(0.0 - acc / BATCH);
    }
    return 0;
}

static void run(const scenario_t *sc, avg_env_t *e)
{
    avg_env_init(e, N, ELEMS, sc->seed);
    ap_btard_round_ctx(RUN, 42, 2, BATCH_SEED);
    for (uint64_t k = 0; k < ELEMS; k++) {
        double c = 10 * sin((double)k * 0.01);
        for (int x = 0; x < NEX; x++) Y[x][k] = (float)(-c - (2 * avg_rnd01(e) - 1));
    }
    for (int i = 0; i < N; i++) {
        grad_of(NULL, (uint32_t)i, e->nd[i].orig);
        for (uint64_t k = 0; k < ELEMS; k++) {
            if (i == sc->poisoner) e->nd[i].orig[k] += 1000;
            if (i == sc->stale - 1) e->nd[i].orig[k] -= 0.3f;
            e->nd[i].data[k] = e->nd[i].orig[k];
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
    const int eq = sc->equivocator - 1;
    if (eq >= 0) { /* what the second half received of eq's part */
        uint64_t off = 0;
        for (int j = 0; j < eq; j++) off += counts[j];
        for (int i = N / 2; i < N; i++)
            for (uint64_t k = 0; i != eq && k < counts[eq]; k++) e->nd[i].data[off + k] += 0.5f;
    }
    if (sc->slow >= 0)
        /* the others' messages take 2.5 s to reach it, its own 0.5 s to
         * reach them: its commitment is in time, its reveal (sent once it
         * holds every commitment) comes after the others' 2 s reveal
         * deadline */
        for (int i = 0; i < N; i++) {
            if (i == sc->slow) continue;
            ap_sim_link_t in = {.latency_us = 2500000}, out = {.latency_us = 500000};
            assert_ok(ap_sim_set_link(e->sim, i, sc->slow, &in));
            assert_ok(ap_sim_set_link(e->sim, sc->slow, i, &out));
        }
    static const uint8_t STATE_A[32] = {1}, STATE_B[32] = {2};
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
                                 .attack = i == sc->disputer     ? AP_BTARD_STEP_FALSE_DISPUTE
                                           : i == sc->accuser    ? AP_BTARD_STEP_FALSE_ACCUSE
                                           : i == sc->withholder ? AP_BTARD_STEP_WITHHOLD_REVEAL
                                           : i == eq && !sc->equiv_data_only
                                               ? AP_BTARD_STEP_EQUIVOCATE
                                               : AP_BTARD_STEP_HONEST,
                                 .done = on_verdict,
                                 .arg = &P[i],
                                 .validators = sc->validators,
                                 .grad = grad_of,
                                 .state = !sc->states          ? NULL
                                          : i == sc->stale - 1 ? STATE_B
                                                               : STATE_A};
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
        scenario_t sc = {-1, -1, -1, 40, seed, 0, -1, -1, -1, 0, false, false, 0};
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
        scenario_t sc = {-1, 6, -1, taus[t], 4 + (uint64_t)t, 0, -1, -1, -1, 0, false, false, 0};
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
        scenario_t sc = {bad, -1, -1, 40, seed, 0, -1, -1, -1, 0, false, false, 0};
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
    scenario_t sc = {-1, -1, 2, 40, 9, 0, -1, -1, -1, 0, false, false, 0};
    run(&sc, &e);
    for (int i = 0; i < N; i++) {
        assert_int_equal(P[i].v.nconvicted, 0);
        assert_false(P[i].v.apply);
        assert_int_equal(P[i].v.disputes, N - 1);
    }
    finish(&e);
}

static bool targeted(const uint8_t seed[32], uint32_t k, int who)
{
    uint32_t val[N], tgt[N];
    assert_ok(ap_btard_pick_validators(seed, N, k, val, tgt));
    for (uint32_t q = 0; q < k; q++)
        if ((int)tgt[q] == who) return true;
    return false;
}

static bool convicted_as(const peer_t *p, const ap_peer_id_t *who, ap_btard_fault_t f)
{
    for (size_t i = 0; i < p->v.nconvicted && i < N; i++)
        if (ap_peer_id_eq(&p->convicted[i], who)) return p->fault[i] == f;
    return false;
}

/* With the gradient check on, honest rounds convict nobody: every
 * validator's recomputation matches its target's committed part. */
static void test_gradient_check_clean(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 2; seed++) {
        avg_env_t e;
        scenario_t sc = {-1, -1, -1, 40, seed, N, -1, -1, -1, 0, false, false, 0};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            assert_true(P[i].v.apply);
            assert_int_equal(P[i].v.nconvicted, 0);
            assert_int_equal(P[i].v.accusations, 0);
        }
        finish(&e);
    }
}

/* A sender whose vector is its gradient + 1000 per element: whenever the
 * seed makes it some validator's target, every peer convicts it of
 * bad_gradient (and nobody else); otherwise nobody is convicted. Over the
 * seeds it is caught at least once. */
static void test_gradient_check_poisoner(void **state)
{
    (void)state;
    int caught = 0;
    for (uint64_t seed = 1; seed <= 6; seed++) {
        avg_env_t e;
        const int bad = (int)(seed % N);
        const uint32_t k = 3;
        scenario_t sc = {-1, bad, -1, 40, seed, k, -1, -1, -1, 0, false, false, 0};
        run(&sc, &e);
        bool hit = targeted(P[0].v.seed, k, bad);
        caught += hit;
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            assert_memory_equal(P[i].v.seed, P[0].v.seed, 32);
            if (hit) {
                assert_int_equal(P[i].v.nconvicted, 1);
                assert_true(convicted_as(&P[i], avg_peer_id(&e, bad), AP_BTARD_FAULT_BAD_GRADIENT));
                assert_false(P[i].v.apply);
            } else {
                assert_int_equal(P[i].v.nconvicted, 0);
            }
        }
        finish(&e);
    }
    assert_true(caught > 0);
}

/* Stated states, all equal: the step applies as without them. A member on
 * other parameters (an honest peer that missed a step): its gradient differs
 * from what validators recompute, yet nobody is convicted, whoever validates
 * it; every part it sent fails, so nobody applies the step; it alone learns
 * it is out of sync, with the other N - 1 as the members to reload from.
 * Without stated states the same member is convicted of bad_gradient when
 * targeted. */
static void test_stale_member_not_convicted(void **state)
{
    (void)state;
    avg_env_t e;
    scenario_t same = {-1, -1, -1, 40, 1, N, -1, -1, -1, 0, false, true, 0};
    run(&same, &e);
    for (int i = 0; i < N; i++) {
        assert_true(P[i].v.apply);
        assert_false(P[i].v.out_of_sync);
        assert_int_equal(P[i].v.nin_sync, N);
    }
    finish(&e);
    int convicted_without = 0;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        const int stale = (int)(seed % N);
        scenario_t sc = {-1, -1, -1, 40, seed, N, -1, -1, -1, 0, false, true, stale + 1};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            assert_int_equal(P[i].v.nconvicted, 0);
            assert_false(P[i].v.apply);
            assert_true(P[i].v.parts_failed > 0);
            assert_int_equal(P[i].v.out_of_sync, i == stale);
            assert_int_equal(P[i].v.nin_sync, N - 1);
        }
        finish(&e);
        sc.states = false;
        run(&sc, &e);
        convicted_without +=
            convicted_as(&P[(stale + 1) % N], avg_peer_id(&e, stale), AP_BTARD_FAULT_BAD_GRADIENT);
        finish(&e);
    }
    assert_true(convicted_without > 0);
}

/* A member that accuses an honest peer is convicted of false_accusation by
 * every peer; the accused is not. */
static void test_false_accuser(void **state)
{
    (void)state;
    for (uint32_t k = 0; k <= 2; k += 2) {
        avg_env_t e;
        scenario_t sc = {-1, -1, -1, 40, 11 + k, k, 5, -1, -1, 0, false, false, 0};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.nconvicted, 1);
            assert_true(convicted_as(&P[i], avg_peer_id(&e, 5), AP_BTARD_FAULT_FALSE_ACCUSATION));
            assert_false(P[i].v.apply);
        }
        finish(&e);
    }
}

static bool excluded(const peer_t *p, const ap_peer_id_t *who)
{
    for (size_t i = 0; i < p->v.nexcluded && i < N; i++)
        if (ap_peer_id_eq(&p->excluded[i], who)) return true;
    return false;
}

/* A member that withholds its reveal in the step's MPRNG round is excluded
 * (no_reveal) by every honest peer, which agree on the seed of the round
 * without it, and convicted by none: an absence proves nothing. Its own
 * check is on the seed it saw, so its part fails and the step is dropped. */
static void test_withheld_reveal(void **state)
{
    (void)state;
    avg_env_t e;
    const int bad = 3;
    scenario_t sc = {-1, -1, -1, 40, 21, 2, -1, bad, -1, 0, false, false, 0};
    run(&sc, &e);
    for (int i = 0; i < N; i++) {
        if (i == bad) continue;
        assert_int_equal(P[i].v.status, 0);
        assert_memory_equal(P[i].v.seed, P[i == 0 ? 1 : 0].v.seed, 32);
        assert_int_equal(P[i].v.nconvicted, 0);
        assert_int_equal(P[i].v.nexcluded, 1);
        assert_true(excluded(&P[i], avg_peer_id(&e, bad)));
        assert_false(P[i].v.apply);
    }
    finish(&e);
}

/* An honest member whose messages arrive late (the others' take 2.5 s to
 * reach it, past the 2 s reveal deadline): the others exclude it from the
 * MPRNG round and agree on a seed without it. With the gradient check on
 * (every member a validator) nobody, it included, convicts anyone honest,
 * also with a poisoner in the group, whom the slow member (on a seed of its
 * own) may accuse: its accusations are not judged. */
static void test_slow_honest_peer_not_banned(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 4; seed++) {
        avg_env_t e;
        const int slow = (int)(seed * 3 % N);
        const int bad = seed > 2 ? (slow + 2) % N : -1;
        scenario_t sc = {-1, bad, -1, 40, 30 + seed, N, -1, -1, slow, 0, false, false, 0};
        run(&sc, &e);
        const int ref = slow == 0 ? 1 : 0;
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            for (size_t q = 0; q < P[i].v.nconvicted && q < N; q++)
                assert_true(bad >= 0 && ap_peer_id_eq(&P[i].convicted[q], avg_peer_id(&e, bad)));
            if (i == slow) continue;
            assert_memory_equal(P[i].v.seed, P[ref].v.seed, 32);
            assert_true(excluded(&P[i], avg_peer_id(&e, slow)));
            assert_int_equal(P[i].v.nexcluded, 1);
        }
        finish(&e);
    }
}

/* An aggregator sends different results to the two halves of the group
 * and signs, to each half, a commitment naming the aggregate that half got.
 * Every member relays what it receives once, so every member holds both
 * signed commitments: every peer convicts it (step_equivocation, with the
 * two messages as a ban record that proves it and nobody else), nobody else
 * is convicted, and nobody applies the step. */
static void test_equivocating_aggregator_convicted(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        avg_env_t e;
        const int bad = (int)(seed * 3 % N); /* 3, 6, 1: in either half */
        scenario_t sc = {-1, -1, -1, 40, seed, 0, -1, -1, -1, bad + 1, false, false, 0};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            assert_false(P[i].v.apply);
            assert_int_equal(P[i].v.nconvicted, 1);
            assert_true(ap_peer_id_eq(&P[i].convicted[0], avg_peer_id(&e, bad)));
            assert_int_equal(P[i].fault[0], AP_BTARD_FAULT_STEP_EQUIVOCATION);
            ap_btard_ban_t b;
            assert_ok(
                ap_btard_ban_check(P[i].ban[0], P[i].ban_len[0], avg_peer_id(&e, bad), RUN, &b));
            assert_int_equal(b.fault, AP_BTARD_FAULT_STEP_EQUIVOCATION);
            assert_int_equal(ap_btard_ban_check(P[i].ban[0], P[i].ban_len[0],
                                                avg_peer_id(&e, (bad + 1) % N), RUN, &b),
                             AP_EINVAL);
            uint8_t other[32] = {8};
            assert_int_equal(
                ap_btard_ban_check(P[i].ban[0], P[i].ban_len[0], avg_peer_id(&e, bad), other, &b),
                AP_EINVAL);
        }
        finish(&e);
    }
}

/* The same results, but one commitment (naming what the first half got) to
 * everyone: the second half's copies do not match it. Every peer drops the
 * step (the part fails), and nobody is convicted: an unsigned copy proves
 * nothing about who lies, the aggregator or the members that report it. */
static void test_equivocating_data_only_dropped(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 2; seed++) {
        avg_env_t e;
        const int bad = (int)(seed * 3 % N);
        scenario_t sc = {-1, -1, -1, 40, seed, 0, -1, -1, -1, bad + 1, true, false, 0};
        run(&sc, &e);
        for (int i = 0; i < N; i++) {
            assert_int_equal(P[i].v.status, 0);
            assert_false(P[i].v.apply);
            assert_int_equal(P[i].v.nconvicted, 0);
            assert_true(P[i].v.parts_failed >= 1);
        }
        finish(&e);
    }
}

int main(void)
{
    ap_log_set_level(getenv("BTARD_VERBOSE") ? AP_LOG_INFO : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clean_round_applies),
        cmocka_unit_test(test_poisoned_sender_no_false_conviction),
        cmocka_unit_test(test_shifting_aggregator_convicted),
        cmocka_unit_test(test_false_disputer),
        cmocka_unit_test(test_gradient_check_clean),
        cmocka_unit_test(test_gradient_check_poisoner),
        cmocka_unit_test(test_false_accuser),
        cmocka_unit_test(test_withheld_reveal),
        cmocka_unit_test(test_slow_honest_peer_not_banned),
        cmocka_unit_test(test_equivocating_aggregator_convicted),
        cmocka_unit_test(test_equivocating_data_only_dropped),
        cmocka_unit_test(test_stale_member_not_convicted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
