/* Fault tolerance: a peer killed at each phase of a round. The survivors
 * finish, every element is either its local value or a weighted mean (over
 * all senders, or over all but the victim when the victim had not delivered
 * that chunk), the parts of live reducers are averaged for everyone and
 * agree bit for bit, and each peer reports exactly the fraction averaged. */
#include "avg_harness.h"

enum phase { DEAD_AT_START, WHILE_SENDING, WHILE_REDUCING, AFTER };

typedef struct watch {
    avg_env_t *e;
    int victim;
    enum phase ph;
} watch_t;

static bool reached(void *arg)
{
    watch_t *w = arg;
    avg_node_t *d = &w->e->nd[w->victim];
    if (w->ph == AFTER) return d->done;
    if (!d->ar) return false;
    ap__avg_progress_t p;
    ap__allreduce_progress(d->ar, &p);
    if (w->ph == WHILE_SENDING) {
        /* the reducers have part of the victim's data, not all of it */
        uint32_t got = 0, total = 0;
        for (int r = 0; r < w->e->n; r++) {
            if (r == w->victim || !w->e->nd[r].ar) continue;
            uint32_t g, t;
            ap__allreduce_sender_progress(w->e->nd[r].ar, w->victim, &g, &t);
            got += g;
            total += t;
        }
        return got > 0 && got < total / 2;
    }
    return p.reduced > 0 && p.reduced < p.my_chunks;
}

static void run_fault(enum phase ph, ap_avg_role_t victim_role, uint64_t seed)
{
    const int n = 5;
    const uint64_t elems = 20000;
    avg_env_t e;
    avg_env_init(&e, n, elems, seed);
    int idx[5] = {0, 1, 2, 3, 4};
    const int v = 2;
    for (int i = 0; i < n; i++) {
        e.nd[i].role = AP_AVG_NORMAL;
        avg_set_bw(&e, i, 1e6, 1e6);
    }
    e.nd[v].role = victim_role;
    uint8_t gid[32];
    memset(gid, 0x33, sizeof gid);
    ap_allreduce_opts_t o = {.chunk_elems = 500};
    if (ph == DEAD_AT_START) {
        /* a member that is gone before the round: it never starts */
        int live[4] = {0, 1, 3, 4};
        avg_crash(&e, v);
        /* the group still lists it: start the others with the full member list */
        ap_avg_member_t mem[5];
        for (int k = 0; k < n; k++)
            mem[k] = (ap_avg_member_t){*avg_peer_id(&e, k), e.nd[k].role, 1e6, 1e6};
        ap_avg_group_t g = {.members = mem, .n = 5};
        memcpy(g.id, gid, 32);
        for (int k = 0; k < 4; k++) {
            avg_node_t *d = &e.nd[live[k]];
            d->in_round = true;
            assert_ok(ap_allreduce_start(d->svc, &g, d->data, elems, d->weight, &o, avg_on_done, d,
                                         &d->ar));
        }
    } else {
        avg_start(&e, idx, n, gid, NULL, NULL, &o);
        watch_t wt = {&e, v, ph};
        assert_true(avg_run_until(&e, reached, &wt, 600000000ull));
        avg_crash(&e, v);
    }
    assert_true(avg_run_until(&e, avg_all_done, &e, 600000000ull));

    double *all = malloc(elems * sizeof *all), *without = malloc(elems * sizeof *without);
    bool inc[5] = {true, true, false, true, true};
    avg_reference(&e, idx, n, NULL, all);
    avg_reference(&e, idx, n, inc, without);
    /* part boundaries */
    ap_avg_bw_t bw[5];
    double sh[5];
    uint64_t cnt[5], off[5];
    for (int i = 0; i < n; i++) bw[i] = (ap_avg_bw_t){e.nd[i].role, 1e6, 1e6};
    assert_ok(ap_avg_balance(bw, 5, NULL, sh, NULL));
    assert_ok(ap_avg_round_counts(sh, 5, elems, cnt));
    off[0] = 0;
    for (int i = 1; i < n; i++) off[i] = off[i - 1] + cnt[i - 1];

    for (int i = 0; i < n; i++) {
        if (i == v) continue;
        avg_node_t *d = &e.nd[i];
        assert_true(d->done);
        assert_int_equal(d->res.status, 0);
        uint64_t averaged = 0;
        for (int k = 0; k < n; k++) {
            for (uint64_t x = off[k]; x < off[k] + cnt[k]; x++) {
                bool local = d->data[x] == d->orig[x];
                if (!local) averaged++;
                if (k != v || ph == AFTER) {
                    /* a live reducer's part: averaged for everyone, identically */
                    if (local)
                        fail_msg("ph %d peer %d elem %llu left local", ph, i,
                                 (unsigned long long)x);
                    assert_true(d->data[x] == e.nd[i == 0 ? 1 : 0].data[x]);
                }
                if (!local && !close_rel(d->data[x], all[x], 1e-6) &&
                    !close_rel(d->data[x], without[x], 1e-6))
                    fail_msg("ph %d peer %d elem %llu: %.9g is no mean (%.9g / %.9g)", ph, i,
                             (unsigned long long)x, d->data[x], all[x], without[x]);
            }
        }
        if (getenv("AVG_VERBOSE"))
            printf("ph %d role %d peer %d: averaged %llu/%llu failed %u dropped %u used %u "
                   "elapsed %.3f s (lp %.3f s)\n",
                   ph, victim_role, i, (unsigned long long)averaged, (unsigned long long)elems,
                   d->res.parts_failed, d->res.senders_dropped, d->res.senders_used,
                   d->res.elapsed_us / 1e6, d->res.predicted_s);
        assert_int_equal(d->res.elems_averaged, averaged);
        assert_true(d->res.averaged_fraction == (double)averaged / (double)elems);
        if (ph == AFTER) assert_true(averaged == elems);
        if (ph == DEAD_AT_START && victim_role != AP_AVG_CLIENT) {
            assert_int_equal(d->res.parts_failed, 1);
            assert_int_equal(averaged, elems - cnt[v]);
        }
        if (ph == DEAD_AT_START && victim_role != AP_AVG_AUX && cnt[i] > 0)
            assert_int_equal(d->res.senders_dropped, 1);
        /* bounded: well inside the round deadline */
        assert_true((double)d->res.elapsed_us < 4 * d->res.predicted_s * 1e6 + 4.5e6);
    }
    free(all);
    free(without);
    avg_env_free(&e);
}

static void test_dead_at_start(void **state)
{
    (void)state;
    run_fault(DEAD_AT_START, AP_AVG_NORMAL, ap_test_seed(71));
    run_fault(DEAD_AT_START, AP_AVG_AUX, ap_test_seed(72));
    run_fault(DEAD_AT_START, AP_AVG_CLIENT, ap_test_seed(73));
}

static void test_while_sending(void **state)
{
    (void)state;
    run_fault(WHILE_SENDING, AP_AVG_NORMAL, ap_test_seed(74));
    run_fault(WHILE_SENDING, AP_AVG_CLIENT, ap_test_seed(75));
}

static void test_while_reducing(void **state)
{
    (void)state;
    run_fault(WHILE_REDUCING, AP_AVG_NORMAL, ap_test_seed(76));
    run_fault(WHILE_REDUCING, AP_AVG_AUX, ap_test_seed(77));
}

static void test_after(void **state)
{
    (void)state;
    run_fault(AFTER, AP_AVG_NORMAL, ap_test_seed(78));
}

/* Cancel: done runs with AP_ECANCELED, every stream closes, the others finish. */
static void test_cancel(void **state)
{
    (void)state;
    avg_env_t e;
    avg_env_init(&e, 4, 20000, ap_test_seed(79));
    int idx[4] = {0, 1, 2, 3};
    for (int i = 0; i < 4; i++) avg_set_bw(&e, i, 1e6, 1e6);
    uint8_t gid[32] = {9};
    ap_allreduce_opts_t o = {.chunk_elems = 500};
    avg_start(&e, idx, 4, gid, NULL, NULL, &o);
    avg_run_for(&e, 20000);
    ap_allreduce_cancel(e.nd[1].ar);
    assert_true(avg_run_until(&e, avg_all_done, &e, 600000000ull));
    assert_int_equal(e.nd[1].res.status, AP_ECANCELED);
    for (int i = 0; i < 4; i++)
        if (i != 1) {
            assert_int_equal(e.nd[i].res.status, 0);
            assert_true(e.nd[i].res.parts_failed == 1);
        }
    avg_env_free(&e);
}

int main(void)
{
    ap_log_set_level(getenv("AVG_VERBOSE") ? AP_LOG_WARN : AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dead_at_start),  cmocka_unit_test(test_while_sending),
        cmocka_unit_test(test_while_reducing), cmocka_unit_test(test_after),
        cmocka_unit_test(test_cancel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
