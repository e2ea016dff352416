/* Fuzzes the simulator's address parser (ap_rt_dial / ap_rt_add_addr take
 * multiaddr text that may come from untrusted DHT records). */
#include "apiary/sim.h"

#include <stdlib.h>
#include <string.h>

static ap_sim_t *g_sim;

static void on_dial(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer) {}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!g_sim) {
        g_sim = ap_sim_new(1);
        if (!g_sim) return 0;
        ap_sim_add_node(g_sim, NULL);
        ap_sim_add_node(g_sim, NULL);
    }
    if (size > 4 * AP_RT_ADDR_MAX) return 0;
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    ap_rt_t *rt = ap_sim_node(g_sim, 0);
    (void)ap_rt_add_addr(rt, ap_sim_peer_id(g_sim, 1), text);
    if (ap_rt_dial(rt, text, 1000, on_dial, NULL) == 0) ap_sim_run_for(g_sim, 2000);
    free(text);
    return 0;
}
