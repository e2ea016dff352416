/* DHT wire messages: strict decoding. See wire.h. */
#include "dht/wire.h"

#include <string.h>

int ap__dht_record_from_pb(const Apiary__Dht__Record *pb, ap_dht_record_t *out, const uint8_t **sig,
                           bool *has_sig)
{
    if (pb->key.len == 0 || pb->key.len > AP_DHT_KEY_MAX || pb->subkey.len > AP_DHT_SUBKEY_MAX ||
        pb->value.len > AP_DHT_VALUE_MAX)
        return AP_EMSGSIZE;
    if (pb->signature.len != 0 && pb->signature.len != AP_ED25519_SIG_LEN) return AP_EPROTO;
    out->key = pb->key.data;
    out->key_len = pb->key.len;
    out->subkey = pb->subkey.len ? pb->subkey.data : NULL;
    out->subkey_len = pb->subkey.len;
    out->value = pb->value.data;
    out->value_len = pb->value.len;
    out->expiration_ms = pb->expiration_ms;
    *has_sig = pb->signature.len == AP_ED25519_SIG_LEN;
    *sig = *has_sig ? pb->signature.data : NULL;
    return 0;
}

void ap__dht_record_to_pb(const ap_dht_record_t *rec, const uint8_t *sig, bool has_sig,
                          Apiary__Dht__Record *pb)
{
    apiary__dht__record__init(pb);
    pb->key.data = (uint8_t *)rec->key;
    pb->key.len = rec->key_len;
    pb->subkey.data = (uint8_t *)rec->subkey;
    pb->subkey.len = rec->subkey_len;
    pb->value.data = (uint8_t *)rec->value;
    pb->value.len = rec->value_len;
    pb->expiration_ms = rec->expiration_ms;
    if (has_sig) {
        pb->signature.data = (uint8_t *)sig;
        pb->signature.len = AP_ED25519_SIG_LEN;
    }
}

static int check_addr(const char *a)
{
    if (!a) return AP_EPROTO;
    size_t n = strnlen(a, AP_RT_ADDR_MAX);
    return n == 0 || n >= AP_RT_ADDR_MAX ? AP_EPROTO : 0;
}

int ap__dht_peerinfo_check(const Apiary__Dht__PeerInfo *pi, ap_peer_id_t *id)
{
    if (!pi) return AP_EPROTO;
    if (ap_peer_id_from_bytes(id, pi->id.data, pi->id.len) != 0) return AP_EPROTO;
    if (pi->n_addrs > AP__DHT_MAX_ADDRS) return AP_EPROTO;
    for (size_t i = 0; i < pi->n_addrs; i++)
        if (check_addr(pi->addrs[i])) return AP_EPROTO;
    return 0;
}

static int check_record(const Apiary__Dht__Record *r)
{
    ap_dht_record_t v;
    const uint8_t *sig;
    bool has_sig;
    if (!r) return AP_EPROTO;
    return ap__dht_record_from_pb(r, &v, &sig, &has_sig);
}

int ap__dht_decode_record(const uint8_t *data, size_t len, Apiary__Dht__Record **out)
{
    *out = NULL;
    if (len > AP__DHT_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Dht__Record *r = apiary__dht__record__unpack(NULL, len, data);
    if (!r) return AP_EPROTO;
    int rc = check_record(r);
    if (rc) {
        apiary__dht__record__free_unpacked(r, NULL);
        return rc;
    }
    *out = r;
    return 0;
}

static int check_request(const Apiary__Dht__Request *q)
{
    if (q->n_sender_addrs > AP__DHT_MAX_ADDRS) return AP_EPROTO;
    for (size_t i = 0; i < q->n_sender_addrs; i++)
        if (check_addr(q->sender_addrs[i])) return AP_EPROTO;
    switch (q->body_case) {
    case APIARY__DHT__REQUEST__BODY_PING:
        return 0;
    case APIARY__DHT__REQUEST__BODY_STORE: {
        const Apiary__Dht__StoreRequest *s = q->store;
        if (s->n_records == 0 || s->n_records > AP__DHT_MAX_BATCH) return AP_EPROTO;
        for (size_t i = 0; i < s->n_records; i++) {
            int rc = check_record(s->records[i]);
            if (rc) return rc;
        }
        return 0;
    }
    case APIARY__DHT__REQUEST__BODY_FIND: {
        const Apiary__Dht__FindRequest *f = q->find;
        if (f->n_key_ids == 0 || f->n_key_ids > AP__DHT_MAX_BATCH) return AP_EPROTO;
        for (size_t i = 0; i < f->n_key_ids; i++)
            if (f->key_ids[i].len != AP_DHT_ID_LEN) return AP_EPROTO;
        return 0;
    }
    default:
        return AP_EPROTO;
    }
}

int ap__dht_decode_request(const uint8_t *data, size_t len, Apiary__Dht__Request **out)
{
    *out = NULL;
    if (len > AP__DHT_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Dht__Request *q = apiary__dht__request__unpack(NULL, len, data);
    if (!q) return AP_EPROTO;
    int rc = check_request(q);
    if (rc) {
        apiary__dht__request__free_unpacked(q, NULL);
        return rc;
    }
    *out = q;
    return 0;
}

static int check_response(const Apiary__Dht__Response *r)
{
    switch (r->body_case) {
    case APIARY__DHT__RESPONSE__BODY_PING:
        return 0;
    case APIARY__DHT__RESPONSE__BODY_STORE:
        return r->store->n_status <= AP__DHT_MAX_BATCH ? 0 : AP_EPROTO;
    case APIARY__DHT__RESPONSE__BODY_FIND: {
        const Apiary__Dht__FindResponse *f = r->find;
        if (f->n_results > AP__DHT_MAX_BATCH) return AP_EPROTO;
        for (size_t i = 0; i < f->n_results; i++) {
            const Apiary__Dht__FindResult *fr = f->results[i];
            if (fr->n_records > AP__DHT_MAX_RESULT_RECS || fr->n_nearest > AP__DHT_MAX_NEAREST)
                return AP_EPROTO;
            for (size_t j = 0; j < fr->n_records; j++) {
                int rc = check_record(fr->records[j]);
                if (rc) return rc;
            }
            for (size_t j = 0; j < fr->n_nearest; j++) {
                ap_peer_id_t id;
                int rc = ap__dht_peerinfo_check(fr->nearest[j], &id);
                if (rc) return rc;
            }
        }
        return 0;
    }
    default:
        return AP_EPROTO;
    }
}

int ap__dht_decode_response(const uint8_t *data, size_t len, Apiary__Dht__Response **out)
{
    *out = NULL;
    if (len > AP__DHT_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Dht__Response *r = apiary__dht__response__unpack(NULL, len, data);
    if (!r) return AP_EPROTO;
    int rc = check_response(r);
    if (rc) {
        apiary__dht__response__free_unpacked(r, NULL);
        return rc;
    }
    *out = r;
    return 0;
}
