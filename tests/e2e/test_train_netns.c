/* Collaborative training across hosts: three network namespaces on a bridge
 * (testing/netns.h), each with its own address and its own loopback, so no
 * address is shared by chance. An `apiary dht` bootstrap node in host 0 and
 * an `apiary train` peer (MLP) in each of hosts 1 and 2, all on the default
 * wildcard listen address: the bootstrap must print its host address (not
 * 0.0.0.0), and the two peers must find each other through it and average
 * together (epoch lines with a group of 2, not partial). A peer that listens
 * only on loopback while its initial peer is on another host is refused at
 * start with a message naming the fix; a malformed --announce is refused.
 * Skipped (cmocka skip) when not root or without netns/veth. */
#include "aptest.h"
#include "procs.h"

#include "netns.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NH 3

/* Runs the CLI with argv in host i's namespace, output to log. */
static pid_t spawn_in(const ap_netns_t *ns, size_t host, char *const argv[], const char *log)
{
    return ap_test_spawn_in_ns(ap_netns_name(ns, host), argv, log);
}

static void test_train_across_hosts(void **state)
{
    (void)state;
    char why[300];
    if (ap_netns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    ap_netns_t *ns;
    if (ap_netns_new(NH, NULL, &ns, why, sizeof why)) fail_msg("namespaces: %s", why);
    char dir[] = "/tmp/apiary-e2e-netns-XXXXXX";
    assert_non_null(mkdtemp(dir));

    char blog[300], line[1024], addr[512];
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
    char *bargv[] = {(char *)ap_test_cli(), "dht", NULL};
    pid_t boot = spawn_in(ns, 0, bargv, blog);
    char want[64];
    snprintf(want, sizeof want, "  /ip4/%s/tcp/", ap_netns_ip(ns, 0));
    ap_test_wait_line(blog, want, line, sizeof line, 10);
    if (!line[0]) {
        kill(boot, SIGKILL);
        ap_netns_free(ns);
        fail_msg("the bootstrap did not print its host address %s", want);
    }
    assert_false(ap_proc_grep_file(blog, "0.0.0.0", NULL, 0));
    line[strcspn(line, "\n")] = 0;
    snprintf(addr, sizeof addr, "%s", strstr(line, "/ip4/"));

    char logs[NH][300];
    pid_t pids[NH] = {0};
    for (int i = 1; i < NH; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/peer%d.log", dir, i);
        char seed[8];
        snprintf(seed, sizeof seed, "%d", i);
        char *av[] = {(char *)ap_test_cli(),
                      "train",
                      "--run-id",
                      "netns",
                      "--initial-peers",
                      addr,
                      "--model",
                      "mlp",
                      "--target-batch-size",
                      "32",
                      "--batch-size",
                      "8",
                      "--max-epochs",
                      "6",
                      "--duration",
                      "60",
                      "--seed",
                      seed,
                      "--matchmaking-window",
                      "0.3",
                      "--slowdown",
                      "10",
                      NULL};
        pids[i] = spawn_in(ns, (size_t)i, av, logs[i]);
    }
    int st[NH] = {0};
    for (int i = 1; i < NH; i++) st[i] = ap_proc_wait_exit(pids[i], 90);

    /* on loopback only, with a remote initial peer: refused at start */
    char llog[300];
    snprintf(llog, sizeof llog, "%s/loopback.log", dir);
    char *lv[] = {(char *)ap_test_cli(),
                  "train",
                  "--run-id",
                  "netns",
                  "--initial-peers",
                  addr,
                  "--listen",
                  "/ip4/127.0.0.1/tcp/0",
                  "--model",
                  "mlp",
                  "--duration",
                  "20",
                  NULL};
    int lst = ap_proc_wait_exit(spawn_in(ns, 1, lv, llog), 30);
    char alog[300];
    snprintf(alog, sizeof alog, "%s/announce.log", dir);
    char *badv[] = {(char *)ap_test_cli(), "train", "--announce", "/ip4/10.0.0.1", NULL};
    int ast = ap_proc_wait_exit(spawn_in(ns, 1, badv, alog), 30);
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);

    for (int i = 1; i < NH; i++) {
        assert_int_equal(st[i], 0);
        assert_true(ap_proc_grep_file(logs[i], "summary:", line, sizeof line));
        print_message("peer%d %s", i, line);
        unsigned long long ep = 0;
        assert_int_equal(sscanf(strstr(line, "epochs"), "epochs %llu", &ep), 1);
        assert_true(ep >= 6);
        /* its address is its host's, never the wildcard */
        char mine[64];
        snprintf(mine, sizeof mine, "listening on /ip4/%s/tcp/", ap_netns_ip(ns, (size_t)i));
        assert_true(ap_proc_grep_file(logs[i], mine, NULL, 0));
        assert_false(ap_proc_grep_file(logs[i], "0.0.0.0", NULL, 0));
        /* the two peers averaged with each other, across the bridge */
        assert_true(ap_proc_grep_file(logs[i], "| group 2 |", NULL, 0));
    }
    assert_int_equal(lst, 1);
    assert_true(ap_proc_grep_file(llog, "reachable only on loopback", NULL, 0));
    assert_int_equal(ast, 2);
    assert_true(ap_proc_grep_file(alog, "--announce needs", NULL, 0));
    ap_netns_free(ns); /* on a failed assertion, at exit (testing/netns.h) */
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_train_across_hosts)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
