/* The `apiary` command-line tool: subcommand registry.
 *
 * Each subcommand lives in its own file and registers itself with
 * AP_CLI_COMMAND, so adding one never edits a shared table. */
#ifndef AP_CLI_H
#define AP_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "apiary/node.h"
#include "apiary/runtime.h"

typedef struct ap_cli_cmd {
    const char *name;
    int (*main)(int argc, char **argv); /* argv[0] is the subcommand name */
    const char *summary;
} ap_cli_cmd_t;

void ap_cli_register(const ap_cli_cmd_t *cmd);
const ap_cli_cmd_t *ap_cli_find(const char *name);

#define AP_CLI_COMMAND(ident, cname, fn, text)                                                     \
    static const ap_cli_cmd_t ident = {.name = cname, .main = fn, .summary = text};                \
    __attribute__((constructor)) static void ident##_register(void)                                \
    {                                                                                              \
        ap_cli_register(&ident);                                                                   \
    }

/* Common helpers. */
/* Sets the log level from --log-level text; prints an error and returns
 * false if it is not a level. */
bool ap_cli_set_log_level(const char *text);

/* Strict numeric flags: the whole text must be a number in [min, max]
 * (integers in base 10; counts may end in K, M or G = 2^10, 2^20, 2^30);
 * otherwise "apiary: FLAG needs ..." is printed and false returned. */
bool ap_cli_int(const char *flag, const char *text, long long min, long long max, long long *out);
bool ap_cli_num(const char *flag, const char *text, double min, double max, double *out);
/* A count with an optional K/M/G suffix: 0, or AP_EINVAL (nothing printed). */
int ap_cli_count(const char *text, uint64_t *out);

/* --announce TEXT: checks that it is a TCP multiaddr peers can dial (a host
 * and a port > 0) and appends it to list (*n < AP_NODE_MAX_ANNOUNCE entries);
 * otherwise prints the expected form and returns false. */
bool ap_cli_announce(const char *text, const char **list, int *n);
/* --initial-peers A,B,...: appends a copy of each address to list (the
 * caller frees them), at most max in all; otherwise prints why, naming cmd,
 * and returns false. */
bool ap_cli_peer_list(const char *cmd, const char *text, char **list, int *n, int max);
/* Whether a node whose advertised addresses are addrs can be reached by its
 * initial peers: false (and a message naming the fix) when every address is
 * loopback but a peer is on another host. */
bool ap_cli_check_reachable(const char *cmd, char (*addrs)[AP_RT_ADDR_MAX], int naddrs,
                            char *const *peers, int npeers);

/* --relays MULTIADDR[,MULTIADDR...], --relay-bulk, --no-hole-punch
 * (addrs.c, docs/nat.md), shared by the long-running commands. */
typedef struct ap_cli_relays {
    char addr[AP_NODE_MAX_RELAYS][AP_RT_ADDR_MAX];
    const char *list[AP_NODE_MAX_RELAYS];
    int n;
    bool bulk, no_punch;
} ap_cli_relays_t;
/* Adds the comma-separated relays of text (each a TCP multiaddr with
 * /p2p/RELAY); false, with a message, on a bad or an extra one. */
bool ap_cli_relays_add(const char *cmd, const char *text, ap_cli_relays_t *r);
/* Sets no's relay options from r (r must outlive the ap_node_new call). */
void ap_cli_relays_apply(const ap_cli_relays_t *r, ap_node_opts_t *no);
/* One line on stdout, "apiary CMD: relays: reservations ... | hole punches
 * ...", when the node was given relays or saw relayed connections. */
void ap_cli_relays_report(const char *cmd, ap_rt_t *rt);

/* AutoNAT and port mapping for a long-running node (nat_cli.c,
 * docs/nat.md): starts ap_node_nat_start on rt unless client (a node that
 * only asks has nothing to check), with port mapping unless no_port_map or
 * the node listens on a loopback address (listen). Each change of verdict
 * prints one line, "apiary CMD: reachability private (...)"; with a dht
 * and/or collab that the user did not force into client mode (client
 * false), a private node switches them to client-only and a public one
 * back. dht and collab may be NULL; *collab is read at each change (it may
 * be set after this call). Returns 0 or a negative AP_E* code (printed). */
typedef struct ap_cli_nat {
    const char *cmd;
    bool client, no_port_map;
    bool relays; /* the node has relays: a private verdict leaves averaging as it is */
    struct ap_dht *dht;
    struct ap_collab *const *collab;
    int last; /* the previous verdict (ap_node_reach_t), set by the callback */
} ap_cli_nat_t;
int ap_cli_nat_start(ap_rt_t *rt, const char *listen, ap_cli_nat_t *nat);
/* Before freeing the dht or the collab: later changes leave them alone
 * (on the loop thread, so no change is being handled meanwhile). */
void ap_cli_nat_detach(ap_rt_t *rt, ap_cli_nat_t *nat);

/* SIGINT and SIGTERM set a flag instead of ending the process, so that a
 * long-running command stops on its own path (summary, state, everything
 * freed) and exits 0 (stop.c). ap_cli_stop_signal: the signal caught, 0 if
 * none; ap_cli_stop_name: "SIGINT" / "SIGTERM". */
void ap_cli_catch_stop(void);
int ap_cli_stop_signal(void);
const char *ap_cli_stop_name(void);

#endif
