/* SWARM server announcements in the DHT: the stage key, the value codec, and
 * feeding a trainer's balancer from a get of that key. */
#include "apiary/swarm.h"

#include "base/buf.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define MAGIC   0x57
#define VERSION 2

int ap_swarm_stage_key(const char *run, uint32_t stage, char key[AP_SWARM_KEY_MAX])
{
    if (!run || !key) return AP_EINVAL;
    size_t n = strlen(run);
    if (!n || n > AP_SWARM_RUN_MAX) return AP_EINVAL;
    int len = snprintf(key, AP_SWARM_KEY_MAX, "swarm/%s/stage/%u", run, stage);
    return len > 0 && len < AP_SWARM_KEY_MAX ? len : AP_EINVAL;
}

void ap_swarm_announce_encode(const ap_swarm_announce_t *a, uint8_t out[AP_SWARM_ANNOUNCE_LEN])
{
    uint64_t bits;
    double t = isfinite(a->throughput) && a->throughput > 0 ? a->throughput : 0;
    memcpy(&bits, &t, 8);
    out[0] = MAGIC;
    out[1] = VERSION;
    out[2] = a->estimate && t > 0 ? AP_SWARM_ANNOUNCE_ESTIMATE : 0;
    out[3] = 0;
    ap__put_be64(out + 4, bits);
    ap__put_be32(out + 12, a->queue);
    ap__put_be64(out + 16, a->version);
    ap__put_be32(out + 24, a->period_ms);
    ap__put_be32(out + 28, a->ttl_ms);
}

int ap_swarm_announce_decode(const uint8_t *in, size_t len, ap_swarm_announce_t *a)
{
    if (!in || !a || len != AP_SWARM_ANNOUNCE_LEN || in[0] != MAGIC) return AP_ECORRUPT;
    if (in[1] != VERSION) return AP_EVERSION;
    if ((in[2] & ~AP_SWARM_ANNOUNCE_ESTIMATE) || in[3]) return AP_ECORRUPT;
    uint64_t bits = ap__get_be64(in + 4);
    double t;
    memcpy(&t, &bits, 8);
    if (!isfinite(t) || signbit(t)) return AP_ECORRUPT; /* also -0: one encoding per value */
    if (in[2] && !(t > 0)) return AP_ECORRUPT;          /* an estimate of nothing */
    a->throughput = t;
    a->estimate = in[2] != 0;
    a->queue = ap__get_be32(in + 12);
    a->version = ap__get_be64(in + 16);
    a->period_ms = ap__get_be32(in + 24);
    a->ttl_ms = ap__get_be32(in + 28);
    return 0;
}

int ap_swarm_announce_owner(const ap_dht_record_t *rec, ap_peer_id_t *peer)
{
    if (!rec || !peer || !rec->subkey) return AP_EINVAL;
    char txt[AP_PEER_ID_STR_MAX];
    const size_t n = rec->subkey_len;
    if (n < 9 || n - 8 >= sizeof txt || memcmp(rec->subkey, "[owner:", 7) != 0 ||
        rec->subkey[n - 1] != ']')
        return AP_ECORRUPT;
    memcpy(txt, rec->subkey + 7, n - 8);
    txt[n - 8] = 0;
    return ap_peer_id_parse(peer, txt) ? AP_ECORRUPT : 0;
}

int ap_swarm_balancer_feed(ap_swarm_balancer_t *b, const ap_dht_result_t *res, uint64_t now_us,
                           int64_t wall_ms)
{
    if (!b || !res) return AP_EINVAL;
    if (!res->found || !res->is_dict) return 0;
    int fed = 0;
    for (size_t i = 0; i < res->nrecords; i++) {
        const ap_dht_record_t *r = &res->records[i];
        ap_peer_id_t peer;
        ap_swarm_announce_t a;
        if (ap_swarm_announce_owner(r, &peer) ||
            ap_swarm_announce_decode(r->value, r->value_len, &a))
            continue;
        if (r->expiration_ms <= wall_ms) continue;
        int64_t left_ms = r->expiration_ms - wall_ms;
        if (left_ms > (int64_t)(UINT64_MAX / 2000 - now_us / 1000)) continue;
        uint64_t exp = now_us + (uint64_t)left_ms * 1000;
        if (ap_swarm_balancer_update_record(b, &peer, a.throughput, exp, (uint64_t)r->expiration_ms,
                                            now_us) == 0)
            fed++;
    }
    return fed;
}
