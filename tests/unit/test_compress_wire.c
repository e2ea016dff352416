/* Chunk header version 2 (compact): byte layout, round trips against
 * version 1 for every codec, size and offset, derived rand-k seeds,
 * re-framing between versions, and untrusted input (truncated, oversized,
 * non-canonical, wrong version). */
#include "aptest.h"

#include "apiary/compress.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define V2 AP_COMPRESS_COMPACT
#define NS (AP_COMPRESS_COMPACT | AP_COMPRESS_NO_SEED)

static void fill(float *x, size_t n, uint64_t s)
{
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 4 - 2);
    }
}

/* The spec's examples, byte for byte. */
static void test_layout(void **state)
{
    (void)state;
    float x[100];
    fill(x, 100, 1);
    uint8_t out[512];
    size_t len;
    ap_codec_cfg_t rk = {.id = AP_CODEC_RANDK, .k = 2, .seed = 5};
    assert_ok(ap_compress_encode_ex(&rk, x, 100, 0, NS, out, sizeof out, &len));
    assert_int_equal(len, 4 + 8); /* tag, codec 8, count 100, k 2, two floats */
    const uint8_t want[] = {0xA6, 0x08, 100, 2};
    assert_memory_equal(out, want, 4);
    assert_int_equal(ap_compress_size_ex(&rk, 100, 0, NS), len);
    assert_ok(ap_compress_encode_ex(&rk, x, 100, 0, V2, out, sizeof out, &len));
    assert_int_equal(len, 4 + 8 + 8); /* with the seed */
    assert_int_equal(out[1], 0x48);
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    assert_ok(ap_compress_encode_ex(&none, x, 100, 300, V2, out, sizeof out, &len));
    const uint8_t want2[] = {0xA6, 0x10, 100, 0xAC, 0x02}; /* offset 300 = 0xAC 0x02 */
    assert_memory_equal(out, want2, 5);
    assert_int_equal(len, 5 + 400);
    assert_memory_equal(out + 5, x, 400);
    ap_codec_cfg_t bw = {.id = AP_CODEC_BLOCKWISE8};
    assert_ok(ap_compress_encode_ex(&bw, x, 100, 0, V2, out, sizeof out, &len));
    const uint8_t want3[] = {0xA6, 0x06, 100}; /* default block size: not sent */
    assert_memory_equal(out, want3, 3);
    assert_int_equal(len, 3 + 4 + 100);
    ap_compress_hdr_t h;
    assert_ok(ap_compress_parse(out, len, &h));
    assert_int_equal(h.version, 2);
    assert_int_equal(h.hdr_len, 3);
    assert_int_equal(h.param, AP_COMPRESS_BLOCK);
    assert_int_equal(h.payload_len, 104);
    assert_false(h.has_seed);
    /* version 1 is unchanged */
    assert_ok(ap_compress_encode(&bw, x, 100, 0, out, sizeof out, &len));
    assert_int_equal(out[0], AP_COMPRESS_MAGIC);
    assert_int_equal(len, AP_COMPRESS_HDR_LEN + 104);
    assert_ok(ap_compress_parse(out, len, &h));
    assert_int_equal(h.version, 1);
    assert_int_equal(h.hdr_len, AP_COMPRESS_HDR_LEN);
}

/* Every codec, size and offset: version 2 decodes to the bits version 1
 * decodes to, its size is exact, and re-framing either way gives the bytes
 * the other encoder writes. */
static void test_roundtrip_vs_v1(void **state)
{
    (void)state;
    static const size_t sizes[] = {1, 37, 300, 5000};
    static const uint64_t offs[] = {0, 1, 1000, 1ull << 40};
    size_t cap = 64 + 4 * 5000 + 1024;
    uint8_t *a = malloc(cap), *b = malloc(cap), *c = malloc(cap);
    float *x = malloc(5000 * sizeof *x), *y1 = malloc(6000 * sizeof *y1),
          *y2 = malloc(6000 * sizeof *y2);
    assert_true(a && b && c && x && y1 && y2);
    for (int id = 0; id < AP_CODEC__COUNT; id++)
        for (size_t si = 0; si < 4; si++)
            for (size_t oi = 0; oi < 4; oi++) {
                size_t n = sizes[si];
                uint64_t off = offs[oi];
                fill(x, n, (uint64_t)id * 77 + n);
                ap_codec_cfg_t cfg = {.id = (ap_codec_id_t)id, .fraction = 0.05, .seed = 9 + n};
                size_t la, lb, lc;
                assert_ok(ap_compress_encode(&cfg, x, n, off, a, cap, &la));
                unsigned flags = id == AP_CODEC_RANDK && oi % 2 ? NS : V2;
                assert_ok(ap_compress_encode_ex(&cfg, x, n, off, flags, b, cap, &lb));
                assert_int_equal(lb, ap_compress_size_ex(&cfg, n, off, flags));
                assert_true(lb < la);
                assert_true(la - lb >= 24 - AP_COMPRESS_V2_HDR_MAX);
                /* decode both into a window around the chunk (offset 1000 max) */
                uint64_t base = off > 1000 ? off - 1000 : 0;
                size_t dn = (size_t)(off - base) + n;
                ap_compress_hdr_t ha, hb;
                /* shift the offset by re-framing is not possible: decode at
                 * the real offset only when it fits the window */
                if (off <= 1000) {
                    memset(y1, 0, dn * sizeof *y1);
                    memset(y2, 0xff, dn * sizeof *y2);
                    assert_ok(ap_compress_decode(a, la, y1, dn, &ha));
                    assert_ok(ap_compress_decode_seeded(b, lb, cfg.seed, y2, dn, &hb));
                    assert_memory_equal(y1 + off, y2 + off, n * sizeof *y1);
                    assert_int_equal(ha.count, hb.count);
                    assert_int_equal(ha.offset, hb.offset);
                    assert_int_equal(ha.param, hb.param);
                    assert_int_equal(ha.payload_len,
                                     hb.payload_len +
                                         (id == AP_CODEC_RANDK && !hb.has_seed ? 8 : 0));
                    /* accumulate mode agrees too */
                    memset(y1, 0, dn * sizeof *y1);
                    memset(y2, 0, dn * sizeof *y2);
                    assert_ok(ap_compress_decode_add(a, la, 0.5f, y1, dn, NULL));
                    assert_ok(ap_compress_decode_add_seeded(b, lb, cfg.seed, 0.5f, y2, dn, NULL));
                    assert_memory_equal(y1, y2, dn * sizeof *y1);
                }
                /* re-frame v2 -> v1 == the v1 encoder's bytes, and back */
                assert_ok(ap_compress_reframe(b, lb, true, cfg.seed, 0, c, cap, &lc));
                assert_int_equal(lc, la);
                assert_memory_equal(c, a, la);
                assert_ok(ap_compress_reframe(a, la, false, 0, flags, c, cap, &lc));
                assert_int_equal(lc, lb);
                assert_memory_equal(c, b, lb);
                /* too small an output buffer */
                assert_int_equal(ap_compress_reframe(a, la, false, 0, flags, c, lb - 1, &lc),
                                 AP_EMSGSIZE);
            }
    free(a);
    free(b);
    free(c);
    free(x);
    free(y1);
    free(y2);
}

/* A chunk without its seed needs the receiver's seed: without it, decoding
 * and re-framing to a seeded form fail cleanly; with a wrong one the
 * indices differ. */
static void test_derived_seed(void **state)
{
    (void)state;
    float x[1000], y[1000], z[1000];
    fill(x, 1000, 3);
    ap_codec_cfg_t rk = {.id = AP_CODEC_RANDK, .k = 20, .seed = 1234};
    uint8_t out[256], re[256];
    size_t len, rl;
    assert_ok(ap_compress_encode_ex(&rk, x, 1000, 0, NS, out, sizeof out, &len));
    assert_int_equal(ap_compress_decode(out, len, y, 1000, NULL), AP_EPROTO);
    assert_int_equal(ap_compress_decode_add(out, len, 1, y, 1000, NULL), AP_EPROTO);
    assert_int_equal(ap_compress_reframe(out, len, false, 0, 0, re, sizeof re, &rl), AP_EPROTO);
    assert_ok(ap_compress_reframe(out, len, false, 0, NS, re, sizeof re, &rl)); /* as it is */
    assert_int_equal(rl, len);
    assert_ok(ap_compress_decode_seeded(out, len, 1234, y, 1000, NULL));
    assert_ok(ap_compress_decode_seeded(out, len, 1235, z, 1000, NULL));
    int same = 0, nz = 0;
    for (int i = 0; i < 1000; i++) {
        if (y[i] != 0) nz++;
        if (y[i] != 0 && z[i] == y[i]) same++;
    }
    assert_int_equal(nz, 20);
    assert_true(same < 20);
    /* every kept value is x * n/k at its index */
    for (int i = 0; i < 1000; i++)
        if (y[i] != 0) assert_true(fabsf(y[i] - x[i] * 50.0f) <= 1e-5f * fabsf(y[i]));
    /* a seed in the chunk wins over the receiver's */
    assert_ok(ap_compress_encode_ex(&rk, x, 1000, 0, V2, out, sizeof out, &len));
    assert_ok(ap_compress_decode_seeded(out, len, 999, z, 1000, NULL));
    assert_memory_equal(y, z, sizeof y);
    /* error feedback through a seedless encoding keeps e = x - sent */
    ap_compress_ef_t *ef = ap_compress_ef_new(1000);
    assert_non_null(ef);
    assert_ok(ap_compress_ef_encode_ex(ef, &rk, x, 1000, 0, NS, out, sizeof out, &len));
    assert_ok(ap_compress_decode_seeded(out, len, 1234, y, 1000, NULL));
    const float *e = ap_compress_ef_residual(ef);
    for (int i = 0; i < 1000; i++) assert_true(fabsf(e[i] - (x[i] - y[i])) <= 1e-4f);
    ap_compress_ef_free(ef);
    /* flags */
    assert_int_equal(
        ap_compress_encode_ex(&rk, x, 1000, 0, AP_COMPRESS_NO_SEED, out, sizeof out, &len),
        AP_EINVAL);
    assert_int_equal(ap_compress_encode_ex(&rk, x, 1000, 0, 8, out, sizeof out, &len), AP_EINVAL);
    assert_int_equal(ap_compress_size_ex(&rk, 1000, 0, AP_COMPRESS_NO_SEED), 0);
}

/* Untrusted version 2 headers. */
static void test_bad_v2(void **state)
{
    (void)state;
    float x[300], y[300];
    fill(x, 300, 5);
    for (int id = 0; id < AP_CODEC__COUNT; id++) {
        ap_codec_cfg_t c = {.id = (ap_codec_id_t)id, .k = 7, .seed = 3};
        uint8_t out[4096], bad[4096];
        size_t len;
        assert_ok(ap_compress_encode_ex(&c, x, 300, 0, V2, out, sizeof out, &len));
        /* truncated at every length, one byte extra */
        for (size_t l = 0; l < len; l++)
            assert_true(ap_compress_decode_seeded(out, l, 3, y, 300, NULL) < 0);
        memcpy(bad, out, len);
        bad[len] = 0;
        assert_int_equal(ap_compress_decode(bad, len + 1, y, 300, NULL), AP_ECORRUPT);
        /* count 300 = 0xAC 0x02 at bytes 2..3 */
        assert_int_equal(out[2], 0xAC);
        assert_int_equal(out[3], 0x02);
        /* later version, not a chunk, unknown codec, reserved bit */
        memcpy(bad, out, len);
        bad[0] = 0xA7;
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_EVERSION);
        bad[0] = 0xB0;
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        memcpy(bad, out, len);
        bad[1] = (uint8_t)((bad[1] & 0xf0) | 9);
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ENOTSUP);
        memcpy(bad, out, len);
        bad[1] |= 0x80;
        assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        /* a seed bit on another codec / a block bit on another codec */
        if (id != AP_CODEC_RANDK) {
            memcpy(bad, out, len);
            bad[1] |= 0x40;
            assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        }
        if (id != AP_CODEC_BLOCKWISE8) {
            memcpy(bad, out, len);
            bad[1] |= 0x20;
            assert_int_equal(ap_compress_decode(bad, len, y, 300, NULL), AP_ECORRUPT);
        }
        /* count that does not match the payload (dense codecs) */
        if (id != AP_CODEC_TOPK && id != AP_CODEC_RANDK) {
            memcpy(bad, out, len);
            bad[2] = 0xAD; /* 301 */
            assert_int_equal(ap_compress_decode(bad, len, y, 400, NULL), AP_ECORRUPT);
        }
        /* overlong count varint: 300 as 0xAC 0x82 0x00 */
        memcpy(bad, out, 4);
        bad[3] = 0x82;
        bad[4] = 0x00;
        memcpy(bad + 5, out + 4, len - 4);
        assert_int_equal(ap_compress_decode(bad, len + 1, y, 300, NULL), AP_ECORRUPT);
        /* an explicit zero offset is not canonical */
        memcpy(bad, out, 4);
        bad[1] |= 0x10;
        bad[4] = 0;
        memcpy(bad + 5, out + 4, len - 4);
        assert_int_equal(ap_compress_decode(bad, len + 1, y, 300, NULL), AP_ECORRUPT);
        /* chunk outside the destination */
        assert_int_equal(ap_compress_decode_seeded(out, len, 3, y, 299, NULL), AP_ERANGE);
    }
    uint8_t b[64];
    /* oversized count: 2^28 + 1 elements of none */
    const uint8_t big[] = {0xA6, 0x00, 0x81, 0x80, 0x80, 0x80, 0x01};
    assert_int_equal(ap_compress_parse(big, sizeof big, NULL), AP_ECORRUPT);
    /* six-byte count varint */
    const uint8_t longv[] = {0xA6, 0x00, 0x81, 0x80, 0x80, 0x80, 0x80, 0x00};
    assert_int_equal(ap_compress_parse(longv, sizeof longv, NULL), AP_ECORRUPT);
    /* offset + count overflows: count 1, offset 2^64 - 1 (ten bytes) */
    uint8_t ov[] = {0xA6, 0x10, 1,    0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                    0xff, 0xff, 0xff, 0x01, 0,    0,    0,    0};
    assert_int_equal(ap_compress_parse(ov, sizeof ov, NULL), AP_ECORRUPT);
    /* an offset beyond 64 bits */
    ov[12] = 0x02;
    assert_int_equal(ap_compress_parse(ov, sizeof ov, NULL), AP_ECORRUPT);
    /* k > count; blockwise8 block size 0, 2^20 + 1, or the default 4096 sent */
    const uint8_t kbig[] = {0xA6, 0x07, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0,
                            0,    0,    0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    assert_int_equal(ap_compress_parse(kbig, sizeof kbig, NULL), AP_ECORRUPT);
    const uint8_t b0[] = {0xA6, 0x26, 1, 0, 0, 0, 0, 0, 0};
    assert_int_equal(ap_compress_parse(b0, sizeof b0, NULL), AP_ECORRUPT);
    const uint8_t bdef[] = {0xA6, 0x26, 1, 0x80, 0x20, 0, 0, 0, 0, 0};
    assert_int_equal(ap_compress_parse(bdef, sizeof bdef, NULL), AP_ECORRUPT);
    const uint8_t bbig[] = {0xA6, 0x26, 1, 0x81, 0x80, 0x40, 0, 0, 0, 0, 0};
    assert_int_equal(ap_compress_parse(bbig, sizeof bbig, NULL), AP_ECORRUPT);
    /* a valid non-default block size decodes */
    const uint8_t b7[] = {0xA6, 0x26, 1, 7, 0, 0, 0x80, 0x3f, 0x7f};
    ap_compress_hdr_t h;
    assert_ok(ap_compress_parse(b7, sizeof b7, &h));
    assert_int_equal(h.param, 7);
    float one;
    assert_ok(ap_compress_decode(b7, sizeof b7, &one, 1, NULL));
    assert_true(one == 1.0f);
    /* too short to be a header */
    assert_int_equal(ap_compress_parse(b, 0, NULL), AP_ECORRUPT);
    b[0] = 0xA6, b[1] = 0;
    assert_int_equal(ap_compress_parse(b, 2, NULL), AP_ECORRUPT);
    assert_int_equal(ap_compress_parse(NULL, 5, NULL), AP_ECORRUPT);
}

/* Bare chunks (AP_COMPRESS_BARE): the payload alone, the same bytes as a
 * compact chunk's payload, decoded with what the receiver expects; a size
 * that disagrees, flags without BARE, COMPACT with BARE, a bad cfg or a
 * destination too small are refused and write nothing. */
static void test_bare(void **state)
{
    (void)state;
    static const ap_codec_id_t ids[] = {AP_CODEC_NONE,       AP_CODEC_FP16,     AP_CODEC_BF16,
                                        AP_CODEC_MEANSTD16,  AP_CODEC_UNIFORM8, AP_CODEC_QUANTILE8,
                                        AP_CODEC_BLOCKWISE8, AP_CODEC_TOPK,     AP_CODEC_RANDK};
    static const size_t ns[] = {1, 37, 5000};
    float x[5000], a[5000 + 8], b[5000 + 8];
    fill(x, 5000, 9);
    static uint8_t v2[30000], bare[30000];
    for (size_t ci = 0; ci < sizeof ids / sizeof ids[0]; ci++)
        for (size_t ni = 0; ni < 3; ni++)
            for (unsigned ns_seed = 0; ns_seed < 2; ns_seed++) {
                if (ns_seed && ids[ci] != AP_CODEC_RANDK) continue;
                size_t n = ns[ni];
                ap_codec_cfg_t c = {.id = ids[ci], .fraction = 0.1, .seed = 77};
                unsigned fb = AP_COMPRESS_BARE | (ns_seed ? AP_COMPRESS_NO_SEED : 0);
                unsigned f2 = AP_COMPRESS_COMPACT | (ns_seed ? AP_COMPRESS_NO_SEED : 0);
                size_t l2, lb;
                assert_ok(ap_compress_encode_ex(&c, x, n, 3, f2, v2, sizeof v2, &l2));
                assert_ok(ap_compress_encode_ex(&c, x, n, 3, fb, bare, sizeof bare, &lb));
                assert_int_equal(ap_compress_size_ex(&c, n, 3, fb), lb);
                ap_compress_hdr_t h;
                assert_ok(ap_compress_parse(v2, l2, &h));
                assert_int_equal(lb, h.payload_len);
                assert_memory_equal(bare, v2 + h.hdr_len, lb);
                memset(a, 0x55, sizeof a);
                memset(b, 0x55, sizeof b);
                assert_ok(ap_compress_decode_seeded(v2, l2, 77, a, n + 3, NULL));
                assert_ok(ap_compress_decode_bare(&c, n, 3, fb, bare, lb, b, n + 3));
                assert_memory_equal(a, b, sizeof a);
                assert_ok(ap_compress_decode_add_seeded(v2, l2, 77, 0.5f, a, n + 3, NULL));
                assert_ok(ap_compress_decode_add_bare(&c, n, 3, fb, bare, lb, 0.5f, b, n + 3));
                assert_memory_equal(a, b, sizeof a);
                /* malformed: every other length, a destination too small */
                memset(b, 0x55, sizeof b);
                memcpy(a, b, sizeof a);
                assert_int_equal(ap_compress_decode_bare(&c, n, 3, fb, bare, lb - 1, b, n + 3),
                                 AP_ECORRUPT);
                assert_int_equal(ap_compress_decode_bare(&c, n, 3, fb, bare, lb + 1, b, n + 3),
                                 AP_ECORRUPT);
                assert_int_equal(ap_compress_decode_bare(&c, n, 3, fb, bare, 0, b, n + 3),
                                 AP_ECORRUPT);
                assert_int_equal(ap_compress_decode_bare(&c, n, 3, fb, bare, lb, b, n + 2),
                                 AP_ERANGE);
                assert_memory_equal(a, b, sizeof a);
            }
    ap_codec_cfg_t c = {.id = AP_CODEC_NONE};
    float y[4] = {1, 2, 3, 4}, d[4];
    uint8_t out[64];
    size_t len;
    assert_int_equal(ap_compress_encode_ex(&c, y, 4, 0, AP_COMPRESS_BARE | AP_COMPRESS_COMPACT, out,
                                           sizeof out, &len),
                     AP_EINVAL);
    assert_int_equal(ap_compress_size_ex(&c, 4, 0, AP_COMPRESS_BARE | AP_COMPRESS_COMPACT), 0);
    assert_ok(ap_compress_encode_ex(&c, y, 4, 0, AP_COMPRESS_BARE, out, sizeof out, &len));
    assert_int_equal(len, 16);
    assert_memory_equal(out, y, 16);
    /* not a bare decode, unknown codec, count above the cap, offset overflow */
    assert_int_equal(ap_compress_decode_bare(&c, 4, 0, AP_COMPRESS_COMPACT, out, 16, d, 4),
                     AP_EINVAL);
    assert_int_equal(ap_compress_decode_bare(&c, 4, 0, AP_COMPRESS_BARE | 8u, out, 16, d, 4),
                     AP_EINVAL);
    ap_codec_cfg_t bad = {.id = AP_CODEC__COUNT};
    assert_int_equal(ap_compress_decode_bare(&bad, 4, 0, AP_COMPRESS_BARE, out, 16, d, 4),
                     AP_EINVAL);
    assert_int_equal(ap_compress_decode_bare(&c, (size_t)AP_COMPRESS_MAX_COUNT + 1, 0,
                                             AP_COMPRESS_BARE, out, 16, d, 4),
                     AP_EINVAL);
    assert_int_equal(
        ap_compress_decode_bare(&c, 4, UINT64_MAX - 2, AP_COMPRESS_BARE, out, 16, d, 4), AP_EINVAL);
    /* a bare chunk is nothing to ap_compress_parse: it must not be taken for one */
    ap_codec_cfg_t rk = {.id = AP_CODEC_RANDK, .k = 2};
    assert_int_equal(
        ap_compress_decode_bare(&rk, 100, 0, AP_COMPRESS_BARE | AP_COMPRESS_NO_SEED, out, 16, d, 4),
        AP_ECORRUPT);
    /* a non-finite value in a bare randk payload is refused like a framed one */
    float inf[2] = {INFINITY, 1};
    memcpy(out, inf, 8);
    float big[100];
    assert_int_equal(ap_compress_decode_bare(&rk, 100, 0, AP_COMPRESS_BARE | AP_COMPRESS_NO_SEED,
                                             out, 8, big, 100),
                     AP_ECORRUPT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout),       cmocka_unit_test(test_roundtrip_vs_v1),
        cmocka_unit_test(test_derived_seed), cmocka_unit_test(test_bad_v2),
        cmocka_unit_test(test_bare),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
