/* Butterfly all-reduce, the sender side: sending each reducer its part,
 * paced by a lead (chunks ahead of the results) sized from the measured
 * round trip and result rate (docs/averaging.md, "Pacing"), and taking the
 * results back in. The round itself: allreduce.c. */
#include "averaging/allreduce_impl.h"

#include "apiary/log.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- sender side -------------------------------------------------------------- */

void ap__ar_fail_part(ap_allreduce_t *ar, int k, int err, const char *why)
{
    out_slot_t *os = &ar->out[k];
    if (os->state == SLOT_DONE || os->state == SLOT_DROPPED) return;
    char sb[AP_PEER_SHORT_LEN];
    ap_warn(MOD, "round: part of reducer %s (index %d) stays local from chunk %u: %s",
            ap__ar_short_of(ar, k, sb), k, os->next_recv, why);
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
    if (c >= os->trip_end) { /* one round trip since the last check */
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
        if (os->full) {
            /* the bandwidth-delay product starved the part: where the round
             * trip grows with the lead (a CPU-bound loopback, where queued
             * chunks wait for the processes), rate × smallest round trip
             * is below the lead the rate needs; keep the lead that reached
             * it */
            if (os->lead < os->full_lead && trip_rate < LEAD_STARVED * os->full_rate)
                os->floor_lead = os->full_lead;
        } else if (queue && os->full_lead) {
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
        if (lead < os->floor_lead) lead = os->floor_lead;
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
    uint32_t nc = ap__ar_nchunks(ar, ar->cnt[k]);
    int rc;
    if (ap__avg_frame_parse(data, len, &f) || f.type != AP__AVG_FRAME_RESULT ||
        f.codec != ar->codec->id) {
        ap__ar_fail_part(ar, k, AP_EPROTO, "malformed result frame");
    } else if (f.index != os->next_recv || f.index >= nc || f.index >= os->next_send) {
        ap__ar_fail_part(ar, k, AP_EPROTO, "result chunk out of order");
    } else if (f.elems != ap__ar_chunk_len(ar, ar->cnt[k], f.index)) {
        ap__ar_fail_part(ar, k, AP_EPROTO, "result chunk of the wrong size");
    } else if ((rc = ar->codec->check_raw
                         ? ar->codec->check_raw(f.payload, f.payload_len, f.elems)
                         : ar->codec->decode(f.payload, f.payload_len, f.elems, ar->scratch))) {
        ap__ar_fail_part(ar, k, AP_EPROTO,
                         rc == AP_ENONFINITE ? "NaN or Inf in result"
                                             : "result payload size mismatch");
    } else {
        /* checked before it touches the data; raw float32 is copied once */
        float *dst = ar->data + ar->off[k] + (uint64_t)f.index * ar->o.chunk_elems;
        memcpy(dst, ar->codec->check_raw ? (const void *)f.payload : (const void *)ar->scratch,
               (size_t)f.elems * sizeof(float));
        ar->res.elems_averaged += f.elems;
        ar->res.bytes_received += len;
        lead_sample(ar, os, f.index);
        if (++os->next_recv == nc) os->state = SLOT_DONE;
        ap__ar_pump_send_all(ar);
    }
    ap__ar_check_done(ar);
}

/* How many data chunks of part k may be in flight (sent, result not yet
 * back): docs/averaging.md, "Pacing". */
static uint32_t lead_limit(const ap_allreduce_t *ar, int k)
{
    if (ar->o.max_lead_chunks) return ar->o.max_lead_chunks; /* fixed, or AP_ALLREDUCE_LEAD_OFF */
    return ar->out[k].lead;
}

/* Sends the next data chunk of part k: 1 if sent, 0 if blocked or finished. */
static int send_one(ap_allreduce_t *ar, int k)
{
    out_slot_t *os = &ar->out[k];
    if (os->state != SLOT_ACTIVE || !os->link || !os->link->s || os->sent_all) return 0;
    ap_stream_t *s = os->link->s;
    uint32_t nc = ap__ar_nchunks(ar, ar->cnt[k]);
    /* pacing: at most max_lead_chunks data chunks ahead of the results
     * this reducer has sent back (docs/averaging.md, "Pacing") */
    if (os->next_send < nc && os->next_send - os->next_recv >= lead_limit(ar, k)) return 0;
    if (os->next_send < nc) {
        uint32_t c = os->next_send;
        uint32_t len = ap__ar_chunk_len(ar, ar->cnt[k], c);
        size_t fl = AP__AVG_FRAME_HDR + ar->codec->size(len);
        int rc = ap__ar_send_chunk(ar, s, AP__AVG_FRAME_DATA, c, len,
                                   ar->data + ar->off[k] + (uint64_t)c * ar->o.chunk_elems);
        if (rc == AP_EAGAIN) return 0;
        if (rc) {
            ap__ar_fail_part(ar, k, AP_ERESET, "cannot send data");
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
void ap__ar_pump_send_all(ap_allreduce_t *ar)
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
    if (l->ar->out[l->peer].link == l) ap__ar_pump_send_all(l->ar);
    ap__ar_check_done(l->ar);
}

static void on_out_end(ap_stream_t *s, void *arg)
{
    link_t *l = arg;
    ap_allreduce_t *ar = l->ar;
    (void)s;
    if (ar->out[l->peer].link == l && ar->out[l->peer].state == SLOT_ACTIVE)
        ap__ar_fail_part(ar, l->peer, AP_EPROTO, "reducer ended before sending the whole part");
    ap__ar_check_done(ar);
}

const ap_stream_cbs_t ap__ar_out_cbs = {on_out_msg, on_out_writable, on_out_end,
                                        ap__ar_on_link_close};

void ap__ar_on_link_close(ap_stream_t *s, void *arg, int status)
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
                ap__ar_fail_part(ar, l->peer, status,
                                 status ? ap_strerror(status) : "closed early");
        }
        /* unreachable: it cannot deliver its data to us either */
        if (status == AP_EUNREACH && ar->in && ar->in[l->peer].state == SLOT_WAITING)
            ap__ar_drop_sender(ar, l->peer, AP_EUNREACH, "unreachable");
        ap__ar_finalise_chunks(ar);
        ap__ar_pump_results(ar);
    } else {
        in_slot_t *sl = &ar->in[l->peer];
        if (sl->link == l) {
            sl->link = NULL;
            if (sl->state == SLOT_ACTIVE) {
                if (sl->next_in < ar->my_chunks)
                    ap__ar_drop_sender(ar, l->peer, status,
                                       status ? ap_strerror(status)
                                              : "closed before the whole part");
                else if (sl->next_out < ar->my_chunks)
                    sl->state = SLOT_DONE; /* it has its data in; it just misses results */
            }
        }
        ap__ar_finalise_chunks(ar);
        ap__ar_pump_results(ar);
    }
    ap__ar_check_done(ar);
}

/* Automatic pacing: one ring per part, as long as the most chunks that may
 * be in flight (the stream window, LEAD_CAP, the part's chunk count). */
int ap__ar_setup_pacing(ap_allreduce_t *ar)
{
    size_t fmax = ap__ar_frame_max(ar);
    size_t win = ap__ar_data_window(fmax);
    uint32_t cap = (uint32_t)(win / fmax < LEAD_CAP ? win / fmax : LEAD_CAP);
    size_t total = 0;
    for (int k = 0; k < ar->n; k++) {
        if (k == ar->self || !ar->cnt[k]) continue;
        uint32_t nc = ap__ar_nchunks(ar, ar->cnt[k]);
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
