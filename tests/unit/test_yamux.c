/* yamux: the header bytes of the spec, open / accept / data / FIN / RST
 * between two sessions wired back to back (whole reads and byte-at-a-time),
 * the 256 KiB window and back-pressure when the reader stops consuming,
 * window growth, a window overrun resetting only that stream, ping, go-away,
 * every session-level protocol error, the stream limit, and 256 concurrent
 * streams with checksums. */
#include "aptest.h"

#include "base/buf.h"
#include "p2p/yamux.h"

#include <stdlib.h>
#include <string.h>

#define NS 300

typedef struct peer {
    ap_yamux_t y;
    ap_buf_t out;
    struct peer *other;
    bool consume;  /* consume data as it arrives */
    bool checksum; /* keep a checksum of each stream's data */
    int refuse;    /* on_open result */
    int opened, fins, writable, pongs, goaways;
    uint32_t last_pong, last_goaway;
    int closed[NS * 2 + 8];
    int close_st[NS * 2 + 8];
    uint64_t got[NS * 2 + 8];
    uint32_t sum[NS * 2 + 8];
} peer_t;

static uint32_t fnv(uint32_t h, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

static void w(void *arg, const uint8_t hdr[AP_YAMUX_HDR_LEN], const uint8_t *p, size_t n)
{
    peer_t *pe = arg;
    assert_ok(ap__buf_append(&pe->out, hdr, AP_YAMUX_HDR_LEN));
    if (n) assert_ok(ap__buf_append(&pe->out, p, n));
}
static int on_open(void *arg, uint32_t id)
{
    peer_t *pe = arg;
    pe->opened++;
    return pe->refuse;
}
static void on_data(void *arg, uint32_t id, const uint8_t *p, size_t n)
{
    peer_t *pe = arg;
    pe->got[id] += n;
    if (pe->checksum) pe->sum[id] = fnv(pe->sum[id] ? pe->sum[id] : 2166136261u, p, n);
    if (pe->consume) ap__yamux_consume(&pe->y, id, n);
}
static void on_fin(void *arg, uint32_t id)
{
    ((peer_t *)arg)->fins++;
}
static void on_writable(void *arg, uint32_t id)
{
    ((peer_t *)arg)->writable++;
}
static void on_close(void *arg, uint32_t id, int st)
{
    peer_t *pe = arg;
    pe->closed[id]++;
    pe->close_st[id] = st;
}
static void on_pong(void *arg, uint32_t v)
{
    peer_t *pe = arg;
    pe->pongs++;
    pe->last_pong = v;
}
static void on_goaway(void *arg, uint32_t code)
{
    peer_t *pe = arg;
    pe->goaways++;
    pe->last_goaway = code;
}

static const ap_yamux_cbs_t cbs = {w,           on_open,  on_data, on_fin,
                                   on_writable, on_close, on_pong, on_goaway};

static void pair(peer_t *a, peer_t *b, size_t max_streams)
{
    memset(a, 0, sizeof *a);
    memset(b, 0, sizeof *b);
    a->other = b;
    b->other = a;
    a->consume = b->consume = true;
    ap__yamux_init(&a->y, true, &cbs, a, max_streams);
    ap__yamux_init(&b->y, false, &cbs, b, max_streams);
}

static void unpair(peer_t *a, peer_t *b)
{
    ap__yamux_free(&a->y, AP_ECLOSED);
    ap__yamux_free(&b->y, AP_ECLOSED);
    ap__buf_free(&a->out);
    ap__buf_free(&b->out);
}

/* Delivers a's output to b, chunk bytes per feed (0 = at once). */
static int deliver(peer_t *a, size_t chunk)
{
    ap_buf_t o = a->out;
    memset(&a->out, 0, sizeof a->out);
    int rc = 0;
    for (size_t off = 0; off < o.len && !rc;) {
        size_t n = chunk && chunk < o.len - off ? chunk : o.len - off;
        rc = ap__yamux_feed(&a->other->y, o.data + off, n);
        off += n;
    }
    ap__buf_free(&o);
    return rc;
}

static void pump(peer_t *a, peer_t *b, size_t chunk)
{
    for (int i = 0; i < 1000 && (a->out.len || b->out.len); i++) {
        assert_ok(deliver(a, chunk));
        assert_ok(deliver(b, chunk));
    }
    assert_int_equal(a->out.len + b->out.len, 0);
}

static void test_header(void **state)
{
    (void)state;
    ap_yamux_hdr_t h = {0, AP_YAMUX_WINDOW, AP_YAMUX_SYN | AP_YAMUX_ACK, 0x01020304, 0x00040000};
    uint8_t b[12];
    ap__yamux_hdr_put(b, &h);
    assert_memory_equal(b, "\x00\x01\x00\x03\x01\x02\x03\x04\x00\x04\x00\x00", 12);
    ap_yamux_hdr_t g;
    assert_ok(ap__yamux_hdr_get(b, &g));
    assert_int_equal(g.type, AP_YAMUX_WINDOW);
    assert_int_equal(g.flags, 3);
    assert_int_equal(g.stream, 0x01020304);
    assert_int_equal(g.length, 256 * 1024);
    b[0] = 1;
    assert_int_equal(ap__yamux_hdr_get(b, &g), AP_EPROTO);
    b[0] = 0;
    b[1] = 4;
    assert_int_equal(ap__yamux_hdr_get(b, &g), AP_EPROTO);
}

static void test_stream_lifecycle(void **state)
{
    (void)state;
    for (size_t chunk = 0; chunk <= 1; chunk++) {
        peer_t a, b;
        pair(&a, &b, 0);
        uint32_t id;
        assert_ok(ap__yamux_open(&a.y, &id));
        assert_int_equal(id, 1); /* the client's ids are odd */
        /* the SYN leaves as a window update with length 0 */
        assert_int_equal(a.out.len, 12);
        assert_memory_equal(a.out.data, "\x00\x01\x00\x01\x00\x00\x00\x01\x00\x00\x00\x00", 12);
        assert_int_equal(ap__yamux_send(&a.y, id, (const uint8_t *)"hello", 5), 5);
        pump(&a, &b, chunk);
        assert_int_equal(b.opened, 1);
        assert_int_equal(b.got[1], 5);
        uint32_t bid;
        assert_ok(ap__yamux_open(&b.y, &bid));
        assert_int_equal(bid, 2); /* the server's are even */
        assert_int_equal(ap__yamux_send(&b.y, 1, (const uint8_t *)"back", 4), 4);
        assert_ok(ap__yamux_close(&a.y, 1));
        assert_int_equal(ap__yamux_send(&a.y, 1, (const uint8_t *)"x", 1), AP_ECLOSED);
        pump(&a, &b, chunk);
        assert_int_equal(a.got[1], 4);
        assert_int_equal(b.fins, 1);
        assert_int_equal(b.closed[1], 0); /* half-closed: b may still send */
        assert_ok(ap__yamux_close(&b.y, 1));
        assert_int_equal(b.closed[1], 1); /* both directions done */
        assert_int_equal(b.close_st[1], 0);
        pump(&a, &b, chunk);
        assert_int_equal(a.closed[1], 1);
        assert_int_equal(a.close_st[1], 0);
        /* reset: the peer sees ERESET, we get no on_close */
        ap__yamux_reset(&b.y, 2);
        pump(&a, &b, chunk);
        assert_int_equal(a.closed[2], 1);
        assert_int_equal(a.close_st[2], AP_ERESET);
        assert_int_equal(b.closed[2], 0);
        assert_int_equal(ap__yamux_nstreams(&a.y), 0);
        assert_int_equal(ap__yamux_nstreams(&b.y), 0);
        /* a refused stream is reset */
        b.refuse = AP_ENOPROTO;
        assert_ok(ap__yamux_open(&a.y, &id));
        pump(&a, &b, chunk);
        assert_int_equal(a.closed[id], 1);
        assert_int_equal(a.close_st[id], AP_ERESET);
        unpair(&a, &b);
    }
}

static void test_backpressure_and_growth(void **state)
{
    (void)state;
    peer_t a, b;
    pair(&a, &b, 0);
    b.consume = false; /* the reader is paused */
    uint32_t id;
    assert_ok(ap__yamux_open(&a.y, &id));
    static uint8_t big[1 << 20];
    for (size_t i = 0; i < sizeof big; i++) big[i] = (uint8_t)(i * 7);
    long n = ap__yamux_send(&a.y, id, big, sizeof big);
    assert_int_equal(n, AP_YAMUX_WINDOW_INIT); /* exactly one window */
    assert_int_equal(ap__yamux_send(&a.y, id, big, 10), 0);
    pump(&a, &b, 0);
    assert_int_equal(b.got[id], AP_YAMUX_WINDOW_INIT);
    assert_int_equal(ap__yamux_send(&a.y, id, big, 10), 0); /* still full: no grant */
    assert_int_equal(a.writable, 0);
    /* the reader consumes less than half: still nothing */
    ap__yamux_consume(&b.y, id, AP_YAMUX_WINDOW_INIT / 2 - 1);
    assert_int_equal(b.out.len, 0);
    /* the rest: one grant; the sender was window-limited, so the window doubles */
    ap__yamux_consume(&b.y, id, AP_YAMUX_WINDOW_INIT);
    assert_int_equal(ap__yamux_recv_window(&b.y, id), 2 * AP_YAMUX_WINDOW_INIT);
    pump(&a, &b, 0);
    assert_int_equal(a.writable, 1);
    assert_int_equal(ap__yamux_send_window(&a.y, id), 2 * AP_YAMUX_WINDOW_INIT);
    /* keep it window-limited: the window grows to the cap and no further */
    size_t sent = AP_YAMUX_WINDOW_INIT;
    for (int i = 0; i < 8; i++) { /* 512 KiB doubles to 16 MiB in five grants */
        uint32_t win = ap__yamux_send_window(&a.y, id);
        static uint8_t chunk[AP_YAMUX_WINDOW_MAX];
        assert_int_equal(ap__yamux_send(&a.y, id, chunk, sizeof chunk), win);
        sent += win;
        pump(&a, &b, 0);
        ap__yamux_consume(&b.y, id, win);
        pump(&a, &b, 0);
    }
    assert_int_equal(ap__yamux_recv_window(&b.y, id), AP_YAMUX_WINDOW_MAX);
    assert_int_equal(b.got[id], sent);
    /* a reader that keeps up (the sender never runs dry) does not grow it */
    peer_t c, d;
    pair(&c, &d, 0);
    d.consume = false;
    assert_ok(ap__yamux_open(&c.y, &id));
    for (int i = 0; i < 8; i++) {
        assert_int_equal(ap__yamux_send(&c.y, id, big, AP_YAMUX_WINDOW_INIT / 2),
                         AP_YAMUX_WINDOW_INIT / 2);
        pump(&c, &d, 0);
        ap__yamux_consume(&d.y, id, AP_YAMUX_WINDOW_INIT / 2);
        pump(&c, &d, 0);
    }
    assert_int_equal(ap__yamux_recv_window(&d.y, id), AP_YAMUX_WINDOW_INIT);
    unpair(&a, &b);
    unpair(&c, &d);
}

/* Feeds raw bytes to b as if from a. */
static int inject(peer_t *b, uint8_t type, uint16_t flags, uint32_t id, uint32_t len,
                  const uint8_t *payload, size_t n)
{
    uint8_t h[12];
    ap_yamux_hdr_t hd = {0, type, flags, id, len};
    ap__yamux_hdr_put(h, &hd);
    int rc = ap__yamux_feed(&b->y, h, 12);
    if (rc == 0 && n) rc = ap__yamux_feed(&b->y, payload, n);
    return rc;
}

static void test_overrun(void **state)
{
    (void)state;
    peer_t a, b;
    pair(&a, &b, 0);
    b.consume = false;
    uint32_t s1, s2;
    assert_ok(ap__yamux_open(&a.y, &s1));
    assert_ok(ap__yamux_open(&a.y, &s2));
    pump(&a, &b, 0);
    static uint8_t junk[AP_YAMUX_WINDOW_INIT + 1];
    /* one byte past the window on s1: s1 is reset, the session lives */
    assert_ok(inject(&b, AP_YAMUX_DATA, 0, s1, sizeof junk, junk, sizeof junk));
    assert_int_equal(b.closed[s1], 1);
    assert_int_equal(b.close_st[s1], AP_ELIMIT);
    assert_int_equal(b.got[s1], 0);
    assert_ok(inject(&b, AP_YAMUX_DATA, 0, s2, 3, (const uint8_t *)"abc", 3));
    assert_int_equal(b.got[s2], 3);
    pump(&a, &b, 0);
    assert_int_equal(a.close_st[s1], AP_ERESET);
    /* data for an unknown stream is skipped */
    assert_ok(inject(&b, AP_YAMUX_DATA, 0, 99, 4, (const uint8_t *)"zzzz", 4));
    assert_ok(inject(&b, AP_YAMUX_DATA, 0, s2, 1, (const uint8_t *)"d", 1));
    assert_int_equal(b.got[s2], 4);
    unpair(&a, &b);
}

static void test_ping_goaway(void **state)
{
    (void)state;
    peer_t a, b;
    pair(&a, &b, 0);
    ap__yamux_ping(&a.y, 0xdeadbeef);
    pump(&a, &b, 0);
    assert_int_equal(a.pongs, 1);
    assert_int_equal(a.last_pong, 0xdeadbeef);
    assert_int_equal(b.pongs, 0);
    uint32_t id;
    ap__yamux_goaway(&b.y, AP_YAMUX_GOAWAY_NORMAL);
    assert_int_equal(ap__yamux_open(&b.y, &id), AP_ESHUTDOWN);
    /* a SYN after our go-away is refused with RST */
    assert_ok(ap__yamux_open(&a.y, &id));
    pump(&a, &b, 0);
    assert_int_equal(a.goaways, 1);
    assert_int_equal(a.last_goaway, 0);
    assert_int_equal(a.close_st[id], AP_ERESET);
    assert_int_equal(b.opened, 0);
    assert_int_equal(ap__yamux_open(&a.y, &id), AP_ESHUTDOWN);
    unpair(&a, &b);
}

static void expect_proto_error(uint8_t type, uint16_t flags, uint32_t id, uint32_t len,
                               bool open_first)
{
    peer_t a, b;
    pair(&a, &b, 0);
    if (open_first) {
        uint32_t s;
        assert_ok(ap__yamux_open(&a.y, &s));
        pump(&a, &b, 0);
    }
    assert_int_equal(inject(&b, type, flags, id, len, NULL, 0), AP_EPROTO);
    /* sticky, and b said why: Go Away with code 1 */
    assert_int_equal(ap__yamux_feed(&b.y, (const uint8_t *)"x", 1), AP_EPROTO);
    assert_int_equal(ap__yamux_open(&b.y, &id), AP_EPROTO);
    assert_int_equal(b.out.len, 12);
    assert_memory_equal(b.out.data, "\x00\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01", 12);
    unpair(&a, &b);
}

static void test_protocol_errors(void **state)
{
    (void)state;
    expect_proto_error(AP_YAMUX_DATA, 0, 0, 0, false);            /* data on stream 0 */
    expect_proto_error(AP_YAMUX_WINDOW, 0, 0, 5, false);          /* window on stream 0 */
    expect_proto_error(AP_YAMUX_PING, AP_YAMUX_SYN, 3, 0, false); /* ping on a stream */
    expect_proto_error(AP_YAMUX_GOAWAY, 0, 1, 0, false);
    expect_proto_error(AP_YAMUX_WINDOW, AP_YAMUX_SYN, 2, 0, false); /* server id from client */
    expect_proto_error(AP_YAMUX_WINDOW, AP_YAMUX_SYN, 1, 0, true);  /* SYN for a live stream */
    expect_proto_error(AP_YAMUX_WINDOW, 0, 1, UINT32_MAX, true);    /* window beyond 2^32-1 */
    /* bad version and type through the byte stream */
    peer_t a, b;
    pair(&a, &b, 0);
    assert_int_equal(
        ap__yamux_feed(&b.y, (const uint8_t *)"\x01\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00",
                       12),
        AP_EPROTO);
    unpair(&a, &b);
    pair(&a, &b, 0);
    assert_int_equal(
        ap__yamux_feed(&b.y, (const uint8_t *)"\x00\x07\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00",
                       12),
        AP_EPROTO);
    unpair(&a, &b);
}

static void test_stream_limit(void **state)
{
    (void)state;
    peer_t a, b;
    pair(&a, &b, 4);
    uint32_t id;
    for (int i = 0; i < 4; i++) assert_ok(ap__yamux_open(&a.y, &id));
    assert_int_equal(ap__yamux_open(&a.y, &id), AP_ELIMIT);
    /* the peer beyond our limit: RST, the session lives */
    for (uint32_t i = 0; i < 5; i++)
        assert_ok(inject(&a, AP_YAMUX_WINDOW, AP_YAMUX_SYN, 2 + 2 * i, 0, NULL, 0));
    assert_int_equal(a.opened, 0); /* a was full with its own four */
    pump(&a, &b, 0);
    assert_int_equal(b.opened, 4);
    unpair(&a, &b);
}

static void test_many_streams(void **state)
{
    (void)state;
    peer_t a, b;
    pair(&a, &b, 0);
    a.checksum = b.checksum = true;
    enum { N = 256, LEN = 40000 };
    static uint8_t data[LEN];
    uint32_t ids[N], want[N];
    size_t sent[N];
    for (int i = 0; i < N; i++) {
        assert_ok(ap__yamux_open(&a.y, &ids[i]));
        want[i] = 2166136261u;
        sent[i] = 0;
    }
    for (size_t round = 0; round < 10; round++) {
        for (int i = 0; i < N; i++) {
            size_t n = LEN / 10;
            for (size_t k = 0; k < n; k++) data[k] = (uint8_t)(ids[i] * 31 + sent[i] + k);
            assert_int_equal(ap__yamux_send(&a.y, ids[i], data, n), n);
            want[i] = fnv(want[i], data, n);
            sent[i] += n;
        }
        pump(&a, &b, round % 2 ? 4093 : 0);
    }
    for (int i = 0; i < N; i++) {
        assert_ok(ap__yamux_close(&a.y, ids[i]));
        assert_ok(ap__yamux_close(&b.y, ids[i]));
    }
    pump(&a, &b, 0);
    for (int i = 0; i < N; i++) {
        assert_int_equal(b.got[ids[i]], LEN);
        assert_int_equal(b.sum[ids[i]], want[i]);
        assert_int_equal(a.closed[ids[i]], 1);
        assert_int_equal(b.closed[ids[i]], 1);
    }
    assert_int_equal(ap__yamux_nstreams(&a.y), 0);
    assert_int_equal(ap__yamux_nstreams(&b.y), 0);
    unpair(&a, &b);
}

static void test_free_closes(void **state)
{
    (void)state;
    peer_t a, b;
    pair(&a, &b, 0);
    uint32_t id;
    assert_ok(ap__yamux_open(&a.y, &id));
    assert_ok(ap__yamux_open(&a.y, &id));
    ap__yamux_free(&a.y, AP_ECLOSED);
    assert_int_equal(a.closed[1] + a.closed[3], 2);
    assert_int_equal(a.close_st[3], AP_ECLOSED);
    ap__yamux_free(&b.y, AP_ECLOSED);
    ap__buf_free(&a.out);
    ap__buf_free(&b.out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_header),
        cmocka_unit_test(test_stream_lifecycle),
        cmocka_unit_test(test_backpressure_and_growth),
        cmocka_unit_test(test_overrun),
        cmocka_unit_test(test_ping_goaway),
        cmocka_unit_test(test_protocol_errors),
        cmocka_unit_test(test_stream_limit),
        cmocka_unit_test(test_many_streams),
        cmocka_unit_test(test_free_closes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
