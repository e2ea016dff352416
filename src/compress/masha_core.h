/* MASHA worker and server state machines, shared by the in-process solver
 * and the runtime protocol. Internal. */
#ifndef AP_COMPRESS_MASHA_CORE_H
#define AP_COMPRESS_MASHA_CORE_H

#include "apiary/compress.h"
#include "apiary/masha.h"

/* Message headers, then one compress.h chunk (docs/compression.md):
 * version 1 (/apiary/masha/1, 8 bytes, version 1 chunk):
 *   request: u8 version=1, u8 phase, u16 LE worker, u32 LE iteration
 *   reply:   u8 version=1, u8 phase, u8 refresh bit, u8 0, u32 LE iteration
 * version 2 (/apiary/masha/2, 3..5 bytes, compact chunk with offset 0 and
 * no rand-k seed: both sides derive it from the run seed, the iteration and
 * the worker index):
 *   request: u8 0x20 | phase, u8 iteration mod 256, varint worker
 *   reply:   u8 0x20 | refresh << 3 | phase, u8 iteration mod 256
 * version 3 (/apiary/masha/3, 1..2 bytes, bare chunk: no chunk header, the
 * phase and the run's options imply codec, count, k and offset 0):
 *   request: u8 0x80 | (iteration mod 32) << 2 | (phase - 1), varint worker
 *   reply:   u8 0x80 | (iteration mod 16) << 3 | refresh << 2 | (phase - 1) */
#define AP__MASHA_HDR     8
#define AP__MASHA_VERSION 1
#define AP__MASHA_V2      2
#define AP__MASHA_V3      3

/* A parsed request or reply header. */
typedef struct ap__masha_hdr {
    int version;     /* 1, 2 or 3 */
    uint8_t phase;   /* 1..4 */
    uint32_t iter;   /* version 1: the iteration; 2: its low 8 bits; 3: 5 (requests), 4 */
    unsigned worker; /* requests */
    bool refresh;    /* replies */
    size_t hdr_len;  /* the chunk follows */
} ap__masha_hdr_t;

/* Parses the header of a request (is_reply false) or a reply: AP_EPROTO if
 * short or malformed, AP_EVERSION for an unknown version. */
int ap__masha_hdr_parse(const uint8_t *b, size_t len, bool is_reply, ap__masha_hdr_t *h);

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
/* The worker's wire version (1, 2 or 3). */
int ap__masha_worker_wire(const ap__masha_worker_t *w);
/* Switches the worker one wire version down (the server does not speak its
 * version): the pending request is re-framed (same values) and the byte
 * count adjusted. AP_ESTATE once a reply was accepted; 0 and no change in
 * version 1. */
int ap__masha_worker_downgrade(ap__masha_worker_t *w);
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
/* The same in two steps, so that the average does not depend on the order
 * in which requests arrive (float sums are not associative): check()
 * validates a request fully (returns 1 when all M are in, 0 when more are
 * expected, or an error as add()); the caller keeps the requests, then
 * complete() sums them in worker-index order — exactly what add() computes
 * when called in index order — and builds the reply (returns 1). */
int ap__masha_server_check(ap__masha_server_t *s, const uint8_t *req, size_t len);
int ap__masha_server_complete(ap__masha_server_t *s, const uint8_t *const *reqs,
                              const size_t *lens);
/* The reply for the completed phase in wire version `version` (1, 2 or 3; 0 =
 * the opts' wire version), for the workers that spoke it (valid until the
 * next add). */
const uint8_t *ap__masha_server_reply(ap__masha_server_t *s, int version, size_t *len);

#endif
