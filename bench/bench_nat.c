/* `apiary bench nat [--json]`: NAT traversal in network namespaces
 * (testing/natns.h), one part per group of metrics. Each part builds the
 * topology it needs and reports its metrics with a field "nat" naming the
 * router kind where one applies.
 *
 *   autonat   autonat_correct: the fraction of nodes whose AutoNAT verdict
 *             was right -- a node on the internet bridge must end public,
 *             one behind each kind of NAT private (testing/nat_autonat.h),
 *             one behind a UPnP router (miniupnpd) that maps its port
 *             public; also one line per kind with that kind's fraction.
 *
 * Needs root and nftables; otherwise it prints why and reports nothing
 * ({"skipped":true} with --json). `--part NAME` runs one part only.
 * `--delay MS` adds MS of netem delay each way at every router in the
 * holepunch and relay parts (a round trip between two homes grows by
 * 4 * MS); their lines then carry "delay_ms". */
#include "bench.h"

#include "apiary/log.h"
#include "nat_autonat.h"
#include "nat_punch.h"
#include "natns.h"
#include "p2p/portmap.h"
#include "p2p/reach.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct nat_part {
    const char *name;
    int (*run)(ap_bench_ctx_t *c);
} nat_part_t;

static unsigned g_delay_ms; /* --delay */

/* --delay on every router of ns; 0 or 1 (reason printed). */
static int apply_delay(ap_natns_t *ns)
{
    char why[400];
    for (size_t k = 0; k < ap_natns_nhomes(ns) && g_delay_ms; k++)
        if (ap_natns_set_delay(ns, k, g_delay_ms, why, sizeof why)) {
            fprintf(stderr, "nat: --delay: %s\n", why);
            return 1;
        }
    return 0;
}

/* ",\"delay_ms\":N" with --delay, else "". */
static const char *delay_field(void)
{
    static char f[32];
    f[0] = 0;
    if (g_delay_ms) snprintf(f, sizeof f, ",\"delay_ms\":%u", g_delay_ms);
    return f;
}

static void json_safe(char *out, size_t n, const char *s)
{
    size_t k = 0;
    for (; *s && k + 1 < n; s++) out[k++] = (*s == '"' || *s == '\\' || *s < 0x20) ? '\'' : *s;
    out[k] = 0;
}

/* ---- autonat --------------------------------------------------------------------------- */

static int part_autonat(ap_bench_ctx_t *c)
{
    const ap_nat_kind_t kinds[] = {AP_NAT_DROP, AP_NAT_RST, AP_NAT_SYMMETRIC, AP_NAT_UPNP};
    const size_t nk = sizeof kinds / sizeof kinds[0];
    char why[400];
    ap_natns_t *ns = NULL;
    if (ap_natns_new(AP_NAT_AUTONAT_SERVERS + 1, nk, kinds, &ns, why, sizeof why)) {
        fprintf(stderr, "nat: topology: %s\n", why);
        return 1;
    }
    /* one client on the bridge, one behind each router */
    ap_nat_where_t where[1 + sizeof kinds / sizeof kinds[0]];
    where[0] = (ap_nat_where_t){.home = false, .index = AP_NAT_AUTONAT_SERVERS};
    for (size_t k = 0; k < nk; k++)
        where[1 + k] = (ap_nat_where_t){
            .home = true, .index = k, .portmap = kinds[k] == AP_NAT_UPNP ? AP_PORTMAP_ANY : 0};
    ap_nat_autonat_result_t res[1 + sizeof kinds / sizeof kinds[0]];
    int rc = ap_nat_autonat_run(ns, where, 1 + nk, c->quick ? 60000 : 90000, res, why, sizeof why);
    ap_natns_free(ns);
    if (rc) {
        fprintf(stderr, "nat: autonat: %s\n", why);
        return 1;
    }
    size_t right = 0;
    for (size_t k = 0; k < 1 + nk; k++) {
        bool mapped = k > 0 && kinds[k - 1] == AP_NAT_UPNP;
        int want = k == 0 || mapped ? AP_REACH_PUBLIC : AP_REACH_PRIVATE;
        bool ok = res[k].state == want;
        right += ok;
        char f[96];
        snprintf(f, sizeof f, "\"nat\":\"%s\",\"verdict\":\"%s\"",
                 k == 0 ? "none" : ap_nat_kind_name(kinds[k - 1]),
                 ap__reach_name((ap_reach_state_t)res[k].state));
        ap_bench_report(c, "autonat_correct", ok ? 1.0 : 0.0, "fraction", f);
    }
    char f[64];
    snprintf(f, sizeof f, "\"nat\":\"all\",\"nodes\":%zu", 1 + nk);
    ap_bench_report(c, "autonat_correct", (double)right / (double)(1 + nk), "fraction", f);
    return 0;
}

/* ---- holepunch: DCUtR behind each NAT kind ------------------------------------------------ */

/* Two homes of one kind (A and B), then A behind the symmetric NAT and B
 * behind a drop NAT; the relay on public node 0. */
static int part_holepunch(ap_bench_ctx_t *c)
{
    const ap_nat_kind_t kinds[] = {AP_NAT_DROP, AP_NAT_DROP,      AP_NAT_RST,
                                   AP_NAT_RST,  AP_NAT_SYMMETRIC, AP_NAT_DROP};
    const size_t pairs[3][2] = {{0, 1}, {2, 3}, {4, 5}};
    int rounds = c->quick ? 4 : 20;
    char why[400];
    ap_natns_t *ns = NULL;
    if (ap_natns_new(1, 6, kinds, &ns, why, sizeof why)) {
        fprintf(stderr, "nat: topology: %s\n", why);
        return 1;
    }
    static ap_nat_punch_round_t res[AP_NAT_PUNCH_ROUNDS];
    int rc = apply_delay(ns);
    for (size_t k = 0; k < 3 && rc == 0; k++) {
        int n = k == 2 ? (rounds < 3 ? rounds : 3) : rounds;
        if (ap_nat_punch_run(ns, 0, pairs[k][0], pairs[k][1], n, 20000, res, why, sizeof why)) {
            fprintf(stderr, "nat: holepunch: %s\n", why);
            rc = 1;
            break;
        }
        int ok = 0;
        double ms = 0;
        for (int r = 0; r < n; r++)
            if (res[r].status == 0) {
                ok++;
                ms += res[r].ms_direct;
            }
        const char *kind = ap_nat_kind_name(kinds[pairs[k][0]]);
        char f[128];
        snprintf(f, sizeof f, "\"nat\":\"%s\",\"rounds\":%d%s", kind, n, delay_field());
        ap_bench_report(c, "holepunch_success_rate", (double)ok / n, "fraction", f);
        if (ok) ap_bench_report(c, "time_to_direct_ms", ms / ok, "ms", f);
    }
    ap_natns_free(ns);
    return rc;
}

/* ---- relay: bytes through a circuit, against a direct connection ------------------------- */

static int part_relay(ap_bench_ctx_t *c)
{
    const ap_nat_kind_t kinds[] = {AP_NAT_DROP, AP_NAT_DROP};
    char why[400];
    ap_natns_t *ns = NULL;
    if (ap_natns_new(1, 2, kinds, &ns, why, sizeof why)) {
        fprintf(stderr, "nat: topology: %s\n", why);
        return 1;
    }
    size_t bytes = c->quick ? (1u << 20) : (3u << 20);
    double relayed = 0, direct = 0;
    if (apply_delay(ns)) {
        ap_natns_free(ns);
        return 1;
    }
    int rc = ap_nat_relay_throughput(ns, 0, 0, 1, bytes, &relayed, &direct, why, sizeof why);
    ap_natns_free(ns);
    if (rc) {
        fprintf(stderr, "nat: relay: %s\n", why);
        return 1;
    }
    char f[128];
    snprintf(f, sizeof f, "\"bytes\":%zu,\"baseline_is\":\"direct to the relay\"%s", bytes,
             delay_field());
    ap_bench_report_vs(c, "relay_circuit_MBps", relayed / 1e6, "MB/s", direct / 1e6, f);
    return 0;
}

/* ---- the parts --------------------------------------------------------------------------- */

static const nat_part_t parts[] = {
    {"autonat", part_autonat},
    {"holepunch", part_holepunch},
    {"relay", part_relay},
};

static int bench_nat(ap_bench_ctx_t *c, int argc, char **argv)
{
    const char *only = NULL;
    for (int k = 1; k < argc; k++) {
        char *end = NULL;
        if (!strcmp(argv[k], "--part") && k + 1 < argc) {
            only = argv[++k];
        } else if (!strcmp(argv[k], "--delay") && k + 1 < argc &&
                   (g_delay_ms = (unsigned)strtoul(argv[k + 1], &end, 10), *end == 0) &&
                   argv[k + 1][0] && g_delay_ms <= 1000) {
            k++;
        } else {
            fprintf(stderr, "usage: apiary bench nat [--json] [--quick] [--part NAME] "
                            "[--delay MS (0-1000)]\n");
            return 2;
        }
    }
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        char safe[400];
        json_safe(safe, sizeof safe, why);
        fprintf(stderr, "nat: skipped: %s\n", safe);
        if (c->json)
            printf("{\"bench\":\"%s\",\"skipped\":true,\"reason\":\"%s\"}\n", c->name, safe);
        return 0;
    }
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(AP_LOG_ERROR);
    int rc = 0;
    bool found = false;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (only && strcmp(only, parts[i].name)) continue;
        found = true;
        if (parts[i].run(c)) rc = 1;
    }
    if (!found) {
        fprintf(stderr, "nat: no part '%s'\n", only);
        return 2;
    }
    return rc;
}

AP_BENCH(bench_nat_def, "nat", bench_nat,
         "NAT traversal in namespaces: AutoNAT verdicts, hole punching behind each NAT "
         "kind, bytes through a relay")
