/* Internals of the butterfly all-reduce shared with its fuzz target. */
#ifndef AP_AVERAGING_ALLREDUCE_H
#define AP_AVERAGING_ALLREDUCE_H

#include "apiary/allreduce.h"
#include "apiary/avg.h"

#define AP__AVG_HELLO_MAX 256        /* cap on an encoded hello */
#define AP__AVG_FRAME_HDR 12         /* chunk frame header bytes */
#define AP__AVG_CHUNK_MAX (1u << 20) /* cap on chunk_elems */

enum { AP__AVG_FRAME_DATA = 1, AP__AVG_FRAME_RESULT = 2 };

typedef struct ap__avg_hello {
    uint8_t group_id[AP_AVG_GROUP_ID_LEN];
    uint32_t sender, reducer, chunk_elems, codec;
    uint64_t offset, count, total;
    double weight;
} ap__avg_hello_t;

/* Encodes into out (AP__AVG_HELLO_MAX bytes); returns the length. */
size_t ap__avg_hello_encode(const ap__avg_hello_t *h, uint8_t *out);
/* Decodes untrusted bytes: AP_EMSGSIZE over the cap, AP_ECORRUPT if not a
 * hello or a field is out of range (group id length, offset + count > total,
 * total > AP_ALLREDUCE_MAX_ELEMS, chunk_elems 0 or > cap, weight not finite > 0). */
int ap__avg_hello_decode(const uint8_t *b, size_t len, ap__avg_hello_t *out);

/* Chunk frame: u8 type, u8 codec, u16 zero, be32 index, be32 elems, payload. */
typedef struct ap__avg_frame {
    uint8_t type, codec;
    uint32_t index, elems;
    const uint8_t *payload; /* points into the parsed bytes */
    size_t payload_len;
} ap__avg_frame_t;

/* The default chunk size for a group (ap_allreduce_opts_t.chunk_elems = 0). */
uint32_t ap__avg_auto_chunk(const ap_avg_group_t *g);

void ap__avg_frame_header(uint8_t *out, uint8_t type, uint8_t codec, uint32_t index,
                          uint32_t elems);
/* AP_ECORRUPT if shorter than the header, a bad type or nonzero reserved bits. */
int ap__avg_frame_parse(const uint8_t *b, size_t len, ap__avg_frame_t *out);

#endif

/* The runtime a service runs on. */
ap_rt_t *ap__avg_service_rt(ap_avg_service_t *svc);

/* Test hooks. */
typedef struct ap__avg_progress {
    uint32_t data_chunks_sent, data_chunks_total; /* as sender, over all parts */
    uint32_t results_recv, results_total;         /* as receiver */
    uint32_t reduced, my_chunks;                  /* as reducer */
    uint32_t lead_min, lead_max; /* automatic pacing: current leads over the parts (0: none) */
} ap__avg_progress_t;
void ap__allreduce_progress(const ap_allreduce_t *ar, ap__avg_progress_t *p);
/* Data chunks this node (as reducer) has received from group member j, and
 * how many its part has; both 0 if it reduces nothing. */
void ap__allreduce_sender_progress(const ap_allreduce_t *ar, int j, uint32_t *got, uint32_t *total);
/* Frees a service and its rounds without touching the runtime: for a node
 * that crashed in a test (its runtime is gone). */
void ap__avg_service_abandon(ap_avg_service_t *svc);
