/* The circuit relay v2 service (see relay_svc.h). */
#include "p2p/relay_svc.h"
#include "apiary/error.h"
#include "apiary/log.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SWEEP_MS 500

struct ap_relay_service {
    ap_p2p_proto_t hop; /* first: a stream's proto leads back here */
    ap_p2p_proto_t stop;
    ap_p2p_host_t *h;
    ap_relay_t r;
    ap_relay_svc_stats_t st;
    uv_timer_t sweep; /* circuits over their duration are reset */
    struct circ *circs;
};

enum { C_READ, C_WAIT_STOP, C_SPLICE, C_DONE };

typedef struct circ {
    ap_relay_service_t *svc;
    int state;
    uint64_t id; /* in svc->r, 0 before CONNECT was accepted */
    ap_p2p_stream_t *src, *dst;
    ap_peer_id_t src_peer;
    ap_relay_rd_t rd;
    struct circ *next, *prev; /* svc->circs, while a circuit id is held */
} circ_t;

static ap_relay_msg_t msg; /* loop thread only */
static uint8_t obuf[AP_RELAY_MSG_MAX + 16];

static uint64_t now_us(const ap_relay_service_t *svc)
{
    return uv_now(ap__p2p_host_loop(svc->h)) * 1000ull;
}

static const char *who(ap_p2p_stream_t *s, char b[AP_PEER_SHORT_LEN])
{
    const ap_peer_id_t *p = ap__p2p_conn_peer(ap__p2p_stream_conn(s));
    return p ? ap_peer_id_short(p, b) : "(unknown)";
}

static void send_msg(ap_p2p_stream_t *s, const ap_relay_msg_t *m)
{
    int n = ap__relay_encode(m, obuf, sizeof obuf);
    if (n > 0) ap__p2p_stream_write(s, obuf, (size_t)n);
}

static void set_limit(ap_relay_msg_t *m, const ap_relay_limits_t *l)
{
    m->has_limit = m->has_duration = m->has_data = true;
    m->duration = (uint32_t)(l->circuit_duration_us / 1000000u);
    m->data = l->circuit_bytes;
}

static void hop_status(ap_p2p_stream_t *s, int status, bool close)
{
    memset(&msg, 0, sizeof msg);
    msg.type = AP_RELAY_HOP_STATUS;
    msg.has_status = true;
    msg.status = status;
    send_msg(s, &msg);
    if (close) ap__p2p_stream_close(s);
}

static void circ_unlink(circ_t *c)
{
    if (!c->id) return;
    ap__relay_circuit_end(&c->svc->r, c->id);
    c->id = 0;
    if (c->next) c->next->prev = c->prev;
    if (c->prev)
        c->prev->next = c->next;
    else
        c->svc->circs = c->next;
    c->next = c->prev = NULL;
}

/* Resets both sides; each on_close clears its pointer, the last frees c. */
static void circ_reset(circ_t *c)
{
    c->state = C_DONE;
    circ_unlink(c);
    ap_p2p_stream_t *a = c->src, *b = c->dst; /* c may be gone after the first */
    if (a) ap__p2p_stream_reset(a);
    if (b) ap__p2p_stream_reset(b);
}

static void circ_side_closed(circ_t *c, ap_p2p_stream_t *s)
{
    if (c->src == s) c->src = NULL;
    if (c->dst == s) c->dst = NULL;
    if (c->src || c->dst) {
        if (c->state != C_DONE) circ_reset(c);
        return;
    }
    circ_unlink(c);
    free(c);
}

/* Bytes from one side go to the other, counted against the limits. */
static void circ_copy(circ_t *c, ap_p2p_stream_t *from, const uint8_t *p, size_t n)
{
    ap_p2p_stream_t *to = from == c->src ? c->dst : c->src;
    if (!to) return;
    ap_relay_service_t *svc = c->svc;
    char b[AP_PEER_SHORT_LEN];
    if (ap__relay_account(&svc->r, c->id, n, now_us(svc)) != 0) {
        ap_info("relay", "peer %s: circuit reset: over its limit (%llu bytes, %llu s)",
                ap_peer_id_short(&c->src_peer, b), (unsigned long long)svc->r.lim.circuit_bytes,
                (unsigned long long)(svc->r.lim.circuit_duration_us / 1000000u));
        svc->st.circ_reset++;
        circ_reset(c);
        return;
    }
    svc->st.bytes += n;
    if (ap__p2p_stream_write(to, p, n) != 0) {
        ap_info("relay", "peer %s: circuit reset: its peer does not read", who(to, b));
        svc->st.circ_reset++;
        circ_reset(c);
    }
}

/* ---- the stop stream to the reserved peer ------------------------------------- */

static void stop_open(ap_p2p_stream_t *s)
{
    circ_t *c = ap__p2p_stream_udata(s);
    memset(&msg, 0, sizeof msg);
    msg.stop = true;
    msg.type = AP_RELAY_STOP_CONNECT;
    msg.has_peer = true;
    msg.peer = c->src_peer;
    set_limit(&msg, &c->svc->r.lim);
    send_msg(s, &msg);
}

static void stop_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    circ_t *c = ap__p2p_stream_udata(s);
    char b[AP_PEER_SHORT_LEN];
    if (c->state == C_SPLICE) {
        circ_copy(c, s, p, n);
        return;
    }
    if (c->state != C_WAIT_STOP) return;
    size_t used;
    int rc = ap__relay_rd_feed(&c->rd, true, p, n, &msg, &used);
    if (rc == 0) return;
    if (rc < 0 || msg.type != AP_RELAY_STOP_STATUS || msg.status != AP_RELAY_OK) {
        ap_info("relay", "peer %s: refused a circuit: %s", who(s, b),
                rc < 0 ? ap_err_name(rc) : ap__relay_status_name(msg.status));
        c->svc->st.circ_refused++;
        c->state = C_DONE;
        circ_unlink(c);
        if (c->src) hop_status(c->src, AP_RELAY_CONNECTION_FAILED, true);
        ap__p2p_stream_reset(s);
        return;
    }
    memset(&msg, 0, sizeof msg);
    msg.type = AP_RELAY_HOP_STATUS;
    msg.has_status = true;
    msg.status = AP_RELAY_OK;
    set_limit(&msg, &c->svc->r.lim);
    if (c->src) send_msg(c->src, &msg);
    c->svc->st.circuits++;
    c->state = C_SPLICE;
    if (n > used) circ_copy(c, s, p + used, n - used);
}

static void side_fin(ap_p2p_stream_t *s)
{
    circ_t *c = ap__p2p_stream_udata(s);
    if (!c || c->state != C_SPLICE) return;
    ap_p2p_stream_t *to = s == c->src ? c->dst : c->src;
    if (to) ap__p2p_stream_close(to);
}

static void side_close(ap_p2p_stream_t *s, int st)
{
    (void)st;
    circ_t *c = ap__p2p_stream_udata(s);
    if (!c) return;
    if (c->state == C_WAIT_STOP && s == c->dst && c->src) {
        c->state = C_DONE;
        c->svc->st.circ_refused++;
        circ_unlink(c);
        hop_status(c->src, AP_RELAY_CONNECTION_FAILED, true);
    }
    circ_side_closed(c, s);
}

/* ---- the hop stream ------------------------------------------------------------ */

static void hop_open(ap_p2p_stream_t *s)
{
    ap_relay_service_t *svc = (ap_relay_service_t *)ap__p2p_stream_proto(s);
    circ_t *c = calloc(1, sizeof *c);
    if (!c) {
        ap__p2p_stream_reset(s);
        return;
    }
    c->svc = svc;
    c->src = s;
    ap__p2p_stream_set_udata(s, c);
}

static bool disconnected(void *arg, const ap_peer_id_t *peer)
{
    return ap__p2p_host_find(arg, peer, AP_P2P_FIND_DIRECT) == NULL;
}

static void do_reserve(circ_t *c, ap_p2p_stream_t *s, ap_p2p_conn_t *conn)
{
    ap_relay_service_t *svc = c->svc;
    char b[AP_PEER_SHORT_LEN], why[96] = "";
    uint64_t exp_us = 0;
    ap__relay_drop_if(&svc->r, disconnected, svc->h); /* a reservation ends with its connection */
    int st = ap__relay_reserve(&svc->r, ap__p2p_conn_peer(conn), ap__p2p_conn_remote(conn),
                               now_us(svc), &exp_us, why, sizeof why);
    if (st != AP_RELAY_OK) {
        ap_info("relay", "peer %s: reservation refused: %s", who(s, b), why);
        svc->st.resv_refused++;
        hop_status(s, st, true);
        return;
    }
    svc->st.reserved++;
    memset(&msg, 0, sizeof msg);
    msg.type = AP_RELAY_HOP_STATUS;
    msg.has_status = true;
    msg.status = AP_RELAY_OK;
    msg.has_reservation = true;
    msg.expire = (uint64_t)time(NULL) + (exp_us - now_us(svc)) / 1000000u;
    int k = ap__p2p_host_addrs(svc->h, msg.raddrs, AP_RELAY_ADDRS_MAX);
    for (int i = 0; i < k; i++)
        if (!msg.raddrs[i].circuit) msg.raddrs[msg.nraddrs++] = msg.raddrs[i];
    set_limit(&msg, &svc->r.lim);
    send_msg(s, &msg);
    ap__p2p_stream_close(s);
}

static void do_connect(circ_t *c, ap_p2p_stream_t *s, ap_p2p_conn_t *conn)
{
    ap_relay_service_t *svc = c->svc;
    char b[AP_PEER_SHORT_LEN], why[96] = "";
    if (!msg.has_peer || msg.peer_other) {
        ap_info("relay", "peer %s: CONNECT without a usable peer id", who(s, b));
        svc->st.circ_refused++;
        hop_status(s, AP_RELAY_MALFORMED_MESSAGE, true);
        return;
    }
    ap_peer_id_t dst = msg.peer;
    c->src_peer = *ap__p2p_conn_peer(conn);
    uint64_t id = 0;
    int st = ap__relay_connect(&svc->r, &c->src_peer, &dst, now_us(svc), &id, why, sizeof why);
    ap_p2p_conn_t *to =
        st == AP_RELAY_OK ? ap__p2p_host_find(svc->h, &dst, AP_P2P_FIND_DIRECT) : NULL;
    if (st == AP_RELAY_OK && !to) {
        ap__relay_circuit_end(&svc->r, id);
        st = AP_RELAY_CONNECTION_FAILED;
        snprintf(why, sizeof why, "the reserved peer is not connected");
    }
    if (st != AP_RELAY_OK) {
        ap_info("relay", "peer %s: circuit refused: %s", who(s, b), why);
        svc->st.circ_refused++;
        hop_status(s, st, true);
        return;
    }
    c->id = id;
    c->next = svc->circs;
    if (svc->circs) svc->circs->prev = c;
    svc->circs = c;
    c->state = C_WAIT_STOP;
    if (ap__p2p_stream_open(to, &svc->stop, c, &c->dst) != 0) {
        c->dst = NULL;
        c->state = C_DONE;
        svc->st.circ_refused++;
        circ_unlink(c);
        hop_status(s, AP_RELAY_CONNECTION_FAILED, true);
    }
}

static void hop_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    circ_t *c = ap__p2p_stream_udata(s);
    char b[AP_PEER_SHORT_LEN];
    if (!c) return;
    if (c->state == C_SPLICE) {
        circ_copy(c, s, p, n);
        return;
    }
    if (c->state != C_READ) { /* bytes before the circuit opened */
        ap_info("relay", "peer %s: data before the circuit opened", who(s, b));
        circ_reset(c);
        return;
    }
    size_t used;
    int rc = ap__relay_rd_feed(&c->rd, false, p, n, &msg, &used);
    if (rc == 0) return;
    ap_p2p_conn_t *conn = ap__p2p_stream_conn(s);
    if (rc < 0) {
        ap_info("relay", "peer %s: malformed hop message: %s", who(s, b), ap_err_name(rc));
        c->state = C_DONE;
        hop_status(s, AP_RELAY_MALFORMED_MESSAGE, true);
        return;
    }
    c->state = C_DONE;
    if (ap__p2p_conn_relayed(conn)) {
        ap_info("relay", "peer %s: hop request over a relayed connection refused", who(s, b));
        hop_status(s, AP_RELAY_PERMISSION_DENIED, true);
        return;
    }
    if (msg.type == AP_RELAY_HOP_RESERVE)
        do_reserve(c, s, conn);
    else if (msg.type == AP_RELAY_HOP_CONNECT && n == used)
        do_connect(c, s, conn);
    else {
        ap_info("relay", "peer %s: unexpected hop message %d", who(s, b), msg.type);
        hop_status(s, AP_RELAY_UNEXPECTED_MESSAGE, true);
    }
}

static void sweep(uv_timer_t *t)
{
    ap_relay_service_t *svc = t->data;
    uint64_t now = now_us(svc);
    circ_t *c = svc->circs;
    while (c) {
        circ_t *next = c->next;
        if (c->state == C_SPLICE && ap__relay_account(&svc->r, c->id, 0, now) != 0) {
            char b[AP_PEER_SHORT_LEN];
            ap_info("relay", "peer %s: circuit reset: over its duration",
                    ap_peer_id_short(&c->src_peer, b));
            svc->st.circ_reset++;
            circ_reset(c); /* may free c; next is still linked */
        }
        c = next;
    }
}

ap_relay_service_t *ap__relay_serve(ap_p2p_host_t *h, const ap_relay_limits_t *lim)
{
    ap_relay_service_t *svc = calloc(1, sizeof *svc);
    if (!svc) return NULL;
    ap_relay_limits_t def;
    ap__relay_limits_default(&def);
    if (ap__relay_init(&svc->r, lim ? lim : &def) != 0) {
        free(svc);
        return NULL;
    }
    svc->h = h;
    svc->hop = (ap_p2p_proto_t){AP_RELAY_HOP_PROTO, hop_open, hop_data, side_fin, side_close};
    svc->stop = (ap_p2p_proto_t){AP_RELAY_STOP_PROTO, stop_open, stop_data, side_fin, side_close};
    if (ap__p2p_host_serve(h, &svc->hop) != 0) {
        ap__relay_free(&svc->r);
        free(svc);
        return NULL;
    }
    uv_timer_init(ap__p2p_host_loop(h), &svc->sweep);
    svc->sweep.data = svc;
    uv_timer_start(&svc->sweep, sweep, SWEEP_MS, SWEEP_MS);
    uv_unref((uv_handle_t *)&svc->sweep);
    return svc;
}

static void svc_closed(uv_handle_t *hd)
{
    ap_relay_service_t *svc = hd->data;
    ap__relay_free(&svc->r);
    free(svc);
}

void ap__relay_service_free(ap_relay_service_t *svc)
{
    if (!svc) return;
    uv_close((uv_handle_t *)&svc->sweep, svc_closed);
}

ap_relay_svc_stats_t ap__relay_service_stats(const ap_relay_service_t *svc)
{
    return svc->st;
}

size_t ap__relay_service_circuits(const ap_relay_service_t *svc)
{
    return ap__relay_circuits(&svc->r);
}
