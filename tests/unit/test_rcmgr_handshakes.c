/* Resource manager: handshakes in progress are counted per remote IP and in
 * the transient scope; one address stalling many handshakes reaches its own
 * limit and leaves room for peers from other addresses. */
#include "aptest.h"

#include "apiary/error.h"
#include "base/rcmgr.h"

#include <stdio.h>
#include <string.h>

static void ip4(uint8_t ip[16], uint8_t a, uint8_t b, uint8_t c, uint8_t d)
{
    memset(ip, 0, 16);
    ip[10] = ip[11] = 0xff;
    ip[12] = a;
    ip[13] = b;
    ip[14] = c;
    ip[15] = d;
}

/* 1,000 handshakes from one address: at most hs_per_ip are counted, the
 * rest refused in that address's scope; a new peer from another address
 * still begins its handshake. */
static void test_one_ip_cannot_lock_out(void **state)
{
    (void)state;
    ap_rcmgr_t *m = ap_rcmgr_new(NULL);
    assert_non_null(m);
    const ap_rcmgr_config_t *c = ap_rcmgr_config(m);
    assert_int_equal(c->hs_per_ip, 16);
    assert_int_equal(c->hs_transient, 256);
    uint8_t a[16], b[16];
    ip4(a, 10, 0, 0, 1);
    ip4(b, 10, 0, 0, 2);
    uint32_t ok = 0, refused = 0;
    for (int i = 0; i < 1000; i++) {
        ap_rc_scope_t *full = NULL;
        int rc = ap_rc_hs_begin(m, a, &full);
        if (rc == 0) {
            ok++;
        } else {
            assert_int_equal(rc, AP_ELIMIT);
            assert_non_null(full);
            assert_int_equal(ap_rc_scope_kind(full), AP_RC_IP);
            refused++;
        }
    }
    assert_int_equal(ok, c->hs_per_ip);
    assert_int_equal(refused, 1000 - c->hs_per_ip);
    assert_int_equal(ap_rc_hs_count(m, a), c->hs_per_ip);
    assert_int_equal(ap_rc_hs_total(m), c->hs_per_ip);
    assert_int_equal(ap_rcmgr_refusals(m), 1000 - c->hs_per_ip);
    /* another address is not refused */
    ap_rc_scope_t *full = NULL;
    assert_ok(ap_rc_hs_begin(m, b, &full));
    assert_int_equal(ap_rc_hs_count(m, b), 1);
    /* the scope is named in the refusal */
    assert_int_equal(ap_rc_hs_begin(m, a, &full), AP_ELIMIT);
    char d[256];
    ap_rc_scope_describe(full, d, sizeof d);
    assert_non_null(strstr(d, "handshakes from 10.0.0.1"));
    assert_non_null(strstr(d, "conns 16/16"));
    /* ends free the address's slots */
    for (uint32_t i = 0; i < c->hs_per_ip; i++) ap_rc_hs_end(m, a);
    assert_int_equal(ap_rc_hs_count(m, a), 0);
    assert_ok(ap_rc_hs_begin(m, a, NULL));
    ap_rc_hs_end(m, a);
    ap_rc_hs_end(m, b);
    assert_int_equal(ap_rc_hs_total(m), 0);
    /* an end without a begin changes nothing */
    ap_rc_hs_end(m, a);
    assert_int_equal(ap_rc_hs_total(m), 0);
    ap_rcmgr_free(m);
}

/* The transient scope bounds the total: many addresses together fill it,
 * and a refusal names it; an end makes room again. */
static void test_transient_total(void **state)
{
    (void)state;
    ap_rcmgr_config_t cfg;
    ap_rcmgr_config_default(&cfg);
    cfg.hs_per_ip = 4;
    cfg.hs_transient = 10;
    ap_rcmgr_t *m = ap_rcmgr_new(&cfg);
    assert_non_null(m);
    uint8_t ip[16];
    uint32_t ok = 0;
    for (int k = 0; k < 5; k++) {
        ip4(ip, 192, 168, 0, (uint8_t)k);
        for (int i = 0; i < 4; i++)
            if (ap_rc_hs_begin(m, ip, NULL) == 0) ok++;
    }
    assert_int_equal(ok, 10);
    assert_int_equal(ap_rc_hs_total(m), 10);
    ap_rc_scope_t *full = NULL;
    ip4(ip, 192, 168, 1, 1);
    assert_int_equal(ap_rc_hs_begin(m, ip, &full), AP_ELIMIT);
    assert_ptr_equal(full, ap_rcmgr_transient(m));
    assert_int_equal(ap_rc_scope_kind(full), AP_RC_TRANSIENT);
    assert_int_equal(ap_rc_hs_count(m, ip), 0);
    /* the report shows the transient scope while it is in use */
    char rep[1024];
    ap_rcmgr_report(m, 4, rep, sizeof rep);
    assert_non_null(strstr(rep, "handshakes (transient): memory 0/0, streams 0/0, conns 10/10"));
    uint8_t first[16];
    ip4(first, 192, 168, 0, 0);
    ap_rc_hs_end(m, first);
    assert_ok(ap_rc_hs_begin(m, ip, NULL));
    ap_rc_hs_end(m, ip);
    for (int k = 0; k < 5; k++) {
        ip4(ip, 192, 168, 0, (uint8_t)k);
        for (int i = 0; i < 4; i++) ap_rc_hs_end(m, ip);
    }
    assert_int_equal(ap_rc_hs_total(m), 0);
    ap_rcmgr_free(m);
}

/* IPv6 addresses are scopes of their own and are named in full. */
static void test_ipv6_named(void **state)
{
    (void)state;
    ap_rcmgr_config_t cfg;
    ap_rcmgr_config_default(&cfg);
    cfg.hs_per_ip = 1;
    ap_rcmgr_t *m = ap_rcmgr_new(&cfg);
    uint8_t ip[16] = {0x20, 0x01, 0x0d, 0xb8};
    ip[15] = 1;
    assert_ok(ap_rc_hs_begin(m, ip, NULL));
    ap_rc_scope_t *full = NULL;
    assert_int_equal(ap_rc_hs_begin(m, ip, &full), AP_ELIMIT);
    char d[256];
    ap_rc_scope_describe(full, d, sizeof d);
    assert_non_null(strstr(d, "handshakes from 2001:0db8:0000:0000:0000:0000:0000:0001"));
    ip[15] = 2;
    assert_ok(ap_rc_hs_begin(m, ip, NULL));
    ap_rc_hs_end(m, ip);
    ip[15] = 1;
    ap_rc_hs_end(m, ip);
    assert_int_equal(ap_rc_hs_total(m), 0);
    ap_rcmgr_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_ip_cannot_lock_out),
        cmocka_unit_test(test_transient_total),
        cmocka_unit_test(test_ipv6_named),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
