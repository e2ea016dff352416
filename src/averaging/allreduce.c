/* Fault-tolerant butterfly all-reduce over runtime.h streams.
 *
 * Each sender opens one stream per reducing peer (never to itself), sends a
 * Hello, then the data chunks of that reducer's part, then half-closes. The
 * reducer accumulates Σ w_j x_j per chunk as chunks arrive; once every sender
 * still in the round has delivered chunk c (or was dropped), chunk c's mean is
 * final and streams back to every live sender on the same stream. So both
 * directions run at once and the reduction overlaps communication.
 *
 * Faults (docs/averaging.md, "Fault rules"): a sender whose stream fails, that
 * stalls, or sends bad data is dropped; the chunks it had delivered keep its
 * contribution, later chunks are averaged over the others (weights
 * renormalised). A reducer that fails leaves the rest of its part local at
 * each sender; the result reports exactly how many elements were averaged. A
 * round deadline bounds everything; no stream outlives its round. */
#include "averaging/allreduce.h"

#include "apiary/log.h"
#include "averaging/avg_codec.h"
#include "averaging/balance.h"
#include "base/arena.h"
#include "base/buf.h"
#include "compress/kernels.h"

#include "averaging.pb-c.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- wire helpers ----------------------------------------------------------- */

size_t ap__avg_hello_encode(const ap__avg_hello_t *h, uint8_t *out)
{
    Apiary__Avg__Hello m = APIARY__AVG__HELLO__INIT;
    m.group_id.data = (uint8_t *)h->group_id;
    m.group_id.len = AP_AVG_GROUP_ID_LEN;
    m.sender = h->sender;
    m.reducer = h->reducer;
    m.offset = h->offset;
    m.count = h->count;
    m.total = h->total;
    m.chunk_elems = h->chunk_elems;
    m.codec = h->codec;
    m.weight = h->weight;
    if (apiary__avg__hello__get_packed_size(&m) > AP__AVG_HELLO_MAX) return 0;
    return apiary__avg__hello__pack(&m, out);
}

int ap__avg_hello_decode(const uint8_t *b, size_t len, ap__avg_hello_t *out)
{
    if (len > AP__AVG_HELLO_MAX) return AP_EMSGSIZE;
    Apiary__Avg__Hello *m = apiary__avg__hello__unpack(NULL, len, b);
    if (!m) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    if (m->group_id.len != AP_AVG_GROUP_ID_LEN) goto out;
    if (m->total > AP_AVG_MAX_ELEMS || m->offset > m->total || m->count > m->total - m->offset)
        goto out;
    if (m->chunk_elems == 0 || m->chunk_elems > AP__AVG_CHUNK_MAX) goto out;
    if (!isfinite(m->weight) || !(m->weight > 0)) goto out;
    memcpy(out->group_id, m->group_id.data, AP_AVG_GROUP_ID_LEN);
    out->sender = m->sender;
    out->reducer = m->reducer;
    out->offset = m->offset;
    out->count = m->count;
    out->total = m->total;
    out->chunk_elems = m->chunk_elems;
    out->codec = m->codec;
    out->weight = m->weight;
    rc = 0;
out:
    apiary__avg__hello__free_unpacked(m, NULL);
    return rc;
}

void ap__avg_frame_header(uint8_t *out, uint8_t type, uint8_t codec, uint32_t index, uint32_t elems)
{
    out[0] = type;
    out[1] = codec;
    out[2] = out[3] = 0;
    ap__put_be32(out + 4, index);
    ap__put_be32(out + 8, elems);
}

int ap__avg_frame_parse(const uint8_t *b, size_t len, ap__avg_frame_t *out)
{
    if (len < AP__AVG_FRAME_HDR) return AP_ECORRUPT;
    if (b[0] != AP__AVG_FRAME_DATA && b[0] != AP__AVG_FRAME_RESULT) return AP_ECORRUPT;
    if (b[2] || b[3]) return AP_ECORRUPT;
    out->type = b[0];
    out->codec = b[1];
    out->index = ap__get_be32(b + 4);
    out->elems = ap__get_be32(b + 8);
    out->payload = b + AP__AVG_FRAME_HDR;
    out->payload_len = len - AP__AVG_FRAME_HDR;
    return 0;
}

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

static const char *short_of(const ap_allreduce_t *ar, int i, char buf[AP_PEER_SHORT_LEN])
{
    return ap_peer_id_short(&ar->m[i].id, buf);
}

static uint32_t nchunks(const ap_allreduce_t *ar, uint64_t count)
{
    return (uint32_t)((count + ar->o.chunk_elems - 1) / ar->o.chunk_elems);
}

static uint32_t chunk_len(const ap_allreduce_t *ar, uint64_t count, uint32_t c)
{
    uint64_t start = (uint64_t)c * ar->o.chunk_elems;
    uint64_t left = count - start;
    return left < ar->o.chunk_elems ? (uint32_t)left : ar->o.chunk_elems;
}

static void check_done(ap_allreduce_t *ar);
static void open_deferred(ap_allreduce_t *ar, int k);
static void pump_results(ap_allreduce_t *ar);
static void pump_send_all(ap_allreduce_t *ar);

/* ---- reducer side ------------------------------------------------------------ */

static void drop_sender(ap_allreduce_t *ar, int j, int err, const char *why)
{
    in_slot_t *sl = &ar->in[j];
    if (sl->state == SLOT_DROPPED || sl->state == SLOT_DONE) return;
    char sb[AP_PEER_SHORT_LEN];
    ap_warn(MOD, "round: dropping sender %s (index %d): %s", short_of(ar, j, sb), j, why);
    bool had_data = sl->next_in == ar->my_chunks;
    sl->state = had_data ? SLOT_DONE : SLOT_DROPPED;
    if (!had_data) ar->res.senders_dropped++;
    link_t *l = sl->link;
    sl->link = NULL;
    if (l && l->s) ap_stream_reset(l->s, err);
}

static bool chunk_ready(const ap_allreduce_t *ar, uint32_t c)
{
    for (int j = 0; j < ar->n; j++) {
        if (j == ar->self || ar->m[j].role == AP_AVG_AUX) continue;
        const in_slot_t *sl = &ar->in[j];
        if (sl->state == SLOT_DROPPED) continue;
        if (sl->next_in <= c) return false;
    }
    return true;
}

static double *acc_of(const ap_allreduce_t *ar, uint32_t c)
{
    return ar->acc + (size_t)ar->slot[c] * ar->o.chunk_elems;
}

static void finalise_chunks(ap_allreduce_t *ar)
{
    while (ar->reduced < ar->my_chunks && chunk_ready(ar, ar->reduced)) {
        uint32_t c = ar->reduced;
        uint64_t s = (uint64_t)c * ar->o.chunk_elems;
        uint32_t len = chunk_len(ar, ar->cnt[ar->self], c);
        double w = ar->wsum[c];
        if (w > 0) {
            if (ar->touched[c])
                ar->k->wsum_mean(ar->result + s, acc_of(ar, c), len, w);
            else /* nobody else delivered: the same arithmetic on the own term alone */
                for (uint32_t e = 0; e < len; e++)
                    ar->result[s + e] = (float)(ar->weight * ar->result[s + e] / w);
            /* a lossy codec: encode the result once, keep its decoding and send
             * those bytes, so that every member holds the same values */
            if (ar->res_enc) {
                uint8_t *fr = ar->res_enc + (size_t)c * ar->res_fsz;
                ap__avg_frame_header(fr, AP__AVG_FRAME_RESULT, ar->codec->id, c, len);
                if (ar->codec->encode(ar->result + s, len, fr + AP__AVG_FRAME_HDR) ||
                    ar->codec->decode(fr + AP__AVG_FRAME_HDR, ar->codec->size(len), len,
                                      ar->result + s)) {
                    ap_warn(MOD, "round: codec %s failed on a result chunk", ar->codec->name);
                    fr[0] = 0; /* not a frame: sent by encoding afresh */
                }
            }
            if (ar->sends) ar->res.elems_averaged += len;
        } else if (!ar->sends) {
            /* aux with every sender dropped: nothing to average, nobody to tell */
            memset(ar->result + s, 0, (size_t)len * sizeof(float));
            if (ar->res_enc) ar->res_enc[(size_t)c * ar->res_fsz] = 0;
        }
        if (ar->touched[c]) ar->free_slots[ar->nfree++] = ar->slot[c];
        ar->reduced++;
    }
}

static void on_in_msg(ap_stream_t *s, void *arg, const uint8_t *data, size_t len)
{
    link_t *l = arg;
    ap_allreduce_t *ar = l->ar;
    in_slot_t *sl = &ar->in[l->peer];
    if (sl->link != l || sl->state != SLOT_ACTIVE) return;
    ap__avg_frame_t f;
    uint64_t now = ap_rt_now_us(ar->rt);
    if (ap__avg_frame_parse(data, len, &f) || f.type != AP__AVG_FRAME_DATA) {
        drop_sender(ar, l->peer, AP_EPROTO, "malformed chunk frame");
        goto after;
    }
    if (f.codec != ar->codec->id) {
        drop_sender(ar, l->peer, AP_EPROTO, "chunk codec differs from the round's");
        goto after;
    }
    if (f.index != sl->next_in || sl->next_in >= ar->my_chunks) {
        drop_sender(ar, l->peer, AP_EPROTO, "chunk out of order or past the part's end");
        goto after;
    }
    uint32_t want = chunk_len(ar, ar->cnt[ar->self], f.index);
    if (f.elems != want) {
        drop_sender(ar, l->peer, AP_EPROTO, "chunk of the wrong size");
        goto after;
    }
    /* raw float32: checked in place and summed straight from the message */
    int rc = ar->codec->check_raw
                 ? ar->codec->check_raw(f.payload, f.payload_len, f.elems)
                 : ar->codec->decode(f.payload, f.payload_len, f.elems, ar->scratch);
    if (rc) {
        drop_sender(ar, l->peer, AP_EPROTO,
                    rc == AP_ENONFINITE ? "NaN or Inf in chunk" : "chunk payload size mismatch");
        goto after;
    }
    double w = sl->weight;
    const float *own = ar->sends ? ar->result + (uint64_t)f.index * ar->o.chunk_elems : NULL;
    double ow = ar->weight;
    bool first = !ar->touched[f.index];
    if (first) /* at most my_chunks slots are ever in use */
        ar->slot[f.index] = ar->nfree ? ar->free_slots[--ar->nfree] : ar->fresh_slot++;
    ar->touched[f.index] = 1;
    double *acc = acc_of(ar, f.index);
    /* acc = ow·own + Σ w_j x_j, summed in arrival order (the same operations
     * as initialising acc with the own term, then adding); one vectorised
     * pass straight from the message for raw float32 */
    const void *x = ar->codec->check_raw ? (const void *)f.payload : (const void *)ar->scratch;
    if (!first)
        ar->k->wsum_add(acc, x, f.elems, w);
    else
        ar->k->wsum_init(acc, own, ow, x, f.elems, w);
    ar->wsum[f.index] += w;
    sl->next_in++;
    if (!sl->first_us) sl->first_us = now;
    sl->last_us = now;
    sl->stall_from_us = now;
    sl->bytes += len;
    ar->res.bytes_received += len;
after:
    finalise_chunks(ar);
    pump_results(ar);
    check_done(ar);
    (void)s;
}

/* Sends chunk c (len elements at x) as a frame of the given type. Raw
 * float32 (the payload is the tensor's bytes) goes header + tensor straight
 * into the stream's send buffer: one copy; other codecs encode into the
 * frame buffer first. 0, AP_EAGAIN or an error, as ap_stream_send. */
/* The default chunk size for group g (averager.h, chunk_elems): what the
 * slowest declared link moves in 5 ms, rounded down to a power of two, within
 * [4096, 16384] elements. Declared bandwidths are validated finite and > 0. */
uint32_t ap__avg_auto_chunk(const ap_avg_group_t *g)
{
    double slow = INFINITY;
    for (size_t i = 0; i < g->n; i++) {
        double b = fmin(g->members[i].up, g->members[i].down);
        if (b > 0 && b < slow) slow = b;
    }
    double elems = slow * 0.005 / sizeof(float);
    uint32_t c = 4096;
    while (c < 16384 && (double)(c * 2) <= elems) c *= 2;
    return c;
}

/* The largest chunk frame of this round, and the send window of a data
 * stream: AVG_WINDOW, or four frames if that is more. The pacing rings are
 * as long as that window holds frames. */
static size_t frame_max(const ap_allreduce_t *ar)
{
    return AP__AVG_FRAME_HDR + ar->codec->size(ar->o.chunk_elems);
}

static size_t data_window(size_t fmax)
{
    return fmax * 4 > AVG_WINDOW ? fmax * 4 : AVG_WINDOW;
}

static int send_chunk(ap_allreduce_t *ar, ap_stream_t *s, uint8_t type, uint32_t c, uint32_t len,
                      const float *x)
{
    size_t pl = ar->codec->size(len);
    if (ar->codec->check_raw) {
        uint8_t hdr[AP__AVG_FRAME_HDR];
        ap__avg_frame_header(hdr, type, ar->codec->id, c, len);
        const ap_iovec_t iov[2] = {{hdr, sizeof hdr}, {x, pl}};
        return ap_stream_sendv(s, iov, 2);
    }
    ap__avg_frame_header(ar->frame, type, ar->codec->id, c, len);
    int rc = ar->codec->encode(x, len, ar->frame + AP__AVG_FRAME_HDR);
    return rc ? rc : ap_stream_send(s, ar->frame, AP__AVG_FRAME_HDR + pl);
}

static void send_results_to(ap_allreduce_t *ar, int j)
{
    in_slot_t *sl = &ar->in[j];
    if (!sl->link || !sl->link->s || sl->closed_out) return;
    if (sl->state != SLOT_ACTIVE && sl->state != SLOT_DONE) return;
    ap_stream_t *s = sl->link->s;
    while (sl->next_out < ar->reduced) {
        uint32_t c = sl->next_out;
        uint32_t len = chunk_len(ar, ar->cnt[ar->self], c);
        size_t fl = AP__AVG_FRAME_HDR + ar->codec->size(len);
        const uint8_t *fr = ar->res_enc ? ar->res_enc + (size_t)c * ar->res_fsz : NULL;
        int rc;
        if (fr && fr[0] == AP__AVG_FRAME_RESULT)
            rc = ap_stream_send(s, fr, fl);
        else
            rc = send_chunk(ar, s, AP__AVG_FRAME_RESULT, c, len,
                            ar->result + (uint64_t)c * ar->o.chunk_elems);
        if (rc == AP_EAGAIN) return;
        if (rc) {
            drop_sender(ar, j, AP_ERESET, "cannot send results");
            return;
        }
        ar->res.bytes_sent += fl;
        sl->next_out++;
        /* a paced sender waits for these results: its stall clock starts
         * when they leave, not at its last chunk */
        sl->stall_from_us = ap_rt_now_us(ar->rt);
    }
    if (sl->next_out == ar->my_chunks) {
        sl->closed_out = true;
        ap_stream_close(s);
    }
}

static void pump_results(ap_allreduce_t *ar)
{
    if (!ar->in) return;
    for (int r = 1; r <= ar->n; r++) send_results_to(ar, (ar->self + r) % ar->n);
}

static void on_in_writable(ap_stream_t *s, void *arg)
{
    link_t *l = arg;
    (void)s;
    if (l->ar->in[l->peer].link == l) send_results_to(l->ar, l->peer);
    check_done(l->ar);
}

static void on_in_end(ap_stream_t *s, void *arg)
{
    link_t *l = arg;
    ap_allreduce_t *ar = l->ar;
    in_slot_t *sl = &ar->in[l->peer];
    (void)s;
    if (sl->link == l && sl->state == SLOT_ACTIVE && sl->next_in < ar->my_chunks)
        drop_sender(ar, l->peer, AP_EPROTO, "stream ended before the whole part");
    finalise_chunks(ar);
    pump_results(ar);
    check_done(ar);
}

static void on_link_close(ap_stream_t *s, void *arg, int status);

static const ap_stream_cbs_t in_cbs = {on_in_msg, on_in_writable, on_in_end, on_link_close};

/* Validates a sender's hello against this round; 0 or a reason. */
static const char *hello_mismatch(const ap_allreduce_t *ar, const ap__avg_hello_t *h,
                                  const ap_peer_id_t *peer)
{
    if (h->sender >= (uint32_t)ar->n) return "sender index out of range";
    if (!ap_peer_id_eq(&ar->m[h->sender].id, peer)) return "sender index is not this peer";
    if (ar->m[h->sender].role == AP_AVG_AUX) return "an auxiliary peer cannot send";
    if ((int)h->sender == ar->self) return "stream from self";
    if (h->reducer != (uint32_t)ar->self) return "part is not this reducer's";
    if (h->total != ar->total) return "vector length differs";
    if (h->offset != ar->off[ar->self] || h->count != ar->cnt[ar->self])
        return "part offset or size differs";
    if (h->count == 0) return "empty part";
    if (h->chunk_elems != ar->o.chunk_elems) return "chunk size differs";
    if (h->codec != ar->codec->id) return "codec differs";
    if (ar->in[h->sender].state != SLOT_WAITING) return "sender joined twice or was dropped";
    if (ar->stopped) return "round is over";
    return NULL;
}

/* Takes an incoming stream into the round; on refusal returns an error after
 * logging the reason (the caller refuses or resets the stream). */
static int adopt(ap_allreduce_t *ar, ap_stream_t *s, const ap__avg_hello_t *h)
{
    const ap_peer_id_t *peer = ap_stream_peer(s);
    const char *why = hello_mismatch(ar, h, peer);
    if (why) {
        char sb[AP_PEER_SHORT_LEN];
        ap_warn(MOD, "refusing stream from %s: %s", ap_peer_id_short(peer, sb), why);
        return AP_EPROTO;
    }
    link_t *l = calloc(1, sizeof *l);
    if (!l) return AP_ENOMEM;
    l->ar = ar;
    l->s = s;
    l->peer = (int)h->sender;
    l->next = ar->links;
    ar->links = l;
    ar->live_links++;
    in_slot_t *sl = &ar->in[h->sender];
    sl->state = SLOT_ACTIVE;
    sl->link = l;
    sl->weight = h->weight;
    sl->last_us = ap_rt_now_us(ar->rt);
    sl->stall_from_us = sl->last_us;
    ap_stream_set_cbs(s, &in_cbs, l);
    return 0;
}

/* ---- sender side -------------------------------------------------------------- */

static void fail_part(ap_allreduce_t *ar, int k, int err, const char *why)
{
    out_slot_t *os = &ar->out[k];
    if (os->state == SLOT_DONE || os->state == SLOT_DROPPED) return;
    char sb[AP_PEER_SHORT_LEN];
    ap_warn(MOD, "round: part of reducer %s (index %d) stays local from chunk %u: %s",
            short_of(ar, k, sb), k, os->next_recv, why);
    os->state = SLOT_DROPPED;
    ar->res.parts_failed++;
    link_t *l = os->link;
    os->link = NULL;
    if (l && l->s) ap_stream_reset(l->s, err);
}

/* Automatic pacing: the result of chunk c of a part arrived (before
 * next_recv counts it). Its round trip (send → result, which includes the
 * reducer's wait for its slowest sender) and the results that arrived during
 * it give a rate sample. Like TCP BBR's start-up: while the part's result
 * rate still grows by ≥ 25 % per round trip, the lead doubles per round trip
 * (LEAD_GROW × bandwidth-delay product); after two round trips without such
 * growth, or once a queue forms (a whole round trip's fastest sample 25 %
 * over the smallest, like HyStart), the path is full and the lead is its
 * bandwidth-delay product —
 * smoothed rate × smallest round trip, rounded — but no more than the lead
 * at the last growth (a larger one did not raise the rate), so little data
 * waits in front of results (docs/averaging.md, "Pacing"). */
static void lead_sample(ap_allreduce_t *ar, out_slot_t *os, uint32_t c)
{
    if (!os->ring || c >= os->next_send || os->next_send - c > os->ring_len) return;
    const struct lead_sample *ls = &os->ring[c % os->ring_len];
    uint64_t now = ap_rt_now_us(ar->rt);
    uint64_t rtt = now > ls->sent_us ? now - ls->sent_us : 1;
    double rate = (double)(c + 1 - ls->recv_at) / (double)rtt;
    if (!os->min_rtt_us || rtt < os->min_rtt_us) os->min_rtt_us = rtt;
    if (!os->trip_min_us || rtt < os->trip_min_us) os->trip_min_us = rtt;
    os->rate = os->rate > 0 ? os->rate + (rate - os->rate) / 8 : rate;
    if (!os->full && c >= os->trip_end) { /* one round trip since the last check */
        /* the results' rate over that round trip */
        double trip_rate =
            now > os->trip_us ? (double)(c + 1 - os->trip_recv) / (double)(now - os->trip_us) : 0;
        /* a queue formed: even this trip's fastest round trip is 25 % over
         * the smallest */
        bool queue = (double)os->trip_min_us > 1.25 * (double)os->min_rtt_us;
        os->trip_end = os->next_send;
        os->trip_us = now;
        os->trip_recv = c + 1;
        os->trip_min_us = 0;
        if (queue && os->full_lead) {
            os->full = true;
        } else if (trip_rate >= 1.25 * os->full_rate) {
            os->full_rate = trip_rate;
            os->full_lead = os->lead;
            os->flat_trips = 0;
        } else if (++os->flat_trips >= 2) {
            os->full = true;
        }
    }
    double bdp = os->rate * (double)os->min_rtt_us;
    double lead = ceil(LEAD_GROW * bdp) + 1;
    if (os->full) { /* no more than the lead that last raised the rate */
        lead = round(bdp);
        if (lead > os->full_lead) lead = os->full_lead;
    }
    if (!os->full && lead < os->lead) lead = os->lead; /* start-up: never shrink */
    if (lead < LEAD_MIN) lead = LEAD_MIN;
    os->lead = lead > (double)os->ring_len ? os->ring_len : (uint32_t)lead;
}

static void on_out_msg(ap_stream_t *s, void *arg, const uint8_t *data, size_t len)
{
    link_t *l = arg;
    ap_allreduce_t *ar = l->ar;
    int k = l->peer;
    out_slot_t *os = &ar->out[k];
    (void)s;
    if (os->link != l || os->state != SLOT_ACTIVE) return;
    ap__avg_frame_t f;
    uint32_t nc = nchunks(ar, ar->cnt[k]);
    int rc;
    if (ap__avg_frame_parse(data, len, &f) || f.type != AP__AVG_FRAME_RESULT ||
        f.codec != ar->codec->id) {
        fail_part(ar, k, AP_EPROTO, "malformed result frame");
    } else if (f.index != os->next_recv || f.index >= nc || f.index >= os->next_send) {
        fail_part(ar, k, AP_EPROTO, "result chunk out of order");
    } else if (f.elems != chunk_len(ar, ar->cnt[k], f.index)) {
        fail_part(ar, k, AP_EPROTO, "result chunk of the wrong size");
    } else if ((rc = ar->codec->check_raw
                         ? ar->codec->check_raw(f.payload, f.payload_len, f.elems)
                         : ar->codec->decode(f.payload, f.payload_len, f.elems, ar->scratch))) {
        fail_part(ar, k, AP_EPROTO,
                  rc == AP_ENONFINITE ? "NaN or Inf in result" : "result payload size mismatch");
    } else {
        /* checked before it touches the data; raw float32 is copied once */
        float *dst = ar->data + ar->off[k] + (uint64_t)f.index * ar->o.chunk_elems;
        memcpy(dst, ar->codec->check_raw ? (const void *)f.payload : (const void *)ar->scratch,
               (size_t)f.elems * sizeof(float));
        ar->res.elems_averaged += f.elems;
        ar->res.bytes_received += len;
        lead_sample(ar, os, f.index);
        if (++os->next_recv == nc) os->state = SLOT_DONE;
        pump_send_all(ar);
    }
    check_done(ar);
}

/* How many data chunks of part k may be in flight (sent, result not yet
 * back): docs/averaging.md, "Pacing". */
static uint32_t lead_limit(const ap_allreduce_t *ar, int k)
{
    if (ar->o.max_lead_chunks) return ar->o.max_lead_chunks; /* fixed, or AP_AVG_LEAD_OFF */
    return ar->out[k].lead;
}

/* Sends the next data chunk of part k: 1 if sent, 0 if blocked or finished. */
static int send_one(ap_allreduce_t *ar, int k)
{
    out_slot_t *os = &ar->out[k];
    if (os->state != SLOT_ACTIVE || !os->link || !os->link->s || os->sent_all) return 0;
    ap_stream_t *s = os->link->s;
    uint32_t nc = nchunks(ar, ar->cnt[k]);
    /* pacing: at most max_lead_chunks data chunks ahead of the results
     * this reducer has sent back (docs/averaging.md, "Pacing") */
    if (os->next_send < nc && os->next_send - os->next_recv >= lead_limit(ar, k)) return 0;
    if (os->next_send < nc) {
        uint32_t c = os->next_send;
        uint32_t len = chunk_len(ar, ar->cnt[k], c);
        size_t fl = AP__AVG_FRAME_HDR + ar->codec->size(len);
        int rc = send_chunk(ar, s, AP__AVG_FRAME_DATA, c, len,
                            ar->data + ar->off[k] + (uint64_t)c * ar->o.chunk_elems);
        if (rc == AP_EAGAIN) return 0;
        if (rc) {
            fail_part(ar, k, AP_ERESET, "cannot send data");
            return 0;
        }
        ar->res.bytes_sent += fl;
        if (os->ring) {
            struct lead_sample *ls = &os->ring[c % os->ring_len];
            ls->sent_us = ap_rt_now_us(ar->rt);
            ls->recv_at = os->next_recv;
        }
        os->next_send++;
    }
    if (os->next_send == nc) {
        os->sent_all = true;
        ap_stream_close(s);
        return 0;
    }
    return 1;
}

/* Interleaves the parts chunk by chunk, starting after this peer's own index,
 * so every reducer receives data from the start and no reducer's results
 * wait behind all the others' (docs/averaging.md, "Scheduling"). */
static void pump_send_all(ap_allreduce_t *ar)
{
    if (!ar->out) return;
    for (int progress = 1; progress;) {
        progress = 0;
        for (int r = 1; r <= ar->n; r++) {
            int k = (ar->self + r) % ar->n;
            if (k != ar->self && ar->cnt[k]) progress |= send_one(ar, k);
        }
    }
}

static void on_out_writable(ap_stream_t *s, void *arg)
{
    link_t *l = arg;
    (void)s;
    if (l->ar->out[l->peer].link == l) pump_send_all(l->ar);
    check_done(l->ar);
}

static void on_out_end(ap_stream_t *s, void *arg)
{
    link_t *l = arg;
    ap_allreduce_t *ar = l->ar;
    (void)s;
    if (ar->out[l->peer].link == l && ar->out[l->peer].state == SLOT_ACTIVE)
        fail_part(ar, l->peer, AP_EPROTO, "reducer ended before sending the whole part");
    check_done(ar);
}

static const ap_stream_cbs_t out_cbs = {on_out_msg, on_out_writable, on_out_end, on_link_close};

static void on_link_close(ap_stream_t *s, void *arg, int status)
{
    link_t *l = arg;
    ap_allreduce_t *ar = l->ar;
    (void)s;
    l->s = NULL;
    ar->live_links--;
    if (l->outgoing) {
        out_slot_t *os = &ar->out[l->peer];
        if (os->link == l) {
            os->link = NULL;
            if (os->state == SLOT_ACTIVE)
                fail_part(ar, l->peer, status, status ? ap_strerror(status) : "closed early");
        }
        /* unreachable: it cannot deliver its data to us either */
        if (status == AP_EUNREACH && ar->in && ar->in[l->peer].state == SLOT_WAITING)
            drop_sender(ar, l->peer, AP_EUNREACH, "unreachable");
        finalise_chunks(ar);
        pump_results(ar);
    } else {
        in_slot_t *sl = &ar->in[l->peer];
        if (sl->link == l) {
            sl->link = NULL;
            if (sl->state == SLOT_ACTIVE) {
                if (sl->next_in < ar->my_chunks)
                    drop_sender(ar, l->peer, status,
                                status ? ap_strerror(status) : "closed before the whole part");
                else if (sl->next_out < ar->my_chunks)
                    sl->state = SLOT_DONE; /* it has its data in; it just misses results */
            }
        }
        finalise_chunks(ar);
        pump_results(ar);
    }
    check_done(ar);
}

/* ---- round lifecycle ---------------------------------------------------------- */

static bool all_resolved(const ap_allreduce_t *ar)
{
    if (ar->in && ar->reduced < ar->my_chunks) return false;
    for (int j = 0; ar->in && j < ar->n; j++) {
        const in_slot_t *sl = &ar->in[j];
        if (j == ar->self || ar->m[j].role == AP_AVG_AUX) continue;
        if (sl->state == SLOT_DROPPED) continue;
        if (sl->state == SLOT_WAITING) return false;
        if (sl->link && sl->next_out < ar->my_chunks) return false;
    }
    for (int k = 0; ar->sends && k < ar->n; k++) {
        if (k == ar->self || ar->cnt[k] == 0) continue;
        if (ar->out[k].state == SLOT_ACTIVE || ar->out[k].state == SLOT_WAITING) return false;
    }
    return true;
}

static void finish_cb(ap_rt_t *rt, void *arg);

static void check_done(ap_allreduce_t *ar)
{
    if (ar->finishing || ar->live_links > 0 || !all_resolved(ar)) return;
    ar->finishing = true;
    ar->finish_timer = ap_rt_timer_start(ar->rt, 0, 0, finish_cb, ar);
}

/* Resets every stream of the round that is still open (e.g. a peer that got
 * everything but never closed its direction). */
static void reset_open_links(ap_allreduce_t *ar, int err)
{
    for (link_t *l = ar->links; l; l = l->next)
        if (l->s && !l->resetting) {
            l->resetting = true;
            ap_stream_reset(l->s, err);
        }
}

/* Ends the round now: every unresolved sender is dropped, every unresolved
 * part fails; the remaining chunks are finalised with what arrived. */
static void stop_round(ap_allreduce_t *ar, int err, const char *why)
{
    if (ar->stopped) return;
    ar->stopped = true;
    if (!ar->res.status) ar->res.status = err == AP_ETIMEDOUT ? 0 : err;
    for (int j = 0; ar->in && j < ar->n; j++) {
        if (j == ar->self || ar->m[j].role == AP_AVG_AUX) continue;
        in_slot_t *sl = &ar->in[j];
        if (sl->state == SLOT_WAITING || (sl->state == SLOT_ACTIVE && sl->next_in < ar->my_chunks))
            drop_sender(ar, j, err, why);
    }
    finalise_chunks(ar);
    for (int j = 0; ar->in && j < ar->n; j++) { /* results the others can no longer wait for */
        in_slot_t *sl = &ar->in[j];
        if (sl->link && sl->link->s && sl->next_out < ar->my_chunks) {
            link_t *l = sl->link;
            sl->link = NULL;
            sl->state = SLOT_DONE;
            ap_stream_reset(l->s, err);
        }
    }
    for (int k = 0; ar->sends && k < ar->n; k++)
        if (k != ar->self && ar->cnt[k] &&
            (ar->out[k].state == SLOT_ACTIVE || ar->out[k].state == SLOT_WAITING))
            fail_part(ar, k, err, why);
    reset_open_links(ar, err);
    check_done(ar);
}

static void tick_cb(ap_rt_t *rt, void *arg)
{
    ap_allreduce_t *ar = arg;
    uint64_t now = ap_rt_now_us(rt);
    if (ar->stopped) return;
    if (now >= ar->deadline_us) {
        stop_round(ar, AP_ETIMEDOUT, "round deadline");
        return;
    }
    /* deferred parts whose connection did not come up: dial now */
    if (ar->out && now >= ar->start_us + ar->o.connect_grace_us / 2) {
        for (int k = 0; k < ar->n; k++)
            if (k != ar->self) open_deferred(ar, k);
        pump_send_all(ar);
    }
    /* Everything delivered but a peer keeps its direction open: give the
     * graceful close stall_min_us, then reset. */
    if (all_resolved(ar) && ar->live_links > 0) {
        if (!ar->resolved_us)
            ar->resolved_us = now;
        else if (now - ar->resolved_us > ar->o.stall_min_us)
            reset_open_links(ar, AP_ETIMEDOUT);
        return;
    }
    /* Stall rule: no message for max(stall_min, stall_factor × the expected
     * gap between two chunks at the stream's measured rate, or at the
     * declared bandwidth before the first chunk). */
    for (int j = 0; ar->in && j < ar->n; j++) {
        in_slot_t *sl = &ar->in[j];
        if (j == ar->self || ar->m[j].role == AP_AVG_AUX) continue;
        if (sl->state != SLOT_WAITING && sl->state != SLOT_ACTIVE) continue;
        if (sl->state == SLOT_ACTIVE && sl->next_in == ar->my_chunks) continue;
        if (sl->state == SLOT_ACTIVE && sl->next_in > ar->reduced) {
            sl->stall_from_us = now; /* ahead: another sender gates the results */
            continue;
        }
        double chunk_bytes = (double)ar->codec->size(ar->o.chunk_elems) + AP__AVG_FRAME_HDR;
        double rate;
        if (sl->next_in >= 2 && sl->last_us > sl->first_us)
            rate = (double)sl->bytes / ((double)(sl->last_us - sl->first_us) / 1e6);
        else {
            /* its upload is shared by the parts it sends */
            double up = ar->m[j].up / (double)(ar->n > 1 ? ar->n - 1 : 1);
            double down = ar->m[ar->self].down / (double)(ar->n > 1 ? ar->n - 1 : 1);
            rate = up < down ? up : down;
        }
        double gap_us = chunk_bytes / rate * 1e6 * ar->o.stall_factor;
        uint64_t limit = ar->o.stall_min_us;
        if (gap_us > (double)limit) limit = gap_us > 1e15 ? (uint64_t)1e15 : (uint64_t)gap_us;
        if (sl->state == SLOT_WAITING && limit < ar->o.connect_grace_us)
            limit = ar->o.connect_grace_us;
        uint64_t last = sl->state == SLOT_WAITING ? ar->start_us : sl->stall_from_us;
        if (now > last + limit)
            drop_sender(ar, j, AP_ETIMEDOUT,
                        sl->state == SLOT_WAITING ? "never connected" : "stalled");
    }
    finalise_chunks(ar);
    pump_results(ar);
    check_done(ar);
}

/* A member whose connection dropped cannot deliver or reduce any more: act at
 * once instead of waiting for the stall rule. */
static int open_part(ap_allreduce_t *ar, int k);

/* Whether to wait before opening the stream to reducer k. Two peers that
 * both send to each other would both dial at once, and the transport then
 * drops one of the two connections with the streams on it. So the peer with
 * the higher index waits until the lower one's connection is up (it dials us
 * for its own part), or for connect_grace_us / 2 at most. The lower index never
 * waits, so nobody waits in a cycle. */
static bool defer_open(const ap_allreduce_t *ar, int k)
{
    return k < ar->self && ar->m[k].role != AP_AVG_AUX && ar->cnt[ar->self] > 0 &&
           !ap_rt_is_connected(ar->rt, &ar->m[k].id);
}

static void open_deferred(ap_allreduce_t *ar, int k)
{
    if (!ar->out || !ar->cnt[k] || ar->out[k].state != SLOT_WAITING) return;
    if (open_part(ar, k)) fail_part(ar, k, AP_ENOMEM, "cannot open a stream");
}

static void on_peer_event(ap_rt_t *rt, void *arg, const ap_peer_id_t *peer, ap_peer_event_t ev)
{
    ap_allreduce_t *ar = arg;
    if (ar->stopped || ar->finishing) return;
    if (ev == AP_PEER_CONNECTED) { /* a deferred part can go over this connection now */
        for (int j = 0; j < ar->n; j++)
            if (j != ar->self && ap_peer_id_eq(&ar->m[j].id, peer)) open_deferred(ar, j);
        pump_send_all(ar);
        return;
    }
    /* a duplicate connection closing while another one stays up is no loss */
    if (ev != AP_PEER_DISCONNECTED || ap_rt_is_connected(rt, peer)) return;
    for (int j = 0; j < ar->n; j++) {
        if (j == ar->self || !ap_peer_id_eq(&ar->m[j].id, peer)) continue;
        if (ar->out && ar->cnt[j] && ar->out[j].state == SLOT_WAITING)
            fail_part(ar, j, AP_ECLOSED, "disconnected");
        if (ar->in && ar->m[j].role != AP_AVG_AUX &&
            (ar->in[j].state == SLOT_WAITING ||
             (ar->in[j].state == SLOT_ACTIVE && ar->in[j].next_in < ar->my_chunks)))
            drop_sender(ar, j, AP_ECLOSED, "disconnected");
        if (ar->out && ar->cnt[j] && ar->out[j].state == SLOT_ACTIVE)
            fail_part(ar, j, AP_ECLOSED, "disconnected");
    }
    finalise_chunks(ar);
    pump_results(ar);
    check_done(ar);
}

static void unregister_round(ap_allreduce_t *ar)
{
    for (ap_allreduce_t **p = &ar->svc->rounds; *p; p = &(*p)->next)
        if (*p == ar) {
            *p = ar->next;
            return;
        }
}

static void *cache_take(ap_avg_service_t *svc, int k, size_t need, size_t *got)
{
    big_cache_t *c = &svc->cache[k];
    if (c->p && c->bytes >= need) {
        void *p = c->p;
        *got = c->bytes;
        c->p = NULL;
        c->bytes = 0;
        return p;
    }
    size_t bytes = (need + 4095) & ~(size_t)4095;
    void *p = ap__big_alloc(bytes);
    *got = p ? bytes : 0;
    return p;
}

static void cache_put(ap_avg_service_t *svc, int k, void *p, size_t bytes)
{
    if (!p) return;
    big_cache_t *c = &svc->cache[k];
    if (svc->closing || (c->p && c->bytes >= bytes)) {
        ap__big_free(p, bytes);
        return;
    }
    if (c->p) ap__big_free(c->p, c->bytes);
    c->p = p;
    c->bytes = bytes;
}

static void round_free(ap_allreduce_t *ar)
{
    while (ar->links) {
        link_t *l = ar->links;
        ar->links = l->next;
        free(l);
    }
    free(ar->m);
    free(ar->off);
    free(ar->cnt);
    cache_put(ar->svc, 0, ar->acc, ar->acc_bytes);
    free(ar->wsum);
    free(ar->touched);
    free(ar->slot);
    free(ar->free_slots);
    cache_put(ar->svc, 1, ar->aux_buf, ar->aux_bytes);
    cache_put(ar->svc, 2, ar->res_enc, ar->res_enc_bytes);
    free(ar->in);
    free(ar->out);
    free(ar->lead_rings);
    free(ar->scratch);
    free(ar->frame);
    free(ar);
}

static void finish_cb(ap_rt_t *rt, void *arg)
{
    ap_allreduce_t *ar = arg;
    if (ar->tick_timer) ap_rt_timer_stop(rt, ar->tick_timer);
    if (ar->watch_id) ap_rt_peer_unwatch(rt, ar->watch_id);
    unregister_round(ar);
    ar->res.elapsed_us = ap_rt_now_us(rt) - ar->start_us;
    ar->res.elems = ar->total;
    if (ar->sends) {
        ar->res.averaged_fraction =
            ar->total ? (double)ar->res.elems_averaged / (double)ar->total : 1.0;
    } else {
        ar->res.averaged_fraction = 1.0;
    }
    for (int j = 0; ar->in && j < ar->n; j++)
        if (j != ar->self && ar->m[j].role != AP_AVG_AUX && ar->in[j].state != SLOT_DROPPED &&
            ar->in[j].next_in == ar->my_chunks)
            ar->res.senders_used++;
    if (ar->in && ar->sends) ar->res.senders_used++; /* itself */
    ar->done(rt, ar->done_arg, &ar->res);
    round_free(ar);
}

static int open_part(ap_allreduce_t *ar, int k)
{
    ap__avg_hello_t h = {0};
    memcpy(h.group_id, ar->gid, sizeof h.group_id);
    h.sender = (uint32_t)ar->self;
    h.reducer = (uint32_t)k;
    h.offset = ar->off[k];
    h.count = ar->cnt[k];
    h.total = ar->total;
    h.chunk_elems = ar->o.chunk_elems;
    h.codec = ar->codec->id;
    h.weight = ar->weight;
    uint8_t hb[AP__AVG_HELLO_MAX];
    size_t hl = ap__avg_hello_encode(&h, hb);
    link_t *l = calloc(1, sizeof *l);
    if (!l) return AP_ENOMEM;
    l->ar = ar;
    l->peer = k;
    l->outgoing = true;
    l->next = ar->links;
    ar->links = l;
    size_t fmax = frame_max(ar);
    ap_stream_opts_t so = {.window = data_window(fmax),
                           .max_msg = fmax,
                           .open_timeout_us = ar->deadline_us - ar->start_us};
    ap_stream_t *s = NULL;
    int rc = ap_rt_stream_open(ar->rt, &ar->m[k].id, AP_AVG_PROTO, hb, hl, &so, &out_cbs, l, &s);
    if (rc) return rc;
    l->s = s;
    ar->live_links++;
    ar->out[k].state = SLOT_ACTIVE;
    ar->out[k].link = l;
    return 0;
}

/* Automatic pacing: one ring per part, as long as the most chunks that may
 * be in flight (the stream window, LEAD_CAP, the part's chunk count). */
static int setup_pacing(ap_allreduce_t *ar)
{
    size_t fmax = frame_max(ar);
    size_t win = data_window(fmax);
    uint32_t cap = (uint32_t)(win / fmax < LEAD_CAP ? win / fmax : LEAD_CAP);
    size_t total = 0;
    for (int k = 0; k < ar->n; k++) {
        if (k == ar->self || !ar->cnt[k]) continue;
        uint32_t nc = nchunks(ar, ar->cnt[k]);
        ar->out[k].ring_len = nc < cap ? nc : cap;
        ar->out[k].lead = LEAD_INIT < ar->out[k].ring_len ? LEAD_INIT : ar->out[k].ring_len;
        ar->out[k].trip_us = ar->start_us; /* the first round trip starts with the round */
        total += ar->out[k].ring_len;
    }
    ar->lead_rings = calloc(total ? total : 1, sizeof *ar->lead_rings);
    if (!ar->lead_rings) return AP_ENOMEM;
    size_t at = 0;
    for (int k = 0; k < ar->n; k++) {
        if (!ar->out[k].ring_len) continue;
        ar->out[k].ring = ar->lead_rings + at;
        at += ar->out[k].ring_len;
    }
    return 0;
}

static int setup(ap_allreduce_t *ar, const ap_avg_group_t *g)
{
    ar->m = malloc((size_t)g->n * sizeof *ar->m);
    ar->off = calloc((size_t)g->n, sizeof *ar->off);
    ar->cnt = calloc((size_t)g->n, sizeof *ar->cnt);
    ap_avg_bw_t *bw = malloc((size_t)g->n * sizeof *bw);
    double *shares = malloc((size_t)g->n * sizeof *shares);
    int rc = AP_ENOMEM;
    if (!ar->m || !ar->off || !ar->cnt || !bw || !shares) goto out;
    memcpy(ar->m, g->members, (size_t)g->n * sizeof *ar->m);
    for (size_t i = 0; i < g->n; i++)
        bw[i] = (ap_avg_bw_t){g->members[i].role, g->members[i].up, g->members[i].down};
    ap_avg_balance_opts_t bo = {.min_share = ar->o.min_share};
    double t;
    rc = ap_avg_balance(bw, g->n, &bo, shares, &t);
    if (rc) goto out;
    rc = ap_avg_round_counts(shares, g->n, ar->total, ar->cnt);
    if (rc) goto out;
    for (size_t i = 1; i < g->n; i++) ar->off[i] = ar->off[i - 1] + ar->cnt[i - 1];
    /* bytes per element on the wire with this codec (headers included) */
    double bpe = (double)ar->codec->size(ar->o.chunk_elems) / (double)ar->o.chunk_elems;
    ar->t_lp_s = t * (double)ar->total * bpe;
    ar->res.predicted_s = ar->t_lp_s;
    ar->res.my_part_elems = ar->cnt[ar->self];
    size_t ce = ar->o.chunk_elems;
    ar->scratch = malloc(ce * sizeof(float));
    ar->frame = malloc(AP__AVG_FRAME_HDR + ar->codec->size((uint32_t)ce));
    if (!ar->scratch || !ar->frame) goto nomem;
    if (ar->cnt[ar->self] > 0) {
        uint64_t c = ar->cnt[ar->self];
        ar->my_chunks = nchunks(ar, c);
        ar->acc =
            cache_take(ar->svc, 0, (size_t)ar->my_chunks * ce * sizeof *ar->acc, &ar->acc_bytes);
        ar->wsum = calloc(ar->my_chunks, sizeof *ar->wsum);
        ar->touched = calloc(ar->my_chunks, 1);
        ar->slot = malloc(ar->my_chunks * sizeof *ar->slot);
        ar->free_slots = malloc(ar->my_chunks * sizeof *ar->free_slots);
        ar->in = calloc((size_t)g->n, sizeof *ar->in);
        if (!ar->acc || !ar->wsum || !ar->touched || !ar->slot || !ar->free_slots || !ar->in)
            goto nomem;
        if (ar->codec->id != AP_AVG_CODEC_F32) {
            ar->res_fsz = AP__AVG_FRAME_HDR + ar->codec->size((uint32_t)ce);
            ar->res_enc =
                cache_take(ar->svc, 2, (size_t)ar->my_chunks * ar->res_fsz, &ar->res_enc_bytes);
            if (!ar->res_enc) goto nomem;
        }
        if (ar->sends) {
            ar->result = ar->data + ar->off[ar->self];
            for (uint32_t k = 0; k < ar->my_chunks; k++) ar->wsum[k] = ar->weight;
        } else {
            ar->aux_buf = cache_take(ar->svc, 1, c * sizeof(float), &ar->aux_bytes);
            if (!ar->aux_buf) goto nomem;
            ar->result = ar->aux_buf;
        }
    }
    if (ar->sends) {
        ar->out = calloc((size_t)g->n, sizeof *ar->out);
        if (!ar->out) goto nomem;
        if (!ar->o.max_lead_chunks && setup_pacing(ar)) goto nomem;
    }
    rc = 0;
    goto out;
nomem:
    rc = AP_ENOMEM;
out:
    free(bw);
    free(shares);
    return rc;
}

static void noop_msg(ap_stream_t *s, void *arg, const uint8_t *d, size_t n)
{
    (void)s, (void)arg, (void)d, (void)n;
}
static void noop_ev(ap_stream_t *s, void *arg)
{
    (void)s, (void)arg;
}
static void noop_close(ap_stream_t *s, void *arg, int st)
{
    (void)s, (void)arg, (void)st;
}
static const ap_stream_cbs_t noop_cbs = {noop_msg, noop_ev, noop_ev, noop_close};

int ap_allreduce_start(ap_avg_service_t *svc, const ap_avg_group_t *g, float *data,
                       uint64_t n_elems, double weight, const ap_allreduce_opts_t *opts,
                       ap_allreduce_done_fn done, void *arg, ap_allreduce_t **out)
{
    if (!svc || !g || !g->members || g->n == 0 || g->n > AP_AVG_MAX_PEERS || !done ||
        n_elems > AP_AVG_MAX_ELEMS)
        return AP_EINVAL;
    ap_rt_t *rt = svc->rt;
    int self = -1;
    for (size_t i = 0; i < g->n; i++) {
        if (ap_peer_id_eq(&g->members[i].id, ap_rt_self(rt))) {
            if (self >= 0) return AP_EINVAL;
            self = (int)i;
        }
        for (size_t j = 0; j < i; j++)
            if (ap_peer_id_eq(&g->members[i].id, &g->members[j].id)) return AP_EINVAL;
    }
    if (self < 0) return AP_EINVAL;
    for (ap_allreduce_t *r = svc->rounds; r; r = r->next)
        if (!memcmp(r->gid, g->id, AP_AVG_GROUP_ID_LEN)) return AP_EEXIST;
    bool sends = g->members[self].role != AP_AVG_AUX;
    if (sends && (!data || !isfinite(weight) || !(weight > 0))) return AP_EINVAL;
    ap_allreduce_opts_t o = opts ? *opts : (ap_allreduce_opts_t){0};
    if (!o.chunk_elems) o.chunk_elems = ap__avg_auto_chunk(g);
    if (o.chunk_elems > AP__AVG_CHUNK_MAX) return AP_EINVAL;
    if (!(o.deadline_factor > 0)) o.deadline_factor = 4;
    if (!o.deadline_slack_us) o.deadline_slack_us = 2000000;
    if (!o.stall_min_us) o.stall_min_us = 1000000;
    if (!o.connect_grace_us) o.connect_grace_us = 2000000;
    if (!(o.stall_factor > 0)) o.stall_factor = 10;
    const ap__avg_codec_t *codec = ap__avg_codec_get(o.codec);
    if (!codec) return AP_ENOTSUP;
    /* vectorised: it reads the whole vector */
    if (sends && !ap__kernels()->all_finite(data, n_elems)) return AP_ENONFINITE;

    ap_allreduce_t *ar = calloc(1, sizeof *ar);
    if (!ar) return AP_ENOMEM;
    ar->svc = svc;
    ar->rt = rt;
    memcpy(ar->gid, g->id, AP_AVG_GROUP_ID_LEN);
    ar->n = (int)g->n;
    ar->self = self;
    ar->sends = sends;
    ar->data = data;
    ar->total = n_elems;
    ar->weight = sends ? weight : 0;
    ar->o = o;
    ar->codec = codec;
    ar->k = ap__kernels();
    ar->done = done;
    ar->done_arg = arg;
    ar->start_us = ap_rt_now_us(rt);
    int rc = setup(ar, g);
    if (rc) {
        round_free(ar);
        return rc;
    }
    double dl = (double)o.connect_grace_us + o.deadline_factor * ar->t_lp_s * 1e6 +
                (double)o.deadline_slack_us;
    ar->deadline_us = ar->start_us + (dl > 1e15 ? (uint64_t)1e15 : (uint64_t)dl);
    if (o.deadline_at_us && o.deadline_at_us < ar->deadline_us) ar->deadline_us = o.deadline_at_us;
    ar->next = svc->rounds;
    svc->rounds = ar;

    /* streams that arrived before this round started */
    for (parked_t **p = &svc->parked; *p;) {
        parked_t *pk = *p;
        if (memcmp(pk->hello.group_id, ar->gid, AP_AVG_GROUP_ID_LEN) || !ar->in) {
            p = &pk->next;
            continue;
        }
        *p = pk->next;
        svc->nparked--;
        ap_stream_t *s = pk->s;
        ap__avg_hello_t h = pk->hello;
        free(pk);
        if (adopt(ar, s, &h) == 0)
            ap_stream_pause(s, false);
        else {
            ap_stream_set_cbs(s, &noop_cbs, NULL);
            ap_stream_reset(s, AP_EPROTO);
        }
    }
    for (int k = 0; sends && k < ar->n; k++) {
        if (k == self || ar->cnt[k] == 0 || defer_open(ar, k)) continue;
        if (open_part(ar, k)) {
            ar->out[k].state = SLOT_DROPPED;
            ar->res.parts_failed++;
        }
    }
    ar->tick_timer = ap_rt_timer_start(rt, o.stall_min_us / 4 ? o.stall_min_us / 4 : 1,
                                       o.stall_min_us / 4 ? o.stall_min_us / 4 : 1, tick_cb, ar);
    ar->watch_id = ap_rt_peer_watch(rt, on_peer_event, ar);
    pump_send_all(ar);
    finalise_chunks(ar);
    pump_results(ar);
    check_done(ar);
    if (out) *out = ar;
    return 0;
}

void ap_allreduce_cancel(ap_allreduce_t *ar)
{
    if (!ar || ar->finishing) return;
    ar->res.status = AP_ECANCELED;
    stop_round(ar, AP_ECANCELED, "canceled");
}

/* ---- service ------------------------------------------------------------------- */

static void on_parked_close(ap_stream_t *s, void *arg, int status)
{
    parked_t *pk = arg;
    (void)s;
    (void)status;
    ap_avg_service_t *svc = pk->svc;
    for (parked_t **p = &svc->parked; *p; p = &(*p)->next)
        if (*p == pk) {
            *p = pk->next;
            svc->nparked--;
            break;
        }
    free(pk);
}

static const ap_stream_cbs_t parked_cbs = {noop_msg, noop_ev, noop_ev, on_parked_close};

static void park_timer_cb(ap_rt_t *rt, void *arg)
{
    ap_avg_service_t *svc = arg;
    uint64_t now = ap_rt_now_us(rt);
    for (parked_t *pk = svc->parked; pk;) {
        parked_t *next = pk->next;
        if (now >= pk->since_us + PARK_US) {
            char sb[AP_PEER_SHORT_LEN];
            ap_warn(MOD, "refusing stream from %s: no round with its group id",
                    ap_peer_id_short(ap_stream_peer(pk->s), sb));
            ap_stream_reset(pk->s, AP_ENOTFOUND); /* on_parked_close frees pk */
        }
        pk = next;
    }
}

static int on_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    ap_avg_service_t *svc = arg;
    ap__avg_hello_t h;
    char sb[AP_PEER_SHORT_LEN];
    int rc = ap__avg_hello_decode(hello, len, &h);
    if (rc) {
        ap_warn(MOD, "refusing stream from %s: bad hello (%s)", ap_peer_id_short(peer, sb),
                ap_err_name(rc));
        return rc;
    }
    for (ap_allreduce_t *ar = svc->rounds; ar; ar = ar->next)
        if (!memcmp(ar->gid, h.group_id, AP_AVG_GROUP_ID_LEN)) {
            if (!ar->in) {
                ap_warn(MOD, "refusing stream from %s: this peer reduces no part",
                        ap_peer_id_short(peer, sb));
                return AP_EPROTO;
            }
            return adopt(ar, s, &h);
        }
    if (svc->nparked >= PARK_MAX) {
        ap_warn(MOD, "refusing stream from %s: unknown group id and too many waiting",
                ap_peer_id_short(peer, sb));
        return AP_ELIMIT;
    }
    parked_t *pk = calloc(1, sizeof *pk);
    if (!pk) return AP_ENOMEM;
    pk->svc = svc;
    pk->s = s;
    pk->hello = h;
    pk->since_us = ap_rt_now_us(rt);
    pk->next = svc->parked;
    svc->parked = pk;
    svc->nparked++;
    ap_stream_set_cbs(s, &parked_cbs, pk);
    ap_stream_pause(s, true);
    return 0;
}

ap_rt_t *ap__avg_service_rt(ap_avg_service_t *svc)
{
    return svc->rt;
}

int ap_avg_service_new(ap_rt_t *rt, ap_avg_service_t **out)
{
    if (!rt || !out) return AP_EINVAL;
    ap_avg_service_t *svc = calloc(1, sizeof *svc);
    if (!svc) return AP_ENOMEM;
    svc->rt = rt;
    ap_stream_opts_t so = {.window = AVG_WINDOW,
                           .max_msg = AP__AVG_FRAME_HDR + (size_t)AP__AVG_CHUNK_MAX * 4};
    int rc = ap_rt_stream_listen(rt, AP_AVG_PROTO, &so, on_accept, svc);
    if (rc) {
        free(svc);
        return rc;
    }
    svc->park_timer = ap_rt_timer_start(rt, 1000000, 1000000, park_timer_cb, svc);
    *out = svc;
    return 0;
}

int ap_avg_service_free(ap_avg_service_t *svc)
{
    if (!svc) return 0;
    if (svc->rounds) return AP_EBUSY;
    ap_rt_stream_unlisten(svc->rt, AP_AVG_PROTO);
    if (svc->park_timer) ap_rt_timer_stop(svc->rt, svc->park_timer);
    while (svc->parked) {
        parked_t *pk = svc->parked;
        svc->parked = pk->next;
        ap_stream_set_cbs(pk->s, &noop_cbs, NULL);
        ap_stream_reset(pk->s, AP_ESHUTDOWN);
        free(pk);
    }
    for (int k = 0; k < 3; k++)
        if (svc->cache[k].p) ap__big_free(svc->cache[k].p, svc->cache[k].bytes);
    free(svc);
    return 0;
}

/* ---- test hooks ------------------------------------------------------------------ */

void ap__allreduce_progress(const ap_allreduce_t *ar, ap__avg_progress_t *p)
{
    memset(p, 0, sizeof *p);
    p->reduced = ar->reduced;
    p->my_chunks = ar->my_chunks;
    for (int k = 0; ar->sends && k < ar->n; k++) {
        if (k == ar->self || !ar->cnt[k]) continue;
        p->data_chunks_sent += ar->out[k].next_send;
        p->data_chunks_total += nchunks(ar, ar->cnt[k]);
        p->results_recv += ar->out[k].next_recv;
        p->results_total += nchunks(ar, ar->cnt[k]);
        uint32_t lead = ar->out[k].lead;
        if (lead && (!p->lead_min || lead < p->lead_min)) p->lead_min = lead;
        if (lead > p->lead_max) p->lead_max = lead;
    }
}

void ap__allreduce_sender_progress(const ap_allreduce_t *ar, int j, uint32_t *got, uint32_t *total)
{
    *got = ar->in && j >= 0 && j < ar->n ? ar->in[j].next_in : 0;
    *total = ar->in ? ar->my_chunks : 0;
}

void ap__avg_service_abandon(ap_avg_service_t *svc)
{
    if (!svc) return;
    svc->closing = true;
    while (svc->rounds) {
        ap_allreduce_t *ar = svc->rounds;
        svc->rounds = ar->next;
        round_free(ar);
    }
    while (svc->parked) {
        parked_t *pk = svc->parked;
        svc->parked = pk->next;
        free(pk);
    }
    for (int k = 0; k < 3; k++)
        if (svc->cache[k].p) ap__big_free(svc->cache[k].p, svc->cache[k].bytes);
    free(svc);
}
