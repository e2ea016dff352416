/* Port mapping on the home gateway: UPnP IGD (libminiupnpc) and NAT-PMP
 * (libnatpmp, RFC 6886). Internal.
 *
 * A node behind a home router listens on a private address; the router
 * can be asked to forward a port of its public address to it. Two
 * protocols do that: UPnP IGD (SSDP discovery, then SOAP over HTTP to the
 * router's WANIPConnection service) and NAT-PMP (UDP to the default
 * gateway, port 5351). Both calls block (discovery waits for answers), so:
 *
 *   - ap__portmap_add / ap__portmap_del are the blocking calls;
 *   - ap__portmap_start runs them on a thread of its own: it maps a TCP
 *     port, renews the lease at half its lifetime, retries after a
 *     failure, and ap__portmap_stop removes the mapping and joins the
 *     thread. A loop thread never waits for a gateway.
 *
 * A mapping is not proof of reachability (a second NAT upstream, a
 * firewall): the node announces the mapped address only once AutoNAT
 * confirms it (docs/nat.md). */
#ifndef AP_P2P_PORTMAP_H
#define AP_P2P_PORTMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum ap_portmap_via {
    AP_PORTMAP_UPNP = 1,
    AP_PORTMAP_NATPMP = 2,
} ap_portmap_via_t;
#define AP_PORTMAP_ANY (AP_PORTMAP_UPNP | AP_PORTMAP_NATPMP)

#define AP_PORTMAP_LIFETIME_S 3600u /* asked for; renewed at half of what is granted */

typedef struct ap_portmap_lease {
    ap_portmap_via_t via;
    uint16_t internal_port, external_port;
    char external_ip[46]; /* dotted IPv4: the gateway's public address */
    char internal_ip[46]; /* our LAN address the gateway forwards to (UPnP) */
    uint32_t lifetime_s;  /* granted; 0 = permanent (UPnP only) */
    /* UPnP: the service the mapping was made at (to renew and delete it
     * without discovering again) */
    char control_url[512];
    char service_type[256];
} ap_portmap_lease_t;

const char *ap__portmap_via_name(ap_portmap_via_t via);

/* Blocking: asks the gateway to forward TCP `port` of its public address
 * to this host's `port`, trying UPnP then NAT-PMP among `protos`
 * (AP_PORTMAP_* bits), each bounded by about timeout_ms. 0 and *out, or
 * AP_ENOTFOUND (no gateway answered), AP_EEXIST (the port is mapped to
 * another host), AP_EPERM (refused) or AP_EIO, with the reason in why. */
int ap__portmap_add(unsigned protos, uint16_t port, uint32_t lifetime_s, int timeout_ms,
                    ap_portmap_lease_t *out, char *why, size_t wn);
/* Blocking: removes a mapping ap__portmap_add made. */
int ap__portmap_del(const ap_portmap_lease_t *l, int timeout_ms, char *why, size_t wn);

/* ---- on a thread of its own ----------------------------------------------------------- */

typedef struct ap_portmap ap_portmap_t;

/* status 0: l is the current mapping (new, or changed at a renewal);
 * negative: the mapping failed or was lost (l NULL); a retry follows after
 * AP_PORTMAP_RETRY_S. Runs on the portmap's thread: hand it to your loop
 * (ap_rt_post, uv_async_send). Never called once ap__portmap_stop began. */
typedef void (*ap_portmap_cb)(void *arg, int status, const ap_portmap_lease_t *l);
#define AP_PORTMAP_RETRY_S 300u

/* Starts mapping TCP `port` (protos: AP_PORTMAP_* bits). NULL if the
 * thread cannot start. Any thread. */
ap_portmap_t *ap__portmap_start(uint16_t port, unsigned protos, ap_portmap_cb cb, void *arg);
/* Stops renewing, removes the mapping if one is held (a call in flight is
 * finished first), joins the thread and frees pm. Blocks for up to two
 * gateway timeouts: call it off the loop thread where possible. Returns
 * whether a mapping was removed. NULL: false. */
bool ap__portmap_stop(ap_portmap_t *pm);

#endif
