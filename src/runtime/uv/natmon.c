/* libuv driver: a node's reachability. AutoNAT v1 probes through the peers
 * the node is connected to, the verdict kept by src/p2p/reach.h, and the
 * port mapping of src/p2p/portmap.h (see apiary/node.h, docs/nat.md). */
#include "runtime/uv/natmon.h"

#include "apiary/log.h"
#include "p2p/autonat_uv.h"
#include "p2p/portmap.h"
#include "p2p/reach.h"
#include "runtime/uv/uv_impl.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD         "nat"
#define MAX_ASK     5 /* peers asked per round */
#define CALL_MS     15000
#define TICK_US     1000000u
#define FIRST_US    3000000u
#define RETRY_US    20000000u
#define RECHECK_US  (15ull * 60 * 1000000)
#define DIAL_BACK_N 3 /* addresses offered: believed IPs and the mapped one */

typedef struct ap_natmon natmon_t;

typedef struct ask {
    natmon_t *m;
    ap_peer_id_t peer;
    ap_multiaddr_t addr; /* with /p2p/ */
} ask_t;

struct ap_natmon {
    ap_node_t *node; /* NULL once the node is gone */
    ap_p2p_host_t *h;
    ap_node_nat_opts_t o;
    ap_obs_t obs;
    ap_reach_t reach;
    uint16_t port;
    uint64_t timer;
    bool round; /* a probe round is under way */
    int pending;
    ask_t asks[MAX_ASK];
    int nasks;
    int answers[MAX_ASK];
    ap_multiaddr_t offered[DIAL_BACK_N];
    size_t noffered;
    /* port mapping: the portmap thread posts its answers (ap_rt_post) */
    ap_portmap_t *pm;
    bool mapped;
    ap_multiaddr_t mapped_ma;
    bool announced; /* the mapped address is what the node advertises */
    char saved[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int nsaved;
};

/* ---- verdicts ----------------------------------------------------------------------- */

const char *ap_node_reach_name(ap_node_reach_t r)
{
    return ap__reach_name((ap_reach_state_t)r);
}

static void update_announce(natmon_t *m)
{
    ap_node_t *n = m->node;
    bool want = m->mapped && m->reach.state == AP_REACH_PUBLIC && m->reach.has_addr &&
                ap_multiaddr_eq(&m->reach.addr, &m->mapped_ma);
    if (want == m->announced) return;
    if (want) {
        char a[AP_RT_ADDR_MAX];
        if (ap_multiaddr_print(&m->mapped_ma, a, sizeof a) < 0) return;
        const char *one[1] = {a};
        if (ap__node_set_announce(n, one, 1) != 0) return;
        ap_info(MOD, "advertising the mapped address %s (peers dialled it)", a);
    } else {
        memcpy(n->announce, m->saved, sizeof m->saved);
        n->nannounce = m->nsaved;
        ap_info(MOD, "no longer advertising the mapped address");
    }
    m->announced = want;
}

static void changed(natmon_t *m, ap_reach_state_t was)
{
    char a[AP_RT_ADDR_MAX] = "";
    if (m->reach.state == AP_REACH_PUBLIC && m->reach.has_addr)
        ap_multiaddr_print(&m->reach.addr, a, sizeof a);
    else if (m->noffered)
        ap_multiaddr_print(&m->offered[0], a, sizeof a);
    /* one line per change: the owner's callback prints its own */
    ap_log(m->o.on_change ? AP_LOG_DEBUG : AP_LOG_INFO, MOD, "reachability %s -> %s (%s %s)",
           ap__reach_name(was), ap__reach_name(m->reach.state),
           m->reach.state == AP_REACH_PUBLIC ? "peers dialled back" : "peers could not dial",
           a[0] ? a : "-");
    update_announce(m);
    if (m->o.on_change) m->o.on_change(&m->node->rt, m->o.arg, (ap_node_reach_t)m->reach.state, a);
}

/* ---- a probe round ---------------------------------------------------------------------- */

static uint64_t now_us(natmon_t *m)
{
    return ap__host_now_us(m->node->host);
}

static void round_done(natmon_t *m)
{
    m->round = false;
    ap__reach_probed(&m->reach, now_us(m));
}

static void on_answer(void *arg, int status, const ap_multiaddr_t *addr, const char *text)
{
    ask_t *k = arg;
    natmon_t *m = k->m;
    if (!m->node) return;
    char who[AP_PEER_SHORT_LEN];
    ap_debug(MOD, "AutoNAT answer from %s: %s%s%s", ap_peer_id_short(&k->peer, who),
             ap__autonat_status_name(status), text && *text ? ": " : "", text ? text : "");
    if (status >= 0) {
        ap_reach_state_t was = m->reach.state;
        if (ap__reach_answer(&m->reach, &k->peer, status, addr, now_us(m))) changed(m, was);
    }
    if (--m->pending == 0) round_done(m);
}

static void start_probes(natmon_t *m)
{
    ap_multiaddr_t ips[DIAL_BACK_N];
    size_t n = ap__obs_believed_ips(&m->obs, now_us(m), ips, DIAL_BACK_N);
    m->noffered = 0;
    if (m->mapped) m->offered[m->noffered++] = m->mapped_ma;
    for (size_t i = 0; i < n && m->noffered < DIAL_BACK_N; i++) {
        ap_multiaddr_t a = ips[i];
        a.has_tcp = true;
        a.port = m->port;
        bool dup = false;
        for (size_t j = 0; j < m->noffered; j++) dup |= ap_multiaddr_eq(&a, &m->offered[j]);
        if (!dup) m->offered[m->noffered++] = a;
    }
    if (n == 0) {
        ap_debug(MOD, "no public address believed yet (fewer than %d peers agree)", AP_OBS_BELIEVE);
        round_done(m);
        return;
    }
    m->pending = 1; /* held while starting */
    for (int i = 0; i < m->nasks; i++) {
        m->pending++;
        int rc = ap__autonat_probe(m->h, &m->asks[i].addr, m->offered, m->noffered, CALL_MS,
                                   on_answer, &m->asks[i]);
        if (rc) m->pending--;
    }
    if (--m->pending == 0) round_done(m);
}

static void on_identify(void *arg, int status, const ap_identify_t *id)
{
    ask_t *k = arg;
    natmon_t *m = k->m;
    if (!m->node) return;
    if (status == 0 && id->has_observed) ap__obs_add(&m->obs, &k->peer, &id->observed, now_us(m));
    if (--m->pending == 0) start_probes(m);
}

/* Connected peers with a TCP address in the book, up to MAX_ASK, from a
 * random one on. */
static int pick(natmon_t *m)
{
    ap_node_t *n = m->node;
    int nconn = 0;
    for (ap_mconn_t *c = n->conns; c; c = c->next) nconn++;
    int skip = nconn ? (int)randombytes_uniform((uint32_t)nconn) : 0;
    m->nasks = 0;
    for (int pass = 0; pass < 2; pass++) {
        int i = 0;
        for (ap_mconn_t *c = n->conns; c && m->nasks < MAX_ASK; c = c->next, i++) {
            if ((pass == 0) != (i >= skip)) continue;
            if (c->state != MC_UP || !c->known_peer) continue;
            bool dup = false;
            for (int j = 0; j < m->nasks && !dup; j++)
                dup = ap_peer_id_eq(&m->asks[j].peer, &c->peer);
            if (dup) continue;
            for (size_t b = 0; b < n->nbook; b++) {
                if (!ap_peer_id_eq(&n->book[b].peer, &c->peer)) continue;
                for (int a = 0; a < n->book[b].n; a++) {
                    ap_multiaddr_t ma;
                    if (ap_multiaddr_parse(&ma, n->book[b].addrs[a]) != 0 || !ma.has_tcp ||
                        ma.host != AP_MA_HOST_IP4 || ma.circuit)
                        continue;
                    ma.has_peer = true;
                    ma.peer = c->peer;
                    m->asks[m->nasks++] = (ask_t){m, c->peer, ma};
                    break;
                }
                break;
            }
        }
    }
    return m->nasks;
}

static void tick(ap_rt_t *rt, void *arg)
{
    natmon_t *m = arg;
    if (m->round || !ap__reach_due(&m->reach, now_us(m))) return;
    if (pick(m) == 0) {
        ap_debug(MOD, "no connected peer to ask");
        ap__reach_probed(&m->reach, now_us(m));
        return;
    }
    m->round = true;
    m->pending = 1;
    for (int i = 0; i < m->nasks; i++) {
        m->pending++;
        int rc = ap__p2p_identify_peer(m->h, &m->asks[i].addr, CALL_MS, on_identify, &m->asks[i]);
        if (rc) m->pending--;
    }
    if (--m->pending == 0) start_probes(m);
}

/* ---- port mapping ---------------------------------------------------------------------- */

typedef struct mapped_msg {
    int status;
    ap_portmap_lease_t l;
} mapped_msg_t;

static void on_mapped_loop(ap_rt_t *rt, void *arg)
{
    mapped_msg_t *msg = arg;
    natmon_t *m = ((ap_node_t *)rt)->natmon;
    if (m) {
        char t[96];
        snprintf(t, sizeof t, "/ip4/%s/tcp/%u", msg->l.external_ip, (unsigned)msg->l.external_port);
        bool ok = msg->status == 0 && ap_multiaddr_parse(&m->mapped_ma, t) == 0;
        if (ok != m->mapped || ok) {
            m->mapped = ok;
            /* a new address is not believed until AutoNAT dialled it: probe soon */
            if (ok) m->reach.next_probe_us = now_us(m);
            update_announce(m);
        }
    }
    free(msg);
}

/* the portmap's thread */
static void on_mapped(void *arg, int status, const ap_portmap_lease_t *l)
{
    ap_rt_t *rt = arg;
    mapped_msg_t *msg = calloc(1, sizeof *msg);
    if (!msg) return;
    msg->status = status;
    if (l) msg->l = *l;
    if (ap_rt_post(rt, on_mapped_loop, msg) != 0) free(msg);
}

/* ---- lifetime -------------------------------------------------------------------------- */

int ap_node_nat_start(ap_rt_t *rt, const ap_node_nat_opts_t *o)
{
    ap_node_t *n = (ap_node_t *)rt;
    if (!n->tcpc || !n->addr[0]) return AP_EINVAL;
    if (n->natmon) return AP_EEXIST;
    ap_multiaddr_t bound;
    if (ap_multiaddr_parse(&bound, n->addr) != 0 || !bound.has_tcp) return AP_EINVAL;
    natmon_t *m = calloc(1, sizeof *m);
    if (!m) return AP_ENOMEM;
    if (o) m->o = *o;
    m->node = n;
    m->port = bound.port;
    ap_identity_t id;
    memcpy(id.sk, rt->sk, AP_ED25519_SK_LEN);
    crypto_sign_ed25519_sk_to_pk(id.pk, id.sk);
    id.id = rt->self;
    m->h = ap__p2p_host_new(&n->host->loop, &id, "apiary");
    ap_identity_wipe(&id);
    if (!m->h || ap__p2p_host_serve_basics(m->h) != 0) {
        if (m->h) ap__p2p_host_free(m->h);
        free(m);
        return AP_ENOMEM;
    }
    ap__obs_init(&m->obs);
    uint64_t now = ap__host_now_us(n->host);
    ap__reach_init(&m->reach, now, m->o.retry_us ? m->o.retry_us : RETRY_US,
                   m->o.recheck_us ? m->o.recheck_us : RECHECK_US);
    m->reach.next_probe_us = now + (m->o.first_us ? m->o.first_us : FIRST_US);
    memcpy(m->saved, n->announce, sizeof m->saved);
    m->nsaved = n->nannounce;
    m->timer = ap_rt_timer_start(rt, TICK_US, TICK_US, tick, m);
    n->natmon = m;
    if (m->o.port_map) {
        m->pm = ap__portmap_start(m->port, AP_PORTMAP_ANY, on_mapped, rt);
        if (!m->pm) ap_warn(MOD, "cannot start the port mapping thread");
    }
    return 0;
}

ap_node_reach_t ap_node_reachability(ap_rt_t *rt, char *addr, size_t n)
{
    natmon_t *m = ((ap_node_t *)rt)->natmon;
    if (addr && n) addr[0] = 0;
    if (!m) return AP_NODE_REACH_UNKNOWN;
    if (addr && n && m->reach.state == AP_REACH_PUBLIC && m->reach.has_addr)
        ap_multiaddr_print(&m->reach.addr, addr, n);
    return (ap_node_reach_t)m->reach.state;
}

typedef struct take {
    ap_node_t *n;
    ap_portmap_t *pm;
} take_t;

static void take_pm(void *arg)
{
    take_t *t = arg;
    natmon_t *m = t->n->natmon;
    if (!m) return;
    t->pm = m->pm;
    m->pm = NULL;
}

void ap__natmon_unmap(ap_node_t *n)
{
    take_t t = {n, NULL};
    if (ap__host_on_loop(n->host, take_pm, &t) < 0) return;
    ap__portmap_stop(t.pm); /* here, not on the loop: it waits for the gateway */
}

static void host_freed(void *arg)
{
    free(arg);
}

void ap__natmon_free(ap_node_t *n)
{
    natmon_t *m = n->natmon;
    if (!m) return;
    n->natmon = NULL;
    m->node = NULL;                     /* callbacks still owed see this */
    if (m->pm) ap__portmap_stop(m->pm); /* not taken by ap__natmon_unmap: blocks here */
    m->pm = NULL;
    ap__p2p_host_free_then(m->h, host_freed, m);
}

/* ---- from other threads ------------------------------------------------------------------ */

typedef struct sync_args {
    const ap_node_nat_opts_t *o;
    char *addr;
    size_t n;
} sync_args_t;

static void start_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    sync_args_t *a = arg;
    ap_sync_complete(done, ap_node_nat_start(rt, a->o));
}

static void reach_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    sync_args_t *a = arg;
    ap_sync_complete(done, (int)ap_node_reachability(rt, a->addr, a->n));
}

int ap_node_nat_start_sync(ap_rt_t *rt, const ap_node_nat_opts_t *o)
{
    sync_args_t a = {o, NULL, 0};
    return ap_node_call_sync(rt, start_fn, &a);
}

int ap_node_reachability_sync(ap_rt_t *rt, char *addr, size_t n)
{
    sync_args_t a = {NULL, addr, n};
    return ap_node_call_sync(rt, reach_fn, &a);
}
