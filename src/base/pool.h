/* Worker pool for compute-heavy work (reductions, codecs, optimizer steps,
 * model kernels). Fixed threads, a FIFO queue, and a parallel-for that the
 * calling thread joins. Internal. */
#ifndef AP_BASE_POOL_H
#define AP_BASE_POOL_H

#include <stddef.h>

typedef struct ap_pool ap_pool_t;

/* nthreads 0 = number of online CPUs. NULL on failure. */
ap_pool_t *ap__pool_new(int nthreads);
/* Waits for queued tasks, joins the threads, frees. */
void ap__pool_free(ap_pool_t *p);
int ap__pool_size(const ap_pool_t *p);

/* Queues fn(arg) on a worker. AP_ENOMEM / AP_ESHUTDOWN on failure. */
int ap__pool_submit(ap_pool_t *p, void (*fn)(void *arg), void *arg);

/* Runs fn(arg, begin, end) over [0, n) split into ranges of at least grain
 * items across the workers and the calling thread; returns when all ranges
 * are done. Safe to call from several threads at once. With p == NULL, runs
 * serially on the caller. Must not be called from inside a pool task (it
 * would wait on itself); nested calls run serially. */
void ap__pool_parallel_for(ap_pool_t *p, size_t n, size_t grain,
                           void (*fn)(void *arg, size_t begin, size_t end), void *arg);

/* A process-wide pool, created on first use (threads = online CPUs, or
 * APIARY_THREADS). Never freed before exit. */
ap_pool_t *ap__pool_global(void);

#endif
