/* Fuzz target: the BTARD signed-message decoder, an MPRNG state machine
 * taking the message, and the evidence checker (input split at byte 0). */
#include "apiary/btard.h"
#include "apiary/identity.h"
#include "btard/wire.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

static void sign_cb(void *arg, const uint8_t *msg, size_t len, uint8_t sig[AP_ED25519_SIG_LEN])
{
    crypto_sign_detached(sig, NULL, msg, len, ((const ap_identity_t *)arg)->sk);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap__btard_msg_t m;
    if (ap__btard_msg_decode(data, size, &m) == 0) {
        if (m.kind != AP__BTARD_MPRNG_COMMIT && m.kind != AP__BTARD_MPRNG_REVEAL) abort();
        /* a group of the sender and one local peer, in the message's round */
        static ap_identity_t me;
        static int init;
        if (!init) {
            uint8_t s[AP_IDENTITY_SEED_LEN] = {7};
            if (ap_identity_from_seed(&me, s)) abort();
            init = 1;
        }
        ap_peer_id_t peers[2] = {me.id, m.sender};
        ap_btard_mprng_cfg_t cfg = {.peers = peers, .n = 2, .self = 0, .sign = sign_cb};
        cfg.sign_arg = &me;
        memcpy(cfg.ctx, m.ctx, AP_BTARD_HASH_LEN);
        ap_btard_mprng_t *g = ap_btard_mprng_new(&cfg);
        if (g) {
            uint8_t v[AP_BTARD_HASH_LEN] = {1};
            if (ap_btard_mprng_start(g, v)) abort();
            /* any outcome is fine: no crash, no leak */
            int rc = ap_btard_mprng_receive(g, data, size);
            rc |= ap_btard_mprng_receive(g, data, size);
            (void)rc;
            (void)ap_btard_mprng_deadline(g);
            ap_btard_mprng_free(g);
        }
    }
    if (size > 1) {
        size_t cut = 1 + data[0] % (size - 1);
        ap_btard_fault_t f;
        uint8_t ctx[AP_BTARD_HASH_LEN] = {0};
        if (ap__btard_msg_decode(data + 1, cut - 1, &m) == 0) memcpy(ctx, m.ctx, sizeof ctx);
        int ok = ap_btard_mprng_check_evidence(ctx, &m.sender, data + 1, cut - 1, data + cut,
                                               size - cut, &f);
        (void)ok;
    }
    return 0;
}
