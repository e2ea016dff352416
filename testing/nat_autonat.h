/* AutoNAT verdicts through real NATs (testing/natns.h), for tests and
 * `apiary bench nat`.
 *
 * ap_nat_autonat_run starts AP_NAT_AUTONAT_SERVERS AutoNAT servers on
 * public nodes 0..2 (libp2p hosts on port AP_NAT_AUTONAT_PORT, each in a
 * forked process) and one client per entry of `where`: a libp2p host on
 * the same port in its own process, on a public node or a home host. A
 * client identifies the three servers, believes its public IP once all of
 * them report it (observed addresses), asks every server to dial it back
 * at that IP and its listen port, and feeds the answers to the
 * reachability state machine (src/p2p/reach.h). A client with portmap
 * set first maps its port on its gateway, and asks to be dialled at the
 * mapped address as well. Every child is killed by its PID before the call
 * returns. */
#ifndef AP_TESTING_NAT_AUTONAT_H
#define AP_TESTING_NAT_AUTONAT_H

#include "natns.h"

#include <stdbool.h>
#include <stddef.h>

#define AP_NAT_AUTONAT_SERVERS 3
#define AP_NAT_AUTONAT_PORT    4001
#define AP_NAT_AUTONAT_MAX     8 /* clients per run */

typedef struct ap_nat_where {
    bool home;      /* false: public node `index`; true: home host `index` */
    size_t index;   /* public nodes 0..2 hold the servers */
    bool ask_third; /* also ask server 0 to dial server 1 (must be refused) */
    /* map the listen port on the gateway first (src/p2p/portmap.h, these
     * protocols: AP_PORTMAP_* bits), probe, then remove the mapping */
    unsigned portmap;
} ap_nat_where_t;

typedef struct ap_nat_autonat_result {
    int state;                      /* ap_reach_state_t */
    int st[AP_NAT_AUTONAT_SERVERS]; /* each server's answer (ap_autonat_status_t or AP_E*) */
    int third;                      /* answer to the third-party request, 1 if not asked */
    char seen[64];                  /* the believed public IP, "" if none */
    int mapped;                     /* portmap: 0 mapped, else the AP_E* code */
    int via;                        /* portmap: the ap_portmap_via_t that mapped */
    char mapped_to[64];             /* portmap: "IP:PORT" on the gateway */
    bool unmapped;                  /* portmap: the mapping was removed before the report */
} ap_nat_autonat_result_t;

/* Runs the scenario; res[i] for where[i]. 0, or a negative AP_E* code and
 * the reason in why (a server did not start, a client reported nothing
 * within limit_ms). */
int ap_nat_autonat_run(ap_natns_t *ns, const ap_nat_where_t *where, size_t n, int limit_ms,
                       ap_nat_autonat_result_t *res, char *why, size_t wn);

#endif
