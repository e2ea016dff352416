/* Apiary — the Averager (prefix ap_averager_): a fixed set of float32 tensors
 * averaged with a group, in place, one step at a time; the group comes from
 * matchmaking over the DHT (ap_averager_step) or from the caller
 * (ap_averager_step_group). Each step runs one all-reduce round
 * (apiary/allreduce.h). Everything runs on the runtime's loop thread except
 * the *_sync / *_wait forms, which are for a user thread of a node of the
 * real driver (apiary/node.h). */
#ifndef APIARY_AVERAGER_H
#define APIARY_AVERAGER_H

#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the Averager ------------------------------------------------------------
 *
 * Owns a fixed set of float32 tensors (one contiguous, pre-faulted buffer) and
 * averages them with a group, in place, one step at a time. The user writes
 * the tensors through ap_averager_tensor() only while no step runs. */

typedef enum ap_averager_stage {
    AP_AVERAGER_STAGE_LOOKING = 1, /* looking for a group (matchmaking) */
    AP_AVERAGER_STAGE_RUNNING = 2, /* the all-reduce round runs */
    AP_AVERAGER_STAGE_DONE = 3,    /* finished; see the result for the averaged fraction */
    AP_AVERAGER_STAGE_FAILED = 4,  /* canceled or could not run */
} ap_averager_stage_t;

typedef struct ap_averager_opts {
    ap_avg_role_t role;
    /* Declared bandwidth in bytes/s. 0 = the measured estimate: an EWMA of
     * the payload rates of this peer's past rounds (starts at 1 MB/s). */
    double up, down;
    ap_allreduce_opts_t round; /* chunk size, codec, min share, deadlines */
} ap_averager_opts_t;

typedef struct ap_averager ap_averager_t;
typedef struct ap_averager_step ap_averager_step_t;

/* Creates an averager over ntensors tensors of sizes[i] elements (zeroed).
 * Loop thread. AP_EINVAL if the total exceeds AP_ALLREDUCE_MAX_ELEMS. */
AP_EXPORT int ap_averager_new(ap_avg_service_t *svc, const size_t *sizes, size_t ntensors,
                              const ap_averager_opts_t *opts, ap_averager_t **out);
/* AP_EBUSY while a step runs. Loop thread. */
AP_EXPORT int ap_averager_free(ap_averager_t *av);
/* Blocking forms for a user thread of a node of the real driver: run
 * ap_averager_new / _free on the loop of rt (the service's node) and wait. */
AP_EXPORT int ap_averager_new_sync(ap_rt_t *rt, ap_avg_service_t *svc, const size_t *sizes,
                                   size_t ntensors, const ap_averager_opts_t *opts,
                                   ap_averager_t **out);
AP_EXPORT int ap_averager_free_sync(ap_rt_t *rt, ap_averager_t *av);
/* Tensor i (owned by the averager, valid until ap_averager_free); NULL if out
 * of range. Write it only while no step runs. */
AP_EXPORT float *ap_averager_tensor(ap_averager_t *av, size_t i, size_t *n_elems);
/* Whether a step runs (loop thread). */
AP_EXPORT bool ap_averager_running(const ap_averager_t *av);
/* The bandwidth this peer declares in its next group (configured or measured). */
AP_EXPORT void ap_averager_bandwidth(const ap_averager_t *av, double *up, double *down);
/* The member entry this peer contributes to a group (id, role, bandwidth). */
AP_EXPORT void ap_averager_member(const ap_averager_t *av, ap_avg_member_t *out);

typedef void (*ap_averager_step_fn)(ap_rt_t *rt, void *arg, ap_averager_step_t *step);

/* Starts one step in group g (copied) with this peer's weight; deadline_at_us
 * (ap_rt_now_us time, 0 = none) caps the round. cb (may be NULL) runs on the
 * loop thread when the step is DONE or FAILED. *out is the handle: poll it,
 * cancel it, and free it with ap_averager_step_free. AP_EBUSY if a step runs.
 * Loop thread. */
AP_EXPORT int ap_averager_step_group(ap_averager_t *av, const ap_avg_group_t *g, double weight,
                                     uint64_t deadline_at_us, ap_averager_step_fn cb, void *arg,
                                     ap_averager_step_t **out);
AP_EXPORT ap_averager_stage_t ap_averager_step_stage(const ap_averager_step_t *st);
/* The round's result once DONE or FAILED, else NULL. Valid until freed. */
AP_EXPORT const ap_allreduce_result_t *ap_averager_step_result(const ap_averager_step_t *st);
/* Cancels a running step (it ends FAILED with AP_ECANCELED; cb still runs). */
AP_EXPORT void ap_averager_step_cancel(ap_averager_step_t *st);
/* Frees the handle; a running step is canceled and freed when it ends. */
AP_EXPORT void ap_averager_step_free(ap_averager_step_t *st);

/* Blocking form for a user thread (NOT the loop thread): runs
 * ap_averager_step_group on the loop thread through ap_rt_post and waits for
 * the end. g is copied before returning. Returns the start error, or the
 * round's status; *res (may be NULL) gets the result. */
AP_EXPORT int ap_averager_step_group_wait(ap_averager_t *av, const ap_avg_group_t *g, double weight,
                                          uint64_t deadline_at_us, ap_allreduce_result_t *res);

/* One step with matchmaking: stage LOOKING until a group is found, then
 * RUNNING as ap_averager_step_group (the round's deadline comes from the
 * averager's round options). If no group forms, the step ends FAILED with
 * the search's status in the result. cb, *out, cancel and free as in
 * ap_averager_step_group. Loop thread. */
AP_EXPORT int ap_averager_step(ap_averager_t *av, ap_avg_matchmaker_t *mm, const ap_avg_match_t *m,
                               double weight, ap_averager_step_fn cb, void *arg,
                               ap_averager_step_t **out);
/* The group the step ran in (valid once RUNNING; NULL before): its size. */
AP_EXPORT size_t ap_averager_step_group_size(const ap_averager_step_t *st);
/* The members of the group of this averager's latest step that began a
 * round (in the group's order; a failed search leaves the previous one):
 * copies up to cap of them into out (may be NULL) and returns how many there
 * are (0 before the first round). Loop thread, or the user thread of the
 * *_sync forms between its steps. */
AP_EXPORT size_t ap_averager_last_group(const ap_averager_t *av, ap_avg_member_t *out, size_t cap);
/* What member i of that group gave its group (ap_avg_match_t.gather;
 * nothing for a group not made by matchmaking): copies up to cap bytes into
 * out (may be NULL) and returns their length (0..AP_AVG_GATHER_MAX), or
 * AP_EINVAL if i is not a member's index. Same threads as above. */
AP_EXPORT int ap_averager_last_gather(const ap_averager_t *av, size_t i, uint8_t *out, size_t cap);

/* Blocking form of ap_averager_step for a user thread (NOT the loop thread)
 * of a node of the real driver: looks for a group and averages in it, then
 * returns. m is copied (its key and gather must stay valid until this returns). If
 * look_us > 0 the search's deadline is look_us after the step starts on the
 * loop (m->deadline_at_us is then ignored: a user thread cannot read the
 * loop's clock); else m->deadline_at_us is used as given. Returns the start
 * error or the step's status (0: *res tells the averaged fraction;
 * AP_ETIMEDOUT: no group formed). res and group_size may be NULL. Write the
 * tensors only while no step runs, i.e. between calls. */
AP_EXPORT int ap_averager_step_sync(ap_rt_t *rt, ap_averager_t *av, ap_avg_matchmaker_t *mm,
                                    const ap_avg_match_t *m, uint64_t look_us, double weight,
                                    ap_allreduce_result_t *res, size_t *group_size);

#ifdef __cplusplus
}
#endif
#endif
