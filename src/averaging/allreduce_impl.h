/* Internals of the butterfly all-reduce, shared by its files:
 *   allreduce.c         the round's state machine, the service, wire helpers
 *   allreduce_reduce.c  the reducer side: accumulate, finalise, send results
 *   allreduce_pacing.c  the sender side: paced sending, results back in
 * The module's interface is averaging/allreduce.h. */
#ifndef AP_AVERAGING_ALLREDUCE_IMPL_H
#define AP_AVERAGING_ALLREDUCE_IMPL_H

#include "averaging/allreduce.h"
#include "averaging/avg_codec.h"
#include "averaging/balance.h"
#include "base/arena.h"
#include "base/buf.h"
#include "compress/kernels.h"

#define MOD      "avg"
#define PARK_MAX 256
#define PARK_US  10000000ull
#ifndef AVG_WINDOW
#define AVG_WINDOW (4u << 20)
#endif
/* automatic pacing: the lead before the first result of a part, its floor,
 * its ceiling (chunks), the start-up growth factor */
#define LEAD_INIT 3u
#define LEAD_MIN  3u
#define LEAD_CAP  1024u
#define LEAD_GROW 2.0
/* after start-up, a round trip's result rate below this share of the best
 * start-up rate means the lead starved the part */
#define LEAD_STARVED 0.75

/* ---- state ------------------------------------------------------------------ */

typedef struct link {
    struct link *next; /* all links of a round, freed with it */
    ap_allreduce_t *ar;
    ap_stream_t *s; /* NULL once on_close ran */
    int peer;       /* group index of the remote */
    bool outgoing;  /* we send data to the remote reducer */
    bool resetting; /* ap_stream_reset was called; on_close pending */
} link_t;

enum { SLOT_WAITING = 0, SLOT_ACTIVE, SLOT_DONE, SLOT_DROPPED };

/* This node as reducer: one slot per sender of its part. */
typedef struct in_slot {
    int state;
    link_t *link;
    double weight;
    uint32_t next_in;  /* next data chunk expected */
    uint32_t next_out; /* next result chunk to send back */
    bool closed_out;   /* we half-closed after the last result */
    uint64_t first_us, last_us, bytes;
    /* stall clock: the last chunk, or the last tick at which this sender was
     * ahead of the reduction (then it may be paced, waiting for results
     * that wait for someone else) */
    uint64_t stall_from_us;
} in_slot_t;

/* This node as sender: one slot per reducer of a part (not itself). */
typedef struct out_slot {
    int state;
    link_t *link;
    uint32_t next_send, next_recv;
    bool sent_all;
    /* automatic pacing (max_lead_chunks = 0; docs/averaging.md, "Pacing"):
     * for the chunks in flight, ring[c % ring_len] holds when chunk c was
     * sent and how many results had arrived by then; from these, the
     * smallest round trip (send → result) and the smoothed result rate of
     * this round give the lead (lead_sample) */
    struct lead_sample {
        uint64_t sent_us;
        uint32_t recv_at;
    } * ring;
    uint32_t ring_len, lead;
    uint64_t min_rtt_us;
    double rate;                   /* result chunks per µs: moving average (1/8) of the samples */
    double full_rate;              /* start-up: the rate at the last ≥ 25 % growth */
    uint32_t trip_end, flat_trips; /* start-up: round trip boundary, trips without growth */
    uint32_t full_lead;            /* start-up: the lead at the last ≥ 25 % growth */
    uint32_t floor_lead;           /* after start-up: the lead never goes below it */
    uint32_t trip_recv;            /* start-up: results when the round trip began */
    uint64_t trip_us;              /* start-up: when it began */
    uint64_t trip_min_us;          /* start-up: its smallest round trip so far */
    bool full;                     /* start-up is over */
} out_slot_t;

struct ap_allreduce {
    ap_allreduce_t *next; /* in the service's list */
    ap_avg_service_t *svc;
    ap_rt_t *rt;
    uint8_t gid[AP_AVG_GROUP_ID_LEN];
    ap_avg_member_t *m;
    int n, self;
    bool sends; /* self ∈ S (= R) */
    float *data;
    uint64_t total;
    double weight;
    ap_allreduce_opts_t o;
    const ap__avg_codec_t *codec;
    const ap__kernels_t *k; /* vectorised weighted sums */
    uint64_t *off, *cnt;
    double t_lp_s;
    /* reducer */
    uint32_t my_chunks, reduced;
    double *acc, *wsum; /* acc: acc_bytes from the service's cache */
    /* touched[c]: chunk c has a sum in its accumulator slot slot[c]. A slot
     * is chunk_elems doubles of acc, taken by the first chunk c that arrives
     * (own term + its term in one pass: a round starts sending at once
     * instead of first writing the whole accumulator) and given back when c
     * is final. Free slots are reused last-in first-out, so the few chunks
     * in flight keep summing into memory that is still in the cache instead
     * of a fresh stretch of a big array (room for my_chunks slots stays
     * reserved: a sender may run any distance ahead of the others). */
    uint8_t *touched;
    uint32_t *slot, *free_slots;
    uint32_t nfree, fresh_slot;
    /* senders of weight 0 (a trainer without samples): their terms add
     * nothing to acc; acc0 (chunk_elems doubles per slot, like acc; zero
     * while a slot is free) sums them unweighted and n0[c] counts them, for
     * the plain mean of a chunk whose weights are all 0. NULL until such a
     * sender joins. */
    double *acc0;
    uint32_t *n0;
    /* lossy codecs: each result chunk's frame, encoded once when the chunk is
     * final; the reducer keeps its decoding and every receiver gets these very
     * bytes (re-encoding decoded values is not the identity for every codec,
     * e.g. uniform8 re-derives its bins) */
    uint8_t *res_enc; /* my_chunks frames of res_fsz bytes; res_enc_bytes from the cache */
    size_t res_fsz, res_enc_bytes;
    size_t acc_bytes;
    float *result;  /* where means go: data + off[self], or aux_buf */
    float *aux_buf; /* aux_bytes from the service's cache */
    size_t aux_bytes;
    in_slot_t *in;
    /* opts.reduce: every sender's copy of this node's part, sender j's at
     * copies + j·cnt[self] (its own at self's index) */
    float *copies;
    /* sender */
    out_slot_t *out;
    struct lead_sample *lead_rings; /* the out slots' rings, one block */
    /* scratch */
    float *scratch;
    uint8_t *frame;
    link_t *links;
    int live_links;
    uint64_t start_us, deadline_us, tick_timer, finish_timer, watch_id;
    uint64_t resolved_us; /* when all_resolved first held with streams open */
    bool finishing, stopped;
    ap_allreduce_result_t res;
    ap_allreduce_done_fn done;
    void *done_arg;
};

typedef struct parked {
    struct parked *next;
    ap_avg_service_t *svc;
    ap_stream_t *s;
    ap__avg_hello_t hello;
    uint64_t since_us;
} parked_t;

/* Large per-round buffers (the reducer's accumulator, an aux's result) are
 * pre-faulted once and reused by the next round (DESIGN.md §7: fresh pages
 * cost ~30x a memcpy). One cached buffer per kind; a bigger need replaces it. */
typedef struct big_cache {
    void *p;
    size_t bytes;
} big_cache_t;

struct ap_avg_service {
    ap_rt_t *rt;
    big_cache_t cache[3]; /* accumulator, aux result, encoded results */
    ap_allreduce_t *rounds;
    parked_t *parked;
    int nparked;
    bool closing;
    uint64_t park_timer;
};

static inline const char *ap__ar_short_of(const ap_allreduce_t *ar, int i,
                                          char buf[AP_PEER_SHORT_LEN])
{
    return ap_peer_id_short(&ar->m[i].id, buf);
}

static inline uint32_t ap__ar_nchunks(const ap_allreduce_t *ar, uint64_t count)
{
    return (uint32_t)((count + ar->o.chunk_elems - 1) / ar->o.chunk_elems);
}

static inline uint32_t ap__ar_chunk_len(const ap_allreduce_t *ar, uint64_t count, uint32_t c)
{
    uint64_t start = (uint64_t)c * ar->o.chunk_elems;
    uint64_t left = count - start;
    return left < ar->o.chunk_elems ? (uint32_t)left : ar->o.chunk_elems;
}

/* allreduce.c */
void ap__ar_check_done(ap_allreduce_t *ar); /* finishes the round once all is resolved */

/* allreduce_reduce.c */
/* Drops sender j from this node's part (its delivered chunks keep its term). */
void ap__ar_drop_sender(ap_allreduce_t *ar, int j, int err, const char *why);
void ap__ar_finalise_chunks(ap_allreduce_t *ar);
void ap__ar_pump_results(ap_allreduce_t *ar);
/* The chunk index a sender at or below which gates the results: the chunks
 * reduced, or with opts.reduce (all results at the end) the fewest chunks a
 * live sender delivered. A sender past it waits for others, not stalled. */
uint32_t ap__ar_gate(const ap_allreduce_t *ar);
/* The largest data frame, and the data streams' window for it. */
size_t ap__ar_frame_max(const ap_allreduce_t *ar);
size_t ap__ar_data_window(size_t fmax);
int ap__ar_send_chunk(ap_allreduce_t *ar, ap_stream_t *s, uint8_t type, uint32_t c, uint32_t len,
                      const float *x);
/* An incoming stream whose hello matches the round becomes a sender's link. */
int ap__ar_adopt(ap_allreduce_t *ar, ap_stream_t *s, const ap__avg_hello_t *h);

/* allreduce_pacing.c */
extern const ap_stream_cbs_t ap__ar_out_cbs; /* a part's stream to its reducer */
void ap__ar_on_link_close(ap_stream_t *s, void *arg, int status);
/* Gives up part k (left local): its reducer failed. */
void ap__ar_fail_part(ap_allreduce_t *ar, int k, int err, const char *why);
void ap__ar_pump_send_all(ap_allreduce_t *ar);
int ap__ar_setup_pacing(ap_allreduce_t *ar);

#endif
