/* BTARD verified-step messages: protobuf-c bodies in the Signed envelope,
 * capped and checked (see proto/btard.proto). */
#include "btard/step_wire.h"

#include "btard.pb-c.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DOMAIN     "apiary/btard/1"
#define DOMAIN_LEN 14
#define BODY_MAX   (AP_BTARD_STEP_MSG_MAX - 128)
#define H          AP_BTARD_HASH_LEN

static uint8_t *signed_input(uint32_t kind, const uint8_t *body, size_t len, size_t *sl)
{
    uint8_t *out = malloc(DOMAIN_LEN + 4 + len);
    if (!out) return NULL;
    memcpy(out, DOMAIN, DOMAIN_LEN);
    for (int i = 0; i < 4; i++) out[DOMAIN_LEN + i] = (uint8_t)(kind >> (8 * i));
    if (len) memcpy(out + DOMAIN_LEN + 4, body, len);
    *sl = DOMAIN_LEN + 4 + len;
    return out;
}

static ProtobufCBinaryData bin(const uint8_t *p, size_t n)
{
    return (ProtobufCBinaryData){n, (uint8_t *)p};
}

static size_t body_encode(const ap__step_msg_t *m, uint8_t *out, size_t cap)
{
    if (m->kind == AP__BTARD_STEP_COMMIT) {
        const ap__step_commit_t *c = &m->u.commit;
        if (c->n == 0 || c->n > AP_BTARD_STEP_MAX_PEERS) return 0;
        Apiary__Btard__StepCommit p = APIARY__BTARD__STEP_COMMIT__INIT;
        p.ctx = bin(c->ctx, H);
        p.weight = c->weight;
        p.part_hashes = bin(&c->part[0][0], (size_t)c->n * H);
        p.recv_hashes = bin(&c->recv[0][0], (size_t)c->n * H);
        p.agg_hash = bin(c->agg, c->has_agg ? H : 0);
        p.state_hash = bin(c->state, c->has_state ? H : 0);
        if (apiary__btard__step_commit__get_packed_size(&p) > cap) return 0;
        return apiary__btard__step_commit__pack(&p, out);
    }
    if (m->kind == AP__BTARD_AGG_CHECK) {
        const ap__agg_check_t *c = &m->u.check;
        if (c->n > AP_BTARD_STEP_MAX_PEERS) return 0;
        Apiary__Btard__AggCheck p = APIARY__BTARD__AGG_CHECK__INIT;
        Apiary__Btard__AggEntry ent[AP_BTARD_STEP_MAX_PEERS], *ep[AP_BTARD_STEP_MAX_PEERS];
        for (uint32_t i = 0; i < c->n; i++) {
            apiary__btard__agg_entry__init(&ent[i]);
            ent[i].hash = bin(c->e[i].hash, H);
            ent[i].weight = c->e[i].weight;
            ent[i].dist = c->e[i].dist;
            ent[i].proj = c->e[i].proj;
            ep[i] = &ent[i];
        }
        p.ctx = bin(c->ctx, H);
        p.part = c->part;
        p.seed = bin(c->seed, H);
        p.agg_hash = bin(c->agg, H);
        p.tau = c->tau;
        p.n_entries = c->n;
        p.entries = ep;
        if (apiary__btard__agg_check__get_packed_size(&p) > cap) return 0;
        return apiary__btard__agg_check__pack(&p, out);
    }
    if (m->kind == AP__BTARD_STEP_REPORT) {
        const ap__step_report_t *r = &m->u.report;
        if (r->n > AP_BTARD_STEP_MAX_PEERS || r->nacc > AP_BTARD_STEP_MAX_PEERS) return 0;
        Apiary__Btard__StepReport p = APIARY__BTARD__STEP_REPORT__INIT;
        p.ctx = bin(r->ctx, H);
        p.n_disputed = r->n;
        p.disputed = (uint32_t *)r->disputed;
        p.n_accused = p.n_accused_part = r->nacc;
        p.accused = (uint32_t *)r->acc_target;
        p.accused_part = (uint32_t *)r->acc_part;
        if (apiary__btard__step_report__get_packed_size(&p) > cap) return 0;
        return apiary__btard__step_report__pack(&p, out);
    }
    return 0;
}

size_t ap__step_msg_encode(const ap__step_msg_t *m, ap_btard_sign_fn sign, void *sign_arg,
                           uint8_t *out, size_t cap)
{
    if (!m || !sign || !out) return 0;
    uint8_t *body = malloc(BODY_MAX);
    if (!body) return 0;
    size_t n = 0, sl = 0, bl = body_encode(m, body, BODY_MAX);
    uint8_t *sin = bl ? signed_input(m->kind, body, bl, &sl) : NULL;
    if (sin) {
        uint8_t sig[AP_ED25519_SIG_LEN];
        sign(sign_arg, sin, sl, sig);
        Apiary__Btard__Signed s = APIARY__BTARD__SIGNED__INIT;
        s.kind = m->kind;
        s.sender = bin(m->sender.b, AP_PEER_ID_LEN);
        s.body = bin(body, bl);
        s.sig = bin(sig, AP_ED25519_SIG_LEN);
        n = apiary__btard__signed__get_packed_size(&s);
        if (n > cap || n > AP_BTARD_STEP_MSG_MAX)
            n = 0;
        else
            n = apiary__btard__signed__pack(&s, out);
    }
    free(sin);
    free(body);
    return n;
}

static bool hash_ok(const ProtobufCBinaryData *b)
{
    return b->len == H;
}

static int decode_commit(const uint8_t *b, size_t len, ap__step_commit_t *c)
{
    Apiary__Btard__StepCommit *p = apiary__btard__step_commit__unpack(NULL, len, b);
    if (!p) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    size_t n = p->part_hashes.len / H;
    if (!hash_ok(&p->ctx) || n == 0 || n > AP_BTARD_STEP_MAX_PEERS || p->part_hashes.len % H ||
        p->recv_hashes.len != p->part_hashes.len || (p->agg_hash.len && !hash_ok(&p->agg_hash)) ||
        (p->state_hash.len && !hash_ok(&p->state_hash)) || !isfinite(p->weight) || p->weight < 0)
        goto out;
    memcpy(c->ctx, p->ctx.data, H);
    c->weight = p->weight;
    c->n = (uint32_t)n;
    memcpy(c->part, p->part_hashes.data, n * H);
    memcpy(c->recv, p->recv_hashes.data, n * H);
    c->has_agg = p->agg_hash.len == H;
    if (c->has_agg) memcpy(c->agg, p->agg_hash.data, H);
    c->has_state = p->state_hash.len == H;
    if (c->has_state) memcpy(c->state, p->state_hash.data, H);
    rc = 0;
out:
    apiary__btard__step_commit__free_unpacked(p, NULL);
    return rc;
}

static int decode_check(const uint8_t *b, size_t len, ap__agg_check_t *c)
{
    Apiary__Btard__AggCheck *p = apiary__btard__agg_check__unpack(NULL, len, b);
    if (!p) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    if (!hash_ok(&p->ctx) || !hash_ok(&p->seed) || !hash_ok(&p->agg_hash) ||
        p->n_entries > AP_BTARD_STEP_MAX_PEERS || p->part >= AP_BTARD_STEP_MAX_PEERS)
        goto out;
    memcpy(c->ctx, p->ctx.data, H);
    memcpy(c->seed, p->seed.data, H);
    memcpy(c->agg, p->agg_hash.data, H);
    c->part = p->part;
    c->tau = p->tau;
    c->n = (uint32_t)p->n_entries;
    for (size_t i = 0; i < p->n_entries; i++) {
        const Apiary__Btard__AggEntry *e = p->entries[i];
        if (!hash_ok(&e->hash)) goto out;
        memcpy(c->e[i].hash, e->hash.data, H);
        c->e[i].weight = e->weight;
        c->e[i].dist = e->dist;
        c->e[i].proj = e->proj;
    }
    rc = 0;
out:
    apiary__btard__agg_check__free_unpacked(p, NULL);
    return rc;
}

static int decode_report(const uint8_t *b, size_t len, ap__step_report_t *r)
{
    Apiary__Btard__StepReport *p = apiary__btard__step_report__unpack(NULL, len, b);
    if (!p) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    if (!hash_ok(&p->ctx) || p->n_disputed > AP_BTARD_STEP_MAX_PEERS ||
        p->n_accused > AP_BTARD_STEP_MAX_PEERS || p->n_accused != p->n_accused_part)
        goto out;
    memcpy(r->ctx, p->ctx.data, H);
    r->n = (uint32_t)p->n_disputed;
    for (size_t i = 0; i < p->n_disputed; i++) {
        if (p->disputed[i] >= AP_BTARD_STEP_MAX_PEERS) goto out;
        r->disputed[i] = p->disputed[i];
    }
    r->nacc = (uint32_t)p->n_accused;
    for (size_t i = 0; i < p->n_accused; i++) {
        if (p->accused[i] >= AP_BTARD_STEP_MAX_PEERS ||
            p->accused_part[i] >= AP_BTARD_STEP_MAX_PEERS)
            goto out;
        r->acc_target[i] = p->accused[i];
        r->acc_part[i] = p->accused_part[i];
    }
    rc = 0;
out:
    apiary__btard__step_report__free_unpacked(p, NULL);
    return rc;
}

int ap__step_msg_decode(const uint8_t *b, size_t len, ap__step_msg_t *m)
{
    if (!m || (!b && len)) return AP_EINVAL;
    if (len > AP_BTARD_STEP_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Btard__Signed *s = apiary__btard__signed__unpack(NULL, len, b);
    if (!s) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    memset(m, 0, sizeof *m);
    uint8_t *sin = NULL;
    if (s->kind < AP__BTARD_STEP_COMMIT || s->kind > AP__BTARD_STEP_REPORT) {
        rc = AP_ENOTSUP;
        goto out;
    }
    if (s->sig.len != AP_ED25519_SIG_LEN || s->body.len > BODY_MAX) goto out;
    if (ap_peer_id_from_bytes(&m->sender, s->sender.data, s->sender.len) != 0) goto out;
    size_t sl;
    sin = signed_input(s->kind, s->body.data, s->body.len, &sl);
    if (!sin) {
        rc = AP_ENOMEM;
        goto out;
    }
    if (ap_peer_verify(&m->sender, sin, sl, s->sig.data) != 0) {
        rc = AP_EAUTH;
        goto out;
    }
    m->kind = s->kind;
    if (s->kind == AP__BTARD_STEP_COMMIT)
        rc = decode_commit(s->body.data, s->body.len, &m->u.commit);
    else if (s->kind == AP__BTARD_AGG_CHECK)
        rc = decode_check(s->body.data, s->body.len, &m->u.check);
    else
        rc = decode_report(s->body.data, s->body.len, &m->u.report);
out:
    free(sin);
    apiary__btard__signed__free_unpacked(s, NULL);
    return rc;
}
