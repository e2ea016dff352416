/* runtime.h protocols over libp2p connections (src/runtime/uv/p2p_bridge.c):
 * a DHT and an all-reduce between TCP nodes forced to yamux, the native mux
 * agreed as "/apiary/mux/2" between nodes dialling with libp2p, and a
 * foreign libp2p peer (a bare libp2p host, yamux only, as js-libp2p is) that
 * runs identify, ping and an Apiary RPC by its protocol name on one
 * connection to a node's port, with a bad in-band frame resetting only its
 * stream. */
#include "aptest.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/dht.h"
#include "apiary/host.h"
#include "apiary/node.h"
#include "apiary/sync.h"
#include "p2p/identify.h"
#include "p2p/p2p_conn.h"
#include "p2p/yamux.h"
#include "runtime/uv/p2p_bridge.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---------------------------------------------------------------------- */

static void wire_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_sync_complete(done, ap_node_set_wire(rt, *(ap_node_wire_t *)arg));
}

static void addr_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    char a[1][AP_RT_ADDR_MAX];
    int n = ap_rt_listen_addrs(rt, a, 1, true);
    if (n >= 1) memcpy(arg, a[0], AP_RT_ADDR_MAX);
    ap_sync_complete(done, n >= 1 ? 0 : AP_EADDR);
}

static void stats_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    const ap_p2pb_t *b = ap__tcpc_bridge((ap_node_t *)rt);
    if (b) *(ap_p2pb_stats_t *)arg = b->stats;
    ap_sync_complete(done, b ? 0 : AP_ENOTSUP);
}

static void wall_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    *(int64_t *)arg = ap_rt_wall_ms(rt);
    ap_sync_complete(done, 0);
}

static ap_rt_t *tcp_node(ap_host_t *h, int i, ap_node_wire_t wire, bool sync)
{
    uint8_t seed[32] = {0};
    seed[0] = (uint8_t)(i + 1);
    seed[1] = 0x5a;
    ap_node_opts_t o = {
        .ed25519_seed = seed, .rng_seed = (uint64_t)i + 7, .listen = "/ip4/127.0.0.1/tcp/0"};
    ap_rt_t *rt = NULL;
    assert_ok(ap_node_new(h, &o, &rt));
    if (sync)
        assert_ok(ap_node_call_sync(rt, wire_fn, &wire));
    else
        assert_ok(ap_node_set_wire(rt, wire));
    return rt;
}

/* ---- a DHT between nodes forced to yamux ----------------------------------------------- */

#define NDHT 6

static void test_dht_over_yamux(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    assert_ok(ap_host_start(h));
    ap_rt_t *rt[NDHT];
    ap_dht_t *dht[NDHT];
    for (int i = 0; i < NDHT; i++) {
        rt[i] = tcp_node(h, i, AP_NODE_WIRE_YAMUX, true);
        assert_ok(ap_dht_new_sync(rt[i], NULL, &dht[i]));
    }
    char addr0[AP_RT_ADDR_MAX];
    assert_ok(ap_node_call_sync(rt[0], addr_fn, addr0));
    const char *boot[1] = {addr0};
    for (int i = 1; i < NDHT; i++) assert_ok(ap_dht_bootstrap_sync(dht[i], boot, 1));
    int64_t now;
    assert_ok(ap_node_call_sync(rt[2], wall_fn, &now));
    char key[32], val[32];
    for (int k = 0; k < 8; k++) {
        snprintf(key, sizeof key, "yamux-key-%d", k);
        snprintf(val, sizeof val, "yamux-value-%d", k);
        ap_dht_record_t r = {.key = (const uint8_t *)key,
                             .key_len = strlen(key),
                             .value = (const uint8_t *)val,
                             .value_len = strlen(val),
                             .expiration_ms = now + 60000};
        int nstored = 0;
        assert_ok(ap_dht_store_sync(dht[k % NDHT], &r, &nstored));
        assert_true(nstored >= 3);
    }
    for (int k = 0; k < 8; k++) {
        snprintf(key, sizeof key, "yamux-key-%d", k);
        snprintf(val, sizeof val, "yamux-value-%d", k);
        ap_dht_result_t *res = NULL;
        assert_ok(ap_dht_get_sync(dht[(k * 5 + 1) % NDHT], (const uint8_t *)key, strlen(key), true,
                                  &res));
        assert_non_null(res);
        assert_true(res->found);
        assert_int_equal(res->records[0].value_len, strlen(val));
        assert_memory_equal(res->records[0].value, val, strlen(val));
        ap_dht_result_free(res);
    }
    /* every connection was yamux, and the DHT's RPCs were yamux streams */
    uint64_t yconns = 0, out = 0, in = 0;
    for (int i = 0; i < NDHT; i++) {
        ap_p2pb_stats_t st = {0};
        assert_ok(ap_node_call_sync(rt[i], stats_fn, &st));
        assert_int_equal(st.conns_native, 0);
        assert_int_equal(st.bad_frames, 0);
        yconns += st.conns_yamux;
        out += st.streams_out;
        in += st.streams_in;
    }
    assert_true(yconns >= 2 * (NDHT - 1));
    assert_true(out >= 16);
    assert_int_equal(out, in); /* each stream opened on one side was accepted on the other */
    for (int i = 0; i < NDHT; i++) assert_ok(ap_dht_free_sync(dht[i]));
    assert_ok(ap_host_free(h));
}

/* ---- an all-reduce between nodes forced to yamux --------------------------------------- */

#define NAR   4
#define ELEMS (1u << 16)

typedef struct ar_state {
    bool done;
    ap_allreduce_result_t res;
} ar_state_t;

static void ar_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    ar_state_t *s = arg;
    s->res = *res;
    s->done = true;
}

static bool all_done(void *arg)
{
    ar_state_t *s = arg;
    for (int i = 0; i < NAR; i++)
        if (!s[i].done) return false;
    return true;
}

static float val(int peer, uint32_t k)
{
    return (float)((k * 2654435761u >> 9) % 1000) / 8.0f + (float)peer * 3.0f;
}

static void run_allreduce(ap_node_wire_t wire, ap_p2pb_stats_t *total)
{
    ap_host_t *h = ap_host_new(); /* caller-driven: everything on this thread */
    assert_non_null(h);
    ap_rt_t *rt[NAR];
    ap_avg_service_t *svc[NAR];
    ap_avg_member_t mem[NAR];
    char addr[NAR][AP_RT_ADDR_MAX];
    for (int i = 0; i < NAR; i++) {
        rt[i] = tcp_node(h, 10 + i, wire, false);
        assert_ok(ap_avg_service_new(rt[i], &svc[i]));
        char a[1][AP_RT_ADDR_MAX];
        assert_int_equal(ap_rt_listen_addrs(rt[i], a, 1, false), 1);
        memcpy(addr[i], a[0], sizeof addr[i]);
        mem[i].id = *ap_rt_self(rt[i]);
        mem[i].role = AP_AVG_NORMAL;
        mem[i].up = mem[i].down = 50e6;
    }
    for (int i = 0; i < NAR; i++)
        for (int j = 0; j < NAR; j++)
            if (i != j) assert_ok(ap_rt_add_addr(rt[i], &mem[j].id, addr[j]));
    float *x[NAR];
    ar_state_t st[NAR];
    memset(st, 0, sizeof st);
    ap_avg_group_t g = {.members = mem, .n = NAR};
    memset(g.id, 0x7e, sizeof g.id);
    ap_allreduce_opts_t o = {.chunk_elems = ELEMS / 32, .deadline_factor = 40};
    for (int i = 0; i < NAR; i++) {
        x[i] = malloc(ELEMS * sizeof(float));
        assert_non_null(x[i]);
        for (uint32_t k = 0; k < ELEMS; k++) x[i][k] = val(i, k);
        ap_allreduce_t *ar = NULL;
        assert_ok(ap_allreduce_start(svc[i], &g, x[i], ELEMS, 1.0, &o, ar_done, &st[i], &ar));
    }
    assert_true(ap_host_run_until(h, all_done, st, 120000000ull));
    for (int i = 0; i < NAR; i++) {
        assert_int_equal(st[i].res.status, 0);
        for (uint32_t k = 0; k < ELEMS; k += 97) {
            double m = 0;
            for (int j = 0; j < NAR; j++) m += val(j, k);
            m /= NAR;
            assert_true(fabs(x[i][k] - m) <= 1e-4 * fabs(m) + 1e-5);
        }
    }
    memset(total, 0, sizeof *total);
    for (int i = 0; i < NAR; i++) {
        const ap_p2pb_t *b = ap__tcpc_bridge((ap_node_t *)rt[i]);
        assert_non_null(b);
        total->conns_native += b->stats.conns_native;
        total->conns_yamux += b->stats.conns_yamux;
        total->streams_out += b->stats.streams_out;
        total->streams_in += b->stats.streams_in;
        total->bad_frames += b->stats.bad_frames;
    }
    for (int i = 0; i < NAR; i++) {
        ap_avg_service_free(svc[i]);
        ap_node_free(rt[i]);
        free(x[i]);
    }
    assert_ok(ap_host_free(h));
}

static void test_allreduce_over_yamux(void **state)
{
    (void)state;
    ap_p2pb_stats_t t;
    run_allreduce(AP_NODE_WIRE_YAMUX, &t);
    assert_int_equal(t.conns_native, 0);
    assert_true(t.conns_yamux >= NAR - 1);
    assert_true(t.streams_out >= NAR - 1);
    assert_int_equal(t.bad_frames, 0);
}

/* Between Apiary nodes dialling with libp2p, the native mux is agreed. */
static void test_allreduce_native_over_libp2p(void **state)
{
    (void)state;
    ap_p2pb_stats_t t;
    run_allreduce(AP_NODE_WIRE_LIBP2P, &t);
    assert_int_equal(t.conns_yamux, 0);
    assert_true(t.conns_native >= NAR - 1);
    assert_int_equal(t.streams_out + t.streams_in, 0);
}

/* ---- a foreign libp2p peer on a node's port ----------------------------------------------- */

typedef struct foreign {
    ap_p2p_conn_t *c;
    bool ready, closed;
    int close_status;
    /* identify */
    ap_buf_t id_in;
    bool id_done;
    /* ping */
    uint8_t ping[32];
    size_t ping_got;
    /* the RPC stream */
    ap_buf_t rpc_in;
    bool rpc_fin;
    int rpc_status;
    bool rpc_closed;
    bool bad; /* send a frame with a wrong stream id */
    /* the unknown protocol */
    int nope_status;
    bool nope_closed;
} foreign_t;

static foreign_t F;

static void f_ready(ap_p2p_conn_t *c, void *arg)
{
    (void)c;
    ((foreign_t *)arg)->ready = true;
}

static void f_close(ap_p2p_conn_t *c, void *arg, int status)
{
    (void)c;
    foreign_t *f = arg;
    f->closed = true;
    f->close_status = status;
}

static void id_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    (void)s;
    assert_ok(ap__buf_append(&F.id_in, p, n));
}

static void id_fin(ap_p2p_stream_t *s)
{
    (void)s;
    F.id_done = true;
}

static void ping_open(ap_p2p_stream_t *s)
{
    for (int i = 0; i < 32; i++) F.ping[i] = (uint8_t)(i * 7 + 1);
    assert_ok(ap__p2p_stream_write(s, F.ping, sizeof F.ping));
}

static void ping_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    (void)s;
    for (size_t i = 0; i < n && F.ping_got < 32; i++, F.ping_got++)
        assert_int_equal(p[i], F.ping[F.ping_got]);
}

/* The mux's frames, written in-band as an Apiary peer would (docs/protocol.md). */
static void rpc_open(ap_p2p_stream_t *s)
{
    uint32_t sid = ap__p2p_stream_id(s);
    ap_buf_t b = {0};
    const char *req = "hello over yamux";
    assert_ok(ap__frame_put_open(&b, F.bad ? sid + 2 : sid, true, 1024, "/test/echo/1"));
    assert_ok(ap__frame_put_data(&b, sid, true, (uint32_t)strlen(req), (const uint8_t *)req,
                                 strlen(req)));
    assert_ok(ap__frame_put_close(&b, sid));
    assert_ok(ap__p2p_stream_write(s, b.data, b.len));
    ap__buf_free(&b);
}

static void rpc_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    (void)s;
    assert_ok(ap__buf_append(&F.rpc_in, p, n));
}

static void rpc_fin(ap_p2p_stream_t *s)
{
    F.rpc_fin = true;
    ap__p2p_stream_close(s);
}

static void rpc_close(ap_p2p_stream_t *s, int status)
{
    (void)s;
    F.rpc_status = status;
    F.rpc_closed = true;
}

static void nope_close(ap_p2p_stream_t *s, int status)
{
    (void)s;
    F.nope_status = status;
    F.nope_closed = true;
}

static const ap_p2p_proto_t id_cli = {AP_IDENTIFY_PROTO, NULL, id_data, id_fin, NULL};
static const ap_p2p_proto_t ping_cli = {AP_PING_PROTO, ping_open, ping_data, NULL, NULL};
static const ap_p2p_proto_t rpc_cli = {"/test/echo/1", rpc_open, rpc_data, rpc_fin, rpc_close};
static const ap_p2p_proto_t nope_cli = {"/test/nope/1", NULL, NULL, NULL, nope_close};

static bool pred_ready(void *arg)
{
    (void)arg;
    return F.ready || F.closed;
}
static bool pred_first(void *arg)
{
    (void)arg;
    return (F.id_done && F.ping_got == 32 && F.rpc_closed && F.nope_closed) || F.closed;
}
static bool pred_rpc(void *arg)
{
    (void)arg;
    return F.rpc_closed || F.closed;
}

/* What came back on the RPC stream: WINDOW ACCEPT, DATA(response), CLOSE. */
static void check_response(uint32_t sid)
{
    const uint8_t *p = F.rpc_in.data;
    size_t n = F.rpc_in.len, off = 0;
    bool data = false, close = false;
    while (off + AP_FRAME_HDR <= n) {
        ap_frame_t f;
        assert_ok(ap__frame_parse_hdr(p + off, &f));
        f.payload = p + off + AP_FRAME_HDR;
        assert_true(off + AP_FRAME_HDR + f.len <= n);
        assert_int_equal(f.sid, sid);
        if (f.type == AP_FRAME_DATA) {
            bool has_total;
            uint32_t total;
            const uint8_t *d;
            size_t dn;
            assert_ok(ap__frame_parse_data(&f, &has_total, &total, &d, &dn));
            assert_true(has_total);
            assert_int_equal(dn, strlen("hello over yamux"));
            assert_memory_equal(d, "hello over yamux", dn);
            data = true;
        }
        if (f.type == AP_FRAME_CLOSE) close = true;
        off += AP_FRAME_HDR + f.len;
    }
    assert_int_equal(off, n);
    assert_true(data);
    assert_true(close);
}

static void test_foreign_peer(void **state)
{
    (void)state;
    memset(&F, 0, sizeof F);
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, &o, &rt));
    assert_ok(ap_rt_rpc_register(rt, "/test/echo/1", 0, ap_test_rpc_echo, NULL));
    char a[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(rt, a, 1, true), 1);
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, a[0]));

    ap_identity_t id;
    assert_ok(ap_identity_generate(&id));
    ap_p2p_host_t *fh = ap__p2p_host_new(&((ap_node_t *)rt)->host->loop, &id, "foreign");
    assert_non_null(fh);
    ap_p2p_conn_cbs_t cbs = {f_ready, f_close};
    assert_ok(ap__p2p_dial(fh, &ma, &cbs, &F, &F.c));
    assert_true(ap_host_run_until(h, pred_ready, NULL, 30000000ull));
    assert_true(F.ready);
    assert_string_equal(ap__p2p_conn_muxer(F.c, NULL), AP_YAMUX_PROTO);

    /* identify, ping, an Apiary RPC and an unknown protocol on one connection */
    assert_ok(ap__p2p_stream_open(F.c, &id_cli, NULL, NULL));
    assert_ok(ap__p2p_stream_open(F.c, &ping_cli, NULL, NULL));
    ap_p2p_stream_t *rs;
    assert_ok(ap__p2p_stream_open(F.c, &rpc_cli, NULL, &rs));
    uint32_t rsid = ap__p2p_stream_id(rs);
    assert_ok(ap__p2p_stream_open(F.c, &nope_cli, NULL, NULL));
    assert_true(ap_host_run_until(h, pred_first, NULL, 30000000ull));
    assert_false(F.closed);
    static ap_identify_t info;
    size_t hl, bl;
    assert_int_equal(ap__identify_frame(F.id_in.data, F.id_in.len, &hl, &bl), 1);
    assert_ok(ap__identify_decode(F.id_in.data + hl, bl, &info));
    bool lists_ping = false;
    for (size_t i = 0; i < info.nprotocols; i++)
        if (strcmp(info.protocols[i], AP_PING_PROTO) == 0) lists_ping = true;
    assert_true(lists_ping);
    assert_int_equal(F.ping_got, 32);
    assert_int_equal(F.rpc_status, 0);
    check_response(rsid);
    assert_int_equal(F.nope_status, AP_ENOPROTO);

    /* a frame whose stream id is not the yamux stream's: that stream is
     * reset, the connection and the node go on */
    ap__buf_free(&F.rpc_in);
    memset(&F.rpc_in, 0, sizeof F.rpc_in);
    F.rpc_closed = false;
    F.bad = true;
    assert_ok(ap__p2p_stream_open(F.c, &rpc_cli, NULL, NULL));
    assert_true(ap_host_run_until(h, pred_rpc, NULL, 30000000ull));
    assert_false(F.closed);
    assert_int_not_equal(F.rpc_status, 0);
    assert_int_equal(ap__tcpc_bridge((ap_node_t *)rt)->stats.bad_frames, 1);
    F.bad = false;
    F.rpc_closed = false;
    ap__buf_free(&F.rpc_in);
    memset(&F.rpc_in, 0, sizeof F.rpc_in);
    assert_ok(ap__p2p_stream_open(F.c, &rpc_cli, NULL, &rs));
    rsid = ap__p2p_stream_id(rs);
    assert_true(ap_host_run_until(h, pred_rpc, NULL, 30000000ull));
    assert_int_equal(F.rpc_status, 0);
    check_response(rsid);

    ap__p2p_conn_close(F.c);
    ap__p2p_host_free(fh);
    ap__buf_free(&F.id_in);
    ap__buf_free(&F.rpc_in);
    ap_identity_wipe(&id);
    ap_node_free(rt);
    assert_ok(ap_host_free(h));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_foreign_peer),
        cmocka_unit_test(test_allreduce_native_over_libp2p),
        cmocka_unit_test(test_allreduce_over_yamux),
        cmocka_unit_test(test_dht_over_yamux),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
