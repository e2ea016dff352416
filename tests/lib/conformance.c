/* Runtime conformance suite: see conformance.h. */
#include "aptest.h"
#include "conformance.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const ap_testbed_ops_t *T;

#define MS  1000ull
#define SEC (1000ull * 1000ull)

/* Generous bounds: with real time (uv) a loaded CI machine may be slow. */
#define LONG_WAIT (20 * SEC)

typedef struct {
    ap_testbed_t *tb;
} fixture_t;

static int setup2(void **state)
{
    fixture_t *f = calloc(1, sizeof *f);
    f->tb = T->create(2, ap_test_seed(42));
    if (!f->tb) return -1;
    *state = f;
    return 0;
}

static int setup3(void **state)
{
    fixture_t *f = calloc(1, sizeof *f);
    f->tb = T->create(3, ap_test_seed(43));
    if (!f->tb) return -1;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    T->destroy(f->tb);
    free(f);
    return 0;
}

static bool flag_set(void *arg)
{
    return *(volatile bool *)arg;
}
static bool ptr_set(void *arg)
{
    return *(void *volatile *)arg != NULL;
}

#define RUN_UNTIL_FLAG(tb, flag) T->run_until(tb, flag_set, &(flag), LONG_WAIT)

/* ---- timers -------------------------------------------------------------- */

typedef struct {
    int order[16];
    int n;
    uint64_t ids[8];
    int periodic_fires;
    ap_rt_t *rt;
    uint64_t t0;
    uint64_t fired_at[16];
} timer_ctx_t;

typedef struct {
    timer_ctx_t *ctx;
    int tag;
} timer_arg_t;

static void on_timer(ap_rt_t *rt, void *arg)
{
    timer_arg_t *a = arg;
    a->ctx->fired_at[a->ctx->n] = ap_rt_now_us(rt) - a->ctx->t0;
    a->ctx->order[a->ctx->n++] = a->tag;
}

static void on_periodic(ap_rt_t *rt, void *arg)
{
    timer_ctx_t *c = arg;
    if (++c->periodic_fires == 3) assert_true(ap_rt_timer_stop(rt, c->ids[7]));
}

static bool timers_done(void *arg)
{
    const timer_ctx_t *c = arg;
    return c->n >= 4 && c->periodic_fires >= 3;
}

/* Waits for the events themselves, not for an amount of time: on a loaded
 * machine a loop turn can come tens of ms late, and a wall-clock budget
 * would then see fewer periodic fires than the timer really makes. */
static void test_timer_order(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *rt = T->node(f->tb, 0);
    timer_ctx_t c = {.rt = rt, .t0 = ap_rt_now_us(rt)};
    timer_arg_t a[5] = {{&c, 30}, {&c, 10}, {&c, 20}, {&c, 11}, {&c, 99}};
    uint64_t d[5] = {30 * MS, 10 * MS, 20 * MS, 10 * MS, 15 * MS};
    for (int i = 0; i < 5; i++) {
        c.ids[i] = ap_rt_timer_start(rt, d[i], 0, on_timer, &a[i]);
        assert_true(c.ids[i] != 0);
    }
    assert_true(ap_rt_timer_stop(rt, c.ids[4])); /* the 15 ms one never fires */
    c.ids[7] = ap_rt_timer_start(rt, 5 * MS, 5 * MS, on_periodic, &c);
    assert_true(T->run_until(f->tb, timers_done, &c, 30000 * MS));
    T->run_until(f->tb, NULL, NULL, 40 * MS); /* let anything wrong fire */
    assert_int_equal(c.n, 4);
    assert_int_equal(c.order[0], 10);
    assert_int_equal(c.order[1], 11); /* same due time: start order */
    assert_int_equal(c.order[2], 20);
    assert_int_equal(c.order[3], 30);
    /* never early */
    assert_true(c.fired_at[0] >= 10 * MS);
    assert_true(c.fired_at[2] >= 20 * MS);
    assert_true(c.fired_at[3] >= 30 * MS);
    assert_int_equal(c.periodic_fires, 3);        /* stopped from inside its own callback */
    assert_false(ap_rt_timer_stop(rt, c.ids[0])); /* already fired: no-op */
    assert_false(ap_rt_timer_stop(rt, c.ids[7]));
    assert_false(ap_rt_timer_stop(rt, 0));
}

/* ---- post and work ------------------------------------------------------- */

typedef struct {
    int seq[8];
    int n;
    bool work_ran;
    int after_status;
    bool after_ran;
} pw_ctx_t;

static pw_ctx_t *g_pw;
static void post_fn(ap_rt_t *rt, void *arg)
{
    (void)rt;
    g_pw->seq[g_pw->n++] = (int)(intptr_t)arg;
}

static void work_fn(void *arg)
{
    pw_ctx_t *c = arg;
    c->work_ran = true;
}

static void after_fn(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    pw_ctx_t *c = arg;
    c->after_status = status;
    c->after_ran = true;
}

static void test_post_and_work(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *rt = T->node(f->tb, 0);
    pw_ctx_t c = {0};
    g_pw = &c;
    for (intptr_t i = 1; i <= 5; i++) assert_ok(ap_rt_post(rt, post_fn, (void *)i));
    assert_int_equal(c.n, 0); /* never run inside ap_rt_post */
    assert_ok(ap_rt_work(rt, 1e6, work_fn, after_fn, &c));
    assert_false(c.after_ran);
    assert_true(RUN_UNTIL_FLAG(f->tb, c.after_ran));
    if (c.n < 5) T->run_until(f->tb, NULL, NULL, 10 * MS);
    assert_int_equal(c.n, 5);
    for (int i = 0; i < 5; i++) assert_int_equal(c.seq[i], i + 1);
    assert_true(c.work_ran);
    assert_int_equal(c.after_status, 0);
}

/* ---- RPC ----------------------------------------------------------------- */

typedef struct {
    bool done;
    int status;
    uint8_t resp[256];
    size_t len;
    char errmsg[128];
    int calls;
    ap_rpc_req_t *held; /* a request the handler did not answer yet */
    ap_peer_id_t req_peer;
    uint64_t started_us, done_us;
    ap_rt_t *caller;
} rpc_ctx_t;

static void rpc_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                     const char *errmsg)
{
    rpc_ctx_t *c = arg;
    c->calls++;
    c->done = true;
    c->status = status;
    c->done_us = ap_rt_now_us(rt);
    c->len = len < sizeof c->resp ? len : sizeof c->resp;
    if (resp && c->len) memcpy(c->resp, resp, c->len);
    snprintf(c->errmsg, sizeof c->errmsg, "%s", errmsg ? errmsg : "");
}

static void echo_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    rpc_ctx_t *c = arg;
    c->req_peer = *ap_rpc_req_peer(req);
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    uint8_t out[300];
    out[0] = 'E';
    memcpy(out + 1, d, n < 256 ? n : 256);
    ap_rpc_respond(req, out, (n < 256 ? n : 256) + 1);
}

static void hold_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    rpc_ctx_t *c = arg;
    c->held = req;
}

static void error_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    ap_rpc_respond_error(req, AP_ENOTFOUND, "no such thing");
}

static void test_rpc_echo(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    rpc_ctx_t srv = {0}, cli = {0};
    assert_ok(ap_rt_rpc_register(b, "/test/echo/1", 0, echo_handler, &srv));
    assert_int_equal(ap_rt_rpc_register(b, "/test/echo/1", 0, echo_handler, &srv), AP_EEXIST);
    assert_int_equal(ap_rt_rpc_register(b, "no-slash", 0, echo_handler, &srv), AP_EINVAL);
    uint64_t id = ap_rt_rpc_call(a, ap_rt_self(b), "/test/echo/1", (const uint8_t *)"hi", 2, NULL,
                                 rpc_done, &cli);
    assert_true(id != 0);
    assert_false(cli.done); /* never completes inside the call */
    assert_true(RUN_UNTIL_FLAG(f->tb, cli.done));
    assert_int_equal(cli.status, 0);
    assert_int_equal(cli.len, 3);
    assert_memory_equal(cli.resp, "Ehi", 3);
    assert_true(ap_peer_id_eq(&srv.req_peer, ap_rt_self(a)));
    assert_false(ap_rt_rpc_cancel(a, id)); /* completed: no-op */
    T->run_until(f->tb, NULL, NULL, 10 * MS);
    assert_int_equal(cli.calls, 1);

    /* many calls in flight at once, each answered once */
    enum { N = 50 };
    rpc_ctx_t many[N];
    memset(many, 0, sizeof many);
    for (int i = 0; i < N; i++) {
        uint8_t msg[4] = {(uint8_t)i, 1, 2, 3};
        assert_true(ap_rt_rpc_call(a, ap_rt_self(b), "/test/echo/1", msg, sizeof msg, NULL,
                                   rpc_done, &many[i]) != 0);
    }
    for (int i = 0; i < N; i++) {
        assert_true(RUN_UNTIL_FLAG(f->tb, many[i].done));
        assert_int_equal(many[i].status, 0);
        assert_int_equal(many[i].resp[1], i);
    }

    /* empty request and response */
    rpc_ctx_t e = {0};
    assert_true(ap_rt_rpc_call(a, ap_rt_self(b), "/test/echo/1", NULL, 0, NULL, rpc_done, &e));
    assert_true(RUN_UNTIL_FLAG(f->tb, e.done));
    assert_int_equal(e.status, 0);
    assert_int_equal(e.len, 1);
}

/* A response built in place (ap_rpc_respond_begin / _commit); a request
 * starting with 'x' drops its begun buffer for an error. */
static void built_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    bool drop = n && d[0] == 'x';
    uint8_t *out = ap_rpc_respond_begin(req, n + 1);
    if (!out) return;
    out[0] = 'B';
    memcpy(out + 1, d, n); /* the request is still valid while building */
    if (drop)
        ap_rpc_respond_error(req, AP_ENOTFOUND, "dropped");
    else
        ap_rpc_respond_commit(req);
}

static void test_rpc_built_response(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    assert_ok(ap_rt_rpc_register(b, "/test/built/1", 0, built_handler, NULL));
    rpc_ctx_t ok = {0}, err = {0}, empty = {0};
    assert_true(ap_rt_rpc_call(a, ap_rt_self(b), "/test/built/1", (const uint8_t *)"hey", 3, NULL,
                               rpc_done, &ok));
    assert_true(ap_rt_rpc_call(a, ap_rt_self(b), "/test/built/1", (const uint8_t *)"xy", 2, NULL,
                               rpc_done, &err));
    assert_true(ap_rt_rpc_call(a, ap_rt_self(b), "/test/built/1", NULL, 0, NULL, rpc_done, &empty));
    assert_true(RUN_UNTIL_FLAG(f->tb, ok.done));
    assert_true(RUN_UNTIL_FLAG(f->tb, err.done));
    assert_true(RUN_UNTIL_FLAG(f->tb, empty.done));
    assert_int_equal(ok.status, 0);
    assert_int_equal(ok.len, 4);
    assert_memory_equal(ok.resp, "Bhey", 4);
    assert_int_equal(err.status, AP_ENOTFOUND);
    assert_string_equal(err.errmsg, "dropped");
    assert_int_equal(empty.status, 0);
    assert_int_equal(empty.len, 1);
}

static void test_rpc_errors(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    rpc_ctx_t srv = {0};
    assert_ok(ap_rt_rpc_register(b, "/test/err/1", 0, error_handler, &srv));
    assert_ok(ap_rt_rpc_register(b, "/test/small/1", 16, echo_handler, &srv));

    rpc_ctx_t c1 = {0}, c2 = {0}, c3 = {0}, c4 = {0};
    ap_rt_rpc_call(a, ap_rt_self(b), "/test/err/1", (const uint8_t *)"x", 1, NULL, rpc_done, &c1);
    assert_true(RUN_UNTIL_FLAG(f->tb, c1.done));
    assert_int_equal(c1.status, AP_ENOTFOUND);
    assert_string_equal(c1.errmsg, "no such thing");

    ap_rt_rpc_call(a, ap_rt_self(b), "/test/none/1", (const uint8_t *)"x", 1, NULL, rpc_done, &c2);
    assert_true(RUN_UNTIL_FLAG(f->tb, c2.done));
    assert_int_equal(c2.status, AP_ENOPROTO);

    uint8_t big[64] = {0};
    ap_rt_rpc_call(a, ap_rt_self(b), "/test/small/1", big, sizeof big, NULL, rpc_done, &c3);
    assert_true(RUN_UNTIL_FLAG(f->tb, c3.done));
    assert_int_equal(c3.status, AP_EMSGSIZE);

    /* response larger than the caller's cap */
    ap_rpc_opts_t o = {.max_resp = 4};
    ap_rt_rpc_call(a, ap_rt_self(b), "/test/small/1", big, 10, &o, rpc_done, &c4);
    assert_true(RUN_UNTIL_FLAG(f->tb, c4.done));
    assert_int_equal(c4.status, AP_EMSGSIZE);

    /* the handler is unregistered: now ENOPROTO */
    ap_rt_rpc_unregister(b, "/test/err/1");
    rpc_ctx_t c5 = {0};
    ap_rt_rpc_call(a, ap_rt_self(b), "/test/err/1", NULL, 0, NULL, rpc_done, &c5);
    assert_true(RUN_UNTIL_FLAG(f->tb, c5.done));
    assert_int_equal(c5.status, AP_ENOPROTO);
}

static void test_rpc_deadline(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    rpc_ctx_t srv = {0}, cli = {0};
    assert_ok(ap_rt_rpc_register(b, "/test/hold/1", 0, hold_handler, &srv));
    /* warm the connection so the deadline measures the call only */
    rpc_ctx_t warm = {0};
    assert_ok(ap_rt_rpc_register(b, "/test/echo/1", 0, echo_handler, &warm));
    ap_rt_rpc_call(a, ap_rt_self(b), "/test/echo/1", NULL, 0, NULL, rpc_done, &warm);
    assert_true(RUN_UNTIL_FLAG(f->tb, warm.done));

    ap_rpc_opts_t o = {.timeout_us = 200 * MS};
    cli.started_us = ap_rt_now_us(a);
    ap_rt_rpc_call(a, ap_rt_self(b), "/test/hold/1", (const uint8_t *)"q", 1, &o, rpc_done, &cli);
    assert_true(RUN_UNTIL_FLAG(f->tb, cli.done));
    assert_int_equal(cli.status, AP_ETIMEDOUT);
    assert_true(cli.done_us - cli.started_us >= 200 * MS);
    assert_true(cli.done_us - cli.started_us < (T->virtual_time ? 201 * MS : 10 * SEC));
    /* The handler answers late: dropped silently, no second completion. */
    assert_non_null(srv.held);
    ap_rpc_respond(srv.held, (const uint8_t *)"late", 4);
    srv.held = NULL;
    T->run_until(f->tb, NULL, NULL, 50 * MS);
    assert_int_equal(cli.calls, 1);
}

static void test_rpc_cancel(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    rpc_ctx_t srv = {0}, cli = {0}, cli2 = {0};
    assert_ok(ap_rt_rpc_register(b, "/test/hold/1", 0, hold_handler, &srv));
    /* cancel before anything was sent */
    uint64_t id = ap_rt_rpc_call(a, ap_rt_self(b), "/test/hold/1", NULL, 0, NULL, rpc_done, &cli);
    assert_true(ap_rt_rpc_cancel(a, id));
    assert_true(cli.done); /* done ran inside cancel */
    assert_int_equal(cli.status, AP_ECANCELED);
    assert_false(ap_rt_rpc_cancel(a, id));
    /* cancel while the server holds it */
    uint64_t id2 = ap_rt_rpc_call(a, ap_rt_self(b), "/test/hold/1", NULL, 0, NULL, rpc_done, &cli2);
    assert_true(T->run_until(f->tb, ptr_set, &srv.held, LONG_WAIT));
    assert_true(ap_rt_rpc_cancel(a, id2));
    assert_int_equal(cli2.status, AP_ECANCELED);
    ap_rpc_respond(srv.held, (const uint8_t *)"x", 1);
    T->run_until(f->tb, NULL, NULL, 50 * MS);
    assert_int_equal(cli.calls, 1);
    assert_int_equal(cli2.calls, 1);
}

/* ---- peer crash mid-call, restart, peer events ---------------------------- */

typedef struct {
    int connected, disconnected;
    ap_peer_id_t last;
} watch_ctx_t;

static void on_peer(ap_rt_t *rt, void *arg, const ap_peer_id_t *peer, ap_peer_event_t ev)
{
    (void)rt;
    watch_ctx_t *w = arg;
    if (ev == AP_PEER_CONNECTED) w->connected++;
    if (ev == AP_PEER_DISCONNECTED) w->disconnected++;
    w->last = *peer;
}

static void test_peer_crash_mid_call(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    ap_peer_id_t bid = *ap_rt_self(b);
    rpc_ctx_t srv = {0}, cli = {0};
    watch_ctx_t wa = {0}, wb = {0};
    assert_true(ap_rt_peer_watch(a, on_peer, &wa) != 0);
    assert_true(ap_rt_peer_watch(b, on_peer, &wb) != 0);
    assert_ok(ap_rt_rpc_register(b, "/test/hold/1", 0, hold_handler, &srv));
    ap_rpc_opts_t o = {.timeout_us = 60 * SEC};
    ap_rt_rpc_call(a, &bid, "/test/hold/1", NULL, 0, &o, rpc_done, &cli);
    assert_true(T->run_until(f->tb, ptr_set, &srv.held, LONG_WAIT));
    assert_true(wa.connected >= 1);
    assert_true(ap_peer_id_eq(&wa.last, &bid));
    assert_true(wb.connected >= 1);
    assert_true(ap_rt_is_connected(a, &bid));
    T->crash(f->tb, 1); /* srv.held is gone with the node */
    assert_null(T->node(f->tb, 1));
    assert_true(RUN_UNTIL_FLAG(f->tb, cli.done));
    assert_int_equal(cli.status, AP_ECLOSED);
    assert_true(wa.disconnected >= 1);
    assert_false(ap_rt_is_connected(a, &bid));

    /* a call to the crashed peer fails (unreachable, or timed out) */
    rpc_ctx_t dead = {0};
    ap_rpc_opts_t so = {.timeout_us = 500 * MS};
    ap_rt_rpc_call(a, &bid, "/test/hold/1", NULL, 0, &so, rpc_done, &dead);
    assert_true(RUN_UNTIL_FLAG(f->tb, dead.done));
    assert_true(dead.status == AP_EUNREACH || dead.status == AP_ETIMEDOUT);

    /* restart: same identity, fresh state (no handler until registered) */
    T->restart(f->tb, 1);
    b = T->node(f->tb, 1);
    assert_non_null(b);
    assert_true(ap_peer_id_eq(ap_rt_self(b), &bid));
    rpc_ctx_t none = {0};
    ap_rt_rpc_call(a, &bid, "/test/echo/1", NULL, 0, NULL, rpc_done, &none);
    assert_true(RUN_UNTIL_FLAG(f->tb, none.done));
    assert_int_equal(none.status, AP_ENOPROTO);
    rpc_ctx_t srv2 = {0}, ok = {0};
    assert_ok(ap_rt_rpc_register(b, "/test/echo/1", 0, echo_handler, &srv2));
    ap_rt_rpc_call(a, &bid, "/test/echo/1", (const uint8_t *)"z", 1, NULL, rpc_done, &ok);
    assert_true(RUN_UNTIL_FLAG(f->tb, ok.done));
    assert_int_equal(ok.status, 0);
    assert_memory_equal(ok.resp, "Ez", 2);
}

/* ---- streams ------------------------------------------------------------- */

typedef struct {
    ap_stream_t *s;
    int received;
    uint32_t next_expected;
    bool order_ok;
    bool ended, closed;
    int close_status;
    int writable;
    size_t bytes;
    bool pause_on_accept;
    bool refuse;
    bool echo_close; /* close our side when the peer ends */
    ap_peer_id_t peer;
    size_t max_buffered;
} st_ctx_t;

static void st_on_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    st_ctx_t *c = arg;
    if (n < 4) {
        c->order_ok = false;
        return;
    }
    uint32_t seq = (uint32_t)d[0] << 24 | (uint32_t)d[1] << 16 | (uint32_t)d[2] << 8 | d[3];
    if (seq != c->next_expected) c->order_ok = false;
    /* payload bytes are a function of seq and position */
    for (size_t i = 4; i < n; i++)
        if (d[i] != (uint8_t)(seq * 7 + i)) c->order_ok = false;
    c->next_expected++;
    c->received++;
    c->bytes += n;
}

static void st_on_writable(ap_stream_t *s, void *arg)
{
    (void)s;
    st_ctx_t *c = arg;
    c->writable++;
}

static void st_on_end(ap_stream_t *s, void *arg)
{
    st_ctx_t *c = arg;
    c->ended = true;
    if (c->echo_close) ap_stream_close(s);
}

static void st_on_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    st_ctx_t *c = arg;
    if (c->closed) c->order_ok = false; /* twice: contract broken */
    c->closed = true;
    c->close_status = status;
    c->s = NULL;
}

static const ap_stream_cbs_t st_cbs = {.on_msg = st_on_msg,
                                       .on_writable = st_on_writable,
                                       .on_end = st_on_end,
                                       .on_close = st_on_close};

static int st_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt;
    st_ctx_t *c = arg;
    if (c->refuse) return AP_EPERM;
    c->s = s;
    c->peer = *peer;
    if (len != 5 || memcmp(hello, "hello", 5) != 0) c->order_ok = false;
    ap_stream_set_cbs(s, &st_cbs, c);
    if (c->pause_on_accept) ap_stream_pause(s, true);
    return 0;
}

static size_t msg_len(uint32_t seq)
{
    return 4 + (seq * 37) % 3000;
}

static int send_seq(ap_stream_t *s, uint32_t seq)
{
    uint8_t buf[4 + 3000];
    size_t n = msg_len(seq);
    buf[0] = (uint8_t)(seq >> 24);
    buf[1] = (uint8_t)(seq >> 16);
    buf[2] = (uint8_t)(seq >> 8);
    buf[3] = (uint8_t)seq;
    for (size_t i = 4; i < n; i++) buf[i] = (uint8_t)(seq * 7 + i);
    return ap_stream_send(s, buf, n);
}

static bool st_closed_both(void *arg)
{
    st_ctx_t **p = arg;
    return p[0]->closed && p[1]->closed;
}

static void test_stream_order(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    st_ctx_t srv = {.order_ok = true, .echo_close = true}, cli = {.order_ok = true};
    assert_ok(ap_rt_stream_listen(b, "/test/stream/1", NULL, st_accept, &srv));
    ap_stream_opts_t o = {.window = 1 << 20};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/test/stream/1", (const uint8_t *)"hello", 5, &o,
                                &st_cbs, &cli, &cli.s));
    assert_non_null(cli.s);
    assert_true(ap_peer_id_eq(ap_stream_peer(cli.s), ap_rt_self(b)));
    /* queue before the stream is established: allowed */
    const uint32_t total = 500;
    uint32_t sent = 0;
    while (sent < total) {
        int rc = send_seq(cli.s, sent);
        if (rc == AP_EAGAIN) {
            assert_true(ap_stream_buffered(cli.s) <= ap_stream_window(cli.s));
            T->run_until(f->tb, NULL, NULL, 2 * MS);
            continue;
        }
        assert_ok(rc);
        sent++;
    }
    assert_ok(ap_stream_close(cli.s));
    st_ctx_t *both[2] = {&srv, &cli};
    assert_true(T->run_until(f->tb, st_closed_both, both, LONG_WAIT));
    assert_true(srv.order_ok);
    assert_int_equal(srv.received, (int)total);
    assert_true(srv.ended);
    assert_true(ap_peer_id_eq(&srv.peer, ap_rt_self(a)));
    assert_int_equal(srv.close_status, 0);
    assert_int_equal(cli.close_status, 0);
    assert_true(cli.order_ok);
}

static void test_stream_flow_control(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    st_ctx_t srv = {.order_ok = true, .pause_on_accept = true, .echo_close = true};
    st_ctx_t cli = {.order_ok = true};
    assert_ok(ap_rt_stream_listen(b, "/test/flow/1", NULL, st_accept, &srv));
    ap_stream_opts_t o = {.window = 64 * 1024};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/test/flow/1", (const uint8_t *)"hello", 5, &o,
                                &st_cbs, &cli, &cli.s));
    /* The receiver is paused: the sender must hit EAGAIN with bounded buffer. */
    uint32_t sent = 0;
    int eagain = 0;
    for (int round = 0; round < 200 && eagain < 5; round++) {
        int rc = send_seq(cli.s, sent);
        if (rc == AP_EAGAIN) {
            eagain++;
            T->run_until(f->tb, NULL, NULL, 10 * MS);
            continue;
        }
        assert_ok(rc);
        sent++;
        assert_true(ap_stream_buffered(cli.s) <= 64 * 1024);
    }
    assert_true(eagain >= 5);
    assert_true(sent < 200);           /* bounded by the window, not by the loop */
    assert_int_equal(srv.received, 0); /* paused: nothing delivered */
    /* resume: everything arrives in order and on_writable fires */
    int writable_before = cli.writable;
    ap_stream_pause(srv.s, false);
    for (int i = 0; i < 2000 && srv.received < (int)sent; i++)
        T->run_until(f->tb, NULL, NULL, 5 * MS);
    assert_int_equal(srv.received, (int)sent);
    assert_true(srv.order_ok);
    for (int i = 0; i < 200 && cli.writable == writable_before; i++)
        T->run_until(f->tb, NULL, NULL, 5 * MS);
    assert_true(cli.writable > writable_before);
    ap_stream_close(cli.s);
    st_ctx_t *both[2] = {&srv, &cli};
    assert_true(T->run_until(f->tb, st_closed_both, both, LONG_WAIT));
}

static void test_stream_refuse_and_reset(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    st_ctx_t srv = {.order_ok = true, .refuse = true}, cli = {.order_ok = true};
    assert_ok(ap_rt_stream_listen(b, "/test/refuse/1", NULL, st_accept, &srv));
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/test/refuse/1", (const uint8_t *)"hello", 5,
                                NULL, &st_cbs, &cli, &cli.s));
    assert_true(RUN_UNTIL_FLAG(f->tb, cli.closed));
    assert_int_equal(cli.close_status, AP_ERESET);

    /* no listener at all */
    st_ctx_t cli2 = {.order_ok = true};
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/test/nobody/1", NULL, 0, NULL, &st_cbs, &cli2,
                                &cli2.s));
    assert_true(RUN_UNTIL_FLAG(f->tb, cli2.closed));
    assert_true(cli2.close_status == AP_ERESET || cli2.close_status == AP_ENOPROTO);

    /* reset by the acceptor mid-stream: both sides closed with errors */
    st_ctx_t srv3 = {.order_ok = true}, cli3 = {.order_ok = true};
    assert_ok(ap_rt_stream_listen(b, "/test/reset/1", NULL, st_accept, &srv3));
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/test/reset/1", (const uint8_t *)"hello", 5,
                                NULL, &st_cbs, &cli3, &cli3.s));
    assert_ok(send_seq(cli3.s, 0));
    for (int i = 0; i < 2000 && srv3.received < 1; i++) T->run_until(f->tb, NULL, NULL, 5 * MS);
    assert_int_equal(srv3.received, 1);
    ap_stream_reset(srv3.s, AP_ECANCELED);
    assert_true(srv3.closed); /* the resetting side closes at once or soon */
    assert_true(RUN_UNTIL_FLAG(f->tb, cli3.closed));
    assert_int_equal(cli3.close_status, AP_ERESET);
}

static void test_stream_peer_crash(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    st_ctx_t srv = {.order_ok = true}, cli = {.order_ok = true};
    assert_ok(ap_rt_stream_listen(b, "/test/crash/1", NULL, st_accept, &srv));
    assert_ok(ap_rt_stream_open(a, ap_rt_self(b), "/test/crash/1", (const uint8_t *)"hello", 5,
                                NULL, &st_cbs, &cli, &cli.s));
    assert_ok(send_seq(cli.s, 0));
    for (int i = 0; i < 2000 && srv.received < 1; i++) T->run_until(f->tb, NULL, NULL, 5 * MS);
    assert_int_equal(srv.received, 1);
    T->crash(f->tb, 1);
    assert_true(RUN_UNTIL_FLAG(f->tb, cli.closed));
    assert_int_equal(cli.close_status, AP_ECLOSED);
}

/* ---- gather send (ap_stream_sendv) ---------------------------------------- */

/* Message k of a sendv test: gv_len(k) bytes, byte i = gv_byte(k, i). Some
 * are empty, some span several transport frames. */
static size_t gv_len(uint32_t k)
{
    if (k % 17 == 5) return 0;
    if (k % 23 == 0) return 70000 + k;
    return 1 + (k * 53) % 5000;
}

static uint8_t gv_byte(uint32_t k, size_t i)
{
    return (uint8_t)(k * 31 + i * 7 + (i >> 8));
}

typedef struct {
    ap_stream_t *s;
    uint32_t base; /* index of the first message */
    uint32_t received;
    bool ok, ended, closed, paused;
    int close_status;
    int writable;
} gv_ctx_t;

static void gv_on_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    gv_ctx_t *c = arg;
    uint32_t k = c->base + c->received++;
    if (n != gv_len(k)) {
        c->ok = false;
        return;
    }
    for (size_t i = 0; i < n; i++)
        if (d[i] != gv_byte(k, i)) {
            c->ok = false;
            return;
        }
}

static void gv_on_writable(ap_stream_t *s, void *arg)
{
    (void)s;
    ((gv_ctx_t *)arg)->writable++;
}

static void gv_on_end(ap_stream_t *s, void *arg)
{
    gv_ctx_t *c = arg;
    c->ended = true;
    ap_stream_close(s);
}

static void gv_on_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    gv_ctx_t *c = arg;
    if (c->closed) c->ok = false;
    c->closed = true;
    c->close_status = status;
    c->s = NULL;
}

static const ap_stream_cbs_t gv_cbs = {.on_msg = gv_on_msg,
                                       .on_writable = gv_on_writable,
                                       .on_end = gv_on_end,
                                       .on_close = gv_on_close};

static int gv_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt, (void)peer, (void)hello, (void)len;
    gv_ctx_t *c = arg;
    c->s = s;
    ap_stream_set_cbs(s, &gv_cbs, c);
    if (c->paused) ap_stream_pause(s, true);
    return 0;
}

static bool gv_closed_both(void *arg)
{
    gv_ctx_t **p = arg;
    return p[0]->closed && p[1]->closed;
}

/* Sends message k cut into pieces that depend on k: 0 to 6 pieces, some of
 * length 0 (with and without a base), cuts anywhere (also inside what the
 * receiver reads first). buf holds at least gv_len(k) bytes. */
static int gv_send(ap_stream_t *s, uint32_t k, uint8_t *buf)
{
    size_t n = gv_len(k);
    for (size_t i = 0; i < n; i++) buf[i] = gv_byte(k, i);
    ap_iovec_t iov[8];
    int cnt = 0;
    if (n == 0 && k % 2) return ap_stream_sendv(s, NULL, 0); /* no pieces at all */
    int pieces = 1 + (int)(k % 6);
    size_t at = 0;
    for (int p = 0; p < pieces; p++) {
        size_t left = n - at;
        size_t take = p == pieces - 1 ? left : (left * (size_t)(p + 1 + k % 3)) / 7;
        if ((k + (uint32_t)p) % 5 == 0) take = 0; /* an empty piece in the middle */
        if (p == pieces - 1) take = left;
        iov[cnt].base = take || (k + (uint32_t)p) % 2 ? buf + at : NULL;
        iov[cnt].len = take;
        cnt++;
        at += take;
    }
    return ap_stream_sendv(s, iov, cnt);
}

/* Messages sent with ap_stream_sendv arrive whole, in order, interleaved
 * with ap_stream_send; empty pieces and empty messages are fine. */
static void test_stream_sendv_order(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    gv_ctx_t srv = {.ok = true}, cli = {.ok = true};
    assert_ok(ap_rt_stream_listen(b, "/test/sendv/1", NULL, gv_accept, &srv));
    ap_stream_opts_t o = {.window = 256 * 1024};
    assert_ok(
        ap_rt_stream_open(a, ap_rt_self(b), "/test/sendv/1", NULL, 0, &o, &gv_cbs, &cli, &cli.s));
    uint8_t *buf = malloc(80000);
    assert_non_null(buf);
    const uint32_t total = 300;
    uint32_t sent = 0;
    while (sent < total) {
        int rc;
        if (sent % 7 == 3) { /* plain send in between */
            size_t n = gv_len(sent);
            for (size_t i = 0; i < n; i++) buf[i] = gv_byte(sent, i);
            rc = ap_stream_send(cli.s, buf, n);
        } else {
            rc = gv_send(cli.s, sent, buf);
        }
        if (rc == AP_EAGAIN) {
            assert_true(ap_stream_buffered(cli.s) <= ap_stream_window(cli.s));
            T->run_until(f->tb, NULL, NULL, 2 * MS);
            continue;
        }
        assert_ok(rc);
        sent++;
    }
    free(buf);
    assert_ok(ap_stream_close(cli.s));
    gv_ctx_t *both[2] = {&srv, &cli};
    assert_true(T->run_until(f->tb, gv_closed_both, both, LONG_WAIT));
    assert_true(srv.ok);
    assert_int_equal(srv.received, total);
    assert_true(srv.ended);
    assert_int_equal(srv.close_status, 0);
    assert_int_equal(cli.close_status, 0);
    assert_true(cli.ok);
}

/* The window applies to a gather's total exactly as to ap_stream_send: a
 * refused sendv copies nothing and on_writable follows; bad arguments are
 * refused before anything is queued. */
static void test_stream_sendv_window(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    gv_ctx_t srv = {.ok = true, .paused = true, .base = 24}, cli = {.ok = true};
    assert_ok(ap_rt_stream_listen(b, "/test/sendvw/1", NULL, gv_accept, &srv));
    const size_t W = 64 * 1024;
    ap_stream_opts_t o = {.window = W};
    assert_ok(
        ap_rt_stream_open(a, ap_rt_self(b), "/test/sendvw/1", NULL, 0, &o, &gv_cbs, &cli, &cli.s));
    uint8_t *buf = malloc(80000);
    assert_non_null(buf);

    /* bad arguments: refused, nothing queued */
    uint8_t one = 1;
    ap_iovec_t bad_base[2] = {{&one, 1}, {NULL, 3}};
    ap_iovec_t huge[2] = {{&one, SIZE_MAX / 2 + 1}, {&one, SIZE_MAX / 2 + 1}};
    ap_iovec_t many[AP_STREAM_IOV_MAX + 1];
    for (int i = 0; i <= AP_STREAM_IOV_MAX; i++) many[i] = (ap_iovec_t){&one, 0};
    assert_int_equal(ap_stream_sendv(cli.s, bad_base, -1), AP_EINVAL);
    assert_int_equal(ap_stream_sendv(cli.s, NULL, 1), AP_EINVAL);
    assert_int_equal(ap_stream_sendv(cli.s, bad_base, 2), AP_EINVAL);
    assert_int_equal(ap_stream_sendv(cli.s, many, AP_STREAM_IOV_MAX + 1), AP_EINVAL);
    assert_int_equal(ap_stream_sendv(cli.s, huge, 2), AP_EMSGSIZE);
    assert_int_equal(ap_stream_buffered(cli.s), 0);

    /* the receiver is paused: sendv hits AP_EAGAIN with a bounded buffer */
    uint32_t k = srv.base, sent = 0;
    int eagain = 0;
    for (int round = 0; round < 400 && eagain < 5; round++) {
        size_t before = ap_stream_buffered(cli.s);
        int rc = gv_send(cli.s, k, buf);
        if (rc == AP_EAGAIN) {
            eagain++;
            assert_int_equal(ap_stream_buffered(cli.s), before); /* nothing copied */
            assert_true(before > 0 && before + gv_len(k) > W);
            T->run_until(f->tb, NULL, NULL, 10 * MS);
            continue;
        }
        assert_ok(rc);
        assert_true(ap_stream_buffered(cli.s) <= W);
        k++, sent++;
    }
    assert_true(eagain >= 5);
    assert_true(sent > 3 && sent < 400);
    assert_int_equal(srv.received, 0);
    /* resume: everything arrives whole and in order, on_writable fires */
    int writable_before = cli.writable;
    ap_stream_pause(srv.s, false);
    for (int i = 0; i < 2000 && srv.received < sent; i++) T->run_until(f->tb, NULL, NULL, 5 * MS);
    assert_int_equal(srv.received, sent);
    assert_true(srv.ok);
    for (int i = 0; i < 200 && cli.writable == writable_before; i++)
        T->run_until(f->tb, NULL, NULL, 5 * MS);
    assert_true(cli.writable > writable_before);
    /* an empty buffer takes one message bigger than the window, as send
     * does: send the messages before the next big one, drain, then it */
    while (gv_len(k) <= W) {
        int rc = gv_send(cli.s, k, buf);
        if (rc == AP_EAGAIN) {
            T->run_until(f->tb, NULL, NULL, 5 * MS);
            continue;
        }
        assert_ok(rc);
        k++, sent++;
    }
    for (int i = 0; i < 2000 && ap_stream_buffered(cli.s) > 0; i++)
        T->run_until(f->tb, NULL, NULL, 5 * MS);
    assert_int_equal(ap_stream_buffered(cli.s), 0);
    assert_ok(gv_send(cli.s, k, buf));
    k++, sent++;
    assert_ok(ap_stream_close(cli.s));
    /* after close: the same error as ap_stream_send */
    int rc_send = ap_stream_send(cli.s, buf, 1);
    ap_iovec_t v1 = {buf, 1};
    assert_true(rc_send < 0);
    assert_int_equal(ap_stream_sendv(cli.s, &v1, 1), rc_send);
    free(buf);
    gv_ctx_t *both[2] = {&srv, &cli};
    assert_true(T->run_until(f->tb, gv_closed_both, both, LONG_WAIT));
    assert_int_equal(srv.received, sent);
    assert_true(srv.ok);
    assert_int_equal(cli.close_status, 0);
}

/* A third node is unaffected by a crash between the other two. */
static void test_crash_isolated(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *c = T->node(f->tb, 2);
    rpc_ctx_t s1 = {0}, r1 = {0};
    assert_ok(ap_rt_rpc_register(c, "/test/echo/1", 0, echo_handler, &s1));
    ap_rt_rpc_call(a, ap_rt_self(c), "/test/echo/1", NULL, 0, NULL, rpc_done, &r1);
    assert_true(RUN_UNTIL_FLAG(f->tb, r1.done));
    T->crash(f->tb, 1);
    rpc_ctx_t r2 = {0};
    ap_rt_rpc_call(a, ap_rt_self(c), "/test/echo/1", (const uint8_t *)"k", 1, NULL, rpc_done, &r2);
    assert_true(RUN_UNTIL_FLAG(f->tb, r2.done));
    assert_int_equal(r2.status, 0);
    assert_true(ap_rt_is_connected(a, ap_rt_self(c)));
}

static void test_stats(void **state)
{
    fixture_t *f = *state;
    ap_rt_t *a = T->node(f->tb, 0), *b = T->node(f->tb, 1);
    rpc_ctx_t srv = {0}, cli = {0};
    assert_ok(ap_rt_rpc_register(b, "/test/echo/1", 0, echo_handler, &srv));
    ap_rt_stats_t s0, s1, t1;
    ap_rt_get_stats(a, &s0);
    uint8_t payload[200] = {0};
    ap_rt_rpc_call(a, ap_rt_self(b), "/test/echo/1", payload, sizeof payload, NULL, rpc_done, &cli);
    assert_true(RUN_UNTIL_FLAG(f->tb, cli.done));
    ap_rt_get_stats(a, &s1);
    ap_rt_get_stats(b, &t1);
    assert_true(s1.rpc_calls == s0.rpc_calls + 1);
    assert_true(s1.bytes_sent >= s0.bytes_sent + sizeof payload);
    assert_true(t1.bytes_received >= sizeof payload);
    assert_true(t1.rpc_served >= 1);
    assert_true(s1.connections >= 1);
}

int ap_conformance_run(const ap_testbed_ops_t *ops)
{
    T = ops;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_timer_order, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_post_and_work, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_rpc_echo, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_rpc_errors, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_rpc_built_response, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_rpc_deadline, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_rpc_cancel, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_peer_crash_mid_call, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_stream_order, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_stream_flow_control, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_stream_refuse_and_reset, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_stream_peer_crash, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_stream_sendv_order, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_stream_sendv_window, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_crash_isolated, setup3, teardown),
        cmocka_unit_test_setup_teardown(test_stats, setup2, teardown),
    };
    char name[64];
    snprintf(name, sizeof name, "runtime conformance (%s)", ops->name);
    return _cmocka_run_group_tests(name, tests, sizeof tests / sizeof tests[0], NULL, NULL);
}
