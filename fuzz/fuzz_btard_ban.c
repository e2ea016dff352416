/* Fuzz target: the Ban decoder and checker, and the DHT ban validator. The
 * input is a Ban value; the accused is the signer named by its evidence (or
 * a fixed peer), so the evidence checks run on well-formed proofs too
 * (MPRNG pairs and an aggregator's AggCheck). */
#include "apiary/btard.h"
#include "btard/step_wire.h"
#include "btard/wire.h"

#include "btard.pb-c.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap_peer_id_t peer;
    memset(&peer, 0, sizeof peer);
    uint8_t run[AP_BTARD_HASH_LEN] = {0};
    if (size <= AP_BTARD_BAN_MAX) {
        Apiary__Btard__Ban *m = apiary__btard__ban__unpack(NULL, size, data);
        if (m) {
            ap__btard_msg_t msg;
            ap__step_msg_t *sm = malloc(sizeof *sm);
            if (ap__btard_msg_decode(m->evidence_a.data, m->evidence_a.len, &msg) == 0)
                peer = msg.sender;
            else if (sm && ap__step_msg_decode(m->evidence_a.data, m->evidence_a.len, sm) == 0)
                peer = sm->sender;
            free(sm);
            if (m->run.len == AP_BTARD_HASH_LEN) memcpy(run, m->run.data, sizeof run);
            apiary__btard__ban__free_unpacked(m, NULL);
        }
    }
    ap_btard_ban_t b;
    int rc = ap_btard_ban_check(data, size, &peer, NULL, &b);
    if (rc == 0 && b.fault != AP_BTARD_FAULT_BAD_REVEAL && b.fault != AP_BTARD_FAULT_EQUIVOCATION &&
        b.fault != AP_BTARD_FAULT_BAD_AGGREGATE)
        abort();
    char key[AP_BTARD_BAN_KEY_LEN + 1];
    ap_btard_ban_key(run, key);
    ap_dht_record_t rec = {.key = (const uint8_t *)key,
                           .key_len = AP_BTARD_BAN_KEY_LEN,
                           .subkey = peer.b,
                           .subkey_len = AP_PEER_ID_LEN,
                           .value = data,
                           .value_len = size};
    int vr = ap_btard_ban_validator(NULL, &rec, NULL);
    if ((vr == 0) != (rc == 0)) abort();
    return 0;
}
