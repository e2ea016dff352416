/* libp2p connections over real loopback sockets under admission: many
 * connections stalled mid-handshake from one address (127.0.0.2) fill only
 * that address's handshake scope in the resource manager; a libp2p peer
 * from another address (127.0.0.1) still connects; the stalled ones are
 * closed at the handshake deadline and their scope is empty again. */
#include "aptest.h"

#include "apiary/identity.h"
#include "base/rcmgr.h"
#include "p2p/p2p_conn.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#define NSTALLED 24

typedef struct ctx {
    uv_loop_t loop;
    ap_p2p_conn_t *conn;
    bool ready, closed;
} ctx_t;

static void ready(ap_p2p_conn_t *c, void *arg)
{
    (void)c;
    ((ctx_t *)arg)->ready = true;
}
static void closed(ap_p2p_conn_t *c, void *arg, int st)
{
    (void)c;
    (void)st;
    ((ctx_t *)arg)->closed = true;
}
static const ap_p2p_conn_cbs_t cbs = {ready, closed};

#define RUN_UNTIL(x, cond)                                                                         \
    do {                                                                                           \
        for (int ap__i = 0; !(cond) && ap__i < 100000; ap__i++) uv_run(&(x)->loop, UV_RUN_ONCE);   \
        assert_true(cond);                                                                         \
    } while (0)

static void ident(ap_identity_t *id, uint8_t b)
{
    uint8_t seed[32];
    memset(seed, b, sizeof seed);
    assert_ok(ap_identity_from_seed(id, seed));
}

static void ip4(uint8_t ip[16], const char *s)
{
    memset(ip, 0, 16);
    ip[10] = ip[11] = 0xff;
    assert_int_equal(inet_pton(AF_INET, s, ip + 12), 1);
}

/* A socket from 127.0.0.2 to port that sends only the first bytes of
 * multistream-select and then nothing. */
static int stalled(uint16_t port)
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
    assert_int_equal(send(fd, part, sizeof part, MSG_NOSIGNAL), (ssize_t)sizeof part);
    return fd;
}

/* The socket was closed by the other end (EOF or reset), without waiting. */
static bool peer_closed(int fd)
{
    uint8_t b[64];
    for (;;) {
        ssize_t n = recv(fd, b, sizeof b, MSG_DONTWAIT);
        if (n == 0) return true;
        if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    }
}

static bool all_closed(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (!peer_closed(fds[i])) return false;
    return true;
}

static void test_stalled_from_one_ip(void **state)
{
    (void)state;
    static ctx_t x;
    memset(&x, 0, sizeof x);
    uv_loop_init(&x.loop);
    ap_identity_t ida, idb;
    ident(&ida, 7);
    ident(&idb, 8);
    ap_rcmgr_t *m = ap_rcmgr_new(NULL);
    assert_non_null(m);
    const uint32_t per_ip = ap_rcmgr_config(m)->hs_per_ip;
    assert_true(per_ip < NSTALLED);
    ap_p2p_host_t *a = ap__p2p_host_new(&x.loop, &ida, "apiary-test/a");
    ap_p2p_host_t *b = ap__p2p_host_new(&x.loop, &idb, "apiary-test/b");
    assert_non_null(a);
    assert_non_null(b);
    ap__p2p_host_set_rcmgr(a, m);
    ap__p2p_host_set_hs_timeout(a, 400);
    assert_ok(ap__p2p_host_serve_basics(a));
    ap_multiaddr_t ma, bound;
    assert_ok(ap_multiaddr_parse(&ma, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(a, &ma, &bound));
    bound.has_peer = true;
    bound.peer = ida.id;

    uint8_t bad[16], good[16];
    ip4(bad, "127.0.0.2");
    ip4(good, "127.0.0.1");
    int fds[NSTALLED];
    for (int i = 0; i < NSTALLED; i++) fds[i] = stalled(bound.port);
    /* every one is accepted: per_ip are counted, the rest refused (closed) */
    RUN_UNTIL(&x, ap_rc_hs_count(m, bad) == per_ip && ap_rcmgr_refusals(m) >= NSTALLED - per_ip);
    assert_int_equal(ap_rcmgr_refusals(m), NSTALLED - per_ip);
    assert_int_equal(ap_rc_hs_total(m), per_ip);

    /* a peer from another address connects while they stall */
    assert_ok(ap__p2p_dial(b, &bound, &cbs, &x, &x.conn));
    RUN_UNTIL(&x, x.ready || x.closed);
    assert_true(x.ready);
    assert_false(x.closed);
    /* the listener's side of its handshake ends once the last message is in */
    RUN_UNTIL(&x, ap_rc_hs_count(m, good) == 0);
    assert_int_equal(ap_rc_hs_count(m, bad), per_ip);

    /* the deadline closes the stalled ones; the connected peer stays */
    RUN_UNTIL(&x, ap_rc_hs_total(m) == 0 && all_closed(fds, NSTALLED));
    assert_int_equal(ap_rc_hs_count(m, bad), 0);
    assert_false(x.closed);
    for (int i = 0; i < NSTALLED; i++) close(fds[i]);

    ap__p2p_host_free(a);
    ap__p2p_host_free(b);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&x.loop), 0);
    assert_int_equal(ap_rc_hs_total(m), 0);
    ap_rcmgr_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stalled_from_one_ip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
