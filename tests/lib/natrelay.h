/* The relayed-training scenario of the e2e NAT tests (testing/natns.h): a
 * public `apiary dht --relay-service` node on the bridge and two
 * `apiary train --relays` peers, each behind its own port-preserving NAT
 * that drops unsolicited packets, with a netem delay at each router. The
 * peers know only the relay; they find each other through its DHT, reach
 * each other through a circuit, and (unless told not to) hole-punch to a
 * direct connection. Each peer's log gives its counters (the `relays:` line
 * printed at exit), its epochs and the group sizes it averaged in. */
#ifndef AP_TEST_NATRELAY_H
#define AP_TEST_NATRELAY_H

#include <stdbool.h>
#include <stddef.h>

typedef struct ap_natrelay_opts {
    bool no_hole_punch; /* --no-hole-punch on both peers */
    bool relay_bulk;    /* --relay-bulk on both peers */
    unsigned delay_ms;  /* netem delay each way at each router (0: none) */
    int duration_s;     /* --duration of the training */
} ap_natrelay_opts_t;

typedef struct ap_natrelay_peer {
    char log[300];
    int status; /* exit status */
    /* the `relays:` line; have_stats false when it is missing */
    bool have_stats;
    unsigned reservations, live;
    unsigned long long relayed_in, relayed_out;
    unsigned punches, direct, failed;
    unsigned long long moved, bulk_refused;
    unsigned long long epochs; /* the summary line */
    bool group2;               /* an epoch averaged with both peers */
    char punch_line[512];      /* dcutr's "direct connection after" line, or "" */
} ap_natrelay_peer_t;

/* Skips the test (cmocka skip, with the reason) when the namespaces cannot
 * be made here: not root, no nftables, no netem. Builds the topology, runs
 * the scenario to its end and fills out[0] and out[1]; fails the test when
 * the relay does not start or a peer does not end within its time. */
void ap_natrelay_run(const ap_natrelay_opts_t *o, ap_natrelay_peer_t out[2]);
/* Prints a peer's figures (print_message). */
void ap_natrelay_print(const char *name, const ap_natrelay_peer_t *p);
/* Kills what is left and deletes the namespaces and logs; a cmocka
 * teardown. */
int ap_natrelay_teardown(void **state);

#endif
