/* Closed-run tokens: issue, text round trip, verification (forged, expired,
 * another peer's, another run's), strict decoding of untrusted bytes and
 * revocation subkeys. */
#include "aptest.h"

#include "apiary/identity.h"
#include "apiary/run_token.h"

#include <stdio.h>
#include <string.h>

static void keys(ap_identity_t *owner, ap_identity_t *peer, ap_identity_t *other)
{
    uint8_t s1[AP_IDENTITY_SEED_LEN] = {1}, s2[AP_IDENTITY_SEED_LEN] = {2},
            s3[AP_IDENTITY_SEED_LEN] = {3};
    assert_ok(ap_identity_from_seed(owner, s1));
    assert_ok(ap_identity_from_seed(peer, s2));
    assert_ok(ap_identity_from_seed(other, s3));
}

static void test_issue_verify(void **state)
{
    (void)state;
    ap_identity_t o, p, x;
    keys(&o, &p, &x);
    ap_run_token_t t;
    assert_ok(ap_run_token_issue(&o, "run-a", &p.id, 5000, &t));
    assert_ok(ap_run_token_verify(&t, &o.id, "run-a", &p.id, 4999));
    assert_ok(ap_run_token_verify(&t, &o.id, "run-a", &p.id, 5000));
    assert_int_equal(ap_run_token_verify(&t, &o.id, "run-a", &p.id, 5001), AP_EEXPIRED);
    assert_int_equal(ap_run_token_verify(&t, &o.id, "run-a", &x.id, 0), AP_EPERM);
    assert_int_equal(ap_run_token_verify(&t, &o.id, "run-b", &p.id, 0), AP_EAUTH);
    assert_int_equal(ap_run_token_verify(&t, &x.id, "run-a", &p.id, 0), AP_EAUTH);
    /* signed by another key: forged */
    ap_run_token_t f;
    assert_ok(ap_run_token_issue(&x, "run-a", &p.id, 5000, &f));
    assert_int_equal(ap_run_token_verify(&f, &o.id, "run-a", &p.id, 0), AP_EAUTH);
    /* a changed expiry breaks the signature */
    t.expires_ms += 1;
    assert_int_equal(ap_run_token_verify(&t, &o.id, "run-a", &p.id, 0), AP_EAUTH);
    assert_string_equal(ap_run_token_why(AP_EEXPIRED), "its token expired");
    assert_int_equal(ap_run_token_issue(&o, "", &p.id, 1, &t), AP_EINVAL);
}

static void test_text(void **state)
{
    (void)state;
    ap_identity_t o, p, x;
    keys(&o, &p, &x);
    ap_run_token_t t, back;
    assert_ok(ap_run_token_issue(&o, "r", &p.id, 1800000000000LL, &t));
    char text[AP_RUN_TOKEN_TEXT_MAX];
    int n = ap_run_token_format(&t, text, sizeof text);
    assert_true(n > 0 && n < AP_RUN_TOKEN_TEXT_MAX);
    assert_null(strpbrk(text, "+/= \n")); /* base64url, no padding: one shell word */
    assert_ok(ap_run_token_parse(text, &back));
    assert_memory_equal(&t, &back, sizeof t);
    char padded[AP_RUN_TOKEN_TEXT_MAX + 8];
    snprintf(padded, sizeof padded, " %s\n", text);
    assert_ok(ap_run_token_parse(padded, &back));
    assert_int_equal(ap_run_token_parse("", &back), AP_ECORRUPT);
    assert_int_equal(ap_run_token_parse("abc", &back), AP_ECORRUPT);
    text[5] = '+';
    assert_int_equal(ap_run_token_parse(text, &back), AP_ECORRUPT);
    char small[16];
    assert_int_equal(ap_run_token_format(&t, small, sizeof small), AP_EMSGSIZE);
}

static void test_unpack_strict(void **state)
{
    (void)state;
    ap_identity_t o, p, x;
    keys(&o, &p, &x);
    ap_run_token_t t, back;
    assert_ok(ap_run_token_issue(&o, "r", &p.id, 77, &t));
    uint8_t buf[AP_RUN_TOKEN_MAX];
    int n = ap_run_token_pack(&t, buf, sizeof buf);
    assert_true(n > 0);
    assert_ok(ap_run_token_unpack(buf, (size_t)n, &back));
    assert_memory_equal(&t, &back, sizeof t);
    for (int cut = 0; cut < n; cut++)
        assert_int_not_equal(ap_run_token_unpack(buf, (size_t)cut, &back), 0);
    uint8_t big[AP_RUN_TOKEN_MAX + 1];
    memset(big, 0, sizeof big);
    assert_int_equal(ap_run_token_unpack(big, sizeof big, &back), AP_ECORRUPT);
    assert_int_equal(ap_run_token_unpack(NULL, 0, &back), AP_ECORRUPT);
    /* version 2 is refused */
    assert_int_equal(buf[0], 0x08);
    buf[1] = 2;
    assert_int_equal(ap_run_token_unpack(buf, (size_t)n, &back), AP_ECORRUPT);
}

static void test_revoked_subkey(void **state)
{
    (void)state;
    ap_identity_t o, p, x;
    keys(&o, &p, &x);
    char sub[256], key[256];
    int n = ap_run_token_revoked_subkey(&o.id, &p.id, sub, sizeof sub);
    assert_true(n > 0);
    assert_int_equal(ap_run_token_revoked_key("r1", key, sizeof key), 10);
    assert_string_equal(key, "r1_revoked");
    ap_peer_id_t who;
    assert_ok(ap_run_token_revoked_peer(&o.id, (const uint8_t *)sub, (size_t)n, &who));
    assert_true(ap_peer_id_eq(&who, &p.id));
    /* another owner's subkey is not a revocation of this run */
    assert_int_equal(ap_run_token_revoked_peer(&x.id, (const uint8_t *)sub, (size_t)n, &who),
                     AP_EINVAL);
    assert_int_equal(ap_run_token_revoked_peer(&o.id, (const uint8_t *)sub, (size_t)n - 1, &who),
                     AP_EINVAL);
    assert_int_equal(ap_run_token_revoked_peer(&o.id, (const uint8_t *)"x", 1, &who), AP_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_issue_verify),
        cmocka_unit_test(test_text),
        cmocka_unit_test(test_unpack_strict),
        cmocka_unit_test(test_revoked_subkey),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
