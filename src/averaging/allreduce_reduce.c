/* Butterfly all-reduce, the reducer side: accumulating each sender's chunks
 * (weighted sums, lossy-codec decoding), finalising a chunk once every live
 * sender delivered it, and streaming the results back; adopting incoming
 * streams. The round itself: allreduce.c. */
#include "averaging/allreduce_impl.h"

#include "apiary/log.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- reducer side ------------------------------------------------------------ */

void ap__ar_drop_sender(ap_allreduce_t *ar, int j, int err, const char *why)
{
    in_slot_t *sl = &ar->in[j];
    if (sl->state == SLOT_DROPPED || sl->state == SLOT_DONE) return;
    char sb[AP_PEER_SHORT_LEN];
    ap_warn(MOD, "round: dropping sender %s (index %d): %s", ap__ar_short_of(ar, j, sb), j, why);
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

/* Chunk c of the result is final at ar->result: encode it once for a lossy
 * codec, keep its decoding and send those bytes, so that every member holds
 * the same values. */
static void publish_chunk(ap_allreduce_t *ar, uint32_t c, uint64_t s, uint32_t len)
{
    if (ar->res_enc) {
        uint8_t *fr = ar->res_enc + (size_t)c * ar->res_fsz;
        ap__avg_frame_header(fr, AP__AVG_FRAME_RESULT, ar->codec->id, c, len);
        if (ar->codec->encode(ar->result + s, len, fr + AP__AVG_FRAME_HDR) ||
            ar->codec->decode(fr + AP__AVG_FRAME_HDR, ar->codec->size(len), len, ar->result + s)) {
            ap_warn(MOD, "round: codec %s failed on a result chunk", ar->codec->name);
            fr[0] = 0; /* not a frame: sent by encoding afresh */
        }
    }
    if (ar->sends) ar->res.elems_averaged += len;
}

uint32_t ap__ar_gate(const ap_allreduce_t *ar)
{
    if (!ar->copies) return ar->reduced;
    uint32_t g = ar->my_chunks;
    for (int j = 0; j < ar->n; j++) {
        if (j == ar->self || ar->m[j].role == AP_AVG_AUX) continue;
        const in_slot_t *sl = &ar->in[j];
        if (sl->state == SLOT_DROPPED) continue;
        if (sl->next_in < g) g = sl->next_in;
    }
    return g;
}

/* opts.reduce: once every live sender delivered the whole part, the part is
 * replaced by the reducer's aggregate of all the copies. */
static void finalise_robust(ap_allreduce_t *ar)
{
    if (ar->reduced == ar->my_chunks || !chunk_ready(ar, ar->my_chunks - 1)) return;
    uint64_t cnt = ar->cnt[ar->self];
    const float **x = malloc((size_t)ar->n * sizeof *x);
    double *w = malloc((size_t)ar->n * sizeof *w);
    size_t k = 0;
    double wsum = 0;
    int rc = AP_ENOMEM;
    if (!x || !w) goto fail;
    for (int j = 0; j < ar->n; j++) {
        if (j == ar->self) {
            if (!ar->sends) continue;
            w[k] = ar->weight;
        } else {
            const in_slot_t *sl = &ar->in[j];
            if (ar->m[j].role == AP_AVG_AUX || sl->state == SLOT_DROPPED ||
                sl->next_in != ar->my_chunks)
                continue;
            w[k] = sl->weight;
        }
        x[k] = ar->copies + (size_t)j * cnt;
        wsum += w[k++];
    }
    if (k == 0) { /* aux with every sender dropped: nothing to average, nobody to tell */
        memset(ar->result, 0, cnt * sizeof(float));
        if (ar->res_enc)
            for (uint32_t c = 0; c < ar->my_chunks; c++) ar->res_enc[(size_t)c * ar->res_fsz] = 0;
        free(x);
        free(w);
        ar->reduced = ar->my_chunks;
        return;
    }
    if (!(wsum > 0))
        for (size_t i = 0; i < k; i++) w[i] = 1; /* as the mean: the plain mean then */
    uint32_t clipped = 0;
    rc = ar->o.reduce(ar->o.reduce_arg, x, w, k, (size_t)cnt, ar->result, &clipped);
    if (rc) goto fail;
    ar->res.inputs_clipped = clipped;
    ar->res.inputs_reduced = (uint32_t)k;
    for (uint32_t c = 0; c < ar->my_chunks; c++)
        publish_chunk(ar, c, (uint64_t)c * ar->o.chunk_elems, ap__ar_chunk_len(ar, cnt, c));
    free(x);
    free(w);
    ar->reduced = ar->my_chunks;
    return;
fail:
    free(x);
    free(w);
    ap_warn(MOD, "round: the part's reducer failed: %s; the part stays local", ap_strerror(rc));
    if (ar->sends) memcpy(ar->result, ar->copies + (size_t)ar->self * cnt, cnt * sizeof(float));
    for (int j = 0; j < ar->n; j++)
        if (j != ar->self && ar->m[j].role != AP_AVG_AUX && ar->in[j].state != SLOT_DROPPED) {
            ar->in[j].state = SLOT_ACTIVE; /* reset below whatever it delivered */
            ar->in[j].next_in = 0;
            ap__ar_drop_sender(ar, j, AP_ERESET, "the part's reducer failed");
        }
    ar->reduced = ar->my_chunks;
}

/* Chunk c's weights were all 0: its result is the plain mean of the terms
 * that arrived (acc0, n0) and the own one; false if there were none (an
 * auxiliary whose senders all dropped). */
static bool zero_weight_mean(ap_allreduce_t *ar, uint32_t c, uint64_t s, uint32_t len)
{
    const double *z =
        ar->acc0 && ar->touched[c] ? ar->acc0 + (size_t)ar->slot[c] * ar->o.chunk_elems : NULL;
    uint32_t n = (z ? ar->n0[c] : 0) + (ar->sends ? 1 : 0);
    if (n == 0) return false;
    for (uint32_t e = 0; e < len; e++) {
        double v = (z ? z[e] : 0) + (ar->sends ? ar->result[s + e] : 0);
        ar->result[s + e] = (float)(v / n);
    }
    return true;
}

void ap__ar_finalise_chunks(ap_allreduce_t *ar)
{
    if (ar->copies) {
        finalise_robust(ar);
        return;
    }
    while (ar->reduced < ar->my_chunks && chunk_ready(ar, ar->reduced)) {
        uint32_t c = ar->reduced;
        uint64_t s = (uint64_t)c * ar->o.chunk_elems;
        uint32_t len = ap__ar_chunk_len(ar, ar->cnt[ar->self], c);
        double w = ar->wsum[c];
        if (w > 0) {
            if (ar->touched[c])
                ar->k->wsum_mean(ar->result + s, acc_of(ar, c), len, w);
            else /* nobody else delivered: the same arithmetic on the own term alone */
                for (uint32_t e = 0; e < len; e++)
                    ar->result[s + e] = (float)(ar->weight * ar->result[s + e] / w);
            publish_chunk(ar, c, s, len);
        } else if (zero_weight_mean(ar, c, s, len)) {
            publish_chunk(ar, c, s, len);
        } else if (!ar->sends) {
            /* aux with every sender dropped: nothing to average, nobody to tell */
            memset(ar->result + s, 0, (size_t)len * sizeof(float));
            if (ar->res_enc) ar->res_enc[(size_t)c * ar->res_fsz] = 0;
        }
        if (ar->touched[c]) {
            if (ar->acc0) /* zero while the slot is free */
                memset(ar->acc0 + (size_t)ar->slot[c] * ar->o.chunk_elems, 0,
                       (size_t)len * sizeof *ar->acc0);
            ar->free_slots[ar->nfree++] = ar->slot[c];
        }
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
        ap__ar_drop_sender(ar, l->peer, AP_EPROTO, "malformed chunk frame");
        goto after;
    }
    if (f.codec != ar->codec->id) {
        ap__ar_drop_sender(ar, l->peer, AP_EPROTO, "chunk codec differs from the round's");
        goto after;
    }
    if (f.index != sl->next_in || sl->next_in >= ar->my_chunks) {
        ap__ar_drop_sender(ar, l->peer, AP_EPROTO, "chunk out of order or past the part's end");
        goto after;
    }
    uint32_t want = ap__ar_chunk_len(ar, ar->cnt[ar->self], f.index);
    if (f.elems != want) {
        ap__ar_drop_sender(ar, l->peer, AP_EPROTO, "chunk of the wrong size");
        goto after;
    }
    /* raw float32: checked in place and summed straight from the message */
    int rc = ar->codec->check_raw
                 ? ar->codec->check_raw(f.payload, f.payload_len, f.elems)
                 : ar->codec->decode(f.payload, f.payload_len, f.elems, ar->scratch);
    if (rc) {
        ap__ar_drop_sender(ar, l->peer, AP_EPROTO,
                           rc == AP_ENONFINITE ? "NaN or Inf in chunk"
                                               : "chunk payload size mismatch");
        goto after;
    }
    double w = sl->weight;
    const void *x = ar->codec->check_raw ? (const void *)f.payload : (const void *)ar->scratch;
    if (ar->copies) { /* kept whole for the part's reducer */
        memcpy(ar->copies + (size_t)l->peer * ar->cnt[ar->self] +
                   (uint64_t)f.index * ar->o.chunk_elems,
               x, (size_t)f.elems * sizeof(float));
        goto took;
    }
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
    if (!first)
        ar->k->wsum_add(acc, x, f.elems, w);
    else
        ar->k->wsum_init(acc, own, ow, x, f.elems, w);
    ar->wsum[f.index] += w;
    if (!(w > 0) && ar->acc0) { /* weight 0: nothing in acc; kept for an all-zero chunk */
        ar->k->wsum_add(ar->acc0 + (size_t)ar->slot[f.index] * ar->o.chunk_elems, x, f.elems, 1.0);
        ar->n0[f.index]++;
    }
took:
    sl->next_in++;
    if (!sl->first_us) sl->first_us = now;
    sl->last_us = now;
    sl->stall_from_us = now;
    sl->bytes += len;
    ar->res.bytes_received += len;
after:
    ap__ar_finalise_chunks(ar);
    ap__ar_pump_results(ar);
    ap__ar_check_done(ar);
    (void)s;
}

/* Sends chunk c (len elements at x) as a frame of the given type. Raw
 * float32 (the payload is the tensor's bytes) goes header + tensor straight
 * into the stream's send buffer: one copy; other codecs encode into the
 * frame buffer first. 0, AP_EAGAIN or an error, as ap_stream_send. */
/* The default chunk size for group g (allreduce.h, chunk_elems): what the
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
size_t ap__ar_frame_max(const ap_allreduce_t *ar)
{
    return AP__AVG_FRAME_HDR + ar->codec->size(ar->o.chunk_elems);
}

size_t ap__ar_data_window(size_t fmax)
{
    return fmax * 4 > AVG_WINDOW ? fmax * 4 : AVG_WINDOW;
}

int ap__ar_send_chunk(ap_allreduce_t *ar, ap_stream_t *s, uint8_t type, uint32_t c, uint32_t len,
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
        uint32_t len = ap__ar_chunk_len(ar, ar->cnt[ar->self], c);
        size_t fl = AP__AVG_FRAME_HDR + ar->codec->size(len);
        const uint8_t *fr = ar->res_enc ? ar->res_enc + (size_t)c * ar->res_fsz : NULL;
        int rc;
        if (fr && fr[0] == AP__AVG_FRAME_RESULT)
            rc = ap_stream_send(s, fr, fl);
        else
            rc = ap__ar_send_chunk(ar, s, AP__AVG_FRAME_RESULT, c, len,
                                   ar->result + (uint64_t)c * ar->o.chunk_elems);
        if (rc == AP_EAGAIN) return;
        if (rc) {
            ap__ar_drop_sender(ar, j, AP_ERESET, "cannot send results");
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

void ap__ar_pump_results(ap_allreduce_t *ar)
{
    if (!ar->in) return;
    for (int r = 1; r <= ar->n; r++) send_results_to(ar, (ar->self + r) % ar->n);
}

static void on_in_writable(ap_stream_t *s, void *arg)
{
    link_t *l = arg;
    (void)s;
    if (l->ar->in[l->peer].link == l) send_results_to(l->ar, l->peer);
    ap__ar_check_done(l->ar);
}

static void on_in_end(ap_stream_t *s, void *arg)
{
    link_t *l = arg;
    ap_allreduce_t *ar = l->ar;
    in_slot_t *sl = &ar->in[l->peer];
    (void)s;
    if (sl->link == l && sl->state == SLOT_ACTIVE && sl->next_in < ar->my_chunks)
        ap__ar_drop_sender(ar, l->peer, AP_EPROTO, "stream ended before the whole part");
    ap__ar_finalise_chunks(ar);
    ap__ar_pump_results(ar);
    ap__ar_check_done(ar);
}

static const ap_stream_cbs_t in_cbs = {on_in_msg, on_in_writable, on_in_end, ap__ar_on_link_close};

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
int ap__ar_adopt(ap_allreduce_t *ar, ap_stream_t *s, const ap__avg_hello_t *h)
{
    const ap_peer_id_t *peer = ap_stream_peer(s);
    const char *why = hello_mismatch(ar, h, peer);
    if (why) {
        char sb[AP_PEER_SHORT_LEN];
        ap_warn(MOD, "refusing stream from %s: %s", ap_peer_id_short(peer, sb), why);
        return AP_EPROTO;
    }
    if (!(h->weight > 0) && !ar->copies && !ar->acc0) {
        ar->acc0 = calloc((size_t)ar->my_chunks * ar->o.chunk_elems, sizeof *ar->acc0);
        ar->n0 = calloc(ar->my_chunks, sizeof *ar->n0);
        if (!ar->acc0 || !ar->n0) {
            free(ar->acc0);
            free(ar->n0);
            ar->acc0 = NULL;
            ar->n0 = NULL;
            return AP_ENOMEM;
        }
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
