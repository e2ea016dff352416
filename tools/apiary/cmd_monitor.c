/* `apiary monitor`: a client-mode node that reads a run's progress records
 * from the DHT and serves the dashboard, /api/state, /api/events and
 * /metrics (docs/monitor.md). */
#include "cli.h"
#include "monitor.h"

#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/log.h"
#include "apiary/node.h"

#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_PEERS 64

static void usage(FILE *f)
{
    fprintf(f, "usage: apiary monitor --run-id R --initial-peers MADDR[,MADDR...] [options]\n\n"
               "Watches a collaborative run: reads its peers' progress records from the DHT\n"
               "(as a client: it never answers DHT requests) and serves a live dashboard.\n\n"
               "options:\n"
               "  --run-id R                the run to watch (required)\n"
               "  --initial-peers MADDR,... peers to join through, with /p2p/<PeerID> (required)\n"
               "  --http ADDR               where to serve the page (default 127.0.0.1:8080;\n"
               "                            port 0 = any; it is read-only, but bind a public\n"
               "                            address only on purpose)\n"
               "  --log-level LEVEL         debug, info, warn (default), error, off\n\n"
               "endpoints: /  (the page)   /api/state  (JSON)   /api/events  (server-sent\n"
               "events)   /metrics  (Prometheus text)\n");
}

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig)
{
    stop_flag = sig;
}

static int monitor_main(int argc, char **argv)
{
    const char *run_id = NULL, *http = "127.0.0.1:8080";
    char *peers[MAX_PEERS];
    int npeers = 0;
    enum { O_RUN = 1, O_PEERS, O_HTTP, O_LOG };
    static const struct option lo[] = {
        {"run-id", required_argument, 0, O_RUN}, {"initial-peers", required_argument, 0, O_PEERS},
        {"http", required_argument, 0, O_HTTP},  {"log-level", required_argument, 0, O_LOG},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    int ch, rc = 2;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case O_RUN:
            run_id = optarg;
            break;
        case O_HTTP:
            http = optarg;
            break;
        case O_LOG:
            if (!ap_cli_set_log_level(optarg)) goto out;
            break;
        case O_PEERS:
            if (!ap_cli_peer_list("monitor", optarg, peers, &npeers, MAX_PEERS)) goto out;
            break;
        case 'h':
            usage(stdout);
            rc = 0;
            goto out;
        default:
            usage(stderr);
            goto out;
        }
    }
    if (!run_id || !*run_id || strlen(run_id) > AP_COLLAB_RUN_ID_MAX || !npeers) {
        fprintf(stderr, "apiary monitor: needs --run-id R (1..%d bytes) and --initial-peers\n",
                AP_COLLAB_RUN_ID_MAX);
        usage(stderr);
        goto out;
    }
    rc = 1;
    ap_host_t *host = ap_host_new();
    ap_rt_t *rt = NULL;
    ap_dht_t *dht = NULL;
    mon_server_t *mon = NULL;
    ap_node_opts_t no = {.dial_only = true};
    int e = host ? ap_host_start(host) : AP_ENOMEM;
    if (!e) e = ap_node_new(host, &no, &rt);
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    cfg.client_mode = true;
    if (!e) e = ap_dht_new_sync(rt, &cfg, &dht);
    if (e) {
        fprintf(stderr, "apiary monitor: cannot start a node: %s\n", ap_strerror(e));
        goto close;
    }
    e = ap_dht_bootstrap_sync(dht, (const char *const *)peers, (size_t)npeers);
    if (e) {
        fprintf(stderr,
                "apiary monitor: none of the %d initial peers answered (%s); check the "
                "addresses (they need /p2p/<PeerID>) and that those nodes are running\n",
                npeers, ap_strerror(e));
        goto close;
    }
    e = mon_server_start(rt, dht, run_id, http, &mon);
    if (e) {
        fprintf(stderr, "apiary monitor: cannot serve HTTP on %s: %s (use --http HOST:PORT)\n",
                http, ap_strerror(e));
        goto close;
    }
    printf("apiary monitor: run %s: dashboard at %s (metrics at %smetrics)\n", run_id,
           mon_server_url(mon), mon_server_url(mon));
    fflush(stdout);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    while (!stop_flag) pause();
    fprintf(stderr, "apiary monitor: shutting down\n");
    rc = 0;
close:
    mon_server_stop(mon);
    if (dht) ap_dht_free_sync(dht);
    if (host) ap_host_free(host);
out:
    for (int i = 0; i < npeers; i++) free(peers[i]);
    return rc;
}

AP_CLI_COMMAND(monitor_cmd, "monitor", monitor_main,
               "watch a run: live dashboard, /api/state and Prometheus /metrics over HTTP")
