/* Authenticated Noise XX handshake (see secure.h). */
#include "net/secure.h"
#include "apiary/error.h"

#include "libp2p.pb-c.h"
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

const char *ap__secure_key_type_name(int type)
{
    switch (type) {
    case AP_KEY_RSA:
        return "RSA";
    case AP_KEY_ED25519:
        return "Ed25519";
    case AP_KEY_SECP256K1:
        return "Secp256k1";
    case AP_KEY_ECDSA:
        return "ECDSA";
    default:
        return "unknown";
    }
}

int ap__secure_make_payload_muxers(const ap_identity_t *id, const uint8_t s_pub[AP_NOISE_DHLEN],
                                   const char *const *muxers, size_t n, uint8_t *out, size_t cap,
                                   size_t *len)
{
    uint8_t key[PUBKEY_PB_LEN], sig[AP_ED25519_SIG_LEN];
    uint8_t msg[SIG_PREFIX_LEN + AP_NOISE_DHLEN];
    memcpy(key, pubkey_prefix, sizeof pubkey_prefix);
    memcpy(key + sizeof pubkey_prefix, id->pk, AP_ED25519_PK_LEN);
    signed_msg(msg, s_pub);
    crypto_sign_detached(sig, NULL, msg, sizeof msg, id->sk);
    Apiary__NoiseHandshakePayload p = APIARY__NOISE_HANDSHAKE_PAYLOAD__INIT;
    Apiary__NoiseExtensions ext = APIARY__NOISE_EXTENSIONS__INIT;
    p.has_identity_key = 1;
    p.identity_key.data = key;
    p.identity_key.len = sizeof key;
    p.has_identity_sig = 1;
    p.identity_sig.data = sig;
    p.identity_sig.len = sizeof sig;
    if (n) {
        ext.n_stream_muxers = n;
        ext.stream_muxers = (char **)muxers; /* protobuf-c only reads them */
        p.extensions = &ext;
    }
    size_t sz = apiary__noise_handshake_payload__get_packed_size(&p);
    if (sz > cap) return AP_EMSGSIZE;
    *len = apiary__noise_handshake_payload__pack(&p, out);
    return 0;
}

int ap__secure_make_payload(const ap_identity_t *id, const uint8_t s_pub[AP_NOISE_DHLEN],
                            uint8_t *out, size_t cap, size_t *len)
{
    return ap__secure_make_payload_muxers(id, s_pub, NULL, 0, out, cap, len);
}

int ap__secure_creds_init(ap_secure_creds_t *c, const ap_identity_t *id, ap_noise_hash_t hash,
                          const uint8_t *s_priv)
{
    return ap__secure_creds_init_muxers(c, id, hash, s_priv, NULL, 0);
}

int ap__secure_creds_init_muxers(ap_secure_creds_t *c, const ap_identity_t *id,
                                 ap_noise_hash_t hash, const uint8_t *s_priv,
                                 const char *const *muxers, size_t n)
{
    if (sodium_init() < 0) return AP_ESYS;
    memset(c, 0, sizeof *c);
    if (n > AP_SECURE_MUXERS_MAX || (n && !muxers)) return AP_EINVAL;
    for (size_t i = 0; i < n; i++) {
        size_t l = muxers[i] ? strlen(muxers[i]) : 0;
        if (l == 0 || l > 256) return AP_EINVAL;
        c->muxers[i] = muxers[i];
    }
    c->nmuxers = n;
    c->id = *id;
    c->hash = hash;
    if (s_priv) {
        memcpy(c->s_priv, s_priv, AP_NOISE_DHLEN);
        crypto_scalarmult_base(c->s_pub, c->s_priv);
    } else {
        crypto_box_keypair(c->s_pub, c->s_priv);
    }
    return ap__secure_make_payload_muxers(&c->id, c->s_pub, c->muxers, c->nmuxers, c->payload,
                                          sizeof c->payload, &c->payload_len);
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

/* Decodes the identity key (a libp2p PublicKey). Writes its type to *type
 * (-1 if the bytes are not a PublicKey) and, for Ed25519, the key. */
static int read_pubkey(const uint8_t *b, size_t n, int *type, uint8_t pk[AP_ED25519_PK_LEN])
{
    *type = -1;
    Libp2p__PublicKey *k = libp2p__public_key__unpack(NULL, n, b);
    if (!k) return AP_ECORRUPT;
    int rc = 0;
    *type = (int)k->type;
    if (*type < 0) /* not a KeyType: a varint beyond int32 (protobuf-c truncates it) */
        rc = AP_ECORRUPT;
    else if (k->type != LIBP2P__KEY_TYPE__Ed25519)
        rc = AP_ENOTSUP;
    else if (k->data.len != AP_ED25519_PK_LEN)
        rc = AP_ECORRUPT;
    else
        memcpy(pk, k->data.data, AP_ED25519_PK_LEN);
    libp2p__public_key__free_unpacked(k, NULL);
    return rc;
}

static bool listed(const char *const *list, size_t n, const char *s)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(list[i], s) == 0) return true;
    return false;
}

int ap__secure_check_payload_ex(const uint8_t *payload, size_t len,
                                const uint8_t rs[AP_NOISE_DHLEN], const char *const *ours,
                                size_t nours, bool we_initiate, ap_secure_remote_t *out)
{
    out->key_type = -1;
    out->has_muxers = false;
    out->muxer = -1;
    if (len == 0 || len > AP_SECURE_PAYLOAD_MAX) return AP_ECORRUPT;
    Apiary__NoiseHandshakePayload *p = apiary__noise_handshake_payload__unpack(NULL, len, payload);
    if (!p) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    uint8_t pk[AP_ED25519_PK_LEN];
    if (!p->has_identity_key) goto out;
    rc = read_pubkey(p->identity_key.data, p->identity_key.len, &out->key_type, pk);
    if (rc != 0) goto out;
    rc = AP_ECORRUPT;
    if (!p->has_identity_sig || p->identity_sig.len != AP_ED25519_SIG_LEN) goto out;
    uint8_t msg[SIG_PREFIX_LEN + AP_NOISE_DHLEN];
    signed_msg(msg, rs);
    if (crypto_sign_verify_detached(p->identity_sig.data, msg, sizeof msg, pk) != 0) {
        rc = AP_EAUTH;
        goto out;
    }
    const Apiary__NoiseExtensions *ext = p->extensions;
    size_t nt = ext ? ext->n_stream_muxers : 0;
    out->has_muxers = nt > 0;
    if (nt && nours) {
        if (we_initiate) {
            for (size_t i = 0; i < nours && out->muxer < 0; i++)
                if (listed((const char *const *)ext->stream_muxers, nt, ours[i]))
                    out->muxer = (int)i;
        } else {
            for (size_t i = 0; i < nt && out->muxer < 0; i++)
                for (size_t j = 0; j < nours && out->muxer < 0; j++)
                    if (strcmp(ext->stream_muxers[i], ours[j]) == 0) out->muxer = (int)j;
        }
        if (out->muxer < 0) {
            rc = AP_ENOPROTO;
            goto out;
        }
    }
    ap_peer_id_from_ed25519(&out->id, pk);
    rc = 0;
out:
    apiary__noise_handshake_payload__free_unpacked(p, NULL);
    return rc;
}

int ap__secure_check_payload(const uint8_t *payload, size_t len, const uint8_t rs[AP_NOISE_DHLEN],
                             ap_peer_id_t *out)
{
    ap_secure_remote_t info;
    int rc = ap__secure_check_payload_ex(payload, len, rs, NULL, 0, false, &info);
    if (rc == 0) *out = info.id;
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
    rc = rs ? ap__secure_check_payload_ex(payload, plen, rs, hs->creds->muxers, hs->creds->nmuxers,
                                          hs->noise.initiator, &hs->info)
            : AP_ESTATE;
    sodium_memzero(payload, plen);
    if (rc != 0) {
        /* the message was not accepted: the step keeps naming it (logs say
         * "message 3", not the next one) */
        hs->noise.step = step;
        hs->noise.failed = rc;
        return rc;
    }
    hs->remote = hs->info.id;
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
