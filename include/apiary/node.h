/* Apiary — the real runtime driver's nodes (prefix ap_node_), on the hosts
 * of apiary/host.h (one libuv loop each).
 *
 * A NODE is an ap_rt_t (apiary/runtime.h) on a host: an Ed25519 identity,
 * an RNG, timers, RPC and streams multiplexed over one connection per peer
 * (docs/protocol.md): either in-process ("/memory/<n>", reachable from
 * any host of the same process) or TCP + Noise XX (ap_node_opts_t.listen).
 *
 * THREADING. ap_node_new / ap_node_free may be called from any
 * thread: on a host running its own thread they are carried out on the loop
 * thread while the caller waits; on a caller-driven host they run at once
 * (call them from the driving thread). Everything in runtime.h follows
 * runtime.h's rules (loop thread only, except ap_rt_post). ap_node_call_sync
 * is for OTHER threads. */
#ifndef APIARY_NODE_H
#define APIARY_NODE_H

#include "apiary/host.h"
#include "apiary/runtime.h"
#include "apiary/sync.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_NODE_MAX_ANNOUNCE 4 /* ap_node_opts_t.announce entries */
#define AP_NODE_MAX_RELAYS   8 /* ap_node_opts_t.relays entries */

/* Limits of the circuit relay v2 service (ap_node_opts_t.relay_service,
 * docs/nat.md); 0 = the default, sized for training's control traffic. */
typedef struct ap_node_relay_limits {
    uint32_t max_reservations;    /* peers holding a slot at once: 128 */
    uint32_t circuits_per_peer;   /* circuits per peer, as either end: 16 */
    uint64_t circuit_duration_us; /* each circuit: 10 min */
    uint64_t circuit_bytes;       /* each circuit, both directions: 4 MiB */
} ap_node_relay_limits_t;

/* Connection admission on a TCP node's port (docs/security.md): one budget
 * for native and libp2p connections alike; 0 = the default. */
typedef struct ap_node_admission {
    uint32_t handshakes;           /* inbound handshakes in progress, all sources: 256 */
    uint32_t handshakes_per_ip;    /* of them from one source address: 16 */
    uint32_t handshake_timeout_ms; /* accept to authenticated and upgraded: 10,000 */
    uint32_t conns;                /* open connections, both directions: 1024 */
    uint32_t conns_per_ip;         /* open inbound connections from one source address: 64 */
} ap_node_admission_t;

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
    /* Serve circuit relay v2 hop ("/libp2p/circuit/relay/0.2.0/hop") on the
     * node's TCP port: peers behind NAT reserve a slot here and others reach
     * them through it, within relay_limits. Needs a TCP node with a
     * listener: AP_EINVAL otherwise. */
    bool relay_service;
    ap_node_relay_limits_t relay_limits;
    /* A TCP node's connection admission (ignored by an in-process node). */
    ap_node_admission_t admission;
    /* Relays for a node behind a NAT (circuit relay v2 client, docs/nat.md):
     * TCP multiaddrs with /p2p/RELAY ("/ip4/198.51.100.7/tcp/4001/p2p/
     * 12D3KooW..."), at most AP_NODE_MAX_RELAYS; copied. The node keeps a
     * reservation on each (refreshed before it expires, made again after a
     * failure) and advertises its circuit addresses
     * ("/ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/SELF") after its direct ones
     * (ap_rt_listen_addrs, identify, the DHT), except while AutoNAT finds it
     * public. Peers dial direct addresses first and circuits last. When a
     * peer reaches the node through a relay, the node starts DCUtR hole
     * punching (unless no_hole_punch) and moves its traffic to the direct
     * connection once there is one. Needs a TCP node with a listener:
     * AP_EINVAL otherwise; AP_EADDR for a malformed relay address. */
    const char *const *relays;
    int nrelays;
    /* Bulk protocols (all-reduce parts, state downloads) also over relayed
     * connections; by default they are refused there with AP_EPERM (a relay
     * carries control traffic: DHT, matchmaking, progress). */
    bool relay_bulk;
    /* No DCUtR: relayed connections stay relayed. */
    bool no_hole_punch;
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

/* ---- the wire between TCP nodes -------------------------------------------- */

/* How a TCP node dials its peers (docs/libp2p.md). Every TCP node accepts
 * all of them on its port.
 *   NATIVE  TCP + Noise XX (BLAKE2b) + the native mux (the default, fastest).
 *   LIBP2P  libp2p: multistream-select, libp2p Noise (SHA-256), then the
 *           native mux offered as "/apiary/mux/2" before "/yamux/1.0.0": two
 *           Apiary nodes agree on the native mux in the handshake.
 *   YAMUX   libp2p with yamux only, also for the libp2p peers that dial
 *           this node: each runtime.h stream or call is a yamux stream
 *           negotiated by its protocol name.
 * Either way every runtime.h protocol works unchanged. Only ip4/ip6
 * addresses are dialled with libp2p. Loop thread, before the node has a
 * connection: AP_ESTATE otherwise; AP_ENOTSUP for an in-process node. */
typedef enum ap_node_wire {
    AP_NODE_WIRE_NATIVE = 0,
    AP_NODE_WIRE_LIBP2P = 1,
    AP_NODE_WIRE_YAMUX = 2,
} ap_node_wire_t;
AP_EXPORT int ap_node_set_wire(ap_rt_t *rt, ap_node_wire_t wire);

/* ---- resource limits ------------------------------------------------------ */

/* What peers can make a TCP or in-process node hold (docs/security.md):
 * every message received (partial or waiting for a paused reader) and every
 * RPC response queued for a peer that has not read it is counted in the
 * scopes it belongs to -- the stream, its connection, its peer, its
 * protocol and the node -- and a reservation that would take any of them
 * over its limit is refused: the stream gets RESET AP_ELIMIT (the caller's
 * RPC fails with "... memory full") and one rate-limited WARN names the peer
 * and the full scope. On the node and on a protocol, one reservation
 * takes at most half of what is free (another peer's small request always
 * fits). Streams a peer opens and connections per peer are counted
 * the same way. 0 = no limit. */
typedef struct ap_node_limits {
    uint64_t node_memory;   /* 256 MiB */
    uint64_t proto_memory;  /* each protocol: 192 MiB */
    uint64_t peer_memory;   /* each peer, all its connections: 64 MiB */
    uint64_t conn_memory;   /* each connection: 64 MiB */
    uint64_t stream_memory; /* each stream: 32 MiB */
    uint32_t node_streams;  /* streams peers opened, all peers: 16384 */
    uint32_t peer_streams;  /* each peer: 1024 */
    uint32_t conn_streams;  /* each connection: 1024 */
    uint32_t peer_conns;    /* connections per peer: 16 */
} ap_node_limits_t;

AP_EXPORT void ap_node_limits_default(ap_node_limits_t *l);
/* Replaces the node's limits. Only before the node has a connection
 * (right after ap_node_new): AP_ESTATE otherwise. Loop thread. */
AP_EXPORT int ap_node_set_limits(ap_rt_t *rt, const ap_node_limits_t *l);
/* The scopes' use against their limits, one line each: the node, every
 * protocol, and the max_peers peers holding the most memory, e.g.
 * "peer 12D3KooW...: memory 1048576/67108864, streams 3/1024, conns 1/16",
 * then "refused N" (reservations refused so far). Returns the length
 * (truncated to n - 1). Loop thread. */
AP_EXPORT size_t ap_node_resources(ap_rt_t *rt, int max_peers, char *out, size_t n);
/* The two above from any other thread (through ap_node_call_sync); the
 * report returns its length or a negative error as ap_node_call_sync. */
AP_EXPORT int ap_node_set_limits_sync(ap_rt_t *rt, const ap_node_limits_t *l);
AP_EXPORT int ap_node_resources_sync(ap_rt_t *rt, int max_peers, char *out, size_t n);

/* ---- reachability: AutoNAT and port mapping (docs/nat.md) ---------------- */

/* What the node believes about being reachable from the Internet. */
typedef enum ap_node_reach {
    AP_NODE_REACH_UNKNOWN = 0,
    AP_NODE_REACH_PUBLIC = 1,  /* peers dialled it back */
    AP_NODE_REACH_PRIVATE = 2, /* behind a NAT or a firewall: peers could not */
} ap_node_reach_t;

/* "unknown", "public", "private". */
AP_EXPORT const char *ap_node_reach_name(ap_node_reach_t r);

/* A change of verdict; addr: the address peers dialled (public) or the
 * one they could not (private), "" if none. Loop thread. */
typedef void (*ap_node_reach_fn)(ap_rt_t *rt, void *arg, ap_node_reach_t r, const char *addr);

typedef struct ap_node_nat_opts {
    /* Also map the listen port on the home gateway (UPnP IGD, then
     * NAT-PMP), renew it, and remove it when the node is freed. The mapped
     * address is advertised (ap_rt_listen_addrs, identify, the DHT) only
     * once AutoNAT confirms that peers reach the node there. */
    bool port_map;
    uint64_t first_us;          /* first probe after start: 0 = 3 s (peers connect first) */
    uint64_t retry_us;          /* between probes while unknown or in doubt: 0 = 20 s */
    uint64_t recheck_us;        /* between probes once settled: 0 = 15 min */
    ap_node_reach_fn on_change; /* may be NULL; every change is also logged (INFO, "nat") */
    void *arg;
} ap_node_nat_opts_t;

/* Starts AutoNAT on a TCP node with a listener: every probe round
 * identifies up to 5 connected peers (their observed addresses tell the
 * node its public IP, believed once 3 peers agree), then asks each to dial
 * it back at that IP and its listen port (and the mapped address); 3
 * agreeing answers from different peers settle the verdict. Every TCP
 * node also answers such requests (libp2p AutoNAT v1, dialling back only
 * the requester's own IP). AP_EINVAL for an in-process or dial-only node,
 * AP_EEXIST if already started. Loop thread. */
AP_EXPORT int ap_node_nat_start(ap_rt_t *rt, const ap_node_nat_opts_t *o);
/* The current verdict; addr (may be NULL, n bytes) as for ap_node_reach_fn.
 * AP_NODE_REACH_UNKNOWN before ap_node_nat_start. Loop thread. */
AP_EXPORT ap_node_reach_t ap_node_reachability(ap_rt_t *rt, char *addr, size_t n);
/* The two above from any other thread (through ap_node_call_sync);
 * ap_node_reachability_sync returns the verdict or a negative error. */
AP_EXPORT int ap_node_nat_start_sync(ap_rt_t *rt, const ap_node_nat_opts_t *o);
AP_EXPORT int ap_node_reachability_sync(ap_rt_t *rt, char *addr, size_t n);

/* ---- relays and hole punching (docs/nat.md) -------------------------------- */

typedef struct ap_node_relay_stats {
    unsigned reservations;      /* obtained on our relays, refreshes included */
    unsigned live_reservations; /* held now */
    uint64_t relayed_in;        /* relayed connections peers opened to us (the node's) */
    uint64_t relayed_out;       /* ... we opened through a relay */
    uint64_t bulk_refused;      /* bulk streams refused over relayed connections */
    unsigned punch_started;     /* DCUtR hole punches, either side */
    unsigned punch_direct;      /* ... that ended in a direct connection */
    unsigned punch_failed;      /* ... that did not */
    uint64_t direct_taken;      /* hole-punched connections the node's traffic moved to */
} ap_node_relay_stats_t;

/* The counters above (zero for a node without TCP). Loop thread; the _sync
 * form from any other thread (through ap_node_call_sync). */
AP_EXPORT void ap_node_relay_stats(ap_rt_t *rt, ap_node_relay_stats_t *out);
AP_EXPORT int ap_node_relay_stats_sync(ap_rt_t *rt, ap_node_relay_stats_t *out);

/* ---- blocking bridge for user threads ------------------------------------ */

/* Posts fn to rt's loop and blocks until done is completed; returns the
 * status given to ap_sync_complete, AP_ESHUTDOWN if the node closed before fn
 * ran, or AP_ESTATE when called on the loop thread (or by the thread that
 * drives a caller-driven host: that would deadlock). Any other thread. */
AP_EXPORT int ap_node_call_sync(ap_rt_t *rt, ap_sync_fn fn, void *arg);

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
