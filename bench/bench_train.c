/* `apiary bench train`: collaborative training throughput on loopback with
 * real processes (a DHT bootstrap node + N `apiary train` peers over TCP +
 * Noise), N = 1, 2, 4.
 *   samples_per_s       global samples/s of N peers (field peers)
 *   scaling_efficiency  samples/s(N) / (N * samples/s(1)), baseline = the
 *                       single peer measured in the same run (peers 2, 4)
 *   time_efficiency     the peers' mean compute share / the single peer's
 *                       (peers 2, 4): the wall time the collaboration costs
 *                       (waiting for groups, rounds, downloads, reports),
 *                       independent of how much CPU other load leaves to the
 *                       run, which scaling_efficiency also measures
 *   bytes_per_sample    bytes sent by all peers / samples (peers 2, 4)
 *   compute_share       per peer (field peer): the share of its wall time spent
 *                       computing batches; fields group (waiting for a group),
 *                       averaging (rounds + step), download (state), idle (the
 *                       rest: reports, reads, held submits) and overshoot
 *                       (mean samples averaged per epoch past the target,
 *                       relative to it); synchronous time only: with delayed
 *                       updates the background rounds are not counted
 *   samples_per_cpu_s   samples / CPU seconds (user + system) of the peer
 *                       and bootstrap processes of that run (getrusage of
 *                       the children): robust to other load on the machine
 * `apiary bench train --dht-matchmaking` runs the same with groups formed
 * by the averaging module's DHT matchmaker (every line then carries
 * "dht_matchmaking":true).
 * The machine has 2 shared cores, so every peer runs with --slowdown 3 (it
 * sleeps 3x its compute time after each batch, like a slower accelerator):
 * four peers then need about one core for compute and the measurement shows
 * the collaboration's overhead rather than CPU contention. */
#include "bench.h"
#include "proc.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Runs N peers for dur seconds; returns 0 and the totals. */
static double children_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

/* One peer's shares of its wall time (its "time:" summary line). */
typedef struct shares {
    double compute, group, averaging, download, idle, overshoot;
    unsigned long long epochs;
} shares_t;

static int run_n(const char *exe, const char *dir, int n, bool delayed, bool dhtmm, double dur,
                 double *sps, double *bps, double *spc, shares_t *sh)
{
    double cpu0 = children_cpu_s();
    char blog[600], addr[1100] = "", line[1100];
    snprintf(blog, sizeof blog, "%s/boot%d%s.log", dir, n, delayed ? "d" : "");
    char *bargv[] = {(char *)exe, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    pid_t boot = ap_proc_spawn_log(exe, bargv, blog);
    for (int i = 0; i < 100 && !addr[0]; i++) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
        if (ap_proc_last_line(blog, "  /ip4/127.0.0.1/tcp/", line, sizeof line)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(addr, sizeof addr, "%s", line + 2);
        }
    }
    if (!addr[0]) {
        kill(boot, SIGTERM);
        waitpid(boot, NULL, 0);
        return -1;
    }
    pid_t pids[8];
    char logs[8][600];
    char target[32], durs[32];
    snprintf(target, sizeof target, "%d", 512 * n);
    snprintf(durs, sizeof durs, "%.0f", dur);
    for (int i = 0; i < n; i++) {
        char seed[16];
        snprintf(seed, sizeof seed, "%d", i + 1);
        snprintf(logs[i], sizeof logs[i], "%s/n%d%s_peer%d.log", dir, n, delayed ? "d" : "", i);
        char *av[] = {(char *)exe,
                      "train",
                      "--run-id",
                      "bench",
                      "--initial-peers",
                      addr,
                      "--listen",
                      "/ip4/127.0.0.1/tcp/0",
                      "--target-batch-size",
                      target,
                      "--batch-size",
                      "16",
                      "--duration",
                      durs,
                      "--slowdown",
                      "3",
                      "--seed",
                      seed,
                      delayed ? "--delayed-updates"
                      : dhtmm ? "--dht-matchmaking"
                              : NULL,
                      delayed && dhtmm ? "--dht-matchmaking" : NULL,
                      NULL};
        pids[i] = ap_proc_spawn_log(exe, av, logs[i]);
    }
    for (int i = 0; i < n; i++) waitpid(pids[i], NULL, 0);
    kill(boot, SIGTERM);
    waitpid(boot, NULL, 0);
    double samples = 0, bytes = 0, el = 0;
    for (int i = 0; i < n; i++) {
        if (!ap_proc_last_line(logs[i], "summary:", line, sizeof line)) return -1;
        double lsps = 0, secs = 0;
        unsigned long long sent = 0;
        const char *p = strstr(line, "local ");
        const char *q = strstr(line, "bytes sent ");
        const char *r = strrchr(line, '|');
        if (!p || !q || !r || sscanf(p, "local %lf", &lsps) != 1 ||
            sscanf(q, "bytes sent %llu", &sent) != 1 || sscanf(r, "| %lfs", &secs) != 1)
            return -1;
        samples += lsps * secs;
        shares_t *t = &sh[i];
        memset(t, 0, sizeof *t);
        if (ap_proc_last_line(logs[i], "time:", line, sizeof line))
            sscanf(line,
                   "time: compute %lf | group %lf | averaging %lf | download %lf | idle %lf | "
                   "overshoot %lf | epochs %llu",
                   &t->compute, &t->group, &t->averaging, &t->download, &t->idle, &t->overshoot,
                   &t->epochs);
        bytes += (double)sent;
        if (secs > el) el = secs;
    }
    *sps = el > 0 ? samples / el : 0;
    *bps = samples > 0 ? bytes / samples : 0;
    double cpu = children_cpu_s() - cpu0;
    *spc = cpu > 0 ? samples / cpu : 0;
    return 0;
}

static int bench_train(ap_bench_ctx_t *c, int argc, char **argv)
{
    char exe[1024];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el <= 0) return 1;
    exe[el] = 0;
    char dir[] = "/tmp/apiary-bench-train-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    double dur = c->quick ? 15 : 60;
    double sps[5] = {0}, bps[5] = {0}, spc[5] = {0};
    shares_t sh[8];
    double share1 = 0; /* the single peer's compute share */
    bool dhtmm = false;
    for (int i = 1; i < argc; i++) { /* argv[0] is the bench's name */
        if (strcmp(argv[i], "--dht-matchmaking") == 0) {
            dhtmm = true;
        } else {
            fprintf(stderr, "bench train: unknown option %s (only --dht-matchmaking)\n", argv[i]);
            return 2;
        }
    }
    /* 1, 2, 4 peers synchronous, then 2 and 4 with delayed updates (the
     * single-peer rate of the same run is the reference for both) */
    const int ns[5] = {1, 2, 4, 2, 4};
    for (int k = 0; k < 5; k++) {
        int n = ns[k];
        bool delayed = k >= 3;
        if (run_n(exe, dir, n, delayed, dhtmm, dur, &sps[n], &bps[n], &spc[n], sh) != 0) {
            fprintf(stderr, "bench train: the %d-peer run failed (logs in %s)\n", n, dir);
            return 1;
        }
        char f[128];
        snprintf(f, sizeof f, "\"peers\":%d,\"slowdown\":3,\"delayed_updates\":%s%s", n,
                 delayed ? "true" : "false", dhtmm ? ",\"dht_matchmaking\":true" : "");
        ap_bench_report(c, "samples_per_s", sps[n], "samples/s", f);
        ap_bench_report(c, "samples_per_cpu_s", spc[n], "samples/cpu-s", f);
        /* per peer: where its wall time went, and the epochs' overshoot */
        double share = 0;
        for (int i = 0; i < n; i++) {
            share += sh[i].compute / n;
            char g[400];
            snprintf(g, sizeof g,
                     "%s,\"peer\":%d,\"group\":%.3f,\"averaging\":%.3f,\"download\":%.3f,"
                     "\"idle\":%.3f,\"overshoot\":%.3f,\"epochs\":%llu",
                     f, i, sh[i].group, sh[i].averaging, sh[i].download, sh[i].idle,
                     sh[i].overshoot, sh[i].epochs);
            ap_bench_report(c, "compute_share", sh[i].compute, "ratio", g);
        }
        if (n == 1) share1 = share;
        if (n > 1) {
            char g[200];
            snprintf(g, sizeof g, "%s,\"single_peer_samples_per_s\":%.1f", f, sps[1]);
            ap_bench_report(c, "scaling_efficiency", sps[1] > 0 ? sps[n] / (n * sps[1]) : 0,
                            "ratio", g);
            snprintf(g, sizeof g, "%s,\"single_peer_compute_share\":%.3f", f, share1);
            ap_bench_report(c, "time_efficiency", share1 > 0 ? share / share1 : 0, "ratio", g);
            ap_bench_report(c, "bytes_per_sample", bps[n], "B", f);
        }
    }
    return 0;
}

AP_BENCH(bench_train_def, "train", bench_train,
         "collaborative training on loopback: samples/s of 1, 2, 4 peer processes")
