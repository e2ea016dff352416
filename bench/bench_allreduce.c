/* `apiary bench allreduce`: the butterfly all-reduce on real processes over
 * TCP + Noise on 127.0.0.1 (P `apiary avg-worker` processes, spawned and
 * synchronised by testing/allreduce_procs.c), for P = 2, 4, 8, 16M and 64M
 * float32 elements, codecs none, fp16, uniform8, blockwise8.
 *   round_s          median wall time of a measured round (barrier release to
 *                    the last worker's report), fields peers, elems, codec
 *   busbw_MBps       2(P-1)/P * elems * 4 / round_s / 1e6 (the NCCL "bus
 *                    bandwidth" of float32 data, whatever the codec), with
 *                    PyTorch gloo's all_reduce of the same P and elems as the
 *                    baseline when python3-torch is importable
 *   cpu_s_per_round  median CPU seconds of a round, summed over the workers;
 *                    every row also carries it per wire byte (summed over
 *                    the workers too) and per element, gloo's per element
 *   gloo_busbw_MBps  the gloo baseline itself (bench/allreduce_gloo.py)
 * Every round's result is checked by the workers against the weighted mean
 * computed from the data seeds (exact to one float rounding for none; the
 * codec's error bound otherwise) and the receivers' digests must agree; a
 * failed check fails the bench. */
#include "allreduce_procs.h"
#include "bench.h"
#include "cli.h"

#include "apiary/error.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAXL 8

static int parse_list_u64(const char *s, uint64_t *out, int max)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == max || ap_cli_count(t, &out[n]) || !out[n]) return -1;
        n++;
    }
    return n;
}

static int parse_codecs(const char *s, uint8_t *out, int max)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == max || ap_arp_codec_parse(t, &out[n])) return -1;
        n++;
    }
    return n;
}

/* Median round time of gloo's all_reduce, or 0 if it failed. */
static double run_gloo(const char *py, const char *script, int peers, uint64_t elems, int rounds,
                       int warmup, double *cpu)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "env OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE '%s' '%s' --peers %d --elems %llu "
             "--rounds %d --warmup %d 2>/dev/null",
             py, script, peers, (unsigned long long)elems, rounds, warmup);
    FILE *p = popen(cmd, "r");
    if (!p) return 0;
    char line[1024];
    double rs = 0;
    *cpu = 0;
    while (fgets(line, sizeof line, p)) {
        const char *q = strstr(line, "\"round_s\":");
        if (q) rs = atof(q + 10);
        const char *c = strstr(line, "\"cpu_s\":");
        if (c) *cpu = atof(c + 8);
    }
    if (pclose(p) != 0) return 0;
    return rs;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: apiary bench allreduce [--json] [--quick] [options]\n\n"
               "The all-reduce on P real processes over TCP + Noise on 127.0.0.1.\n"
               "  --peers LIST        process counts (default 2,4,8)\n"
               "  --elems LIST        vector lengths, suffix K/M/G (default 16M,64M)\n"
               "  --codec LIST        none,fp16,bf16,uniform8,blockwise8 (default\n"
               "                      none,fp16,uniform8,blockwise8)\n"
               "  --rounds R          measured rounds per case (default 3)\n"
               "  --warmup W          warm-up rounds per case (default 1)\n"
               "  --chunk-elems N     elements per chunk (default: the library's)\n"
               "  --lead auto|off|N   pacing lead in chunks (default auto)\n"
               "  --no-gloo           skip the PyTorch gloo baseline\n"
               "  --keep              keep the temporary directory (keys, group, logs)\n"
               "  --dump-dir DIR      workers write their last vector to\n"
               "                      DIR/<codec>-p<P>-e<elems>/result-<i>.f32\n"
               "  --timeout S         per case (default 600)\n"
               "  --roles LIST        member roles in order, e.g. normal,client,aux (one\n"
               "                      --peers value of that length); default all normal\n"
               "--quick: peers 2,4, 1M elements, none and fp16, 2 rounds.\n");
}

static int bench_allreduce(ap_bench_ctx_t *c, int argc, char **argv)
{
    uint64_t peers[MAXL] = {2, 4, 8}, elems[MAXL] = {16u << 20, 64u << 20};
    int np = 3, ne = 2, nc = 4;
    uint8_t codecs[MAXL] = {AP_AVG_CODEC_F32, AP_AVG_CODEC_FP16, AP_AVG_CODEC_UNIFORM8,
                            AP_AVG_CODEC_BLOCKWISE8};
    int rounds = 3, warmup = 1;
    uint64_t chunk = 0;
    uint32_t lead = 0;
    bool gloo = true, keep = false;
    const char *dump_dir = NULL;
    double timeout = 600;
    ap_avg_role_t roles[AP_ARP_MAX_PEERS];
    int nroles = 0;
    if (c->quick) {
        np = 2;
        elems[0] = 1u << 20;
        ne = 1;
        nc = 2;
        rounds = 2;
    }
    static const struct option opts[] = {
        {"peers", required_argument, NULL, 'p'},   {"elems", required_argument, NULL, 'e'},
        {"codec", required_argument, NULL, 'c'},   {"rounds", required_argument, NULL, 'r'},
        {"warmup", required_argument, NULL, 'w'},  {"chunk-elems", required_argument, NULL, 'C'},
        {"lead", required_argument, NULL, 'A'},    {"no-gloo", no_argument, NULL, 'G'},
        {"keep", no_argument, NULL, 'k'},          {"dump-dir", required_argument, NULL, 'd'},
        {"timeout", required_argument, NULL, 't'}, {"roles", required_argument, NULL, 'R'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0}};
    int o;
    optind = 1;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (o) {
        case 'p':
            np = parse_list_u64(optarg, peers, MAXL);
            for (int i = 0; i < np; i++)
                if (peers[i] < 2 || peers[i] > AP_ARP_MAX_PEERS) np = -1;
            if (np < 1) {
                fprintf(stderr, "bench allreduce: --peers needs a list of 2..%d\n",
                        AP_ARP_MAX_PEERS);
                return 2;
            }
            break;
        case 'e':
            ne = parse_list_u64(optarg, elems, MAXL);
            if (ne < 1) {
                fprintf(stderr, "bench allreduce: --elems needs a list like 16M,64M\n");
                return 2;
            }
            break;
        case 'c':
            nc = parse_codecs(optarg, codecs, MAXL);
            if (nc < 1) {
                fprintf(stderr,
                        "bench allreduce: --codec needs a list of none, fp16, bf16, uniform8, "
                        "blockwise8\n");
                return 2;
            }
            break;
        case 'r': {
            long long v_;
            if (!ap_cli_int("--rounds", optarg, 1, 100000, &v_)) return 2;
            rounds = (int)v_;
        } break;
        case 'w': {
            long long v_;
            if (!ap_cli_int("--warmup", optarg, 0, 100000, &v_)) return 2;
            warmup = (int)v_;
        } break;
        case 'C':
            if (ap_cli_count(optarg, &chunk) || !chunk || chunk > (1u << 20)) {
                fprintf(stderr, "bench allreduce: --chunk-elems needs 1..2^20\n");
                return 2;
            }
            break;
        case 'A':
            if (!ap_arp_lead_parse(optarg, &lead)) {
                fprintf(stderr, "bench allreduce: --lead needs auto, off or a chunk count\n");
                return 2;
            }
            break;
        case 'G':
            gloo = false;
            break;
        case 'k':
            keep = true;
            break;
        case 'd':
            dump_dir = optarg;
            break;
        case 't':
            if (!ap_cli_num("--timeout", optarg, 1, 1e6, &timeout)) return 2;
            break;
        case 'R': {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", optarg);
            nroles = 0;
            char *save = NULL;
            for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
                if (nroles == AP_ARP_MAX_PEERS || ap_arp_role_parse(t, &roles[nroles++])) {
                    fprintf(stderr, "bench allreduce: --roles needs normal, client or aux\n");
                    return 2;
                }
            break;
        }
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    for (int i = 0; nroles && i < np; i++)
        if (peers[i] != (uint64_t)nroles) {
            fprintf(stderr, "bench allreduce: --roles lists %d roles; use it with --peers %d\n",
                    nroles, nroles);
            return 2;
        }
    if (rounds < 1 || warmup < 0 || rounds + warmup > AP_ARP_MAX_ROUNDS) {
        fprintf(stderr, "bench allreduce: need 1 <= rounds and rounds + warmup <= %d\n",
                AP_ARP_MAX_ROUNDS);
        return 2;
    }
    const char *py = NULL, *script = NULL;
    if (gloo) {
        script = ap_bench_script("allreduce_gloo.py");
        py = script ? ap_bench_python("import torch.distributed as d; assert d.is_gloo_available()")
                    : NULL;
        if (!py)
            fprintf(stderr,
                    "bench allreduce: PyTorch with gloo not importable%s; no gloo "
                    "baseline (apt-get install python3-torch)\n",
                    script ? "" : " or bench/allreduce_gloo.py not found");
    }
    /* A benchmark measures throughput, not the fault rules: on a shared 2-core
     * machine at load ~10, 8 processes can leave one stream without a message
     * for more than the workers' default 5 s, and the stall rule would then
     * drop a live peer (seen at P = 8). */
    char lead_s[16];
    const char *const lenient[] = {"--stall-s", "60",     "--connect-grace-s",
                                   "60",        "--lead", ap_arp_lead_name(lead, lead_s),
                                   NULL};
    char dir[] = "/tmp/apiary-bench-allreduce-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    int failed = 0;
    for (int ie = 0; ie < ne; ie++) {
        for (int ip = 0; ip < np; ip++) {
            int P = (int)peers[ip];
            uint64_t E = elems[ie];
            double bus_bytes = 2.0 * (P - 1) / P * (double)E * 4;
            double gloo_bus = 0;
            if (py) {
                double gcpu = 0;
                double gs = run_gloo(py, script, P, E, rounds, warmup, &gcpu);
                if (gs > 0) {
                    gloo_bus = bus_bytes / gs / 1e6;
                    char f[256];
                    snprintf(f, sizeof f,
                             "\"peers\":%d,\"elems\":%llu,\"codec\":\"none\",\"round_s\":%.4f,"
                             "\"cpu_s\":%.3f,\"cpu_ns_per_elem\":%.3f,\"encrypted\":false,"
                             "\"load1\":%.2f",
                             P, (unsigned long long)E, gs, gcpu, E ? gcpu * 1e9 / (double)E : 0,
                             ap_bench_load1());
                    ap_bench_report(c, "gloo_busbw_MBps", gloo_bus, "MB/s", f);
                } else {
                    fprintf(stderr, "bench allreduce: the gloo run (P=%d) failed\n", P);
                }
            }
            for (int ic = 0; ic < nc; ic++) {
                char cdir[600], ddir[900];
                snprintf(cdir, sizeof cdir, "%s/%s-p%d-e%llu", dir, ap_arp_codec_name(codecs[ic]),
                         P, (unsigned long long)E);
                mkdir(cdir, 0700);
                if (dump_dir) {
                    mkdir(dump_dir, 0755);
                    snprintf(ddir, sizeof ddir, "%s/%s-p%d-e%llu", dump_dir,
                             ap_arp_codec_name(codecs[ic]), P, (unsigned long long)E);
                    mkdir(ddir, 0755);
                }
                ap_arp_cfg_t cfg = {.dir = cdir,
                                    .peers = P,
                                    .elems = E,
                                    .codec = codecs[ic],
                                    .rounds = rounds,
                                    .warmup = warmup,
                                    .chunk_elems = (uint32_t)chunk,
                                    .seed = 1,
                                    .timeout_s = timeout,
                                    .roles = nroles ? roles : NULL,
                                    .extra_args = lenient,
                                    .dump_dir = dump_dir ? ddir : NULL};
                double l1 = ap_bench_load1();
                static ap_arp_result_t res;
                int rc = ap_arp_run(&cfg, &res);
                if (rc || !res.verified) {
                    fprintf(stderr, "bench allreduce: P=%d elems=%llu codec=%s: %s\n", P,
                            (unsigned long long)E, ap_arp_codec_name(codecs[ic]),
                            res.why[0] ? res.why : ap_strerror(rc));
                    failed = 1;
                    keep = true;
                    if (rc) continue;
                }
                uint64_t bytes = res.nrounds ? res.r[0].bytes_sent : 0;
                char each[400];
                size_t el = 0;
                each[0] = 0;
                for (int k = 0; k < res.nrounds && el + 16 < sizeof each; k++)
                    el += (size_t)snprintf(each + el, sizeof each - el, "%s%.3f", k ? "," : "",
                                           res.r[k].wall_s);
                char f[900];
                snprintf(f, sizeof f,
                         "\"peers\":%d,\"elems\":%llu,\"codec\":\"%s\",\"encrypted\":true,"
                         "\"verified\":%s,\"cpu_s\":%.3f,\"worker_round_s\":%.4f,"
                         "\"wire_bytes\":%llu,\"cpu_ns_per_wire_byte\":%.3f,"
                         "\"cpu_ns_per_elem\":%.3f,\"max_err\":%.3g,\"lead\":\"%s\","
                         "\"rounds_s\":[%s],\"load1\":%.2f",
                         P, (unsigned long long)E, ap_arp_codec_name(codecs[ic]),
                         res.verified ? "true" : "false", res.median_cpu_s, res.median_worker_s,
                         (unsigned long long)bytes,
                         bytes ? res.median_cpu_s * 1e9 / (double)bytes : 0,
                         E ? res.median_cpu_s * 1e9 / (double)E : 0,
                         res.nrounds ? res.r[0].max_err : 0, lead_s, each, l1);
                double rs = res.median_wall_s;
                ap_bench_report(c, "round_s", rs, "s", f);
                double bus = rs > 0 ? bus_bytes / rs / 1e6 : 0;
                if (gloo_bus > 0)
                    ap_bench_report_vs(c, "busbw_MBps", bus, "MB/s", gloo_bus, f);
                else
                    ap_bench_report(c, "busbw_MBps", bus, "MB/s", f);
                ap_bench_report(c, "cpu_s_per_round", res.median_cpu_s, "s", f);
            }
        }
    }
    if (keep)
        fprintf(stderr, "bench allreduce: keys, group files and worker logs kept in %s\n", dir);
    else {
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) fprintf(stderr, "bench allreduce: could not remove %s\n", dir);
    }
    return failed;
}

AP_BENCH(bench_allreduce_def, "allreduce", bench_allreduce,
         "all-reduce on 2/4/8 real processes over TCP+Noise: busbw_MBps, round_s (vs gloo)")
