/* Secure TCP transport: admission. Listening, accepting under the caps on
 * connections and handshakes, the Noise XX handshake (both directions) and
 * the choice between duplicate connections to one peer. */
#include "net/tcp_impl.h"
#include "p2p/p2p_conn.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- handshake ------------------------------------------------------------------- */

static int hs_write(ap_tcp_conn_t *c)
{
    uint8_t m[AP_TCP_HS_MSG_MAX];
    size_t n;
    int rc = ap__secure_write(c->hs, m, sizeof m, &n);
    if (rc == 0) rc = ap__tcp_queue_plain(c, m, n);
    if (rc == 0) ap__tcp_flush(c);
    return rc;
}

/* Both ends agree: between two connections to the same peer, keep the one
 * dialled by the smaller PeerID; same dialler: keep the older one. */
static bool new_wins(ap_tcp_t *t, ap_tcp_conn_t *old, ap_tcp_conn_t *nw)
{
    if (old->outbound == nw->outbound) return false;
    const ap_peer_id_t *self = &t->creds.id.id;
    bool self_smaller = ap_peer_id_cmp(self, &nw->peer) < 0;
    /* the winner is the connection we dialled iff we are the smaller id */
    return nw->outbound == self_smaller;
}

static void hs_finish(ap_tcp_conn_t *c)
{
    ap_tcp_t *t = c->t;
    int rc = ap__secure_split(c->hs, &c->send, &c->recv);
    free(c->hs);
    c->hs = NULL;
    if (rc) {
        ap__tcp_conn_fail(c, AP_EPROTO, "handshake split failed");
        return;
    }
    if (c->counted_hs) {
        c->counted_hs = false;
        t->nhandshaking--;
    }
    t->stats.handshakes_ok++;
    ap_tcp_conn_t *old = ap__tcp_find(t, &c->peer);
    bool in_table = true;
    if (old && t->cfg.keep_duplicates && old->outbound != c->outbound) {
        /* both stay open; the layer above retires the loser (GOAWAY) */
        t->stats.dup_kept++;
        if (new_wins(t, old, c)) {
            ap_debug(MOD, "duplicate connection %s %s: it becomes the peer's connection",
                     c->outbound ? "to" : "from", c->who);
            ap__tcp_table_remove(t, old);
        } else {
            ap_debug(MOD, "duplicate connection %s %s: kept open for the layer above",
                     c->outbound ? "to" : "from", c->who);
            in_table = false;
        }
    } else if (old) {
        t->stats.dup_closed++;
        if (!new_wins(t, old, c)) {
            ap_debug(MOD, "duplicate connection %s %s: keeping the existing one",
                     c->outbound ? "to" : "from", c->who);
            /* waiting dials get the surviving connection */
            while (c->reqs) {
                dial_req_t *r = c->reqs;
                c->reqs = r->next;
                ap__tcp_dial_done(r, old->st == C_OPEN ? 0 : AP_ECLOSED, old);
            }
            ap__tcp_conn_abort(c, AP_EEXIST);
            return;
        }
        ap_debug(MOD, "duplicate connection %s %s: replacing the existing one",
                 c->outbound ? "to" : "from", c->who);
        ap__tcp_conn_abort(old, AP_EEXIST);
    }
    /* Open connections: per source IP and in total, slots kept for own dials
     * and known peers; at a limit the least useful idle inbound connection
     * makes room (base/admit.h), so held connections cannot lock peers out. */
    if (!c->outbound && c->admitted) {
        uint64_t victim = 0;
        bool known = t->cbs.is_known && t->cbs.is_known(t->arg, &c->peer);
        ap_admit_verdict_t v =
            ap_admit_open(&t->admit, (uint64_t)(uintptr_t)c, known, ap__tcp_now_ms(t), &victim);
        if (v == AP_ADMIT_DROP) {
            static ap_log_limit_t lim = {.burst = 8, .window_ms = 10000};
            const ap_admit_stats_t *as = ap_admit_stats(&t->admit);
            ap_log_limited(&lim, AP_LOG_WARN, MOD,
                           "refusing connection from %s: %u inbound connections open, none idle "
                           "to make room",
                           c->who, as->open_in);
            t->stats.refused_open++;
            ap__tcp_conn_abort(c, AP_ELIMIT);
            return;
        }
        if (v == AP_ADMIT_EVICT) {
            ap_debug(MOD, "closing an idle connection to make room for %s", c->who);
            t->stats.evicted_idle++;
            ap__tcp_admit_evict(t, victim);
        }
    }
    if (in_table && ap__tcp_table_insert(t, c) != 0) {
        ap__tcp_conn_abort(c, AP_ENOMEM);
        return;
    }
    c->st = C_OPEN;
    t->stats.open++;
    c->announced = true;
    c->last_app = c->last_rx = c->last_tx = ap__tcp_now_ms(t);
    ap_info(MOD, "connection %s %s open", c->outbound ? "to" : "from", c->who);
    if (t->cbs.on_conn) t->cbs.on_conn(t->arg, c);
    ap__tcp_dials_done(c, c->st == C_OPEN ? 0 : AP_ECLOSED);
}

void ap__tcp_hs_frame(ap_tcp_conn_t *c, const uint8_t *m, size_t n)
{
    int rc = ap__secure_read(c->hs, m, n);
    if (rc != 0) {
        const ap_peer_id_t *who = ap__secure_remote(c->hs);
        if (who) {
            c->peer = *who;
            ap__tcp_set_who_peer(c);
        }
        if (rc == AP_EAUTH && who && c->has_expected) {
            char want[AP_PEER_ID_STR_MAX], got[AP_PEER_ID_STR_MAX];
            ap__tcp_conn_fail(c, AP_EAUTH, "expected peer %s but it is %s",
                              ap_peer_id_str(&c->expected, want), ap_peer_id_str(who, got));
        } else {
            ap__tcp_conn_fail(c, rc, "handshake message %d rejected", c->hs->noise.step + 1);
        }
        return;
    }
    if (ap__secure_remote(c->hs) && !c->has_peer) {
        c->peer = *ap__secure_remote(c->hs);
        c->has_peer = true;
        ap__tcp_set_who_peer(c);
    }
    if (ap__secure_my_turn(c->hs) && (rc = hs_write(c)) != 0) {
        ap__tcp_conn_fail(c, rc, "cannot write handshake message");
        return;
    }
    if (ap__secure_done(c->hs)) hs_finish(c);
}

int ap__tcp_hs_start(ap_tcp_conn_t *c)
{
    ap_tcp_t *t = c->t;
    c->hs = malloc(sizeof *c->hs);
    if (!c->hs) return AP_ENOMEM;
    int rc = ap__secure_init_prologue(c->hs, &t->creds, c->outbound,
                                      c->has_expected ? &c->expected : NULL, NULL,
                                      (const uint8_t *)AP_TCP_PROLOGUE, strlen(AP_TCP_PROLOGUE));
    if (rc) return rc;
    c->st = C_HANDSHAKE;
    c->last_rx = c->last_tx = ap__tcp_now_ms(t);
    uv_tcp_nodelay(&c->h, 1);
    ap__tcp_start_reading(c);
    if (c->outbound) return hs_write(c);
    return 0;
}

void ap__tcp_ip16(const struct sockaddr_storage *ss, uint8_t ip[16])
{
    memset(ip, 0, 16);
    if (ss->ss_family == AF_INET) {
        ip[10] = ip[11] = 0xff;
        memcpy(ip + 12, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        memcpy(ip, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
    }
}

void ap__tcp_admit_evict(ap_tcp_t *t, uint64_t id)
{
    if (id & AP_P2P_ADMIT_TAG) {
        if (t->p2p) ap__p2p_host_evict(t->p2p, id);
        return;
    }
    ap_tcp_conn_t *c = (ap_tcp_conn_t *)(uintptr_t)id;
    ap_debug(MOD, "closing the connection from %s to make room", c->who);
    ap__tcp_conn_abort(c, AP_ELIMIT);
}

/* The remote address as 16 bytes (IPv4 as ::ffff:a.b.c.d). */
static void remote_ip16(ap_tcp_conn_t *c, uint8_t ip[16])
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    if (uv_tcp_getpeername(&c->h, (struct sockaddr *)&ss, &len) != 0) ss.ss_family = AF_UNSPEC;
    ap__tcp_ip16(&ss, ip);
}

static void on_connection(uv_stream_t *server, int status)
{
    ap_tcp_t *t = server->data;
    if (status < 0 || t->closing) return;
    ap_tcp_conn_t *c = ap__tcp_conn_new(t, false);
    if (!c) return;
    if (uv_accept(server, (uv_stream_t *)&c->h) != 0) {
        ap__tcp_conn_abort(c, AP_EIO);
        return;
    }
    ap__tcp_set_who_addr(c);
    /* Accept and drop over the caps, so the backlog never fills with
     * connections nobody will serve. Open connections are admitted (or make
     * room) when their handshake is done; this bounds the sockets. */
    if (t->nconns > t->cfg.max_conns + t->cfg.max_handshakes) {
        ap_debug(MOD, "refusing connection from %s: %zu connections", c->who, t->nconns - 1);
        ap__tcp_conn_abort(c, AP_ELIMIT);
        return;
    }
    /* Pending handshakes: per source address and in total, random early
     * drop past a soft limit, a stalled one closed for a newcomer at the
     * hard limit (base/admit.h): stalled handshakes cannot lock peers out. */
    uint8_t ip[16];
    remote_ip16(c, ip);
    if (!ap_admit_has_room(&t->admit, ip, ap__tcp_now_ms(t))) {
        const ap_admit_stats_t *as = ap_admit_stats(&t->admit);
        ap_debug(MOD, "refusing connection from %s: %u connections open, none idle", c->who,
                 as->open_in + as->open_out);
        t->stats.refused_open++;
        ap__tcp_conn_abort(c, AP_ELIMIT);
        return;
    }
    uint64_t victim = 0;
    ap_admit_verdict_t v = ap_admit_inbound(&t->admit, (uint64_t)(uintptr_t)c, ip,
                                            ap__tcp_now_ms(t), randombytes_random(), &victim);
    if (v == AP_ADMIT_DROP) {
        ap_debug(MOD, "refusing connection from %s: %u handshakes pending from it, %u in all",
                 c->who, ap_admit_pending_ip(&t->admit, ip), ap_admit_stats(&t->admit)->pending);
        ap__tcp_conn_abort(c, AP_ELIMIT);
        return;
    }
    /* one count for native and libp2p handshakes: a socket that turns out to
     * speak multistream-select takes its entry along to the libp2p host
     * (tcp_p2p.c), which keeps it until its upgrade is done */
    c->admitted = true;
    if (v == AP_ADMIT_EVICT) {
        ap_debug(MOD, "closing a stalled handshake for %s", c->who);
        ap__tcp_admit_evict(t, victim);
    }
    c->counted_hs = true;
    t->nhandshaking++;
    c->deadline = ap__tcp_now_ms(t) + t->cfg.handshake_timeout_ms;
    int rc = ap__tcp_hs_start(c);
    if (rc) ap__tcp_conn_abort(c, rc);
}

int ap__tcp_listen(ap_tcp_t *t, const char *multiaddr)
{
    if (t->closing) return AP_ESHUTDOWN;
    if (t->nlisteners >= AP_TCP_MAX_LISTENERS) return AP_ELIMIT;
    ap_multiaddr_t ma;
    struct sockaddr_storage ss;
    if (ap_multiaddr_parse(&ma, multiaddr) != 0 || ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss))
        return AP_EADDR;
    uv_tcp_t *l = malloc(sizeof *l);
    if (!l) return AP_ENOMEM;
    int rc = uv_tcp_init(t->loop, l);
    if (rc) {
        free(l);
        return ap_err_from_errno(rc);
    }
    l->data = t;
    t->handles++;
    if (t->cfg.reuse_port) { /* hole punching dials from this port (p2p/dcutr_uv.h) */
        int one = 1, fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
            setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0 ||
            (rc = uv_tcp_open(l, fd)) != 0) {
            if (fd >= 0) close(fd);
            ap_error(MOD, "cannot listen on %s: cannot set SO_REUSEPORT", multiaddr);
            uv_close((uv_handle_t *)l, ap__tcp_listener_closed);
            return AP_ESYS;
        }
    }
    rc = uv_tcp_bind(l, (struct sockaddr *)&ss, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)l, 511, on_connection);
    int len = sizeof ss;
    if (rc == 0) rc = uv_tcp_getsockname(l, (struct sockaddr *)&ss, &len);
    if (rc) {
        ap_error(MOD, "cannot listen on %s: %s", multiaddr, uv_strerror(rc));
        uv_close((uv_handle_t *)l, ap__tcp_listener_closed);
        return ap_err_from_errno(rc);
    }
    t->listeners[t->nlisteners] = l;
    ap_multiaddr_from_sockaddr(&t->listen_ma[t->nlisteners], &ss);
    t->listen_ma[t->nlisteners].has_peer = true;
    t->listen_ma[t->nlisteners].peer = t->creds.id.id;
    t->nlisteners++;
    return 0;
}

int ap__tcp_listen_addrs(ap_tcp_t *t, ap_multiaddr_t *out, int max)
{
    for (int i = 0; i < t->nlisteners && i < max; i++) out[i] = t->listen_ma[i];
    return t->nlisteners;
}
