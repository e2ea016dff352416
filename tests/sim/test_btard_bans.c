/* Global bans in the DHT (simulator, 16 nodes running the ban validator): a
 * ban proving a mismatching reveal or an equivocation is stored and read back
 * by a node that joins afterwards; a "ban" of an honest peer (its honest
 * commitment and reveal), a ban naming another peer than the evidence's
 * signer, one of another run and a malformed one are refused by the storing
 * nodes. Also the encoding round trip and the checks without the DHT. */
#include "aptest.h"

#include "apiary/btard.h"
#include "apiary/identity.h"
#include "btard.pb-c.h"
#include "btard/wire.h"
#include "dht_swarm.h"

#include <sodium.h>

#define NODES 16

static void sign_cb(void *arg, const uint8_t *msg, size_t len, uint8_t sig[AP_ED25519_SIG_LEN])
{
    crypto_sign_detached(sig, NULL, msg, len, ((const ap_identity_t *)arg)->sk);
}

typedef struct ev {
    uint8_t a[AP_BTARD_MSG_MAX], b[AP_BTARD_MSG_MAX];
    size_t al, bl;
} ev_t;

/* Signed messages of identity id in round (run, step, 0): a commitment to
 * value and a reveal of reveal_value (equal = honest), or two commitments. */
static void make_ev(const ap_identity_t *id, const uint8_t run[32], uint64_t step, bool equivocate,
                    bool honest, ev_t *e)
{
    uint8_t ctx[32], value[32] = {1, 2, 3}, h[32];
    ap_btard_round_ctx(run, step, 0, ctx);
    /* the commitment hash as the state machine computes it */
    ap_btard_mprng_cfg_t c = {.peers = &id->id, .n = 1, .self = 0, .sign = sign_cb};
    c.sign_arg = (void *)id;
    memcpy(c.ctx, ctx, 32);
    ap_btard_mprng_t *m = ap_btard_mprng_new(&c);
    assert_non_null(m);
    assert_ok(ap_btard_mprng_start(m, value));
    const uint8_t *b;
    size_t len;
    assert_true(ap_btard_mprng_outbox(m, &b, &len));
    memcpy(e->a, b, len);
    e->al = len;
    ap__btard_msg_t msg;
    assert_ok(ap__btard_msg_decode(e->a, e->al, &msg));
    memcpy(h, msg.data, 32);
    if (equivocate) {
        h[0] ^= 1;
        memcpy(msg.data, h, 32);
    } else {
        msg.kind = AP__BTARD_MPRNG_REVEAL;
        memcpy(msg.data, value, 32);
        if (!honest) msg.data[31] ^= 1;
    }
    e->bl = ap__btard_msg_encode(&msg, sign_cb, (void *)id, e->b, sizeof e->b);
    assert_true(e->bl > 0);
    ap_btard_mprng_free(m);
}

static ap_btard_ban_t ban_of(const uint8_t run[32], uint64_t step, const ap_peer_id_t *p,
                             ap_btard_fault_t f, const ev_t *e)
{
    ap_btard_ban_t b = {.step = step, .peer = *p, .fault = f};
    memcpy(b.run, run, 32);
    b.ev_a = e->a;
    b.ev_a_len = e->al;
    b.ev_b = e->b;
    b.ev_b_len = e->bl;
    return b;
}

/* The encoder refuses non-proofs; this writes one anyway, as an attacker would. */
static size_t raw_ban(const ap_btard_ban_t *b, uint8_t *out)
{
    Apiary__Btard__Ban m = APIARY__BTARD__BAN__INIT;
    m.run = (ProtobufCBinaryData){32, (uint8_t *)b->run};
    m.step = b->step;
    m.fault = (uint32_t)b->fault;
    m.evidence_a = (ProtobufCBinaryData){b->ev_a_len, (uint8_t *)b->ev_a};
    m.evidence_b = (ProtobufCBinaryData){b->ev_b_len, (uint8_t *)b->ev_b};
    return apiary__btard__ban__pack(&m, out);
}

static ap_identity_t idx(int i)
{
    ap_identity_t id;
    uint8_t s[32] = {0};
    s[0] = (uint8_t)(100 + i);
    assert_ok(ap_identity_from_seed(&id, s));
    return id;
}

static void test_checks_offline(void **st)
{
    (void)st;
    uint8_t run[32] = {7}, other[32] = {8}, val[AP_BTARD_BAN_MAX];
    ap_identity_t x = idx(0), y = idx(1);
    ev_t bad, eq, honest;
    make_ev(&x, run, 5, false, false, &bad);
    make_ev(&x, run, 6, true, false, &eq);
    make_ev(&y, run, 5, false, true, &honest);
    size_t len;
    ap_btard_ban_t b = ban_of(run, 5, &x.id, AP_BTARD_FAULT_BAD_REVEAL, &bad), out;
    assert_ok(ap_btard_ban_encode(&b, val, sizeof val, &len));
    assert_ok(ap_btard_ban_check(val, len, &x.id, run, &out));
    assert_int_equal(out.fault, AP_BTARD_FAULT_BAD_REVEAL);
    assert_true(out.step == 5 && ap_peer_id_eq(&out.peer, &x.id));
    assert_int_equal(ap_btard_ban_check(val, len, &y.id, run, &out), AP_EINVAL);
    assert_int_equal(ap_btard_ban_check(val, len, &x.id, other, &out), AP_EINVAL);
    assert_int_equal(ap_btard_ban_check(val, 3, &x.id, run, &out), AP_ECORRUPT);
    /* the wrong step or the wrong fault proves nothing */
    ap_btard_ban_t w = b;
    w.step = 6;
    assert_int_equal(ap_btard_ban_encode(&w, val, sizeof val, &len), AP_EINVAL);
    w = b;
    w.fault = AP_BTARD_FAULT_EQUIVOCATION;
    assert_int_equal(ap_btard_ban_encode(&w, val, sizeof val, &len), AP_EINVAL);
    w = ban_of(run, 6, &x.id, AP_BTARD_FAULT_EQUIVOCATION, &eq);
    assert_ok(ap_btard_ban_encode(&w, val, sizeof val, &len));
    assert_ok(ap_btard_ban_check(val, len, &x.id, NULL, &out));
    w = ban_of(run, 5, &y.id, AP_BTARD_FAULT_BAD_REVEAL, &honest);
    assert_int_equal(ap_btard_ban_encode(&w, val, sizeof val, &len), AP_EINVAL);
    len = raw_ban(&w, val);
    assert_int_equal(ap_btard_ban_check(val, len, &y.id, run, &out), AP_EINVAL);
    /* the validator leaves other keys alone and checks ban keys strictly */
    ap_dht_record_t r = {.key = (const uint8_t *)"other", .key_len = 5};
    assert_ok(ap_btard_ban_validator(NULL, &r, NULL));
    r.key = (const uint8_t *)AP_BTARD_BAN_PREFIX "zz";
    r.key_len = strlen((const char *)r.key);
    assert_int_equal(ap_btard_ban_validator(NULL, &r, NULL), AP_EINVAL);
}

typedef struct got {
    bool done;
    int status;
    size_t n;
    ap_peer_id_t p[8];
} got_t;

static void on_bans(void *arg, int status, const ap_peer_id_t *banned, size_t n)
{
    got_t *g = arg;
    g->done = true;
    g->status = status;
    g->n = n;
    for (size_t i = 0; i < n && i < 8; i++) g->p[i] = banned[i];
}

static bool got_done(void *arg)
{
    return ((got_t *)arg)->done;
}

static op_t store_raw(swarm_t *s, int node, const uint8_t run[32], const ap_peer_id_t *subject,
                      const uint8_t *val, size_t len)
{
    char key[AP_BTARD_BAN_KEY_LEN + 1];
    ap_btard_ban_key(run, key);
    ap_dht_record_t rec = {.key = (const uint8_t *)key,
                           .key_len = AP_BTARD_BAN_KEY_LEN,
                           .subkey = subject->b,
                           .subkey_len = AP_PEER_ID_LEN,
                           .value = val,
                           .value_len = len,
                           .expiration_ms = ap_rt_wall_ms(sw_rt(s, node)) + 3600000};
    op_t o = {.s = s};
    s->pending++;
    int rc = ap_dht_store(s->dht[node], &rec, sw_store_cb, &o);
    if (rc) {
        s->pending--;
        o.done = true;
        o.status = rc;
    }
    sw_run_idle(s, 60000000);
    return o;
}

static void test_bans_in_dht(void **st)
{
    (void)st;
    swarm_t *s = sw_new_n(NODES, NODES - 1, ap_test_seed(3), 20000, NULL, 20000);
    assert_non_null(s);
    for (int i = 0; i < NODES - 1; i++)
        assert_ok(ap_dht_add_validator(s->dht[i], ap_btard_ban_validator, NULL));
    uint8_t run[32] = {42}, other[32] = {43}, val[AP_BTARD_BAN_MAX];
    ap_identity_t x = idx(0), y = idx(1), z = idx(2);
    ev_t bad, eq, honest;
    make_ev(&x, run, 5, false, false, &bad);
    make_ev(&z, run, 9, true, false, &eq);
    make_ev(&y, run, 5, false, true, &honest);
    /* two real bans */
    ap_btard_ban_t bx = ban_of(run, 5, &x.id, AP_BTARD_FAULT_BAD_REVEAL, &bad);
    ap_btard_ban_t bz = ban_of(run, 9, &z.id, AP_BTARD_FAULT_EQUIVOCATION, &eq);
    op_t o = {.s = s};
    s->pending++;
    assert_ok(ap_btard_ban_publish(s->dht[3], &bx, ap_rt_wall_ms(sw_rt(s, 3)) + 3600000,
                                   sw_store_cb, &o));
    sw_run_idle(s, 60000000);
    assert_ok(o.status);
    assert_true(o.nstored >= 1);
    size_t len;
    assert_ok(ap_btard_ban_encode(&bz, val, sizeof val, &len));
    o = store_raw(s, 4, run, &z.id, val, len);
    assert_ok(o.status);
    /* forgeries: honest evidence; x's evidence against y; x's ban in another run */
    ap_btard_ban_t fy = ban_of(run, 5, &y.id, AP_BTARD_FAULT_BAD_REVEAL, &honest);
    len = raw_ban(&fy, val);
    o = store_raw(s, 5, run, &y.id, val, len);
    assert_int_not_equal(o.status, 0);
    assert_int_equal(o.nstored, 0);
    assert_ok(ap_btard_ban_encode(&bx, val, sizeof val, &len));
    o = store_raw(s, 6, run, &y.id, val, len);
    assert_int_not_equal(o.status, 0);
    o = store_raw(s, 7, other, &x.id, val, len);
    assert_int_not_equal(o.status, 0);
    o = store_raw(s, 8, run, &y.id, (const uint8_t *)"junk", 4);
    assert_int_not_equal(o.status, 0);
    /* a newcomer joins and learns the bans */
    int nc = NODES - 1;
    assert_ok(sw_start_node(s, nc));
    assert_ok(ap_dht_add_validator(s->dht[nc], ap_btard_ban_validator, NULL));
    sw_bootstrap(s, nc, nc);
    sw_run_idle(s, 60000000);
    got_t g = {0};
    assert_ok(ap_btard_bans_fetch(s->dht[nc], run, on_bans, &g));
    assert_true(sw_run(s, got_done, &g, 60000000));
    assert_ok(g.status);
    assert_int_equal(g.n, 2);
    bool hx = false, hz = false;
    for (size_t i = 0; i < g.n; i++) {
        hx |= ap_peer_id_eq(&g.p[i], &x.id);
        hz |= ap_peer_id_eq(&g.p[i], &z.id);
    }
    assert_true(hx && hz);
    /* another run has no bans */
    got_t g2 = {0};
    assert_ok(ap_btard_bans_fetch(s->dht[nc], other, on_bans, &g2));
    assert_true(sw_run(s, got_done, &g2, 60000000));
    assert_int_equal(g2.n, 0);
    sw_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_checks_offline),
        cmocka_unit_test(test_bans_in_dht),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
