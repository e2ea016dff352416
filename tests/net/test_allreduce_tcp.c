/* The all-reduce on real sockets: 8 processes on loopback (TCP + Noise XX),
 * one of them killed with SIGKILL in the middle of the round. It kills itself
 * once its reducer has averaged part of its part (or, if its chunks came in
 * one burst, once it has sent data but received no result), so the kill is
 * always mid-round. Every survivor must end the round with status 0, every element
 * either its local value or a weighted mean (over all 8, or over the 7 when
 * the victim's chunk never arrived), and report exactly how many elements it
 * averaged; the parts of live reducers must be averaged entirely. And a
 * member of weight 0 among four nodes of one host: a full member whose
 * values add nothing. */
#include "aptest.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "averaging/allreduce.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NP     8
#define VICTIM 5

typedef struct hello_msg {
    uint8_t id[AP_PEER_ID_LEN];
    char addr[AP_RT_ADDR_MAX];
} hello_msg_t;

typedef struct report {
    int status;
    int ok; /* 1 if the child's own checks passed */
    uint64_t averaged, counted;
    uint32_t parts_failed, senders_dropped;
    char why[160];
} report_t;

static uint64_t elems(void)
{
    return ap_test_sanitized() ? (1u << 16) : (1u << 20);
}
static float value(int peer, uint64_t k)
{
    return (float)(((k * 2654435761u) >> 7) % 1000) / 10.0f + (float)peer;
}
static double weight(int peer)
{
    return 1.0 + peer;
}

static bool write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w <= 0) return false;
        b += w;
        n -= (size_t)w;
    }
    return true;
}
static bool read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n) {
        ssize_t r = read(fd, b, n);
        if (r <= 0) return false;
        b += r;
        n -= (size_t)r;
    }
    return true;
}

typedef struct child_state {
    bool done;
    ap_allreduce_result_t res;
    ap_allreduce_t *ar;
    bool victim;
} child_state_t;

static void child_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    child_state_t *s = arg;
    s->res = *res;
    s->done = true;
    s->ar = NULL;
}

static bool child_pred(void *arg)
{
    child_state_t *s = arg;
    if (s->victim && s->ar) {
        ap__avg_progress_t p;
        ap__allreduce_progress(s->ar, &p);
        /* mid-round: reducing its part, or (when a burst of chunks arrived
         * in one loop iteration) sending with no result received yet */
        if ((p.reduced > 0 && p.reduced < p.my_chunks) ||
            (p.data_chunks_sent > 0 && p.results_recv == 0))
            kill(getpid(), SIGKILL);
    }
    return s->done;
}

static int child_main(int i, int to_parent, int from_parent)
{
    ap_log_set_level(getenv("AVG_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_OFF);
    ap_host_t *h = ap_host_new();
    uint8_t seed[32] = {0};
    seed[0] = (uint8_t)(i + 1);
    ap_node_opts_t no = {
        .ed25519_seed = seed, .rng_seed = (uint64_t)i + 1, .listen = "/ip4/127.0.0.1/tcp/0"};
    ap_rt_t *rt;
    if (!h || ap_node_new(h, &no, &rt)) return 10;
    ap_avg_service_t *svc;
    if (ap_avg_service_new(rt, &svc)) return 11;
    hello_msg_t me = {0};
    memcpy(me.id, ap_rt_self(rt)->b, AP_PEER_ID_LEN);
    char addrs[1][AP_RT_ADDR_MAX];
    if (ap_rt_listen_addrs(rt, addrs, 1, false) < 1) return 12;
    snprintf(me.addr, sizeof me.addr, "%s", addrs[0]);
    if (!write_all(to_parent, &me, sizeof me)) return 13;
    hello_msg_t all[NP];
    if (!read_all(from_parent, all, sizeof all)) return 14;
    ap_avg_member_t mem[NP];
    for (int j = 0; j < NP; j++) {
        if (ap_peer_id_from_bytes(&mem[j].id, all[j].id, AP_PEER_ID_LEN)) return 15;
        mem[j].role = AP_AVG_NORMAL;
        mem[j].up = mem[j].down = 50e6;
        if (j != i && ap_rt_add_addr(rt, &mem[j].id, all[j].addr)) return 16;
    }
    uint64_t n = elems();
    float *x = malloc(n * sizeof *x);
    for (uint64_t k = 0; k < n; k++) x[k] = value(i, k);
    ap_avg_group_t g = {.members = mem, .n = NP};
    memset(g.id, 0xab, sizeof g.id);
    /* 8 processes on 2 shared cores: a process may be off the CPU for a while */
    ap_allreduce_opts_t o = {.chunk_elems = (uint32_t)(n / 128), /* 16 chunks per part */
                             .deadline_factor = 40,
                             .stall_min_us = 3000000,
                             .connect_grace_us = 10000000};
    child_state_t st = {.victim = i == VICTIM};
    if (ap_allreduce_start(svc, &g, x, n, weight(i), &o, child_done, &st, &st.ar)) return 17;
    bool ok = ap_host_run_until(h, child_pred, &st, 120000000ull);

    report_t rep = {.status = ok ? st.res.status : AP_ETIMEDOUT, .ok = 1};
    rep.averaged = st.res.elems_averaged;
    rep.parts_failed = st.res.parts_failed;
    rep.senders_dropped = st.res.senders_dropped;
    /* the split every member computed */
    ap_avg_bw_t bw[NP];
    double sh[NP];
    uint64_t cnt[NP], off[NP];
    for (int j = 0; j < NP; j++) bw[j] = (ap_avg_bw_t){AP_AVG_NORMAL, 50e6, 50e6};
    ap_avg_balance(bw, NP, NULL, sh, NULL);
    ap_avg_round_counts(sh, NP, n, cnt);
    off[0] = 0;
    for (int j = 1; j < NP; j++) off[j] = off[j - 1] + cnt[j - 1];
    for (int r = 0; r < NP && rep.ok; r++) {
        for (uint64_t k = off[r]; k < off[r] + cnt[r]; k++) {
            double sa = 0, wa = 0, sw = 0, ww = 0;
            for (int j = 0; j < NP; j++) {
                sa += weight(j) * value(j, k);
                wa += weight(j);
                if (j != VICTIM) {
                    sw += weight(j) * value(j, k);
                    ww += weight(j);
                }
            }
            bool local = x[k] == value(i, k);
            if (!local) rep.counted++;
            double all_m = sa / wa, wo_m = sw / ww;
            bool is_mean = fabs(x[k] - all_m) <= 1e-5 * fabs(all_m) + 1e-6 ||
                           fabs(x[k] - wo_m) <= 1e-5 * fabs(wo_m) + 1e-6;
            if (!local && !is_mean) {
                rep.ok = 0;
                snprintf(rep.why, sizeof rep.why, "elem %llu = %g is no mean (%g / %g)",
                         (unsigned long long)k, x[k], all_m, wo_m);
            } else if (r != VICTIM && r != i && local) {
                rep.ok = 0;
                snprintf(rep.why, sizeof rep.why, "elem %llu of live reducer %d left local",
                         (unsigned long long)k, r);
            }
        }
    }
    write_all(to_parent, &rep, sizeof rep);
    free(x);
    ap_avg_service_free(svc);
    ap_node_free(rt);
    ap_host_free(h);
    return 0;
}

static void test_eight_processes_one_killed(void **state)
{
    (void)state;
    int up[NP][2], down[NP][2];
    pid_t pid[NP];
    for (int i = 0; i < NP; i++) {
        assert_int_equal(pipe(up[i]), 0);
        assert_int_equal(pipe(down[i]), 0);
        pid[i] = fork();
        assert_true(pid[i] >= 0);
        if (pid[i] == 0) {
            for (int j = 0; j <= i; j++) {
                close(up[j][0]);
                close(down[j][1]);
            }
            _exit(child_main(i, up[i][1], down[i][0]));
        }
        close(up[i][1]);
        close(down[i][0]);
    }
    hello_msg_t all[NP];
    for (int i = 0; i < NP; i++) assert_true(read_all(up[i][0], &all[i], sizeof all[i]));
    for (int i = 0; i < NP; i++) assert_true(write_all(down[i][1], all, sizeof all));
    report_t rep[NP];
    for (int i = 0; i < NP; i++) {
        bool got = read_all(up[i][0], &rep[i], sizeof rep[i]);
        if (i == VICTIM && got) /* it must be killed before reporting */
            fail_msg("the victim finished: status %d averaged %llu failed %u dropped %u",
                     rep[i].status, (unsigned long long)rep[i].averaged, rep[i].parts_failed,
                     rep[i].senders_dropped);
        else if (i != VICTIM && !got)
            fail_msg("peer %d died without a report", i);
    }
    for (int i = 0; i < NP; i++) {
        int ws;
        assert_int_equal(waitpid(pid[i], &ws, 0), pid[i]);
        if (i == VICTIM) {
            assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
            continue;
        }
        assert_true(WIFEXITED(ws));
        assert_int_equal(WEXITSTATUS(ws), 0);
        printf("peer %d: status %d averaged %llu/%llu parts_failed %u dropped %u %s\n", i,
               rep[i].status, (unsigned long long)rep[i].averaged, (unsigned long long)elems(),
               rep[i].parts_failed, rep[i].senders_dropped, rep[i].ok ? "ok" : rep[i].why);
        assert_int_equal(rep[i].status, 0);
        assert_true(rep[i].ok);
        assert_true(rep[i].averaged == rep[i].counted);
    }
    for (int i = 0; i < NP; i++) {
        close(up[i][0]);
        close(down[i][1]);
    }
}

/* ---- weight 0 over real sockets ---------------------------------------------------- */

#define NZ 4

typedef struct zstate {
    bool done;
    ap_allreduce_result_t res;
} zstate_t;

static void z_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    zstate_t *s = arg;
    s->res = *res;
    s->done = true;
}

static bool z_all_done(void *arg)
{
    zstate_t *s = arg;
    for (int i = 0; i < NZ; i++)
        if (!s[i].done) return false;
    return true;
}

/* Four nodes of one host on loopback, peer 1 with weight 0 (a trainer
 * without samples): nobody is dropped, every part is averaged, every peer
 * holds the weighted mean of the others, peer 1 included. */
static void test_zero_weight_member(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new(); /* caller-driven: everything on this thread */
    assert_non_null(h);
    ap_rt_t *rt[NZ];
    ap_avg_service_t *svc[NZ];
    ap_avg_member_t mem[NZ];
    char addr[NZ][AP_RT_ADDR_MAX];
    const double w[NZ] = {1, 0, 2, 1};
    for (int i = 0; i < NZ; i++) {
        uint8_t seed[32] = {0};
        seed[0] = (uint8_t)(40 + i);
        ap_node_opts_t no = {
            .ed25519_seed = seed, .rng_seed = (uint64_t)i + 40, .listen = "/ip4/127.0.0.1/tcp/0"};
        assert_ok(ap_node_new(h, &no, &rt[i]));
        assert_ok(ap_avg_service_new(rt[i], &svc[i]));
        char a[1][AP_RT_ADDR_MAX];
        assert_int_equal(ap_rt_listen_addrs(rt[i], a, 1, false), 1);
        memcpy(addr[i], a[0], sizeof addr[i]);
        mem[i].id = *ap_rt_self(rt[i]);
        mem[i].role = AP_AVG_NORMAL;
        mem[i].up = mem[i].down = 50e6;
    }
    for (int i = 0; i < NZ; i++)
        for (int j = 0; j < NZ; j++)
            if (i != j) assert_ok(ap_rt_add_addr(rt[i], &mem[j].id, addr[j]));
    const uint64_t n = 1u << 16;
    float *x[NZ];
    zstate_t st[NZ];
    memset(st, 0, sizeof st);
    ap_avg_group_t g = {.members = mem, .n = NZ};
    memset(g.id, 0x5a, sizeof g.id);
    ap_allreduce_opts_t o = {.chunk_elems = (uint32_t)(n / 64), .deadline_factor = 40};
    for (int i = 0; i < NZ; i++) {
        x[i] = malloc(n * sizeof(float));
        assert_non_null(x[i]);
        for (uint64_t k = 0; k < n; k++) x[i][k] = value(i, k);
        assert_ok(ap_allreduce_start(svc[i], &g, x[i], n, w[i], &o, z_done, &st[i], NULL));
    }
    assert_true(ap_host_run_until(h, z_all_done, st, 120000000ull));
    for (int i = 0; i < NZ; i++) {
        assert_int_equal(st[i].res.status, 0);
        assert_int_equal(st[i].res.senders_dropped, 0);
        assert_int_equal(st[i].res.parts_failed, 0);
        assert_true(st[i].res.averaged_fraction == 1.0);
        assert_int_equal(st[i].res.elems_averaged, n);
        for (uint64_t k = 0; k < n; k++) {
            double sx = 0, sw = 0;
            for (int j = 0; j < NZ; j++) sx += w[j] * value(j, k), sw += w[j];
            double m = sx / sw;
            if (!(fabs(x[i][k] - m) <= 1e-5 * fabs(m) + 1e-6))
                fail_msg("peer %d elem %llu: %g want %g", i, (unsigned long long)k, x[i][k], m);
        }
    }
    for (int i = 0; i < NZ; i++) {
        ap_avg_service_free(svc[i]);
        ap_node_free(rt[i]);
        free(x[i]);
    }
    assert_ok(ap_host_free(h));
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eight_processes_one_killed),
        cmocka_unit_test(test_zero_weight_member),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
