/* libp2p connections under connection admission (base/admit.h) over real
 * loopback sockets, alone and sharing one admission with native
 * connections on the TCP transport's port:
 *   - a libp2p host alone: connections stalled mid-handshake from one
 *     address (127.0.0.2) fill only that address's handshake budget; a
 *     libp2p peer from 127.0.0.1 still connects; the deadline closes the
 *     stalled ones;
 *   - the transport's port: stalled libp2p and native handshakes from one
 *     address share one per-address budget (16 in all, not 16 of each);
 *     native and libp2p peers from another address still connect;
 *   - at the handshake limit a native newcomer closes a stalled libp2p
 *     handshake; at the per-address limit of open connections a libp2p
 *     connection makes an idle native one make room, and the other way. */
#include "aptest.h"

#include "apiary/identity.h"
#include "base/admit.h"
#include "net/tcp.h"
#include "p2p/p2p_conn.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#define NSTALLED 24
#define HALF     (NSTALLED / 2)

typedef struct ctx {
    uv_loop_t loop;
    ap_p2p_conn_t *conn;
    bool ready, closed;
    int tcp_conns, tcp_closed; /* the native client's transport */
    bool timer_fired;
} ctx_t;

static void ready(ap_p2p_conn_t *c, void *arg)
{
    (void)c;
    ((ctx_t *)arg)->ready = true;
}
static void closed(ap_p2p_conn_t *c, void *arg, int st)
{
    (void)c;
    (void)st;
    ((ctx_t *)arg)->closed = true;
}
static const ap_p2p_conn_cbs_t cbs = {ready, closed};

#define RUN_UNTIL(x, cond)                                                                         \
    do {                                                                                           \
        for (int ap__i = 0; !(cond) && ap__i < 100000; ap__i++) uv_run(&(x)->loop, UV_RUN_ONCE);   \
        assert_true(cond);                                                                         \
    } while (0)

static void ident(ap_identity_t *id, uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    assert_ok(ap_identity_from_seed(id, seed));
}

static void ip4(uint8_t ip[16], const char *s)
{
    memset(ip, 0, 16);
    ip[10] = ip[11] = 0xff;
    assert_int_equal(inet_pton(AF_INET, s, ip + 12), 1);
}

/* A socket from src to 127.0.0.1:port that sends only the first bytes of
 * multistream-select (libp2p) or nothing at all (a native handshake never
 * begun), then stalls. */
static int stalled_from(const char *from, uint16_t port, bool libp2p)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in src = {.sin_family = AF_INET}, dst = {.sin_family = AF_INET};
    inet_pton(AF_INET, from, &src.sin_addr);
    inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
    dst.sin_port = htons(port);
    assert_int_equal(bind(fd, (struct sockaddr *)&src, sizeof src), 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&dst, sizeof dst), 0);
    static const uint8_t part[] = {0x13, '/', 'm', 'u', 'l'};
    if (libp2p) assert_int_equal(send(fd, part, sizeof part, MSG_NOSIGNAL), (ssize_t)sizeof part);
    return fd;
}

static int stalled(uint16_t port)
{
    return stalled_from("127.0.0.2", port, true);
}

/* The socket was closed by the other end (EOF or reset), without waiting. */
static bool peer_closed(int fd)
{
    uint8_t b[64];
    for (;;) {
        ssize_t n = recv(fd, b, sizeof b, MSG_DONTWAIT);
        if (n == 0) return true;
        if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    }
}

static int nclosed(const int *fds, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++) k += peer_closed(fds[i]);
    return k;
}

static void test_stalled_from_one_ip(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t ida, idb;
    ident(&ida, 7);
    ident(&idb, 8);
    ap_p2p_host_t *a = ap__p2p_host_new(&x.loop, &ida, "apiary-test/a");
    ap_p2p_host_t *b = ap__p2p_host_new(&x.loop, &idb, "apiary-test/b");
    assert_non_null(a);
    assert_non_null(b);
    ap_admit_t *adm = ap__p2p_host_admit(a);
    const uint32_t per_ip = adm->cfg.hs_per_ip;
    assert_true(per_ip < NSTALLED);
    ap__p2p_host_set_hs_timeout(a, 400);
    assert_ok(ap__p2p_host_serve_basics(a));
    ap_multiaddr_t ma, bound;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(a, &ma, &bound));
    bound.has_peer = true;
    bound.peer = ida.id;

    uint8_t bad[16], good[16];
    ip4(bad, "127.0.0.2");
    ip4(good, "127.0.0.1");
    int fds[NSTALLED];
    for (int i = 0; i < NSTALLED; i++) fds[i] = stalled(bound.port);
    /* every one is accepted: per_ip are pending, the rest refused (closed) */
    const ap_admit_stats_t *as = ap_admit_stats(adm);
    RUN_UNTIL(&x,
              ap_admit_pending_ip(adm, bad) == per_ip && as->dropped_per_ip >= NSTALLED - per_ip);
    assert_int_equal(as->dropped_per_ip, NSTALLED - per_ip);
    assert_int_equal(as->pending, per_ip);

    /* a peer from another address connects while they stall */
    assert_ok(ap__p2p_dial(b, &bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    assert_true(x.ready);
    assert_false(x.closed);
    /* the listener's side of its handshake ends once the last message is
     * in: the connection is open in admission */
    RUN_UNTIL(&x, ap_admit_pending_ip(adm, good) == 0 && as->open_in == 1);
    assert_int_equal(ap_admit_pending_ip(adm, bad), per_ip);

    /* the deadline closes the stalled ones; the connected peer stays */
    RUN_UNTIL(&x, as->pending == 0 && nclosed(fds, NSTALLED) == NSTALLED);
    assert_int_equal(ap_admit_pending_ip(adm, bad), 0);
    assert_false(x.closed);
    assert_int_equal(as->open_in, 1);
    for (int i = 0; i < NSTALLED; i++) close(fds[i]);

    ap__p2p_host_free(a);
    ap__p2p_host_free(b);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

/* ---- the TCP transport's port: one admission for native and libp2p ------------ */

static void t_conn(void *arg, ap_tcp_conn_t *c)
{
    (void)c;
    ((ctx_t *)arg)->tcp_conns++;
}
static void t_close(void *arg, ap_tcp_conn_t *c, int st)
{
    (void)c;
    (void)st;
    ((ctx_t *)arg)->tcp_closed++;
}
static const ap_tcp_cbs_t tcbs = {.on_conn = t_conn, .on_close = t_close};

static void dial_cb(void *arg, int status, ap_tcp_conn_t *c)
{
    (void)c;
    *(int *)arg = status;
}

static void flag_done(void *arg)
{
    *(bool *)arg = true;
}

typedef struct port {
    ap_tcp_t *t;
    ap_multiaddr_t bound;
    char addr[AP_MA_TEXT_MAX];
} port_t;

static void port_open(ctx_t *x, port_t *p, const ap_identity_t *id, const ap_tcp_cfg_t *cfg)
{
    assert_ok(ap__tcp_new(&x->loop, id, cfg, NULL, NULL, &p->t));
    assert_ok(ap__tcp_listen(p->t, "/ip4/127.0.0.1/tcp/0"));
    assert_int_equal(ap__tcp_listen_addrs(p->t, &p->bound, 1), 1);
    assert_true(p->bound.has_peer);
    assert_true(ap_multiaddr_print(&p->bound, p->addr, sizeof p->addr) > 0);
}

static void port_close(ctx_t *x, port_t *p)
{
    bool done = false;
    ap__tcp_close(p->t, flag_done, &done);
    RUN_UNTIL(x, done);
}

/* Stalled libp2p and native handshakes from one address share its budget. */
static void test_mixed_kinds_one_budget(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t ida, idb, idc;
    ident(&ida, 11);
    ident(&idb, 12);
    ident(&idc, 13);
    ap_tcp_cfg_t cfg = {.handshake_timeout_ms = 1500};
    port_t a;
    port_open(&x, &a, &ida, &cfg);
    ap_tcp_stats_t st;
    uint8_t bad[16];
    ip4(bad, "127.0.0.2");

    /* HALF libp2p handshakes stalled inside multistream-select: each moves
     * to the libp2p host with its admission entry */
    int lp[HALF], nat[HALF];
    for (int i = 0; i < HALF; i++) lp[i] = stalled_from("127.0.0.2", a.bound.port, true);
    ap__tcp_get_stats(a.t, &st);
    for (int i = 0; i < 100000 && (st.admit.pending != HALF || st.handshaking != 0); i++) {
        uv_run(&x.loop, UV_RUN_ONCE);
        ap__tcp_get_stats(a.t, &st);
    }
    assert_int_equal(st.admit.pending, HALF);
    assert_int_equal(st.handshaking, 0); /* none is a native handshake any more */
    assert_int_equal(nclosed(lp, HALF), 0);

    /* HALF native handshakes from the same address: only 16 - HALF fit */
    const uint32_t per_ip = 16;
    for (int i = 0; i < HALF; i++) nat[i] = stalled_from("127.0.0.2", a.bound.port, false);
    const int refused = (int)(HALF + HALF - per_ip);
    for (int i = 0; i < 100000 && nclosed(nat, HALF) < refused; i++) uv_run(&x.loop, UV_RUN_ONCE);
    ap__tcp_get_stats(a.t, &st);
    assert_int_equal(st.admit.dropped_per_ip, refused);
    assert_int_equal(st.admit.pending, per_ip);
    assert_int_equal(st.handshaking, per_ip - HALF);
    assert_int_equal(nclosed(nat, HALF), refused);
    assert_int_equal(nclosed(lp, HALF), 0);
    /* and the other way: a libp2p handshake over the shared budget is refused */
    int extra = stalled_from("127.0.0.2", a.bound.port, true);
    RUN_UNTIL(&x, peer_closed(extra));
    close(extra);
    ap__tcp_get_stats(a.t, &st);
    assert_int_equal(st.admit.pending, per_ip);

    /* peers from another address get in, native and libp2p */
    ap_tcp_t *u = NULL;
    assert_ok(ap__tcp_new(&x.loop, &idb, NULL, &tcbs, &x, &u));
    int dial_st = 1;
    assert_ok(ap__tcp_dial(u, a.addr, 5000, dial_cb, &dial_st));
    ap_p2p_host_t *h = ap__p2p_host_new(&x.loop, &idc, "apiary-test/c");
    assert_non_null(h);
    assert_ok(ap__p2p_dial(h, &a.bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, dial_st != 1 && (x.ready || x.closed));
    assert_int_equal(dial_st, 0);
    assert_true(x.ready);

    /* the deadline closes every stalled one, of both kinds */
    RUN_UNTIL(&x, nclosed(lp, HALF) == HALF && nclosed(nat, HALF) == HALF);
    ap__tcp_get_stats(a.t, &st);
    for (int i = 0; i < 100000 && st.admit.pending != 0; i++) {
        uv_run(&x.loop, UV_RUN_ONCE);
        ap__tcp_get_stats(a.t, &st);
    }
    assert_int_equal(st.admit.pending, 0);
    assert_int_equal(ap_admit_pending_ip(ap__p2p_host_admit(ap__tcp_p2p_host(a.t)), bad), 0);
    assert_int_equal(st.admit.open_in, 2); /* the native and the libp2p peer */
    assert_false(x.closed);
    for (int i = 0; i < HALF; i++) {
        close(lp[i]);
        close(nat[i]);
    }

    ap__p2p_host_free(h);
    bool done = false;
    ap__tcp_close(u, flag_done, &done);
    RUN_UNTIL(&x, done && x.closed);
    port_close(&x, &a);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

static void on_timer(uv_timer_t *t)
{
    ((ctx_t *)t->data)->timer_fired = true;
}

/* At the handshake limit a native newcomer closes a stalled libp2p
 * handshake (the oldest, stalled past hs_min_age_ms): either kind makes room. */
static void test_native_evicts_stalled_libp2p(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t ida;
    ident(&ida, 14);
    enum { FULL = 8 };
    ap_tcp_cfg_t cfg = {.max_handshakes = FULL};
    port_t a;
    port_open(&x, &a, &ida, &cfg);
    /* one stalled libp2p handshake from each of FULL addresses: a first
     * handshake from an address is never dropped at random */
    int lp[FULL];
    for (int i = 0; i < FULL; i++) {
        char from[32];
        snprintf(from, sizeof from, "127.0.0.%d", 2 + i);
        lp[i] = stalled_from(from, a.bound.port, true);
    }
    ap_tcp_stats_t st;
    ap__tcp_get_stats(a.t, &st);
    for (int i = 0; i < 100000 && (st.admit.pending != FULL || st.handshaking != 0); i++) {
        uv_run(&x.loop, UV_RUN_ONCE);
        ap__tcp_get_stats(a.t, &st);
    }
    assert_int_equal(st.admit.pending, FULL);
    assert_int_equal(st.handshaking, 0);
    /* they stall past hs_min_age_ms */
    uv_timer_t tm;
    uv_timer_init(&x.loop, &tm);
    tm.data = &x;
    uv_timer_start(&tm, on_timer, 2 * ap__p2p_host_admit(ap__tcp_p2p_host(a.t))->cfg.hs_min_age_ms,
                   0);
    RUN_UNTIL(&x, x.timer_fired);
    uv_close((uv_handle_t *)&tm, NULL);

    int nat = stalled_from("127.0.0.20", a.bound.port, false);
    RUN_UNTIL(&x, nclosed(lp, FULL) == 1);
    ap__tcp_get_stats(a.t, &st);
    assert_int_equal(st.admit.evicted_pending, 1);
    assert_int_equal(st.admit.pending, FULL);
    assert_int_equal(st.handshaking, 1);
    assert_false(peer_closed(nat));
    close(nat);
    for (int i = 0; i < FULL; i++) close(lp[i]);
    port_close(&x, &a);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

/* Open connections: one per address (conns_per_ip 1). An idle native
 * connection is closed for a libp2p one from its address, and that one in
 * turn for a native newcomer. */
static void test_open_budget_shared(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t ida, idb, idc, idd;
    ident(&ida, 15);
    ident(&idb, 16);
    ident(&idc, 17);
    ident(&idd, 18);
    ap_tcp_cfg_t cfg = {.conns_per_ip = 1};
    port_t a;
    port_open(&x, &a, &ida, &cfg);

    ap_tcp_t *u = NULL;
    assert_ok(ap__tcp_new(&x.loop, &idb, NULL, &tcbs, &x, &u));
    int dial_st = 1;
    assert_ok(ap__tcp_dial(u, a.addr, 5000, dial_cb, &dial_st));
    RUN_UNTIL(&x, dial_st != 1);
    assert_int_equal(dial_st, 0);
    ap_tcp_stats_t st;
    ap__tcp_get_stats(a.t, &st);
    for (int i = 0; i < 100000 && st.admit.open_in != 1; i++) {
        uv_run(&x.loop, UV_RUN_ONCE);
        ap__tcp_get_stats(a.t, &st);
    }
    assert_int_equal(st.admit.open_in, 1);

    /* the libp2p peer from the same address: the idle native one goes */
    ap_p2p_host_t *h = ap__p2p_host_new(&x.loop, &idc, "apiary-test/c");
    assert_non_null(h);
    assert_ok(ap__p2p_dial(h, &a.bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, (x.ready || x.closed) && x.tcp_closed == 1);
    assert_true(x.ready);
    assert_false(x.closed);
    ap__tcp_get_stats(a.t, &st);
    assert_int_equal(st.admit.open_in, 1);
    assert_int_equal(st.admit.evicted_idle, 1);

    /* a native newcomer from the same address: the idle libp2p one goes */
    ap_tcp_t *w = NULL;
    ctx_t y;
    memset(&y, 0, sizeof y);
    assert_ok(ap__tcp_new(&x.loop, &idd, NULL, &tcbs, &y, &w));
    dial_st = 1;
    assert_ok(ap__tcp_dial(w, a.addr, 5000, dial_cb, &dial_st));
    RUN_UNTIL(&x, dial_st != 1 && x.closed);
    assert_int_equal(dial_st, 0);
    ap__tcp_get_stats(a.t, &st);
    assert_int_equal(st.admit.open_in, 1);
    assert_int_equal(st.admit.evicted_idle, 2);

    ap__p2p_host_free(h);
    bool d1 = false, d2 = false;
    ap__tcp_close(u, flag_done, &d1);
    ap__tcp_close(w, flag_done, &d2);
    RUN_UNTIL(&x, d1 && d2);
    port_close(&x, &a);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stalled_from_one_ip),
        cmocka_unit_test(test_mixed_kinds_one_budget),
        cmocka_unit_test(test_native_evicts_stalled_libp2p),
        cmocka_unit_test(test_open_budget_shared),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
