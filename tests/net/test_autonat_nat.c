/* AutoNAT v1 through real NATs (testing/natns.h): three public AutoNAT
 * servers on the internet bridge; clients on the bridge and behind each
 * kind of NAT (drop, rst, symmetric), each a libp2p host listening on its
 * port in its own process. A client learns its public IP from identify's
 * observed addresses (believed once all three servers report it), asks
 * every server to dial it back at that IP and its listen port, and feeds
 * the answers to the reachability state machine. The public client must
 * end public (every answer OK), every NATed one private (every answer
 * E_DIAL_ERROR); a request to dial a third party's address is refused.
 * Skipped (cmocka skip, with the reason) when not root or without nftables. */
#include "aptest.h"

#include "nat_autonat.h"
#include "natns.h"

#include "apiary/log.h"
#include "p2p/autonat.h"
#include "p2p/reach.h"

#include <signal.h>
#include <stdlib.h>

#define NCL   4     /* public, drop, rst, symmetric */
#define LIMIT 90000 /* ms a client may take */

static ap_natns_t *g_ns;

static int teardown(void **state)
{
    (void)state;
    ap_natns_free(g_ns);
    g_ns = NULL;
    return 0;
}

static void test_autonat_through_nats(void **state)
{
    (void)state;
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    const ap_nat_kind_t kinds[3] = {AP_NAT_DROP, AP_NAT_RST, AP_NAT_SYMMETRIC};
    if (ap_natns_new(AP_NAT_AUTONAT_SERVERS + 1, 3, kinds, &g_ns, why, sizeof why))
        fail_msg("topology: %s", why);
    /* clients: on the bridge (the public node after the servers), then home k */
    ap_nat_where_t where[NCL] = {
        {.home = false, .index = AP_NAT_AUTONAT_SERVERS, .ask_third = true},
        {.home = true, .index = 0},
        {.home = true, .index = 1},
        {.home = true, .index = 2}};
    ap_nat_autonat_result_t res[NCL];
    if (ap_nat_autonat_run(g_ns, where, NCL, LIMIT, res, why, sizeof why)) fail_msg("%s", why);
    int correct = 0;
    for (size_t k = 0; k < NCL; k++) {
        const ap_nat_autonat_result_t *r = &res[k];
        const char *where_s = k == 0 ? "public" : ap_nat_kind_name(kinds[k - 1]);
        const char *want_ip = k == 0 ? ap_natns_public_ip(g_ns, AP_NAT_AUTONAT_SERVERS)
                                     : ap_natns_router_ip(g_ns, k - 1);
        print_message("client %s: seen at %s, answers %s %s %s, verdict %s\n", where_s, r->seen,
                      ap__autonat_status_name(r->st[0]), ap__autonat_status_name(r->st[1]),
                      ap__autonat_status_name(r->st[2]),
                      ap__reach_name((ap_reach_state_t)r->state));
        int want = k == 0 ? AP_AUTONAT_OK : AP_AUTONAT_E_DIAL_ERROR;
        assert_string_equal(r->seen, want_ip);
        for (int i = 0; i < AP_NAT_AUTONAT_SERVERS; i++) assert_int_equal(r->st[i], want);
        assert_int_equal(r->state, k == 0 ? AP_REACH_PUBLIC : AP_REACH_PRIVATE);
        correct++;
    }
    print_message("third-party dial request: %s\n", ap__autonat_status_name(res[0].third));
    assert_int_equal(res[0].third, AP_AUTONAT_E_DIAL_REFUSED);
    print_message("autonat_correct %d/%d\n", correct, NCL);
    teardown(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_autonat_through_nats, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
