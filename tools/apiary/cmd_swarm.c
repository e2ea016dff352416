/* `apiary swarm server|trainer|demo`: SWARM pipeline training (docs/swarm.md).
 * A server holds one stage of the model kit's GPT, announces itself in the
 * DHT and trains its stage with the other servers of that stage through the
 * collaborative optimizer; a trainer owns the data and pushes micro-batches
 * through the stages, finding the servers in the DHT. The node runs on a
 * libuv host thread; the protocol objects live on its loop and this thread
 * reads their state with ap_node_call_sync. The demo is swarm_demo.c. */
#include "cli.h"
#include "swarm_cli.h"

#include "apiary/avg.h"
#include "apiary/collab.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "apiary/swarm.h"
#include "apiary/sync.h"

#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PEERS 16

typedef struct sopts {
    const char *run_id, *listen, *identity, *data, *stage_txt;
    char *peers[MAX_PEERS];
    int npeers;
    int stages, layers_per_stage, width, heads, ctx, batch;
    int inflight;
    long long steps, target;
    double lr, clip, period, record_ttl, duration, rebalance, margin;
    bool local, uncompressed;
    uint64_t seed;
} sopts_t;

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: apiary swarm server --run-id R --initial-peers MADDR [--stage N|auto] [options]\n"
        "       apiary swarm trainer --run-id R --initial-peers MADDR [options]\n"
        "       apiary swarm demo [--duration S]\n\n"
        "The model kit's GPT cut into --stages pipeline stages; every server holds one\n"
        "stage, trainers push micro-batches through them (docs/swarm.md). Every process\n"
        "of a run needs the same model flags.\n\n"
        "common options:\n"
        "  --run-id R                the run (required)\n"
        "  --initial-peers MADDR[,MADDR...]  DHT peers to join through, with /p2p/<PeerID>\n"
        "                            (required; repeatable)\n"
        "  --listen MULTIADDR        (default /ip4/0.0.0.0/tcp/0; a trainer dials only)\n"
        "  --identity PATH           Ed25519 key file, created (mode 0600) if missing\n"
        "  --stages S                pipeline stages (default 2)\n"
        "  --layers-per-stage K      transformer blocks per stage (default 1)\n"
        "  --width C                 embedding width (default 64)\n"
        "  --heads H                 attention heads (default 4)\n"
        "  --ctx T                   sequence length (default 32)\n"
        "  --batch B                 rows per micro-batch (default 8)\n"
        "  --uncompressed            activations as float32 (default blockwise 8-bit)\n"
        "  --log-level LEVEL         debug, info, warn (default), error, off\n\n"
        "server options:\n"
        "  --stage N|auto            the stage to serve (default auto: the stage with the\n"
        "                            least announced throughput, read from the DHT)\n"
        "  --announce-period S       seconds between announcements (default 2)\n"
        "  --record-ttl S            seconds each announcement lives in the DHT (default\n"
        "                            3 announcement periods, the least allowed)\n"
        "  --target-batch N          samples per optimizer step of a stage, summed over its\n"
        "                            servers (default 64)\n"
        "  --lr X                    Adam learning rate (default 0.003)\n"
        "  --local                   no collaboration: every server steps plain SGD on its\n"
        "                            own gradients after each backward\n"
        "  --clip X                  --local: clip each step's gradient to global L2 norm\n"
        "                            X (default 1; 0 = no clipping); a non-finite\n"
        "                            gradient is refused and not applied\n"
        "  --seed N                  parameter initialisation (default 42; the same on\n"
        "                            every server of a stage)\n"
        "  --rebalance-period S      seconds between rebalancing checks, randomised to\n"
        "                            S/2..3S/2 (default 10; 0 = never move): a server of an\n"
        "                            over-served stage moves to the bottleneck stage,\n"
        "                            downloading that stage's state first\n"
        "  --rebalance-margin X      relative gain of the pipeline's throughput a move\n"
        "                            must bring (default 0.25: measured throughputs are\n"
        "                            noisy on shared machines)\n\n"
        "trainer options:\n"
        "  --data PATH               text to train on (default: the shipped corpus)\n"
        "  --steps N                 micro-batches, then a summary and exit (default 0 =\n"
        "                            until Ctrl-C)\n"
        "  --inflight K              micro-batches in the pipeline at once (default 4)\n"
        "  --duration S              stop after S seconds (default: no limit)\n"
        "A trainer prints a status line every second (samples/s, loss, servers per stage)\n"
        "and a summary line at the end.\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int add_peers(sopts_t *o, const char *list)
{
    char *copy = strdup(list);
    if (!copy) return -1;
    int rc = 0;
    for (char *save = NULL, *tok = strtok_r(copy, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (!*tok) continue;
        if (o->npeers == MAX_PEERS) {
            fprintf(stderr, "apiary swarm: at most %d initial peers\n", MAX_PEERS);
            rc = -1;
            break;
        }
        o->peers[o->npeers++] = strdup(tok);
    }
    free(copy);
    return rc;
}

/* ---- the node ------------------------------------------------------------- */

typedef struct node {
    ap_host_t *host;
    ap_rt_t *rt;
    ap_dht_t *dht;
} node_t;

static void node_close(node_t *n)
{
    if (n->dht) ap_dht_free_sync(n->dht);
    if (n->host) ap_host_free(n->host);
    memset(n, 0, sizeof *n);
}

static int node_open(node_t *n, const sopts_t *o, bool client, const char *cmd)
{
    memset(n, 0, sizeof *n);
    ap_identity_t id;
    bool have_id = false;
    int rc;
    if (o->identity) {
        bool created = false;
        rc = ap_identity_load_or_create(&id, o->identity, &created);
        if (rc) {
            fprintf(stderr, "apiary swarm %s: cannot use identity file %s: %s\n", cmd, o->identity,
                    ap_strerror(rc));
            return rc;
        }
        have_id = true;
    }
    n->host = ap_host_new();
    rc = n->host ? ap_host_start(n->host) : AP_ENOMEM;
    ap_node_opts_t no = {.ed25519_sk = have_id ? id.sk : NULL,
                         .listen = o->listen ? o->listen
                                   : client  ? NULL
                                             : "/ip4/0.0.0.0/tcp/0",
                         .dial_only = client && !o->listen};
    if (!rc) rc = ap_node_new(n->host, &no, &n->rt);
    if (have_id) ap_identity_wipe(&id);
    if (rc) {
        fprintf(stderr, "apiary swarm %s: cannot start the node on %s: %s\n", cmd,
                no.listen ? no.listen : "(dial only)", ap_strerror(rc));
        node_close(n);
        return rc;
    }
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    cfg.client_mode = client;
    rc = ap_dht_new_sync(n->rt, &cfg, &n->dht);
    if (!rc) rc = ap_dht_bootstrap_sync(n->dht, (const char *const *)o->peers, (size_t)o->npeers);
    if (rc) {
        fprintf(stderr,
                "apiary swarm %s: cannot join the DHT through the %d initial peers: %s (they "
                "need /p2p/<PeerID>)\n",
                cmd, o->npeers, ap_strerror(rc));
        node_close(n);
        return rc;
    }
    return 0;
}

static int stage_model(const sopts_t *o, int stage, ap_nn_model_t **out)
{
    ap_nn_gpt_config_t c = ap_nn_gpt_config_default(o->ctx, o->stages * o->layers_per_stage,
                                                    o->heads, o->width, o->batch);
    c.layer_begin = stage * o->layers_per_stage;
    c.layer_end = (stage + 1) * o->layers_per_stage;
    c.embed = stage == 0;
    c.head = stage == o->stages - 1;
    int rc = ap_nn_gpt_new(&c, out);
    if (rc) return rc;
    ap_nn_model_init(*out, o->seed + (uint64_t)stage);
    return 0;
}

/* ---- server ----------------------------------------------------------------- */

typedef struct srv {
    const sopts_t *o;
    ap_rt_t *rt;
    ap_dht_t *dht;
    ap_nn_model_t *m;
    ap_swarm_server_t *s;
    ap_collab_t *c;
    ap_avg_service_t *svc;
    ap_swarm_rebalancer_t *rb;
    char crun[AP_COLLAB_RUN_ID_MAX + 1];
    uint32_t stage, to;
    uint64_t poll, moves;
    ap_nn_model_t *next; /* the model of the stage being moved to */
    uint64_t acc_samples, steps;
    uint32_t acc_calls;
    bool stepping;
    int status;
    /* --stage auto */
    double totals[AP_SWARM_STAGES_MAX];
    bool got;
} srv_t;

/* A rebalancing move is under way: from on_move (the poll waits for the
 * compute) to move_end (v->next, the new stage's model, is set between); only
 * move_end resumes serving meanwhile. */
static bool moving(const srv_t *v)
{
    return v->poll || v->next;
}

static void on_stepped(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    srv_t *v = arg;
    v->stepping = false;
    if (status && status != AP_ECANCELED)
        ap_warn("swarm", "stage %u: optimizer step: %s", v->stage, ap_err_name(status));
    ap_collab_stats_t st;
    ap_collab_get_stats(v->c, &st);
    ap_swarm_server_set_version(v->s, st.epoch);
    v->steps++;
    if (!moving(v)) ap_swarm_server_pause(v->s, false);
}

static void on_bwd(ap_swarm_server_t *s, void *arg, uint64_t samples)
{
    srv_t *v = arg;
    ap_nn_params_t *p = ap_nn_model_params(v->m);
    v->acc_samples += samples;
    v->acc_calls++;
    if (v->o->local || !v->c) { /* !v->c: its collaboration could not be rejoined */
        /* a non-finite gradient is refused (logged) and not applied */
        if (ap_swarm_sgd_step(p, (float)v->o->lr, (float)v->o->clip, NULL) == AP_OK) v->steps++;
        v->acc_samples = v->acc_calls = 0;
        return;
    }
    /* while moving, the old stage's gradients are only accumulated (and
     * dropped by the move): a step would resume serving the old stage */
    if (v->stepping || moving(v) || v->acc_samples < (uint64_t)v->o->batch) return;
    /* the mean gradient over the calls accumulated */
    const float inv = 1.0f / (float)v->acc_calls;
    for (size_t k = 0; k < p->count; k++) p->grad[k] *= inv;
    ap_swarm_server_pause(s, true); /* idle now: nothing computes until the step is taken */
    v->stepping = true;
    int rc = ap_collab_submit(v->c, p->grad, (uint32_t)v->acc_samples, 0, on_stepped, v);
    ap_nn_model_zero_grad(v->m);
    v->acc_samples = v->acc_calls = 0;
    if (rc) {
        v->stepping = false;
        ap_warn("swarm", "stage %u: cannot submit the gradients: %s", v->stage, ap_err_name(rc));
        if (!moving(v)) ap_swarm_server_pause(s, false);
    }
}

/* The stage's collaboration: run <run>_stage<s>, Adam, shared by the
 * stage's servers. */
static void collab_cfg(srv_t *v, uint32_t stage, ap_nn_model_t *m, ap_collab_config_t *cfg)
{
    snprintf(v->crun, sizeof v->crun, "%s_stage%u", v->o->run_id, stage);
    ap_collab_config_default(cfg);
    cfg->run_id = v->crun;
    cfg->target_batch_size = (uint64_t)v->o->target;
    cfg->solver = ap_nn_solver_defaults(AP_NN_ADAM);
    cfg->lr = (ap_nn_lr_schedule_t){
        .kind = AP_NN_LR_CONSTANT, .base = (float)v->o->lr, .min = (float)v->o->lr};
    cfg->model_kind = (uint32_t)ap_nn_model_kind(m);
    ap_nn_model_shape(m, cfg->model_shape);
    cfg->average_state_every = 5;
    cfg->averaging_timeout_us = 10000000;
    cfg->matchmaking_window_us = 500000;
    cfg->delayed_updates = true;
}

static void on_rejoined(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    srv_t *v = arg;
    if (status == AP_ECANCELED) return;
    if (status)
        ap_warn("swarm", "stage %u: rejoining its collaboration: %s (serving anyway)", v->stage,
                ap_err_name(status));
    ap_collab_stats_t st;
    ap_collab_get_stats(v->c, &st);
    ap_swarm_server_set_version(v->s, st.epoch);
}

/* Leaves the current collaboration (if any) and joins stage's, over m's
 * parameters; start's callback is cb. On failure v->c is NULL. */
static int join_collab(srv_t *v, uint32_t stage, ap_nn_model_t *m, ap_collab_fn cb)
{
    ap_collab_free(v->c);
    v->c = NULL;
    ap_collab_config_t cfg;
    collab_cfg(v, stage, m, &cfg);
    ap_nn_params_t *p = ap_nn_model_params(m);
    int rc =
        ap_collab_new(v->rt, v->dht, v->svc, &cfg, p->data, p->count, p->views, p->nviews, &v->c);
    if (!rc) rc = ap_collab_start(v->c, cb, v);
    if (rc) {
        ap_collab_free(v->c);
        v->c = NULL;
    }
    return rc;
}

/* After a failed move that had left the stage's collaboration: the new
 * stage's collaboration, if joined (it works on v->next's parameters), is
 * left before v->next is freed, and the server rejoins its own stage's. */
static void rejoin_old(srv_t *v)
{
    int rc = join_collab(v, v->stage, v->m, on_rejoined);
    if (rc)
        ap_warn("swarm", "stage %u: cannot rejoin its collaboration: %s (training locally)",
                v->stage, ap_err_name(rc));
}

/* A rebalancing move, on the loop thread: pause, wait for the compute and
 * the optimizer step in progress (nothing resumes serving meanwhile), join
 * the new stage's collaboration (which downloads its parameters and
 * optimizer state from that stage's peers), then serve the new stage. A
 * move that fails leaves the server in its stage and its collaboration. */
static void move_end(srv_t *v, int rc)
{
    if (!rc) rc = ap_swarm_server_set_stage(v->s, v->next, v->to);
    if (rc) {
        ap_warn("swarm", "rebalancing: cannot move to stage %u: %s; staying in stage %u", v->to,
                ap_err_name(rc), v->stage);
        /* with v->next loaded, a collaborative server has left its stage's
         * collaboration (on_move_poll) */
        if (v->next && !v->o->local) rejoin_old(v);
        ap_nn_model_free(v->next);
    } else {
        ap_collab_stats_t cs = {0};
        if (v->c) ap_collab_get_stats(v->c, &cs);
        /* no state download (no donor in the view read at the start, or the
         * download failed): it serves freshly initialised parameters */
        printf("rebalancing: moved from stage %u to stage %u (%s, epoch %llu)\n", v->stage, v->to,
               v->o->local      ? "local SGD"
               : cs.state_loads ? "its collaboration's state downloaded"
                                : "no state downloaded: fresh parameters",
               (unsigned long long)cs.epoch);
        fflush(stdout);
        ap_nn_model_free(v->m);
        v->m = v->next;
        v->stage = v->to;
        v->moves++;
        v->acc_samples = v->acc_calls = 0;
    }
    v->next = NULL;
    ap_swarm_server_pause(v->s, false);
    ap_swarm_rebalancer_moved(v->rb, rc);
}

static void on_joined(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    srv_t *v = arg;
    if (status == AP_ECANCELED) return;
    if (status && status != AP_ECONFIG)
        ap_warn("swarm", "rebalancing: state download of stage %u: %s (serving anyway)", v->to,
                ap_err_name(status));
    ap_collab_stats_t st;
    ap_collab_get_stats(v->c, &st);
    ap_swarm_server_set_version(v->s, st.epoch);
    move_end(v, status == AP_ECONFIG ? status : 0);
}

static void on_move_poll(ap_rt_t *rt, void *arg)
{
    srv_t *v = arg;
    if (!ap_swarm_server_idle(v->s) || v->stepping) return;
    ap_rt_timer_stop(rt, v->poll);
    v->poll = 0;
    int rc = stage_model(v->o, (int)v->to, &v->next);
    if (rc) {
        v->next = NULL;
        move_end(v, rc);
        return;
    }
    if (v->o->local) {
        move_end(v, 0);
        return;
    }
    /* leave the old stage's collaboration, join the new one's */
    rc = join_collab(v, v->to, v->next, on_joined);
    if (rc) {
        ap_warn("swarm", "rebalancing: cannot join stage %u's collaboration: %s", v->to,
                ap_err_name(rc));
        move_end(v, rc);
    }
}

static void on_move(ap_swarm_rebalancer_t *rb, void *arg, uint32_t from, uint32_t to)
{
    srv_t *v = arg;
    printf("rebalancing: stage %u is the bottleneck; moving from stage %u\n", to, from);
    fflush(stdout);
    v->to = to;
    ap_swarm_server_pause(v->s, true);
    v->poll = ap_rt_timer_start(v->rt, 20000, 20000, on_move_poll, v);
    if (!v->poll) {
        ap_swarm_server_pause(v->s, false);
        ap_swarm_rebalancer_moved(rb, AP_ENOMEM);
    }
}

static void srv_start_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    srv_t *v = arg;
    const ap_codec_cfg_t raw = {.id = AP_CODEC_NONE};
    int rc = ap_swarm_server_new(rt, v->m, v->stage, v->o->uncompressed ? &raw : NULL, &v->s);
    if (!rc) {
        ap_swarm_server_on_backward(v->s, on_bwd, v);
        if (v->o->record_ttl > 0)
            rc = ap_swarm_server_announce_ttl(v->s, (uint64_t)(v->o->record_ttl * 1e6 + 0.5));
        if (!rc)
            rc = ap_swarm_server_announce(v->s, v->dht, v->o->run_id,
                                          (uint64_t)(v->o->period * 1e6), 0);
    }
    if (!rc && v->o->rebalance > 0) {
        ap_swarm_rebalance_opts_t ro = {
            .period_us = (uint64_t)(v->o->rebalance * 1e6), .margin = v->o->margin, .cooldown = 3};
        rc = ap_swarm_rebalancer_new(rt, v->s, v->dht, v->o->run_id, (uint32_t)v->o->stages, &ro,
                                     on_move, v, &v->rb);
    }
    ap_sync_complete(done, rc);
}

static void srv_stop_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    srv_t *v = arg;
    ap_swarm_rebalancer_free(v->rb);
    v->rb = NULL;
    if (v->poll) { /* a move not begun: stay */
        ap_rt_timer_stop(v->rt, v->poll);
        v->poll = 0;
    }
    ap_swarm_server_pause(v->s, true);
    ap_sync_complete(done, ap_swarm_server_idle(v->s) && !v->stepping && !v->next ? 0 : AP_EBUSY);
}

static void srv_free_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    srv_t *v = arg;
    ap_swarm_server_free(v->s);
    v->s = NULL;
    ap_sync_complete(done, 0);
}

typedef struct srv_status {
    ap_swarm_server_stats_t st;
    uint64_t steps, epoch, moves;
    uint32_t stage;
} srv_status_t;

static srv_t *status_src;
static void srv_status_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    srv_status_t *out = arg;
    ap_swarm_server_stats(status_src->s, &out->st);
    out->steps = status_src->steps;
    out->moves = status_src->moves;
    out->stage = status_src->stage;
    ap_collab_stats_t cs = {0};
    if (status_src->c) ap_collab_get_stats(status_src->c, &cs);
    out->epoch = cs.epoch;
    ap_sync_complete(done, 0);
}

/* --stage auto: one read of every stage's records. */
typedef struct auto_read {
    srv_t *v;
    ap_sync_t *done;
    ap_swarm_watch_t *w;
    int failures;
} auto_read_t;

static void on_auto(ap_rt_t *rt, void *arg, int status, const ap_dht_result_t *res, uint32_t n)
{
    auto_read_t *a = arg;
    if (status && ++a->failures < 5) return; /* the watch reads again in a second */
    if (!status) {
        static ap_swarm_member_t m[1024];
        static int64_t exp[1024];
        int k = ap_swarm_members_from(res, n, ap_rt_wall_ms(rt), m, exp, 1024);
        for (int i = 0; i < k; i++)
            a->v->totals[m[i].stage] += m[i].throughput > 0 ? m[i].throughput : 1;
        a->v->got = true;
    }
    ap_swarm_watch_free(a->w);
    ap_sync_complete(a->done, status);
}

static void auto_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    auto_read_t *a = arg;
    a->done = done;
    int rc =
        ap_swarm_watch_new(rt, a->v->dht, a->v->o->run_id, (uint32_t)a->v->o->stages, 1000000ull,
                           on_auto, a, &a->w); /* a failed read is retried each second */
    if (rc) ap_sync_complete(done, rc);
}

static int run_server(const sopts_t *o)
{
    signal(SIGPIPE, SIG_IGN);
    ap_cli_catch_stop();
    node_t n;
    if (node_open(&n, o, false, "server")) return 1;
    srv_t v = {.o = o, .rt = n.rt, .dht = n.dht};
    status_src = &v;
    long long st_ll = -1;
    if (!o->stage_txt || !strcmp(o->stage_txt, "auto")) {
        auto_read_t a = {.v = &v};
        int rc = ap_node_call_sync(n.rt, auto_fn, &a);
        uint32_t best = 0;
        for (uint32_t s = 1; s < (uint32_t)o->stages; s++)
            if (v.totals[s] < v.totals[best]) best = s;
        v.stage = best;
        printf("stage auto: %s; serving stage %u (announced totals:", rc ? ap_strerror(rc) : "read",
               best);
        for (int s = 0; s < o->stages; s++) printf(" %.0f", v.totals[s]);
        printf(")\n");
    } else if (!ap_cli_int("--stage", o->stage_txt, 0, o->stages - 1, &st_ll)) {
        node_close(&n);
        return 2;
    } else {
        v.stage = (uint32_t)st_ll;
    }
    int rc = stage_model(o, (int)v.stage, &v.m);
    if (rc) {
        fprintf(stderr, "apiary swarm server: cannot build stage %u: %s\n", v.stage,
                ap_strerror(rc));
        node_close(&n);
        return 1;
    }
    ap_nn_params_t *pr = ap_nn_model_params(v.m);
    if (!o->local) {
        rc = ap_avg_service_new_sync(n.rt, &v.svc);
        ap_collab_config_t cfg;
        collab_cfg(&v, v.stage, v.m, &cfg);
        if (!rc)
            rc = ap_collab_new_sync(n.rt, n.dht, v.svc, &cfg, pr->data, pr->count, pr->views,
                                    pr->nviews, &v.c);
        if (!rc) {
            int lrc = ap_collab_start_sync(v.c);
            if (lrc && lrc != AP_ECONFIG)
                fprintf(stderr, "apiary swarm server: state download: %s (training on)\n",
                        ap_strerror(lrc));
            rc = lrc == AP_ECONFIG ? lrc : 0;
        }
        if (rc) fprintf(stderr, "apiary swarm server: optimizer: %s\n", ap_strerror(rc));
    }
    if (!rc) rc = ap_node_call_sync(n.rt, srv_start_fn, &v);
    if (rc) {
        fprintf(stderr, "apiary swarm server: cannot serve stage %u: %s\n", v.stage,
                ap_strerror(rc));
    } else {
        char id[AP_PEER_ID_STR_MAX];
        ap_peer_id_str(ap_rt_self(n.rt), id);
        printf("swarm server %s: run %s, stage %u of %d (%zu parameters)%s\n", id, o->run_id,
               v.stage, o->stages, pr->count, o->local ? ", local SGD" : "");
        fflush(stdout);
        double last = now_s();
        while (!ap_cli_stop_signal()) {
            struct timespec tick = {0, 200 * 1000 * 1000};
            nanosleep(&tick, NULL);
            if (now_s() - last < 5) continue;
            last = now_s();
            srv_status_t ss;
            ap_node_call_sync(n.rt, srv_status_fn, &ss);
            printf("stage %u: %llu forwards, %llu backwards, %llu refused, %.0f tokens/s, queue "
                   "%u, %llu steps, epoch %llu, moves %llu\n",
                   ss.stage, (unsigned long long)ss.st.forwards,
                   (unsigned long long)ss.st.backwards, (unsigned long long)ss.st.refused,
                   ss.st.throughput, ss.st.queue, (unsigned long long)ss.steps,
                   (unsigned long long)ss.epoch, (unsigned long long)ss.moves);
            fflush(stdout);
        }
        fprintf(stderr, "apiary swarm server: %s, shutting down\n", ap_cli_stop_name());
        /* wait for the compute and the step in progress, then free */
        for (int i = 0; i < 300 && ap_node_call_sync(n.rt, srv_stop_fn, &v); i++) {
            struct timespec t = {0, 20 * 1000 * 1000};
            nanosleep(&t, NULL);
        }
        srv_status_t ss;
        ap_node_call_sync(n.rt, srv_status_fn, &ss);
        printf("stage %u summary: %llu forwards, %llu backwards, %llu steps, %llu moves\n",
               ss.stage, (unsigned long long)ss.st.forwards, (unsigned long long)ss.st.backwards,
               (unsigned long long)ss.steps, (unsigned long long)ss.moves);
    }
    if (v.s) ap_node_call_sync(n.rt, srv_free_fn, &v);
    if (v.c) ap_collab_free_sync(n.rt, v.c);
    if (v.svc) ap_avg_service_free_sync(n.rt, v.svc);
    node_close(&n);
    ap_nn_model_free(v.m);
    ap_nn_model_free(v.next);
    return rc ? 1 : 0;
}

/* ---- trainer ---------------------------------------------------------------- */

#define LOSS_WIN 20

typedef struct trn {
    const sopts_t *o;
    ap_rt_t *rt;
    ap_dht_t *dht;
    ap_swarm_trainer_t *t;
    ap_nn_text_t *text;
    uint64_t cursor, submitted, done, failed;
    int inflight;
    bool stop;
    int32_t *tok, *tgt;
    float first, recent[LOSS_WIN];
    int nrecent;
    bool have_first;
} trn_t;

static void submit_one(trn_t *r);

static void on_batch(ap_rt_t *rt, void *arg, int status, float loss)
{
    (void)rt;
    trn_t *r = arg;
    r->inflight--;
    if (status == AP_ECANCELED) return;
    if (status) {
        r->failed++;
        ap_warn("swarm", "micro-batch failed: %s", ap_err_name(status));
    } else {
        if (!r->have_first) {
            r->first = loss;
            r->have_first = true;
        }
        r->recent[r->nrecent++ % LOSS_WIN] = loss;
        r->done++;
    }
    submit_one(r);
}

static void submit_one(trn_t *r)
{
    if (r->stop || (r->o->steps && r->submitted >= (uint64_t)r->o->steps)) return;
    int rc =
        ap_nn_text_batch(r->text, r->o->seed, &r->cursor, r->o->batch, r->o->ctx, r->tok, r->tgt);
    if (!rc)
        rc = ap_swarm_trainer_submit(r->t, (uint32_t)r->o->batch, (uint32_t)r->o->ctx, r->tok,
                                     r->tgt, on_batch, r);
    if (rc) {
        ap_warn("swarm", "cannot submit a micro-batch: %s", ap_err_name(rc));
        r->stop = true;
        return;
    }
    r->submitted++;
    r->inflight++;
}

static void trn_start_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    trn_t *r = arg;
    const ap_codec_cfg_t raw = {.id = AP_CODEC_NONE};
    int rc = ap_swarm_trainer_new(rt, (uint32_t)r->o->stages, (uint32_t)r->o->width,
                                  r->o->uncompressed ? &raw : NULL, 64, &r->t);
    if (!rc) rc = ap_swarm_trainer_watch(r->t, r->dht, r->o->run_id, 1000000);
    for (int i = 0; !rc && i < r->o->inflight; i++) submit_one(r);
    ap_sync_complete(done, rc);
}

typedef struct trn_status {
    ap_swarm_trainer_stats_t st;
    uint64_t bytes;
    uint32_t servers[AP_SWARM_STAGES_MAX];
    float loss;
    int inflight;
} trn_status_t;

static trn_t *trn_src;
static void trn_status_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    trn_status_t *out = arg;
    trn_t *r = trn_src;
    ap_swarm_trainer_stats(r->t, &out->st);
    out->bytes = ap_swarm_trainer_bytes(r->t);
    const uint64_t now = ap_rt_now_us(rt);
    for (int s = 0; s < r->o->stages; s++)
        out->servers[s] =
            (uint32_t)ap_swarm_balancer_eligible(ap_swarm_trainer_balancer(r->t, (uint32_t)s), now);
    int k = r->nrecent < LOSS_WIN ? r->nrecent : LOSS_WIN;
    float sum = 0;
    for (int i = 0; i < k; i++) sum += r->recent[i];
    out->loss = k ? sum / (float)k : NAN;
    out->inflight = r->inflight;
    ap_sync_complete(done, 0);
}

static void trn_stop_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    trn_t *r = arg;
    r->stop = true;
    ap_sync_complete(done, r->inflight);
}

static void trn_free_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)rt;
    trn_t *r = arg;
    ap_swarm_trainer_free(r->t);
    r->t = NULL;
    ap_sync_complete(done, 0);
}

static int run_trainer(const sopts_t *o)
{
    signal(SIGPIPE, SIG_IGN);
    ap_cli_catch_stop();
    trn_t r = {.o = o};
    const char *path = o->data ? o->data : ap_nn_default_corpus();
    int rc = ap_nn_text_open(path, &r.text);
    if (rc) {
        fprintf(stderr, "apiary swarm trainer: cannot read %s: %s\n", path, ap_strerror(rc));
        return 1;
    }
    r.tok = calloc((size_t)o->batch * o->ctx, sizeof *r.tok);
    r.tgt = calloc((size_t)o->batch * o->ctx, sizeof *r.tgt);
    node_t n;
    if (!r.tok || !r.tgt || node_open(&n, o, true, "trainer")) {
        free(r.tok);
        free(r.tgt);
        ap_nn_text_free(r.text);
        return 1;
    }
    r.rt = n.rt;
    r.dht = n.dht;
    trn_src = &r;
    rc = ap_node_call_sync(n.rt, trn_start_fn, &r);
    if (rc) fprintf(stderr, "apiary swarm trainer: cannot start: %s\n", ap_strerror(rc));
    const double t0 = now_s();
    trn_status_t ts = {0};
    uint64_t last_samples = 0;
    double last_t = t0;
    while (!rc && !ap_cli_stop_signal()) {
        struct timespec tick = {0, 250 * 1000 * 1000};
        nanosleep(&tick, NULL);
        ap_node_call_sync(n.rt, trn_status_fn, &ts);
        const double t = now_s();
        const bool finished = o->steps && ts.st.batches + ts.st.failed >= (uint64_t)o->steps;
        if (t - last_t >= 1 || finished) {
            const double sps = (double)(ts.st.samples - last_samples) / (t - last_t);
            printf("t %5.1f s  samples/s %6.1f  loss %.4f  batches %llu  failed %llu  servers "
                   "per stage",
                   t - t0, sps, ts.loss, (unsigned long long)ts.st.batches,
                   (unsigned long long)ts.st.failed);
            for (int s = 0; s < o->stages; s++) printf(" %u", ts.servers[s]);
            printf("  calls %llu (failed %llu, timed out %llu)\n", (unsigned long long)ts.st.calls,
                   (unsigned long long)ts.st.call_failures,
                   (unsigned long long)ts.st.call_timeouts);
            fflush(stdout);
            last_samples = ts.st.samples;
            last_t = t;
        }
        if (finished || (o->duration > 0 && t - t0 >= o->duration)) break;
    }
    const double elapsed = now_s() - t0;
    if (!rc) {
        for (int i = 0; i < 600 && ap_node_call_sync(n.rt, trn_stop_fn, &r) > 0; i++) {
            struct timespec t = {0, 50 * 1000 * 1000};
            nanosleep(&t, NULL);
        }
        ap_node_call_sync(n.rt, trn_status_fn, &ts);
        printf("summary: batches %llu failed %llu samples %llu seconds %.1f samples/s %.2f "
               "bytes/sample %.0f loss first %.4f last %.4f\n",
               (unsigned long long)ts.st.batches, (unsigned long long)ts.st.failed,
               (unsigned long long)ts.st.samples, elapsed, (double)ts.st.samples / elapsed,
               ts.st.samples ? (double)ts.bytes / (double)ts.st.samples : 0.0, r.first, ts.loss);
        fflush(stdout);
    }
    if (r.t) ap_node_call_sync(n.rt, trn_free_fn, &r);
    node_close(&n);
    free(r.tok);
    free(r.tgt);
    ap_nn_text_free(r.text);
    return rc || ts.st.failed ? 1 : 0;
}

/* ---- flags ------------------------------------------------------------------ */

static int swarm_main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "demo")) return ap_swarm_demo_main(argc - 1, argv + 1);
    const bool server = !strcmp(sub, "server");
    if (!server && strcmp(sub, "trainer")) {
        usage(stderr);
        return 2;
    }
    sopts_t o = {.stages = 2,
                 .layers_per_stage = 1,
                 .width = 64,
                 .heads = 4,
                 .ctx = 32,
                 .batch = 8,
                 .inflight = 4,
                 .target = 64,
                 .lr = 0.003,
                 .clip = 1.0,
                 .period = 2,
                 .rebalance = 10,
                 .margin = 0.25,
                 .seed = 42};
    static const struct option lopts[] = {{"run-id", required_argument, NULL, 'R'},
                                          {"initial-peers", required_argument, NULL, 'P'},
                                          {"listen", required_argument, NULL, 'L'},
                                          {"identity", required_argument, NULL, 'i'},
                                          {"stage", required_argument, NULL, 's'},
                                          {"stages", required_argument, NULL, 'S'},
                                          {"layers-per-stage", required_argument, NULL, 'K'},
                                          {"width", required_argument, NULL, 'C'},
                                          {"heads", required_argument, NULL, 'H'},
                                          {"ctx", required_argument, NULL, 'T'},
                                          {"batch", required_argument, NULL, 'B'},
                                          {"uncompressed", no_argument, NULL, 'u'},
                                          {"announce-period", required_argument, NULL, 'a'},
                                          {"record-ttl", required_argument, NULL, 1002},
                                          {"target-batch", required_argument, NULL, 'g'},
                                          {"lr", required_argument, NULL, 'r'},
                                          {"local", no_argument, NULL, 'o'},
                                          {"clip", required_argument, NULL, 1001},
                                          {"seed", required_argument, NULL, 'e'},
                                          {"rebalance-period", required_argument, NULL, 'b'},
                                          {"rebalance-margin", required_argument, NULL, 'M'},
                                          {"data", required_argument, NULL, 'd'},
                                          {"steps", required_argument, NULL, 'n'},
                                          {"inflight", required_argument, NULL, 'f'},
                                          {"duration", required_argument, NULL, 'D'},
                                          {"log-level", required_argument, NULL, 'l'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    int c, rc = 2;
    long long v;
    optind = 1;
    while ((c = getopt_long(argc - 1, argv + 1, "h", lopts, NULL)) != -1) {
        switch (c) {
        case 'R':
            o.run_id = optarg;
            break;
        case 'P':
            if (add_peers(&o, optarg)) goto out;
            break;
        case 'L':
            o.listen = optarg;
            break;
        case 'i':
            o.identity = optarg;
            break;
        case 's':
            o.stage_txt = optarg;
            break;
        case 'S':
            if (!ap_cli_int("--stages", optarg, 1, 64, &v)) goto out;
            o.stages = (int)v;
            break;
        case 'K':
            if (!ap_cli_int("--layers-per-stage", optarg, 1, 64, &v)) goto out;
            o.layers_per_stage = (int)v;
            break;
        case 'C':
            if (!ap_cli_int("--width", optarg, 8, 4096, &v)) goto out;
            o.width = (int)v;
            break;
        case 'H':
            if (!ap_cli_int("--heads", optarg, 1, 64, &v)) goto out;
            o.heads = (int)v;
            break;
        case 'T':
            if (!ap_cli_int("--ctx", optarg, 2, 4096, &v)) goto out;
            o.ctx = (int)v;
            break;
        case 'B':
            if (!ap_cli_int("--batch", optarg, 1, 1024, &v)) goto out;
            o.batch = (int)v;
            break;
        case 'u':
            o.uncompressed = true;
            break;
        case 'a':
            if (!ap_cli_num("--announce-period", optarg, 0.1, 3600, &o.period)) goto out;
            break;
        case 1002:
            if (!ap_cli_num("--record-ttl", optarg, 0.3,
                            (double)(AP_SWARM_RECORD_TTL_MAX_US / 1000000), &o.record_ttl))
                goto out;
            break;
        case 'g':
            if (!ap_cli_int("--target-batch", optarg, 1, 1 << 30, &o.target)) goto out;
            break;
        case 'r':
            if (!ap_cli_num("--lr", optarg, 1e-9, 10, &o.lr)) goto out;
            break;
        case 'o':
            o.local = true;
            break;
        case 1001:
            if (!ap_cli_num("--clip", optarg, 0, 1e9, &o.clip)) goto out;
            break;
        case 'b':
            if (!ap_cli_num("--rebalance-period", optarg, 0, 86400, &o.rebalance)) goto out;
            if (o.rebalance > 0 && o.rebalance < 0.1) o.rebalance = 0.1;
            break;
        case 'M':
            if (!ap_cli_num("--rebalance-margin", optarg, 0.001, 10, &o.margin)) goto out;
            break;
        case 'e':
            if (!ap_cli_int("--seed", optarg, 0, 1ll << 62, &v)) goto out;
            o.seed = (uint64_t)v;
            break;
        case 'd':
            o.data = optarg;
            break;
        case 'n':
            if (!ap_cli_int("--steps", optarg, 0, 1ll << 40, &o.steps)) goto out;
            break;
        case 'f':
            if (!ap_cli_int("--inflight", optarg, 1, 256, &v)) goto out;
            o.inflight = (int)v;
            break;
        case 'D':
            if (!ap_cli_num("--duration", optarg, 0, 1e7, &o.duration)) goto out;
            break;
        case 'l':
            if (!ap_cli_set_log_level(optarg)) goto out;
            break;
        case 'h':
            usage(stdout);
            rc = 0;
            goto out;
        default:
            usage(stderr);
            goto out;
        }
    }
    if (optind < argc - 1) {
        fprintf(stderr, "apiary swarm %s: unexpected argument '%s'\n", sub, argv[optind + 1]);
        goto out;
    }
    if (!o.run_id || !*o.run_id || strlen(o.run_id) > 100 || !o.npeers) {
        fprintf(stderr, "apiary swarm %s: needs --run-id (1..100 bytes) and --initial-peers\n",
                sub);
        goto out;
    }
    if (o.record_ttl > 0 && o.record_ttl < 3 * o.period * (1 - 1e-9)) {
        fprintf(stderr,
                "apiary swarm %s: --record-ttl %g is below 3 announcement periods (%g s): a "
                "record must outlive two missed refreshes; give at least %g or a shorter "
                "--announce-period\n",
                sub, o.record_ttl, 3 * o.period, 3 * o.period);
        goto out;
    }
    if (o.width % o.heads) {
        fprintf(stderr, "apiary swarm %s: --width must be a multiple of --heads\n", sub);
        goto out;
    }
    rc = server ? run_server(&o) : run_trainer(&o);
out:
    for (int i = 0; i < o.npeers; i++) free(o.peers[i]);
    return rc;
}

AP_CLI_COMMAND(cmd_swarm, "swarm", swarm_main,
               "SWARM pipeline training: stage servers, trainers, a demo (apiary swarm --help)")
