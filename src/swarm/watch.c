/* Reading every stage's server records from the DHT on a timer: what
 * trainers route by and what the rebalancing loop plans from. Sans-I/O. */
#include "apiary/log.h"
#include "apiary/swarm.h"

#include <stdlib.h>
#include <string.h>

#define MOD        "swarm"
#define PERIOD_MIN 50000 /* us */

struct ap_swarm_watch {
    ap_rt_t *rt;
    ap_dht_t *dht;
    uint32_t S;
    char (*keys)[AP_SWARM_KEY_MAX];
    const uint8_t **kp;
    size_t *kl;
    uint64_t period_us, timer_id;
    ap_swarm_watch_fn fn;
    void *arg;
    bool getting, again, dying;
    bool in_fn; /* inside fn: a free from it is finished here */
    uint64_t reads, failures;
};

static void start_get(ap_swarm_watch_t *w);

static void watch_destroy(ap_swarm_watch_t *w)
{
    free(w->keys);
    free(w->kp);
    free(w->kl);
    free(w);
}

static void on_got(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res, size_t n)
{
    (void)dht;
    ap_swarm_watch_t *w = arg;
    w->getting = false;
    if (w->dying) {
        watch_destroy(w);
        return;
    }
    if (status || n != w->S) {
        w->failures++;
        ap_info(MOD, "reading the stage records failed: %s",
                ap_err_name(status ? status : AP_EPROTO));
        w->in_fn = true;
        if (w->fn) w->fn(w->rt, w->arg, status ? status : AP_EPROTO, NULL, w->S);
    } else {
        w->reads++;
        w->in_fn = true;
        if (w->fn) w->fn(w->rt, w->arg, 0, res, w->S);
    }
    w->in_fn = false;
    if (w->dying) { /* freed from its callback */
        watch_destroy(w);
        return;
    }
    if (w->again) {
        w->again = false;
        start_get(w);
    }
}

static void start_get(ap_swarm_watch_t *w)
{
    if (w->getting) {
        w->again = true;
        return;
    }
    w->getting = true;
    int rc = ap_dht_get_many(w->dht, w->kp, w->kl, w->S, true, on_got, w);
    if (rc) {
        w->getting = false;
        w->failures++;
    }
}

static void on_timer(ap_rt_t *rt, void *arg)
{
    (void)rt;
    start_get(arg);
}

int ap_swarm_watch_new(ap_rt_t *rt, ap_dht_t *dht, const char *run, uint32_t nstages,
                       uint64_t period_us, ap_swarm_watch_fn fn, void *arg, ap_swarm_watch_t **out)
{
    if (!rt || !dht || !run || !out || !nstages || nstages > AP_SWARM_STAGES_MAX ||
        period_us < PERIOD_MIN)
        return AP_EINVAL;
    ap_swarm_watch_t *w = calloc(1, sizeof *w);
    if (!w) return AP_ENOMEM;
    w->keys = calloc(nstages, sizeof *w->keys);
    w->kp = calloc(nstages, sizeof *w->kp);
    w->kl = calloc(nstages, sizeof *w->kl);
    if (!w->keys || !w->kp || !w->kl) {
        watch_destroy(w);
        return AP_ENOMEM;
    }
    for (uint32_t s = 0; s < nstages; s++) {
        int len = ap_swarm_stage_key(run, s, w->keys[s]);
        if (len < 0) {
            watch_destroy(w);
            return AP_EINVAL;
        }
        w->kp[s] = (const uint8_t *)w->keys[s];
        w->kl[s] = (size_t)len;
    }
    w->rt = rt;
    w->dht = dht;
    w->S = nstages;
    w->period_us = period_us;
    w->fn = fn;
    w->arg = arg;
    w->timer_id = ap_rt_timer_start(rt, period_us, period_us, on_timer, w);
    if (!w->timer_id) {
        watch_destroy(w);
        return AP_ENOMEM;
    }
    start_get(w);
    *out = w;
    return 0;
}

void ap_swarm_watch_now(ap_swarm_watch_t *w)
{
    if (w && !w->dying) start_get(w);
}

void ap_swarm_watch_free(ap_swarm_watch_t *w)
{
    if (!w) return;
    ap_rt_timer_stop(w->rt, w->timer_id);
    w->dying = true;
    w->fn = NULL;
    if (!w->getting && !w->in_fn) watch_destroy(w);
}

uint64_t ap_swarm_watch_reads(const ap_swarm_watch_t *w)
{
    return w ? w->reads : 0;
}

int ap_swarm_members_from(const ap_dht_result_t *res, uint32_t nstages, int64_t wall_ms,
                          ap_swarm_member_t *m, int64_t *expires_ms, size_t max)
{
    if (!res || !m || !expires_ms || !nstages) return AP_EINVAL;
    size_t n = 0;
    for (uint32_t s = 0; s < nstages; s++) {
        const ap_dht_result_t *r = &res[s];
        if (!r->found || !r->is_dict) continue;
        for (size_t i = 0; i < r->nrecords; i++) {
            const ap_dht_record_t *rec = &r->records[i];
            ap_swarm_announce_t a;
            ap_peer_id_t peer;
            if (rec->expiration_ms <= wall_ms || ap_swarm_announce_owner(rec, &peer) ||
                ap_swarm_announce_decode(rec->value, rec->value_len, &a))
                continue;
            /* a server that moved keeps a record in its old stage until it
             * expires: the one expiring last is where it is now */
            size_t k;
            for (k = 0; k < n; k++)
                if (ap_peer_id_cmp(&m[k].peer, &peer) == 0) break;
            if (k < n && expires_ms[k] >= rec->expiration_ms) continue;
            if (k == n) {
                if (n == max) return AP_ELIMIT;
                m[n].peer = peer;
                n++;
            }
            m[k].stage = s;
            m[k].throughput = a.throughput;
            m[k].estimate = a.estimate;
            m[k].made_ms = a.ttl_ms && rec->expiration_ms > (int64_t)a.ttl_ms
                               ? rec->expiration_ms - (int64_t)a.ttl_ms
                               : 0;
            m[k].period_ms = a.period_ms;
            expires_ms[k] = rec->expiration_ms;
        }
    }
    return (int)n;
}
