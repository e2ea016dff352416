/* A SWARM stage server on a runtime: decodes stage calls, queues them, runs
 * them one at a time on its stage model off the loop thread (ap_rt_work),
 * answers; measures its own throughput and announces it in the DHT. Sans-I/O:
 * runtime.h only. */
#include "apiary/log.h"
#include "apiary/swarm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD          "swarm"
#define THR_EMA      0.05 /* slow: the announced figure feeds the rebalancing plan */
#define TTL_PERIODS  3
#define ANNOUNCE_MIN 100000 /* us */
#define STORES_MAX   4      /* announcement stores in flight at once */

typedef struct job job_t;
struct job {
    job_t *next;
    ap_swarm_server_t *s;
    ap_rpc_req_t *req;
    ap_swarm_req_t q;
    ap_swarm_resp_t r;
    uint8_t *out;
    size_t olen;
    int rc;
    const char *why;
    bool calib; /* a synthetic backward measuring the stage's compute: no caller */
    uint64_t arrived_us;
};

struct ap_swarm_server {
    ap_rt_t *rt;
    ap_nn_model_t *m;
    uint32_t stage;
    bool last; /* the model has the head: trainers send it backwards only */
    size_t nparams;
    ap_codec_cfg_t codec;
    ap_swarm_server_stats_t st;
    job_t *head, *tail; /* waiting */
    uint32_t queued;
    job_t *running;
    uint64_t started_us;
    bool paused, dying;
    bool leaving; /* a move is under way: announce no throughput */
    double thr;   /* measured tokens/s, 0 = not yet */
    double est;   /* estimate until measured: given, or from a synthetic call (0 = none) */
    ap_swarm_backward_fn on_bwd;
    void *bwd_arg;
    /* announcements */
    ap_dht_t *dht;
    char run[AP_SWARM_RUN_MAX + 1];
    uint64_t period_us, ttl_us, timer_id, version;
    uint32_t storing; /* stores in flight */
    bool store_again; /* one was due while STORES_MAX were in flight */
};

static ap_log_limit_t refuse_lim;

static void refuse(ap_swarm_server_t *s, ap_rpc_req_t *req, int rc, const char *why)
{
    char who[AP_PEER_SHORT_LEN];
    ap_peer_id_short(ap_rpc_req_peer(req), who);
    ap_log_limited(&refuse_lim, AP_LOG_WARN, MOD, "stage %u: refused a call from %s: %s (%s)",
                   s->stage, who, why ? why : "invalid", ap_err_name(rc));
    s->st.refused++;
    ap_rpc_respond_error(req, rc, why ? why : "invalid");
}

static void job_free(job_t *j)
{
    ap_swarm_req_clear(&j->q);
    ap_swarm_resp_clear(&j->r);
    free(j->out);
    free(j);
}

/* A job that will not run: its caller (if any) gets rc with why. */
static void job_drop(job_t *j, int rc, const char *why)
{
    if (j->req) ap_rpc_respond_error(j->req, rc, why);
    job_free(j);
}

/* The synthetic call's compute leaves the stage's gradients as they were:
 * they may hold a served backward's contribution not yet stepped. */
static void calib_run(job_t *j)
{
    ap_nn_params_t *p = ap_nn_model_params(j->s->m);
    float *keep = malloc((p->count ? p->count : 1) * sizeof *keep);
    if (!keep) {
        j->rc = AP_ENOMEM;
        return;
    }
    memcpy(keep, p->grad, p->count * sizeof *keep);
    j->rc = ap_swarm_stage_run(j->s->m, j->s->stage, &j->q, &j->r, &j->why);
    memcpy(p->grad, keep, p->count * sizeof *keep);
    free(keep);
}

/* Worker thread: the stage compute and the answer's encoding. Touches only
 * the job and the model, which nothing else touches while it runs. */
static void work(void *arg)
{
    job_t *j = arg;
    ap_swarm_server_t *s = j->s;
    if (j->calib) {
        calib_run(j);
        return;
    }
    j->rc = ap_swarm_stage_run(s->m, s->stage, &j->q, &j->r, &j->why);
    if (j->rc) return;
    j->rc = ap_swarm_resp_encode(&j->r, &s->codec, &j->out, &j->olen);
    if (j->rc) j->why = "cannot encode the answer";
}

static void pump(ap_swarm_server_t *s);
static void server_destroy(ap_swarm_server_t *s);
static void announce_now(ap_swarm_server_t *s);

/* Tokens of micro-batches per second that a call of `tokens` computed in
 * el_us stands for: a micro-batch costs a stage a forward and a backward
 * (about three forwards), the last stage only the backward (trainers skip
 * its forward). */
static double units_per_s(const ap_swarm_server_t *s, ap_swarm_op_t op, double tokens,
                          uint64_t el_us)
{
    const double units = s->last ? tokens : op == AP_SWARM_BACKWARD ? tokens * 0.75 : tokens * 0.25;
    return units * 1e6 / (double)(el_us ? el_us : 1);
}

static void after(ap_rt_t *rt, void *arg, int status)
{
    job_t *j = arg;
    ap_swarm_server_t *s = j->s;
    s->running = NULL;
    const uint64_t now = ap_rt_now_us(rt);
    const uint64_t el = now > s->started_us ? now - s->started_us : 1;
    if (j->calib) {
        if (status == 0 && j->rc == 0) {
            s->est = units_per_s(s, j->q.op, (double)j->q.B * j->q.T, el);
            if (!(s->thr > 0) && !s->dying) announce_now(s); /* the estimate, at once */
        } else {
            ap_debug(MOD, "stage %u: the synthetic call failed: %s", s->stage,
                     j->why ? j->why : ap_err_name(status ? status : j->rc));
        }
        job_free(j);
    } else if (status == 0 && j->rc == 0) {
        const double v = units_per_s(s, j->q.op, (double)j->q.B * j->q.T, el);
        const bool first = !(s->thr > 0);
        s->thr = first ? v : (1 - THR_EMA) * s->thr + THR_EMA * v;
        /* the first measurement replaces the estimate (or nothing) in the
         * record at once */
        if (first && !s->dying) announce_now(s);
        if (j->q.op == AP_SWARM_FORWARD) {
            s->st.forwards++;
        } else {
            s->st.backwards++;
            s->st.samples += (uint64_t)j->q.B;
        }
        ap_rpc_respond(j->req, j->out, j->olen);
        const bool bwd = j->q.op == AP_SWARM_BACKWARD;
        const uint64_t samples = j->q.B;
        job_free(j);
        if (bwd && s->on_bwd && !s->dying) s->on_bwd(s, s->bwd_arg, samples);
    } else if (status) {
        job_drop(j, status, "server shutting down");
    } else {
        refuse(s, j->req, j->rc, j->why);
        job_free(j);
    }
    if (s->dying) {
        server_destroy(s);
        return;
    }
    pump(s);
}

static void pump(ap_swarm_server_t *s)
{
    while (!s->running && !s->paused && s->head) {
        job_t *j = s->head;
        s->head = j->next;
        if (!s->head) s->tail = NULL;
        s->queued--;
        /* Its caller has given up (its timer started before the call was
         * sent, so it has run out by now): computing it would only delay
         * the calls behind it, at the moment this server is the busiest. */
        if (j->q.budget_us && ap_rt_now_us(s->rt) - j->arrived_us >= j->q.budget_us) {
            s->st.expired++;
            job_drop(j, AP_ETIMEDOUT, "waited longer than the caller's deadline");
            continue;
        }
        const double tokens = (double)j->q.B * j->q.T;
        const double cost =
            2.0 * tokens * (double)s->nparams * (j->q.op == AP_SWARM_BACKWARD ? 3.0 : 1.0);
        s->running = j;
        s->started_us = ap_rt_now_us(s->rt);
        int rc = ap_rt_work(s->rt, cost, work, after, j);
        if (rc) {
            s->running = NULL;
            job_drop(j, rc, "cannot schedule the compute");
        }
    }
}

static void on_call(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_swarm_server_t *s = arg;
    if (s->queued >= AP_SWARM_QUEUE_MAX) {
        refuse(s, req, AP_EBUSY, "queue full");
        return;
    }
    job_t *j = calloc(1, sizeof *j);
    if (!j) {
        ap_rpc_respond_error(req, AP_ENOMEM, "out of memory");
        return;
    }
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    const char *why = NULL;
    int rc = ap_swarm_req_decode(data, len, &j->q, &why);
    if (!rc && j->q.stage != s->stage) rc = AP_EINVAL, why = "wrong stage";
    if (rc) {
        ap_swarm_req_clear(&j->q); /* a decoded request for another stage */
        free(j);
        refuse(s, req, rc, why);
        return;
    }
    j->s = s;
    j->req = req;
    j->arrived_us = ap_rt_now_us(rt);
    if (s->tail)
        s->tail->next = j;
    else
        s->head = j;
    s->tail = j;
    s->queued++;
    pump(s);
}

/* Queues, first, a synthetic backward of the largest micro-batch the stage
 * takes (zero inputs; the gradients it computes are discarded): its compute
 * time gives an estimate of the server's throughput in this stage before any
 * trainer has called it. */
static void calibrate(ap_swarm_server_t *s)
{
    ap_nn_gpt_config_t c;
    if (ap_nn_model_gpt_config(s->m, &c) || c.max_batch < 1 || c.ctx < 1 || c.n_embd < 1) return;
    job_t *j = calloc(1, sizeof *j);
    if (!j) return;
    const size_t N = (size_t)c.max_batch * (size_t)c.ctx, NC = N * (size_t)c.n_embd;
    j->s = s;
    j->calib = true;
    j->q = (ap_swarm_req_t){.op = AP_SWARM_BACKWARD,
                            .stage = s->stage,
                            .B = (uint32_t)c.max_batch,
                            .T = (uint32_t)c.ctx,
                            .C = (uint32_t)c.n_embd};
    const bool in = c.embed ? (j->q.tokens = calloc(N, sizeof *j->q.tokens)) != NULL
                            : (j->q.in = calloc(NC, sizeof *j->q.in)) != NULL;
    const bool out = c.head ? (j->q.targets = calloc(N, sizeof *j->q.targets)) != NULL
                            : (j->q.dout = calloc(NC, sizeof *j->q.dout)) != NULL;
    if (!in || !out) {
        job_free(j);
        return;
    }
    j->next = s->head; /* before the calls waiting */
    s->head = j;
    if (!s->tail) s->tail = j;
    s->queued++;
    pump(s);
}

int ap_swarm_server_new(ap_rt_t *rt, ap_nn_model_t *m, uint32_t stage, const ap_codec_cfg_t *codec,
                        ap_swarm_server_t **out)
{
    if (!rt || !m || !out) return AP_EINVAL;
    ap_nn_gpt_config_t c;
    if (ap_nn_model_gpt_config(m, &c)) return AP_EINVAL;
    ap_swarm_server_t *s = calloc(1, sizeof *s);
    if (!s) return AP_ENOMEM;
    s->rt = rt;
    s->m = m;
    s->stage = stage;
    s->last = c.head;
    s->nparams = ap_nn_model_params(m)->count;
    if (codec)
        s->codec = *codec;
    else
        s->codec.id = AP_CODEC_BLOCKWISE8;
    int rc = ap_rt_rpc_register(rt, AP_SWARM_PROTO_STAGE, AP_SWARM_MSG_MAX, on_call, s);
    if (rc) {
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

static void server_destroy(ap_swarm_server_t *s)
{
    if (s->storing || s->running) return; /* the store's or the compute's completion frees */
    free(s);
}

void ap_swarm_server_free(ap_swarm_server_t *s)
{
    if (!s) return;
    ap_rt_rpc_unregister(s->rt, AP_SWARM_PROTO_STAGE);
    if (s->timer_id) ap_rt_timer_stop(s->rt, s->timer_id);
    s->timer_id = 0;
    while (s->head) {
        job_t *j = s->head;
        s->head = j->next;
        job_drop(j, AP_ESHUTDOWN, "server shutting down");
    }
    s->tail = NULL;
    s->queued = 0;
    s->dying = true;
    s->dht = NULL;
    if (s->running) return; /* after() frees */
    server_destroy(s);
}

void ap_swarm_server_stats(const ap_swarm_server_t *s, ap_swarm_server_stats_t *out)
{
    if (!s || !out) return;
    *out = s->st;
    out->queue = s->queued + (s->running ? 1 : 0);
    out->throughput = s->thr;
}

double ap_swarm_server_throughput(const ap_swarm_server_t *s)
{
    if (!s || s->leaving) return 0;
    return s->thr > 0 ? s->thr : s->est;
}

bool ap_swarm_server_estimated(const ap_swarm_server_t *s)
{
    return s && !s->leaving && !(s->thr > 0) && s->est > 0;
}

uint32_t ap_swarm_server_stage(const ap_swarm_server_t *s)
{
    return s ? s->stage : 0;
}

void ap_swarm_server_pause(ap_swarm_server_t *s, bool paused)
{
    if (!s) return;
    s->paused = paused;
    if (!paused) pump(s);
}

bool ap_swarm_server_idle(const ap_swarm_server_t *s)
{
    return s && !s->running;
}

void ap_swarm_server_on_backward(ap_swarm_server_t *s, ap_swarm_backward_fn fn, void *arg)
{
    if (!s) return;
    s->on_bwd = fn;
    s->bwd_arg = arg;
}

void ap_swarm_server_set_version(ap_swarm_server_t *s, uint64_t version)
{
    if (s) s->version = version;
}

int ap_swarm_server_set_stage(ap_swarm_server_t *s, ap_nn_model_t *m, uint32_t stage)
{
    if (!s || !m) return AP_EINVAL;
    if (s->running) return AP_EBUSY;
    ap_nn_gpt_config_t c;
    if (ap_nn_model_gpt_config(m, &c)) return AP_EINVAL;
    while (s->head) { /* calls for the old stage (and a synthetic one) */
        job_t *j = s->head;
        s->head = j->next;
        job_drop(j, AP_EINVAL, "wrong stage");
    }
    s->tail = NULL;
    s->queued = 0;
    s->m = m;
    s->stage = stage;
    s->last = c.head;
    s->nparams = ap_nn_model_params(m)->count;
    s->thr = 0; /* another stage: measure again */
    s->est = 0;
    s->leaving = false;
    if (s->dht) announce_now(s); /* 0 until the synthetic call measures this stage */
    calibrate(s);
    return 0;
}

static void on_stored(ap_dht_t *dht, void *arg, int status, int nstored)
{
    (void)dht;
    (void)nstored;
    ap_swarm_server_t *s = arg;
    s->storing--;
    if (s->dying) {
        server_destroy(s);
        return;
    }
    s->st.announces++;
    if (status) {
        s->st.announce_failures++;
        ap_info(MOD, "stage %u: announcement not stored: %s", s->stage, ap_err_name(status));
    }
    if (s->store_again) {
        s->store_again = false;
        announce_now(s);
    }
}

/* Stores the record now, even while earlier stores are still in flight (a
 * slow DHT): skipping a refresh because the last one has not finished would
 * let the record lapse while the server is alive. The DHT keeps the record
 * expiring last, so stores completing out of order do no harm. Beyond
 * STORES_MAX in flight, the store starts as soon as one of them ends. */
static void announce_now(ap_swarm_server_t *s)
{
    if (!s->dht) return;
    if (s->storing >= STORES_MAX) {
        s->store_again = true;
        return;
    }
    char key[AP_SWARM_KEY_MAX];
    int klen = ap_swarm_stage_key(s->run, s->stage, key);
    if (klen < 0) return;
    char idtxt[AP_PEER_ID_STR_MAX], sub[AP_PEER_ID_STR_MAX + 16];
    ap_peer_id_str(ap_rt_self(s->rt), idtxt);
    int slen = snprintf(sub, sizeof sub, "[owner:%s]", idtxt);
    ap_swarm_announce_t a = {.throughput = ap_swarm_server_throughput(s),
                             .estimate = ap_swarm_server_estimated(s),
                             .queue = s->queued + (s->running ? 1 : 0),
                             .version = s->version,
                             .period_ms = (uint32_t)(s->period_us / 1000),
                             .ttl_ms = (uint32_t)(s->ttl_us / 1000)};
    uint8_t val[AP_SWARM_ANNOUNCE_LEN];
    ap_swarm_announce_encode(&a, val);
    const int64_t ttl_ms = (int64_t)(s->ttl_us / 1000);
    ap_dht_record_t r = {.key = (const uint8_t *)key,
                         .key_len = (size_t)klen,
                         .subkey = (const uint8_t *)sub,
                         .subkey_len = (size_t)slen,
                         .value = val,
                         .value_len = sizeof val,
                         .expiration_ms = ap_rt_wall_ms(s->rt) + ttl_ms};
    s->storing++;
    if (ap_dht_store(s->dht, &r, on_stored, s) != 0) {
        s->storing--;
        s->st.announce_failures++;
    }
}

void ap_swarm_server_leave(ap_swarm_server_t *s, bool leaving)
{
    if (!s || s->leaving == leaving) return;
    s->leaving = leaving;
    if (s->dht) announce_now(s);
}

int ap_swarm_server_announce_ttl(ap_swarm_server_t *s, uint64_t ttl_us)
{
    if (!s || ttl_us > AP_SWARM_RECORD_TTL_MAX_US) return AP_EINVAL;
    if (s->dht) {
        if (!ttl_us) ttl_us = s->period_us * TTL_PERIODS;
        if (ttl_us < s->period_us * TTL_PERIODS) return AP_EINVAL;
    }
    s->ttl_us = ttl_us;
    return 0;
}

uint64_t ap_swarm_server_record_ttl(const ap_swarm_server_t *s)
{
    return s ? s->ttl_us : 0;
}

static void on_announce_timer(ap_rt_t *rt, void *arg)
{
    (void)rt;
    announce_now(arg);
}

int ap_swarm_server_announce(ap_swarm_server_t *s, ap_dht_t *dht, const char *run,
                             uint64_t period_us, double initial_throughput)
{
    if (!s || !dht || !run || period_us < ANNOUNCE_MIN || period_us > AP_SWARM_RECORD_TTL_MAX_US)
        return AP_EINVAL;
    char key[AP_SWARM_KEY_MAX];
    if (ap_swarm_stage_key(run, 0, key) < 0) return AP_EINVAL;
    if (s->dht) return AP_EEXIST;
    if (s->ttl_us && s->ttl_us < period_us * TTL_PERIODS) return AP_EINVAL;
    memcpy(s->run, run, strlen(run) + 1);
    s->dht = dht;
    s->period_us = period_us;
    if (!s->ttl_us) s->ttl_us = period_us * TTL_PERIODS;
    if (initial_throughput > 0 && !(s->thr > 0)) s->est = initial_throughput;
    s->timer_id = ap_rt_timer_start(s->rt, period_us, period_us, on_announce_timer, s);
    if (!s->timer_id) {
        s->dht = NULL;
        return AP_ENOMEM;
    }
    announce_now(s);
    if (!(s->thr > 0) && !(s->est > 0)) calibrate(s);
    return 0;
}
