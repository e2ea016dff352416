/* Byzantine-tolerant training with real processes across hosts: nine network
 * namespaces on a bridge (testing/netns.h), each with its own address. An
 * `apiary dht` bootstrap in host 0 and eight `apiary train` peers (MLP), one
 * per host, two of them attackers. With --byzantine-tolerant (ButterflyClip
 * and the verified step in every gradient round) one attacker flips its
 * gradient (--attack sign-flip: times -1000) and the other cheats as an
 * aggregator (--attack bad-aggregator): every honest peer bans the cheater
 * (and nobody else) and its loss ends far below where it began. The same run
 * with the plain mean and two sign-flippers diverges, so the test can fail.
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

#define NH     9 /* host 0: bootstrap; hosts 1..8: peers */
#define EPOCHS 12
#define BAD    2 /* the last BAD peers attack */

/* Runs the CLI with argv in host i's namespace, output to log. */
static pid_t spawn_in(const ap_netns_t *ns, size_t host, char *const argv[], const char *log)
{
    return ap_test_spawn_in_ns(ap_netns_name(ns, host), argv, log);
}

/* The loss of each "epoch K | loss X" line of a peer's log, by epoch. */
static int read_losses(const char *log, double *loss, int max)
{
    FILE *f = fopen(log, "r");
    if (!f) return 0;
    char line[1024];
    int last = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long ep;
        double l;
        if (sscanf(line, "epoch %llu | loss %lf", &ep, &l) == 2 && ep >= 1 && ep <= (unsigned)max) {
            loss[ep - 1] = l;
            if ((int)ep > last) last = (int)ep;
        }
    }
    fclose(f);
    return last;
}

/* One run: returns how many honest peers reached EPOCHS; first/last: the
 * honest peers' mean loss of epoch 1 and of the last three epochs. */
static int run(const ap_netns_t *ns, const char *dir, const char *addr, bool byz, int validators,
               double *first, double *last)
{
    char logs[NH][300];
    pid_t pids[NH] = {0};
    const char *run_id = !byz ? "btard-mean" : validators ? "btard-check" : "btard-byz";
    char nval[8];
    snprintf(nval, sizeof nval, "%d", validators);
    for (int i = 1; i < NH; i++) {
        snprintf(logs[i], sizeof logs[i], "%s/%s-peer%d.log", dir, run_id, i);
        char seed[8], ep[8];
        snprintf(seed, sizeof seed, "%d", i);
        snprintf(ep, sizeof ep, "%d", EPOCHS);
        char *av[40];
        int k = 0;
        char *base[] = {(char *)ap_test_cli(),
                        "train",
                        "--run-id",
                        (char *)run_id,
                        "--initial-peers",
                        (char *)addr,
                        "--model",
                        "mlp",
                        "--target-batch-size",
                        "64",
                        "--batch-size",
                        "8",
                        "--max-epochs",
                        ep,
                        "--duration",
                        "120",
                        "--seed",
                        seed,
                        "--matchmaking-window",
                        "0.5",
                        "--average-state-every",
                        "0"};
        for (size_t j = 0; j < sizeof base / sizeof *base; j++) av[k++] = base[j];
        if (byz) {
            av[k++] = "--byzantine-tolerant";
            av[k++] = "--btard-tau";
            av[k++] = "0.05";
            if (validators) {
                av[k++] = "--btard-validators";
                av[k++] = nval;
            }
        }
        if (i > NH - 1 - BAD) {
            av[k++] = "--attack";
            av[k++] = byz && i == NH - 1 ? "bad-aggregator" : "sign-flip";
        }
        /* info: a failure's logs tell each part's and each check's fate */
        av[k++] = "--log-level";
        av[k++] = "info";
        av[k] = NULL;
        pids[i] = spawn_in(ns, (size_t)i, av, logs[i]);
    }
    int st[NH] = {0};
    for (int i = 1; i < NH; i++) st[i] = ap_proc_wait_exit(pids[i], 180);
    /* each peer's short id (the last 8 characters of its PeerID), the form
     * of the "peer X banned (how)" lines */
    char ids[NH][16] = {{0}};
    for (int i = 1; i < NH; i++) {
        char line[1024], full[128];
        if (ap_proc_grep_file(logs[i], "peer 12D3Koo", line, sizeof line) &&
            sscanf(line, "peer %127s (", full) == 1 && strlen(full) > 8)
            snprintf(ids[i], sizeof ids[i], "%s", full + strlen(full) - 8);
    }
    int reached = 0;
    double f = 0, l = 0;
    int nf = 0;
    for (int i = 1; i <= NH - 1 - BAD; i++) {
        double loss[EPOCHS] = {0};
        int got = read_losses(logs[i], loss, EPOCHS);
        char line[1024];
        if (ap_proc_grep_file(logs[i], "summary:", line, sizeof line))
            print_message("%s peer%d (exit %d) %s", run_id, i, st[i], line);
        if (st[i] != 0 || got < EPOCHS) continue;
        reached++;
        f += loss[0];
        l += (loss[EPOCHS - 1] + loss[EPOCHS - 2] + loss[EPOCHS - 3]) / 3;
        nf++;
        /* it averaged with the whole group, across the bridge (byz: the
         * group without the banned cheater after its ban) */
        assert_true(ap_proc_grep_file(logs[i],
                                      !byz         ? "| group 8 |"
                                      : validators ? "| group 6 |"
                                                   : "| group 7 |",
                                      NULL, 0));
        if (byz) {
            /* the cheating aggregator is banned, nobody else */
            if (ap_proc_grep_file(logs[i], "byzantine-tolerant:", line, sizeof line))
                print_message("%s peer%d %s", run_id, i, line);
            assert_true(ap_proc_grep_file(logs[i],
                                          validators ? "byzantine-tolerant: peers banned 2 |"
                                                     : "byzantine-tolerant: peers banned 1 |",
                                          NULL, 0));
            for (int j = 1; j < NH; j++) {
                char want[64];
                assert_true(ids[j][0]);
                snprintf(want, sizeof want, "peer %s banned (", ids[j]);
                bool banned = ap_proc_grep_file(logs[i], want, line, sizeof line);
                if (j == NH - 1) {
                    /* the cheating aggregator: the check's sum convicts it */
                    assert_true(banned);
                } else if (j == NH - 2 && validators) {
                    /* the sign-flipper: its validator's recomputation
                     * (bad_gradient) or, if it validates first, its own
                     * flipped recomputation of an honest target
                     * (false_accusation): either way its own messages */
                    assert_true(banned);
                    assert_true(strstr(line, "(bad_gradient)") ||
                                strstr(line, "(false_accusation)"));
                } else {
                    assert_false(banned);
                }
            }
        }
    }
    *first = nf ? f / nf : 0;
    *last = nf ? l / nf : 0;
    print_message("%s: %d honest peers reached epoch %d, loss %.4f -> %.4f\n", run_id, reached,
                  EPOCHS, *first, *last);
    return reached;
}

static void test_two_attackers_of_eight(void **state)
{
    (void)state;
    char why[300];
    if (ap_netns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    ap_netns_t *ns;
    if (ap_netns_new(NH, NULL, &ns, why, sizeof why)) fail_msg("namespaces: %s", why);
    char dir[] = "/tmp/apiary-e2e-btard-XXXXXX";
    assert_non_null(mkdtemp(dir));

    char blog[300], line[1024] = "", addr[512];
    snprintf(blog, sizeof blog, "%s/boot.log", dir);
    char *bargv[] = {(char *)ap_test_cli(), "dht", NULL};
    pid_t boot = spawn_in(ns, 0, bargv, blog);
    char want[64];
    snprintf(want, sizeof want, "  /ip4/%s/tcp/", ap_netns_ip(ns, 0));
    for (int i = 0; i < 100 && !ap_proc_grep_file(blog, want, line, sizeof line); i++)
        ap_proc_sleep_ms(100);
    if (!strstr(line, "/ip4/")) {
        kill(boot, SIGKILL);
        ap_netns_free(ns);
        fail_msg("the bootstrap did not print its host address %s", want);
    }
    line[strcspn(line, "\n")] = 0;
    snprintf(addr, sizeof addr, "%s", strstr(line, "/ip4/"));

    double bf, bl, mf, ml;
    double cf, cl;
    int check = run(ns, dir, addr, true, 2, &cf, &cl);
    int byz = run(ns, dir, addr, true, 0, &bf, &bl);
    int mean = run(ns, dir, addr, false, 0, &mf, &ml);
    kill(boot, SIGTERM);
    ap_proc_wait_exit(boot, 10);

    assert_int_equal(check, NH - 1 - BAD);
    print_message("with the gradient check: loss %.4f -> %.4f\n", cf, cl);
    /* measured 1.29 -> 0.19 idle; with both cores busy (two `yes`) 1.27 ->
     * 0.25 and 1.23 -> 0.62, when late messages split the group's verdicts
     * and the peers that took another step than the rest (found out by the
     * stated state) reloaded theirs: 8 of 12 steps dropped */
    assert_true(cl < 0.75 * cf);
    assert_int_equal(byz, NH - 1 - BAD);
    assert_int_equal(mean, NH - 1 - BAD);
    /* with ButterflyClip: converges (measured 1.31 -> ~0.1 on loopback) */
    assert_true(bl < 0.5 * bf);
    /* with the plain mean: the two attackers wreck it (measured 1.31 -> 5.7) */
    assert_true(ml > mf);
    ap_netns_free(ns); /* on a failed assertion, at exit (testing/netns.h) */
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_two_attackers_of_eight)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
