/* The standing hostile suite, reduced: `apiary bench hostile --quick --json`
 * runs each scripted attack against a real `apiary dht` process on loopback;
 * this test asserts what must hold whatever the machine's speed: the target
 * never crashes, the legitimate client is served during the attack, the
 * legitimate record survives, and the target's memory stays within its
 * limit. (The served fraction against its 0.99 target, and the figures, are
 * the benchmark's business.) Also the honest messages of `dht store`. */
#include "aptest.h"
#include "procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static double field(const char *line, const char *name)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", name);
    const char *p = strstr(line, pat);
    return p ? strtod(p + strlen(pat), NULL) : -1;
}

static void test_attacks(void **state)
{
    (void)state;
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s bench hostile --quick --json 2>&1", ap_test_cli());
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    char line[4096];
    int attacks = 0;
    while (fgets(line, sizeof line, f)) {
        if (!strstr(line, "\"metric\":\"served_during_attack\"")) continue;
        print_message("%s", line);
        attacks++;
        assert_int_equal((int)field(line, "crashed"), 0);
        assert_int_equal((int)field(line, "setup_ok"), 1);
        assert_true(field(line, "probes") >= 1);
        /* served at all while attacked (not a timing figure: a node that
         * locks new peers out serves 0) */
        assert_true(field(line, "served_during_attack") > 0.5);
        assert_int_equal((int)field(line, "legit_record_found"), 1);
        double base = field(line, "baseline_rss_mb"), peak = field(line, "peak_rss_mb");
        assert_true(base > 0);
        assert_true(peak <= base + 512);
        /* memory returns after the attack (the benchmark's target is 1.5 x
         * baseline; this bound only catches a node that keeps what an
         * attacker made it hold: the zero-window attack peaks near 200 MB
         * and ends near 11 MB on a 10 MB baseline). Not under ASan, whose
         * allocator keeps freed memory in quarantine: there RSS after the
         * attack equals its peak */
        if (!ap_test_sanitized()) assert_true(field(line, "rss_after_mb") <= 2 * base + 32);
    }
    int st = pclose(f);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(attacks, 13);
}

static int sh(char *out, size_t n, const char *cmd)
{
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t k = fread(out, 1, n - 1, f);
    out[k] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* `dht store --value-file PATH|-`, and refusals that name their limit. */
static void test_store_cli(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-hostile-cli-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char log[300], line[1024], addr[512] = "";
    snprintf(log, sizeof log, "%s/node.log", dir);
    char *av[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0", NULL};
    pid_t node = ap_test_spawn_log(av, log);
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        if (ap_proc_grep_file(log, "  /ip4/127.0.0.1/tcp/", line, sizeof line)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(addr, sizeof addr, "%s", strstr(line, "/ip4/"));
        }
    }
    assert_true(addr[0]);
    char cmd[2048], out[8192];
    /* from stdin */
    snprintf(cmd, sizeof cmd,
             "printf 'from stdin' | %s dht store k-stdin --value-file - --ttl 60 "
             "--initial-peers %s 2>&1",
             ap_test_cli(), addr);
    assert_int_equal(sh(out, sizeof out, cmd), 0);
    assert_non_null(strstr(out, "stored on 1 node"));
    snprintf(cmd, sizeof cmd, "%s dht get k-stdin --initial-peers %s 2>&1", ap_test_cli(), addr);
    assert_int_equal(sh(out, sizeof out, cmd), 0);
    assert_non_null(strstr(out, "from stdin\t"));
    /* from a file */
    char path[300];
    snprintf(path, sizeof path, "%s/value", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("from a file", f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "%s dht store k-file --value-file %s --ttl 60 --initial-peers %s 2>&1 && "
             "%s dht get k-file --initial-peers %s 2>&1",
             ap_test_cli(), path, addr, ap_test_cli(), addr);
    assert_int_equal(sh(out, sizeof out, cmd), 0);
    assert_non_null(strstr(out, "from a file\t"));
    /* over the value limit: refused before any network traffic, saying so */
    f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 70000; i++) fputc('x', f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s dht store k-big --value-file %s --ttl 60 --initial-peers %s 2>&1",
             ap_test_cli(), path, addr);
    assert_int_equal(sh(out, sizeof out, cmd), 1);
    assert_non_null(strstr(out, "65536-byte value limit"));
    kill(node, SIGTERM);
    assert_int_equal(ap_proc_wait_exit(node, 10), 0);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

static pid_t node_up(char *const av[], const char *log, char *addr, size_t n)
{
    char line[1024];
    pid_t pid = ap_test_spawn_log(av, log);
    addr[0] = 0;
    for (int i = 0; i < 100 && !addr[0]; i++) {
        ap_proc_sleep_ms(100);
        if (ap_proc_grep_file(log, "  /ip4/127.0.0.1/tcp/", line, sizeof line)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(addr, n, "%s", strstr(line, "/ip4/"));
        }
    }
    return pid;
}

/* `apiary dht --stats`: the scopes' use against the limits given on the
 * command line, the connected peer's own scope, and the refusals, printed
 * periodically and at exit. */
static void test_stats(void **state)
{
    (void)state;
    char dir[] = "/tmp/apiary-hostile-stats-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char alog[300], blog[300], a[512], b[512], line[1024];
    snprintf(alog, sizeof alog, "%s/a.log", dir);
    snprintf(blog, sizeof blog, "%s/b.log", dir);
    char *av[] = {(char *)ap_test_cli(),
                  "dht",
                  "--listen",
                  "/ip4/127.0.0.1/tcp/0",
                  "--stats",
                  "--stats-interval",
                  "1",
                  "--max-memory",
                  "64",
                  "--peer-memory",
                  "8",
                  NULL};
    pid_t na = node_up(av, alog, a, sizeof a);
    assert_true(a[0]);
    char *bv[] = {(char *)ap_test_cli(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0",
                  "--initial-peers",     a,     NULL};
    pid_t nb = node_up(bv, blog, b, sizeof b);
    assert_true(b[0]);
    const char *bid = strstr(b, "/p2p/") + 5;
    char want[160];
    snprintf(want, sizeof want, "  peer %s: memory ", bid);
    for (int i = 0; i < 50 && !ap_proc_grep_file(alog, want, NULL, 0); i++) ap_proc_sleep_ms(100);
    kill(na, SIGTERM);
    assert_int_equal(ap_proc_wait_exit(na, 10), 0);
    kill(nb, SIGTERM);
    assert_int_equal(ap_proc_wait_exit(nb, 10), 0);
    assert_true(ap_proc_grep_file(alog, "resources:", NULL, 0));
    assert_true(ap_proc_grep_file(alog, "  node: memory ", line, sizeof line));
    print_message("%s", line);
    assert_non_null(strstr(line, "/67108864, streams ")); /* --max-memory 64 */
    assert_true(ap_proc_grep_file(alog, want, line, sizeof line));
    print_message("%s", line);
    assert_non_null(strstr(line, "/8388608, streams ")); /* --peer-memory 8 */
    assert_non_null(strstr(line, ", conns 1/"));
    assert_true(ap_proc_grep_file(alog, "  refused 0 (memory: ", NULL, 0));
    assert_false(ap_proc_grep_file(alog, "/0,", NULL, 0)); /* no limit reads as "/-" */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_store_cli),
        cmocka_unit_test(test_stats),
        cmocka_unit_test(test_attacks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
