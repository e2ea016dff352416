/* The node's mux over libp2p connections (p2p/p2p_conn.h), behind the
 * connection seam (conn.h), so every protocol of runtime.h runs over them
 * unchanged.
 *
 * NATIVE MUXER. When both sides list AP_P2P_NATIVE_MUX ("/apiary/mux/2"),
 * the decrypted libp2p channel carries the mux's frames as they are: the
 * connection is a byte pipe exactly like the native transport's.
 *
 * YAMUX. Otherwise each mux stream is one yamux stream, opened with
 * multistream-select of its protocol name ("/apiary/dht/1", ...): the
 * responder selects it when the node has a handler or listener of that
 * name, else answers "na" (the opener's stream or call fails with
 * AP_ENOPROTO). The mux's frames of that stream travel inside it as they
 * are (OPEN first, then DATA, WINDOW, CLOSE, RESET), their stream id being
 * the yamux stream's id on the wire and the mux's own id locally. So the
 * mux's per-stream credit works end to end: a reader that stops reading
 * stops its sender as over the native transport. yamux credit is returned as
 * the frames are handed to the mux, whose own windows bound what it holds.
 * Connection-level frames stay local: the mux's connection credit (WINDOW on
 * stream 0) is a receive-rate bound, given back here as its DATA leaves;
 * GOAWAY becomes yamux Go Away and back.
 *
 * Frames that reach the mux from here rather than from the peer (credit, a
 * RESET for a yamux stream that ended without its mux stream ending, a
 * GOAWAY) are delivered from a timer, never from inside write(). In-band
 * frames are checked before the mux sees them: the stream id must be the
 * yamux stream's, the first frame of a stream the peer opened must be an
 * OPEN naming the negotiated protocol, and no other OPEN may follow; a
 * violation resets that stream with one log line naming the peer. */
#include "runtime/uv/p2p_bridge.h"

#include "apiary/avg.h"
#include "apiary/collab.h"
#include "apiary/error.h"
#include "apiary/log.h"
#include "apiary/masha.h"
#include "p2p/relay_svc.h"
#include "base/u64map.h"
#include "runtime/rt_impl.h"
#include "runtime/uv/frame.h"
#include "runtime/uv/inband.h"

#include <stdlib.h>
#include <string.h>

#define MOD         "p2p"
#define HDR         ((size_t)AP_FRAME_HDR)
#define HIGH_WATER  (4u << 20) /* backlog above which the mux pauses DATA */
#define CREDIT_BACK (1u << 20) /* connection credit handed back in batches */

typedef struct bstream bstream_t;

typedef struct bconn {
    ap_conn_t conn; /* must be first */
    ap_p2pb_t *b;
    ap_p2p_conn_t *pc; /* NULL once the libp2p connection is gone */
    bool up, released, closed, blocked, native;
    bool dialing;        /* a circuit dial: pc comes with its on_ready */
    bool in_dial;        /* inside ap__circuit_dial */
    int dial_err;        /* its failure reported from inside */
    ap_buf_t part;       /* outbound: the start of a frame written in part */
    ap_u64map_t streams; /* the mux's stream id -> bstream_t * */
    ap_buf_t inq;        /* frames for the mux, delivered from the timer */
    uint64_t owed;       /* connection credit to hand back */
    uv_timer_t kick;
    bool kick_open;
    char who[AP_PEER_SHORT_LEN];
    uint8_t scratch[AP_FRAME_HDR + AP_FRAME_PAYLOAD_MAX];
} bconn_t;

struct bstream {
    bconn_t *bc;
    ap_p2p_stream_t *ps; /* NULL once the yamux stream is gone */
    ap_inband_t ib;      /* ids, checks, how it ends (inband.h) */
    bool ready, busy, dead;
    ap_buf_t pend;     /* frames written before the negotiation finished */
    ap_p2p_proto_t pr; /* opener: the protocol proposed */
    char name[AP_RT_PROTO_MAX];
};

static void b_open(ap_p2p_stream_t *s);
static bconn_t *adopt(ap_p2pb_t *b, ap_p2p_conn_t *pc);
static void b_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n);
static void b_close(ap_p2p_stream_t *s, int status);

/* The length of the frame whose header starts at h. */
static size_t frame_len(const uint8_t *h)
{
    return HDR + (size_t)ap__get_be16(h + 6);
}

/* ---- frames for the mux ---------------------------------------------------------- */

static void kick_cb(uv_timer_t *t);

static void kick(bconn_t *bc)
{
    if (bc->kick_open && !bc->released && !uv_is_active((uv_handle_t *)&bc->kick))
        uv_timer_start(&bc->kick, kick_cb, 0, 0);
}

static void to_mux(bconn_t *bc, const uint8_t *p, size_t n)
{
    if (bc->released || bc->closed || !bc->up || !bc->conn.cbs.on_read) return;
    bc->conn.cbs.on_read(bc->conn.user, &bc->conn, p, n);
}

static void queue_reset(bconn_t *bc, uint32_t sid, int code, const char *msg)
{
    if (ap__frame_put_reset(&bc->inq, sid, code, msg) == 0) kick(bc);
}

static void kick_cb(uv_timer_t *t)
{
    bconn_t *bc = t->data;
    while (bc->owed) {
        uint32_t d = bc->owed > (1u << 30) ? 1u << 30 : (uint32_t)bc->owed;
        if (ap__frame_put_window(&bc->inq, 0, false, d) != 0) break;
        bc->owed -= d;
    }
    if (bc->inq.len == 0) return;
    ap_buf_t q = bc->inq;
    memset(&bc->inq, 0, sizeof bc->inq);
    to_mux(bc, q.data, q.len);
    ap__buf_free(&q);
}

/* ---- streams ----------------------------------------------------------------------- */

static bstream_t *bs_get(bconn_t *bc, uint32_t sid)
{
    uint64_t v;
    return ap__u64map_get(&bc->streams, sid, &v) ? (bstream_t *)(uintptr_t)v : NULL;
}

static void bs_free(bstream_t *bs)
{
    ap__buf_free(&bs->pend);
    ap__inband_free(&bs->ib);
    free(bs);
}

/* Sends one in-band frame (f, n bytes, our id in it) on bs's yamux stream. */
static void bs_send(bstream_t *bs, const uint8_t *f, size_t n)
{
    bconn_t *bc = bs->bc;
    if (!bs->ps) return;
    if (bs->ib.sid != bs->ib.yid) { /* our id -> the yamux id */
        memcpy(bc->scratch, f, n);
        ap__put_be32(bc->scratch + 2, bs->ib.yid);
        f = bc->scratch;
    }
    if (!bs->ready) {
        if (ap__buf_append(&bs->pend, f, n) != 0) ap__p2p_stream_reset(bs->ps);
        return;
    }
    int rc = ap__p2p_stream_write_all(bs->ps, f, n);
    if (rc == AP_ENOMEM) ap__p2p_stream_reset(bs->ps);
}

static void bs_end_out(bstream_t *bs)
{
    if (bs->ps && bs->ready) ap__p2p_stream_close(bs->ps); /* FIN once the queue is out */
}

/* The mux opened stream sid (f: its OPEN frame). */
static void out_open(bconn_t *bc, const ap_frame_t *f, const uint8_t *frame, size_t n)
{
    uint32_t window;
    bstream_t *bs = calloc(1, sizeof *bs);
    if (!bs) {
        queue_reset(bc, f->sid, AP_ENOMEM, "out of memory");
        return;
    }
    bs->bc = bc;
    bs->ib.sid = f->sid;
    bs->ib.opener = true;
    if (ap__frame_parse_open(f, &window, bs->name, sizeof bs->name) != 0 ||
        ap__u64map_put(&bc->streams, f->sid, (uint64_t)(uintptr_t)bs) != 0) {
        free(bs);
        queue_reset(bc, f->sid, AP_ENOMEM, "cannot open");
        return;
    }
    bs->pr = (ap_p2p_proto_t){bs->name, b_open, b_data, NULL, b_close};
    int rc = AP_EPERM;
    if (bc->conn.relayed && !bc->b->relay_bulk && ap__p2pb_bulk(bs->name)) {
        bc->b->stats.bulk_refused++;
        ap_debug(MOD, "peer %s: %s not opened over a relayed connection (bulk)", bc->who, bs->name);
    } else {
        rc = ap__p2p_stream_open(bc->pc, &bs->pr, bs, &bs->ps);
    }
    if (rc) {
        ap__u64map_del(&bc->streams, f->sid, NULL);
        free(bs);
        queue_reset(bc, f->sid, rc,
                    rc == AP_EPERM ? "bulk traffic does not go through a relay"
                                   : "cannot open a yamux stream");
        return;
    }
    bs->ib.yid = ap__p2p_stream_id(bs->ps);
    bc->b->stats.streams_out++;
    bs_send(bs, frame, n);
}

/* One whole frame the mux wrote. */
static void out_frame(bconn_t *bc, const uint8_t *frame, size_t n)
{
    ap_frame_t f;
    if (ap__frame_parse_hdr(frame, &f) != 0) return; /* our own mux: cannot happen */
    f.payload = frame + AP_FRAME_HDR;
    if (f.sid == 0) {
        if (f.type == AP_FRAME_GOAWAY) ap__p2p_conn_goaway(bc->pc);
        return; /* connection credit stays local */
    }
    if (f.type == AP_FRAME_OPEN) {
        out_open(bc, &f, frame, n);
        return;
    }
    bstream_t *bs = bs_get(bc, f.sid);
    if (!bs || bs->dead) return; /* the stream is gone: the mux learns it from a RESET */
    if (f.type == AP_FRAME_DATA) bc->owed += f.len - ((f.flags & AP_FRAME_F_START) ? 4u : 0u);
    bs_send(bs, frame, n);
    ap__inband_sent(&bs->ib, f.type);
    if (f.type == AP_FRAME_CLOSE || f.type == AP_FRAME_RESET) bs_end_out(bs);
}

/* A yamux stream is negotiated: ours (opener) or one the peer opened. */
static void b_open(ap_p2p_stream_t *s)
{
    bstream_t *bs = ap__p2p_stream_udata(s);
    if (bs) { /* ours: what the mux wrote meanwhile goes out */
        bs->ready = true;
        ap_buf_t q = bs->pend;
        memset(&bs->pend, 0, sizeof bs->pend);
        if (q.len && ap__p2p_stream_write_all(s, q.data, q.len) != 0) {
            ap__buf_free(&q);
            ap__p2p_stream_reset(s);
            return;
        }
        ap__buf_free(&q);
        if (bs->ib.lclose) ap__p2p_stream_close(s);
        return;
    }
    ap_p2p_conn_t *pc = ap__p2p_stream_conn(s);
    bconn_t *bc = ap__p2p_conn_user(pc);
    if (!bc) bc = adopt(ap__p2p_host_bridge_arg(ap__p2p_conn_host(pc)), pc);
    uint32_t id = ap__p2p_stream_id(s);
    if (!bc || !bc->up || bc->released || bc->native || bs_get(bc, id) ||
        !(bs = calloc(1, sizeof *bs))) {
        ap__p2p_stream_reset(s);
        return;
    }
    bs->bc = bc;
    bs->ps = s;
    bs->ib.sid = bs->ib.yid = id;
    bs->ready = true;
    snprintf(bs->name, sizeof bs->name, "%s", ap__p2p_stream_name(s));
    bs->ib.name = bs->name;
    if (ap__u64map_put(&bc->streams, id, (uint64_t)(uintptr_t)bs) != 0) {
        free(bs);
        ap__p2p_stream_reset(s);
        return;
    }
    ap__p2p_stream_set_udata(s, bs);
    bc->b->stats.streams_in++;
}

static int emit(void *arg, const uint8_t *frame, size_t len)
{
    bstream_t *bs = arg;
    to_mux(bs->bc, frame, len);
    return bs->dead || !bs->ps; /* the stream ended while the mux handled it */
}

/* Hands whole checked frames from p (n bytes) to the mux. */
static void in_bytes(bstream_t *bs, const uint8_t *p, size_t n)
{
    bconn_t *bc = bs->bc;
    int rc = ap__inband_feed(&bs->ib, p, n, bc->scratch, emit, bs);
    if (rc >= 0) return;
    ap_warn(MOD, "peer %s: %s on %s stream %u: reset", bc->who,
            rc == AP_EPROTO ? "bad mux frame" : ap_err_name(rc), bs->name, (unsigned)bs->ib.yid);
    if (rc == AP_EPROTO) bc->b->stats.bad_frames++;
    if (bs->ps) ap__p2p_stream_reset(bs->ps);
}

static void b_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    bstream_t *bs = ap__p2p_stream_udata(s);
    if (!bs) return;
    bs->busy = true;
    in_bytes(bs, p, n);
    bs->busy = false;
    if (bs->dead) bs_free(bs);
}

static void b_close(ap_p2p_stream_t *s, int status)
{
    bstream_t *bs = ap__p2p_stream_udata(s);
    if (!bs) return;
    bconn_t *bc = bs->bc;
    bs->ps = NULL;
    /* the mux learns that its stream is gone (inband.h) */
    if (bc->pc && ap__inband_orphaned(&bs->ib, status))
        queue_reset(bc, bs->ib.sid, status ? status : AP_ERESET,
                    status == AP_ENOPROTO ? "protocol not served" : "yamux stream ended");
    ap__u64map_del(&bc->streams, bs->ib.sid, NULL);
    bs->dead = true;
    if (!bs->busy) bs_free(bs);
}

static const ap_p2p_proto_t inbound_proto = {"", b_open, b_data, NULL, b_close};

/* ---- the connection ------------------------------------------------------------------ */

static int c_write(ap_conn_t *c, const uint8_t *p, size_t n);
static void c_close(ap_conn_t *c);
static const ap_conn_vt_t bridge_vt = {.write = c_write, .close = c_close};

static void bc_maybe_free(bconn_t *bc)
{
    if (!bc->released || bc->pc || bc->kick_open || bc->dialing) return;
    ap__u64map_free(&bc->streams);
    ap__buf_free(&bc->part);
    ap__buf_free(&bc->inq);
    free(bc);
}

static void kick_closed(uv_handle_t *h)
{
    bconn_t *bc = h->data;
    bc->kick_open = false;
    bc_maybe_free(bc);
}

static int backlog(bconn_t *bc)
{
    if (ap__p2p_conn_backlog(bc->pc) <= HIGH_WATER) return 0;
    bc->blocked = true;
    ap__p2p_conn_want_drain(bc->pc, HIGH_WATER / 2);
    return 1;
}

static int c_write(ap_conn_t *c, const uint8_t *p, size_t n)
{
    bconn_t *bc = (bconn_t *)c;
    if (!bc->pc || !bc->up || bc->released) return AP_ECLOSED;
    if (bc->native) {
        int rc = ap__p2p_conn_write(bc->pc, p, n);
        return rc ? rc : backlog(bc);
    }
    while (n && bc->pc) {
        if (bc->part.len) { /* complete the frame begun in an earlier write */
            size_t have = bc->part.len;
            size_t need = have < HDR ? HDR - have : frame_len(bc->part.data) - have;
            size_t k = n < need ? n : need;
            if (ap__buf_append(&bc->part, p, k) != 0) return AP_ENOMEM;
            p += k;
            n -= k;
            if (bc->part.len < HDR || bc->part.len < frame_len(bc->part.data)) continue;
            ap_buf_t q = bc->part;
            memset(&bc->part, 0, sizeof bc->part);
            out_frame(bc, q.data, q.len);
            ap__buf_free(&q);
            continue;
        }
        size_t flen = n >= HDR ? frame_len(p) : SIZE_MAX;
        if (n < flen) {
            if (ap__buf_append(&bc->part, p, n) != 0) return AP_ENOMEM;
            break;
        }
        out_frame(bc, p, flen);
        p += flen;
        n -= flen;
    }
    if (!bc->pc) return AP_ECLOSED;
    if (bc->owed >= CREDIT_BACK) kick(bc);
    return backlog(bc);
}

static void c_close(ap_conn_t *c)
{
    bconn_t *bc = (bconn_t *)c;
    bc->released = true;
    if (bc->kick_open) uv_close((uv_handle_t *)&bc->kick, kick_closed);
    if (bc->pc) ap__p2p_conn_close(bc->pc); /* its on_close frees bc */
    bc_maybe_free(bc);
}

static void pc_ready(ap_p2p_conn_t *pc, void *arg)
{
    bconn_t *bc = arg;
    if (bc->up || bc->released) return;
    bc->up = true;
    bc->native = ap__p2p_conn_native(pc);
    if (bc->native)
        bc->b->stats.conns_native++;
    else
        bc->b->stats.conns_yamux++;
    bc->conn.relayed = ap__p2p_conn_relayed(pc);
    if (bc->conn.relayed) bc->b->stats.relayed_out++;
    bc->conn.remote = *ap__p2p_conn_peer(pc);
    ap_peer_id_short(&bc->conn.remote, bc->who);
    if (bc->conn.cbs.on_up) bc->conn.cbs.on_up(bc->conn.user, &bc->conn, &bc->conn.remote);
}

static void pc_close(ap_p2p_conn_t *pc, void *arg, int status)
{
    bconn_t *bc = arg;
    (void)pc;
    bc->pc = NULL;
    if (!bc->released && !bc->closed) {
        bc->closed = true;
        int st = status == 0 ? AP_ECLOSED : status;
        if (bc->conn.cbs.on_close) bc->conn.cbs.on_close(bc->conn.user, &bc->conn, st);
    }
    bc_maybe_free(bc);
}

static void pc_data(ap_p2p_conn_t *pc, void *arg, const uint8_t *p, size_t n)
{
    (void)pc;
    to_mux(arg, p, n);
}

static void pc_drain(ap_p2p_conn_t *pc, void *arg)
{
    bconn_t *bc = arg;
    (void)pc;
    if (!bc->blocked || bc->released) return;
    bc->blocked = false;
    if (bc->conn.cbs.on_drain) bc->conn.cbs.on_drain(bc->conn.user, &bc->conn);
}

static void pc_goaway(ap_p2p_conn_t *pc, void *arg)
{
    bconn_t *bc = arg;
    (void)pc;
    if (ap__frame_put_goaway(&bc->inq) == 0) kick(bc);
}

static const ap_p2p_conn_cbs_t pc_cbs = {pc_ready, pc_close};
static const ap_p2p_conn_xcbs_t pc_xcbs = {pc_data, pc_drain, pc_goaway};

static bconn_t *bc_new(ap_p2pb_t *b, bool dialer)
{
    bconn_t *bc = calloc(1, sizeof *bc);
    if (!bc) return NULL;
    bc->conn.vt = &bridge_vt;
    bc->conn.dialer = dialer;
    bc->b = b;
    if (uv_timer_init(b->loop, &bc->kick) != 0) {
        free(bc);
        return NULL;
    }
    bc->kick.data = bc;
    bc->kick_open = true;
    snprintf(bc->who, sizeof bc->who, "(dialing)");
    return bc;
}

static void bc_discard(bconn_t *bc)
{
    bc->released = true;
    uv_close((uv_handle_t *)&bc->kick, kick_closed);
}

/* ---- the host's side --------------------------------------------------------------- */

static bool serves(void *arg, const char *proto)
{
    ap_p2pb_t *b = arg;
    return b->node && !atomic_load(&b->node->closing) &&
           (ap__rt_find_handler(&b->node->rt, proto) || ap__rt_find_listener(&b->node->rt, proto));
}

bool ap__p2pb_bulk(const char *proto)
{
    static const char *const bulk[] = {AP_AVG_PROTO, AP_COLLAB_STATE_PROTO, AP_MASHA_PROTO,
                                       AP_MASHA_PROTO2, AP_MASHA_PROTO3};
    for (size_t i = 0; i < sizeof bulk / sizeof bulk[0]; i++)
        if (strcmp(proto, bulk[i]) == 0) return true;
    return false;
}

/* A relayed connection carries the node's control protocols (DHT,
 * matchmaking, progress), its bulk ones only when the node allows it. */
static bool serves_relayed(void *arg, const char *proto)
{
    ap_p2pb_t *b = arg;
    if (!serves(arg, proto)) return false;
    if (b->relay_bulk || !ap__p2pb_bulk(proto)) return true;
    b->stats.bulk_refused++;
    return false;
}

/* An inbound connection becomes one of the node's when the node's protocols
 * first travel on it: its first mux bytes (native) or the first stream
 * named for one of them (yamux). Until then it serves identify, ping and
 * AutoNAT only, so a connection that is not the peer's mux (an AutoNAT
 * dial-back, a peer's one-shot identify) never competes with the peer's
 * real connection in the node. */
static bconn_t *adopt_as(ap_p2pb_t *b, ap_p2p_conn_t *pc, bool dialer)
{
    if (!b->node || atomic_load(&b->node->closing)) return NULL;
    bconn_t *bc = bc_new(b, dialer);
    if (!bc) return NULL;
    bc->pc = pc;
    bc->up = true;
    bc->native = ap__p2p_conn_native(pc);
    if (bc->native)
        b->stats.conns_native++;
    else
        b->stats.conns_yamux++;
    bc->conn.relayed = ap__p2p_conn_relayed(pc);
    if (bc->conn.relayed) b->stats.relayed_in++;
    bc->conn.remote = *ap__p2p_conn_peer(pc);
    ap_peer_id_short(&bc->conn.remote, bc->who);
    ap__p2p_conn_set_cbs(pc, &pc_cbs, &pc_xcbs, bc);
    ap__p2p_conn_set_user(pc, bc);
    ap__node_accept_conn(b->node, &bc->conn);
    return bc;
}

static bconn_t *adopt(ap_p2pb_t *b, ap_p2p_conn_t *pc)
{
    return ap__p2p_conn_initiator(pc) ? NULL : adopt_as(b, pc, false);
}

void ap__p2pb_take(ap_p2pb_t *b, ap_p2p_conn_t *pc)
{
    if (ap__p2p_conn_user(pc)) return; /* already the node's */
    if (adopt_as(b, pc, ap__p2p_conn_initiator(pc))) b->stats.direct_taken++;
}

static void pending_data(ap_p2p_conn_t *pc, void *arg, const uint8_t *p, size_t n)
{
    bconn_t *bc = adopt(arg, pc);
    if (bc)
        to_mux(bc, p, n);
    else
        ap__p2p_conn_close(pc);
}

static const ap_p2p_conn_cbs_t pending_cbs = {NULL, NULL};
static const ap_p2p_conn_xcbs_t pending_xcbs = {pending_data, NULL, NULL};

static void on_conn(void *arg, ap_p2p_conn_t *pc)
{
    if (ap__p2p_conn_native(pc)) ap__p2p_conn_set_cbs(pc, &pending_cbs, &pending_xcbs, arg);
}

int ap__p2pb_init(ap_p2pb_t *b, ap_node_t *n, uv_loop_t *loop, bool native)
{
    b->node = n;
    b->loop = loop;
    b->ops = (ap_p2p_bridge_t){native, serves, serves_relayed, &inbound_proto, on_conn};
    return 0;
}

int ap__p2pb_dial(ap_p2pb_t *b, ap_p2p_host_t *h, const char *addr, ap_conn_t **out)
{
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) != 0) return AP_EADDR;
    bconn_t *bc = bc_new(b, true);
    if (!bc) return AP_ENOMEM;
    ap_p2p_conn_t *pc = NULL;
    int rc = ap__p2p_dial(h, &ma, &pc_cbs, bc, &pc);
    if (rc) {
        bc_discard(bc);
        return rc;
    }
    if (!pc) { /* failed at once: its on_close reports it from the loop */
        *out = &bc->conn;
        return 0;
    }
    bc->pc = pc;
    ap__p2p_conn_set_cbs(pc, &pc_cbs, &pc_xcbs, bc);
    ap__p2p_conn_set_user(pc, bc);
    *out = &bc->conn;
    return 0;
}

/* ---- through a circuit relay ---------------------------------------------------------- */

static void circ_ready(ap_p2p_conn_t *pc, void *arg)
{
    bconn_t *bc = arg;
    bc->dialing = false;
    bc->pc = pc;
    ap__p2p_conn_set_cbs(pc, &pc_cbs, &pc_xcbs, bc);
    ap__p2p_conn_set_user(pc, bc);
    if (bc->released) { /* the mux gave up meanwhile: its on_close frees bc */
        ap__p2p_conn_close(pc);
        return;
    }
    pc_ready(pc, bc);
}

static void circ_closed(ap_p2p_conn_t *pc, void *arg, int status)
{
    bconn_t *bc = arg;
    bc->dialing = false;
    if (bc->in_dial) { /* failed at once: the dial returns it */
        bc->dial_err = status ? status : AP_EUNREACH;
        return;
    }
    pc_close(pc, bc, status ? status : AP_EUNREACH);
}

static const ap_p2p_conn_cbs_t circ_cbs = {circ_ready, circ_closed};

int ap__p2pb_dial_circuit(ap_p2pb_t *b, ap_p2p_host_t *h, const ap_multiaddr_t *ma, ap_conn_t **out)
{
    bconn_t *bc = bc_new(b, true);
    if (!bc) return AP_ENOMEM;
    bc->conn.relayed = true;
    bc->dialing = bc->in_dial = true;
    int rc = ap__circuit_dial(h, ma, &circ_cbs, bc);
    bc->in_dial = false;
    if (rc == 0 && bc->dial_err) rc = bc->dial_err;
    if (rc) {
        bc->dialing = false;
        bc_discard(bc);
        return rc;
    }
    *out = &bc->conn;
    return 0;
}
