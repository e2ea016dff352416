/* BTARD signed messages: protobuf-c envelopes, capped and checked. */
#include "btard/wire.h"

#include "btard.pb-c.h"

#include <string.h>

#define DOMAIN     "apiary/btard/1"
#define DOMAIN_LEN 14

static size_t signed_input(uint32_t kind, const uint8_t *body, size_t len, uint8_t *out)
{
    memcpy(out, DOMAIN, DOMAIN_LEN);
    for (int i = 0; i < 4; i++) out[DOMAIN_LEN + i] = (uint8_t)(kind >> (8 * i));
    memcpy(out + DOMAIN_LEN + 4, body, len);
    return DOMAIN_LEN + 4 + len;
}

static size_t body_encode(const ap__btard_msg_t *m, uint8_t *out, size_t cap)
{
    ProtobufCBinaryData ctx = {AP_BTARD_HASH_LEN, (uint8_t *)m->ctx};
    ProtobufCBinaryData data = {AP_BTARD_HASH_LEN, (uint8_t *)m->data};
    if (m->kind == AP__BTARD_MPRNG_COMMIT) {
        Apiary__Btard__MprngCommit c = APIARY__BTARD__MPRNG_COMMIT__INIT;
        c.ctx = ctx;
        c.attempt = m->attempt;
        c.hash = data;
        if (apiary__btard__mprng_commit__get_packed_size(&c) > cap) return 0;
        return apiary__btard__mprng_commit__pack(&c, out);
    }
    if (m->kind == AP__BTARD_MPRNG_REVEAL) {
        Apiary__Btard__MprngReveal r = APIARY__BTARD__MPRNG_REVEAL__INIT;
        r.ctx = ctx;
        r.attempt = m->attempt;
        r.value = data;
        if (apiary__btard__mprng_reveal__get_packed_size(&r) > cap) return 0;
        return apiary__btard__mprng_reveal__pack(&r, out);
    }
    return 0;
}

size_t ap__btard_msg_encode(const ap__btard_msg_t *m, ap_btard_sign_fn sign, void *sign_arg,
                            uint8_t *out, size_t cap)
{
    uint8_t body[128], sin[DOMAIN_LEN + 4 + 128], sig[AP_ED25519_SIG_LEN];
    size_t bl = body_encode(m, body, sizeof body);
    if (!bl || !sign) return 0;
    size_t sl = signed_input(m->kind, body, bl, sin);
    sign(sign_arg, sin, sl, sig);
    Apiary__Btard__Signed s = APIARY__BTARD__SIGNED__INIT;
    s.kind = m->kind;
    s.sender = (ProtobufCBinaryData){AP_PEER_ID_LEN, (uint8_t *)m->sender.b};
    s.body = (ProtobufCBinaryData){bl, body};
    s.sig = (ProtobufCBinaryData){AP_ED25519_SIG_LEN, sig};
    size_t n = apiary__btard__signed__get_packed_size(&s);
    if (n > cap || n > AP_BTARD_MSG_MAX) return 0;
    return apiary__btard__signed__pack(&s, out);
}

static int body_decode(uint32_t kind, const uint8_t *b, size_t len, ap__btard_msg_t *m)
{
    const ProtobufCBinaryData *ctx, *data;
    int rc = AP_ECORRUPT;
    if (kind == AP__BTARD_MPRNG_COMMIT) {
        Apiary__Btard__MprngCommit *c = apiary__btard__mprng_commit__unpack(NULL, len, b);
        if (!c) return AP_ECORRUPT;
        ctx = &c->ctx;
        data = &c->hash;
        if (ctx->len == AP_BTARD_HASH_LEN && data->len == AP_BTARD_HASH_LEN) {
            memcpy(m->ctx, ctx->data, AP_BTARD_HASH_LEN);
            memcpy(m->data, data->data, AP_BTARD_HASH_LEN);
            m->attempt = c->attempt;
            rc = 0;
        }
        apiary__btard__mprng_commit__free_unpacked(c, NULL);
        return rc;
    }
    Apiary__Btard__MprngReveal *r = apiary__btard__mprng_reveal__unpack(NULL, len, b);
    if (!r) return AP_ECORRUPT;
    ctx = &r->ctx;
    data = &r->value;
    if (ctx->len == AP_BTARD_HASH_LEN && data->len == AP_BTARD_HASH_LEN) {
        memcpy(m->ctx, ctx->data, AP_BTARD_HASH_LEN);
        memcpy(m->data, data->data, AP_BTARD_HASH_LEN);
        m->attempt = r->attempt;
        rc = 0;
    }
    apiary__btard__mprng_reveal__free_unpacked(r, NULL);
    return rc;
}

int ap__btard_msg_decode(const uint8_t *b, size_t len, ap__btard_msg_t *m)
{
    if (len > AP_BTARD_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Btard__Signed *s = apiary__btard__signed__unpack(NULL, len, b);
    if (!s) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    memset(m, 0, sizeof *m);
    if (s->kind != AP__BTARD_MPRNG_COMMIT && s->kind != AP__BTARD_MPRNG_REVEAL) {
        rc = AP_ENOTSUP;
        goto out;
    }
    if (s->sig.len != AP_ED25519_SIG_LEN || s->body.len > 128) goto out;
    if (ap_peer_id_from_bytes(&m->sender, s->sender.data, s->sender.len) != 0) goto out;
    uint8_t sin[DOMAIN_LEN + 4 + 128];
    size_t sl = signed_input(s->kind, s->body.data, s->body.len, sin);
    if (ap_peer_verify(&m->sender, sin, sl, s->sig.data) != 0) {
        rc = AP_EAUTH;
        goto out;
    }
    m->kind = s->kind;
    rc = body_decode(s->kind, s->body.data, s->body.len, m);
out:
    apiary__btard__signed__free_unpacked(s, NULL);
    return rc;
}
