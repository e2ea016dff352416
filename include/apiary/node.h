/* Apiary — the real runtime driver: hosts and nodes on libuv.
 *
 * A HOST owns one libuv loop. Either it runs the loop on its own thread
 * (ap_host_start: the normal case for a node in a program or the CLI), or the
 * caller drives it (ap_host_run_once / ap_host_run_until: tests). Several
 * nodes may live on one host.
 *
 * A NODE is an ap_rt_t (apiary/runtime.h) on a host: an Ed25519 identity,
 * an RNG, timers, RPC and streams multiplexed over one connection per peer
 * (docs/protocol.md). Today nodes talk through the in-process transport:
 * every node listens on "/memory/<n>", reachable from any host of the same
 * process. The TCP + Noise transport plugs into the same connection seam
 * (src/runtime/uv/conn.h).
 *
 * THREADING. ap_host_* functions are called by the thread that created the
 * host (the "owner"). ap_node_new / ap_node_free may be called from any
 * thread: on a host running its own thread they are carried out on the loop
 * thread while the caller waits; on a caller-driven host they run at once
 * (call them from the driving thread). Everything in runtime.h follows
 * runtime.h's rules (loop thread only, except ap_rt_post). ap_node_call_sync
 * is for OTHER threads. */
#ifndef APIARY_NODE_H
#define APIARY_NODE_H

#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ap_host ap_host_t;

/* Creates a host with its loop (not running). NULL on failure. */
AP_EXPORT ap_host_t *ap_host_new(void);
/* Starts a thread that runs the loop until ap_host_stop. AP_ESTATE if already
 * started. */
AP_EXPORT int ap_host_start(ap_host_t *h);
/* Stops and joins the loop thread (no-op if not started). Nodes stay alive;
 * the owner may then drive the loop itself or free the host. */
AP_EXPORT void ap_host_stop(ap_host_t *h);
/* Caller-driven mode (host not started): runs one loop iteration, waiting for
 * at most max_wait_us for an event (0 = do not block). Returns whether more
 * work is pending (handles active). */
AP_EXPORT bool ap_host_run_once(ap_host_t *h, uint64_t max_wait_us);
/* Runs the loop until pred(arg) holds (checked after every iteration) or
 * timeout_us of monotonic time passed. Returns whether pred held. pred NULL:
 * run for the whole timeout. */
AP_EXPORT bool ap_host_run_until(ap_host_t *h, bool (*pred)(void *arg), void *arg,
                                 uint64_t timeout_us);
/* Stops the loop thread if any, frees every node still on the host (as
 * ap_node_free), runs the loop until every handle and request is done and
 * closes it. Owner thread only. Returns 0, or AP_EBUSY if the loop could
 * not be closed cleanly (a leak: a bug). */
AP_EXPORT int ap_host_free(ap_host_t *h);

#define AP_NODE_MAX_ANNOUNCE 4 /* ap_node_opts_t.announce entries */

typedef struct ap_node_opts {
    /* Identity: a full libsodium Ed25519 secret key (64 bytes), or a 32-byte
     * seed, or neither (fresh random key). sk wins over seed. Copied. */
    const uint8_t *ed25519_sk;
    const uint8_t *ed25519_seed;
    /* RNG seed for ap_rt_rand_*; 0 = from the OS. */
    uint64_t rng_seed;
    /* In-process listen address "/memory/<n>"; NULL = the next free number.
     * AP_EEXIST if another live node holds it (a restarted node may reuse the
     * address of a freed one).
     * Or a TCP multiaddr "/ip4/A.B.C.D/tcp/PORT" / "/ip6/.../tcp/PORT" (PORT 0
     * = any; ap_rt_listen_addrs reads the bound one back): the node then talks
     * TCP + Noise XX (docs/transport.md) and dials ip4/ip6/dns4/dns6 + /tcp
     * multiaddrs, e.g. ap_rt_dial(rt, "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...").
     * A node is either in-process or TCP.
     * A wildcard host (0.0.0.0 or ::) is not an address a peer can dial: the
     * node advertises (ap_rt_listen_addrs) the host's interface addresses of
     * that family instead, with the bound port: every one that is not
     * loopback (nor IPv6 link-local), read again every 10 s; the loopback
     * address only when the host has no other. */
    const char *listen;
    /* Addresses to advertise instead of the listen addresses, e.g. a public
     * address in front of a port forward, "/ip4/203.0.113.7/tcp/4001": TCP
     * multiaddrs (ip4/ip6/dns4/dns6 + /tcp, port not 0); a trailing /p2p/ID
     * must be this node's id and is dropped. At most AP_NODE_MAX_ANNOUNCE;
     * copied. AP_EADDR if one is malformed, AP_EINVAL for an in-process or
     * dial-only node. Every protocol then advertises these. */
    const char *const *announce;
    int nannounce;
    /* TCP + Noise without a listener: the node only dials out (a client
     * behind NAT; its listen address list is empty). listen must be NULL. */
    bool dial_only;
} ap_node_opts_t;

/* Creates a node on host h. opts may be NULL. *out receives the runtime.
 * Any thread (see THREADING). */
AP_EXPORT int ap_node_new(ap_host_t *h, const ap_node_opts_t *opts, ap_rt_t **out);
/* Tears the node down at once: its connections drop (peers see AP_ECLOSED on
 * calls and streams, and AP_PEER_DISCONNECTED); then every callback it still
 * owes runs before this returns: RPC done callbacks with AP_ECANCELED, stream
 * on_close with AP_ECLOSED, work after() with AP_ECANCELED, call_sync waiters
 * whose function never ran get AP_ESHUTDOWN. Timers and posts are dropped;
 * RPC requests a handler still holds are freed (never respond to them after).
 * Any thread (see THREADING), but not from inside a callback of this node. */
AP_EXPORT void ap_node_free(ap_rt_t *rt);
/* The host a node lives on. */
AP_EXPORT ap_host_t *ap_node_host(ap_rt_t *rt);

/* ---- blocking bridge for user threads ------------------------------------ */

typedef struct ap_sync ap_sync_t;
/* Runs on the loop thread. It must arrange that ap_sync_complete(done, ...)
 * is called exactly once: now, or later from a callback (RPC done, stream
 * on_close, timer...). Callbacks owed by the node always run, at the latest
 * in ap_node_free, so completing from one is enough. */
typedef void (*ap_sync_fn)(ap_rt_t *rt, void *arg, ap_sync_t *done);

/* Posts fn to rt's loop and blocks until done is completed; returns the
 * status given to ap_sync_complete, AP_ESHUTDOWN if the node closed before fn
 * ran, or AP_ESTATE when called on the loop thread (or by the thread that
 * drives a caller-driven host: that would deadlock). Any other thread. */
AP_EXPORT int ap_node_call_sync(ap_rt_t *rt, ap_sync_fn fn, void *arg);
/* Completes a call_sync with status. Any thread; exactly once per call. */
AP_EXPORT void ap_sync_complete(ap_sync_t *done, int status);

/* ap_rt_listen_addrs from a user thread (through ap_node_call_sync): the
 * node's listen addresses, with "/p2p/<id>" if with_id, up to max entries;
 * returns how many exist (may be more than max), or a negative error as
 * ap_node_call_sync. Any thread but the loop thread. */
AP_EXPORT int ap_node_listen_addrs_sync(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max,
                                        bool with_id);

#ifdef __cplusplus
}
#endif
#endif
