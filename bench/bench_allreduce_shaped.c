/* `apiary bench allreduce-shaped`: the butterfly all-reduce between real
 * processes on shaped links (network namespaces, veth + htb: testing/netns.h),
 * against the DeDLOC model's lower bound.
 *
 *   equal links:  4 and 8 peers at 100 Mbit/s up and down, 4 M floats;
 *   hetero links: 1000/100/100/20 Mbit/s + a client-only peer at 100, 2 M
 *                 floats, once with LP-balanced parts and once with equal
 *                 parts (every member declares the same bandwidth).
 *
 * Metrics: shaped_round_over_bound {links: equal|hetero} = median round time
 * / the LP bound computed with the links' measured TCP goodput (one plain
 * TCP stream per link and direction, measured first in the same run) and the
 * protocol's framing overhead (chunk header, mux frames, Noise tag + length:
 * +0.08 % at 16 K-element chunks); shaped_balanced_speedup = equal-parts
 * round / balanced round. Fields give the bound at the nominal rates too
 * (over_nominal), the CPU seconds of all workers per round, payload MB per
 * CPU second and the load average.
 *
 * --lead auto|off|N: pacing of the measured runs (default auto, the
 * library's); --vs L: the same cases with lead L back to back, in the same
 * line (vs_round_s, vs_over_bound). --codec a,b,...: every case per codec;
 * the bound of a codec is the LP bound at its bytes per element on the wire
 * instead of 4, and shaped_codec_speedup = the first codec's round / this
 * codec's round (bytes_ratio: the proportional speed-up).
 *
 * Needs root and network namespaces; otherwise it prints why and reports
 * nothing (exit 0). */
#include "allreduce_netns.h"
#include "allreduce_procs.h"
#include "bench.h"
#include "netns.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/log.h"
#include "averaging/allreduce.h"
#include "averaging/avg_codec.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXP   16
#define MBIT   1e6
#define FRAME  1514.0 /* Ethernet frame of a full TCP segment */
#define TCP_PL 1448.0 /* its payload (with timestamps) */

/* Wire bytes per payload byte above TCP: the chunk header (12 B) and the mux
 * START length (4 B) per chunk of cb payload bytes, a mux frame header (8 B)
 * per 32 KiB, the Noise tag + length prefix (18 B) per 65,519 B. */
static double framing_overhead(double cb)
{
    return (1 + 16 / cb) * (1 + 8 / 32768.0) * (1 + 18 / 65519.0);
}

/* The LP bound (s) for elems float32 with links up/down (bytes/s of payload). */
static double lp_bound(size_t n, const ap_avg_role_t *roles, const double *up, const double *down,
                       uint64_t elems)
{
    ap_avg_bw_t bw[MAXP];
    double sh[MAXP], t;
    for (size_t i = 0; i < n; i++) bw[i] = (ap_avg_bw_t){roles[i], up[i], down[i]};
    if (ap_avg_balance(bw, n, NULL, sh, &t)) return -1;
    return t * (double)elems * 4;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* JSON-safe copy (quotes, backslashes and control characters become ' '). */
static void json_safe(char *dst, size_t n, const char *src)
{
    size_t k = 0;
    for (; src[k] && k + 1 < n; k++) {
        char ch = src[k];
        dst[k] = (ch == '"' || ch == '\\' || (unsigned char)ch < 0x20) ? ' ' : ch;
    }
    dst[k] = 0;
}

typedef struct series {
    double median_s, cpu_s, mb_per_cpu_s;
    int rounds;
} series_t;

/* warmup + rounds rounds; the median of the measured ones. -1 on failure
 * (message printed). */
static uint32_t g_chunk;       /* --chunk; 0 = the library's rule for the real links */
static uint32_t g_lead = 0;    /* --lead: pacing of the measured runs (0 = auto) */
static uint32_t g_vs_lead = 0; /* --vs: pacing of a comparison series */
static bool g_vs = false;      /* whether to run it */
#define MAX_CODECS 8
static uint8_t g_codecs[MAX_CODECS] = {AP_AVG_CODEC_F32}; /* --codec */
static size_t g_ncodecs = 1;

static const struct {
    const char *name;
    uint8_t id;
} codec_names[] = {{"none", AP_AVG_CODEC_F32},
                   {"fp16", AP_AVG_CODEC_FP16},
                   {"bf16", AP_AVG_CODEC_BF16},
                   {"uniform8", AP_AVG_CODEC_UNIFORM8},
                   {"blockwise8", AP_AVG_CODEC_BLOCKWISE8}};

static const char *codec_name(uint8_t id)
{
    for (size_t k = 0; k < sizeof codec_names / sizeof codec_names[0]; k++)
        if (codec_names[k].id == id) return codec_names[k].name;
    return "?";
}

/* A comma-separated list of codec names into g_codecs. */
static bool parse_codecs(const char *arg)
{
    char buf[200];
    snprintf(buf, sizeof buf, "%s", arg);
    g_ncodecs = 0;
    char *save;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        size_t k = 0;
        while (k < sizeof codec_names / sizeof codec_names[0] && strcmp(codec_names[k].name, t))
            k++;
        if (k == sizeof codec_names / sizeof codec_names[0] || g_ncodecs == MAX_CODECS)
            return false;
        g_codecs[g_ncodecs++] = codec_names[k].id;
    }
    return g_ncodecs > 0;
}

/* Payload bytes per element on the wire with codec id (chunks of chunk). */
static double codec_bpe(uint8_t id, uint32_t chunk)
{
    const ap__avg_codec_t *c = ap__avg_codec_get(id);
    return c ? (double)c->size(chunk) / chunk : 4;
}

static int run_series(ap_netns_t *ns, const ap_arns_peer_t *peers, size_t n, uint64_t elems,
                      int warmup, int rounds, uint32_t lead, uint8_t codec, uint32_t chunk,
                      series_t *out)
{
    ap_arns_opts_t o = {.elems = elems,
                        .max_lead_chunks = lead,
                        .chunk_elems = chunk,
                        .codec = codec,
                        /* equal-parts runs declare bandwidths the links do not
                         * have: a long deadline lets them finish */
                        .deadline_factor = 50,
                        .connect_grace_us = 10000000,
                        .stall_min_us = 3000000,
                        .rounds = warmup + rounds};
    ap_arns_round_t res[64];
    char why[300];
    int rc = ap_arns_run(ns, peers, n, &o, res, why, sizeof why);
    if (rc) {
        fprintf(stderr, "allreduce-shaped: %s (%s)\n", why, ap_err_name(rc));
        return -1;
    }
    double t[64], cpu = 0, bytes = 0;
    for (int r = 0; r < warmup + rounds; r++) {
        if (res[r].status || !res[r].exact || res[r].min_fraction != 1.0) {
            fprintf(stderr, "allreduce-shaped: round %d failed: status %s, fraction %.4f: %s\n", r,
                    ap_err_name(res[r].status), res[r].min_fraction, res[r].why);
            return -1;
        }
        if (r < warmup) continue;
        t[r - warmup] = res[r].round_s;
        cpu += res[r].cpu_s;
        bytes += (double)res[r].payload_bytes;
    }
    qsort(t, (size_t)rounds, sizeof t[0], cmp_double);
    out->median_s = rounds % 2 ? t[rounds / 2] : (t[rounds / 2 - 1] + t[rounds / 2]) / 2;
    out->cpu_s = cpu / rounds;
    out->mb_per_cpu_s = cpu > 0 ? bytes / 1e6 / cpu : 0;
    out->rounds = rounds;
    return 0;
}

typedef struct links_meas {
    double up[MAXP], down[MAXP]; /* bytes/s of TCP payload */
    double worst_ratio;          /* min over links of goodput / (rate·1448/1514) */
} links_meas_t;

/* Measures the links and checks that the shaping holds: no link may carry
 * more than 5 % above its rate's TCP payload share. */
static int measure_links(ap_netns_t *ns, const ap_netns_link_t *links, size_t n, double seconds,
                         links_meas_t *m)
{
    char why[300];
    int rc = ap_netns_measure(ns, seconds, m->up, m->down, why, sizeof why);
    if (rc) {
        fprintf(stderr, "allreduce-shaped: measuring the links: %s\n", why);
        return -1;
    }
    m->worst_ratio = 10;
    for (size_t i = 0; i < n; i++) {
        double ru = m->up[i] / (links[i].up_bps / 8 * TCP_PL / FRAME);
        double rd = m->down[i] / (links[i].down_bps / 8 * TCP_PL / FRAME);
        fprintf(stderr,
                "allreduce-shaped: host %zu TCP goodput up %.1f Mbit/s (%.3f of %.0f), down %.1f "
                "Mbit/s (%.3f of %.0f)\n",
                i, m->up[i] * 8 / MBIT, ru, links[i].up_bps / MBIT, m->down[i] * 8 / MBIT, rd,
                links[i].down_bps / MBIT);
        if (ru > 1.05 || rd > 1.05) {
            fprintf(stderr, "allreduce-shaped: host %zu's link is not shaped as asked\n", i);
            return -1;
        }
        if (ru < m->worst_ratio) m->worst_ratio = ru;
        if (rd < m->worst_ratio) m->worst_ratio = rd;
    }
    if (m->worst_ratio < 0.8)
        fprintf(stderr,
                "allreduce-shaped: a link carries %.0f %% of its rate (CPU-bound on this host?); "
                "the bound uses the measured goodput\n",
                m->worst_ratio * 100);
    return 0;
}

typedef struct scenario {
    const char *links;
    size_t n;
    ap_avg_role_t role[MAXP];
    double up_mbit[MAXP], down_mbit[MAXP];
    uint64_t elems;
    bool equal_parts_too; /* also run with equal declared bandwidths */
} scenario_t;

static int run_scenario(ap_bench_ctx_t *c, const scenario_t *s, int warmup, int rounds,
                        double measure_s)
{
    size_t n = s->n;
    ap_netns_link_t links[MAXP];
    for (size_t i = 0; i < n; i++)
        links[i] = (ap_netns_link_t){s->up_mbit[i] * MBIT, s->down_mbit[i] * MBIT};
    ap_netns_t *ns;
    char why[300];
    int rc = ap_netns_new(n, links, &ns, why, sizeof why);
    if (rc) {
        fprintf(stderr, "allreduce-shaped: namespaces: %s\n", why);
        return -1;
    }
    int ret = -1;
    double f32_s = 0;
    links_meas_t m;
    if (measure_links(ns, links, n, measure_s, &m)) goto out;

    ap_arns_peer_t peers[MAXP];
    for (size_t i = 0; i < n; i++)
        peers[i] = (ap_arns_peer_t){s->role[i], links[i].up_bps / 8, links[i].down_bps / 8};
    /* One chunk size for every series of the scenario (the equal-parts runs
     * declare other bandwidths): --chunk, or what the library picks for the
     * real links (ap_allreduce_opts_t.chunk_elems = 0). */
    uint32_t chunk = g_chunk;
    if (!chunk) {
        ap_avg_member_t mem[MAXP];
        memset(mem, 0, sizeof mem);
        for (size_t i = 0; i < n; i++)
            mem[i].up = peers[i].decl_up, mem[i].down = peers[i].decl_down;
        ap_avg_group_t g = {.members = mem, .n = n};
        chunk = ap__avg_auto_chunk(&g);
    }
    for (size_t ci = 0; ci < g_ncodecs; ci++) {
        uint8_t codec = g_codecs[ci];
        /* the bound for a codec: the LP bound at its bytes per element */
        double bpe = codec_bpe(codec, chunk);
        double ovh = framing_overhead(bpe * chunk);
        double mu[MAXP], md[MAXP], nu[MAXP], nd[MAXP];
        for (size_t i = 0; i < n; i++) {
            mu[i] = m.up[i] / ovh * 4 / bpe;
            md[i] = m.down[i] / ovh * 4 / bpe;
            nu[i] = links[i].up_bps / 8 * 4 / bpe;
            nd[i] = links[i].down_bps / 8 * 4 / bpe;
        }
        double bound = lp_bound(n, s->role, mu, md, s->elems);
        double bound_nom = lp_bound(n, s->role, nu, nd, s->elems);
        if (bound <= 0 || bound_nom <= 0) goto out;

        series_t bal, vs = {0};
        if (run_series(ns, peers, n, s->elems, warmup, rounds, g_lead, codec, chunk, &bal))
            goto out;
        if (g_vs &&
            run_series(ns, peers, n, s->elems, warmup, rounds, g_vs_lead, codec, chunk, &vs))
            goto out;
        char f[900], lb[16], vb[16], vsf[200] = "";
        if (g_vs)
            snprintf(vsf, sizeof vsf,
                     ",\"vs_lead\":\"%s\",\"vs_round_s\":%.4f,\"vs_over_bound\":%.4f",
                     ap_arp_lead_name(g_vs_lead, vb), vs.median_s, vs.median_s / bound);
        snprintf(f, sizeof f,
                 "\"links\":\"%s\",\"peers\":%zu,\"elems\":%llu,\"codec\":\"%s\","
                 "\"bytes_per_elem\":%.4f,\"chunk_elems\":%u,\"lead\":\"%s\",\"rounds\":%d,"
                 "\"round_s\":%.4f,\"bound_s\":%.4f,\"bound_nominal_s\":%.4f,"
                 "\"over_nominal\":%.4f%s,\"tcp_goodput_min\":%.3f,\"framing_overhead\":%.5f,"
                 "\"cpu_s_per_round\":%.3f,\"payload_MB_per_cpu_s\":%.1f,\"load1\":%.2f",
                 s->links, n, (unsigned long long)s->elems, codec_name(codec), bpe, chunk,
                 ap_arp_lead_name(g_lead, lb), bal.rounds, bal.median_s, bound, bound_nom,
                 bal.median_s / bound_nom, vsf, m.worst_ratio, ovh, bal.cpu_s, bal.mb_per_cpu_s,
                 ap_bench_load1());
        ap_bench_report(c, "shaped_round_over_bound", bal.median_s / bound, "x", f);
        if (g_ncodecs > 1) {
            if (ci == 0)
                f32_s = bal.median_s;
            else if (f32_s > 0) {
                snprintf(f, sizeof f,
                         "\"links\":\"%s\",\"peers\":%zu,\"codec\":\"%s\",\"vs_codec\":\"%s\","
                         "\"round_s\":%.4f,\"vs_round_s\":%.4f,\"bytes_ratio\":%.3f,"
                         "\"load1\":%.2f",
                         s->links, n, codec_name(codec), codec_name(g_codecs[0]), bal.median_s,
                         f32_s, codec_bpe(g_codecs[0], chunk) / bpe, ap_bench_load1());
                ap_bench_report(c, "shaped_codec_speedup", f32_s / bal.median_s, "x", f);
            }
        }

        if (s->equal_parts_too && ci == 0) {
            ap_arns_peer_t eqp[MAXP];
            for (size_t i = 0; i < n; i++) eqp[i] = (ap_arns_peer_t){s->role[i], 12.5e6, 12.5e6};
            series_t eq;
            if (run_series(ns, eqp, n, s->elems, warmup, rounds, g_lead, codec, chunk, &eq))
                goto out;
            snprintf(f, sizeof f,
                     "\"links\":\"%s\",\"peers\":%zu,\"elems\":%llu,\"codec\":\"%s\","
                     "\"rounds\":%d,\"equal_parts_s\":%.4f,\"balanced_s\":%.4f,"
                     "\"equal_parts_cpu_s\":%.3f,\"load1\":%.2f",
                     s->links, n, (unsigned long long)s->elems, codec_name(codec), eq.rounds,
                     eq.median_s, bal.median_s, eq.cpu_s, ap_bench_load1());
            ap_bench_report(c, "shaped_balanced_speedup", eq.median_s / bal.median_s, "x", f);
        }
    }
    ret = 0;
out:
    ap_netns_free(ns);
    return ret;
}

static void usage(void)
{
    fprintf(stderr, "usage: apiary bench allreduce-shaped [--part equal|equal8|hetero|all] "
                    "[--rounds R] [--elems N] [--chunk ELEMS] [--lead auto|off|CHUNKS] "
                    "[--vs auto|off|CHUNKS] [--codec none,fp16,bf16,uniform8,blockwise8]\n");
}

static int bench_allreduce_shaped(ap_bench_ctx_t *c, int argc, char **argv)
{
    const char *part = "all";
    int rounds = c->quick ? 1 : 3, warmup = 1;
    uint64_t elems_override = 0;
    for (int k = 1; k < argc; k++) { /* argv[0] is the bench name */
        if (!strcmp(argv[k], "--part") && k + 1 < argc)
            part = argv[++k];
        else if (!strcmp(argv[k], "--rounds") && k + 1 < argc)
            rounds = atoi(argv[++k]);
        else if (!strcmp(argv[k], "--lead") && k + 1 < argc &&
                 ap_arp_lead_parse(argv[k + 1], &g_lead))
            k++;
        else if (!strcmp(argv[k], "--vs") && k + 1 < argc &&
                 ap_arp_lead_parse(argv[k + 1], &g_vs_lead))
            k++, g_vs = true;
        else if (!strcmp(argv[k], "--codec") && k + 1 < argc && parse_codecs(argv[k + 1]))
            k++;
        else if (!strcmp(argv[k], "--chunk") && k + 1 < argc)
            g_chunk = (uint32_t)strtoul(argv[++k], NULL, 10);
        else if (!strcmp(argv[k], "--elems") && k + 1 < argc)
            elems_override = strtoull(argv[++k], NULL, 10);
        else {
            usage();
            return 2;
        }
    }
    if (rounds < 1 || rounds > 32 || (g_chunk && g_chunk < 256) || g_chunk > (1u << 20)) {
        usage();
        return 2;
    }
    char why[300];
    int rc = ap_netns_probe(why, sizeof why);
    if (rc) {
        char safe[300];
        json_safe(safe, sizeof safe, why);
        fprintf(stderr, "allreduce-shaped: skipped: %s\n", safe);
        if (c->json)
            printf("{\"bench\":\"%s\",\"skipped\":true,\"reason\":\"%s\"}\n", c->name, safe);
        return 0;
    }
    ap_log_set_level(AP_LOG_ERROR);
    uint64_t big = c->quick ? (1u << 19) : (1u << 22);
    double measure_s = c->quick ? 1.0 : 2.0;
    scenario_t equal4 = {.links = "equal",
                         .n = 4,
                         .role = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL},
                         .up_mbit = {100, 100, 100, 100},
                         .down_mbit = {100, 100, 100, 100},
                         .elems = elems_override ? elems_override : big};
    scenario_t equal8 = equal4;
    equal8.n = 8;
    for (size_t i = 0; i < 8; i++) {
        equal8.role[i] = AP_AVG_NORMAL;
        equal8.up_mbit[i] = equal8.down_mbit[i] = 100;
    }
    scenario_t hetero = {
        .links = "hetero",
        .n = 5,
        .role = {AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_NORMAL, AP_AVG_CLIENT},
        .up_mbit = {1000, 100, 100, 20, 100},
        .down_mbit = {1000, 100, 100, 20, 100},
        .elems = elems_override ? elems_override : big / 2,
        .equal_parts_too = true};
    bool all = !strcmp(part, "all");
    int fails = 0, ran = 0;
    if (all || !strcmp(part, "equal"))
        ran++, fails += run_scenario(c, &equal4, warmup, rounds, measure_s) != 0;
    if ((all && !c->quick) || !strcmp(part, "equal8"))
        ran++, fails += run_scenario(c, &equal8, warmup, rounds, measure_s) != 0;
    if (all || !strcmp(part, "hetero"))
        ran++, fails += run_scenario(c, &hetero, warmup, rounds, measure_s) != 0;
    if (!ran) {
        usage();
        return 2;
    }
    return fails ? 1 : 0;
}

AP_BENCH(bench_allreduce_shaped_def, "allreduce-shaped", bench_allreduce_shaped,
         "butterfly all-reduce between processes on htb-shaped veth links (netns, root): round "
         "time vs the DeDLOC LP bound")
