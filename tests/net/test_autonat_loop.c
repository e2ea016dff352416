/* AutoNAT v1 client and server over loopback, in one loop (no root
 * needed): a client whose listen address answers is told OK with that
 * address; an address where nothing listens gets E_DIAL_ERROR; an address
 * at another IP than the request's is refused without a dial; a malformed
 * request gets E_BAD_REQUEST and the server keeps serving; one-shot
 * identify reports the observed address. Both hosts are freed at the end
 * and the loop runs dry (ASan checks nothing leaks). */
#include "aptest.h"
#include "p2ptest.h"

#include "apiary/identity.h"
#include "apiary/log.h"
#include "p2p/autonat_uv.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

typedef struct answer {
    bool done;
    int status;
    bool has_addr;
    ap_multiaddr_t addr;
    char text[AP_AUTONAT_TEXT_MAX + 1];
} answer_t;

static void on_answer(void *arg, int status, const ap_multiaddr_t *addr, const char *text)
{
    answer_t *a = arg;
    a->done = true;
    a->status = status;
    a->has_addr = addr != NULL;
    if (addr) a->addr = *addr;
    snprintf(a->text, sizeof a->text, "%s", text ? text : "");
}

typedef struct idres {
    bool done;
    int status;
    bool has_observed;
    ap_multiaddr_t observed;
} idres_t;

static void on_identify(void *arg, int status, const ap_identify_t *id)
{
    idres_t *r = arg;
    r->done = true;
    r->status = status;
    if (id) {
        r->has_observed = id->has_observed;
        r->observed = id->observed;
    }
}

/* A raw AutoNAT stream that sends garbage and records the answer. */
typedef struct raw {
    uint8_t buf[256];
    size_t len;
    bool closed;
} raw_t;

static void raw_open(ap_p2p_stream_t *s)
{
    static const uint8_t junk[] = {0x03, 0xff, 0xff, 0xff};
    assert_ok(ap__p2p_stream_write(s, junk, sizeof junk));
}
static void raw_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    raw_t *r = ap__p2p_stream_udata(s);
    if (n > sizeof r->buf - r->len) n = sizeof r->buf - r->len;
    memcpy(r->buf + r->len, p, n);
    r->len += n;
}
static void raw_fin(ap_p2p_stream_t *s)
{
    ((raw_t *)ap__p2p_stream_udata(s))->closed = true; /* the answer is complete */
}
static void raw_close(ap_p2p_stream_t *s, int st)
{
    ((raw_t *)ap__p2p_stream_udata(s))->closed = true;
}
static const ap_p2p_proto_t raw_proto = {AP_AUTONAT_PROTO, raw_open, raw_data, raw_fin, raw_close};

typedef struct rawconn {
    raw_t *r;
    bool ready, closed;
    ap_p2p_conn_t *c;
} rawconn_t;

static void rc_ready(ap_p2p_conn_t *c, void *arg)
{
    rawconn_t *x = arg;
    x->ready = true;
    assert_ok(ap__p2p_stream_open(c, &raw_proto, x->r, NULL));
}
static void rc_closed(ap_p2p_conn_t *c, void *arg, int st)
{
    ((rawconn_t *)arg)->closed = true;
}

static int g_freed;
static void freed(void *arg)
{
    (void)arg;
    g_freed++;
}

static void test_autonat_loopback(void **state)
{
    (void)state;
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    ap_identity_t sid = ap_test_ident(1), cid = ap_test_ident(2);
    ap_p2p_host_t *srv = ap__p2p_host_new(&loop, &sid, "apiary-test");
    ap_p2p_host_t *cli = ap__p2p_host_new(&loop, &cid, "apiary-test");
    assert_non_null(srv);
    assert_non_null(cli);
    assert_ok(ap__p2p_host_serve_basics(srv));
    assert_ok(ap__p2p_host_serve_basics(cli));
    ap_autonat_service_t *svc = ap__autonat_serve(srv, 3000);
    assert_non_null(svc);
    ap_multiaddr_t any, sb, cb;
    assert_ok(ap_multiaddr_parse(&any, "/ip4/127.0.0.1/tcp/0"));
    assert_ok(ap__p2p_host_listen(srv, &any, &sb));
    assert_ok(ap__p2p_host_listen(cli, &any, &cb));
    sb.has_peer = true;
    sb.peer = sid.id;

    /* identify: the server sees us at 127.0.0.1 */
    idres_t ir = {0};
    assert_ok(ap__p2p_identify_peer(cli, &sb, 10000, on_identify, &ir));
    AP_TEST_RUN_UNTIL(&loop, ir.done);
    assert_int_equal(ir.status, 0);
    assert_true(ir.has_observed);
    assert_int_equal(ir.observed.ip[0], 127);

    /* our listen address answers */
    answer_t a = {0};
    assert_ok(ap__autonat_probe(cli, &sb, &cb, 1, 10000, on_answer, &a));
    AP_TEST_RUN_UNTIL(&loop, a.done);
    print_message("listen address: %s (%s)\n", ap__autonat_status_name(a.status), a.text);
    assert_int_equal(a.status, AP_AUTONAT_OK);
    assert_true(a.has_addr);
    assert_int_equal(a.addr.port, cb.port);

    /* nothing listens there: the server's own port + 1 is unlikely to be
     * anyone's; a refusal comes at once on loopback */
    ap_multiaddr_t dead = cb;
    assert_ok(ap_multiaddr_parse(&dead, "/ip4/127.0.0.1/tcp/1"));
    answer_t b = {0};
    assert_ok(ap__autonat_probe(cli, &sb, &dead, 1, 10000, on_answer, &b));
    AP_TEST_RUN_UNTIL(&loop, b.done);
    print_message("dead address: %s (%s)\n", ap__autonat_status_name(b.status), b.text);
    assert_int_equal(b.status, AP_AUTONAT_E_DIAL_ERROR);

    /* another IP than the request's: refused, nothing dialled */
    ap_multiaddr_t other;
    assert_ok(ap_multiaddr_parse(&other, "/ip4/127.0.0.2/tcp/4001"));
    answer_t c = {0};
    assert_ok(ap__autonat_probe(cli, &sb, &other, 1, 10000, on_answer, &c));
    AP_TEST_RUN_UNTIL(&loop, c.done);
    print_message("third party: %s (%s)\n", ap__autonat_status_name(c.status), c.text);
    assert_int_equal(c.status, AP_AUTONAT_E_DIAL_REFUSED);

    /* garbage: answered E_BAD_REQUEST (from a third identity: the rate
     * limit allows 3 requests per peer) */
    ap_identity_t jid = ap_test_ident(3);
    ap_p2p_host_t *junk = ap__p2p_host_new(&loop, &jid, "apiary-test");
    raw_t r = {0};
    rawconn_t rc = {.r = &r};
    assert_ok(ap__p2p_dial(junk, &sb, &(ap_p2p_conn_cbs_t){rc_ready, rc_closed}, &rc, &rc.c));
    AP_TEST_RUN_UNTIL(&loop, r.closed);
    size_t hl, bl;
    assert_int_equal(ap__autonat_frame(r.buf, r.len, &hl, &bl), 1);
    ap_autonat_msg_t m;
    assert_ok(ap__autonat_decode(r.buf + hl, bl, &m));
    print_message("garbage: %s (%s)\n", ap__autonat_status_name(m.status), m.text);
    assert_int_equal(m.status, AP_AUTONAT_E_BAD_REQUEST);

    /* the server still serves */
    answer_t d = {0};
    ap_identity_t did = ap_test_ident(4);
    ap_p2p_host_t *cli2 = ap__p2p_host_new(&loop, &did, "apiary-test");
    assert_ok(ap__autonat_probe(cli2, &sb, &dead, 1, 10000, on_answer, &d));
    AP_TEST_RUN_UNTIL(&loop, d.done);
    assert_int_equal(d.status, AP_AUTONAT_E_DIAL_ERROR);

    ap_autonat_stats_t st = ap__autonat_service_stats(svc);
    assert_int_equal(st.ok, 1);
    assert_int_equal(st.dial_error, 2);
    assert_int_equal(st.refused, 1);
    assert_int_equal(st.bad, 1);

    ap__p2p_host_free_then(srv, freed, NULL);
    ap__p2p_host_free_then(cli, freed, NULL);
    ap__p2p_host_free_then(cli2, freed, NULL);
    ap__p2p_host_free_then(junk, freed, NULL);
    AP_TEST_RUN_UNTIL(&loop, g_freed == 4);
    ap__autonat_service_free(svc);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(getenv("NAT_VERBOSE") ? AP_LOG_DEBUG : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_autonat_loopback),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
