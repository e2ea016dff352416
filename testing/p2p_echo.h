/* An echo client over a libp2p connection (AP_P2P_ECHO_PROTO, served by
 * ap__p2p_host_serve_echo and by tests/interop/js/peer.mjs): opens streams
 * at once, sends size bytes of ap_echo_byte(k, i) on stream k as fast as the
 * stream's queue takes them (waiting for on_writable after AP_EAGAIN),
 * half-closes, and checks every byte that comes back. Shared by
 * tests/net/test_p2p_js.c and `apiary bench libp2p`. Loop thread only. */
#ifndef AP_TESTING_P2P_ECHO_H
#define AP_TESTING_P2P_ECHO_H

#include "p2p/p2p_conn.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Byte i of stream k (peer.mjs's pattern()). */
static inline uint8_t ap_echo_byte(uint32_t k, uint64_t i)
{
    return (uint8_t)((i ^ (i >> 8) ^ (i >> 16) ^ (k * 37u)) & 0xff);
}

/* out[j] = ap_echo_byte(k, off + j) for j < n, eight bytes at a time (the
 * pattern is a 64 KiB table XOR one byte per 64 KiB block). */
void ap_echo_fill(uint32_t k, uint64_t off, uint8_t *out, size_t n);
/* Whether p[j] == ap_echo_byte(k, off + j) for every j < n. */
bool ap_echo_check(uint32_t k, uint64_t off, const uint8_t *p, size_t n);

typedef struct ap_echo_run {
    int nstreams;
    size_t size;
    int closed;        /* streams whose on_close ran */
    int ok;            /* closed cleanly with every byte back and equal */
    int first_error;   /* the first failed stream's status (0: none) */
    size_t max_queued; /* most bytes one stream's send queue held */
    uint64_t bytes_back;
    struct ap_echo_stream *streams;
} ap_echo_run_t;

/* Starts the run on c (ready). 0 or an error (nothing started). */
int ap_echo_start(ap_p2p_conn_t *c, ap_echo_run_t *r, int nstreams, size_t size);
static inline bool ap_echo_done(const ap_echo_run_t *r)
{
    return r->closed == r->nstreams;
}
/* Frees the run's state once ap_echo_done. */
void ap_echo_free(ap_echo_run_t *r);

#endif
