/* runtime.h: the parts common to every driver, and dispatch to the driver. */
#include "runtime/rt_impl.h"
#include "apiary/log.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

/* ---- RNG: xoshiro256** seeded through splitmix64 ------------------------ */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void ap__rng_seed(uint64_t s[4], uint64_t seed)
{
    for (int i = 0; i < 4; i++) s[i] = splitmix64(&seed);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t ap__rng_next(uint64_t s[4])
{
    uint64_t r = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* ---- init / fini -------------------------------------------------------- */

int ap__rt_init_sk(ap_rt_t *rt, const ap_rt_ops_t *ops, const uint8_t sk[AP_ED25519_SK_LEN],
                   uint64_t rng_seed)
{
    if (sodium_init() < 0) return AP_ESYS;
    memset(rt, 0, sizeof *rt);
    rt->ops = ops;
    memcpy(rt->sk, sk, AP_ED25519_SK_LEN);
    uint8_t pk[crypto_sign_PUBLICKEYBYTES];
    crypto_sign_ed25519_sk_to_pk(pk, rt->sk);
    ap_peer_id_from_ed25519(&rt->self, pk);
    ap_peer_id_short(&rt->self, rt->short_id);
    ap__rng_seed(rt->rng, rng_seed);
    rt->next_watch_id = 1;
    return 0;
}

int ap__rt_init(ap_rt_t *rt, const ap_rt_ops_t *ops, const uint8_t *ed25519_seed, uint64_t rng_seed)
{
    if (sodium_init() < 0) return AP_ESYS;
    uint8_t pk[crypto_sign_PUBLICKEYBYTES], sk[crypto_sign_SECRETKEYBYTES];
    if (ed25519_seed)
        crypto_sign_seed_keypair(pk, sk, ed25519_seed);
    else
        crypto_sign_keypair(pk, sk);
    int rc = ap__rt_init_sk(rt, ops, sk, rng_seed);
    sodium_memzero(sk, sizeof sk);
    return rc;
}

void ap__rt_fini(ap_rt_t *rt)
{
    sodium_memzero(rt->sk, sizeof rt->sk);
    free(rt->handlers);
    free(rt->listeners);
    free(rt->watches);
    rt->handlers = NULL;
    rt->listeners = NULL;
    rt->watches = NULL;
    rt->nhandlers = rt->nlisteners = rt->nwatches = 0;
}

/* ---- identity ----------------------------------------------------------- */

const ap_peer_id_t *ap_rt_self(ap_rt_t *rt)
{
    return &rt->self;
}

void ap_rt_sign(ap_rt_t *rt, const uint8_t *msg, size_t len, uint8_t sig[AP_ED25519_SIG_LEN])
{
    crypto_sign_detached(sig, NULL, msg, len, rt->sk);
}

int ap_rt_listen_addrs(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id)
{
    return rt->ops->listen_addrs(rt, addrs, max, with_id);
}

/* ---- time, RNG ------------------------------------------------------------ */

uint64_t ap_rt_now_us(ap_rt_t *rt)
{
    return rt->ops->now_us(rt);
}
int64_t ap_rt_wall_ms(ap_rt_t *rt)
{
    return rt->ops->wall_ms(rt);
}
uint64_t ap_rt_rand_u64(ap_rt_t *rt)
{
    return ap__rng_next(rt->rng);
}

uint64_t ap__rng_below(uint64_t s[4], uint64_t n)
{
    if (n <= 1) return 0;
    /* Lemire's nearly-divisionless method: no modulo bias. */
    uint64_t x = ap__rng_next(s);
    __uint128_t m = (__uint128_t)x * n;
    uint64_t l = (uint64_t)m;
    if (l < n) {
        uint64_t t = -n % n;
        while (l < t) {
            x = ap__rng_next(s);
            m = (__uint128_t)x * n;
            l = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

uint64_t ap_rt_rand_below(ap_rt_t *rt, uint64_t n)
{
    return ap__rng_below(rt->rng, n);
}

double ap_rt_rand_double(ap_rt_t *rt)
{
    return (double)(ap__rng_next(rt->rng) >> 11) * 0x1.0p-53;
}

void ap_rt_rand_bytes(ap_rt_t *rt, void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len) {
        uint64_t r = ap__rng_next(rt->rng);
        size_t n = len < 8 ? len : 8;
        memcpy(p, &r, n);
        p += n;
        len -= n;
    }
}

/* ---- timers, post, work ------------------------------------------------- */

uint64_t ap_rt_timer_start(ap_rt_t *rt, uint64_t delay_us, uint64_t period_us, ap_timer_fn cb,
                           void *arg)
{
    return rt->ops->timer_start(rt, delay_us, period_us, cb, arg);
}

bool ap_rt_timer_stop(ap_rt_t *rt, uint64_t timer_id)
{
    if (timer_id == 0) return false;
    return rt->ops->timer_stop(rt, timer_id);
}

int ap_rt_post(ap_rt_t *rt, ap_post_fn fn, void *arg)
{
    return rt->ops->post(rt, fn, arg);
}

int ap_rt_work(ap_rt_t *rt, double cost, ap_work_fn work, ap_after_work_fn after, void *arg)
{
    return rt->ops->work(rt, cost, work, after, arg);
}

/* ---- peers ------------------------------------------------------------------ */

int ap_rt_add_addr(ap_rt_t *rt, const ap_peer_id_t *peer, const char *addr)
{
    return rt->ops->add_addr(rt, peer, addr);
}

int ap_rt_dial(ap_rt_t *rt, const char *addr, uint64_t timeout_us, ap_dial_fn cb, void *arg)
{
    return rt->ops->dial(rt, addr, timeout_us, cb, arg);
}

bool ap_rt_is_connected(ap_rt_t *rt, const ap_peer_id_t *peer)
{
    return rt->ops->is_connected(rt, peer);
}

uint64_t ap_rt_peer_watch(ap_rt_t *rt, ap_peer_fn cb, void *arg)
{
    if (rt->nwatches == rt->watches_cap) {
        size_t cap = rt->watches_cap ? rt->watches_cap * 2 : 8;
        ap_rt_watch_t *w = realloc(rt->watches, cap * sizeof *w);
        if (!w) return 0;
        rt->watches = w;
        rt->watches_cap = cap;
    }
    uint64_t id = rt->next_watch_id++;
    rt->watches[rt->nwatches++] = (ap_rt_watch_t){.id = id, .cb = cb, .arg = arg};
    return id;
}

void ap_rt_peer_unwatch(ap_rt_t *rt, uint64_t watch_id)
{
    for (size_t i = 0; i < rt->nwatches; i++) {
        if (rt->watches[i].id != watch_id) continue;
        if (rt->notifying) {
            rt->watches[i].cb = NULL; /* compacted after the notification loop */
        } else {
            memmove(&rt->watches[i], &rt->watches[i + 1],
                    (rt->nwatches - i - 1) * sizeof *rt->watches);
            rt->nwatches--;
        }
        return;
    }
}

void ap__rt_peer_event(ap_rt_t *rt, const ap_peer_id_t *peer, ap_peer_event_t ev)
{
    bool outer = !rt->notifying;
    rt->notifying = true;
    /* Watchers added during the loop are not notified of this event. */
    size_t n = rt->nwatches;
    for (size_t i = 0; i < n && i < rt->nwatches; i++)
        if (rt->watches[i].cb) rt->watches[i].cb(rt, rt->watches[i].arg, peer, ev);
    if (!outer) return;
    rt->notifying = false;
    size_t j = 0;
    for (size_t i = 0; i < rt->nwatches; i++)
        if (rt->watches[i].cb) rt->watches[j++] = rt->watches[i];
    rt->nwatches = j;
}

/* ---- RPC ------------------------------------------------------------------- */

static bool proto_ok(const char *proto)
{
    return proto && proto[0] == '/' && strlen(proto) < AP_RT_PROTO_MAX;
}

const ap_rt_handler_t *ap__rt_find_handler(ap_rt_t *rt, const char *proto)
{
    for (size_t i = 0; i < rt->nhandlers; i++)
        if (strcmp(rt->handlers[i].proto, proto) == 0) return &rt->handlers[i];
    return NULL;
}

int ap_rt_rpc_register(ap_rt_t *rt, const char *proto, size_t max_req, ap_rpc_handler_fn handler,
                       void *arg)
{
    if (!proto_ok(proto) || !handler) return AP_EINVAL;
    if (ap__rt_find_handler(rt, proto)) return AP_EEXIST;
    if (rt->nhandlers == rt->handlers_cap) {
        size_t cap = rt->handlers_cap ? rt->handlers_cap * 2 : 8;
        ap_rt_handler_t *h = realloc(rt->handlers, cap * sizeof *h);
        if (!h) return AP_ENOMEM;
        rt->handlers = h;
        rt->handlers_cap = cap;
    }
    ap_rt_handler_t *h = &rt->handlers[rt->nhandlers++];
    memset(h, 0, sizeof *h);
    strcpy(h->proto, proto);
    h->max_req = max_req ? max_req : AP_RT_RPC_MAX_DEFAULT;
    h->fn = handler;
    h->arg = arg;
    return 0;
}

void ap_rt_rpc_unregister(ap_rt_t *rt, const char *proto)
{
    for (size_t i = 0; i < rt->nhandlers; i++) {
        if (strcmp(rt->handlers[i].proto, proto) != 0) continue;
        memmove(&rt->handlers[i], &rt->handlers[i + 1],
                (rt->nhandlers - i - 1) * sizeof *rt->handlers);
        rt->nhandlers--;
        return;
    }
}

const ap_peer_id_t *ap_rpc_req_peer(const ap_rpc_req_t *req)
{
    return &req->peer;
}

const uint8_t *ap_rpc_req_data(const ap_rpc_req_t *req, size_t *len)
{
    if (len) *len = req->len;
    return req->data;
}

void ap_rpc_respond(ap_rpc_req_t *req, const uint8_t *data, size_t len)
{
    req->rt->ops->rpc_respond(req, 0, NULL, data, len);
}

void ap_rpc_respond_error(ap_rpc_req_t *req, int err, const char *msg)
{
    if (err >= 0) err = AP_EHANDLER;
    free(req->resp_buf);
    req->resp_buf = NULL;
    req->rt->ops->rpc_respond(req, err, msg, NULL, 0);
}

uint8_t *ap_rpc_respond_begin(ap_rpc_req_t *req, size_t len)
{
    const ap_rt_ops_t *ops = req->rt->ops;
    if (ops->rpc_respond_begin) return ops->rpc_respond_begin(req, len);
    uint8_t *b = malloc(len ? len : 1);
    if (!b) {
        ops->rpc_respond(req, AP_ENOMEM, "out of memory", NULL, 0);
        return NULL;
    }
    req->resp_buf = b;
    req->resp_len = len;
    return b;
}

void ap_rpc_respond_commit(ap_rpc_req_t *req)
{
    const ap_rt_ops_t *ops = req->rt->ops;
    if (ops->rpc_respond_commit) {
        ops->rpc_respond_commit(req);
        return;
    }
    uint8_t *b = req->resp_buf;
    req->resp_buf = NULL;
    ops->rpc_respond(req, 0, NULL, b, req->resp_len); /* frees req */
    free(b);
}

uint64_t ap_rt_rpc_call(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                        const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                        ap_rpc_done_fn done, void *arg)
{
    if (!proto_ok(proto) || !done) return 0;
    ap_rpc_opts_t o = {0};
    if (opts) o = *opts;
    if (!o.timeout_us) o.timeout_us = 30u * 1000 * 1000;
    if (!o.max_resp) o.max_resp = AP_RT_RPC_MAX_DEFAULT;
    return rt->ops->rpc_call(rt, peer, proto, req, len, &o, done, arg);
}

bool ap_rt_rpc_cancel(ap_rt_t *rt, uint64_t call_id)
{
    if (call_id == 0) return false;
    return rt->ops->rpc_cancel(rt, call_id);
}

/* ---- streams ------------------------------------------------------------- */

const ap_rt_listener_t *ap__rt_find_listener(ap_rt_t *rt, const char *proto)
{
    for (size_t i = 0; i < rt->nlisteners; i++)
        if (strcmp(rt->listeners[i].proto, proto) == 0) return &rt->listeners[i];
    return NULL;
}

static void fill_stream_opts(ap_stream_opts_t *o, const ap_stream_opts_t *in)
{
    memset(o, 0, sizeof *o);
    if (in) *o = *in;
    if (!o->window) o->window = AP_RT_STREAM_WINDOW_DEFAULT;
    if (!o->max_msg) o->max_msg = AP_RT_STREAM_MSG_MAX_DEFAULT;
    if (!o->open_timeout_us) o->open_timeout_us = 30u * 1000 * 1000;
}

int ap_rt_stream_listen(ap_rt_t *rt, const char *proto, const ap_stream_opts_t *opts,
                        ap_stream_accept_fn accept, void *arg)
{
    if (!proto_ok(proto) || !accept) return AP_EINVAL;
    if (ap__rt_find_listener(rt, proto)) return AP_EEXIST;
    if (rt->nlisteners == rt->listeners_cap) {
        size_t cap = rt->listeners_cap ? rt->listeners_cap * 2 : 8;
        ap_rt_listener_t *l = realloc(rt->listeners, cap * sizeof *l);
        if (!l) return AP_ENOMEM;
        rt->listeners = l;
        rt->listeners_cap = cap;
    }
    ap_rt_listener_t *l = &rt->listeners[rt->nlisteners++];
    memset(l, 0, sizeof *l);
    strcpy(l->proto, proto);
    fill_stream_opts(&l->opts, opts);
    l->fn = accept;
    l->arg = arg;
    return 0;
}

void ap_rt_stream_unlisten(ap_rt_t *rt, const char *proto)
{
    for (size_t i = 0; i < rt->nlisteners; i++) {
        if (strcmp(rt->listeners[i].proto, proto) != 0) continue;
        memmove(&rt->listeners[i], &rt->listeners[i + 1],
                (rt->nlisteners - i - 1) * sizeof *rt->listeners);
        rt->nlisteners--;
        return;
    }
}

int ap_rt_stream_open(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                      const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                      const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out)
{
    if (!proto_ok(proto) || !cbs || !out) return AP_EINVAL;
    ap_stream_opts_t o;
    fill_stream_opts(&o, opts);
    return rt->ops->stream_open(rt, peer, proto, hello, len, &o, cbs, arg, out);
}

void ap_stream_set_cbs(ap_stream_t *s, const ap_stream_cbs_t *cbs, void *arg)
{
    s->cbs = *cbs;
    s->arg = arg;
}

int ap_stream_send(ap_stream_t *s, const uint8_t *data, size_t len)
{
    return s->rt->ops->stream_send(s, data, len);
}

void ap__iov_gather(uint8_t *dst, const ap_iovec_t *iov, int iovcnt)
{
    for (int i = 0; i < iovcnt; i++) {
        if (!iov[i].len) continue;
        memcpy(dst, iov[i].base, iov[i].len);
        dst += iov[i].len;
    }
}

int ap_stream_sendv(ap_stream_t *s, const ap_iovec_t *iov, int iovcnt)
{
    if (iovcnt < 0 || iovcnt > AP_STREAM_IOV_MAX || (iovcnt > 0 && !iov)) return AP_EINVAL;
    size_t total = 0;
    for (int i = 0; i < iovcnt; i++) {
        if (iov[i].len && !iov[i].base) return AP_EINVAL;
        if (iov[i].len > SIZE_MAX - total) return AP_EMSGSIZE;
        total += iov[i].len;
    }
    if (s->rt->ops->stream_sendv) return s->rt->ops->stream_sendv(s, iov, iovcnt, total);
    /* a driver without a gather path: one temporary copy */
    uint8_t *tmp = malloc(total ? total : 1);
    if (!tmp) return AP_ENOMEM;
    ap__iov_gather(tmp, iov, iovcnt);
    int rc = s->rt->ops->stream_send(s, tmp, total);
    free(tmp);
    return rc;
}

size_t ap_stream_buffered(const ap_stream_t *s)
{
    return s->rt->ops->stream_buffered(s);
}
size_t ap_stream_window(const ap_stream_t *s)
{
    return s->window;
}
void ap_stream_pause(ap_stream_t *s, bool paused)
{
    s->rt->ops->stream_pause(s, paused);
}
int ap_stream_close(ap_stream_t *s)
{
    return s->rt->ops->stream_close(s);
}
void ap_stream_reset(ap_stream_t *s, int err)
{
    s->rt->ops->stream_reset(s, err);
}
const ap_peer_id_t *ap_stream_peer(const ap_stream_t *s)
{
    return &s->peer;
}
ap_rt_t *ap_stream_rt(const ap_stream_t *s)
{
    return s->rt;
}
uint64_t ap_stream_id(const ap_stream_t *s)
{
    return s->id;
}

void ap_rt_get_stats(ap_rt_t *rt, ap_rt_stats_t *out)
{
    memset(out, 0, sizeof *out);
    rt->ops->get_stats(rt, out);
}

int ap_rt_mem_reserve(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes)
{
    if (!rt) return AP_EINVAL;
    return rt->ops->mem_reserve ? rt->ops->mem_reserve(rt, peer, bytes) : 0;
}

void ap_rt_mem_release(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes)
{
    if (rt && rt->ops->mem_release) rt->ops->mem_release(rt, peer, bytes);
}
