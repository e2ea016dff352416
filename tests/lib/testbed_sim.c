/* Testbed on the deterministic simulator (tests/lib/testbed.h). */
#include "testbed.h"

#include "apiary/sim.h"

#include <stdlib.h>

struct ap_testbed {
    ap_sim_t *sim;
};

static ap_testbed_t *tb_create(int n, uint64_t seed)
{
    ap_testbed_t *tb = calloc(1, sizeof *tb);
    if (!tb) return NULL;
    tb->sim = ap_sim_new(seed);
    if (!tb->sim) {
        free(tb);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (ap_sim_add_node(tb->sim, NULL) < 0) {
            ap_sim_free(tb->sim);
            free(tb);
            return NULL;
        }
    }
    return tb;
}

static void tb_destroy(ap_testbed_t *tb)
{
    if (!tb) return;
    ap_sim_free(tb->sim);
    free(tb);
}

static ap_rt_t *tb_node(ap_testbed_t *tb, int i)
{
    return ap_sim_node(tb->sim, i);
}

static bool tb_run_until(ap_testbed_t *tb, ap_tb_pred_fn pred, void *arg, uint64_t timeout_us)
{
    uint64_t now = ap_sim_now_us(tb->sim);
    uint64_t deadline = now + timeout_us < now ? UINT64_MAX : now + timeout_us;
    return ap_sim_run_until(tb->sim, pred, arg, deadline);
}

static void tb_crash(ap_testbed_t *tb, int i)
{
    ap_sim_crash(tb->sim, i);
}
static void tb_restart(ap_testbed_t *tb, int i)
{
    ap_sim_restart(tb->sim, i);
}

const ap_testbed_ops_t ap_testbed_sim = {
    .name = "sim",
    .create = tb_create,
    .destroy = tb_destroy,
    .node = tb_node,
    .run_until = tb_run_until,
    .crash = tb_crash,
    .restart = tb_restart,
    .virtual_time = true,
};
