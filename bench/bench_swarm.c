/* `apiary bench swarm [--json] [--quick]`: SWARM parallelism.
 *
 * On a fluid model of the pipeline (throughput = least stage total; 4
 * stages, 12 servers of speeds drawn from {1, 2, 4}):
 *   swarm_throughput_over_optimum  after rebalancing from a bad assignment,
 *                                  mean over draws (the worst in "worst");
 *   swarm_over_fixed_pipelines     under preemption (every period one server
 *                                  leaves, one joins), SWARM with rebalancing
 *                                  vs the same servers wired as fixed
 *                                  one-server-per-stage pipelines;
 *   rebalance_recovery_periods     periods until >= 0.9 x the new optimum
 *                                  after a change, mean over the changes
 *                                  (10 = not within 10; the worst and the
 *                                  share within 2 periods as fields).
 * In one process, over encoded stage calls of a 3-stage model-kit GPT:
 *   samples_per_s and bytes_per_sample, with blockwise 8-bit activations
 *   and uncompressed (the ratio is against uncompressed). */
#include "bench.h"

#include "apiary/swarm.h"
#include "swarm_optimum.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S      4
#define NSRV   12
#define MARGIN 0.05

static uint64_t rs = 12345;
static uint64_t rnd(void)
{
    uint64_t z = (rs += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static const double speeds[3] = {1, 2, 4};

static ap_peer_id_t pid(uint32_t i)
{
    uint8_t pk[AP_ED25519_PK_LEN] = {0};
    pk[0] = (uint8_t)i;
    pk[1] = (uint8_t)(i >> 8);
    pk[2] = (uint8_t)(i >> 16);
    ap_peer_id_t id;
    ap_peer_id_from_ed25519(&id, pk);
    return id;
}

/* The exact optimum (testing/swarm_optimum.c). */
static int opt_throughput(const ap_swarm_member_t *m, size_t n)
{
    int best = ap_test_swarm_optimum(m, n, S);
    return best > 0 ? best : 1;
}

static int period(ap_swarm_member_t *m, size_t n)
{
    uint32_t to[NSRV];
    int mv = ap_swarm_rebalance_plan(m, n, S, MARGIN, to);
    for (size_t i = 0; mv > 0 && i < n; i++) m[i].stage = to[i];
    return mv;
}

static double tput(const ap_swarm_member_t *m)
{
    return ap_swarm_pipeline_throughput(m, NULL, NSRV, S);
}

static void fluid(ap_bench_ctx_t *c)
{
    const int trials = c->quick ? 20 : 200;
    double sum = 0, worst = 1;
    for (int t = 0; t < trials; t++) {
        ap_swarm_member_t m[NSRV];
        for (uint32_t i = 0; i < NSRV; i++) {
            m[i] = (ap_swarm_member_t){pid(i + 100u * (uint32_t)t), i < S - 1 ? i + 1 : 0,
                                       speeds[rnd() % 3]};
        }
        for (int p = 0; p < 20 && period(m, NSRV) > 0; p++) {
        }
        double r = tput(m) / opt_throughput(m, NSRV);
        sum += r;
        worst = fmin(worst, r);
    }
    char f[128];
    snprintf(f, sizeof f, "\"model\":\"fluid\",\"draws\":%d,\"worst\":%.3f", trials, worst);
    ap_bench_report(c, "swarm_throughput_over_optimum", sum / trials, "ratio", f);

    /* Preemption: SWARM vs fixed pipelines over the same membership. */
    const int periods = c->quick ? 50 : 500;
    ap_swarm_member_t m[NSRV];
    double slot[NSRV]; /* fixed pipelines: slot p*S+s holds a server's speed, 0 = empty */
    uint32_t next = 0;
    for (uint32_t i = 0; i < NSRV; i++) {
        m[i] = (ap_swarm_member_t){pid(next++), i % S, speeds[rnd() % 3]};
        slot[i] = m[i].throughput;
    }
    while (period(m, NSRV) > 0) {
    }
    double swarm = 0, fixed = 0;
    int worst_rec = 0, within2 = 0;
    long rec_sum = 0;
    size_t pending = NSRV; /* fixed: slot refilled at the next period */
    double pending_v = 0;
    for (int t = 0; t < periods; t++) {
        if (pending < NSRV) slot[pending] = pending_v;
        size_t gone = (size_t)(rnd() % NSRV);
        double v = speeds[rnd() % 3];
        m[gone] = (ap_swarm_member_t){pid(next++), (uint32_t)(rnd() % S), v};
        slot[gone] = 0; /* the fixed pipeline loses its server for this period */
        pending = gone;
        pending_v = v;
        const double opt = opt_throughput(m, NSRV);
        int rec = 0;
        ap_swarm_member_t probe[NSRV];
        memcpy(probe, m, sizeof probe);
        while (tput(probe) < 0.9 * opt && rec < 10) {
            if (period(probe, NSRV) <= 0) {
                rec = 10;
                break;
            }
            rec++;
        }
        worst_rec = rec > worst_rec ? rec : worst_rec;
        rec_sum += rec;
        within2 += rec <= 2;
        period(m, NSRV);
        swarm += tput(m);
        for (int p = 0; p < NSRV / S; p++) {
            double lo = slot[p * S];
            for (int s = 1; s < S; s++) lo = fmin(lo, slot[p * S + s]);
            fixed += lo;
        }
    }
    snprintf(f, sizeof f, "\"model\":\"fluid\",\"periods\":%d,\"pipelines\":%d", periods, NSRV / S);
    ap_bench_report_vs(c, "swarm_over_fixed_pipelines", swarm / periods, "units/s", fixed / periods,
                       f);
    snprintf(f, sizeof f,
             "\"model\":\"fluid\",\"changes\":%d,\"worst\":%d,\"within_2\":%.3f,"
             "\"cap\":10",
             periods, worst_rec, (double)within2 / periods);
    ap_bench_report(c, "rebalance_recovery_periods", (double)rec_sum / periods, "periods", f);
}

/* ---- in-process stage calls ------------------------------------------------ */

typedef struct stats {
    double bytes;
    double seconds;
    long samples;
} stats_t;

static int call(ap_nn_model_t *m, uint32_t s, const ap_swarm_req_t *q, const ap_codec_cfg_t *cc,
                ap_swarm_resp_t *r, stats_t *st)
{
    uint8_t *buf;
    size_t len;
    const char *why = NULL;
    int rc = ap_swarm_req_encode(q, cc, &buf, &len);
    if (rc) return rc;
    st->bytes += (double)len;
    ap_swarm_req_t dq;
    rc = ap_swarm_req_decode(buf, len, &dq, &why);
    free(buf);
    if (rc) return rc;
    ap_swarm_resp_t sr;
    rc = ap_swarm_stage_run(m, s, &dq, &sr, &why);
    ap_swarm_req_clear(&dq);
    if (rc) return rc;
    rc = ap_swarm_resp_encode(&sr, cc, &buf, &len);
    ap_swarm_resp_clear(&sr);
    if (rc) return rc;
    st->bytes += (double)len;
    rc = ap_swarm_resp_decode(buf, len, r, &why);
    free(buf);
    return rc;
}

static int pipeline(ap_bench_ctx_t *c, const ap_codec_cfg_t *cc, stats_t *st, float *last_loss)
{
    enum { NS = 3, L = 6, B = 8, T = 64, C = 128, H = 4 };
    const int cut[NS + 1] = {0, 2, 4, 6};
    ap_nn_model_t *sm[NS] = {0};
    int rc = 0;
    ap_nn_gpt_config_t wc = ap_nn_gpt_config_default(T, L, H, C, B);
    for (int s = 0; s < NS && !rc; s++) {
        ap_nn_gpt_config_t g = wc;
        g.layer_begin = cut[s];
        g.layer_end = cut[s + 1];
        g.embed = s == 0;
        g.head = s == NS - 1;
        if ((rc = ap_nn_gpt_new(&g, &sm[s]))) break;
        ap_nn_model_init(sm[s], 3 + (uint64_t)s);
    }
    int32_t tok[B * T], tgt[B * T];
    uint64_t x = 99;
    const int steps = c->quick ? 2 : 10;
    double t0 = ap_bench_now();
    for (int step = 0; step < steps && !rc; step++) {
        for (int i = 0; i < B * T; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            tok[i] = (int32_t)(x % 26) + 'a';
            tgt[i] = (int32_t)((x >> 8) % 26) + 'a';
        }
        float *ins[NS] = {0}, *dout = NULL;
        ap_swarm_resp_t r;
        for (int s = 0; s < NS - 1 && !rc; s++) {
            ap_swarm_req_t q = {
                .op = AP_SWARM_FORWARD, .stage = (uint32_t)s, .B = B, .T = T, .C = C};
            q.tokens = s == 0 ? tok : NULL;
            q.in = ins[s];
            if (!(rc = call(sm[s], (uint32_t)s, &q, cc, &r, st))) ins[s + 1] = r.act;
        }
        for (int s = NS - 1; s >= 0 && !rc; s--) {
            ap_swarm_req_t q = {
                .op = AP_SWARM_BACKWARD, .stage = (uint32_t)s, .B = B, .T = T, .C = C};
            q.tokens = s == 0 ? tok : NULL;
            q.targets = s == NS - 1 ? tgt : NULL;
            q.in = ins[s];
            q.dout = dout;
            if ((rc = call(sm[s], (uint32_t)s, &q, cc, &r, st))) break;
            if (s == NS - 1) *last_loss = r.loss;
            free(dout);
            dout = r.act;
        }
        free(dout);
        for (int s = 0; s < NS; s++) free(ins[s]);
        st->samples += B;
    }
    st->seconds = ap_bench_now() - t0;
    for (int s = 0; s < NS; s++) ap_nn_model_free(sm[s]);
    return rc;
}

static int bench_swarm(ap_bench_ctx_t *c, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fluid(c);
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE}, b8 = {.id = AP_CODEC_BLOCKWISE8};
    stats_t sn = {0}, sb = {0};
    float ln = 0, lb = 0;
    int rc = pipeline(c, &none, &sn, &ln);
    if (!rc) rc = pipeline(c, &b8, &sb, &lb);
    if (rc) {
        fprintf(stderr, "bench swarm: stage calls failed: %s\n", ap_strerror(rc));
        return 1;
    }
    const char *f = "\"mode\":\"in-process\",\"stages\":3,\"codec\":\"blockwise8\"";
    ap_bench_report_vs(c, "samples_per_s", (double)sb.samples / sb.seconds, "samples/s",
                       (double)sn.samples / sn.seconds, f);
    ap_bench_report_vs(c, "bytes_per_sample", sb.bytes / (double)sb.samples, "bytes",
                       sn.bytes / (double)sn.samples, f);
    return 0;
}

AP_BENCH(bench_swarm_def, "swarm", bench_swarm,
         "SWARM: rebalancing vs optimum and fixed pipelines (fluid model), stage-call bytes");
