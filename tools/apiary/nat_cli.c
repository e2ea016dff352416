/* AutoNAT and port mapping for the CLI's long-running nodes (see cli.h). */
#include "cli.h"

#include "apiary/collab.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/multiaddr.h"
#include "apiary/node.h"

#include <stdio.h>
#include <string.h>

static void on_change(ap_rt_t *rt, void *arg, ap_node_reach_t r, const char *addr)
{
    ap_cli_nat_t *nat = arg;
    bool priv = r == AP_NODE_REACH_PRIVATE;
    const char *what = "";
    if (!nat->client && r != AP_NODE_REACH_UNKNOWN) {
        ap_collab_t *c = nat->collab ? *nat->collab : NULL;
        if (nat->dht) ap_dht_set_client_mode(nat->dht, priv);
        /* with relays, peers reach it through them (and hole punching) */
        if (c && !nat->relays) ap_collab_set_client(c, priv);
        if (c && nat->relays) c = NULL;
        if (priv)
            what = nat->dht && c             ? "; the DHT and averaging run client-only"
                   : nat->dht && nat->relays ? "; the DHT runs client-only, peers reach it "
                                               "through its relays"
                   : nat->dht                ? "; the DHT runs client-only"
                                             : "";
        else if (nat->last == AP_NODE_REACH_PRIVATE)
            what = nat->dht && c ? "; the DHT and averaging answer again"
                   : nat->dht    ? "; the DHT answers again"
                                 : "";
    }
    nat->last = (int)r;
    printf("apiary %s: reachability %s (%s %s)%s\n", nat->cmd, ap_node_reach_name(r),
           r == AP_NODE_REACH_PUBLIC ? "peers dialled back" : "peers could not dial",
           addr && *addr ? addr : "-", what);
    fflush(stdout);
}

static bool loopback(const char *listen)
{
    ap_multiaddr_t ma;
    if (!listen || ap_multiaddr_parse(&ma, listen) != 0) return false;
    if (ma.host == AP_MA_HOST_IP4) return ma.ip[0] == 127;
    if (ma.host == AP_MA_HOST_IP6) {
        static const uint8_t one[16] = {[15] = 1};
        return memcmp(ma.ip, one, 16) == 0;
    }
    return false;
}

int ap_cli_nat_start(ap_rt_t *rt, const char *listen, ap_cli_nat_t *nat)
{
    if (nat->client) return 0;
    ap_node_nat_opts_t o = {
        .port_map = !nat->no_port_map && !loopback(listen), .on_change = on_change, .arg = nat};
    int rc = ap_node_nat_start_sync(rt, &o);
    if (rc)
        fprintf(stderr, "apiary %s: cannot check reachability (AutoNAT): %s\n", nat->cmd,
                ap_strerror(rc));
    return rc;
}

static void detach_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_cli_nat_t *nat = arg;
    nat->dht = NULL;
    nat->collab = NULL;
    ap_sync_complete(done, 0);
}

void ap_cli_nat_detach(ap_rt_t *rt, ap_cli_nat_t *nat)
{
    int rc = ap_node_call_sync(rt, detach_fn, nat);
    (void)rc; /* AP_ESHUTDOWN: the node is gone, nothing calls back */
}
