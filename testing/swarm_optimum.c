#include "swarm_optimum.h"

#include <stdlib.h>
#include <string.h>

int ap_test_swarm_optimum(const ap_swarm_member_t *m, size_t n, int stages)
{
    const int S = stages;
    if (S < 1 || S > AP_TEST_SWARM_MAX_STAGES) return -1;
    int total = 0;
    for (size_t i = 0; i < n; i++) total += (int)m[i].throughput;
    const int U = total / S, D = U + 1;
    size_t NS = 1;
    for (int k = 0; k < S; k++) {
        if (NS > ((size_t)1 << 32) / (size_t)D) return -1;
        NS *= (size_t)D;
    }
    char *cur = calloc(NS, 1), *nxt = calloc(NS, 1);
    if (!cur || !nxt) {
        free(cur);
        free(nxt);
        return -1;
    }
    cur[0] = 1;
    for (size_t i = 0; i < n; i++) {
        memset(nxt, 0, NS);
        int v = (int)m[i].throughput;
        for (size_t st = 0; st < NS; st++) {
            if (!cur[st]) continue;
            int t[AP_TEST_SWARM_MAX_STAGES];
            size_t x = st;
            for (int k = 0; k < S; k++) t[k] = (int)(x % (size_t)D), x /= (size_t)D;
            for (int k = 0; k < S; k++) {
                int u[AP_TEST_SWARM_MAX_STAGES];
                memcpy(u, t, (size_t)S * sizeof *u);
                u[k] = u[k] + v > U ? U : u[k] + v;
                size_t y = 0;
                for (int j = S - 1; j >= 0; j--) y = y * (size_t)D + (size_t)u[j];
                nxt[y] = 1;
            }
        }
        char *tmp = cur;
        cur = nxt;
        nxt = tmp;
    }
    int best = 0;
    for (size_t st = 0; st < NS; st++) {
        if (!cur[st]) continue;
        size_t x = st;
        int lo = U;
        for (int k = 0; k < S; k++) {
            int t = (int)(x % (size_t)D);
            x /= (size_t)D;
            if (t < lo) lo = t;
        }
        if (lo > best) best = lo;
    }
    free(cur);
    free(nxt);
    return best;
}
