/* Closed runs: join tokens signed by the run's owner and the owner's
 * revocation records (include/apiary/run_token.h). Sans-I/O: libsodium for
 * the signatures, the DHT for revocations. */
#include "apiary/run_token.h"

#include "apiary/error.h"
#include "apiary/runtime.h"

#include "optim.pb-c.h"
#include "optim/collab_impl.h"

#include <sodium.h>
#include <string.h>

#define TOKEN_DOMAIN "apiary run token v1"
#define RUN_ID_MAX   128

static size_t signed_bytes(const char *run_id, const ap_peer_id_t *peer, int64_t expires_ms,
                           uint8_t *out);

/* The signed bytes: domain | 0 | run id | 0 | peer | expires LE. */
size_t ap__run_token_message(const char *run_id, const ap_peer_id_t *peer, int64_t expires_ms,
                             uint8_t *out)
{
    return signed_bytes(run_id, peer, expires_ms, out);
}

static size_t signed_bytes(const char *run_id, const ap_peer_id_t *peer, int64_t expires_ms,
                           uint8_t *out)
{
    size_t dl = sizeof TOKEN_DOMAIN; /* with its NUL */
    size_t rl = strlen(run_id);
    size_t o = 0;
    memcpy(out + o, TOKEN_DOMAIN, dl);
    o += dl;
    memcpy(out + o, run_id, rl);
    o += rl;
    out[o++] = 0;
    memcpy(out + o, peer->b, AP_PEER_ID_LEN);
    o += AP_PEER_ID_LEN;
    uint64_t e = (uint64_t)expires_ms;
    for (int i = 0; i < 8; i++) out[o++] = (uint8_t)(e >> (8 * i));
    return o;
}

static bool run_id_ok(const char *run_id)
{
    size_t rl = run_id ? strlen(run_id) : 0;
    return rl > 0 && rl <= RUN_ID_MAX;
}

int ap_run_token_issue(const ap_identity_t *owner, const char *run_id, const ap_peer_id_t *peer,
                       int64_t expires_ms, ap_run_token_t *out)
{
    if (!owner || !peer || !out || !run_id_ok(run_id)) return AP_EINVAL;
    if (sodium_init() < 0) return AP_ESYS;
    uint8_t msg[sizeof TOKEN_DOMAIN + RUN_ID_MAX + 1 + AP_PEER_ID_LEN + 8];
    size_t len = signed_bytes(run_id, peer, expires_ms, msg);
    memset(out, 0, sizeof *out);
    out->peer = *peer;
    out->expires_ms = expires_ms;
    crypto_sign_detached(out->sig, NULL, msg, len, owner->sk);
    return 0;
}

int ap_run_token_verify(const ap_run_token_t *t, const ap_peer_id_t *owner, const char *run_id,
                        const ap_peer_id_t *peer, int64_t now_ms)
{
    if (!t || !owner || !peer || !run_id_ok(run_id)) return AP_EINVAL;
    uint8_t msg[sizeof TOKEN_DOMAIN + RUN_ID_MAX + 1 + AP_PEER_ID_LEN + 8];
    size_t len = signed_bytes(run_id, &t->peer, t->expires_ms, msg);
    /* the signature first: a forged token says nothing true */
    if (ap_peer_verify(owner, msg, len, t->sig) != 0) return AP_EAUTH;
    if (!ap_peer_id_eq(&t->peer, peer)) return AP_EPERM;
    if (t->expires_ms < now_ms) return AP_EEXPIRED;
    return 0;
}

const char *ap_run_token_why(int rc)
{
    switch (rc) {
    case AP_EPERM:
        return "its token admits another peer";
    case AP_EEXPIRED:
        return "its token expired";
    case AP_EAUTH:
        return "its token is not signed by the run's owner";
    case AP_ENOTFOUND:
        return "no token";
    case AP_ESTALE:
        return "revoked by the run's owner";
    case AP_ECORRUPT:
        return "undecodable token";
    default:
        return ap_strerror(rc);
    }
}

int ap_run_token_pack(const ap_run_token_t *t, uint8_t *buf, size_t cap)
{
    Apiary__Optim__RunToken m = APIARY__OPTIM__RUN_TOKEN__INIT;
    m.version = 1;
    m.peer.data = (uint8_t *)t->peer.b;
    m.peer.len = AP_PEER_ID_LEN;
    m.expires_ms = t->expires_ms;
    m.sig.data = (uint8_t *)t->sig;
    m.sig.len = AP_ED25519_SIG_LEN;
    size_t len = apiary__optim__run_token__get_packed_size(&m);
    if (len > cap || len > AP_RUN_TOKEN_MAX) return AP_EMSGSIZE;
    apiary__optim__run_token__pack(&m, buf);
    return (int)len;
}

int ap_run_token_unpack(const uint8_t *buf, size_t len, ap_run_token_t *out)
{
    if (!buf || len == 0 || len > AP_RUN_TOKEN_MAX) return AP_ECORRUPT;
    Apiary__Optim__RunToken *m = apiary__optim__run_token__unpack(NULL, len, buf);
    if (!m) return AP_ECORRUPT;
    ap_run_token_t t;
    memset(&t, 0, sizeof t);
    int rc = 0;
    if (m->version != 1 || m->sig.len != AP_ED25519_SIG_LEN ||
        ap_peer_id_from_bytes(&t.peer, m->peer.data, m->peer.len) != 0)
        rc = AP_ECORRUPT;
    if (!rc) {
        uint8_t pk[AP_ED25519_PK_LEN];
        if (ap_peer_id_pubkey(&t.peer, pk) != 0) rc = AP_ECORRUPT;
    }
    if (!rc) {
        t.expires_ms = m->expires_ms;
        memcpy(t.sig, m->sig.data, AP_ED25519_SIG_LEN);
    }
    apiary__optim__run_token__free_unpacked(m, NULL);
    if (!rc) *out = t;
    return rc;
}

int ap_run_token_format(const ap_run_token_t *t, char *out, size_t cap)
{
    uint8_t bin[AP_RUN_TOKEN_MAX];
    int len = ap_run_token_pack(t, bin, sizeof bin);
    if (len < 0) return len;
    size_t need = sodium_base64_ENCODED_LEN((size_t)len, sodium_base64_VARIANT_URLSAFE_NO_PADDING);
    if (!out || cap < need || need > AP_RUN_TOKEN_TEXT_MAX) return AP_EMSGSIZE;
    sodium_bin2base64(out, cap, bin, (size_t)len, sodium_base64_VARIANT_URLSAFE_NO_PADDING);
    return (int)strlen(out);
}

int ap_run_token_parse(const char *text, ap_run_token_t *out)
{
    if (!text || !out) return AP_ECORRUPT;
    size_t len = strnlen(text, AP_RUN_TOKEN_TEXT_MAX * 2);
    const char *b = text, *e = text + len;
    while (b < e && (*b == ' ' || *b == '\t' || *b == '\n' || *b == '\r')) b++;
    while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r')) e--;
    if (e == b || (size_t)(e - b) >= AP_RUN_TOKEN_TEXT_MAX) return AP_ECORRUPT;
    uint8_t bin[AP_RUN_TOKEN_MAX];
    size_t bl = 0;
    const char *end = NULL;
    if (sodium_base642bin(bin, sizeof bin, b, (size_t)(e - b), NULL, &bl, &end,
                          sodium_base64_VARIANT_URLSAFE_NO_PADDING) != 0 ||
        end != e)
        return AP_ECORRUPT;
    return ap_run_token_unpack(bin, bl, out);
}

int ap_run_token_revoked_key(const char *run_id, char *out, size_t cap)
{
    if (!run_id_ok(run_id) || !out) return AP_EINVAL;
    int n = snprintf(out, cap, "%s%s", run_id, AP_RUN_TOKEN_REVOKED);
    return n < 0 || (size_t)n >= cap ? AP_EINVAL : n;
}

int ap_run_token_revoked_subkey(const ap_peer_id_t *owner, const ap_peer_id_t *peer, char *out,
                                size_t cap)
{
    if (!owner || !peer || !out) return AP_EINVAL;
    char o[AP_PEER_ID_STR_MAX], p[AP_PEER_ID_STR_MAX];
    int n = snprintf(out, cap, "[owner:%s]%s", ap_peer_id_str(owner, o), ap_peer_id_str(peer, p));
    return n < 0 || (size_t)n >= cap ? AP_EINVAL : n;
}

int ap_run_token_revoked_peer(const ap_peer_id_t *owner, const uint8_t *subkey, size_t len,
                              ap_peer_id_t *out)
{
    char o[AP_PEER_ID_STR_MAX], prefix[AP_PEER_ID_STR_MAX + 16], txt[AP_PEER_ID_STR_MAX];
    if (!owner || !subkey || !out) return AP_EINVAL;
    int pl = snprintf(prefix, sizeof prefix, "[owner:%s]", ap_peer_id_str(owner, o));
    if (pl <= 0 || len <= (size_t)pl || memcmp(subkey, prefix, (size_t)pl) != 0) return AP_EINVAL;
    size_t tl = len - (size_t)pl;
    if (tl >= sizeof txt) return AP_EINVAL;
    memcpy(txt, subkey + pl, tl);
    txt[tl] = 0;
    if (memchr(txt, 0, tl)) return AP_EINVAL;
    return ap_peer_id_parse(out, txt) == 0 ? 0 : AP_EINVAL;
}

int ap_run_token_revoke(ap_dht_t *dht, const char *run_id, const ap_peer_id_t *peer,
                        int64_t expiration_ms, ap_dht_store_fn cb, void *arg)
{
    if (!dht || !peer) return AP_EINVAL;
    char key[RUN_ID_MAX + sizeof AP_RUN_TOKEN_REVOKED];
    char sub[2 * AP_PEER_ID_STR_MAX + 16];
    int kl = ap_run_token_revoked_key(run_id, key, sizeof key);
    if (kl < 0) return kl;
    const ap_peer_id_t *self = ap_rt_self(ap_dht_runtime(dht));
    int sl = ap_run_token_revoked_subkey(self, peer, sub, sizeof sub);
    if (sl < 0) return sl;
    ap_dht_record_t rec = {.key = (const uint8_t *)key,
                           .key_len = (size_t)kl,
                           .subkey = (const uint8_t *)sub,
                           .subkey_len = (size_t)sl,
                           .value = (const uint8_t *)"",
                           .value_len = 0,
                           .expiration_ms = expiration_ms};
    return ap_dht_store(dht, &rec, cb, arg);
}
