/* Shaped links for benchmarks and tests: a star of network namespaces.
 *
 *                 hub namespace "apiary-<pid>-hub"
 *          bridge br0 (10.77.0.254/24), one port hI per host
 *            |                |                      |
 *   veth h0<->eth0    veth h1<->eth0    ...   veth hN-1<->eth0
 *   ns apiary-<pid>-0 ns apiary-<pid>-1       ns apiary-<pid>-<N-1>
 *   eth0 10.77.0.1/24 eth0 10.77.0.2/24       eth0 10.77.0.N/24
 *
 * Nothing is created in the root namespace: the bridge and the hub-side
 * veth ends live in the hub namespace, so deleting the namespaces removes
 * everything, and parallel runs (different pids) never see each other.
 *
 * Shaping (htb, one class per device, rate = ceil): egress of the host's
 * eth0 = the host's upload, egress of the hub-side hI = its download. A rate
 * of 0 leaves that direction unshaped. htb counts whole Ethernet frames
 * (14-byte header + IP + TCP + payload), so TCP goodput is ~95 % of the rate
 * at MTU 1500; ap_netns_measure reports what a plain TCP stream really gets.
 *
 * Commands run as argv arrays through posix_spawnp (`ip`, `tc`; no shell).
 * Clean-up: ap_netns_free deletes every namespace; so do exit() (atexit) and
 * SIGINT/SIGTERM/SIGHUP (the handler unmounts the namespaces with
 * async-signal-safe calls, then re-raises the signal), when no other handler
 * was installed. Namespaces of a process that died by SIGKILL are removed by
 * the next ap_netns_new (names carry the creator's pid).
 *
 * Not thread-safe: one thread creates, shapes and frees. Needs root (or
 * CAP_SYS_ADMIN + CAP_NET_ADMIN) and a kernel with veth, bridge and htb. */
#ifndef AP_BENCH_NETNS_H
#define AP_BENCH_NETNS_H

#include <stdbool.h>
#include <stddef.h>

#define AP_NETNS_MAX_HOSTS 200
#define AP_NETNS_HUB_IP    "10.77.0.254"

typedef struct ap_netns ap_netns_t;

/* Link rates of one host in bits/s (0 = unshaped). */
typedef struct ap_netns_link {
    double up_bps;
    double down_bps;
} ap_netns_link_t;

/* 0 if namespaces can be made here (root, `ip` and `tc` found, a probe
 * namespace with a veth pair and an htb qdisc could be created and deleted);
 * else a negative AP_E* code (AP_EPERM: not root; AP_ENOTSUP: no netns, veth
 * or htb) and a reason in why (n bytes). */
int ap_netns_probe(char *why, size_t n);

/* Write / read exactly n bytes on a pipe or a socket (EINTR retried; a
 * socket is written with MSG_NOSIGNAL). False on error or end of file. */
bool ap_netns_write_full(int fd, const void *p, size_t n);
bool ap_netns_read_full(int fd, void *p, size_t n);

/* Creates the hub and n hosts (1..AP_NETNS_MAX_HOSTS) with links[i] (NULL =
 * all unshaped). On failure everything made so far is deleted, *out is NULL
 * and why holds the failing command and its output. */
int ap_netns_new(size_t n, const ap_netns_link_t *links, ap_netns_t **out, char *why, size_t wn);

/* Deletes every namespace of ns (the bridge and veths go with them) and
 * frees it. NULL is a no-op. Processes still inside a namespace keep it
 * alive (without its name) until they exit. */
void ap_netns_free(ap_netns_t *ns);

size_t ap_netns_count(const ap_netns_t *ns);
/* Namespace name of host i, or of the hub when i == ap_netns_count(ns). */
const char *ap_netns_name(const ap_netns_t *ns, size_t i);
/* Dotted IPv4 address of host i ("10.77.0.<i+1>"), or of the hub (i == n). */
const char *ap_netns_ip(const ap_netns_t *ns, size_t i);
/* The current shaping of host i. */
ap_netns_link_t ap_netns_link(const ap_netns_t *ns, size_t i);

/* Changes host i's shaping (tc replace; takes effect at once). */
int ap_netns_shape(ap_netns_t *ns, size_t i, const ap_netns_link_t *l, char *why, size_t wn);

/* Moves the calling process into host i's namespace (i == n: the hub). Meant
 * for a freshly forked child: sockets it opens afterwards live there. */
int ap_netns_enter(const ap_netns_t *ns, size_t i);

/* Measures what one TCP stream gets through each host's link, all hosts at
 * once: host i uploads to a sink in the hub for `seconds`, then downloads
 * from it for `seconds`; rates are payload bytes/s at the receiver, counted
 * after the first 20 % of the transfer (slow start, htb's burst). up and
 * down have ap_netns_count(ns) entries. */
int ap_netns_measure(ap_netns_t *ns, double seconds, double *up, double *down, char *why,
                     size_t wn);

#endif
