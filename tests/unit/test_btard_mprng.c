/* MPRNG: 8 peers agree on the documented seed; a withheld commitment or
 * reveal, a mismatching reveal and two different commitments exclude the
 * culprit at every honest peer and the round restarts without it; evidence
 * is checkable by anyone; the seed stays uniform (chi-squared) when 7 of 8
 * choose their values after seeing the honest commitment; bad input. */
#include "aptest.h"

#include "apiary/btard.h"
#include "apiary/identity.h"
#include "btard/wire.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 8

enum beh { HONEST, NO_COMMIT, NO_REVEAL, BAD_REVEAL, EQUIVOCATE };

typedef struct q {
    int to;
    size_t len;
    uint8_t b[AP_BTARD_MSG_MAX];
} q_t;

typedef struct net {
    ap_identity_t id[N];
    ap_peer_id_t peers[N];
    ap_btard_mprng_t *m[N];
    enum beh beh[N];
    uint8_t ctx[AP_BTARD_HASH_LEN];
    bool relay;
    q_t *q;
    size_t qh, qt, qcap;
    uint64_t vs; /* value stream */
} net_t;

static void sign_cb(void *arg, const uint8_t *msg, size_t len, uint8_t sig[AP_ED25519_SIG_LEN])
{
    const ap_identity_t *id = arg;
    crypto_sign_detached(sig, NULL, msg, len, id->sk);
}

static void push(net_t *t, int to, const uint8_t *b, size_t len)
{
    if (t->qt == t->qcap) {
        t->qcap = t->qcap ? 2 * t->qcap : 256;
        t->q = realloc(t->q, t->qcap * sizeof(q_t));
    }
    q_t *e = &t->q[t->qt++];
    e->to = to;
    e->len = len;
    memcpy(e->b, b, len);
}

static void bcast(net_t *t, int from, const uint8_t *b, size_t len)
{
    for (int j = 0; j < N; j++)
        if (j != from) push(t, j, b, len);
}

static void next_value(net_t *t, uint8_t v[AP_BTARD_HASH_LEN])
{
    uint8_t s[8];
    for (int i = 0; i < 8; i++) s[i] = (uint8_t)(t->vs >> (8 * i));
    t->vs++;
    crypto_generichash(v, AP_BTARD_HASH_LEN, s, 8, t->ctx, AP_BTARD_HASH_LEN);
}

static size_t craft(net_t *t, int i, uint32_t kind, const uint8_t data[32], uint8_t *out)
{
    ap__btard_msg_t msg = {.kind = kind, .sender = t->peers[i]};
    memcpy(msg.ctx, t->ctx, 32);
    msg.attempt = ap_btard_mprng_attempt(t->m[i]);
    memcpy(msg.data, data, 32);
    return ap__btard_msg_encode(&msg, sign_cb, &t->id[i], out, AP_BTARD_MSG_MAX);
}

/* Sends peer i's outbox, as its behaviour dictates. */
static void flush(net_t *t, int i)
{
    const uint8_t *b;
    size_t len;
    while (ap_btard_mprng_outbox(t->m[i], &b, &len)) {
        ap__btard_msg_t msg;
        assert_ok(ap__btard_msg_decode(b, len, &msg));
        bool commit = msg.kind == AP__BTARD_MPRNG_COMMIT;
        switch (t->beh[i]) {
        case NO_COMMIT:
            continue;
        case NO_REVEAL:
            if (!commit) continue;
            break;
        case BAD_REVEAL:
            if (!commit) {
                uint8_t v[32], out[AP_BTARD_MSG_MAX];
                memcpy(v, msg.data, 32);
                v[0] ^= 1;
                size_t l = craft(t, i, AP__BTARD_MPRNG_REVEAL, v, out);
                bcast(t, i, out, l);
                continue;
            }
            break;
        case EQUIVOCATE:
            if (commit) {
                uint8_t h[32], out[AP_BTARD_MSG_MAX];
                memcpy(h, msg.data, 32);
                h[5] ^= 0x40;
                size_t l = craft(t, i, AP__BTARD_MPRNG_COMMIT, h, out);
                for (int j = 0; j < N; j++)
                    if (j != i) push(t, j, j < N / 2 ? b : out, j < N / 2 ? len : l);
                continue;
            }
            break;
        case HONEST:
            break;
        }
        bcast(t, i, b, len);
    }
}

static void net_init(net_t *t, uint64_t seed, bool relay)
{
    memset(t, 0, sizeof *t);
    t->relay = relay;
    for (int i = 0; i < N; i++) {
        uint8_t s[AP_IDENTITY_SEED_LEN] = {0};
        s[0] = (uint8_t)(i + 1);
        assert_ok(ap_identity_from_seed(&t->id[i], s));
        t->peers[i] = t->id[i].id;
    }
    t->vs = seed * 1000003;
}

static void net_round(net_t *t, uint64_t round)
{
    memset(t->ctx, 0, sizeof t->ctx);
    for (int i = 0; i < 8; i++) t->ctx[i] = (uint8_t)(round >> (8 * i));
    for (int i = 0; i < N; i++) {
        ap_btard_mprng_free(t->m[i]);
        ap_btard_mprng_cfg_t cfg = {.peers = t->peers, .n = N, .self = (size_t)i};
        memcpy(cfg.ctx, t->ctx, 32);
        cfg.sign = sign_cb;
        cfg.sign_arg = &t->id[i];
        t->m[i] = ap_btard_mprng_new(&cfg);
        assert_non_null(t->m[i]);
    }
}

static void net_free(net_t *t)
{
    for (int i = 0; i < N; i++) ap_btard_mprng_free(t->m[i]);
    free(t->q);
}

static bool honest_done(net_t *t)
{
    for (int i = 0; i < N; i++)
        if (t->beh[i] == HONEST && ap_btard_mprng_state(t->m[i]) != AP_BTARD_MPRNG_DONE)
            return false;
    return true;
}

/* Runs until every honest peer has the seed; deadlines fire when the network
 * is quiet. Returns how many deadlines fired. */
static int net_run(net_t *t)
{
    int deadlines = 0;
    for (int phase = 0; phase < 4 * N; phase++) {
        for (;;) {
            bool any = false;
            for (int i = 0; i < N; i++) {
                if (ap_btard_mprng_state(t->m[i]) == AP_BTARD_MPRNG_NEED_VALUE) {
                    uint8_t v[32];
                    next_value(t, v);
                    assert_ok(ap_btard_mprng_start(t->m[i], v));
                }
                flush(t, i);
            }
            while (t->qh < t->qt) {
                q_t e = t->q[t->qh++];
                any = true;
                int rc = ap_btard_mprng_receive(t->m[e.to], e.b, e.len);
                assert_true(rc >= 0);
                if (rc == 1 && t->relay && t->beh[e.to] == HONEST) bcast(t, e.to, e.b, e.len);
                flush(t, e.to);
            }
            t->qh = t->qt = 0;
            if (!any) break;
        }
        if (honest_done(t)) return deadlines;
        for (int i = 0; i < N; i++) (void)ap_btard_mprng_deadline(t->m[i]);
        deadlines++;
    }
    fail_msg("round did not finish");
    return -1;
}

static void expect_agreement(net_t *t, int culprit, ap_btard_fault_t f)
{
    uint8_t s0[32], s[32];
    int first = -1;
    for (int i = 0; i < N; i++) {
        if (t->beh[i] != HONEST) continue;
        assert_ok(ap_btard_mprng_seed(t->m[i], s));
        if (first < 0) {
            first = i;
            memcpy(s0, s, 32);
        }
        assert_memory_equal(s, s0, 32);
        for (int j = 0; j < N; j++) {
            ap_btard_fault_t want = j == culprit ? f : AP_BTARD_FAULT_NONE;
            if (ap_btard_mprng_fault(t->m[i], j) != want)
                fail_msg("peer %d sees peer %d as %s, want %s", i, j,
                         ap_btard_fault_name(ap_btard_mprng_fault(t->m[i], j)),
                         ap_btard_fault_name(want));
        }
        assert_int_equal(ap_btard_mprng_attempt(t->m[i]), culprit < 0 ? 0 : 1);
    }
}

static void test_agree(void **st)
{
    (void)st;
    net_t t;
    net_init(&t, 1, true);
    for (uint64_t r = 0; r < 4; r++) {
        net_round(&t, r);
        assert_int_equal(net_run(&t), 0);
        expect_agreement(&t, -1, AP_BTARD_FAULT_NONE);
    }
    net_free(&t);
}

static void test_withheld_reveal(void **st)
{
    (void)st;
    net_t t;
    net_init(&t, 2, true);
    t.beh[3] = NO_REVEAL;
    net_round(&t, 7);
    assert_int_equal(net_run(&t), 1);
    expect_agreement(&t, 3, AP_BTARD_FAULT_NO_REVEAL);
    const uint8_t *a, *b;
    size_t al, bl;
    assert_int_equal(ap_btard_mprng_evidence(t.m[0], 3, &a, &al, &b, &bl), AP_ENOTFOUND);
    net_free(&t);
}

static void test_withheld_commit(void **st)
{
    (void)st;
    net_t t;
    net_init(&t, 3, true);
    t.beh[6] = NO_COMMIT;
    net_round(&t, 8);
    assert_int_equal(net_run(&t), 1);
    expect_agreement(&t, 6, AP_BTARD_FAULT_NO_COMMIT);
    net_free(&t);
}

static void check_evidence_everywhere(net_t *t, int culprit, ap_btard_fault_t f)
{
    for (int i = 0; i < N; i++) {
        if (t->beh[i] != HONEST) continue;
        const uint8_t *a, *b;
        size_t al, bl;
        assert_ok(ap_btard_mprng_evidence(t->m[i], culprit, &a, &al, &b, &bl));
        ap_btard_fault_t got = AP_BTARD_FAULT_NONE;
        assert_ok(ap_btard_mprng_check_evidence(t->ctx, &t->peers[culprit], a, al, b, bl, &got));
        assert_int_equal(got, f);
        /* the same messages prove nothing against anyone else or for another round */
        assert_int_equal(
            ap_btard_mprng_check_evidence(t->ctx, &t->peers[(culprit + 1) % N], a, al, b, bl, &got),
            AP_EINVAL);
        uint8_t other[32];
        memcpy(other, t->ctx, 32);
        other[31] ^= 1;
        assert_int_equal(
            ap_btard_mprng_check_evidence(other, &t->peers[culprit], a, al, b, bl, &got),
            AP_EINVAL);
        /* a tampered message fails its signature */
        uint8_t bad[AP_BTARD_MSG_MAX];
        memcpy(bad, b, bl);
        bad[bl - 1] ^= 1;
        assert_true(
            ap_btard_mprng_check_evidence(t->ctx, &t->peers[culprit], a, al, bad, bl, &got) < 0);
    }
}

static void test_bad_reveal(void **st)
{
    (void)st;
    net_t t;
    net_init(&t, 4, true);
    t.beh[5] = BAD_REVEAL;
    net_round(&t, 9);
    assert_int_equal(net_run(&t), 0); /* no deadline needed: the mismatch is seen at once */
    expect_agreement(&t, 5, AP_BTARD_FAULT_BAD_REVEAL);
    check_evidence_everywhere(&t, 5, AP_BTARD_FAULT_BAD_REVEAL);
    net_free(&t);
}

static void test_equivocation(void **st)
{
    (void)st;
    net_t t;
    net_init(&t, 5, true);
    t.beh[1] = EQUIVOCATE;
    net_round(&t, 10);
    assert_int_equal(net_run(&t), 0);
    expect_agreement(&t, 1, AP_BTARD_FAULT_EQUIVOCATION);
    check_evidence_everywhere(&t, 1, AP_BTARD_FAULT_EQUIVOCATION);
    net_free(&t);
}

/* An honest commitment and its honest reveal prove nothing. */
static void test_honest_evidence_refused(void **st)
{
    (void)st;
    net_t t;
    net_init(&t, 6, false);
    net_round(&t, 11);
    uint8_t v[32], c[AP_BTARD_MSG_MAX], r[AP_BTARD_MSG_MAX], h[32];
    next_value(&t, v);
    assert_ok(ap_btard_mprng_start(t.m[2], v));
    const uint8_t *b;
    size_t len;
    assert_true(ap_btard_mprng_outbox(t.m[2], &b, &len));
    memcpy(c, b, len);
    ap__btard_msg_t msg;
    assert_ok(ap__btard_msg_decode(c, len, &msg));
    memcpy(h, msg.data, 32);
    size_t rl = craft(&t, 2, AP__BTARD_MPRNG_REVEAL, v, r);
    ap_btard_fault_t f;
    assert_int_equal(ap_btard_mprng_check_evidence(t.ctx, &t.peers[2], c, len, r, rl, &f),
                     AP_EINVAL);
    assert_int_equal(ap_btard_mprng_check_evidence(t.ctx, &t.peers[2], c, len, c, len, &f),
                     AP_EINVAL);
    net_free(&t);
}

/* The documented seed formula, and the attackers' best guess at it (the
 * honest value replaced by what they can see: its commitment). */
static void seed_formula(const uint8_t ctx[32], uint32_t attempt, uint8_t vals[N][32],
                         uint8_t out[32])
{
    static const char tag[] = "apiary/btard/mprng/seed";
    crypto_generichash_state st;
    uint8_t a[4] = {(uint8_t)attempt, (uint8_t)(attempt >> 8), (uint8_t)(attempt >> 16),
                    (uint8_t)(attempt >> 24)};
    crypto_generichash_init(&st, NULL, 0, 32);
    crypto_generichash_update(&st, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&st, ctx, 32);
    crypto_generichash_update(&st, a, 4);
    for (uint32_t i = 0; i < N; i++) {
        uint8_t ix[4] = {(uint8_t)i, 0, 0, 0};
        crypto_generichash_update(&st, ix, 4);
        crypto_generichash_update(&st, vals[i], 32);
    }
    crypto_generichash_final(&st, out, 32);
}

static double chi2(const int *bins, int k, int total)
{
    double e = (double)total / k, c = 0;
    for (int i = 0; i < k; i++) c += (bins[i] - e) * (bins[i] - e) / e;
    return c;
}

/* Peers 1..7 wait for peer 0's commitment, then grind their values (64
 * candidates) so that the seed they can predict falls in bin 0. */
static void test_uniform_under_adaptive_choice(void **st)
{
    (void)st;
    int rounds = ap_test_sanitized() ? 256 : 512;
    int bins[16] = {0}, pbins[16] = {0};
    net_t t;
    net_init(&t, 7, false);
    for (int r = 0; r < rounds; r++) {
        net_round(&t, 1000 + (uint64_t)r);
        uint8_t vals[N][32], v0[32];
        next_value(&t, v0);
        assert_ok(ap_btard_mprng_start(t.m[0], v0));
        const uint8_t *b;
        size_t len;
        assert_true(ap_btard_mprng_outbox(t.m[0], &b, &len));
        uint8_t c0[AP_BTARD_MSG_MAX];
        size_t c0l = len;
        memcpy(c0, b, len);
        ap__btard_msg_t msg;
        assert_ok(ap__btard_msg_decode(c0, c0l, &msg));
        /* the attackers see h0 and choose */
        memcpy(vals[0], msg.data, 32);
        for (int i = 1; i < N; i++) crypto_generichash(vals[i], 32, msg.data, 32, &t.ctx[0], 8);
        uint8_t best[32], pred[32];
        int found = 0;
        for (int j = 0; j < 64 && !found; j++) {
            vals[1][0] = (uint8_t)j;
            seed_formula(t.ctx, 0, vals, pred);
            if ((pred[0] >> 4) == 0) found = 1;
        }
        memcpy(best, vals[1], 32);
        seed_formula(t.ctx, 0, vals, pred);
        pbins[pred[0] >> 4]++;
        for (int i = 1; i < N; i++) {
            assert_ok(ap_btard_mprng_start(t.m[i], i == 1 ? best : vals[i]));
            while (ap_btard_mprng_outbox(t.m[i], &b, &len)) bcast(&t, i, b, len);
        }
        bcast(&t, 0, c0, c0l);
        net_run(&t);
        uint8_t s[32], s1[32];
        assert_ok(ap_btard_mprng_seed(t.m[0], s));
        assert_ok(ap_btard_mprng_seed(t.m[1], s1));
        assert_memory_equal(s, s1, 32);
        memcpy(vals[0], v0, 32);
        seed_formula(t.ctx, 0, vals, pred);
        assert_memory_equal(s, pred, 32); /* the documented formula */
        bins[s[0] >> 4]++;
    }
    double c = chi2(bins, 16, rounds), pc = chi2(pbins, 16, rounds);
    printf("chi2 of the seed %.1f (15 dof, p=0.001 at 37.7); of the attackers' prediction %.1f\n",
           c, pc);
    assert_true(c < 37.7);
    /* the grinding works on what the attackers can compute: the test can fail */
    assert_true(pc > 1000);
    net_free(&t);
}

static void test_bad_input(void **st)
{
    (void)st;
    net_t t;
    net_init(&t, 8, false);
    net_round(&t, 12);
    uint8_t v[32], buf[AP_BTARD_MSG_MAX + 8];
    next_value(&t, v);
    assert_ok(ap_btard_mprng_start(t.m[0], v));
    assert_int_equal(ap_btard_mprng_start(t.m[0], v), AP_ESTATE);
    const uint8_t *b;
    size_t len;
    assert_true(ap_btard_mprng_outbox(t.m[0], &b, &len));
    memcpy(buf, b, len);
    /* before peer 1 started, a commitment is kept for later */
    assert_int_equal(ap_btard_mprng_receive(t.m[1], buf, len), 1);
    assert_int_equal(ap_btard_mprng_receive(t.m[1], buf, len), 0);
    next_value(&t, v);
    assert_ok(ap_btard_mprng_start(t.m[1], v));
    assert_int_equal(ap_btard_mprng_state(t.m[1]), AP_BTARD_MPRNG_COMMITTING);
    assert_int_equal(ap_btard_mprng_receive(t.m[1], buf, len), 0); /* already taken in */
    memset(buf, 0, sizeof buf);
    assert_int_equal(ap_btard_mprng_receive(t.m[1], buf, sizeof buf), AP_EMSGSIZE);
    assert_true(ap_btard_mprng_receive(t.m[1], buf, 10) < 0);
    assert_true(ap_btard_mprng_receive(t.m[1], NULL, 0) < 0);
    /* a stranger's message */
    ap_identity_t x;
    uint8_t s[32] = {99};
    assert_ok(ap_identity_from_seed(&x, s));
    ap__btard_msg_t msg = {.kind = AP__BTARD_MPRNG_COMMIT, .sender = x.id};
    memcpy(msg.ctx, t.ctx, 32);
    size_t l = ap__btard_msg_encode(&msg, sign_cb, &x, buf, sizeof buf);
    assert_int_equal(ap_btard_mprng_receive(t.m[1], buf, l), AP_EPERM);
    /* signed by someone else than the named sender */
    msg.sender = t.peers[2];
    l = ap__btard_msg_encode(&msg, sign_cb, &x, buf, sizeof buf);
    assert_int_equal(ap_btard_mprng_receive(t.m[1], buf, l), AP_EAUTH);
    /* another round */
    msg.ctx[0] ^= 1;
    l = ap__btard_msg_encode(&msg, sign_cb, &t.id[2], buf, sizeof buf);
    assert_int_equal(ap_btard_mprng_receive(t.m[1], buf, l), AP_EPROTO);
    /* bad configurations */
    ap_btard_mprng_cfg_t cfg = {.peers = t.peers, .n = N, .self = N, .sign = sign_cb};
    assert_null(ap_btard_mprng_new(&cfg));
    cfg.self = 0;
    cfg.n = 0;
    assert_null(ap_btard_mprng_new(&cfg));
    ap_peer_id_t dup[2] = {t.peers[0], t.peers[0]};
    cfg.peers = dup;
    cfg.n = 2;
    assert_null(ap_btard_mprng_new(&cfg));
    uint8_t seed[32];
    assert_int_equal(ap_btard_mprng_seed(t.m[1], seed), AP_ESTATE);
    net_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_agree),
        cmocka_unit_test(test_withheld_reveal),
        cmocka_unit_test(test_withheld_commit),
        cmocka_unit_test(test_bad_reveal),
        cmocka_unit_test(test_equivocation),
        cmocka_unit_test(test_honest_evidence_refused),
        cmocka_unit_test(test_uniform_under_adaptive_choice),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
