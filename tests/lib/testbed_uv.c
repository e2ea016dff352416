/* The uv testbed: N nodes on one libuv host, driven by the test thread,
 * talking through the in-process transport (ap_testbed_uv) or TCP + Noise on
 * loopback (ap_testbed_uv_tcp). crash = ap_node_free (the
 * connections drop at once); restart = a new node with the same identity at
 * the same /memory/ address. */
#include "testbed.h"

#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "runtime/rt_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ap_testbed {
    ap_host_t *host;
    int n;
    uint64_t seed;
    ap_rt_t **nodes;
    uint8_t (*idseed)[32];
    ap_peer_id_t *ids;
    char (*addrs)[AP_RT_ADDR_MAX];
    int *gen;
    bool tcp;            /* nodes listen on 127.0.0.1 TCP (Noise) instead of /memory/ */
    ap_node_wire_t wire; /* how TCP nodes dial each other */
};

static void derive(ap_testbed_t *tb, int i)
{
    uint64_t s[4];
    ap__rng_seed(s, tb->seed * 0x9e3779b97f4a7c15ull + (uint64_t)i + 1);
    for (int k = 0; k < 4; k++) {
        uint64_t v = ap__rng_next(s);
        memcpy(tb->idseed[i] + 8 * k, &v, 8);
    }
}

static int start_node(ap_testbed_t *tb, int i, const char *listen)
{
    ap_node_opts_t o = {.ed25519_seed = tb->idseed[i],
                        .rng_seed =
                            tb->seed * 1000003u + (uint64_t)i * 7919u + (uint64_t)tb->gen[i] + 1,
                        .listen = listen    ? listen
                                  : tb->tcp ? "/ip4/127.0.0.1/tcp/0"
                                            : NULL};
    int rc = ap_node_new(tb->host, &o, &tb->nodes[i]);
    if (rc < 0) return rc;
    if (tb->wire != AP_NODE_WIRE_NATIVE) {
        rc = ap_node_set_wire(tb->nodes[i], tb->wire);
        if (rc < 0) return rc;
    }
    tb->ids[i] = *ap_rt_self(tb->nodes[i]);
    char a[1][AP_RT_ADDR_MAX];
    ap_rt_listen_addrs(tb->nodes[i], a, 1, false);
    memcpy(tb->addrs[i], a[0], AP_RT_ADDR_MAX);
    return 0;
}

static void teach(ap_testbed_t *tb, int i)
{
    for (int j = 0; j < tb->n; j++)
        if (j != i) ap_rt_add_addr(tb->nodes[i], &tb->ids[j], tb->addrs[j]);
}

static void tb_destroy(ap_testbed_t *tb)
{
    if (!tb) return;
    if (tb->host && ap_host_free(tb->host) != 0)
        fprintf(stderr, "testbed_uv: host did not close cleanly\n");
    free(tb->nodes);
    free(tb->idseed);
    free(tb->ids);
    free(tb->addrs);
    free(tb->gen);
    free(tb);
}

static ap_testbed_t *tb_create_any(int n, uint64_t seed, bool tcp, ap_node_wire_t wire)
{
    ap_testbed_t *tb = calloc(1, sizeof *tb);
    if (!tb) return NULL;
    tb->tcp = tcp;
    tb->wire = wire;
    tb->n = n;
    tb->seed = seed;
    tb->host = ap_host_new();
    tb->nodes = calloc((size_t)n, sizeof *tb->nodes);
    tb->idseed = calloc((size_t)n, sizeof *tb->idseed);
    tb->ids = calloc((size_t)n, sizeof *tb->ids);
    tb->addrs = calloc((size_t)n, sizeof *tb->addrs);
    tb->gen = calloc((size_t)n, sizeof *tb->gen);
    if (!tb->host || !tb->nodes || !tb->idseed || !tb->ids || !tb->addrs || !tb->gen) {
        tb_destroy(tb);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        derive(tb, i);
        if (start_node(tb, i, NULL) < 0) {
            tb_destroy(tb);
            return NULL;
        }
    }
    for (int i = 0; i < n; i++) teach(tb, i);
    return tb;
}

static ap_testbed_t *tb_create(int n, uint64_t seed)
{
    return tb_create_any(n, seed, false, AP_NODE_WIRE_NATIVE);
}

static ap_testbed_t *tb_create_tcp(int n, uint64_t seed)
{
    return tb_create_any(n, seed, true, AP_NODE_WIRE_NATIVE);
}

static ap_testbed_t *tb_create_libp2p(int n, uint64_t seed)
{
    return tb_create_any(n, seed, true, AP_NODE_WIRE_LIBP2P);
}

static ap_testbed_t *tb_create_yamux(int n, uint64_t seed)
{
    return tb_create_any(n, seed, true, AP_NODE_WIRE_YAMUX);
}

static ap_rt_t *tb_node(ap_testbed_t *tb, int i)
{
    return (i >= 0 && i < tb->n) ? tb->nodes[i] : NULL;
}

static bool tb_run_until(ap_testbed_t *tb, ap_tb_pred_fn pred, void *arg, uint64_t timeout_us)
{
    return ap_host_run_until(tb->host, pred, arg, timeout_us);
}

static void tb_crash(ap_testbed_t *tb, int i)
{
    if (i < 0 || i >= tb->n || !tb->nodes[i]) return;
    ap_node_free(tb->nodes[i]);
    tb->nodes[i] = NULL;
}

static void tb_restart(ap_testbed_t *tb, int i)
{
    if (i < 0 || i >= tb->n) return;
    tb_crash(tb, i);
    tb->gen[i]++;
    char listen[AP_RT_ADDR_MAX];
    memcpy(listen, tb->addrs[i], sizeof listen);
    if (start_node(tb, i, listen) < 0) {
        ap_error("testbed", "restart of node %d failed", i);
        return;
    }
    teach(tb, i);
}

const ap_testbed_ops_t ap_testbed_uv = {
    .name = "uv",
    .create = tb_create,
    .destroy = tb_destroy,
    .node = tb_node,
    .run_until = tb_run_until,
    .crash = tb_crash,
    .restart = tb_restart,
    .virtual_time = false,
};

/* The same, over real TCP on 127.0.0.1 with Noise XX (src/net/tcp*.c):
 * every node listens on its own port; a restarted node rebinds it. */
const ap_testbed_ops_t ap_testbed_uv_tcp = {
    .name = "uv-tcp",
    .create = tb_create_tcp,
    .destroy = tb_destroy,
    .node = tb_node,
    .run_until = tb_run_until,
    .crash = tb_crash,
    .restart = tb_restart,
    .virtual_time = false,
};

/* Over libp2p connections (src/runtime/uv/p2p_bridge.c): multistream-select,
 * libp2p Noise, then the native mux agreed as "/apiary/mux/2". */
const ap_testbed_ops_t ap_testbed_uv_libp2p = {
    .name = "uv-libp2p",
    .create = tb_create_libp2p,
    .destroy = tb_destroy,
    .node = tb_node,
    .run_until = tb_run_until,
    .crash = tb_crash,
    .restart = tb_restart,
    .virtual_time = false,
};

/* The same with yamux forced: every stream and call is a yamux stream
 * negotiated by its protocol name. */
const ap_testbed_ops_t ap_testbed_uv_yamux = {
    .name = "uv-yamux",
    .create = tb_create_yamux,
    .destroy = tb_destroy,
    .node = tb_node,
    .run_until = tb_run_until,
    .crash = tb_crash,
    .restart = tb_restart,
    .virtual_time = false,
};
