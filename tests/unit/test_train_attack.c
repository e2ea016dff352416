/* `apiary train --attack` (tools/apiary/train_btard.c): every name parses
 * and nothing else does; each gradient attack does what its help line says
 * (sign-flip x -1000, ipm x -0.5, random-direction 1000 x the norm along one
 * direction per epoch whatever the gradient, the same for every attacker);
 * label-flip maps y to C-1-y; the others leave gradients and labels alone. */
#include "aptest.h"

#include "train_btard.h"

#include <math.h>
#include <string.h>

#define D 64

static double norm(const float *g)
{
    double s = 0;
    for (int i = 0; i < D; i++) s += (double)g[i] * g[i];
    return sqrt(s);
}

static void fill(float *g, float a)
{
    for (int i = 0; i < D; i++) g[i] = a * (float)(i % 7) - 1.5f;
}

static void test_names(void **state)
{
    (void)state;
    static const char *const names[] = {"sign-flip",      "random-direction", "ipm",
                                        "label-flip",     "bad-aggregator",   "false-accuser",
                                        "withhold-reveal"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        int a = ap_train_attack_parse(names[i]);
        assert_int_equal(a, (int)i + 1);
        assert_non_null(strstr(ap_train_attack_names(), names[i]));
    }
    assert_int_equal(ap_train_attack_parse("alie"), -1);
    assert_int_equal(ap_train_attack_parse(""), -1);
    assert_int_equal(ap_train_attack_parse("SIGN-FLIP"), -1);
    assert_int_equal(ap_train_attack_parse(NULL), -1);
}

static void test_gradient_attacks(void **state)
{
    (void)state;
    float g[D], h[D];
    fill(g, 1);
    memcpy(h, g, sizeof g);
    ap_train_attack_grad(AP_TRAIN_SIGN_FLIP, 3, h, D);
    for (int i = 0; i < D; i++) assert_true(h[i] == g[i] * -1000.0f);
    memcpy(h, g, sizeof g);
    ap_train_attack_grad(AP_TRAIN_IPM, 3, h, D);
    for (int i = 0; i < D; i++) assert_true(h[i] == g[i] * -0.5f);
    for (int a = AP_TRAIN_LABEL_FLIP; a <= AP_TRAIN_WITHHOLD_REVEAL; a++) {
        memcpy(h, g, sizeof g);
        ap_train_attack_grad((ap_train_attack_t)a, 3, h, D);
        assert_memory_equal(h, g, sizeof g);
    }
    /* random direction: 1000 x |g|, one direction per epoch */
    float r1[D], r2[D], r3[D];
    memcpy(r1, g, sizeof g);
    ap_train_attack_grad(AP_TRAIN_RANDOM_DIRECTION, 3, r1, D);
    assert_true(fabs(norm(r1) - 1000.0 * norm(g)) < 1e-4 * 1000.0 * norm(g));
    fill(r2, 5); /* another attacker's gradient, same epoch */
    double n2 = norm(r2);
    ap_train_attack_grad(AP_TRAIN_RANDOM_DIRECTION, 3, r2, D);
    double dot = 0;
    for (int i = 0; i < D; i++) dot += (double)r1[i] * r2[i];
    assert_true(fabs(dot / (norm(r1) * norm(r2)) - 1.0) < 1e-6);
    assert_true(fabs(norm(r2) - 1000.0 * n2) < 1e-4 * 1000.0 * n2);
    memcpy(r3, g, sizeof g);
    ap_train_attack_grad(AP_TRAIN_RANDOM_DIRECTION, 4, r3, D); /* next epoch: another one */
    dot = 0;
    for (int i = 0; i < D; i++) dot += (double)r1[i] * r3[i];
    assert_true(fabs(dot / (norm(r1) * norm(r3))) < 0.9);
}

static void test_label_flip(void **state)
{
    (void)state;
    int32_t y[8] = {0, 1, 2, 3, 3, 2, 1, 0}, z[8];
    memcpy(z, y, sizeof y);
    ap_train_attack_labels(AP_TRAIN_LABEL_FLIP, z, 8, 4);
    for (int i = 0; i < 8; i++) assert_int_equal(z[i], 3 - y[i]);
    int32_t t[3] = {0, 97, 255};
    ap_train_attack_labels(AP_TRAIN_LABEL_FLIP, t, 3, 256);
    assert_int_equal(t[0], 255);
    assert_int_equal(t[1], 158);
    assert_int_equal(t[2], 0);
    memcpy(z, y, sizeof y);
    ap_train_attack_labels(AP_TRAIN_SIGN_FLIP, z, 8, 4);
    assert_memory_equal(z, y, sizeof y);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_gradient_attacks),
        cmocka_unit_test(test_label_flip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
