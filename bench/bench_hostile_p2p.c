/* `apiary bench hostile`: the attacks on the target's libp2p listener (its
 * TCP port: multistream-select, Noise, yamux). The attackers are the
 * library's own libp2p host on a libuv loop of this thread, writing raw
 * yamux frames on its authenticated connections, or plain sockets where
 * the attack is to speak less than the protocol:
 *   p2p_slowloris  300 connections from 8 other loopback addresses that
 *                  send "/multistream/1.0.0\n" one byte every 500 ms,
 *                  reopened as they are closed
 *   yamux_streams  4 connections of one identity, each opening 5,000
 *                  streams that never negotiate a protocol, held 5 s
 *   yamux_window   connections that grant a window past 2^32 - 1, and
 *                  ones that send 512 KiB on a stream whose window is
 *                  256 KiB, again and again
 *   p2p_oversized  identify streams that get 8 MiB of data, and data frames
 *                  that declare 4 GiB
 *   p2p_no_read    8 connections of one identity that stop reading and send
 *                  4,096 pings every 10 ms (each answered), reopened as they
 *                  are closed (at most 64 dials)
 * --quick: smaller counts. Every loop is bounded in count and time. */
#include "hostile.h"

#include "apiary/error.h"
#include "apiary/identity.h"
#include "p2p/p2p_conn.h"
#include "p2p/p2p_impl.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#define MAX_SLOTS 64

typedef struct slot {
    ap_p2p_conn_t *c; /* NULL once closed */
    bool ready, dead;
    uint32_t next_id; /* the next stream id to open (odd: we dial) */
} slot_t;

typedef struct patk {
    hctx_t *cx;
    uv_loop_t loop;
    uv_timer_t tick;
    ap_p2p_host_t *h;
    ap_multiaddr_t ma;
    slot_t s[MAX_SLOTS];
    int dials, closed_by_target;
} patk_t;

static void s_ready(ap_p2p_conn_t *c, void *arg)
{
    (void)c;
    ((slot_t *)arg)->ready = true;
}

static void s_closed(ap_p2p_conn_t *c, void *arg, int st)
{
    (void)c;
    (void)st;
    slot_t *s = arg;
    s->dead = true;
    s->c = NULL;
}

static const ap_p2p_conn_cbs_t scbs = {s_ready, s_closed};

static void on_tick(uv_timer_t *t)
{
    (void)t; /* wakes the loop: uv_run(ONCE) never blocks for long */
}

static int patk_open(patk_t *p, hctx_t *cx)
{
    memset(p, 0, sizeof *p);
    p->cx = cx;
    if (uv_loop_init(&p->loop)) abort(); /* only fails without file descriptors */
    uv_timer_init(&p->loop, &p->tick);
    uv_timer_start(&p->tick, on_tick, 10, 10);
    ap_identity_t id;
    int rc = ap_identity_generate(&id);
    if (rc) return rc;
    p->h = ap__p2p_host_new(&p->loop, &id, "apiary-bench/hostile");
    ap_identity_wipe(&id);
    if (!p->h) return AP_ENOMEM;
    return ap_multiaddr_parse(&p->ma, cx->t.addr);
}

static void pump(patk_t *p, double s)
{
    double t0 = ap_bench_now();
    do uv_run(&p->loop, UV_RUN_ONCE);
    while (ap_bench_now() - t0 < s);
}

static void patk_close(patk_t *p)
{
    if (p->h) ap__p2p_host_free(p->h);
    uv_close((uv_handle_t *)&p->tick, NULL);
    uv_run(&p->loop, UV_RUN_DEFAULT);
    uv_loop_close(&p->loop);
}

/* Dials slot i; waits (at most 5 s) for it to be ready. */
static bool slot_dial(patk_t *p, int i)
{
    slot_t *s = &p->s[i];
    memset(s, 0, sizeof *s);
    s->next_id = 1;
    p->dials++;
    if (ap__p2p_dial(p->h, &p->ma, &scbs, s, &s->c) != 0) {
        s->dead = true;
        return false;
    }
    double t0 = ap_bench_now();
    while (!s->ready && !s->dead && ap_bench_now() - t0 < 5) uv_run(&p->loop, UV_RUN_ONCE);
    return s->ready && !s->dead;
}

static bool live(const slot_t *s)
{
    return s->ready && !s->dead && s->c;
}

/* One raw yamux frame on s's connection. */
static void yframe(slot_t *s, uint8_t type, uint16_t flags, uint32_t id, uint32_t len,
                   const uint8_t *payload, size_t n)
{
    if (!live(s)) return;
    uint8_t hdr[AP_YAMUX_HDR_LEN];
    ap_yamux_hdr_t h = {0, type, flags, id, len};
    ap__yamux_hdr_put(hdr, &h);
    ap__p2p_secure_write(s->c, hdr, sizeof hdr, payload, n);
}

static void flush(slot_t *s)
{
    if (live(s)) ap__p2p_conn_submit(s->c);
}

static void report(hctx_t *cx, const char *attack, const char *metric, double v, const char *unit)
{
    char f[64];
    snprintf(f, sizeof f, "\"attack\":\"%s\"", attack);
    ap_bench_report(cx->b, metric, v, unit, f);
}

/* ---- p2p_slowloris ------------------------------------------------------------- */

int hostile_p2p_slowloris(hctx_t *cx)
{
    enum { N = 300 };
    static const char line[] = "\x13/multistream/1.0.0\n";
    int n = cx->quick ? 60 : N, fds[N], at[N];
    for (int i = 0; i < n; i++) {
        fds[i] = hostile_tcp_open(cx->t.port, i);
        at[i] = 0;
    }
    double t0 = ap_bench_now(), dur = cx->quick ? 4 : 15, last = 0;
    int reopened = 0, max_reopen = cx->quick ? 1000 : 5000;
    while (ap_bench_now() - t0 < dur && hostile_target_alive(&cx->t)) {
        struct pollfd pf[N];
        for (int i = 0; i < n; i++) pf[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
        poll(pf, (nfds_t)n, 50);
        bool drip = ap_bench_now() - last >= 0.5;
        if (drip) last = ap_bench_now();
        for (int i = 0; i < n; i++) {
            bool gone = fds[i] < 0 || (pf[i].revents & (POLLHUP | POLLERR));
            if (!gone && (pf[i].revents & POLLIN)) {
                char junk[256];
                ssize_t k = recv(fds[i], junk, sizeof junk, 0);
                gone = k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
            }
            if (gone) {
                if (fds[i] >= 0) close(fds[i]);
                fds[i] = reopened < max_reopen ? hostile_tcp_open(cx->t.port, i) : -1;
                at[i] = 0;
                reopened++;
                continue;
            }
            /* one more byte of the line, never its end */
            if (drip && at[i] < (int)sizeof line - 2 &&
                send(fds[i], line + at[i], 1, MSG_NOSIGNAL) == 1)
                at[i]++;
        }
    }
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
    report(cx, "p2p_slowloris", "reopened", reopened, "connections");
    return 0;
}

/* ---- yamux_streams ------------------------------------------------------------- */

int hostile_yamux_streams(hctx_t *cx)
{
    patk_t *p = calloc(1, sizeof *p);
    if (!p) return AP_ENOMEM;
    int rc = patk_open(p, cx), nconn = cx->quick ? 2 : 4, per = cx->quick ? 1000 : 5000;
    long opened = 0;
    for (int i = 0; !rc && i < nconn && hostile_target_alive(&cx->t); i++) {
        if (!slot_dial(p, i)) continue;
        for (int k = 0; k < per && live(&p->s[i]); k++) {
            yframe(&p->s[i], AP_YAMUX_WINDOW, AP_YAMUX_SYN, p->s[i].next_id, 0, NULL, 0);
            p->s[i].next_id += 2;
            opened++;
            if (k % 500 == 499) {
                flush(&p->s[i]);
                pump(p, 0.02);
            }
        }
        flush(&p->s[i]);
    }
    pump(p, cx->quick ? 2 : 5); /* held, never negotiated */
    patk_close(p);
    free(p);
    report(cx, "yamux_streams", "streams_opened", (double)opened, "streams");
    return rc;
}

/* ---- yamux_window -------------------------------------------------------------- */

int hostile_yamux_window(hctx_t *cx)
{
    patk_t *p = calloc(1, sizeof *p);
    uint8_t *big = calloc(1, 512u << 10);
    if (!p || !big) {
        free(p);
        free(big);
        return AP_ENOMEM;
    }
    int rc = patk_open(p, cx), rounds = cx->quick ? 10 : 50, sessions = 0;
    double t0 = ap_bench_now(), dur = cx->quick ? 3 : 8;
    for (int r = 0; !rc && r < rounds && ap_bench_now() - t0 < dur; r++) {
        if (!hostile_target_alive(&cx->t)) break;
        int i = r % MAX_SLOTS;
        if (p->s[i].c) ap__p2p_conn_close(p->s[i].c);
        pump(p, 0.01);
        if (!slot_dial(p, i)) continue;
        sessions++;
        slot_t *s = &p->s[i];
        /* a stream, then a window past 2^32 - 1 on it */
        yframe(s, AP_YAMUX_WINDOW, AP_YAMUX_SYN, 1, 0, NULL, 0);
        yframe(s, AP_YAMUX_WINDOW, 0, 1, UINT32_MAX, NULL, 0);
        /* data past the window of another stream */
        yframe(s, AP_YAMUX_DATA, AP_YAMUX_SYN, 3, 512u << 10, big, 512u << 10);
        flush(s);
        pump(p, 0.1);
    }
    patk_close(p);
    free(p);
    free(big);
    report(cx, "yamux_window", "sessions", sessions, "connections");
    return rc;
}

/* ---- p2p_oversized ------------------------------------------------------------- */

int hostile_p2p_oversized(hctx_t *cx)
{
    patk_t *p = calloc(1, sizeof *p);
    uint8_t *junk = calloc(1, 64u << 10);
    if (!p || !junk) {
        free(p);
        free(junk);
        return AP_ENOMEM;
    }
    static const char neg[] = "\x13/multistream/1.0.0\n\x0f/ipfs/id/1.0.0\n";
    int rc = patk_open(p, cx), rounds = cx->quick ? 4 : 16;
    long sent = 0;
    double t0 = ap_bench_now(), dur = cx->quick ? 3 : 8;
    for (int r = 0; !rc && r < rounds && ap_bench_now() - t0 < dur; r++) {
        if (!hostile_target_alive(&cx->t)) break;
        int i = r % MAX_SLOTS;
        if (!slot_dial(p, i)) continue;
        slot_t *s = &p->s[i];
        uint32_t id = s->next_id;
        s->next_id += 2;
        /* identify, negotiated, then 8 MiB of data on it */
        yframe(s, AP_YAMUX_DATA, AP_YAMUX_SYN, id, sizeof neg - 1, (const uint8_t *)neg,
               sizeof neg - 1);
        for (int k = 0; k < 128 && live(s); k++) {
            yframe(s, AP_YAMUX_DATA, 0, id, 64u << 10, junk, 64u << 10);
            sent += 64 << 10;
            if (k % 8 == 7) {
                flush(s);
                pump(p, 0.01);
            }
        }
        /* a data frame that declares 4 GiB, followed by 4 MiB of it */
        uint32_t id2 = s->next_id;
        s->next_id += 2;
        yframe(s, AP_YAMUX_DATA, AP_YAMUX_SYN, id2, UINT32_MAX, NULL, 0);
        for (int k = 0; k < 64 && live(s); k++) {
            ap__p2p_secure_write(s->c, junk, 64u << 10, NULL, 0);
            sent += 64 << 10;
            if (k % 8 == 7) {
                flush(s);
                pump(p, 0.01);
            }
        }
        flush(s);
        pump(p, 0.2);
        if (s->c) ap__p2p_conn_close(s->c);
    }
    pump(p, 0.5);
    patk_close(p);
    free(p);
    free(junk);
    report(cx, "p2p_oversized", "bytes_sent", (double)sent, "bytes");
    return rc;
}

/* ---- p2p_no_read --------------------------------------------------------------- */

int hostile_p2p_no_read(hctx_t *cx)
{
    patk_t *p = calloc(1, sizeof *p);
    if (!p) return AP_ENOMEM;
    int rc = patk_open(p, cx), nconn = cx->quick ? 4 : 8, max_dials = cx->quick ? 16 : 64;
    long pings = 0;
    double t0 = ap_bench_now(), dur = cx->quick ? 3 : 10;
    while (!rc && ap_bench_now() - t0 < dur && hostile_target_alive(&cx->t)) {
        for (int i = 0; i < nconn; i++) {
            slot_t *s = &p->s[i];
            if (!live(s)) {
                if (s->dead) p->closed_by_target++;
                s->dead = false;
                if (p->dials >= max_dials || !slot_dial(p, i)) continue;
                uv_read_stop((uv_stream_t *)&s->c->tcp); /* never reads again */
            }
            for (int k = 0; k < 4096; k++)
                yframe(s, AP_YAMUX_PING, AP_YAMUX_SYN, 0, (uint32_t)k, NULL, 0);
            pings += 4096;
            flush(s);
        }
        pump(p, 0.01);
    }
    /* the attacker reads nothing, so it cannot see the target close: the
     * target's log says (its WARNs are rate-limited: at least this many) */
    int closed = p->closed_by_target, logged = hostile_log_count(cx->log, "does not read");
    if (logged > closed) closed = logged;
    patk_close(p);
    free(p);
    report(cx, "p2p_no_read", "pings_sent", (double)pings, "pings");
    report(cx, "p2p_no_read", "connections_closed", closed, "connections");
    return rc;
}
