/* A scenario on the simulator: 200 nodes under virtual time on 100 Mbit/s
 * links with 20 ms +- 5 ms latency; each node pings a random other node
 * every second. A partition splits them in two, one node crashes and comes
 * back (its restart hook re-creates its protocol state), and the same seed
 * gives the same trace hash on a second run. */
#include <apiary/sim.h>

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#define NODES 200
#define PING  "/example/ping/1"

typedef struct world {
    ap_sim_t *sim;
    uint64_t answered;
} world_t;

static void pong(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_rpc_respond(req, (const uint8_t *)"pong", 4);
}

static void on_pong(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                    const char *errmsg)
{
    world_t *w = arg;
    if (status == 0) w->answered++;
}

static void tick(ap_rt_t *rt, void *arg)
{
    world_t *w = arg;
    int to = (int)ap_rt_rand_below(rt, NODES);
    ap_rpc_opts_t o = {.timeout_us = 2000000};
    ap_rt_rpc_call(rt, ap_sim_peer_id(w->sim, to), PING, NULL, 0, &o, on_pong, w);
}

/* Registers handlers and timers: at start, and again after a restart. */
static void boot_node(ap_sim_t *sim, int node, ap_rt_t *rt, void *arg)
{
    ap_rt_rpc_register(rt, PING, 0, pong, arg);
    ap_rt_timer_start(rt, 1000000, 1000000, tick, arg);
}

static uint64_t run(uint64_t seed, uint64_t *answered)
{
    world_t w = {.sim = ap_sim_new(seed)};
    if (!w.sim) return 0;
    ap_sim_link_t wan = {.bandwidth_bps = 100000000, .latency_us = 20000, .jitter_us = 5000};
    ap_sim_set_default_link(w.sim, &wan);
    for (int i = 0; i < NODES; i++) {
        ap_sim_node_opts_t o = {.up_bps = 10000000,
                                .down_bps = 100000000, /* home links */
                                .flops = 1e12,
                                .on_restart = boot_node,
                                .hook_arg = &w};
        int idx = ap_sim_add_node(w.sim, &o); /* node i listens on /sim/<i> */
        boot_node(w.sim, idx, ap_sim_node(w.sim, idx), &w);
    }
    ap_sim_run_for(w.sim, 10 * 1000000ull); /* ten virtual seconds */
    int groups[NODES] = {0};
    for (int i = 0; i < NODES / 2; i++) groups[i] = 1;
    ap_sim_partition(w.sim, groups); /* split in two */
    ap_sim_crash(w.sim, 7);
    ap_sim_run_for(w.sim, 10 * 1000000ull);
    ap_sim_heal(w.sim);
    ap_sim_restart(w.sim, 7);
    ap_sim_run_for(w.sim, 10 * 1000000ull);
    uint64_t h = ap_sim_trace_hash(w.sim);
    *answered = w.answered;
    ap_sim_free(w.sim);
    return h;
}

int main(void)
{
    uint64_t a1, a2;
    uint64_t h1 = run(42, &a1), h2 = run(42, &a2);
    printf("trace %016" PRIx64 ", %" PRIu64 " pings answered; again: %016" PRIx64 "\n", h1, a1, h2);
    return h1 != 0 && h1 == h2 && a1 == a2 && a1 > 0 ? 0 : 1;
}
