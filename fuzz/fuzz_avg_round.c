/* Fuzz target: a reducer's handling of an untrusted sender, end to end on the
 * simulator. Three nodes form a group (0 and 1 honest, 2 driven by the
 * input); node 2 opens streams to the reducers with hellos and chunk frames
 * taken from the input. Whatever it sends, the honest round must end, its
 * values must stay finite, and nothing may leak (ASan). Each input runs twice:
 * with the mean and with ButterflyClip as the part reducer.
 *
 * Input: a sequence of records [u8 op][u16 len][len bytes]:
 *   op % 4 == 0: open a stream to reducer (byte0 % 2) with hello = bytes 1..
 *   op % 4 == 1: send bytes as a message on the last stream
 *   op % 4 == 2: send a well-formed data frame header + bytes as payload
 *   op % 4 == 3: close the last stream */
#include "apiary/allreduce.h"
#include "apiary/avg.h"
#include "apiary/btard.h"
#include "apiary/log.h"
#include "apiary/sim.h"
#include "averaging/allreduce.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ELEMS 40

typedef struct st {
    ap_avg_service_t *svc;
    float data[ELEMS];
    bool done;
    ap_allreduce_result_t res;
} st_t;

static void on_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    (void)rt;
    st_t *s = arg;
    s->res = *res;
    s->done = true;
}

static void nop_msg(ap_stream_t *s, void *a, const uint8_t *d, size_t n)
{
    (void)s, (void)a, (void)d, (void)n;
}
static void nop_ev(ap_stream_t *s, void *a)
{
    (void)s, (void)a;
}
static void on_close(ap_stream_t *s, void *a, int st)
{
    (void)s, (void)st;
    *(ap_stream_t **)a = NULL;
}
static const ap_stream_cbs_t cbs = {nop_msg, nop_ev, nop_ev, on_close};

static st_t nodes[2];
static bool both_done(void *arg)
{
    (void)arg;
    return nodes[0].done && nodes[1].done;
}

/* One round against the input's sender; clip: every reducer aggregates with
 * ButterflyClip (all copies kept, results at the part's end). */
static void run_one(const uint8_t *data, size_t size, bool clip)
{
    ap_sim_t *sim = ap_sim_new(1);
    for (int i = 0; i < 3; i++) ap_sim_add_node(sim, NULL);
    ap_avg_member_t mem[3];
    for (int i = 0; i < 3; i++)
        mem[i] = (ap_avg_member_t){*ap_sim_peer_id(sim, i), i == 2 ? AP_AVG_CLIENT : AP_AVG_NORMAL,
                                   1e6, 1e6};
    ap_avg_group_t g = {.members = mem, .n = 3};
    memset(g.id, 0x77, sizeof g.id);
    memset(nodes, 0, sizeof nodes);
    ap_btard_bclip_t bc[2];
    for (int i = 0; i < 2; i++) {
        bc[i] = (ap_btard_bclip_t){.cfg = ap_btard_clip_cfg_default()};
        ap_allreduce_opts_t o = {.chunk_elems = 8, .stall_min_us = 100000};
        if (clip) {
            o.reduce = ap_btard_butterfly_clip;
            o.reduce_arg = &bc[i];
        }
        ap_avg_service_new(ap_sim_node(sim, i), &nodes[i].svc);
        for (int k = 0; k < ELEMS; k++) nodes[i].data[k] = (float)(k + i);
        ap_allreduce_start(nodes[i].svc, &g, nodes[i].data, ELEMS, 1.0 + i, &o, on_done, &nodes[i],
                           NULL);
    }
    ap_rt_t *rogue = ap_sim_node(sim, 2);
    ap_stream_t *streams[16] = {0};
    int ns = 0;
    size_t at = 0;
    uint8_t frame[AP__AVG_FRAME_HDR + 512];
    while (at + 3 <= size && ns < 16) {
        uint8_t op = data[at];
        size_t len = (size_t)data[at + 1] | ((size_t)data[at + 2] << 8);
        at += 3;
        if (len > size - at) len = size - at;
        const uint8_t *b = data + at;
        at += len;
        ap_stream_t **last = ns ? &streams[ns - 1] : NULL;
        switch (op % 4) {
        case 0:
            if (len < 1) break;
            ap_rt_stream_open(rogue, ap_sim_peer_id(sim, b[0] % 2), AP_AVG_PROTO, b + 1, len - 1,
                              NULL, &cbs, &streams[ns], &streams[ns]);
            ns++;
            break;
        case 1:
            if (last && *last) ap_stream_send(*last, b, len);
            break;
        case 2:
            if (last && *last && len <= 512) {
                ap__avg_frame_header(frame, AP__AVG_FRAME_DATA, 0, op >> 2, (uint32_t)(len / 4));
                memcpy(frame + AP__AVG_FRAME_HDR, b, len);
                ap_stream_send(*last, frame, AP__AVG_FRAME_HDR + len);
            }
            break;
        default:
            if (last && *last) ap_stream_close(*last);
            break;
        }
        ap_sim_run_for(sim, 500);
    }
    if (!ap_sim_run_until(sim, both_done, NULL, ap_sim_now_us(sim) + 600000000ull)) abort();
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < ELEMS; k++)
            if (!isfinite(nodes[i].data[k])) abort();
    for (int i = 0; i < 2; i++)
        if (ap_avg_service_free(nodes[i].svc)) abort();
    ap_sim_free(sim);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool init;
    if (!init) {
        ap_log_set_level(AP_LOG_OFF);
        init = true;
    }
    run_one(data, size, false);
    run_one(data, size, true);
    return 0;
}
