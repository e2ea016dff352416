/* The distributed MASHA protocol (server + M workers over runtime.h) on a
 * minimal deterministic in-process RPC driver defined here (a FIFO of
 * deliveries; no time, no loss). Checks: the run matches the in-process
 * solver exactly, and each node's runtime byte counter equals the analytic
 * count. (The simulator driver gets the same scenario in tests/sim once it
 * lands on main.) */
#include "aptest.h"

#include "apiary/compress.h"
#include "apiary/masha.h"
#include "runtime/rt_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 16

typedef struct lnode {
    struct ap_rt rt; /* first */
    int idx;
    ap_rt_stats_t st;
} lnode_t;

typedef struct lreq {
    struct ap_rpc_req head; /* first */
    uint64_t call_id;
    int caller;
    uint8_t *buf;
} lreq_t;

typedef struct ev {
    int kind; /* 1 request, 2 response */
    int from, to;
    char proto[AP_RT_PROTO_MAX];
    uint8_t *data;
    size_t len;
    uint64_t call_id;
    int err;
} ev_t;

typedef struct call {
    uint64_t id;
    int caller;
    size_t max_resp;
    ap_rpc_done_fn done;
    void *arg;
    bool active;
} call_t;

static lnode_t nodes[MAXN];
static int nnodes;
static ev_t *q;
static size_t qh, qt, qcap;
static call_t *calls;
static size_t ncalls, calls_cap;
static uint64_t clock_us;

static void push(ev_t e)
{
    if (qt == qcap) {
        qcap = qcap ? 2 * qcap : 256;
        q = realloc(q, qcap * sizeof *q);
        assert_non_null(q);
    }
    q[qt++] = e;
}

static int find_node(const ap_peer_id_t *p)
{
    for (int i = 0; i < nnodes; i++)
        if (ap_peer_id_eq(&nodes[i].rt.self, p)) return i;
    return -1;
}

static uint64_t l_now(ap_rt_t *rt)
{
    return (void)rt, clock_us;
}
static int64_t l_wall(ap_rt_t *rt)
{
    return (void)rt, 0;
}
static uint64_t l_timer_start(ap_rt_t *rt, uint64_t d, uint64_t p, ap_timer_fn cb, void *a)
{
    (void)rt, (void)d, (void)p, (void)cb, (void)a;
    return 0;
}
static bool l_timer_stop(ap_rt_t *rt, uint64_t id)
{
    return (void)rt, (void)id, false;
}
static int l_post(ap_rt_t *rt, ap_post_fn fn, void *arg)
{
    (void)rt, (void)fn, (void)arg;
    return AP_ENOTSUP;
}
static int l_work(ap_rt_t *rt, double cost, ap_work_fn w, ap_after_work_fn after, void *arg)
{
    (void)cost;
    w(arg);
    after(rt, arg, 0);
    return 0;
}
static int l_addrs(ap_rt_t *rt, char (*a)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    (void)rt, (void)a, (void)max, (void)with_id;
    return 0;
}
static int l_add_addr(ap_rt_t *rt, const ap_peer_id_t *p, const char *a)
{
    (void)rt, (void)p, (void)a;
    return 0;
}
static int l_dial(ap_rt_t *rt, const char *a, uint64_t t, ap_dial_fn cb, void *arg)
{
    (void)rt, (void)a, (void)t, (void)cb, (void)arg;
    return AP_ENOTSUP;
}
static bool l_conn(ap_rt_t *rt, const ap_peer_id_t *p)
{
    return (void)rt, find_node(p) >= 0;
}

static uint64_t l_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto, const uint8_t *req,
                       size_t len, const ap_rpc_opts_t *opts, ap_rpc_done_fn done, void *arg)
{
    lnode_t *n = (lnode_t *)rt;
    if (ncalls == calls_cap) {
        calls_cap = calls_cap ? 2 * calls_cap : 256;
        calls = realloc(calls, calls_cap * sizeof *calls);
        assert_non_null(calls);
    }
    uint64_t id = ncalls + 1;
    calls[ncalls++] = (call_t){.id = id,
                               .caller = n->idx,
                               .max_resp = opts->max_resp,
                               .done = done,
                               .arg = arg,
                               .active = true};
    ev_t e = {.kind = 1, .from = n->idx, .to = find_node(peer), .len = len, .call_id = id};
    snprintf(e.proto, sizeof e.proto, "%s", proto);
    e.data = malloc(len ? len : 1);
    memcpy(e.data, req, len);
    n->st.bytes_sent += len;
    n->st.rpc_calls++;
    push(e);
    return id;
}

static bool l_cancel(ap_rt_t *rt, uint64_t id)
{
    if (id == 0 || id > ncalls || !calls[id - 1].active) return false;
    calls[id - 1].active = false;
    calls[id - 1].done(rt, calls[id - 1].arg, AP_ECANCELED, NULL, 0, NULL);
    return true;
}

static void l_respond(ap_rpc_req_t *r, int err, const char *msg, const uint8_t *data, size_t len)
{
    (void)msg;
    lreq_t *lr = (lreq_t *)r;
    lnode_t *n = (lnode_t *)r->rt;
    ev_t e = {.kind = 2,
              .from = n->idx,
              .to = lr->caller,
              .len = len,
              .call_id = lr->call_id,
              .err = err};
    e.data = malloc(len ? len : 1);
    if (len) memcpy(e.data, data, len);
    n->st.bytes_sent += len;
    push(e);
    free(lr->buf);
    free(lr);
}

static void l_stats(ap_rt_t *rt, ap_rt_stats_t *out)
{
    *out = ((lnode_t *)rt)->st;
}

static const ap_rt_ops_t lops = {
    .name = "loop",
    .now_us = l_now,
    .wall_ms = l_wall,
    .timer_start = l_timer_start,
    .timer_stop = l_timer_stop,
    .post = l_post,
    .work = l_work,
    .listen_addrs = l_addrs,
    .add_addr = l_add_addr,
    .dial = l_dial,
    .is_connected = l_conn,
    .rpc_call = l_call,
    .rpc_cancel = l_cancel,
    .rpc_respond = l_respond,
    .get_stats = l_stats,
};

static void run_queue(void)
{
    while (qh < qt) {
        ev_t e = q[qh++];
        clock_us++;
        if (e.kind == 1) {
            lnode_t *t = e.to >= 0 ? &nodes[e.to] : NULL;
            const ap_rt_handler_t *h = t ? ap__rt_find_handler(&t->rt, e.proto) : NULL;
            size_t cap = h && h->max_req ? h->max_req : AP_RT_RPC_MAX_DEFAULT;
            if (!h || e.len > cap) {
                push((ev_t){.kind = 2,
                            .from = e.to,
                            .to = e.from,
                            .call_id = e.call_id,
                            .err = !h ? AP_ENOPROTO : AP_EMSGSIZE});
                free(e.data);
                continue;
            }
            t->st.bytes_received += e.len;
            t->st.rpc_served++;
            lreq_t *r = calloc(1, sizeof *r);
            r->head.rt = &t->rt;
            r->head.peer = nodes[e.from].rt.self;
            r->head.data = e.data;
            r->head.len = e.len;
            r->buf = e.data;
            r->call_id = e.call_id;
            r->caller = e.from;
            h->fn(&t->rt, h->arg, &r->head);
        } else {
            call_t *c = &calls[e.call_id - 1];
            if (c->active) {
                c->active = false;
                int err = e.err;
                if (!err && c->max_resp && e.len > c->max_resp) err = AP_EMSGSIZE;
                nodes[e.to].st.bytes_received += e.len;
                c->done(&nodes[e.to].rt, c->arg, err, err ? NULL : e.data, err ? 0 : e.len, NULL);
            }
            free(e.data);
        }
    }
}

typedef struct wres {
    int status;
    bool finished;
    ap_masha_result_t r;
} wres_t;

static void on_done(void *arg, int status, const ap_masha_result_t *r)
{
    wres_t *w = arg;
    w->status = status;
    w->finished = true;
    w->r = *r;
}

static void run_distributed(ap_masha_method_t method, double gamma, double frac, double sfrac)
{
    const int M = 10;
    ap_masha_bilinear_cfg_t pc = {.n = 50, .workers = M, .lambda = 0.05, .h = 0.1, .seed = 2021};
    ap_masha_opts_t o = {.method = method,
                         .gamma = gamma,
                         .fraction = frac,
                         .server_fraction = sfrac,
                         .seed = 99,
                         .target = 1e-6,
                         .max_iters = 100000};
    nnodes = M + 1;
    qh = qt = 0;
    ncalls = 0;
    for (int i = 0; i < nnodes; i++) {
        memset(&nodes[i], 0, sizeof nodes[i]);
        uint8_t seed[32] = {(uint8_t)(i + 1), 7};
        assert_ok(ap__rt_init(&nodes[i].rt, &lops, seed, 1000 + (uint64_t)i));
        nodes[i].idx = i;
    }
    ap_masha_node_t *srv, *wk[MAXN];
    wres_t res[MAXN] = {{0}}, sres = {0};
    assert_ok(ap_masha_server_start(&nodes[0].rt, &pc, &o, &srv));
    assert_ok(ap_masha_server_track(srv, on_done, &sres));
    assert_int_equal(ap_masha_server_track(srv, on_done, &sres), AP_ESTATE);
    for (int m = 0; m < M; m++)
        assert_ok(ap_masha_worker_start(&nodes[1 + m].rt, &nodes[0].rt.self, &pc, &o, m, on_done,
                                        &res[m], &wk[m]));
    run_queue();
    /* the in-process solver sends the same bytes */
    ap_masha_problem_t *p = ap_masha_bilinear_new(&pc);
    ap_masha_result_t ref;
    assert_ok(ap_masha_run(p, &o, &ref));
    assert_true(ref.converged);
    ap_rt_stats_t st;
    for (int m = 0; m < M; m++) {
        assert_true(res[m].finished);
        assert_int_equal(res[m].status, 0);
        assert_true(res[m].r.converged);
        assert_int_equal(res[m].r.iters, ref.iters);
        assert_int_equal(res[m].r.refreshes, ref.refreshes);
        assert_int_equal(res[m].r.bytes_up, ref.bytes_up);
        ap_rt_get_stats(&nodes[1 + m].rt, &st);
        /* the runtime's byte counter == the analytic count */
        assert_int_equal(st.bytes_sent, ap_masha_upload_bytes(p, &o, ref.iters, ref.refreshes));
        assert_int_equal(st.bytes_received, ref.bytes_down);
    }
    /* the server followed the run and saw the same end */
    assert_true(sres.finished);
    assert_int_equal(sres.status, 0);
    assert_true(sres.r.converged);
    assert_int_equal(sres.r.iters, ref.iters);
    assert_int_equal(sres.r.refreshes, ref.refreshes);
    assert_int_equal(sres.r.floats_up, ref.floats_up);
    assert_int_equal(sres.r.bytes_up, ref.bytes_up);
    assert_int_equal(sres.r.bytes_down, ref.bytes_down);
    assert_true(sres.r.rel_dist2 == ref.rel_dist2);
    ap_rt_get_stats(&nodes[0].rt, &st);
    assert_int_equal(st.bytes_sent, (uint64_t)M * ref.bytes_down);
    print_message("method %d: %llu iterations, %llu B up per worker\n", (int)method,
                  (unsigned long long)ref.iters, (unsigned long long)ref.bytes_up);
    for (int m = 0; m < M; m++) ap_masha_node_free(wk[m]);
    ap_masha_node_free(srv);
    ap_masha_problem_free(p);
    for (int i = 0; i < nnodes; i++) ap__rt_fini(&nodes[i].rt);
}

static void test_distributed_eg(void **state)
{
    (void)state, run_distributed(AP_MASHA_EXTRAGRADIENT, 1.8, 0, 0);
}
static void test_distributed_masha1(void **state)
{
    (void)state, run_distributed(AP_MASHA_1, 0.4, 0.1, 0);
}
static void test_distributed_masha2(void **state)
{
    (void)state, run_distributed(AP_MASHA_2, 0.2, 0.1, 0.5);
}

static int bad_status;
static void bad_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                     const char *errmsg)
{
    (void)rt, (void)arg, (void)resp, (void)len, (void)errmsg;
    bad_status = status;
}

/* Garbage and truncated requests get an error reply; the server keeps going. */
static void test_bad_request(void **state)
{
    (void)state;
    ap_masha_bilinear_cfg_t pc = {.n = 4, .workers = 2, .lambda = 0.05, .h = 1, .seed = 1};
    ap_masha_opts_t o = {.method = AP_MASHA_1,
                         .gamma = 0.1,
                         .fraction = 0.5,
                         .seed = 1,
                         .target = 1e-6,
                         .max_iters = 10};
    nnodes = 2;
    qh = qt = 0;
    ncalls = 0;
    for (int i = 0; i < nnodes; i++) {
        memset(&nodes[i], 0, sizeof nodes[i]);
        uint8_t seed[32] = {(uint8_t)(i + 1), 9};
        assert_ok(ap__rt_init(&nodes[i].rt, &lops, seed, 5 + (uint64_t)i));
        nodes[i].idx = i;
    }
    ap_masha_node_t *srv;
    assert_ok(ap_masha_server_start(&nodes[0].rt, &pc, &o, &srv));
    const uint8_t junk[][12] = {
        {1, 1, 0, 0}, {9, 9, 9, 9, 9, 9, 9, 9, 9}, {1, 1, 5, 0, 0, 0, 0, 0, 0xA5}};
    const size_t lens[] = {4, 9, 12};
    for (int i = 0; i < 3; i++) {
        bad_status = 1;
        ap_rpc_opts_t ro = {0};
        assert_true(ap_rt_rpc_call(&nodes[1].rt, &nodes[0].rt.self, AP_MASHA_PROTO, junk[i],
                                   lens[i], &ro, bad_done, NULL) != 0);
        run_queue();
        assert_true(bad_status < 0);
    }
    /* a worker index belongs to the peer that first used it */
    nnodes = 3;
    memset(&nodes[2], 0, sizeof nodes[2]);
    uint8_t seed2[32] = {3, 9};
    assert_ok(ap__rt_init(&nodes[2].rt, &lops, seed2, 7));
    nodes[2].idx = 2;
    uint8_t req[8 + 24 + 32] = {1, 1, 0, 0, 0, 0, 0, 0};
    float zero[8] = {0};
    size_t clen;
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    assert_ok(ap_compress_encode(&none, zero, 8, 0, req + 8, sizeof req - 8, &clen));
    assert_int_equal(8 + clen, sizeof req);
    ap_rpc_opts_t ro = {0};
    bad_status = 1;
    assert_true(ap_rt_rpc_call(&nodes[1].rt, &nodes[0].rt.self, AP_MASHA_PROTO, req, sizeof req,
                               &ro, bad_done, NULL) != 0);
    run_queue();
    assert_int_equal(bad_status, 1); /* held: waiting for worker 1 */
    assert_true(ap_rt_rpc_call(&nodes[2].rt, &nodes[0].rt.self, AP_MASHA_PROTO, req, sizeof req,
                               &ro, bad_done, NULL) != 0);
    run_queue();
    assert_int_equal(bad_status, AP_EPERM);
    ap_masha_node_free(srv); /* the held request gets AP_ESHUTDOWN */
    run_queue();
    assert_int_equal(bad_status, AP_ESHUTDOWN);
    for (int i = 0; i < nnodes; i++) ap__rt_fini(&nodes[i].rt);
}

bool ap__p2pb_bulk(const char *proto); /* src/runtime/uv/p2p_bridge.c */

/* Every MASHA wire version is bulk: refused over a relayed connection
 * unless the node allows bulk there (docs/nat.md). */
static void test_bulk_over_relays(void **state)
{
    (void)state;
    assert_true(ap__p2pb_bulk(AP_MASHA_PROTO));
    assert_true(ap__p2pb_bulk(AP_MASHA_PROTO2));
    assert_true(ap__p2pb_bulk(AP_MASHA_PROTO3));
    assert_false(ap__p2pb_bulk("/apiary/masha/9"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_distributed_eg),     cmocka_unit_test(test_distributed_masha1),
        cmocka_unit_test(test_distributed_masha2), cmocka_unit_test(test_bad_request),
        cmocka_unit_test(test_bulk_over_relays),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
