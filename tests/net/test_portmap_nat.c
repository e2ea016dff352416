/* Port mapping through a real gateway: a router running miniupnpd (UPnP
 * IGD and NAT-PMP, testing/natns.h AP_NAT_UPNP) in front of a home host,
 * next to a plain port-preserving NAT. Three AutoNAT servers on the bridge
 * (testing/nat_autonat.h). The client behind the UPnP router maps its
 * listen port (src/p2p/portmap.h, on the loop's worker pool), is dialled
 * back through the mapping and ends public; the mapping is gone from the
 * router once the client stopped. The same with NAT-PMP alone. The client
 * behind the plain NAT finds no gateway to ask and ends private.
 * Skipped (cmocka skip, with the reason) when not root, without nftables
 * or without miniupnpd. */
#include "aptest.h"

#include "nat_autonat.h"
#include "natns.h"

#include "apiary/error.h"
#include "apiary/log.h"
#include "p2p/autonat.h"
#include "p2p/portmap.h"
#include "p2p/reach.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LIMIT 90000 /* ms a client may take */

static ap_natns_t *g_ns;

static int teardown(void **state)
{
    (void)state;
    ap_natns_free(g_ns);
    g_ns = NULL;
    return 0;
}

static bool have_miniupnpd(void)
{
    return access("/usr/sbin/miniupnpd", X_OK) == 0;
}

static void show(const char *who, const ap_nat_autonat_result_t *r)
{
    print_message("%s: mapped %s%s%s, seen at %s, answers %s %s %s, verdict %s, %s\n", who,
                  r->mapped == 0   ? r->mapped_to
                  : r->mapped == 1 ? "(not asked)"
                                   : ap_err_name(r->mapped),
                  r->mapped == 0 ? " via " : "",
                  r->mapped == 0 ? ap__portmap_via_name((ap_portmap_via_t)r->via) : "", r->seen,
                  ap__autonat_status_name(r->st[0]), ap__autonat_status_name(r->st[1]),
                  ap__autonat_status_name(r->st[2]), ap__reach_name((ap_reach_state_t)r->state),
                  r->unmapped ? "mapping removed" : "no mapping to remove");
}

static void test_portmap_through_gateway(void **state)
{
    (void)state;
    char why[400];
    if (ap_natns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    if (!have_miniupnpd()) {
        print_message("skipped: /usr/sbin/miniupnpd is not installed (scripts/deps.sh)\n");
        skip();
    }
    const ap_nat_kind_t kinds[2] = {AP_NAT_UPNP, AP_NAT_DROP};
    if (ap_natns_new(AP_NAT_AUTONAT_SERVERS, 2, kinds, &g_ns, why, sizeof why))
        fail_msg("topology: %s", why);
    assert_int_equal(ap_natns_upnp_mappings(g_ns, 0), 0);

    /* UPnP first (discovery over SSDP), and the plain NAT at the same time */
    ap_nat_where_t where[2] = {{.home = true, .index = 0, .portmap = AP_PORTMAP_ANY},
                               {.home = true, .index = 1, .portmap = AP_PORTMAP_ANY}};
    ap_nat_autonat_result_t res[2];
    if (ap_nat_autonat_run(g_ns, where, 2, LIMIT, res, why, sizeof why)) fail_msg("%s", why);
    show("behind upnp", &res[0]);
    show("behind drop", &res[1]);
    char want[64];
    snprintf(want, sizeof want, "%s:%d", ap_natns_router_ip(g_ns, 0), AP_NAT_AUTONAT_PORT);
    assert_int_equal(res[0].mapped, 0);
    assert_int_equal(res[0].via, AP_PORTMAP_UPNP);
    assert_string_equal(res[0].mapped_to, want);
    assert_string_equal(res[0].seen, ap_natns_router_ip(g_ns, 0));
    for (int i = 0; i < AP_NAT_AUTONAT_SERVERS; i++) assert_int_equal(res[0].st[i], AP_AUTONAT_OK);
    assert_int_equal(res[0].state, AP_REACH_PUBLIC);
    assert_true(res[0].unmapped);
    assert_true(ap_natns_upnp_log_has(g_ns, 0, "AddPortMapping"));
    assert_int_equal(ap_natns_upnp_mappings(g_ns, 0), 0);

    assert_int_not_equal(res[1].mapped, 0);
    assert_int_equal(res[1].state, AP_REACH_PRIVATE);

    /* NAT-PMP alone */
    ap_nat_where_t pmp = {.home = true, .index = 0, .portmap = AP_PORTMAP_NATPMP};
    if (ap_nat_autonat_run(g_ns, &pmp, 1, LIMIT, res, why, sizeof why)) fail_msg("%s", why);
    show("behind upnp, NAT-PMP", &res[0]);
    assert_int_equal(res[0].mapped, 0);
    assert_int_equal(res[0].via, AP_PORTMAP_NATPMP);
    assert_string_equal(res[0].mapped_to, want);
    assert_int_equal(res[0].state, AP_REACH_PUBLIC);
    assert_true(res[0].unmapped);
    assert_true(ap_natns_upnp_log_has(g_ns, 0, "NAT-PMP port mapping request"));
    assert_int_equal(ap_natns_upnp_mappings(g_ns, 0), 0);

    /* without a mapping the same host is private */
    ap_nat_where_t none = {.home = true, .index = 0};
    if (ap_nat_autonat_run(g_ns, &none, 1, LIMIT, res, why, sizeof why)) fail_msg("%s", why);
    show("behind upnp, no mapping", &res[0]);
    assert_int_equal(res[0].state, AP_REACH_PRIVATE);
    teardown(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_portmap_through_gateway, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
