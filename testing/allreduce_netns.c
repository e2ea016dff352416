/* The all-reduce across network namespaces: see allreduce_netns.h. */
#include "allreduce_netns.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "averaging/allreduce.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_MEMBERS 64

typedef struct hello {
    uint8_t id[AP_PEER_ID_LEN];
    char addr[AP_RT_ADDR_MAX];
} hello_t;

typedef struct wreport {
    int status;
    int exact;
    double elapsed_s, fraction, cpu_s;
    uint64_t sent, received;
    uint32_t dropped, failed;
    long long retrans, timeouts; /* TCP segments retransmitted, RTOs in the round */
    char why[200];
} wreport_t;

static float value(size_t member, uint64_t k)
{
    return (float)(((k * 2654435761u) >> 7) % 1000 + member);
}

static double weight(size_t member)
{
    return 1.0 + (double)member;
}

static double cpu_now(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

typedef struct round_state {
    bool done;
    ap_allreduce_result_t res;
} round_state_t;

static void on_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    round_state_t *s = arg;
    s->res = *res;
    s->done = true;
}

static bool is_done(void *arg)
{
    return ((round_state_t *)arg)->done;
}

/* Checks a receiver's vector against the exact weighted mean of the senders. */
static void check_exact(const float *x, uint64_t elems, const ap_arns_peer_t *peers, size_t n,
                        wreport_t *rep)
{
    double wsum = 0;
    for (size_t j = 0; j < n; j++)
        if (peers[j].role != AP_AVG_AUX) wsum += weight(j);
    for (uint64_t k = 0; k < elems; k++) {
        double s = 0;
        for (size_t j = 0; j < n; j++)
            if (peers[j].role != AP_AVG_AUX) s += weight(j) * (double)value(j, k);
        float ref = (float)(s / wsum);
        if (x[k] != ref) {
            rep->exact = 0;
            snprintf(rep->why, sizeof rep->why, "element %llu is %.9g, the exact mean is %.9g",
                     (unsigned long long)k, (double)x[k], (double)ref);
            return;
        }
    }
    rep->exact = 1;
}

/* ---- optional trace (APIARY_ARNS_TRACE=DIR): eth0 byte counters and the
 * round's progress every 10 ms, one file per member and round, for finding
 * idle links ---- */

static bool eth0_bytes(uint64_t *rx, uint64_t *tx)
{
    FILE *f = fopen("/proc/self/net/dev", "r");
    if (!f) return false;
    char line[512];
    bool ok = false;
    while (fgets(line, sizeof line, f)) {
        char *p = strstr(line, "eth0:");
        if (!p) continue;
        unsigned long long v[9];
        if (sscanf(p + 5, "%llu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2],
                   &v[3], &v[4], &v[5], &v[6], &v[7], &v[8]) == 9) {
            *rx = v[0];
            *tx = v[8];
            ok = true;
        }
    }
    fclose(f);
    return ok;
}

/* A counter from /proc/self/net/{snmp,netstat} (this namespace): section
 * "Tcp" or "TcpExt", field name; -1 if absent. */
static long long net_counter(const char *file, const char *sect, const char *field)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/net/%s", file);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    static char hdr[8192], val[8192];
    long long out = -1;
    size_t sl = strlen(sect);
    while (fgets(hdr, sizeof hdr, f) && fgets(val, sizeof val, f)) {
        if (strncmp(hdr, sect, sl) || hdr[sl] != ':') continue;
        char *hs, *vs;
        char *h = strtok_r(hdr + sl + 1, " \n", &hs);
        char *v = strtok_r(val + sl + 1, " \n", &vs);
        while (h && v) {
            if (!strcmp(h, field)) out = atoll(v);
            h = strtok_r(NULL, " \n", &hs);
            v = strtok_r(NULL, " \n", &vs);
        }
    }
    fclose(f);
    return out;
}

/* With APIARY_ARNS_TRACE: runs the round like ap_host_run_until and writes
 * DIR/p<pid>-m<member>-r<round>.txt, one line per ~10 ms from the loop thread:
 * seconds since the start, eth0 rx and tx bytes, data chunks sent, results
 * received, chunks reduced, smallest and largest automatic lead
 * (ap__allreduce_progress). */
static bool progress_trace(ap_host_t *h, ap_allreduce_t *ar, round_state_t *st, size_t member,
                           uint32_t round, uint64_t timeout_us)
{
    char path[512];
    snprintf(path, sizeof path, "%s/p%d-m%zu-r%u.txt", getenv("APIARY_ARNS_TRACE"), (int)getpid(),
             member, round);
    FILE *f = fopen(path, "w");
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double last = -1;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        double t = (double)(now.tv_sec - t0.tv_sec) + (double)(now.tv_nsec - t0.tv_nsec) * 1e-9;
        if (st->done || t * 1e6 > (double)timeout_us) break;
        if (f && t - last >= 0.01) {
            uint64_t rx = 0, tx = 0;
            ap__avg_progress_t p;
            eth0_bytes(&rx, &tx);
            ap__allreduce_progress(ar, &p);
            fprintf(f, "%.4f %llu %llu %u %u %u %u %u\n", t, (unsigned long long)rx,
                    (unsigned long long)tx, p.data_chunks_sent, p.results_recv, p.reduced,
                    p.lead_min, p.lead_max);
            last = t;
        }
        ap_host_run_once(h, 1000);
    }
    if (f) fclose(f);
    return st->done;
}

/* Runs h's loop until from_parent is readable (a command or EOF). */
static bool wait_parent(ap_host_t *h, int from_parent)
{
    for (;;) {
        struct pollfd p = {.fd = from_parent, .events = POLLIN};
        int rc = poll(&p, 1, 0);
        if (rc > 0) return true;
        if (rc < 0 && errno != EINTR) return false;
        ap_host_run_once(h, 2000); /* 2 ms: the rounds start within that of each other */
    }
}

static int worker(ap_netns_t *ns, size_t i, const ap_arns_peer_t *peers, size_t n,
                  const ap_arns_opts_t *o, int to_parent, int from_parent)
{
    if (ap_netns_enter(ns, i)) return 10;
    const char *nice_s = getenv("APIARY_ARNS_NICE");
    if (nice_s) setpriority(PRIO_PROCESS, 0, atoi(nice_s));
    uint8_t seed[32] = {0x5a};
    seed[1] = (uint8_t)(i + 1);
    char listen[64];
    snprintf(listen, sizeof listen, "/ip4/%s/tcp/0", ap_netns_ip(ns, i));
    ap_node_opts_t no = {.ed25519_seed = seed, .rng_seed = (uint64_t)i + 1, .listen = listen};
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    if (!h || ap_node_new(h, &no, &rt)) return 11;
    ap_avg_service_t *svc;
    if (ap_avg_service_new(rt, &svc)) return 12;
    hello_t me = {0};
    memcpy(me.id, ap_rt_self(rt)->b, AP_PEER_ID_LEN);
    char addrs[1][AP_RT_ADDR_MAX];
    if (ap_rt_listen_addrs(rt, addrs, 1, false) < 1) return 13;
    snprintf(me.addr, sizeof me.addr, "%s", addrs[0]);
    if (!ap_netns_write_full(to_parent, &me, sizeof me)) return 14;
    hello_t *all = calloc(n, sizeof *all);
    ap_avg_member_t *mem = calloc(n, sizeof *mem);
    if (!all || !mem || !ap_netns_read_full(from_parent, all, n * sizeof *all)) return 15;
    for (size_t j = 0; j < n; j++) {
        if (ap_peer_id_from_bytes(&mem[j].id, all[j].id, AP_PEER_ID_LEN)) return 16;
        mem[j].role = peers[j].role;
        mem[j].up = peers[j].decl_up;
        mem[j].down = peers[j].decl_down;
        if (j != i && ap_rt_add_addr(rt, &mem[j].id, all[j].addr)) return 17;
    }
    bool has_data = peers[i].role != AP_AVG_AUX;
    float *x = has_data ? malloc(o->elems * sizeof *x) : NULL;
    if (has_data && !x) return 18;
    ap_allreduce_opts_t ro = {.chunk_elems = o->chunk_elems,
                              .codec = o->codec,
                              .deadline_factor = o->deadline_factor,
                              .connect_grace_us = o->connect_grace_us,
                              .stall_min_us = o->stall_min_us,
                              .max_lead_chunks = o->max_lead_chunks};
    uint64_t timeout_us = (uint64_t)((o->round_timeout_s > 0 ? o->round_timeout_s : 600) * 1e6);
    uint32_t r;
    /* Between rounds the loop must keep running: when this member's round
     * is over, bytes it queued (the last results, CLOSE frames) may still sit
     * in its transport's write queue, and the others wait for them. */
    while (wait_parent(h, from_parent) && ap_netns_read_full(from_parent, &r, sizeof r)) {
        if (x)
            for (uint64_t k = 0; k < o->elems; k++) x[k] = value(i, k);
        ap_avg_group_t g = {.members = mem, .n = n};
        memset(g.id, 0xa5, sizeof g.id);
        memcpy(g.id, &r, sizeof r);
        round_state_t st = {0};
        wreport_t rep = {0};
        bool tracing = getenv("APIARY_ARNS_TRACE") != NULL;
        long long rt0 = net_counter("snmp", "Tcp", "RetransSegs"),
                  to0 = net_counter("netstat", "TcpExt", "TCPTimeouts");
        double c0 = cpu_now();
        ap_allreduce_t *ar = NULL;
        int rc = ap_allreduce_start(svc, &g, x, o->elems, weight(i), &ro, on_done, &st, &ar);
        if (rc) {
            rep.status = rc;
            snprintf(rep.why, sizeof rep.why, "member %zu: start: %s", i, ap_strerror(rc));
        } else {
            bool finished = tracing ? progress_trace(h, ar, &st, i, r, timeout_us)
                                    : ap_host_run_until(h, is_done, &st, timeout_us);
            if (!finished) {
                ap_allreduce_cancel(ar);
                ap_host_run_until(h, is_done, &st, 10000000);
            }
            rep.status = st.done ? st.res.status : AP_ETIMEDOUT;
            rep.elapsed_s = (double)st.res.elapsed_us / 1e6;
            rep.fraction = st.res.averaged_fraction;
            rep.sent = st.res.bytes_sent;
            rep.received = st.res.bytes_received;
            rep.dropped = st.res.senders_dropped;
            rep.failed = st.res.parts_failed;
            rep.exact = 1;
            if (rep.status)
                snprintf(rep.why, sizeof rep.why, "member %zu: status %s", i,
                         ap_err_name(rep.status));
            else if (has_data && o->codec == AP_AVG_CODEC_F32)
                check_exact(x, o->elems, peers, n, &rep);
        }
        rep.cpu_s = cpu_now() - c0;
        rep.retrans = net_counter("snmp", "Tcp", "RetransSegs") - rt0;
        rep.timeouts = net_counter("netstat", "TcpExt", "TCPTimeouts") - to0;
        if (!ap_netns_write_full(to_parent, &rep, sizeof rep)) break;
    }
    free(x);
    free(all);
    free(mem);
    ap_avg_service_free(svc);
    ap_node_free(rt);
    ap_host_free(h);
    return 0;
}

int ap_arns_run(ap_netns_t *ns, const ap_arns_peer_t *peers, size_t n, const ap_arns_opts_t *o,
                ap_arns_round_t *out, char *why, size_t wn)
{
    if (!ns || !peers || !o || !out || n < 2 || n > MAX_MEMBERS || n > ap_netns_count(ns) ||
        o->rounds < 1 || o->rounds > 64 || o->elems == 0) {
        snprintf(why, wn, "bad arguments");
        return AP_EINVAL;
    }
    int up[MAX_MEMBERS][2], down[MAX_MEMBERS][2];
    pid_t pid[MAX_MEMBERS];
    size_t started = 0;
    int rc = 0;
    why[0] = 0;
    fflush(NULL);
    for (; started < n; started++) {
        size_t i = started;
        if (pipe(up[i])) {
            snprintf(why, wn, "pipe: %s", strerror(errno));
            rc = AP_ESYS;
            break;
        }
        if (pipe(down[i])) {
            snprintf(why, wn, "pipe: %s", strerror(errno));
            close(up[i][0]);
            close(up[i][1]);
            rc = AP_ESYS;
            break;
        }
        pid[i] = fork();
        if (pid[i] < 0) {
            close(up[i][0]), close(up[i][1]), close(down[i][0]), close(down[i][1]);
            snprintf(why, wn, "fork: %s", strerror(errno));
            rc = AP_ESYS;
            break;
        }
        if (pid[i] == 0) {
            for (size_t j = 0; j < i; j++) close(up[j][0]), close(down[j][1]);
            close(up[i][0]);
            close(down[i][1]);
            signal(SIGPIPE, SIG_IGN);
            _exit(worker(ns, i, peers, n, o, up[i][1], down[i][0]));
        }
        close(up[i][1]);
        close(down[i][0]);
    }
    hello_t *all = calloc(n, sizeof *all);
    if (!rc && !all) rc = AP_ENOMEM;
    for (size_t i = 0; i < started && !rc; i++)
        if (!ap_netns_read_full(up[i][0], &all[i], sizeof all[i])) {
            snprintf(why, wn, "worker %zu (namespace %s) did not start", i, ap_netns_name(ns, i));
            rc = AP_EIO;
        }
    for (size_t i = 0; i < started && !rc; i++)
        if (!ap_netns_write_full(down[i][1], all, n * sizeof *all)) rc = AP_EIO;
    for (int r = 0; r < o->rounds && !rc; r++) {
        uint32_t ri = (uint32_t)r;
        for (size_t i = 0; i < n && !rc; i++)
            if (!ap_netns_write_full(down[i][1], &ri, sizeof ri)) rc = AP_EIO;
        ap_arns_round_t *a = &out[r];
        memset(a, 0, sizeof *a);
        a->exact = true;
        a->min_fraction = 1;
        for (size_t i = 0; i < n && !rc; i++) {
            wreport_t rep;
            if (!ap_netns_read_full(up[i][0], &rep, sizeof rep)) {
                snprintf(why, wn, "worker %zu died in round %d", i, r);
                rc = AP_EIO;
                break;
            }
            rep.why[sizeof rep.why - 1] = 0;
            if (getenv("APIARY_ARNS_VERBOSE"))
                fprintf(stderr,
                        "arns: round %d member %zu: %.3f s, sent %.1f MB (%.2f MB/s), received "
                        "%.1f MB (%.2f MB/s), cpu %.3f s, status %d, tcp retrans %lld rto %lld\n",
                        r, i, rep.elapsed_s, (double)rep.sent / 1e6,
                        (double)rep.sent / 1e6 / rep.elapsed_s, (double)rep.received / 1e6,
                        (double)rep.received / 1e6 / rep.elapsed_s, rep.cpu_s, rep.status,
                        rep.retrans, rep.timeouts);
            if (rep.status && !a->status) a->status = rep.status;
            if (!rep.exact) a->exact = false;
            if ((rep.status || !rep.exact) && !a->why[0])
                snprintf(a->why, sizeof a->why, "%s", rep.why);
            if (rep.elapsed_s > a->round_s) a->round_s = rep.elapsed_s;
            if (rep.fraction < a->min_fraction) a->min_fraction = rep.fraction;
            a->cpu_s += rep.cpu_s;
            a->payload_bytes += rep.sent;
            a->senders_dropped += rep.dropped;
            a->parts_failed += rep.failed;
        }
    }
    for (size_t i = 0; i < started; i++) close(down[i][1]); /* workers end on EOF */
    for (size_t i = 0; i < started; i++) {
        if (rc) kill(pid[i], SIGKILL);
        int ws;
        while (waitpid(pid[i], &ws, 0) < 0 && errno == EINTR) {
        }
        close(up[i][0]);
    }
    free(all);
    return rc;
}
