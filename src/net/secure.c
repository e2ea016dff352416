/* Authenticated Noise XX handshake (see secure.h). */
#include "net/secure.h"
#include "apiary/error.h"

#include "noise.pb-c.h"

#include <sodium.h>
#include <string.h>

/* libp2p PublicKey{Type = Ed25519, Data = 32 bytes} */
static const uint8_t pubkey_prefix[4] = {0x08, 0x01, 0x12, 0x20};
#define PUBKEY_PB_LEN  (sizeof pubkey_prefix + AP_ED25519_PK_LEN)
#define SIG_PREFIX_LEN (sizeof AP_SECURE_SIG_PREFIX - 1)

static void signed_msg(uint8_t out[SIG_PREFIX_LEN + AP_NOISE_DHLEN],
                       const uint8_t s_pub[AP_NOISE_DHLEN])
{
    memcpy(out, AP_SECURE_SIG_PREFIX, SIG_PREFIX_LEN);
    memcpy(out + SIG_PREFIX_LEN, s_pub, AP_NOISE_DHLEN);
}

int ap__secure_make_payload(const ap_identity_t *id, const uint8_t s_pub[AP_NOISE_DHLEN],
                            uint8_t *out, size_t cap, size_t *len)
{
    uint8_t key[PUBKEY_PB_LEN], sig[AP_ED25519_SIG_LEN];
    uint8_t msg[SIG_PREFIX_LEN + AP_NOISE_DHLEN];
    memcpy(key, pubkey_prefix, sizeof pubkey_prefix);
    memcpy(key + sizeof pubkey_prefix, id->pk, AP_ED25519_PK_LEN);
    signed_msg(msg, s_pub);
    crypto_sign_detached(sig, NULL, msg, sizeof msg, id->sk);
    Apiary__NoiseHandshakePayload p = APIARY__NOISE_HANDSHAKE_PAYLOAD__INIT;
    p.has_identity_key = 1;
    p.identity_key.data = key;
    p.identity_key.len = sizeof key;
    p.has_identity_sig = 1;
    p.identity_sig.data = sig;
    p.identity_sig.len = sizeof sig;
    size_t n = apiary__noise_handshake_payload__get_packed_size(&p);
    if (n > cap) return AP_EMSGSIZE;
    *len = apiary__noise_handshake_payload__pack(&p, out);
    return 0;
}

int ap__secure_creds_init(ap_secure_creds_t *c, const ap_identity_t *id, ap_noise_hash_t hash,
                          const uint8_t *s_priv)
{
    if (sodium_init() < 0) return AP_ESYS;
    memset(c, 0, sizeof *c);
    c->id = *id;
    c->hash = hash;
    if (s_priv) {
        memcpy(c->s_priv, s_priv, AP_NOISE_DHLEN);
        crypto_scalarmult_base(c->s_pub, c->s_priv);
    } else {
        crypto_box_keypair(c->s_pub, c->s_priv);
    }
    return ap__secure_make_payload(&c->id, c->s_pub, c->payload, sizeof c->payload,
                                   &c->payload_len);
}

void ap__secure_creds_clear(ap_secure_creds_t *c)
{
    sodium_memzero(c, sizeof *c);
}

int ap__secure_init(ap_secure_hs_t *hs, const ap_secure_creds_t *creds, bool initiator,
                    const ap_peer_id_t *expected, const uint8_t *e_priv)
{
    return ap__secure_init_prologue(hs, creds, initiator, expected, e_priv, NULL, 0);
}

int ap__secure_init_prologue(ap_secure_hs_t *hs, const ap_secure_creds_t *creds, bool initiator,
                             const ap_peer_id_t *expected, const uint8_t *e_priv,
                             const uint8_t *prologue, size_t prologue_len)
{
    memset(hs, 0, sizeof *hs);
    hs->creds = creds;
    if (expected) {
        hs->has_expected = true;
        hs->expected = *expected;
    }
    return ap__noise_hs_init(&hs->noise, creds->hash, initiator, prologue, prologue_len,
                             creds->s_priv, e_priv);
}

bool ap__secure_my_turn(const ap_secure_hs_t *hs)
{
    return ap__noise_hs_my_turn(&hs->noise);
}

bool ap__secure_done(const ap_secure_hs_t *hs)
{
    return ap__noise_hs_done(&hs->noise) && hs->has_remote &&
           (!hs->has_expected || ap_peer_id_eq(&hs->expected, &hs->remote));
}

int ap__secure_write(ap_secure_hs_t *hs, uint8_t *out, size_t cap, size_t *out_len)
{
    /* message 1 (step 0) is empty; messages 2 and 3 carry our identity */
    bool with_id = hs->noise.step > 0;
    return ap__noise_hs_write(&hs->noise, with_id ? hs->creds->payload : NULL,
                              with_id ? hs->creds->payload_len : 0, out, cap, out_len);
}

int ap__secure_check_payload(const uint8_t *payload, size_t len, const uint8_t rs[AP_NOISE_DHLEN],
                             ap_peer_id_t *out)
{
    if (len == 0 || len > AP_SECURE_PAYLOAD_MAX) return AP_ECORRUPT;
    Apiary__NoiseHandshakePayload *p = apiary__noise_handshake_payload__unpack(NULL, len, payload);
    if (!p) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    if (!p->has_identity_key || p->identity_key.len != PUBKEY_PB_LEN ||
        memcmp(p->identity_key.data, pubkey_prefix, sizeof pubkey_prefix) != 0)
        goto out;
    if (!p->has_identity_sig || p->identity_sig.len != AP_ED25519_SIG_LEN) goto out;
    const uint8_t *pk = p->identity_key.data + sizeof pubkey_prefix;
    uint8_t msg[SIG_PREFIX_LEN + AP_NOISE_DHLEN];
    signed_msg(msg, rs);
    if (crypto_sign_verify_detached(p->identity_sig.data, msg, sizeof msg, pk) != 0) {
        rc = AP_EAUTH;
        goto out;
    }
    ap_peer_id_from_ed25519(out, pk);
    rc = 0;
out:
    apiary__noise_handshake_payload__free_unpacked(p, NULL);
    return rc;
}

int ap__secure_read(ap_secure_hs_t *hs, const uint8_t *msg, size_t len)
{
    uint8_t payload[AP_NOISE_MSG_MAX];
    size_t plen = 0;
    int step = hs->noise.step;
    int rc = ap__noise_hs_read(&hs->noise, msg, len, payload, sizeof payload, &plen);
    if (rc != 0) return rc;
    if (step == 0) return 0; /* payload of message 1 is ignored (libp2p: empty) */
    const uint8_t *rs = ap__noise_hs_remote_static(&hs->noise);
    rc = rs ? ap__secure_check_payload(payload, plen, rs, &hs->remote) : AP_ESTATE;
    sodium_memzero(payload, plen);
    if (rc != 0) {
        /* the message was not accepted: the step keeps naming it (logs say
         * "message 3", not the next one) */
        hs->noise.step = step;
        hs->noise.failed = rc;
        return rc;
    }
    hs->has_remote = true;
    if (hs->has_expected && !ap_peer_id_eq(&hs->expected, &hs->remote)) {
        hs->noise.step = step;
        hs->noise.failed = AP_EAUTH;
        return AP_EAUTH;
    }
    return 0;
}

const ap_peer_id_t *ap__secure_remote(const ap_secure_hs_t *hs)
{
    return hs->has_remote ? &hs->remote : NULL;
}

int ap__secure_split(ap_secure_hs_t *hs, ap_noise_cs_t *send, ap_noise_cs_t *recv)
{
    if (!ap__secure_done(hs)) return AP_ESTATE;
    int rc = ap__noise_hs_split(&hs->noise, send, recv);
    ap__noise_hs_clear(&hs->noise);
    return rc;
}

void ap__secure_clear(ap_secure_hs_t *hs)
{
    ap__noise_hs_clear(&hs->noise);
}
