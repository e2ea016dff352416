/* `apiary train`'s watchdog: every wait of the training thread has an end.
 *
 * The training thread blocks in ap_collab_submit_sync while an epoch waits
 * for its peers (exact mode waits for every peer's batch; a killed peer never
 * sends it). This thread wakes every 100 ms: when a stop was asked (SIGINT,
 * SIGTERM) or --duration is over while a submit is pending, it lets the
 * submit go (ap_collab_release_sync), so the command prints its summary,
 * saves its checkpoint and exits within a second. While a submit waits, it
 * says so every 10 s, with the reason from the collaboration's state. */
#include "train_watch.h"

#include "apiary/collab.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

struct ap_train_watch {
    pthread_t th;
    ap_collab_t *c;
    volatile sig_atomic_t *stop;
    double deadline; /* monotonic seconds, 0 = none */
    uint64_t target;
    atomic_bool quit;
    atomic_bool in_submit;
    atomic_uint_fast64_t submit_since_ms; /* when the pending submit began */
};

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void say_waiting(ap_train_watch_t *w, double waited)
{
    ap_collab_stats_t st;
    if (ap_collab_get_stats_sync(w->c, &st) != 0) return;
    const char *why;
    if (st.peers <= 1)
        why = "no other peer's progress is visible (are the others running?)";
    else if (st.global_samples < (double)w->target)
        why = "the epoch's target batch size is not reached yet";
    else
        why = "waiting for an averaging group (a peer of this epoch may have left)";
    fprintf(stderr,
            "apiary train: waiting %.0f s at epoch %llu: %s; %.0f/%llu samples, %u peers, "
            "%.0f samples/s (Ctrl-C or SIGTERM stops)\n",
            waited, (unsigned long long)st.epoch, why, st.global_samples,
            (unsigned long long)w->target, st.peers, st.global_sps);
}

static void *watch_main(void *arg)
{
    ap_train_watch_t *w = arg;
    struct timespec tick = {0, 100 * 1000 * 1000};
    bool released = false;
    double last_say = 0;
    while (!atomic_load(&w->quit)) {
        nanosleep(&tick, NULL);
        if (!atomic_load(&w->in_submit)) {
            released = false;
            last_say = 0;
            continue;
        }
        double now = mono_s();
        bool must_stop = *w->stop || (w->deadline > 0 && now >= w->deadline);
        if (must_stop && !released) {
            ap_collab_release_sync(w->c);
            released = true;
            continue;
        }
        double since = (double)atomic_load(&w->submit_since_ms) / 1000.0;
        if (now - since >= 10 && now - last_say >= 10) {
            say_waiting(w, now - since);
            last_say = now;
        }
    }
    return NULL;
}

ap_train_watch_t *ap_train_watch_start(ap_collab_t *c, volatile sig_atomic_t *stop,
                                       double duration_s, uint64_t target)
{
    ap_train_watch_t *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->c = c;
    w->stop = stop;
    w->deadline = duration_s > 0 ? mono_s() + duration_s : 0;
    w->target = target;
    if (pthread_create(&w->th, NULL, watch_main, w) != 0) {
        free(w);
        return NULL;
    }
    return w;
}

void ap_train_watch_submit(ap_train_watch_t *w, bool pending)
{
    if (!w) return;
    if (pending) atomic_store(&w->submit_since_ms, (uint_fast64_t)llround(mono_s() * 1000.0));
    atomic_store(&w->in_submit, pending);
}

void ap_train_watch_stop(ap_train_watch_t *w)
{
    if (!w) return;
    atomic_store(&w->quit, true);
    pthread_join(w->th, NULL);
    free(w);
}
