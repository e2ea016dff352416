/* The butterfly all-reduce across network namespaces: one process per group
 * member, each inside its own namespace of an ap_netns_t (so every byte it
 * sends or receives crosses its shaped veth link), talking TCP + Noise XX
 * through the uv driver. Shared by `apiary bench allreduce-shaped` and
 * tests/net/test_avg_netns.c.
 *
 * Each worker is a fork()ed child that enters its namespace, starts a node
 * on /ip4/10.77.0.<i+1>/tcp/0 and reports its PeerID and address to the
 * parent over a pipe; the parent sends every worker the full list, then
 * starts the rounds one at a time (a byte on each worker's pipe) and waits
 * for every worker's report before the next. Member i holds
 * x_i[k] = ((k·2654435761) >> 7) mod 1000 + i with weight 1 + i (integers,
 * so Σ w·x is exact in double and a float32 round must give exactly the
 * reference mean); the vector is re-filled before each round.
 *
 * Parent side: one thread; the caller must not hold other children it
 * waits for with waitpid(-1). */
#ifndef AP_BENCH_ALLREDUCE_NETNS_H
#define AP_BENCH_ALLREDUCE_NETNS_H

#include "netns.h"

#include "apiary/allreduce.h"
#include "apiary/avg.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct ap_arns_peer {
    ap_avg_role_t role;
    double decl_up, decl_down; /* bytes/s this member declares to the group */
} ap_arns_peer_t;

typedef struct ap_arns_opts {
    uint64_t elems;            /* vector length */
    uint32_t chunk_elems;      /* 0 = the library's default */
    uint8_t codec;             /* ap_avg_codec_t; exactness is checked for F32 only */
    double deadline_factor;    /* 0 = the library's default */
    uint64_t connect_grace_us; /* 0 = the library's default */
    uint64_t stall_min_us;     /* 0 = the library's default */
    uint32_t max_lead_chunks;  /* pacing (ap_allreduce_opts_t); 0 = unpaced */
    int rounds;                /* 1..64 */
    double round_timeout_s;    /* a worker gives up on a round after this (0 = 600) */
} ap_arns_opts_t;

typedef struct ap_arns_round {
    int status;             /* 0, or the first non-zero status of a member */
    bool exact;             /* every receiver holds exactly the reference mean (F32) */
    double round_s;         /* the slowest member's round time (its own start to done) */
    double min_fraction;    /* smallest averaged_fraction over members */
    double cpu_s;           /* CPU seconds of all workers during the round (user + sys) */
    uint64_t payload_bytes; /* chunk payload bytes all members sent */
    uint32_t senders_dropped, parts_failed; /* sums over members */
    char why[200];                          /* the first problem seen, or "" */
} ap_arns_round_t;

/* Runs o->rounds rounds with n members (n ≤ ap_netns_count(ns); member i in
 * host i's namespace) and fills out[0..rounds-1]. Returns 0 when every
 * worker started and reported every round (a round may still have failed:
 * see out[r].status / exact); else a negative AP_E* code and a reason in
 * why. All workers are reaped before it returns. */
int ap_arns_run(ap_netns_t *ns, const ap_arns_peer_t *peers, size_t n, const ap_arns_opts_t *o,
                ap_arns_round_t *out, char *why, size_t wn);

#endif
