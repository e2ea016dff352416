/* A whole SWARM run on the network simulator (swarm_world.h). */
#include "swarm_world.h"

#include "apiary/dht.h"
#include "apiary/log.h"
#include "swarm_optimum.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RUN    "simswarm"
#define RUNLEN 32
#define CW     16
#define BB     2
#define TT     8
#define HEADS  2

typedef struct slot {
    ap_test_sw_t *w;
    uint32_t i;
    int node;
    ap_dht_t *dht;
    ap_nn_model_t *m;
    ap_swarm_server_t *s;
    ap_swarm_rebalancer_t *rb;
    uint32_t stage, to;
    double speed;
    bool up;
    uint32_t moves;
    uint64_t poll;
} slot_t;

typedef struct trn {
    ap_test_sw_t *w;
    int node;
    ap_dht_t *dht;
    ap_swarm_trainer_t *t;
    uint64_t next;
} trn_t;

struct ap_test_sw {
    ap_test_sw_cfg_t c;
    ap_sim_t *sim;
    ap_dht_t *boot;
    slot_t srv[AP_TEST_SW_SERVERS_MAX];
    trn_t trn[AP_TEST_SW_TRAINERS_MAX];
    uint64_t done, failed, refused;
};

static ap_nn_model_t *stage_model(uint32_t S, uint32_t s)
{
    ap_nn_gpt_config_t c = ap_nn_gpt_config_default(TT, (int)S, HEADS, CW, BB);
    c.layer_begin = (int)s;
    c.layer_end = (int)s + 1;
    c.embed = s == 0;
    c.head = s == S - 1;
    ap_nn_model_t *m = NULL;
    if (ap_nn_gpt_new(&c, &m)) return NULL;
    ap_nn_model_init(m, 11 + s);
    return m;
}

/* The node's compute speed for serving `stage` with model m: set before the
 * server computes anything there (its synthetic call included). */
static void set_speed_for(slot_t *v, uint32_t stage, ap_nn_model_t *m)
{
    /* a forward (2 x tokens x parameters) and a backward (3 times that);
     * the last stage gets only the backward (it recomputes the forward) */
    const double per = stage == v->w->c.stages - 1 ? 6.0 : 8.0;
    const double cost = per * BB * TT * (double)ap_nn_model_params(m)->count;
    ap_sim_set_flops(v->w->sim, v->node, v->speed * v->w->c.unit * cost);
}

static void set_speed(slot_t *v)
{
    set_speed_for(v, v->stage, v->m);
}

static void on_bwd(ap_swarm_server_t *s, void *arg, uint64_t samples)
{
    (void)samples;
    slot_t *v = arg;
    /* a non-finite gradient is refused (and logged), not applied */
    if (ap_swarm_sgd_step(ap_nn_model_params(v->m), v->w->c.lr, v->w->c.clip, NULL))
        v->w->refused++;
    (void)s;
}

static void slot_down(slot_t *v)
{
    ap_rt_t *rt = ap_sim_node(v->w->sim, v->node);
    if (v->poll) ap_rt_timer_stop(rt, v->poll);
    v->poll = 0;
    ap_swarm_rebalancer_free(v->rb);
    v->rb = NULL;
    ap_swarm_server_free(v->s);
    v->s = NULL;
    ap_dht_free(v->dht);
    v->dht = NULL;
    v->up = false;
}

static void on_crash(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    (void)sim;
    (void)rt;
    ap_test_sw_t *w = arg;
    if (node >= 1 && node <= (int)w->c.slots) slot_down(&w->srv[node - 1]);
}

/* The live server of `stage` with the lowest slot, other than v. */
static slot_t *source_of(ap_test_sw_t *w, const slot_t *v, uint32_t stage)
{
    for (uint32_t i = 0; i < w->c.slots; i++)
        if (&w->srv[i] != v && w->srv[i].up && w->srv[i].stage == stage && w->srv[i].s)
            return &w->srv[i];
    return NULL;
}

/* The move, once the server is idle: the new stage's parameters from one of
 * its servers, then the switch. */
static void on_poll(ap_rt_t *rt, void *arg)
{
    slot_t *v = arg;
    if (!ap_swarm_server_idle(v->s)) return;
    ap_rt_timer_stop(rt, v->poll);
    v->poll = 0;
    int rc = AP_ENOTFOUND;
    ap_nn_model_t *m = stage_model(v->w->c.stages, v->to);
    slot_t *src = source_of(v->w, v, v->to);
    if (m && src) {
        ap_nn_params_t *a = ap_nn_model_params(m), *b = ap_nn_model_params(src->m);
        if (a->count == b->count) memcpy(a->data, b->data, a->count * sizeof *a->data);
        set_speed_for(v, v->to, m);
        rc = ap_swarm_server_set_stage(v->s, m, v->to);
        if (rc) set_speed(v);
    }
    if (rc) {
        ap_nn_model_free(m);
    } else {
        ap_swarm_server_on_backward(v->s, on_bwd, v);
        ap_nn_model_free(v->m);
        v->m = m;
        v->stage = v->to;
        v->moves++;
    }
    ap_swarm_server_pause(v->s, false);
    ap_swarm_rebalancer_moved(v->rb, rc);
}

static void on_move(ap_swarm_rebalancer_t *rb, void *arg, uint32_t from, uint32_t to)
{
    (void)rb;
    (void)from;
    slot_t *v = arg;
    v->to = to;
    ap_swarm_server_pause(v->s, true);
    v->poll = ap_rt_timer_start(ap_sim_node(v->w->sim, v->node), 1000, 1000, on_poll, v);
    if (!v->poll) {
        ap_swarm_server_pause(v->s, false);
        ap_swarm_rebalancer_moved(rb, AP_ENOMEM);
    }
}

static void on_boot(ap_dht_t *dht, void *arg, int status)
{
    (void)dht;
    (void)arg;
    (void)status;
}

static const char *run_of(const ap_test_sw_t *w, uint32_t i, char buf[RUNLEN])
{
    if (!w->c.pipelines) return RUN;
    snprintf(buf, RUNLEN, "%s%u", RUN, i % w->c.pipelines);
    return buf;
}

static int join(ap_test_sw_t *w, int node, ap_dht_t **out)
{
    int rc = ap_dht_new(ap_sim_node(w->sim, node), NULL, out);
    if (rc) return rc;
    const char *boot = "/sim/0";
    return ap_dht_bootstrap(*out, &boot, 1, on_boot, w);
}

ap_test_sw_t *ap_test_sw_new(const ap_test_sw_cfg_t *cfg)
{
    if (!cfg || !cfg->stages || cfg->stages > 8 || !cfg->slots ||
        cfg->slots > AP_TEST_SW_SERVERS_MAX || !cfg->trainers ||
        cfg->trainers > AP_TEST_SW_TRAINERS_MAX || !cfg->inflight || !(cfg->unit > 0))
        return NULL;
    ap_test_sw_t *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->c = *cfg;
    if (!w->c.rebalance_us) w->c.rebalance_us = 2000000;
    if (!w->c.announce_us) w->c.announce_us = 1000000;
    if (!(w->c.lr > 0)) w->c.lr = 0.002f;
    if (w->c.clip == 0) w->c.clip = 1.0f;
    if (w->c.clip < 0) w->c.clip = 0; /* none */
    w->sim = ap_sim_new(cfg->seed);
    if (!w->sim) goto fail;
    ap_sim_link_t link = {.latency_us = 5000, .jitter_us = 1000};
    ap_sim_set_default_link(w->sim, &link);
    const int n = 1 + (int)cfg->slots + (int)cfg->trainers;
    uint64_t rng = cfg->seed * 0x9e3779b97f4a7c15ull + 1;
    for (int i = 0; i < n; i++) {
        ap_sim_node_opts_t o = {.on_crash = on_crash, .hook_arg = w};
        if (ap_sim_add_node(w->sim, &o) != i) goto fail;
    }
    if (cfg->hetero_links) {
        /* every node: one-way latency 2..20 ms to every other, and an access
         * link of 50..1000 Mbit/s */
        static const uint64_t lat[] = {2000, 5000, 10000, 20000};
        static const uint64_t bw[] = {50000000, 100000000, 300000000, 1000000000};
        uint64_t nl[AP_TEST_SW_SERVERS_MAX + AP_TEST_SW_TRAINERS_MAX + 1];
        for (int i = 0; i < n; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            nl[i] = lat[(rng >> 33) % 4];
            const uint64_t b = bw[(rng >> 40) % 4];
            ap_sim_set_node_bw(w->sim, i, b, b);
        }
        for (int a = 0; a < n; a++)
            for (int b = 0; b < n; b++) {
                if (a == b) continue;
                ap_sim_link_t l = {.latency_us = (nl[a] + nl[b]) / 2,
                                   .jitter_us = (nl[a] + nl[b]) / 10};
                ap_sim_set_link(w->sim, a, b, &l);
            }
    }
    if (ap_dht_new(ap_sim_node(w->sim, 0), NULL, &w->boot)) goto fail;
    for (uint32_t i = 0; i < cfg->slots; i++) {
        w->srv[i].w = w;
        w->srv[i].i = i;
        w->srv[i].node = 1 + (int)i;
    }
    for (uint32_t k = 0; k < cfg->trainers; k++) {
        w->trn[k].w = w;
        w->trn[k].node = 1 + (int)cfg->slots + (int)k;
    }
    return w;
fail:
    ap_test_sw_free(w);
    return NULL;
}

void ap_test_sw_free(ap_test_sw_t *w)
{
    if (!w) return;
    for (uint32_t k = 0; k < w->c.trainers; k++) {
        ap_swarm_trainer_free(w->trn[k].t);
        ap_dht_free(w->trn[k].dht);
    }
    for (uint32_t i = 0; i < w->c.slots && w->sim; i++) slot_down(&w->srv[i]);
    ap_dht_free(w->boot);
    /* a server freed while its compute runs is freed by the compute's
     * completion: let those complete before the simulator goes */
    if (w->sim) ap_sim_run_for(w->sim, 120 * 1000000ull);
    ap_sim_free(w->sim);
    for (uint32_t i = 0; i < w->c.slots; i++) ap_nn_model_free(w->srv[i].m);
    free(w);
}

int ap_test_sw_start(ap_test_sw_t *w, uint32_t i, uint32_t stage, double speed)
{
    if (!w || i >= w->c.slots || stage >= w->c.stages || !(speed > 0) || w->srv[i].up)
        return AP_EINVAL;
    slot_t *v = &w->srv[i];
    if (!ap_sim_is_up(w->sim, v->node) && ap_sim_restart(w->sim, v->node)) return AP_ESTATE;
    ap_nn_model_free(v->m);
    v->m = stage_model(w->c.stages, stage);
    if (!v->m) return AP_ENOMEM;
    v->stage = v->to = stage;
    v->speed = speed;
    v->moves = 0;
    ap_rt_t *rt = ap_sim_node(w->sim, v->node);
    const ap_codec_cfg_t raw = {.id = AP_CODEC_NONE};
    char rb[RUNLEN];
    const char *run = run_of(w, i, rb);
    set_speed(v);
    int rc = join(w, v->node, &v->dht);
    if (!rc) rc = ap_swarm_server_new(rt, v->m, stage, w->c.compressed ? NULL : &raw, &v->s);
    if (!rc) {
        ap_swarm_server_on_backward(v->s, on_bwd, v);
        if (w->c.record_ttl_us) rc = ap_swarm_server_announce_ttl(v->s, w->c.record_ttl_us);
        if (!rc) rc = ap_swarm_server_announce(v->s, v->dht, run, w->c.announce_us, 0);
    }
    if (!rc && w->c.rebalance) {
        ap_swarm_rebalance_opts_t o = {.period_us = w->c.rebalance_us};
        rc = ap_swarm_rebalancer_new(rt, v->s, v->dht, run, w->c.stages, &o, on_move, v, &v->rb);
    }
    v->up = true;
    if (rc) slot_down(v);
    return rc;
}

void ap_test_sw_crash(ap_test_sw_t *w, uint32_t i)
{
    if (!w || i >= w->c.slots || !w->srv[i].up) return;
    ap_sim_crash(w->sim, w->srv[i].node); /* on_crash takes it down */
}

static void submit(trn_t *r);

static void on_batch(ap_rt_t *rt, void *arg, int status, float loss)
{
    (void)rt;
    (void)loss;
    trn_t *r = arg;
    if (status == AP_ECANCELED) return;
    if (status)
        r->w->failed++;
    else
        r->w->done++;
    submit(r);
}

static void submit(trn_t *r)
{
    int32_t tok[BB * TT], tgt[BB * TT];
    const uint64_t i = r->next++;
    for (int b = 0; b < BB; b++)
        for (int t = 0; t < TT; t++) {
            tok[b * TT + t] = 'a' + (int)((uint64_t)(b + t) + i) % 4;
            tgt[b * TT + t] = 'a' + (int)((uint64_t)(b + t + 1) + i) % 4;
        }
    int rc = ap_swarm_trainer_submit(r->t, BB, TT, tok, tgt, on_batch, r);
    if (rc) ap_warn("swarm", "world: cannot submit: %s", ap_err_name(rc));
}

int ap_test_sw_train(ap_test_sw_t *w)
{
    for (uint32_t k = 0; k < w->c.trainers; k++) {
        trn_t *r = &w->trn[k];
        ap_rt_t *rt = ap_sim_node(w->sim, r->node);
        const ap_codec_cfg_t raw = {.id = AP_CODEC_NONE};
        int rc = join(w, r->node, &r->dht);
        if (!rc)
            rc = ap_swarm_trainer_new(rt, w->c.stages, CW, w->c.compressed ? NULL : &raw, 0, &r->t);
        char rb[RUNLEN];
        if (!rc) rc = ap_swarm_trainer_watch(r->t, r->dht, run_of(w, k, rb), 500000);
        if (rc) return rc;
        for (uint32_t j = 0; j < w->c.inflight; j++) submit(r);
    }
    return 0;
}

void ap_test_sw_run(ap_test_sw_t *w, uint64_t us)
{
    ap_sim_run_for(w->sim, us);
}

ap_sim_t *ap_test_sw_sim(ap_test_sw_t *w)
{
    return w->sim;
}

bool ap_test_sw_up(const ap_test_sw_t *w, uint32_t i)
{
    return i < w->c.slots && w->srv[i].up;
}

uint32_t ap_test_sw_stage(const ap_test_sw_t *w, uint32_t i)
{
    return i < w->c.slots ? w->srv[i].stage : 0;
}

double ap_test_sw_speed(const ap_test_sw_t *w, uint32_t i)
{
    return i < w->c.slots ? w->srv[i].speed : 0;
}

uint32_t ap_test_sw_moves(const ap_test_sw_t *w, uint32_t i)
{
    return i < w->c.slots ? w->srv[i].moves : 0;
}

uint64_t ap_test_sw_backwards(const ap_test_sw_t *w, uint32_t i)
{
    if (i >= w->c.slots || !w->srv[i].s) return 0;
    ap_swarm_server_stats_t st;
    ap_swarm_server_stats(w->srv[i].s, &st);
    return st.backwards;
}

uint64_t ap_test_sw_samples(const ap_test_sw_t *w)
{
    return w->done * BB;
}

uint64_t ap_test_sw_failed(const ap_test_sw_t *w)
{
    return w->failed;
}

uint64_t ap_test_sw_refused(const ap_test_sw_t *w)
{
    return w->refused;
}

uint64_t ap_test_sw_bytes(const ap_test_sw_t *w)
{
    uint64_t b = 0;
    for (uint32_t k = 0; k < w->c.trainers; k++)
        if (w->trn[k].t) b += ap_swarm_trainer_bytes(w->trn[k].t);
    return b;
}

double ap_test_sw_rate(ap_test_sw_t *w, uint64_t us)
{
    const uint64_t a = ap_test_sw_samples(w);
    ap_test_sw_run(w, us);
    return (double)(ap_test_sw_samples(w) - a) * 1e6 / (double)us;
}

double ap_test_sw_assigned(const ap_test_sw_t *w)
{
    double tot[8] = {0};
    for (uint32_t i = 0; i < w->c.slots; i++)
        if (w->srv[i].up) tot[w->srv[i].stage] += w->srv[i].speed;
    double lo = tot[0];
    for (uint32_t s = 1; s < w->c.stages; s++) lo = fmin(lo, tot[s]);
    return lo * w->c.unit * BB;
}

double ap_test_sw_optimum(const ap_test_sw_t *w)
{
    ap_swarm_member_t m[AP_TEST_SW_SERVERS_MAX];
    size_t n = 0;
    for (uint32_t i = 0; i < w->c.slots; i++)
        if (w->srv[i].up) m[n++] = (ap_swarm_member_t){.throughput = round(w->srv[i].speed)};
    int o = ap_test_swarm_optimum(m, n, (int)w->c.stages);
    return o < 0 ? -1 : o * w->c.unit * BB;
}

uint32_t ap_test_sw_rows(void)
{
    return BB;
}

int ap_test_sw_rebalance_stats(const ap_test_sw_t *w, uint32_t i, ap_swarm_rebalance_stats_t *out)
{
    if (i >= w->c.slots || !w->srv[i].rb) return AP_ENOTFOUND;
    ap_swarm_rebalancer_stats(w->srv[i].rb, out);
    return 0;
}

double ap_test_sw_announced(const ap_test_sw_t *w, uint32_t i)
{
    return i < w->c.slots && w->srv[i].s ? ap_swarm_server_throughput(w->srv[i].s) : 0;
}

bool ap_test_sw_estimated(const ap_test_sw_t *w, uint32_t i)
{
    return i < w->c.slots && w->srv[i].s && ap_swarm_server_estimated(w->srv[i].s);
}

uint32_t ap_test_sw_tokens(void)
{
    return BB * TT;
}
