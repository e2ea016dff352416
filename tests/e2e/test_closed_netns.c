/* A closed run across hosts (network namespaces on a bridge, each with its
 * own address; testing/netns.h): an `apiary dht` bootstrap node in host 0,
 * the run's owner (`apiary train --run-owner <its own PeerID>`) in host 1
 * and a peer with the owner's token (`apiary run-token`) in host 2 train
 * together; an intruder in host 3 runs the same run id and configuration as
 * an open-run peer (no token). The two admitted peers average with each
 * other only (every epoch line says group 2, never 3) and each logs the
 * intruder's record as ignored, naming it. Then, in host 3: a peer of the
 * closed run without a token, with an expired token and with a token the
 * owner revoked (`apiary run-token --revoke`, stored in the run's DHT over
 * the bridge) each exits 1 with one line saying why. Skipped (cmocka skip)
 * when not root or without netns/veth. */
#include "aptest.h"
#include "procs.h"

#include "netns.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NH 4

/* Runs the CLI with argv in host i's namespace, output to log. */
static pid_t spawn_in(const ap_netns_t *ns, size_t host, char *const argv[], const char *log)
{
    return ap_test_spawn_in_ns(ap_netns_name(ns, host), argv, log);
}

/* Runs the CLI (no namespace needed: keys and tokens are offline) and
 * returns the first line of its stdout in out. */
static void cli_line(const char *args, char *out, size_t n)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s 2>/dev/null", ap_test_cli(), args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    out[0] = 0;
    if (!fgets(out, (int)n, p)) out[0] = 0;
    out[strcspn(out, "\n")] = 0;
    assert_int_equal(pclose(p), 0);
    assert_true(out[0] != 0);
}

static void test_closed_run_across_hosts(void **state)
{
    (void)state;
    char why[300];
    if (ap_netns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    char dir[] = "/tmp/apiary-e2e-closed-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char args[900], owner[128], peer[128], intruder[128], late[128], tok[300], old[300], rtok[300];
    snprintf(args, sizeof args, "identity --identity %s/owner.key", dir);
    cli_line(args, owner, sizeof owner);
    snprintf(args, sizeof args, "identity --identity %s/peer.key", dir);
    cli_line(args, peer, sizeof peer);
    snprintf(args, sizeof args, "identity --identity %s/intruder.key", dir);
    cli_line(args, intruder, sizeof intruder);
    snprintf(args, sizeof args, "identity --identity %s/late.key", dir);
    cli_line(args, late, sizeof late);
    snprintf(args, sizeof args, "run-token --owner-key %s/owner.key --run-id closed --peer %s", dir,
             peer);
    cli_line(args, tok, sizeof tok);
    /* the intruder's token is expired by the time it is used */
    snprintf(args, sizeof args,
             "run-token --owner-key %s/owner.key --run-id closed --peer %s --expires 1s", dir,
             intruder);
    cli_line(args, old, sizeof old);
    snprintf(args, sizeof args, "run-token --owner-key %s/owner.key --run-id closed --peer %s", dir,
             late);
    cli_line(args, rtok, sizeof rtok);

    ap_netns_t *ns;
    if (ap_netns_new(NH, NULL, &ns, why, sizeof why)) fail_msg("namespaces: %s", why);
    char blog[300], line[1024], addr[512];
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
    char *bargv[] = {(char *)ap_test_cli(), "dht", NULL};
    pid_t boot = spawn_in(ns, 0, bargv, blog);
    char want[64];
    snprintf(want, sizeof want, "  /ip4/%s/tcp/", ap_netns_ip(ns, 0));
    line[0] = 0;
    for (int i = 0; i < 100 && !ap_proc_grep_file(blog, want, line, sizeof line); i++)
        ap_proc_sleep_ms(100);
    if (!line[0]) {
        kill(boot, SIGKILL);
        ap_netns_free(ns);
        fail_msg("the bootstrap did not print its host address %s", want);
    }
    line[strcspn(line, "\n")] = 0;
    snprintf(addr, sizeof addr, "%s", strstr(line, "/ip4/"));

    const char *keys[NH] = {NULL, "owner", "peer", "intruder"};
    char logs[NH][300], keyp[NH][300];
    pid_t pids[NH] = {0};
    /* the intruder first: its records are in the DHT when the others start */
    for (int j = 0; j < NH - 1; j++) {
        int i = j == 0 ? 3 : j;
        snprintf(logs[i], sizeof logs[i], "%s/%s.log", dir, keys[i]);
        snprintf(keyp[i], sizeof keyp[i], "%s/%s.key", dir, keys[i]);
        char seed[8];
        snprintf(seed, sizeof seed, "%d", i);
        char *av[40] = {(char *)ap_test_cli(),
                        "train",
                        "--run-id",
                        "closed",
                        "--initial-peers",
                        addr,
                        "--identity",
                        keyp[i],
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
                        "10"};
        int k = 24;
        if (i != 3) {
            av[k++] = "--run-owner";
            av[k++] = owner;
        }
        if (i == 2) {
            av[k++] = "--token";
            av[k++] = tok;
        }
        av[k] = NULL;
        pids[i] = spawn_in(ns, (size_t)i, av, logs[i]);
        for (int w = 0; i == 3 && w < 300 && !ap_proc_grep_file(logs[i], "epoch 1 |", NULL, 0); w++)
            ap_proc_sleep_ms(100);
    }
    int st[NH] = {0};
    for (int i = 1; i < 3; i++) st[i] = ap_proc_wait_exit(pids[i], 120);
    kill(pids[3], SIGTERM);
    ap_proc_wait_exit(pids[3], 20);

    /* refused ones, in host 3 */
    char nolog[300], oldlog[300], revlog[300], rvklog[300], latekey[300];
    snprintf(nolog, sizeof nolog, "%s/notoken.log", dir);
    snprintf(oldlog, sizeof oldlog, "%s/expired.log", dir);
    snprintf(revlog, sizeof revlog, "%s/revoked.log", dir);
    snprintf(rvklog, sizeof rvklog, "%s/revoke.log", dir);
    snprintf(latekey, sizeof latekey, "%s/late.key", dir);
    char *nov[] = {(char *)ap_test_cli(), "train", "--run-id", "closed", "--initial-peers", addr,
                   "--identity",          keyp[3], "--model",  "mlp",    "--run-owner",     owner,
                   "--duration",          "20",    NULL};
    int nst = ap_proc_wait_exit(spawn_in(ns, 3, nov, nolog), 30);
    char *oldv[] = {(char *)ap_test_cli(),
                    "train",
                    "--run-id",
                    "closed",
                    "--initial-peers",
                    addr,
                    "--identity",
                    keyp[3],
                    "--model",
                    "mlp",
                    "--run-owner",
                    owner,
                    "--token",
                    old,
                    "--duration",
                    "20",
                    NULL};
    int ost = ap_proc_wait_exit(spawn_in(ns, 3, oldv, oldlog), 30);
    char ownerkey[300];
    snprintf(ownerkey, sizeof ownerkey, "%s/owner.key", dir);
    char *rvkv[] = {(char *)ap_test_cli(),
                    "run-token",
                    "--owner-key",
                    ownerkey,
                    "--run-id",
                    "closed",
                    "--revoke",
                    late,
                    "--initial-peers",
                    addr,
                    NULL};
    int kst = ap_proc_wait_exit(spawn_in(ns, 3, rvkv, rvklog), 30);
    char *revv[] = {(char *)ap_test_cli(),
                    "train",
                    "--run-id",
                    "closed",
                    "--initial-peers",
                    addr,
                    "--identity",
                    latekey,
                    "--model",
                    "mlp",
                    "--run-owner",
                    owner,
                    "--token",
                    rtok,
                    "--duration",
                    "20",
                    NULL};
    int rst = ap_proc_wait_exit(spawn_in(ns, 3, revv, revlog), 30);
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);

    char ishort[16];
    snprintf(ishort, sizeof ishort, "%s", intruder + strlen(intruder) - 8);
    char ignored[128];
    snprintf(ignored, sizeof ignored, "ignoring the progress record of peer %s (no token)", ishort);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(st[i], 0);
        assert_true(ap_proc_grep_file(logs[i], "summary:", line, sizeof line));
        print_message("%s %s", keys[i], line);
        unsigned long long ep = 0;
        assert_int_equal(sscanf(strstr(line, "epochs"), "epochs %llu", &ep), 1);
        assert_true(ep >= 6);
        /* the admitted peers averaged with each other, and only with each other */
        assert_true(ap_proc_grep_file(logs[i], "| group 2 |", NULL, 0));
        assert_false(ap_proc_grep_file(logs[i], "| group 3 |", NULL, 0));
        assert_true(ap_proc_grep_file(logs[i], ignored, NULL, 0));
    }
    assert_int_equal(nst, 1);
    assert_true(ap_proc_grep_file(nolog,
                                  "apiary train: run closed is closed: ask its owner for a "
                                  "token",
                                  NULL, 0));
    assert_int_equal(ost, 1);
    assert_true(ap_proc_grep_file(oldlog, "token expired", NULL, 0));
    assert_int_equal(kst, 0);
    assert_true(ap_proc_grep_file(rvklog, "revoked", NULL, 0));
    assert_int_equal(rst, 1);
    assert_true(ap_proc_grep_file(revlog, "its owner revoked this peer's token", NULL, 0));
    ap_netns_free(ns);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_closed_run_across_hosts)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
