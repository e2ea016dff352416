/* The Averager: owned tensors, one step at a time in a given group, async
 * handle with stage and cancel, a blocking form for user threads, and the
 * bandwidth it declares (configured, or measured over past rounds). */
#include "apiary/allreduce.h"
#include "apiary/averager.h"
#include "apiary/avg.h"

#include "apiary/log.h"
#include "averaging/allreduce.h"
#include "base/arena.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MOD      "avg"
#define BW_START 1e6 /* bytes/s declared before any round measured one */
#define BW_ALPHA 0.3 /* EWMA weight of the newest round */

struct ap_averager {
    ap_avg_service_t *svc;
    ap_rt_t *rt;
    ap_averager_opts_t o;
    float *buf;
    size_t bytes;
    uint64_t total;
    size_t n;
    uint64_t *off, *len;
    double up_est, down_est;
    ap_averager_step_t *running;
    ap_avg_member_t *group; /* the last step's group (group_cap entries allocated) */
    size_t group_n, group_cap;
    uint8_t *gather;    /* group_cap x AP_AVG_GATHER_MAX: each member's gathered bytes */
    size_t *gather_len; /* group_cap */
};

struct ap_averager_step {
    ap_averager_t *av;
    ap_averager_stage_t stage;
    ap_allreduce_t *ar;
    ap_allreduce_result_t res;
    ap_averager_step_fn cb;
    void *arg;
    bool orphaned;           /* freed by the user while running: free at the end */
    ap_avg_search_t *search; /* matchmaking in progress (stage LOOKING) */
    double weight;
    size_t group_n;
};

int ap_averager_new(ap_avg_service_t *svc, const size_t *sizes, size_t ntensors,
                    const ap_averager_opts_t *opts, ap_averager_t **out)
{
    if (!svc || !out || (ntensors && !sizes)) return AP_EINVAL;
    ap_averager_opts_t o = opts ? *opts : (ap_averager_opts_t){0};
    if (o.role != AP_AVG_NORMAL && o.role != AP_AVG_CLIENT && o.role != AP_AVG_AUX)
        return AP_EINVAL;
    if (!isfinite(o.up) || !isfinite(o.down) || o.up < 0 || o.down < 0) return AP_EINVAL;
    uint64_t total = 0;
    for (size_t i = 0; i < ntensors; i++) {
        if (sizes[i] > AP_ALLREDUCE_MAX_ELEMS - total) return AP_EINVAL;
        total += sizes[i];
    }
    ap_averager_t *av = calloc(1, sizeof *av);
    if (!av) return AP_ENOMEM;
    av->svc = svc;
    av->rt = ap__avg_service_rt(svc);
    av->o = o;
    av->n = ntensors;
    av->total = total;
    av->off = calloc(ntensors ? ntensors : 1, sizeof *av->off);
    av->len = calloc(ntensors ? ntensors : 1, sizeof *av->len);
    av->bytes = (size_t)(total ? total : 1) * sizeof(float);
    av->buf = ap__big_alloc(av->bytes);
    if (!av->off || !av->len || !av->buf) {
        if (av->buf) ap__big_free(av->buf, av->bytes);
        free(av->off);
        free(av->len);
        free(av);
        return AP_ENOMEM;
    }
    for (size_t i = 0, at = 0; i < ntensors; at += sizes[i], i++) {
        av->off[i] = at;
        av->len[i] = sizes[i];
    }
    av->up_est = av->down_est = BW_START;
    *out = av;
    return 0;
}

int ap_averager_free(ap_averager_t *av)
{
    if (!av) return 0;
    if (av->running) return AP_EBUSY;
    ap__big_free(av->buf, av->bytes);
    free(av->off);
    free(av->len);
    free(av->group);
    free(av->gather);
    free(av->gather_len);
    free(av);
    return 0;
}

size_t ap_averager_last_group(const ap_averager_t *av, ap_avg_member_t *out, size_t cap)
{
    if (!av) return 0;
    if (out)
        for (size_t i = 0; i < av->group_n && i < cap; i++) out[i] = av->group[i];
    return av->group_n;
}

int ap_averager_last_gather(const ap_averager_t *av, size_t i, uint8_t *out, size_t cap)
{
    if (!av || i >= av->group_n) return AP_EINVAL;
    size_t n = av->gather_len[i];
    if (out) memcpy(out, av->gather + i * AP_AVG_GATHER_MAX, n < cap ? n : cap);
    return (int)n;
}

/* Keeps a copy of the group a step runs in (ap_averager_last_group) and of
 * what its members gathered (ap_averager_last_gather). */
static void remember_group(ap_averager_t *av, const ap_avg_group_t *g, bool matched)
{
    av->group_n = 0;
    if (g->n > av->group_cap) {
        ap_avg_member_t *m = malloc(g->n * sizeof *m);
        uint8_t *ga = malloc(g->n * AP_AVG_GATHER_MAX);
        size_t *gl = malloc(g->n * sizeof *gl);
        if (!m || !ga || !gl) { /* informational only: the step runs without it */
            free(m);
            free(ga);
            free(gl);
            return;
        }
        free(av->group);
        free(av->gather);
        free(av->gather_len);
        av->group = m;
        av->gather = ga;
        av->gather_len = gl;
        av->group_cap = g->n;
    }
    memcpy(av->group, g->members, g->n * sizeof *g->members);
    for (size_t i = 0; i < g->n; i++) {
        size_t n =
            matched && g->gather && g->gather[i].len <= AP_AVG_GATHER_MAX ? g->gather[i].len : 0;
        if (n) memcpy(av->gather + i * AP_AVG_GATHER_MAX, g->gather[i].data, n);
        av->gather_len[i] = n;
    }
    av->group_n = g->n;
}

float *ap_averager_tensor(ap_averager_t *av, size_t i, size_t *n_elems)
{
    if (!av || i >= av->n) return NULL;
    if (n_elems) *n_elems = av->len[i];
    return av->buf + av->off[i];
}

bool ap_averager_running(const ap_averager_t *av)
{
    return av && av->running;
}

void ap_averager_bandwidth(const ap_averager_t *av, double *up, double *down)
{
    if (up) *up = av->o.up > 0 ? av->o.up : av->up_est;
    if (down) *down = av->o.down > 0 ? av->o.down : av->down_est;
}

void ap_averager_member(const ap_averager_t *av, ap_avg_member_t *out)
{
    memset(out, 0, sizeof *out);
    out->id = *ap_rt_self(av->rt);
    out->role = av->o.role;
    ap_averager_bandwidth(av, &out->up, &out->down);
}

/* A round's payload rate is a lower bound on the link (links idle at times),
 * so the estimate only rises by the EWMA and falls at most by the same
 * weight: a round that moved little data (a small part) says little. */
static void measure(ap_averager_t *av, const ap_allreduce_result_t *r)
{
    if (r->elapsed_us < 1000 || r->status) return;
    double s = (double)r->elapsed_us / 1e6;
    double up = (double)r->bytes_sent / s, down = (double)r->bytes_received / s;
    if (up > 0) av->up_est = (1 - BW_ALPHA) * av->up_est + BW_ALPHA * up;
    if (down > 0) av->down_est = (1 - BW_ALPHA) * av->down_est + BW_ALPHA * down;
}

static void step_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    ap_averager_step_t *st = arg;
    ap_averager_t *av = st->av;
    st->res = *res;
    st->ar = NULL;
    st->stage = res->status == 0 ? AP_AVERAGER_STAGE_DONE : AP_AVERAGER_STAGE_FAILED;
    if (av) {
        av->running = NULL;
        measure(av, res);
    }
    if (st->orphaned) {
        free(st);
        return;
    }
    if (st->cb) st->cb(rt, st->arg, st);
}

int ap_averager_step_group(ap_averager_t *av, const ap_avg_group_t *g, double weight,
                           uint64_t deadline_at_us, ap_averager_step_fn cb, void *arg,
                           ap_averager_step_t **out)
{
    if (!av || !g || !out) return AP_EINVAL;
    if (av->running) return AP_EBUSY;
    ap_averager_step_t *st = calloc(1, sizeof *st);
    if (!st) return AP_ENOMEM;
    st->av = av;
    st->cb = cb;
    st->arg = arg;
    st->stage = AP_AVERAGER_STAGE_RUNNING;
    ap_allreduce_opts_t ro = av->o.round;
    if (deadline_at_us && (!ro.deadline_at_us || deadline_at_us < ro.deadline_at_us))
        ro.deadline_at_us = deadline_at_us;
    bool aux = av->o.role == AP_AVG_AUX;
    int rc = ap_allreduce_start(av->svc, g, aux ? NULL : av->buf, av->total, aux ? 0 : weight, &ro,
                                step_done, st, &st->ar);
    if (rc) {
        free(st);
        return rc;
    }
    av->running = st;
    st->group_n = g->n;
    remember_group(av, g, false);
    *out = st;
    return 0;
}

/* ---- with matchmaking ------------------------------------------------------------ */

static void step_fail(ap_rt_t *rt, ap_averager_step_t *st, int status)
{
    memset(&st->res, 0, sizeof st->res);
    st->res.status = status;
    st->res.elems = st->av->total;
    st->stage = AP_AVERAGER_STAGE_FAILED;
    st->av->running = NULL;
    if (st->orphaned) {
        free(st);
        return;
    }
    if (st->cb) st->cb(rt, st->arg, st);
}

static void step_matched(ap_rt_t *rt, void *arg, int status, const ap_avg_group_t *g)
{
    ap_averager_step_t *st = arg;
    ap_averager_t *av = st->av;
    st->search = NULL;
    if (status) {
        step_fail(rt, st, status);
        return;
    }
    if (st->orphaned) {
        /* freed while looking: the group is told nothing; the round's members
         * drop this peer by their connect grace */
        step_fail(rt, st, AP_ECANCELED);
        return;
    }
    st->stage = AP_AVERAGER_STAGE_RUNNING;
    st->group_n = g->n;
    remember_group(av, g, true);
    bool aux = av->o.role == AP_AVG_AUX;
    int rc = ap_allreduce_start(av->svc, g, aux ? NULL : av->buf, av->total, aux ? 0 : st->weight,
                                &av->o.round, step_done, st, &st->ar);
    if (rc) step_fail(rt, st, rc);
}

int ap_averager_step(ap_averager_t *av, ap_avg_matchmaker_t *mm, const ap_avg_match_t *m,
                     double weight, ap_averager_step_fn cb, void *arg, ap_averager_step_t **out)
{
    if (!av || !mm || !m || !out) return AP_EINVAL;
    if (!isfinite(weight) || weight < 0) return AP_EINVAL;
    if (av->running) return AP_EBUSY;
    ap_averager_step_t *st = calloc(1, sizeof *st);
    if (!st) return AP_ENOMEM;
    st->av = av;
    st->cb = cb;
    st->arg = arg;
    st->weight = weight;
    st->stage = AP_AVERAGER_STAGE_LOOKING;
    ap_avg_member_t me;
    ap_averager_member(av, &me);
    int rc = ap_avg_match_start(mm, m, &me, step_matched, st, &st->search);
    if (rc) {
        free(st);
        return rc;
    }
    av->running = st;
    *out = st;
    return 0;
}

size_t ap_averager_step_group_size(const ap_averager_step_t *st)
{
    return st && st->stage != AP_AVERAGER_STAGE_LOOKING ? st->group_n : 0;
}

ap_averager_stage_t ap_averager_step_stage(const ap_averager_step_t *st)
{
    return st->stage;
}

const ap_allreduce_result_t *ap_averager_step_result(const ap_averager_step_t *st)
{
    return st->stage == AP_AVERAGER_STAGE_DONE || st->stage == AP_AVERAGER_STAGE_FAILED ? &st->res
                                                                                        : NULL;
}

void ap_averager_step_cancel(ap_averager_step_t *st)
{
    if (st && st->search)
        ap_avg_match_cancel(st->search);
    else if (st && st->ar)
        ap_allreduce_cancel(st->ar);
}

void ap_averager_step_free(ap_averager_step_t *st)
{
    if (!st) return;
    if (st->search) {
        st->orphaned = true;
        ap_avg_match_cancel(st->search); /* frees st through step_fail */
        return;
    }
    if (st->ar) {
        st->orphaned = true;
        ap_allreduce_cancel(st->ar);
        return;
    }
    free(st);
}

/* ---- blocking form --------------------------------------------------------------- */

typedef struct waiter {
    ap_averager_t *av;
    ap_avg_group_t g;
    ap_avg_member_t *members;
    double weight;
    uint64_t deadline;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool finished;
    int rc;
    ap_allreduce_result_t res;
    ap_averager_step_t *st;
} waiter_t;

static void waiter_wake(waiter_t *w, int rc)
{
    pthread_mutex_lock(&w->mu);
    w->rc = rc;
    w->finished = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void waiter_step_done(ap_rt_t *rt, void *arg, ap_averager_step_t *st)
{
    (void)rt;
    waiter_t *w = arg;
    w->res = st->res;
    ap_averager_step_free(st);
    waiter_wake(w, w->res.status);
}

static void waiter_start(ap_rt_t *rt, void *arg)
{
    (void)rt;
    waiter_t *w = arg;
    int rc =
        ap_averager_step_group(w->av, &w->g, w->weight, w->deadline, waiter_step_done, w, &w->st);
    if (rc) waiter_wake(w, rc);
}

int ap_averager_step_group_wait(ap_averager_t *av, const ap_avg_group_t *g, double weight,
                                uint64_t deadline_at_us, ap_allreduce_result_t *res)
{
    if (!av || !g || !g->members || g->n == 0 || g->n > AP_AVG_MAX_PEERS) return AP_EINVAL;
    waiter_t w;
    memset(&w, 0, sizeof w);
    w.av = av;
    w.g = *g;
    w.members = malloc(g->n * sizeof *w.members);
    if (!w.members) return AP_ENOMEM;
    memcpy(w.members, g->members, g->n * sizeof *w.members);
    w.g.members = w.members;
    w.weight = weight;
    w.deadline = deadline_at_us;
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    int rc = ap_rt_post(av->rt, waiter_start, &w);
    if (rc == 0) {
        pthread_mutex_lock(&w.mu);
        while (!w.finished) pthread_cond_wait(&w.cv, &w.mu);
        pthread_mutex_unlock(&w.mu);
        rc = w.rc;
        if (res) *res = w.res;
    }
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
    free(w.members);
    return rc;
}
