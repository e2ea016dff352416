/* AutoNAT through real NATs: servers and clients in forked processes. */
#include "nat_autonat.h"

#include "apiary/error.h"
#include "apiary/identity.h"
#include "p2p/autonat_uv.h"
#include "p2p/portmap.h"
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

#define NSRV AP_NAT_AUTONAT_SERVERS
#define PORT AP_NAT_AUTONAT_PORT

static ap_identity_t ident(uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    ap_identity_t id;
    int rc = ap_identity_from_seed(&id, seed);
    if (rc) abort();
    return id;
}

static ap_multiaddr_t srv_addr(ap_natns_t *ns, size_t i)
{
    ap_multiaddr_t a;
    char t[AP_MA_TEXT_MAX];
    char pid[AP_PEER_ID_STR_MAX];
    ap_identity_t id = ident((uint8_t)(1 + i));
    snprintf(t, sizeof t, "/ip4/%s/tcp/%d/p2p/%s", ap_natns_public_ip(ns, i), PORT,
             ap_peer_id_str(&id.id, pid));
    if (ap_multiaddr_parse(&a, t)) abort();
    return a;
}

static ap_p2p_host_t *start_host(uv_loop_t *loop, uint8_t seed)
{
    ap_identity_t id = ident(seed);
    ap_p2p_host_t *h = ap__p2p_host_new(loop, &id, "apiary-test");
    if (!h || ap__p2p_host_serve_basics(h)) _exit(5);
    return h;
}

static void listen_any(ap_p2p_host_t *h)
{
    ap_multiaddr_t any;
    char t[64];
    snprintf(t, sizeof t, "/ip4/0.0.0.0/tcp/%d", PORT);
    if (ap_multiaddr_parse(&any, t) || ap__p2p_host_listen(h, &any, NULL)) _exit(7);
}

static void run_server(size_t i, int fd)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    ap_p2p_host_t *h = start_host(&loop, (uint8_t)(1 + i));
    if (!ap__autonat_serve(h, 2000)) _exit(6);
    listen_any(h);
    char r = 'r';
    if (write(fd, &r, 1) != 1) _exit(8);
    uv_run(&loop, UV_RUN_DEFAULT);
    _exit(0);
}

/* ---- a client (one per process) ------------------------------------------------------- */

typedef struct client {
    uv_loop_t loop;
    ap_natns_t *ns;
    ap_p2p_host_t *h;
    ap_obs_t obs;
    ap_reach_t reach;
    int pending;
    bool ask_third;
    unsigned portmap;
    ap_portmap_t *pm;
    uv_async_t mapped;
    uv_mutex_t mu; /* the portmap's answer: */
    bool answered;
    int map_status;
    ap_portmap_lease_t lease;
    ap_nat_autonat_result_t res;
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
    ap_multiaddr_t other = srv_addr(c->ns, 1);
    other.has_peer = false;
    g_calls[NSRV] = (call_t){c, 0};
    ap_multiaddr_t s0 = srv_addr(c->ns, 0);
    if (ap__autonat_probe(c->h, &s0, &other, 1, 20000, on_third, &g_calls[NSRV])) probes_done(c);
}

static void start_probes(client_t *c)
{
    ap_multiaddr_t ips[2], cand[3];
    size_t n = ap__obs_believed_ips(&c->obs, now_us(c), ips, 2);
    for (size_t k = 0; k < n; k++) {
        cand[k] = ips[k];
        cand[k].has_tcp = true;
        cand[k].port = PORT;
    }
    if (c->res.mapped == 0 && c->portmap) { /* the mapped address, if not the same */
        char t[96];
        snprintf(t, sizeof t, "/ip4/%s/tcp/%u", c->lease.external_ip,
                 (unsigned)c->lease.external_port);
        ap_multiaddr_t m;
        bool dup = false;
        if (ap_multiaddr_parse(&m, t) == 0) {
            for (size_t k = 0; k < n; k++) dup |= ap_multiaddr_eq(&m, &cand[k]);
            if (!dup) cand[n++] = m;
        }
    }
    if (n) inet_ntop(AF_INET, ips[0].ip, c->res.seen, sizeof c->res.seen);
    c->pending = NSRV;
    for (size_t i = 0; i < NSRV; i++) {
        g_calls[i] = (call_t){c, i};
        ap_multiaddr_t s = srv_addr(c->ns, i);
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

static void start_identify(client_t *c)
{
    c->pending = NSRV;
    for (size_t i = 0; i < NSRV; i++) {
        c->srv[i] = ident((uint8_t)(1 + i)).id;
        g_calls[i] = (call_t){c, i};
        ap_multiaddr_t s = srv_addr(c->ns, i);
        int rc = ap__p2p_identify_peer(c->h, &s, 20000, on_identify, &g_calls[i]);
        if (rc) on_identify(&g_calls[i], rc, NULL);
    }
}

/* the portmap's thread: the first answer only, handed to the loop */
static void on_mapped(void *arg, int status, const ap_portmap_lease_t *l)
{
    client_t *c = arg;
    uv_mutex_lock(&c->mu);
    if (!c->answered) {
        c->answered = true;
        c->map_status = status;
        if (status == 0) c->lease = *l;
        uv_async_send(&c->mapped);
    }
    uv_mutex_unlock(&c->mu);
}

static void on_mapped_loop(uv_async_t *a)
{
    client_t *c = a->data;
    uv_close((uv_handle_t *)a, NULL);
    uv_mutex_lock(&c->mu);
    c->res.mapped = c->map_status;
    if (c->map_status == 0) {
        c->res.via = (int)c->lease.via;
        snprintf(c->res.mapped_to, sizeof c->res.mapped_to, "%s:%u", c->lease.external_ip,
                 (unsigned)c->lease.external_port);
    }
    uv_mutex_unlock(&c->mu);
    start_identify(c);
}

static void run_client(ap_natns_t *ns, uint8_t seed, bool ask_third, unsigned portmap, int fd)
{
    static client_t c;
    memset(&c, 0, sizeof c);
    c.ns = ns;
    uv_loop_init(&c.loop);
    c.h = start_host(&c.loop, seed);
    listen_any(c.h);
    c.ask_third = ask_third;
    ap__obs_init(&c.obs);
    ap__reach_init(&c.reach, now_us(&c), 5000000, 900000000);
    c.res.third = 1;
    c.res.mapped = 1; /* not yet */
    c.portmap = portmap;
    if (portmap) {
        uv_mutex_init(&c.mu);
        uv_async_init(&c.loop, &c.mapped, on_mapped_loop);
        c.mapped.data = &c;
        c.pm = ap__portmap_start(PORT, portmap, on_mapped, &c);
        if (!c.pm) _exit(10);
    } else {
        start_identify(&c);
    }
    uv_run(&c.loop, UV_RUN_DEFAULT);
    c.res.unmapped = ap__portmap_stop(c.pm); /* blocking: the loop is done */
    ssize_t w = write(fd, &c.res, sizeof c.res);
    _exit(w == (ssize_t)sizeof c.res ? 0 : 9);
}

/* ---- the run --------------------------------------------------------------------------- */

int ap_nat_autonat_run(ap_natns_t *ns, const ap_nat_where_t *where, size_t n, int limit_ms,
                       ap_nat_autonat_result_t *res, char *why, size_t wn)
{
    pid_t pids[NSRV + AP_NAT_AUTONAT_MAX] = {0};
    int fds[AP_NAT_AUTONAT_MAX];
    if (n > AP_NAT_AUTONAT_MAX || ap_natns_npublic(ns) < NSRV) {
        snprintf(why, wn, "at most %d clients, at least %d public nodes", AP_NAT_AUTONAT_MAX, NSRV);
        return AP_EINVAL;
    }
    for (size_t i = 0; i < NSRV; i++) {
        int p[2];
        if (pipe(p)) {
            ap_natns_kill_all(pids, NSRV);
            snprintf(why, wn, "pipe failed");
            return AP_EIO;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            if (ap_natns_enter_public(ns, i)) _exit(3);
            run_server(i, p[1]);
        }
        close(p[1]);
        pids[i] = pid;
        char r;
        bool ok = pid > 0 && ap_natns_read_within(p[0], &r, 1, 30000);
        close(p[0]);
        if (!ok) {
            ap_natns_kill_all(pids, NSRV);
            snprintf(why, wn, "AutoNAT server %zu did not start", i);
            return AP_ETIMEDOUT;
        }
    }
    size_t started = 0;
    int rc = 0;
    for (size_t k = 0; k < n; k++) {
        int p[2];
        if (pipe(p)) {
            snprintf(why, wn, "pipe failed");
            rc = AP_EIO;
            break;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            int e = where[k].home ? ap_natns_enter_home(ns, where[k].index)
                                  : ap_natns_enter_public(ns, where[k].index);
            if (e) _exit(3);
            run_client(ns, (uint8_t)(50 + k), where[k].ask_third, where[k].portmap, p[1]);
        }
        close(p[1]);
        pids[NSRV + k] = pid;
        fds[k] = p[0];
        started++;
    }
    for (size_t k = 0; k < started; k++) {
        bool ok = ap_natns_read_within(fds[k], &res[k], sizeof res[k], limit_ms);
        close(fds[k]);
        if (!ok && rc == 0) {
            snprintf(why, wn, "client %zu reported nothing within %d ms", k, limit_ms);
            rc = AP_ETIMEDOUT;
        }
    }
    ap_natns_kill_all(pids, NSRV + n);
    return rc;
}
