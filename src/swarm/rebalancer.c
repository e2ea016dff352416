/* The live rebalancing loop of a stage server: after a randomised delay it
 * reads every stage's records, computes the plan every server computes from
 * the same view (ap_swarm_rebalance_plan) and, when the plan moves this
 * server, hands the move to its owner, who downloads the new stage's state
 * and switches the server (ap_swarm_server_set_stage). Sans-I/O. */
#include "apiary/log.h"
#include "apiary/swarm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD          "swarm"
#define PERIOD_MIN   100000 /* us */
#define MARGIN_DEF   0.05
#define COOLDOWN_DEF 2
#define MEMBERS_MAX  AP_SWARM_BALANCER_MAX

struct ap_swarm_rebalancer {
    ap_rt_t *rt;
    ap_dht_t *dht;
    ap_swarm_server_t *s;
    char run[AP_SWARM_RUN_MAX + 1];
    uint32_t S;
    ap_swarm_rebalance_opts_t o;
    ap_swarm_move_fn fn;
    void *arg;
    uint64_t timer_id, read_us; /* when the view's read began */
    ap_swarm_watch_t *w;
    bool moving, dying, in_cb;
    uint32_t cooldown; /* checks left before this server may move again */
    ap_swarm_member_t *m;
    int64_t *exp;
    uint32_t *to;
    ap_swarm_rebalance_stats_t st;
};

static void arm(ap_swarm_rebalancer_t *rb);

/* Throughputs rounded to an eighth of an octave (about 9 %) before
 * planning: servers read their views at different moments, and measurement
 * noise below that step then does not change the plan from one server's view
 * to another's (the plan itself needs a 5 % gain). */
static double coarse(double v)
{
    return exp2(round(log2(v) * 8.0) / 8.0);
}

static void destroy(ap_swarm_rebalancer_t *rb)
{
    free(rb->m);
    free(rb->exp);
    free(rb->to);
    free(rb);
}

/* Decides from one view; true when a move was handed to the owner. */
static bool decide(ap_swarm_rebalancer_t *rb, const ap_dht_result_t *res, uint32_t n)
{
    const int64_t wall = ap_rt_wall_ms(rb->rt);
    int k = ap_swarm_members_from(res, n, wall, rb->m, rb->exp, MEMBERS_MAX - 1);
    if (k < 0) {
        rb->st.skipped++;
        return false;
    }
    /* A record whose owner stopped refreshing it (made over 1.5 periods ago,
     * plus the time this read took) is left out: its server is gone, and
     * counting it until its record expires (a TTL of 3 periods or more)
     * would hide the hole it left. */
    const uint64_t now = ap_rt_now_us(rb->rt);
    const int64_t slack = (int64_t)((now > rb->read_us ? now - rb->read_us : 0) / 1000);
    const ap_peer_id_t *me = ap_rt_self(rb->rt);
    size_t cnt = 0, self;
    for (size_t i = 0; i < (size_t)k; i++) {
        if (ap_peer_id_cmp(&rb->m[i].peer, me) != 0 &&
            ap_swarm_member_stale(&rb->m[i], wall, slack)) {
            rb->st.stale++;
            continue;
        }
        rb->m[cnt++] = rb->m[i];
    }
    for (self = 0; self < cnt; self++)
        if (ap_peer_id_cmp(&rb->m[self].peer, me) == 0) break;
    /* This server's own state is known better than its record says: the
     * record may lag a move or a new measurement. */
    const uint32_t cur = ap_swarm_server_stage(rb->s);
    const double thr = ap_swarm_server_throughput(rb->s);
    if (self == cnt) {
        rb->m[cnt] = (ap_swarm_member_t){.peer = *me};
        cnt++;
    }
    rb->m[self].stage = cur;
    if (thr > 0) rb->m[self].throughput = thr;
    /* Decide only on records with a throughput, measured or estimated (a
     * newcomer or a mover announces the compute of a synthetic call at once):
     * a server announcing 0 (leaving for another stage, or not yet estimated)
     * would look like an empty place to fill, and a move under way must
     * finish before anyone plans again. */
    uint32_t per[AP_SWARM_STAGES_MAX] = {0};
    for (size_t i = 0; i < cnt; i++) {
        if (!(rb->m[i].throughput > 0)) {
            rb->st.skipped++;
            return false;
        }
        rb->m[i].throughput = coarse(rb->m[i].throughput);
        per[rb->m[i].stage]++;
    }
    const double before = ap_swarm_pipeline_throughput(rb->m, NULL, cnt, rb->S);
    if (AP_LOG_ENABLED(AP_LOG_DEBUG)) {
        char line[256];
        int len =
            snprintf(line, sizeof line, "rebalancing: view of %zu servers, stage totals", cnt);
        for (uint32_t t = 0; t < rb->S && len > 0 && (size_t)len < sizeof line; t++) {
            double tot = 0;
            for (size_t i = 0; i < cnt; i++)
                if (rb->m[i].stage == t) tot += rb->m[i].throughput;
            len += snprintf(line + len, sizeof line - (size_t)len, " %.0f/%u", tot, per[t]);
        }
        ap_debug(MOD, "%s", line);
    }
    int movers = ap_swarm_rebalance_plan(rb->m, cnt, rb->S, rb->o.margin, rb->to);
    if (movers < 0) {
        rb->st.skipped++;
        return false;
    }
    rb->st.last_min = before;
    rb->st.last_planned =
        movers > 0 ? ap_swarm_pipeline_throughput(rb->m, rb->to, cnt, rb->S) : before;
    const uint32_t to = rb->to[self];
    if (to == cur) return false;
    /* Never empty a stage: half of a swap whose partner has not moved yet
     * would, if this server is its stage's last. */
    if (per[cur] < 2) {
        rb->st.skipped++;
        return false;
    }
    if (rb->cooldown) {
        rb->st.skipped++;
        return false;
    }
    ap_info(MOD, "rebalancing: moving from stage %u to stage %u (pipeline %.1f -> %.1f)", cur, to,
            before, rb->st.last_planned);
    ap_swarm_server_leave(rb->s, true); /* the others hold off until the move is over */
    rb->moving = true;
    rb->st.moves++;
    rb->fn(rb, rb->arg, cur, to);
    return true;
}

static void on_view(ap_rt_t *rt, void *arg, int status, const ap_dht_result_t *res, uint32_t n)
{
    (void)rt;
    ap_swarm_rebalancer_t *rb = arg;
    ap_swarm_watch_free(rb->w); /* one read per check */
    rb->w = NULL;
    rb->st.checks++;
    if (rb->cooldown) rb->cooldown--;
    if (status) {
        rb->st.skipped++;
    } else {
        rb->in_cb = true;
        decide(rb, res, n);
        rb->in_cb = false;
    }
    if (rb->dying) { /* freed from the move callback */
        destroy(rb);
        return;
    }
    if (!rb->moving && !rb->timer_id) arm(rb);
}

static void on_timer(ap_rt_t *rt, void *arg)
{
    ap_swarm_rebalancer_t *rb = arg;
    rb->timer_id = 0;
    rb->read_us = ap_rt_now_us(rt);
    /* the watch reads at once; its own period never elapses before on_view */
    int rc =
        ap_swarm_watch_new(rt, rb->dht, rb->run, rb->S, rb->o.period_us * 4, on_view, rb, &rb->w);
    if (rc) {
        rb->st.skipped++;
        arm(rb);
    }
}

static void arm(ap_swarm_rebalancer_t *rb)
{
    const uint64_t d = ap_swarm_rebalance_delay(rb->o.period_us, ap_rt_rand_double(rb->rt));
    rb->timer_id = ap_rt_timer_start(rb->rt, d, 0, on_timer, rb);
    if (!rb->timer_id) ap_warn(MOD, "rebalancing: cannot arm the timer: out of memory");
}

int ap_swarm_rebalancer_new(ap_rt_t *rt, ap_swarm_server_t *s, ap_dht_t *dht, const char *run,
                            uint32_t nstages, const ap_swarm_rebalance_opts_t *opts,
                            ap_swarm_move_fn fn, void *arg, ap_swarm_rebalancer_t **out)
{
    if (!rt || !s || !dht || !run || !fn || !out || !nstages || nstages > AP_SWARM_STAGES_MAX ||
        ap_swarm_server_stage(s) >= nstages)
        return AP_EINVAL;
    char key[AP_SWARM_KEY_MAX];
    if (ap_swarm_stage_key(run, 0, key) < 0) return AP_EINVAL;
    ap_swarm_rebalance_opts_t o = {0};
    if (opts) o = *opts;
    if (o.period_us < PERIOD_MIN) return AP_EINVAL;
    if (o.margin == 0) o.margin = MARGIN_DEF;
    if (!(o.margin > 0) || o.margin > 10) return AP_EINVAL;
    if (o.cooldown == 0) o.cooldown = COOLDOWN_DEF;
    ap_swarm_rebalancer_t *rb = calloc(1, sizeof *rb);
    if (!rb) return AP_ENOMEM;
    rb->m = calloc(MEMBERS_MAX, sizeof *rb->m);
    rb->exp = calloc(MEMBERS_MAX, sizeof *rb->exp);
    rb->to = calloc(MEMBERS_MAX, sizeof *rb->to);
    if (!rb->m || !rb->exp || !rb->to) {
        destroy(rb);
        return AP_ENOMEM;
    }
    rb->rt = rt;
    rb->dht = dht;
    rb->s = s;
    memcpy(rb->run, run, strlen(run) + 1);
    rb->S = nstages;
    rb->o = o;
    rb->fn = fn;
    rb->arg = arg;
    arm(rb);
    if (!rb->timer_id) {
        destroy(rb);
        return AP_ENOMEM;
    }
    *out = rb;
    return 0;
}

void ap_swarm_rebalancer_moved(ap_swarm_rebalancer_t *rb, int status)
{
    if (!rb || !rb->moving || rb->dying) return;
    rb->moving = false;
    if (status) {
        rb->st.failed_moves++;
        ap_info(MOD, "rebalancing: the move failed (%s); staying", ap_err_name(status));
        ap_swarm_server_leave(rb->s, false);
    }
    rb->cooldown = rb->o.cooldown;
    if (!rb->timer_id && !rb->in_cb) arm(rb);
}

void ap_swarm_rebalancer_free(ap_swarm_rebalancer_t *rb)
{
    if (!rb) return;
    if (rb->timer_id) ap_rt_timer_stop(rb->rt, rb->timer_id);
    rb->timer_id = 0;
    ap_swarm_watch_free(rb->w); /* fn is not called again */
    rb->w = NULL;
    if (rb->in_cb) { /* inside the move callback: on_view finishes */
        rb->dying = true;
        return;
    }
    destroy(rb);
}

void ap_swarm_rebalancer_stats(const ap_swarm_rebalancer_t *rb, ap_swarm_rebalance_stats_t *out)
{
    if (rb && out) *out = rb->st;
}
