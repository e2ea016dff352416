/* Home networks behind NAT routers, in network namespaces, for tests and
 * benchmarks of NAT traversal.
 *
 *   ns "apnat-<pid>-<seq>-net": the "internet", bridge br0 198.18.0.254/24
 *     |-- public node i:  ns ...-p<i>, eth0 198.18.0.<1+i>/24
 *     |-- router k:       ns ...-r<k>, wan0 198.18.0.<101+k>/24,
 *     |                   lan0 10.<90+k>.0.1/24, conntrack NAT (nftables)
 *     |     `-- home host k: ns ...-h<k>, eth0 10.<90+k>.0.2/24,
 *     |                      default route via 10.<90+k>.0.1
 *
 * 198.18.0.0/15 is the range set aside for network tests (RFC 2544); home
 * networks use private addresses (RFC 1918), as behind a real router. Every
 * router masquerades what leaves wan0 and forwards nothing inbound that is
 * not part of a connection a home host started. Kinds:
 *   AP_NAT_DROP       port-preserving (the kernel keeps the source port when
 *                     it is free); unsolicited inbound packets are dropped
 *                     silently, also those addressed to the router itself;
 *   AP_NAT_RST        port-preserving; an unsolicited TCP SYN is answered
 *                     with a RST (other unsolicited packets are dropped);
 *   AP_NAT_SYMMETRIC  `masquerade fully-random`: every new connection gets a
 *                     random source port, so the mapping a peer observes is
 *                     useless to anyone else; unsolicited inbound dropped.
 *   AP_NAT_UPNP       as AP_NAT_DROP, and the router runs miniupnpd (UPnP IGD
 *                     and NAT-PMP on lan0, nftables backend): a home host
 *                     may ask it to forward a port. miniupnpd refuses to
 *                     forward from an external address in a reserved range,
 *                     198.18.0.0/15 included, so this router's wan0 has
 *                     AP_NATNS_UPNP_NET.<101+k>/24 instead, on the same
 *                     bridge (every node has an on-link route to that /24).
 *                     Nothing leaves the namespaces, so no real host at that
 *                     address is ever reached.
 *
 * Nothing is created in the root namespace; deleting the namespaces removes
 * the bridge, the veths and the rules. Commands run as argv arrays (`ip`,
 * `nft`, no shell). Clean-up: ap_natns_free; also exit() (atexit) and
 * SIGINT/SIGTERM/SIGHUP when no other handler was installed; namespaces of
 * a creator that died by SIGKILL are removed by the next ap_natns_new.
 *
 * Not thread-safe. Needs root and a kernel with veth, bridge, nf_tables and
 * nf_conntrack. */
#ifndef AP_TESTING_NATNS_H
#define AP_TESTING_NATNS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define AP_NATNS_MAX_PUBLIC 16
#define AP_NATNS_MAX_HOMES  16

typedef enum ap_nat_kind {
    AP_NAT_DROP = 0,
    AP_NAT_RST = 1,
    AP_NAT_SYMMETRIC = 2,
    AP_NAT_UPNP = 3,
} ap_nat_kind_t;

#define AP_NATNS_UPNP_NET "11.18.0" /* the wan0 /24 of AP_NAT_UPNP routers */

typedef struct ap_natns ap_natns_t;

/* "drop", "rst", "symmetric", "upnp". */
const char *ap_nat_kind_name(ap_nat_kind_t k);

/* 0 if the topology can be built here: root, `ip` and `nft` found, and a
 * probe namespace accepted a NAT table. Else a negative AP_E* code
 * (AP_EPERM: not root; AP_ENOTSUP: a tool or kernel feature is missing)
 * and the reason in why. */
int ap_natns_probe(char *why, size_t wn);

/* Builds the internet with npublic public nodes and one home network
 * behind a router of kinds[k] for each k < nhomes. On failure everything
 * made so far is deleted, *out is NULL and why names the failing command
 * and its output. */
int ap_natns_new(size_t npublic, size_t nhomes, const ap_nat_kind_t *kinds, ap_natns_t **out,
                 char *why, size_t wn);
/* Deletes every namespace (processes still inside keep theirs alive until
 * they exit) and frees ns. NULL is a no-op. */
void ap_natns_free(ap_natns_t *ns);

size_t ap_natns_npublic(const ap_natns_t *ns);
size_t ap_natns_nhomes(const ap_natns_t *ns);
ap_nat_kind_t ap_natns_kind(const ap_natns_t *ns, size_t home);

/* Dotted IPv4 addresses: public node i; home host k (its private
 * address); router k's public (wan0) address, which is what peers on the
 * internet see of home host k. NULL when out of range. */
const char *ap_natns_public_ip(const ap_natns_t *ns, size_t i);
const char *ap_natns_home_ip(const ap_natns_t *ns, size_t k);
const char *ap_natns_router_ip(const ap_natns_t *ns, size_t k);

/* Delays every packet between home host k and the internet by ms in each
 * direction (tc netem on router k's wan0 and lan0), so a home's round trip
 * to a public node grows by 2 * ms and one between two delayed homes by
 * 2 * (ms_a + ms_b). 0 removes the delay. AP_EINVAL for a bad k; AP_ENOTSUP
 * without `tc` or the netem qdisc (why says which). */
int ap_natns_set_delay(ap_natns_t *ns, size_t k, unsigned ms, char *why, size_t wn);

/* AP_NAT_UPNP router k: the number of TCP port forwards miniupnpd holds
 * now (its DNAT rules), or a negative AP_E* code (not a UPnP router, nft
 * failed). */
int ap_natns_upnp_mappings(const ap_natns_t *ns, size_t k);
/* Whether the file miniupnpd of router k logs into contains needle. */
bool ap_natns_upnp_log_has(const ap_natns_t *ns, size_t k, const char *needle);

/* Namespace names (for `ip netns exec` and the like). */
const char *ap_natns_public_name(const ap_natns_t *ns, size_t i);
const char *ap_natns_home_name(const ap_natns_t *ns, size_t k);
const char *ap_natns_router_name(const ap_natns_t *ns, size_t k);

/* Moves the calling process (meant for a freshly forked child) into public
 * node i / home host k / router k. */
int ap_natns_enter_public(const ap_natns_t *ns, size_t i);
int ap_natns_enter_home(const ap_natns_t *ns, size_t k);
int ap_natns_enter_router(const ap_natns_t *ns, size_t k);

/* Reads exactly n bytes from fd (a child's result pipe), waiting at most
 * ms for each read; false on timeout, EOF or error. */
bool ap_natns_read_within(int fd, void *p, size_t n, int ms);
/* SIGKILLs and reaps every pids[i] > 0 (the scenario's children), zeroing
 * each. */
void ap_natns_kill_all(pid_t *pids, size_t n);

#endif
