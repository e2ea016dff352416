/* libp2p on the transport's TCP port: an inbound connection whose first byte
 * is 0x13 (the length of "/multistream/1.0.0\n") is a libp2p dialer. A native
 * handshake starts with a 2-byte frame length far below 0x1300, so the two
 * cannot be confused. The socket moves to a libp2p host sharing the
 * transport's identity, which serves identify, ping and AutoNAT v1 (it
 * dials a requester back only at its own IP: src/p2p/autonat.h), and, with
 * a bridge (ap__tcp_set_bridge), the node's own protocols. The node's
 * libp2p dials go through the same host. */
#include "apiary/error.h"
#include "apiary/log.h"
#include "net/tcp_impl.h"
#include "p2p/autonat_uv.h"
#include "p2p/dcutr_uv.h"
#include "p2p/p2p_conn.h"
#include "p2p/relay_svc.h"

#include <string.h>
#include <unistd.h>

#define MSS_FIRST_BYTE  0x13
#define AUTONAT_DIAL_MS 5000 /* a dial-back must prove the requester's PeerID within this */

void ap__tcp_set_announce(ap_tcp_t *t, ap_tcp_addrs_fn fn, void *arg)
{
    t->announce = fn;
    t->announce_arg = arg;
}

static bool wildcard(const ap_multiaddr_t *ma)
{
    static const uint8_t zero[16] = {0};
    return (ma->host == AP_MA_HOST_IP4 && memcmp(ma->ip, zero, 4) == 0) ||
           (ma->host == AP_MA_HOST_IP6 && memcmp(ma->ip, zero, 16) == 0);
}

/* identify's listen addresses: the node's, else the concrete bound ones */
static int listen_addrs(void *arg, ap_multiaddr_t *out, int max)
{
    ap_tcp_t *t = arg;
    if (t->announce) return t->announce(t->announce_arg, out, max);
    int k = 0;
    for (int i = 0; i < t->nlisteners && k < max; i++)
        if (!wildcard(&t->listen_ma[i])) out[k++] = t->listen_ma[i];
    return k;
}

void ap__tcp_set_bridge(ap_tcp_t *t, const struct ap_p2p_bridge *b, void *arg)
{
    t->bridge = b;
    t->bridge_arg = arg;
    if (t->p2p && ap__p2p_host_set_bridge(t->p2p, b, arg) != 0)
        ap_warn(MOD, "libp2p host busy: its muxers stay as they were");
}

static void admit_evict(void *arg, uint64_t id)
{
    ap__tcp_admit_evict(arg, id);
}

static bool admit_known(void *arg, const ap_peer_id_t *peer)
{
    ap_tcp_t *t = arg;
    return t->cbs.is_known && t->cbs.is_known(t->arg, peer);
}

void ap__tcp_set_rcmgr(ap_tcp_t *t, struct ap_rcmgr *m)
{
    t->rc = m;
    if (t->p2p) ap__p2p_host_set_rcmgr(t->p2p, m);
}

static ap_p2p_host_t *host(ap_tcp_t *t)
{
    if (t->p2p) return t->p2p;
    ap_p2p_host_t *h = ap__p2p_host_new(t->loop, &t->creds.id, "apiary");
    if (!h) return NULL;
    ap__p2p_host_set_addrs(h, listen_addrs, t);
    /* one admission for both: a libp2p connection takes its native entry
     * along when it moves to the host, and either kind may be closed to
     * make room for the other */
    static const ap_p2p_admit_hooks_t hooks = {admit_evict, admit_known};
    ap__p2p_host_set_admit(h, &t->admit, &hooks, t);
    ap__p2p_host_set_rcmgr(h, t->rc);
    ap__p2p_host_set_hs_timeout(h, t->cfg.handshake_timeout_ms);
    ap_autonat_service_t *an = NULL;
    if (ap__p2p_host_serve_basics(h) != 0 ||
        (t->bridge && ap__p2p_host_set_bridge(h, t->bridge, t->bridge_arg) != 0) ||
        !(an = ap__autonat_serve(h, AUTONAT_DIAL_MS))) {
        ap__p2p_host_free(h);
        return NULL;
    }
    t->p2p = h;
    t->autonat = an;
    return h;
}

ap_p2p_host_t *ap__tcp_p2p_host(ap_tcp_t *t)
{
    return t->closing ? NULL : host(t);
}

int ap__tcp_serve_relay(ap_tcp_t *t, const struct ap_relay_limits *lim)
{
    if (t->relay) return AP_EEXIST;
    ap_p2p_host_t *h = ap__tcp_p2p_host(t);
    if (!h) return AP_ENOMEM;
    t->relay = ap__relay_serve(h, lim);
    return t->relay ? 0 : AP_ENOMEM;
}

struct ap_relay_service *ap__tcp_relay(ap_tcp_t *t)
{
    return t->relay;
}

ap_relay_client_t *ap__tcp_use_relays(ap_tcp_t *t, const ap_multiaddr_t *relays, size_t n,
                                      ap_relay_inbound_fn on_inbound, void *arg)
{
    if (t->relay_cl) return NULL;
    ap_p2p_host_t *h = ap__tcp_p2p_host(t);
    if (!h) return NULL;
    t->relay_cl = ap__relay_client_new(h, relays, n, on_inbound, arg);
    return t->relay_cl;
}

ap_relay_client_t *ap__tcp_relay_client(ap_tcp_t *t)
{
    return t->relay_cl;
}

ap_dcutr_t *ap__tcp_serve_dcutr(ap_tcp_t *t, const ap_dcutr_opts_t *o, ap_dcutr_result_fn cb,
                                void *arg)
{
    if (t->dcutr) return NULL;
    ap_p2p_host_t *h = ap__tcp_p2p_host(t);
    if (!h) return NULL;
    t->dcutr = ap__dcutr_serve(h, o, cb, arg);
    return t->dcutr;
}

ap_dcutr_t *ap__tcp_dcutr(ap_tcp_t *t)
{
    return t->dcutr;
}

bool ap__tcp_sniff(ap_tcp_conn_t *c, const uint8_t *p, size_t n)
{
    ap_tcp_t *t = c->t;
    if (n == 0 || p[0] != MSS_FIRST_BYTE || t->closing) return false;
    ap_p2p_host_t *h = host(t);
    uv_os_fd_t fd;
    if (!h || uv_fileno((uv_handle_t *)&c->h, &fd) != 0) {
        ap__tcp_conn_fail(c, AP_ENOMEM, "cannot serve its libp2p connection");
        return true;
    }
    int dup_fd = dup(fd);
    if (dup_fd < 0) {
        ap__tcp_conn_fail(c, AP_EIO, "cannot serve its libp2p connection");
        return true;
    }
    ap_debug(MOD, "%s speaks multistream-select: serving it as libp2p", c->who);
    /* its admission entry (pending, with its age) and its deadline go along */
    uint64_t aid = c->admitted ? (uint64_t)(uintptr_t)c : 0, deadline = c->deadline;
    c->admitted = false;
    ap__tcp_conn_abort(c, AP_ECLOSED); /* closes our descriptor; dup_fd keeps the socket */
    int rc = ap__p2p_host_adopt(h, (uv_os_sock_t)dup_fd, p, n, aid, deadline);
    if (rc) ap_debug(MOD, "libp2p connection not served: %s", ap_strerror(rc));
    return true;
}

static void p2p_freed(void *arg)
{
    ap_tcp_t *t = arg;
    ap__autonat_service_free(t->autonat);
    t->autonat = NULL;
    if (t->relay) ap__relay_service_free(t->relay);
    t->relay = NULL;
    ap__relay_client_free(t->relay_cl);
    t->relay_cl = NULL;
    ap__dcutr_free(t->dcutr);
    t->dcutr = NULL;
    t->handles--;
    ap__tcp_maybe_finish(t);
}

void ap__tcp_p2p_close(ap_tcp_t *t)
{
    if (!t->p2p) return;
    ap_p2p_host_t *h = t->p2p;
    t->p2p = NULL;
    t->handles++;
    ap__p2p_host_free_then(h, p2p_freed, t);
}
