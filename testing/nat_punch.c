/* Circuit relay and DCUtR through real NATs: a relay and two peers in
 * forked processes (see nat_punch.h). */
#include "nat_punch.h"

#include "apiary/error.h"
#include "apiary/identity.h"
#include "p2p/autonat_uv.h"
#include "p2p/dcutr_uv.h"
#include "p2p/relay_svc.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

#define RELAY_PORT 4001
#define SEED_RELAY 1
#define SEED_B     100 /* + round */
#define SEED_A     200 /* + round */

static ap_identity_t ident(uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    ap_identity_t id;
    if (ap_identity_from_seed(&id, seed)) abort();
    return id;
}

static ap_multiaddr_t relay_addr(ap_natns_t *ns, size_t relay)
{
    ap_multiaddr_t a;
    char t[AP_MA_TEXT_MAX], pid[AP_PEER_ID_STR_MAX];
    ap_identity_t id = ident(SEED_RELAY);
    snprintf(t, sizeof t, "/ip4/%s/tcp/%d/p2p/%s", ap_natns_public_ip(ns, relay), RELAY_PORT,
             ap_peer_id_str(&id.id, pid));
    if (ap_multiaddr_parse(&a, t)) abort();
    return a;
}

static void listen_port(ap_p2p_host_t *h, int port)
{
    ap_multiaddr_t any;
    char t[64];
    snprintf(t, sizeof t, "/ip4/0.0.0.0/tcp/%d", port);
    if (ap_multiaddr_parse(&any, t) || ap__p2p_host_listen(h, &any, NULL)) _exit(7);
}

/* ---- the relay ------------------------------------------------------------------------ */

static ap_multiaddr_t g_pub; /* the process's announced address */
static int pub_addrs(void *arg, ap_multiaddr_t *out, int max)
{
    (void)arg;
    if (max < 1) return 0;
    out[0] = g_pub;
    return 1;
}

static void run_relay(ap_natns_t *ns, size_t relay, int fd)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    ap_identity_t id = ident(SEED_RELAY);
    ap_p2p_host_t *h = ap__p2p_host_new(&loop, &id, "apiary-test");
    if (!h || ap__p2p_host_serve_basics(h)) _exit(5);
    ap_relay_limits_t lim;
    ap__relay_limits_default(&lim);
    lim.circuit_bytes = 256u << 20; /* the throughput run */
    if (!ap__relay_serve(h, &lim)) _exit(6);
    g_pub = relay_addr(ns, relay);
    g_pub.has_peer = false;
    ap__p2p_host_set_addrs(h, pub_addrs, NULL);
    listen_port(h, RELAY_PORT);
    char r = 'r';
    if (write(fd, &r, 1) != 1) _exit(8);
    uv_run(&loop, UV_RUN_DEFAULT);
    _exit(0);
}

/* ---- a peer: one host per round ---------------------------------------------------------- */

typedef struct peer {
    uv_loop_t loop;
    ap_natns_t *ns;
    size_t relay;
    bool b_side;
    int round, port;
    ap_p2p_host_t *h;
    ap_relay_client_t *cl;
    ap_dcutr_t *dc;
    ap_peer_id_t other;
    ap_multiaddr_t obs; /* our public address: observed IP, listen port */
    bool has_obs, connected, ended;
    uv_timer_t poll, deadline;
    int freed;
    ap_nat_punch_round_t res;
    /* the ping check */
    uint8_t ping[64];
    size_t pinged;
    /* throughput */
    size_t bytes, sent, echoed;
    uint64_t t0;
    double Bps[2];
    int phase;
} peer_t;

static peer_t P;

static int peer_addrs(void *arg, ap_multiaddr_t *out, int max)
{
    (void)arg;
    int k = 0;
    if (P.has_obs && max > 0) out[k++] = P.obs;
    if (P.cl) k += ap__relay_client_addrs(P.cl, out + k, max - k);
    return k;
}

static void round_end(void)
{
    if (P.ended) return;
    P.ended = true;
    uv_stop(&P.loop);
}

static void on_freed(void *arg)
{
    (void)arg;
    P.freed = 1;
}

/* ping over c: 64 bytes out, the same back */
static void pg_open(ap_p2p_stream_t *s)
{
    for (size_t i = 0; i < sizeof P.ping; i++) P.ping[i] = (uint8_t)(i + P.round);
    if (ap__p2p_stream_write(s, P.ping, sizeof P.ping)) ap__p2p_stream_reset(s);
}
static void pg_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n && P.pinged < sizeof P.ping; i++)
        if (p[i] == P.ping[P.pinged]) P.pinged++;
    if (P.pinged < sizeof P.ping) return;
    bool relayed = ap__p2p_conn_relayed(ap__p2p_stream_conn(s));
    if (P.res.status == 0 && !relayed) P.res.direct_used = 1;
    if (P.res.status != 0 && relayed) P.res.relayed_alive = 1;
    ap__p2p_stream_close(s);
    round_end();
}
static void pg_close(ap_p2p_stream_t *s, int st)
{
    (void)s;
    (void)st;
    round_end();
}
static const ap_p2p_proto_t ping_c = {AP_PING_PROTO, pg_open, pg_data, NULL, pg_close};

static void check_tick(uv_timer_t *t)
{
    (void)t;
    /* after the grace period: the relayed connection must be gone on
     * success, alive on failure; ping goes over what is left */
    ap_p2p_conn_t *r = ap__p2p_host_find(P.h, &P.other, AP_P2P_FIND_RELAYED);
    ap_p2p_conn_t *d = ap__p2p_host_find(P.h, &P.other, AP_P2P_FIND_DIRECT);
    ap_p2p_conn_t *use = P.res.status == 0 ? (r ? NULL : d) : r;
    if (!use || ap__p2p_stream_open(use, &ping_c, NULL, NULL)) round_end();
}

static void on_punch(void *arg, const ap_peer_id_t *peer, bool b_side, int status, int attempts,
                     double ms, ap_p2p_conn_t *direct)
{
    (void)arg;
    (void)peer;
    (void)direct;
    if (!b_side || !P.b_side) return;
    P.res.status = status;
    P.res.attempts = attempts;
    P.res.ms_direct = ms;
    uv_timer_start(&P.poll, check_tick, status == 0 ? 800 : 100, 0);
}

static void on_inbound(void *arg, ap_p2p_conn_t *c)
{
    (void)arg;
    P.res.relayed = 1;
    P.other = *ap__p2p_conn_peer(c);
    if (P.phase == 0 && ap__dcutr_start(P.dc, c)) round_end();
}

/* A: dial B through the relay until B's reservation is there */
static void dial_b(uv_timer_t *t);
static void a_ready(ap_p2p_conn_t *c, void *arg)
{
    (void)arg;
    (void)c;
    P.connected = true;
}
static void a_closed(ap_p2p_conn_t *c, void *arg, int st)
{
    (void)arg;
    (void)st;
    if (!c && !P.ended) uv_timer_start(&P.poll, dial_b, 200, 0); /* not reserved yet */
}
static const ap_p2p_conn_cbs_t a_cbs = {a_ready, a_closed};

static void a_watch(uv_timer_t *t)
{
    (void)t;
    if (P.connected && !ap__p2p_host_find(P.h, &P.other, AP_P2P_FIND_ANY)) {
        round_end(); /* B ended its round */
        return;
    }
    uv_timer_start(&P.deadline, a_watch, 100, 0);
}

static void dial_b(uv_timer_t *t)
{
    (void)t;
    ap_multiaddr_t ma = relay_addr(P.ns, P.relay);
    ma.circuit = ma.has_dst = true;
    ma.dst = P.other;
    if (ap__circuit_dial(P.h, &ma, &a_cbs, NULL)) uv_timer_start(&P.poll, dial_b, 200, 0);
}

static void thr_start(void);

static void on_identify(void *arg, int status, const ap_identify_t *id)
{
    (void)arg;
    if (status == 0 && id->has_observed) {
        P.obs = id->observed;
        P.obs.port = (uint16_t)P.port;
        P.has_obs = true;
    }
    if (P.b_side) {
        ap_multiaddr_t ra = relay_addr(P.ns, P.relay);
        P.cl = ap__relay_client_new(P.h, &ra, 1, on_inbound, NULL);
        if (!P.cl) _exit(10);
    } else if (P.phase == 0) {
        dial_b(NULL);
        a_watch(NULL);
    } else
        thr_start();
}

static void round_timeout(uv_timer_t *t)
{
    (void)t;
    round_end();
}

static void peer_round(int limit_ms)
{
    memset(&P.res, 0, sizeof P.res);
    P.res.status = AP_ETIMEDOUT;
    P.ended = P.connected = P.has_obs = false;
    P.pinged = 0;
    P.port = AP_NAT_PUNCH_PORT + P.round;
    ap_identity_t id = ident((uint8_t)((P.b_side ? SEED_B : SEED_A) + P.round));
    P.other = ident((uint8_t)((P.b_side ? SEED_A : SEED_B) + P.round)).id;
    P.h = ap__p2p_host_new(&P.loop, &id, "apiary-test");
    if (!P.h || ap__p2p_host_serve_basics(P.h)) _exit(5);
    if (P.phase == 1) ap__p2p_host_relay_bulk(P.h, true);
    ap_dcutr_opts_t o = {.port = (uint16_t)P.port, .attempt_ms = 1500, .grace_ms = 300};
    P.dc = ap__dcutr_serve(P.h, &o, on_punch, NULL);
    P.cl = NULL;
    if (!P.dc) _exit(6);
    ap__p2p_host_set_addrs(P.h, peer_addrs, NULL);
    listen_port(P.h, P.port);
    ap_multiaddr_t ra = relay_addr(P.ns, P.relay);
    if (ap__p2p_identify_peer(P.h, &ra, 10000, on_identify, NULL)) _exit(9);
    if (P.b_side) uv_timer_start(&P.deadline, round_timeout, (uint64_t)limit_ms, 0);
    uv_run(&P.loop, UV_RUN_DEFAULT);
    uv_timer_stop(&P.poll);
    uv_timer_stop(&P.deadline);
    P.freed = 0;
    ap__p2p_host_free_then(P.h, on_freed, NULL);
    while (!P.freed) uv_run(&P.loop, UV_RUN_ONCE);
    ap__relay_client_free(P.cl);
    ap__dcutr_free(P.dc);
    P.cl = NULL;
    uv_run(&P.loop, UV_RUN_NOWAIT);
}

static void run_peer(ap_natns_t *ns, size_t relay, bool b_side, int rounds, int phase, size_t bytes,
                     int limit_ms, int fd)
{
    memset(&P, 0, sizeof P);
    P.ns = ns;
    P.relay = relay;
    P.b_side = b_side;
    P.phase = phase;
    P.bytes = bytes;
    uv_loop_init(&P.loop);
    uv_timer_init(&P.loop, &P.poll);
    uv_timer_init(&P.loop, &P.deadline);
    for (P.round = 0; P.round < rounds; P.round++) {
        peer_round(limit_ms);
        if (b_side && phase == 0 && write(fd, &P.res, sizeof P.res) != (ssize_t)sizeof P.res)
            _exit(11);
    }
    if (phase == 1 && !b_side && write(fd, P.Bps, sizeof P.Bps) != (ssize_t)sizeof P.Bps) _exit(11);
    _exit(0);
}

/* ---- throughput: ping through the circuit, then straight to the relay ------------------- */

static void thr_next(void);
static void tp_push(ap_p2p_stream_t *s)
{
    static uint8_t chunk[64 << 10];
    while (P.sent < P.bytes) {
        size_t n = P.bytes - P.sent < sizeof chunk ? P.bytes - P.sent : sizeof chunk;
        if (ap__p2p_stream_write(s, chunk, n) != 0) return; /* on_writable follows */
        P.sent += n;
    }
}
static void tp_open(ap_p2p_stream_t *s)
{
    ap__p2p_stream_set_flow(s, tp_push, false);
    P.sent = P.echoed = 0;
    P.t0 = uv_hrtime();
    tp_push(s);
}
static void tp_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    (void)p;
    P.echoed += n;
    if (P.echoed < P.bytes) return;
    P.Bps[P.round] = (double)P.bytes / ((double)(uv_hrtime() - P.t0) / 1e9);
    ap__p2p_stream_close(s);
    thr_next();
}
static void tp_close(ap_p2p_stream_t *s, int st)
{
    (void)s;
    (void)st;
    if (P.echoed < P.bytes) round_end();
}
static const ap_p2p_proto_t tp_c = {AP_PING_PROTO, tp_open, tp_data, NULL, tp_close};

static void tp_ready(ap_p2p_conn_t *c, void *arg)
{
    (void)arg;
    if (ap__p2p_stream_open(c, &tp_c, NULL, NULL)) round_end();
}
static void thr_retry(uv_timer_t *t);
static void tp_closed(ap_p2p_conn_t *c, void *arg, int st)
{
    (void)arg;
    (void)st;
    if (!c && !P.ended) uv_timer_start(&P.poll, thr_retry, 200, 0);
}
static const ap_p2p_conn_cbs_t tp_cbs = {tp_ready, tp_closed};

static void thr_retry(uv_timer_t *t)
{
    (void)t;
    thr_start();
}

/* A's rounds in the throughput run: 0 through the circuit, 1 to the relay */
static void thr_start(void)
{
    ap_multiaddr_t ma = relay_addr(P.ns, P.relay);
    if (P.round == 0) {
        ma.circuit = ma.has_dst = true;
        ma.dst = ident(SEED_B).id;
        if (ap__circuit_dial(P.h, &ma, &tp_cbs, NULL)) round_end();
    } else if (ap__p2p_dial(P.h, &ma, &tp_cbs, NULL, NULL))
        round_end();
}

static void thr_next(void)
{
    round_end();
}

/* ---- the runs ----------------------------------------------------------------------------- */

static int start_relay(ap_natns_t *ns, size_t relay, pid_t *pid, char *why, size_t wn)
{
    int p[2];
    if (pipe(p)) {
        snprintf(why, wn, "pipe failed");
        return AP_EIO;
    }
    *pid = fork();
    if (*pid == 0) {
        close(p[0]);
        if (ap_natns_enter_public(ns, relay)) _exit(3);
        run_relay(ns, relay, p[1]);
    }
    close(p[1]);
    char r;
    bool ok = *pid > 0 && ap_natns_read_within(p[0], &r, 1, 30000);
    close(p[0]);
    if (!ok) {
        int st = 0;
        if (*pid > 0 && waitpid(*pid, &st, 0) == *pid) *pid = 0;
        snprintf(why, wn, "the relay did not start (exit %d)",
                 WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        return AP_ETIMEDOUT;
    }
    return 0;
}

static pid_t start_peer(ap_natns_t *ns, size_t relay, size_t home, bool b_side, int rounds,
                        int phase, size_t bytes, int limit_ms, int *rfd)
{
    int p[2];
    if (pipe(p)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        if (ap_natns_enter_home(ns, home)) _exit(3);
        run_peer(ns, relay, b_side, rounds, phase, bytes, limit_ms, p[1]);
    }
    close(p[1]);
    *rfd = p[0];
    return pid;
}

int ap_nat_punch_run(ap_natns_t *ns, size_t relay, size_t home_a, size_t home_b, int rounds,
                     int limit_ms, ap_nat_punch_round_t *res, char *why, size_t wn)
{
    pid_t pids[3] = {0};
    int fa = -1, fb = -1, rc;
    if (rounds < 1 || rounds > AP_NAT_PUNCH_ROUNDS) {
        snprintf(why, wn, "1 to %d rounds", AP_NAT_PUNCH_ROUNDS);
        return AP_EINVAL;
    }
    if ((rc = start_relay(ns, relay, &pids[0], why, wn)) != 0) {
        ap_natns_kill_all(pids, 1);
        return rc;
    }
    pids[1] = start_peer(ns, relay, home_b, true, rounds, 0, 0, limit_ms, &fb);
    pids[2] = start_peer(ns, relay, home_a, false, rounds, 0, 0, limit_ms, &fa);
    rc = 0;
    for (int r = 0; r < rounds && rc == 0; r++)
        if (fb < 0 || !ap_natns_read_within(fb, &res[r], sizeof res[r], limit_ms + 5000)) {
            snprintf(why, wn, "B reported nothing for round %d within %d ms", r, limit_ms);
            rc = AP_ETIMEDOUT;
        }
    if (fa >= 0) close(fa);
    if (fb >= 0) close(fb);
    ap_natns_kill_all(pids, 3);
    return rc;
}

int ap_nat_relay_throughput(ap_natns_t *ns, size_t relay, size_t home_a, size_t home_b,
                            size_t bytes, double *relayed_Bps, double *direct_Bps, char *why,
                            size_t wn)
{
    pid_t pids[3] = {0};
    int fa = -1, fb = -1, rc;
    if ((rc = start_relay(ns, relay, &pids[0], why, wn)) != 0) {
        ap_natns_kill_all(pids, 1);
        return rc;
    }
    pids[1] = start_peer(ns, relay, home_b, true, 1, 1, bytes, 120000, &fb);
    pids[2] = start_peer(ns, relay, home_a, false, 2, 1, bytes, 120000, &fa);
    double Bps[2] = {0, 0};
    if (fa < 0 || !ap_natns_read_within(fa, Bps, sizeof Bps, 120000)) {
        snprintf(why, wn, "A reported no throughput");
        rc = AP_ETIMEDOUT;
    }
    *relayed_Bps = Bps[0];
    *direct_Bps = Bps[1];
    if (fa >= 0) close(fa);
    if (fb >= 0) close(fb);
    ap_natns_kill_all(pids, 3);
    return rc;
}
