/* Port mapping on a thread of its own: the blocking calls of portmap.c,
 * renewals, removal on stop (see portmap.h). */
#include "p2p/portmap.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MOD        "portmap"
#define TIMEOUT_MS 3000
#define MIN_RENEW  30u /* s: a lease shorter than twice this is renewed this often */

struct ap_portmap {
    uint16_t port;
    unsigned protos;
    ap_portmap_cb cb;
    void *arg;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;    /* guarded by mu */
    bool removed; /* set by the thread before it exits */
};

static bool wait_or_stop(ap_portmap_t *pm, unsigned seconds)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += seconds;
    pthread_mutex_lock(&pm->mu);
    while (!pm->stop && pthread_cond_timedwait(&pm->cv, &pm->mu, &until) != ETIMEDOUT) {
    }
    bool stop = pm->stop;
    pthread_mutex_unlock(&pm->mu);
    return stop;
}

static bool stopping(ap_portmap_t *pm)
{
    pthread_mutex_lock(&pm->mu);
    bool s = pm->stop;
    pthread_mutex_unlock(&pm->mu);
    return s;
}

static void *run(void *arg)
{
    ap_portmap_t *pm = arg;
    ap_portmap_lease_t lease = {0};
    bool held = false;
    char why[512];
    for (;;) {
        ap_portmap_lease_t next = held ? lease : (ap_portmap_lease_t){0};
        why[0] = 0;
        int rc = ap__portmap_add(pm->protos, pm->port, AP_PORTMAP_LIFETIME_S, TIMEOUT_MS, &next,
                                 why, sizeof why);
        unsigned wait_s = AP_PORTMAP_RETRY_S;
        if (rc == 0) {
            bool changed = !held || strcmp(lease.external_ip, next.external_ip) ||
                           lease.external_port != next.external_port;
            lease = next;
            held = true;
            if (changed)
                ap_info(MOD, "TCP %u mapped to %s:%u via %s (lease %u s)", (unsigned)pm->port,
                        lease.external_ip, (unsigned)lease.external_port,
                        ap__portmap_via_name(lease.via), (unsigned)lease.lifetime_s);
            uint32_t life = lease.lifetime_s ? lease.lifetime_s : AP_PORTMAP_LIFETIME_S;
            wait_s = life / 2 > MIN_RENEW ? life / 2 : MIN_RENEW;
            if (changed && !stopping(pm) && pm->cb) pm->cb(pm->arg, 0, &lease);
        } else {
            if (held)
                ap_warn(MOD, "lost the mapping of TCP %u: %s", (unsigned)pm->port, why);
            else
                ap_info(MOD, "no mapping for TCP %u: %s", (unsigned)pm->port, why);
            held = false;
            if (!stopping(pm) && pm->cb) pm->cb(pm->arg, rc, NULL);
        }
        if (wait_or_stop(pm, wait_s)) break;
    }
    if (held) {
        int rc = ap__portmap_del(&lease, TIMEOUT_MS, why, sizeof why);
        if (rc)
            ap_warn(MOD, "could not remove the mapping of TCP %u: %s", (unsigned)pm->port, why);
        else
            ap_info(MOD, "removed the mapping of TCP %u (%s)", (unsigned)pm->port,
                    ap__portmap_via_name(lease.via));
        pm->removed = rc == 0;
    }
    return NULL;
}

ap_portmap_t *ap__portmap_start(uint16_t port, unsigned protos, ap_portmap_cb cb, void *arg)
{
    if (port == 0 || !(protos & AP_PORTMAP_ANY)) return NULL;
    ap_portmap_t *pm = calloc(1, sizeof *pm);
    if (!pm) return NULL;
    pm->port = port;
    pm->protos = protos;
    pm->cb = cb;
    pm->arg = arg;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&pm->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&pm->mu, NULL);
    if (pthread_create(&pm->thread, NULL, run, pm) != 0) {
        pthread_cond_destroy(&pm->cv);
        pthread_mutex_destroy(&pm->mu);
        free(pm);
        return NULL;
    }
    return pm;
}

bool ap__portmap_stop(ap_portmap_t *pm)
{
    if (!pm) return false;
    pthread_mutex_lock(&pm->mu);
    pm->stop = true;
    pthread_cond_broadcast(&pm->cv);
    pthread_mutex_unlock(&pm->mu);
    pthread_join(pm->thread, NULL);
    bool removed = pm->removed;
    pthread_cond_destroy(&pm->cv);
    pthread_mutex_destroy(&pm->mu);
    free(pm);
    return removed;
}
