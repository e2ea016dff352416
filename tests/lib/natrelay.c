/* The relayed-training scenario of the e2e NAT tests: see natrelay.h. */
#include "natrelay.h"

#include "aptest.h"
#include "natns.h"
#include "procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NPROC 3 /* the relay, peer 0, peer 1 */

static ap_natns_t *g_ns;
static pid_t g_pids[NPROC];
static char g_dir[64];
static char g_logs[NPROC][300];

int ap_natrelay_teardown(void **state)
{
    (void)state;
    ap_natns_kill_all(g_pids, NPROC);
    ap_natns_free(g_ns);
    g_ns = NULL;
    if (g_dir[0] && getenv("APIARY_TEST_KEEP_LOGS")) {
        print_message("logs kept in %s\n", g_dir);
    } else if (g_dir[0]) {
        for (size_t i = 0; i < NPROC; i++)
            if (g_logs[i][0]) unlink(g_logs[i]);
        rmdir(g_dir);
    }
    g_dir[0] = 0;
    memset(g_logs, 0, sizeof g_logs);
    return 0;
}

/* The `relays:` line printed at exit (tools/apiary/addrs.c). */
static void parse_stats(ap_natrelay_peer_t *p)
{
    char line[1024];
    if (!ap_proc_grep_file(p->log, "apiary train: relays: ", line, sizeof line)) return;
    const char *s = strstr(line, "relays: ");
    p->have_stats =
        sscanf(s,
               "relays: reservations %u (live %u) | relayed connections in %llu, out %llu | hole "
               "punches %u: direct %u, failed %u | moved to direct %llu | bulk refused %llu",
               &p->reservations, &p->live, &p->relayed_in, &p->relayed_out, &p->punches, &p->direct,
               &p->failed, &p->moved, &p->bulk_refused) == 9;
}

static void parse_peer(ap_natrelay_peer_t *p)
{
    parse_stats(p);
    char sum[1024];
    if (ap_proc_grep_file(p->log, "summary: epochs ", sum, sizeof sum))
        sscanf(strstr(sum, "epochs "), "epochs %llu", &p->epochs);
    p->group2 = ap_proc_grep_file(p->log, "| group 2 |", NULL, 0);
    if (ap_proc_grep_file(p->log, ": direct connection after ", p->punch_line,
                          sizeof p->punch_line))
        p->punch_line[strcspn(p->punch_line, "\n")] = 0;
}

void ap_natrelay_print(const char *name, const ap_natrelay_peer_t *p)
{
    print_message("%s: exit %d, epochs %llu, group 2 %s; reservations %u (live %u), relayed in "
                  "%llu out %llu, hole punches %u: direct %u failed %u, moved to direct %llu, "
                  "bulk refused %llu%s%s\n",
                  name, p->status, p->epochs, p->group2 ? "yes" : "no", p->reservations, p->live,
                  p->relayed_in, p->relayed_out, p->punches, p->direct, p->failed, p->moved,
                  p->bulk_refused, p->punch_line[0] ? "\n  " : "", p->punch_line);
}

void ap_natrelay_run(const ap_natrelay_opts_t *o, ap_natrelay_peer_t out[2])
{
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    const ap_nat_kind_t kinds[2] = {AP_NAT_DROP, AP_NAT_DROP};
    if (ap_natns_new(1, 2, kinds, &g_ns, why, sizeof why)) fail_msg("topology: %s", why);
    for (size_t k = 0; k < 2 && o->delay_ms; k++) {
        int rc = ap_natns_set_delay(g_ns, k, o->delay_ms, why, sizeof why);
        if (rc == AP_ENOTSUP) { /* no sch_netem in this kernel: run without delay */
            print_message("no netem here, links without delay: %s\n", why);
            break;
        }
        if (rc) fail_msg("delay: %s", why);
    }
    snprintf(g_dir, sizeof g_dir, "/tmp/apiary-e2e-natrelay-XXXXXX");
    assert_non_null(mkdtemp(g_dir));
    for (size_t i = 0; i < NPROC; i++)
        snprintf(g_logs[i], sizeof g_logs[i], "%s/%s.log", g_dir, i ? i == 1 ? "a" : "b" : "relay");

    /* the relay: the only public node, also the DHT the peers meet in */
    char *rargv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/0.0.0.0/tcp/4001",
                     "--relay-service",     NULL};
    g_pids[0] = ap_test_spawn_in_ns(ap_natns_public_name(g_ns, 0), rargv, g_logs[0]);
    char want[64], line[1024], relay[512];
    snprintf(want, sizeof want, "  /ip4/%s/tcp/4001/p2p/", ap_natns_public_ip(g_ns, 0));
    if (!ap_test_wait_line(g_logs[0], want, line, sizeof line, 30))
        fail_msg("the relay did not print its address %s", want);
    line[strcspn(line, "\n")] = 0;
    snprintf(relay, sizeof relay, "%s", strstr(line, "/ip4/"));

    char dur[16];
    snprintf(dur, sizeof dur, "%d", o->duration_s);
    for (size_t k = 0; k < 2; k++) {
        char seed[8];
        snprintf(seed, sizeof seed, "%zu", k + 1);
        char *av[32] = {(char *)ap_test_cli(),
                        "train",
                        "--run-id",
                        "natrelay",
                        "--initial-peers",
                        relay,
                        "--relays",
                        relay,
                        "--no-port-map",
                        "--model",
                        "mlp",
                        "--target-batch-size",
                        "32",
                        "--batch-size",
                        "8",
                        "--duration",
                        dur,
                        "--seed",
                        seed,
                        "--matchmaking-window",
                        "0.5",
                        "--slowdown",
                        "10",
                        "--log-level",
                        "info"};
        size_t n = 25;
        if (o->no_hole_punch) av[n++] = "--no-hole-punch";
        if (o->relay_bulk) av[n++] = "--relay-bulk";
        av[n] = NULL;
        g_pids[1 + k] = ap_test_spawn_in_ns(ap_natns_home_name(g_ns, k), av, g_logs[1 + k]);
    }
    for (size_t k = 0; k < 2; k++) {
        memset(&out[k], 0, sizeof out[k]);
        snprintf(out[k].log, sizeof out[k].log, "%s", g_logs[1 + k]);
        out[k].status = ap_proc_wait_exit(g_pids[1 + k], o->duration_s + 120);
        g_pids[1 + k] = 0;
        parse_peer(&out[k]);
    }
}
