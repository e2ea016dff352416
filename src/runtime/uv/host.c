/* libuv driver: the host (loop, cross-thread task queue, timers) and the
 * blocking bridge. See docs/runtime-uv.md. */
#include "runtime/uv/uv_impl.h"

#include "apiary/log.h"

#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

/* ---- timers: one binary heap per host, ordered by (due, seq) --------------- */

static bool tless(const ap_timer_t *a, const ap_timer_t *b)
{
    return a->due < b->due || (a->due == b->due && a->seq < b->seq);
}

static void hswap(ap_host_t *h, size_t i, size_t j)
{
    ap_timer_t *t = h->heap[i];
    h->heap[i] = h->heap[j];
    h->heap[j] = t;
    h->heap[i]->idx = i;
    h->heap[j]->idx = j;
}

static void hup(ap_host_t *h, size_t i)
{
    while (i > 0 && tless(h->heap[i], h->heap[(i - 1) / 2])) {
        hswap(h, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
}

static void hdown(ap_host_t *h, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->nheap && tless(h->heap[l], h->heap[m])) m = l;
        if (r < h->nheap && tless(h->heap[r], h->heap[m])) m = r;
        if (m == i) return;
        hswap(h, i, m);
        i = m;
    }
}

static int hpush(ap_host_t *h, ap_timer_t *t)
{
    if (h->nheap == h->heap_cap) {
        size_t cap = h->heap_cap ? h->heap_cap * 2 : 64;
        ap_timer_t **nh = realloc(h->heap, cap * sizeof *nh);
        if (!nh) return AP_ENOMEM;
        h->heap = nh;
        h->heap_cap = cap;
    }
    t->idx = h->nheap;
    h->heap[h->nheap++] = t;
    hup(h, t->idx);
    return 0;
}

static void hremove(ap_host_t *h, ap_timer_t *t)
{
    size_t i = t->idx;
    h->nheap--;
    if (i != h->nheap) {
        h->heap[i] = h->heap[h->nheap];
        h->heap[i]->idx = i;
        hdown(h, i);
        hup(h, i);
    }
}

uint64_t ap__host_now_us(ap_host_t *h)
{
    (void)h;
    return uv_hrtime() / 1000;
}

static void on_uv_timer(uv_timer_t *ut);

static void arm(ap_host_t *h)
{
    if (h->nheap == 0) {
        if (h->armed_due) uv_timer_stop(&h->timer);
        h->armed_due = 0;
        return;
    }
    uint64_t due = h->heap[0]->due;
    if (h->armed_due == due) return;
    uint64_t now = ap__host_now_us(h);
    uint64_t ms = due > now ? (due - now + 999) / 1000 : 0;
    uv_update_time(&h->loop);
    uv_timer_start(&h->timer, on_uv_timer, ms, 0);
    h->armed_due = due;
}

static void on_uv_timer(uv_timer_t *ut)
{
    ap_host_t *h = ut->data;
    h->armed_due = 0;
    uint64_t now = ap__host_now_us(h);
    /* Fire only what is due now; timers started by callbacks wait for the
     * next round, so a zero-delay timer loop cannot starve the loop. */
    uint64_t limit = h->next_seq;
    while (h->nheap && h->heap[0]->due <= now && h->heap[0]->seq < limit) {
        ap_timer_t *t = h->heap[0];
        ap_node_t *n = t->node;
        if (t->period) {
            hremove(h, t);
            t->due += t->period;
            if (t->due <= now) t->due = now + t->period;
            t->seq = h->next_seq++;
            if (hpush(h, t) < 0) { /* cannot happen: the slot was just freed */
                ap__idmap_del(&h->timers, t->id);
                free(t);
                continue;
            }
            t->cb(&n->rt, t->arg);
        } else {
            hremove(h, t);
            ap__idmap_del(&h->timers, t->id);
            ap_timer_fn cb = t->cb;
            void *arg = t->arg;
            free(t);
            cb(&n->rt, arg);
        }
    }
    arm(h);
}

uint64_t ap__host_timer_start(ap_node_t *n, uint64_t delay_us, uint64_t period_us, ap_timer_fn cb,
                              void *arg);
uint64_t ap__host_timer_start(ap_node_t *n, uint64_t delay_us, uint64_t period_us, ap_timer_fn cb,
                              void *arg)
{
    ap_host_t *h = n->host;
    if (atomic_load(&n->closing) || !cb) return 0;
    ap_timer_t *t = calloc(1, sizeof *t);
    if (!t) return 0;
    t->id = ++h->next_timer_id;
    t->seq = h->next_seq++;
    uint64_t now = ap__host_now_us(h);
    t->due = delay_us > UINT64_MAX - now ? UINT64_MAX : now + delay_us;
    t->period = period_us;
    t->node = n;
    t->cb = cb;
    t->arg = arg;
    if (ap__idmap_put(&h->timers, t->id, t) < 0 || hpush(h, t) < 0) {
        ap__idmap_del(&h->timers, t->id);
        free(t);
        return 0;
    }
    arm(h);
    return t->id;
}

bool ap__host_timer_stop(ap_node_t *n, uint64_t id);
bool ap__host_timer_stop(ap_node_t *n, uint64_t id)
{
    ap_host_t *h = n->host;
    ap_timer_t *t = ap__idmap_get(&h->timers, id);
    if (!t || t->node != n) return false;
    ap__idmap_del(&h->timers, id);
    hremove(h, t);
    free(t);
    arm(h);
    return true;
}

void ap__host_drop_timers(ap_node_t *n);
void ap__host_drop_timers(ap_node_t *n)
{
    ap_host_t *h = n->host;
    for (size_t i = 0; i < h->nheap;) {
        ap_timer_t *t = h->heap[i];
        if (t->node != n) {
            i++;
            continue;
        }
        ap__idmap_del(&h->timers, t->id);
        hremove(h, t);
        free(t);
        i = 0; /* the heap was reshuffled */
    }
    arm(h);
}

/* ---- task queue ------------------------------------------------------------- */

int ap__host_post(ap_host_t *h, ap_task_t *t)
{
    uv_mutex_lock(&h->mu);
    if (t->node && atomic_load(&t->node->closing)) {
        uv_mutex_unlock(&h->mu);
        return AP_ESHUTDOWN;
    }
    t->next = NULL;
    if (h->tail)
        h->tail->next = t;
    else
        h->head = t;
    h->tail = t;
    uv_mutex_unlock(&h->mu);
    uv_async_send(&h->async);
    return 0;
}

void ap__host_kick(ap_host_t *h)
{
    h->soon = true;
    uv_async_send(&h->async);
}

/* Removes and discards n's queued tasks (n->closing is set already). */
void ap__host_drop_tasks(ap_node_t *n);
void ap__host_drop_tasks(ap_node_t *n)
{
    ap_host_t *h = n->host;
    ap_task_t *mine = NULL, **tailp = &mine;
    uv_mutex_lock(&h->mu);
    ap_task_t **pp = &h->head;
    h->tail = NULL;
    while (*pp) {
        ap_task_t *t = *pp;
        if (t->node == n) {
            *pp = t->next;
            t->next = NULL;
            *tailp = t;
            tailp = &t->next;
        } else {
            h->tail = t;
            pp = &t->next;
        }
    }
    uv_mutex_unlock(&h->mu);
    while (mine) {
        ap_task_t *t = mine;
        mine = t->next;
        t->run(t, true);
    }
}

static void on_async(uv_async_t *a)
{
    ap_host_t *h = a->data;
    uv_mutex_lock(&h->mu);
    ap_task_t *t = h->head;
    h->head = h->tail = NULL;
    uv_mutex_unlock(&h->mu);
    while (t) {
        ap_task_t *next = t->next;
        t->run(t, false);
        t = next;
    }
    if (h->soon) {
        h->soon = false;
        /* a callback may free another node of this host: restart the walk */
        for (ap_node_t *n = h->nodes; n;) {
            uint64_t gen = h->nodes_gen;
            ap__node_run_soon(n);
            n = gen == h->nodes_gen ? n->next : h->nodes;
        }
        for (ap_node_t *n = h->nodes; n; n = n->next)
            if (ap__node_has_soon(n)) h->soon = true;
        if (h->soon) uv_async_send(&h->async);
    }
}

/* ---- host lifecycle ----------------------------------------------------------- */

/* A peer that closes a connection while we write to it must cost an EPIPE,
 * never the process: libuv writes sockets with write(2), which raises SIGPIPE.
 * A handler the application installed is left alone. */
static pthread_once_t sigpipe_once = PTHREAD_ONCE_INIT;

static void ignore_sigpipe(void)
{
    struct sigaction old;
    if (sigaction(SIGPIPE, NULL, &old) == 0 && old.sa_handler == SIG_DFL &&
        !(old.sa_flags & SA_SIGINFO))
        signal(SIGPIPE, SIG_IGN);
}

/* Memory returns: after a burst (a peer's responses, a flood of records, a
 * state download) glibc keeps the freed pages in its arenas, and the RSS
 * stays at its peak. Every 500 ms, a node whose message cache saw no use for
 * the whole period is idle: its recycled buffers are released; then, if any
 * was, and every second anyway, the free pages go back with malloc_trim,
 * which walks only the free chunks of every arena (the loop thread's
 * included), so it costs little when there is nothing to return. A burst's
 * memory is back within about 1.5 s of its end. */
#define TRIM_PERIOD_MS 500
#define TRIM_EVERY     2 /* periods between unconditional trims */

static void on_trim(uv_timer_t *t)
{
    ap_host_t *h = t->data;
    bool freed = false;
    for (ap_node_t *n = h->nodes; n; n = n->next) {
        if (n->msg_allocs == n->msg_allocs_seen && n->msg_cache) {
            ap__mux_free_cache(n);
            freed = true;
        }
        n->msg_allocs_seen = n->msg_allocs;
    }
    if (freed || ++h->trim_ticks % TRIM_EVERY == 0) malloc_trim(0);
}

ap_host_t *ap_host_new(void)
{
    pthread_once(&sigpipe_once, ignore_sigpipe);
    ap_host_t *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    if (uv_loop_init(&h->loop) < 0) {
        free(h);
        return NULL;
    }
    uv_mutex_init(&h->mu);
    uv_mutex_init(&h->work_mu);
    uv_cond_init(&h->work_cv);
    uv_async_init(&h->loop, &h->async, on_async);
    h->async.data = h;
    uv_timer_init(&h->loop, &h->timer);
    h->timer.data = h;
    uv_timer_init(&h->loop, &h->wake);
    uv_timer_init(&h->loop, &h->trim);
    h->trim.data = h;
    uv_timer_start(&h->trim, on_trim, TRIM_PERIOD_MS, TRIM_PERIOD_MS);
    uv_unref((uv_handle_t *)&h->trim); /* never keeps the loop alive */
    h->owner = uv_thread_self();
    return h;
}

static void loop_enter(ap_host_t *h)
{
    uv_mutex_lock(&h->mu);
    h->loop_tid = uv_thread_self();
    atomic_store(&h->in_loop, true);
    uv_mutex_unlock(&h->mu);
}

static void loop_leave(ap_host_t *h)
{
    atomic_store(&h->in_loop, false);
}

static void thread_main(void *arg)
{
    ap_host_t *h = arg;
    loop_enter(h);
    while (!atomic_load(&h->stop)) uv_run(&h->loop, UV_RUN_ONCE);
    loop_leave(h);
}

int ap_host_start(ap_host_t *h)
{
    if (h->threaded) return AP_ESTATE;
    atomic_store(&h->stop, false);
    h->threaded = true;
    if (uv_thread_create(&h->thread, thread_main, h) != 0) {
        h->threaded = false;
        return AP_ESYS;
    }
    return 0;
}

void ap_host_stop(ap_host_t *h)
{
    if (!h->threaded) return;
    atomic_store(&h->stop, true);
    uv_async_send(&h->async);
    uv_thread_join(&h->thread);
    h->threaded = false;
}

static void on_wake(uv_timer_t *t)
{
    (void)t;
}

bool ap_host_run_once(ap_host_t *h, uint64_t max_wait_us)
{
    if (h->threaded) return false;
    loop_enter(h);
    bool more;
    if (max_wait_us == 0) {
        more = uv_run(&h->loop, UV_RUN_NOWAIT) != 0;
    } else {
        uv_update_time(&h->loop);
        uv_timer_start(&h->wake, on_wake, (max_wait_us + 999) / 1000, 0);
        more = uv_run(&h->loop, UV_RUN_ONCE) != 0;
        uv_timer_stop(&h->wake);
    }
    loop_leave(h);
    return more;
}

bool ap_host_run_until(ap_host_t *h, bool (*pred)(void *arg), void *arg, uint64_t timeout_us)
{
    uint64_t deadline = ap__host_now_us(h) + timeout_us;
    for (;;) {
        if (pred && pred(arg)) return true;
        uint64_t now = ap__host_now_us(h);
        if (now >= deadline) return pred ? pred(arg) : true;
        uint64_t wait = deadline - now;
        if (wait > 10000) wait = 10000;
        ap_host_run_once(h, wait);
    }
}

static void walk_close(uv_handle_t *hd, void *arg)
{
    (void)arg;
    if (!uv_is_closing(hd)) uv_close(hd, NULL);
}

static void count_closing(uv_handle_t *hd, void *arg)
{
    if (uv_is_closing(hd)) (*(int *)arg)++;
}

int ap_host_free(ap_host_t *h)
{
    if (!h) return 0;
    ap_host_stop(h);
    loop_enter(h);
    while (h->nodes) ap_node_free(&h->nodes->rt);
    /* Transport tasks still queued (pipes to nodes elsewhere) release refs. */
    uv_mutex_lock(&h->mu);
    ap_task_t *t = h->head;
    h->head = h->tail = NULL;
    uv_mutex_unlock(&h->mu);
    while (t) {
        ap_task_t *next = t->next;
        t->run(t, true);
        t = next;
    }
    /* Closes in flight finish first: their callbacks free what they close and
     * may close more (a node's libp2p host, then its services' timers), which
     * walk_close would close without a callback. */
    for (int i = 0; i < 256; i++) {
        int closing = 0;
        uv_walk(&h->loop, count_closing, &closing);
        if (!closing) break;
        uv_run(&h->loop, UV_RUN_NOWAIT);
    }
    uv_walk(&h->loop, walk_close, NULL);
    uv_run(&h->loop, UV_RUN_DEFAULT);
    loop_leave(h);
    int rc = uv_loop_close(&h->loop);
    if (rc != 0) ap_error("uv", "host: loop not closed cleanly: %s", uv_strerror(rc));
    uv_mutex_destroy(&h->mu);
    uv_mutex_destroy(&h->work_mu);
    uv_cond_destroy(&h->work_cv);
    ap__idmap_free(&h->timers);
    free(h->heap);
    free(h);
    return rc == 0 ? 0 : AP_EBUSY;
}

/* ---- running a function on the loop thread ------------------------------------------ */

typedef struct onloop {
    ap_task_t t;
    void (*fn)(void *arg);
    void *arg;
    uv_mutex_t mu;
    uv_cond_t cv;
    bool done, ran;
} onloop_t;

static void onloop_run(ap_task_t *t, bool discard)
{
    onloop_t *o = (onloop_t *)t;
    if (!discard) o->fn(o->arg);
    uv_mutex_lock(&o->mu);
    o->ran = !discard;
    o->done = true;
    uv_cond_signal(&o->cv);
    uv_mutex_unlock(&o->mu);
}

int ap__host_on_loop(ap_host_t *h, void (*fn)(void *arg), void *arg)
{
    uv_thread_t self = uv_thread_self();
    uv_mutex_lock(&h->mu);
    bool on_loop = atomic_load(&h->in_loop) && uv_thread_equal(&h->loop_tid, &self);
    uv_mutex_unlock(&h->mu);
    if (!h->threaded || on_loop) {
        fn(arg);
        return 0;
    }
    onloop_t o = {.t = {.run = onloop_run}, .fn = fn, .arg = arg};
    uv_mutex_init(&o.mu);
    uv_cond_init(&o.cv);
    ap__host_post(h, &o.t);
    uv_mutex_lock(&o.mu);
    while (!o.done) uv_cond_wait(&o.cv, &o.mu);
    uv_mutex_unlock(&o.mu);
    uv_cond_destroy(&o.cv);
    uv_mutex_destroy(&o.mu);
    return o.ran ? 0 : AP_ESHUTDOWN;
}

/* ---- blocking bridge ------------------------------------------------------------ */

struct ap_sync {
    uv_mutex_t mu;
    uv_cond_t cv;
    bool done;
    int status;
};

typedef struct sync_task {
    ap_task_t t;
    ap_sync_fn fn;
    void *arg;
    ap_sync_t *s;
} sync_task_t;

static void sync_run(ap_task_t *t, bool discard)
{
    sync_task_t *st = (sync_task_t *)t;
    if (discard)
        ap_sync_complete(st->s, AP_ESHUTDOWN);
    else
        st->fn(&st->t.node->rt, st->arg, st->s);
    free(st);
}

int ap_node_call_sync(ap_rt_t *rt, ap_sync_fn fn, void *arg)
{
    ap_node_t *n = (ap_node_t *)rt;
    ap_host_t *h = n->host;
    uv_thread_t self = uv_thread_self();
    uv_mutex_lock(&h->mu);
    bool on_loop = atomic_load(&h->in_loop) && uv_thread_equal(&h->loop_tid, &self);
    uv_mutex_unlock(&h->mu);
    if (on_loop || (!h->threaded && uv_thread_equal(&h->owner, &self))) return AP_ESTATE;
    ap_sync_t s;
    uv_mutex_init(&s.mu);
    uv_cond_init(&s.cv);
    s.done = false;
    s.status = 0;
    sync_task_t *st = calloc(1, sizeof *st);
    if (!st) return AP_ENOMEM;
    st->t.run = sync_run;
    st->t.node = n;
    st->fn = fn;
    st->arg = arg;
    st->s = &s;
    int rc = ap__host_post(h, &st->t);
    if (rc < 0) {
        free(st);
    } else {
        uv_mutex_lock(&s.mu);
        while (!s.done) uv_cond_wait(&s.cv, &s.mu);
        rc = s.status;
        uv_mutex_unlock(&s.mu);
    }
    uv_cond_destroy(&s.cv);
    uv_mutex_destroy(&s.mu);
    return rc;
}

void ap_sync_complete(ap_sync_t *done, int status)
{
    uv_mutex_lock(&done->mu);
    done->status = status;
    done->done = true;
    uv_cond_signal(&done->cv);
    uv_mutex_unlock(&done->mu);
}
