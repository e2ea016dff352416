/* Moshpit grid groups: the group key of a round and the coordinate update. */
#include "apiary/avg.h"

#include "base/buf.h"

#include <sodium.h>
#include <string.h>

int ap_avg_moshpit_key(const char *prefix, const uint32_t *coords, int dims, uint64_t round,
                       uint8_t key[AP_AVG_GROUP_ID_LEN])
{
    if (!prefix || !coords || !key || dims <= 0 || dims > AP_AVG_MOSHPIT_MAX_DIMS) return AP_EINVAL;
    if (sodium_init() < 0) return AP_ESYS;
    crypto_generichash_state st;
    uint8_t b[8];
    crypto_generichash_init(&st, NULL, 0, AP_AVG_GROUP_ID_LEN);
    crypto_generichash_update(&st, (const uint8_t *)"apiary/moshpit/1", 16);
    size_t plen = strlen(prefix);
    ap__put_be64(b, plen);
    crypto_generichash_update(&st, b, 8);
    crypto_generichash_update(&st, (const uint8_t *)prefix, plen);
    ap__put_be64(b, round);
    crypto_generichash_update(&st, b, 8);
    int active = (int)(round % (uint64_t)dims);
    for (int i = 0; i < dims; i++) {
        if (i == active) continue;
        ap__put_be32(b, coords[i]);
        crypto_generichash_update(&st, b, 4);
    }
    crypto_generichash_final(&st, key, AP_AVG_GROUP_ID_LEN);
    return 0;
}

int ap_avg_moshpit_advance(uint32_t *coords, int dims, uint64_t round, uint32_t index)
{
    if (!coords || dims <= 0 || dims > AP_AVG_MOSHPIT_MAX_DIMS) return AP_EINVAL;
    coords[round % (uint64_t)dims] = index;
    return 0;
}
