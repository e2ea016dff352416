/* MPRNG: shared randomness by signed commit and reveal, with exclusion and
 * restart (see apiary/btard.h for the rules). */
#include "apiary/btard.h"
#include "btard/wire.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#define OUTBOX_MAX 4

typedef struct raw {
    uint16_t len;
    uint8_t b[AP_BTARD_MSG_MAX];
} raw_t;

typedef struct member {
    ap_peer_id_t id;
    ap_btard_fault_t fault;
    bool have_commit, have_reveal, reveal_ok, have_next;
    uint32_t next_attempt;
    uint8_t hash[AP_BTARD_HASH_LEN];
    uint8_t value[AP_BTARD_HASH_LEN];
    raw_t commit, reveal, next; /* signed messages as received */
    raw_t ev_a, ev_b;           /* evidence of a provable fault */
} member_t;

struct ap_btard_mprng {
    uint8_t ctx[AP_BTARD_HASH_LEN];
    size_t n, self;
    ap_btard_sign_fn sign;
    void *sign_arg;
    ap_btard_mprng_state_t state;
    uint32_t attempt;
    uint8_t seed[AP_BTARD_HASH_LEN];
    member_t *m;
    raw_t out[OUTBOX_MAX];
    int out_head, out_count;
    raw_t out_cur;
};

const char *ap_btard_fault_name(ap_btard_fault_t f)
{
    switch (f) {
    case AP_BTARD_FAULT_NONE:
        return "none";
    case AP_BTARD_FAULT_NO_COMMIT:
        return "no_commit";
    case AP_BTARD_FAULT_NO_REVEAL:
        return "no_reveal";
    case AP_BTARD_FAULT_BAD_REVEAL:
        return "bad_reveal";
    case AP_BTARD_FAULT_EQUIVOCATION:
        return "equivocation";
    case AP_BTARD_FAULT_BAD_AGGREGATE:
        return "bad_aggregate";
    case AP_BTARD_FAULT_BAD_GRADIENT:
        return "bad_gradient";
    case AP_BTARD_FAULT_FALSE_ACCUSATION:
        return "false_accusation";
    case AP_BTARD_FAULT_STEP_EQUIVOCATION:
        return "step_equivocation";
    }
    return "unknown";
}

static void le32(uint8_t out[4], uint32_t v)
{
    for (int i = 0; i < 4; i++) out[i] = (uint8_t)(v >> (8 * i));
}

static void commit_hash(const uint8_t ctx[AP_BTARD_HASH_LEN], uint32_t attempt,
                        const ap_peer_id_t *id, const uint8_t value[AP_BTARD_HASH_LEN],
                        uint8_t out[AP_BTARD_HASH_LEN])
{
    static const char tag[] = "apiary/btard/mprng/commit";
    uint8_t a[4];
    le32(a, attempt);
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&st, ctx, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, a, 4);
    crypto_generichash_update(&st, id->b, AP_PEER_ID_LEN);
    crypto_generichash_update(&st, value, AP_BTARD_HASH_LEN);
    crypto_generichash_final(&st, out, AP_BTARD_HASH_LEN);
}

static void raw_set(raw_t *r, const uint8_t *b, size_t len)
{
    r->len = (uint16_t)len;
    memcpy(r->b, b, len);
}

static bool participant(const ap_btard_mprng_t *m, size_t i)
{
    return m->m[i].fault == AP_BTARD_FAULT_NONE;
}

ap_btard_mprng_t *ap_btard_mprng_new(const ap_btard_mprng_cfg_t *cfg)
{
    if (!cfg || !cfg->peers || cfg->n == 0 || cfg->n > AP_BTARD_MPRNG_MAX_PEERS ||
        cfg->self >= cfg->n || !cfg->sign)
        return NULL;
    for (size_t i = 0; i < cfg->n; i++)
        for (size_t j = i + 1; j < cfg->n; j++)
            if (ap_peer_id_eq(&cfg->peers[i], &cfg->peers[j])) return NULL;
    if (sodium_init() < 0) return NULL;
    ap_btard_mprng_t *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->m = calloc(cfg->n, sizeof(member_t));
    if (!m->m) {
        free(m);
        return NULL;
    }
    memcpy(m->ctx, cfg->ctx, AP_BTARD_HASH_LEN);
    m->n = cfg->n;
    m->self = cfg->self;
    m->sign = cfg->sign;
    m->sign_arg = cfg->sign_arg;
    m->state = AP_BTARD_MPRNG_NEED_VALUE;
    for (size_t i = 0; i < cfg->n; i++) m->m[i].id = cfg->peers[i];
    return m;
}

void ap_btard_mprng_free(ap_btard_mprng_t *m)
{
    if (!m) return;
    sodium_memzero(m->m, m->n * sizeof(member_t));
    free(m->m);
    free(m);
}

/* ---- outbox ------------------------------------------------------------------ */

static void outbox_push(ap_btard_mprng_t *m, const uint8_t *b, size_t len)
{
    if (m->out_count == OUTBOX_MAX) { /* drop the oldest: only the latest attempt matters */
        m->out_head = (m->out_head + 1) % OUTBOX_MAX;
        m->out_count--;
    }
    raw_set(&m->out[(m->out_head + m->out_count) % OUTBOX_MAX], b, len);
    m->out_count++;
}

bool ap_btard_mprng_outbox(ap_btard_mprng_t *m, const uint8_t **msg, size_t *len)
{
    if (!m || m->out_count == 0) return false;
    m->out_cur = m->out[m->out_head];
    m->out_head = (m->out_head + 1) % OUTBOX_MAX;
    m->out_count--;
    *msg = m->out_cur.b;
    *len = m->out_cur.len;
    return true;
}

/* ---- phases ------------------------------------------------------------------ */

static int handle(ap_btard_mprng_t *m, const ap__btard_msg_t *msg, const uint8_t *b, size_t len);

static void restart(ap_btard_mprng_t *m)
{
    m->attempt++;
    m->state = AP_BTARD_MPRNG_NEED_VALUE;
    m->out_count = 0;
    for (size_t i = 0; i < m->n; i++) {
        member_t *p = &m->m[i];
        p->have_commit = p->have_reveal = p->reveal_ok = false;
        sodium_memzero(p->value, sizeof p->value);
    }
}

static void exclude(ap_btard_mprng_t *m, size_t i, ap_btard_fault_t f)
{
    if (i == m->self || !participant(m, i)) return;
    m->m[i].fault = f;
}

static void finish(ap_btard_mprng_t *m)
{
    static const char tag[] = "apiary/btard/mprng/seed";
    uint8_t a[4];
    le32(a, m->attempt);
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&st, m->ctx, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, a, 4);
    for (size_t i = 0; i < m->n; i++) {
        if (!participant(m, i)) continue;
        le32(a, (uint32_t)i);
        crypto_generichash_update(&st, a, 4);
        crypto_generichash_update(&st, m->m[i].value, AP_BTARD_HASH_LEN);
    }
    crypto_generichash_final(&st, m->seed, AP_BTARD_HASH_LEN);
    m->state = AP_BTARD_MPRNG_DONE;
}

static void check_reveals(ap_btard_mprng_t *m)
{
    if (m->state != AP_BTARD_MPRNG_REVEALING) return;
    for (size_t i = 0; i < m->n; i++)
        if (participant(m, i) && !m->m[i].reveal_ok) return;
    finish(m);
}

static int send_msg(ap_btard_mprng_t *m, uint32_t kind, const uint8_t data[AP_BTARD_HASH_LEN],
                    raw_t *keep)
{
    ap__btard_msg_t msg = {.kind = kind, .sender = m->m[m->self].id, .attempt = m->attempt};
    memcpy(msg.ctx, m->ctx, AP_BTARD_HASH_LEN);
    memcpy(msg.data, data, AP_BTARD_HASH_LEN);
    uint8_t buf[AP_BTARD_MSG_MAX];
    size_t len = ap__btard_msg_encode(&msg, m->sign, m->sign_arg, buf, sizeof buf);
    if (!len) return AP_EINVAL;
    raw_set(keep, buf, len);
    outbox_push(m, buf, len);
    return 0;
}

static void check_commits(ap_btard_mprng_t *m)
{
    if (m->state != AP_BTARD_MPRNG_COMMITTING) return;
    for (size_t i = 0; i < m->n; i++)
        if (participant(m, i) && !m->m[i].have_commit) return;
    member_t *me = &m->m[m->self];
    if (send_msg(m, AP__BTARD_MPRNG_REVEAL, me->value, &me->reveal) != 0) return;
    me->have_reveal = me->reveal_ok = true;
    m->state = AP_BTARD_MPRNG_REVEALING;
    check_reveals(m);
}

int ap_btard_mprng_start(ap_btard_mprng_t *m, const uint8_t value[AP_BTARD_HASH_LEN])
{
    if (!m || !value) return AP_EINVAL;
    if (m->state != AP_BTARD_MPRNG_NEED_VALUE) return AP_ESTATE;
    member_t *me = &m->m[m->self];
    memcpy(me->value, value, AP_BTARD_HASH_LEN);
    commit_hash(m->ctx, m->attempt, &me->id, value, me->hash);
    int rc = send_msg(m, AP__BTARD_MPRNG_COMMIT, me->hash, &me->commit);
    if (rc) return rc;
    me->have_commit = true;
    m->state = AP_BTARD_MPRNG_COMMITTING;
    /* commitments for this attempt that arrived while the previous one ran */
    for (size_t i = 0; i < m->n && m->state == AP_BTARD_MPRNG_COMMITTING; i++) {
        member_t *p = &m->m[i];
        if (!p->have_next || p->next_attempt != m->attempt) continue;
        p->have_next = false;
        ap__btard_msg_t msg;
        if (ap__btard_msg_decode(p->next.b, p->next.len, &msg) == 0 && msg.attempt == m->attempt)
            (void)handle(m, &msg, p->next.b, p->next.len);
    }
    check_commits(m);
    return 0;
}

/* A reveal and a commitment of member i are both in: do they match? */
static void verify_reveal(ap_btard_mprng_t *m, size_t i)
{
    member_t *p = &m->m[i];
    if (!p->have_commit || !p->have_reveal || p->reveal_ok) return;
    uint8_t h[AP_BTARD_HASH_LEN];
    commit_hash(m->ctx, m->attempt, &p->id, p->value, h);
    if (sodium_memcmp(h, p->hash, AP_BTARD_HASH_LEN) == 0) {
        p->reveal_ok = true;
        check_reveals(m);
        return;
    }
    p->ev_a = p->commit;
    p->ev_b = p->reveal;
    exclude(m, i, AP_BTARD_FAULT_BAD_REVEAL);
    restart(m);
}

static int on_commit(ap_btard_mprng_t *m, size_t i, const ap__btard_msg_t *msg, const uint8_t *b,
                     size_t len)
{
    member_t *p = &m->m[i];
    if (p->have_commit) {
        if (memcmp(p->hash, msg->data, AP_BTARD_HASH_LEN) == 0) return 0;
        p->ev_a = p->commit;
        raw_set(&p->ev_b, b, len);
        exclude(m, i, AP_BTARD_FAULT_EQUIVOCATION);
        restart(m);
        return 1;
    }
    p->have_commit = true;
    memcpy(p->hash, msg->data, AP_BTARD_HASH_LEN);
    raw_set(&p->commit, b, len);
    verify_reveal(m, i);
    check_commits(m);
    return 1;
}

static int on_reveal(ap_btard_mprng_t *m, size_t i, const ap__btard_msg_t *msg, const uint8_t *b,
                     size_t len)
{
    member_t *p = &m->m[i];
    if (p->have_reveal) return 0;
    p->have_reveal = true;
    memcpy(p->value, msg->data, AP_BTARD_HASH_LEN);
    raw_set(&p->reveal, b, len);
    verify_reveal(m, i);
    return 1;
}

static int handle(ap_btard_mprng_t *m, const ap__btard_msg_t *msg, const uint8_t *b, size_t len)
{
    size_t i = m->n;
    for (size_t j = 0; j < m->n; j++)
        if (ap_peer_id_eq(&m->m[j].id, &msg->sender)) {
            i = j;
            break;
        }
    if (i == m->n) return AP_EPERM;
    if (i == m->self || !participant(m, i)) return 0;
    if (msg->attempt == m->attempt + 1 ||
        (msg->attempt == m->attempt && m->state == AP_BTARD_MPRNG_NEED_VALUE)) {
        member_t *p = &m->m[i];
        if (msg->kind != AP__BTARD_MPRNG_COMMIT) return 0;
        if (p->have_next && p->next_attempt >= msg->attempt) return 0;
        p->have_next = true; /* checked again when that attempt starts */
        p->next_attempt = msg->attempt;
        raw_set(&p->next, b, len);
        return 1;
    }
    if (msg->attempt != m->attempt || m->state == AP_BTARD_MPRNG_DONE) return 0;
    return msg->kind == AP__BTARD_MPRNG_COMMIT ? on_commit(m, i, msg, b, len)
                                               : on_reveal(m, i, msg, b, len);
}

int ap_btard_mprng_receive(ap_btard_mprng_t *m, const uint8_t *b, size_t len)
{
    if (!m || (!b && len)) return AP_EINVAL;
    ap__btard_msg_t msg;
    int rc = ap__btard_msg_decode(b, len, &msg);
    if (rc) return rc;
    if (memcmp(msg.ctx, m->ctx, AP_BTARD_HASH_LEN) != 0) return AP_EPROTO;
    return handle(m, &msg, b, len);
}

int ap_btard_mprng_deadline(ap_btard_mprng_t *m)
{
    if (!m) return AP_EINVAL;
    if (m->state != AP_BTARD_MPRNG_COMMITTING && m->state != AP_BTARD_MPRNG_REVEALING) return 0;
    bool commit_phase = m->state == AP_BTARD_MPRNG_COMMITTING;
    int n = 0;
    for (size_t i = 0; i < m->n; i++) {
        member_t *p = &m->m[i];
        if (i == m->self || !participant(m, i)) continue;
        if (commit_phase ? !p->have_commit : !p->reveal_ok) {
            exclude(m, i, commit_phase ? AP_BTARD_FAULT_NO_COMMIT : AP_BTARD_FAULT_NO_REVEAL);
            n++;
        }
    }
    if (n) restart(m);
    return n;
}

ap_btard_mprng_state_t ap_btard_mprng_state(const ap_btard_mprng_t *m)
{
    return m->state;
}

uint32_t ap_btard_mprng_attempt(const ap_btard_mprng_t *m)
{
    return m->attempt;
}

int ap_btard_mprng_seed(const ap_btard_mprng_t *m, uint8_t seed[AP_BTARD_HASH_LEN])
{
    if (!m || m->state != AP_BTARD_MPRNG_DONE) return AP_ESTATE;
    memcpy(seed, m->seed, AP_BTARD_HASH_LEN);
    return 0;
}

ap_btard_fault_t ap_btard_mprng_fault(const ap_btard_mprng_t *m, size_t i)
{
    return (m && i < m->n) ? m->m[i].fault : AP_BTARD_FAULT_NONE;
}

int ap_btard_mprng_evidence(const ap_btard_mprng_t *m, size_t i, const uint8_t **a, size_t *alen,
                            const uint8_t **b, size_t *blen)
{
    if (!m || i >= m->n) return AP_EINVAL;
    const member_t *p = &m->m[i];
    if (p->fault != AP_BTARD_FAULT_BAD_REVEAL && p->fault != AP_BTARD_FAULT_EQUIVOCATION)
        return AP_ENOTFOUND;
    *a = p->ev_a.b;
    *alen = p->ev_a.len;
    *b = p->ev_b.b;
    *blen = p->ev_b.len;
    return 0;
}

int ap_btard_mprng_check_evidence(const uint8_t ctx[AP_BTARD_HASH_LEN], const ap_peer_id_t *accused,
                                  const uint8_t *a, size_t alen, const uint8_t *b, size_t blen,
                                  ap_btard_fault_t *fault)
{
    if (!ctx || !accused || !fault) return AP_EINVAL;
    ap__btard_msg_t x, y;
    int rc = ap__btard_msg_decode(a, alen, &x);
    if (rc == 0) rc = ap__btard_msg_decode(b, blen, &y);
    if (rc) return rc;
    if (!ap_peer_id_eq(&x.sender, accused) || !ap_peer_id_eq(&y.sender, accused) ||
        memcmp(x.ctx, ctx, AP_BTARD_HASH_LEN) || memcmp(y.ctx, ctx, AP_BTARD_HASH_LEN) ||
        x.attempt != y.attempt)
        return AP_EINVAL;
    if (x.kind == AP__BTARD_MPRNG_COMMIT && y.kind == AP__BTARD_MPRNG_COMMIT) {
        if (memcmp(x.data, y.data, AP_BTARD_HASH_LEN) == 0) return AP_EINVAL;
        *fault = AP_BTARD_FAULT_EQUIVOCATION;
        return 0;
    }
    const ap__btard_msg_t *c = x.kind == AP__BTARD_MPRNG_COMMIT ? &x : &y;
    const ap__btard_msg_t *r = x.kind == AP__BTARD_MPRNG_REVEAL ? &x : &y;
    if (c->kind != AP__BTARD_MPRNG_COMMIT || r->kind != AP__BTARD_MPRNG_REVEAL) return AP_EINVAL;
    uint8_t h[AP_BTARD_HASH_LEN];
    commit_hash(ctx, c->attempt, accused, r->data, h);
    if (memcmp(h, c->data, AP_BTARD_HASH_LEN) == 0) return AP_EINVAL;
    *fault = AP_BTARD_FAULT_BAD_REVEAL;
    return 0;
}
