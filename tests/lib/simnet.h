/* simnet: a small deterministic driver of runtime.h (virtual time, unary RPC,
 * timers, dial, per-node clock skew, crashes, partitions) for the DHT
 * scenario tests and the DHT benchmark. It covers exactly what protocol code
 * that uses RPC only needs; streams are not supported (AP_ENOTSUP). The full
 * simulator (include/apiary/sim.h) supersedes it for everything else.
 *
 * Everything runs on the calling thread; callbacks run from simnet_run*. */
#ifndef AP_TEST_SIMNET_H
#define AP_TEST_SIMNET_H

#include "apiary/runtime.h"

typedef struct simnet simnet_t;

/* n nodes, one-way link latency latency_us (+ up to jitter_us uniform
 * jitter), identities and RNGs derived from seed. */
simnet_t *simnet_new(int n, uint64_t seed, uint64_t latency_us, uint64_t jitter_us);
void simnet_free(simnet_t *net);
int simnet_size(const simnet_t *net);
/* Node i's runtime, NULL while crashed. */
ap_rt_t *simnet_rt(simnet_t *net, int i);
/* Node i's identity (also while crashed). */
const ap_peer_id_t *simnet_peer(simnet_t *net, int i);
/* Kills node i: its timers stop, calls to it fail (unreachable), calls it made
 * are dropped without callbacks. Free protocol objects on it FIRST. */
void simnet_crash(simnet_t *net, int i);
/* Brings node i back with the same identity and a fresh runtime. */
void simnet_restart(simnet_t *net, int i);
/* Adds skew_ms to node i's wall clock. */
void simnet_set_skew(simnet_t *net, int i, int64_t skew_ms);
/* Nodes in different groups cannot reach each other (messages dropped:
 * callers time out). Group 0 for everyone heals the partition. */
void simnet_set_group(simnet_t *net, int i, int group);
/* Runs events until pred(arg) holds (checked after each event), no events
 * remain, or timeout_us of virtual time passed. Returns whether pred held. */
bool simnet_run_until(simnet_t *net, bool (*pred)(void *), void *arg, uint64_t timeout_us);
uint64_t simnet_now_us(const simnet_t *net);
/* RPC requests delivered so far (all nodes). */
uint64_t simnet_rpcs(const simnet_t *net);

#endif
