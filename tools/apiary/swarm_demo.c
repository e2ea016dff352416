/* `apiary swarm demo`: SWARM on this machine, as real processes over TCP on
 * 127.0.0.1: a DHT bootstrap node, 3 pipeline stages served by unequal
 * numbers of `apiary swarm server` processes (3, 2, 2) and 2 `apiary swarm
 * trainer` processes. Midway a stage-2 server is killed (SIGKILL), leaving
 * stage 2 the bottleneck; the servers' rebalancing loop moves one server
 * there, which downloads the stage's state first. Prints the trainers'
 * status and the moves as they happen and a summary (samples/s, servers per
 * stage over time, bytes per sample, loss). */
#include "cli.h"
#include "proc.h"
#include "swarm_cli.h"

#include "apiary/nn.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NSRV 7
#define NTRN 2

typedef struct dproc {
    pid_t pid;
    char log[512];
    bool alive;
    int moves; /* rebalancing lines printed */
} dproc_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The k-th (from 0) line of a log starting with prefix, without its newline. */
static bool nth_line(const char *path, const char *prefix, int k, char *out, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    const size_t pl = strlen(prefix);
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, prefix, pl) || k-- > 0) continue;
        line[strcspn(line, "\n")] = 0;
        snprintf(out, n, "%s", line);
        found = true;
        break;
    }
    fclose(f);
    return found;
}

static void reap(dproc_t *p)
{
    int st;
    if (p->alive && waitpid(p->pid, &st, WNOHANG) == p->pid) p->alive = false;
}

static void stop(dproc_t *p)
{
    if (p->alive) kill(p->pid, SIGTERM);
    for (int i = 0; i < 100 && p->alive; i++) {
        reap(p);
        ap_proc_sleep_ms(100);
    }
    if (p->alive) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, NULL, 0);
        p->alive = false;
    }
}

int ap_swarm_demo_main(int argc, char **argv)
{
    double total = 120;
    static const struct option lopts[] = {{"duration", required_argument, NULL, 'd'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", lopts, NULL)) != -1) {
        if (ch == 'd') {
            if (!ap_cli_num("--duration", optarg, 20, 86400, &total)) return 2;
        } else {
            printf("usage: apiary swarm demo [--duration S]\n"
                   "Runs a DHT bootstrap node, 3 pipeline stages served by 3, 2 and 2 `apiary\n"
                   "swarm server` processes and 2 `apiary swarm trainer` processes on 127.0.0.1;\n"
                   "kills a stage-2 server midway; the servers' rebalancing moves one to the\n"
                   "bottleneck. About two minutes (default 120 s).\n");
            return ch == 'h' ? 0 : 2;
        }
    }
    char exe[1024];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el <= 0) {
        fprintf(stderr, "apiary swarm demo: cannot find my own executable\n");
        return 1;
    }
    exe[el] = 0;
    char dir[] = "/tmp/apiary-swarm-demo-XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "apiary swarm demo: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    ap_cli_catch_stop();
    printf("apiary swarm demo: real processes on 127.0.0.1 (TCP + Noise), logs in %s\n", dir);
    dproc_t boot = {0};
    snprintf(boot.log, sizeof boot.log, "%s/bootstrap.log", dir);
    char *bargv[] = {exe, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    boot.pid = ap_proc_spawn_log(exe, bargv, boot.log);
    boot.alive = boot.pid > 0;
    char addr[1100] = "";
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        char line[1024];
        if (ap_proc_last_line(boot.log, "  /ip4/127.0.0.1/tcp/", line, sizeof line))
            snprintf(addr, sizeof addr, "%s", line + 2);
    }
    if (!addr[0]) {
        fprintf(stderr, "apiary swarm demo: the bootstrap node did not start (see %s)\n", boot.log);
        stop(&boot);
        return 1;
    }
    printf("bootstrap node: %s\n", addr);
    const double t0 = now_s();
    dproc_t srv[NSRV] = {0}, trn[NTRN] = {0};
    const char *stage_of[NSRV] = {"0", "0", "0", "1", "1", "2", "2"};
    const double kill_at = total * 0.4;
    for (int i = 0; i < NSRV; i++) {
        snprintf(srv[i].log, sizeof srv[i].log, "%s/server%d.log", dir, i);
        char *av[] = {exe,
                      "swarm",
                      "server",
                      "--run-id",
                      "demo",
                      "--stages",
                      "3",
                      "--initial-peers",
                      addr,
                      "--listen",
                      "/ip4/127.0.0.1/tcp/0",
                      "--stage",
                      (char *)stage_of[i],
                      "--rebalance-period",
                      "6",
                      "--log-level",
                      "warn",
                      NULL};
        srv[i].pid = ap_proc_spawn_log(exe, av, srv[i].log);
        srv[i].alive = srv[i].pid > 0;
        printf("%5.1fs  started server%d (stage %s), pid %d\n", now_s() - t0, i, stage_of[i],
               (int)srv[i].pid);
    }
    ap_proc_sleep_ms(3000); /* let them announce */
    char dur[32];
    snprintf(dur, sizeof dur, "%.0f", total - (now_s() - t0) - 5);
    for (int i = 0; i < NTRN; i++) {
        snprintf(trn[i].log, sizeof trn[i].log, "%s/trainer%d.log", dir, i);
        char seed[16];
        snprintf(seed, sizeof seed, "%d", 7 + i);
        char *av[] = {exe,  "swarm",           "trainer", "--run-id",   "demo", "--stages",
                      "3",  "--initial-peers", addr,      "--duration", dur,    "--seed",
                      seed, "--log-level",     "warn",    NULL};
        trn[i].pid = ap_proc_spawn_log(exe, av, trn[i].log);
        trn[i].alive = trn[i].pid > 0;
        printf("%5.1fs  started trainer%d, pid %d\n", now_s() - t0, i, (int)trn[i].pid);
    }
    fflush(stdout);
    bool killed = false;
    double last_print = 0;
    char over_time[4096] = "";
    while (!ap_cli_stop_signal()) {
        ap_proc_sleep_ms(250);
        for (int i = 0; i < NSRV; i++) reap(&srv[i]);
        for (int i = 0; i < NTRN; i++) reap(&trn[i]);
        const double t = now_s() - t0;
        if (!killed && t >= kill_at) {
            kill(srv[NSRV - 1].pid, SIGKILL);
            killed = true;
            printf("%5.1fs  killed server%d (stage 2) with SIGKILL\n", t, NSRV - 1);
        }
        for (int i = 0; i < NSRV; i++) {
            char line[1024];
            if (srv[i].moves < 4 &&
                nth_line(srv[i].log, "rebalancing:", srv[i].moves, line, sizeof line)) {
                srv[i].moves++;
                printf("%5.1fs  server%d: %s\n", t, i, line);
            }
        }
        if (t - last_print >= 5) {
            last_print = t;
            char line[1024];
            if (ap_proc_last_line(trn[0].log, "t ", line, sizeof line)) {
                printf("%5.1fs  trainer0: %s\n", t, line);
                const char *sp = strstr(line, "servers per stage ");
                if (sp) {
                    int a = 0, b = 0, c = 0;
                    if (sscanf(sp + 18, "%d %d %d", &a, &b, &c) == 3) {
                        size_t n = strlen(over_time);
                        snprintf(over_time + n, sizeof over_time - n, " %d/%d/%d", a, b, c);
                    }
                }
            }
            fflush(stdout);
        }
        if (!trn[0].alive && !trn[1].alive) break;
    }
    for (int i = 0; i < NTRN; i++) stop(&trn[i]);
    for (int i = 0; i < NSRV; i++) stop(&srv[i]);
    stop(&boot);
    char line[1024];
    for (int i = 0; i < NSRV; i++)
        if (ap_proc_last_line(srv[i].log, "stage ", line, sizeof line))
            printf("server%d: %s\n", i, line);
    printf("\nsummary:\n");
    int ok = 0;
    for (int i = 0; i < NTRN; i++) {
        if (ap_proc_last_line(trn[i].log, "summary:", line, sizeof line)) {
            printf("  trainer%d %s\n", i, line + 9);
            float first = 0, last = 0;
            unsigned long long failed = 1;
            const char *f = strstr(line, "failed ");
            const char *l = strstr(line, "loss first ");
            if (f) failed = strtoull(f + 7, NULL, 10);
            if (l && sscanf(l, "loss first %f last %f", &first, &last) == 2 && last < first &&
                failed == 0)
                ok++;
        } else {
            printf("  trainer%d: no summary (see %s)\n", i, trn[i].log);
        }
    }
    printf("servers per stage over time (every 5 s, stage 0/1/2):%s\n", over_time);
    printf("logs: %s\n", dir);
    return ok == NTRN ? 0 : 1;
}
