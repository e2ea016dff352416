/* `apiary demo`: a whole collaboration on this machine, as real processes
 * talking TCP on 127.0.0.1: a DHT bootstrap node (`apiary dht`) and four
 * `apiary train` peers on the shipped corpus (one client-only, one slower).
 * Midway one peer is killed (SIGKILL) and a fresh one joins and catches up by
 * downloading the state. Prints the loss as it falls and a summary. */
#include "cli.h"
#include "curve_svg.h"
#include "proc.h"

#include "apiary/nn.h"

#include <errno.h>
#include <math.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NPROC 6 /* 4 peers + the fresh one + spare */

typedef struct proc {
    pid_t pid;
    char log[512];
    char name[32];
    bool alive, killed;
    double started, ended;
} proc_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static bool log_has(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

static void reap(proc_t *p, int n)
{
    int st;
    for (int i = 0; i < n; i++)
        if (p[i].alive && waitpid(p[i].pid, &st, WNOHANG) == p[i].pid) {
            p[i].alive = false;
            p[i].ended = now_s();
        }
}

static int demo_main(int argc, char **argv)
{
    double total = 120, kill_at = 45, join_at = 55;
    static const struct option lopts[] = {{"duration", required_argument, NULL, 'd'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", lopts, NULL)) != -1) {
        if (ch == 'd') {
            if (!ap_cli_num("--duration", optarg, 20, 86400, &total)) return 2;
            kill_at = total * 0.375;
            join_at = total * 0.46;
        } else {
            printf("usage: apiary demo [--duration S]\n"
                   "Runs a DHT bootstrap node and 4 `apiary train` peers as processes on\n"
                   "127.0.0.1 (one client-only, one 3x slower) training the model kit's GPT on\n"
                   "the shipped corpus; kills one peer midway and starts a fresh one that\n"
                   "catches up by downloading the state. About two minutes (default 120 s).\n");
            return ch == 'h' ? 0 : 2;
        }
    }
    char exe[1024];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el <= 0) {
        fprintf(stderr, "apiary demo: cannot find my own executable\n");
        return 1;
    }
    exe[el] = 0;
    const char *corpus = ap_nn_default_corpus();
    if (access(corpus, R_OK) != 0) {
        fprintf(stderr, "apiary demo: the shipped corpus %s is missing (set APIARY_DATA)\n",
                corpus);
        return 1;
    }
    char dir[] = "/tmp/apiary-demo-XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "apiary demo: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    ap_cli_catch_stop(); /* the peers are stopped and collected, then the demo exits 0 */
    printf("apiary demo: real processes on 127.0.0.1 (TCP + Noise), logs in %s\n", dir);

    /* bootstrap node */
    proc_t boot = {0};
    snprintf(boot.log, sizeof boot.log, "%s/bootstrap.log", dir);
    char *bargv[] = {exe,      "dht",         "--listen", "/ip4/127.0.0.1/tcp/0",
                     "--http", "127.0.0.1:0", "--run-id", "demo",
                     NULL};
    boot.pid = ap_proc_spawn_log(exe, bargv, boot.log);
    boot.alive = boot.pid > 0;
    char addr[1100] = "";
    for (int i = 0; i < 100 && !addr[0]; i++) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
        char line[1024];
        if (ap_proc_last_line(boot.log, "  /ip4/127.0.0.1/tcp/", line, sizeof line))
            snprintf(addr, sizeof addr, "%s", line + 2);
    }
    if (!addr[0]) {
        fprintf(stderr, "apiary demo: the bootstrap node did not start (see %s)\n", boot.log);
        if (boot.alive) kill(boot.pid, SIGTERM);
        return 1;
    }
    printf("bootstrap node: %s\n", addr);
    char mline[1024];
    if (ap_proc_last_line(boot.log, "monitor of run demo at ", mline, sizeof mline))
        printf("live dashboard: %s", mline + strlen("monitor of run demo at "));

    proc_t p[NPROC] = {0};
    int np = 0;
    double t0 = now_s();
    char dur[32];
    const char *roles[5] = {"normal", "normal", "slow (3x)", "client-only", "fresh newcomer"};
#define START_PEER(i, extra1, extra2)                                                              \
    do {                                                                                           \
        snprintf(p[i].log, sizeof p[i].log, "%s/peer%d.log", dir, i);                              \
        snprintf(p[i].name, sizeof p[i].name, "peer%d", i);                                        \
        snprintf(dur, sizeof dur, "%.0f", total - (now_s() - t0) - 3);                             \
        char seed[16];                                                                             \
        snprintf(seed, sizeof seed, "%d", 100 + i);                                                \
        char *av[] = {exe,                                                                         \
                      "train",                                                                     \
                      "--run-id",                                                                  \
                      "demo",                                                                      \
                      "--initial-peers",                                                           \
                      addr,                                                                        \
                      "--listen",                                                                  \
                      "/ip4/127.0.0.1/tcp/0",                                                      \
                      "--target-batch-size",                                                       \
                      "512",                                                                       \
                      "--batch-size",                                                              \
                      "16",                                                                        \
                      "--duration",                                                                \
                      dur,                                                                         \
                      "--seed",                                                                    \
                      seed,                                                                        \
                      "--average-state-every",                                                     \
                      "4",                                                                         \
                      "--log-level",                                                               \
                      "info",                                                                      \
                      extra1,                                                                      \
                      extra2,                                                                      \
                      NULL};                                                                       \
        p[i].pid = ap_proc_spawn_log(exe, av, p[i].log);                                           \
        p[i].alive = p[i].pid > 0;                                                                 \
        p[i].started = now_s();                                                                    \
        printf("%5.1fs  started %s (%s), pid %d\n", now_s() - t0, p[i].name, roles[i],             \
               (int)p[i].pid);                                                                     \
    } while (0)

    START_PEER(0, NULL, NULL);
    np = 1;
    struct timespec gap = {1, 0};
    nanosleep(&gap, NULL);
    START_PEER(1, NULL, NULL);
    START_PEER(2, "--slowdown", "2");
    START_PEER(3, "--client", NULL);
    np = 4;
    fflush(stdout);

    bool killed = false, joined = false, caught_said = false;
    double last_print = 0;
    int peers_over_time[64] = {0};
    int nsample = 0;
    while (now_s() - t0 < total && !ap_cli_stop_signal()) {
        struct timespec ts = {0, 250 * 1000 * 1000};
        nanosleep(&ts, NULL);
        reap(p, np);
        double t = now_s() - t0;
        if (!killed && t >= kill_at) {
            kill(p[1].pid, SIGKILL);
            p[1].killed = true;
            killed = true;
            printf("%5.1fs  killed peer1 with SIGKILL (mid-training)\n", t);
        }
        if (!joined && t >= join_at) {
            START_PEER(4, NULL, NULL);
            np = 5;
            joined = true;
        }
        if (t - last_print >= 5) {
            last_print = t;
            int alive = 0;
            for (int i = 0; i < np; i++) alive += p[i].alive;
            if (nsample < 64) peers_over_time[nsample++] = alive;
            char line[1024] = "";
            int src = p[0].alive ? 0 : 4;
            if (ap_proc_last_line(p[src].log, "epoch ", line, sizeof line))
                printf("%5.1fs  %d peers | %s: %s\n", t, alive, p[src].name, line);
            else
                printf("%5.1fs  %d peers | joining...\n", t, alive);
            if (joined && !caught_said && log_has(p[4].log, "caught up")) {
                char cl[1024];
                if (ap_proc_last_line(p[4].log, "caught up", cl, sizeof cl))
                    printf("         peer4 %s\n", cl);
                caught_said = true;
            }
            fflush(stdout);
        }
        bool any = false;
        for (int i = 0; i < np; i++) any |= p[i].alive;
        if (!any && joined) break;
    }
    /* stop everyone that is left and collect */
    for (int i = 0; i < np; i++)
        if (p[i].alive) kill(p[i].pid, SIGTERM);
    for (int w = 0; w < 100; w++) {
        reap(p, np);
        bool any = false;
        for (int i = 0; i < np; i++) any |= p[i].alive;
        if (!any) break;
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < np; i++)
        if (p[i].alive) kill(p[i].pid, SIGKILL);
    reap(p, np);
    kill(boot.pid, SIGTERM);
    waitpid(boot.pid, NULL, 0);

    printf("\nloss over the run (%s, one line per epoch, every 4th shown):\n", p[0].name);
    FILE *f = fopen(p[0].log, "r");
    char line[1024];
    int k = 0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "epoch ", 6) == 0 && k++ % 4 == 0) printf("  %s", line);
    if (f) fclose(f);

    printf("\nsummary (per process):\n");
    for (int i = 0; i < np; i++) {
        char s[1024];
        if (ap_proc_last_line(p[i].log, "summary:", s, sizeof s))
            printf("  %-6s %-15s %s\n", p[i].name, roles[i], s + 9);
        else
            printf("  %-6s %-15s %s\n", p[i].name, roles[i],
                   p[i].killed ? "killed with SIGKILL (no summary)" : "no summary (see its log)");
    }
    /* the loss curves, drawn */
    ap_cli_curve_t *curves = calloc((size_t)np, sizeof *curves);
    char svg[600];
    snprintf(svg, sizeof svg, "%s/loss.svg", dir);
    double final = NAN;
    if (curves) {
        for (int i = 0; i < np; i++) {
            ap_cli_curve_read(p[i].log, &curves[i]);
            curves[i].name = p[i].name;
        }
        const ap_cli_curve_t *fc = curves[0].n ? &curves[0] : np > 4 ? &curves[4] : NULL;
        if (fc && fc->n) final = fc->loss[fc->n - 1];
        char ref[64];
        snprintf(ref, sizeof ref, "0.6 ln 256 = %.2f", 0.6 * log(256.0));
        if (ap_cli_curve_svg(svg, curves, np, 0.6 * log(256.0), ref))
            printf("loss curve: %s\n", svg);
        else
            fprintf(stderr, "apiary demo: cannot write %s\n", svg);
        free(curves);
    }
    if (isfinite(final)) printf("final loss %.4f (%.2f x ln 256)\n", final, final / log(256.0));
    printf("peers alive over time (every 5 s):");
    for (int i = 0; i < nsample; i++) printf(" %d", peers_over_time[i]);
    printf("\n");
    bool caught = log_has(p[4].log, "caught up") || log_has(p[4].log, "state loads 1");
    printf("fresh peer caught up by state download: %s\n", caught ? "yes" : "NO");
    printf("logs: %s\n", dir);
    return caught ? 0 : 1;
}

AP_CLI_COMMAND(cmd_demo, "demo", demo_main,
               "run a whole collaboration on this machine (bootstrap + 4 peers, ~2 minutes)")
