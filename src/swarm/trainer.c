/* A SWARM trainer on a runtime: drives micro-batches through the stages,
 * choosing each call's server with the stage's balancer, retrying failed or
 * garbage answers on another server. Sans-I/O: runtime.h only. */
#include "apiary/log.h"
#include "apiary/swarm.h"

#include <stdlib.h>
#include <string.h>

#define MOD          "swarm"
#define WAIT_US      200000 /* no eligible server: look again after this */
#define ATTEMPTS_DEF 16

typedef struct mb mb_t;

struct ap_swarm_trainer {
    ap_rt_t *rt;
    uint32_t S, C;
    ap_codec_cfg_t codec;
    int attempts;
    ap_swarm_balancer_t **bal;
    mb_t *head;
    uint64_t bytes;
    ap_swarm_trainer_stats_t st;
    ap_swarm_watch_t *watch;
    ap_swarm_member_t *members;
    int64_t *expires;
};

struct mb {
    ap_swarm_trainer_t *t;
    mb_t *prev, *next;
    uint32_t B, T;
    int32_t *tokens, *targets;
    float **ins; /* ins[s]: input of stage s (s >= 1) */
    float *dout;
    bool backward;
    uint32_t s;
    int attempt, last_err;
    uint64_t call_id, timer_id, sent_us, deadline_us;
    ap_peer_id_t peer;
    float loss;
    ap_swarm_batch_fn done;
    void *arg;
};

static void step(mb_t *b);

static void finish(mb_t *b, int status)
{
    ap_swarm_trainer_t *t = b->t;
    if (b->prev)
        b->prev->next = b->next;
    else
        t->head = b->next;
    if (b->next) b->next->prev = b->prev;
    if (b->timer_id) ap_rt_timer_stop(t->rt, b->timer_id);
    for (uint32_t s = 0; s < t->S; s++) free(b->ins[s]);
    free(b->ins);
    free(b->dout);
    free(b->tokens);
    free(b->targets);
    ap_swarm_batch_fn done = b->done;
    void *arg = b->arg;
    float loss = b->loss;
    if (status == 0) {
        t->st.batches++;
        t->st.samples += b->B;
    } else if (status != AP_ECANCELED) {
        t->st.failed++;
    }
    free(b);
    if (done) done(t->rt, arg, status, loss);
}

static void on_wait(ap_rt_t *rt, void *arg)
{
    (void)rt;
    mb_t *b = arg;
    b->timer_id = 0;
    step(b);
}

/* Another attempt at the current step, or the end of the micro-batch. */
static void retry(mb_t *b, int err, bool wait)
{
    b->last_err = err;
    if (++b->attempt >= b->t->attempts) {
        finish(b, err);
        return;
    }
    if (!wait) {
        step(b);
        return;
    }
    b->timer_id = ap_rt_timer_start(b->t->rt, WAIT_US, 0, on_wait, b);
    if (!b->timer_id) finish(b, AP_ENOMEM);
}

static void build(const mb_t *b, ap_swarm_req_t *q)
{
    const ap_swarm_trainer_t *t = b->t;
    memset(q, 0, sizeof *q);
    q->op = b->backward ? AP_SWARM_BACKWARD : AP_SWARM_FORWARD;
    q->stage = b->s;
    q->B = b->B;
    q->T = b->T;
    q->C = t->C;
    q->tokens = b->s == 0 ? b->tokens : NULL;
    q->in = b->s == 0 ? NULL : b->ins[b->s];
    q->targets = b->backward && b->s == t->S - 1 ? b->targets : NULL;
    q->dout = b->backward && b->s < t->S - 1 ? b->dout : NULL;
}

static void on_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    mb_t *b = arg;
    ap_swarm_trainer_t *t = b->t;
    b->call_id = 0;
    const uint64_t now = ap_rt_now_us(rt), elapsed = now - b->sent_us;
    ap_swarm_balancer_t *bal = t->bal[b->s];
    const double size = (double)b->B * b->T;
    char who[AP_PEER_SHORT_LEN];
    if (status == AP_ECANCELED) {
        finish(b, AP_ECANCELED);
        return;
    }
    if (status == AP_ETIMEDOUT) t->st.call_timeouts++;
    if (status == AP_EBUSY) {
        /* A full queue is a busy server, not a broken one: no ban; it counts
         * like a timeout (a call of at least the deadline), so its share
         * shrinks, and the step goes elsewhere (after a pause if the last
         * attempt was refused too). */
        t->st.call_timeouts++;
        ap_swarm_balancer_report(bal, &b->peer, AP_ETIMEDOUT, size,
                                 elapsed > b->deadline_us ? elapsed : b->deadline_us, now);
        const bool again = b->last_err == AP_EBUSY && b->attempt > 0;
        retry(b, AP_EBUSY, again);
        return;
    }
    if (status) {
        if (status != AP_ETIMEDOUT) t->st.call_failures++;
        ap_peer_id_short(&b->peer, who);
        ap_info(MOD, "stage %u: call to %s failed: %s%s%s", b->s, who, ap_err_name(status),
                errmsg ? ": " : "", errmsg ? errmsg : "");
        ap_swarm_balancer_report(bal, &b->peer, status, size, elapsed, now);
        retry(b, status, false);
        return;
    }
    t->bytes += len;
    ap_swarm_req_t q;
    build(b, &q);
    ap_swarm_resp_t r;
    const char *why = NULL;
    int rc = ap_swarm_resp_decode(resp, len, &r, &why);
    if (!rc) rc = ap_swarm_resp_check(&q, &r, b->s == 0, b->s == t->S - 1, &why);
    if (rc) {
        ap_swarm_resp_clear(&r);
        t->st.garbage++;
        ap_peer_id_short(&b->peer, who);
        ap_warn(MOD, "stage %u: server %s answered garbage (%s): banned", b->s, who,
                why ? why : ap_err_name(rc));
        ap_swarm_balancer_report(bal, &b->peer, AP_EPROTO, size, elapsed, now);
        retry(b, AP_EPROTO, false);
        return;
    }
    ap_swarm_balancer_report(bal, &b->peer, 0, size, elapsed, now);
    b->attempt = 0;
    if (!b->backward) {
        b->ins[b->s + 1] = r.act;
        b->s++;
        if (b->s == t->S - 1) b->backward = true;
    } else {
        if (b->s == t->S - 1) b->loss = r.loss;
        free(b->dout);
        b->dout = r.act;
        if (b->s == 0) {
            finish(b, 0);
            return;
        }
        b->s--;
    }
    step(b);
}

static void step(mb_t *b)
{
    ap_swarm_trainer_t *t = b->t;
    const uint64_t now = ap_rt_now_us(t->rt);
    uint64_t deadline = 0;
    int rc = ap_swarm_balancer_pick(t->bal[b->s], (double)b->B * b->T, now, &b->peer, &deadline);
    if (rc) {
        ap_swarm_watch_now(t->watch); /* servers may have appeared */
        retry(b, AP_EUNREACH, true);
        return;
    }
    ap_swarm_req_t q;
    build(b, &q);
    q.budget_us = deadline > UINT32_MAX ? UINT32_MAX : (uint32_t)deadline;
    uint8_t *buf;
    size_t len;
    if ((rc = ap_swarm_req_encode(&q, &t->codec, &buf, &len))) {
        finish(b, rc);
        return;
    }
    t->bytes += len;
    t->st.calls++;
    ap_rpc_opts_t o = {.timeout_us = deadline, .max_resp = AP_SWARM_MSG_MAX};
    b->sent_us = now;
    b->deadline_us = deadline;
    b->call_id = ap_rt_rpc_call(t->rt, &b->peer, AP_SWARM_PROTO_STAGE, buf, len, &o, on_done, b);
    free(buf);
    if (!b->call_id) finish(b, AP_ENOMEM);
}

int ap_swarm_trainer_new(ap_rt_t *rt, uint32_t nstages, uint32_t width, const ap_codec_cfg_t *codec,
                         int attempts, ap_swarm_trainer_t **out)
{
    if (!rt || !out || !nstages || nstages > AP_SWARM_STAGES_MAX || !width) return AP_EINVAL;
    ap_swarm_trainer_t *t = calloc(1, sizeof *t);
    if (!t) return AP_ENOMEM;
    t->rt = rt;
    t->S = nstages;
    t->C = width;
    if (codec)
        t->codec = *codec;
    else
        t->codec.id = AP_CODEC_BLOCKWISE8;
    t->attempts = attempts > 0 ? attempts : ATTEMPTS_DEF;
    t->bal = calloc(nstages, sizeof *t->bal);
    if (!t->bal) {
        free(t);
        return AP_ENOMEM;
    }
    for (uint32_t s = 0; s < nstages; s++)
        if (!(t->bal[s] = ap_swarm_balancer_new(NULL))) {
            ap_swarm_trainer_free(t);
            return AP_ENOMEM;
        }
    *out = t;
    return 0;
}

void ap_swarm_trainer_free(ap_swarm_trainer_t *t)
{
    if (!t) return;
    while (t->head) {
        mb_t *b = t->head;
        if (b->call_id && ap_rt_rpc_cancel(t->rt, b->call_id)) continue; /* on_done finished it */
        finish(b, AP_ECANCELED);
    }
    ap_swarm_watch_free(t->watch);
    free(t->members);
    free(t->expires);
    for (uint32_t s = 0; s < t->S; s++) ap_swarm_balancer_free(t->bal[s]);
    free(t->bal);
    free(t);
}

ap_swarm_balancer_t *ap_swarm_trainer_balancer(ap_swarm_trainer_t *t, uint32_t stage)
{
    return t && stage < t->S ? t->bal[stage] : NULL;
}

uint64_t ap_swarm_trainer_bytes(const ap_swarm_trainer_t *t)
{
    return t ? t->bytes : 0;
}

int ap_swarm_trainer_submit(ap_swarm_trainer_t *t, uint32_t B, uint32_t T, const int32_t *tokens,
                            const int32_t *targets, ap_swarm_batch_fn done, void *arg)
{
    if (!t || !tokens || !targets || !B || !T) return AP_EINVAL;
    if ((uint64_t)B * T > AP_SWARM_TOKENS_MAX || (uint64_t)B * T * t->C > AP_SWARM_TENSOR_MAX)
        return AP_ELIMIT;
    const size_t N = (size_t)B * T;
    mb_t *b = calloc(1, sizeof *b);
    if (!b) return AP_ENOMEM;
    b->t = t;
    b->B = B;
    b->T = T;
    b->tokens = malloc(N * sizeof *b->tokens);
    b->targets = malloc(N * sizeof *b->targets);
    b->ins = calloc(t->S, sizeof *b->ins);
    if (!b->tokens || !b->targets || !b->ins) {
        free(b->tokens);
        free(b->targets);
        free(b->ins);
        free(b);
        return AP_ENOMEM;
    }
    memcpy(b->tokens, tokens, N * sizeof *tokens);
    memcpy(b->targets, targets, N * sizeof *targets);
    b->backward = t->S == 1;
    b->done = done;
    b->arg = arg;
    b->next = t->head;
    if (t->head) t->head->prev = b;
    t->head = b;
    /* Start from a timer so done never runs inside this call. */
    b->timer_id = ap_rt_timer_start(t->rt, 0, 0, on_wait, b);
    if (!b->timer_id) {
        b->done = NULL;
        finish(b, AP_ENOMEM);
        return AP_ENOMEM;
    }
    return 0;
}

void ap_swarm_trainer_stats(const ap_swarm_trainer_t *t, ap_swarm_trainer_stats_t *out)
{
    if (!t || !out) return;
    *out = t->st;
    out->reads = ap_swarm_watch_reads(t->watch);
}

static void on_records(ap_rt_t *rt, void *arg, int status, const ap_dht_result_t *res,
                       uint32_t nstages)
{
    ap_swarm_trainer_t *t = arg;
    if (status || nstages != t->S) return;
    const int64_t wall = ap_rt_wall_ms(rt);
    const uint64_t now = ap_rt_now_us(rt);
    int n =
        ap_swarm_members_from(res, nstages, wall, t->members, t->expires, AP_SWARM_BALANCER_MAX);
    if (n < 0) {
        ap_warn(MOD, "stage records: %s", ap_err_name(n));
        return;
    }
    for (int i = 0; i < n; i++) {
        const ap_swarm_member_t *m = &t->members[i];
        const int64_t left_ms = t->expires[i] - wall;
        if (left_ms <= 0 || left_ms > 7 * 86400000ll) continue;
        for (uint32_t s = 0; s < t->S; s++)
            if (s != m->stage) ap_swarm_balancer_remove(t->bal[s], &m->peer);
        int rc = ap_swarm_balancer_update_record(t->bal[m->stage], &m->peer, m->throughput,
                                                 now + (uint64_t)left_ms * 1000,
                                                 (uint64_t)t->expires[i], now);
        if (rc) ap_info(MOD, "stage %u: server not tracked: %s", m->stage, ap_err_name(rc));
    }
}

int ap_swarm_trainer_watch(ap_swarm_trainer_t *t, ap_dht_t *dht, const char *run,
                           uint64_t period_us)
{
    if (!t || !dht || !run) return AP_EINVAL;
    if (t->watch) return AP_EEXIST;
    if (!t->members && !(t->members = calloc(AP_SWARM_BALANCER_MAX, sizeof *t->members)))
        return AP_ENOMEM;
    if (!t->expires && !(t->expires = calloc(AP_SWARM_BALANCER_MAX, sizeof *t->expires)))
        return AP_ENOMEM;
    return ap_swarm_watch_new(t->rt, dht, run, t->S, period_us, on_records, t, &t->watch);
}
