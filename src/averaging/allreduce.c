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
 * round deadline bounds everything; no stream outlives its round. *
 * This file: the round's state machine (setup, opening the parts, the tick
 * with its stall and deadline rules, peer events, finishing) and the service
 * that parks early streams; the wire helpers and test hooks. The reducer
 * side is allreduce_reduce.c, the paced sender side allreduce_pacing.c. */
#include "averaging/allreduce_impl.h"

#include "apiary/log.h"

#include "averaging.pb-c.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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
    if (m->total > AP_ALLREDUCE_MAX_ELEMS || m->offset > m->total ||
        m->count > m->total - m->offset)
        goto out;
    if (m->chunk_elems == 0 || m->chunk_elems > AP__AVG_CHUNK_MAX) goto out;
    if (!isfinite(m->weight) || !(m->weight >= 0)) goto out;
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

static void open_deferred(ap_allreduce_t *ar, int k);

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

void ap__ar_check_done(ap_allreduce_t *ar)
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
            ap__ar_drop_sender(ar, j, err, why);
    }
    ap__ar_finalise_chunks(ar);
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
            ap__ar_fail_part(ar, k, err, why);
    reset_open_links(ar, err);
    ap__ar_check_done(ar);
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
        ap__ar_pump_send_all(ar);
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
        if (sl->state == SLOT_ACTIVE && sl->next_in > ap__ar_gate(ar)) {
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
            ap__ar_drop_sender(ar, j, AP_ETIMEDOUT,
                               sl->state == SLOT_WAITING ? "never connected" : "stalled");
    }
    ap__ar_finalise_chunks(ar);
    ap__ar_pump_results(ar);
    ap__ar_check_done(ar);
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
    if (open_part(ar, k)) ap__ar_fail_part(ar, k, AP_ENOMEM, "cannot open a stream");
}

static void on_peer_event(ap_rt_t *rt, void *arg, const ap_peer_id_t *peer, ap_peer_event_t ev)
{
    ap_allreduce_t *ar = arg;
    if (ar->stopped || ar->finishing) return;
    if (ev == AP_PEER_CONNECTED) { /* a deferred part can go over this connection now */
        for (int j = 0; j < ar->n; j++)
            if (j != ar->self && ap_peer_id_eq(&ar->m[j].id, peer)) open_deferred(ar, j);
        ap__ar_pump_send_all(ar);
        return;
    }
    /* a duplicate connection closing while another one stays up is no loss */
    if (ev != AP_PEER_DISCONNECTED || ap_rt_is_connected(rt, peer)) return;
    for (int j = 0; j < ar->n; j++) {
        if (j == ar->self || !ap_peer_id_eq(&ar->m[j].id, peer)) continue;
        if (ar->out && ar->cnt[j] && ar->out[j].state == SLOT_WAITING)
            ap__ar_fail_part(ar, j, AP_ECLOSED, "disconnected");
        if (ar->in && ar->m[j].role != AP_AVG_AUX &&
            (ar->in[j].state == SLOT_WAITING ||
             (ar->in[j].state == SLOT_ACTIVE && ar->in[j].next_in < ar->my_chunks)))
            ap__ar_drop_sender(ar, j, AP_ECLOSED, "disconnected");
        if (ar->out && ar->cnt[j] && ar->out[j].state == SLOT_ACTIVE)
            ap__ar_fail_part(ar, j, AP_ECLOSED, "disconnected");
    }
    ap__ar_finalise_chunks(ar);
    ap__ar_pump_results(ar);
    ap__ar_check_done(ar);
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
    free(ar->acc0);
    free(ar->n0);
    free(ar->slot);
    free(ar->free_slots);
    cache_put(ar->svc, 1, ar->aux_buf, ar->aux_bytes);
    cache_put(ar->svc, 2, ar->res_enc, ar->res_enc_bytes);
    free(ar->in);
    free(ar->copies);
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
    for (int k = 0; ar->out && k < ar->n; k++) { /* automatic pacing, per part */
        const out_slot_t *os = &ar->out[k];
        if (k != ar->self && os->ring)
            ap_debug(MOD,
                     "round: part %d lead %u (start-up %s, lead at last growth %u), smallest "
                     "round trip %llu us, %.3f results/ms",
                     k, os->lead, os->full ? "ended" : "not ended", os->full_lead,
                     (unsigned long long)os->min_rtt_us, os->rate * 1e3);
    }
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
    uint8_t *faults = ar->n > 0 ? calloc((size_t)ar->n, 1) : NULL;
    for (int j = 0; faults && j < ar->n; j++) {
        if (j == ar->self) continue;
        if (ar->out && ar->cnt[j] && ar->out[j].state == SLOT_DROPPED)
            faults[j] |= AP_ALLREDUCE_PART_FAILED;
        if (ar->in && ar->m[j].role != AP_AVG_AUX && ar->in[j].state == SLOT_DROPPED)
            faults[j] |= AP_ALLREDUCE_SENDER_DROPPED;
    }
    ar->res.member_faults = faults;
    ar->done(rt, ar->done_arg, &ar->res);
    free(faults);
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
    size_t fmax = ap__ar_frame_max(ar);
    ap_stream_opts_t so = {.window = ap__ar_data_window(fmax),
                           .max_msg = fmax,
                           .open_timeout_us = ar->deadline_us - ar->start_us};
    ap_stream_t *s = NULL;
    int rc =
        ap_rt_stream_open(ar->rt, &ar->m[k].id, AP_AVG_PROTO, hb, hl, &so, &ap__ar_out_cbs, l, &s);
    if (rc) return rc;
    l->s = s;
    ar->live_links++;
    ar->out[k].state = SLOT_ACTIVE;
    ar->out[k].link = l;
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
        ar->my_chunks = ap__ar_nchunks(ar, c);
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
        if (ar->o.reduce) {
            if ((size_t)g->n > SIZE_MAX / sizeof(float) / c) goto nomem;
            ar->copies = malloc((size_t)g->n * c * sizeof(float));
            if (!ar->copies) goto nomem;
            if (ar->sends)
                memcpy(ar->copies + (size_t)ar->self * c, ar->data + ar->off[ar->self],
                       c * sizeof(float));
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
        if (!ar->o.max_lead_chunks && ap__ar_setup_pacing(ar)) goto nomem;
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
        n_elems > AP_ALLREDUCE_MAX_ELEMS)
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
    if (sends && (!data || !isfinite(weight) || !(weight >= 0))) return AP_EINVAL;
    ap_allreduce_opts_t o = opts ? *opts : (ap_allreduce_opts_t){0};
    if (!o.chunk_elems) o.chunk_elems = ap__avg_auto_chunk(g);
    if (o.chunk_elems > AP__AVG_CHUNK_MAX) return AP_EINVAL;
    if (!(o.deadline_factor > 0)) o.deadline_factor = 4;
    if (!o.deadline_slack_us) o.deadline_slack_us = 2000000;
    if (!o.stall_min_us) o.stall_min_us = 1000000;
    if (!o.connect_grace_us) o.connect_grace_us = 2000000;
    if (!(o.stall_factor > 0)) o.stall_factor = 10;
    if (o.reduce) o.max_lead_chunks = AP_ALLREDUCE_LEAD_OFF; /* results only at the end */
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
        if (ap__ar_adopt(ar, s, &h) == 0)
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
    ap__ar_pump_send_all(ar);
    ap__ar_finalise_chunks(ar);
    ap__ar_pump_results(ar);
    ap__ar_check_done(ar);
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
            return ap__ar_adopt(ar, s, &h);
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
        p->data_chunks_total += ap__ar_nchunks(ar, ar->cnt[k]);
        p->results_recv += ar->out[k].next_recv;
        p->results_total += ap__ar_nchunks(ar, ar->cnt[k]);
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
