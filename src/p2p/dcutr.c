/* DCUtR message codec: see dcutr.h. */
#include "p2p/dcutr.h"

#include "apiary/error.h"
#include "base/varint.h"

#include "dcutr.pb-c.h"

#include <string.h>

int ap__dcutr_encode(const ap_dcutr_msg_t *m, uint8_t *out, size_t cap)
{
    static uint8_t b[AP_DCUTR_ADDRS_MAX][AP_MA_BINARY_MAX];
    ProtobufCBinaryData d[AP_DCUTR_ADDRS_MAX];
    if (m->naddrs > AP_DCUTR_ADDRS_MAX) return AP_EINVAL;
    if (m->type != AP_DCUTR_CONNECT && m->type != AP_DCUTR_SYNC) return AP_EINVAL;
    for (size_t i = 0; i < m->naddrs; i++) {
        int w = ap_multiaddr_encode(&m->addrs[i], b[i], sizeof b[i]);
        if (w < 0) return w;
        d[i].data = b[i];
        d[i].len = (size_t)w;
    }
    Holepunch__HolePunch h = HOLEPUNCH__HOLE_PUNCH__INIT;
    h.type = (Holepunch__HolePunch__Type)m->type;
    h.n_obsaddrs = m->naddrs;
    h.obsaddrs = d;
    size_t body = holepunch__hole_punch__get_packed_size(&h);
    if (body > AP_DCUTR_MSG_MAX) return AP_EMSGSIZE;
    uint8_t pre[AP_UVARINT_MAX];
    size_t k = ap__uvarint_put(pre, body);
    if (k + body > cap) return AP_EMSGSIZE;
    memcpy(out, pre, k);
    holepunch__hole_punch__pack(&h, out + k);
    return (int)(k + body);
}

int ap__dcutr_decode(const uint8_t *msg, size_t len, ap_dcutr_msg_t *out)
{
    memset(out, 0, sizeof *out);
    if (len > AP_DCUTR_MSG_MAX) return AP_EMSGSIZE;
    Holepunch__HolePunch *h = holepunch__hole_punch__unpack(NULL, len, msg);
    if (!h) return AP_ECORRUPT;
    int rc = 0;
    if (h->type != HOLEPUNCH__HOLE_PUNCH__TYPE__CONNECT &&
        h->type != HOLEPUNCH__HOLE_PUNCH__TYPE__SYNC)
        rc = AP_EPROTO;
    else if (h->n_obsaddrs > AP_DCUTR_ADDRS_MAX)
        rc = AP_ELIMIT;
    else {
        out->type = (int)h->type;
        for (size_t i = 0; i < h->n_obsaddrs; i++) {
            if (ap_multiaddr_decode(&out->addrs[out->naddrs], h->obsaddrs[i].data,
                                    h->obsaddrs[i].len) == 0)
                out->naddrs++;
            else
                out->addrs_other++;
        }
    }
    holepunch__hole_punch__free_unpacked(h, NULL);
    return rc;
}

int ap__dcutr_rd_feed(ap_dcutr_rd_t *r, const uint8_t *p, size_t n, ap_dcutr_msg_t *m, size_t *used)
{
    size_t old = r->len, take = sizeof r->buf - r->len;
    if (take > n) take = n;
    if (take) memcpy(r->buf + r->len, p, take);
    r->len += take;
    *used = take;
    uint64_t v;
    int k = ap__mf_uvarint_get(r->buf, r->len, &v);
    if (k == AP_EAGAIN) return r->len == sizeof r->buf ? AP_EMSGSIZE : 0;
    if (k < 0) return AP_ECORRUPT;
    if (v > AP_DCUTR_MSG_MAX) return AP_EMSGSIZE;
    size_t total = (size_t)k + (size_t)v;
    if (r->len < total) return 0;
    *used = total - old;
    r->len = 0;
    int rc = ap__dcutr_decode(r->buf + k, (size_t)v, m);
    return rc < 0 ? rc : 1;
}
