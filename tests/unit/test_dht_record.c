/* DHT records: owner markers, signatures, wire decoding. */
#include "aptest.h"

#include "apiary/dht.h"
#include "dht/record.h"
#include "dht/wire.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ident {
    uint8_t pk[32], sk[64];
    ap_peer_id_t id;
    char text[AP_PEER_ID_STR_MAX];
} ident_t;

static void ident_new(ident_t *i)
{
    crypto_sign_keypair(i->pk, i->sk);
    ap_peer_id_from_ed25519(&i->id, i->pk);
    ap_peer_id_str(&i->id, i->text);
}

static void sign_rec(const ident_t *i, const ap_dht_record_t *r, uint8_t sig[64])
{
    uint8_t *m;
    size_t n;
    assert_ok(ap_dht_record_sign_bytes(r, &m, &n));
    crypto_sign_detached(sig, NULL, m, n, i->sk);
    free(m);
}

static ap_dht_record_t rec_of(const char *key, const char *subkey, const char *value, int64_t exp)
{
    ap_dht_record_t r = {.key = (const uint8_t *)key,
                         .key_len = strlen(key),
                         .subkey = subkey ? (const uint8_t *)subkey : NULL,
                         .subkey_len = subkey ? strlen(subkey) : 0,
                         .value = (const uint8_t *)value,
                         .value_len = strlen(value),
                         .expiration_ms = exp};
    return r;
}

static void test_owner_signature(void **state)
{
    (void)state;
    ident_t a, b;
    ident_new(&a);
    ident_new(&b);
    char key[128], sub[128], subb[128];
    snprintf(key, sizeof key, "progress[owner:%s]", a.text);
    snprintf(sub, sizeof sub, "x[owner:%s]", a.text);
    snprintf(subb, sizeof subb, "[owner:%s]", b.text);
    uint8_t sig[64];

    /* plain key, no owner: must not carry a signature */
    ap_dht_record_t r = rec_of("plain", NULL, "v", 1000);
    assert_ok(ap__dht_check_owner(&r, NULL, false));
    assert_int_equal(ap__dht_check_owner(&r, sig, true), AP_EAUTH);

    /* owned key: valid signature passes, missing / forged / other signer fail */
    r = rec_of(key, NULL, "v1", 1000);
    assert_int_equal(ap__dht_check_owner(&r, NULL, false), AP_EAUTH);
    sign_rec(&a, &r, sig);
    assert_ok(ap__dht_check_owner(&r, sig, true));
    sig[5] ^= 1;
    assert_int_equal(ap__dht_check_owner(&r, sig, true), AP_EAUTH);
    sign_rec(&b, &r, sig);
    assert_int_equal(ap__dht_check_owner(&r, sig, true), AP_EAUTH);

    /* the signature covers every field */
    sign_rec(&a, &r, sig);
    ap_dht_record_t r2 = r;
    r2.expiration_ms++;
    assert_int_equal(ap__dht_check_owner(&r2, sig, true), AP_EAUTH);
    r2 = rec_of(key, NULL, "v2", 1000);
    assert_int_equal(ap__dht_check_owner(&r2, sig, true), AP_EAUTH);

    /* owner in the subkey only */
    r = rec_of("peers", subb, "hello", 5);
    sign_rec(&b, &r, sig);
    assert_ok(ap__dht_check_owner(&r, sig, true));
    sign_rec(&a, &r, sig);
    assert_int_equal(ap__dht_check_owner(&r, sig, true), AP_EAUTH);

    /* key and subkey naming the same owner: fine; different owners: refused */
    r = rec_of(key, sub, "v", 5);
    sign_rec(&a, &r, sig);
    assert_ok(ap__dht_check_owner(&r, sig, true));
    r = rec_of(key, subb, "v", 5);
    sign_rec(&a, &r, sig);
    assert_int_equal(ap__dht_check_owner(&r, sig, true), AP_EAUTH);
    sign_rec(&b, &r, sig);
    assert_int_equal(ap__dht_check_owner(&r, sig, true), AP_EAUTH);

    /* malformed markers */
    r = rec_of("k[owner:notapeer]", NULL, "v", 5);
    assert_int_equal(ap__dht_check_owner(&r, NULL, false), AP_EAUTH);
    r = rec_of("k[owner:12D3KooW", NULL, "v", 5);
    assert_int_equal(ap__dht_check_owner(&r, NULL, false), AP_EAUTH);
    r = rec_of("k[owner:]", NULL, "v", 5);
    assert_int_equal(ap__dht_check_owner(&r, NULL, false), AP_EAUTH);
}

/* The cache of verified signatures skips only a verification it did before:
 * the same owner, bytes and signature. A forged signature, a changed field or
 * another signer after a cached success are still refused, and a failure is
 * never remembered. */
static void test_sig_cache(void **state)
{
    (void)state;
    ident_t a, b;
    ident_new(&a);
    ident_new(&b);
    char key[128];
    snprintf(key, sizeof key, "progress[owner:%s]", a.text);
    static ap__dht_sigcache_t sc;
    memset(&sc, 0, sizeof sc);
    uint8_t sig[64], bad[64];
    ap_dht_record_t r = rec_of(key, NULL, "v1", 1000);
    sign_rec(&a, &r, sig);
    assert_ok(ap__dht_check_owner_cached(&sc, &r, sig, true));
    assert_int_equal(sc.misses, 1);
    assert_ok(ap__dht_check_owner_cached(&sc, &r, sig, true));
    assert_int_equal(sc.hits, 1); /* verified once */
    memcpy(bad, sig, sizeof bad);
    bad[7] ^= 1;
    assert_int_equal(ap__dht_check_owner_cached(&sc, &r, bad, true), AP_EAUTH);
    assert_int_equal(ap__dht_check_owner_cached(&sc, &r, bad, true), AP_EAUTH);
    ap_dht_record_t r2 = r;
    r2.expiration_ms++;
    assert_int_equal(ap__dht_check_owner_cached(&sc, &r2, sig, true), AP_EAUTH);
    r2 = rec_of(key, NULL, "v2", 1000);
    assert_int_equal(ap__dht_check_owner_cached(&sc, &r2, sig, true), AP_EAUTH);
    sign_rec(&b, &r, bad);
    assert_int_equal(ap__dht_check_owner_cached(&sc, &r, bad, true), AP_EAUTH);
    assert_int_equal(sc.hits, 1);
    /* the ring forgets the oldest: still correct, verified again */
    for (int i = 0; i < AP__DHT_SIGCACHE; i++) {
        char v[16];
        snprintf(v, sizeof v, "x%d", i);
        ap_dht_record_t t = rec_of(key, NULL, v, 1000);
        uint8_t ts[64];
        sign_rec(&a, &t, ts);
        assert_ok(ap__dht_check_owner_cached(&sc, &t, ts, true));
    }
    uint64_t misses = sc.misses;
    assert_ok(ap__dht_check_owner_cached(&sc, &r, sig, true));
    assert_int_equal(sc.misses, misses + 1);
}

static void test_sizes_and_ids(void **state)
{
    (void)state;
    static uint8_t big[AP_DHT_VALUE_MAX + 1];
    ap_dht_record_t r = {
        .key = big, .key_len = AP_DHT_KEY_MAX, .value = big, .value_len = AP_DHT_VALUE_MAX};
    assert_ok(ap__dht_check_sizes(&r));
    r.key_len++;
    assert_int_equal(ap__dht_check_sizes(&r), AP_EMSGSIZE);
    r.key_len = 1;
    r.value_len++;
    assert_int_equal(ap__dht_check_sizes(&r), AP_EMSGSIZE);
    r.value_len = 0;
    r.subkey = big;
    r.subkey_len = AP_DHT_SUBKEY_MAX + 1;
    assert_int_equal(ap__dht_check_sizes(&r), AP_EMSGSIZE);
    r.subkey_len = 0;
    r.key_len = 0;
    assert_int_equal(ap__dht_check_sizes(&r), AP_EINVAL);

    /* ids: BLAKE2b-160; distance helpers */
    uint8_t a[20] = {0}, b[20] = {0}, t[20] = {0};
    a[19] = 1;
    b[0] = 0x80;
    assert_true(ap__dht_cmp_dist(t, a, b) < 0);
    assert_true(ap__dht_cmp_dist(b, a, b) > 0);
    assert_int_equal(ap__dht_cmp_dist(t, a, a), 0);
    assert_int_equal(ap__dht_common_prefix(a, t), 159);
    assert_int_equal(ap__dht_common_prefix(b, t), 0);
    assert_int_equal(ap__dht_common_prefix(t, t), 160);
    uint8_t id1[20], id2[20];
    ap_dht_key_id((const uint8_t *)"abc", 3, id1);
    uint8_t ref[20];
    crypto_generichash(ref, 20, (const uint8_t *)"abc", 3, NULL, 0);
    assert_memory_equal(id1, ref, 20);
    ap_dht_key_id((const uint8_t *)"abd", 3, id2);
    assert_memory_not_equal(id1, id2, 20);
}

static size_t pack_req(Apiary__Dht__Request *q, uint8_t **buf)
{
    size_t n = apiary__dht__request__get_packed_size(q);
    *buf = malloc(n + 1);
    apiary__dht__request__pack(q, *buf);
    return n;
}

static int decode_req(Apiary__Dht__Request *q)
{
    uint8_t *buf;
    size_t n = pack_req(q, &buf);
    Apiary__Dht__Request *out = NULL;
    int rc = ap__dht_decode_request(buf, n, &out);
    if (out) apiary__dht__request__free_unpacked(out, NULL);
    free(buf);
    return rc;
}

static void test_wire_strict(void **state)
{
    (void)state;
    uint8_t kid[65][20];
    memset(kid, 7, sizeof kid);
    ProtobufCBinaryData ids[65];
    for (int i = 0; i < 65; i++) {
        ids[i].len = 20;
        ids[i].data = kid[i];
    }
    Apiary__Dht__FindRequest f = APIARY__DHT__FIND_REQUEST__INIT;
    f.key_ids = ids;
    f.n_key_ids = 64;
    Apiary__Dht__Request q = APIARY__DHT__REQUEST__INIT;
    q.body_case = APIARY__DHT__REQUEST__BODY_FIND;
    q.find = &f;
    assert_ok(decode_req(&q));
    f.n_key_ids = 65; /* over the batch cap */
    assert_int_equal(decode_req(&q), AP_EPROTO);
    f.n_key_ids = 0;
    assert_int_equal(decode_req(&q), AP_EPROTO);
    f.n_key_ids = 1;
    ids[0].len = 19; /* key ids are 20 bytes */
    assert_int_equal(decode_req(&q), AP_EPROTO);
    ids[0].len = 20;

    /* no body */
    Apiary__Dht__Request empty = APIARY__DHT__REQUEST__INIT;
    assert_int_equal(decode_req(&empty), AP_EPROTO);

    /* too many / too long sender addresses */
    char longaddr[300];
    memset(longaddr, 'a', sizeof longaddr - 1);
    longaddr[sizeof longaddr - 1] = 0;
    char *addrs[5] = {"/sim/1", "/sim/2", "/sim/3", "/sim/4", "/sim/5"};
    q.sender_addrs = addrs;
    q.n_sender_addrs = 4;
    assert_ok(decode_req(&q));
    q.n_sender_addrs = 5;
    assert_int_equal(decode_req(&q), AP_EPROTO);
    addrs[0] = longaddr;
    q.n_sender_addrs = 1;
    assert_int_equal(decode_req(&q), AP_EPROTO);
    q.n_sender_addrs = 0;

    /* STORE: oversize value, bad signature length, empty key */
    static uint8_t big[AP_DHT_VALUE_MAX + 1];
    Apiary__Dht__Record r = APIARY__DHT__RECORD__INIT;
    Apiary__Dht__Record *rp = &r;
    r.key.data = (uint8_t *)"k";
    r.key.len = 1;
    r.value.data = big;
    r.value.len = AP_DHT_VALUE_MAX;
    Apiary__Dht__StoreRequest s = APIARY__DHT__STORE_REQUEST__INIT;
    s.records = &rp;
    s.n_records = 1;
    Apiary__Dht__Request qs = APIARY__DHT__REQUEST__INIT;
    qs.body_case = APIARY__DHT__REQUEST__BODY_STORE;
    qs.store = &s;
    assert_ok(decode_req(&qs));
    r.value.len++;
    assert_int_equal(decode_req(&qs), AP_EMSGSIZE);
    r.value.len = 1;
    r.signature.data = big;
    r.signature.len = 10;
    assert_int_equal(decode_req(&qs), AP_EPROTO);
    r.signature.len = 64;
    assert_ok(decode_req(&qs));
    r.key.len = 0;
    assert_int_equal(decode_req(&qs), AP_EMSGSIZE);

    /* garbage and oversize input */
    uint8_t junk[64];
    for (int i = 0; i < 64; i++) junk[i] = (uint8_t)(i * 37 + 11);
    Apiary__Dht__Request *out = NULL;
    assert_int_not_equal(ap__dht_decode_request(junk, sizeof junk, &out), 0);
    assert_null(out);
    assert_int_equal(ap__dht_decode_request(junk, AP__DHT_MSG_MAX + 1, &out), AP_EMSGSIZE);

    /* responses: a nearest peer with a bad id is refused */
    Apiary__Dht__PeerInfo pi = APIARY__DHT__PEER_INFO__INIT;
    Apiary__Dht__PeerInfo *pip = &pi;
    pi.id.data = kid[0];
    pi.id.len = 20;
    Apiary__Dht__FindResult fr = APIARY__DHT__FIND_RESULT__INIT;
    Apiary__Dht__FindResult *frp = &fr;
    fr.nearest = &pip;
    fr.n_nearest = 1;
    Apiary__Dht__FindResponse fresp = APIARY__DHT__FIND_RESPONSE__INIT;
    fresp.results = &frp;
    fresp.n_results = 1;
    Apiary__Dht__Response resp = APIARY__DHT__RESPONSE__INIT;
    resp.body_case = APIARY__DHT__RESPONSE__BODY_FIND;
    resp.find = &fresp;
    uint8_t rb[4096];
    size_t rn = apiary__dht__response__pack(&resp, rb);
    Apiary__Dht__Response *rout = NULL;
    assert_int_equal(ap__dht_decode_response(rb, rn, &rout), AP_EPROTO);
    /* and a valid one passes */
    ident_t a;
    ident_new(&a);
    pi.id.data = a.id.b;
    pi.id.len = AP_PEER_ID_LEN;
    rn = apiary__dht__response__pack(&resp, rb);
    assert_ok(ap__dht_decode_response(rb, rn, &rout));
    assert_int_equal(rout->find->n_results, 1);
    apiary__dht__response__free_unpacked(rout, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_owner_signature),
        cmocka_unit_test(test_sig_cache),
        cmocka_unit_test(test_sizes_and_ids),
        cmocka_unit_test(test_wire_strict),
    };
    if (sodium_init() < 0) return 1;
    return cmocka_run_group_tests(tests, NULL, NULL);
}
