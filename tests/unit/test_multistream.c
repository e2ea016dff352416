/* multistream-select 1.0: the wire bytes of the spec's examples, pipelined
 * and byte-at-a-time negotiation between our two sides, na / fall-back, ls,
 * the bytes after the negotiation left for the protocol, and every bound
 * (oversized, malformed, non-minimal, wrong header, endless proposals). */
#include "aptest.h"

#include "base/varint.h"
#include "p2p/multistream.h"

#include <stdio.h>
#include <string.h>

static const char *const dht[] = {"/apiary/dht/1"};
static const char *const pref[] = {"/apiary/mux/2", "/yamux/1.0.0"};
static const char *const both[] = {"/yamux/1.0.0", "/apiary/mux/2", "/ipfs/ping/1.0.0"};
static const char *const yamux_only[] = {"/yamux/1.0.0"};

/* Moves a's output into b, k bytes per feed (0 = all at once); appends what b
 * did not consume to rest. Returns b's feed result. */
static int pump(ap_mss_t *a, ap_mss_t *b, size_t k, uint8_t *rest, size_t *rest_len)
{
    size_t n;
    const uint8_t *o = ap__mss_output(a, &n);
    uint8_t buf[AP_MSS_OUT_MAX];
    memcpy(buf, o, n);
    ap__mss_output_done(a);
    size_t off = 0;
    while (off < n) {
        size_t step = k && k < n - off ? k : n - off, used = 0;
        int rc = ap__mss_feed(b, buf + off, step, &used);
        if (rc) return rc;
        if (used < step) { /* done: the rest is the protocol's */
            memcpy(rest + *rest_len, buf + off + used, n - off - used);
            *rest_len += n - off - used;
            return 0;
        }
        off += step;
    }
    return 0;
}

static void negotiate(const char *const *ip, size_t in, const char *const *rp, size_t rn, size_t k,
                      const char *want)
{
    ap_mss_t i, r;
    uint8_t rest[64];
    size_t rl = 0;
    assert_ok(ap__mss_init(&i, true, ip, in));
    assert_ok(ap__mss_init(&r, false, rp, rn));
    for (int round = 0; round < 8; round++) {
        int rc = pump(&i, &r, k, rest, &rl);
        if (rc) {
            assert_null(want);
            return;
        }
        rc = pump(&r, &i, k, rest, &rl);
        if (rc) {
            assert_null(want);
            assert_int_equal(rc, AP_ENOPROTO);
            return;
        }
        if (ap__mss_state(&i) == AP_MSS_DONE) break;
    }
    assert_non_null(want);
    assert_int_equal(ap__mss_state(&i), AP_MSS_DONE);
    assert_int_equal(ap__mss_state(&r), AP_MSS_DONE);
    assert_string_equal(ap__mss_selected(&i), want);
    assert_string_equal(ap__mss_selected(&r), want);
    assert_int_equal(rl, 0);
}

static void test_wire_bytes(void **state)
{
    (void)state;
    /* "na\n" is 03 6e 61 0a (the spec's example) */
    uint8_t out[16];
    assert_int_equal(ap__mss_put_line(out, sizeof out, "na", 2), 4);
    assert_memory_equal(out, "\x03na\n", 4);
    assert_int_equal(ap__mss_put_line(out, 3, "na", 2), AP_EMSGSIZE);
    /* an initiator opens with the header and its first proposal */
    ap_mss_t m;
    assert_ok(ap__mss_init(&m, true, dht, 1));
    size_t n;
    const uint8_t *o = ap__mss_output(&m, &n);
    const char want[] = "\x13/multistream/1.0.0\n\x0e/apiary/dht/1\n";
    assert_int_equal(n, sizeof want - 1);
    assert_memory_equal(o, want, n);
    ap__mss_output_done(&m);
    ap__mss_output(&m, &n);
    assert_int_equal(n, 0);
    /* a responder opens with the header alone */
    assert_ok(ap__mss_init(&m, false, dht, 1));
    o = ap__mss_output(&m, &n);
    assert_int_equal(n, 20);
    assert_memory_equal(o, want, 20);
    assert_null(ap__mss_selected(&m));
}

static void test_negotiate(void **state)
{
    (void)state;
    for (size_t k = 0; k <= 3; k++) {
        negotiate(dht, 1, dht, 1, k, "/apiary/dht/1");
        negotiate(pref, 2, both, 3, k, "/apiary/mux/2");      /* first proposal */
        negotiate(pref, 2, yamux_only, 1, k, "/yamux/1.0.0"); /* after one na */
        negotiate(pref, 2, dht, 1, k, NULL);                  /* nothing in common */
    }
}

static void test_leftover_bytes(void **state)
{
    (void)state;
    /* a lazy initiator's header, proposal and first protocol bytes in one read */
    ap_mss_t r;
    assert_ok(ap__mss_init(&r, false, both, 3));
    const char in[] = "\x13/multistream/1.0.0\n\x11/ipfs/ping/1.0.0\nPINGDATA";
    size_t used;
    assert_ok(ap__mss_feed(&r, (const uint8_t *)in, sizeof in - 1, &used));
    assert_int_equal(ap__mss_state(&r), AP_MSS_DONE);
    assert_int_equal(used, sizeof in - 1 - 8);
    assert_string_equal(ap__mss_selected(&r), "/ipfs/ping/1.0.0");
    size_t n;
    const uint8_t *o = ap__mss_output(&r, &n);
    assert_int_equal(n, 20 + 18);
    assert_memory_equal(o + 20, "\x11/ipfs/ping/1.0.0\n", 18);
    /* once done, feed takes nothing more */
    assert_ok(ap__mss_feed(&r, (const uint8_t *)"x", 1, &used));
    assert_int_equal(used, 0);
    /* the initiator side: header + echo + data */
    ap_mss_t i;
    assert_ok(ap__mss_init(&i, true, dht, 1));
    const char in2[] = "\x13/multistream/1.0.0\n\x0e/apiary/dht/1\n\x01\x02";
    assert_ok(ap__mss_feed(&i, (const uint8_t *)in2, sizeof in2 - 1, &used));
    assert_int_equal(ap__mss_state(&i), AP_MSS_DONE);
    assert_int_equal(used, sizeof in2 - 1 - 2);
}

static void test_ls_and_na(void **state)
{
    (void)state;
    ap_mss_t r;
    assert_ok(ap__mss_init(&r, false, both, 3));
    ap__mss_output_done(&r);
    const char in[] = "\x13/multistream/1.0.0\n\x03ls\n\x08/nope/1\n";
    size_t used, n;
    assert_ok(ap__mss_feed(&r, (const uint8_t *)in, sizeof in - 1, &used));
    assert_int_equal(used, sizeof in - 1);
    assert_int_equal(ap__mss_state(&r), AP_MSS_RUNNING);
    const uint8_t *o = ap__mss_output(&r, &n);
    /* ls answer: varint(body) body, body = lines + "\n" */
    uint64_t bl;
    int k = ap__mf_uvarint_get(o, n, &bl);
    assert_int_equal(k, 1);
    const char body[] = "\x0d/yamux/1.0.0\n\x0e/apiary/mux/2\n\x11/ipfs/ping/1.0.0\n\n";
    assert_int_equal(bl, sizeof body - 1);
    assert_memory_equal(o + 1, body, bl);
    /* then na for the unknown protocol, and nothing else changed */
    assert_int_equal(n, 1 + bl + 4);
    assert_memory_equal(o + 1 + bl, "\x03na\n", 4);
    ap__mss_output_done(&r);
    assert_ok(ap__mss_feed(&r, (const uint8_t *)"\x0d/yamux/1.0.0\n", 14, &used));
    assert_int_equal(ap__mss_state(&r), AP_MSS_DONE);
    assert_string_equal(ap__mss_selected(&r), "/yamux/1.0.0");
}

static void test_output_backpressure(void **state)
{
    (void)state;
    /* many ls requests in one read: feed stops when the output is full and
     * continues once it was sent; nothing is lost */
    ap_mss_t r;
    assert_ok(ap__mss_init(&r, false, both, 3));
    uint8_t in[20 + 100 * 4];
    memcpy(in, "\x13/multistream/1.0.0\n", 20);
    for (int i = 0; i < 100; i++) memcpy(in + 20 + 4 * i, "\x03ls\n", 4);
    size_t off = 0, answers = 0, rounds = 0;
    while (off < sizeof in || r.in_len) {
        size_t used, n;
        assert_ok(ap__mss_feed(&r, in + off, sizeof in - off, &used));
        off += used;
        const uint8_t *o = ap__mss_output(&r, &n);
        for (size_t p = 0; p < n;) {
            uint64_t l;
            int k = ap__mf_uvarint_get(o + p, n - p, &l);
            assert_true(k > 0);
            if (l > 20) answers++;
            p += (size_t)k + l;
        }
        ap__mss_output_done(&r);
        assert_true(++rounds < 100);
    }
    assert_int_equal(answers, 100);
    assert_true(rounds > 1);
}

static void expect_fail(bool initiator, const char *const *protos, size_t n, const uint8_t *in,
                        size_t len, int err)
{
    ap_mss_t m;
    assert_ok(ap__mss_init(&m, initiator, protos, n));
    size_t used;
    int rc = ap__mss_feed(&m, in, len, &used);
    if (rc != err) fail_msg("got %s, want %s", ap_err_name(rc), ap_err_name(err));
    assert_int_equal(ap__mss_state(&m), AP_MSS_FAILED);
    /* sticky */
    assert_int_equal(ap__mss_feed(&m, in, len, &used), err);
    assert_int_equal(used, 0);
}

#define S(x) (const uint8_t *)(x), sizeof(x) - 1

static void test_bad_input(void **state)
{
    (void)state;
    expect_fail(false, dht, 1, S("\x13/multistream/2.0.0\n"), AP_EPROTO); /* wrong header */
    expect_fail(false, dht, 1, S("\x13/multistream/1.0.0X"), AP_EPROTO);  /* no newline */
    expect_fail(false, dht, 1, S("\x81\x08"), AP_EMSGSIZE);               /* 1025 */
    expect_fail(false, dht, 1, S("\x80\x00"), AP_EPROTO);                 /* non-minimal */
    expect_fail(false, dht, 1, S("\xff\xff\xff\xff\xff\xff\xff\xff\xff"), AP_EPROTO); /* long */
    expect_fail(false, dht, 1, S("\x00"), AP_EPROTO);                                 /* empty */
    expect_fail(false, dht, 1, S("\x01\n"), AP_EPROTO);                           /* blank line */
    expect_fail(false, dht, 1, S("\x14/multistream/1.0.0\n\n"), AP_EPROTO);       /* \n inside */
    expect_fail(false, dht, 1, S("\x03n\0\n"), AP_EPROTO);                        /* NUL inside */
    expect_fail(true, dht, 1, S("\x03na\n"), AP_EPROTO);                          /* no header */
    expect_fail(true, dht, 1, S("\x13/multistream/1.0.0\n\x04/dh\n"), AP_EPROTO); /* wrong echo */
    expect_fail(true, dht, 1, S("\x13/multistream/1.0.0\n\x03na\n"), AP_ENOPROTO);
    /* endless proposals */
    uint8_t in[20 + 40 * 4];
    memcpy(in, "\x13/multistream/1.0.0\n", 20);
    for (int i = 0; i < 40; i++) memcpy(in + 20 + 4 * i, "\x03/x\n", 4);
    ap_mss_t m;
    assert_ok(ap__mss_init(&m, false, dht, 1));
    size_t used;
    assert_int_equal(ap__mss_feed(&m, in, sizeof in, &used), AP_ENOPROTO);
    assert_int_equal(m.tries, AP_MSS_TRIES_MAX);
    /* a long proposal we cannot speak is answered na, not an error */
    uint8_t longp[20 + 2 + 600];
    memcpy(longp, "\x13/multistream/1.0.0\n", 20);
    longp[20] = 0x80 | (601 & 0x7f);
    longp[21] = 601 >> 7;
    memset(longp + 22, 'a', 599);
    longp[22 + 599] = '\n';
    assert_ok(ap__mss_init(&m, false, dht, 1));
    assert_ok(ap__mss_feed(&m, longp, 22 + 600, &used));
    assert_int_equal(used, 22 + 600);
    assert_int_equal(ap__mss_state(&m), AP_MSS_RUNNING);
    /* bad protocol lists are refused at init */
    const char *const bad1[] = {""};
    const char *const bad2[] = {"/a\nb"};
    char big[AP_MSS_PROTO_MAX + 2];
    memset(big, 'b', sizeof big - 1);
    big[sizeof big - 1] = 0;
    const char *const bad3[] = {big};
    assert_int_equal(ap__mss_init(&m, true, bad1, 1), AP_EINVAL);
    assert_int_equal(ap__mss_init(&m, true, bad2, 1), AP_EINVAL);
    assert_int_equal(ap__mss_init(&m, false, bad3, 1), AP_EINVAL);
    assert_int_equal(ap__mss_init(&m, true, dht, 0), AP_EINVAL);
}

static void test_mf_varint(void **state)
{
    (void)state;
    uint64_t v;
    assert_int_equal(ap__mf_uvarint_get((const uint8_t *)"\x7f", 1, &v), 1);
    assert_int_equal(v, 127);
    assert_int_equal(ap__mf_uvarint_get((const uint8_t *)"\x80\x01", 2, &v), 2);
    assert_int_equal(v, 128);
    assert_int_equal(ap__mf_uvarint_get((const uint8_t *)"\x80", 1, &v), AP_EAGAIN);
    assert_int_equal(ap__mf_uvarint_get((const uint8_t *)"\x80\x00", 2, &v), AP_ECORRUPT);
    /* 9 bytes is the most: 2^63 - 1 fits, a tenth byte never */
    const uint8_t max9[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f};
    assert_int_equal(ap__mf_uvarint_get(max9, 9, &v), 9);
    assert_true(v == INT64_MAX);
    const uint8_t ten[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
    assert_int_equal(ap__mf_uvarint_get(ten, 10, &v), AP_ECORRUPT);
    assert_int_equal(ap__mf_uvarint_get(ten, 9, &v), AP_ECORRUPT);
    assert_int_equal(ap__mf_uvarint_get(ten, 8, &v), AP_EAGAIN);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_bytes),          cmocka_unit_test(test_negotiate),
        cmocka_unit_test(test_leftover_bytes),      cmocka_unit_test(test_ls_and_na),
        cmocka_unit_test(test_output_backpressure), cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_mf_varint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
