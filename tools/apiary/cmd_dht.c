/* `apiary dht`: run a DHT node, or get / store one key against a live
 * network. The node runs on a libuv host thread (include/apiary/node.h); this
 * thread talks to it through the DHT's blocking wrappers. */
#include "cli.h"
#include "monitor.h"

#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PEERS 64

static void usage(FILE *f)
{
    fprintf(
        f, "usage: apiary dht [options]                          run a DHT node until Ctrl-C\n"
           "       apiary dht get KEY [--latest] [options]       print the value(s) of KEY\n"
           "       apiary dht store KEY VALUE --ttl S [--subkey SK] [options]\n"
           "       apiary dht store KEY --value-file PATH|- --ttl S [...]  value from a file or "
           "stdin\n\n"
           "options:\n"
           "  --listen MULTIADDR        listen address (default /ip4/0.0.0.0/tcp/0 for a node,\n"
           "                            /ip4/127.0.0.1/tcp/0 for get/store)\n"
           "  --announce MULTIADDR      address to give to other peers instead (repeatable, <= 4)\n"
           "  --initial-peers MADDR[,MADDR...]  peers to join through, with /p2p/<PeerID>\n"
           "                            (repeatable; required for get and store)\n"
           "  --identity PATH           Ed25519 key file, created (mode 0600) if missing\n"
           "                            (default: a fresh key for this run)\n"
           "  --client                  ask, never answer (default for get/store); without it a\n"
           "                            node checks whether peers can reach it (AutoNAT) and\n"
           "                            runs as a client while they cannot (docs/nat.md)\n"
           "  --no-port-map             node: do not ask the home router (UPnP IGD, NAT-PMP) to\n"
           "                            forward the listen port\n"
           "  --relay-service           node: relay for peers behind NAT (circuit relay v2:\n"
           "                            they reserve a slot here and are reached through it)\n"
           "  --relay-max-reservations N  node: peers holding a relay slot at once (default 128)\n"
           "  --relays MADDR[,MADDR...] node behind a NAT: hold a reservation on these relays\n"
           "                            (with /p2p/<PeerID>; <= 8) and advertise the circuit\n"
           "                            addresses through them after the direct ones\n"
           "  --relay-bulk              also send bulk data over relayed connections\n"
           "  --no-hole-punch           keep relayed connections (no DCUtR to a direct one)\n"
           "  --stats-interval S        node: log routing-table size and stored keys every S\n"
           "                            seconds (default 30)\n"
           "  --stats                   node: also print the resource scopes (use and limits of\n"
           "                            the node, each protocol and the busiest peers) every\n"
           "                            --stats-interval and at exit\n"
           "  --max-memory MIB          node: what all peers together may make it hold\n"
           "                            (default 256)\n"
           "  --peer-memory MIB         node: what one peer may make it hold (default 64)\n"
           "  --max-handshakes N        node: inbound handshakes in progress, all sources\n"
           "                            (default 256; native and libp2p alike)\n"
           "  --handshakes-per-ip N     node: of them from one address (default 16)\n"
           "  --max-conns N             node: open connections (default 1024)\n"
           "  --conns-per-ip N          node: open inbound connections from one address\n"
           "                            (default 64; raise it for many peers behind one NAT)\n"
           "  --latest                  get: ask the k nearest nodes and return the newest value\n"
           "  --ttl S                   store: the record lives S seconds (required)\n"
           "  --subkey SK               store: write one entry of KEY's dictionary\n"
           "  --value-file PATH|-       store: the value is this file's bytes (- = stdin),\n"
           "                            at most 64 KiB\n"
           "  --http ADDR               node: serve the run monitor there (docs/monitor.md)\n"
           "  --run-id R                the run the monitor watches (default apiary)\n"
           "  --log-level LEVEL         debug, info, warn (default), error, off\n");
}

typedef struct opts {
    const char *listen;
    const char *announce[AP_NODE_MAX_ANNOUNCE];
    int nannounce;
    char *peers[MAX_PEERS];
    int npeers;
    const char *identity;
    bool client, latest, no_port_map;
    long ttl;
    const char *subkey;
    const char *value_file;
    int stats_interval;
    bool stats;
    long long max_memory_mib, peer_memory_mib; /* 0 = default */
    const char *http, *run_id;
    bool relay_service;
    long long relay_max_resv;                             /* 0 = default */
    long long max_hs, hs_per_ip, max_conns, conns_per_ip; /* admission; 0 = default */
    ap_cli_relays_t relays;
} opts_t;

static int add_peers(opts_t *o, const char *list)
{
    char *copy = strdup(list);
    if (!copy) return -1;
    for (char *save = NULL, *tok = strtok_r(copy, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (!*tok) continue;
        if (o->npeers == MAX_PEERS) {
            fprintf(stderr, "apiary dht: at most %d initial peers\n", MAX_PEERS);
            free(copy);
            return -1;
        }
        o->peers[o->npeers++] = strdup(tok);
    }
    free(copy);
    return 0;
}

/* The node's listen addresses with /p2p/<id>, at most max; a negative error
 * as ap_node_listen_addrs_sync. */
static int listen_addrs(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max)
{
    int n = ap_node_listen_addrs_sync(rt, addrs, max, true);
    return n > max ? max : n;
}

static void wall_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    *(int64_t *)arg = ap_rt_wall_ms(rt);
    ap_sync_complete(done, 0);
}

typedef struct node {
    ap_host_t *host;
    ap_rt_t *rt;
    ap_dht_t *dht;
} node_t;

static void node_close(node_t *n)
{
    if (n->dht) ap_dht_free_sync(n->dht);
    if (n->host) ap_host_free(n->host);
    memset(n, 0, sizeof *n);
}

/* Starts host, node and DHT; bootstraps through the initial peers.
 * dflt_listen NULL (a one-shot get or store): without --listen the node
 * only dials out and its DHT is a client, so it never advertises an address
 * nobody could dial back. */
static int node_open(node_t *n, const opts_t *o, const char *dflt_listen)
{
    bool client = o->client || (!dflt_listen && !o->listen);
    memset(n, 0, sizeof *n);
    ap_identity_t id;
    bool have_id = false;
    if (o->identity) {
        bool created = false;
        int rc = ap_identity_load_or_create(&id, o->identity, &created);
        if (rc) {
            fprintf(stderr, "apiary dht: cannot use identity file %s: %s\n", o->identity,
                    *ap_identity_last_error() ? ap_identity_last_error() : ap_strerror(rc));
            return rc;
        }
        if (created) fprintf(stderr, "apiary dht: created identity file %s\n", o->identity);
        have_id = true;
    }
    n->host = ap_host_new();
    if (!n->host) return AP_ENOMEM;
    int rc = ap_host_start(n->host);
    ap_node_opts_t no = {.ed25519_sk = have_id ? id.sk : NULL,
                         .listen = o->listen ? o->listen : dflt_listen,
                         .dial_only = !o->listen && !dflt_listen,
                         .announce = o->announce,
                         .nannounce = o->nannounce,
                         .relay_service = o->relay_service && dflt_listen,
                         .relay_limits = {.max_reservations = (uint32_t)o->relay_max_resv},
                         .admission = {.handshakes = (uint32_t)o->max_hs,
                                       .handshakes_per_ip = (uint32_t)o->hs_per_ip,
                                       .conns = (uint32_t)o->max_conns,
                                       .conns_per_ip = (uint32_t)o->conns_per_ip}};
    if (dflt_listen) ap_cli_relays_apply(&o->relays, &no);
    if (!rc) rc = ap_node_new(n->host, &no, &n->rt);
    if (have_id) ap_identity_wipe(&id);
    if (!rc && (o->max_memory_mib || o->peer_memory_mib)) {
        ap_node_limits_t lim;
        ap_node_limits_default(&lim);
        if (o->max_memory_mib) lim.node_memory = (uint64_t)o->max_memory_mib << 20;
        if (o->peer_memory_mib) lim.peer_memory = (uint64_t)o->peer_memory_mib << 20;
        if (lim.conn_memory > lim.peer_memory) lim.conn_memory = lim.peer_memory;
        if (lim.proto_memory > lim.node_memory) lim.proto_memory = lim.node_memory;
        rc = ap_node_set_limits_sync(n->rt, &lim);
        if (rc) {
            fprintf(stderr, "apiary dht: cannot set the resource limits: %s\n", ap_strerror(rc));
            node_close(n);
            return rc;
        }
    }
    if (rc) {
        fprintf(stderr, "apiary dht: cannot listen on %s: %s\n",
                no.listen ? no.listen : "(no listen address)", ap_strerror(rc));
        node_close(n);
        return rc;
    }
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    cfg.client_mode = client;
    rc = ap_dht_new_sync(n->rt, &cfg, &n->dht);
    if (rc) {
        fprintf(stderr, "apiary dht: cannot start the DHT: %s\n", ap_strerror(rc));
        node_close(n);
        return rc;
    }
    char addrs[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int na = client ? 0 : listen_addrs(n->rt, addrs, AP_NODE_MAX_ANNOUNCE);
    if (!client && !ap_cli_check_reachable("dht", addrs, na, o->peers, o->npeers)) {
        node_close(n);
        return AP_EUNREACH;
    }
    if (o->npeers) {
        rc = ap_dht_bootstrap_sync(n->dht, (const char *const *)o->peers, (size_t)o->npeers);
        if (rc) {
            fprintf(stderr,
                    "apiary dht: none of the %d initial peers answered (%s); check the addresses "
                    "(they need /p2p/<PeerID>) and that those nodes are running\n",
                    o->npeers, ap_strerror(rc));
            node_close(n);
            return rc;
        }
    }
    return 0;
}

static void print_bytes(const uint8_t *p, size_t n)
{
    bool text = true;
    for (size_t i = 0; i < n; i++)
        if (!isprint(p[i]) && p[i] != '\t') text = false;
    if (text) {
        fwrite(p, 1, n, stdout);
    } else {
        printf("0x");
        for (size_t i = 0; i < n; i++) printf("%02x", p[i]);
    }
}

static int run_get(const opts_t *o, const char *key)
{
    node_t n;
    int rc = node_open(&n, o, NULL);
    if (rc) return 1;
    ap_dht_result_t *res = NULL;
    rc = ap_dht_get_sync(n.dht, (const uint8_t *)key, strlen(key), o->latest, &res);
    int64_t now = 0;
    ap_node_call_sync(n.rt, wall_fn, &now);
    int exit_code = 0;
    if (rc) {
        fprintf(stderr, "apiary dht get: %s\n", ap_strerror(rc));
        exit_code = 1;
    } else if (!res->found) {
        fprintf(stderr, "apiary dht get: %s: not found\n", key);
        exit_code = 1;
    } else {
        for (size_t i = 0; i < res->nrecords; i++) {
            const ap_dht_record_t *r = &res->records[i];
            if (res->is_dict) {
                print_bytes(r->subkey, r->subkey_len);
                printf("\t");
            }
            print_bytes(r->value, r->value_len);
            printf("\t(expires in %.1f s)\n", (double)(r->expiration_ms - now) / 1000.0);
        }
    }
    ap_dht_result_free(res);
    node_close(&n);
    return exit_code;
}

/* Reads at most AP_DHT_VALUE_MAX bytes of path ("-" = stdin) into buf. */
static int read_value(const char *path, uint8_t *buf, size_t *len)
{
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) {
        fprintf(stderr, "apiary dht store: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t n = fread(buf, 1, AP_DHT_VALUE_MAX + 1, f);
    bool err = ferror(f);
    if (f != stdin) fclose(f);
    if (err) {
        fprintf(stderr, "apiary dht store: cannot read %s\n", path);
        return -1;
    }
    if (n > AP_DHT_VALUE_MAX) {
        fprintf(stderr, "apiary dht store: %s is over the %u-byte value limit\n", path,
                AP_DHT_VALUE_MAX);
        return -1;
    }
    *len = n;
    return 0;
}

/* What a refusal means, with the limit that was hit. */
static const char *store_reason(int rc)
{
    switch (rc) {
    case AP_EQUOTA:
        return "the nodes refused it: this peer's storage quota there is used up (bytes or "
               "records per peer); let some of its records expire or store from another node";
    case AP_EFULL:
        return "the nodes refused it: their storage is full of records that expire later and "
               "none can be evicted for this one; retry later or use a longer --ttl";
    case AP_ERATE:
        return "the nodes refused it: this peer exceeded their stores-per-minute rate limit; "
               "retry in a minute";
    case AP_EMSGSIZE:
        return "the record is over the size limits (key 1 KiB, subkey 1 KiB, value 64 KiB)";
    case AP_ERANGE:
        return "--ttl is beyond the nodes' maximum record lifetime";
    case AP_ESTALE:
        return "the nodes hold a value of this key that expires later (newest expiration wins)";
    default:
        return ap_strerror(rc);
    }
}

static int run_store(const opts_t *o, const char *key, const char *value)
{
    static uint8_t filebuf[AP_DHT_VALUE_MAX + 1];
    size_t vlen = value ? strlen(value) : 0;
    if (o->value_file) {
        if (read_value(o->value_file, filebuf, &vlen)) return 1;
        value = (const char *)filebuf;
    } else if (vlen > AP_DHT_VALUE_MAX) {
        fprintf(stderr, "apiary dht store: the value is over the %u-byte limit\n",
                AP_DHT_VALUE_MAX);
        return 1;
    }
    node_t n;
    int rc = node_open(&n, o, NULL);
    if (rc) return 1;
    int64_t now = 0;
    ap_node_call_sync(n.rt, wall_fn, &now);
    ap_dht_record_t r = {.key = (const uint8_t *)key,
                         .key_len = strlen(key),
                         .subkey = (const uint8_t *)o->subkey,
                         .subkey_len = o->subkey ? strlen(o->subkey) : 0,
                         .value = (const uint8_t *)value,
                         .value_len = vlen,
                         .expiration_ms = now + (int64_t)o->ttl * 1000};
    int nstored = 0;
    rc = ap_dht_store_sync(n.dht, &r, &nstored);
    if (rc)
        fprintf(stderr, "apiary dht store: %s (%s)\n", store_reason(rc), ap_err_name(rc));
    else
        printf("stored on %d node%s\n", nstored, nstored == 1 ? "" : "s");
    node_close(&n);
    return rc ? 1 : 0;
}

/* The resource scopes: the node's line in the log; with --stats the whole
 * report on stdout. */
static void print_resources(ap_rt_t *rt, bool full)
{
    char rep[8192];
    int len = ap_node_resources_sync(rt, 8, rep, sizeof rep);
    if (len <= 0) return;
    char *nl = strchr(rep, '\n');
    int first = nl ? (int)(nl - rep) : len;
    ap_log(AP_LOG_INFO, "rcmgr", "%.*s", first, rep);
    if (!full) return;
    printf("resources:\n");
    for (char *line = rep; *line;) {
        char *e = strchr(line, '\n');
        printf("  %.*s\n", e ? (int)(e - line) : (int)strlen(line), line);
        if (!e) break;
        line = e + 1;
    }
    fflush(stdout);
}

static int run_node(const opts_t *o)
{
    ap_cli_catch_stop(); /* a signal during the bootstrap also ends here, cleanly */
    node_t n;
    int rc = node_open(&n, o, "/ip4/0.0.0.0/tcp/0");
    if (rc) return 1;
    char addrs[4][AP_RT_ADDR_MAX];
    int na = listen_addrs(n.rt, addrs, 4);
    char id[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(ap_rt_self(n.rt), id);
    printf("DHT node %s%s\n", id, o->client ? " (client mode)" : "");
    printf("share one of these with --initial-peers:\n");
    for (int i = 0; i < na; i++) printf("  %s\n", addrs[i]);
    ap_cli_nat_t nat = {.cmd = "dht",
                        .client = o->client,
                        .no_port_map = o->no_port_map,
                        .relays = o->relays.n > 0,
                        .dht = n.dht};
    ap_cli_nat_start(n.rt, o->listen ? o->listen : "/ip4/0.0.0.0/tcp/0", &nat);
    mon_server_t *mon = NULL;
    if (o->http) {
        rc = mon_server_start(n.rt, n.dht, o->run_id ? o->run_id : "apiary", o->http, &mon);
        if (rc) {
            fprintf(stderr, "apiary dht: cannot serve the monitor on %s: %s\n", o->http,
                    ap_strerror(rc));
            node_close(&n);
            return 1;
        }
        printf("monitor of run %s at %s\n", o->run_id ? o->run_id : "apiary", mon_server_url(mon));
    }
    fflush(stdout);
    int interval = o->stats_interval > 0 ? o->stats_interval : 30;
    struct timespec tick = {0, 200 * 1000 * 1000};
    int ticks = 0;
    while (!ap_cli_stop_signal()) {
        nanosleep(&tick, NULL);
        if (++ticks % (interval * 5) == 0) {
            print_resources(n.rt, o->stats);
            ap_dht_stats_t st;
            if (ap_dht_get_stats_sync(n.dht, &st) == 0)
                ap_log(AP_LOG_INFO, "dht",
                       "routing table: %zu peers in %zu buckets (+%zu waiting); stored: %zu keys, "
                       "%zu records, %zu bytes; cached: %zu records; rpcs served %llu",
                       st.routing_peers, st.routing_buckets, st.replacement_peers, st.stored_keys,
                       st.stored_records, st.stored_bytes, st.cached_records,
                       (unsigned long long)st.rpcs_served);
        }
    }
    if (o->stats) print_resources(n.rt, true);
    ap_cli_relays_report("dht", n.rt);
    fprintf(stderr, "apiary dht: %s, shutting down\n", ap_cli_stop_name());
    mon_server_stop(mon);
    ap_cli_nat_detach(n.rt, &nat);
    node_close(&n);
    return 0;
}

static int dht_main(int argc, char **argv)
{
    opts_t o = {.stats_interval = 30};
    static const struct option lopts[] = {{"listen", required_argument, NULL, 'L'},
                                          {"announce", required_argument, NULL, 'A'},
                                          {"initial-peers", required_argument, NULL, 'P'},
                                          {"identity", required_argument, NULL, 'i'},
                                          {"client", no_argument, NULL, 'c'},
                                          {"no-port-map", no_argument, NULL, 'N'},
                                          {"latest", no_argument, NULL, 'x'},
                                          {"ttl", required_argument, NULL, 't'},
                                          {"subkey", required_argument, NULL, 's'},
                                          {"value-file", required_argument, NULL, 'V'},
                                          {"stats-interval", required_argument, NULL, 'S'},
                                          {"stats", no_argument, NULL, 'T'},
                                          {"max-memory", required_argument, NULL, 'M'},
                                          {"peer-memory", required_argument, NULL, 'm'},
                                          {"http", required_argument, NULL, 'H'},
                                          {"run-id", required_argument, NULL, 'R'},
                                          {"relay-service", no_argument, NULL, 'r'},
                                          {"relay-max-reservations", required_argument, NULL, 'X'},
                                          {"max-handshakes", required_argument, NULL, 'W'},
                                          {"handshakes-per-ip", required_argument, NULL, 'w'},
                                          {"max-conns", required_argument, NULL, 'C'},
                                          {"conns-per-ip", required_argument, NULL, 'p'},
                                          {"relays", required_argument, NULL, 'Y'},
                                          {"relay-bulk", no_argument, NULL, 'B'},
                                          {"no-hole-punch", no_argument, NULL, 'Z'},
                                          {"log-level", required_argument, NULL, 'l'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    int c, rc = 2;
    bool level_set = getenv("APIARY_LOG") != NULL;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", lopts, NULL)) != -1) {
        switch (c) {
        case 'L':
            o.listen = optarg;
            break;
        case 'A':
            if (!ap_cli_announce(optarg, o.announce, &o.nannounce)) goto out;
            break;
        case 'P':
            if (add_peers(&o, optarg)) goto out;
            break;
        case 'i':
            o.identity = optarg;
            break;
        case 'c':
            o.client = true;
            break;
        case 'x':
            o.latest = true;
            break;
        case 'N':
            o.no_port_map = true;
            break;
        case 't': {
            char *end;
            o.ttl = strtol(optarg, &end, 10);
            if (*end || o.ttl <= 0 || o.ttl > 86400) {
                fprintf(stderr, "apiary dht: --ttl takes whole seconds, 1..86400\n");
                goto out;
            }
            break;
        }
        case 's':
            o.subkey = optarg;
            break;
        case 'V':
            o.value_file = optarg;
            break;
        case 'H':
            o.http = optarg;
            break;
        case 'R':
            o.run_id = optarg;
            break;
        case 'S': {
            long long v_;
            if (!ap_cli_int("--stats-interval", optarg, 1, 86400, &v_)) goto out;
            o.stats_interval = (int)v_;
        }
            if (o.stats_interval <= 0) {
                fprintf(stderr, "apiary dht: --stats-interval takes seconds > 0\n");
                goto out;
            }
            break;
        case 'T':
            o.stats = true;
            break;
        case 'r':
            o.relay_service = true;
            break;
        case 'X':
            if (!ap_cli_int("--relay-max-reservations", optarg, 1, 1024, &o.relay_max_resv))
                goto out;
            break;
        case 'W':
            if (!ap_cli_int("--max-handshakes", optarg, 1, 65536, &o.max_hs)) goto out;
            break;
        case 'w':
            if (!ap_cli_int("--handshakes-per-ip", optarg, 1, 65536, &o.hs_per_ip)) goto out;
            break;
        case 'C':
            if (!ap_cli_int("--max-conns", optarg, 16, 1 << 20, &o.max_conns)) goto out;
            break;
        case 'p':
            if (!ap_cli_int("--conns-per-ip", optarg, 1, 1 << 20, &o.conns_per_ip)) goto out;
            break;
        case 'Y':
            if (!ap_cli_relays_add("dht", optarg, &o.relays)) goto out;
            break;
        case 'B':
            o.relays.bulk = true;
            break;
        case 'Z':
            o.relays.no_punch = true;
            break;
        case 'M':
            if (!ap_cli_int("--max-memory", optarg, 8, 1 << 20, &o.max_memory_mib)) goto out;
            break;
        case 'm':
            if (!ap_cli_int("--peer-memory", optarg, 1, 1 << 20, &o.peer_memory_mib)) goto out;
            break;
        case 'l':
            if (!ap_cli_set_log_level(optarg)) goto out;
            level_set = true;
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
    int nargs = argc - optind;
    if (nargs == 0) {
        /* the periodic routing-table / storage lines are INFO */
        if (!level_set) ap_log_set_level(AP_LOG_INFO);
        rc = run_node(&o);
    } else if (!strcmp(argv[optind], "get") && nargs == 2) {
        if (!o.npeers) {
            fprintf(stderr, "apiary dht get: needs --initial-peers (a running node's address)\n");
            goto out;
        }
        o.client = true;
        rc = run_get(&o, argv[optind + 1]);
    } else if (!strcmp(argv[optind], "store") && nargs == (o.value_file ? 2 : 3)) {
        if (!o.npeers || o.ttl <= 0) {
            fprintf(stderr, "apiary dht store: needs --initial-peers and --ttl SECONDS\n");
            goto out;
        }
        o.client = true;
        rc = run_store(&o, argv[optind + 1], o.value_file ? NULL : argv[optind + 2]);
    } else {
        usage(stderr);
    }
out:
    for (int i = 0; i < o.npeers; i++) free(o.peers[i]);
    return rc;
}

AP_CLI_COMMAND(cmd_dht, "dht", dht_main, "run a DHT node, or get/store a key (apiary dht --help)")
