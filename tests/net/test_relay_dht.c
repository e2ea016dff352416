/* A peer behind a relay is found through the DHT (loopback, no root): node
 * N announces only an address where nobody listens (as a NATed peer's
 * private address is unreachable from outside) and keeps a reservation on
 * relay R, which is also the DHT both N and peer P bootstrap from. P learns
 * N's addresses only from R's FIND answers; they must carry N's circuit
 * address beside the dead direct one (src/dht/dht_circuits.c), so P's call
 * to N fails over from the dead address to the circuit and is answered
 * through R. (When FIND answers carried one direct address per contact, P
 * knew only the dead one and the call failed with EUNREACH.) */
#include "aptest.h"

#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/node.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#define CTL_PROTO "/apiary/test/relay-dht/1"

static void addr_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    char a[1][AP_RT_ADDR_MAX];
    int n = ap_rt_listen_addrs(rt, a, 1, true);
    if (n >= 1) memcpy(arg, a[0], AP_RT_ADDR_MAX);
    ap_sync_complete(done, n >= 1 ? 0 : AP_EADDR);
}

static void register_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)arg;
    ap_sync_complete(done, ap_rt_rpc_register(rt, CTL_PROTO, 0, ap_test_rpc_echo, NULL));
}

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt;
    (void)errmsg;
    ap_sync_t *done = arg;
    ap_sync_complete(done, status ? status : len == 5 && !memcmp(resp, "hello", 5) ? 0 : AP_EPROTO);
}

static void call_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_rt_t *to = arg;
    ap_rpc_opts_t o = {.timeout_us = 20000000};
    if (!ap_rt_rpc_call(rt, ap_rt_self(to), CTL_PROTO, (const uint8_t *)"hello", 5, &o, on_done,
                        done))
        ap_sync_complete(done, AP_ENOMEM);
}

static void test_found_through_relay(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    assert_ok(ap_host_start(h));
    ap_rt_t *relay, *n, *p;
    ap_node_opts_t ro = {.listen = "/ip4/127.0.0.1/tcp/0", .relay_service = true};
    assert_ok(ap_node_new(h, &ro, &relay));
    char raddr[AP_RT_ADDR_MAX];
    assert_ok(ap_node_call_sync(relay, addr_fn, raddr));
    const char *relays[1] = {raddr};
    const char *dead[1] = {"/ip4/127.0.0.1/tcp/1"};
    ap_node_opts_t no = {.listen = "/ip4/127.0.0.1/tcp/0",
                         .announce = dead,
                         .nannounce = 1,
                         .relays = relays,
                         .nrelays = 1,
                         .no_hole_punch = true};
    assert_ok(ap_node_new(h, &no, &n));
    assert_ok(ap_node_call_sync(n, register_fn, NULL));
    ap_node_relay_stats_t st = {0};
    for (int i = 0; i < 300 && st.live_reservations == 0; i++) {
        usleep(10000);
        assert_ok(ap_node_relay_stats_sync(n, &st));
    }
    assert_int_equal(st.live_reservations, 1);
    ap_node_opts_t po = {.listen = "/ip4/127.0.0.1/tcp/0"};
    assert_ok(ap_node_new(h, &po, &p));
    ap_dht_t *dr, *dn, *dp;
    assert_ok(ap_dht_new_sync(relay, NULL, &dr));
    assert_ok(ap_dht_new_sync(n, NULL, &dn));
    assert_ok(ap_dht_new_sync(p, NULL, &dp));
    const char *boot[1] = {raddr};
    assert_ok(ap_dht_bootstrap_sync(dn, boot, 1)); /* its requests carry its circuit */
    assert_ok(ap_dht_bootstrap_sync(dp, boot, 1)); /* R's answer names N with both */
    int rc = ap_node_call_sync(p, call_fn, n);
    if (rc) fail_msg("P's call to N: %s", ap_err_name(rc));
    ap_node_relay_stats_t sp;
    assert_ok(ap_node_relay_stats_sync(p, &sp));
    assert_true(sp.relayed_out >= 1); /* more when the mux drops a relayed one (docs/nat.md) */
    assert_ok(ap_dht_free_sync(dp));
    assert_ok(ap_dht_free_sync(dn));
    assert_ok(ap_dht_free_sync(dr));
    ap_node_free(p);
    ap_node_free(n);
    ap_node_free(relay);
    assert_ok(ap_host_free(h));
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_found_through_relay)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
