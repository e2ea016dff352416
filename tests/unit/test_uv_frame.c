/* Mux frame codec round trips, and every malformed-frame case fed to a live
 * connection's state machine through a fake transport. */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "runtime/uv/uv_impl.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- codec ------------------------------------------------------------------ */

typedef struct {
    ap_frame_t f[16];
    uint8_t payload[16][AP_FRAME_HDR + AP_FRAME_PAYLOAD_MAX];
    int n;
} frames_t;

static int collect(void *arg, const ap_frame_t *f)
{
    frames_t *fs = arg;
    if (fs->n == 16) return AP_ELIMIT;
    fs->f[fs->n] = *f;
    memcpy(fs->payload[fs->n], f->payload, f->len);
    fs->f[fs->n].payload = fs->payload[fs->n];
    fs->n++;
    return 0;
}

static void test_codec_roundtrip(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    static uint8_t big[AP_FRAME_PAYLOAD_MAX];
    for (size_t i = 0; i < sizeof big; i++) big[i] = (uint8_t)(i * 31);
    assert_ok(ap__frame_put_open(&b, 7, true, 123456, "/apiary/dht/1"));
    assert_ok(ap__frame_put_data(&b, 7, true, 100000, big, AP_FRAME_PAYLOAD_MAX - 4));
    assert_ok(ap__frame_put_data(&b, 7, false, 0, big, AP_FRAME_PAYLOAD_MAX));
    assert_ok(ap__frame_put_data(&b, 9, true, 0, NULL, 0)); /* empty message */
    assert_ok(ap__frame_put_close(&b, 7));
    assert_ok(ap__frame_put_reset(&b, 7, AP_ENOTFOUND, "no such\tthing"));
    assert_ok(ap__frame_put_window(&b, 0, false, 1u << 20));
    assert_ok(ap__frame_put_window(&b, 8, true, 65536));
    assert_int_equal(ap__frame_put_data(&b, 7, true, 1, big, AP_FRAME_PAYLOAD_MAX),
                     AP_EINVAL); /* too large for one frame */

    /* fed in every split: whole, byte by byte, odd chunks */
    size_t steps[] = {b.len, 1, 7, 4099};
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        frames_t *fs = calloc(1, sizeof *fs);
        ap_frame_dec_t *d = malloc(sizeof *d);
        ap__frame_dec_init(d);
        for (size_t off = 0; off < b.len; off += steps[k]) {
            size_t n = b.len - off < steps[k] ? b.len - off : steps[k];
            assert_ok(ap__frame_dec_feed(d, b.data + off, n, collect, fs));
        }
        assert_int_equal(fs->n, 8);
        uint32_t w;
        char proto[AP_RT_PROTO_MAX];
        assert_int_equal(fs->f[0].type, AP_FRAME_OPEN);
        assert_int_equal(fs->f[0].flags, AP_FRAME_F_RPC);
        assert_int_equal(fs->f[0].sid, 7);
        assert_ok(ap__frame_parse_open(&fs->f[0], &w, proto, sizeof proto));
        assert_int_equal(w, 123456);
        assert_string_equal(proto, "/apiary/dht/1");
        bool has;
        uint32_t total;
        const uint8_t *data;
        size_t n;
        assert_ok(ap__frame_parse_data(&fs->f[1], &has, &total, &data, &n));
        assert_true(has);
        assert_int_equal(total, 100000);
        assert_int_equal(n, AP_FRAME_PAYLOAD_MAX - 4);
        assert_memory_equal(data, big, n);
        assert_ok(ap__frame_parse_data(&fs->f[2], &has, &total, &data, &n));
        assert_false(has);
        assert_int_equal(n, AP_FRAME_PAYLOAD_MAX);
        assert_memory_equal(data, big, n);
        assert_ok(ap__frame_parse_data(&fs->f[3], &has, &total, &data, &n));
        assert_true(has);
        assert_int_equal(total, 0);
        assert_int_equal(n, 0);
        assert_int_equal(fs->f[4].type, AP_FRAME_CLOSE);
        int code;
        char msg[AP_FRAME_RESET_MSG_MAX + 1];
        assert_ok(ap__frame_parse_reset(&fs->f[5], &code, msg, sizeof msg));
        assert_int_equal(code, AP_ENOTFOUND);
        assert_string_equal(msg, "no such?thing"); /* control characters replaced */
        assert_ok(ap__frame_parse_window(&fs->f[6], &w));
        assert_int_equal(w, 1u << 20);
        assert_int_equal(fs->f[6].sid, 0);
        assert_ok(ap__frame_parse_window(&fs->f[7], &w));
        assert_int_equal(fs->f[7].flags, AP_FRAME_F_ACCEPT);
        assert_int_equal(w, 65536);
        free(fs);
        free(d);
    }
    ap__buf_free(&b);
}

static void hdr(uint8_t *h, uint8_t type, uint8_t flags, uint32_t sid, uint16_t len)
{
    h[0] = type;
    h[1] = flags;
    ap__put_be32(h + 2, sid);
    ap__put_be16(h + 6, len);
}

static void test_codec_rejects(void **state)
{
    (void)state;
    uint8_t h[AP_FRAME_HDR];
    ap_frame_t f;
    hdr(h, 0, 0, 1, 0);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* unknown type */
    hdr(h, 7, 0, 0, 0);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* unknown type */
    hdr(h, AP_FRAME_GOAWAY, 0, 0, 0);
    assert_ok(ap__frame_parse_hdr(h, &f)); /* GOAWAY: stream 0, empty, no flags */
    hdr(h, AP_FRAME_GOAWAY, 0, 1, 0);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* not on a stream */
    hdr(h, AP_FRAME_GOAWAY, 0, 0, 4);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* no payload */
    hdr(h, AP_FRAME_GOAWAY, 1, 0, 0);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* no flags */
    hdr(h, AP_FRAME_DATA, 0x02, 1, 4);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* unknown flag */
    hdr(h, AP_FRAME_DATA, 0, 0, 4);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* DATA on stream 0 */
    hdr(h, AP_FRAME_DATA, 0, 1, 0);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* empty continuation */
    hdr(h, AP_FRAME_DATA, AP_FRAME_F_START, 1, 3);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* START without length */
    hdr(h, AP_FRAME_OPEN, 0, 1, 200);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* oversized OPEN */
    hdr(h, AP_FRAME_CLOSE, 0, 1, 1);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO);
    hdr(h, AP_FRAME_RESET, 0, 1, 3 + AP_FRAME_RESET_MSG_MAX + 1);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO);
    hdr(h, AP_FRAME_WINDOW, AP_FRAME_F_ACCEPT, 0, 4);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO); /* ACCEPT on stream 0 */
    hdr(h, AP_FRAME_WINDOW, 0, 1, 5);
    assert_int_equal(ap__frame_parse_hdr(h, &f), AP_EPROTO);

    /* payload checks */
    uint8_t p[80];
    f = (ap_frame_t){.type = AP_FRAME_OPEN, .sid = 1, .len = 8, .payload = p};
    uint32_t w;
    char proto[AP_RT_PROTO_MAX];
    memset(p, 0, sizeof p);
    p[4] = 5; /* claims 5 bytes, has 3 */
    memcpy(p + 5, "/ab", 3);
    assert_int_equal(ap__frame_parse_open(&f, &w, proto, sizeof proto), AP_EPROTO);
    p[4] = 3;
    assert_ok(ap__frame_parse_open(&f, &w, proto, sizeof proto));
    p[5] = 'x'; /* no leading slash */
    assert_int_equal(ap__frame_parse_open(&f, &w, proto, sizeof proto), AP_EPROTO);
    p[5] = '/';
    p[6] = ' '; /* not printable */
    assert_int_equal(ap__frame_parse_open(&f, &w, proto, sizeof proto), AP_EPROTO);
    /* DATA START carrying more than its total */
    ap__put_be32(p, 2);
    f = (ap_frame_t){
        .type = AP_FRAME_DATA, .flags = AP_FRAME_F_START, .sid = 1, .len = 7, .payload = p};
    bool has;
    uint32_t total;
    const uint8_t *data;
    size_t n;
    assert_int_equal(ap__frame_parse_data(&f, &has, &total, &data, &n), AP_EPROTO);
    /* RESET with code 0, or a length mismatch */
    int code;
    char msg[AP_FRAME_RESET_MSG_MAX + 1];
    memset(p, 0, sizeof p);
    f = (ap_frame_t){.type = AP_FRAME_RESET, .sid = 1, .len = 3, .payload = p};
    assert_int_equal(ap__frame_parse_reset(&f, &code, msg, sizeof msg), AP_EPROTO);
    p[1] = 5;
    p[2] = 4;
    assert_int_equal(ap__frame_parse_reset(&f, &code, msg, sizeof msg), AP_EPROTO);
    /* WINDOW delta above 2^31-1 */
    ap__put_be32(p, 0x80000000u);
    f = (ap_frame_t){.type = AP_FRAME_WINDOW, .sid = 1, .len = 4, .payload = p};
    assert_int_equal(ap__frame_parse_window(&f, &w), AP_EPROTO);
}

/* ---- malformed frames against a live connection ------------------------------- */

typedef struct fake {
    ap_conn_t conn;
    ap_buf_t out;
    bool closed;
} fake_t;

static int fake_write(ap_conn_t *c, const uint8_t *p, size_t n)
{
    fake_t *f = (fake_t *)c;
    return ap__buf_append(&f->out, p, n) < 0 ? AP_ENOMEM : 0;
}

static void fake_close(ap_conn_t *c)
{
    ((fake_t *)c)->closed = true;
}

static const ap_conn_vt_t fake_vt = {.write = fake_write, .close = fake_close};

static char g_log[512];
static int g_warns;
static void sink(void *arg, ap_log_level_t lvl, const char *mod, const char *msg)
{
    (void)arg;
    (void)mod;
    if (lvl >= AP_LOG_WARN) {
        g_warns++;
        snprintf(g_log, sizeof g_log, "%s", msg);
    }
}

typedef struct env {
    ap_host_t *h;
    ap_rt_t *rt;
    fake_t fk;
    ap_mconn_t *mc;
    char peer_short[AP_PEER_SHORT_LEN];
    int accepted;
    int served;
    int msgs;
    ap_stream_t *last; /* last accepted stream */
} env_t;

static void noop_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    (void)d;
    (void)n;
    ((env_t *)arg)->msgs++;
}

static const ap_stream_cbs_t env_cbs = {.on_msg = noop_msg};

static int env_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                      const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)peer;
    (void)hello;
    (void)len;
    env_t *e = arg;
    e->accepted++;
    e->last = s;
    ap_stream_set_cbs(s, &env_cbs, e);
    return 0;
}

static void env_handler(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    ((env_t *)arg)->served++;
    ap_rpc_respond(req, (const uint8_t *)"ok", 2);
}

static void env_up(env_t *e)
{
    memset(e, 0, sizeof *e);
    e->h = ap_host_new();
    assert_non_null(e->h);
    assert_ok(ap_node_new(e->h, NULL, &e->rt));
    ap_stream_opts_t o = {.window = 1024, .max_msg = 8192};
    assert_ok(ap_rt_stream_listen(e->rt, "/t/s", &o, env_accept, e));
    assert_ok(ap_rt_rpc_register(e->rt, "/t/r", 100, env_handler, e));
    ap_stream_opts_t big = {.window = 1024, .max_msg = 1u << 20};
    assert_ok(ap_rt_stream_listen(e->rt, "/t/big", &big, env_accept, e));
    uint8_t pk[32], sk[64];
    crypto_sign_keypair(pk, sk);
    e->fk.conn.vt = &fake_vt;
    e->fk.conn.dialer = false; /* the remote dialed us: its stream ids are odd */
    ap_peer_id_from_ed25519(&e->fk.conn.remote, pk);
    ap_peer_id_short(&e->fk.conn.remote, e->peer_short);
    ap__node_accept_conn((ap_node_t *)e->rt, &e->fk.conn);
    e->mc = e->fk.conn.user;
    assert_non_null(e->mc);
    g_warns = 0;
    g_log[0] = 0;
}

static void env_run(env_t *e)
{
    for (int i = 0; i < 5; i++) ap_host_run_once(e->h, 0);
}

static void env_down(env_t *e)
{
    ap_node_free(e->rt);
    assert_ok(ap_host_free(e->h));
    ap__buf_free(&e->fk.out);
}

static void feed(env_t *e, ap_buf_t *b)
{
    ap__mux_feed(e->mc, b->data, b->len);
    ap__buf_reset(b);
}

/* Asserts the connection was closed with one log line naming the peer. */
static void expect_closed(env_t *e)
{
    assert_true(e->fk.closed);
    assert_int_equal(g_warns, 1);
    assert_non_null(strstr(g_log, e->peer_short));
}

static void open_stream(env_t *e, ap_buf_t *b, uint32_t sid, const char *proto, bool rpc)
{
    assert_ok(ap__frame_put_open(b, sid, rpc, 65536, proto));
    assert_ok(ap__frame_put_data(b, sid, true, 2, (const uint8_t *)"hi", 2));
    feed(e, b);
}

static void test_valid_open_accepts(void **state)
{
    (void)state;
    env_t e;
    env_up(&e);
    ap_buf_t b = {0};
    open_stream(&e, &b, 1, "/t/s", false);
    assert_int_equal(e.accepted, 1);
    /* a split frame is not an error: the decoder waits for the rest */
    assert_ok(ap__frame_put_data(&b, 1, true, 3, (const uint8_t *)"abc", 3));
    ap__mux_feed(e.mc, b.data, 5);
    assert_int_equal(e.msgs, 0);
    ap__mux_feed(e.mc, b.data + 5, b.len - 5);
    assert_int_equal(e.msgs, 1);
    ap__buf_reset(&b);
    env_run(&e);
    assert_false(e.fk.closed);
    /* the node answered with WINDOW(ACCEPT, 1024) on stream 1 */
    ap_frame_t f;
    assert_true(e.fk.out.len >= AP_FRAME_HDR + 4);
    assert_ok(ap__frame_parse_hdr(e.fk.out.data, &f));
    assert_int_equal(f.type, AP_FRAME_WINDOW);
    assert_int_equal(f.flags, AP_FRAME_F_ACCEPT);
    assert_int_equal(f.sid, 1);
    assert_int_equal(ap__get_be32(e.fk.out.data + AP_FRAME_HDR), 1024);
    /* an RPC is served (in the node's next serve turn) */
    open_stream(&e, &b, 3, "/t/r", true);
    env_run(&e);
    assert_int_equal(e.served, 1);
    assert_int_equal(g_warns, 0);
    ap__buf_free(&b);
    env_down(&e);
}

/* Finds the first frame of type (and sid, unless any_sid) the node wrote. */
static bool out_has(const env_t *e, uint8_t type, uint32_t sid, ap_frame_t *out)
{
    size_t off = 0;
    while (off + AP_FRAME_HDR <= e->fk.out.len) {
        ap_frame_t f;
        assert_ok(ap__frame_parse_hdr(e->fk.out.data + off, &f));
        f.payload = e->fk.out.data + off + AP_FRAME_HDR;
        if (f.type == type && f.sid == sid) {
            if (out) *out = f;
            return true;
        }
        off += AP_FRAME_HDR + f.len;
    }
    return false;
}

/* GOAWAY: streams opened before it run to their end; OPENs the peer sends
 * after its own GOAWAY are refused (RESET ECLOSED, no accept, connection
 * kept); the node answers with its GOAWAY, and closes the connection once
 * the last stream ended; a second GOAWAY is a violation. */
static void test_goaway(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    env_t e;
    env_up(&e);
    open_stream(&e, &b, 1, "/t/s", false); /* before GOAWAY: accepted */
    assert_int_equal(e.accepted, 1);
    env_run(&e);
    assert_true(out_has(&e, AP_FRAME_WINDOW, 1, NULL)); /* ACCEPT */
    assert_ok(ap__frame_put_goaway(&b));
    /* after it: an OPEN and an RPC, both refused */
    assert_ok(ap__frame_put_open(&b, 3, false, 1024, "/t/s"));
    assert_ok(ap__frame_put_data(&b, 3, true, 2, (const uint8_t *)"hi", 2));
    assert_ok(ap__frame_put_open(&b, 5, true, 100, "/t/r"));
    assert_ok(ap__frame_put_data(&b, 5, true, 2, (const uint8_t *)"rq", 2));
    assert_ok(ap__frame_put_close(&b, 5));
    feed(&e, &b);
    env_run(&e);
    assert_false(e.fk.closed);
    assert_int_equal(e.accepted, 1);
    assert_int_equal(e.served, 0);
    ap_frame_t f;
    int code;
    char msg[AP_FRAME_RESET_MSG_MAX + 1];
    assert_true(out_has(&e, AP_FRAME_RESET, 3, &f));
    assert_ok(ap__frame_parse_reset(&f, &code, msg, sizeof msg));
    assert_int_equal(code, AP_ECLOSED);
    assert_true(out_has(&e, AP_FRAME_RESET, 5, &f));
    assert_true(out_has(&e, AP_FRAME_GOAWAY, 0, NULL)); /* answered */
    ap_rt_stats_t st;
    ap_rt_get_stats(e.rt, &st);
    assert_int_equal(st.goaway_refused, 2);
    /* the stream opened before GOAWAY still works */
    assert_ok(ap__frame_put_data(&b, 1, true, 3, (const uint8_t *)"abc", 3));
    feed(&e, &b);
    assert_int_equal(e.msgs, 1);
    /* ... and once it ended (both CLOSEs), the connection is closed */
    assert_ok(ap__frame_put_close(&b, 1));
    feed(&e, &b);
    env_run(&e);
    assert_false(e.fk.closed); /* our side of stream 1 is still open */
    assert_int_equal(g_warns, 0);
    ap_stream_close(e.last);
    env_run(&e);
    assert_true(out_has(&e, AP_FRAME_CLOSE, 1, NULL));
    assert_true(e.fk.closed);
    assert_int_equal(g_warns, 0);
    env_down(&e);

    /* a second GOAWAY is a protocol violation */
    env_up(&e);
    assert_ok(ap__frame_put_goaway(&b));
    assert_ok(ap__frame_put_goaway(&b));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    ap__buf_free(&b);
}

static void test_unknown_type(void **state)
{
    (void)state;
    env_t e;
    env_up(&e);
    uint8_t h[AP_FRAME_HDR];
    hdr(h, 0x42, 0, 1, 0);
    ap__mux_feed(e.mc, h, sizeof h);
    expect_closed(&e);
    /* more bytes after the close are ignored */
    ap__mux_feed(e.mc, h, sizeof h);
    assert_int_equal(g_warns, 1);
    env_down(&e);
}

static void test_oversized_header(void **state)
{
    (void)state;
    env_t e;
    env_up(&e);
    uint8_t h[AP_FRAME_HDR];
    hdr(h, AP_FRAME_OPEN, 0, 1, 60000); /* an OPEN can never be this long */
    ap__mux_feed(e.mc, h, sizeof h);
    expect_closed(&e);
    env_down(&e);
}

static void test_truncated_payload(void **state)
{
    (void)state;
    env_t e;
    env_up(&e);
    /* OPEN whose proto length claims more than the frame carries */
    uint8_t fr[AP_FRAME_HDR + 8];
    hdr(fr, AP_FRAME_OPEN, 0, 1, 8);
    memset(fr + AP_FRAME_HDR, 0, 8);
    fr[AP_FRAME_HDR + 4] = 10;
    memcpy(fr + AP_FRAME_HDR + 5, "/ab", 3);
    ap__mux_feed(e.mc, fr, sizeof fr);
    expect_closed(&e);
    env_down(&e);
}

static void test_stream_id_misuse(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    env_t e;
    /* DATA on a stream never opened */
    env_up(&e);
    assert_ok(ap__frame_put_data(&b, 99, true, 1, (const uint8_t *)"x", 1));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    /* OPEN with our parity (even ids are ours) */
    env_up(&e);
    assert_ok(ap__frame_put_open(&b, 2, false, 1024, "/t/s"));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    /* OPEN reusing an id */
    env_up(&e);
    open_stream(&e, &b, 5, "/t/s", false);
    assert_false(e.fk.closed);
    assert_ok(ap__frame_put_open(&b, 5, false, 1024, "/t/s"));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    /* OPEN going backwards */
    env_up(&e);
    open_stream(&e, &b, 9, "/t/s", false);
    assert_ok(ap__frame_put_open(&b, 7, false, 1024, "/t/s"));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    /* WINDOW on a stream we never opened (even id beyond ours) */
    env_up(&e);
    assert_ok(ap__frame_put_window(&b, 40, false, 10));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    /* continuation without START, DATA overrunning its message, second CLOSE */
    env_up(&e);
    open_stream(&e, &b, 1, "/t/s", false);
    assert_ok(ap__frame_put_data(&b, 1, false, 0, (const uint8_t *)"x", 1));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    env_up(&e);
    open_stream(&e, &b, 1, "/t/s", false);
    assert_ok(ap__frame_put_data(&b, 1, true, 2, (const uint8_t *)"xx", 2));
    assert_ok(ap__frame_put_data(&b, 1, true, 4, (const uint8_t *)"ab", 2));
    assert_ok(ap__frame_put_data(&b, 1, false, 0, (const uint8_t *)"cde", 3));
    feed(&e, &b);
    expect_closed(&e);
    assert_int_equal(e.msgs, 1);
    env_down(&e);
    env_up(&e);
    open_stream(&e, &b, 1, "/t/s", false);
    assert_ok(ap__frame_put_close(&b, 1));
    assert_ok(ap__frame_put_close(&b, 1));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    ap__buf_free(&b);
}

static void test_window_overflow(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    env_t e;
    /* connection credit beyond 2^31-1 */
    env_up(&e);
    assert_ok(ap__frame_put_window(&b, 0, false, 0x7fffffffu));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    /* more DATA than the 1024-byte stream window granted */
    env_up(&e);
    open_stream(&e, &b, 1, "/t/s", false);
    static uint8_t big[4096];
    assert_ok(ap__frame_put_data(&b, 1, true, 4096, big, 2048));
    feed(&e, &b);
    expect_closed(&e);
    env_down(&e);
    /* more DATA than the connection window, over many streams */
    env_up(&e);
    static uint8_t chunk[60000];
    uint32_t sent = 0;
    for (uint32_t sid = 1; sent <= AP_MUX_CONN_WINDOW && !e.fk.closed; sid += 2) {
        /* hellos are exempt from stream credit but not from connection credit;
         * the RPC handler cap (100) refuses them after the START, which still
         * costs connection credit */
        assert_ok(ap__frame_put_open(&b, sid, false, 1024, "/t/s"));
        assert_ok(ap__frame_put_data(&b, sid, true, 8000, chunk, 8000));
        feed(&e, &b);
        sent += 8000;
        if (sid > 4000) break;
    }
    (void)chunk;
    /* the node acknowledged connection credit as it consumed bytes, so an
     * honest flood of hellos never overflows: the connection stays up */
    assert_false(e.fk.closed);
    env_down(&e);
    ap__buf_free(&b);
}

static void test_message_over_cap(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    env_t e;
    env_up(&e);
    open_stream(&e, &b, 1, "/t/s", false);
    /* max_msg is 8192: the stream is reset, the connection stays */
    assert_ok(ap__frame_put_data(&b, 1, true, 1u << 30, (const uint8_t *)"x", 1));
    feed(&e, &b);
    assert_false(e.fk.closed);
    env_run(&e);
    /* RPC request over the handler's 100-byte cap: refused with EMSGSIZE */
    static uint8_t req[200];
    assert_ok(ap__frame_put_open(&b, 3, true, 1024, "/t/r"));
    assert_ok(ap__frame_put_data(&b, 3, true, sizeof req, req, sizeof req));
    feed(&e, &b);
    assert_false(e.fk.closed);
    assert_int_equal(e.served, 0);
    env_run(&e);
    /* find RESET frames in the output: stream 1 and 3, EMSGSIZE */
    ap_frame_dec_t *d = malloc(sizeof *d);
    ap__frame_dec_init(d);
    frames_t *fs = calloc(1, sizeof *fs);
    assert_ok(ap__frame_dec_feed(d, e.fk.out.data, e.fk.out.len, collect, fs));
    int resets = 0;
    for (int i = 0; i < fs->n; i++) {
        if (fs->f[i].type != AP_FRAME_RESET) continue;
        int code;
        char msg[AP_FRAME_RESET_MSG_MAX + 1];
        assert_ok(ap__frame_parse_reset(&fs->f[i], &code, msg, sizeof msg));
        assert_int_equal(code, AP_EMSGSIZE);
        resets++;
    }
    assert_int_equal(resets, 2);
    free(fs);
    free(d);
    ap__buf_free(&b);
    env_down(&e);
}

static void test_too_many_streams(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    env_t e;
    env_up(&e);
    /* OPENs without hello: each holds a slot */
    for (uint32_t i = 0; i < AP_MUX_MAX_STREAMS + 10; i++)
        assert_ok(ap__frame_put_open(&b, 1 + 2 * i, false, 1024, "/t/s"));
    feed(&e, &b);
    assert_false(e.fk.closed);
    assert_int_equal(g_warns, 1); /* one line per connection, not per refusal */
    env_run(&e);
    ap_frame_dec_t *d = malloc(sizeof *d);
    ap__frame_dec_init(d);
    frames_t *fs = calloc(1, sizeof *fs);
    assert_ok(ap__frame_dec_feed(d, e.fk.out.data, e.fk.out.len, collect, fs));
    assert_int_equal(fs->n, 10);
    for (int i = 0; i < fs->n; i++) assert_int_equal(fs->f[i].type, AP_FRAME_RESET);
    free(fs);
    free(d);
    ap__buf_free(&b);
    env_down(&e);
}

static void test_bad_reset_and_close(void **state)
{
    (void)state;
    env_t e;
    env_up(&e);
    uint8_t fr[AP_FRAME_HDR + 3] = {0};
    hdr(fr, AP_FRAME_RESET, 0, 1, 3); /* code 0 is not an error */
    ap__mux_feed(e.mc, fr, sizeof fr);
    expect_closed(&e);
    env_down(&e);
    env_up(&e);
    uint8_t cl[AP_FRAME_HDR + 1] = {0};
    hdr(cl, AP_FRAME_CLOSE, 0, 1, 1); /* CLOSE carries no payload */
    ap__mux_feed(e.mc, cl, sizeof cl);
    expect_closed(&e);
    env_down(&e);
}

static void test_peer_buffer_cap(void **state)
{
    (void)state;
    ap_buf_t b = {0};
    env_t e;
    env_up(&e);
    /* partial 1 MiB hellos: each START reserves its total; the 65th would
     * take the peer over the 64 MiB per-connection cap and is reset */
    uint32_t n = AP_MUX_CONN_MEM_MAX / (1u << 20);
    for (uint32_t i = 0; i <= n; i++) {
        assert_ok(ap__frame_put_open(&b, 1 + 2 * i, false, 1024, "/t/big"));
        assert_ok(ap__frame_put_data(&b, 1 + 2 * i, true, 1u << 20, (const uint8_t *)"x", 1));
    }
    feed(&e, &b);
    assert_false(e.fk.closed);
    assert_int_equal(e.mc->rx_buffered, (size_t)n << 20);
    assert_int_equal(g_warns, 1); /* one line for the refused stream */
    assert_non_null(strstr(g_log, e.peer_short));
    env_run(&e);
    ap_frame_dec_t *d = malloc(sizeof *d);
    ap__frame_dec_init(d);
    frames_t *fs = calloc(1, sizeof *fs);
    assert_ok(ap__frame_dec_feed(d, e.fk.out.data, e.fk.out.len, collect, fs));
    assert_int_equal(fs->n, 1);
    assert_int_equal(fs->f[0].type, AP_FRAME_RESET);
    assert_int_equal(fs->f[0].sid, 1 + 2 * n);
    int code;
    char msg[AP_FRAME_RESET_MSG_MAX + 1];
    assert_ok(ap__frame_parse_reset(&fs->f[0], &code, msg, sizeof msg));
    assert_int_equal(code, AP_ELIMIT);
    free(fs);
    free(d);
    ap__buf_free(&b);
    env_down(&e);
}

int main(void)
{
    ap_log_set_sink(sink, NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codec_roundtrip),
        cmocka_unit_test(test_codec_rejects),
        cmocka_unit_test(test_valid_open_accepts),
        cmocka_unit_test(test_unknown_type),
        cmocka_unit_test(test_goaway),
        cmocka_unit_test(test_oversized_header),
        cmocka_unit_test(test_truncated_payload),
        cmocka_unit_test(test_stream_id_misuse),
        cmocka_unit_test(test_window_overflow),
        cmocka_unit_test(test_message_over_cap),
        cmocka_unit_test(test_too_many_streams),
        cmocka_unit_test(test_bad_reset_and_close),
        cmocka_unit_test(test_peer_buffer_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
