/* identify message codec (see identify.h). */
#include "p2p/identify.h"
#include "apiary/error.h"
#include "base/varint.h"

#include "libp2p.pb-c.h"

#include <string.h>

int ap__identify_frame(const uint8_t *in, size_t len, size_t *hdr_len, size_t *body_len)
{
    uint64_t n;
    int k = ap__mf_uvarint_get(in, len, &n);
    if (k == AP_EAGAIN) return 0;
    if (k < 0) return AP_ECORRUPT;
    if (n > AP_IDENTIFY_MSG_MAX) return AP_EMSGSIZE;
    *hdr_len = (size_t)k;
    *body_len = (size_t)n;
    return 1;
}

int ap__identify_encode(const ap_identify_t *id, const uint8_t pk[AP_ED25519_PK_LEN], uint8_t *out,
                        size_t cap)
{
    uint8_t key[4 + AP_ED25519_PK_LEN];
    memcpy(key, "\x08\x01\x12\x20", 4);
    memcpy(key + 4, pk, AP_ED25519_PK_LEN);
    uint8_t addrs[AP_IDENTIFY_ADDRS_MAX][AP_MA_BINARY_MAX], obs[AP_MA_BINARY_MAX];
    ProtobufCBinaryData bins[AP_IDENTIFY_ADDRS_MAX];
    Libp2p__Identify m = LIBP2P__IDENTIFY__INIT;
    m.protocolversion = (char *)id->protocol_version;
    m.agentversion = (char *)id->agent_version;
    m.has_publickey = 1;
    m.publickey.data = key;
    m.publickey.len = sizeof key;
    size_t na = id->nlisten < AP_IDENTIFY_ADDRS_MAX ? id->nlisten : AP_IDENTIFY_ADDRS_MAX;
    for (size_t i = 0; i < na; i++) {
        int n = ap_multiaddr_encode(&id->listen[i], addrs[i], sizeof addrs[i]);
        if (n < 0) return n;
        bins[i].data = addrs[i];
        bins[i].len = (size_t)n;
    }
    m.n_listenaddrs = na;
    m.listenaddrs = bins;
    if (id->has_observed) {
        int n = ap_multiaddr_encode(&id->observed, obs, sizeof obs);
        if (n < 0) return n;
        m.has_observedaddr = 1;
        m.observedaddr.data = obs;
        m.observedaddr.len = (size_t)n;
    }
    m.n_protocols = id->nprotocols;
    m.protocols = (char **)id->protocols;
    size_t body = libp2p__identify__get_packed_size(&m);
    if (body > AP_IDENTIFY_MSG_MAX) return AP_EMSGSIZE;
    size_t k = ap__uvarint_len(body);
    if (k + body > cap) return AP_EMSGSIZE;
    ap__uvarint_put(out, body);
    libp2p__identify__pack(&m, out + k);
    return (int)(k + body);
}

static int copy_str(char *dst, const char *src)
{
    if (!src) {
        dst[0] = 0;
        return 0;
    }
    size_t n = strlen(src);
    if (n > AP_IDENTIFY_STR_MAX) return AP_ELIMIT;
    memcpy(dst, src, n + 1);
    return 0;
}

/* A protobuf string may hold a NUL that strlen would silently cut: the
 * unpacked field's own length is not kept by protobuf-c, so decode refuses
 * messages whose strings contain one by re-checking the wire bytes. */
static bool has_nul_string(const uint8_t *msg, size_t len)
{
    size_t off = 0;
    while (off < len) {
        uint64_t tag, v;
        int k = ap__uvarint_get(msg + off, len - off, &tag);
        if (k < 0) return true;
        off += (size_t)k;
        unsigned wt = (unsigned)(tag & 7), field = (unsigned)(tag >> 3);
        if (wt == 0) {
            k = ap__uvarint_get(msg + off, len - off, &v);
            if (k < 0) return true;
            off += (size_t)k;
        } else if (wt == 2) {
            k = ap__uvarint_get(msg + off, len - off, &v);
            if (k < 0 || v > len - off - (size_t)k) return true;
            off += (size_t)k;
            bool str = field == 3 || field == 5 || field == 6;
            if (str && memchr(msg + off, 0, (size_t)v)) return true;
            off += (size_t)v;
        } else if (wt == 1 || wt == 5) {
            size_t w = wt == 1 ? 8 : 4;
            if (len - off < w) return true;
            off += w;
        } else {
            return true;
        }
    }
    return false;
}

int ap__identify_decode(const uint8_t *msg, size_t len, ap_identify_t *out)
{
    memset(out, 0, sizeof *out);
    if (len > AP_IDENTIFY_MSG_MAX) return AP_EMSGSIZE;
    if (has_nul_string(msg, len)) return AP_ECORRUPT;
    Libp2p__Identify *m = libp2p__identify__unpack(NULL, len, msg);
    if (!m) return AP_ECORRUPT;
    int rc = copy_str(out->protocol_version, m->protocolversion);
    if (rc == 0) rc = copy_str(out->agent_version, m->agentversion);
    if (rc) goto out;
    rc = AP_ELIMIT;
    if (m->n_listenaddrs > AP_IDENTIFY_ADDRS_MAX || m->n_protocols > AP_IDENTIFY_PROTOS_MAX)
        goto out;
    if (m->has_publickey) {
        out->has_key = true;
        Libp2p__PublicKey *k =
            libp2p__public_key__unpack(NULL, m->publickey.len, m->publickey.data);
        if (!k) {
            rc = AP_ECORRUPT;
            goto out;
        }
        out->key_type = (int)k->type;
        if (out->key_type < 0) { /* not a KeyType (a varint beyond int32) */
            libp2p__public_key__free_unpacked(k, NULL);
            out->key_type = -1;
            rc = AP_ECORRUPT;
            goto out;
        }
        if (k->type == LIBP2P__KEY_TYPE__Ed25519 && k->data.len == AP_ED25519_PK_LEN) {
            ap_peer_id_from_ed25519(&out->id, k->data.data);
            out->has_id = true;
        }
        libp2p__public_key__free_unpacked(k, NULL);
    }
    for (size_t i = 0; i < m->n_listenaddrs; i++) {
        if (ap_multiaddr_decode(&out->listen[out->nlisten], m->listenaddrs[i].data,
                                m->listenaddrs[i].len) == 0)
            out->nlisten++;
        else
            out->addrs_other++;
    }
    if (m->has_observedaddr &&
        ap_multiaddr_decode(&out->observed, m->observedaddr.data, m->observedaddr.len) == 0)
        out->has_observed = true;
    size_t t = 0;
    for (size_t i = 0; i < m->n_protocols; i++) {
        size_t n = strlen(m->protocols[i]);
        if (n > AP_IDENTIFY_STR_MAX || n + 1 > sizeof out->text - t) goto out;
        memcpy(out->text + t, m->protocols[i], n + 1);
        out->protocols[out->nprotocols++] = out->text + t;
        t += n + 1;
    }
    if (m->has_signedpeerrecord) out->signed_record_len = m->signedpeerrecord.len;
    rc = 0;
out:
    libp2p__identify__free_unpacked(m, NULL);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}
