/* Global bans: self-proving Ban records in the DHT (see apiary/btard.h). */
#include "apiary/btard.h"
#include "apiary/log.h"
#include "btard/step_wire.h"

#include "btard.pb-c.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

void ap_btard_round_ctx(const uint8_t run[AP_BTARD_HASH_LEN], uint64_t step, uint32_t round,
                        uint8_t ctx[AP_BTARD_HASH_LEN])
{
    static const char tag[] = "apiary/btard/round";
    uint8_t b[12];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(step >> (8 * i));
    for (int i = 0; i < 4; i++) b[8 + i] = (uint8_t)(round >> (8 * i));
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&st, run, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, b, sizeof b);
    crypto_generichash_final(&st, ctx, AP_BTARD_HASH_LEN);
}

void ap_btard_ban_key(const uint8_t run[AP_BTARD_HASH_LEN], char key[AP_BTARD_BAN_KEY_LEN + 1])
{
    static const char hex[] = "0123456789abcdef";
    size_t p = sizeof AP_BTARD_BAN_PREFIX - 1;
    memcpy(key, AP_BTARD_BAN_PREFIX, p);
    for (int i = 0; i < AP_BTARD_HASH_LEN; i++) {
        key[p++] = hex[run[i] >> 4];
        key[p++] = hex[run[i] & 15];
    }
    key[p] = 0;
}

/* BAD_AGGREGATE: ev_a is an AggCheck signed by the peer for this run's step
 * whose projections do not sum to ~0. */
static int prove_aggregate(const ap_btard_ban_t *b)
{
    if (!b->ev_a || b->ev_b_len) return AP_EINVAL;
    ap__step_msg_t *m = malloc(sizeof *m);
    if (!m) return AP_ENOMEM;
    int rc = ap__step_msg_decode(b->ev_a, b->ev_a_len, m);
    uint8_t ctx[AP_BTARD_HASH_LEN];
    ap_btard_round_ctx(b->run, b->step, b->round, ctx);
    if (rc == 0)
        rc = m->kind == AP__BTARD_AGG_CHECK && ap_peer_id_eq(&m->sender, &b->peer) &&
                     !memcmp(m->u.check.ctx, ctx, AP_BTARD_HASH_LEN) &&
                     ap_btard_agg_fails(m->u.check.e, m->u.check.n, m->u.check.tau)
                 ? 0
                 : AP_EINVAL;
    free(m);
    return rc;
}

/* STEP_EQUIVOCATION: ev_a and ev_b are two different messages of one kind,
 * StepCommit or AggCheck, both signed by the peer for this run's step. */
static int prove_step_equivocation(const ap_btard_ban_t *b)
{
    if (!b->ev_a || !b->ev_b ||
        (b->ev_a_len == b->ev_b_len && !memcmp(b->ev_a, b->ev_b, b->ev_a_len)))
        return AP_EINVAL;
    ap__step_msg_t *m = malloc(2 * sizeof *m);
    if (!m) return AP_ENOMEM;
    uint8_t ctx[AP_BTARD_HASH_LEN];
    ap_btard_round_ctx(b->run, b->step, b->round, ctx);
    int rc = ap__step_msg_decode(b->ev_a, b->ev_a_len, &m[0]);
    if (rc == 0) rc = ap__step_msg_decode(b->ev_b, b->ev_b_len, &m[1]);
    for (int k = 0; rc == 0 && k < 2; k++) {
        const uint8_t *mc = m[k].kind == AP__BTARD_STEP_COMMIT ? m[k].u.commit.ctx
                            : m[k].kind == AP__BTARD_AGG_CHECK ? m[k].u.check.ctx
                                                               : NULL;
        if (!mc || m[k].kind != m[0].kind || !ap_peer_id_eq(&m[k].sender, &b->peer) ||
            memcmp(mc, ctx, AP_BTARD_HASH_LEN) != 0)
            rc = AP_EINVAL;
    }
    free(m);
    return rc ? AP_EINVAL : 0;
}

static int prove(const ap_btard_ban_t *b)
{
    if (b->fault == AP_BTARD_FAULT_BAD_AGGREGATE) return prove_aggregate(b);
    if (b->fault == AP_BTARD_FAULT_STEP_EQUIVOCATION) return prove_step_equivocation(b);
    if (b->fault != AP_BTARD_FAULT_BAD_REVEAL && b->fault != AP_BTARD_FAULT_EQUIVOCATION)
        return AP_EINVAL;
    uint8_t ctx[AP_BTARD_HASH_LEN];
    ap_btard_round_ctx(b->run, b->step, b->round, ctx);
    ap_btard_fault_t f;
    int rc = ap_btard_mprng_check_evidence(ctx, &b->peer, b->ev_a, b->ev_a_len, b->ev_b,
                                           b->ev_b_len, &f);
    if (rc) return rc < 0 ? AP_EINVAL : rc;
    return f == b->fault ? 0 : AP_EINVAL;
}

int ap_btard_ban_encode(const ap_btard_ban_t *b, uint8_t *out, size_t cap, size_t *len)
{
    if (!b || !out || !len || !b->ev_a || (!b->ev_b && b->ev_b_len) ||
        b->ev_a_len > AP_BTARD_STEP_MSG_MAX || b->ev_b_len > AP_BTARD_STEP_MSG_MAX)
        return AP_EINVAL;
    int rc = prove(b);
    if (rc) return AP_EINVAL;
    Apiary__Btard__Ban m = APIARY__BTARD__BAN__INIT;
    m.run = (ProtobufCBinaryData){AP_BTARD_HASH_LEN, (uint8_t *)b->run};
    m.step = b->step;
    m.round = b->round;
    m.fault = (uint32_t)b->fault;
    m.evidence_a = (ProtobufCBinaryData){b->ev_a_len, (uint8_t *)b->ev_a};
    m.evidence_b = (ProtobufCBinaryData){b->ev_b_len, (uint8_t *)b->ev_b};
    size_t n = apiary__btard__ban__get_packed_size(&m);
    if (n > cap || n > AP_BTARD_BAN_MAX) return AP_EMSGSIZE;
    *len = apiary__btard__ban__pack(&m, out);
    return 0;
}

int ap_btard_ban_check(const uint8_t *value, size_t len, const ap_peer_id_t *peer,
                       const uint8_t run[AP_BTARD_HASH_LEN], ap_btard_ban_t *out)
{
    if (!value || !peer || !out) return AP_EINVAL;
    if (len > AP_BTARD_BAN_MAX) return AP_EMSGSIZE;
    Apiary__Btard__Ban *m = apiary__btard__ban__unpack(NULL, len, value);
    if (!m) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    if (m->run.len != AP_BTARD_HASH_LEN || m->evidence_a.len > AP_BTARD_STEP_MSG_MAX ||
        m->evidence_b.len > AP_BTARD_STEP_MSG_MAX || m->fault > 0xff)
        goto out;
    memset(out, 0, sizeof *out);
    memcpy(out->run, m->run.data, AP_BTARD_HASH_LEN);
    out->step = m->step;
    out->round = m->round;
    out->peer = *peer;
    out->fault = (ap_btard_fault_t)m->fault;
    out->ev_a = m->evidence_a.data;
    out->ev_a_len = m->evidence_a.len;
    out->ev_b = m->evidence_b.data;
    out->ev_b_len = m->evidence_b.len;
    rc = AP_EINVAL;
    if (run && memcmp(run, out->run, AP_BTARD_HASH_LEN) != 0) goto out;
    rc = prove(out) == 0 ? 0 : AP_EINVAL;
out:
    if (rc == 0 || rc == AP_EINVAL) { /* the evidence is freed with m */
        out->ev_a = out->ev_b = NULL;
        out->ev_a_len = out->ev_b_len = 0;
    }
    apiary__btard__ban__free_unpacked(m, NULL);
    return rc;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

int ap_btard_ban_validator(void *arg, const ap_dht_record_t *rec, const ap_peer_id_t *from_peer)
{
    (void)arg, (void)from_peer;
    size_t pl = sizeof AP_BTARD_BAN_PREFIX - 1;
    if (rec->key_len < pl || memcmp(rec->key, AP_BTARD_BAN_PREFIX, pl) != 0) return 0;
    if (rec->key_len != AP_BTARD_BAN_KEY_LEN) return AP_EINVAL;
    uint8_t run[AP_BTARD_HASH_LEN];
    for (int i = 0; i < AP_BTARD_HASH_LEN; i++) {
        int hi = hexval((char)rec->key[pl + 2 * i]), lo = hexval((char)rec->key[pl + 2 * i + 1]);
        if (hi < 0 || lo < 0) return AP_EINVAL;
        run[i] = (uint8_t)(hi << 4 | lo);
    }
    ap_peer_id_t peer;
    if (!rec->subkey || ap_peer_id_from_bytes(&peer, rec->subkey, rec->subkey_len) != 0)
        return AP_EINVAL;
    ap_btard_ban_t b;
    return ap_btard_ban_check(rec->value, rec->value_len, &peer, run, &b) == 0 ? 0 : AP_EINVAL;
}

int ap_btard_ban_publish(ap_dht_t *dht, const ap_btard_ban_t *b, int64_t expiration_ms,
                         ap_dht_store_fn cb, void *arg)
{
    if (!dht || !b) return AP_EINVAL;
    uint8_t val[AP_BTARD_BAN_MAX];
    size_t len;
    int rc = ap_btard_ban_encode(b, val, sizeof val, &len);
    if (rc) return rc;
    char key[AP_BTARD_BAN_KEY_LEN + 1];
    ap_btard_ban_key(b->run, key);
    ap_dht_record_t rec = {.key = (const uint8_t *)key,
                           .key_len = AP_BTARD_BAN_KEY_LEN,
                           .subkey = b->peer.b,
                           .subkey_len = AP_PEER_ID_LEN,
                           .value = val,
                           .value_len = len,
                           .expiration_ms = expiration_ms};
    return ap_dht_store(dht, &rec, cb, arg);
}

typedef struct fetch {
    uint8_t run[AP_BTARD_HASH_LEN];
    ap_btard_bans_fn cb;
    void *arg;
} fetch_t;

static void on_get(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res)
{
    (void)dht;
    fetch_t *f = arg;
    ap_peer_id_t *out = NULL;
    size_t n = 0;
    if (status == 0 && res && res->found && res->is_dict && res->nrecords) {
        out = calloc(res->nrecords, sizeof *out);
        for (size_t i = 0; out && i < res->nrecords; i++) {
            const ap_dht_record_t *r = &res->records[i];
            ap_peer_id_t p;
            ap_btard_ban_t b;
            if (ap_peer_id_from_bytes(&p, r->subkey, r->subkey_len) != 0) continue;
            if (ap_btard_ban_check(r->value, r->value_len, &p, f->run, &b) != 0) {
                char s[AP_PEER_SHORT_LEN];
                ap_log(AP_LOG_WARN, "btard", "ban of %s proves nothing: skipped",
                       ap_peer_id_short(&p, s));
                continue;
            }
            bool dup = false;
            for (size_t j = 0; j < n; j++) dup |= ap_peer_id_eq(&out[j], &p);
            if (!dup) out[n++] = p;
        }
    }
    f->cb(f->arg, status, out, n);
    free(out);
    free(f);
}

int ap_btard_bans_fetch(ap_dht_t *dht, const uint8_t run[AP_BTARD_HASH_LEN], ap_btard_bans_fn cb,
                        void *arg)
{
    if (!dht || !run || !cb) return AP_EINVAL;
    fetch_t *f = malloc(sizeof *f);
    if (!f) return AP_ENOMEM;
    memcpy(f->run, run, AP_BTARD_HASH_LEN);
    f->cb = cb;
    f->arg = arg;
    char key[AP_BTARD_BAN_KEY_LEN + 1];
    ap_btard_ban_key(run, key);
    int rc = ap_dht_get(dht, (const uint8_t *)key, AP_BTARD_BAN_KEY_LEN, true, on_get, f);
    if (rc) free(f);
    return rc;
}

/* ---- ban list ------------------------------------------------------------------ */

struct ap_btard_banlist {
    ap_peer_id_t *p;
    size_t n, cap;
};

ap_btard_banlist_t *ap_btard_banlist_new(void)
{
    return calloc(1, sizeof(ap_btard_banlist_t));
}

void ap_btard_banlist_free(ap_btard_banlist_t *bl)
{
    if (!bl) return;
    free(bl->p);
    free(bl);
}

bool ap_btard_banlist_has(void *arg, const ap_peer_id_t *peer)
{
    const ap_btard_banlist_t *bl = arg;
    if (!bl || !peer) return false;
    for (size_t i = 0; i < bl->n; i++)
        if (ap_peer_id_eq(&bl->p[i], peer)) return true;
    return false;
}

int ap_btard_banlist_add(ap_btard_banlist_t *bl, const ap_peer_id_t *peer)
{
    if (!bl || !peer) return AP_EINVAL;
    if (ap_btard_banlist_has(bl, peer)) return 0;
    if (bl->n == AP_BTARD_BANLIST_MAX) return AP_ELIMIT;
    if (bl->n == bl->cap) {
        size_t cap = bl->cap ? 2 * bl->cap : 16;
        ap_peer_id_t *p = realloc(bl->p, cap * sizeof *p);
        if (!p) return AP_ENOMEM;
        bl->p = p;
        bl->cap = cap;
    }
    bl->p[bl->n++] = *peer;
    return 1;
}

size_t ap_btard_banlist_count(const ap_btard_banlist_t *bl)
{
    return bl ? bl->n : 0;
}
