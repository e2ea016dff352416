/* The echo pattern (testing/p2p_echo.h): the table-driven fill and check
 * give exactly ap_echo_byte, at any offset, length and stream. */
#include "aptest.h"
#include "p2p_echo.h"

#include <stdlib.h>
#include <string.h>

static void test_fill_matches_byte(void **state)
{
    (void)state;
    static uint8_t buf[200000];
    const uint64_t offs[] = {0, 1, 7, 65535, 65536, 65537, 131071, 3u << 20, (1ull << 32) - 5};
    const size_t lens[] = {0, 1, 8, 9, 4095, 65536, 65537, 200000};
    for (uint32_t k = 0; k < 300; k += 37)
        for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++)
            for (size_t j = 0; j < sizeof lens / sizeof lens[0]; j++) {
                ap_echo_fill(k, offs[i], buf, lens[j]);
                for (size_t x = 0; x < lens[j]; x++)
                    if (buf[x] != ap_echo_byte(k, offs[i] + x))
                        fail_msg("k %u off %llu len %zu: byte %zu differs", (unsigned)k,
                                 (unsigned long long)offs[i], lens[j], x);
                assert_true(ap_echo_check(k, offs[i], buf, lens[j]));
            }
}

static void test_check_finds_a_change(void **state)
{
    (void)state;
    static uint8_t buf[100000];
    ap_echo_fill(3, 12345, buf, sizeof buf);
    assert_true(ap_echo_check(3, 12345, buf, sizeof buf));
    assert_false(ap_echo_check(4, 12345, buf, sizeof buf)); /* another stream */
    assert_false(ap_echo_check(3, 12346, buf, sizeof buf)); /* another offset */
    for (size_t at = 0; at < sizeof buf; at += 9973) {
        buf[at] ^= 0x40;
        assert_false(ap_echo_check(3, 12345, buf, sizeof buf));
        buf[at] ^= 0x40;
    }
    buf[sizeof buf - 1] ^= 1; /* the last byte too */
    assert_false(ap_echo_check(3, 12345, buf, sizeof buf));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fill_matches_byte),
        cmocka_unit_test(test_check_finds_a_change),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
