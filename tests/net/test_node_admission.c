/* A TCP node's admission limits (ap_node_opts_t.admission) over real
 * loopback sockets: with 3 handshakes per address, 2 stalled libp2p and 3
 * stalled native handshakes from 127.0.0.2 leave 3 pending on the node's
 * port, the other 2 refused; the default would have taken all 5. */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/multiaddr.h"
#include "apiary/node.h"
#include "apiary/runtime.h"
#include "net/tcp.h"
#include "runtime/uv/uv_impl.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define WAIT_US (10u * 1000u * 1000u)

static int stalled(uint16_t port, bool libp2p)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in src = {.sin_family = AF_INET}, dst = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.2", &src.sin_addr);
    inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
    dst.sin_port = htons(port);
    assert_int_equal(bind(fd, (struct sockaddr *)&src, sizeof src), 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&dst, sizeof dst), 0);
    static const uint8_t part[] = {0x13, '/', 'm', 'u', 'l'};
    if (libp2p) assert_int_equal(send(fd, part, sizeof part, MSG_NOSIGNAL), (ssize_t)sizeof part);
    return fd;
}

typedef struct want {
    ap_rt_t *rt;
    uint32_t pending;
    uint64_t dropped;
} want_t;

static bool admitted(void *arg)
{
    want_t *w = arg;
    ap_tcp_stats_t ts;
    ap__tcp_get_stats(ap__tcpc_transport((ap_node_t *)w->rt), &ts);
    return ts.admit.pending == w->pending && ts.admit.dropped_per_ip == w->dropped;
}

static void run(uint32_t per_ip, uint32_t want_pending)
{
    ap_host_t *h = ap_host_new();
    assert_non_null(h);
    ap_node_opts_t o = {.listen = "/ip4/127.0.0.1/tcp/0",
                        .admission = {.handshakes_per_ip = per_ip}};
    ap_rt_t *rt = NULL;
    assert_ok(ap_node_new(h, &o, &rt));
    char a[1][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(rt, a, 1, false), 1);
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, a[0]));
    int fds[5];
    for (int i = 0; i < 5; i++) fds[i] = stalled(ma.port, i < 2);
    want_t w = {rt, want_pending, 5 - want_pending};
    assert_true(ap_host_run_until(h, admitted, &w, WAIT_US));
    for (int i = 0; i < 5; i++) close(fds[i]);
    ap_node_free(rt);
    assert_int_equal(ap_host_free(h), 0);
}

static void test_handshakes_per_ip(void **state)
{
    (void)state;
    run(3, 3);
}

static void test_default(void **state)
{
    (void)state;
    run(0, 5);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handshakes_per_ip),
        cmocka_unit_test(test_default),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
