/* Circuit relay v2 and DCUtR through real NATs (testing/natns.h,
 * testing/nat_punch.h): a relay on the internet bridge, peers behind NAT
 * routers, each in its own process. In every round B (behind a NAT) holds
 * a reservation, A (behind another NAT) dials it through the relay, the
 * relayed connection carries DCUtR, and both dial from their listen ports.
 * - two `drop` NATs: the relayed connection reaches B in every round, the
 *   hole punch succeeds in at least 19 of 20 rounds, and after the grace
 *   period the relayed connection is closed and ping goes over the direct
 *   one;
 * - two `rst` NATs: every round ends cleanly (direct and used, or still on
 *   the relay); the success rate is printed, not asserted: a SYN reaching
 *   the other NAT before that side's own SYN left is answered with a RST,
 *   which closes the mapping on our side too, so the two SYNs must cross
 *   within the one-way delay (docs/nat.md);
 * - A behind the `symmetric` NAT: every punch fails cleanly and ping still
 *   goes over the relayed connection.
 * Skipped (cmocka skip, with the reason) when not root or without nftables. */
#include "aptest.h"

#include "nat_punch.h"
#include "natns.h"

#include "apiary/log.h"

#include <signal.h>
#include <stdlib.h>

#define ROUNDS 20
#define LIMIT  20000 /* ms a round may take */

static ap_natns_t *g_ns;

static int teardown(void **state)
{
    (void)state;
    ap_natns_free(g_ns);
    g_ns = NULL;
    return 0;
}

static int setup(void **state)
{
    (void)state;
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        return 0;
    }
    const ap_nat_kind_t kinds[6] = {AP_NAT_DROP, AP_NAT_DROP,      AP_NAT_RST,
                                    AP_NAT_RST,  AP_NAT_SYMMETRIC, AP_NAT_DROP};
    if (ap_natns_new(1, 6, kinds, &g_ns, why, sizeof why)) fail_msg("topology: %s", why);
    return 0;
}

enum { WANT_DIRECT, WANT_CLEAN, WANT_RELAY };

static void punch(size_t home_a, size_t home_b, int rounds, int want)
{
    if (!g_ns) skip();
    char why[400];
    static ap_nat_punch_round_t res[AP_NAT_PUNCH_ROUNDS];
    if (ap_nat_punch_run(g_ns, 0, home_a, home_b, rounds, LIMIT, res, why, sizeof why))
        fail_msg("%s", why);
    int direct = 0;
    for (int r = 0; r < rounds; r++) {
        print_message("%s -> %s round %d: relayed %d, %s after %d attempt(s), %.1f ms, %s\n",
                      ap_nat_kind_name(ap_natns_kind(g_ns, home_a)),
                      ap_nat_kind_name(ap_natns_kind(g_ns, home_b)), r, res[r].relayed,
                      res[r].status == 0 ? "direct" : ap_err_name(res[r].status), res[r].attempts,
                      res[r].ms_direct,
                      res[r].status == 0
                          ? (res[r].direct_used ? "ping over direct" : "NOT USED")
                          : (res[r].relayed_alive ? "ping over relay" : "RELAY LOST"));
        assert_int_equal(res[r].relayed, 1);
        if (res[r].status == 0) {
            direct++;
            assert_int_equal(res[r].direct_used, 1);
        } else {
            assert_int_equal(res[r].relayed_alive, 1);
        }
    }
    print_message("holepunch %d/%d\n", direct, rounds);
    if (want == WANT_DIRECT) assert_true(direct * 20 >= rounds * 19);
    if (want == WANT_RELAY) assert_int_equal(direct, 0);
}

static void test_punch_drop(void **state)
{
    (void)state;
    punch(0, 1, ROUNDS, WANT_DIRECT);
}

static void test_punch_rst(void **state)
{
    (void)state;
    punch(2, 3, ROUNDS, WANT_CLEAN);
}

static void test_punch_symmetric(void **state)
{
    (void)state;
    punch(4, 5, 3, WANT_RELAY);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_punch_drop),
        cmocka_unit_test(test_punch_rst),
        cmocka_unit_test(test_punch_symmetric),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
