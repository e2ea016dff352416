/* Two `apiary train --relays` peers, each behind its own NAT (conntrack,
 * nftables masquerade, port-preserving, unsolicited packets dropped; 15 ms
 * of netem delay each way at each router, so 60 ms between the homes), and
 * a public `apiary dht --relay-service` node, the only address they are
 * given (tests/lib/natrelay.h). They meet in its DHT, reach each other
 * through a circuit on it, hole-punch (DCUtR) to a direct connection that
 * replaces the relayed one, and average over it: both train the whole run
 * in groups of 2. The counters each prints at exit show the relayed
 * connection (in at one, out at the other) and the move to direct.
 * Skipped (cmocka skip) when not root, without nftables or netem. */
#include "aptest.h"
#include "natrelay.h"

#include <signal.h>

static void test_relayed_then_direct(void **state)
{
    (void)state;
    ap_natrelay_opts_t o = {.delay_ms = 15, .duration_s = 25};
    ap_natrelay_peer_t p[2];
    ap_natrelay_run(&o, p);
    ap_natrelay_print("home 0", &p[0]);
    ap_natrelay_print("home 1", &p[1]);
    for (size_t k = 0; k < 2; k++) {
        assert_int_equal(p[k].status, 0);
        assert_true(p[k].have_stats);
        assert_true(p[k].reservations >= 1);
        assert_true(p[k].epochs >= 3);
        /* averaging (a bulk protocol) ran between them: over a direct
         * connection, since neither allows bulk over a relay */
        assert_true(p[k].group2);
        assert_int_equal((int)p[k].bulk_refused, 0); /* no bulk call went to the relay */
    }
    /* the side whose punched connection replaced its relayed one counts the
     * move (the other accepts the direct connection as any inbound one) */
    assert_true(p[0].moved + p[1].moved >= 1);
    /* the connection started relayed: opened through the relay by one,
     * accepted from it by the other */
    assert_true(p[0].relayed_in + p[1].relayed_in >= 1);
    assert_true(p[0].relayed_out + p[1].relayed_out >= 1);
    /* and the hole punch made the direct one */
    assert_true(p[0].direct + p[1].direct >= 1);
    assert_true(p[0].punch_line[0] || p[1].punch_line[0]);
    ap_natrelay_teardown(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_relayed_then_direct, ap_natrelay_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
