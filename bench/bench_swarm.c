/* `apiary bench swarm [--json] [--quick]`: SWARM parallelism.
 *
 * On the network simulator, with the real servers, trainers and
 * rebalancing loop routed by the DHT (testing/swarm_world.h; 4 stages, 12
 * servers of speeds drawn from {1, 2, 4}, links of 2-20 ms and 50-1000
 * Mbit/s, 8 trainers):
 *   swarm_throughput_over_optimum  samples/s the trainers deliver after
 *                                  rebalancing from a bad assignment, over
 *                                  the optimum least stage total (mean over
 *                                  draws; the worst in "worst");
 *   swarm_over_fixed_pipelines     under preemption (every 10 s one server
 *                                  leaves and a new one joins), SWARM vs the
 *                                  same servers wired as fixed
 *                                  one-server-per-stage pipelines (a leaver
 *                                  is replaced in its pipeline and stage);
 *   rebalance_recovery_periods     rebalancing periods (T = 2 s) after each
 *                                  change until the delivered samples/s is
 *                                  >= 0.9 x the new optimum (mean; capped at
 *                                  5, the worst and the share within 2 as
 *                                  fields).
 * The same three on a fluid model of the plan alone (throughput = least
 * stage total, trainers never the limit): fluid_*.
 * On real processes (`apiary swarm server|trainer` on 127.0.0.1, 2 stages,
 * one server each, plain SGD): samples_per_s and bytes_per_sample with
 * blockwise 8-bit activations, against uncompressed. */
#include "bench.h"

#include "apiary/log.h"
#include "apiary/swarm.h"
#include "proc.h"
#include "swarm_optimum.h"
#include "swarm_world.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

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
            m[i] = (ap_swarm_member_t){.peer = pid(i + 100u * (uint32_t)t),
                                       .stage = i < S - 1 ? i + 1 : 0,
                                       .throughput = speeds[rnd() % 3]};
        }
        for (int p = 0; p < 20 && period(m, NSRV) > 0; p++) {
        }
        double r = tput(m) / opt_throughput(m, NSRV);
        sum += r;
        worst = fmin(worst, r);
    }
    char f[128];
    snprintf(f, sizeof f, "\"model\":\"fluid\",\"draws\":%d,\"worst\":%.3f", trials, worst);
    ap_bench_report(c, "fluid_throughput_over_optimum", sum / trials, "ratio", f);

    /* Preemption: SWARM vs fixed pipelines over the same membership. */
    const int periods = c->quick ? 50 : 500;
    ap_swarm_member_t m[NSRV];
    double slot[NSRV]; /* fixed pipelines: slot p*S+s holds a server's speed, 0 = empty */
    uint32_t next = 0;
    for (uint32_t i = 0; i < NSRV; i++) {
        m[i] = (ap_swarm_member_t){
            .peer = pid(next++), .stage = i % S, .throughput = speeds[rnd() % 3]};
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
        m[gone] = (ap_swarm_member_t){
            .peer = pid(next++), .stage = (uint32_t)(rnd() % S), .throughput = v};
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
    ap_bench_report_vs(c, "fluid_over_fixed_pipelines", swarm / periods, "units/s", fixed / periods,
                       f);
    snprintf(f, sizeof f,
             "\"model\":\"fluid\",\"changes\":%d,\"worst\":%d,\"within_2\":%.3f,"
             "\"cap\":10",
             periods, worst_rec, (double)within2 / periods);
    ap_bench_report(c, "fluid_recovery_periods", (double)rec_sum / periods, "periods", f);
}

/* ---- the real implementation on the simulator --------------------------------- */

#define SEC 1000000ull

static ap_test_sw_t *sim_world(uint32_t slots, uint32_t pipelines, bool rebalance, uint64_t seed)
{
    ap_test_sw_cfg_t cfg = {.stages = S,
                            .slots = slots,
                            .trainers = 8,
                            .inflight = 8,
                            .unit = 20,
                            .rebalance = rebalance,
                            .rebalance_us = 2 * SEC,
                            .announce_us = SEC,
                            .hetero_links = true,
                            .pipelines = pipelines,
                            .seed = seed};
    return ap_test_sw_new(&cfg);
}

static double draw_speed(uint64_t *r)
{
    *r = *r * 6364136223846793005ull + 1442695040888963407ull;
    return speeds[(*r >> 33) % 3];
}

/* From a bad assignment (stages 1..3 one server each): delivered / optimum. */
static double sim_optimum(uint64_t seed)
{
    ap_test_sw_t *w = sim_world(NSRV, 0, true, seed);
    if (!w) return -1;
    uint64_t r = seed * 2654435761u + 7;
    for (uint32_t i = 0; i < NSRV; i++)
        if (ap_test_sw_start(w, i, i < S - 1 ? i + 1 : 0, draw_speed(&r))) goto fail;
    ap_test_sw_run(w, 3 * SEC);
    if (ap_test_sw_train(w)) goto fail;
    ap_test_sw_run(w, 40 * SEC);
    const double rate = ap_test_sw_rate(w, 10 * SEC), opt = ap_test_sw_optimum(w);
    ap_test_sw_free(w);
    return opt > 0 ? rate / opt : -1;
fail:
    ap_test_sw_free(w);
    return -1;
}

/* Preemption: every 10 s a random server leaves and a new one of random
 * speed joins (SWARM: at a random stage; fixed: in the leaver's pipeline and
 * stage). Mean samples/s over the changes; SWARM also counts the recovery. */
static double sim_preempt(bool fixed, int changes, uint64_t seed, double *rec_mean, int *rec_worst,
                          double *within2)
{
    const uint32_t K = NSRV / S;
    ap_test_sw_t *w = sim_world(NSRV + K * (uint32_t)changes, fixed ? K : 0, !fixed, seed);
    if (!w) return -1;
    uint64_t r = seed * 40503u + 3;
    for (uint32_t i = 0; i < NSRV; i++)
        if (ap_test_sw_start(w, i, fixed ? i / K : i % S, draw_speed(&r))) goto fail;
    ap_test_sw_run(w, 3 * SEC);
    if (ap_test_sw_train(w)) goto fail;
    ap_test_sw_run(w, 20 * SEC);
    uint32_t live[NSRV];
    for (uint32_t i = 0; i < NSRV; i++) live[i] = i;
    double sum = 0;
    int rec_sum = 0, worst = 0, in2 = 0;
    for (int c = 0; c < changes; c++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t k = (uint32_t)((r >> 33) % NSRV), gone = live[k];
        const double v = draw_speed(&r);
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t stage = fixed ? ap_test_sw_stage(w, gone) : (uint32_t)((r >> 33) % S);
        const uint32_t slot = NSRV + K * (uint32_t)c + gone % K; /* same pipeline */
        ap_test_sw_crash(w, gone);
        if (ap_test_sw_start(w, slot, stage, v)) goto fail;
        live[k] = slot;
        const double opt = fixed ? 0 : ap_test_sw_optimum(w);
        int rec = 5;
        for (int p = 1; p <= 5; p++) {
            const double rate = ap_test_sw_rate(w, 2 * SEC);
            sum += rate / 5;
            if (rec == 5 && opt > 0 && rate >= 0.9 * opt) rec = p;
        }
        rec_sum += rec;
        worst = rec > worst ? rec : worst;
        in2 += rec <= 2;
    }
    ap_test_sw_free(w);
    if (rec_mean) *rec_mean = (double)rec_sum / changes;
    if (rec_worst) *rec_worst = worst;
    if (within2) *within2 = (double)in2 / changes;
    return sum / changes;
fail:
    ap_test_sw_free(w);
    return -1;
}

static int sim(ap_bench_ctx_t *c)
{
    const int draws = c->quick ? 1 : 3, changes = c->quick ? 3 : 10;
    double sum = 0, worst = 1e9;
    for (int d = 0; d < draws; d++) {
        const double x = sim_optimum(72 + (uint64_t)d);
        if (x < 0) return AP_EINVAL;
        sum += x;
        worst = fmin(worst, x);
    }
    char f[200];
    snprintf(f, sizeof f,
             "\"model\":\"sim\",\"stages\":%d,\"servers\":%d,\"trainers\":8,\"draws\":%d,"
             "\"worst\":%.3f",
             S, NSRV, draws, worst);
    ap_bench_report(c, "swarm_throughput_over_optimum", sum / draws, "ratio", f);
    double rec = 0, in2 = 0;
    int rworst = 0;
    const double swarm = sim_preempt(false, changes, 91, &rec, &rworst, &in2);
    const double fixed = sim_preempt(true, changes, 91, NULL, NULL, NULL);
    if (swarm < 0 || fixed < 0) return AP_EINVAL;
    snprintf(f, sizeof f, "\"model\":\"sim\",\"changes\":%d,\"pipelines\":%d,\"every_s\":10",
             changes, NSRV / S);
    ap_bench_report_vs(c, "swarm_over_fixed_pipelines", swarm, "samples/s", fixed, f);
    snprintf(f, sizeof f,
             "\"model\":\"sim\",\"changes\":%d,\"period_s\":2,\"worst\":%d,\"within_2\":%.3f,"
             "\"cap\":5",
             changes, rworst, in2);
    ap_bench_report(c, "rebalance_recovery_periods", rec, "periods", f);
    return 0;
}

/* ---- real processes ------------------------------------------------------------ */

static void stop_proc(pid_t pid)
{
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    if (ap_proc_wait_exit(pid, 30) < 0) waitpid(pid, NULL, WNOHANG);
}

static double after_key(const char *line, const char *key)
{
    const char *p = strstr(line, key);
    return p ? atof(p + strlen(key)) : -1;
}

/* One run: bootstrap, one server per stage, one trainer of `steps`
 * micro-batches; its summary's samples/s and bytes/sample. */
static int procs_run(const char *exe, const char *dir, bool raw, int steps, double *sps,
                     double *bps)
{
    char blog[300], slog[2][300], tlog[300], addr[1100] = "", line[1024], nsteps[16];
    snprintf(blog, sizeof blog, "%s/boot-%d.log", dir, raw);
    char *bav[] = {(char *)exe, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    pid_t boot = ap_proc_spawn_log(exe, bav, blog), srv[2] = {0, 0}, tr = 0;
    int rc = AP_ETIMEDOUT;
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        if (ap_proc_last_line(blog, "  /ip4/127.0.0.1/tcp/", line, sizeof line))
            snprintf(addr, sizeof addr, "%s", line + 2);
    }
    if (!addr[0]) goto out;
    for (int s = 0; s < 2; s++) {
        snprintf(slog[s], sizeof slog[s], "%s/server%d-%d.log", dir, s, raw);
        char *av[20] = {(char *)exe,
                        "swarm",
                        "server",
                        "--run-id",
                        "bench",
                        "--initial-peers",
                        addr,
                        "--listen",
                        "/ip4/127.0.0.1/tcp/0",
                        "--stage",
                        s ? "1" : "0",
                        "--local",
                        "--rebalance-period",
                        "0",
                        "--announce-period",
                        "1"};
        if (raw) av[16] = "--uncompressed";
        srv[s] = ap_proc_spawn_log(exe, av, slog[s]);
    }
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 300 && !ap_proc_grep_file(slog[s], "swarm server ", NULL, 0); k++)
            ap_proc_sleep_ms(100);
    ap_proc_sleep_ms(2000);
    snprintf(tlog, sizeof tlog, "%s/trainer-%d.log", dir, raw);
    snprintf(nsteps, sizeof nsteps, "%d", steps);
    char *tav[16] = {(char *)exe, "swarm",   "trainer", "--run-id",   "bench", "--initial-peers",
                     addr,        "--steps", nsteps,    "--inflight", "4"};
    if (raw) tav[11] = "--uncompressed";
    tr = ap_proc_spawn_log(exe, tav, tlog);
    if (ap_proc_wait_exit(tr, 600) != 0) {
        rc = AP_EPROTO;
        goto out;
    }
    if (!ap_proc_last_line(tlog, "summary:", line, sizeof line)) goto out;
    *sps = after_key(line, "samples/s ");
    *bps = after_key(line, "bytes/sample ");
    rc = *sps > 0 && *bps > 0 ? 0 : AP_EPROTO;
out:
    for (int s = 0; s < 2; s++) stop_proc(srv[s]);
    stop_proc(boot);
    if (rc) fprintf(stderr, "bench swarm: the process run failed (logs in %s)\n", dir);
    return rc;
}

static int procs(ap_bench_ctx_t *c)
{
    char exe[1024];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el <= 0) return AP_ENOTFOUND;
    exe[el] = 0;
    char dir[] = "/tmp/apiary-bench-swarm-XXXXXX";
    if (!mkdtemp(dir)) return AP_EIO;
    const int steps = c->quick ? 20 : 150;
    double s8 = 0, b8 = 0, sr = 0, br = 0;
    int rc = procs_run(exe, dir, false, steps, &s8, &b8);
    if (!rc) rc = procs_run(exe, dir, true, steps, &sr, &br);
    if (rc) return rc;
    char f[200];
    snprintf(f, sizeof f,
             "\"mode\":\"processes\",\"stages\":2,\"servers\":2,\"steps\":%d,"
             "\"codec\":\"blockwise8\",\"load1\":%.2f",
             steps, ap_bench_load1());
    ap_bench_report_vs(c, "samples_per_s", s8, "samples/s", sr, f);
    ap_bench_report_vs(c, "bytes_per_sample", b8, "bytes", br, f);
    return 0;
}

static int bench_swarm(ap_bench_ctx_t *c, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    ap_log_set_level(AP_LOG_ERROR); /* the simulated failures are expected */
    int rc = sim(c);
    if (rc) {
        fprintf(stderr, "bench swarm: the simulated runs failed: %s\n", ap_strerror(rc));
        return 1;
    }
    fluid(c);
    rc = procs(c);
    if (rc) {
        fprintf(stderr, "bench swarm: the process runs failed: %s\n", ap_strerror(rc));
        return 1;
    }
    return 0;
}

AP_BENCH(bench_swarm_def, "swarm", bench_swarm,
         "SWARM: throughput vs optimum and fixed pipelines, recovery (simulator), processes");
