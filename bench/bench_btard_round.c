/* `apiary bench btard`, the round part: one butterfly all-reduce of 16 peers
 * on SIMULATED 100 Mbit/s links (runtime/sim, virtual time) with the plain
 * mean and with BTARD (ap_btard_verified_clip as every reducer's part
 * reducer, then the verified step: commitments, the MPRNG seed, the
 * aggregators' checks and the members' reports), at 10^3 and 10^6 parameters.
 *   btard_round_over_plain: (BTARD's virtual time for the round and its
 *     check + the CPU time of its CenteredClip call on one part, measured on
 *     this machine) / the plain round's virtual time. The simulator does not
 *     charge CPU time, so the clip is timed apart (best of 3) and added.
 *   extra_bytes_per_peer: wire bytes (framing included) sent per peer beyond
 *     the plain round's: the check's messages. */
#include "bench.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/btard.h"
#include "apiary/log.h"
#include "apiary/sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NP 16

typedef struct rnode {
    ap_avg_service_t *svc;
    float *data;
    bool done;
    ap_allreduce_result_t res;
    ap_btard_vclip_t vc;
    float *sent;
    ap_btard_svc_t *mprng;
    ap_btard_step_svc_t *step;
    bool checked, apply;
} rnode_t;

static void on_verdict(void *arg, const ap_btard_verdict_t *v)
{
    rnode_t *s = arg;
    s->checked = true;
    s->apply = v->apply && v->nconvicted == 0;
}

static bool all_checked(void *arg)
{
    rnode_t *st = arg;
    for (int i = 0; i < NP; i++)
        if (!st[i].checked) return false;
    return true;
}

static void on_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    rnode_t *s = arg;
    s->res = *res;
    s->done = true;
}

static bool all_done(void *arg)
{
    rnode_t *st = arg;
    for (int i = 0; i < NP; i++)
        if (!st[i].done) return false;
    return true;
}

/* One round; *round_s = the slowest peer's virtual time, *bytes = bytes sent
 * per peer (mean), *part = elements of the largest part. 0 or -1. */
static int one_round(uint64_t elems, bool clip, double tau, double *round_s, double *bytes,
                     uint64_t *part)
{
    ap_sim_t *sim = ap_sim_new(7);
    if (!sim) return -1;
    rnode_t *st = calloc(NP, sizeof *st);
    ap_avg_member_t mem[NP];
    int rc = -1;
    if (!st) goto out;
    for (int i = 0; i < NP; i++) {
        ap_sim_node_opts_t o = {.up_bps = 100000000, .down_bps = 100000000};
        if (ap_sim_add_node(sim, &o) < 0) goto out;
    }
    for (int i = 0; i < NP; i++) {
        ap_rt_t *rt = ap_sim_node(sim, i);
        if (ap_avg_service_new(rt, &st[i].svc)) goto out;
        mem[i] = (ap_avg_member_t){*ap_rt_self(rt), AP_AVG_NORMAL, 12.5e6, 12.5e6};
        st[i].data = malloc(elems * sizeof(float));
        st[i].sent = malloc(elems * sizeof(float));
        if (!st[i].data || !st[i].sent) goto out;
        for (uint64_t k = 0; k < elems; k++)
            st[i].sent[k] = st[i].data[k] =
                (float)sin((double)k * 1e-3) + (float)((k * 31 + (uint64_t)i) % 97) * 1e-3f;
        st[i].vc.clip.cfg = ap_btard_clip_cfg_default();
        st[i].vc.clip.cfg.tau = tau;
        if (clip && (ap_btard_svc_new(rt, &st[i].mprng) ||
                     ap_btard_step_svc_new(rt, st[i].mprng, &st[i].step)))
            goto out;
    }
    ap_avg_group_t g = {.members = mem, .n = NP};
    memset(g.id, 0xb7, sizeof g.id);
    for (int i = 0; i < NP; i++) {
        ap_allreduce_opts_t ro = {0};
        if (clip) {
            ro.reduce = ap_btard_verified_clip;
            ro.reduce_arg = &st[i].vc;
        }
        if (ap_allreduce_start(st[i].svc, &g, st[i].data, elems, 1.0, &ro, on_done, &st[i], NULL))
            goto out;
    }
    uint64_t t0 = ap_sim_now_us(sim);
    if (!ap_sim_run_until(sim, all_done, st, ap_sim_now_us(sim) + 3600ull * 1000000)) goto out;
    double check_s = 0;
    if (clip) { /* the verified step, right after the round */
        uint64_t counts[NP];
        ap_peer_id_t ids[NP];
        if (ap_btard_split(mem, NP, elems, counts)) goto out;
        for (int i = 0; i < NP; i++) ids[i] = mem[i].id;
        for (int i = 0; i < NP; i++) {
            ap_btard_step_cfg_t c = {.peers = ids,
                                     .n = NP,
                                     .counts = counts,
                                     .sent = st[i].sent,
                                     .result = st[i].data,
                                     .weight = 1.0,
                                     .vclip = &st[i].vc,
                                     .tau = tau,
                                     .done = on_verdict,
                                     .arg = &st[i]};
            if (ap_btard_step_start(st[i].step, &c)) goto out;
        }
        if (!ap_sim_run_until(sim, all_checked, st, ap_sim_now_us(sim) + 600ull * 1000000))
            goto out;
        for (int i = 0; i < NP; i++)
            if (!st[i].apply) goto out; /* an honest round must pass */
        check_s = (double)(ap_sim_now_us(sim) - t0) / 1e6;
    }
    *round_s = 0;
    *bytes = 0;
    *part = 0;
    for (int i = 0; i < NP; i++) {
        if (st[i].res.status || st[i].res.averaged_fraction != 1.0) goto out;
        double s = (double)st[i].res.elapsed_us / 1e6;
        if (s > *round_s) *round_s = s;
        ap_rt_stats_t rs;
        ap_rt_get_stats(ap_sim_node(sim, i), &rs);
        *bytes += (double)rs.bytes_sent / NP;
        if (st[i].res.my_part_elems > *part) *part = st[i].res.my_part_elems;
    }
    if (check_s > *round_s) *round_s = check_s; /* round + check, from the start */
    rc = 0;
out:
    for (int i = 0; st && i < NP; i++) {
        ap_btard_step_svc_free(st[i].step);
        ap_btard_svc_free(st[i].mprng);
        ap_btard_vclip_close(&st[i].vc);
        if (st[i].svc) ap_avg_service_free(st[i].svc);
        free(st[i].data);
        free(st[i].sent);
    }
    ap_sim_free(sim);
    free(st);
    return rc;
}

/* CPU seconds of one CenteredClip call over NP copies of a part of d floats
 * (best of 3; the round's copies of its first part, so it iterates as in
 * the round). */
static double clip_cpu_s(uint64_t d, double tau, int *iters)
{
    float *buf = malloc((size_t)NP * d * sizeof(float)), *out = malloc(d * sizeof(float));
    const float *x[NP];
    ap_btard_clip_ws_t *ws = ap_btard_clip_ws_new();
    double best = -1;
    if (!buf || !out || !ws) goto out;
    for (int i = 0; i < NP; i++) { /* the copies of the simulated round */
        x[i] = buf + (size_t)i * d;
        for (uint64_t k = 0; k < d; k++)
            buf[(size_t)i * d + k] =
                (float)sin((double)k * 1e-3) + (float)((k * 31 + (uint64_t)i) % 97) * 1e-3f;
    }
    ap_btard_vclip_t vc = {.clip = {.cfg = ap_btard_clip_cfg_default(), .ws = ws}};
    vc.clip.cfg.tau = tau;
    for (int t = 0; t < 3; t++) {
        uint32_t clipped;
        double t0 = ap_bench_now();
        if (ap_btard_verified_clip(&vc, x, NULL, NP, (size_t)d, out, &clipped)) goto out;
        double el = ap_bench_now() - t0;
        if (best < 0 || el < best) best = el;
        *iters = vc.clip.last.iters;
    }
out:
    ap_btard_vclip_close(&vc);
    ap_btard_clip_ws_free(ws);
    free(buf);
    free(out);
    return best;
}

int ap__bench_btard_round(ap_bench_ctx_t *ctx);
int ap__bench_btard_round(ap_bench_ctx_t *ctx)
{
    ap_log_set_level(AP_LOG_ERROR);
    const uint64_t sizes[2] = {1000, 1000000};
    for (int s = 0; s < 2; s++) {
        uint64_t elems = sizes[s];
        /* tau: below the copies' spread over a part, so CenteredClip iterates */
        double tau = 0.05 * sqrt((double)elems / NP) * 1e-1;
        double tp, tc, bp, bc;
        uint64_t part;
        if (one_round(elems, false, tau, &tp, &bp, &part) ||
            one_round(elems, true, tau, &tc, &bc, &part)) {
            fprintf(stderr, "apiary bench btard: the simulated round failed\n");
            return 1;
        }
        int iters = 0;
        double cpu = clip_cpu_s(part, tau, &iters);
        if (cpu < 0) return 1;
        char f[300];
        snprintf(f, sizeof f,
                 "\"params\":%llu,\"peers\":%d,\"link_mbit\":100,\"plain_round_s\":%.4f,"
                 "\"clip_round_s\":%.4f,\"clip_cpu_s\":%.4f,\"clip_iters\":%d,\"part\":%llu,"
                 "\"simulated\":true",
                 (unsigned long long)elems, NP, tp, tc, cpu, iters, (unsigned long long)part);
        ap_bench_report(ctx, "btard_round_over_plain", (tc + cpu) / tp, "x", f);
        snprintf(f, sizeof f, "\"params\":%llu,\"peers\":%d,\"plain_bytes_per_peer\":%.0f",
                 (unsigned long long)elems, NP, bp);
        ap_bench_report(ctx, "extra_bytes_per_peer", bc - bp, "bytes", f);
    }
    return 0;
}
