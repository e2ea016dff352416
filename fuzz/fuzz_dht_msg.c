/* libFuzzer target: every DHT wire message (Request and Response bodies).
 * The first byte chooses the decoder; decoded messages are walked the way the
 * node walks them (record views, owner checks, peer infos). */
#include "apiary/dht.h"
#include "dht/record.h"
#include "dht/wire.h"

#include <stddef.h>
#include <stdint.h>

static void walk_record(const Apiary__Dht__Record *pb)
{
    ap_dht_record_t r;
    const uint8_t *sig;
    bool has_sig;
    if (ap__dht_record_from_pb(pb, &r, &sig, &has_sig) == 0) {
        (void)ap__dht_check_sizes(&r);
        (void)ap__dht_check_owner(&r, sig, has_sig);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] & 1) {
        Apiary__Dht__Response *r;
        if (ap__dht_decode_response(data + 1, size - 1, &r) == 0) {
            if (r->body_case == APIARY__DHT__RESPONSE__BODY_FIND) {
                for (size_t i = 0; i < r->find->n_results; i++) {
                    const Apiary__Dht__FindResult *fr = r->find->results[i];
                    for (size_t j = 0; j < fr->n_records; j++) walk_record(fr->records[j]);
                    for (size_t j = 0; j < fr->n_nearest; j++) {
                        ap_peer_id_t id;
                        if (ap__dht_peerinfo_check(fr->nearest[j], &id) == 0) {
                            uint8_t nid[AP_DHT_ID_LEN];
                            ap_dht_peer_node_id(&id, nid);
                        }
                    }
                }
            }
            apiary__dht__response__free_unpacked(r, NULL);
        }
    } else {
        Apiary__Dht__Request *q;
        if (ap__dht_decode_request(data + 1, size - 1, &q) == 0) {
            if (q->body_case == APIARY__DHT__REQUEST__BODY_STORE)
                for (size_t i = 0; i < q->store->n_records; i++) walk_record(q->store->records[i]);
            apiary__dht__request__free_unpacked(q, NULL);
        }
    }
    return 0;
}
