/* Distributed MASHA (server + 10 workers) on the real runtime drivers through
 * the testbed interface: the deterministic simulator and the libuv driver
 * (in-process transport). Each run must equal the in-process solver's run
 * (same iterations, refreshes, bytes), and on the simulator every worker's
 * runtime byte counter must equal the analytic count: the protocol bytes of
 * its requests plus, per message, the protocol name (aux) and the
 * simulator's AP_SIM_FRAME_OVERHEAD, plus one SYN to open its connection.
 * Wire versions: a server that serves only /apiary/masha/1 (as one built
 * before version 2) makes every worker fall back after its first call and
 * the run is the version 1 run; workers of both versions share a server and
 * each gets the counts of its own version. */
#include "aptest.h"
#include "testbed.h"

#include "apiary/compress.h"
#include "apiary/masha.h"
#include "apiary/sim.h"

#include <string.h>

#define M 10

typedef struct wres {
    int status;
    bool finished;
    ap_masha_result_t r;
} wres_t;

static wres_t res[M], sres; /* workers, tracked server */

static void on_done(void *arg, int status, const ap_masha_result_t *r)
{
    wres_t *w = arg;
    w->status = status;
    w->finished = true;
    w->r = *r;
}

static bool all_done(void *arg)
{
    (void)arg;
    if (!sres.finished) return false;
    for (int m = 0; m < M; m++)
        if (!res[m].finished) return false;
    return true;
}

/* MIX_NONE: everyone speaks version 3; MIX_OLD_SERVER: the server speaks
 * versions up to old_wire (1 or 2) and every worker steps down to it;
 * MIX_WORKERS: worker m speaks version 1 + m mod 3. */
enum { MIX_NONE, MIX_OLD_SERVER, MIX_WORKERS };

static void run_mix(const ap_testbed_ops_t *tbo, ap_masha_method_t method, double gamma,
                    double frac, int mix, int old_wire)
{
    ap_masha_bilinear_cfg_t pc = {.n = 50, .workers = M, .lambda = 0.05, .h = 0.1, .seed = 2021};
    ap_masha_opts_t o = {.method = method,
                         .gamma = gamma,
                         .fraction = frac,
                         .seed = 99,
                         .target = 1e-6,
                         .max_iters = 100000};
    memset(res, 0, sizeof res);
    memset(&sres, 0, sizeof sres);
    ap_testbed_t *tb = tbo->create(M + 1, ap_test_seed(7));
    assert_non_null(tb);
    ap_masha_node_t *srv, *wk[M];
    ap_masha_opts_t ov[4] = {o, o, o, o}; /* ov[v]: at most version v */
    for (int v = 1; v <= 3; v++) ov[v].wire = v;
    int sw = mix == MIX_OLD_SERVER ? old_wire : 3; /* the server's version */
    assert_ok(ap_masha_server_start(tbo->node(tb, 0), &pc, &ov[sw], &srv));
    assert_ok(ap_masha_server_track(srv, on_done, &sres));
    const ap_peer_id_t *sid = ap_rt_self(tbo->node(tb, 0));
    char addr[1][AP_RT_ADDR_MAX];
    assert_true(ap_rt_listen_addrs(tbo->node(tb, 0), addr, 1, false) >= 1);
    for (int m = 0; m < M; m++) {
        ap_rt_t *rt = tbo->node(tb, 1 + m);
        assert_ok(ap_rt_add_addr(rt, sid, addr[0]));
        const ap_masha_opts_t *wo = mix == MIX_WORKERS ? &ov[1 + m % 3] : &o;
        assert_ok(ap_masha_worker_start(rt, sid, &pc, wo, m, on_done, &res[m], &wk[m]));
    }
    assert_true(tbo->run_until(tb, all_done, NULL, 600ull * 1000000));

    ap_masha_problem_t *p = ap_masha_bilinear_new(&pc);
    ap_masha_result_t refs[4];
    for (int v = 1; v <= 3; v++) assert_ok(ap_masha_run(p, &ov[v], &refs[v]));
    /* the same run in every version; only the framing differs */
    for (int v = 1; v < 3; v++) {
        assert_int_equal(refs[v].iters, refs[3].iters);
        assert_true(refs[v].rel_dist2 == refs[3].rel_dist2);
        assert_true(refs[v + 1].bytes_up < refs[v].bytes_up);
        assert_true(refs[v + 1].bytes_down < refs[v].bytes_down);
    }
    const ap_masha_result_t *ref = &refs[sw];
    uint64_t nmsgs =
        method == AP_MASHA_EXTRAGRADIENT ? 2 * ref->iters : 1 + ref->refreshes + ref->iters;
    uint64_t per_msg = strlen(AP_MASHA_PROTO) + 1 + AP_SIM_FRAME_OVERHEAD;
    for (int m = 0; m < M; m++) {
        int wv = mix == MIX_WORKERS ? 1 + m % 3 : sw; /* the worker's version in the end */
        const ap_masha_result_t *want_r = &refs[wv];
        assert_int_equal(res[m].status, 0);
        assert_true(res[m].r.converged);
        assert_int_equal(res[m].r.iters, ref->iters);
        assert_int_equal(res[m].r.refreshes, ref->refreshes);
        assert_true(res[m].r.rel_dist2 == ref->rel_dist2);
        assert_int_equal(res[m].r.bytes_up, want_r->bytes_up);
        assert_int_equal(res[m].r.bytes_down, want_r->bytes_down);
        assert_int_equal(res[m].r.bytes_up,
                         ap_masha_upload_bytes(p, &ov[wv], ref->iters, ref->refreshes));
        if (tbo->virtual_time) {
            ap_rt_stats_t st;
            ap_rt_get_stats(tbo->node(tb, 1 + m), &st);
            uint64_t want = want_r->bytes_up + nmsgs * per_msg + AP_SIM_FRAME_OVERHEAD /* SYN */;
            /* the first request (dense) refused in each version above the server's */
            ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
            if (mix == MIX_OLD_SERVER)
                want += 1 + 1 + ap_compress_size_ex(&none, 100, 0, AP_COMPRESS_BARE) + per_msg;
            if (mix == MIX_OLD_SERVER && sw == 1)
                want += 2 + 1 + ap_compress_size_ex(&none, 100, 0, AP_COMPRESS_COMPACT) + per_msg;
            assert_int_equal(st.bytes_sent, want);
        }
    }
    /* the tracked server saw the same end as every worker (its shadow
     * speaks the server's version) */
    const ap_masha_result_t *sref = &refs[sw];
    assert_int_equal(sres.status, 0);
    assert_true(sres.r.converged);
    assert_int_equal(sres.r.iters, ref->iters);
    assert_int_equal(sres.r.refreshes, ref->refreshes);
    assert_int_equal(sres.r.bytes_up, sref->bytes_up);
    assert_int_equal(sres.r.bytes_down, sref->bytes_down);
    print_message("%s: method %d, %llu iterations, %llu B of MASHA messages up per worker\n",
                  tbo->name, (int)method, (unsigned long long)ref->iters,
                  (unsigned long long)ref->bytes_up);
    for (int m = 0; m < M; m++) ap_masha_node_free(wk[m]);
    ap_masha_node_free(srv);
    ap_masha_problem_free(p);
    tbo->destroy(tb);
}

static void run(const ap_testbed_ops_t *tbo, ap_masha_method_t method, double gamma, double frac)
{
    run_mix(tbo, method, gamma, frac, MIX_NONE, 3);
}

static void test_sim_eg(void **s)
{
    (void)s, run(&ap_testbed_sim, AP_MASHA_EXTRAGRADIENT, 1.8, 0);
}
static void test_sim_masha1(void **s)
{
    (void)s, run(&ap_testbed_sim, AP_MASHA_1, 0.177, 0.02);
}
static void test_sim_masha2(void **s)
{
    (void)s, run(&ap_testbed_sim, AP_MASHA_2, 0.2, 0.1);
}
static void test_uv_masha1(void **s)
{
    (void)s, run(&ap_testbed_uv, AP_MASHA_1, 0.4, 0.1);
}
static void test_sim_old_server(void **s)
{
    (void)s, run_mix(&ap_testbed_sim, AP_MASHA_1, 0.4, 0.1, MIX_OLD_SERVER, 1);
    run_mix(&ap_testbed_sim, AP_MASHA_1, 0.4, 0.1, MIX_OLD_SERVER, 2);
    run_mix(&ap_testbed_sim, AP_MASHA_EXTRAGRADIENT, 1.8, 0, MIX_OLD_SERVER, 1);
}
static void test_sim_mixed_workers(void **s)
{
    (void)s, run_mix(&ap_testbed_sim, AP_MASHA_2, 0.2, 0.1, MIX_WORKERS, 3);
}
static void test_uv_old_server(void **s)
{
    (void)s, run_mix(&ap_testbed_uv, AP_MASHA_1, 0.4, 0.1, MIX_OLD_SERVER, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sim_eg),         cmocka_unit_test(test_sim_masha1),
        cmocka_unit_test(test_sim_masha2),     cmocka_unit_test(test_uv_masha1),
        cmocka_unit_test(test_sim_old_server), cmocka_unit_test(test_sim_mixed_workers),
        cmocka_unit_test(test_uv_old_server),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
