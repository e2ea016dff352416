/* The `apiary` command-line tool: the address flags shared by every
 * long-running command (--announce) and the check that a node listening only
 * on loopback is not asked to join peers on other hosts. */
#include "cli.h"

#include "apiary/multiaddr.h"
#include "apiary/node.h"
#include "apiary/error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool ap_cli_announce(const char *text, const char **list, int *n)
{
    ap_multiaddr_t ma;
    if (*n >= AP_NODE_MAX_ANNOUNCE) {
        fprintf(stderr, "apiary: at most %d --announce addresses\n", AP_NODE_MAX_ANNOUNCE);
        return false;
    }
    if (!text || ap_multiaddr_parse(&ma, text) != 0 || ma.host == AP_MA_HOST_NONE || !ma.has_tcp ||
        ma.port == 0) {
        fprintf(stderr,
                "apiary: --announce needs an address peers can dial, /ip4/A.B.C.D/tcp/PORT, "
                "/ip6/ADDR/tcp/PORT or /dns4/NAME/tcp/PORT with PORT > 0 (got '%s')\n",
                text ? text : "");
        return false;
    }
    list[(*n)++] = text;
    return true;
}

bool ap_cli_peer_list(const char *cmd, const char *text, char **list, int *n, int max)
{
    char *copy = strdup(text);
    if (!copy) {
        fprintf(stderr, "apiary %s: out of memory\n", cmd);
        return false;
    }
    bool ok = true;
    for (char *sv = NULL, *t = strtok_r(copy, ",", &sv); t && ok; t = strtok_r(NULL, ",", &sv)) {
        if (*n == max) {
            fprintf(stderr, "apiary %s: at most %d initial peers\n", cmd, max);
            ok = false;
        } else if (!(list[*n] = strdup(t))) {
            fprintf(stderr, "apiary %s: out of memory\n", cmd);
            ok = false;
        } else {
            (*n)++;
        }
    }
    free(copy);
    return ok;
}

static bool is_loopback(const char *addr)
{
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) != 0) return false;
    static const uint8_t v6lo[16] = {[15] = 1};
    switch (ma.host) {
    case AP_MA_HOST_IP4:
        return ma.ip[0] == 127;
    case AP_MA_HOST_IP6:
        return memcmp(ma.ip, v6lo, 16) == 0;
    case AP_MA_HOST_DNS4:
    case AP_MA_HOST_DNS6:
        return strcmp(ma.dns, "localhost") == 0;
    default:
        return false;
    }
}

bool ap_cli_check_reachable(const char *cmd, char (*addrs)[AP_RT_ADDR_MAX], int naddrs,
                            char *const *peers, int npeers)
{
    for (int i = 0; i < naddrs; i++)
        if (!is_loopback(addrs[i])) return true;
    for (int i = 0; i < npeers; i++) {
        if (is_loopback(peers[i])) continue;
        fprintf(stderr,
                "apiary %s: this node is reachable only on loopback (%s) but initial peer %s is "
                "on another host, which could not reach it back; listen on a host address "
                "(--listen /ip4/0.0.0.0/tcp/PORT) or give the address peers should dial "
                "(--announce /ip4/A.B.C.D/tcp/PORT)\n",
                cmd, naddrs ? addrs[0] : "no address", peers[i]);
        return false;
    }
    return true;
}

bool ap_cli_relays_add(const char *cmd, const char *text, ap_cli_relays_t *r)
{
    char *copy = strdup(text);
    if (!copy) {
        fprintf(stderr, "apiary %s: out of memory\n", cmd);
        return false;
    }
    bool ok = true;
    for (char *sv = NULL, *t = strtok_r(copy, ",", &sv); t && ok; t = strtok_r(NULL, ",", &sv)) {
        ap_multiaddr_t ma;
        if (r->n == AP_NODE_MAX_RELAYS) {
            fprintf(stderr, "apiary %s: at most %d relays\n", cmd, AP_NODE_MAX_RELAYS);
            ok = false;
        } else if (strlen(t) >= AP_RT_ADDR_MAX || ap_multiaddr_parse(&ma, t) != 0 || ma.circuit ||
                   !ma.has_peer || !ma.has_tcp || ma.port == 0 || ma.host == AP_MA_HOST_NONE) {
            fprintf(stderr,
                    "apiary %s: --relays takes relay addresses with their PeerID, "
                    "/ip4/A.B.C.D/tcp/PORT/p2p/12D3KooW... (got '%s')\n",
                    cmd, t);
            ok = false;
        } else {
            snprintf(r->addr[r->n], AP_RT_ADDR_MAX, "%s", t);
            r->list[r->n] = r->addr[r->n];
            r->n++;
        }
    }
    free(copy);
    return ok;
}

void ap_cli_relays_apply(const ap_cli_relays_t *r, ap_node_opts_t *no)
{
    no->relays = r->n ? r->list : NULL;
    no->nrelays = r->n;
    no->relay_bulk = r->bulk;
    no->no_hole_punch = r->no_punch;
}

void ap_cli_relays_report(const char *cmd, ap_rt_t *rt)
{
    ap_node_relay_stats_t st;
    if (ap_node_relay_stats_sync(rt, &st) != 0) return;
    if (!st.reservations && !st.relayed_in && !st.relayed_out && !st.punch_started) return;
    printf("apiary %s: relays: reservations %u (live %u) | relayed connections in %llu, out %llu "
           "| hole punches %u: direct %u, failed %u | moved to direct %llu | bulk refused %llu\n",
           cmd, st.reservations, st.live_reservations, (unsigned long long)st.relayed_in,
           (unsigned long long)st.relayed_out, st.punch_started, st.punch_direct, st.punch_failed,
           (unsigned long long)st.direct_taken, (unsigned long long)st.bulk_refused);
    fflush(stdout);
}
