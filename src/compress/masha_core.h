/* MASHA worker and server state machines, shared by the in-process solver
 * and the runtime protocol. Internal. */
#ifndef AP_COMPRESS_MASHA_CORE_H
#define AP_COMPRESS_MASHA_CORE_H

#include "apiary/compress.h"
#include "apiary/masha.h"

/* Message header (8 bytes, then one compress.h chunk):
 *   request: u8 version=1, u8 phase, u16 LE worker, u32 LE iteration
 *   reply:   u8 version=1, u8 phase, u8 refresh bit, u8 0, u32 LE iteration */
#define AP__MASHA_HDR     8
#define AP__MASHA_VERSION 1

typedef enum ap__masha_phase {
    AP__MP_FULL = 1, /* F_m(w) in full (MASHA init/refresh) */
    AP__MP_DIFF = 2, /* compressed difference (MASHA) */
    AP__MP_EG_A = 3, /* F_m(z) (extragradient) */
    AP__MP_EG_B = 4, /* F_m(z_half) (extragradient) */
} ap__masha_phase_t;

typedef struct ap__masha_worker ap__masha_worker_t;
typedef struct ap__masha_server ap__masha_server_t;

ap__masha_worker_t *ap__masha_worker_new(const ap_masha_problem_t *p, const ap_masha_opts_t *o,
                                         int m);
void ap__masha_worker_free(ap__masha_worker_t *w);
/* Builds the first request. */
int ap__masha_worker_start(ap__masha_worker_t *w);
/* The pending request (valid until the next call). */
const uint8_t *ap__masha_worker_msg(const ap__masha_worker_t *w, size_t *len);
/* Applies the server's reply and builds the next request. *iter_done is set
 * when the reply completed an iteration. */
int ap__masha_worker_on_reply(ap__masha_worker_t *w, const uint8_t *rep, size_t len,
                              bool *iter_done);
const double *ap__masha_worker_z(const ap__masha_worker_t *w);
uint64_t ap__masha_worker_iter(const ap__masha_worker_t *w);
void ap__masha_worker_counts(const ap__masha_worker_t *w, ap_masha_result_t *r);

ap__masha_server_t *ap__masha_server_new(size_t d, int workers, const ap_masha_opts_t *o);
void ap__masha_server_free(ap__masha_server_t *s);
/* Adds one worker's request. Returns 1 when all M requests of the phase are
 * in (then call ap__masha_server_reply), 0 when more are expected, or an
 * error (AP_EPROTO / AP_ECORRUPT: bad or duplicate request). */
int ap__masha_server_add(ap__masha_server_t *s, const uint8_t *req, size_t len);
/* The reply for the completed phase (valid until the next add). */
const uint8_t *ap__masha_server_reply(ap__masha_server_t *s, size_t *len);

#endif
