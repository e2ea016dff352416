/* Progress records: round trip, and every kind of impossible progress is
 * refused with the documented code; the run configuration they carry: round
 * trip, digest checked, and differences named with both values. */
#include "aptest.h"

#include "apiary/avg.h"
#include "apiary/collab.h"
#include "apiary/nn.h"
#include "apiary/progress.h"
#include "apiary/run_config.h"
#include "optim.pb-c.h"

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
    p.samples_per_s = 2 * AP_PROGRESS_MAX_SPS;
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

static ap_run_config_t run_cfg(void)
{
    ap_run_config_t rc;
    memset(&rc, 0, sizeof rc);
    strcpy(rc.model, "gpt layers 2 heads 4 embd 128 ctx 64");
    rc.n_params = 1000;
    rc.state_count = 2000;
    rc.codec = AP_AVG_CODEC_F32;
    rc.target_batch_size = 256;
    rc.solver = AP_NN_ADAM;
    rc.lr = 3e-3f;
    rc.lr_min = 3e-3f;
    rc.clip = 1.0;
    rc.state_every = 5;
    return rc;
}

static void test_run_config_roundtrip(void **state)
{
    (void)state;
    ap_progress_t p = honest(), q;
    p.has_config = true;
    p.config = run_cfg();
    p.config.exact = true;
    p.config.state_codec = AP_AVG_CODEC_BF16;
    p.config.byzantine_tolerant = true;
    p.config.btard_validators = 5;
    uint8_t buf[512];
    int len = ap_progress_encode(&p, buf, sizeof buf);
    assert_true(len > 0);
    assert_ok(ap_progress_decode(buf, (size_t)len, NOW, 5000, &q));
    assert_true(q.has_config);
    assert_string_equal(q.config.model, p.config.model);
    assert_int_equal(q.config.n_params, 1000);
    assert_true(q.config.exact);
    assert_int_equal(q.config.state_codec, AP_AVG_CODEC_BF16);
    assert_int_equal(q.config.btard_validators, 5);
    uint8_t d[AP_RUN_CONFIG_DIGEST_LEN];
    ap_run_config_digest(&p.config, d);
    assert_memory_equal(d, q.config_digest, sizeof d);
    char why[AP_RUN_CONFIG_MSG_MAX];
    assert_int_equal(ap_run_config_diff(&p.config, "here", &q.config, "there", why, sizeof why), 0);
    /* a record without a configuration decodes without one */
    ap_progress_t r = honest();
    len = ap_progress_encode(&r, buf, sizeof buf);
    assert_ok(ap_progress_decode(buf, (size_t)len, NOW, 5000, &q));
    assert_false(q.has_config);
    /* one changed bit of the config (the lr's last mantissa bit, at the
     * float's position in the encoding): another digest, which a reader
     * compares with its own */
    p.config.lr = 1.5f; /* 0x3fc00000: a recognisable pattern */
    len = ap_progress_encode(&p, buf, sizeof buf);
    int hit = -1;
    for (int i = 0; i + 4 <= len; i++)
        if (buf[i] == 0x00 && buf[i + 1] == 0x00 && buf[i + 2] == 0xc0 && buf[i + 3] == 0x3f)
            hit = i;
    assert_true(hit >= 0);
    ap_progress_t q1;
    assert_ok(ap_progress_decode(buf, (size_t)len, NOW, 5000, &q1));
    buf[hit] ^= 1;
    assert_ok(ap_progress_decode(buf, (size_t)len, NOW, 5000, &q));
    assert_true(memcmp(q.config_digest, q1.config_digest, AP_RUN_CONFIG_DIGEST_LEN) != 0);
    assert_int_equal(ap_run_config_diff(&q1.config, "a", &q.config, "b", why, sizeof why), 1);
    assert_non_null(strstr(why, "learning rate: 1.5 a, "));
    /* non-finite numbers and unprintable model names are refused */
    p.config = run_cfg();
    p.config.lr = NAN;
    len = ap_progress_encode(&p, buf, sizeof buf);
    assert_int_equal(ap_progress_decode(buf, (size_t)len, NOW, 5000, &q), AP_ERANGE);
    p.config = run_cfg();
    p.config.model[3] = '\n';
    len = ap_progress_encode(&p, buf, sizeof buf);
    assert_int_equal(ap_progress_decode(buf, (size_t)len, NOW, 5000, &q), AP_ECORRUPT);
}

static void test_run_config_diff_names_field(void **state)
{
    (void)state;
    ap_run_config_t a = run_cfg(), b = run_cfg();
    char why[AP_RUN_CONFIG_MSG_MAX];
    b.codec = AP_AVG_CODEC_FP16;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why, "compression: none here, fp16 at X");
    b = run_cfg();
    strcpy(b.model, "mlp 16-64-4");
    b.n_params = 7;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why,
                        "model: 'gpt layers 2 heads 4 embd 128 ctx 64' here, 'mlp 16-64-4' at X");
    b = run_cfg();
    b.target_batch_size = 512;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why, "target batch size: 256 here, 512 at X");
    b = run_cfg();
    b.solver = AP_NN_LAMB;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why, "optimizer: adam here, lamb at X");
    b = run_cfg();
    b.exact = true;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why, "exact mode: off here, on at X");
    b = run_cfg();
    b.state_codec = AP_AVG_CODEC_UNIFORM8;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why, "state compression: none here, uniform8 at X");
    b = run_cfg();
    b.btard_validators = 2;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why, "btard validators: 0 here, 2 at X");
    uint8_t da[AP_RUN_CONFIG_DIGEST_LEN], db[AP_RUN_CONFIG_DIGEST_LEN];
    ap_run_config_digest(&a, da);
    ap_run_config_digest(&b, db);
    assert_memory_not_equal(da, db, sizeof da);
    b = run_cfg();
    b.lr = 1e-3f;
    assert_int_equal(ap_run_config_diff(&a, "here", &b, "at X", why, sizeof why), 1);
    assert_string_equal(why, "learning rate: 0.003 here, 0.001 at X");
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

/* byzantine-tolerant runs' left_out list: kept through a round trip (up to
 * AP_PROGRESS_LEFT_OUT_MAX); more entries, or one that is not a PeerID, and
 * the record is refused (AP_ECORRUPT); encode refuses more than the cap. */
static void test_left_out(void **state)
{
    (void)state;
    ap_progress_t p = honest(), q;
    p.nleft_out = AP_PROGRESS_LEFT_OUT_MAX;
    for (uint32_t i = 0; i < p.nleft_out; i++) {
        uint8_t pk[AP_ED25519_PK_LEN];
        memset(pk, (int)i + 1, sizeof pk);
        ap_peer_id_from_ed25519(&p.left_out[i], pk);
    }
    uint8_t buf[512];
    int len = ap_progress_encode(&p, buf, sizeof buf);
    assert_true(len > 0);
    assert_ok(ap_progress_decode(buf, (size_t)len, NOW, 5000, &q));
    assert_int_equal(q.nleft_out, AP_PROGRESS_LEFT_OUT_MAX);
    for (uint32_t i = 0; i < q.nleft_out; i++)
        assert_true(ap_peer_id_eq(&q.left_out[i], &p.left_out[i]));
    p.nleft_out = AP_PROGRESS_LEFT_OUT_MAX + 1;
    assert_int_equal(ap_progress_encode(&p, buf, sizeof buf), AP_EINVAL);
    /* hand-made records: one entry too many; a malformed PeerID */
    Apiary__Optim__Progress *m = apiary__optim__progress__unpack(NULL, (size_t)len, buf);
    assert_non_null(m);
    ProtobufCBinaryData five[AP_PROGRESS_LEFT_OUT_MAX + 1];
    for (int i = 0; i <= AP_PROGRESS_LEFT_OUT_MAX; i++) five[i] = m->left_out[0];
    ProtobufCBinaryData *kept = m->left_out;
    size_t nkept = m->n_left_out;
    m->left_out = five;
    m->n_left_out = AP_PROGRESS_LEFT_OUT_MAX + 1;
    uint8_t raw[768];
    size_t rl = apiary__optim__progress__pack(m, raw);
    assert_int_equal(ap_progress_decode(raw, rl, NOW, 5000, &q), AP_ECORRUPT);
    uint8_t bad[AP_PEER_ID_LEN] = {0x12, 0x20}; /* a sha2-256 multihash, not Ed25519 */
    five[0].data = bad;
    m->n_left_out = 1;
    rl = apiary__optim__progress__pack(m, raw);
    assert_int_equal(ap_progress_decode(raw, rl, NOW, 5000, &q), AP_ECORRUPT);
    five[0].len = 3; /* truncated */
    rl = apiary__optim__progress__pack(m, raw);
    assert_int_equal(ap_progress_decode(raw, rl, NOW, 5000, &q), AP_ECORRUPT);
    m->left_out = kept;
    m->n_left_out = nkept;
    apiary__optim__progress__free_unpacked(m, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_impossible_refused),
        cmocka_unit_test(test_config_rejected),
        cmocka_unit_test(test_run_config_roundtrip),
        cmocka_unit_test(test_run_config_diff_names_field),
        cmocka_unit_test(test_left_out),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
