/* The resource manager on real TCP + Noise on 127.0.0.1 (libuv host on its
 * own thread): a peer that holds messages it makes the node buffer, or opens
 * more streams than its limit, is refused at the limit (RESET AP_ELIMIT, one
 * WARN naming it), and another peer is served throughout. Memory protocol
 * code reserves on a peer's account (ap_rt_mem_reserve) counts in the same
 * scopes. */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NHOLD   10
#define MSG_LEN (1u << 20)

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_refusals[4096];

static void sink(void *arg, ap_log_level_t level, const char *module, const char *msg)
{
    (void)arg;
    if (level < AP_LOG_WARN || strcmp(module, "mux") || !strstr(msg, "refusing")) return;
    pthread_mutex_lock(&log_mu);
    size_t k = strlen(g_refusals);
    if (k + strlen(msg) + 2 < sizeof g_refusals)
        snprintf(g_refusals + k, sizeof g_refusals - k, "%s\n", msg);
    pthread_mutex_unlock(&log_mu);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- the target's protocols ---------------------------------------------- */

static ap_rpc_req_t *g_held[NHOLD];
static atomic_int g_nheld;

static void hold_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    int k = atomic_load(&g_nheld);
    if (k >= NHOLD) {
        ap_rpc_respond(req, NULL, 0);
        return;
    }
    g_held[k] = req;
    atomic_store(&g_nheld, k + 1);
}

static void echo_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    ap_rpc_respond(req, (const uint8_t *)"legit", 5);
}

static void release_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    (void)arg;
    int k = atomic_load(&g_nheld);
    for (int i = 0; i < k; i++) ap_rpc_respond(g_held[i], (const uint8_t *)"done", 4);
    atomic_store(&g_nheld, 0);
    ap_sync_complete(done, 0);
}

static int sink_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                       const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)arg;
    (void)peer;
    (void)hello;
    (void)len;
    ap_stream_pause(s, true); /* reads nothing: what arrives is held */
    return 0;
}

typedef struct setup {
    ap_node_limits_t lim;
} setup_t;

static void target_setup_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    setup_t *st = arg;
    int rc = ap_node_set_limits(rt, &st->lim);
    if (!rc) rc = ap_rt_rpc_register(rt, "/t/hold", 0, hold_handler, NULL);
    if (!rc) rc = ap_rt_rpc_register(rt, "/t/echo", 0, echo_handler, NULL);
    ap_stream_opts_t o = {.window = 16u << 20, .max_msg = 2 * MSG_LEN};
    if (!rc) rc = ap_rt_stream_listen(rt, "/t/sink", &o, sink_accept, NULL);
    ap_sync_complete(done, rc);
}

/* ---- clients ------------------------------------------------------------- */

typedef struct addr_arg {
    const ap_peer_id_t *peer;
    const char *addr;
} addr_arg_t;

static void add_addr_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    addr_arg_t *a = arg;
    ap_sync_complete(done, ap_rt_add_addr(rt, a->peer, a->addr));
}

typedef struct calls {
    const ap_peer_id_t *peer;
    const char *proto;
    int n;
    atomic_int ok, limited, other;
    char errmsg[128];
} calls_t;

static void call_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    (void)rt;
    (void)resp;
    (void)len;
    calls_t *c = arg;
    if (status == 0) {
        atomic_fetch_add(&c->ok, 1);
    } else if (status == AP_ELIMIT) {
        if (errmsg) snprintf(c->errmsg, sizeof c->errmsg, "%s", errmsg);
        atomic_fetch_add(&c->limited, 1);
    } else {
        atomic_fetch_add(&c->other, 1);
    }
}

static void calls_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    calls_t *c = arg;
    ap_rpc_opts_t o = {.timeout_us = 20000000};
    for (int i = 0; i < c->n; i++)
        if (!ap_rt_rpc_call(rt, c->peer, c->proto, (const uint8_t *)"q", 1, &o, call_done, c))
            atomic_fetch_add(&c->other, 1);
    ap_sync_complete(done, 0);
}

typedef struct one_call {
    const ap_peer_id_t *peer;
    ap_sync_t *done;
    char resp[16];
} one_call_t;

static void one_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                     const char *errmsg)
{
    (void)rt;
    (void)errmsg;
    one_call_t *c = arg;
    if (status == 0 && len < sizeof c->resp) memcpy(c->resp, resp, len);
    ap_sync_complete(c->done, status);
}

static void echo_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    one_call_t *c = arg;
    c->done = done;
    ap_rpc_opts_t o = {.timeout_us = 10000000};
    if (!ap_rt_rpc_call(rt, c->peer, "/t/echo", (const uint8_t *)"legit", 5, &o, one_done, c))
        ap_sync_complete(done, AP_ENOMEM);
}

typedef struct flood {
    const ap_peer_id_t *peer;
    ap_stream_t *s;
    atomic_int closed; /* 1 + status offset */
    atomic_int status;
    int n; /* messages of MSG_LEN; 0 = 6 */
} flood_t;

static void flood_close(ap_stream_t *s, void *arg, int status)
{
    (void)s;
    flood_t *f = arg;
    atomic_store(&f->status, status);
    atomic_store(&f->closed, 1);
}

static void flood_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    flood_t *f = arg;
    static uint8_t msg[MSG_LEN];
    ap_stream_cbs_t cbs = {.on_close = flood_close};
    ap_stream_opts_t o = {.window = 16u << 20};
    int rc = ap_rt_stream_open(rt, f->peer, "/t/sink", (const uint8_t *)"h", 1, &o, &cbs, f, &f->s);
    /* 6 MiB into a stream the target reads nothing from: more than the
     * peer may make it hold */
    for (int i = 0; rc == 0 && i < (f->n ? f->n : 6); i++)
        rc = ap_stream_send(f->s, msg, sizeof msg);
    ap_sync_complete(done, rc);
}

static bool wait_for(atomic_int *v, int want, int ms)
{
    for (int t = 0; t < ms / 10; t++) {
        if (atomic_load(v) >= want) return true;
        sleep_ms(10);
    }
    return atomic_load(v) >= want;
}

typedef struct report {
    char out[4096];
    int len;
} report_t;

static void test_limits_over_tcp(void **state)
{
    (void)state;
    ap_log_set_sink(sink, NULL);
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    assert_ok(ap_host_start(h));
    ap_node_opts_t no = {.listen = "/ip4/127.0.0.1/tcp/0"};
    ap_rt_t *target, *bad, *good;
    assert_ok(ap_node_new(h, &no, &target));
    assert_ok(ap_node_new(h, &no, &bad));
    assert_ok(ap_node_new(h, &no, &good));
    setup_t st;
    ap_node_limits_default(&st.lim);
    st.lim.peer_streams = 4;
    st.lim.peer_memory = 3 * MSG_LEN + 4096;
    assert_ok(ap_node_call_sync(target, target_setup_fn, &st));
    char addr[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_node_listen_addrs_sync(target, addr, 1, false), 1);
    const ap_peer_id_t *tid = ap_rt_self(target);
    addr_arg_t aa = {.peer = tid, .addr = addr[0]};
    assert_ok(ap_node_call_sync(bad, add_addr_fn, &aa));
    assert_ok(ap_node_call_sync(good, add_addr_fn, &aa));
    char bad_short[AP_PEER_SHORT_LEN];
    ap_peer_id_short(ap_rt_self(bad), bad_short);

    /* memory: 6 x 1 MiB into a paused stream; the peer may make the target
     * hold 3 MiB, so its stream is reset */
    flood_t fl = {.peer = tid};
    assert_ok(ap_node_call_sync(bad, flood_fn, &fl));
    assert_true(wait_for(&fl.closed, 1, 20000));
    assert_int_not_equal(atomic_load(&fl.status), 0);
    one_call_t e1 = {.peer = tid};
    assert_ok(ap_node_call_sync(good, echo_fn, &e1));
    assert_string_equal(e1.resp, "legit");

    /* streams: 10 held calls against a limit of 4 per peer */
    calls_t hold = {.peer = tid, .proto = "/t/hold", .n = NHOLD};
    assert_ok(ap_node_call_sync(bad, calls_fn, &hold));
    assert_true(wait_for(&hold.limited, NHOLD - 4, 20000));
    assert_true(wait_for(&g_nheld, 4, 20000));
    assert_int_equal(atomic_load(&hold.limited), NHOLD - 4);
    assert_non_null(strstr(hold.errmsg, "peer streams full"));
    /* another peer is served while the first holds its 4 */
    one_call_t e2 = {.peer = tid};
    assert_ok(ap_node_call_sync(good, echo_fn, &e2));
    assert_string_equal(e2.resp, "legit");

    /* the report shows the flooding peer at its stream limit, its 4 held
     * 1-byte requests still counted */
    report_t r;
    r.len = ap_node_resources_sync(target, 8, r.out, sizeof r.out);
    assert_true(r.len > 0);
    char bad_id[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(ap_rt_self(bad), bad_id);
    char want[AP_PEER_ID_STR_MAX + 64];
    snprintf(want, sizeof want, "peer %s: memory 4/%u, streams 4/4", bad_id,
             (unsigned)st.lim.peer_memory);
    if (!strstr(r.out, want)) fprintf(stderr, "report:\n%s\nwanted: %s\n", r.out, want);
    assert_non_null(strstr(r.out, want));
    assert_non_null(strstr(r.out, "refused "));

    assert_ok(ap_node_call_sync(target, release_fn, NULL));
    assert_true(wait_for(&hold.ok, 4, 20000));
    /* the WARNs name the peer and the scope */
    pthread_mutex_lock(&log_mu);
    char lines[sizeof g_refusals];
    memcpy(lines, g_refusals, sizeof lines);
    pthread_mutex_unlock(&log_mu);
    assert_non_null(strstr(lines, bad_short));
    assert_non_null(strstr(lines, "memory"));
    ap_node_free(good);
    ap_node_free(bad);
    ap_node_free(target);
    assert_ok(ap_host_free(h));
    ap_log_set_sink(NULL, NULL);
}

typedef struct res {
    const ap_peer_id_t *peer;
    size_t bytes;
    bool release;
} res_t;

static void res_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    res_t *r = arg;
    if (r->release) {
        ap_rt_mem_release(rt, r->peer, r->bytes);
        ap_sync_complete(done, 0);
    } else {
        ap_sync_complete(done, ap_rt_mem_reserve(rt, r->peer, r->bytes));
    }
}

/* A protocol's reservation on a peer's account: within the peer's limit
 * and the node's, shown in the report, and it leaves that peer less room
 * for what it sends (its 1 MiB message is refused), not another peer. */
static void test_protocol_reservations(void **state)
{
    (void)state;
    atomic_store(&g_nheld, 0);
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    assert_ok(ap_host_start(h));
    ap_node_opts_t no = {.listen = "/ip4/127.0.0.1/tcp/0"};
    ap_rt_t *target, *bad, *good;
    assert_ok(ap_node_new(h, &no, &target));
    assert_ok(ap_node_new(h, &no, &bad));
    assert_ok(ap_node_new(h, &no, &good));
    setup_t st;
    ap_node_limits_default(&st.lim);
    st.lim.peer_memory = 2 * MSG_LEN + 4096;
    assert_ok(ap_node_call_sync(target, target_setup_fn, &st));
    char addr[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_node_listen_addrs_sync(target, addr, 1, false), 1);
    const ap_peer_id_t *tid = ap_rt_self(target);
    addr_arg_t aa = {.peer = tid, .addr = addr[0]};
    assert_ok(ap_node_call_sync(bad, add_addr_fn, &aa));
    assert_ok(ap_node_call_sync(good, add_addr_fn, &aa));

    const ap_peer_id_t *bid = ap_rt_self(bad);
    res_t r1 = {bid, 3 * MSG_LEN / 2, false}, r2 = {bid, MSG_LEN, false};
    res_t r3 = {NULL, MSG_LEN, false};
    assert_ok(ap_node_call_sync(target, res_fn, &r1));
    assert_int_equal(ap_node_call_sync(target, res_fn, &r2), AP_ELIMIT); /* the peer's scope */
    assert_ok(ap_node_call_sync(target, res_fn, &r3));                   /* the node's only */
    assert_int_equal(ap_node_set_limits_sync(target, &st.lim), AP_ESTATE);
    report_t r;
    r.len = ap_node_resources_sync(target, 8, r.out, sizeof r.out);
    char bad_id[AP_PEER_ID_STR_MAX], want[AP_PEER_ID_STR_MAX + 64];
    ap_peer_id_str(bid, bad_id);
    snprintf(want, sizeof want, "peer %s: memory %u/%u", bad_id, 3 * MSG_LEN / 2,
             (unsigned)st.lim.peer_memory);
    if (!strstr(r.out, want)) fprintf(stderr, "report:\n%s\nwanted: %s\n", r.out, want);
    assert_non_null(strstr(r.out, want));
    snprintf(want, sizeof want, "held for peers by protocols %u bytes", 5 * MSG_LEN / 2);
    assert_non_null(strstr(r.out, want));

    /* that peer's 1 MiB message no longer fits its scope; another peer is served */
    flood_t fl = {.peer = tid, .n = 1};
    assert_ok(ap_node_call_sync(bad, flood_fn, &fl));
    assert_true(wait_for(&fl.closed, 1, 20000));
    assert_int_not_equal(atomic_load(&fl.status), 0);
    one_call_t e = {.peer = tid};
    assert_ok(ap_node_call_sync(good, echo_fn, &e));
    assert_string_equal(e.resp, "legit");

    r1.release = r3.release = true;
    assert_ok(ap_node_call_sync(target, res_fn, &r1));
    assert_ok(ap_node_call_sync(target, res_fn, &r3));
    r.len = ap_node_resources_sync(target, 8, r.out, sizeof r.out);
    assert_non_null(strstr(r.out, "held for peers by protocols 0 bytes"));
    ap_node_free(good);
    ap_node_free(bad);
    ap_node_free(target);
    assert_ok(ap_host_free(h));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_limits_over_tcp),
        cmocka_unit_test(test_protocol_reservations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
