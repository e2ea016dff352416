/* A testbed: N nodes of one runtime driver that a test can run, crash and
 * restart. The runtime conformance suite (conformance.h) is written against
 * this interface only, so the same tests run on every driver:
 *   - sim: all nodes in the deterministic simulator (virtual time);
 *   - uv:     nodes on a libuv loop in this process, in-process transport;
 *   - uv-tcp: the same nodes over real TCP + Noise XX on 127.0.0.1.
 *
 * Threading: the test thread drives the loop (run_until/run_for), so every
 * callback runs on the test thread and tests need no locks. */
#ifndef AP_TESTBED_H
#define AP_TESTBED_H

#include "apiary/runtime.h"

typedef struct ap_testbed ap_testbed_t;
typedef bool (*ap_tb_pred_fn)(void *arg);

typedef struct ap_testbed_ops {
    const char *name;
    /* n nodes, all able to reach each other, seeded. NULL on failure. */
    ap_testbed_t *(*create)(int n, uint64_t seed);
    void (*destroy)(ap_testbed_t *tb);
    /* Node i's runtime; NULL while node i is crashed. */
    ap_rt_t *(*node)(ap_testbed_t *tb, int i);
    /* Runs the nodes until pred(arg) holds (checked after every event or
     * loop iteration) or timeout_us of the driver's time passed. Returns
     * whether pred held. pred may be NULL (run for the whole timeout). */
    bool (*run_until)(ap_testbed_t *tb, ap_tb_pred_fn pred, void *arg, uint64_t timeout_us);
    /* Kills node i abruptly: its state is gone, its peers see their calls
     * and streams to it fail (connection lost). */
    void (*crash)(ap_testbed_t *tb, int i);
    /* Starts node i again with the same identity and a fresh state. */
    void (*restart)(ap_testbed_t *tb, int i);
    /* Whether the driver's time is virtual (sim) — tests may then use long
     * timeouts freely. */
    bool virtual_time;
} ap_testbed_ops_t;

/* The drivers' testbeds (tests/lib/testbed_<driver>.c). */
extern const ap_testbed_ops_t ap_testbed_sim;
extern const ap_testbed_ops_t ap_testbed_uv;
extern const ap_testbed_ops_t ap_testbed_uv_tcp;
extern const ap_testbed_ops_t ap_testbed_uv_libp2p;
extern const ap_testbed_ops_t ap_testbed_uv_yamux;

static inline void ap_tb_run_for(const ap_testbed_ops_t *ops, ap_testbed_t *tb, uint64_t us)
{
    ops->run_until(tb, NULL, NULL, us);
}

#endif
