/* libFuzzer target: the DHT record parser and everything a storing node does
 * with a record (size checks, owner markers and signature, storage put). */
#include "apiary/dht.h"
#include "dht/record.h"
#include "dht/storage.h"
#include "dht/wire.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Apiary__Dht__Record *pb;
    if (ap__dht_decode_record(data, size, &pb) != 0) return 0;
    ap_dht_record_t r;
    const uint8_t *sig;
    bool has_sig;
    if (ap__dht_record_from_pb(pb, &r, &sig, &has_sig) == 0 && ap__dht_check_sizes(&r) == 0 &&
        ap__dht_check_owner(&r, sig, has_sig) == 0) {
        ap__dht_storage_t st;
        ap__dht_storage_init(&st, 4, 1 << 16, 1000000, 0);
        int64_t now = r.expiration_ms > INT64_MIN + 1000 ? r.expiration_ms - 500 : 0;
        (void)ap__dht_storage_put(&st, &r, sig, has_sig, now);
        ap_dht_record_t r2 = r;
        r2.subkey = (const uint8_t *)"s";
        r2.subkey_len = 1;
        (void)ap__dht_storage_put(&st, &r2, sig, has_sig, now);
        uint8_t id[AP_DHT_ID_LEN];
        ap_dht_key_id(r.key, r.key_len, id);
        (void)ap__dht_storage_find(&st, id, now);
        ap__dht_storage_close(&st);
    }
    apiary__dht__record__free_unpacked(pb, NULL);
    return 0;
}
