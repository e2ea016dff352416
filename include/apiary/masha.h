/* Apiary — MASHA: distributed extragradient with compressed communication
 * for variational inequalities / min-max problems (Beznosikov, Richtárik,
 * Diskin, Ryabinin, Gasnikov, 2022). docs/compression.md, "MASHA".
 *
 * M workers each hold an operator F_m (for a min-max problem, the gradient
 * field (grad_x f_m, -grad_y f_m)); a server averages their messages.
 *   - EXTRAGRADIENT: uncompressed baseline; per iteration each worker uploads
 *     F_m(z) and F_m(z_half), d floats each.
 *   - MASHA1: unbiased rand-k. Workers keep a reference point w with the
 *     exact F(w); per iteration z_bar = tau z + (1-tau) w, z_half = z_bar -
 *     gamma F(w), upload Q(F_m(z_half) - F_m(w)), z = z_half - gamma g where
 *     g is the server's average; with probability 1 - tau (one coin at the
 *     server, shared) w = z and every worker uploads F_m(w) in full.
 *   - MASHA2: the same with top-k and error feedback on gamma (F_m(z_half) -
 *     F_m(w)); z = z_half - g.
 * Optional server-side compression of the average (rand-k for MASHA1, top-k
 * with error feedback at the server for MASHA2).
 *
 * The math lives in worker and server state machines shared by the
 * in-process solver (ap_masha_run, for tests and `apiary bench masha`) and
 * the distributed protocol over runtime.h (ap_masha_server_start /
 * ap_masha_worker_start), so both send the same bytes.
 *
 * THREADS. The in-process functions are reentrant on distinct objects. The
 * protocol objects live on their runtime's loop thread. */
#ifndef APIARY_MASHA_H
#define APIARY_MASHA_H

#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- problems --------------------------------------------------------------- */

/* The paper's bilinear problem:
 *   f(x,y) = 1/M sum_m [x'A_m y + b_m'x + c_m'y + lambda/2 |x|^2 - lambda/2 |y|^2]
 * x, y in R^n, A_m = Abar + h (A0_m - Abar), A0_m entries N(0, 1/n), Abar the
 * mean of the A0_m, b_m, c_m ~ N(0, I). Everything from one seed (xoshiro,
 * Box-Muller), so every worker can build its own shard from the seed. */
typedef struct ap_masha_bilinear_cfg {
    int n;         /* 50 */
    int workers;   /* M = 10 */
    double lambda; /* 0.05 */
    double h;      /* 0.1 or 1 */
    uint64_t seed;
} ap_masha_bilinear_cfg_t;

typedef struct ap_masha_problem ap_masha_problem_t;

/* Builds the problem and solves F(z*) = 0 (Gaussian elimination with partial
 * pivoting). NULL on OOM or a singular system. */
AP_EXPORT ap_masha_problem_t *ap_masha_bilinear_new(const ap_masha_bilinear_cfg_t *cfg);
AP_EXPORT void ap_masha_problem_free(ap_masha_problem_t *p);
AP_EXPORT size_t ap_masha_dim(const ap_masha_problem_t *p); /* d = 2n */
AP_EXPORT int ap_masha_workers(const ap_masha_problem_t *p);
/* out[0..d) = F_m(z). */
AP_EXPORT void ap_masha_operator(const ap_masha_problem_t *p, int m, const double *z, double *out);
/* z* (d doubles, owned by p). */
AP_EXPORT const double *ap_masha_solution(const ap_masha_problem_t *p);
/* |z - z*|^2 / |z0 - z*|^2 with z0 = 0. */
AP_EXPORT double ap_masha_rel_dist2(const ap_masha_problem_t *p, const double *z);

/* ---- methods ----------------------------------------------------------------- */

typedef enum ap_masha_method {
    AP_MASHA_EXTRAGRADIENT = 0,
    AP_MASHA_1 = 1, /* rand-k */
    AP_MASHA_2 = 2, /* top-k + error feedback */
} ap_masha_method_t;

typedef struct ap_masha_opts {
    ap_masha_method_t method;
    double gamma;           /* step size */
    double fraction;        /* k/d for the worker compressor (MASHA1/2); k = round, >= 1 */
    double tau;             /* 0 = 1 - k/d (reference refresh probability k/d) */
    double server_fraction; /* 0 = server sends the dense average; else k/d of
                               the server's compressor (rand-k / top-k+EF) */
    uint64_t seed;          /* compressor seeds and the server's coin */
    uint64_t max_iters;     /* give up after this many iterations */
    double target;          /* stop when |z-z*|^2 <= target |z0-z*|^2 (1e-6) */
    int wire;               /* 0 = the newest wire version (3, /apiary/masha/3, 1-2 byte
                               headers, bare chunks); 1, 2 = speak at most that version
                               (what a peer built before version 2 or 3 speaks): a server
                               serves versions 1..wire, a worker starts at wire and steps
                               down. Workers of all versions can share a server: it
                               answers each in its version. */
    /* called after every iteration (may be NULL): bytes/floats uploaded per
     * worker so far and the relative squared distance */
    void (*trace)(void *arg, uint64_t iter, uint64_t floats_up, uint64_t bytes_up, double rel2);
    void *trace_arg;
} ap_masha_opts_t;

typedef struct ap_masha_result {
    bool converged;
    uint64_t iters;
    uint64_t refreshes;  /* reference-point refreshes (full uploads after init) */
    uint64_t floats_up;  /* per worker: values uploaded (indices not counted) */
    uint64_t bytes_up;   /* per worker: protocol bytes uploaded (headers, indices, seeds) */
    uint64_t bytes_down; /* per worker: protocol bytes of the server's replies */
    double rel_dist2;    /* final */
} ap_masha_result_t;

/* Runs the method in-process (the same worker/server code as the protocol,
 * messages passed by memory). */
AP_EXPORT int ap_masha_run(const ap_masha_problem_t *p, const ap_masha_opts_t *o,
                           ap_masha_result_t *r);

/* Upload bytes per worker that the protocol sends for a run of `iters`
 * iterations with `refreshes` reference refreshes (headers included), in
 * wire version o->wire. Versions 2 and 3 carry the worker index as a varint: the
 * count is exact for workers 0..127; a worker 128..16383 sends one byte more
 * per request, from 16384 two. */
AP_EXPORT uint64_t ap_masha_upload_bytes(const ap_masha_problem_t *p, const ap_masha_opts_t *o,
                                         uint64_t iters, uint64_t refreshes);

/* ---- distributed protocol over runtime.h ---------------------------------------
 * Each worker calls the server once per phase (request: header + a
 * compress.h chunk); the server answers every worker of the phase at once
 * when all M requests are in (reply: header + chunk of the average, and the
 * shared refresh coin). Every worker rebuilds its own operator from the
 * problem config and its index. Three wire versions (docs/compression.md):
 * "/apiary/masha/3" (1-2 byte headers, bare chunks: codec, count and k are
 * implied by the phase and the run's options), "/apiary/masha/2" (3-byte
 * headers, compact chunks, rand-k seeds derived by the receiver) and
 * "/apiary/masha/1" (8-byte headers, 24-byte chunk headers, seeds sent). A
 * server serves all and answers each worker in its version; a worker speaks
 * version 3 and steps down one version for good each time the server does
 * not serve it (AP_ENOPROTO on its first call). */

#define AP_MASHA_PROTO  "/apiary/masha/1"
#define AP_MASHA_PROTO2 "/apiary/masha/2"
#define AP_MASHA_PROTO3 "/apiary/masha/3"

typedef struct ap_masha_node ap_masha_node_t;

/* Starts the server on rt. peers are not needed: workers identify
 * themselves by index; a second request for a worker index in the same
 * phase is refused (AP_EPROTO), and an index is bound to the PeerID that
 * first used it (AP_EPERM for another peer). The average of a phase is
 * summed in worker-index order whatever the arrival order, so a run is
 * bit-identical to ap_masha_run of the same config on any driver. */
AP_EXPORT int ap_masha_server_start(ap_rt_t *rt, const ap_masha_bilinear_cfg_t *pc,
                                    const ap_masha_opts_t *o, ap_masha_node_t **out);
typedef void (*ap_masha_done_fn)(void *arg, int status, const ap_masha_result_t *r);

/* Makes the server follow the run, so a server process knows when it is
 * over. The server rebuilds the problem from its pc and applies every reply
 * it sends to a shadow copy of worker 0's state machine (whose z, iteration
 * and byte counts equal every worker's). done(arg, status, r) runs once, on
 * the loop thread:
 *   - status 0 right after the replies that end the run were handed to the
 *     runtime (the workers stop on them: target met, max_iters or
 *     divergence; r->converged tells which); r holds the per-worker counts,
 *     equal to ap_masha_run's result for the same config;
 *   - AP_ECLOSED when a worker that took part disconnected before the end
 *     (no fault tolerance: the run cannot complete);
 *   - AP_EPROTO when the completed phases disagree with the server's copy.
 * Afterwards the server refuses requests (AP_ESTATE). Call right after
 * ap_masha_server_start, before any request arrives (else AP_ESTATE). Loop
 * thread. (Independently of tracking, a worker index is bound to the PeerID
 * that first used it; another peer claiming it gets AP_EPERM.) */
AP_EXPORT int ap_masha_server_track(ap_masha_node_t *server, ap_masha_done_fn done, void *arg);

/* Starts worker `index` (0..M-1) talking to server. done(arg, result) runs on
 * the loop thread when the worker stops (converged: it sees the target is
 * met from its own copy of z, which equals every other worker's; or
 * max_iters; or an error, then status < 0). */
AP_EXPORT int ap_masha_worker_start(ap_rt_t *rt, const ap_peer_id_t *server,
                                    const ap_masha_bilinear_cfg_t *pc, const ap_masha_opts_t *o,
                                    int index, ap_masha_done_fn done, void *arg,
                                    ap_masha_node_t **out);
/* Stops (unregisters, cancels the pending call) and frees. Not from inside
 * done. */
AP_EXPORT void ap_masha_node_free(ap_masha_node_t *n);

#ifdef __cplusplus
}
#endif
#endif
