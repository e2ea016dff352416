/* BTARD signed messages on the wire (proto/btard.proto). Internal. */
#ifndef AP_BTARD_WIRE_H
#define AP_BTARD_WIRE_H

#include "apiary/btard.h"
#include "apiary/peer.h"

enum { AP__BTARD_MPRNG_COMMIT = 1, AP__BTARD_MPRNG_REVEAL = 2 };

/* A decoded, signature-checked MPRNG message (commit: data = hash; reveal:
 * data = value). */
typedef struct ap__btard_msg {
    uint32_t kind;
    ap_peer_id_t sender;
    uint8_t ctx[AP_BTARD_HASH_LEN];
    uint32_t attempt;
    uint8_t data[AP_BTARD_HASH_LEN];
} ap__btard_msg_t;

/* Encodes and signs m (sender = the signer's id). Returns the length written
 * to out (cap >= AP_BTARD_MSG_MAX), or 0 on failure. */
size_t ap__btard_msg_encode(const ap__btard_msg_t *m, ap_btard_sign_fn sign, void *sign_arg,
                            uint8_t *out, size_t cap);
/* Decodes b, checks every length and the sender's signature. AP_EMSGSIZE,
 * AP_ECORRUPT (malformed), AP_ENOTSUP (unknown kind), AP_EAUTH (bad
 * signature). */
int ap__btard_msg_decode(const uint8_t *b, size_t len, ap__btard_msg_t *m);

#endif
