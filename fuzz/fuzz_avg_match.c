/* Fuzz target: the matchmaking wire decoders (DHT declaration, join request,
 * join response). First byte selects the decoder. Whatever decodes must
 * satisfy the decoder's guarantees and survive an encode/decode round trip
 * unchanged. */
#include "averaging/matchmaking.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void check_member(const ap__mm_member_t *m)
{
    if (m->role > AP_AVG_AUX || !isfinite(m->up) || !isfinite(m->down) || !(m->up > 0) ||
        !(m->down > 0) || m->naddrs < 0 || m->naddrs > AP__MM_ADDRS_MAX ||
        m->gather_len > AP__MM_GATHER_MAX)
        abort();
    for (int i = 0; i < m->naddrs; i++)
        if (!m->addrs[i][0] || !memchr(m->addrs[i], 0, AP_RT_ADDR_MAX)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const uint8_t *b = data + 1;
    size_t n = size - 1;
    uint8_t *enc;
    size_t len;
    switch (data[0] % 3) {
    case 0: {
        ap__mm_member_t m, m2;
        if (ap__mm_decl_decode(b, n, &m)) break;
        check_member(&m);
        if (m.gather_len) abort(); /* gathered bytes never come from the DHT */
        if (ap__mm_decl_encode(&m, &enc, &len)) abort();
        if (ap__mm_decl_decode(enc, len, &m2) || memcmp(&m, &m2, sizeof m)) abort();
        free(enc);
        break;
    }
    case 1: {
        uint8_t key[AP__MM_KEY_MAX], key2[AP__MM_KEY_MAX];
        size_t kl, kl2;
        ap__mm_member_t m, m2;
        bool leave, leave2;
        if (ap__mm_req_decode(b, n, key, &kl, &m, &leave)) break;
        check_member(&m);
        if (kl == 0 || kl > AP__MM_KEY_MAX || m.closed) abort();
        if (ap__mm_req_encode(key, kl, &m, leave, &enc, &len)) abort();
        if (ap__mm_req_decode(enc, len, key2, &kl2, &m2, &leave2) || kl2 != kl ||
            memcmp(key, key2, kl) || memcmp(&m, &m2, sizeof m) || leave2 != leave)
            abort();
        free(enc);
        break;
    }
    default: {
        ap__mm_resp_t r, r2;
        if (ap__mm_resp_decode(b, n, &r)) break;
        if (r.code == AP__MM_BEGIN) {
            if (r.n < 2 || r.n > AP__MM_GROUP_MAX || !r.members) abort();
            for (size_t i = 0; i < r.n; i++) check_member(&r.members[i]);
        } else if (r.members || r.n) {
            abort();
        }
        if (r.code == AP__MM_REDIRECT) check_member(&r.redirect);
        if (ap__mm_resp_encode(&r, &enc, &len)) abort();
        if (ap__mm_resp_decode(enc, len, &r2) || r2.code != r.code || r2.n != r.n ||
            strcmp(r.reason, r2.reason) ||
            (r.n && memcmp(r.members, r2.members, r.n * sizeof *r.members)))
            abort();
        free(enc);
        free(r.members);
        free(r2.members);
        break;
    }
    }
    return 0;
}
