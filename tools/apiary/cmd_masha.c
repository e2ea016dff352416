/* `apiary masha`: MASHA (docs/compression.md) as real processes: one server
 * and M workers over TCP + Noise. Every process rebuilds the bilinear problem
 * from the shared seed, exactly as the in-process solver (ap_masha_run).
 *
 *   apiary masha server --listen /ip4/127.0.0.1/tcp/0 --workers 10 ...
 *       stdout line 1: the server's full multiaddr (with /p2p/);
 *       last line: a JSON summary once the run is over.
 *   apiary masha worker --server MULTIADDR --index I --workers 10 ...
 *       stdout: one JSON summary line.
 * Exit status: 0 converged, 3 the run ended without converging (max_iters or
 * divergence), 1 error (network, refused, timeout), 2 bad usage. */
#include "cli.h"

#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/log.h"
#include "apiary/masha.h"
#include "apiary/multiaddr.h"
#include "apiary/node.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXIT_USAGE      2
#define EXIT_NOCONVERGE 3
#define GRACE_US        (5ull * 1000000) /* server: wait for workers to hang up */
#define DIAL_RETRY_US   (200ull * 1000)
#define DIAL_ATTEMPT_US (5ull * 1000000)

typedef struct masha_args {
    bool server;
    const char *listen, *server_addr, *identity;
    const char *announce[AP_NODE_MAX_ANNOUNCE];
    int nannounce;
    int index;
    ap_masha_bilinear_cfg_t pc;
    ap_masha_opts_t o;
    bool gamma_set, cseed_set;
    double timeout_s;
} masha_args_t;

static const char *method_name(ap_masha_method_t m)
{
    return m == AP_MASHA_EXTRAGRADIENT ? "eg" : m == AP_MASHA_1 ? "masha1" : "masha2";
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: apiary masha server --listen MULTIADDR [options]\n"
            "       apiary masha worker --server MULTIADDR --index I [options]\n\n"
            "Runs MASHA (distributed extragradient with compressed communication) on the\n"
            "bilinear min-max problem of docs/compression.md, one process per node. The\n"
            "server prints its multiaddr (with /p2p/) on the first stdout line; give it to\n"
            "every worker. Server and workers must get the same problem and method options.\n"
            "Each process prints a JSON summary line when the run is over.\n\n"
            "server:\n"
            "  --listen MULTIADDR    e.g. /ip4/127.0.0.1/tcp/0 (port 0: any free port)\n"
            "worker:\n"
            "  --server MULTIADDR    the server's address incl. /p2p/<PeerID>\n"
            "  --index I             this worker's index, 0..workers-1\n"
            "  --listen MULTIADDR    own TCP address (default /ip4/127.0.0.1/tcp/0)\n"
            "problem (same on every process):\n"
            "  --workers M           number of workers (default 10)\n"
            "  --dim N               x, y in R^N (default 50)\n"
            "  --lambda L            regularization (default 0.05)\n"
            "  --h H                 heterogeneity of the A_m (default 0.1)\n"
            "  --seed S              problem seed (default 2021)\n"
            "method (same on every process):\n"
            "  --method M            eg | masha1 | masha2 (default masha1)\n"
            "  --fraction F          k/d of the workers' rand-k / top-k (default 0.1)\n"
            "  --gamma G             step size (default: the tuned value of docs/compression.md\n"
            "                        for the method, fraction 0.02 or 0.1 and h 0.1 or 1)\n"
            "  --tau T               0 < T < 1 (default 1 - k/d)\n"
            "  --server-fraction F   compress the server's average too (default 0: dense)\n"
            "  --compress-seed S     compressor seeds and refresh coin (default: --seed)\n"
            "  --target T            stop at |z-z*|^2 <= T |z0-z*|^2 (default 1e-6)\n"
            "  --max-iters N         give up after N iterations (default 100000)\n"
            "  --wire V              3: /apiary/masha/3 1-2 byte headers and bare chunks,\n"
            "                        stepping down to 2 and 1 if the server lacks them\n"
            "                        (default); 2: at most /apiary/masha/2; 1: only /1\n"
            "common:\n"
            "  --announce MULTIADDR  address to give to peers instead of --listen's, e.g.\n"
            "                        a forwarded port /ip4/A.B.C.D/tcp/PORT (repeatable)\n"
            "  --identity PATH       Ed25519 key file (created if missing; default: a fresh key)\n"
            "  --timeout SEC         fail if the run is not over after SEC seconds (default 300)\n"
            "  --log-level LEVEL     error|warn|info|debug\n"
            "exit status: 0 converged, 3 ended without converging, 1 error, 2 usage\n");
}

/* Tuned step sizes (apiary bench masha, docs/compression.md). */
static bool default_gamma(const masha_args_t *a, double *g)
{
    static const struct {
        ap_masha_method_t m;
        double frac, h, gamma;
    } t[] = {
        {AP_MASHA_1, 0.02, 0.1, 0.175},  {AP_MASHA_1, 0.1, 0.1, 0.686},
        {AP_MASHA_2, 0.02, 0.1, 0.0899}, {AP_MASHA_2, 0.1, 0.1, 0.403},
        {AP_MASHA_1, 0.02, 1, 0.0666},   {AP_MASHA_1, 0.1, 1, 0.352},
        {AP_MASHA_2, 0.02, 1, 0.0962},   {AP_MASHA_2, 0.1, 1, 0.403},
    };
    if (a->o.method == AP_MASHA_EXTRAGRADIENT && (a->pc.h == 0.1 || a->pc.h == 1)) {
        *g = 1.81;
        return true;
    }
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (t[i].m == a->o.method && t[i].frac == a->o.fraction && t[i].h == a->pc.h) {
            *g = t[i].gamma;
            return true;
        }
    return false;
}

static bool parse_double(const char *flag, const char *s, double lo, double hi, bool lo_open,
                         double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v > hi || (lo_open ? v <= lo : v < lo)) {
        fprintf(stderr, "apiary masha: %s must be a number in %s%g, %g]\n", flag,
                lo_open ? "(" : "[", lo, hi);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    errno = 0;
    if (*s == '-' || *s == '\0') goto bad;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi) goto bad;
    *out = v;
    return true;
bad:
    fprintf(stderr, "apiary masha: %s must be an integer in [%llu, %llu]\n", flag,
            (unsigned long long)lo, (unsigned long long)hi);
    return false;
}

/* Returns 0 to run, -1 to exit 0 (--help), else the exit status. */
static int parse_args(int argc, char **argv, masha_args_t *a)
{
    enum {
        O_LISTEN = 256,
        O_SERVER,
        O_INDEX,
        O_WORKERS,
        O_DIM,
        O_LAMBDA,
        O_H,
        O_SEED,
        O_METHOD,
        O_FRACTION,
        O_GAMMA,
        O_TAU,
        O_SFRAC,
        O_CSEED,
        O_TARGET,
        O_MAXIT,
        O_IDENTITY,
        O_TIMEOUT,
        O_LOG,
        O_HELP,
        O_ANNOUNCE,
        O_WIRE
    };
    static const struct option opts[] = {{"listen", required_argument, NULL, O_LISTEN},
                                         {"announce", required_argument, NULL, O_ANNOUNCE},
                                         {"server", required_argument, NULL, O_SERVER},
                                         {"index", required_argument, NULL, O_INDEX},
                                         {"workers", required_argument, NULL, O_WORKERS},
                                         {"dim", required_argument, NULL, O_DIM},
                                         {"lambda", required_argument, NULL, O_LAMBDA},
                                         {"h", required_argument, NULL, O_H},
                                         {"seed", required_argument, NULL, O_SEED},
                                         {"method", required_argument, NULL, O_METHOD},
                                         {"fraction", required_argument, NULL, O_FRACTION},
                                         {"gamma", required_argument, NULL, O_GAMMA},
                                         {"tau", required_argument, NULL, O_TAU},
                                         {"server-fraction", required_argument, NULL, O_SFRAC},
                                         {"compress-seed", required_argument, NULL, O_CSEED},
                                         {"target", required_argument, NULL, O_TARGET},
                                         {"max-iters", required_argument, NULL, O_MAXIT},
                                         {"wire", required_argument, NULL, O_WIRE},
                                         {"identity", required_argument, NULL, O_IDENTITY},
                                         {"timeout", required_argument, NULL, O_TIMEOUT},
                                         {"log-level", required_argument, NULL, O_LOG},
                                         {"help", no_argument, NULL, O_HELP},
                                         {NULL, 0, NULL, 0}};
    memset(a, 0, sizeof *a);
    a->index = -1;
    a->pc =
        (ap_masha_bilinear_cfg_t){.n = 50, .workers = 10, .lambda = 0.05, .h = 0.1, .seed = 2021};
    a->o = (ap_masha_opts_t){
        .method = AP_MASHA_1, .fraction = 0.1, .max_iters = 100000, .target = 1e-6};
    a->timeout_s = 300;
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        usage(stdout);
        return -1;
    }
    if (argc < 2 || (strcmp(argv[1], "server") && strcmp(argv[1], "worker"))) {
        fprintf(stderr, "apiary masha: say 'server' or 'worker' first (see --help)\n");
        return EXIT_USAGE;
    }
    a->server = !strcmp(argv[1], "server");
    argc--;
    argv++;
    optind = 1;
    int c;
    uint64_t u;
    double v;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_LISTEN:
            a->listen = optarg;
            break;
        case O_ANNOUNCE:
            if (!ap_cli_announce(optarg, a->announce, &a->nannounce)) return EXIT_USAGE;
            break;
        case O_SERVER:
            a->server_addr = optarg;
            break;
        case O_INDEX:
            if (!parse_u64("--index", optarg, 0, 4095, &u)) return EXIT_USAGE;
            a->index = (int)u;
            break;
        case O_WORKERS:
            if (!parse_u64("--workers", optarg, 1, 4096, &u)) return EXIT_USAGE;
            a->pc.workers = (int)u;
            break;
        case O_DIM:
            if (!parse_u64("--dim", optarg, 1, 4096, &u)) return EXIT_USAGE;
            a->pc.n = (int)u;
            break;
        case O_LAMBDA:
            if (!parse_double("--lambda", optarg, 0, 1e6, false, &a->pc.lambda)) return EXIT_USAGE;
            break;
        case O_H:
            if (!parse_double("--h", optarg, 0, 1e6, false, &a->pc.h)) return EXIT_USAGE;
            break;
        case O_SEED:
            if (!parse_u64("--seed", optarg, 0, UINT64_MAX, &a->pc.seed)) return EXIT_USAGE;
            break;
        case O_METHOD:
            if (!strcmp(optarg, "eg") || !strcmp(optarg, "extragradient"))
                a->o.method = AP_MASHA_EXTRAGRADIENT;
            else if (!strcmp(optarg, "masha1"))
                a->o.method = AP_MASHA_1;
            else if (!strcmp(optarg, "masha2"))
                a->o.method = AP_MASHA_2;
            else {
                fprintf(stderr, "apiary masha: --method must be eg, masha1 or masha2\n");
                return EXIT_USAGE;
            }
            break;
        case O_FRACTION:
            if (!parse_double("--fraction", optarg, 0, 1, true, &a->o.fraction)) return EXIT_USAGE;
            break;
        case O_GAMMA:
            if (!parse_double("--gamma", optarg, 0, 1e6, true, &a->o.gamma)) return EXIT_USAGE;
            a->gamma_set = true;
            break;
        case O_TAU:
            if (!parse_double("--tau", optarg, 0, 1, true, &v)) return EXIT_USAGE;
            if (v >= 1) {
                fprintf(stderr, "apiary masha: --tau must be < 1\n");
                return EXIT_USAGE;
            }
            a->o.tau = v;
            break;
        case O_SFRAC:
            if (!parse_double("--server-fraction", optarg, 0, 1, false, &a->o.server_fraction))
                return EXIT_USAGE;
            break;
        case O_CSEED:
            if (!parse_u64("--compress-seed", optarg, 0, UINT64_MAX, &a->o.seed)) return EXIT_USAGE;
            a->cseed_set = true;
            break;
        case O_TARGET:
            if (!parse_double("--target", optarg, 0, 1, true, &a->o.target)) return EXIT_USAGE;
            break;
        case O_MAXIT:
            if (!parse_u64("--max-iters", optarg, 1, UINT32_MAX, &a->o.max_iters))
                return EXIT_USAGE;
            break;
        case O_WIRE: {
            uint64_t wv;
            if (!parse_u64("--wire", optarg, 1, 3, &wv)) return EXIT_USAGE;
            a->o.wire = (int)wv;
            break;
        }
        case O_IDENTITY:
            a->identity = optarg;
            break;
        case O_TIMEOUT:
            if (!parse_double("--timeout", optarg, 0, 1e6, true, &a->timeout_s)) return EXIT_USAGE;
            break;
        case O_LOG:
            if (!ap_cli_set_log_level(optarg)) return EXIT_USAGE;
            break;
        case O_HELP:
            usage(stdout);
            return -1;
        default:
            fprintf(stderr, "apiary masha: see --help\n");
            return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "apiary masha: unexpected argument '%s' (see --help)\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (!a->cseed_set) a->o.seed = a->pc.seed;
    if (!a->gamma_set && !default_gamma(a, &a->o.gamma)) {
        fprintf(stderr,
                "apiary masha: no tuned step size for --method %s --fraction %g --h %g; give "
                "--gamma (apiary bench masha tunes it)\n",
                method_name(a->o.method), a->o.fraction, a->pc.h);
        return EXIT_USAGE;
    }
    ap_multiaddr_t ma;
    if (a->server) {
        if (a->server_addr || a->index >= 0) {
            fprintf(stderr, "apiary masha server: --server and --index are worker options\n");
            return EXIT_USAGE;
        }
        if (!a->listen) {
            fprintf(stderr, "apiary masha server: give --listen, e.g. /ip4/127.0.0.1/tcp/0\n");
            return EXIT_USAGE;
        }
    } else {
        if (!a->server_addr) {
            fprintf(stderr, "apiary masha worker: give --server, the multiaddr the server "
                            "printed (/ip4/.../tcp/PORT/p2p/12D3KooW...)\n");
            return EXIT_USAGE;
        }
        if (ap_multiaddr_parse(&ma, a->server_addr) || !ma.has_tcp || !ma.has_peer ||
            ma.host == AP_MA_HOST_NONE) {
            fprintf(stderr,
                    "apiary masha worker: --server '%s' is not a multiaddr with a host, /tcp/ "
                    "and /p2p/ (e.g. /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...)\n",
                    a->server_addr);
            return EXIT_USAGE;
        }
        if (a->index < 0 || a->index >= a->pc.workers) {
            fprintf(stderr, "apiary masha worker: give --index in [0, %d] (--workers %d)\n",
                    a->pc.workers - 1, a->pc.workers);
            return EXIT_USAGE;
        }
        if (!a->listen) a->listen = "/ip4/127.0.0.1/tcp/0";
    }
    if (ap_multiaddr_parse(&ma, a->listen) || !ma.has_tcp || ma.has_peer ||
        (ma.host != AP_MA_HOST_IP4 && ma.host != AP_MA_HOST_IP6)) {
        fprintf(stderr,
                "apiary masha: --listen '%s' must be /ip4/A.B.C.D/tcp/PORT or /ip6/ADDR/tcp/PORT "
                "without /p2p/\n",
                a->listen);
        return EXIT_USAGE;
    }
    return 0;
}

/* ---- shared run state ---- */

typedef struct run {
    masha_args_t *a;
    ap_rt_t *rt;
    ap_masha_node_t *node;
    bool finished;
    int status;
    ap_masha_result_t r;
    /* worker dialing */
    bool dialed;
    int dial_status;
    ap_peer_id_t server_id;
    uint64_t dial_timer;
    uint64_t deadline_us;
} run_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void on_done(void *arg, int status, const ap_masha_result_t *r)
{
    run_t *run = arg;
    run->finished = true;
    run->status = status;
    run->r = *r;
}

/* The run is over, or SIGINT / SIGTERM asked to stop. */
static bool is_finished(void *arg)
{
    return ((run_t *)arg)->finished || ap_cli_stop_signal();
}

/* After a stop signal: say so, free everything, exit 0. */
static bool stopped(const char *who)
{
    if (!ap_cli_stop_signal()) return false;
    fprintf(stderr, "masha %s: %s, stopping before the run is over\n", who, ap_cli_stop_name());
    return true;
}

/* r: the MASHA protocol counts (per worker); the runtime's counters add
 * what TCP + Noise + mux framing cost on the wire (incl. handshakes). */
static void print_summary(const masha_args_t *a, ap_rt_t *rt, const char *role,
                          const ap_masha_result_t *r, double secs)
{
    ap_rt_stats_t st;
    ap_rt_get_stats(rt, &st);
    printf("{\"role\":\"%s\",", role);
    if (!a->server) printf("\"index\":%d,", a->index);
    printf("\"method\":\"%s\",\"workers\":%d,\"dim\":%d,\"h\":%g,\"seed\":%llu,\"gamma\":%g,"
           "\"fraction\":%g,\"converged\":%s,\"iterations\":%llu,\"refreshes\":%llu,"
           "\"floats_per_worker\":%llu,\"bytes_per_worker\":%llu,\"bytes_down_per_worker\":%llu,"
           "\"rel_dist2\":%.6g,\"wire_bytes_sent\":%llu,\"wire_bytes_received\":%llu,"
           "\"seconds\":%.3f}\n",
           method_name(a->o.method), a->pc.workers, a->pc.n, a->pc.h,
           (unsigned long long)a->pc.seed, a->o.gamma, a->o.fraction,
           r->converged ? "true" : "false", (unsigned long long)r->iters,
           (unsigned long long)r->refreshes, (unsigned long long)r->floats_up,
           (unsigned long long)r->bytes_up, (unsigned long long)r->bytes_down, r->rel_dist2,
           (unsigned long long)st.bytes_sent, (unsigned long long)st.bytes_received, secs);
    fflush(stdout);
}

static int make_node(masha_args_t *a, ap_host_t **hp, ap_rt_t **rtp)
{
    ap_identity_t id;
    bool have_id = false;
    if (a->identity) {
        bool created = false;
        int rc = ap_identity_load_or_create(&id, a->identity, &created);
        if (rc) {
            fprintf(stderr, "apiary masha: cannot use identity %s: %s\n", a->identity,
                    ap_strerror(rc));
            return 1;
        }
        if (created) fprintf(stderr, "created a new identity in %s\n", a->identity);
        have_id = true;
    }
    ap_host_t *h = ap_host_new();
    if (!h) {
        fprintf(stderr, "apiary masha: cannot start the event loop\n");
        if (have_id) ap_identity_wipe(&id);
        return 1;
    }
    ap_node_opts_t no = {.listen = a->listen,
                         .ed25519_sk = have_id ? id.sk : NULL,
                         .announce = a->announce,
                         .nannounce = a->nannounce};
    ap_rt_t *rt;
    int rc = ap_node_new(h, &no, &rt);
    if (have_id) ap_identity_wipe(&id);
    if (rc) {
        fprintf(stderr, "apiary masha: cannot listen on %s: %s\n", a->listen, ap_strerror(rc));
        ap_host_free(h);
        return 1;
    }
    *hp = h;
    *rtp = rt;
    return 0;
}

/* ---- server ---- */

static bool no_connections(void *arg)
{
    ap_rt_stats_t st;
    ap_rt_get_stats(arg, &st);
    return st.connections == 0;
}

static int server_main(masha_args_t *a)
{
    ap_host_t *h;
    ap_rt_t *rt;
    if (make_node(a, &h, &rt)) return 1;
    int ret = 1;
    run_t run = {.a = a, .rt = rt};
    char addrs[4][AP_RT_ADDR_MAX];
    if (ap_rt_listen_addrs(rt, addrs, 4, true) < 1) {
        fprintf(stderr, "apiary masha server: no listen address\n");
        goto out;
    }
    int rc = ap_masha_server_start(rt, &a->pc, &a->o, &run.node);
    if (!rc) rc = ap_masha_server_track(run.node, on_done, &run);
    if (rc) {
        fprintf(stderr, "apiary masha server: cannot start: %s\n", ap_strerror(rc));
        goto out;
    }
    printf("%s\n", addrs[0]);
    fflush(stdout);
    fprintf(stderr, "masha server: %s, %d workers, waiting for them\n", method_name(a->o.method),
            a->pc.workers);
    double t0 = now_s();
    bool over = ap_host_run_until(h, is_finished, &run, (uint64_t)(a->timeout_s * 1e6));
    if (!run.finished && stopped("server")) {
        ret = 0;
        goto out;
    }
    if (!over) {
        fprintf(stderr,
                "apiary masha server: the run is not over after %g s (--timeout); are all %d "
                "workers running?\n",
                a->timeout_s, a->pc.workers);
        goto out;
    }
    double secs = now_s() - t0;
    if (run.status) {
        fprintf(stderr, "apiary masha server: the run failed: %s\n", ap_strerror(run.status));
        goto out;
    }
    /* The last replies are queued: let the workers receive them and hang up. */
    if (!ap_host_run_until(h, no_connections, rt, GRACE_US) && !ap_cli_stop_signal())
        fprintf(stderr, "masha server: some workers did not hang up within %llu s\n",
                (unsigned long long)(GRACE_US / 1000000));
    print_summary(a, rt, "server", &run.r, secs);
    ret = run.r.converged ? 0 : EXIT_NOCONVERGE;
    if (!run.r.converged)
        fprintf(stderr, "masha server: stopped without converging (rel_dist2 %.3g)\n",
                run.r.rel_dist2);
out:
    ap_masha_node_free(run.node);
    ap_host_free(h);
    return ret;
}

/* ---- worker ---- */

static void dial(ap_rt_t *rt, void *arg);

static void on_dialed(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    run_t *run = arg;
    if (status == 0) {
        run->dialed = true;
        run->dial_status = 0;
        run->server_id = *peer;
        return;
    }
    run->dial_status = status;
    /* the server may not be up yet: retry until the deadline, except when
     * the peer answered with another identity */
    if (status != AP_EAUTH && ap_rt_now_us(rt) + DIAL_RETRY_US < run->deadline_us) {
        run->dial_timer = ap_rt_timer_start(rt, DIAL_RETRY_US, 0, dial, run);
        if (run->dial_timer) return;
    }
    run->dialed = true;
}

static void dial(ap_rt_t *rt, void *arg)
{
    run_t *run = arg;
    run->dial_timer = 0;
    int rc = ap_rt_dial(rt, run->a->server_addr, DIAL_ATTEMPT_US, on_dialed, run);
    if (rc) {
        run->dial_status = rc;
        run->dialed = true;
    }
}

static bool is_dialed(void *arg)
{
    return ((run_t *)arg)->dialed || ap_cli_stop_signal();
}

static int worker_main(masha_args_t *a)
{
    ap_host_t *h;
    ap_rt_t *rt;
    if (make_node(a, &h, &rt)) return 1;
    int ret = 1;
    run_t run = {.a = a, .rt = rt};
    uint64_t budget = (uint64_t)(a->timeout_s * 1e6);
    run.deadline_us = ap_rt_now_us(rt) + budget;
    double t0 = now_s();
    dial(rt, &run);
    ap_host_run_until(h, is_dialed, &run, budget);
    if (!run.dialed && stopped("worker")) {
        if (run.dial_timer) ap_rt_timer_stop(rt, run.dial_timer);
        ret = 0;
        goto out;
    }
    if (!run.dialed || run.dial_status) {
        int st = run.dialed ? run.dial_status : AP_ETIMEDOUT;
        ap_multiaddr_t ma;
        char want[AP_PEER_ID_STR_MAX] = "?", host[AP_MA_TEXT_MAX] = "?";
        if (!ap_multiaddr_parse(&ma, a->server_addr)) {
            ap_peer_id_str(&ma.peer, want);
            ma.has_peer = false;
            ap_multiaddr_print(&ma, host, sizeof host);
        }
        if (st == AP_EAUTH)
            fprintf(stderr,
                    "apiary masha worker: the node at %s is not the server %s: it proved "
                    "another PeerID (EAUTH). Check the /p2p/ part of --server against the "
                    "server's first output line\n",
                    host, want);
        else
            fprintf(stderr, "apiary masha worker: cannot reach the server at %s: %s (%s)\n",
                    a->server_addr, ap_strerror(st), ap_err_name(st));
        if (run.dial_timer) ap_rt_timer_stop(rt, run.dial_timer);
        goto out;
    }
    int rc = ap_masha_worker_start(rt, &run.server_id, &a->pc, &a->o, a->index, on_done, &run,
                                   &run.node);
    if (rc) {
        fprintf(stderr, "apiary masha worker: cannot start: %s\n", ap_strerror(rc));
        goto out;
    }
    uint64_t now = ap_rt_now_us(rt);
    bool over =
        ap_host_run_until(h, is_finished, &run, run.deadline_us > now ? run.deadline_us - now : 0);
    if (!run.finished && stopped("worker")) {
        ret = 0;
        goto out;
    }
    if (!over) {
        fprintf(stderr, "apiary masha worker %d: the run is not over after %g s (--timeout)\n",
                a->index, a->timeout_s);
        goto out;
    }
    if (run.status) {
        fprintf(stderr, "apiary masha worker %d: the run failed: %s (%s)\n", a->index,
                ap_strerror(run.status), ap_err_name(run.status));
        goto out;
    }
    print_summary(a, rt, "worker", &run.r, now_s() - t0);
    ret = run.r.converged ? 0 : EXIT_NOCONVERGE;
out:
    ap_masha_node_free(run.node);
    ap_host_free(h);
    return ret;
}

static int masha_main(int argc, char **argv)
{
    masha_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;
    ap_cli_catch_stop();
    return a.server ? server_main(&a) : worker_main(&a);
}

AP_CLI_COMMAND(masha_cmd, "masha", masha_main,
               "run MASHA as a server or a worker process over TCP (min-max, compressed)")
