/* BTARD's overhead does not grow with the model: 8 peers on simulated
 * 100 Mbit/s links run one step at 10^3 and at 10^6 parameters, once as a
 * plain all-reduce (the mean) and once verified (ButterflyClip with the
 * recording reducer, then the check: commitments, the step's MPRNG seed,
 * the aggregators' checks, two validators' gradient checks, the members'
 * reports). The bytes a peer sends beyond the plain round's (the check's
 * messages and their framing) are the same within 10 % at both sizes, and
 * the verified step applies at every peer. */
#include "avg_harness.h"

#include "apiary/btard.h"

enum { N = 8 };

typedef struct peer {
    ap_btard_svc_t *mprng;
    ap_btard_step_svc_t *step;
    ap_btard_vclip_t vc;
    bool done;
    ap_btard_verdict_t v;
} peer_t;

static peer_t P[N];
static uint64_t ELEMS;

static void on_verdict(void *arg, const ap_btard_verdict_t *v)
{
    peer_t *p = arg;
    p->done = true;
    p->v = *v;
    p->v.bans = NULL;
    p->v.excluded = NULL;
    p->v.in_sync = NULL;
}

static bool all_verdicts(void *arg)
{
    (void)arg;
    for (int i = 0; i < N; i++)
        if (!P[i].done) return false;
    return true;
}

/* Member m's vector: what it sent and what a validator recomputes. */
static float value(uint32_t m, uint64_t k)
{
    return (float)sin((double)k * 1e-3) + (float)((k * 31 + m) % 97) * 1e-3f;
}

static int grad_of(void *arg, uint32_t member, float *out)
{
    (void)arg;
    for (uint64_t k = 0; k < ELEMS; k++) out[k] = value(member, k);
    return 0;
}

/* Bytes sent per peer (mean) by one step of elems parameters. */
static double step_bytes(uint64_t elems, bool verified)
{
    avg_env_t e;
    ELEMS = elems;
    avg_env_init(&e, N, elems, 11);
    ap_avg_member_t mem[N];
    for (int i = 0; i < N; i++) {
        for (uint64_t k = 0; k < elems; k++)
            e.nd[i].orig[k] = e.nd[i].data[k] = value((uint32_t)i, k);
        e.nd[i].weight = 1.0;
        avg_set_bw(&e, i, 12.5e6, 12.5e6); /* 100 Mbit/s */
        mem[i] = (ap_avg_member_t){*avg_peer_id(&e, i), AP_AVG_NORMAL, e.up[i], e.down[i]};
    }
    memset(P, 0, sizeof P);
    const double tau = 1e3; /* every copy within it: the clip is the mean */
    for (int i = 0; verified && i < N; i++) {
        P[i].vc.clip.cfg = ap_btard_clip_cfg_default();
        P[i].vc.clip.cfg.tau = tau;
        P[i].vc.clip.ws = ap_btard_clip_ws_new();
        assert_non_null(P[i].vc.clip.ws);
        assert_ok(ap_btard_svc_new(avg_rt(&e, i), &P[i].mprng));
        assert_ok(ap_btard_step_svc_new(avg_rt(&e, i), P[i].mprng, &P[i].step));
    }
    ap_avg_group_t g = {.members = mem, .n = N};
    memset(g.id, 0x5d, sizeof g.id);
    for (int i = 0; i < N; i++) {
        ap_allreduce_opts_t o = {0};
        if (verified) {
            o.reduce = ap_btard_verified_clip;
            o.reduce_arg = &P[i].vc;
        }
        avg_node_t *d = &e.nd[i];
        d->in_round = true;
        assert_ok(ap_allreduce_start(d->svc, &g, d->data, elems, 1.0, &o, avg_on_done, d, &d->ar));
    }
    assert_true(avg_run_until(&e, avg_all_done, &e, 600000000ull));
    for (int i = 0; i < N; i++) {
        assert_int_equal(e.nd[i].res.status, 0);
        assert_true(e.nd[i].res.averaged_fraction == 1.0);
    }
    if (verified) {
        static const uint8_t RUN[32] = {9, 9};
        uint64_t counts[N];
        ap_peer_id_t ids[N];
        assert_ok(ap_btard_split(mem, N, elems, counts));
        for (int i = 0; i < N; i++) ids[i] = mem[i].id;
        for (int i = 0; i < N; i++) {
            ap_btard_step_cfg_t c = {.step = 3,
                                     .peers = ids,
                                     .n = N,
                                     .counts = counts,
                                     .sent = e.nd[i].orig,
                                     .result = e.nd[i].data,
                                     .weight = 1.0,
                                     .vclip = &P[i].vc,
                                     .tau = tau,
                                     .done = on_verdict,
                                     .arg = &P[i],
                                     .validators = 2,
                                     .grad = grad_of};
            memcpy(c.run, RUN, sizeof RUN);
            assert_ok(ap_btard_step_start(P[i].step, &c));
        }
        assert_true(avg_run_until(&e, all_verdicts, NULL, 60000000ull));
        for (int i = 0; i < N; i++) {
            assert_true(P[i].v.apply);
            assert_int_equal(P[i].v.nconvicted, 0);
            assert_int_equal(P[i].v.parts_failed, 0);
        }
    }
    double bytes = 0;
    for (int i = 0; i < N; i++) {
        ap_rt_stats_t rs;
        ap_rt_get_stats(avg_rt(&e, i), &rs);
        bytes += (double)rs.bytes_sent / N;
    }
    for (int i = 0; verified && i < N; i++) {
        ap_btard_step_svc_free(P[i].step);
        ap_btard_svc_free(P[i].mprng);
        ap_btard_clip_ws_free(P[i].vc.clip.ws);
        ap_btard_vclip_close(&P[i].vc);
    }
    avg_env_free(&e);
    return bytes;
}

static void test_extra_bytes_flat_in_model_size(void **state)
{
    (void)state;
    double small = step_bytes(1000, true) - step_bytes(1000, false);
    double large = step_bytes(1000000, true) - step_bytes(1000000, false);
    print_message("extra bytes per peer: %.0f at 10^3, %.0f at 10^6 parameters\n", small, large);
    assert_true(small > 0); /* the check sends something */
    assert_true(fabs(large - small) <= 0.10 * small);
}

int main(void)
{
    ap_log_set_level(AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_extra_bytes_flat_in_model_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
