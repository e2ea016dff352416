/* Circuit relay and DCUtR hole punching through real NATs
 * (testing/natns.h), for tests and `apiary bench nat`.
 *
 * ap_nat_punch_run starts a relay (the hop service, limits sized for the
 * run) on public node `relay`, and two peers in forked processes: B on
 * home host home_b keeps a reservation on the relay and runs the DCUtR B
 * side on every relayed connection that reaches it; A on home host home_a
 * dials B through the relay and answers DCUtR. Each learns its public IP
 * from the relay's identify (the observed address) and announces it with
 * its listen port. Round r uses listen port AP_NAT_PUNCH_PORT + r on both
 * sides (new hosts each round: no TIME_WAIT left from the round before).
 * After each round B checks the outcome: on success that the relayed
 * connection was closed after the grace period and that a ping stream
 * goes over the direct connection; on failure that ping still goes over
 * the relayed one. Every child is killed by its PID before the call
 * returns. */
#ifndef AP_TESTING_NAT_PUNCH_H
#define AP_TESTING_NAT_PUNCH_H

#include "natns.h"

#include <stdbool.h>
#include <stddef.h>

#define AP_NAT_PUNCH_PORT   4101
#define AP_NAT_PUNCH_ROUNDS 32

typedef struct ap_nat_punch_round {
    int relayed;       /* 1: the relayed connection reached B */
    int status;        /* B's DCUtR result: 0 direct, else AP_E* */
    int attempts;      /* attempts B used */
    double ms_direct;  /* B: relayed connection ready -> direct ready */
    int direct_used;   /* success: relayed closed, ping over the direct connection */
    int relayed_alive; /* failure: ping still over the relayed connection */
} ap_nat_punch_round_t;

/* rounds <= AP_NAT_PUNCH_ROUNDS; res[r] for each round. 0, or a negative
 * AP_E* code and the reason in why (a process did not start or did not
 * report within limit_ms). */
int ap_nat_punch_run(ap_natns_t *ns, size_t relay, size_t home_a, size_t home_b, int rounds,
                     int limit_ms, ap_nat_punch_round_t *res, char *why, size_t wn);

/* Bytes per second through a circuit from home_a to home_b over the relay
 * on public node `relay` (bytes sent through ping and echoed back), and the
 * same over a direct connection from home_a to the relay (baseline).
 * 0 or a negative AP_E* code with why. */
int ap_nat_relay_throughput(ap_natns_t *ns, size_t relay, size_t home_a, size_t home_b,
                            size_t bytes, double *relayed_Bps, double *direct_Bps, char *why,
                            size_t wn);

#endif
