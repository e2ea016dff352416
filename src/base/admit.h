/* Connection admission that cannot be starved: the decisions a transport
 * makes when a connection arrives, handshakes or goes, kept apart from any
 * socket so the TCP and libp2p transports share them and tests drive them
 * with chosen times and random numbers. Internal.
 *
 * Pending inbound handshakes are limited per source IP and in total. Past a
 * soft total (start) a new one is dropped with a probability rising linearly
 * from rate_pct at start to 100 % at full (OpenSSH's MaxStartups
 * "start:rate:full"); at full the oldest pending handshake of the IP holding
 * the most is closed to make room (or, when every source holds as few as
 * the newcomer, the oldest one if it has stalled for hs_min_age_ms), so a
 * flood of stalled handshakes cannot keep a new peer out. Open connections are limited per IP and
 * in total, with slots kept for the node's own dials and for peers it already knows (routing
 * table): a flood of fresh identities fills only the shared part. When a limit is reached, a
 * newcomer is admitted in place of the least useful inbound connection, one to a peer not
 * known: at the per-IP limit, the longest idle of the newcomer's own IP (activity reported with
 * ap_admit_touch), so that address's budget turns over and a client holding it cannot lock a
 * new peer behind the same address out; at the total limit, one idle for at least
 * evict_idle_ms, from the source IP holding the most connections, the longest idle first. So
 * connections held open by one client cannot lock new peers out, and active or known peers are
 * not the ones that make room.
 *
 * Identify connections by a caller-chosen non-zero id; addresses are 16
 * bytes (IPv4 as ::ffff:a.b.c.d). One admission serves every transport on
 * a port (the TCP transport's is shared with the libp2p host on it): each
 * kind of connection has ids of its own, so a victim id tells its owner.
 * Not thread-safe. */
#ifndef AP_BASE_ADMIT_H
#define AP_BASE_ADMIT_H

#include "base/u64map.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ap_admit_config {
    uint32_t hs_start;      /* pending inbound handshakes before random drop (64) */
    uint32_t hs_rate_pct;   /* drop probability at hs_start, percent (30) */
    uint32_t hs_full;       /* pending inbound handshakes at most (256) */
    uint32_t hs_per_ip;     /* pending inbound handshakes per source IP (16) */
    uint32_t hs_min_age_ms; /* at hs_full: a handshake this old may be closed for a new one (500) */
    uint32_t max_conns;     /* open connections, both directions (1024) */
    uint32_t conns_per_ip;  /* open inbound connections per source IP (64) */
    uint32_t reserved_out;  /* of max_conns, kept for the node's own dials (64) */
    uint32_t reserved_known; /* of max_conns, kept for known peers (64) */
    uint32_t evict_idle_ms;  /* an open inbound connection idle this long may make room (200) */
} ap_admit_config_t;

typedef enum ap_admit_verdict {
    AP_ADMIT_OK = 0,
    AP_ADMIT_EVICT = 1, /* admitted: first close *victim (a pending handshake, or for
                           ap_admit_open an idle open connection) */
    AP_ADMIT_DROP = 2,  /* refused: close the new connection now */
} ap_admit_verdict_t;

typedef struct ap_admit_stats {
    uint32_t pending, open_in, open_out, open_known;
    uint64_t dropped_random, dropped_per_ip, dropped_full, evicted_pending;
    uint64_t refused_conns_per_ip, refused_conns;
    uint64_t evicted_idle; /* open connections closed for a newcomer */
} ap_admit_stats_t;

typedef struct ap_admit {
    ap_admit_config_t cfg;
    ap_u64map_t conns; /* id -> index into ents */
    ap_u64map_t ips;   /* ip hash -> index into ipc */
    struct ap_admit_ent *ents;
    size_t nents, ents_cap;
    struct ap_admit_ip *ipc;
    size_t nipc, ipc_cap;
    ap_admit_stats_t st;
} ap_admit_t;

/* Fills the defaults above. */
void ap_admit_config_default(ap_admit_config_t *c);
/* cfg NULL = defaults; zero fields take their default. */
void ap_admit_init(ap_admit_t *a, const ap_admit_config_t *cfg);
void ap_admit_close(ap_admit_t *a);

/* An inbound connection id from ip arrives at now_ms; rnd is a uniform
 * random 32-bit value (the caller's seeded RNG). On AP_ADMIT_EVICT the
 * caller closes *victim (and reports it with ap_admit_gone). AP_ADMIT_DROP:
 * nothing is recorded. AP_ADMIT_OK / _EVICT: id is pending until
 * ap_admit_open or ap_admit_gone. */
ap_admit_verdict_t ap_admit_inbound(ap_admit_t *a, uint64_t id, const uint8_t ip[16],
                                    uint64_t now_ms, uint32_t rnd, uint64_t *victim);
/* The handshake of id finished at now_ms: it becomes an open connection.
 * known: the peer is one the node already knows (routing table), which may
 * use the reserved known slots. AP_ADMIT_OK; AP_ADMIT_EVICT: admitted, the
 * caller closes *victim (an idle open inbound connection, see above);
 * AP_ADMIT_DROP: the limits refuse it and no connection may make room
 * (close it then, and call ap_admit_gone). */
ap_admit_verdict_t ap_admit_open(ap_admit_t *a, uint64_t id, bool known, uint64_t now_ms,
                                 uint64_t *victim);
/* Whether an inbound connection from ip could be admitted now by
 * ap_admit_open, were its handshake done and its peer known: a slot is free
 * (the known slots included: the peer is not identified yet) or an idle
 * connection could make room. A transport refuses at accept otherwise. */
bool ap_admit_has_room(const ap_admit_t *a, const uint8_t ip[16], uint64_t now_ms);
/* id carried application data at now_ms (any state; unknown ids ignored). */
void ap_admit_touch(ap_admit_t *a, uint64_t id, uint64_t now_ms);
/* Marks open connection id as one to a known peer, or not. */
void ap_admit_set_known(ap_admit_t *a, uint64_t id, bool known);
/* The node dials out (id new): true if a slot is free (the reserved_out
 * slots included). The connection counts as open from now. */
bool ap_admit_outbound(ap_admit_t *a, uint64_t id, const uint8_t ip[16]);
/* id closed, in whatever state (unknown ids are ignored). */
void ap_admit_gone(ap_admit_t *a, uint64_t id);
/* id is known as new_id from now on, in the same state and with the same
 * times (a connection handed from one transport to another keeps its
 * count and its age). false, nothing changed, if id is unknown or new_id
 * is 0 or already in use. */
bool ap_admit_rekey(ap_admit_t *a, uint64_t id, uint64_t new_id);
/* Pending inbound handshakes from ip. */
uint32_t ap_admit_pending_ip(const ap_admit_t *a, const uint8_t ip[16]);

static inline const ap_admit_stats_t *ap_admit_stats(const ap_admit_t *a)
{
    return &a->st;
}

#endif
