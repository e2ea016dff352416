/* Dials that cross a connection from the same peer (runtime/uv over TCP):
 * the transport keeps one connection per peer, so a dial may be resolved with
 * a connection the node's mux already owns (the one the peer opened). The
 * dial must then succeed on that connection, and calls queued behind it must
 * run on it; the peers end with one connection.
 * Simultaneous dials with calls and streams already queued (TCP and the
 * in-process transport): the duplicate connection is retired with GOAWAY
 * once its calls and streams are done, so every one of them succeeds. */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/node.h"
#include "apiary/runtime.h"
#include "net/tcp.h"
#include "runtime/uv/uv_impl.h"

#include "base/buf.h"

#include <stdlib.h>
#include <string.h>

#define WAIT_US (10u * 1000u * 1000u)

typedef struct dial_res {
    bool done;
    int status;
    ap_peer_id_t peer;
} dial_res_t;

static void on_dial(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    (void)rt;
    dial_res_t *d = arg;
    d->done = true;
    d->status = status;
    if (peer) d->peer = *peer;
}

static bool dial_done(void *arg)
{
    return ((dial_res_t *)arg)->done;
}

typedef struct pair_wait {
    dial_res_t *a, *b;
    int *calls_left;
} pair_wait_t;

static bool all_done(void *arg)
{
    pair_wait_t *w = arg;
    return w->a->done && w->b->done && (!w->calls_left || *w->calls_left == 0);
}

typedef struct call {
    int *left;
    int status;
    bool ok;
} call_t;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt;
    (void)errmsg;
    call_t *c = arg;
    c->status = status;
    c->ok = status == 0 && len == 5 && memcmp(resp, "hello", 5) == 0;
    (*c->left)--;
}

static void new_node(ap_host_t *h, ap_rt_t **rt, char *addr_id, char *addr_bare)
{
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
    assert_ok(ap_node_new(h, &o, rt));
    char a[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(*rt, a, 1, true), 1);
    strcpy(addr_id, a[0]);
    assert_int_equal(ap_rt_listen_addrs(*rt, a, 1, false), 1);
    strcpy(addr_bare, a[0]);
    assert_ok(ap_rt_rpc_register(*rt, "/t/ap_test_rpc_echo/1", 0, ap_test_rpc_echo, NULL));
}

typedef struct two {
    ap_rt_t *a, *b;
} two_t;

/* One side is settled when its transport has no handshake in progress and
 * one open connection, and its mux holds exactly that one. */
static bool side_settled(ap_rt_t *rt)
{
    ap_tcp_stats_t ts;
    ap__tcp_get_stats(ap__tcpc_transport((ap_node_t *)rt), &ts);
    ap_rt_stats_t s;
    ap_rt_get_stats(rt, &s);
    return ts.handshaking == 0 && ts.open == 1 && s.connections == 1;
}

static bool settled(void *arg)
{
    two_t *t = arg;
    return side_settled(t->a) && side_settled(t->b);
}

static const ap_peer_id_t *self_id(ap_rt_t *rt)
{
    return ap_rt_self(rt);
}

/* An ap_test_rpc_echo call each way over the peers' connection: both succeed. */
static void echo_both_ways(ap_host_t *h, ap_rt_t *a, ap_rt_t *b)
{
    int left = 2;
    call_t c1 = {.left = &left}, c2 = {.left = &left};
    assert_true(ap_rt_rpc_call(a, self_id(b), "/t/ap_test_rpc_echo/1", (const uint8_t *)"hello", 5,
                               NULL, on_done, &c1) != 0);
    assert_true(ap_rt_rpc_call(b, self_id(a), "/t/ap_test_rpc_echo/1", (const uint8_t *)"hello", 5,
                               NULL, on_done, &c2) != 0);
    dial_res_t dummy = {.done = true};
    pair_wait_t w = {&dummy, &dummy, &left};
    assert_true(ap_host_run_until(h, all_done, &w, WAIT_US));
    if (!c1.ok) fail_msg("c1 %s", ap_err_name(c1.status));
    if (!c2.ok) fail_msg("c2 %s", ap_err_name(c2.status));
}

/* Each peer holds exactly one connection; then both nodes and the host go. */
static void one_connection_each_then_free(ap_host_t *h, ap_rt_t *a, ap_rt_t *b)
{
    ap_rt_stats_t sa, sb;
    ap_rt_get_stats(a, &sa);
    ap_rt_get_stats(b, &sb);
    assert_int_equal(sa.connections, 1);
    assert_int_equal(sb.connections, 1);
    ap_node_free(a);
    ap_node_free(b);
    assert_int_equal(ap_host_free(h), 0);
}

/* Deterministic: A is connected to B (A dialed). B then dials A's address
 * without a /p2p/ part: its mux cannot know it is A, so it dials; the
 * transport authenticates A, finds the existing connection from A and keeps
 * it (one per peer). That dial must succeed with A's id, on that one
 * connection. Both directions of the rule (B smaller or larger) run. */
static void test_dial_resolved_with_inbound(void **state)
{
    (void)state;
    for (int round = 0; round < 6; round++) {
        ap_host_t *h = ap_host_new();
        assert_non_null(h);
        ap_rt_t *a, *b;
        char a_id[AP_RT_ADDR_MAX], a_bare[AP_RT_ADDR_MAX], b_id[AP_RT_ADDR_MAX],
            b_bare[AP_RT_ADDR_MAX];
        new_node(h, &a, a_id, a_bare);
        new_node(h, &b, b_id, b_bare);
        /* even rounds: B has the smaller id (the transport replaces A's
         * connection by B's); odd rounds: B's dial loses and is resolved
         * with A's connection, which B's mux already owns */
        if ((ap_peer_id_cmp(self_id(b), self_id(a)) < 0) != (round % 2 == 0)) {
            ap_rt_t *t = a;
            a = b;
            b = t;
            char tmp[AP_RT_ADDR_MAX];
            strcpy(tmp, a_id);
            strcpy(a_id, b_id);
            strcpy(b_id, tmp);
            strcpy(tmp, a_bare);
            strcpy(a_bare, b_bare);
            strcpy(b_bare, tmp);
        }
        dial_res_t d1 = {0};
        assert_ok(ap_rt_dial(a, b_id, WAIT_US, on_dial, &d1));
        assert_true(ap_host_run_until(h, dial_done, &d1, WAIT_US));
        assert_ok(d1.status);
        /* B must see the connection before dialing back */
        two_t t1 = {a, b};
        assert_true(ap_host_run_until(h, settled, &t1, WAIT_US));
        dial_res_t d2 = {0};
        assert_ok(ap_rt_dial(b, a_bare, WAIT_US, on_dial, &d2));
        assert_true(ap_host_run_until(h, dial_done, &d2, WAIT_US));
        assert_ok(d2.status);
        assert_true(ap_peer_id_eq(&d2.peer, self_id(a)));
        /* the transport may have replaced A's connection by B's (the rule
         * keeps the one dialled by the smaller id): wait for one each */
        two_t t2 = {a, b};
        assert_true(ap_host_run_until(h, settled, &t2, WAIT_US));
        /* and the connection works both ways */
        echo_both_ways(h, a, b);
        one_connection_each_then_free(h, a, b);
    }
}

/* Both peers dial each other in the same loop turn, many rounds: every dial
 * succeeds (whichever connection survives), and the peers settle on one
 * connection each, over which calls then work. */
static void test_simultaneous_dials(void **state)
{
    (void)state;
    int rounds = ap_test_sanitized() ? 10 : 40;
    for (int round = 0; round < rounds; round++) {
        ap_host_t *h = ap_host_new();
        assert_non_null(h);
        ap_rt_t *a, *b;
        char a_id[AP_RT_ADDR_MAX], a_bare[AP_RT_ADDR_MAX], b_id[AP_RT_ADDR_MAX],
            b_bare[AP_RT_ADDR_MAX];
        new_node(h, &a, a_id, a_bare);
        new_node(h, &b, b_id, b_bare);
        dial_res_t da = {0}, db = {0};
        /* alternate which side starts first and whether the id is known */
        const char *to_b = round & 2 ? b_bare : b_id;
        const char *to_a = round & 4 ? a_bare : a_id;
        if (round & 1) {
            assert_ok(ap_rt_dial(a, to_b, WAIT_US, on_dial, &da));
            assert_ok(ap_rt_dial(b, to_a, WAIT_US, on_dial, &db));
        } else {
            assert_ok(ap_rt_dial(b, to_a, WAIT_US, on_dial, &db));
            assert_ok(ap_rt_dial(a, to_b, WAIT_US, on_dial, &da));
        }
        pair_wait_t w = {&da, &db, NULL};
        assert_true(ap_host_run_until(h, all_done, &w, WAIT_US));
        if (da.status || db.status)
            fail_msg("round %d: dials ended %s / %s", round, ap_err_name(da.status),
                     ap_err_name(db.status));
        assert_true(ap_peer_id_eq(&da.peer, self_id(b)));
        assert_true(ap_peer_id_eq(&db.peer, self_id(a)));
        /* settle: the losing duplicate is retired (GOAWAY) and closed */
        two_t t2 = {a, b};
        assert_true(ap_host_run_until(h, settled, &t2, WAIT_US));
        echo_both_ways(h, a, b);
        one_connection_each_then_free(h, a, b);
    }
}

/* ---- calls and streams in flight while the duplicate is retired ---------- */

typedef struct slow {
    ap_rt_t *rt;
    ap_rpc_req_t *req;
} slow_t;

static void slow_fire(ap_rt_t *rt, void *arg)
{
    (void)rt;
    slow_t *s = arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(s->req, &n);
    ap_rpc_respond(s->req, d, n);
    free(s);
}

/* Echo after 20 ms: the call is still running when GOAWAY arrives. */
static void slow_echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)arg;
    slow_t *s = malloc(sizeof *s);
    assert_non_null(s);
    s->rt = rt;
    s->req = req;
    assert_true(ap_rt_timer_start(rt, 20000, 0, slow_fire, s) != 0);
}

/* The stream ap_test_rpc_echo server obeys flow control as a user must: a message its
 * send window cannot take yet is held and the stream paused (so no further
 * on_msg runs) until on_writable; the end is passed on after it. Echoing
 * blindly fails with AP_EAGAIN whenever the client's credit comes back a
 * loop turn later than its next messages (a loaded machine). */
typedef struct echo_srv {
    uint8_t held[64];
    size_t nheld;
    bool holding, ended;
} echo_srv_t;

static void echo_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    echo_srv_t *e = arg;
    int rc = ap_stream_send(s, d, n);
    if (rc != AP_EAGAIN) {
        assert_ok(rc);
        return;
    }
    assert_true(n <= sizeof e->held && !e->holding);
    memcpy(e->held, d, n);
    e->nheld = n;
    e->holding = true;
    ap_stream_pause(s, true);
}

static void echo_writable(ap_stream_t *s, void *arg)
{
    echo_srv_t *e = arg;
    if (!e->holding) return;
    int rc = ap_stream_send(s, e->held, e->nheld);
    if (rc == AP_EAGAIN) return; /* on_writable comes again */
    assert_ok(rc);
    e->holding = false;
    if (e->ended)
        ap_stream_close(s);
    else
        ap_stream_pause(s, false);
}

static void echo_end(ap_stream_t *s, void *arg)
{
    echo_srv_t *e = arg;
    e->ended = true;
    if (!e->holding) ap_stream_close(s);
}

static void echo_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    (void)status;
    free(arg);
}

static const ap_stream_cbs_t echo_cbs = {
    .on_msg = echo_msg, .on_writable = echo_writable, .on_end = echo_end, .on_close = echo_close};

static int echo_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                       const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)arg;
    (void)peer;
    (void)hello;
    (void)len;
    echo_srv_t *e = calloc(1, sizeof *e);
    if (!e) return AP_ENOMEM;
    ap_stream_set_cbs(s, &echo_cbs, e);
    return 0;
}

#define NCALLS 8
#define NMSGS  20

typedef struct client {
    int got; /* echoed messages, in order */
    bool order_ok;
    bool closed;
    int status;
} client_t;

static void client_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    client_t *c = arg;
    if (n != 4 || (int)ap__get_be32(d) != c->got) c->order_ok = false;
    c->got++;
}

static void client_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    client_t *c = arg;
    c->closed = true;
    c->status = status;
}

static const ap_stream_cbs_t client_cbs = {.on_msg = client_msg, .on_close = client_close};

typedef struct flight {
    int left; /* calls */
    client_t cl[2];
} flight_t;

static bool flight_done(void *arg)
{
    flight_t *f = arg;
    return f->left == 0 && f->cl[0].closed && f->cl[1].closed;
}

static void flight_node(ap_host_t *h, bool tcp, ap_rt_t **rt, char *addr)
{
    ap_node_opts_t o = {.listen = tcp ? "/ip4/127.0.0.1/tcp/0" : NULL};
    assert_ok(ap_node_new(h, &o, rt));
    char a[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(*rt, a, 1, false), 1);
    strcpy(addr, a[0]);
    assert_ok(ap_rt_rpc_register(*rt, "/t/slow/1", 0, slow_echo, NULL));
    assert_ok(ap_rt_rpc_register(*rt, "/t/ap_test_rpc_echo/1", 0, ap_test_rpc_echo, NULL));
    ap_stream_opts_t so = {.window = 64};
    assert_ok(ap_rt_stream_listen(*rt, "/t/ap_test_rpc_echo-stream/1", &so, echo_accept, NULL));
}

static bool mux_settled(void *arg)
{
    two_t *t = arg;
    ap_rt_stats_t sa, sb;
    ap_rt_get_stats(t->a, &sa);
    ap_rt_get_stats(t->b, &sb);
    return sa.connections == 1 && sb.connections == 1;
}

/* Both peers know each other's address and, in the same loop turn, each
 * makes NCALLS slow calls and opens a stream that sends NMSGS messages
 * (window 64: the stream is still sending when the duplicate is found). The
 * two implicit dials cross; one connection goes away with its calls and
 * streams on it. Every call must succeed and every stream must end cleanly
 * with all its messages echoed in order; then the peers settle on one
 * connection and GOAWAY was sent (the test checks the race really
 * happened). */
static void run_calls_in_flight(bool tcp)
{
    int rounds = ap_test_sanitized() ? 6 : 20;
    uint64_t goaways = 0;
    for (int round = 0; round < rounds; round++) {
        ap_host_t *h = ap_host_new();
        assert_non_null(h);
        ap_rt_t *a, *b;
        char a_addr[AP_RT_ADDR_MAX], b_addr[AP_RT_ADDR_MAX];
        flight_node(h, tcp, &a, a_addr);
        flight_node(h, tcp, &b, b_addr);
        assert_ok(ap_rt_add_addr(a, self_id(b), b_addr));
        assert_ok(ap_rt_add_addr(b, self_id(a), a_addr));
        flight_t f = {.left = 2 * NCALLS};
        call_t calls[2 * NCALLS];
        ap_rt_t *sides[2] = {round & 1 ? a : b, round & 1 ? b : a};
        ap_stream_t *st[2];
        for (int k = 0; k < 2; k++) {
            ap_rt_t *from = sides[k], *to = sides[1 - k];
            f.cl[k].order_ok = true;
            ap_stream_opts_t so = {.window = 64};
            assert_ok(ap_rt_stream_open(from, self_id(to), "/t/ap_test_rpc_echo-stream/1", NULL, 0,
                                        &so, &client_cbs, &f.cl[k], &st[k]));
            for (int i = 0; i < NCALLS; i++) {
                call_t *c = &calls[k * NCALLS + i];
                *c = (call_t){.left = &f.left};
                assert_true(ap_rt_rpc_call(from, self_id(to), "/t/slow/1", (const uint8_t *)"hello",
                                           5, NULL, on_done, c) != 0);
            }
        }
        /* the streams send as their window allows */
        int sent[2] = {0, 0};
        uint64_t t0 = ap_rt_now_us(a);
        while (!flight_done(&f) && ap_rt_now_us(a) - t0 < WAIT_US) {
            for (int k = 0; k < 2; k++) {
                while (sent[k] < NMSGS) {
                    uint8_t m[4];
                    ap__put_be32(m, (uint32_t)sent[k]);
                    int rc = ap_stream_send(st[k], m, 4);
                    if (rc == AP_EAGAIN) break;
                    if (rc < 0) fail_msg("round %d: stream send %s", round, ap_err_name(rc));
                    if (++sent[k] == NMSGS) assert_ok(ap_stream_close(st[k]));
                }
            }
            ap_host_run_once(h, 1000);
        }
        assert_true(flight_done(&f));
        for (int i = 0; i < 2 * NCALLS; i++)
            if (!calls[i].ok)
                fail_msg("%s round %d: call %d ended %s", tcp ? "tcp" : "memory", round, i,
                         ap_err_name(calls[i].status));
        for (int k = 0; k < 2; k++) {
            if (f.cl[k].status != 0 || f.cl[k].got != NMSGS || !f.cl[k].order_ok)
                fail_msg("%s round %d: stream %d ended %s with %d/%d messages",
                         tcp ? "tcp" : "memory", round, k, ap_err_name(f.cl[k].status), f.cl[k].got,
                         NMSGS);
        }
        two_t t2 = {a, b};
        assert_true(ap_host_run_until(h, tcp ? settled : mux_settled, &t2, WAIT_US));
        ap_rt_stats_t sa, sb;
        ap_rt_get_stats(a, &sa);
        ap_rt_get_stats(b, &sb);
        goaways += sa.goaways + sb.goaways;
        assert_int_equal(sa.goaway_refused + sb.goaway_refused, 0);
        /* new calls run on the survivor */
        echo_both_ways(h, a, b);
        assert_true(mux_settled(&t2));
        ap_node_free(a);
        ap_node_free(b);
        assert_int_equal(ap_host_free(h), 0);
    }
    /* the dials crossed: duplicates were found and retired */
    assert_true(goaways >= (uint64_t)rounds);
}

static void test_calls_in_flight_tcp(void **state)
{
    (void)state;
    run_calls_in_flight(true);
}

static void test_calls_in_flight_memory(void **state)
{
    (void)state;
    run_calls_in_flight(false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dial_resolved_with_inbound),
        cmocka_unit_test(test_simultaneous_dials),
        cmocka_unit_test(test_calls_in_flight_tcp),
        cmocka_unit_test(test_calls_in_flight_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
