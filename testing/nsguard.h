/* Removing what a test made in the system (network namespaces) when the
 * test process ends: at exit, and on SIGINT, SIGTERM and SIGHUP (then the
 * signal's default action). Shared by the namespace harnesses (netns.h,
 * natns.h). A handler already installed for one of those signals is left
 * alone. Only the process that registered an entry runs it (a forked child
 * does not). */
#ifndef APIARY_TESTING_NSGUARD_H
#define APIARY_TESTING_NSGUARD_H

/* Must be async-signal-safe (it may run from a signal handler). */
#include <stdbool.h>

typedef void (*ap_nsguard_fn)(void *arg);

/* Registers fn(arg); at most 16 at once (more are not guarded: returns false). */
bool ap_nsguard_add(ap_nsguard_fn fn, void *arg);
/* Unregisters arg's entry; the signal handlers go once none is left. */
void ap_nsguard_remove(void *arg);

#endif
