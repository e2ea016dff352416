/* AutoNAT v1 through real NATs (testing/natns.h): three public AutoNAT
 * servers on the internet bridge; clients on the bridge and behind each
 * kind of NAT (drop, rst, symmetric), each a libp2p host listening on its
 * port in its own process. A client learns its public IP from identify's
 * observed addresses (believed once all three servers report it), asks
 * every server to dial it back at that IP and its listen port, and feeds
 * the answers to the reachability state machine. The public client must
 * end public (every answer OK), every NATed one private (every answer
 * E_DIAL_ERROR); a request to dial a third party's address is refused.
 * Skipped (cmocka skip, with the reason) when not root or without nftables. */
#include "aptest.h"

#include "natns.h"

#include "apiary/identity.h"
#include "apiary/log.h"
#include "p2p/autonat_uv.h"
#include "p2p/reach.h"

#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

#define NSRV  3
#define PORT  4001
#define NCL   4     /* public, drop, rst, symmetric */
#define LIMIT 90000 /* ms a client may take */

static pid_t g_pids[NSRV + NCL];
static ap_natns_t *g_ns;

static ap_identity_t ident(uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    ap_identity_t id;
    int rc = ap_identity_from_seed(&id, seed);
    if (rc) abort();
    return id;
}

static ap_multiaddr_t srv_addr(size_t i)
{
    ap_multiaddr_t a;
    char t[AP_MA_TEXT_MAX];
    char pid[AP_PEER_ID_STR_MAX];
    ap_identity_t id = ident((uint8_t)(1 + i));
    snprintf(t, sizeof t, "/ip4/%s/tcp/%d/p2p/%s", ap_natns_public_ip(g_ns, i), PORT,
             ap_peer_id_str(&id.id, pid));
    if (ap_multiaddr_parse(&a, t)) abort();
    return a;
}

static ap_p2p_host_t *start_host(uv_loop_t *loop, uint8_t seed, ap_identity_t *id)
{
    *id = ident(seed);
    ap_p2p_host_t *h = ap__p2p_host_new(loop, id, "apiary-test");
    ap_multiaddr_t any;
    if (!h || ap__p2p_host_serve_basics(h) || ap_multiaddr_parse(&any, "/ip4/0.0.0.0/tcp/4001"))
        _exit(5);
    return h;
}

static void run_server(size_t i, int fd)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    ap_identity_t id;
    ap_p2p_host_t *h = start_host(&loop, (uint8_t)(1 + i), &id);
    if (!ap__autonat_serve(h, 2000)) _exit(6);
    ap_multiaddr_t any;
    if (ap_multiaddr_parse(&any, "/ip4/0.0.0.0/tcp/4001") || ap__p2p_host_listen(h, &any, NULL))
        _exit(7);
    char r = 'r';
    if (write(fd, &r, 1) != 1) _exit(8);
    uv_run(&loop, UV_RUN_DEFAULT);
    _exit(0);
}

/* ---- a client ------------------------------------------------------------------------ */

typedef struct result {
    int state;     /* ap_reach_state_t */
    int st[NSRV];  /* each server's answer */
    int third;     /* the answer to a third-party request (public client only) */
    char seen[64]; /* the believed IP */
} result_t;

typedef struct client {
    uv_loop_t loop;
    ap_p2p_host_t *h;
    ap_obs_t obs;
    ap_reach_t reach;
    int pending;
    bool ask_third;
    result_t res;
    ap_peer_id_t srv[NSRV];
} client_t;

typedef struct call {
    client_t *c;
    size_t i;
} call_t;

static call_t g_calls[NSRV + 1];

static uint64_t now_us(client_t *c)
{
    return uv_now(&c->loop) * 1000ull + 1;
}

static void probes_done(client_t *c)
{
    c->res.state = (int)c->reach.state;
    uv_stop(&c->loop);
}

static void on_third(void *arg, int status, const ap_multiaddr_t *addr, const char *text)
{
    call_t *k = arg;
    k->c->res.third = status;
    probes_done(k->c);
}

static void on_answer(void *arg, int status, const ap_multiaddr_t *addr, const char *text)
{
    call_t *k = arg;
    client_t *c = k->c;
    c->res.st[k->i] = status;
    if (status >= 0) ap__reach_answer(&c->reach, &c->srv[k->i], status, addr, now_us(c));
    if (--c->pending) return;
    if (!c->ask_third) {
        probes_done(c);
        return;
    }
    /* server 0, please dial server 1 */
    ap_multiaddr_t other = srv_addr(1);
    other.has_peer = false;
    g_calls[NSRV] = (call_t){c, 0};
    ap_multiaddr_t s0 = srv_addr(0);
    if (ap__autonat_probe(c->h, &s0, &other, 1, 20000, on_third, &g_calls[NSRV])) probes_done(c);
}

static void start_probes(client_t *c)
{
    ap_multiaddr_t ips[2], cand[2];
    size_t n = ap__obs_believed_ips(&c->obs, now_us(c), ips, 2);
    for (size_t k = 0; k < n; k++) {
        cand[k] = ips[k];
        cand[k].has_tcp = true;
        cand[k].port = PORT;
    }
    if (n) inet_ntop(AF_INET, ips[0].ip, c->res.seen, sizeof c->res.seen);
    c->pending = NSRV;
    for (size_t i = 0; i < NSRV; i++) {
        g_calls[i] = (call_t){c, i};
        ap_multiaddr_t s = srv_addr(i);
        int rc = ap__autonat_probe(c->h, &s, cand, n, 20000, on_answer, &g_calls[i]);
        if (rc) on_answer(&g_calls[i], rc, NULL, NULL);
    }
}

static void on_identify(void *arg, int status, const ap_identify_t *id)
{
    call_t *k = arg;
    client_t *c = k->c;
    if (status == 0 && id->has_observed)
        ap__obs_add(&c->obs, &c->srv[k->i], &id->observed, now_us(c));
    if (--c->pending == 0) start_probes(c);
}

static void run_client(uint8_t seed, bool ask_third, int fd)
{
    static client_t c;
    memset(&c, 0, sizeof c);
    uv_loop_init(&c.loop);
    ap_identity_t id;
    c.h = start_host(&c.loop, seed, &id);
    ap_multiaddr_t any;
    if (ap_multiaddr_parse(&any, "/ip4/0.0.0.0/tcp/4001") || ap__p2p_host_listen(c.h, &any, NULL))
        _exit(7);
    c.ask_third = ask_third;
    ap__obs_init(&c.obs);
    ap__reach_init(&c.reach, now_us(&c), 5000000, 900000000);
    c.res.third = 1;
    c.pending = NSRV;
    for (size_t i = 0; i < NSRV; i++) {
        c.srv[i] = ident((uint8_t)(1 + i)).id;
        g_calls[i] = (call_t){&c, i};
        ap_multiaddr_t s = srv_addr(i);
        int rc = ap__p2p_identify_peer(c.h, &s, 20000, on_identify, &g_calls[i]);
        if (rc) on_identify(&g_calls[i], rc, NULL);
    }
    uv_run(&c.loop, UV_RUN_DEFAULT);
    ssize_t w = write(fd, &c.res, sizeof c.res);
    _exit(w == (ssize_t)sizeof c.res ? 0 : 9);
}

/* ---- the test -------------------------------------------------------------------------- */

static int teardown(void **state)
{
    (void)state;
    for (size_t i = 0; i < NSRV + NCL; i++)
        if (g_pids[i] > 0) {
            kill(g_pids[i], SIGKILL);
            waitpid(g_pids[i], NULL, 0);
            g_pids[i] = 0;
        }
    ap_natns_free(g_ns);
    g_ns = NULL;
    return 0;
}

static bool read_within(int fd, void *p, size_t n, int ms)
{
    size_t got = 0;
    while (got < n) {
        struct pollfd q = {.fd = fd, .events = POLLIN};
        if (poll(&q, 1, ms) != 1) return false;
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0) return false;
        got += (size_t)r;
    }
    return true;
}

static void test_autonat_through_nats(void **state)
{
    (void)state;
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    const ap_nat_kind_t kinds[3] = {AP_NAT_DROP, AP_NAT_RST, AP_NAT_SYMMETRIC};
    if (ap_natns_new(NSRV + 1, 3, kinds, &g_ns, why, sizeof why)) fail_msg("topology: %s", why);

    for (size_t i = 0; i < NSRV; i++) {
        int p[2];
        assert_int_equal(pipe(p), 0);
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            if (ap_natns_enter_public(g_ns, i)) _exit(3);
            run_server(i, p[1]);
        }
        close(p[1]);
        g_pids[i] = pid;
        char r;
        bool ok = read_within(p[0], &r, 1, 30000);
        close(p[0]);
        if (!ok) fail_msg("server %zu did not start", i);
    }
    /* clients: on the bridge (public node NSRV), then home k behind kinds[k] */
    int fds[NCL];
    for (size_t k = 0; k < NCL; k++) {
        int p[2];
        assert_int_equal(pipe(p), 0);
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            int rc = k == 0 ? ap_natns_enter_public(g_ns, NSRV) : ap_natns_enter_home(g_ns, k - 1);
            if (rc) _exit(3);
            run_client((uint8_t)(50 + k), k == 0, p[1]);
        }
        close(p[1]);
        g_pids[NSRV + k] = pid;
        fds[k] = p[0];
    }
    result_t res[NCL];
    for (size_t k = 0; k < NCL; k++) {
        bool ok = read_within(fds[k], &res[k], sizeof res[k], LIMIT);
        close(fds[k]);
        if (!ok) fail_msg("client %zu reported nothing", k);
    }
    int correct = 0;
    for (size_t k = 0; k < NCL; k++) {
        const result_t *r = &res[k];
        const char *where = k == 0 ? "public" : ap_nat_kind_name(kinds[k - 1]);
        const char *want_ip =
            k == 0 ? ap_natns_public_ip(g_ns, NSRV) : ap_natns_router_ip(g_ns, k - 1);
        print_message("client %s: seen at %s, answers %s %s %s, verdict %s\n", where, r->seen,
                      ap__autonat_status_name(r->st[0]), ap__autonat_status_name(r->st[1]),
                      ap__autonat_status_name(r->st[2]),
                      ap__reach_name((ap_reach_state_t)r->state));
        int want = k == 0 ? AP_AUTONAT_OK : AP_AUTONAT_E_DIAL_ERROR;
        assert_string_equal(r->seen, want_ip);
        for (int i = 0; i < NSRV; i++) assert_int_equal(r->st[i], want);
        assert_int_equal(r->state, k == 0 ? AP_REACH_PUBLIC : AP_REACH_PRIVATE);
        correct++;
    }
    print_message("third-party dial request: %s\n", ap__autonat_status_name(res[0].third));
    assert_int_equal(res[0].third, AP_AUTONAT_E_DIAL_REFUSED);
    print_message("autonat_correct %d/%d\n", correct, NCL);
    teardown(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_autonat_through_nats, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
