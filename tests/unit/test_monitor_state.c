/* The run monitor's model (tools/apiary/monitor_state.c) on progress records
 * as the DHT returns them: a loss of exactly 0 (a batch a small model fits
 * perfectly in float32) is a loss, shown as 0 in /api/state, on the page and
 * in /metrics, while a peer that has not submitted a batch yet has none
 * (null, left out of the mean). */
#include "aptest.h"
#include "monitor.h"

#include "apiary/identity.h"
#include "apiary/progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NOW 1800000000000LL

static int record(int k, float loss, bool has_loss, uint8_t *val, char *sub, ap_peer_id_t *id)
{
    uint8_t seed[AP_IDENTITY_SEED_LEN] = {(uint8_t)(k + 1)};
    ap_identity_t who;
    assert_ok(ap_identity_from_seed(&who, seed));
    *id = who.id;
    char txt[AP_PEER_ID_STR_MAX];
    snprintf(sub, 80, "[owner:%s]", ap_peer_id_str(&who.id, txt));
    ap_progress_t p;
    memset(&p, 0, sizeof p);
    p.epoch = 7;
    p.samples = 8;
    p.samples_per_s = 10;
    p.time_ms = NOW - 100;
    p.epoch_start_ms = NOW - 1000;
    p.loss = loss;
    p.has_loss = has_loss;
    int len = ap_progress_encode(&p, val, 512);
    assert_true(len > 0);
    return len;
}

static void test_zero_loss_is_a_loss(void **state)
{
    (void)state;
    uint8_t v[3][512];
    char sub[3][80];
    ap_peer_id_t id[3];
    ap_dht_record_t recs[3];
    const float loss[3] = {0.0f, 0.0f, 0.0f};
    const bool has[3] = {true, true, false}; /* the third has submitted nothing yet */
    for (int k = 0; k < 3; k++) {
        int len = record(k, loss[k], has[k], v[k], sub[k], &id[k]);
        recs[k] = (ap_dht_record_t){.key = (const uint8_t *)"m_progress",
                                    .key_len = 10,
                                    .subkey = (const uint8_t *)sub[k],
                                    .subkey_len = strlen(sub[k]),
                                    .value = v[k],
                                    .value_len = (size_t)len,
                                    .expiration_ms = NOW + 60000};
    }
    ap_dht_result_t res = {.found = true, .is_dict = true, .nrecords = 3, .records = recs};
    mon_state_t m;
    assert_ok(mon_state_init(&m, "m"));
    mon_state_absorb(&m, &res, NOW);
    size_t len = 0;
    char *j = mon_render_json(&m, &len);
    assert_non_null(j);
    /* two peers with loss 0, one without a loss */
    int zeros = 0, nulls = 0;
    for (const char *s = j; (s = strstr(s, "\"loss\":0,")); s++) zeros++;
    for (const char *s = j; (s = strstr(s, "\"loss\":null")); s++) nulls++;
    assert_int_equal(zeros, 2);
    assert_int_equal(nulls, 1);
    /* the loss plot has its point: mean 0 over the two that have one */
    assert_non_null(strstr(j, "\"loss\":[[7,0]]"));
    free(j);
    char *t = mon_render_metrics(&m, NULL, &len);
    assert_non_null(t);
    assert_non_null(strstr(t, "\napiary_loss 0\n"));
    free(t);
    mon_state_free(&m);
}

/* A record from a writer that does not set has_loss: a non-zero loss is
 * still taken as set. */
static void test_old_writer(void **state)
{
    (void)state;
    uint8_t v[512];
    char sub[80];
    ap_peer_id_t id;
    int len = record(0, 1.5f, false, v, sub, &id);
    ap_progress_t p;
    assert_ok(ap_progress_decode(v, (size_t)len, NOW, 5000, &p));
    assert_true(p.has_loss);
    len = record(0, 0.0f, true, v, sub, &id);
    assert_ok(ap_progress_decode(v, (size_t)len, NOW, 5000, &p));
    assert_true(p.has_loss);
    assert_true(p.loss == 0.0f);
    len = record(0, 0.0f, false, v, sub, &id);
    assert_ok(ap_progress_decode(v, (size_t)len, NOW, 5000, &p));
    assert_false(p.has_loss);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zero_loss_is_a_loss),
        cmocka_unit_test(test_old_writer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
