/* Apiary — the deterministic network simulator (runtime driver "sim").
 *
 * One ap_sim_t runs N Apiary nodes in ONE thread under a virtual clock. Each
 * node is a full ap_rt_t (apiary/runtime.h): protocol code runs on it
 * unchanged. The simulator models
 *   - time: a virtual monotonic clock in microseconds, shared by all nodes;
 *     each node's wall clock is a fixed epoch + virtual time + its own skew;
 *   - links: per-direction latency, jitter (never reorders a connection) and
 *     bandwidth; per-node upload and download capacity; concurrent transfers
 *     share capacity fairly (see docs/simulator.md, "Bandwidth");
 *   - faults: partitions and healing, node crash and restart;
 *   - compute: ap_rt_work() charges virtual CPU time to the node.
 * The same seed and the same calls give the same run bit for bit;
 * ap_sim_trace_hash() fingerprints a run.
 *
 * THREADING. An ap_sim_t and all its nodes belong to the thread that calls
 * ap_sim_step/run_*; all node callbacks run on it. The only exception is
 * ap_rt_post() on a sim node, which any thread may call (such posts run at
 * the next step; posts from other threads make a run non-deterministic).
 *
 * UNITS. Time in microseconds (virtual), bandwidth in BITS per second
 * (0 = unlimited), wall clock and skew in milliseconds.
 *
 * ADDRESSES. Node i listens on "/sim/<i>"; ap_rt_dial accepts
 * "/sim/<i>" and "/sim/<i>/p2p/<PeerID>". The simulator keeps a global
 * PeerID -> node map, so ap_rt_rpc_call / ap_rt_stream_open to any sim
 * node's PeerID work without ap_rt_add_addr (which only validates its
 * address). A PeerID that is not a sim node is unreachable (AP_EUNREACH).
 *
 * FAILURES (details in docs/simulator.md):
 *   - connecting to a crashed node fails with AP_EUNREACH after one round
 *     trip (connection refused); a connection attempt across a partition is
 *     silently dropped: the operation fails at its own timeout (AP_ETIMEDOUT)
 *     or at the simulator's connect timeout (AP_EUNREACH), whichever is first;
 *   - when a node crashes or a partition separates two connected nodes, the
 *     connection drops at once on the surviving side(s): watchers get
 *     AP_PEER_DISCONNECTED, pending calls on it AP_ECLOSED, streams on_close
 *     with AP_ECLOSED (no waiting for timeouts).
 *
 * WHERE runtime.h LEAVES A CHOICE, this driver:
 *   - opens at most one connection per node pair (handshake: one round trip;
 *     a SYN lost to a partition is retried every second);
 *   - refuses a stream with no listener with AP_ENOPROTO, and one whose hello
 *     exceeds the listener's max_msg with AP_EMSGSIZE (refusal by the accept
 *     function: AP_ERESET, as runtime.h says);
 *   - accepts a stream message larger than the window when nothing is
 *     buffered (else it could never be sent); a received message over the
 *     receiver's max_msg resets the stream (receiver AP_EMSGSIZE, sender
 *     AP_ERESET);
 *   - ap_stream_reset runs the local on_close (with err, or AP_ERESET if err
 *     is not negative) before it returns; the peer gets AP_ERESET;
 *   - counts in ap_stream_buffered every byte sent and not yet consumed by
 *     the receiver's on_msg (queued, on the wire, or held by a pause);
 *   - ap_rt_work runs work inline and one job at a time per node (see
 *     ap_sim_set_flops).
 */
#ifndef APIARY_SIM_H
#define APIARY_SIM_H

#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ap_sim ap_sim_t;

/* Bytes added to every message's length when it is timed on a link:
 * TCP/IP headers (40) + AEAD tag (16) + mux/RPC frame header (8). */
#define AP_SIM_FRAME_OVERHEAD 64

/* One direction of a link. */
typedef struct ap_sim_link {
    uint64_t bandwidth_bps; /* bits per second; 0 = unlimited */
    uint64_t latency_us;    /* one-way propagation delay */
    uint64_t jitter_us;     /* extra delay, uniform in [0, jitter_us]; never reorders */
} ap_sim_link_t;

/* Harness hook for crash/restart: node is the index, rt its runtime. */
typedef void (*ap_sim_node_fn)(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg);
/* Custom compute cost: returns virtual microseconds for `cost` units. */
typedef double (*ap_sim_compute_fn)(void *arg, int node, double cost);
typedef bool (*ap_sim_pred_fn)(void *arg);

typedef struct ap_sim_node_opts {
    uint64_t up_bps;   /* upload capacity, bits/s; 0 = unlimited */
    uint64_t down_bps; /* download capacity, bits/s; 0 = unlimited */
    int64_t skew_ms;   /* added to this node's ap_rt_wall_ms */
    double flops;      /* compute speed: cost units per virtual second; 0 = free */
    /* Crash hook: runs inside ap_sim_crash AFTER every pending operation of
     * the node was completed (calls AP_ECANCELED, streams on_close
     * AP_ECANCELED, work AP_ECANCELED; timers and posts dropped): free the
     * node's protocol objects here. ap_rt_* calls on rt are harmless no-ops
     * or fail with AP_ESHUTDOWN. */
    ap_sim_node_fn on_crash;
    /* Restart hook: runs inside ap_sim_restart once the node is up again
     * with the same identity and an empty runtime: re-create protocol
     * objects (register handlers, listeners, timers) here. */
    ap_sim_node_fn on_restart;
    void *hook_arg;
} ap_sim_node_opts_t;

typedef struct ap_sim_stats {
    uint64_t events;         /* events processed (cancelled ones excluded) */
    uint64_t messages;       /* RPC requests/responses and stream messages delivered */
    uint64_t bytes;          /* wire bytes (incl. framing) delivered, all messages */
    uint64_t pending_events; /* events in the queue (some may be cancelled) */
    uint64_t connections;    /* open or connecting connections */
} ap_sim_stats_t;

/* A new empty simulation. seed fixes everything random: node keys, node
 * RNGs, jitter. Defaults: links 1 ms latency, no jitter, unlimited
 * bandwidth; connect timeout 10 s; wall-clock epoch 2025-01-01T00:00:00Z.
 * NULL if out of memory or libsodium fails. */
AP_EXPORT ap_sim_t *ap_sim_new(uint64_t seed);
/* Frees everything, including nodes, without running any callback. Pending
 * ap_rpc_req_t and ap_stream_t of every node become invalid. */
AP_EXPORT void ap_sim_free(ap_sim_t *sim);

/* Adds a node (opts may be NULL). Its Ed25519 key is derived from the sim
 * seed and its index, so node i has the same PeerID in every run with that
 * seed. Returns the index (0, 1, ...) or AP_ENOMEM. */
AP_EXPORT int ap_sim_add_node(ap_sim_t *sim, const ap_sim_node_opts_t *opts);
AP_EXPORT int ap_sim_node_count(const ap_sim_t *sim);
/* Node i's runtime, or NULL if i is out of range or the node is crashed.
 * The pointer stays the same across crash and restart. */
AP_EXPORT ap_rt_t *ap_sim_node(ap_sim_t *sim, int i);
/* Node i's PeerID (valid for the sim's lifetime, also while crashed), or NULL. */
AP_EXPORT const ap_peer_id_t *ap_sim_peer_id(ap_sim_t *sim, int i);
/* Index of the node with this PeerID, or -1. */
AP_EXPORT int ap_sim_find_peer(ap_sim_t *sim, const ap_peer_id_t *id);
/* Index of a sim runtime, or -1 if rt is not a node of this sim. */
AP_EXPORT int ap_sim_node_index(ap_sim_t *sim, const ap_rt_t *rt);
AP_EXPORT bool ap_sim_is_up(ap_sim_t *sim, int i);

/* ---- topology ---------------------------------------------------------- */

/* Link parameters for every pair without an explicit ap_sim_set_link. */
AP_EXPORT void ap_sim_set_default_link(ap_sim_t *sim, const ap_sim_link_t *link);
/* Sets the a->b direction (call again with b, a for the other direction).
 * Takes effect at once, also for transfers in progress. AP_EINVAL on bad
 * indexes or a == b. */
AP_EXPORT int ap_sim_set_link(ap_sim_t *sim, int a, int b, const ap_sim_link_t *a_to_b);
/* Node capacities in bits/s (0 = unlimited); take effect at once. */
AP_EXPORT int ap_sim_set_node_bw(ap_sim_t *sim, int i, uint64_t up_bps, uint64_t down_bps);
AP_EXPORT int ap_sim_set_skew(ap_sim_t *sim, int i, int64_t skew_ms);
/* Compute speed in cost units per second (0 = free); replaces a custom fn. */
AP_EXPORT int ap_sim_set_flops(ap_sim_t *sim, int i, double flops);
/* Custom compute cost function (NULL restores flops). */
AP_EXPORT int ap_sim_set_compute(ap_sim_t *sim, int i, ap_sim_compute_fn fn, void *arg);
/* Node i's budget for ap_rt_mem_reserve, in bytes: for all peers together
 * and for each peer (0 = no limit; default 256 MiB and 64 MiB, as
 * ap_node_limits_default). As on a real node, one reservation takes at most
 * half of what the node has free. AP_ESTATE while the node holds a
 * reservation. */
AP_EXPORT int ap_sim_set_memory(ap_sim_t *sim, int i, uint64_t node_bytes, uint64_t peer_bytes);
/* Bytes node i holds reserved with ap_rt_mem_reserve now (0 after a crash). */
AP_EXPORT uint64_t ap_sim_memory_held(ap_sim_t *sim, int i);
AP_EXPORT int ap_sim_set_hooks(ap_sim_t *sim, int i, ap_sim_node_fn on_crash,
                               ap_sim_node_fn on_restart, void *arg);
/* How long a connection attempt waits for an answer before failing with
 * AP_EUNREACH (default 10 s). */
AP_EXPORT void ap_sim_set_connect_timeout(ap_sim_t *sim, uint64_t us);
/* Closes connections that have been idle (no message either way, no call,
 * request, stream or dial using them) for at least `us` microseconds, like a
 * connection manager; both sides see AP_PEER_DISCONNECTED and the next
 * operation reconnects. Checked every us/2. 0 (the default) disables it:
 * then a connection lives until a crash or partition ends it. */
AP_EXPORT void ap_sim_set_idle_timeout(ap_sim_t *sim, uint64_t us);
/* Wall-clock ms at virtual time 0 (before skew). */
AP_EXPORT void ap_sim_set_epoch_ms(ap_sim_t *sim, int64_t epoch_ms);

/* ---- faults ------------------------------------------------------------ */

/* Splits the network: group_of_node[i] for every node (ap_sim_node_count
 * entries; copied). Nodes in different groups cannot reach each other;
 * established connections across groups drop now. AP_EINVAL on NULL. */
AP_EXPORT int ap_sim_partition(ap_sim_t *sim, const int *group_of_node);
/* Ends any partition: every node can reach every other again. */
AP_EXPORT void ap_sim_heal(ap_sim_t *sim);
/* Crashes node i now: its connections drop (peers see it at once), its
 * pending operations complete with AP_ECANCELED on the node itself, then its
 * on_crash hook runs and its runtime state (handlers, listeners, watchers)
 * is cleared. Must not be called from inside a callback of node i itself
 * (use ap_sim_schedule for that).
 * AP_EINVAL if i is out of range, AP_ESTATE if already down. */
AP_EXPORT int ap_sim_crash(ap_sim_t *sim, int i);
/* Restarts a crashed node with the same identity, a fresh RNG stream and an
 * empty runtime, then runs its on_restart hook. AP_ESTATE if it is up. */
AP_EXPORT int ap_sim_restart(ap_sim_t *sim, int i);

/* Crashes (restart = false) or restarts node i at virtual time at_us (now
 * if in the past), as an event: safe to call from any callback, including
 * node i's own. A scheduled crash of a node that is down by then, or a
 * restart of one that is up, does nothing. AP_EINVAL on a bad index. */
AP_EXPORT int ap_sim_schedule(ap_sim_t *sim, int i, uint64_t at_us, bool restart);

/* ---- running ----------------------------------------------------------- */

/* Processes the next event. Returns false if there is none. */
AP_EXPORT bool ap_sim_step(ap_sim_t *sim);
/* Runs events until pred(arg) holds (checked before the first event and
 * after every event) or virtual time would pass deadline_us (absolute);
 * then the clock is set to deadline_us if pred did not hold. pred may be
 * NULL. Returns whether pred held. */
AP_EXPORT bool ap_sim_run_until(ap_sim_t *sim, ap_sim_pred_fn pred, void *arg,
                                uint64_t deadline_us);
/* Runs for us microseconds of virtual time. */
AP_EXPORT void ap_sim_run_for(ap_sim_t *sim, uint64_t us);

AP_EXPORT uint64_t ap_sim_now_us(const ap_sim_t *sim);
/* Hash over every processed event (time, kind, node, size), in order. */
AP_EXPORT uint64_t ap_sim_trace_hash(const ap_sim_t *sim);
AP_EXPORT void ap_sim_get_stats(const ap_sim_t *sim, ap_sim_stats_t *out);

#ifdef __cplusplus
}
#endif
#endif
