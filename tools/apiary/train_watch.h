/* `apiary train`'s watchdog (see train_watch.c). */
#ifndef AP_CLI_TRAIN_WATCH_H
#define AP_CLI_TRAIN_WATCH_H

#include "apiary/collab.h"

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct ap_train_watch ap_train_watch_t;

/* Starts the watchdog over c: a pending submit is released once *stop is
 * set or duration_s (0 = none) has passed from now. target: the epoch's
 * target batch size, for the waiting message. NULL if no thread. */
ap_train_watch_t *ap_train_watch_start(ap_collab_t *c, volatile sig_atomic_t *stop,
                                       double duration_s, uint64_t target);
/* The training thread enters (true) or leaves (false) ap_collab_submit_sync. */
void ap_train_watch_submit(ap_train_watch_t *w, bool pending);
/* Stops and frees the watchdog (NULL: no-op). Before ap_collab_free_sync. */
void ap_train_watch_stop(ap_train_watch_t *w);

#endif
