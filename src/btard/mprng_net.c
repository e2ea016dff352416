/* MPRNG rounds over the runtime: broadcast by unary RPC, relay of new
 * messages, a deadline per phase, messages of rounds not started yet kept
 * in a bounded queue (see apiary/btard.h). */
#include "apiary/btard.h"
#include "apiary/log.h"
#include "btard/wire.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_PHASE_US 5000000u

typedef struct pend {
    struct pend *next;
    ap_peer_id_t from;
    uint8_t ctx[AP_BTARD_HASH_LEN];
    uint16_t len;
    uint8_t b[AP_BTARD_MSG_MAX];
} pend_t;

struct ap_btard_round {
    ap_btard_svc_t *svc;
    ap_btard_round_t *next;
    ap_btard_round_cfg_t cfg;
    ap_peer_id_t *peers;
    size_t self;
    ap_btard_mprng_t *m;
    uint64_t timer;
    int attempts;
    ap_btard_mprng_state_t phase;
    bool finished;
    int status;
};

struct ap_btard_svc {
    ap_rt_t *rt;
    ap_btard_round_t *rounds;
    pend_t *pend;
    size_t npend;
};

static void sign_cb(void *arg, const uint8_t *msg, size_t len, uint8_t sig[AP_ED25519_SIG_LEN])
{
    ap_rt_sign(arg, msg, len, sig);
}

static void call_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    (void)rt, (void)arg, (void)status, (void)resp, (void)len, (void)errmsg;
}

/* Sends b to every member but this node and skip (NULL: none). */
static void send_all(ap_btard_round_t *r, const uint8_t *b, size_t len, const ap_peer_id_t *skip)
{
    ap_rpc_opts_t o = {.timeout_us = r->cfg.phase_timeout_us, .max_resp = 16};
    for (size_t i = 0; i < r->cfg.n; i++) {
        if (i == r->self || (skip && ap_peer_id_eq(skip, &r->peers[i]))) continue;
        (void)ap_rt_rpc_call(r->svc->rt, &r->peers[i], AP_BTARD_MPRNG_PROTO, b, len, &o, call_done,
                             NULL);
    }
}

static void round_unlink(ap_btard_round_t *r)
{
    for (ap_btard_round_t **pp = &r->svc->rounds; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            return;
        }
}

static void round_free(ap_btard_round_t *r)
{
    ap_btard_mprng_free(r->m);
    free(r->peers);
    free(r);
}

static void deliver_done(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_btard_round_t *r = arg;
    uint8_t seed[AP_BTARD_HASH_LEN] = {0};
    bool ok = r->status == 0 && ap_btard_mprng_seed(r->m, seed) == 0;
    round_unlink(r);
    r->cfg.done(r->cfg.arg, ok ? 0 : r->status, ok ? seed : NULL, r->m);
    round_free(r);
}

static void finish(ap_btard_round_t *r, int status)
{
    if (r->finished) return;
    r->finished = true;
    r->status = status;
    ap_rt_timer_stop(r->svc->rt, r->timer);
    /* done runs from a fresh callback, never inside the caller's call */
    r->timer = ap_rt_timer_start(r->svc->rt, 0, 0, deliver_done, r);
    if (!r->timer) deliver_done(r->svc->rt, r);
}

static void on_deadline(ap_rt_t *rt, void *arg);

static void arm(ap_btard_round_t *r)
{
    ap_rt_timer_stop(r->svc->rt, r->timer);
    r->timer = ap_rt_timer_start(r->svc->rt, r->cfg.phase_timeout_us, 0, on_deadline, r);
}

/* This node's value for the current attempt: BLAKE2b-256 of its signature
 * on "apiary/btard/mprng/value" || ctx || le32(attempt), and 32 bytes of the
 * runtime's RNG. The signature makes the value unpredictable to anyone
 * without the node's key even when the RNG (not a cryptographic one) is. */
static void fresh_value(ap_btard_round_t *r, uint8_t v[AP_BTARD_HASH_LEN])
{
    static const char tag[] = "apiary/btard/mprng/value";
    uint8_t in[sizeof tag - 1 + AP_BTARD_HASH_LEN + 4], sig[AP_ED25519_SIG_LEN], rnd[32];
    uint32_t a = ap_btard_mprng_attempt(r->m);
    memcpy(in, tag, sizeof tag - 1);
    memcpy(in + sizeof tag - 1, r->cfg.ctx, AP_BTARD_HASH_LEN);
    for (int i = 0; i < 4; i++)
        in[sizeof tag - 1 + AP_BTARD_HASH_LEN + i] = (uint8_t)(a >> (8 * i));
    ap_rt_sign(r->svc->rt, in, sizeof in, sig);
    ap_rt_rand_bytes(r->svc->rt, rnd, sizeof rnd);
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, AP_BTARD_HASH_LEN);
    crypto_generichash_update(&st, sig, sizeof sig);
    crypto_generichash_update(&st, rnd, sizeof rnd);
    crypto_generichash_final(&st, v, AP_BTARD_HASH_LEN);
    sodium_memzero(sig, sizeof sig);
}

/* Starts attempts as needed, sends the outbox, re-arms the phase deadline. */
static void pump(ap_btard_round_t *r)
{
    for (;;) {
        if (r->finished) return;
        ap_btard_mprng_state_t st = ap_btard_mprng_state(r->m);
        if (st == AP_BTARD_MPRNG_NEED_VALUE) {
            if (r->attempts >= r->cfg.max_attempts) {
                finish(r, AP_ETIMEDOUT);
                return;
            }
            uint8_t v[AP_BTARD_HASH_LEN];
            fresh_value(r, v);
            r->attempts++;
            if (ap_btard_mprng_start(r->m, v) != 0) {
                finish(r, AP_ESTATE);
                return;
            }
            continue;
        }
        const uint8_t *b;
        size_t len;
        while (ap_btard_mprng_outbox(r->m, &b, &len)) {
            ap__btard_msg_t msg;
            if (ap__btard_msg_decode(b, len, &msg) != 0) continue;
            if (msg.kind == AP__BTARD_MPRNG_REVEAL &&
                r->cfg.attack == AP_BTARD_MPRNG_WITHHOLD_REVEAL)
                continue;
            send_all(r, b, len, NULL);
        }
        st = ap_btard_mprng_state(r->m);
        if (st == AP_BTARD_MPRNG_DONE) {
            finish(r, 0);
            return;
        }
        if (st == AP_BTARD_MPRNG_NEED_VALUE) continue;
        if (st != r->phase) {
            r->phase = st;
            arm(r);
        }
        return;
    }
}

static void on_deadline(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_btard_round_t *r = arg;
    r->timer = 0;
    if (r->finished) return;
    int n = ap_btard_mprng_deadline(r->m);
    if (n > 0) {
        char s[AP_PEER_SHORT_LEN];
        for (size_t i = 0; i < r->cfg.n; i++) {
            ap_btard_fault_t f = ap_btard_mprng_fault(r->m, i);
            if (f == AP_BTARD_FAULT_NO_COMMIT || f == AP_BTARD_FAULT_NO_REVEAL)
                ap_log(AP_LOG_INFO, "btard", "mprng: peer %s excluded (%s)",
                       ap_peer_id_short(&r->peers[i], s), ap_btard_fault_name(f));
        }
    }
    r->phase = 0;
    pump(r);
    if (!r->finished && r->phase == ap_btard_mprng_state(r->m) && !r->timer) arm(r);
}

static void feed(ap_btard_round_t *r, const ap_peer_id_t *from, const uint8_t *b, size_t len)
{
    if (r->finished) return;
    int rc = ap_btard_mprng_receive(r->m, b, len);
    if (rc < 0) {
        char s[AP_PEER_SHORT_LEN];
        ap_log(AP_LOG_WARN, "btard", "mprng: message from %s refused: %s",
               ap_peer_id_short(from, s), ap_err_name(rc));
        return;
    }
    if (rc == 1) send_all(r, b, len, from);
    pump(r);
}

static ap_btard_round_t *find_round(ap_btard_svc_t *svc, const uint8_t ctx[AP_BTARD_HASH_LEN])
{
    for (ap_btard_round_t *r = svc->rounds; r; r = r->next)
        if (!memcmp(r->cfg.ctx, ctx, AP_BTARD_HASH_LEN)) return r;
    return NULL;
}

static void pend_add(ap_btard_svc_t *svc, const ap_peer_id_t *from, const ap__btard_msg_t *msg,
                     const uint8_t *b, size_t len)
{
    size_t mine = 0;
    for (pend_t *p = svc->pend; p; p = p->next) mine += ap_peer_id_eq(&p->from, from);
    if (mine >= AP_BTARD_PENDING_PER_PEER) return;
    if (svc->npend >= AP_BTARD_PENDING_MAX) { /* drop the oldest */
        pend_t *old = svc->pend;
        svc->pend = old->next;
        free(old);
        svc->npend--;
    }
    pend_t *p = malloc(sizeof *p);
    if (!p) return;
    p->next = NULL;
    p->from = *from;
    memcpy(p->ctx, msg->ctx, AP_BTARD_HASH_LEN);
    p->len = (uint16_t)len;
    memcpy(p->b, b, len);
    pend_t **pp = &svc->pend;
    while (*pp) pp = &(*pp)->next;
    *pp = p;
    svc->npend++;
}

static void on_rpc(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    ap_btard_svc_t *svc = arg;
    size_t len;
    const uint8_t *b = ap_rpc_req_data(req, &len);
    ap_peer_id_t from = *ap_rpc_req_peer(req);
    ap__btard_msg_t msg;
    int rc = ap__btard_msg_decode(b, len, &msg);
    if (rc) {
        char s[AP_PEER_SHORT_LEN];
        ap_log(AP_LOG_WARN, "btard", "mprng: bad message from %s: %s", ap_peer_id_short(&from, s),
               ap_err_name(rc));
        ap_rpc_respond_error(req, rc, "bad message");
        return;
    }
    ap_btard_round_t *r = find_round(svc, msg.ctx);
    if (r)
        feed(r, &from, b, len);
    else
        pend_add(svc, &from, &msg, b, len);
    ap_rpc_respond(req, NULL, 0);
}

int ap_btard_svc_new(ap_rt_t *rt, ap_btard_svc_t **out)
{
    if (!rt || !out) return AP_EINVAL;
    ap_btard_svc_t *svc = calloc(1, sizeof *svc);
    if (!svc) return AP_ENOMEM;
    svc->rt = rt;
    int rc = ap_rt_rpc_register(rt, AP_BTARD_MPRNG_PROTO, AP_BTARD_MSG_MAX, on_rpc, svc);
    if (rc) {
        free(svc);
        return rc;
    }
    *out = svc;
    return 0;
}

void ap_btard_svc_free(ap_btard_svc_t *svc)
{
    if (!svc) return;
    ap_rt_rpc_unregister(svc->rt, AP_BTARD_MPRNG_PROTO);
    while (svc->rounds) {
        ap_btard_round_t *r = svc->rounds;
        svc->rounds = r->next;
        ap_rt_timer_stop(svc->rt, r->timer);
        uint8_t seed[AP_BTARD_HASH_LEN];
        bool ok = r->finished && r->status == 0 && ap_btard_mprng_seed(r->m, seed) == 0;
        r->cfg.done(r->cfg.arg,
                    ok            ? 0
                    : r->finished ? r->status
                                  : AP_ECANCELED,
                    ok ? seed : NULL, r->m);
        round_free(r);
    }
    while (svc->pend) {
        pend_t *p = svc->pend;
        svc->pend = p->next;
        free(p);
    }
    free(svc);
}

int ap_btard_round_start(ap_btard_svc_t *svc, const ap_btard_round_cfg_t *cfg)
{
    if (!svc || !cfg || !cfg->peers || !cfg->done || cfg->n == 0 ||
        cfg->n > AP_BTARD_MPRNG_MAX_PEERS || cfg->max_attempts < 0)
        return AP_EINVAL;
    if (find_round(svc, cfg->ctx)) return AP_EEXIST;
    const ap_peer_id_t *me = ap_rt_self(svc->rt);
    size_t self = cfg->n;
    for (size_t i = 0; i < cfg->n; i++)
        if (ap_peer_id_eq(&cfg->peers[i], me)) self = i;
    if (self == cfg->n) return AP_EINVAL;
    ap_btard_round_t *r = calloc(1, sizeof *r);
    if (!r) return AP_ENOMEM;
    r->svc = svc;
    r->cfg = *cfg;
    if (!r->cfg.phase_timeout_us) r->cfg.phase_timeout_us = DEFAULT_PHASE_US;
    if (!r->cfg.max_attempts) r->cfg.max_attempts = (int)cfg->n;
    r->self = self;
    r->peers = malloc(cfg->n * sizeof(ap_peer_id_t));
    if (!r->peers) {
        free(r);
        return AP_ENOMEM;
    }
    memcpy(r->peers, cfg->peers, cfg->n * sizeof(ap_peer_id_t));
    r->cfg.peers = r->peers;
    ap_btard_mprng_cfg_t mc = {.peers = r->peers, .n = cfg->n, .self = self, .sign = sign_cb};
    mc.sign_arg = svc->rt;
    memcpy(mc.ctx, cfg->ctx, AP_BTARD_HASH_LEN);
    r->m = ap_btard_mprng_new(&mc);
    if (!r->m) {
        free(r->peers);
        free(r);
        return AP_EINVAL;
    }
    r->next = svc->rounds;
    svc->rounds = r;
    pump(r);
    /* messages that came before this round started */
    for (pend_t **pp = &svc->pend; *pp && !r->finished;) {
        pend_t *p = *pp;
        if (memcmp(p->ctx, cfg->ctx, AP_BTARD_HASH_LEN) != 0) {
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        svc->npend--;
        feed(r, &p->from, p->b, p->len);
        free(p);
    }
    return 0;
}
