#include "apiary/peer.h"
#include "apiary/error.h"
#include "base/codec.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>

/* identity multihash (0x00, len 0x24) of protobuf PublicKey{Type=Ed25519(1), Data=pk} */
static const uint8_t ed25519_prefix[6] = {0x00, 0x24, 0x08, 0x01, 0x12, 0x20};

void ap_peer_id_from_ed25519(ap_peer_id_t *out, const uint8_t pk[AP_ED25519_PK_LEN])
{
    memcpy(out->b, ed25519_prefix, sizeof ed25519_prefix);
    memcpy(out->b + sizeof ed25519_prefix, pk, AP_ED25519_PK_LEN);
}

int ap_peer_id_pubkey(const ap_peer_id_t *id, uint8_t pk[AP_ED25519_PK_LEN])
{
    if (memcmp(id->b, ed25519_prefix, sizeof ed25519_prefix) != 0) return AP_EINVAL;
    memcpy(pk, id->b + sizeof ed25519_prefix, AP_ED25519_PK_LEN);
    return 0;
}

int ap_peer_id_from_bytes(ap_peer_id_t *out, const uint8_t *b, size_t len)
{
    if (len != AP_PEER_ID_LEN || memcmp(b, ed25519_prefix, sizeof ed25519_prefix) != 0)
        return AP_EINVAL;
    memcpy(out->b, b, AP_PEER_ID_LEN);
    return 0;
}

char *ap_peer_id_str(const ap_peer_id_t *id, char buf[AP_PEER_ID_STR_MAX])
{
    if (ap__base58_encode(buf, AP_PEER_ID_STR_MAX, id->b, AP_PEER_ID_LEN) < 0) buf[0] = 0;
    return buf;
}

char *ap_peer_id_short(const ap_peer_id_t *id, char buf[AP_PEER_SHORT_LEN])
{
    char full[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(id, full);
    size_t n = strlen(full);
    const char *tail = n > 8 ? full + n - 8 : full;
    size_t m = strlen(tail);
    if (m > AP_PEER_SHORT_LEN - 1) m = AP_PEER_SHORT_LEN - 1;
    memcpy(buf, tail, m);
    buf[m] = 0;
    return buf;
}

int ap_peer_id_parse(ap_peer_id_t *out, const char *text)
{
    if (!text) return AP_EINVAL;
    uint8_t b[AP_PEER_ID_LEN + 8];
    int n = ap__base58_decode(b, sizeof b, text);
    if (n < 0) return AP_EINVAL;
    return ap_peer_id_from_bytes(out, b, (size_t)n);
}

bool ap_peer_id_eq(const ap_peer_id_t *a, const ap_peer_id_t *b)
{
    return memcmp(a->b, b->b, AP_PEER_ID_LEN) == 0;
}

int ap_peer_id_cmp(const ap_peer_id_t *a, const ap_peer_id_t *b)
{
    return memcmp(a->b, b->b, AP_PEER_ID_LEN);
}

uint64_t ap_peer_id_hash(const ap_peer_id_t *id)
{
    /* The key bytes are uniformly random already; mix 8 of them anyway so a
     * crafted key cannot collide everything into one bucket cheaply. */
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 6; i < AP_PEER_ID_LEN; i++) {
        h ^= id->b[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

int ap_peer_verify(const ap_peer_id_t *id, const uint8_t *msg, size_t len,
                   const uint8_t sig[AP_ED25519_SIG_LEN])
{
    uint8_t pk[AP_ED25519_PK_LEN];
    if (ap_peer_id_pubkey(id, pk) != 0) return AP_EAUTH;
    return crypto_sign_verify_detached(sig, msg, len, pk) == 0 ? 0 : AP_EAUTH;
}
