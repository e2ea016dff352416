/* The all-reduce between processes on shaped links: four namespaces on a
 * bridge (testing/netns.h), every link 20 Mbit/s each way (htb), one process
 * per member talking TCP + Noise XX from inside its namespace. Members: two
 * NORMAL, one CLIENT, one AUX. Two rounds (the second on warm connections):
 * every receiver must end with exactly the weighted mean (float32 codec,
 * integer data: the reference is exact), status 0, the whole vector
 * averaged. A loose check of the set-up: the round must take longer than its
 * payload would at 50 Mbit/s per link — if htb did not shape, veth would carry it
 * at GB/s. Skipped (cmocka skip) when not root or without netns/veth/htb. */
#include "aptest.h"

#include "allreduce_netns.h"
#include "netns.h"

#include "apiary/log.h"

#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define NH 4

static void test_shaped_allreduce_exact(void **state)
{
    (void)state;
    char why[300];
    if (ap_netns_probe(why, sizeof why)) {
        print_message("skipped: %s\n", why);
        skip();
    }
    ap_netns_link_t links[NH];
    for (int i = 0; i < NH; i++) links[i] = (ap_netns_link_t){20e6, 20e6};
    ap_netns_t *ns;
    int rc = ap_netns_new(NH, links, &ns, why, sizeof why);
    if (rc) fail_msg("namespaces: %s", why);
    char hub_path[128];
    snprintf(hub_path, sizeof hub_path, "/var/run/netns/%s", ap_netns_name(ns, NH));
    struct stat st;
    assert_int_equal(stat(hub_path, &st), 0);

    const ap_arns_peer_t peers[NH] = {{AP_AVG_NORMAL, 2.5e6, 2.5e6},
                                      {AP_AVG_NORMAL, 2.5e6, 2.5e6},
                                      {AP_AVG_CLIENT, 2.5e6, 2.5e6},
                                      {AP_AVG_AUX, 2.5e6, 2.5e6}};
    ap_arns_opts_t o = {.elems = ap_test_sanitized() ? (1u << 16) : (1u << 18),
                        .chunk_elems = 4096,
                        .codec = AP_AVG_CODEC_F32,
                        .deadline_factor = 20,
                        .connect_grace_us = 10000000,
                        .stall_min_us = 3000000,
                        .rounds = 2,
                        .round_timeout_s = 60};
    ap_arns_round_t res[2];
    rc = ap_arns_run(ns, peers, NH, &o, res, why, sizeof why);
    ap_netns_free(ns);
    /* the namespaces are gone */
    assert_int_not_equal(stat(hub_path, &st), 0);
    if (rc) fail_msg("run: %s", why);
    for (int r = 0; r < 2; r++) {
        const ap_arns_round_t *a = &res[r];
        double floor_s = (double)a->payload_bytes / (NH * 50e6 / 8);
        print_message("round %d: %.3f s (payload %.2f MB; at 50 Mbit/s per link %.3f s), "
                      "fraction %.4f, dropped %u, failed parts %u %s\n",
                      r, a->round_s, (double)a->payload_bytes / 1e6, floor_s, a->min_fraction,
                      a->senders_dropped, a->parts_failed, a->why);
        assert_int_equal(a->status, 0);
        assert_true(a->exact);
        assert_true(a->min_fraction == 1.0);
        assert_int_equal(a->senders_dropped, 0);
        assert_int_equal(a->parts_failed, 0);
        /* every member sends its data and results: the payload is known */
        assert_true(a->payload_bytes > 3 * o.elems * 4);
        assert_true(a->round_s > floor_s);
    }
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("AVG_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shaped_allreduce_exact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
