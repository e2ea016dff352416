/* libFuzzer target: the MASHA server's request checks and the worker's reply
 * checks (all three wire versions) on untrusted bytes. The first input byte
 * picks the method, server compression, the node's wire version (bit 4:
 * 1, bit 7: 2, else 3) and whether the bytes are a request or a reply; a server is first fed valid
 * requests of its first phase from workers 0..M-2, so the fuzzed request can complete the phase as
 * worker M-1. The one-step and two-step server paths must agree on every input. */
#include "apiary/masha.h"
#include "compress/masha_core.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define M 3

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static ap_masha_problem_t *p;
    if (!p) {
        ap_masha_bilinear_cfg_t pc = {.n = 4, .workers = M, .lambda = 0.05, .h = 1, .seed = 1};
        p = ap_masha_bilinear_new(&pc);
        if (!p) abort();
    }
    if (size < 1) return 0;
    uint8_t sel = data[0];
    data++;
    size--;
    ap_masha_opts_t o = {.method = (ap_masha_method_t)(sel % 3),
                         .gamma = 0.1,
                         .fraction = 0.25,
                         .server_fraction = (sel & 4) ? 0.5 : 0,
                         .seed = 7,
                         .target = 1e-6,
                         .max_iters = 10,
                         .wire = (sel & 16)    ? 1
                                 : (sel & 128) ? 2
                                               : 0};
    size_t d = ap_masha_dim(p);
    ap__masha_hdr_t mh;
    (void)ap__masha_hdr_parse(data, size, (sel & 8) != 0, &mh);
    if (sel & 8) { /* a reply to a worker's first request */
        ap__masha_worker_t *w = ap__masha_worker_new(p, &o, 0);
        if (!w || ap__masha_worker_start(w)) abort();
        bool done;
        (void)ap__masha_worker_on_reply(w, data, size, &done);
        ap__masha_worker_free(w);
        return 0;
    }
    ap__masha_server_t *a = ap__masha_server_new(d, M, &o), *b = ap__masha_server_new(d, M, &o);
    if (!a || !b) abort();
    const uint8_t *reqs[M];
    size_t lens[M];
    ap__masha_worker_t *ws[M] = {0};
    for (int m = 0; m < M - 1; m++) {
        ws[m] = ap__masha_worker_new(p, &o, m);
        if (!ws[m] || ap__masha_worker_start(ws[m])) abort();
        reqs[m] = ap__masha_worker_msg(ws[m], &lens[m]);
        if (ap__masha_server_add(a, reqs[m], lens[m]) != 0) abort();
        if (ap__masha_server_check(b, reqs[m], lens[m]) != 0) abort();
    }
    int ra = ap__masha_server_add(a, data, size);
    int rb = ap__masha_server_check(b, data, size);
    if (ra != rb) abort();
    if (rb == 1) { /* the fuzzed request completes the phase (index order: same sums) */
        reqs[M - 1] = data;
        lens[M - 1] = size;
        if (ap__masha_server_complete(b, reqs, lens) != 1) abort();
        size_t la, lb;
        const uint8_t *pa = ap__masha_server_reply(a, mh.version, &la);
        const uint8_t *pb = ap__masha_server_reply(b, mh.version, &lb);
        if (la != lb || memcmp(pa, pb, la)) abort();
    }
    for (int m = 0; m < M - 1; m++) ap__masha_worker_free(ws[m]);
    ap__masha_server_free(a);
    ap__masha_server_free(b);
    return 0;
}
