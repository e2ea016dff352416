/* The addresses a TCP node gives its peers (runtime/uv, addrs.c) and how a
 * peer with several addresses is reached:
 * - a wildcard listen address (0.0.0.0) is advertised as interface
 *   addresses with the bound port, never as 0.0.0.0;
 * - announced addresses replace the listen address; malformed ones, or one
 *   with another node's /p2p/ id, are refused;
 * - a call to a peer whose newest address is dead (refused) or belongs to
 *   another node (its Noise identity differs) moves on to the peer's older
 *   addresses and succeeds. */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/multiaddr.h"
#include "apiary/node.h"
#include "apiary/runtime.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define WAIT_US (10u * 1000u * 1000u)

typedef struct call {
    bool done;
    int status;
} call_t;

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt;
    (void)resp;
    (void)len;
    (void)errmsg;
    call_t *c = arg;
    c->status = status;
    c->done = true;
}

static bool call_done(void *arg)
{
    return ((call_t *)arg)->done;
}

static void test_wildcard_is_expanded(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_rt_t *rt;
    ap_node_opts_t o = {.listen = "/ip4/0.0.0.0/tcp/0"};
    assert_ok(ap_node_new(h, &o, &rt));
    char a[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int n = ap_rt_listen_addrs(rt, a, AP_NODE_MAX_ANNOUNCE, false);
    assert_true(n >= 1);
    for (int i = 0; i < n && i < AP_NODE_MAX_ANNOUNCE; i++) {
        ap_multiaddr_t ma;
        assert_ok(ap_multiaddr_parse(&ma, a[i]));
        assert_int_equal(ma.host, AP_MA_HOST_IP4);
        assert_true(ma.has_tcp && ma.port != 0);
        static const uint8_t zero[4] = {0};
        assert_memory_not_equal(ma.ip, zero, 4);
        print_message("advertised %s\n", a[i]);
    }
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

static void test_announce(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_rt_t *rt, *other;
    assert_ok(ap_node_new(h, &(ap_node_opts_t){.listen = "/ip4/127.0.0.1/tcp/0"}, &other));
    char oid[AP_PEER_ID_STR_MAX], bad[AP_RT_ADDR_MAX];
    snprintf(bad, sizeof bad, "/ip4/203.0.113.7/tcp/4001/p2p/%s",
             ap_peer_id_str(ap_rt_self(other), oid));
    const char *const refused[][1] = {
        {"/ip4/203.0.113.7"}, {"/ip4/203.0.113.7/tcp/0"}, {"not an address"}, {bad}};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        ap_node_opts_t o = {
            .listen = "/ip4/127.0.0.1/tcp/0", .announce = refused[i], .nannounce = 1};
        assert_int_equal(ap_node_new(h, &o, &rt), AP_EADDR);
    }
    const char *two[] = {"/ip4/203.0.113.7/tcp/4001", "/dns4/peer.example.org/tcp/4001"};
    ap_node_opts_t o = {.listen = "/ip4/0.0.0.0/tcp/0", .announce = two, .nannounce = 2};
    assert_ok(ap_node_new(h, &o, &rt));
    char a[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(rt, a, AP_NODE_MAX_ANNOUNCE, false), 2);
    assert_string_equal(a[0], two[0]);
    assert_string_equal(a[1], two[1]);
    char id[AP_PEER_ID_STR_MAX], want[AP_RT_ADDR_MAX];
    snprintf(want, sizeof want, "%s/p2p/%s", two[0], ap_peer_id_str(ap_rt_self(rt), id));
    assert_int_equal(ap_rt_listen_addrs(rt, a, 1, true), 2);
    assert_string_equal(a[0], want);
    ap_node_free(rt);
    /* in-process nodes have nothing to announce */
    assert_int_equal(ap_node_new(h, &(ap_node_opts_t){.announce = two, .nannounce = 1}, &rt),
                     AP_EINVAL);
    ap_node_free(other);
    assert_int_equal(ap_host_free(h), 0);
}

/* A TCP port on 127.0.0.1 with nothing listening: bound, then closed. */
static int dead_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    socklen_t sl = sizeof sa;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    close(fd);
    return ntohs(sa.sin_port);
}

static void test_call_falls_back_to_older_address(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_rt_t *a, *b, *c;
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0"};
    assert_ok(ap_node_new(h, &o, &a));
    assert_ok(ap_node_new(h, &o, &b));
    assert_ok(ap_node_new(h, &o, &c));
    assert_ok(ap_rt_rpc_register(b, "/t/ap_test_rpc_echo/1", 0, ap_test_rpc_echo, NULL));
    char good[1][AP_RT_ADDR_MAX], wrong[1][AP_RT_ADDR_MAX], dead[AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(b, good, 1, false), 1);
    assert_int_equal(ap_rt_listen_addrs(c, wrong, 1, false), 1); /* another node */
    snprintf(dead, sizeof dead, "/ip4/127.0.0.1/tcp/%d", dead_port());
    /* newest last: the dead address, then the other node's, are tried first */
    assert_ok(ap_rt_add_addr(a, ap_rt_self(b), good[0]));
    assert_ok(ap_rt_add_addr(a, ap_rt_self(b), wrong[0]));
    assert_ok(ap_rt_add_addr(a, ap_rt_self(b), dead));
    call_t r = {0};
    assert_true(ap_rt_rpc_call(a, ap_rt_self(b), "/t/ap_test_rpc_echo/1", (const uint8_t *)"hi", 2,
                               NULL, on_done, &r) != 0);
    assert_true(ap_host_run_until(h, call_done, &r, WAIT_US));
    if (r.status) fail_msg("call: %s", ap_err_name(r.status));
    /* only dead addresses: the call fails, it does not hang */
    ap_rt_t *d;
    assert_ok(ap_node_new(h, &o, &d));
    assert_ok(ap_rt_rpc_register(d, "/t/ap_test_rpc_echo/1", 0, ap_test_rpc_echo, NULL));
    snprintf(dead, sizeof dead, "/ip4/127.0.0.1/tcp/%d", dead_port());
    assert_ok(ap_rt_add_addr(a, ap_rt_self(d), dead));
    assert_ok(ap_rt_add_addr(a, ap_rt_self(d), wrong[0]));
    call_t r2 = {0};
    assert_true(ap_rt_rpc_call(a, ap_rt_self(d), "/t/ap_test_rpc_echo/1", (const uint8_t *)"hi", 2,
                               NULL, on_done, &r2) != 0);
    assert_true(ap_host_run_until(h, call_done, &r2, WAIT_US));
    assert_int_not_equal(r2.status, 0);
    ap_node_free(a);
    ap_node_free(b);
    ap_node_free(c);
    ap_node_free(d);
    assert_int_equal(ap_host_free(h), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wildcard_is_expanded),
        cmocka_unit_test(test_announce),
        cmocka_unit_test(test_call_falls_back_to_older_address),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
