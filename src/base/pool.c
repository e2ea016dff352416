#include "base/pool.h"
#include "apiary/error.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct task {
    void (*fn)(void *);
    void *arg;
    struct task *next;
} task_t;

struct ap_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_t *head, *tail;
    bool stop;
    int n;
    pthread_t *threads;
};

static _Thread_local bool in_pool_task;

static void *worker(void *arg)
{
    ap_pool_t *p = arg;
    in_pool_task = true;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
        if (!p->head && p->stop) break;
        task_t *t = p->head;
        p->head = t->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->mu);
        t->fn(t->arg);
        free(t);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

ap_pool_t *ap__pool_new(int nthreads)
{
    if (nthreads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        nthreads = c > 0 ? (int)c : 1;
    }
    ap_pool_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->threads = calloc((size_t)nthreads, sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) break;
        p->n++;
    }
    if (p->n == 0) {
        ap__pool_free(p);
        return NULL;
    }
    return p;
}

void ap__pool_free(ap_pool_t *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->threads);
    free(p);
}

int ap__pool_size(const ap_pool_t *p)
{
    return p ? p->n : 1;
}

int ap__pool_submit(ap_pool_t *p, void (*fn)(void *), void *arg)
{
    task_t *t = malloc(sizeof *t);
    if (!t) return AP_ENOMEM;
    t->fn = fn;
    t->arg = arg;
    t->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->stop) {
        pthread_mutex_unlock(&p->mu);
        free(t);
        return AP_ESHUTDOWN;
    }
    if (p->tail)
        p->tail->next = t;
    else
        p->head = t;
    p->tail = t;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

typedef struct pfor {
    void (*fn)(void *, size_t, size_t);
    void *arg;
    size_t n, chunk;
    atomic_size_t next;
    atomic_int pending; /* helper tasks not yet finished */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} pfor_t;

static void pfor_drain(pfor_t *f)
{
    for (;;) {
        size_t b = atomic_fetch_add(&f->next, f->chunk);
        if (b >= f->n) break;
        size_t e = b + f->chunk < f->n ? b + f->chunk : f->n;
        f->fn(f->arg, b, e);
    }
}

static void pfor_task(void *arg)
{
    pfor_t *f = arg;
    pfor_drain(f);
    pthread_mutex_lock(&f->mu);
    if (atomic_fetch_sub(&f->pending, 1) == 1) pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

void ap__pool_parallel_for(ap_pool_t *p, size_t n, size_t grain, void (*fn)(void *, size_t, size_t),
                           void *arg)
{
    if (n == 0) return;
    if (grain == 0) grain = 1;
    int workers = p ? p->n : 0;
    if (!p || in_pool_task || n <= grain || workers == 0) {
        fn(arg, 0, n);
        return;
    }
    size_t parts = (size_t)workers + 1;
    size_t chunk = (n + parts * 4 - 1) / (parts * 4);
    if (chunk < grain) chunk = grain;
    size_t nchunks = (n + chunk - 1) / chunk;
    size_t helpers = nchunks - 1 < (size_t)workers ? nchunks - 1 : (size_t)workers;
    pfor_t f = {.fn = fn, .arg = arg, .n = n, .chunk = chunk};
    atomic_init(&f.next, 0);
    atomic_init(&f.pending, 0);
    pthread_mutex_init(&f.mu, NULL);
    pthread_cond_init(&f.cv, NULL);
    for (size_t i = 0; i < helpers; i++) {
        atomic_fetch_add(&f.pending, 1);
        if (ap__pool_submit(p, pfor_task, &f) != 0) {
            atomic_fetch_sub(&f.pending, 1);
            break;
        }
    }
    pfor_drain(&f);
    pthread_mutex_lock(&f.mu);
    while (atomic_load(&f.pending) > 0) pthread_cond_wait(&f.cv, &f.mu);
    pthread_mutex_unlock(&f.mu);
    pthread_mutex_destroy(&f.mu);
    pthread_cond_destroy(&f.cv);
}

static ap_pool_t *g_pool;
static pthread_once_t g_pool_once = PTHREAD_ONCE_INIT;

static void global_init(void)
{
    const char *e = getenv("APIARY_THREADS");
    int n = e ? atoi(e) : 0;
    if (n <= 0) {
        /* The caller of a parallel-for works too: one worker fewer than cores. */
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 1 ? (int)c - 1 : 1;
    }
    g_pool = ap__pool_new(n);
}

ap_pool_t *ap__pool_global(void)
{
    pthread_once(&g_pool_once, global_init);
    return g_pool;
}
