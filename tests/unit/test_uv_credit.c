/* runtime/uv mux: stream credit goes back to the sender within the transport
 * read that earned it (mux_frame.c, ap__mconn_on_read), not at the next flush a loop turn
 * later. Otherwise a receiver handed a whole window in one read burst
 * returns all of it at once, after processing it all, and the sender idles
 * meanwhile: the stream runs stop-and-wait on its window (docs/runtime-uv.md,
 * "Credit return"). Deterministic: the connection is a fake transport whose
 * written bytes the test parses, and the loop never runs between feeding
 * the peer's bytes and looking at what was written. */
#include "aptest.h"
#include "fake_conn.h"

#include "apiary/host.h"
#include "apiary/node.h"
#include "runtime/uv/frame.h"
#include "runtime/uv/uv_impl.h"

#include <string.h>

#define WINDOW (64u * 1024u)

typedef ap_test_fake_conn_t fake_t;

static size_t got_bytes;

static void on_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s;
    (void)arg;
    (void)d;
    got_bytes += n;
}

static int on_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    (void)rt;
    (void)arg;
    (void)peer;
    (void)hello;
    (void)len;
    static const ap_stream_cbs_t cbs = {.on_msg = on_msg};
    ap_stream_set_cbs(s, &cbs, NULL);
    return 0;
}

/* Sum of the stream-level WINDOW credit (not ACCEPT) for sid in f's output. */
static uint64_t credit_written(const fake_t *f, uint32_t sid)
{
    uint64_t sum = 0;
    size_t off = 0;
    while (off + AP_FRAME_HDR <= f->len) {
        ap_frame_t fr;
        assert_ok(ap__frame_parse_hdr(f->out + off, &fr));
        assert_true(off + AP_FRAME_HDR + fr.len <= f->len);
        fr.payload = f->out + off + AP_FRAME_HDR;
        if (fr.type == AP_FRAME_WINDOW && fr.sid == sid && !(fr.flags & AP_FRAME_F_ACCEPT)) {
            uint32_t d;
            assert_ok(ap__frame_parse_window(&fr, &d));
            sum += d;
        }
        off += AP_FRAME_HDR + fr.len;
    }
    assert_int_equal(off, f->len);
    return sum;
}

static void feed(ap_mconn_t *c, ap_buf_t *b)
{
    ap__mux_feed(c, b->data, b->len);
    ap__buf_reset(b);
}

static void test_credit_within_the_read(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    ap_stream_opts_t so = {.window = WINDOW};
    assert_ok(ap_rt_stream_listen(rt, "/s", &so, on_accept, NULL));

    /* an accepted connection from a peer: the peer opens odd stream ids */
    fake_t fk;
    ap_test_fake_conn_init(&fk);
    fk.conn.dialer = false;
    static const uint8_t pk[32] = {9};
    ap_peer_id_from_ed25519(&fk.conn.remote, pk);
    ap__node_accept_conn((ap_node_t *)rt, &fk.conn);
    ap_mconn_t *c = fk.conn.user;
    assert_non_null(c);

    /* the peer opens stream 1 with the same window and says hello */
    ap_buf_t b;
    ap__buf_init(&b);
    assert_ok(ap__frame_put_open(&b, 1, false, WINDOW, "/s"));
    assert_ok(ap__frame_put_data(&b, 1, true, 1, (const uint8_t *)"h", 1));
    feed(c, &b);
    ap_host_run_once(h, 0); /* ACCEPT goes out with the next flush */
    assert_true(fk.len > 0);
    assert_int_equal(credit_written(&fk, 1), 0);
    fk.len = 0;

    /* a quarter of the window in one message: its credit is written before
     * ap__mux_feed returns (the peer still holds 3/4 of the window) */
    static uint8_t msg[WINDOW];
    memset(msg, 0x5a, sizeof msg);
    uint32_t q = WINDOW / 4;
    assert_ok(ap__frame_put_data(&b, 1, true, q, msg, q));
    feed(c, &b);
    assert_int_equal(got_bytes, q);
    assert_int_equal(credit_written(&fk, 1), q);
    fk.len = 0;

    /* a message in several frames: credit for the first quarter is
     * written while the message is still incomplete, within that read */
    uint32_t big = WINDOW - 4096;
    assert_ok(ap__frame_put_data(&b, 1, true, big, msg, q));
    feed(c, &b);
    assert_int_equal(got_bytes, q); /* not delivered yet */
    assert_int_equal(credit_written(&fk, 1), q);
    fk.len = 0;
    assert_ok(ap__frame_put_data(&b, 1, false, 0, msg, big - q));
    feed(c, &b);
    assert_int_equal(got_bytes, q + big);
    assert_int_equal(credit_written(&fk, 1), big - q);
    fk.len = 0;

    /* below the threshold nothing is written: credit is batched per quarter
     * of the window, the write per read is not one per frame */
    assert_ok(ap__frame_put_data(&b, 1, true, 100, msg, 100));
    feed(c, &b);
    assert_int_equal(fk.len, 0);

    ap__buf_free(&b);
    assert_false(fk.closed);
    ap_node_free(rt);
    assert_true(fk.closed);
    assert_int_equal(ap_host_free(h), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_credit_within_the_read),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
