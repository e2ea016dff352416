/* Circuit relay v2 codec and bookkeeping: see relay.h. */
#include "p2p/relay.h"

#include "apiary/error.h"
#include "base/varint.h"

#include "relay.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- codec -------------------------------------------------------------------- */

typedef struct addr_bin {
    uint8_t b[AP_RELAY_ADDRS_MAX][AP_MA_BINARY_MAX];
    ProtobufCBinaryData d[AP_RELAY_ADDRS_MAX];
} addr_bin_t;

static int addrs_out(const ap_multiaddr_t *a, size_t n, addr_bin_t *out)
{
    if (n > AP_RELAY_ADDRS_MAX) return AP_EINVAL;
    for (size_t i = 0; i < n; i++) {
        int w = ap_multiaddr_encode(&a[i], out->b[i], sizeof out->b[i]);
        if (w < 0) return w;
        out->d[i].data = out->b[i];
        out->d[i].len = (size_t)w;
    }
    return 0;
}

static int addrs_in(ProtobufCBinaryData *d, size_t n, ap_multiaddr_t *out, size_t *nout,
                    size_t *other)
{
    if (n > AP_RELAY_ADDRS_MAX) return AP_ELIMIT;
    for (size_t i = 0; i < n; i++) {
        if (ap_multiaddr_decode(&out[*nout], d[i].data, d[i].len) == 0)
            (*nout)++;
        else
            (*other)++;
    }
    return 0;
}

int ap__relay_encode(const ap_relay_msg_t *m, uint8_t *out, size_t cap)
{
    static addr_bin_t pa, ra;
    Circuit__Peer peer = CIRCUIT__PEER__INIT;
    Circuit__Reservation resv = CIRCUIT__RESERVATION__INIT;
    Circuit__Limit lim = CIRCUIT__LIMIT__INIT;
    int rc = addrs_out(m->addrs, m->naddrs, &pa);
    if (rc) return rc;
    peer.id.data = (uint8_t *)m->peer.b;
    peer.id.len = AP_PEER_ID_LEN;
    peer.n_addrs = m->naddrs;
    peer.addrs = pa.d;
    if (m->has_reservation) {
        if ((rc = addrs_out(m->raddrs, m->nraddrs, &ra)) != 0) return rc;
        resv.expire = m->expire;
        resv.n_addrs = m->nraddrs;
        resv.addrs = ra.d;
    }
    lim.has_duration = m->has_duration;
    lim.duration = m->duration;
    lim.has_data = m->has_data;
    lim.data = m->data;
    size_t body;
    Circuit__HopMessage h = CIRCUIT__HOP_MESSAGE__INIT;
    Circuit__StopMessage s = CIRCUIT__STOP_MESSAGE__INIT;
    if (m->stop) {
        s.type = (Circuit__StopMessage__Type)m->type;
        s.peer = m->has_peer ? &peer : NULL;
        s.limit = m->has_limit ? &lim : NULL;
        s.has_status = m->has_status;
        s.status = (Circuit__Status)m->status;
        body = circuit__stop_message__get_packed_size(&s);
    } else {
        h.type = (Circuit__HopMessage__Type)m->type;
        h.peer = m->has_peer ? &peer : NULL;
        h.reservation = m->has_reservation ? &resv : NULL;
        h.limit = m->has_limit ? &lim : NULL;
        h.has_status = m->has_status;
        h.status = (Circuit__Status)m->status;
        body = circuit__hop_message__get_packed_size(&h);
    }
    if (body > AP_RELAY_MSG_MAX) return AP_EMSGSIZE;
    uint8_t pre[AP_UVARINT_MAX];
    size_t k = ap__uvarint_put(pre, body);
    if (k + body > cap) return AP_EMSGSIZE;
    memcpy(out, pre, k);
    if (m->stop)
        circuit__stop_message__pack(&s, out + k);
    else
        circuit__hop_message__pack(&h, out + k);
    return (int)(k + body);
}

int ap__relay_frame(const uint8_t *in, size_t len, size_t *hdr_len, size_t *body_len)
{
    uint64_t v;
    int k = ap__mf_uvarint_get(in, len, &v);
    if (k == AP_EAGAIN) return 0;
    if (k < 0) return AP_ECORRUPT;
    if (v > AP_RELAY_MSG_MAX) return AP_EMSGSIZE;
    *hdr_len = (size_t)k;
    *body_len = (size_t)v;
    return 1;
}

static int peer_in(Circuit__Peer *p, ap_relay_msg_t *out)
{
    if (!p) return 0;
    out->has_peer = true;
    if (ap_peer_id_from_bytes(&out->peer, p->id.data, p->id.len) != 0) out->peer_other = true;
    return addrs_in(p->addrs, p->n_addrs, out->addrs, &out->naddrs, &out->addrs_other);
}

static void limit_in(Circuit__Limit *l, ap_relay_msg_t *out)
{
    if (!l) return;
    out->has_limit = true;
    out->has_duration = l->has_duration;
    out->duration = l->duration;
    out->has_data = l->has_data;
    out->data = l->data;
}

int ap__relay_decode(bool stop, const uint8_t *msg, size_t len, ap_relay_msg_t *out)
{
    memset(out, 0, sizeof *out);
    out->stop = stop;
    out->type = -1;
    if (len > AP_RELAY_MSG_MAX) return AP_EMSGSIZE;
    if (len && !msg) return AP_EINVAL;
    const uint8_t *p = len ? msg : (const uint8_t *)"";
    int rc = 0;
    if (stop) {
        Circuit__StopMessage *s = circuit__stop_message__unpack(NULL, len, p);
        if (!s) return AP_ECORRUPT;
        out->type = (int)s->type;
        rc = peer_in(s->peer, out);
        limit_in(s->limit, out);
        out->has_status = s->has_status;
        out->status = (int)s->status;
        circuit__stop_message__free_unpacked(s, NULL);
    } else {
        Circuit__HopMessage *h = circuit__hop_message__unpack(NULL, len, p);
        if (!h) return AP_ECORRUPT;
        out->type = (int)h->type;
        rc = peer_in(h->peer, out);
        limit_in(h->limit, out);
        out->has_status = h->has_status;
        out->status = (int)h->status;
        if (rc == 0 && h->reservation) {
            Circuit__Reservation *r = h->reservation;
            out->has_reservation = true;
            out->expire = r->expire;
            if (r->has_voucher && r->voucher.len > AP_RELAY_VOUCHER_MAX)
                rc = AP_ELIMIT;
            else
                out->voucher_len = r->has_voucher ? r->voucher.len : 0;
            if (rc == 0)
                rc = addrs_in(r->addrs, r->n_addrs, out->raddrs, &out->nraddrs, &out->raddrs_other);
        }
        circuit__hop_message__free_unpacked(h, NULL);
    }
    if (rc) {
        memset(out, 0, sizeof *out);
        out->stop = stop;
        out->type = -1;
    }
    return rc;
}

const char *ap__relay_status_name(int status)
{
    switch (status) {
    case AP_RELAY_UNUSED:
        return "UNUSED";
    case AP_RELAY_OK:
        return "OK";
    case AP_RELAY_RESERVATION_REFUSED:
        return "RESERVATION_REFUSED";
    case AP_RELAY_RESOURCE_LIMIT_EXCEEDED:
        return "RESOURCE_LIMIT_EXCEEDED";
    case AP_RELAY_PERMISSION_DENIED:
        return "PERMISSION_DENIED";
    case AP_RELAY_CONNECTION_FAILED:
        return "CONNECTION_FAILED";
    case AP_RELAY_NO_RESERVATION:
        return "NO_RESERVATION";
    case AP_RELAY_MALFORMED_MESSAGE:
        return "MALFORMED_MESSAGE";
    case AP_RELAY_UNEXPECTED_MESSAGE:
        return "UNEXPECTED_MESSAGE";
    }
    return "unknown status";
}

/* ---- bookkeeping ---------------------------------------------------------------- */

void ap__relay_limits_default(ap_relay_limits_t *l)
{
    *l = (ap_relay_limits_t){.max_reservations = 128,
                             .reservations_per_ip = 8,
                             .reserve_rate = 4,
                             .max_circuits = 256,
                             .circuits_per_peer = 16,
                             .reservation_ttl_us = 3600ull * 1000000,
                             .circuit_duration_us = 600ull * 1000000,
                             .circuit_bytes = 4ull << 20};
}

int ap__relay_init(ap_relay_t *r, const ap_relay_limits_t *lim)
{
    memset(r, 0, sizeof *r);
    if (!lim->max_reservations || lim->max_reservations > AP_RELAY_TABLE_MAX ||
        !lim->max_circuits || lim->max_circuits > AP_RELAY_TABLE_MAX || !lim->reserve_rate ||
        lim->reserve_rate > 4 || !lim->reservations_per_ip || !lim->circuits_per_peer)
        return AP_EINVAL;
    r->lim = *lim;
    r->resv = calloc(lim->max_reservations, sizeof *r->resv);
    r->circ = calloc(lim->max_circuits, sizeof *r->circ);
    if (!r->resv || !r->circ) {
        ap__relay_free(r);
        return AP_ENOMEM;
    }
    r->resv_cap = lim->max_reservations;
    r->circ_cap = lim->max_circuits;
    r->next_id = 1;
    return 0;
}

void ap__relay_free(ap_relay_t *r)
{
    free(r->resv);
    free(r->circ);
    memset(r, 0, sizeof *r);
}

static void expire_resv(ap_relay_t *r, uint64_t now)
{
    for (size_t i = 0; i < r->nresv;)
        if (r->resv[i].expire_us <= now)
            r->resv[i] = r->resv[--r->nresv];
        else
            i++;
}

static ap_relay_resv_t *find_resv(const ap_relay_t *r, const ap_peer_id_t *p)
{
    for (size_t i = 0; i < r->nresv; i++)
        if (ap_peer_id_eq(&r->resv[i].peer, p)) return &r->resv[i];
    return NULL;
}

int ap__relay_reserve(ap_relay_t *r, const ap_peer_id_t *peer, const ap_multiaddr_t *remote,
                      uint64_t now_us, uint64_t *expire_us, char *why, size_t wn)
{
    if (now_us == 0) now_us = 1;
    expire_resv(r, now_us);
    uint8_t ip[16] = {0};
    if (remote) memcpy(ip, remote->ip, remote->host == AP_MA_HOST_IP4 ? 4 : 16);
    ap_relay_resv_t *e = find_resv(r, peer);
    const uint64_t minute = 60000000ull;
    if (e) {
        size_t recent = 0, oldest = 0;
        for (size_t k = 0; k < r->lim.reserve_rate; k++) {
            if (e->recent[k] && now_us - e->recent[k] < minute) recent++;
            if (e->recent[k] < e->recent[oldest]) oldest = k;
        }
        if (recent >= r->lim.reserve_rate) {
            snprintf(why, wn, "reserving too often (%u per minute)", r->lim.reserve_rate);
            return AP_RELAY_RESERVATION_REFUSED;
        }
        e->recent[oldest] = now_us;
        memcpy(e->ip, ip, sizeof ip);
        e->expire_us = now_us + r->lim.reservation_ttl_us;
        *expire_us = e->expire_us;
        return AP_RELAY_OK;
    }
    size_t same_ip = 0;
    for (size_t i = 0; i < r->nresv; i++) same_ip += memcmp(r->resv[i].ip, ip, 16) == 0;
    if (same_ip >= r->lim.reservations_per_ip) {
        snprintf(why, wn, "too many reservations from this IP (%u)", r->lim.reservations_per_ip);
        return AP_RELAY_RESOURCE_LIMIT_EXCEEDED;
    }
    if (r->nresv >= r->resv_cap) {
        snprintf(why, wn, "the relay is full (%u reservations)", r->lim.max_reservations);
        return AP_RELAY_RESOURCE_LIMIT_EXCEEDED;
    }
    e = &r->resv[r->nresv++];
    memset(e, 0, sizeof *e);
    e->peer = *peer;
    memcpy(e->ip, ip, sizeof ip);
    e->recent[0] = now_us;
    e->expire_us = now_us + r->lim.reservation_ttl_us;
    *expire_us = e->expire_us;
    return AP_RELAY_OK;
}

bool ap__relay_reserved(const ap_relay_t *r, const ap_peer_id_t *dst, uint64_t now_us)
{
    const ap_relay_resv_t *e = find_resv(r, dst);
    return e && e->expire_us > now_us;
}

int ap__relay_connect(ap_relay_t *r, const ap_peer_id_t *src, const ap_peer_id_t *dst,
                      uint64_t now_us, uint64_t *id, char *why, size_t wn)
{
    if (ap_peer_id_eq(src, dst)) {
        snprintf(why, wn, "a circuit to itself");
        return AP_RELAY_PERMISSION_DENIED;
    }
    if (!ap__relay_reserved(r, dst, now_us)) {
        snprintf(why, wn, "the destination holds no reservation");
        return AP_RELAY_NO_RESERVATION;
    }
    size_t free_slot = r->circ_cap, per_src = 0, per_dst = 0;
    for (size_t i = 0; i < r->circ_cap; i++) {
        const ap_relay_circ_t *c = &r->circ[i];
        if (!c->id) {
            if (free_slot == r->circ_cap) free_slot = i;
            continue;
        }
        per_src += ap_peer_id_eq(&c->src, src) || ap_peer_id_eq(&c->dst, src);
        per_dst += ap_peer_id_eq(&c->src, dst) || ap_peer_id_eq(&c->dst, dst);
    }
    if (per_src >= r->lim.circuits_per_peer || per_dst >= r->lim.circuits_per_peer) {
        snprintf(why, wn, "too many circuits for this peer (%u)", r->lim.circuits_per_peer);
        return AP_RELAY_RESOURCE_LIMIT_EXCEEDED;
    }
    if (free_slot == r->circ_cap) {
        snprintf(why, wn, "the relay is full (%u circuits)", r->lim.max_circuits);
        return AP_RELAY_RESOURCE_LIMIT_EXCEEDED;
    }
    ap_relay_circ_t *c = &r->circ[free_slot];
    *c = (ap_relay_circ_t){.id = r->next_id++, .src = *src, .dst = *dst, .start_us = now_us};
    r->ncirc++;
    *id = c->id;
    return AP_RELAY_OK;
}

static ap_relay_circ_t *find_circ(ap_relay_t *r, uint64_t id)
{
    for (size_t i = 0; id && i < r->circ_cap; i++)
        if (r->circ[i].id == id) return &r->circ[i];
    return NULL;
}

int ap__relay_account(ap_relay_t *r, uint64_t id, uint64_t n, uint64_t now_us)
{
    ap_relay_circ_t *c = find_circ(r, id);
    if (!c) return AP_ENOTFOUND;
    c->bytes += n;
    if (c->bytes > r->lim.circuit_bytes || now_us - c->start_us > r->lim.circuit_duration_us)
        return AP_ELIMIT;
    return 0;
}

void ap__relay_circuit_end(ap_relay_t *r, uint64_t id)
{
    ap_relay_circ_t *c = find_circ(r, id);
    if (!c) return;
    c->id = 0;
    r->ncirc--;
}

size_t ap__relay_circuits(const ap_relay_t *r)
{
    return r->ncirc;
}

int ap__relay_rd_feed(ap_relay_rd_t *r, bool stop, const uint8_t *p, size_t n, ap_relay_msg_t *m,
                      size_t *used)
{
    size_t old = r->len, take = sizeof r->buf - r->len;
    if (take > n) take = n;
    if (take) memcpy(r->buf + r->len, p, take);
    r->len += take;
    *used = take;
    size_t hl, bl;
    int rc = ap__relay_frame(r->buf, r->len, &hl, &bl);
    if (rc < 0) return rc;
    if (rc == 0) return r->len == sizeof r->buf ? AP_EMSGSIZE : 0;
    if (hl + bl > sizeof r->buf) return AP_EMSGSIZE;
    if (r->len < hl + bl) return 0;
    *used = hl + bl - old;
    r->len = 0;
    rc = ap__relay_decode(stop, r->buf + hl, bl, m);
    return rc < 0 ? rc : 1;
}

size_t ap__relay_drop_if(ap_relay_t *r, bool (*gone)(void *arg, const ap_peer_id_t *peer),
                         void *arg)
{
    size_t n = 0;
    for (size_t i = 0; i < r->nresv;)
        if (gone(arg, &r->resv[i].peer)) {
            r->resv[i] = r->resv[--r->nresv];
            n++;
        } else
            i++;
    return n;
}
