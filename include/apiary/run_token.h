/* Apiary — closed runs (prefix ap_run_token_): join tokens signed by the
 * run's owner, and the owner's revocations in the DHT.
 *
 * A run is CLOSED when its peers are given the owner's PeerID (config
 * run_owner of apiary/collab.h; `apiary train --run-owner PEERID`). The
 * owner's Ed25519 key signs one token per admitted peer:
 *     sig = Ed25519(owner, "apiary run token v1" 0x00 | run id | 0x00 |
 *                          peer (38 bytes) | expires_ms (8 bytes, LE))
 * so a token admits one peer to one run until a wall-clock time. Peers of a
 * closed run carry their token in their progress records and state requests,
 * and check everyone else's: a record without a valid unexpired token, or of
 * a revoked peer, is ignored (it never enters a group, an estimate or a
 * download), and its state requests and group joins are refused, each
 * logged once per peer with the reason. The owner needs no token.
 *
 * REVOCATION. The owner stores one record per revoked peer under the DHT key
 * "<run_id>_revoked", subkey "[owner:<owner PeerID>]<peer PeerID>" (so only
 * the owner's signature can write it; the DHT checks it on store and on
 * read); the value is empty. Readers look at nothing else under that key.
 * DHT records live at most a day (ap_dht_config_t.max_ttl_ms): the owner
 * stores a revocation again before it expires for as long as the token it
 * revokes is valid.
 *
 * TEXT FORM. `apiary run-token` prints a token as base64url without padding
 * of its protobuf encoding (proto/optim.proto, RunToken): at most
 * AP_RUN_TOKEN_TEXT_MAX - 1 characters.
 *
 * THREADING. Everything here is reentrant except ap_run_token_revoke, which
 * belongs to the DHT's loop thread. */
#ifndef APIARY_RUN_TOKEN_H
#define APIARY_RUN_TOKEN_H

#include "apiary/common.h"
#include "apiary/dht.h"
#include "apiary/identity.h"
#include "apiary/peer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_RUN_TOKEN_MAX      160        /* bytes of a packed token (hard cap when decoding) */
#define AP_RUN_TOKEN_TEXT_MAX 224        /* characters of the text form, NUL included */
#define AP_RUN_TOKEN_REVOKED  "_revoked" /* DHT key suffix of the owner's revocations */

typedef struct ap_run_token {
    ap_peer_id_t peer;  /* the peer it admits */
    int64_t expires_ms; /* wall clock (ms since the Unix epoch) after which it is refused */
    uint8_t sig[AP_ED25519_SIG_LEN];
} ap_run_token_t;

/* Signs a token for peer to join run_id (1..128 bytes) until expires_ms.
 * AP_EINVAL on a bad argument. */
AP_EXPORT int ap_run_token_issue(const ap_identity_t *owner, const char *run_id,
                                 const ap_peer_id_t *peer, int64_t expires_ms, ap_run_token_t *out);

/* Checks a token against the run: 0 if owner signed it for this run_id and
 * this peer and it is not expired at now_ms; else
 *   AP_EPERM     it admits another peer;
 *   AP_EEXPIRED  expires_ms < now_ms;
 *   AP_EAUTH     the signature is not the owner's for this run (forged, or
 *                issued for another run or by another owner).
 * ap_run_token_why gives these reasons as words for log lines. */
AP_EXPORT AP_NODISCARD int ap_run_token_verify(const ap_run_token_t *t, const ap_peer_id_t *owner,
                                               const char *run_id, const ap_peer_id_t *peer,
                                               int64_t now_ms);
/* "admits another peer", "expired", "not signed by the run's owner", "no
 * token", "revoked by the run's owner" for AP_EPERM, AP_EEXPIRED, AP_EAUTH,
 * AP_ENOTFOUND and AP_ESTALE; ap_strerror otherwise. Static strings. */
AP_EXPORT const char *ap_run_token_why(int rc);

/* Binary form (the RunToken protobuf). pack returns the length or
 * AP_EMSGSIZE. unpack decodes UNTRUSTED bytes: AP_ECORRUPT unless they are
 * at most AP_RUN_TOKEN_MAX bytes of a version-1 RunToken with an Ed25519
 * PeerID and a 64-byte signature (*out untouched then). unpack does not
 * check the signature (ap_run_token_verify does). */
AP_EXPORT int ap_run_token_pack(const ap_run_token_t *t, uint8_t *buf, size_t cap);
AP_EXPORT AP_NODISCARD int ap_run_token_unpack(const uint8_t *buf, size_t len, ap_run_token_t *out);
/* Text form: base64url of the binary form, NUL-terminated in out (cap >=
 * AP_RUN_TOKEN_TEXT_MAX). parse takes UNTRUSTED text (surrounding spaces and
 * newlines allowed): AP_ECORRUPT if it is not one. */
AP_EXPORT int ap_run_token_format(const ap_run_token_t *t, char *out, size_t cap);
AP_EXPORT AP_NODISCARD int ap_run_token_parse(const char *text, ap_run_token_t *out);

/* The revocation record's key ("<run_id>_revoked") and subkey
 * ("[owner:<owner>]<peer>"), NUL-terminated; return the length or
 * AP_EINVAL. */
AP_EXPORT int ap_run_token_revoked_key(const char *run_id, char *out, size_t cap);
AP_EXPORT int ap_run_token_revoked_subkey(const ap_peer_id_t *owner, const ap_peer_id_t *peer,
                                          char *out, size_t cap);
/* The peer a revocation subkey names, if it is the owner's form; else
 * AP_EINVAL. Untrusted subkeys are fine. */
AP_EXPORT int ap_run_token_revoked_peer(const ap_peer_id_t *owner, const uint8_t *subkey,
                                        size_t len, ap_peer_id_t *out);

/* Stores a revocation of peer in run_id until expiration_ms (at most the
 * DHT's max_ttl ahead), signed by the DHT node's own key: it revokes as the
 * owner only on a node whose identity is the owner's key (readers ignore
 * anyone else's). cb and the errors as ap_dht_store. Loop thread of the
 * DHT. */
AP_EXPORT int ap_run_token_revoke(ap_dht_t *dht, const char *run_id, const ap_peer_id_t *peer,
                                  int64_t expiration_ms, ap_dht_store_fn cb, void *arg);

#ifdef __cplusplus
}
#endif
#endif
