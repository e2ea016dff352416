/* `apiary avg-worker` (internal): one member of a real-process all-reduce
 * group, driven by `apiary bench allreduce` and the shaped-link bench through
 * a group file and a stdin barrier. Protocol: testing/allreduce_procs.h. */
#include "allreduce_procs.h"
#include "cli.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/log.h"
#include "apiary/multiaddr.h"
#include "apiary/node.h"
#include "apiary/sync.h"
#include "base/arena.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static void usage(FILE *f)
{
    fprintf(
        f, "usage: apiary avg-worker --group FILE --key FILE --elems N [options]\n\n"
           "INTERNAL: one process of `apiary bench allreduce` (and the shaped-link bench).\n"
           "Runs an all-reduce group member over TCP + Noise; the group file lists every\n"
           "member (testing/allreduce_procs.h). Prints JSON lines to stdout and, before each\n"
           "round, waits for one line on stdin (the barrier) unless --no-sync.\n\n"
           "  --group FILE         'member MULTIADDR ROLE UP DOWN [WEIGHT]' lines, in group order\n"
           "  --key FILE           this member's key file (its PeerID is in the group)\n"
           "  --listen ADDR        listen multiaddr, any local IP (default: this member's\n"
           "                       address in the group file; clients never listen)\n"
           "  --elems N            vector length (suffix K, M, G = 2^10, 2^20, 2^30)\n"
           "  --codec C            none|fp16|bf16|uniform8|blockwise8 (default none)\n"
           "  --rounds R           measured rounds (default 3)\n"
           "  --warmup W           warm-up rounds before them (default 1)\n"
           "  --seed S             data seed (default 1)\n"
           "  --chunk-elems N      elements per chunk (default: the library's)\n"
           "  --lead auto|off|N    pacing lead in chunks (default auto)\n"
           "  --stall-s S          stall rule minimum (default 5)\n"
           "  --connect-grace-s S  connect grace (default 10)\n"
           "  --deadline-s S       extra slack on each round's deadline (default 300)\n"
           "  --dump PATH          write the last round's vector to PATH (raw float32)\n"
           "  --no-sync            do not wait on stdin before a round\n"
           "  --log-level LEVEL    debug, info, warn (default), error, off\n");
}

typedef struct wstate {
    ap_rt_t *rt;
    ap_avg_service_t *svc;
    ap_avg_member_t mem[AP_ARP_MAX_PEERS];
    ap_arp_member_t file[AP_ARP_MAX_PEERS];
    size_t n;
    int self;
    float *x;
    uint64_t elems;
    ap_allreduce_opts_t opts;
    uint64_t round;
    ap_allreduce_result_t res;
    int setup_rc;
} wstate_t;

static void setup_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    wstate_t *w = arg;
    int rc = ap_avg_service_new(rt, &w->svc);
    for (size_t j = 0; !rc && j < w->n; j++) {
        if ((int)j == w->self || w->file[j].role == AP_AVG_CLIENT) continue;
        rc = ap_rt_add_addr(rt, &w->mem[j].id, w->file[j].addr);
    }
    ap_sync_complete(done, rc);
}

/* Whether i dials j in the connect phase: one dialer per pair (the higher
 * index; a client dials every non-client, and nobody dials a client), so no
 * simultaneous dial replaces a connection later. */
static bool dials(const wstate_t *w, size_t i, size_t j)
{
    ap_avg_role_t ri = w->file[i].role, rj = w->file[j].role;
    if (rj == AP_AVG_CLIENT) return false;
    return ri == AP_AVG_CLIENT || j < i;
}

static void dial_cb(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    (void)rt, (void)arg, (void)peer;
    if (status) ap_warn("bench", "connect phase: a dial failed: %s", ap_strerror(status));
}

static void dial_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    wstate_t *w = arg;
    for (size_t j = 0; j < w->n; j++)
        if ((int)j != w->self && dials(w, (size_t)w->self, j) &&
            !ap_rt_is_connected(rt, &w->mem[j].id))
            ap_rt_dial(rt, w->file[j].addr, 30000000ull, dial_cb, NULL);
    ap_sync_complete(done, 0);
}

/* Completes with the number of members this one should be connected to but
 * is not (yet). */
static void missing_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    wstate_t *w = arg;
    int missing = 0;
    for (size_t j = 0; j < w->n; j++) {
        if ((int)j == w->self) continue;
        if (!dials(w, (size_t)w->self, j) && !dials(w, j, (size_t)w->self)) continue;
        if (!ap_rt_is_connected(rt, &w->mem[j].id)) missing++;
    }
    ap_sync_complete(done, missing);
}

static void teardown_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    wstate_t *w = arg;
    (void)rt;
    ap_sync_complete(done, ap_avg_service_free(w->svc));
}

typedef struct round_call {
    wstate_t *w;
    ap_sync_t *done;
} round_call_t;

static void round_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    round_call_t *c = arg;
    (void)rt;
    c->w->res = *res;
    ap_sync_complete(c->done, 0);
}

static void round_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    round_call_t *c = arg;
    wstate_t *w = c->w;
    (void)rt;
    c->done = done;
    ap_avg_group_t g = {.members = w->mem, .n = w->n};
    ap_arp_group_id(w->round, g.id);
    bool aux = w->mem[w->self].role == AP_AVG_AUX;
    int rc = ap_allreduce_start(w->svc, &g, aux ? NULL : w->x, w->elems, w->file[w->self].weight,
                                &w->opts, round_done, c, NULL);
    if (rc) ap_sync_complete(done, rc);
}

static double cpu_now(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static uint64_t digest(const float *x, uint64_t n)
{
    uint64_t h = 0xcbf29ce484222325ull, h2 = 0x9e3779b97f4a7c15ull;
    uint64_t k = 0;
    for (; k + 2 <= n; k += 2) {
        uint64_t v;
        memcpy(&v, x + k, 8);
        h = (h ^ v) * 0x100000001b3ull;
        h2 = (h2 + v) * 0xff51afd7ed558ccdull;
    }
    if (k < n) {
        uint32_t v;
        memcpy(&v, x + k, 4);
        h = (h ^ v) * 0x100000001b3ull;
    }
    return h ^ (h2 >> 29) ^ n;
}

/* Per-element tolerance of the round's result against the exact weighted
 * mean m (double), given wabs = Σ w_j |x_j| / Σ w_j, amax = the largest |x|
 * of any sender and smax = the largest per-sender standard deviation. */
static double tolerance(uint8_t codec, double m, double wabs, double amax, double smax)
{
    switch (codec) {
    case AP_AVG_CODEC_F32: { /* one rounding of the double mean to float */
        float f = (float)m;
        return (double)nextafterf(fabsf(f), INFINITY) - (double)fabsf(f) + fabs(m - (double)f);
    }
    case AP_AVG_CODEC_FP16: /* data and result rounded to half: 2^-11 relative each */
        return ldexp(1, -11) * (wabs + fabs(m)) * 1.001 + ldexp(1, -24);
    case AP_AVG_CODEC_BF16:
        return ldexp(1, -8) * (wabs + fabs(m)) * 1.001 + ldexp(1, -24);
    case AP_AVG_CODEC_UNIFORM8: /* a bin width (12 std / 256) per quantisation; a chunk's
                                   std may exceed the vector's: 25 % margin */
        return 2 * 12.0 * smax * 1.25 / 256 + ldexp(1, -20) * amax;
    case AP_AVG_CODEC_BLOCKWISE8: /* 0.00785 × block absmax + 2^-22 |x|, twice */
        return 2 * (0.00785 * amax + ldexp(1, -22) * amax) * 1.001;
    }
    return 0;
}

static int worker_main(int argc, char **argv)
{
    const char *group = NULL, *key = NULL, *listen = NULL, *dump = NULL;
    uint64_t elems = 0;
    uint8_t codec = AP_AVG_CODEC_F32;
    int rounds = 3, warmup = 1;
    uint32_t seed = 1, chunk = 0, lead = 0;
    double stall_s = 5, grace_s = 10, deadline_s = 300;
    bool sync = true;
    static const struct option opts[] = {{"group", required_argument, NULL, 'g'},
                                         {"key", required_argument, NULL, 'k'},
                                         {"listen", required_argument, NULL, 'L'},
                                         {"elems", required_argument, NULL, 'e'},
                                         {"codec", required_argument, NULL, 'c'},
                                         {"rounds", required_argument, NULL, 'r'},
                                         {"warmup", required_argument, NULL, 'w'},
                                         {"seed", required_argument, NULL, 's'},
                                         {"chunk-elems", required_argument, NULL, 'C'},
                                         {"lead", required_argument, NULL, 'A'},
                                         {"stall-s", required_argument, NULL, 'S'},
                                         {"connect-grace-s", required_argument, NULL, 'G'},
                                         {"deadline-s", required_argument, NULL, 'D'},
                                         {"dump", required_argument, NULL, 'd'},
                                         {"no-sync", no_argument, NULL, 'n'},
                                         {"log-level", required_argument, NULL, 'l'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        uint64_t v;
        switch (c) {
        case 'g':
            group = optarg;
            break;
        case 'k':
            key = optarg;
            break;
        case 'L':
            listen = optarg;
            break;
        case 'e':
            if (ap_cli_count(optarg, &elems) || !elems || elems > AP_ALLREDUCE_MAX_ELEMS) {
                fprintf(stderr, "avg-worker: --elems needs 1..2^34 (e.g. 16M)\n");
                return 2;
            }
            break;
        case 'c':
            if (ap_arp_codec_parse(optarg, &codec)) {
                fprintf(stderr, "avg-worker: unknown codec '%s'\n", optarg);
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
        case 's': {
            long long v_;
            if (!ap_cli_int("--seed", optarg, 0, 4294967295LL, &v_)) return 2;
            seed = (uint32_t)v_;
        } break;
        case 'C':
            if (ap_cli_count(optarg, &v) || !v || v > (1u << 20)) {
                fprintf(stderr, "avg-worker: --chunk-elems needs 1..2^20\n");
                return 2;
            }
            chunk = (uint32_t)v;
            break;
        case 'A':
            if (!ap_arp_lead_parse(optarg, &lead)) {
                fprintf(stderr, "avg-worker: --lead needs auto, off or a chunk count\n");
                return 2;
            }
            break;
        case 'S':
            if (!ap_cli_num("--stall-s", optarg, 0, 1e6, &stall_s)) return 2;
            break;
        case 'G':
            if (!ap_cli_num("--connect-grace-s", optarg, 0, 1e6, &grace_s)) return 2;
            break;
        case 'D':
            if (!ap_cli_num("--deadline-s", optarg, 0, 1e6, &deadline_s)) return 2;
            break;
        case 'd':
            dump = optarg;
            break;
        case 'n':
            sync = false;
            break;
        case 'l':
            if (!ap_cli_set_log_level(optarg)) return 2;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (!group || !key || !elems || optind != argc || rounds < 0 || warmup < 0 || !(stall_s > 0) ||
        !(grace_s > 0) || !(deadline_s > 0)) {
        usage(stderr);
        return 2;
    }
    static wstate_t w;
    char err[512];
    if (ap_arp_group_read(group, w.file, AP_ARP_MAX_PEERS, &w.n, err, sizeof err)) {
        fprintf(stderr, "avg-worker: %s\n", err);
        return 2;
    }
    ap_identity_t id;
    int rc = ap_identity_load(&id, key);
    if (rc) {
        fprintf(stderr, "avg-worker: cannot load %s: %s\n", key, ap_strerror(rc));
        return 1;
    }
    w.self = -1;
    for (size_t j = 0; j < w.n; j++) {
        ap_multiaddr_t ma;
        ap_multiaddr_parse(&ma, w.file[j].addr); /* checked by the reader */
        w.mem[j].id = ma.peer;
        w.mem[j].role = w.file[j].role;
        w.mem[j].up = w.file[j].up;
        w.mem[j].down = w.file[j].down;
        if (ap_peer_id_eq(&ma.peer, &id.id)) w.self = (int)j;
    }
    if (w.self < 0) {
        fprintf(stderr, "avg-worker: the key in %s is not a member of %s\n", key, group);
        ap_identity_wipe(&id);
        return 2;
    }
    ap_arp_member_t *me = &w.file[w.self];
    /* the listen address: --listen, or this member's address minus /p2p/ */
    char laddr[AP_ARP_ADDR_MAX];
    if (me->role == AP_AVG_CLIENT) {
        if (listen) {
            fprintf(stderr, "avg-worker: a client does not listen (drop --listen)\n");
            ap_identity_wipe(&id);
            return 2;
        }
    } else if (listen) {
        snprintf(laddr, sizeof laddr, "%s", listen);
    } else {
        snprintf(laddr, sizeof laddr, "%s", me->addr);
        char *p = strstr(laddr, "/p2p/");
        if (p) *p = 0;
    }
    ap_host_t *h = ap_host_new();
    if (!h || ap_host_start(h)) {
        fprintf(stderr, "avg-worker: cannot start the event loop\n");
        return 1;
    }
    ap_node_opts_t no = {.ed25519_sk = id.sk};
    if (me->role == AP_AVG_CLIENT)
        no.dial_only = true;
    else
        no.listen = laddr;
    rc = ap_node_new(h, &no, &w.rt);
    ap_identity_wipe(&id);
    if (rc) {
        fprintf(stderr, "avg-worker: cannot start the node on %s: %s\n",
                me->role == AP_AVG_CLIENT ? "(dial only)" : laddr, ap_strerror(rc));
        ap_host_free(h);
        return 1;
    }
    rc = ap_node_call_sync(w.rt, setup_fn, &w);
    if (rc) {
        fprintf(stderr, "avg-worker: set-up failed: %s\n", ap_strerror(rc));
        ap_host_free(h);
        return 1;
    }
    w.elems = elems;
    w.opts = (ap_allreduce_opts_t){.chunk_elems = chunk,
                                   .codec = codec,
                                   .max_lead_chunks = lead,
                                   .stall_min_us = (uint64_t)(stall_s * 1e6),
                                   .connect_grace_us = (uint64_t)(grace_s * 1e6),
                                   .deadline_slack_us = (uint64_t)(deadline_s * 1e6)};
    bool sends = me->role != AP_AVG_AUX;
    size_t bytes = (size_t)elems * sizeof(float);
    if (sends && !(w.x = ap__big_alloc(bytes))) {
        fprintf(stderr, "avg-worker: cannot allocate %zu bytes\n", bytes);
        ap_host_free(h);
        return 1;
    }
    /* the senders' data statistics, for the lossy codecs' tolerance */
    double wsum = 0, amax = 0, smax = 0;
    for (size_t j = 0; j < w.n; j++) {
        if (w.file[j].role == AP_AVG_AUX) continue;
        wsum += w.file[j].weight;
        double s = 0, s2 = 0;
        uint64_t ns = elems < (1u << 20) ? elems : (1u << 20);
        for (uint64_t k = 0; k < ns; k++) {
            double v = ap_arp_value(seed, (int)j, k * (elems / ns));
            s += v, s2 += v * v;
            if (fabs(v) > amax) amax = fabs(v);
        }
        double sd = sqrt(fmax(0, s2 / (double)ns - (s / (double)ns) * (s / (double)ns)));
        if (sd > smax) smax = sd;
    }
    amax = fmax(amax, 50.0 + (double)w.n); /* |x| < 50 + i for every member */
    /* connect phase: the Noise handshakes happen before the first round, so
     * a round measures the all-reduce on established connections */
    int missing = -1;
    for (int t = 0; t < 1200 && missing != 0; t++) {
        if (t % 20 == 0) ap_node_call_sync(w.rt, dial_fn, &w); /* every second */
        missing = ap_node_call_sync(w.rt, missing_fn, &w);
        if (missing) usleep(50000);
    }
    if (missing) fprintf(stderr, "avg-worker: %d members not connected after 60 s\n", missing);
    char ids[AP_PEER_ID_STR_MAX];
    char addrs[1][AP_RT_ADDR_MAX] = {{0}};
    ap_node_listen_addrs_sync(w.rt, addrs, 1, false); /* the host runs its own thread */
    printf("{\"event\":\"up\",\"index\":%d,\"id\":\"%s\",\"role\":\"%s\",\"addr\":\"%s\","
           "\"unconnected\":%d}\n",
           w.self, ap_peer_id_str(ap_rt_self(w.rt), ids), ap_arp_role_name(me->role), addrs[0],
           missing);
    fflush(stdout);
    int exit_rc = 0;
    for (int r = 0; r < warmup + rounds; r++) {
        if (sends)
            for (uint64_t k = 0; k < elems; k++) w.x[k] = ap_arp_value(seed, w.self, k);
        printf("{\"event\":\"ready\",\"round\":%d,\"phase\":\"start\"}\n", r);
        fflush(stdout);
        if (sync) {
            char line[64];
            if (!fgets(line, sizeof line, stdin)) break; /* the parent is gone */
        }
        w.round = (uint64_t)r;
        round_call_t call = {.w = &w};
        memset(&w.res, 0, sizeof w.res);
        double c0 = cpu_now();
        rc = ap_node_call_sync(w.rt, round_fn, &call);
        double cpu = cpu_now() - c0;
        if (rc) w.res.status = rc;
        const ap_allreduce_result_t *R = &w.res;
        printf("{\"event\":\"round\",\"round\":%d,\"warmup\":%s,\"status\":%d,\"round_s\":%.6f,"
               "\"cpu_s\":%.6f,\"bytes_sent\":%llu,\"bytes_received\":%llu,"
               "\"averaged_fraction\":%.6f,\"parts_failed\":%u,\"senders_dropped\":%u,"
               "\"predicted_s\":%.6f,\"elems\":%llu,\"codec\":\"%s\",\"peers\":%zu,"
               "\"index\":%d}\n",
               r, r < warmup ? "true" : "false", R->status, (double)R->elapsed_us * 1e-6, cpu,
               (unsigned long long)R->bytes_sent, (unsigned long long)R->bytes_received,
               R->averaged_fraction, R->parts_failed, R->senders_dropped, R->predicted_s,
               (unsigned long long)elems, ap_arp_codec_name(codec), w.n, w.self);
        /* the check runs after every member ended its round (second barrier),
         * so it never takes CPU from a round still running */
        printf("{\"event\":\"ready\",\"round\":%d,\"phase\":\"check\"}\n", r);
        fflush(stdout);
        if (sync) {
            char line[64];
            if (!fgets(line, sizeof line, stdin)) break;
        }
        /* check the result against the weighted mean computed from the seeds */
        uint64_t checked = 0, bad = 0;
        double max_err = 0, max_tol = 0;
        uint64_t dg = 0;
        if (sends) {
            uint64_t step = elems <= (4u << 20) ? 1 : elems / (1u << 20);
            for (uint64_t k = 0; k < elems; k += step) {
                double s = 0, sa = 0;
                for (size_t j = 0; j < w.n; j++) {
                    if (w.file[j].role == AP_AVG_AUX) continue;
                    double v = ap_arp_value(seed, (int)j, k);
                    s += w.file[j].weight * v;
                    sa += w.file[j].weight * fabs(v);
                }
                double m = s / wsum;
                double tol = tolerance(codec, m, sa / wsum, amax, smax);
                double e = fabs((double)w.x[k] - m);
                checked++;
                if (e > max_err) max_err = e;
                if (tol > max_tol) max_tol = tol;
                if (!(e <= tol)) bad++;
            }
            dg = digest(w.x, elems);
        }
        printf("{\"event\":\"check\",\"round\":%d,\"checked\":%llu,\"bad\":%llu,"
               "\"max_err\":%.6g,\"tol\":%.6g,\"digest\":\"%016llx\"}\n",
               r, (unsigned long long)checked, (unsigned long long)bad, max_err, max_tol,
               (unsigned long long)dg);
        fflush(stdout);
        if (R->status) exit_rc = 1;
    }
    if (dump && sends) {
        FILE *f = fopen(dump, "wb");
        if (!f || fwrite(w.x, sizeof(float), elems, f) != elems) exit_rc = 1;
        if (f && fclose(f)) exit_rc = 1;
    }
    printf("{\"event\":\"done\"}\n");
    fflush(stdout);
    if (ap_node_call_sync(w.rt, teardown_fn, &w)) exit_rc = 1;
    ap_node_free(w.rt);
    ap_host_free(h);
    if (w.x) ap__big_free(w.x, bytes);
    return exit_rc;
}

AP_CLI_COMMAND(avg_worker_cmd, "avg-worker", worker_main,
               "INTERNAL: one process of `apiary bench allreduce` (see --help)")
