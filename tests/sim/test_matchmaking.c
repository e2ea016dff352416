/* Matchmaking over the DHT on the simulator: groups at target size, min size
 * at the deadline, a dead leader, many concurrent searchers with crashes
 * (everyone ends in a group or fails cleanly by its deadline, and every
 * member of a group holds the same group), every member's gathered bytes
 * reaching the whole group (and never the DHT), and a full ap_averager_step
 * that finds its group and gives the exact weighted mean. */
#include "aptest.h"

#include "apiary/averager.h"
#include "apiary/avg.h"
#include "apiary/btard.h"
#include "apiary/dht.h"
#include "apiary/log.h"
#include "apiary/sim.h"
#include "averaging/allreduce.h"
#include "averaging/matchmaking.h"
#include "matchmaking.pb-c.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 16
#define SEC  1000000ull

typedef struct node {
    ap_dht_t *dht;
    ap_avg_service_t *svc;
    ap_avg_matchmaker_t *mm;
    bool crashed;
    /* the search */
    bool searching, ended;
    int status;
    uint64_t ended_at;
    ap_avg_search_t *search;
    uint8_t gid[AP_AVG_GROUP_ID_LEN];
    ap_avg_member_t mem[MAXN];
    size_t n;
    bool has_gather;
    size_t glen[MAXN];
    uint8_t gather[MAXN][AP_AVG_GATHER_MAX];
} node_t;

typedef struct env {
    ap_sim_t *sim;
    int n;
    node_t nd[MAXN];
} env_t;

static void on_crash(ap_sim_t *sim, int i, ap_rt_t *rt, void *arg)
{
    (void)sim, (void)rt;
    env_t *e = arg;
    node_t *d = &e->nd[i];
    ap_dht_free(d->dht);
    d->dht = NULL;
    ap__avg_matchmaker_abandon(d->mm);
    d->mm = NULL;
    ap__avg_service_abandon(d->svc);
    d->svc = NULL;
}

static void env_init(env_t *e, int n, uint64_t seed)
{
    memset(e, 0, sizeof *e);
    e->sim = ap_sim_new(seed);
    assert_non_null(e->sim);
    e->n = n;
    for (int i = 0; i < n; i++) {
        ap_sim_node_opts_t so = {.on_crash = on_crash, .hook_arg = e};
        assert_int_equal(ap_sim_add_node(e->sim, &so), i);
    }
    for (int i = 0; i < n; i++) {
        node_t *d = &e->nd[i];
        ap_rt_t *rt = ap_sim_node(e->sim, i);
        ap_dht_config_t cfg;
        ap_dht_config_default(&cfg);
        assert_ok(ap_dht_new(rt, &cfg, &d->dht));
        assert_ok(ap_avg_service_new(rt, &d->svc));
        assert_ok(ap_avg_matchmaker_new(d->svc, d->dht, &d->mm));
    }
    /* a small swarm: everyone knows everyone */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            if (i == j) continue;
            char a[32];
            snprintf(a, sizeof a, "/sim/%d", j);
            assert_ok(ap_dht_add_peer(e->nd[i].dht, ap_sim_peer_id(e->sim, j), a));
        }
}

static void env_free(env_t *e)
{
    for (int i = 0; i < e->n; i++) {
        node_t *d = &e->nd[i];
        if (d->crashed) continue;
        ap_dht_free(d->dht);
        assert_ok(ap_avg_matchmaker_free(d->mm));
        assert_ok(ap_avg_service_free(d->svc));
    }
    ap_sim_free(e->sim);
}

static void crash(env_t *e, int i)
{
    e->nd[i].crashed = true;
    assert_ok(ap_sim_crash(e->sim, i));
}

static void on_match(ap_rt_t *rt, void *arg, int status, const ap_avg_group_t *g)
{
    node_t *d = arg;
    d->ended = true;
    d->search = NULL;
    d->status = status;
    d->ended_at = ap_rt_now_us(rt);
    if (status == 0) {
        assert_true(g->n <= MAXN);
        memcpy(d->gid, g->id, sizeof d->gid);
        memcpy(d->mem, g->members, g->n * sizeof *g->members);
        d->n = g->n;
        d->has_gather = g->gather != NULL;
        for (size_t k = 0; g->gather && k < g->n; k++) {
            assert_true(g->gather[k].len <= AP_AVG_GATHER_MAX);
            d->glen[k] = g->gather[k].len;
            if (d->glen[k]) memcpy(d->gather[k], g->gather[k].data, d->glen[k]);
        }
    }
}

static const uint8_t KEY[] = "test-run/step-7";

static void search(env_t *e, int i, uint32_t target, uint32_t min, uint64_t deadline_us)
{
    node_t *d = &e->nd[i];
    ap_rt_t *rt = ap_sim_node(e->sim, i);
    ap_avg_member_t me = {
        .id = *ap_rt_self(rt), .role = AP_AVG_NORMAL, .up = 1e6 * (1 + i), .down = 2e6};
    ap_avg_match_t m = {.key = KEY,
                        .key_len = sizeof KEY - 1,
                        .target_group_size = target,
                        .min_group_size = min,
                        .deadline_at_us = ap_rt_now_us(rt) + deadline_us};
    d->searching = true;
    d->ended = false;
    assert_ok(ap_avg_match_start(d->mm, &m, &me, on_match, d, &d->search));
    /* one search per key at a time */
    assert_int_equal(ap_avg_match_start(d->mm, &m, &me, on_match, d, NULL), AP_EBUSY);
}

/* As search(), keeping the peers of bl out. */
static void search_excluding(env_t *e, int i, uint32_t target, uint32_t min, uint64_t deadline_us,
                             ap_btard_banlist_t *bl)
{
    node_t *d = &e->nd[i];
    ap_rt_t *rt = ap_sim_node(e->sim, i);
    ap_avg_member_t me = {
        .id = *ap_rt_self(rt), .role = AP_AVG_NORMAL, .up = 1e6 * (1 + i), .down = 2e6};
    ap_avg_match_t m = {.key = KEY,
                        .key_len = sizeof KEY - 1,
                        .target_group_size = target,
                        .min_group_size = min,
                        .deadline_at_us = ap_rt_now_us(rt) + deadline_us,
                        .exclude = ap_btard_banlist_has,
                        .exclude_arg = bl};
    d->searching = true;
    d->ended = false;
    assert_ok(ap_avg_match_start(d->mm, &m, &me, on_match, d, &d->search));
}

static bool all_ended(void *arg)
{
    env_t *e = arg;
    for (int i = 0; i < e->n; i++)
        if (e->nd[i].searching && !e->nd[i].crashed && !e->nd[i].ended) return false;
    return true;
}

static int index_of(env_t *e, const ap_peer_id_t *id)
{
    return ap_sim_find_peer(e->sim, id);
}

/* Every live peer that got a group: it is in it, every other live member got
 * the very same group (id, order, declarations), and the leader (member 0)
 * expires first. Returns the number of groups. */
static int check_groups(env_t *e, uint32_t min, uint32_t target)
{
    int groups = 0;
    for (int i = 0; i < e->n; i++) {
        node_t *d = &e->nd[i];
        if (d->crashed || !d->searching || d->status) continue;
        assert_true(d->n >= min && d->n <= target);
        bool self_in = false, first = true;
        for (size_t k = 0; k < d->n; k++) {
            int j = index_of(e, &d->mem[k].id);
            assert_true(j >= 0);
            if (j == i) self_in = true;
            if (j < i) first = false;
            /* the declared bandwidth travelled with the group */
            assert_true(d->mem[k].up == 1e6 * (1 + j) && d->mem[k].down == 2e6);
            for (size_t l = 0; l < k; l++)
                assert_false(ap_peer_id_eq(&d->mem[k].id, &d->mem[l].id));
            node_t *o = &e->nd[j];
            if (o->crashed) continue;
            assert_int_equal(o->status, 0);
            assert_memory_equal(o->gid, d->gid, sizeof d->gid);
            assert_int_equal(o->n, d->n);
            assert_memory_equal(o->mem, d->mem, d->n * sizeof *d->mem);
        }
        assert_true(self_in);
        if (first) groups++; /* count each group once: at its lowest index member */
    }
    return groups;
}

static void test_target_size(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 8, ap_test_seed(601));
    for (int i = 0; i < 8; i++) {
        search(&e, i, 4, 2, 5 * SEC + (uint64_t)i * 10000);
        ap_sim_run_for(e.sim, 1000);
    }
    uint64_t t0 = ap_sim_now_us(e.sim);
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    for (int i = 0; i < 8; i++) {
        assert_int_equal(e.nd[i].status, 0);
        assert_int_equal(e.nd[i].n, 4);
        /* full groups begin at once, not at the deadline */
        assert_true(e.nd[i].ended_at < t0 + 4 * SEC);
    }
    assert_int_equal(check_groups(&e, 2, 4), 2);
    env_free(&e);
}

static void test_min_size_at_deadline(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 5, ap_test_seed(602));
    /* 3 searchers, target 8: the leader begins at its deadline with 3 */
    for (int i = 0; i < 3; i++) search(&e, i, 8, 2, 2 * SEC + (uint64_t)i * 100000);
    uint64_t t0 = ap_sim_now_us(e.sim);
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    for (int i = 0; i < 3; i++) {
        assert_int_equal(e.nd[i].status, 0);
        assert_int_equal(e.nd[i].n, 3);
        assert_true(e.nd[i].ended_at >= t0 + 2 * SEC);
        assert_true(e.nd[i].ended_at < t0 + 3 * SEC);
        /* the earliest-expiring peer leads */
        assert_int_equal(index_of(&e, &e.nd[i].mem[0].id), 0);
    }
    assert_int_equal(check_groups(&e, 2, 8), 1);
    /* a lone searcher fails cleanly at its deadline */
    search(&e, 4, 8, 2, 1 * SEC);
    t0 = ap_sim_now_us(e.sim);
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    assert_int_equal(e.nd[4].status, AP_ETIMEDOUT);
    assert_true(e.nd[4].ended_at >= t0 + SEC && e.nd[4].ended_at < t0 + 2 * SEC);
    env_free(&e);
}

/* Peers 0 and 3 are banned: the others never join them and reject their
 * joins, so the other four form one group and the banned ones none. */
static void test_excluded_peers(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 6, ap_test_seed(607));
    ap_btard_banlist_t *bl = ap_btard_banlist_new();
    assert_non_null(bl);
    assert_int_equal(ap_btard_banlist_add(bl, ap_rt_self(ap_sim_node(e.sim, 0))), 1);
    assert_int_equal(ap_btard_banlist_add(bl, ap_rt_self(ap_sim_node(e.sim, 3))), 1);
    assert_int_equal(ap_btard_banlist_add(bl, ap_rt_self(ap_sim_node(e.sim, 3))), 0);
    assert_int_equal(ap_btard_banlist_count(bl), 2);
    for (int i = 0; i < 6; i++) {
        if (i == 0 || i == 3)
            search(&e, i, 6, 2, 3 * SEC + (uint64_t)i * 10000);
        else
            search_excluding(&e, i, 6, 2, 3 * SEC + (uint64_t)i * 10000, bl);
        ap_sim_run_for(e.sim, 1000);
    }
    uint64_t t0 = ap_sim_now_us(e.sim);
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    for (int i = 0; i < 6; i++) {
        if (i == 0 || i == 3) {
            /* 0 and 3 may find each other, never anyone else */
            if (e.nd[i].status == 0) {
                assert_int_equal(e.nd[i].n, 2);
                for (size_t k = 0; k < e.nd[i].n; k++) {
                    int j = index_of(&e, &e.nd[i].mem[k].id);
                    assert_true(j == 0 || j == 3);
                }
            }
            continue;
        }
        assert_int_equal(e.nd[i].status, 0);
        assert_int_equal(e.nd[i].n, 4);
        for (size_t k = 0; k < e.nd[i].n; k++)
            assert_false(ap_btard_banlist_has(bl, &e.nd[i].mem[k].id));
    }
    ap_btard_banlist_free(bl);
    env_free(&e);
}

static void test_dead_leader(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 6, ap_test_seed(603));
    for (int i = 0; i < 4; i++) search(&e, i, 8, 2, 2 * SEC + (uint64_t)i * 100000);
    uint64_t t0 = ap_sim_now_us(e.sim);
    ap_sim_run_for(e.sim, SEC); /* the others wait at node 0 by now */
    crash(&e, 0);
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    for (int i = 1; i < 4; i++) {
        assert_int_equal(e.nd[i].status, 0);
        assert_int_equal(e.nd[i].n, 3);
        assert_int_equal(index_of(&e, &e.nd[i].mem[0].id), 1); /* the next one leads */
        /* not stalled beyond the new leader's deadline */
        assert_true(e.nd[i].ended_at < t0 + 2 * SEC + 200000);
    }
    assert_int_equal(check_groups(&e, 2, 8), 1);
    env_free(&e);
}

static void test_concurrent_with_crashes(void **state)
{
    (void)state;
    const int n = ap_test_sanitized() ? 10 : 16;
    env_t e;
    env_init(&e, n, ap_test_seed(604));
    uint64_t rng = ap_test_seed(604) | 1;
    uint64_t max_deadline = 0;
    for (int i = 0; i < n; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        uint64_t dl = SEC + rng % (2 * SEC);
        if (dl > max_deadline) max_deadline = dl;
        search(&e, i, 5, 2, dl);
        ap_sim_run_for(e.sim, rng % 50000);
    }
    uint64_t t0 = ap_sim_now_us(e.sim);
    ap_sim_run_for(e.sim, 300000);
    crash(&e, (int)(rng % (uint64_t)n)); /* somebody, maybe a leader */
    crash(&e, (int)((rng >> 20) % (uint64_t)n) == (int)(rng % (uint64_t)n)
                  ? (int)((rng % (uint64_t)n + 1) % (uint64_t)n)
                  : (int)((rng >> 20) % (uint64_t)n));
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + max_deadline + 10 * SEC));
    int ok = 0;
    for (int i = 0; i < n; i++) {
        node_t *d = &e.nd[i];
        if (d->crashed) continue;
        assert_true(d->status == 0 || d->status == AP_ETIMEDOUT);
        /* by its own deadline plus the answer grace */
        assert_true(d->ended_at <= t0 + max_deadline + 2 * SEC + 100000);
        if (d->status == 0) ok++;
    }
    int groups = check_groups(&e, 2, 5);
    assert_true(groups >= 1);
    assert_true(ok >= n - 2 - 1); /* at most one live peer left alone */
    env_free(&e);
}

static void test_cancel(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 3, ap_test_seed(605));
    search(&e, 0, 8, 2, 3 * SEC);
    search(&e, 1, 8, 2, 3 * SEC + 100000);
    ap_sim_run_for(e.sim, SEC); /* 1 waits at 0 */
    ap_avg_match_cancel(e.nd[0].search);
    assert_true(e.nd[0].ended);
    assert_int_equal(e.nd[0].status, AP_ECANCELED);
    uint64_t t0 = ap_sim_now_us(e.sim);
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    /* told "rejected": it ends alone at its own deadline */
    assert_int_equal(e.nd[1].status, AP_ETIMEDOUT);
    env_free(&e);
}

/* LEAVE: a held follower that gives up is dropped by its leader at once. L
 * (target 3) holds A; A cancels; then B joins. Without LEAVE, L would count
 * A and B and begin at once with A in the group (gone: the round would wait
 * connect_grace_us for it); with it, L holds B only and begins at its
 * deadline with {L, B}. */
static void test_follower_leaves(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 4, ap_test_seed(606));
    uint64_t t0 = ap_sim_now_us(e.sim);
    search(&e, 0, 3, 2, 3 * SEC);
    search(&e, 1, 3, 2, 3 * SEC + 100000);
    ap_sim_run_for(e.sim, SEC); /* 1 waits at 0 */
    assert_false(e.nd[1].ended);
    ap_avg_match_cancel(e.nd[1].search);
    assert_int_equal(e.nd[1].status, AP_ECANCELED);
    ap_sim_run_for(e.sim, 200000); /* the LEAVE arrives */
    search(&e, 2, 3, 2, 3 * SEC);  /* expires after 0: follows it */
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    for (int i = 0; i <= 2; i += 2) {
        assert_int_equal(e.nd[i].status, 0);
        assert_int_equal(e.nd[i].n, 2);
        assert_int_equal(index_of(&e, &e.nd[i].mem[0].id), 0);
        assert_int_equal(index_of(&e, &e.nd[i].mem[1].id), 2);
        /* it began at its deadline, not when B joined */
        assert_true(e.nd[i].ended_at >= t0 + 3 * SEC);
    }
    assert_int_equal(memcmp(e.nd[0].gid, e.nd[2].gid, sizeof e.nd[0].gid), 0);
    env_free(&e);
}

/* ---- bad input at a leader ------------------------------------------------------ */

typedef struct call {
    bool done;
    int status;
    uint32_t code;
    char reason[AP__MM_REASON_MAX];
    size_t n;
} call_t;

static void on_call(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    (void)rt, (void)errmsg;
    call_t *c = arg;
    c->done = true;
    c->status = status;
    if (status) return;
    ap__mm_resp_t r;
    assert_ok(ap__mm_resp_decode(resp, len, &r));
    c->code = r.code;
    memcpy(c->reason, r.reason, sizeof c->reason);
    c->n = r.n;
    free(r.members);
}

static void call_join(env_t *e, int from, const uint8_t *key, size_t key_len, int as,
                      int64_t exp_ms, call_t *c)
{
    ap_rt_t *rt = ap_sim_node(e->sim, from);
    ap__mm_member_t m;
    memset(&m, 0, sizeof m);
    m.id = *ap_sim_peer_id(e->sim, as);
    m.role = AP_AVG_NORMAL;
    m.up = m.down = 1e6;
    m.exp_ms = exp_ms;
    uint8_t *b;
    size_t n;
    assert_ok(ap__mm_req_encode(key, key_len, &m, false, &b, &n));
    memset(c, 0, sizeof *c);
    assert_true(ap_rt_rpc_call(rt, ap_sim_peer_id(e->sim, 0), AP_AVG_MATCH_PROTO, b, n, NULL,
                               on_call, c) != 0);
    free(b);
}

static bool call_done(void *arg)
{
    return ((call_t *)arg)->done;
}

static void test_bad_joins(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 3, ap_test_seed(608));
    search(&e, 0, 8, 2, 3 * SEC);
    int64_t wall = ap_rt_wall_ms(ap_sim_node(e.sim, 1));
    uint64_t lim = ap_sim_now_us(e.sim) + 10 * SEC;
    call_t c, held, again;
    /* garbage */
    memset(&c, 0, sizeof c);
    assert_true(ap_rt_rpc_call(ap_sim_node(e.sim, 1), ap_sim_peer_id(e.sim, 0), AP_AVG_MATCH_PROTO,
                               (const uint8_t *)"\xff\xff\xff", 3, NULL, on_call, &c) != 0);
    assert_true(ap_sim_run_until(e.sim, call_done, &c, lim));
    assert_int_equal(c.status, AP_EPROTO);
    /* naming another peer */
    call_join(&e, 1, KEY, sizeof KEY - 1, 2, wall + 10000, &c);
    assert_true(ap_sim_run_until(e.sim, call_done, &c, lim));
    assert_int_equal(c.code, AP__MM_REJECTED);
    assert_string_equal(c.reason, "peer id is not the caller's");
    /* an asker that expires earlier than the leader: never waits for it */
    call_join(&e, 1, KEY, sizeof KEY - 1, 1, wall + 100, &c);
    assert_true(ap_sim_run_until(e.sim, call_done, &c, lim));
    assert_int_equal(c.code, AP__MM_REJECTED);
    assert_string_equal(c.reason, "leader does not expire earlier");
    /* another key */
    call_join(&e, 2, (const uint8_t *)"other", 5, 2, wall + 10000, &c);
    assert_true(ap_sim_run_until(e.sim, call_done, &c, lim));
    assert_int_equal(c.code, AP__MM_REJECTED);
    assert_string_equal(c.reason, "not looking for this group");
    /* accepted: held; the same peer again is refused */
    call_join(&e, 1, KEY, sizeof KEY - 1, 1, wall + 10000, &held);
    ap_sim_run_for(e.sim, 100000);
    assert_false(held.done);
    call_join(&e, 1, KEY, sizeof KEY - 1, 1, wall + 10000, &again);
    assert_true(ap_sim_run_until(e.sim, call_done, &again, lim));
    assert_int_equal(again.code, AP__MM_REJECTED);
    assert_string_equal(again.reason, "already joined");
    /* at its deadline the leader begins with the one it holds */
    assert_true(ap_sim_run_until(e.sim, call_done, &held, lim));
    assert_int_equal(held.status, 0);
    assert_int_equal(held.code, AP__MM_BEGIN);
    assert_int_equal(held.n, 2);
    assert_true(e.nd[0].ended);
    assert_int_equal(e.nd[0].status, 0);
    assert_int_equal(e.nd[0].n, 2);
    assert_int_equal(index_of(&e, &e.nd[0].mem[1].id), 1);
    env_free(&e);
}

/* Each of 6 peers gives its group bytes of its own (peer 5 none, peer 4 the
 * most there may be): every member of both groups gets every member's bytes,
 * in the group's order; the DHT's declarations carry none of them. */
static void test_gather(void **state)
{
    (void)state;
    env_t e;
    env_init(&e, 6, ap_test_seed(608));
    static uint8_t g[6][AP_AVG_GATHER_MAX];
    size_t gl[6];
    for (int i = 0; i < 6; i++) {
        gl[i] = i == 4 ? AP_AVG_GATHER_MAX : i == 5 ? 0 : (size_t)(3 + 40 * i);
        for (size_t k = 0; k < gl[i]; k++) g[i][k] = (uint8_t)(i * 31 + k);
    }
    for (int i = 0; i < 6; i++) {
        node_t *d = &e.nd[i];
        ap_rt_t *rt = ap_sim_node(e.sim, i);
        ap_avg_member_t me = {
            .id = *ap_rt_self(rt), .role = AP_AVG_NORMAL, .up = 1e6 * (1 + i), .down = 2e6};
        ap_avg_match_t m = {.key = KEY,
                            .key_len = sizeof KEY - 1,
                            .target_group_size = 3,
                            .min_group_size = 2,
                            .deadline_at_us = ap_rt_now_us(rt) + 5 * SEC + (uint64_t)i * 10000,
                            .gather = gl[i] ? g[i] : NULL,
                            .gather_len = gl[i]};
        if (i == 0) { /* more than a member may give, or a length without bytes */
            m.gather_len = AP_AVG_GATHER_MAX + 1;
            assert_int_equal(ap_avg_match_start(d->mm, &m, &me, on_match, d, NULL), AP_EINVAL);
            m.gather = NULL;
            m.gather_len = 1;
            assert_int_equal(ap_avg_match_start(d->mm, &m, &me, on_match, d, NULL), AP_EINVAL);
            m.gather = g[i];
            m.gather_len = gl[i];
        }
        d->searching = true;
        assert_ok(ap_avg_match_start(d->mm, &m, &me, on_match, d, &d->search));
        ap_sim_run_for(e.sim, 1000);
    }
    uint64_t t0 = ap_sim_now_us(e.sim);
    assert_true(ap_sim_run_until(e.sim, all_ended, &e, t0 + 10 * SEC));
    assert_int_equal(check_groups(&e, 3, 3), 2);
    for (int i = 0; i < 6; i++) {
        node_t *d = &e.nd[i];
        assert_int_equal(d->status, 0);
        assert_true(d->has_gather);
        for (size_t k = 0; k < d->n; k++) {
            int j = index_of(&e, &d->mem[k].id);
            assert_int_equal(d->glen[k], gl[j]);
            if (gl[j]) assert_memory_equal(d->gather[k], g[j], gl[j]);
        }
    }
    env_free(&e);
}

/* ---- a full step ------------------------------------------------------------- */

#define NT 2
static const size_t sizes[NT] = {333, 1000};

typedef struct stepper {
    ap_averager_step_t *st;
    int calls;
} stepper_t;

static void on_step(ap_rt_t *rt, void *arg, ap_averager_step_t *st)
{
    (void)rt, (void)st;
    ((stepper_t *)arg)->calls++;
}

typedef struct steps {
    stepper_t *s;
    int n;
} steps_t;

static bool steps_over(void *arg)
{
    steps_t *x = arg;
    for (int i = 0; i < x->n; i++) {
        ap_averager_stage_t g = ap_averager_step_stage(x->s[i].st);
        if (g == AP_AVERAGER_STAGE_LOOKING || g == AP_AVERAGER_STAGE_RUNNING) return false;
    }
    return true;
}

static void test_averager_step(void **state)
{
    (void)state;
    enum { N = 4 };
    env_t e;
    env_init(&e, N, ap_test_seed(606));
    ap_averager_t *av[N];
    stepper_t s[N];
    memset(s, 0, sizeof s);
    double w[N];
    float *orig[N];
    uint64_t rng = ap_test_seed(606) | 1;
    size_t total = sizes[0] + sizes[1];
    for (int i = 0; i < N; i++) {
        ap_averager_opts_t o = {.role = AP_AVG_NORMAL, .round = {.chunk_elems = 128}};
        assert_ok(ap_averager_new(e.nd[i].svc, sizes, NT, &o, &av[i]));
        orig[i] = malloc(total * sizeof(float));
        size_t at = 0;
        for (size_t t = 0; t < NT; t++) {
            float *x = ap_averager_tensor(av[i], t, NULL);
            for (size_t k = 0; k < sizes[t]; k++) {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                orig[i][at++] = x[k] = (float)((double)(rng >> 11) / 9007199254740992.0 - 0.5);
            }
        }
        w[i] = 1 + i;
    }
    for (int i = 0; i < N; i++) {
        ap_rt_t *rt = ap_sim_node(e.sim, i);
        ap_avg_match_t m = {.key = KEY,
                            .key_len = sizeof KEY - 1,
                            .target_group_size = N,
                            .deadline_at_us = ap_rt_now_us(rt) + 3 * SEC + (uint64_t)i * 1000};
        assert_ok(ap_averager_step(av[i], e.nd[i].mm, &m, w[i], on_step, &s[i], &s[i].st));
        assert_int_equal(ap_averager_step_stage(s[i].st), AP_AVERAGER_STAGE_LOOKING);
        assert_int_equal(ap_averager_step_group_size(s[i].st), 0);
    }
    steps_t x = {s, N};
    assert_true(ap_sim_run_until(e.sim, steps_over, &x, ap_sim_now_us(e.sim) + 30 * SEC));
    for (int i = 0; i < N; i++) {
        assert_int_equal(ap_averager_step_stage(s[i].st), AP_AVERAGER_STAGE_DONE);
        assert_int_equal(s[i].calls, 1);
        assert_int_equal(ap_averager_step_group_size(s[i].st), N);
        assert_true(ap_averager_step_result(s[i].st)->averaged_fraction == 1.0);
        ap_averager_step_free(s[i].st);
    }
    size_t at = 0;
    for (size_t t = 0; t < NT; t++)
        for (size_t k = 0; k < sizes[t]; k++, at++) {
            double sum = 0, ws = 0;
            for (int j = 0; j < N; j++) sum += w[j] * orig[j][at], ws += w[j];
            for (int i = 0; i < N; i++) {
                double got = ap_averager_tensor(av[i], t, NULL)[k];
                if (fabs(got - sum / ws) > 1e-6 * fmax(1, fabs(sum / ws)))
                    fail_msg("peer %d tensor %zu elem %zu: %g want %g", i, t, k, got, sum / ws);
            }
        }
    /* a lone step fails cleanly with the search's status */
    ap_rt_t *rt = ap_sim_node(e.sim, 0);
    ap_avg_match_t m = {
        .key = KEY, .key_len = sizeof KEY - 1, .deadline_at_us = ap_rt_now_us(rt) + SEC};
    assert_ok(ap_averager_step(av[0], e.nd[0].mm, &m, 1, on_step, &s[0], &s[0].st));
    steps_t one = {s, 1};
    assert_true(ap_sim_run_until(e.sim, steps_over, &one, ap_sim_now_us(e.sim) + 5 * SEC));
    assert_int_equal(ap_averager_step_stage(s[0].st), AP_AVERAGER_STAGE_FAILED);
    assert_int_equal(ap_averager_step_result(s[0].st)->status, AP_ETIMEDOUT);
    ap_averager_step_free(s[0].st);
    for (int i = 0; i < N; i++) {
        assert_ok(ap_averager_free(av[i]));
        free(orig[i]);
    }
    env_free(&e);
}

/* ---- wire ------------------------------------------------------------------- */

static void test_wire(void **state)
{
    (void)state;
    ap_sim_t *sim = ap_sim_new(ap_test_seed(607));
    ap_sim_add_node(sim, NULL);
    ap_sim_add_node(sim, NULL);
    ap__mm_member_t a;
    memset(&a, 0, sizeof a);
    a.id = *ap_sim_peer_id(sim, 0);
    a.role = AP_AVG_CLIENT;
    a.up = 5e6;
    a.down = 7e6;
    a.exp_ms = 1735689600123;
    a.naddrs = 1;
    strcpy(a.addrs[0], "/ip4/127.0.0.1/tcp/4001");
    uint8_t *b;
    size_t n;
    /* request round trip */
    assert_ok(ap__mm_req_encode(KEY, sizeof KEY - 1, &a, false, &b, &n));
    uint8_t key[AP__MM_KEY_MAX];
    size_t kl;
    ap__mm_member_t d;
    bool leave = true;
    assert_ok(ap__mm_req_decode(b, n, key, &kl, &d, &leave));
    assert_int_equal(kl, sizeof KEY - 1);
    assert_memory_equal(&d, &a, sizeof d);
    assert_false(leave);
    assert_int_equal(d.gather_len, 0);
    for (size_t cut = 0; cut < n; cut++) /* truncations never decode into garbage */
        if (ap__mm_req_decode(b, cut, key, &kl, &d, &leave) == 0)
            assert_memory_equal(&d, &a, sizeof d);
    free(b);
    /* a LEAVE round trip */
    assert_ok(ap__mm_req_encode(KEY, sizeof KEY - 1, &a, true, &b, &n));
    assert_ok(ap__mm_req_decode(b, n, key, &kl, &d, &leave));
    assert_true(leave);
    assert_memory_equal(&d, &a, sizeof d);
    free(b);
    /* gathered bytes travel in a request and in a begin, never in a declaration */
    a.gather_len = AP_AVG_GATHER_MAX;
    memset(a.gather, 0xa5, a.gather_len);
    assert_ok(ap__mm_req_encode(KEY, sizeof KEY - 1, &a, false, &b, &n));
    assert_ok(ap__mm_req_decode(b, n, key, &kl, &d, &leave));
    assert_memory_equal(&d, &a, sizeof d);
    free(b);
    assert_ok(ap__mm_decl_encode(&a, &b, &n));
    assert_ok(ap__mm_decl_decode(b, n, &d));
    assert_int_equal(d.gather_len, 0);
    free(b);
    {
        /* a member giving more than AP_AVG_GATHER_MAX, or a declaration with
         * gathered bytes, is refused */
        static uint8_t big[AP_AVG_GATHER_MAX + 1];
        Apiary__Mm__Member pm = APIARY__MM__MEMBER__INIT;
        pm.peer.data = a.id.b;
        pm.peer.len = AP_PEER_ID_LEN;
        pm.up = pm.down = 1e6;
        pm.gather.data = big;
        pm.gather.len = sizeof big;
        Apiary__Mm__JoinRequest pr = APIARY__MM__JOIN_REQUEST__INIT;
        pr.group_key.data = (uint8_t *)KEY;
        pr.group_key.len = sizeof KEY - 1;
        pr.self = &pm;
        uint8_t raw[2048];
        size_t rn = apiary__mm__join_request__pack(&pr, raw);
        assert_int_equal(ap__mm_req_decode(raw, rn, key, &kl, &d, &leave), AP_ECORRUPT);
        pm.gather.len = AP_AVG_GATHER_MAX;
        rn = apiary__mm__join_request__pack(&pr, raw);
        assert_ok(ap__mm_req_decode(raw, rn, key, &kl, &d, &leave));
        pm.peer.len = 0;
        pm.gather.len = 1;
        rn = apiary__mm__member__pack(&pm, raw);
        assert_int_equal(ap__mm_decl_decode(raw, rn, &d), AP_ECORRUPT);
    }
    a.gather_len = 0;
    memset(a.gather, 0, sizeof a.gather);
    /* begin with a duplicate member is refused */
    ap__mm_member_t two[2] = {a, a};
    ap__mm_resp_t r = {.code = AP__MM_BEGIN, .members = two, .n = 2};
    assert_ok(ap__mm_resp_encode(&r, &b, &n));
    ap__mm_resp_t out;
    assert_int_equal(ap__mm_resp_decode(b, n, &out), AP_ECORRUPT);
    free(b);
    two[1].id = *ap_sim_peer_id(sim, 1);
    assert_ok(ap__mm_resp_encode(&r, &b, &n));
    assert_ok(ap__mm_resp_decode(b, n, &out));
    assert_int_equal(out.n, 2);
    assert_memory_equal(out.members, two, sizeof two);
    free(out.members);
    free(b);
    /* non-finite bandwidth in a declaration is refused */
    a.up = NAN;
    assert_ok(ap__mm_decl_encode(&a, &b, &n));
    assert_int_equal(ap__mm_decl_decode(b, n, &d), AP_ECORRUPT);
    free(b);
    /* the order is strict and total */
    ap_peer_id_t p0 = *ap_sim_peer_id(sim, 0), p1 = *ap_sim_peer_id(sim, 1);
    assert_true(ap__mm_order(1, &p0, 2, &p1) < 0 && ap__mm_order(2, &p1, 1, &p0) > 0);
    assert_true(ap__mm_order(5, &p0, 5, &p1) == -ap__mm_order(5, &p1, 5, &p0));
    assert_true(ap__mm_order(5, &p0, 5, &p1) != 0 && ap__mm_order(5, &p0, 5, &p0) == 0);
    ap_sim_free(sim);
}

int main(void)
{
    ap_log_set_level(AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire),
        cmocka_unit_test(test_target_size),
        cmocka_unit_test(test_min_size_at_deadline),
        cmocka_unit_test(test_excluded_peers),
        cmocka_unit_test(test_dead_leader),
        cmocka_unit_test(test_concurrent_with_crashes),
        cmocka_unit_test(test_cancel),
        cmocka_unit_test(test_follower_leaves),
        cmocka_unit_test(test_bad_joins),
        cmocka_unit_test(test_gather),
        cmocka_unit_test(test_averager_step),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
