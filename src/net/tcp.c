/* Secure TCP transport: TCP + Noise XX + identity payload (see tcp.h).
 * This file: the transport object (creation, close, stats), the peer table,
 * closing connections, the sweep (deadlines, keepalive, idle, buffers) and
 * the per-connection accessors. Accepting and the handshake: tcp_admit.c;
 * dialing: tcp_dial.c; reading and writing: tcp_io.c. */
#include "net/tcp_impl.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- small helpers ------------------------------------------------------ */

uint64_t ap__tcp_now_ms(ap_tcp_t *t)
{
    return uv_now(t->loop);
}

void ap__tcp_list_push(dial_req_t **head, dial_req_t *r)
{
    r->prev = NULL;
    r->next = *head;
    if (*head) (*head)->prev = r;
    *head = r;
}

void ap__tcp_list_remove(dial_req_t **head, dial_req_t *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        *head = r->next;
    if (r->next) r->next->prev = r->prev;
    r->next = r->prev = NULL;
}

void ap__tcp_maybe_finish(ap_tcp_t *t)
{
    if (!t->closing || t->handles > 0) return;
    void (*done)(void *) = t->done;
    void *arg = t->done_arg;
    free(t->table);
    free(t->rbuf);
    ap_admit_close(&t->admit);
    ap__secure_creds_clear(&t->creds);
    free(t);
    if (done) done(arg);
}

void ap__tcp_set_who_addr(ap_tcp_conn_t *c)
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    char ip[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (uv_tcp_getpeername(&c->h, (struct sockaddr *)&ss, &len) == 0) {
        if (ss.ss_family == AF_INET) {
            uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof ip);
            port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof ip);
            port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
        }
    }
    snprintf(c->who, sizeof c->who, "%s:%d", ip, port);
}

void ap__tcp_set_who_peer(ap_tcp_conn_t *c)
{
    char s[AP_PEER_SHORT_LEN];
    snprintf(c->who, sizeof c->who, "%s", ap_peer_id_short(&c->peer, s));
}

/* ---- peer table ---------------------------------------------------------- */

static ap_tcp_conn_t **bucket(ap_tcp_t *t, const ap_peer_id_t *p)
{
    return &t->table[ap_peer_id_hash(p) & (t->table_cap - 1)];
}

static int table_grow(ap_tcp_t *t)
{
    size_t ncap = t->table_cap ? t->table_cap * 2 : 64;
    ap_tcp_conn_t **nt = calloc(ncap, sizeof *nt);
    if (!nt) return AP_ENOMEM;
    for (size_t i = 0; i < t->table_cap; i++) {
        ap_tcp_conn_t *c = t->table[i];
        while (c) {
            ap_tcp_conn_t *nx = c->hnext;
            ap_tcp_conn_t **b = &nt[ap_peer_id_hash(&c->peer) & (ncap - 1)];
            c->hnext = *b;
            *b = c;
            c = nx;
        }
    }
    free(t->table);
    t->table = nt;
    t->table_cap = ncap;
    return 0;
}

int ap__tcp_table_insert(ap_tcp_t *t, ap_tcp_conn_t *c)
{
    if (t->table_n + 1 > t->table_cap) {
        int rc = table_grow(t);
        if (rc) return rc;
    }
    ap_tcp_conn_t **b = bucket(t, &c->peer);
    c->hnext = *b;
    *b = c;
    t->table_n++;
    return 0;
}

void ap__tcp_table_remove(ap_tcp_t *t, ap_tcp_conn_t *c)
{
    if (!t->table_cap) return;
    for (ap_tcp_conn_t **p = bucket(t, &c->peer); *p; p = &(*p)->hnext) {
        if (*p == c) {
            *p = c->hnext;
            c->hnext = NULL;
            t->table_n--;
            return;
        }
    }
}

ap_tcp_conn_t *ap__tcp_find(ap_tcp_t *t, const ap_peer_id_t *peer)
{
    if (!t->table_cap) return NULL;
    for (ap_tcp_conn_t *c = *bucket(t, peer); c; c = c->hnext)
        if (ap_peer_id_eq(&c->peer, peer)) return c;
    return NULL;
}

/* ---- closing ----------------------------------------------------------------- */

void ap__tcp_wblocks_free(ap_tcp_conn_t *c);

static void conn_closed(uv_handle_t *h)
{
    ap_tcp_conn_t *c = h->data;
    ap_tcp_t *t = c->t;
    if (c->prev)
        c->prev->next = c->next;
    else
        t->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    t->nconns--;
    if (c->announced && t->cbs.on_close) t->cbs.on_close(t->arg, c, c->close_status);
    ap__tcp_dials_done(c, c->close_status ? c->close_status : AP_ECLOSED);
    if (c->hs) {
        ap__secure_clear(c->hs);
        free(c->hs);
    }
    ap__noise_cs_clear(&c->send);
    ap__noise_cs_clear(&c->recv);
    free(c->part);
    while (c->wq_head) { /* unsubmitted blocks; submitted ones completed before this */
        wblock_t *b = c->wq_head;
        c->wq_head = b->next;
        free(b);
    }
    ap__tcp_wblocks_free(c);
    free(c);
    t->handles--;
    ap__tcp_maybe_finish(t);
}

void ap__tcp_conn_abort(ap_tcp_conn_t *c, int status)
{
    if (c->st == C_CLOSING) return;
    ap_tcp_t *t = c->t;
    if (c->st == C_OPEN && c->has_peer && ap__tcp_find(t, &c->peer) == c)
        ap__tcp_table_remove(t, c);
    if (c->counted_hs) {
        c->counted_hs = false;
        t->nhandshaking--;
    }
    if (c->admitted) {
        c->admitted = false;
        ap_admit_gone(&t->admit, (uint64_t)(uintptr_t)c);
    }
    if (c->st == C_OPEN) t->stats.open--;
    c->st = C_CLOSING;
    c->close_status = status;
    uv_close((uv_handle_t *)&c->h, conn_closed);
}

void ap__tcp_conn_fail(ap_tcp_conn_t *c, int err, const char *fmt, ...)
{
    if (c->st == C_CLOSING) return;
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    /* anyone can open connections and send junk: those lines are rate-limited */
    static ap_log_limit_t unauth = {.burst = 32, .window_ms = 10000}; /* then ~3 lines/s */
    if (c->st == C_OPEN)
        ap_warn(MOD, "closing connection %s %s: %s (%s)", c->outbound ? "to" : "from", c->who, why,
                ap_err_name(err));
    else
        ap_log_limited(&unauth, AP_LOG_WARN, MOD,
                       "closing unauthenticated connection %s %s: %s (%s)",
                       c->outbound ? "to" : "from", c->who, why, ap_err_name(err));
    if (c->st != C_OPEN) c->t->stats.handshakes_failed++;
    c->t->stats.closed_bad_input++;
    ap__tcp_conn_abort(c, err);
}

/* ---- connections --------------------------------------------------------------- */

ap_tcp_conn_t *ap__tcp_conn_new(ap_tcp_t *t, bool outbound)
{
    ap_tcp_conn_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    if (uv_tcp_init(t->loop, &c->h) != 0) {
        free(c);
        return NULL;
    }
    c->t = t;
    c->h.data = c;
    c->wreq.data = c;
    c->creq.data = c;
    c->outbound = outbound;
    c->st = outbound ? C_CONNECTING : C_HANDSHAKE;
    c->next = t->conns;
    if (t->conns) t->conns->prev = c;
    t->conns = c;
    t->nconns++;
    t->handles++;
    return c;
}

int ap__tcp_conn_inject(ap_tcp_t *t, const ap_peer_id_t *peer, const ap_noise_cs_t *send,
                        const ap_noise_cs_t *recv, bool outbound, ap_tcp_conn_t **out)
{
    if (t->closing) return AP_ESHUTDOWN;
    if (ap__tcp_find(t, peer)) return AP_EEXIST;
    ap_tcp_conn_t *c = ap__tcp_conn_new(t, outbound);
    if (!c) return AP_ENOMEM;
    c->sink = true;
    c->peer = *peer;
    c->has_peer = true;
    c->send = *send;
    c->recv = *recv;
    ap__tcp_set_who_peer(c);
    if (ap__tcp_table_insert(t, c) != 0) {
        ap__tcp_conn_abort(c, AP_ENOMEM);
        return AP_ENOMEM;
    }
    c->st = C_OPEN;
    t->stats.open++;
    c->announced = true;
    c->last_app = c->last_rx = c->last_tx = ap__tcp_now_ms(t);
    *out = c;
    if (t->cbs.on_conn) t->cbs.on_conn(t->arg, c);
    return 0;
}

void ap__tcp_conn_feed(ap_tcp_conn_t *c, const uint8_t *p, size_t n)
{
    if (c->st != C_OPEN) return;
    c->last_rx = ap__tcp_now_ms(c->t);
    uint8_t *copy = malloc(n ? n : 1); /* ap__tcp_process() decrypts in place */
    if (!copy) return;
    memcpy(copy, p, n);
    ap__tcp_process(c, copy, n);
    free(copy);
}

bool ap__tcp_conn_is_open(const ap_tcp_conn_t *c)
{
    return c->st == C_OPEN;
}

void ap__tcp_conn_close(ap_tcp_conn_t *c)
{
    if (c->st == C_CLOSING) return;
    if (c->queued == 0 || c->st != C_OPEN) {
        ap__tcp_conn_abort(c, 0);
        return;
    }
    c->draining = true;
    c->drain_started = ap__tcp_now_ms(c->t);
}

const ap_peer_id_t *ap__tcp_conn_peer(const ap_tcp_conn_t *c)
{
    return &c->peer;
}
bool ap__tcp_conn_outbound(const ap_tcp_conn_t *c)
{
    return c->outbound;
}
void ap__tcp_conn_set_user(ap_tcp_conn_t *c, void *user)
{
    c->user = user;
}
void *ap__tcp_conn_user(const ap_tcp_conn_t *c)
{
    return c->user;
}
const ap_identity_t *ap__tcp_identity(const ap_tcp_t *t)
{
    return &t->creds.id;
}

/* ---- the sweep: deadlines, keepalive, dead peers, idle, buffers ----------------- */

static void sweep_conn(ap_tcp_t *t, ap_tcp_conn_t *c, uint64_t now)
{
    const ap_tcp_cfg_t *cfg = &t->cfg;
    if (c->st == C_CONNECTING || c->st == C_HANDSHAKE) {
        if (now >= c->deadline) {
            if (c->outbound) {
                ap_debug(MOD, "dial to %s timed out", c->who);
                ap__tcp_conn_abort(c, AP_ETIMEDOUT);
            } else {
                ap__tcp_conn_fail(c, AP_ETIMEDOUT, "handshake not finished in %llu ms",
                                  (unsigned long long)cfg->handshake_timeout_ms);
            }
        }
        return;
    }
    if (c->st != C_OPEN) return;
    if (c->draining && now - c->drain_started >= DRAIN_MS) {
        ap__tcp_conn_abort(c, 0);
        return;
    }
    if (c->inflight > 0 && now - c->write_started >= cfg->dead_ms) {
        ap__tcp_conn_fail(c, AP_ETIMEDOUT, "peer read nothing for %llu ms",
                          (unsigned long long)(now - c->write_started));
        return;
    }
    if (!c->paused && now - c->last_rx >= cfg->dead_ms) {
        ap__tcp_conn_fail(c, AP_ETIMEDOUT, "peer silent for %llu ms",
                          (unsigned long long)(now - c->last_rx));
        return;
    }
    if (cfg->idle_ms && now - c->last_app >= cfg->idle_ms) {
        ap_info(MOD, "closing idle connection %s %s", c->outbound ? "to" : "from", c->who);
        ap__tcp_conn_close(c);
        return;
    }
    if (now - c->last_tx >= cfg->keepalive_ms && c->queued == 0) {
        if (ap__tcp_queue_sealed(c, NULL, 0, 0) == 0)
            ap__tcp_flush(c);
        else
            ap__tcp_conn_abort(c, AP_ELIMIT);
        return;
    }
    /* release buffers of quiet connections (idle memory stays small) */
    if (c->inflight == 0 && c->queued == 0 && now - c->last_tx >= BUF_RELEASE_MS)
        ap__tcp_wblocks_free(c);
    if (c->plen == 0 && c->part && now - c->last_rx >= BUF_RELEASE_MS) {
        free(c->part);
        c->part = NULL;
    }
}

static void sweep_cb(uv_timer_t *h)
{
    ap_tcp_t *t = h->data;
    uint64_t now = ap__tcp_now_ms(t);
    for (ap_tcp_conn_t *c = t->conns, *nx; c; c = nx) {
        nx = c->next; /* c is only freed in a close callback, later */
        sweep_conn(t, c, now);
    }
    for (dial_req_t *r = t->resolving; r; r = r->next) {
        if (!r->timed_out && now >= r->deadline) {
            r->timed_out = true;
            ap_multiaddr_resolve_cancel(r->res);
        }
    }
}

/* ---- lifecycle ------------------------------------------------------------------- */

static uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

int ap__tcp_new(uv_loop_t *loop, const ap_identity_t *id, const ap_tcp_cfg_t *cfg,
                const ap_tcp_cbs_t *cbs, void *arg, ap_tcp_t **out)
{
    ap_tcp_t *t = calloc(1, sizeof *t);
    if (!t) return AP_ENOMEM;
    t->loop = loop;
    if (cfg) t->cfg = *cfg;
    ap_tcp_cfg_t *c = &t->cfg;
    if (!c->max_conns) c->max_conns = 1024;
    if (!c->max_handshakes) c->max_handshakes = 256;
    if (!c->handshake_timeout_ms) c->handshake_timeout_ms = 10000;
    if (!c->keepalive_ms) c->keepalive_ms = 15000;
    if (!c->dead_ms) c->dead_ms = c->keepalive_ms == UINT64_MAX ? UINT64_MAX : 3 * c->keepalive_ms;
    if (!c->write_queue_max) c->write_queue_max = 4u << 20;
    if (c->read_buf_size < 4096) c->read_buf_size = c->read_buf_size ? 4096 : 1024u * 1024u;
    if (cbs) t->cbs = *cbs;
    t->arg = arg;
    int rc = ap__secure_creds_init(&t->creds, id, c->hash, NULL);
    t->rbuf = malloc(c->read_buf_size);
    if (rc || !t->rbuf) {
        free(t->rbuf);
        ap__secure_creds_clear(&t->creds);
        free(t);
        return rc ? rc : AP_ENOMEM;
    }
    memset(t->rbuf, 0, c->read_buf_size); /* pre-fault once */
    ap_admit_config_t ac = {.hs_full = (uint32_t)c->max_handshakes,
                            .hs_start = (uint32_t)c->max_handshakes / 4,
                            .hs_per_ip = (uint32_t)c->hs_per_ip,
                            .max_conns = (uint32_t)c->max_conns,
                            .conns_per_ip = (uint32_t)c->conns_per_ip,
                            .evict_idle_ms = c->evict_idle_ms};
    ap_admit_init(&t->admit, &ac);
    uint64_t shortest = min_u64(min_u64(c->keepalive_ms, c->dead_ms), c->handshake_timeout_ms);
    if (c->idle_ms) shortest = min_u64(shortest, c->idle_ms);
    t->sweep_ms = shortest / 4;
    if (t->sweep_ms < 5) t->sweep_ms = 5;
    if (t->sweep_ms > 250) t->sweep_ms = 250;
    uv_timer_init(loop, &t->sweep);
    uv_timer_init(loop, &t->kick);
    t->sweep.data = t->kick.data = t;
    t->handles += 2;
    uv_timer_start(&t->sweep, sweep_cb, t->sweep_ms, t->sweep_ms);
    *out = t;
    return 0;
}

static void handle_closed(uv_handle_t *h)
{
    ap_tcp_t *t = h->data;
    t->handles--;
    ap__tcp_maybe_finish(t);
}

void ap__tcp_listener_closed(uv_handle_t *h)
{
    ap_tcp_t *t = h->data;
    free(h);
    t->handles--;
    ap__tcp_maybe_finish(t);
}

static void kick_closed(uv_handle_t *h)
{
    ap_tcp_t *t = h->data;
    while (t->deferred) {
        dial_req_t *r = t->deferred;
        ap__tcp_list_remove(&t->deferred, r);
        ap__tcp_dial_done(r, AP_ESHUTDOWN, NULL);
    }
    handle_closed(h);
}

void ap__tcp_close(ap_tcp_t *t, void (*done)(void *arg), void *arg)
{
    if (t->closing) return;
    t->closing = true;
    t->done = done;
    t->done_arg = arg;
    for (int i = 0; i < t->nlisteners; i++)
        uv_close((uv_handle_t *)t->listeners[i], ap__tcp_listener_closed);
    uv_close((uv_handle_t *)&t->sweep, handle_closed);
    uv_close((uv_handle_t *)&t->kick, kick_closed);
    for (ap_tcp_conn_t *c = t->conns; c; c = c->next) ap__tcp_conn_abort(c, AP_ESHUTDOWN);
    ap__tcp_p2p_close(t);
    for (dial_req_t *r = t->resolving; r; r = r->next) ap_multiaddr_resolve_cancel(r->res);
}

void ap__tcp_get_stats(const ap_tcp_t *t, ap_tcp_stats_t *out)
{
    *out = t->stats;
    out->handshaking = (uint32_t)t->nhandshaking;
    out->admit = *ap_admit_stats(&t->admit);
}
