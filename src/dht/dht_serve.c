/* DHT: serving requests from peers (STORE, FIND), with the per-peer rate
 * limit and record validation. */
#include "dht/dht_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- RPC handler --------------------------------------------------------------- */

/* Packed in place, in a buffer the runtime has counted already: a response
 * the caller's limits cannot take is refused before it is built. */
static void respond(ap_rpc_req_t *req, Apiary__Dht__Response *r)
{
    size_t sz = apiary__dht__response__get_packed_size(r);
    uint8_t *buf = ap_rpc_respond_begin(req, sz);
    if (!buf) return; /* refused: req is answered */
    apiary__dht__response__pack(r, buf);
    ap_rpc_respond_commit(req);
}

static void handle_store(ap_dht_t *dht, ap_rpc_req_t *req, const ap_peer_id_t *from,
                         const Apiary__Dht__StoreRequest *s)
{
    int32_t status[AP__DHT_MAX_BATCH];
    int64_t now = ap_rt_wall_ms(dht->rt);
    uint64_t mono = ap_rt_now_us(dht->rt);
    char sid[AP_PEER_SHORT_LEN];
    for (size_t i = 0; i < s->n_records; i++) {
        ap_dht_record_t r;
        const uint8_t *sig;
        bool has_sig;
        int rc = ap__dht_record_from_pb(s->records[i], &r, &sig, &has_sig);
        if (!rc) rc = ap__dht_storage_charge(&dht->store, from, mono);
        if (!rc) rc = ap__dht_validate(dht, &r, sig, has_sig, from);
        if (!rc) rc = ap__dht_storage_put_from(&dht->store, from, &r, sig, has_sig, now);
        if (rc == 0 || rc == AP_ESTALE) {
            /* a peer just stored this key here: it is the one republishing
             * it now (Kademlia's republish optimization) */
            uint8_t kid[AP_DHT_ID_LEN];
            ap_dht_key_id(r.key, r.key_len, kid);
            ap__dht_republish_postpone(dht, kid);
        }
        if (rc && rc != AP_ESTALE) {
            dht->stats.stores_refused++;
            ap_info(MOD, "peer %s: store refused: %s", ap__dht_short_id(from, sid),
                    ap_err_name(rc));
        }
        status[i] = rc;
    }
    Apiary__Dht__Response r = APIARY__DHT__RESPONSE__INIT;
    Apiary__Dht__StoreResponse sr = APIARY__DHT__STORE_RESPONSE__INIT;
    sr.status = status;
    sr.n_status = s->n_records;
    r.body_case = APIARY__DHT__RESPONSE__BODY_STORE;
    r.store = &sr;
    respond(req, &r);
}

static void handle_find(ap_dht_t *dht, ap_rpc_req_t *req, const ap_peer_id_t *from,
                        const Apiary__Dht__FindRequest *f)
{
    size_t n = f->n_key_ids;
    int k = dht->cfg.k < AP__DHT_MAX_NEAREST ? dht->cfg.k : AP__DHT_MAX_NEAREST;
    int64_t now = ap_rt_wall_ms(dht->rt);
    uint64_t mono = ap_rt_now_us(dht->rt);
    Apiary__Dht__FindResult *res = calloc(n, sizeof *res);
    Apiary__Dht__FindResult **rptr = calloc(n, sizeof *rptr);
    ap__dht_contact_t *near = calloc(n * (size_t)(k + 1), sizeof *near);
    Apiary__Dht__PeerInfo *pis = calloc(n * (size_t)(k + 1), sizeof *pis);
    Apiary__Dht__PeerInfo **piptr = calloc(n * (size_t)(k + 1), sizeof *piptr);
    ProtobufCBinaryData *pids = calloc(n * (size_t)(k + 1), sizeof *pids);
    char **addrp = calloc(2 * n * (size_t)(k + 1), sizeof *addrp); /* direct, circuit */
    /* records: views into storage, valid until we respond */
    Apiary__Dht__Record *recs = NULL, **recptr = NULL;
    size_t nrec_total = 0, recs_cap = 0;
    size_t *rec_start = calloc(n, sizeof *rec_start), *rec_n = calloc(n, sizeof *rec_n);
    bool ok = res && rptr && near && pis && piptr && pids && addrp && rec_start && rec_n;
    size_t budget = AP__DHT_RESP_BUDGET, used = 0;
    for (size_t i = 0; ok && i < n; i++) {
        const uint8_t *id = f->key_ids[i].data;
        ap__dht_sentry_t *e = ap__dht_storage_find(&dht->store, id, now);
        if (!e) e = ap__dht_storage_find(&dht->cache, id, now);
        rec_start[i] = nrec_total;
        for (size_t j = 0; e && j < e->nrecs; j++) {
            ap__dht_srec_t *sr = e->recs[j];
            size_t sz = e->key_len + sr->subkey_len + sr->value_len + 96;
            if (used + sz > budget || rec_n[i] >= AP__DHT_MAX_RESULT_RECS) break;
            if (nrec_total == recs_cap) {
                size_t nc = recs_cap ? recs_cap * 2 : 16;
                Apiary__Dht__Record *n2 = realloc(recs, nc * sizeof *n2);
                if (!n2) {
                    ok = false;
                    break;
                }
                recs = n2;
                recs_cap = nc;
            }
            ap_dht_record_t v;
            ap__dht_srec_view(e, sr, &v);
            ap__dht_record_to_pb(&v, sr->sig, sr->has_sig, &recs[nrec_total++]);
            rec_n[i]++;
            used += sz;
        }
    }
    if (ok && nrec_total) {
        recptr = calloc(nrec_total, sizeof *recptr);
        if (!recptr) ok = false;
        for (size_t j = 0; ok && j < nrec_total; j++) recptr[j] = &recs[j];
    }
    for (size_t i = 0; ok && i < n; i++) {
        apiary__dht__find_result__init(&res[i]);
        rptr[i] = &res[i];
        res[i].records = rec_n[i] ? &recptr[rec_start[i]] : NULL;
        res[i].n_records = rec_n[i];
        ap__dht_contact_t *nb = &near[i * (size_t)(k + 1)];
        int m = ap__dht_routing_nearest(&dht->table, f->key_ids[i].data, k + 1, mono, false, nb);
        size_t base = i * (size_t)(k + 1), cnt = 0;
        for (int j = 0; j < m && (int)cnt < k; j++) {
            if (ap_peer_id_eq(&nb[j].peer, from)) continue;
            Apiary__Dht__PeerInfo *pi = &pis[base + cnt];
            apiary__dht__peer_info__init(pi);
            pids[base + cnt].data = nb[j].peer.b;
            pids[base + cnt].len = AP_PEER_ID_LEN;
            pi->id = pids[base + cnt];
            char **pa = &addrp[2 * (base + cnt)];
            const char *circ = ap__dht_circuit_of(dht, &nb[j].peer);
            if (nb[j].addr[0]) pa[pi->n_addrs++] = nb[j].addr;
            if (circ) pa[pi->n_addrs++] = (char *)circ;
            if (pi->n_addrs) pi->addrs = pa;
            piptr[base + cnt] = pi;
            cnt++;
        }
        res[i].nearest = &piptr[base];
        res[i].n_nearest = cnt;
    }
    if (ok) {
        Apiary__Dht__Response r = APIARY__DHT__RESPONSE__INIT;
        Apiary__Dht__FindResponse fr = APIARY__DHT__FIND_RESPONSE__INIT;
        fr.results = rptr;
        fr.n_results = n;
        r.body_case = APIARY__DHT__RESPONSE__BODY_FIND;
        r.find = &fr;
        respond(req, &r);
    } else {
        ap_rpc_respond_error(req, AP_ENOMEM, "out of memory");
    }
    free(res);
    free(rptr);
    free(near);
    free(pis);
    free(piptr);
    free(pids);
    free(addrp);
    free(recs);
    free(recptr);
    free(rec_start);
    free(rec_n);
}

void ap__dht_on_request(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_dht_t *dht = arg;
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    ap_peer_id_t from = *ap_rpc_req_peer(req);
    char s[AP_PEER_SHORT_LEN];
    Apiary__Dht__Request *q;
    int rc = ap__dht_decode_request(data, len, &q);
    if (rc) {
        ap_warn(MOD, "peer %s: malformed request (%zu bytes): %s", ap__dht_short_id(&from, s), len,
                ap_err_name(rc));
        ap_rpc_respond_error(req, rc, "malformed dht request");
        return;
    }
    dht->stats.rpcs_served++;
    if (!q->client) {
        ap__dht_learn_addrs(dht, &from, q->sender_addrs, q->n_sender_addrs);
        ap__dht_peer_seen(dht, &from, q->n_sender_addrs ? q->sender_addrs[0] : NULL);
        ap__dht_circuit_note(dht, &from, q->sender_addrs, q->n_sender_addrs);
    }
    switch (q->body_case) {
    case APIARY__DHT__REQUEST__BODY_PING: {
        Apiary__Dht__Response r = APIARY__DHT__RESPONSE__INIT;
        Apiary__Dht__PingResponse p = APIARY__DHT__PING_RESPONSE__INIT;
        r.body_case = APIARY__DHT__RESPONSE__BODY_PING;
        r.ping = &p;
        respond(req, &r);
        break;
    }
    case APIARY__DHT__REQUEST__BODY_STORE:
        handle_store(dht, req, &from, q->store);
        break;
    case APIARY__DHT__REQUEST__BODY_FIND:
        handle_find(dht, req, &from, q->find);
        break;
    default:
        ap_rpc_respond_error(req, AP_EPROTO, "no body");
        break;
    }
    apiary__dht__request__free_unpacked(q, NULL);
}
