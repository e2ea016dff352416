/* The all-reduce on real processes: the group file, the worker's data, and
 * the parent side that spawns `apiary avg-worker` processes and collects
 * their per-round JSON lines. Used by `apiary bench allreduce` (loopback) and
 * by the shaped-link bench (the same workers in network namespaces, through
 * the wrap hook below).
 *
 * GROUP FILE (text, one member per line, in group order; '#' starts a
 * comment line, blank lines are skipped):
 *
 *     member MULTIADDR ROLE UP DOWN [WEIGHT]
 *
 *   MULTIADDR  /ip4/A.B.C.D/tcp/PORT/p2p/12D3KooW...  (normal, aux), or
 *              /p2p/12D3KooW... for a client (it never listens)
 *   ROLE       normal | client | aux
 *   UP, DOWN   declared bandwidth in bytes/s (finite, > 0); every worker
 *              feeds them to the load balancer, so all agree on the split
 *   WEIGHT     the member's averaging weight (finite, > 0; default 1;
 *              ignored for aux)
 *
 * At most AP_ARP_MAX_PEERS members; a line is at most 1023 bytes. Anything
 * else is refused with a message naming the line (ap_arp_group_read).
 *
 * WORKER (`apiary avg-worker`, internal, see its --help): loads its key file,
 * finds itself in the group by PeerID, listens (unless client), teaches the
 * runtime every member's address, prints
 *   {"event":"up","index":I,"id":"12D3KooW...","role":"normal","addr":"..."}
 * then, for each of W warm-up and R measured rounds r = 0, 1, ...:
 *   1. fills its vector from the seed (ap_arp_value), prints
 *      {"event":"ready","round":r,"phase":"start"} and waits for one line on
 *      stdin (the start barrier; any text; EOF ends the worker);
 *   2. runs one ap_allreduce_start round with group id ap_arp_group_id(r)
 *      and prints
 *      {"event":"round","round":r,"warmup":B,"status":S,"round_s":T,"cpu_s":C,
 *       "bytes_sent":N,"bytes_received":N,"averaged_fraction":F,
 *       "parts_failed":N,"senders_dropped":N,"predicted_s":T,"elems":N,
 *       "codec":"none","peers":P,"index":I}
 *      round_s = its own round time (start to done), cpu_s = its process CPU
 *      time (user + system, all threads) over the round;
 *   3. prints {"event":"ready","round":r,"phase":"check"} and waits for a
 *      second line (so the check never takes CPU from a member still in
 *      its round), compares its vector with the weighted mean computed from
 *      the seeds (every element up to 4M, else an evenly spread sample of
 *      1M) and prints
 *      {"event":"check","round":r,"checked":N,"bad":N,"max_err":E,"tol":E,
 *       "digest":"HEX"}
 *      bad = elements off by more than tol (none: the float rounding of the
 *      exact mean; lossy codecs: the codec's error bound applied to the data
 *      and to the result); digest = a 64-bit hash of the whole vector (every
 *      receiver must hold the same bytes). An aux member checks nothing.
 * At the end it prints {"event":"done"} and exits 0 (1 if a round failed).
 * With --no-sync it never waits on stdin. Any other stdout line is not JSON
 * with an "event" and is ignored by the parent.
 *
 * THREADS. Everything here runs on the caller's thread; ap_arp_run blocks
 * until every worker ended (or was killed at the timeout). */
#ifndef AP_BENCH_ALLREDUCE_PROCS_H
#define AP_BENCH_ALLREDUCE_PROCS_H

#include "apiary/allreduce.h"
#include "apiary/avg.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_ARP_MAX_PEERS 64
#define AP_ARP_ADDR_MAX  256

typedef struct ap_arp_member {
    char addr[AP_ARP_ADDR_MAX]; /* full multiaddr with /p2p/ (client: /p2p/ only) */
    ap_avg_role_t role;
    double up, down; /* bytes/s */
    double weight;
} ap_arp_member_t;

/* Writes the group file (mode 0644, replaced atomically). 0 or AP_EIO. */
int ap_arp_group_write(const char *path, const ap_arp_member_t *m, size_t n);
/* Reads and checks a group file: every line as described above, multiaddrs
 * that parse and carry /p2p/, clients with /p2p/ only and others with
 * /tcp/, distinct PeerIDs, 1..max members. On error returns AP_ECORRUPT (or
 * AP_EIO) and writes a message naming the line into err (errlen bytes). */
int ap_arp_group_read(const char *path, ap_arp_member_t *m, size_t max, size_t *n, char *err,
                      size_t errlen);

const char *ap_arp_role_name(ap_avg_role_t r);
int ap_arp_role_parse(const char *s, ap_avg_role_t *out);
/* "none"|"f32"|"float32" -> F32, "fp16", "bf16", "uniform8", "blockwise8". */
int ap_arp_codec_parse(const char *s, uint8_t *out);
const char *ap_arp_codec_name(uint8_t codec);
/* Pacing lead (ap_allreduce_opts_t.max_lead_chunks): "auto" -> 0, "off" ->
 * AP_ALLREDUCE_LEAD_OFF, or a chunk count >= 1. False on anything else. */
bool ap_arp_lead_parse(const char *s, uint32_t *out);
/* The inverse, into buf (16 bytes) for numbers. */
const char *ap_arp_lead_name(uint32_t lead, char buf[16]);

/* Element k of member i's vector for data seed `seed`: in [-50 + i, 50 + i),
 * a multiple of 1/20, a pure function (the checker recomputes it). */
static inline float ap_arp_value(uint32_t seed, int i, uint64_t k)
{
    uint32_t h = (uint32_t)(k * 2654435761ull) ^ ((uint32_t)(i + 1) * 0x9E3779B9u) ^ seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    return (float)(h % 2001u) / 20.0f - 50.0f + (float)i;
}
/* The group id of round r: "apiary/bench/ar" || be64(r) || zeros. */
void ap_arp_group_id(uint64_t round, uint8_t out[AP_AVG_GROUP_ID_LEN]);

/* ---- parent side ------------------------------------------------------------ */

/* Hook to run a worker through a wrapper: fill prefix[] with up to max
 * arguments put before the `apiary avg-worker ...` command line (e.g.
 * "ip", "netns", "exec", "ns3") and return how many (0 = none, < 0 = error).
 * The strings must stay valid until ap_arp_run returns. Called once per
 * worker, on the caller's thread, before it is spawned. */
typedef int (*ap_arp_wrap_fn)(void *arg, int index, const char **prefix, int max);

typedef struct ap_arp_cfg {
    const char *exe; /* the apiary binary (NULL = /proc/self/exe) */
    const char *dir; /* a directory for keys, the group file and logs (must exist) */
    int peers;       /* 1..AP_ARP_MAX_PEERS */
    /* per member i (each array may be NULL): */
    const ap_avg_role_t *roles;    /* NULL = all normal */
    const double *up, *down;       /* declared bytes/s; NULL = 1e9 */
    const char *const *listen;     /* listen multiaddr (/ipX/.../tcp/PORT); NULL entry or
                                      array = 127.0.0.1 with a free port the parent picks
                                      (it binds port 0 and closes it) */
    uint64_t elems;                /* vector length */
    uint8_t codec;                 /* ap_avg_codec_t */
    int rounds, warmup;            /* measured and warm-up rounds */
    uint32_t chunk_elems;          /* 0 = the library default */
    uint32_t seed;                 /* data seed */
    double timeout_s;              /* whole run; 0 = 600 */
    const char *dump_dir;          /* NULL, or workers write their last vector there as
                                      result-<index>.f32 (raw little-endian float32) */
    const char *const *extra_args; /* NULL-terminated extra worker flags, or NULL */
    ap_arp_wrap_fn wrap;           /* NULL = run the worker directly */
    void *wrap_arg;
} ap_arp_cfg_t;

#define AP_ARP_MAX_ROUNDS 64

typedef struct ap_arp_round {
    double wall_s;         /* parent: barrier release to the last worker's line */
    double max_worker_s;   /* the slowest worker's round_s */
    double cpu_s;          /* sum of the workers' cpu_s */
    double min_fraction;   /* smallest averaged_fraction of a receiver */
    uint64_t bytes_sent;   /* sum over workers */
    uint64_t checked, bad; /* sum over workers */
    double max_err, tol;   /* worst error seen, and the tolerance it was held to */
    int status;            /* first nonzero worker status, else 0 */
    bool digests_equal;    /* every receiver holds the same vector */
} ap_arp_round_t;

typedef struct ap_arp_result {
    int nrounds; /* measured rounds collected */
    ap_arp_round_t r[AP_ARP_MAX_ROUNDS];
    double median_wall_s, median_cpu_s, median_worker_s;
    bool verified; /* every measured and warm-up round: status 0, fraction 1,
                      bad 0, digests equal */
    char why[256]; /* the first problem, if any */
} ap_arp_result_t;

/* Creates P identities in cfg->dir, writes cfg->dir/group.txt, spawns the P
 * workers (stdout into a pipe read by the parent, stderr into
 * cfg->dir/worker-<i>.log), releases every round's barrier once all are
 * ready, collects the lines, and reaps the workers. Returns 0 if the run
 * completed (see res->verified for the checks), else a negative code with
 * res->why set; workers still running are SIGKILLed. */
int ap_arp_run(const ap_arp_cfg_t *cfg, ap_arp_result_t *res);

#endif
