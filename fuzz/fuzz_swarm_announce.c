/* Fuzz target: the SWARM announcement decoder and the balancer feed. The
 * input is split at its first ';' into a subkey and a value, fed as one DHT
 * dictionary entry; a value that decodes must re-encode to the same bytes. */
#include "apiary/swarm.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap_swarm_announce_t a;
    if (ap_swarm_announce_decode(data, size, &a) == 0) {
        uint8_t back[AP_SWARM_ANNOUNCE_LEN];
        ap_swarm_announce_encode(&a, back);
        if (memcmp(back, data, sizeof back)) abort();
    }
    const uint8_t *semi = size ? memchr(data, ';', size) : NULL; /* data may be NULL when empty */
    size_t sk = semi ? (size_t)(semi - data) : size;
    ap_dht_record_t rec = {.subkey = data,
                           .subkey_len = sk,
                           .value = semi ? semi + 1 : NULL,
                           .value_len = semi ? size - sk - 1 : 0,
                           .expiration_ms = 2000};
    ap_dht_result_t res = {.found = true, .is_dict = true, .nrecords = 1, .records = &rec};
    ap_swarm_balancer_t *b = ap_swarm_balancer_new(NULL);
    if (!b) return 0;
    int fed = ap_swarm_balancer_feed(b, &res, 0, 1000);
    if (fed < 0 || fed > 1 || ap_swarm_balancer_count(b) != (size_t)fed) abort();
    ap_swarm_balancer_free(b);
    return 0;
}
