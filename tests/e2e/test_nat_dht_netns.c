/* `apiary dht` nodes through real NATs (testing/natns.h): three public
 * nodes on the bridge, a fourth public one, one behind a port-preserving
 * NAT that drops unsolicited packets, one behind a router running
 * miniupnpd. The last three join through the first three; each checks its
 * reachability with AutoNAT through the peers it is connected to and
 * prints one line per change: the public node and the one behind the UPnP
 * router (which maps its port) end public, the one behind the plain NAT
 * private, its DHT client-only. When the node behind the UPnP router stops,
 * its mapping is gone from the router. Skipped (cmocka skip) when not
 * root, without nftables or without miniupnpd. */
#include "aptest.h"
#include "procs.h"

#include "natns.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NSEED 3
#define PORT  "4001"

static ap_natns_t *g_ns;
static pid_t g_pids[6];

static int teardown(void **state)
{
    (void)state;
    for (size_t i = 0; i < 6; i++)
        if (g_pids[i] > 0) {
            kill(g_pids[i], SIGKILL);
            waitpid(g_pids[i], NULL, 0);
            g_pids[i] = 0;
        }
    ap_natns_free(g_ns);
    g_ns = NULL;
    return 0;
}

/* Forks into namespace path `ns` (a name from natns) and runs the CLI. */
static pid_t spawn_in(bool home, size_t idx, char *const argv[], const char *log)
{
    const char *name = home ? ap_natns_home_name(g_ns, idx) : ap_natns_public_name(g_ns, idx);
    return ap_test_spawn_in_ns(name, argv, log);
}

static void test_dht_reachability(void **state)
{
    (void)state;
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    if (access("/usr/sbin/miniupnpd", X_OK) != 0) {
        print_message("skipped: /usr/sbin/miniupnpd is not installed (scripts/deps.sh)\n");
        skip();
    }
    const ap_nat_kind_t kinds[2] = {AP_NAT_DROP, AP_NAT_UPNP};
    if (ap_natns_new(NSEED + 1, 2, kinds, &g_ns, why, sizeof why)) fail_msg("topology: %s", why);
    char dir[] = "/tmp/apiary-e2e-nat-XXXXXX";
    assert_non_null(mkdtemp(dir));

    /* the seeds: node 0 first, 1 and 2 join through it */
    char logs[6][300], line[1024], seeds[1024] = "";
    for (size_t i = 0; i < NSEED; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/seed%zu.log", dir, i);
        char *argv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/0.0.0.0/tcp/" PORT,
                        "--initial-peers",     seeds, NULL};
        if (i == 0) argv[4] = NULL;
        g_pids[i] = spawn_in(false, i, argv, logs[i]);
        char want[64];
        snprintf(want, sizeof want, "  /ip4/%s/tcp/" PORT "/p2p/", ap_natns_public_ip(g_ns, i));
        if (!ap_test_wait_line(logs[i], want, line, sizeof line, 20))
            fail_msg("seed %zu did not print its address %s", i, want);
        line[strcspn(line, "\n")] = 0;
        size_t at = strlen(seeds);
        snprintf(seeds + at, sizeof seeds - at, "%s%s", at ? "," : "", strstr(line, "/ip4/"));
    }
    /* the three that check: public node 3, home 0 (drop), home 1 (upnp) */
    const char *names[3] = {"public", "drop", "upnp"};
    for (size_t k = 0; k < 3; k++) {
        snprintf(logs[NSEED + k], sizeof logs[0], "%s/%s.log", dir, names[k]);
        char *argv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/0.0.0.0/tcp/" PORT,
                        "--initial-peers",     seeds, NULL};
        g_pids[NSEED + k] = spawn_in(k > 0, k == 0 ? NSEED : k - 1, argv, logs[NSEED + k]);
    }
    char got[3][1024];
    const char *want[3] = {"reachability public", "reachability private", "reachability public"};
    for (size_t k = 0; k < 3; k++) {
        if (!ap_test_wait_line(logs[NSEED + k], want[k], got[k], sizeof got[k], 90)) {
            ap_proc_grep_file(logs[NSEED + k], "reachability", got[k], sizeof got[k]);
            fail_msg("node %s: no line '%s' (last: %s)", names[k], want[k], got[k]);
        }
        print_message("%s: %s", names[k], got[k]);
    }
    /* the public one was dialled at its own address, the upnp one at the
     * router's public address (the mapping), the private one is a client */
    char a[64];
    snprintf(a, sizeof a, "/ip4/%s/tcp/" PORT, ap_natns_public_ip(g_ns, NSEED));
    assert_non_null(strstr(got[0], a));
    snprintf(a, sizeof a, "/ip4/%s/tcp/" PORT, ap_natns_router_ip(g_ns, 1));
    assert_non_null(strstr(got[2], a));
    char adv[96];
    snprintf(adv, sizeof adv, "advertising the mapped address %s", a);
    assert_true(ap_proc_grep_file(logs[NSEED + 2], adv, NULL, 0));
    assert_non_null(strstr(got[1], "client-only"));
    assert_false(ap_proc_grep_file(logs[NSEED + 0], "reachability private", NULL, 0));
    assert_int_equal(ap_natns_upnp_mappings(g_ns, 1), 1);

    /* `apiary identify` from the internet reaches it through the mapping */
    char idline[256], target[400], ilog[300];
    assert_true(ap_proc_grep_file(logs[NSEED + 2], "DHT node ", idline, sizeof idline));
    idline[strcspn(idline, "\n")] = 0;
    snprintf(target, sizeof target, "%s/p2p/%s", a, strstr(idline, "DHT node ") + 9);
    snprintf(ilog, sizeof ilog, "%s/identify.log", dir);
    char *iargv[] = {(char *)ap_test_cli(), "identify", target, NULL};
    pid_t ip = spawn_in(false, NSEED, iargv, ilog);
    assert_int_equal(ap_proc_wait_exit(ip, 30), 0);
    char want_at[128];
    snprintf(want_at, sizeof want_at, "reached at        %s (direct TCP)", a);
    assert_true(ap_proc_grep_file(ilog, want_at, NULL, 0));
    assert_true(ap_proc_grep_file(ilog, "reachability      public", NULL, 0));
    assert_true(ap_proc_grep_file(ilog, "/libp2p/autonat/1.0.0", NULL, 0));
    print_message("identify through the mapping: %s, reachability public\n", want_at);
    unlink(ilog);

    /* the node behind the UPnP router stops: its mapping goes */
    kill(g_pids[NSEED + 2], SIGTERM);
    int st = ap_proc_wait_exit(g_pids[NSEED + 2], 30);
    g_pids[NSEED + 2] = 0;
    assert_int_equal(st, 0);
    assert_int_equal(ap_natns_upnp_mappings(g_ns, 1), 0);
    print_message("upnp: stopped, mapping removed\n");
    for (size_t i = 0; i < 6; i++) unlink(logs[i]);
    rmdir(dir);
    teardown(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_dht_reachability, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
