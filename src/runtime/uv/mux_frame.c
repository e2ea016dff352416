/* libuv driver, stream multiplexer: the frames. Outgoing: the round-robin
 * scheduler that frames queued messages within credit and hands them to the
 * transport. Incoming: one handler per frame type, enforcing the protocol
 * (docs/protocol.md) and closing the connection of a peer that breaks it. */
#include "runtime/uv/mux_impl.h"

#include "apiary/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Hands the frame buffer to the transport. */
static void conn_write_obuf(ap_mconn_t *c)
{
    if (c->state != MC_UP || !c->t || c->obuf.len == 0) return;
    c->credit_owed = false;
    int rc = c->t->vt->write(c->t, c->obuf.data, c->obuf.len);
    c->node->stats.bytes_sent += c->obuf.len;
    ap__buf_reset(&c->obuf);
    if (rc == 1) c->blocked = true; /* rc < 0: on_close follows */
}

/* Frames one DATA frame of s. Returns whether s can send more now. */
static bool ms_frame_one(ap_mstream_t *s)
{
    ap_mconn_t *c = s->conn;
    ap_msg_t *m = s->sq;
    size_t left = m->len - m->off;
    size_t k = left < AP_MUX_FRAG ? left : AP_MUX_FRAG;
    if (!m->exempt && (int64_t)k > s->credit) k = (size_t)s->credit;
    if ((int64_t)k > c->credit) k = (size_t)c->credit;
    if (k == 0 && left > 0) return false;
    bool start = !m->started;
    if (k >= AP_MUX_DIRECT_MIN) {
        /* Big fragment: the header goes right before the bytes (into the
         * head room, or over bytes already written), and the frame goes to
         * the transport from the message itself: one transport write per
         * frame, so over TCP each frame is one whole Noise message (sealed
         * straight from here; the receiver never reassembles it either). */
        size_t hl = AP_FRAME_HDR + (start ? 4u : 0u);
        uint8_t *h = m->data + m->off - hl;
        h[0] = AP_FRAME_DATA;
        h[1] = start ? AP_FRAME_F_START : 0;
        ap__put_be32(h + 2, s->sid);
        ap__put_be16(h + 6, (uint16_t)(k + hl - AP_FRAME_HDR));
        if (start) ap__put_be32(h + 8, (uint32_t)m->len);
        conn_write_obuf(c); /* frames queued before this one go first */
        if (c->state == MC_UP && c->t) {
            int rc = c->t->vt->write(c->t, h, hl + k);
            c->node->stats.bytes_sent += hl + k;
            c->direct_bytes += hl + k;
            if (rc == 1) c->blocked = true;
        }
    } else {
        int rc = ap__frame_put_data(&c->obuf, s->sid, start, (uint32_t)m->len, m->data + m->off, k);
        if (rc < 0) {
            ap__mconn_fail(c, AP_ENOMEM, "out of memory framing data");
            return false;
        }
    }
    m->started = true;
    m->off += k;
    if (!m->exempt) s->credit -= (int64_t)k;
    c->credit -= (int64_t)k;
    s->sbuf -= k;
    if (s->resp_charged) ap__ms_resp_release(s, k);
    if (!m->exempt) s->inflight += k; /* until the receiver acknowledges it */
    if (m->off == m->len) {
        s->sq = m->next;
        if (!s->sq) s->sq_tail = NULL;
        ap__mux_msg_free(s->node, m);
    }
    ap__ms_check_writable(s);
    if (!s->sq) ap__ms_try_close(s);
    return ap__ms_eligible(s);
}

void ap__mconn_flush(ap_mconn_t *c)
{
    if (c->state != MC_UP || !c->t) return;
    ap_node_t *n = c->node;
    if (c->goaway_sent && c->goaway_rcvd && c->nstreams == 0) {
        /* drained: both sides stopped opening streams and none is left */
        if (c->obuf.len) {
            c->t->vt->write(c->t, c->obuf.data, c->obuf.len);
            n->stats.bytes_sent += c->obuf.len;
            ap__buf_reset(&c->obuf);
        }
        ap_debug("mux", "connection to %s drained after GOAWAY: closing it", c->short_id);
        ap__mconn_fail(c, AP_ECLOSED, NULL);
        return;
    }
    for (int round = 0; round < 8; round++) {
        c->direct_bytes = 0;
        while (!c->blocked && c->sched_head && c->credit > 0 &&
               c->obuf.len + c->direct_bytes < AP_MUX_FLUSH_BYTES && c->state == MC_UP) {
            ap_mstream_t *s = c->sched_head;
            c->sched_head = s->sched_next;
            if (!c->sched_head) c->sched_tail = NULL;
            s->in_sched = false;
            s->sched_next = NULL;
            if (ms_frame_one(s) && s->conn == c) {
                /* round robin: back to the tail */
                s->in_sched = true;
                if (c->sched_tail)
                    c->sched_tail->sched_next = s;
                else
                    c->sched_head = s;
                c->sched_tail = s;
            }
        }
        if (c->state != MC_UP) return;
        conn_write_obuf(c);
        if (c->state != MC_UP || !c->t) return; /* on_close follows */
        if (c->blocked || !c->sched_head || c->credit <= 0) return;
    }
    ap__mconn_want_flush(c); /* more to send: yield to the loop first */
}

/* ---- frame handlers -------------------------------------------------------------------- */

#define PROTO_ERR(c, ...)                                                                          \
    do {                                                                                           \
        char why_[160];                                                                            \
        snprintf(why_, sizeof why_, __VA_ARGS__);                                                  \
        ap__mconn_fail(c, AP_EPROTO, why_);                                                        \
        return 1;                                                                                  \
    } while (0)

static bool remote_sid(const ap_mconn_t *c, uint32_t sid)
{
    return (sid & 1u) == (c->t && c->t->dialer ? 0u : 1u);
}

/* A frame for a stream we do not have: fine if the id was used before (the
 * stream ended while the frame was in flight), a violation otherwise. */
static bool stale_sid(const ap_mconn_t *c, uint32_t sid)
{
    return remote_sid(c, sid) ? sid <= c->last_remote_sid : sid < c->next_sid;
}

static int on_open(ap_mconn_t *c, const ap_frame_t *f)
{
    ap_node_t *n = c->node;
    uint32_t window;
    char proto[AP_RT_PROTO_MAX];
    if (ap__frame_parse_open(f, &window, proto, sizeof proto) < 0) PROTO_ERR(c, "malformed OPEN");
    if (!remote_sid(c, f->sid) || f->sid <= c->last_remote_sid)
        PROTO_ERR(c, "OPEN reuses or misnumbers stream %u", f->sid);
    c->last_remote_sid = f->sid;
    bool rpc = f->flags & AP_FRAME_F_RPC;
    if (c->goaway_rcvd) {
        /* the peer said it would open no more streams here */
        ap_debug("mux", "peer %s opened %s after its GOAWAY: refused", c->short_id, proto);
        c->node->stats.goaway_refused++;
        ap__mconn_send_reset(c, f->sid, AP_ECLOSED, "connection going away");
        return 0;
    }
    if (c->nstreams >= AP_MUX_MAX_STREAMS) {
        /* one warning per connection; a flood of refusals stays quiet */
        if (!c->warned_streams)
            ap_warn("mux", "peer %s exceeds %d streams; refusing %s", c->short_id,
                    AP_MUX_MAX_STREAMS, proto);
        else
            ap_debug("mux", "peer %s: refusing %s (stream cap)", c->short_id, proto);
        c->warned_streams = true;
        ap__mconn_send_reset(c, f->sid, AP_ELIMIT, "too many streams");
        return 0;
    }
    size_t max_msg, rxw, sendw = 0;
    if (rpc) {
        const ap_rt_handler_t *h = ap__rt_find_handler(&n->rt, proto);
        if (!h) {
            ap__mconn_send_reset(c, f->sid, AP_ENOPROTO, "no handler");
            return 0;
        }
        max_msg = h->max_req;
        rxw = 0;
    } else {
        const ap_rt_listener_t *l = ap__rt_find_listener(&n->rt, proto);
        if (!l) {
            ap__mconn_send_reset(c, f->sid, AP_ENOPROTO, "no listener");
            return 0;
        }
        max_msg = l->opts.max_msg;
        rxw = l->opts.window;
        sendw = l->opts.window;
    }
    ap_mstream_t *s = ap__ms_new(n, rpc ? MS_SERVE : MS_STREAM);
    if (!s || ap__idmap_put(&c->streams, f->sid, s) < 0) {
        free(s);
        ap__mconn_send_reset(c, f->sid, AP_ENOMEM, "out of memory");
        return 0;
    }
    c->nstreams++;
    s->conn = c;
    s->sid = f->sid;
    s->pub.peer = c->peer;
    s->pub.window = sendw;
    s->pub.max_msg = max_msg;
    s->rx_window = rxw > INT32_MAX ? INT32_MAX : (uint32_t)rxw;
    s->credit = window;
    s->peer_window = window;
    strcpy(s->proto, proto);
    char why[64];
    if (ap__ms_rc_open(s, why, sizeof why) < 0) {
        /* over the connection's, the peer's or the node's stream limit */
        ap__mconn_send_reset(c, f->sid, AP_ELIMIT, why);
        ap__ms_finish(s, AP_ELIMIT);
        return c->state == MC_DEAD;
    }
    return 0;
}

static int on_data(ap_mconn_t *c, const ap_frame_t *f)
{
    bool has_total;
    uint32_t total;
    const uint8_t *data;
    size_t nb;
    if (ap__frame_parse_data(f, &has_total, &total, &data, &nb) < 0) PROTO_ERR(c, "malformed DATA");
    /* connection-level credit covers every DATA byte */
    if ((int64_t)nb > c->rx_credit) PROTO_ERR(c, "connection window overflow");
    c->rx_credit -= (int64_t)nb;
    c->unacked += (uint32_t)nb;
    if (c->unacked >= AP_MUX_CONN_WINDOW / 4) {
        ap__mconn_ctl_rc(c, ap__frame_put_window(&c->obuf, 0, false, c->unacked));
        if (c->state == MC_DEAD) return 1;
        c->credit_owed = true;
        c->rx_credit += c->unacked;
        c->unacked = 0;
    }
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "DATA on unknown stream %u", f->sid);
    }
    if (s->rclosed) PROTO_ERR(c, "DATA after CLOSE on stream %u", f->sid);
    if (s->opener && !s->accepted) PROTO_ERR(c, "DATA before ACCEPT on stream %u", f->sid);
    if (has_total) {
        if (s->rx_active) PROTO_ERR(c, "DATA START inside a message on stream %u", f->sid);
        bool exempt = !s->opener && !s->got_hello;
        if (total > s->pub.max_msg) {
            ap_info("mux", "peer %s sent a %u-byte message over the %zu cap on %s", c->short_id,
                    total, s->pub.max_msg, s->proto);
            ap__mconn_send_reset(c, f->sid, AP_EMSGSIZE, "message too large");
            ap__ms_finish(s, AP_EMSGSIZE);
            return c->state == MC_DEAD;
        }
        /* counted in the stream's, connection's, peer's, protocol's and
         * node's memory (on the node: at most half of what is free, so many
         * peers together cannot take it all) */
        char why[64];
        if (ap__ms_rc_reserve(s, total, "a message", why, sizeof why) < 0) {
            c->node->refused_rx++;
            ap__mconn_send_reset(c, f->sid, AP_ELIMIT, why);
            ap__ms_finish(s, AP_ELIMIT);
            return c->state == MC_DEAD;
        }
        ap_msg_t *m = ap__mux_msg_alloc(c->node, total);
        if (!m) {
            ap__ms_rc_release(s, total);
            ap__mconn_send_reset(c, f->sid, AP_ENOMEM, "out of memory");
            ap__ms_finish(s, AP_ENOMEM);
            return c->state == MC_DEAD;
        }
        m->len = total;
        s->rx = (uint8_t *)m;
        s->rx_total = total;
        s->rx_have = 0;
        s->rx_active = true;
        s->progress_us = ap__host_now_us(c->node->host);
        s->rx_exempt = exempt;
        s->rx_charged += total;
        c->rx_buffered += total;
        c->node->rx_buffered += total;
        ap__mux_sweep_start(c->node);
    } else if (!s->rx_active) {
        PROTO_ERR(c, "DATA continuation without START on stream %u", f->sid);
    }
    if (nb > (size_t)(s->rx_total - s->rx_have)) PROTO_ERR(c, "DATA overruns its message");
    if (!s->rx_exempt) {
        if ((int64_t)nb > s->rx_credit) PROTO_ERR(c, "stream %u window overflow", f->sid);
        s->rx_credit -= (int64_t)nb;
        s->unacked += (uint32_t)nb;
    }
    ap_msg_t *m = (ap_msg_t *)s->rx;
    if (nb) memcpy(m->data + s->rx_have, data, nb);
    s->rx_have += (uint32_t)nb;
    if (nb) s->progress_us = ap__host_now_us(c->node->host);
    if (s->rx_have < s->rx_total) {
        ap__ms_ack(s, false);
        return c->state == MC_DEAD;
    }
    /* message complete */
    s->rx = NULL;
    s->rx_active = false;
    if (s->rx_exempt) {
        s->got_hello = true;
        if (s->kind == MS_SERVE)
            ap__ms_serve(s, m);
        else
            ap__ms_accept(s, m);
        return c->state == MC_DEAD;
    }
    if (s->paused || s->rq) {
        if (s->rq_tail)
            s->rq_tail->next = m;
        else
            s->rq = m;
        s->rq_tail = m;
        s->rq_bytes += m->len;
        return 0;
    }
    ap__ms_deliver(s, m);
    if (c->state == MC_DEAD) return 1;
    if (!s->finished) {
        ap__ms_ack(s, false);
        ap__ms_maybe_end(s);
    }
    return c->state == MC_DEAD;
}

static int on_close_frame(ap_mconn_t *c, const ap_frame_t *f)
{
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "CLOSE on unknown stream %u", f->sid);
    }
    if (s->rclosed) PROTO_ERR(c, "second CLOSE on stream %u", f->sid);
    if (s->rx_active) PROTO_ERR(c, "CLOSE inside a message on stream %u", f->sid);
    if (s->opener && !s->accepted) PROTO_ERR(c, "CLOSE before ACCEPT on stream %u", f->sid);
    if (!s->opener && !s->got_hello) PROTO_ERR(c, "CLOSE before the first message");
    s->rclosed = true;
    if (s->kind == MS_STREAM && !s->accepted_by_user) return 0; /* accept() not run yet */
    ap__ms_maybe_end(s);
    return c->state == MC_DEAD;
}

static int on_reset(ap_mconn_t *c, const ap_frame_t *f)
{
    int code;
    char msg[AP_FRAME_RESET_MSG_MAX + 1];
    if (ap__frame_parse_reset(f, &code, msg, sizeof msg) < 0) PROTO_ERR(c, "malformed RESET");
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "RESET on unknown stream %u", f->sid);
    }
    if (s->kind == MS_CALL) {
        snprintf(s->errmsg, sizeof s->errmsg, "%s", msg);
        s->has_errmsg = msg[0] != 0;
        ap__ms_finish(s, code);
    } else {
        ap__ms_finish(s, AP_ERESET);
    }
    return c->state == MC_DEAD;
}

static int on_window(ap_mconn_t *c, const ap_frame_t *f)
{
    uint32_t delta;
    if (ap__frame_parse_window(f, &delta) < 0) PROTO_ERR(c, "malformed WINDOW");
    if (f->sid == 0) {
        if (c->credit + delta > INT32_MAX) PROTO_ERR(c, "connection window overflow");
        c->credit += delta;
        ap__mconn_want_flush(c);
        return 0;
    }
    ap_mstream_t *s = ap__idmap_get(&c->streams, f->sid);
    if (!s) {
        if (stale_sid(c, f->sid)) return 0;
        PROTO_ERR(c, "WINDOW on unknown stream %u", f->sid);
    }
    if (f->flags & AP_FRAME_F_ACCEPT) {
        if (!s->opener || s->accepted) PROTO_ERR(c, "unexpected ACCEPT on stream %u", f->sid);
        s->accepted = true;
        if (s->open_timer && s->kind == MS_STREAM) {
            ap_rt_timer_stop(&s->node->rt, s->open_timer);
            s->open_timer = 0;
        }
    } else if (!s->accepted && s->opener) {
        PROTO_ERR(c, "WINDOW before ACCEPT on stream %u", f->sid);
    }
    if (s->credit + delta > INT32_MAX) PROTO_ERR(c, "stream %u window overflow", f->sid);
    s->credit += delta;
    if (f->flags & AP_FRAME_F_ACCEPT) {
        s->peer_window = delta;
    } else {
        s->inflight -= delta < s->inflight ? delta : s->inflight;
        ap__ms_check_writable(s);
    }
    ap__ms_schedule(s);
    ap__ms_try_close(s);
    return c->state == MC_DEAD;
}

static int on_goaway(ap_mconn_t *c)
{
    if (c->goaway_rcvd) PROTO_ERR(c, "second GOAWAY");
    c->goaway_rcvd = true;
    ap_debug("mux", "GOAWAY from %s (%u streams to drain)", c->short_id, c->nstreams);
    ap__mconn_goaway(c);     /* answer it: we open nothing more here either */
    ap__mconn_want_flush(c); /* closes it if nothing is left */
    return c->state == MC_DEAD;
}

static int on_frame(void *arg, const ap_frame_t *f)
{
    ap_mconn_t *c = arg;
    if (c->state != MC_UP) return 1;
    switch (f->type) {
    case AP_FRAME_OPEN:
        return on_open(c, f);
    case AP_FRAME_DATA:
        return on_data(c, f);
    case AP_FRAME_CLOSE:
        return on_close_frame(c, f);
    case AP_FRAME_RESET:
        return on_reset(c, f);
    case AP_FRAME_WINDOW:
        return on_window(c, f);
    case AP_FRAME_GOAWAY:
        return on_goaway(c);
    default:
        PROTO_ERR(c, "unknown frame type %u", f->type);
    }
}

void ap__mconn_on_read(void *user, ap_conn_t *t, const uint8_t *p, size_t n)
{
    ap_mconn_t *c = user;
    (void)t;
    if (c->state != MC_UP) return;
    c->node->stats.bytes_received += n;
    int rc = ap__frame_dec_feed(c->dec, p, n, on_frame, c);
    if (rc < 0 && c->state != MC_DEAD) ap__mconn_fail(c, AP_EPROTO, "malformed frame header");
    /* Credit goes back now, not at the next flush: that runs a loop turn
     * later, after the transport has delivered everything it read in this
     * burst (up to a whole window), so the sender would idle until the
     * receiver had drained it all (stop-and-wait on the window; see
     * docs/runtime-uv.md, "Credit return"). The transport batches these small
     * writes with anything else written while it processes the read. */
    if (c->credit_owed) conn_write_obuf(c);
}

void ap__mux_feed(ap_mconn_t *c, const uint8_t *p, size_t n)
{
    ap__mconn_on_read(c, c->t, p, n);
}
