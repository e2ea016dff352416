/* ap_stream_sendv on a driver without a gather path (ops->stream_sendv NULL):
 * runtime.c assembles the message and calls stream_send once. The drivers'
 * own gather paths are checked by the conformance suite (sim, uv, tcp). */
#include "aptest.h"

#include "runtime/rt_impl.h"

#include <stdlib.h>
#include <string.h>

static uint8_t g_got[256];
static size_t g_len;
static int g_calls;
static int g_rc;

static int fake_send(ap_stream_t *s, const uint8_t *data, size_t len)
{
    (void)s;
    g_calls++;
    if (g_rc) return g_rc;
    assert_true(len <= sizeof g_got);
    if (len) memcpy(g_got, data, len);
    g_len = len;
    return 0;
}

static const ap_rt_ops_t fops = {.name = "fake", .stream_send = fake_send};

static void test_fallback(void **state)
{
    (void)state;
    struct ap_rt rt;
    assert_ok(ap__rt_init(&rt, &fops, NULL, 1));
    struct ap_stream s = {.rt = &rt};
    const char *a = "frame-", *b = "payload";
    ap_iovec_t iov[4] = {{a, 6}, {NULL, 0}, {b, 7}, {b, 0}};
    assert_ok(ap_stream_sendv(&s, iov, 4));
    assert_int_equal(g_calls, 1);
    assert_int_equal(g_len, 13);
    assert_memory_equal(g_got, "frame-payload", 13);
    /* no pieces: one empty message */
    assert_ok(ap_stream_sendv(&s, NULL, 0));
    assert_int_equal(g_calls, 2);
    assert_int_equal(g_len, 0);
    /* the driver's answer is passed through (e.g. AP_EAGAIN) */
    g_rc = AP_EAGAIN;
    assert_int_equal(ap_stream_sendv(&s, iov, 3), AP_EAGAIN);
    assert_int_equal(g_calls, 3);
    g_rc = 0;
    /* refused before the driver is called */
    ap_iovec_t bad = {NULL, 1};
    assert_int_equal(ap_stream_sendv(&s, &bad, 1), AP_EINVAL);
    assert_int_equal(ap_stream_sendv(&s, iov, -1), AP_EINVAL);
    ap_iovec_t huge[2] = {{a, SIZE_MAX}, {b, 1}};
    assert_int_equal(ap_stream_sendv(&s, huge, 2), AP_EMSGSIZE);
    assert_int_equal(g_calls, 3);
    ap__rt_fini(&rt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fallback)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
