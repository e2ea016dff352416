/* DHT records: ids, owner markers, signatures, static checks. */
#include "dht/record.h"

#include "base/buf.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

void ap_dht_key_id(const uint8_t *key, size_t len, uint8_t id[AP_DHT_ID_LEN])
{
    crypto_generichash(id, AP_DHT_ID_LEN, key, len, NULL, 0);
}

void ap_dht_peer_node_id(const ap_peer_id_t *peer, uint8_t id[AP_DHT_ID_LEN])
{
    crypto_generichash(id, AP_DHT_ID_LEN, peer->b, AP_PEER_ID_LEN, NULL, 0);
}

int ap__dht_cmp_dist(const uint8_t *target, const uint8_t *a, const uint8_t *b)
{
    for (int i = 0; i < AP_DHT_ID_LEN; i++) {
        uint8_t da = (uint8_t)(a[i] ^ target[i]), db = (uint8_t)(b[i] ^ target[i]);
        if (da != db) return da < db ? -1 : 1;
    }
    return 0;
}

int ap__dht_common_prefix(const uint8_t *a, const uint8_t *b)
{
    for (int i = 0; i < AP_DHT_ID_LEN; i++) {
        uint8_t x = (uint8_t)(a[i] ^ b[i]);
        if (x) return i * 8 + __builtin_clz((unsigned)x) - 24;
    }
    return AP_DHT_ID_LEN * 8;
}

/* Scans one byte string for owner markers. */
static int scan_owner(const uint8_t *p, size_t n, bool *has, ap_peer_id_t *owner)
{
    const size_t tl = sizeof AP__DHT_OWNER_TAG - 1;
    size_t i = 0;
    while (n >= tl && i <= n - tl) {
        const uint8_t *hit = memmem(p + i, n - i, AP__DHT_OWNER_TAG, tl);
        if (!hit) break;
        size_t start = (size_t)(hit - p) + tl;
        const uint8_t *close = memchr(p + start, ']', n - start);
        if (!close) return AP_EAUTH;
        size_t idlen = (size_t)(close - (p + start));
        if (idlen == 0 || idlen >= AP_PEER_ID_STR_MAX) return AP_EAUTH;
        char text[AP_PEER_ID_STR_MAX];
        memcpy(text, p + start, idlen);
        text[idlen] = 0;
        ap_peer_id_t id;
        if (ap_peer_id_parse(&id, text) != 0) return AP_EAUTH;
        if (*has && !ap_peer_id_eq(&id, owner)) return AP_EAUTH;
        *owner = id;
        *has = true;
        i = (size_t)(close - p) + 1;
    }
    return 0;
}

int ap__dht_find_owner(const ap_dht_record_t *rec, bool *has_owner, ap_peer_id_t *owner)
{
    *has_owner = false;
    int rc = scan_owner(rec->key, rec->key_len, has_owner, owner);
    if (rc == 0 && rec->subkey_len) rc = scan_owner(rec->subkey, rec->subkey_len, has_owner, owner);
    return rc;
}

int ap__dht_check_sizes(const ap_dht_record_t *rec)
{
    if (rec->key_len == 0 || !rec->key) return AP_EINVAL;
    if (rec->key_len > AP_DHT_KEY_MAX || rec->subkey_len > AP_DHT_SUBKEY_MAX ||
        rec->value_len > AP_DHT_VALUE_MAX)
        return AP_EMSGSIZE;
    if ((rec->subkey_len && !rec->subkey) || (rec->value_len && !rec->value)) return AP_EINVAL;
    return 0;
}

int ap_dht_record_sign_bytes(const ap_dht_record_t *rec, uint8_t **out, size_t *out_len)
{
    ap_buf_t b = {0};
    int rc = ap__buf_append(&b, AP__DHT_SIGN_DOMAIN, sizeof AP__DHT_SIGN_DOMAIN); /* incl. NUL */
    if (!rc) rc = ap__buf_append_be32(&b, (uint32_t)rec->key_len);
    if (!rc) rc = ap__buf_append(&b, rec->key, rec->key_len);
    if (!rc) rc = ap__buf_append_be32(&b, (uint32_t)rec->subkey_len);
    if (!rc && rec->subkey_len) rc = ap__buf_append(&b, rec->subkey, rec->subkey_len);
    if (!rc) rc = ap__buf_append_be32(&b, (uint32_t)rec->value_len);
    if (!rc && rec->value_len) rc = ap__buf_append(&b, rec->value, rec->value_len);
    if (!rc) rc = ap__buf_append_be64(&b, (uint64_t)rec->expiration_ms);
    if (rc) {
        ap__buf_free(&b);
        return rc;
    }
    *out = b.data;
    *out_len = b.len;
    return 0;
}

int ap__dht_check_owner(const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig)
{
    return ap__dht_check_owner_cached(NULL, rec, sig, has_sig);
}

static void sigcache_digest(const ap_peer_id_t *owner, const uint8_t *sig, const uint8_t *msg,
                            size_t len, uint8_t d[32])
{
    crypto_generichash_state hs;
    crypto_generichash_init(&hs, NULL, 0, 32);
    crypto_generichash_update(&hs, owner->b, AP_PEER_ID_LEN);
    crypto_generichash_update(&hs, sig, AP_ED25519_SIG_LEN);
    crypto_generichash_update(&hs, msg, len);
    crypto_generichash_final(&hs, d, 32);
}

static void sigcache_put(ap__dht_sigcache_t *sc, const uint8_t d[32])
{
    memcpy(sc->d[sc->next], d, 32);
    sc->next = (sc->next + 1) % AP__DHT_SIGCACHE;
    if (sc->n < AP__DHT_SIGCACHE) sc->n++;
}

static bool sigcache_has(const ap__dht_sigcache_t *sc, const uint8_t d[32])
{
    for (uint32_t i = 0; i < sc->n; i++)
        if (memcmp(sc->d[i], d, 32) == 0) return true;
    return false;
}

int ap__dht_check_owner_cached(ap__dht_sigcache_t *sc, const ap_dht_record_t *rec,
                               const uint8_t *sig, bool has_sig)
{
    bool has_owner;
    ap_peer_id_t owner;
    int rc = ap__dht_find_owner(rec, &has_owner, &owner);
    if (rc) return rc;
    if (!has_owner) return has_sig ? AP_EAUTH : 0;
    if (!has_sig) return AP_EAUTH;
    uint8_t *msg;
    size_t len;
    if ((rc = ap_dht_record_sign_bytes(rec, &msg, &len))) return rc;
    uint8_t d[32];
    if (sc) {
        sigcache_digest(&owner, sig, msg, len, d);
        if (sigcache_has(sc, d)) {
            sc->hits++;
            free(msg);
            return 0;
        }
        sc->misses++;
    }
    rc = ap_peer_verify(&owner, msg, len, sig);
    free(msg);
    if (rc) return AP_EAUTH;
    if (sc) sigcache_put(sc, d);
    return 0;
}

int ap__dht_sign(ap_rt_t *rt, const ap_dht_record_t *rec, uint8_t sig[AP_ED25519_SIG_LEN],
                 bool *has_sig)
{
    return ap__dht_sign_cached(rt, NULL, rec, sig, has_sig);
}

int ap__dht_sign_cached(ap_rt_t *rt, ap__dht_sigcache_t *sc, const ap_dht_record_t *rec,
                        uint8_t sig[AP_ED25519_SIG_LEN], bool *has_sig)
{
    bool has_owner;
    ap_peer_id_t owner;
    *has_sig = false;
    int rc = ap__dht_find_owner(rec, &has_owner, &owner);
    if (rc) return rc;
    if (!has_owner) return 0;
    if (!ap_peer_id_eq(&owner, ap_rt_self(rt))) return AP_EPERM;
    uint8_t *msg;
    size_t len;
    if ((rc = ap_dht_record_sign_bytes(rec, &msg, &len))) return rc;
    ap_rt_sign(rt, msg, len, sig);
    if (sc) { /* our own signature of these bytes: no need to verify it again */
        uint8_t d[32];
        sigcache_digest(&owner, sig, msg, len, d);
        sigcache_put(sc, d);
    }
    free(msg);
    *has_sig = true;
    return 0;
}
