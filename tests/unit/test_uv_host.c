/* libuv driver: hosts, timers, cross-thread posts, the blocking bridge and
 * work offload. */
#include "aptest.h"

#include "apiary/host.h"
#include "apiary/node.h"
#include "apiary/sync.h"
#include "runtime/uv/uv_impl.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MS 1000ull

/* ---- timers ---------------------------------------------------------------------- */

enum { NT = 64 };
typedef struct {
    uint64_t due[NT];
    int order[NT];
    int n;
    uint64_t ids[NT];
    int periodic;
    uint64_t pid;
    uint64_t victim;
    bool victim_fired;
} tctx_t;

typedef struct {
    tctx_t *c;
    int i;
} targ_t;

static void t_fire(ap_rt_t *rt, void *arg)
{
    (void)rt;
    targ_t *a = arg;
    a->c->order[a->c->n++] = a->i;
}

static void t_periodic(ap_rt_t *rt, void *arg)
{
    tctx_t *c = arg;
    if (++c->periodic == 5) assert_true(ap_rt_timer_stop(rt, c->pid));
}

static void t_victim(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ((tctx_t *)arg)->victim_fired = true;
}

static void t_killer(ap_rt_t *rt, void *arg)
{
    tctx_t *c = arg;
    assert_true(ap_rt_timer_stop(rt, c->victim)); /* stop another pending timer */
}

static bool t_done(void *arg)
{
    tctx_t *c = arg;
    return c->n == NT && c->periodic >= 5;
}

static void test_timers(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, &(ap_node_opts_t){.rng_seed = 1}, &rt));
    static tctx_t c;
    memset(&c, 0, sizeof c);
    static targ_t args[NT];
    uint64_t s[4];
    ap__rng_seed(s, ap_test_seed(7));
    for (int i = 0; i < NT; i++) {
        uint64_t delay = (ap__rng_next(s) % 8) * 2 * MS; /* many equal delays */
        args[i] = (targ_t){&c, i};
        c.ids[i] = ap_rt_timer_start(rt, delay, 0, t_fire, &args[i]);
        assert_true(c.ids[i] != 0);
        /* the due instant the driver computed (now + delay at start) */
        ap_timer_t *t = ap__idmap_get(&h->timers, c.ids[i]);
        assert_non_null(t);
        assert_true(t->due >= delay);
        c.due[i] = t->due;
    }
    c.pid = ap_rt_timer_start(rt, 1 * MS, 1 * MS, t_periodic, &c);
    c.victim = ap_rt_timer_start(rt, 30 * MS, 0, t_victim, &c);
    ap_rt_timer_start(rt, 5 * MS, 0, t_killer, &c);
    assert_int_equal(c.n, 0); /* zero-delay timers never fire inside timer_start */
    assert_true(ap_host_run_until(h, t_done, &c, 5000 * MS));
    ap_host_run_until(h, NULL, NULL, 40 * MS);
    /* fired in (due, start order) order */
    for (int k = 1; k < NT; k++) {
        int a = c.order[k - 1], b = c.order[k];
        assert_true(c.due[a] < c.due[b] || (c.due[a] == c.due[b] && a < b));
    }
    assert_int_equal(c.periodic, 5);
    assert_false(c.victim_fired);
    assert_false(ap_rt_timer_stop(rt, c.ids[0]));
    assert_false(ap_rt_timer_stop(rt, c.pid));
    assert_false(ap_rt_timer_stop(rt, 0));
    /* a pending timer dies with its node */
    ap_rt_timer_start(rt, 10 * MS, 0, t_victim, &c);
    ap_node_free(rt);
    ap_host_run_until(h, NULL, NULL, 20 * MS);
    assert_false(c.victim_fired);
    assert_ok(ap_host_free(h));
}

/* ---- posts from many threads ----------------------------------------------------------- */

enum { NTHREADS = 4, NPOSTS = 2000 };
typedef struct {
    ap_rt_t *rt;
    int tid;
    atomic_int *failures;
} poster_t;

static int next_seq[NTHREADS];
static int total_posted;
static bool fifo_ok = true;
static uv_thread_t loop_thread;

static void on_post(ap_rt_t *rt, void *arg)
{
    (void)rt;
    intptr_t v = (intptr_t)arg;
    int tid = (int)(v / NPOSTS), seq = (int)(v % NPOSTS);
    uv_thread_t self = uv_thread_self();
    if (!uv_thread_equal(&self, &loop_thread)) fifo_ok = false;
    if (seq != next_seq[tid]) fifo_ok = false;
    next_seq[tid] = seq + 1;
    total_posted++;
}

static void poster(void *arg)
{
    poster_t *p = arg;
    for (int i = 0; i < NPOSTS; i++)
        if (ap_rt_post(p->rt, on_post, (void *)(intptr_t)(p->tid * NPOSTS + i)) != 0)
            atomic_fetch_add(p->failures, 1);
}

static bool all_posted(void *arg)
{
    (void)arg;
    return total_posted == NTHREADS * NPOSTS;
}

static void test_post_threads(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    loop_thread = uv_thread_self();
    atomic_int failures = 0;
    uv_thread_t th[NTHREADS];
    poster_t p[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        p[i] = (poster_t){rt, i, &failures};
        assert_int_equal(uv_thread_create(&th[i], poster, &p[i]), 0);
    }
    assert_true(ap_host_run_until(h, all_posted, NULL, 20000 * MS));
    for (int i = 0; i < NTHREADS; i++) uv_thread_join(&th[i]);
    assert_int_equal(atomic_load(&failures), 0);
    assert_true(fifo_ok);
    for (int i = 0; i < NTHREADS; i++) assert_int_equal(next_seq[i], NPOSTS);
    ap_node_free(rt);
    assert_ok(ap_host_free(h));
}

/* ---- call_sync ------------------------------------------------------------------------- */

static void complete_later(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_sync_complete(arg, 7);
}

static void sync_timer(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)arg;
    ap_rt_timer_start(rt, 5 * MS, 0, complete_later, done);
}

static void sync_nested(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    (void)arg;
    /* on the loop thread: must refuse instead of deadlocking */
    ap_sync_complete(done, ap_node_call_sync(rt, sync_timer, NULL));
}

static void test_call_sync(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    /* the owner drives this host: a blocking call would deadlock */
    assert_int_equal(ap_node_call_sync(rt, sync_timer, NULL), AP_ESTATE);
    assert_ok(ap_host_start(h));
    assert_int_equal(ap_host_start(h), AP_ESTATE);
    assert_int_equal(ap_node_call_sync(rt, sync_timer, NULL), 7);
    assert_int_equal(ap_node_call_sync(rt, sync_nested, NULL), AP_ESTATE);
    ap_host_stop(h);
    ap_node_free(rt);
    assert_ok(ap_host_free(h));
}

typedef struct {
    ap_rt_t *rt;
    int rc;
} waiter_t;

static void sync_waiter(void *arg)
{
    waiter_t *w = arg;
    w->rc = ap_node_call_sync(w->rt, sync_timer, NULL);
}

static void test_call_sync_node_gone(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    waiter_t w = {rt, 1};
    uv_thread_t th;
    assert_int_equal(uv_thread_create(&th, sync_waiter, &w), 0);
    /* wait until the waiter's task is queued, then free the node unrun */
    for (;;) {
        uv_mutex_lock(&h->mu);
        bool queued = h->head != NULL;
        uv_mutex_unlock(&h->mu);
        if (queued) break;
        usleep(1000);
    }
    ap_node_free(rt);
    uv_thread_join(&th);
    assert_int_equal(w.rc, AP_ESHUTDOWN);
    assert_ok(ap_host_free(h));
}

/* ---- work ------------------------------------------------------------------------------ */

typedef struct {
    uint64_t *v;
    size_t n;
    uint64_t sum;
    uv_thread_t worker;
    int status;
    int afters;
    bool on_loop;
} wctx_t;

static void w_sum(void *arg)
{
    wctx_t *c = arg;
    c->worker = uv_thread_self();
    uint64_t s = 0;
    for (size_t i = 0; i < c->n; i++) s += c->v[i];
    c->sum = s;
}

static void w_slow(void *arg)
{
    (void)arg;
    usleep(30000);
}

static void w_after(ap_rt_t *rt, void *arg, int status)
{
    (void)rt;
    wctx_t *c = arg;
    uv_thread_t self = uv_thread_self();
    c->on_loop = uv_thread_equal(&self, &loop_thread);
    c->status = status;
    c->afters++;
}

static bool w_done(void *arg)
{
    return ((wctx_t *)arg)->afters > 0;
}

static void test_work(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    ap_rt_t *rt;
    assert_ok(ap_node_new(h, NULL, &rt));
    loop_thread = uv_thread_self();
    wctx_t c = {.n = 1 << 20};
    c.v = malloc(c.n * sizeof *c.v);
    uint64_t expect = 0;
    for (size_t i = 0; i < c.n; i++) expect += c.v[i] = i * 3 + 1;
    assert_ok(ap_rt_work(rt, (double)c.n, w_sum, w_after, &c));
    assert_int_equal(c.afters, 0);
    assert_true(ap_host_run_until(h, w_done, &c, 20000 * MS));
    assert_int_equal(c.status, 0);
    assert_int_equal(c.sum, expect);
    assert_true(c.on_loop);
    assert_false(uv_thread_equal(&c.worker, &loop_thread)); /* ran off the loop */
    free(c.v);

    /* node freed while work is queued or running: after() gets ECANCELED once */
    wctx_t d[4];
    memset(d, 0, sizeof d);
    for (int i = 0; i < 4; i++) assert_ok(ap_rt_work(rt, 1, w_slow, w_after, &d[i]));
    ap_node_free(rt);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(d[i].afters, 1);
        assert_int_equal(d[i].status, AP_ECANCELED);
    }
    assert_ok(ap_host_free(h)); /* waits for the orphaned requests; loop closes clean */
    for (int i = 0; i < 4; i++) assert_int_equal(d[i].afters, 1);
}

/* ---- misc ------------------------------------------------------------------------------ */

static void test_node_identity_and_addrs(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    uint8_t seed[32] = {1, 2, 3};
    ap_rt_t *a, *b;
    assert_ok(
        ap_node_new(h, &(ap_node_opts_t){.ed25519_seed = seed, .listen = "/memory/4242"}, &a));
    /* the address is taken while a lives */
    assert_int_equal(ap_node_new(h, &(ap_node_opts_t){.listen = "/memory/4242"}, &b), AP_EEXIST);
    assert_int_equal(ap_node_new(h, &(ap_node_opts_t){.listen = "/ip4/1.2.3.4/tcp/1"}, &b),
                     AP_EADDR);
    char addrs[2][AP_RT_ADDR_MAX];
    assert_int_equal(ap_rt_listen_addrs(a, addrs, 2, false), 1);
    assert_string_equal(addrs[0], "/memory/4242");
    assert_int_equal(ap_rt_listen_addrs(a, addrs, 2, true), 1);
    char id[AP_PEER_ID_STR_MAX];
    assert_non_null(strstr(addrs[0], ap_peer_id_str(ap_rt_self(a), id)));
    ap_peer_id_t first = *ap_rt_self(a);
    ap_node_free(a);
    /* same seed, same address after restart */
    assert_ok(
        ap_node_new(h, &(ap_node_opts_t){.ed25519_seed = seed, .listen = "/memory/4242"}, &b));
    assert_true(ap_peer_id_eq(&first, ap_rt_self(b)));
    int64_t wall = ap_rt_wall_ms(b);
    assert_true(wall > 1600000000000LL); /* after 2020 */
    uint64_t t0 = ap_rt_now_us(b);
    usleep(2000);
    assert_true(ap_rt_now_us(b) >= t0 + 2000);
    ap_node_free(b);
    assert_ok(ap_host_free(h));
}

static void sync_identity(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    *(ap_peer_id_t *)arg = *ap_rt_self(rt);
    ap_sync_complete(done, 0);
}

static void test_threaded_node_lifecycle(void **state)
{
    (void)state;
    ap_host_t *h = ap_host_new();
    assert_ok(ap_host_start(h));
    /* nodes come and go while the loop runs on its own thread */
    for (int i = 0; i < 5; i++) {
        ap_rt_t *rt;
        uint8_t seed[32] = {(uint8_t)i};
        assert_ok(ap_node_new(h, &(ap_node_opts_t){.ed25519_seed = seed}, &rt));
        ap_peer_id_t id;
        assert_ok(ap_node_call_sync(rt, sync_identity, &id));
        assert_true(ap_peer_id_eq(&id, ap_rt_self(rt)));
        assert_int_equal(ap_node_call_sync(rt, sync_timer, NULL), 7);
        ap_node_free(rt);
    }
    ap_host_stop(h);
    assert_ok(ap_host_free(h));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_timers),
        cmocka_unit_test(test_post_threads),
        cmocka_unit_test(test_call_sync),
        cmocka_unit_test(test_call_sync_node_gone),
        cmocka_unit_test(test_work),
        cmocka_unit_test(test_node_identity_and_addrs),
        cmocka_unit_test(test_threaded_node_lifecycle),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
