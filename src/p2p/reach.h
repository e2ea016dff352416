/* What a node believes about its own reachability. Internal, sans-I/O.
 *
 * Observed addresses (ap_obs_t): identify tells each peer the address its
 * connection came from. One peer's word is not enough (it may lie or sit
 * behind the same NAT), so an address is believed only when at least
 * AP_OBS_BELIEVE distinct peers reported it within AP_OBS_TTL_US. A peer's
 * newer report replaces its older one. At most AP_OBS_ADDRS addresses are
 * tracked; when full, the one with the fewest observers (oldest on ties)
 * makes room.
 *
 * Reachability (ap_reach_t): AutoNAT answers from servers. OK is a vote for
 * public, E_DIAL_ERROR a vote for private; refusals and bad requests are no
 * votes. The last AP_REACH_AGREE votes are kept, each from a different
 * server (a server's newer vote replaces its older one). The verdict moves
 * to public or private only when all of them agree; mixed votes keep the
 * current verdict. Probes are due every retry_us while the verdict is
 * unknown or after a contrary vote, and every recheck_us once it is settled. */
#ifndef AP_P2P_REACH_H
#define AP_P2P_REACH_H

#include "apiary/multiaddr.h"
#include "apiary/peer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_OBS_BELIEVE   3
#define AP_OBS_ADDRS     16
#define AP_OBS_OBSERVERS 8
#define AP_OBS_TTL_US    (30ull * 60 * 1000000)

typedef struct ap_obs {
    struct {
        ap_multiaddr_t addr; /* ip + tcp port only */
        ap_peer_id_t by[AP_OBS_OBSERVERS];
        uint64_t at[AP_OBS_OBSERVERS]; /* 0: empty */
        bool used;
    } e[AP_OBS_ADDRS];
} ap_obs_t;

void ap__obs_init(ap_obs_t *o);
/* Peer `by` says it sees us at `seen` (from identify). Addresses without an
 * IP and a TCP port, or circuit addresses, are ignored (AP_EINVAL). */
int ap__obs_add(ap_obs_t *o, const ap_peer_id_t *by, const ap_multiaddr_t *seen, uint64_t now_us);
/* Believed addresses, most observers first: the count (at most max). */
size_t ap__obs_believed(const ap_obs_t *o, uint64_t now_us, ap_multiaddr_t *out, size_t max);
/* Believed IPs: at least AP_OBS_BELIEVE distinct peers see us at the IP,
 * whatever the port (behind a NAT that changes ports per connection, no
 * one address gathers them). Entries carry the IP only (no port); most
 * observers first; the count. */
size_t ap__obs_believed_ips(const ap_obs_t *o, uint64_t now_us, ap_multiaddr_t *out, size_t max);
/* How many distinct peers currently report addr. */
size_t ap__obs_count(const ap_obs_t *o, const ap_multiaddr_t *addr, uint64_t now_us);

typedef enum ap_reach_state {
    AP_REACH_UNKNOWN = 0,
    AP_REACH_PUBLIC = 1,
    AP_REACH_PRIVATE = 2,
} ap_reach_state_t;

#define AP_REACH_AGREE 3

typedef struct ap_reach {
    ap_reach_state_t state;
    ap_peer_id_t voter[AP_REACH_AGREE];
    ap_reach_state_t vote[AP_REACH_AGREE];
    size_t nvotes; /* oldest first */
    uint64_t retry_us, recheck_us, next_probe_us;
    bool has_addr;
    ap_multiaddr_t addr; /* the address the last OK dialled */
    unsigned changes;
} ap_reach_t;

const char *ap__reach_name(ap_reach_state_t s);
void ap__reach_init(ap_reach_t *r, uint64_t now_us, uint64_t retry_us, uint64_t recheck_us);
/* A server's answer (an ap_autonat_status_t; addr: the address it reached,
 * may be NULL). True when the verdict changed. */
bool ap__reach_answer(ap_reach_t *r, const ap_peer_id_t *server, int status,
                      const ap_multiaddr_t *addr, uint64_t now_us);
/* Whether a probe round is due; ap__reach_probed schedules the next one. */
bool ap__reach_due(const ap_reach_t *r, uint64_t now_us);
void ap__reach_probed(ap_reach_t *r, uint64_t now_us);

#endif
