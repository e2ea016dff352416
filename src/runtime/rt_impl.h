/* Internal contract between runtime.h and its drivers (sim, uv).
 *
 * A driver embeds `struct ap_rt` at the start of its node struct, fills in
 * `ops`, and calls ap__rt_init() / ap__rt_fini(). Everything in runtime.h
 * that is the same for every driver (identity, signing, RNG, peer watchers,
 * the RPC handler table, the stream listener table) lives in runtime.c; the
 * rest dispatches through ops.
 *
 * Streams and RPC requests: a driver's stream struct starts with
 * `struct ap_stream` and its request struct with `struct ap_rpc_req`; the
 * accessor functions in runtime.h read those common heads. */
#ifndef AP_RUNTIME_RT_IMPL_H
#define AP_RUNTIME_RT_IMPL_H

#include "apiary/runtime.h"

typedef struct ap_rt_ops {
    const char *name; /* "sim", "uv" */
    uint64_t (*now_us)(ap_rt_t *rt);
    int64_t (*wall_ms)(ap_rt_t *rt);
    uint64_t (*timer_start)(ap_rt_t *rt, uint64_t delay_us, uint64_t period_us, ap_timer_fn cb,
                            void *arg);
    bool (*timer_stop)(ap_rt_t *rt, uint64_t id);
    int (*post)(ap_rt_t *rt, ap_post_fn fn, void *arg);
    int (*work)(ap_rt_t *rt, double cost, ap_work_fn work, ap_after_work_fn after, void *arg);
    int (*listen_addrs)(ap_rt_t *rt, char (*addrs)[AP_RT_ADDR_MAX], int max, bool with_id);
    int (*add_addr)(ap_rt_t *rt, const ap_peer_id_t *peer, const char *addr);
    int (*dial)(ap_rt_t *rt, const char *addr, uint64_t timeout_us, ap_dial_fn cb, void *arg);
    bool (*is_connected)(ap_rt_t *rt, const ap_peer_id_t *peer);
    /* RPC: handler lookup is common (ap__rt_find_handler); the driver moves
     * bytes. respond() must free req. */
    uint64_t (*rpc_call)(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                         const uint8_t *req, size_t len, const ap_rpc_opts_t *opts,
                         ap_rpc_done_fn done, void *arg);
    bool (*rpc_cancel)(ap_rt_t *rt, uint64_t call_id);
    void (*rpc_respond)(ap_rpc_req_t *req, int err, const char *errmsg, const uint8_t *data,
                        size_t len);
    /* A response buffer counted like rpc_respond's copy (NULL: refused, req
     * answered and freed), sent by rpc_respond_commit; rpc_respond with an
     * error drops it. Both NULL: runtime.c uses a plain buffer and
     * rpc_respond. */
    uint8_t *(*rpc_respond_begin)(ap_rpc_req_t *req, size_t len);
    void (*rpc_respond_commit)(ap_rpc_req_t *req);
    /* Streams: listener lookup is common (ap__rt_find_listener). */
    int (*stream_open)(ap_rt_t *rt, const ap_peer_id_t *peer, const char *proto,
                       const uint8_t *hello, size_t len, const ap_stream_opts_t *opts,
                       const ap_stream_cbs_t *cbs, void *arg, ap_stream_t **out);
    int (*stream_send)(ap_stream_t *s, const uint8_t *data, size_t len);
    /* Gather send; runtime.c has checked iov (see ap_stream_sendv) and
     * computed total = the sum of the lengths. NULL: runtime.c assembles the
     * message in a temporary buffer and calls stream_send. */
    int (*stream_sendv)(ap_stream_t *s, const ap_iovec_t *iov, int iovcnt, size_t total);
    size_t (*stream_buffered)(const ap_stream_t *s);
    void (*stream_pause)(ap_stream_t *s, bool paused);
    int (*stream_close)(ap_stream_t *s);
    void (*stream_reset)(ap_stream_t *s, int err);
    void (*get_stats)(ap_rt_t *rt, ap_rt_stats_t *out);
    /* ap_rt_mem_reserve / ap_rt_mem_release (both NULL: nothing is counted,
     * every reservation succeeds) */
    int (*mem_reserve)(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes);
    void (*mem_release)(ap_rt_t *rt, const ap_peer_id_t *peer, size_t bytes);
} ap_rt_ops_t;

typedef struct ap_rt_handler {
    char proto[AP_RT_PROTO_MAX];
    size_t max_req;
    ap_rpc_handler_fn fn;
    void *arg;
} ap_rt_handler_t;

typedef struct ap_rt_listener {
    char proto[AP_RT_PROTO_MAX];
    ap_stream_opts_t opts;
    ap_stream_accept_fn fn;
    void *arg;
} ap_rt_listener_t;

typedef struct ap_rt_watch {
    uint64_t id;
    ap_peer_fn cb;
    void *arg;
} ap_rt_watch_t;

struct ap_rt {
    const ap_rt_ops_t *ops;
    ap_peer_id_t self;
    uint8_t sk[AP_ED25519_SK_LEN]; /* libsodium Ed25519 secret key (seed || pk) */
    uint64_t rng[4];               /* xoshiro256** state */
    ap_rt_handler_t *handlers;
    size_t nhandlers, handlers_cap;
    ap_rt_listener_t *listeners;
    size_t nlisteners, listeners_cap;
    ap_rt_watch_t *watches;
    size_t nwatches, watches_cap;
    uint64_t next_watch_id;
    bool notifying; /* inside ap__rt_peer_event: unwatch defers removal */
    char short_id[AP_PEER_SHORT_LEN];
};

struct ap_stream {
    ap_rt_t *rt;
    ap_peer_id_t peer;
    uint64_t id;
    ap_stream_cbs_t cbs;
    void *arg;
    size_t window;
    size_t max_msg;
};

struct ap_rpc_req {
    ap_rt_t *rt;
    ap_peer_id_t peer;
    const uint8_t *data;
    size_t len;
    /* ap_rpc_respond_begin's buffer when the driver has no rpc_respond_begin
     * (drivers start it NULL) */
    uint8_t *resp_buf;
    size_t resp_len;
};

/* Initialises the common part: identity from a 32-byte Ed25519 seed (NULL =
 * fresh random key), RNG from rng_seed. */
int ap__rt_init(ap_rt_t *rt, const ap_rt_ops_t *ops, const uint8_t *ed25519_seed,
                uint64_t rng_seed);
/* Same, from a full libsodium Ed25519 secret key (64 bytes). */
int ap__rt_init_sk(ap_rt_t *rt, const ap_rt_ops_t *ops, const uint8_t sk[AP_ED25519_SK_LEN],
                   uint64_t rng_seed);
void ap__rt_fini(ap_rt_t *rt);

const ap_rt_handler_t *ap__rt_find_handler(ap_rt_t *rt, const char *proto);
const ap_rt_listener_t *ap__rt_find_listener(ap_rt_t *rt, const char *proto);
/* Drivers call this on connect/disconnect; it notifies every watcher. */
void ap__rt_peer_event(ap_rt_t *rt, const ap_peer_id_t *peer, ap_peer_event_t ev);

/* xoshiro256** seeded by splitmix64 from seed; shared by drivers and tests. */
void ap__rng_seed(uint64_t s[4], uint64_t seed);
uint64_t ap__rng_next(uint64_t s[4]);
/* Uniform in [0, n) without modulo bias (0 when n <= 1). */
uint64_t ap__rng_below(uint64_t s[4], uint64_t n);

/* Copies the pieces of a checked gather (ap_stream_sendv) to dst, which has
 * room for their total. */
void ap__iov_gather(uint8_t *dst, const ap_iovec_t *iov, int iovcnt);

#endif
