/* The secure TCP transport over real loopback sockets (port 0): handshake,
 * data both ways with back-pressure, wrong PeerID, garbage, truncated and
 * oversized messages, replayed / reordered / altered Noise messages (through
 * a frame-aware proxy), handshake timeout, keepalive and dead peers, a peer
 * that never reads, simultaneous dial, caps and idle close. Each bad input
 * closes only that connection, with one WARN line naming the peer. */
#include "aptest.h"

#include "apiary/identity.h"
#include "apiary/log.h"
#include "base/buf.h"
#include "net/tcp.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uv_loop_t loop;

/* ---- log capture ---------------------------------------------------------- */

static int nwarn;
static char warns[8][512];

static void sink(void *arg, ap_log_level_t lvl, const char *mod, const char *msg)
{
    (void)arg;
    (void)mod;
    if (lvl < AP_LOG_WARN) return;
    if (nwarn < 8) snprintf(warns[nwarn], sizeof warns[0], "%s", msg);
    nwarn++;
}

/* ---- nodes ---------------------------------------------------------------- */

#define MAXC 8
typedef struct node {
    ap_identity_t id;
    ap_tcp_t *t;
    char addr[AP_MA_TEXT_MAX]; /* listen address with /p2p/ */
    char short_id[AP_PEER_SHORT_LEN];
    int nconn, nclose, nwritable;
    ap_tcp_conn_t *conns[MAXC];
    int close_status[MAXC];
    ap_buf_t rx;
    bool closed;
    bool echo;            /* on_data sends every message back */
    int inflight_in_echo; /* writes in flight right after the last echo */
} node_t;

static void on_conn(void *arg, ap_tcp_conn_t *c)
{
    node_t *n = arg;
    if (n->nconn < MAXC) n->conns[n->nconn] = c;
    n->nconn++;
}

static void on_data(void *arg, ap_tcp_conn_t *c, const uint8_t *d, size_t len)
{
    node_t *n = arg;
    assert_ok(ap__buf_append(&n->rx, d, len));
    if (n->echo) {
        assert_ok(ap__tcp_send(c, d, len));
        n->inflight_in_echo = ap__tcp_writes_inflight(c);
    }
}

static void on_writable(void *arg, ap_tcp_conn_t *c)
{
    node_t *n = arg;
    (void)c;
    n->nwritable++;
}

static void on_close(void *arg, ap_tcp_conn_t *c, int status)
{
    node_t *n = arg;
    for (int i = 0; i < n->nconn && i < MAXC; i++)
        if (n->conns[i] == c) {
            n->conns[i] = NULL;
            n->close_status[i] = status;
        }
    n->nclose++;
}

/* The peer the listening node "knows" (its routing table), if any. */
static ap_peer_id_t g_known;
static bool g_known_set;

static bool is_known(void *arg, const ap_peer_id_t *peer)
{
    (void)arg;
    return g_known_set && ap_peer_id_eq(&g_known, peer);
}

static const ap_tcp_cbs_t cbs = {on_conn, on_data, on_writable, on_close, is_known};

static void node_init(node_t *n, uint8_t seed, const ap_tcp_cfg_t *cfg, bool listen)
{
    memset(n, 0, sizeof *n);
    uint8_t s[32];
    memset(s, seed, sizeof s);
    assert_ok(ap_identity_from_seed(&n->id, s));
    assert_ok(ap__tcp_new(&loop, &n->id, cfg, &cbs, n, &n->t));
    ap_peer_id_short(&n->id.id, n->short_id);
    if (listen) {
        assert_ok(ap__tcp_listen(n->t, "/ip4/127.0.0.1/tcp/0"));
        ap_multiaddr_t ma;
        assert_int_equal(ap__tcp_listen_addrs(n->t, &ma, 1), 1);
        assert_true(ma.port != 0);
        assert_true(ap_multiaddr_print(&ma, n->addr, sizeof n->addr) > 0);
    }
}

static void node_closed(void *arg)
{
    ((node_t *)arg)->closed = true;
}

static void node_free(node_t *n)
{
    ap__tcp_close(n->t, node_closed, n);
}

/* ---- running the loop ------------------------------------------------------- */

typedef bool (*pred_fn)(void *arg);
static bool timed_out;
static void stop_cb(uv_timer_t *h)
{
    timed_out = true;
    uv_stop(h->loop);
}

/* Runs the loop until pred holds or ms pass; returns pred. */
static bool run_until(pred_fn pred, void *arg, uint64_t ms)
{
    uv_timer_t tm;
    uv_timer_init(&loop, &tm);
    timed_out = false;
    uv_timer_start(&tm, stop_cb, ms, 0);
    while (!timed_out && !(pred && pred(arg))) uv_run(&loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&tm, NULL);
    uv_run(&loop, UV_RUN_NOWAIT);
    return pred ? pred(arg) : true;
}

static void run_for(uint64_t ms)
{
    run_until(NULL, NULL, ms);
}

static bool both_closed(void *arg)
{
    node_t **ns = arg;
    for (int i = 0; ns[i]; i++)
        if (!ns[i]->closed) return false;
    return true;
}

static void free_nodes(node_t **ns)
{
    for (int i = 0; ns[i]; i++) node_free(ns[i]);
    assert_true(run_until(both_closed, ns, 5000));
    for (int i = 0; ns[i]; i++) ap__buf_free(&ns[i]->rx);
}

typedef struct {
    int calls, status;
    ap_tcp_conn_t *c;
} dial_res_t;

static void dial_cb(void *arg, int status, ap_tcp_conn_t *c)
{
    dial_res_t *r = arg;
    r->calls++;
    r->status = status;
    r->c = c;
}

static bool dial_done(void *arg)
{
    return ((dial_res_t *)arg)->calls > 0;
}

typedef struct {
    node_t *n;
    size_t want;
} rx_wait_t;

static bool rx_at_least(void *arg)
{
    rx_wait_t *w = arg;
    return w->n->rx.len >= w->want;
}

static bool wait_rx(node_t *n, size_t want, uint64_t ms)
{
    rx_wait_t w = {n, want};
    return run_until(rx_at_least, &w, ms);
}

static int count_open(node_t *n)
{
    int k = 0;
    for (int i = 0; i < n->nconn && i < MAXC; i++) k += n->conns[i] != NULL;
    return k;
}

static ap_tcp_conn_t *first_open(node_t *n)
{
    for (int i = 0; i < n->nconn && i < MAXC; i++)
        if (n->conns[i]) return n->conns[i];
    return NULL;
}

static ap_tcp_conn_t *connect_pair(node_t *a, node_t *b)
{
    dial_res_t r = {0};
    assert_ok(ap__tcp_dial(b->t, a->addr, 5000, dial_cb, &r));
    assert_int_equal(r.calls, 0); /* never inside the call */
    assert_true(run_until(dial_done, &r, 5000));
    assert_ok(r.status);
    assert_non_null(r.c);
    assert_true(ap_peer_id_eq(ap__tcp_conn_peer(r.c), &a->id.id));
    return r.c;
}

/* Round trip on an existing pair, to show it is unaffected. */
static void ping(node_t *from, ap_tcp_conn_t *c, node_t *to)
{
    size_t before = to->rx.len;
    assert_ok(ap__tcp_send(c, (const uint8_t *)"ping", 4));
    assert_true(wait_rx(to, before + 4, 3000));
    assert_memory_equal(to->rx.data + before, "ping", 4);
    (void)from;
}

static int setup(void **state)
{
    (void)state;
    nwarn = 0;
    ap_log_set_sink(sink, NULL);
    return uv_loop_init(&loop);
}

static void close_any(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

static int teardown(void **state)
{
    (void)state;
    /* after a failed assertion, handles may still be open: close them all
     * (leaks then are the failed test's, not a hang) */
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_walk(&loop, close_any, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    ap_log_set_sink(NULL, NULL);
    return uv_loop_close(&loop) == 0 ? 0 : -1;
}

/* ---- tests -------------------------------------------------------------------- */

static void test_handshake_and_data(void **state)
{
    (void)state;
    node_t a, b;
    ap_tcp_cfg_t cfg = {.write_queue_max = 256 * 1024};
    node_init(&a, 1, &cfg, true);
    node_init(&b, 2, &cfg, false);
    ap_tcp_conn_t *cb = connect_pair(&a, &b);
    run_for(20);
    assert_int_equal(a.nconn, 1);
    assert_int_equal(b.nconn, 1);
    ap_tcp_conn_t *ca = a.conns[0];
    assert_true(ap_peer_id_eq(ap__tcp_conn_peer(ca), &b.id.id));
    assert_true(ap__tcp_conn_outbound(cb));
    assert_false(ap__tcp_conn_outbound(ca));
    assert_ptr_equal(ap__tcp_find(a.t, &b.id.id), ca);
    assert_ptr_equal(ap__tcp_find(b.t, &a.id.id), cb);

    /* a second dial to the same peer reuses the connection */
    dial_res_t r2 = {0};
    assert_ok(ap__tcp_dial(b.t, a.addr, 5000, dial_cb, &r2));
    assert_true(run_until(dial_done, &r2, 2000));
    assert_ok(r2.status);
    assert_ptr_equal(r2.c, cb);
    assert_int_equal(a.nconn, 1);

    /* 6 MiB in odd-sized messages with back-pressure, checked byte for byte */
    size_t total = 6u << 20, sent = 0;
    uint8_t *src = malloc(total);
    for (size_t i = 0; i < total; i++) src[i] = (uint8_t)(i * 131 + (i >> 9));
    int eagain = 0;
    while (sent < total) {
        size_t chunk = 1 + (sent * 7919) % 100000;
        if (chunk > total - sent) chunk = total - sent;
        int rc = ap__tcp_send(cb, src + sent, chunk);
        if (rc == AP_EAGAIN) {
            eagain++;
            assert_true(ap__tcp_queued(cb) <= cfg.write_queue_max);
            int w = b.nwritable;
            while (b.nwritable == w) uv_run(&loop, UV_RUN_ONCE);
            continue;
        }
        assert_ok(rc);
        sent += chunk;
    }
    assert_true(eagain > 0);
    if (!wait_rx(&a, total, 10000)) {
        ap_tcp_stats_t sa, sb;
        ap__tcp_get_stats(a.t, &sa);
        ap__tcp_get_stats(b.t, &sb);
        fail_msg("received %zu of %zu; queued %zu; sent %llu recv %llu; warns %d %s", a.rx.len,
                 total, ap__tcp_queued(cb), (unsigned long long)sb.bytes_sent,
                 (unsigned long long)sa.bytes_received, nwarn, nwarn ? warns[0] : "");
    }
    assert_int_equal(a.rx.len, total);
    assert_memory_equal(a.rx.data, src, total);
    free(src);
    /* and the other way */
    ping(&a, ca, &b);
    assert_int_equal(nwarn, 0);

    /* graceful close: both sides see on_close once */
    ap__tcp_conn_close(cb);
    run_for(100);
    assert_int_equal(a.nclose, 1);
    assert_int_equal(b.nclose, 1);
    assert_int_equal(b.close_status[0], 0);
    assert_int_equal(a.close_status[0], AP_ECLOSED);
    assert_null(ap__tcp_find(a.t, &b.id.id));
    assert_int_equal(nwarn, 0);
    node_t *ns[] = {&a, &b, NULL};
    free_nodes(ns);
}

static void test_wrong_peer_id(void **state)
{
    (void)state;
    node_t a, b, c;
    node_init(&a, 1, NULL, true);
    node_init(&b, 2, NULL, false);
    node_init(&c, 3, NULL, true);
    ap_tcp_conn_t *bc = connect_pair(&c, &b); /* an unrelated good connection */
    /* A's address, with the PeerID of someone else (not connected to B:
     * a dial to a connected PeerID just reuses that connection) */
    ap_identity_t other;
    assert_ok(ap_identity_generate(&other));
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, a.addr));
    ma.peer = other.id;
    char addr[AP_MA_TEXT_MAX];
    ap_multiaddr_print(&ma, addr, sizeof addr);
    dial_res_t r = {0};
    nwarn = 0;
    assert_ok(ap__tcp_dial(b.t, addr, 5000, dial_cb, &r));
    assert_true(run_until(dial_done, &r, 5000));
    assert_int_equal(r.status, AP_EAUTH);
    run_for(50);
    assert_int_equal(nwarn, 1);
    assert_non_null(strstr(warns[0], a.short_id)); /* names who answered */
    assert_non_null(strstr(warns[0], "expected peer"));
    assert_int_equal(a.nconn, 0); /* A never saw an authenticated dialer */
    ping(&b, bc, &c);
    node_t *ns[] = {&a, &b, &c, NULL};
    free_nodes(ns);
}

/* ---- raw clients for bad input ---------------------------------------------------- */

typedef struct raw {
    uv_tcp_t h;
    uv_connect_t creq;
    uv_write_t wreq;
    uint8_t out[70000];
    size_t outlen;
    bool connected, eof, close_after;
    size_t got;
} raw_t;

static void raw_alloc(uv_handle_t *h, size_t s, uv_buf_t *b)
{
    static char buf[65536];
    (void)h;
    (void)s;
    *b = uv_buf_init(buf, sizeof buf);
}

static void raw_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
    raw_t *r = s->data;
    (void)b;
    if (n < 0) r->eof = true;
    if (n > 0) r->got += (size_t)n;
}

static void free_shutdown(uv_shutdown_t *s, int status)
{
    (void)status;
    free(s);
}

static void free_write(uv_write_t *w, int status)
{
    (void)status;
    free(w);
}

static void raw_written(uv_write_t *w, int status)
{
    raw_t *r = w->data;
    (void)status;
    if (r->close_after)
        uv_shutdown(malloc(sizeof(uv_shutdown_t)), (uv_stream_t *)&r->h, free_shutdown);
}

static void raw_connected(uv_connect_t *c, int status)
{
    raw_t *r = c->data;
    assert_int_equal(status, 0);
    r->connected = true;
    uv_read_start((uv_stream_t *)&r->h, raw_alloc, raw_read);
    if (r->outlen) {
        uv_buf_t b = uv_buf_init((char *)r->out, (unsigned)r->outlen);
        r->wreq.data = r;
        uv_write(&r->wreq, (uv_stream_t *)&r->h, &b, 1, raw_written);
    }
}

static void raw_start(raw_t *r, const node_t *target)
{
    ap_multiaddr_t ma;
    struct sockaddr_storage ss;
    assert_ok(ap_multiaddr_parse(&ma, target->addr));
    assert_ok(ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss));
    uv_tcp_init(&loop, &r->h);
    r->h.data = r;
    r->creq.data = r;
    assert_int_equal(uv_tcp_connect(&r->creq, &r->h, (struct sockaddr *)&ss, raw_connected), 0);
}

static bool raw_eof(void *arg)
{
    return ((raw_t *)arg)->eof;
}

static void raw_case(node_t *a, const uint8_t *bytes, size_t n, bool close_after, int want_warns)
{
    raw_t *r = calloc(1, sizeof *r);
    if (n) memcpy(r->out, bytes, n);
    r->outlen = n;
    r->close_after = close_after;
    nwarn = 0;
    raw_start(r, a);
    assert_true(run_until(raw_eof, r, 5000));
    run_for(20);
    assert_int_equal(nwarn, want_warns);
    if (want_warns) assert_non_null(strstr(warns[0], "127.0.0.1:"));
    uv_close((uv_handle_t *)&r->h, (uv_close_cb)NULL);
    run_for(5);
    free(r);
}

static void test_bad_bytes(void **state)
{
    (void)state;
    node_t a, b;
    ap_tcp_cfg_t cfg = {.handshake_timeout_ms = 500};
    node_init(&a, 1, &cfg, true);
    node_init(&b, 2, NULL, false);
    ap_tcp_conn_t *ba = connect_pair(&a, &b);
    run_for(20);

    /* garbage: a huge "length" then junk */
    uint8_t junk[300];
    randombytes_buf(junk, sizeof junk);
    junk[0] = 0xff;
    raw_case(&a, junk, sizeof junk, false, 1);
    assert_non_null(strstr(warns[0], "handshake message of"));
    /* plausible length, random content: not a valid X25519 handshake */
    uint8_t m1[2 + 32];
    m1[0] = 0;
    m1[1] = 32;
    memset(m1 + 2, 0, 32); /* low-order point: DH refused when answering */
    raw_case(&a, m1, sizeof m1, false, 1);
    /* oversized handshake message (60,000 bytes announced and sent) */
    static uint8_t big[2 + 60000];
    big[0] = (uint8_t)(60000 >> 8);
    big[1] = (uint8_t)(60000 & 0xff);
    raw_case(&a, big, sizeof big, false, 1);
    assert_non_null(strstr(warns[0], "60000"));
    /* truncated: the header says 64 bytes, 10 arrive, then EOF */
    uint8_t trunc[12] = {0, 64};
    raw_case(&a, trunc, sizeof trunc, true, 1);
    assert_non_null(strstr(warns[0], "truncated"));
    /* a connection that sends nothing: handshake timeout */
    raw_case(&a, NULL, 0, false, 1);
    assert_non_null(strstr(warns[0], "handshake not finished"));
    /* a message out of turn: message 1 then another message at once */
    uint8_t two[2 * (2 + 32)];
    two[0] = 0;
    two[1] = 32;
    randombytes_buf(two + 2, 32);
    two[34] = 0;
    two[35] = 32;
    randombytes_buf(two + 36, 32);
    raw_case(&a, two, sizeof two, false, 1);

    /* the good connection is unaffected */
    ping(&b, ba, &a);
    assert_int_equal(a.nclose, 0);
    ap_tcp_stats_t st;
    ap__tcp_get_stats(a.t, &st);
    assert_int_equal(st.closed_bad_input, 6);
    assert_int_equal(st.open, 1);
    node_t *ns[] = {&a, &b, NULL};
    free_nodes(ns);
}

/* ---- a frame-aware man in the middle --------------------------------------------- */

typedef enum { MITM_PASS, MITM_REPLAY, MITM_REORDER, MITM_ALTER, MITM_BLACKHOLE } mitm_mode_t;

typedef struct mitm {
    uv_tcp_t listener, down, up; /* down: from the dialer; up: to the target */
    uv_connect_t creq;
    struct sockaddr_storage target;
    mitm_mode_t mode;
    int victim;   /* index of the client->server frame to tamper with (0 = msg 1) */
    ap_buf_t c2s; /* unparsed client->server bytes */
    int frames;
    uint8_t held[70000];
    size_t held_len;
    bool up_ok;
    ap_buf_t pending; /* bytes to forward once up is connected */
    int closed;
} mitm_t;

static void fwd(uv_tcp_t *to, const uint8_t *p, size_t n)
{
    uv_write_t *w = malloc(sizeof *w + n);
    memcpy(w + 1, p, n);
    uv_buf_t b = uv_buf_init((char *)(w + 1), (unsigned)n);
    if (uv_write(w, (uv_stream_t *)to, &b, 1, free_write) != 0) free(w);
}

static void mitm_frame(mitm_t *m, uint8_t *f, size_t n)
{
    int k = m->frames++;
    if (m->mode == MITM_BLACKHOLE && k >= 2) return;
    if (k == m->victim) {
        switch (m->mode) {
        case MITM_REPLAY:
            fwd(&m->up, f, n);
            fwd(&m->up, f, n);
            return;
        case MITM_REORDER:
            memcpy(m->held, f, n);
            m->held_len = n;
            return;
        case MITM_ALTER:
            f[n / 2] ^= 0x20;
            break;
        default:
            break;
        }
    }
    fwd(&m->up, f, n);
    if (m->mode == MITM_REORDER && k == m->victim + 1) fwd(&m->up, m->held, m->held_len);
}

static bool blackholed(const mitm_t *m)
{
    return m->mode == MITM_BLACKHOLE && m->frames >= 2;
}

static void mitm_down_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
    mitm_t *m = s->data;
    if (n < 0 && blackholed(m)) {
        uv_read_stop(s); /* a black hole does not pass on closes either */
        free(b->base);
        return;
    }
    if (n < 0) {
        if (!uv_is_closing((uv_handle_t *)&m->up)) uv_close((uv_handle_t *)&m->up, NULL);
        if (!uv_is_closing((uv_handle_t *)&m->down)) uv_close((uv_handle_t *)&m->down, NULL);
        free(b->base);
        return;
    }
    ap__buf_append(&m->c2s, b->base, (size_t)n);
    free(b->base);
    while (m->c2s.len >= 2) {
        size_t len = 2 + ap__get_be16(m->c2s.data);
        if (m->c2s.len < len) break;
        mitm_frame(m, m->c2s.data, len);
        ap__buf_consume(&m->c2s, len);
    }
}

static void mitm_up_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
    mitm_t *m = s->data;
    if (n < 0 && blackholed(m)) {
        uv_read_stop(s);
    } else if (n < 0) {
        if (!uv_is_closing((uv_handle_t *)&m->up)) uv_close((uv_handle_t *)&m->up, NULL);
        if (!uv_is_closing((uv_handle_t *)&m->down)) uv_close((uv_handle_t *)&m->down, NULL);
    } else if (n > 0) {
        /* server->client: pass, unless blackholed after the handshake */
        if (!blackholed(m)) fwd(&m->down, (uint8_t *)b->base, (size_t)n);
    }
    free(b->base);
}

static void heap_alloc(uv_handle_t *h, size_t s, uv_buf_t *b)
{
    (void)h;
    *b = uv_buf_init(malloc(s), (unsigned)s);
}

static void mitm_up_connected(uv_connect_t *c, int status)
{
    mitm_t *m = c->data;
    assert_int_equal(status, 0);
    uv_read_start((uv_stream_t *)&m->up, heap_alloc, mitm_up_read);
    uv_read_start((uv_stream_t *)&m->down, heap_alloc, mitm_down_read);
}

static void mitm_accept(uv_stream_t *srv, int status)
{
    mitm_t *m = srv->data;
    assert_int_equal(status, 0);
    uv_tcp_init(&loop, &m->down);
    uv_tcp_init(&loop, &m->up);
    m->down.data = m->up.data = m;
    assert_int_equal(uv_accept(srv, (uv_stream_t *)&m->down), 0);
    m->creq.data = m;
    uv_tcp_connect(&m->creq, &m->up, (struct sockaddr *)&m->target, mitm_up_connected);
}

/* Starts a proxy in front of target; writes its dial address (with the
 * target's /p2p/) into addr. */
static void mitm_start(mitm_t *m, const node_t *target, mitm_mode_t mode, int victim, char *addr)
{
    memset(m, 0, sizeof *m);
    m->mode = mode;
    m->victim = victim;
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, target->addr));
    assert_ok(ap_multiaddr_to_sockaddr(&ma, &m->target, sizeof m->target));
    uv_tcp_init(&loop, &m->listener);
    m->listener.data = m;
    struct sockaddr_in sin;
    uv_ip4_addr("127.0.0.1", 0, &sin);
    assert_int_equal(uv_tcp_bind(&m->listener, (struct sockaddr *)&sin, 0), 0);
    assert_int_equal(uv_listen((uv_stream_t *)&m->listener, 8, mitm_accept), 0);
    struct sockaddr_storage ss;
    int len = sizeof ss;
    uv_tcp_getsockname(&m->listener, (struct sockaddr *)&ss, &len);
    ap_multiaddr_t px;
    ap_multiaddr_from_sockaddr(&px, &ss);
    px.has_peer = true;
    px.peer = ma.peer;
    ap_multiaddr_print(&px, addr, AP_MA_TEXT_MAX);
}

static void mitm_stop(mitm_t *m)
{
    uv_close((uv_handle_t *)&m->listener, NULL);
    if (!uv_is_closing((uv_handle_t *)&m->up)) uv_close((uv_handle_t *)&m->up, NULL);
    if (!uv_is_closing((uv_handle_t *)&m->down)) uv_close((uv_handle_t *)&m->down, NULL);
    run_for(10);
    ap__buf_free(&m->c2s);
}

static bool closed_one(void *arg)
{
    return ((node_t *)arg)->nclose >= 1;
}

static void tamper_case(mitm_mode_t mode)
{
    node_t a, b, c;
    node_init(&a, 1, NULL, true);
    node_init(&b, 2, NULL, false);
    node_init(&c, 3, NULL, false);
    ap_tcp_conn_t *ca = connect_pair(&a, &c); /* bystander */
    mitm_t m;
    char addr[AP_MA_TEXT_MAX];
    /* frames client->server: 0 = msg 1, 1 = msg 3, 2.. = transport */
    mitm_start(&m, &a, mode, 3, addr);
    dial_res_t r = {0};
    assert_ok(ap__tcp_dial(b.t, addr, 5000, dial_cb, &r));
    assert_true(run_until(dial_done, &r, 5000));
    assert_ok(r.status);
    nwarn = 0;
    for (int i = 0; i < 4; i++) {
        char msg[32];
        int n = snprintf(msg, sizeof msg, "message %d", i);
        int rc = ap__tcp_send(r.c, (const uint8_t *)msg, (size_t)n);
        /* once the tampered message (index 1) arrived, A may close at once */
        if (rc != 0) {
            assert_int_equal(rc, AP_ECLOSED);
            assert_true(i >= 2);
            break;
        }
        run_for(5);
    }
    assert_true(run_until(closed_one, &a, 3000));
    run_for(30);
    /* frame 2 ("message 0") arrived intact; the tampered one killed it */
    assert_true(a.rx.len >= 9);
    assert_memory_equal(a.rx.data, "message 0", 9);
    assert_int_equal(a.nclose, 1);
    assert_int_equal(a.close_status[1], AP_EAUTH); /* conns[0] is c's */
    assert_int_equal(nwarn, 1);
    assert_non_null(strstr(warns[0], b.short_id));
    assert_non_null(strstr(warns[0], "does not decrypt"));
    assert_true(run_until(closed_one, &b, 3000));
    assert_int_equal(b.close_status[0], AP_ECLOSED);
    /* the bystander is unaffected */
    assert_non_null(a.conns[0]);
    size_t before = a.rx.len;
    assert_ok(ap__tcp_send(ca, (const uint8_t *)"ok", 2));
    assert_true(wait_rx(&a, before + 2, 2000));
    assert_memory_equal(a.rx.data + before, "ok", 2);
    mitm_stop(&m);
    node_t *ns[] = {&a, &b, &c, NULL};
    free_nodes(ns);
}

static void test_replayed(void **state)
{
    (void)state;
    tamper_case(MITM_REPLAY);
}
static void test_reordered(void **state)
{
    (void)state;
    tamper_case(MITM_REORDER);
}
static void test_altered(void **state)
{
    (void)state;
    tamper_case(MITM_ALTER);
}

static void test_keepalive_and_dead_peer(void **state)
{
    (void)state;
    ap_tcp_cfg_t cfg = {.keepalive_ms = 50, .dead_ms = 600};
    node_t a, b;
    node_init(&a, 1, &cfg, true);
    node_init(&b, 2, &cfg, false);
    /* idle but alive: keepalives keep it open well past dead_ms */
    ap_tcp_conn_t *ba = connect_pair(&a, &b);
    nwarn = 0;
    run_for(1500);
    assert_int_equal(a.nclose + b.nclose, 0);
    assert_int_equal(nwarn, 0);
    ping(&b, ba, &a);
    /* a path that silently drops everything after the handshake */
    node_t c;
    node_init(&c, 3, &cfg, false);
    mitm_t m;
    char addr[AP_MA_TEXT_MAX];
    mitm_start(&m, &a, MITM_BLACKHOLE, -1, addr);
    dial_res_t r = {0};
    assert_ok(ap__tcp_dial(c.t, addr, 5000, dial_cb, &r));
    assert_true(run_until(dial_done, &r, 5000));
    assert_ok(r.status);
    nwarn = 0;
    assert_true(run_until(closed_one, &c, 3000));
    assert_int_equal(c.close_status[0], AP_ETIMEDOUT);
    assert_true(run_until(closed_one, &a, 3000));
    assert_int_equal(a.close_status[1], AP_ETIMEDOUT);
    assert_int_equal(nwarn, 2); /* one per side, each naming the other */
    assert_true(strstr(warns[0], a.short_id) || strstr(warns[1], a.short_id));
    assert_true(strstr(warns[0], c.short_id) || strstr(warns[1], c.short_id));
    assert_true(strstr(warns[0], "silent"));
    ping(&b, ba, &a); /* unaffected */
    mitm_stop(&m);
    node_t *ns[] = {&a, &b, &c, NULL};
    free_nodes(ns);
}

static void test_peer_never_reads(void **state)
{
    (void)state;
    ap_tcp_cfg_t cfg = {.keepalive_ms = 50, .dead_ms = 600, .write_queue_max = 1 << 20};
    node_t a, b;
    node_init(&a, 1, &cfg, true);
    node_init(&b, 2, &cfg, false);
    connect_pair(&a, &b);
    run_for(20);
    ap_tcp_conn_t *ab = a.conns[0];
    ap_tcp_conn_t *ba = first_open(&b);
    ap__tcp_pause_read(ba, true);
    static uint8_t chunk[60000];
    int rc = 0;
    size_t pushed = 0;
    for (int i = 0; i < 1000 && rc == 0; i++) {
        rc = ap__tcp_send(ab, chunk, sizeof chunk);
        if (rc == 0) pushed += sizeof chunk;
        run_for(1);
    }
    assert_int_equal(rc, AP_EAGAIN); /* memory stays bounded */
    assert_true(pushed >= cfg.write_queue_max);
    assert_true(ap__tcp_queued(ab) <= cfg.write_queue_max + sizeof chunk);
    nwarn = 0;
    assert_true(run_until(closed_one, &a, 5000));
    assert_int_equal(a.close_status[0], AP_ETIMEDOUT);
    assert_int_equal(nwarn, 1);
    assert_non_null(strstr(warns[0], b.short_id));
    assert_non_null(strstr(warns[0], "read nothing"));
    node_t *ns[] = {&a, &b, NULL};
    free_nodes(ns);
}

static bool one_each(void *arg)
{
    node_t **ns = arg;
    return count_open(ns[0]) == 1 && count_open(ns[1]) == 1 && ns[0]->nconn >= 1 &&
           ns[1]->nconn >= 1;
}

static void test_simultaneous_dial(void **state)
{
    (void)state;
    for (int round = 0; round < 5; round++) {
        node_t a, b;
        node_init(&a, (uint8_t)(10 + round), NULL, true);
        node_init(&b, (uint8_t)(20 + round), NULL, true);
        dial_res_t ra = {0}, rb = {0};
        assert_ok(ap__tcp_dial(a.t, b.addr, 5000, dial_cb, &ra));
        assert_ok(ap__tcp_dial(b.t, a.addr, 5000, dial_cb, &rb));
        assert_true(run_until(dial_done, &ra, 5000));
        assert_true(run_until(dial_done, &rb, 5000));
        assert_ok(ra.status);
        assert_ok(rb.status);
        node_t *pair[] = {&a, &b};
        run_for(100);
        assert_true(run_until(one_each, pair, 2000));
        ap_tcp_conn_t *ca = ap__tcp_find(a.t, &b.id.id), *cb = ap__tcp_find(b.t, &a.id.id);
        assert_non_null(ca);
        assert_non_null(cb);
        /* the survivor was dialled by the smaller PeerID, on both ends */
        bool a_smaller = ap_peer_id_cmp(&a.id.id, &b.id.id) < 0;
        assert_int_equal(ap__tcp_conn_outbound(ca), a_smaller);
        assert_int_equal(ap__tcp_conn_outbound(cb), !a_smaller);
        /* and it is one connection: data flows */
        size_t before = b.rx.len;
        assert_ok(ap__tcp_send(ca, (const uint8_t *)"x", 1));
        assert_true(wait_rx(&b, before + 1, 2000));
        assert_int_equal(nwarn, 0);
        node_t *ns[] = {&a, &b, NULL};
        free_nodes(ns);
    }
}

static void test_caps_and_idle(void **state)
{
    (void)state;
    ap_tcp_cfg_t cfg = {.max_conns = 2, .idle_ms = 300, .evict_idle_ms = 60000};
    node_t a, n[3];
    node_init(&a, 1, &cfg, true);
    dial_res_t r[3] = {{0}};
    for (int i = 0; i < 3; i++) {
        node_init(&n[i], (uint8_t)(2 + i), NULL, false);
        assert_ok(ap__tcp_dial(n[i].t, a.addr, 3000, dial_cb, &r[i]));
        /* each one done (both ends) before the next: under load, a third
         * handshake started before the first two finished would pass the
         * accept-time check and be refused only after it */
        assert_true(run_until(dial_done, &r[i], 3000));
        for (int k = 0; k < 100 && a.nconn < i + 1 && i < 2; k++) run_for(10);
    }
    assert_ok(r[0].status);
    assert_ok(r[1].status);
    assert_int_not_equal(r[2].status, 0); /* over the cap: refused */
    assert_int_equal(a.nconn, 2);
    /* no application data: both close as idle, without warnings */
    nwarn = 0;
    node_t *aa = &a;
    (void)aa;
    run_for(800);
    assert_int_equal(a.nclose, 2);
    assert_int_equal(a.close_status[0], 0);
    assert_int_equal(nwarn, 0);
    /* bad dial arguments fail synchronously */
    dial_res_t rx = {0};
    assert_int_equal(ap__tcp_dial(a.t, "/ip4/127.0.0.1", 100, dial_cb, &rx), AP_EADDR);
    assert_int_equal(ap__tcp_dial(a.t, "nonsense", 100, dial_cb, &rx), AP_EADDR);
    char self[AP_MA_TEXT_MAX];
    snprintf(self, sizeof self, "%s", a.addr);
    assert_int_equal(ap__tcp_dial(a.t, self, 100, dial_cb, &rx), AP_EINVAL);
    /* a refused port: AP_EUNREACH */
    node_t z;
    node_init(&z, 9, NULL, true);
    char zaddr[AP_MA_TEXT_MAX];
    snprintf(zaddr, sizeof zaddr, "%s", z.addr);
    node_t *zz[] = {&z, NULL};
    free_nodes(zz);
    assert_ok(ap__tcp_dial(n[0].t, zaddr, 2000, dial_cb, &rx));
    assert_true(run_until(dial_done, &rx, 3000));
    assert_int_equal(rx.status, AP_EUNREACH);
    node_t *ns[] = {&a, &n[0], &n[1], &n[2], NULL};
    free_nodes(ns);
}

/* Slots kept for known peers: a flood of fresh identities holding
 * connections (not idle enough to be evicted) fills the shared part, and a
 * peer the node knows still gets in; a new unknown one does not. */
static void test_known_peer_slots(void **state)
{
    (void)state;
    /* 16 connections: 2 kept for own dials, 2 for known peers, 12 shared */
    ap_tcp_cfg_t cfg = {.max_conns = 16, .evict_idle_ms = 600000};
    node_t a, n[14];
    node_init(&a, 1, &cfg, true);
    node_init(&n[13], 99, NULL, false);
    g_known = n[13].id.id;
    g_known_set = true;
    dial_res_t r[14] = {{0}};
    for (int i = 0; i < 13; i++) {
        node_init(&n[i], (uint8_t)(2 + i), NULL, false);
        assert_ok(ap__tcp_dial(n[i].t, a.addr, 3000, dial_cb, &r[i]));
        assert_true(run_until(dial_done, &r[i], 5000));
        run_for(20);
    }
    assert_int_equal(a.nconn, 12); /* the 13th fresh identity was refused */
    ap_tcp_stats_t st;
    ap__tcp_get_stats(a.t, &st);
    assert_true(st.refused_open >= 1);
    /* the known peer still gets in */
    assert_ok(ap__tcp_dial(n[13].t, a.addr, 3000, dial_cb, &r[13]));
    assert_true(run_until(dial_done, &r[13], 5000));
    run_for(50);
    assert_ok(r[13].status);
    assert_int_equal(a.nconn, 13);
    g_known_set = false;
    node_t *ns[16];
    ns[0] = &a;
    for (int i = 0; i < 14; i++) ns[1 + i] = &n[i];
    ns[15] = NULL;
    free_nodes(ns);
}

static void test_dns_dial(void **state)
{
    (void)state;
    node_t a, b;
    node_init(&a, 1, NULL, true);
    node_init(&b, 2, NULL, false);
    ap_multiaddr_t ma;
    assert_ok(ap_multiaddr_parse(&ma, a.addr));
    char addr[AP_MA_TEXT_MAX], id[AP_PEER_ID_STR_MAX];
    snprintf(addr, sizeof addr, "/dns4/localhost/tcp/%u/p2p/%s", ma.port,
             ap_peer_id_str(&a.id.id, id));
    dial_res_t r = {0};
    assert_ok(ap__tcp_dial(b.t, addr, 5000, dial_cb, &r));
    assert_true(run_until(dial_done, &r, 5000));
    assert_ok(r.status);
    node_t *ns[] = {&a, &b, NULL};
    free_nodes(ns);
}

/* The write queue's pipelining (tcp_io.c, "writing"): a small write is not held
 * back by an earlier one that went straight into the kernel and only awaits
 * its callback (the mux's credit frames must reach the sender at once), but
 * at most WBLOCK_EARLY_MAX partly filled blocks go out that way; and what is
 * written while a read is processed goes out together after it. */
static void test_write_pipelining(void **state)
{
    (void)state;
    node_t a, b;
    node_init(&a, 1, NULL, true);
    node_init(&b, 2, NULL, false);
    ap_tcp_conn_t *cb = connect_pair(&a, &b);
    run_for(20); /* the handshake's writes are done */
    assert_int_equal(a.nconn, 1);
    assert_int_equal(ap__tcp_writes_inflight(cb), 0);

    assert_ok(ap__tcp_send(cb, (const uint8_t *)"x", 1));
    assert_int_equal(ap__tcp_writes_inflight(cb), 1);
    /* the first write's bytes are in the kernel, its callback is pending:
     * the second small write goes out too, not a loop turn later */
    assert_ok(ap__tcp_send(cb, (const uint8_t *)"y", 1));
    assert_int_equal(ap__tcp_writes_inflight(cb), 2);
    /* bounded: the third waits for a callback and then goes as a batch */
    assert_ok(ap__tcp_send(cb, (const uint8_t *)"z", 1));
    assert_ok(ap__tcp_send(cb, (const uint8_t *)"w", 1));
    assert_int_equal(ap__tcp_writes_inflight(cb), 2);
    assert_true(wait_rx(&a, 4, 3000));
    assert_memory_equal(a.rx.data, "xyzw", 4);

    /* writes made inside on_data wait for the end of the read */
    a.echo = true;
    a.inflight_in_echo = -1;
    assert_ok(ap__tcp_send(cb, (const uint8_t *)"ping", 4));
    assert_true(wait_rx(&b, 4, 3000));
    assert_memory_equal(b.rx.data, "ping", 4);
    assert_int_equal(a.inflight_in_echo, 0);
    assert_int_equal(nwarn, 0);
    node_t *ns[] = {&a, &b, NULL};
    free_nodes(ns);
}

int main(void)
{
    if (sodium_init() < 0) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_handshake_and_data, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_peer_id, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_bytes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_replayed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reordered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_altered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_keepalive_and_dead_peer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_peer_never_reads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_simultaneous_dial, setup, teardown),
        cmocka_unit_test_setup_teardown(test_caps_and_idle, setup, teardown),
        cmocka_unit_test_setup_teardown(test_known_peer_slots, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dns_dial, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_pipelining, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
