/* AutoNAT v1 codec and server policy: see autonat.h. */
#include "p2p/autonat.h"

#include "apiary/error.h"
#include "base/varint.h"

#include "autonat.pb-c.h"

#include <stdio.h>
#include <string.h>

static int put_prefixed(size_t body, uint8_t *out, size_t cap, size_t *hl)
{
    if (body > AP_AUTONAT_MSG_MAX) return AP_EMSGSIZE;
    uint8_t pre[AP_UVARINT_MAX];
    size_t k = ap__uvarint_put(pre, body);
    if (k + body > cap) return AP_EMSGSIZE;
    memcpy(out, pre, k);
    *hl = k;
    return 0;
}

int ap__autonat_encode_dial(const ap_peer_id_t *id, const ap_multiaddr_t *addrs, size_t n,
                            uint8_t *out, size_t cap)
{
    if (n > AP_AUTONAT_ADDRS_MAX || (n && !addrs)) return AP_EINVAL;
    static uint8_t bin[AP_AUTONAT_ADDRS_MAX][AP_MA_BINARY_MAX];
    ProtobufCBinaryData ab[AP_AUTONAT_ADDRS_MAX];
    for (size_t i = 0; i < n; i++) {
        int w = ap_multiaddr_encode(&addrs[i], bin[i], sizeof bin[i]);
        if (w < 0) return w;
        ab[i].data = bin[i];
        ab[i].len = (size_t)w;
    }
    Autonat__Message__PeerInfo pi = AUTONAT__MESSAGE__PEER_INFO__INIT;
    if (id) {
        pi.has_id = 1;
        pi.id.data = (uint8_t *)id->b;
        pi.id.len = AP_PEER_ID_LEN;
    }
    pi.n_addrs = n;
    pi.addrs = ab;
    Autonat__Message__Dial d = AUTONAT__MESSAGE__DIAL__INIT;
    d.peer = &pi;
    Autonat__Message m = AUTONAT__MESSAGE__INIT;
    m.has_type = 1;
    m.type = AUTONAT__MESSAGE__MESSAGE_TYPE__DIAL;
    m.dial = &d;
    size_t body = autonat__message__get_packed_size(&m), hl;
    int rc = put_prefixed(body, out, cap, &hl);
    if (rc) return rc;
    autonat__message__pack(&m, out + hl);
    return (int)(hl + body);
}

int ap__autonat_encode_response(int status, const char *text, const ap_multiaddr_t *addr,
                                uint8_t *out, size_t cap)
{
    uint8_t bin[AP_MA_BINARY_MAX];
    Autonat__Message__DialResponse r = AUTONAT__MESSAGE__DIAL_RESPONSE__INIT;
    r.has_status = 1;
    r.status = (Autonat__Message__ResponseStatus)status;
    char t[AP_AUTONAT_TEXT_MAX + 1];
    if (text) {
        snprintf(t, sizeof t, "%s", text);
        r.statustext = t;
    }
    if (addr) {
        int w = ap_multiaddr_encode(addr, bin, sizeof bin);
        if (w < 0) return w;
        r.has_addr = 1;
        r.addr.data = bin;
        r.addr.len = (size_t)w;
    }
    Autonat__Message m = AUTONAT__MESSAGE__INIT;
    m.has_type = 1;
    m.type = AUTONAT__MESSAGE__MESSAGE_TYPE__DIAL_RESPONSE;
    m.dialresponse = &r;
    size_t body = autonat__message__get_packed_size(&m), hl;
    int rc = put_prefixed(body, out, cap, &hl);
    if (rc) return rc;
    autonat__message__pack(&m, out + hl);
    return (int)(hl + body);
}

int ap__autonat_frame(const uint8_t *in, size_t len, size_t *hdr_len, size_t *body_len)
{
    uint64_t v;
    int k = ap__mf_uvarint_get(in, len, &v);
    if (k == AP_EAGAIN) return 0;
    if (k < 0) return AP_ECORRUPT;
    if (v > AP_AUTONAT_MSG_MAX) return AP_EMSGSIZE;
    *hdr_len = (size_t)k;
    *body_len = (size_t)v;
    return 1;
}

int ap__autonat_decode(const uint8_t *msg, size_t len, ap_autonat_msg_t *out)
{
    memset(out, 0, sizeof *out);
    out->type = -1;
    if (len > AP_AUTONAT_MSG_MAX) return AP_EMSGSIZE;
    if (len && !msg) return AP_EINVAL;
    Autonat__Message *m = autonat__message__unpack(NULL, len, len ? msg : (const uint8_t *)"");
    if (!m) return AP_ECORRUPT;
    int rc = 0;
    if (m->has_type) out->type = (int)m->type;
    if (m->dial) {
        out->has_dial = true;
        Autonat__Message__PeerInfo *pi = m->dial->peer;
        if (pi) {
            if (pi->has_id) {
                if (ap_peer_id_from_bytes(&out->id, pi->id.data, pi->id.len) == 0)
                    out->has_id = true;
                else
                    out->id_other = true;
            }
            if (pi->n_addrs > AP_AUTONAT_ADDRS_MAX) {
                rc = AP_ELIMIT;
                goto done;
            }
            for (size_t i = 0; i < pi->n_addrs; i++) {
                if (ap_multiaddr_decode(&out->addrs[out->naddrs], pi->addrs[i].data,
                                        pi->addrs[i].len) == 0)
                    out->naddrs++;
                else
                    out->addrs_other++;
            }
        }
    }
    if (m->dialresponse) {
        Autonat__Message__DialResponse *r = m->dialresponse;
        out->has_response = true;
        out->status = r->has_status ? (int)r->status : -1;
        if (r->statustext) {
            size_t n = strlen(r->statustext);
            if (n > AP_AUTONAT_TEXT_MAX) {
                rc = AP_ELIMIT;
                goto done;
            }
            memcpy(out->text, r->statustext, n + 1);
        }
        if (r->has_addr && ap_multiaddr_decode(&out->addr, r->addr.data, r->addr.len) == 0)
            out->has_addr = true;
    }
done:
    autonat__message__free_unpacked(m, NULL);
    if (rc) {
        memset(out, 0, sizeof *out);
        out->type = -1;
    }
    return rc;
}

const char *ap__autonat_status_name(int status)
{
    switch (status) {
    case AP_AUTONAT_OK:
        return "OK";
    case AP_AUTONAT_E_DIAL_ERROR:
        return "E_DIAL_ERROR";
    case AP_AUTONAT_E_DIAL_REFUSED:
        return "E_DIAL_REFUSED";
    case AP_AUTONAT_E_BAD_REQUEST:
        return "E_BAD_REQUEST";
    case AP_AUTONAT_E_INTERNAL:
        return "E_INTERNAL_ERROR";
    }
    return "unknown status";
}

/* ---- the server's policy ------------------------------------------------------ */

void ap__autonat_srv_init(ap_autonat_srv_t *s)
{
    memset(s, 0, sizeof *s);
}

static bool in_window(uint64_t t, uint64_t now)
{
    return t != 0 && now - t < AP_AUTONAT_WINDOW_US;
}

/* Counts the request against peer and global budgets; false when over. */
static bool take_budget(ap_autonat_srv_t *s, const ap_peer_id_t *from, uint64_t now, char *why,
                        size_t n)
{
    if (now == 0) now = 1; /* 0 marks an empty slot */
    size_t used = 0;
    for (size_t i = 0; i < AP_AUTONAT_GLOBAL_RATE; i++) used += in_window(s->global[i], now);
    if (used >= AP_AUTONAT_GLOBAL_RATE) {
        snprintf(why, n, "too many requests from everyone (%d per %llu s)", AP_AUTONAT_GLOBAL_RATE,
                 AP_AUTONAT_WINDOW_US / 1000000ull);
        return false;
    }
    size_t slot = AP_AUTONAT_TRACKED, oldest = 0;
    uint64_t oldest_t = UINT64_MAX;
    for (size_t i = 0; i < AP_AUTONAT_TRACKED; i++) {
        if (s->tracked[i].used && ap_peer_id_eq(&s->tracked[i].peer, from)) {
            slot = i;
            break;
        }
        uint64_t last = 0;
        for (size_t k = 0; k < AP_AUTONAT_PEER_RATE; k++)
            if (in_window(s->tracked[i].t[k], now) && s->tracked[i].t[k] > last)
                last = s->tracked[i].t[k];
        if (!s->tracked[i].used || last < oldest_t) {
            oldest_t = s->tracked[i].used ? last : 0;
            oldest = i;
        }
    }
    if (slot == AP_AUTONAT_TRACKED) {
        slot = oldest;
        memset(&s->tracked[slot], 0, sizeof s->tracked[slot]);
        s->tracked[slot].used = true;
        s->tracked[slot].peer = *from;
    }
    size_t mine = 0, free_k = 0;
    for (size_t k = 0; k < AP_AUTONAT_PEER_RATE; k++) {
        if (in_window(s->tracked[slot].t[k], now))
            mine++;
        else
            free_k = k;
    }
    if (mine >= AP_AUTONAT_PEER_RATE) {
        snprintf(why, n, "too many requests from this peer (%d per %llu s)", AP_AUTONAT_PEER_RATE,
                 AP_AUTONAT_WINDOW_US / 1000000ull);
        return false;
    }
    s->tracked[slot].t[free_k] = now;
    s->global[s->global_at] = now;
    s->global_at = (s->global_at + 1) % AP_AUTONAT_GLOBAL_RATE;
    return true;
}

static bool same_ip(const ap_multiaddr_t *a, const ap_multiaddr_t *b)
{
    if (a->host != b->host) return false;
    if (a->host == AP_MA_HOST_IP4) return memcmp(a->ip, b->ip, 4) == 0;
    if (a->host == AP_MA_HOST_IP6) return memcmp(a->ip, b->ip, 16) == 0;
    return false;
}

int ap__autonat_srv_check(ap_autonat_srv_t *s, const ap_autonat_msg_t *req,
                          const ap_peer_id_t *from, const ap_multiaddr_t *remote, bool relayed,
                          uint64_t now_us, ap_multiaddr_t dial[AP_AUTONAT_DIAL_MAX], size_t *ndial,
                          char *why, size_t n)
{
    *ndial = 0;
    if (relayed) {
        snprintf(why, n, "the request came over a relay");
        return AP_AUTONAT_E_DIAL_REFUSED;
    }
    if (req->type != AP_AUTONAT_DIAL || !req->has_dial) {
        snprintf(why, n, "not a DIAL request");
        return AP_AUTONAT_E_BAD_REQUEST;
    }
    if (req->id_other || (req->has_id && !ap_peer_id_eq(&req->id, from))) {
        snprintf(why, n, "the request names another peer");
        return AP_AUTONAT_E_BAD_REQUEST;
    }
    if (!take_budget(s, from, now_us, why, n)) return AP_AUTONAT_E_DIAL_REFUSED;
    for (size_t i = 0; i < req->naddrs && *ndial < AP_AUTONAT_DIAL_MAX; i++) {
        const ap_multiaddr_t *a = &req->addrs[i];
        if (a->circuit || !a->has_tcp || a->port == 0 || !same_ip(a, remote)) continue;
        bool dup = false;
        for (size_t k = 0; k < *ndial; k++)
            dup = dup || (dial[k].port == a->port && same_ip(&dial[k], a));
        if (dup) continue;
        dial[*ndial] = *a;
        dial[*ndial].has_peer = true;
        dial[*ndial].peer = *from;
        (*ndial)++;
    }
    if (*ndial == 0) {
        snprintf(why, n, "no address at the IP the request came from (%zu offered)", req->naddrs);
        return AP_AUTONAT_E_DIAL_REFUSED;
    }
    return AP_AUTONAT_OK;
}
