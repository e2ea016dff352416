/* `apiary bench hostile`: what its attacks share (bench_hostile.c runs
 * them; bench_hostile_p2p.c holds the ones on the libp2p wire). */
#ifndef AP_BENCH_HOSTILE_H
#define AP_BENCH_HOSTILE_H

#include "bench.h"

#include "apiary/host.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct target {
    pid_t pid;
    char addr[256]; /* /ip4/127.0.0.1/tcp/PORT/p2p/ID */
    int port;
    bool dead;
    int status;
} target_t;

typedef struct hctx {
    ap_bench_ctx_t *b;
    bool quick;
    target_t t;
    ap_host_t *host; /* the attackers' */
    /* legitimate client (own thread and host) */
    pthread_t legit;
    atomic_bool legit_quit, measuring;
    atomic_int probes, served;
    /* memory sampler */
    pthread_t sampler;
    atomic_bool sampler_quit;
    atomic_uint_fast64_t peak_kb;
    char log[128]; /* the target's log */
} hctx_t;

void hostile_sleep_s(double s);
/* Lines of the file at path that contain what. */
int hostile_log_count(const char *path, const char *what);
/* Whether the target process still runs (reaps it when it died). */
bool hostile_target_alive(target_t *t);
/* A non-blocking TCP connection to 127.0.0.1:port from attacker address
 * 127.0.0.(2 + src % 8), or -1. */
int hostile_tcp_open(int port, int src);

/* The attacks on the libp2p listener (the target's TCP port: multistream-
 * select, Noise, yamux); each returns 0 or an AP_E* code. */
int hostile_p2p_slowloris(hctx_t *cx);
int hostile_yamux_streams(hctx_t *cx);
int hostile_yamux_window(hctx_t *cx);
int hostile_p2p_oversized(hctx_t *cx);
int hostile_p2p_no_read(hctx_t *cx);

#endif
