/* libuv driver: the addresses a node gives its peers. A node listening on a
 * wildcard host (0.0.0.0, ::) advertises the host's interface addresses with
 * the bound port, since a peer on another machine that dials 0.0.0.0 reaches
 * itself; announced addresses (a port forward, a public address) replace
 * both. */
#include "runtime/uv/uv_impl.h"

#include "apiary/log.h"
#include "apiary/multiaddr.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>

#define IFADDR_REFRESH_US 10000000u /* interfaces come and go (DHCP, VPN) */

int ap__node_set_announce(ap_node_t *n, const char *const *addrs, int naddrs)
{
    if (naddrs <= 0) return 0;
    if (!addrs || naddrs > AP_NODE_MAX_ANNOUNCE) return AP_EINVAL;
    if (!n->tcpc || !n->addr[0]) return AP_EINVAL; /* in-process or dial-only */
    for (int i = 0; i < naddrs; i++) {
        ap_multiaddr_t ma;
        if (!addrs[i] || ap_multiaddr_parse(&ma, addrs[i]) != 0) return AP_EADDR;
        if (ma.host == AP_MA_HOST_NONE || !ma.has_tcp || ma.port == 0) return AP_EADDR;
        if (ma.has_peer && !ap_peer_id_eq(&ma.peer, &n->rt.self)) return AP_EADDR;
        ma.has_peer = false;
        if (ap_multiaddr_print(&ma, n->announce[i], AP_RT_ADDR_MAX) < 0) return AP_EADDR;
    }
    n->nannounce = naddrs;
    return 0;
}

static bool is_wildcard(const ap_multiaddr_t *ma)
{
    static const uint8_t zero[16] = {0};
    size_t len = ma->host == AP_MA_HOST_IP4 ? 4 : 16;
    return (ma->host == AP_MA_HOST_IP4 || ma->host == AP_MA_HOST_IP6) &&
           memcmp(ma->ip, zero, len) == 0;
}

/* Interface addresses of the wildcard's family, not loopback (nor link-local),
 * in the kernel's order; the loopback ones only if nothing else is up. */
static void read_ifaddrs(ap_node_t *n, const ap_multiaddr_t *bound)
{
    uv_interface_address_t *ifs = NULL;
    int nifs = 0;
    n->nifaddr = 0;
    if (uv_interface_addresses(&ifs, &nifs) != 0) {
        ap_warn("uv", "cannot read the interface addresses; advertising none");
        return;
    }
    int family = bound->host == AP_MA_HOST_IP4 ? AF_INET : AF_INET6;
    for (int pass = 0; pass < 2 && n->nifaddr == 0; pass++) {
        for (int i = 0; i < nifs && n->nifaddr < AP_NODE_MAX_ANNOUNCE; i++) {
            const struct sockaddr *sa = (const struct sockaddr *)&ifs[i].address;
            if (sa->sa_family != family) continue;
            if ((ifs[i].is_internal != 0) != (pass == 1)) continue; /* pass 1: loopback */
            if (family == AF_INET6) {
                const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)sa;
                if (IN6_IS_ADDR_LINKLOCAL(&s6->sin6_addr)) continue;
            }
            ap_multiaddr_t ma;
            if (ap_multiaddr_from_sockaddr(&ma, sa) != 0) continue;
            ma.port = bound->port;
            char *out = n->ifaddr[n->nifaddr];
            if (ap_multiaddr_print(&ma, out, AP_RT_ADDR_MAX) < 0) continue;
            bool dup = false; /* one address on two interfaces */
            for (int k = 0; k < n->nifaddr && !dup; k++) dup = strcmp(n->ifaddr[k], out) == 0;
            if (!dup) n->nifaddr++;
        }
    }
    uv_free_interface_addresses(ifs, nifs);
}

int ap__node_addrs(ap_node_t *n, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    if (!n->addr[0]) return 0; /* a dial-only TCP node */
    const char(*src)[AP_RT_ADDR_MAX] = (const char(*)[AP_RT_ADDR_MAX])n->addr;
    int count = 1;
    ap_multiaddr_t bound;
    if (n->nannounce > 0) {
        src = (const char(*)[AP_RT_ADDR_MAX])n->announce;
        count = n->nannounce;
    } else if (n->tcpc && ap_multiaddr_parse(&bound, n->addr) == 0 && is_wildcard(&bound)) {
        uint64_t now = ap__host_now_us(n->host);
        if (!n->ifaddr_at || now - n->ifaddr_at >= IFADDR_REFRESH_US) {
            read_ifaddrs(n, &bound);
            n->ifaddr_at = now ? now : 1;
        }
        src = (const char(*)[AP_RT_ADDR_MAX])n->ifaddr;
        count = n->nifaddr;
    }
    /* circuit addresses (through our relays) after the direct ones; they get
     * at least half of the room when there are more addresses than room */
    char circ[AP_NODE_MAX_CIRCUITS][AP_RT_ADDR_MAX];
    int ncirc = ap__tcpc_circuit_addrs(n, circ, AP_NODE_MAX_CIRCUITS);
    int croom = ncirc < max / 2 ? ncirc : max / 2;
    int ndirect = count < max - croom ? count : max - croom;
    if (ndirect < 0) ndirect = 0;
    char id[AP_PEER_ID_STR_MAX];
    if (with_id) ap_peer_id_str(&n->rt.self, id);
    int k = 0;
    for (int i = 0; i < count + ncirc && k < max; i++) {
        if (i < count && i >= ndirect) continue;
        const char *a = i < count ? src[i] : circ[i - count];
        if (with_id)
            snprintf(addrs[k++], AP_RT_ADDR_MAX, "%.180s/p2p/%s", a, id);
        else
            snprintf(addrs[k++], AP_RT_ADDR_MAX, "%s", a);
    }
    return count + ncirc;
}
