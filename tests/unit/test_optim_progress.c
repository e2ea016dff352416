/* Progress records: round trip, and every kind of impossible progress is
 * refused with the documented code. */
#include "aptest.h"

#include "apiary/optim.h"

#include <math.h>
#include <string.h>

static const int64_t NOW = 1700000000000;

static ap_progress_t honest(void)
{
    ap_progress_t p = {0};
    p.epoch = 7;
    p.samples = 400;
    p.samples_per_s = 100;
    p.time_ms = NOW - 500;
    p.epoch_start_ms = NOW - 4500; /* 4 s in this epoch at 100/s */
    p.role = AP_AVG_CLIENT;
    p.up = 1e6;
    p.down = 2e6;
    p.donor = false;
    return p;
}

static int roundtrip(const ap_progress_t *in, ap_progress_t *out)
{
    uint8_t buf[256];
    int len = ap_progress_encode(in, buf, sizeof buf);
    assert_true(len > 0);
    return ap_progress_decode(buf, (size_t)len, NOW, 5000, out);
}

static void test_roundtrip(void **state)
{
    (void)state;
    ap_progress_t p = honest(), q;
    assert_ok(roundtrip(&p, &q));
    assert_int_equal(q.epoch, 7);
    assert_int_equal(q.samples, 400);
    assert_true(q.samples_per_s == 100);
    assert_int_equal(q.time_ms, p.time_ms);
    assert_int_equal(q.epoch_start_ms, p.epoch_start_ms);
    assert_int_equal(q.role, AP_AVG_CLIENT);
    assert_true(q.up == 1e6 && q.down == 2e6);
    assert_false(q.donor);
    uint8_t small[4];
    assert_int_equal(ap_progress_encode(&p, small, sizeof small), AP_EMSGSIZE);
}

static void test_impossible_refused(void **state)
{
    (void)state;
    ap_progress_t p, q;
    p = honest();
    p.samples = -1;
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    p = honest();
    p.samples_per_s = -3;
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    p = honest();
    p.samples_per_s = NAN;
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    p = honest();
    p.samples_per_s = 2 * AP_OPTIM_MAX_SPS;
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    p = honest();
    p.time_ms = NOW + 60000; /* far future */
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    p = honest();
    p.epoch_start_ms = p.time_ms + 1; /* started after it reported */
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    p = honest();
    p.samples = 5000; /* 4 s at 100/s cannot give 5000 */
    assert_int_equal(roundtrip(&p, &q), AP_ELIMIT);
    p = honest();
    p.samples_per_s = 0;
    p.samples = 2; /* samples with no speed at all */
    assert_int_equal(roundtrip(&p, &q), AP_ELIMIT);
    p = honest();
    p.role = (ap_avg_role_t)3;
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    p = honest();
    p.up = INFINITY;
    assert_int_equal(roundtrip(&p, &q), AP_ERANGE);
    /* slightly in the future is clock skew, accepted */
    p = honest();
    p.time_ms = NOW + 3000;
    assert_ok(roundtrip(&p, &q));
    /* garbage */
    uint8_t junk[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    assert_int_equal(ap_progress_decode(junk, sizeof junk, NOW, 5000, &q), AP_ECORRUPT);
}

static void test_config_rejected(void **state)
{
    (void)state;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    ap_collab_t *c = NULL;
    float params[4] = {0};
    /* no runtime, no run id, no target: refused before touching anything */
    assert_int_equal(ap_collab_new(NULL, NULL, NULL, &cfg, params, 4, NULL, 0, &c), AP_EINVAL);
    assert_null(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_impossible_refused),
        cmocka_unit_test(test_config_rejected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
