/* DCUtR hole punching on a libp2p host (see dcutr_uv.h). */
#include "p2p/dcutr_uv.h"
#include "apiary/error.h"
#include "apiary/log.h"

#include <stdlib.h>
#include <string.h>

#define DIAL_TRIES 32  /* per address and attempt */
#define TICK_MS    20  /* while dialling: is there a direct connection yet? */
#define RESYN_MS   200 /* a SYN unanswered this long (dropped by B's NAT): dial again */
#define REDIAL_MS  40  /* after a refusal (B's NAT answered RST) */
#define PRIME_MS   250 /* B opens its NAT again this often */

enum { P_CONNECT_SENT, P_SYNC_WAIT, P_WAIT_CONNECT, P_WAIT_SYNC, P_DIALING, P_GRACE, P_END };

struct ap_dcutr {
    ap_p2p_proto_t proto; /* first: a stream's proto leads back here */
    ap_p2p_host_t *h;
    ap_dcutr_opts_t o;
    ap_dcutr_result_fn cb;
    void *arg;
    ap_dcutr_stats_t st;
    struct punch *punches;
    size_t npunch;
    bool freeing;
};

typedef struct pdial {
    struct punch *p; /* NULL once the punch moved on */
    int idx;
    uint64_t t0; /* uv_now of the dial */
    ap_p2p_conn_t *c;
} pdial_t;

typedef struct punch {
    ap_dcutr_t *d;
    ap_peer_id_t peer;
    char who[AP_PEER_SHORT_LEN];
    bool b_side;
    int state, attempt;
    ap_p2p_stream_t *s;
    ap_dcutr_rd_t rd;
    uint64_t t_start, t_connect; /* uv_hrtime */
    uint64_t deadline;           /* uv_now */
    ap_multiaddr_t their[AP_DCUTR_DIAL_MAX];
    size_t ntheir;
    pdial_t *dials[AP_DCUTR_DIAL_MAX];
    int tries[AP_DCUTR_DIAL_MAX];
    uint64_t next_try[AP_DCUTR_DIAL_MAX];
    uv_timer_t timer;
    struct punch *next, *prev;
} punch_t;

static ap_dcutr_msg_t msg; /* loop thread only */
static uint8_t obuf[AP_DCUTR_MSG_MAX + 16];

static void punch_tick(uv_timer_t *t);
static void attempt_fail(punch_t *p, int status);
static void begin_attempt(punch_t *p);

static void later(punch_t *p, uint64_t ms)
{
    uv_timer_start(&p->timer, punch_tick, ms, 0);
}

static uv_loop_t *loop_of(const ap_dcutr_t *d)
{
    return ap__p2p_host_loop(d->h);
}

static void send_msg(ap_p2p_stream_t *s, ap_dcutr_t *d, int type)
{
    memset(&msg, 0, sizeof msg);
    msg.type = type;
    if (type == AP_DCUTR_CONNECT) {
        ap_multiaddr_t a[AP_DCUTR_ADDRS_MAX];
        int k = d->o.addrs ? d->o.addrs(d->o.addrs_arg, a, AP_DCUTR_ADDRS_MAX)
                           : ap__p2p_host_addrs(d->h, a, AP_DCUTR_ADDRS_MAX);
        k = k < 0 ? 0 : k > AP_DCUTR_ADDRS_MAX ? AP_DCUTR_ADDRS_MAX : k;
        for (int i = 0; i < k; i++)
            if (!a[i].circuit && a[i].has_tcp && a[i].host != AP_MA_HOST_NONE)
                msg.addrs[msg.naddrs++] = a[i];
    }
    int n = ap__dcutr_encode(&msg, obuf, sizeof obuf);
    if (n > 0) ap__p2p_stream_write(s, obuf, (size_t)n);
}

/* ---- dials --------------------------------------------------------------------------- */

static void pd_ready(ap_p2p_conn_t *c, void *arg);
static void pd_closed(ap_p2p_conn_t *c, void *arg, int status);
static const ap_p2p_conn_cbs_t pd_cbs = {pd_ready, pd_closed};

static void dial_one(punch_t *p, int idx)
{
    ap_dcutr_t *d = p->d;
    pdial_t *pd = calloc(1, sizeof *pd);
    if (!pd) return;
    pd->p = p;
    pd->idx = idx;
    pd->t0 = uv_now(loop_of(d));
    p->tries[idx]++;
    p->next_try[idx] = pd->t0 + REDIAL_MS;
    ap_multiaddr_t ma = p->their[idx];
    ma.has_peer = true;
    ma.peer = p->peer;
    /* A is the client of the connection, B the server (the protocol's roles) */
    int rc = ap__p2p_dial_from(d->h, &ma, d->o.port, !p->b_side, &pd_cbs, pd, &pd->c);
    if (rc) {
        ap_debug("dcutr", "peer %s: dial failed: %s", p->who, ap_err_name(rc));
        d->st.refused_dials++;
        free(pd);
        return;
    }
    p->dials[idx] = pd;
}

static const ap_p2p_conn_cbs_t no_cbs = {NULL, NULL};

/* The punch moves on: its dials are closed except keep (the winner), whose
 * callbacks the punch lets go of. */
static void detach_dials(punch_t *p, ap_p2p_conn_t *keep)
{
    for (size_t i = 0; i < AP_DCUTR_DIAL_MAX; i++) {
        pdial_t *pd = p->dials[i];
        if (!pd) continue;
        p->dials[i] = NULL;
        pd->p = NULL;
        if (pd->c && pd->c == keep) {
            /* unless another owner (the node, for a connection it accepted) has it */
            if (ap__p2p_conn_arg(keep) == pd) ap__p2p_conn_set_cbs(keep, &no_cbs, NULL, NULL);
            free(pd);
        } else if (pd->c) {
            ap__p2p_conn_close(pd->c);
        }
    }
}

static void dial_all(punch_t *p)
{
    uint64_t now = uv_now(loop_of(p->d));
    p->state = P_DIALING;
    p->deadline = now + p->d->o.attempt_ms;
    for (size_t i = 0; i < AP_DCUTR_DIAL_MAX; i++) {
        p->tries[i] = 0;
        p->next_try[i] = now;
    }
    for (size_t i = 0; i < p->ntheir; i++) dial_one(p, (int)i);
    later(p, TICK_MS);
}

static void success(punch_t *p, ap_p2p_conn_t *c)
{
    ap_dcutr_t *d = p->d;
    double ms = (double)(uv_hrtime() - p->t_start) / 1e6;
    detach_dials(p, c);
    d->st.direct++;
    ap_info("dcutr", "peer %s: direct connection after %d attempt(s), %.0f ms", p->who, p->attempt,
            ms);
    p->state = P_GRACE;
    later(p, d->o.grace_ms);
    if (d->cb) d->cb(d->arg, &p->peer, p->b_side, 0, p->attempt, ms, c);
}

static void pd_ready(ap_p2p_conn_t *c, void *arg)
{
    pdial_t *pd = arg;
    punch_t *p = pd->p;
    if (!p || p->state != P_DIALING) {
        ap__p2p_conn_close(c);
        return;
    }
    success(p, c);
}

/* While dialling: a direct connection (one of ours, or one the listener
 * accepted from the peer) ends the attempt; what was refused (a NAT
 * answering RST) or is unanswered (a NAT dropping an early SYN) is dialled
 * again from the same port. */
static void dialling_tick(punch_t *p)
{
    ap_dcutr_t *d = p->d;
    uint64_t now = uv_now(loop_of(d));
    ap_p2p_conn_t *c = ap__p2p_host_find(d->h, &p->peer, AP_P2P_FIND_DIRECT);
    if (c) {
        success(p, c);
        return;
    }
    if (now >= p->deadline) {
        attempt_fail(p, AP_ETIMEDOUT);
        return;
    }
    for (size_t i = 0; i < p->ntheir; i++) {
        pdial_t *pd = p->dials[i];
        /* pd->c is NULL while a dial that failed to start is closing (pd_closed ends it) */
        if (pd && pd->c && now - pd->t0 >= RESYN_MS &&
            ap__p2p_conn_remote(pd->c)->host == AP_MA_HOST_NONE) { /* SYN dropped: a fresh one */
            p->dials[i] = NULL;
            pd->p = NULL;
            ap__p2p_conn_close(pd->c);
            pd = NULL;
        }
        if (!pd && p->tries[i] < DIAL_TRIES && now >= p->next_try[i]) dial_one(p, (int)i);
    }
    later(p, TICK_MS);
}

static void pd_closed(ap_p2p_conn_t *c, void *arg, int status)
{
    pdial_t *pd = arg;
    punch_t *p = pd->p;
    (void)c;
    if (p && p->dials[pd->idx] == pd) {
        int idx = pd->idx;
        p->dials[idx] = NULL;
        if (status != AP_ESHUTDOWN) p->d->st.refused_dials++;
        /* Refused (the peer's NAT answered our SYN with a RST because its
         * own SYN had not opened the mapping yet): dial again at once, so
         * that our fresh SYN reopens our mapping while the peer's SYN is on
         * its way. Bounded by DIAL_TRIES and the attempt's deadline; other
         * failures wait for dialling_tick. */
        if (status == AP_EUNREACH && p->state == P_DIALING && p->tries[idx] < DIAL_TRIES &&
            uv_now(loop_of(p->d)) < p->deadline) {
            p->d->st.redials++;
            dial_one(p, idx);
        }
    }
    free(pd);
}

/* ---- the punch -------------------------------------------------------------------------- */

static void punch_closed(uv_handle_t *hd)
{
    punch_t *p = hd->data;
    ap_dcutr_t *d = p->d;
    free(p);
    if (--d->npunch == 0 && d->freeing) free(d);
}

static void punch_end(punch_t *p)
{
    if (p->state == P_END) return;
    p->state = P_END;
    detach_dials(p, NULL);
    if (p->s) {
        ap_p2p_stream_t *s = p->s;
        p->s = NULL;
        ap__p2p_stream_set_udata(s, NULL);
        ap__p2p_stream_reset(s);
    }
    ap_dcutr_t *d = p->d;
    if (p->next) p->next->prev = p->prev;
    if (p->prev)
        p->prev->next = p->next;
    else
        d->punches = p->next;
    uv_close((uv_handle_t *)&p->timer, punch_closed);
}

static punch_t *punch_new(ap_dcutr_t *d, const ap_peer_id_t *peer, bool b_side)
{
    punch_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->d = d;
    p->peer = *peer;
    ap_peer_id_short(peer, p->who);
    p->b_side = b_side;
    p->t_start = uv_hrtime();
    uv_timer_init(loop_of(d), &p->timer);
    p->timer.data = p;
    p->next = d->punches;
    if (d->punches) d->punches->prev = p;
    d->punches = p;
    d->npunch++;
    d->st.started++;
    return p;
}

static void attempt_fail(punch_t *p, int status)
{
    ap_dcutr_t *d = p->d;
    detach_dials(p, NULL);
    if (p->s) {
        ap_p2p_stream_t *s = p->s;
        p->s = NULL;
        ap__p2p_stream_set_udata(s, NULL);
        ap__p2p_stream_reset(s);
    }
    if (p->b_side && p->attempt < d->o.attempts && status == AP_ETIMEDOUT) {
        begin_attempt(p);
        return;
    }
    if (p->b_side || p->state == P_DIALING) {
        d->st.failed++;
        ap_info("dcutr", "peer %s: no direct connection after %d attempt(s): %s", p->who,
                p->attempt, ap_err_name(status));
        if (d->cb) d->cb(d->arg, &p->peer, p->b_side, status, p->attempt, 0, NULL);
    }
    punch_end(p);
}

static void punch_tick(uv_timer_t *t)
{
    punch_t *p = t->data;
    if (p->state == P_SYNC_WAIT) {
        dial_all(p);
        return;
    }
    if (p->state == P_DIALING) {
        dialling_tick(p);
        return;
    }
    if (p->state == P_GRACE) { /* the direct connection took over */
        ap_p2p_conn_t *r = ap__p2p_host_find(p->d->h, &p->peer, AP_P2P_FIND_RELAYED);
        if (r) ap__p2p_conn_close(r);
        punch_end(p);
        return;
    }
    attempt_fail(p, AP_ETIMEDOUT);
}

static void begin_attempt(punch_t *p)
{
    ap_dcutr_t *d = p->d;
    ap_p2p_conn_t *r = ap__p2p_host_find(d->h, &p->peer, AP_P2P_FIND_RELAYED);
    p->attempt++;
    p->rd.len = 0;
    p->ntheir = 0;
    p->state = P_CONNECT_SENT;
    int rc = r ? ap__p2p_stream_open(r, &d->proto, p, &p->s) : AP_ECLOSED;
    if (rc) {
        p->s = NULL;
        attempt_fail(p, rc);
        return;
    }
    later(p, d->o.attempt_ms);
}

/* ---- the stream ------------------------------------------------------------------------- */

static void s_open(ap_p2p_stream_t *s)
{
    punch_t *p = ap__p2p_stream_udata(s);
    ap_dcutr_t *d = (ap_dcutr_t *)ap__p2p_stream_proto(s);
    if (p) { /* B: our CONNECT, the round trip starts */
        send_msg(s, d, AP_DCUTR_CONNECT);
        p->t_connect = uv_hrtime();
        return;
    }
    const ap_peer_id_t *peer = ap__p2p_conn_peer(ap__p2p_stream_conn(s));
    if (!peer || !(p = punch_new(d, peer, false))) {
        ap__p2p_stream_reset(s);
        return;
    }
    p->attempt = 1;
    p->s = s;
    p->state = P_WAIT_CONNECT;
    ap__p2p_stream_set_udata(s, p);
    later(p, 2 * d->o.attempt_ms);
}

static void take_addrs(punch_t *p)
{
    p->ntheir = 0;
    for (size_t i = 0; i < msg.naddrs && p->ntheir < AP_DCUTR_DIAL_MAX; i++) {
        const ap_multiaddr_t *a = &msg.addrs[i];
        if (a->circuit || !a->has_tcp || a->port == 0 ||
            (a->host != AP_MA_HOST_IP4 && a->host != AP_MA_HOST_IP6))
            continue;
        p->their[p->ntheir++] = *a;
    }
}

static void s_data(ap_p2p_stream_t *s, const uint8_t *b, size_t n)
{
    punch_t *p = ap__p2p_stream_udata(s);
    while (p && n) {
        size_t used;
        int rc = ap__dcutr_rd_feed(&p->rd, b, n, &msg, &used);
        if (rc == 0) return;
        b += used;
        n -= used;
        bool ok = rc > 0;
        if (ok && p->state == P_CONNECT_SENT && msg.type == AP_DCUTR_CONNECT) {
            uint64_t rtt = uv_hrtime() - p->t_connect;
            take_addrs(p);
            send_msg(s, p->d, AP_DCUTR_SYNC);
            p->s = NULL;
            ap__p2p_stream_set_udata(s, NULL);
            ap__p2p_stream_close(s);
            p->state = P_SYNC_WAIT;
            later(p, rtt / 2000000u);
            return;
        } else if (ok && p->state == P_WAIT_CONNECT && msg.type == AP_DCUTR_CONNECT) {
            take_addrs(p);
            send_msg(s, p->d, AP_DCUTR_CONNECT);
            p->state = P_WAIT_SYNC;
        } else if (ok && p->state == P_WAIT_SYNC && msg.type == AP_DCUTR_SYNC) {
            p->s = NULL;
            ap__p2p_stream_set_udata(s, NULL);
            ap__p2p_stream_close(s);
            dial_all(p);
            return;
        } else {
            ap_warn("dcutr", "peer %s: %s message", p->who, ok ? "unexpected" : "malformed");
            p->d->st.bad++;
            punch_end(p);
            return;
        }
    }
}

static void s_close(ap_p2p_stream_t *s, int status)
{
    punch_t *p = ap__p2p_stream_udata(s);
    if (!p || p->s != s) return;
    p->s = NULL;
    if (p->state == P_CONNECT_SENT || p->state == P_WAIT_CONNECT || p->state == P_WAIT_SYNC)
        attempt_fail(p, status == AP_ENOPROTO ? AP_ENOTSUP : AP_ECLOSED);
}

/* ---- the service ------------------------------------------------------------------------ */

ap_dcutr_t *ap__dcutr_serve(ap_p2p_host_t *h, const ap_dcutr_opts_t *o, ap_dcutr_result_fn cb,
                            void *arg)
{
    ap_dcutr_t *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->h = h;
    d->cb = cb;
    d->arg = arg;
    if (o) d->o = *o;
    if (!d->o.attempt_ms) d->o.attempt_ms = 3000;
    if (!d->o.grace_ms) d->o.grace_ms = 2000;
    if (d->o.attempts <= 0) d->o.attempts = 3;
    d->proto = (ap_p2p_proto_t){AP_DCUTR_PROTO, s_open, s_data, NULL, s_close};
    if (ap__p2p_host_serve(h, &d->proto) != 0) {
        free(d);
        return NULL;
    }
    return d;
}

int ap__dcutr_start(ap_dcutr_t *d, ap_p2p_conn_t *relayed)
{
    const ap_peer_id_t *peer = ap__p2p_conn_peer(relayed);
    if (!peer || !ap__p2p_conn_relayed(relayed)) return AP_EINVAL;
    punch_t *p = punch_new(d, peer, true);
    if (!p) return AP_ENOMEM;
    begin_attempt(p);
    return 0;
}

void ap__dcutr_free(ap_dcutr_t *d)
{
    if (!d) return;
    d->freeing = true;
    d->cb = NULL;
    while (d->punches) punch_end(d->punches);
    if (d->npunch == 0) free(d);
}

ap_dcutr_stats_t ap__dcutr_stats(const ap_dcutr_t *d)
{
    return d->st;
}
