/* DHT wire messages (proto/dht.proto): strict decoding with caps. Internal. */
#ifndef AP_DHT_WIRE_H
#define AP_DHT_WIRE_H

#include "apiary/dht.h"
#include "dht.pb-c.h"

#define AP__DHT_MAX_BATCH       64           /* keys per FIND, records per STORE */
#define AP__DHT_MAX_RESULT_RECS 4096         /* records per key in a FIND result */
#define AP__DHT_MAX_NEAREST     64           /* peers per FIND result */
#define AP__DHT_MAX_ADDRS       4            /* addresses per peer */
#define AP__DHT_MSG_MAX         (1u << 20)   /* request and response cap */
#define AP__DHT_RESP_BUDGET     (900u << 10) /* responder stops adding records past this */

/* Unpacks and validates a request: body set, every count and length within
 * its cap, every record well-formed (record_from_pb). AP_EPROTO / AP_EMSGSIZE
 * on bad input. Free *out with apiary__dht__request__free_unpacked(.., NULL). */
int ap__dht_decode_request(const uint8_t *data, size_t len, Apiary__Dht__Request **out);
int ap__dht_decode_response(const uint8_t *data, size_t len, Apiary__Dht__Response **out);
/* A standalone Record message (for the fuzzer and tests). */
int ap__dht_decode_record(const uint8_t *data, size_t len, Apiary__Dht__Record **out);

/* Views a decoded record (borrowing its bytes). Checks sizes and the
 * signature length (0 or 64). Does not verify the signature. */
int ap__dht_record_from_pb(const Apiary__Dht__Record *pb, ap_dht_record_t *out, const uint8_t **sig,
                           bool *has_sig);
/* Fills pb to borrow rec's bytes. */
void ap__dht_record_to_pb(const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig,
                          Apiary__Dht__Record *pb);
/* Validates a PeerInfo and extracts the id. */
int ap__dht_peerinfo_check(const Apiary__Dht__PeerInfo *pi, ap_peer_id_t *id);

#endif
