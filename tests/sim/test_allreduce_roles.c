/* Butterfly all-reduce on the simulated runtime: the exact weighted mean for
 * every role mix, part sizes that follow the LP, and bad input refused. */
#include "avg_harness.h"

static void run_mix(const ap_avg_role_t *roles, int n, uint64_t elems, uint32_t chunk,
                    uint64_t seed)
{
    avg_env_t e;
    avg_env_init(&e, n, elems, seed);
    int idx[64];
    double up[64], down[64];
    for (int i = 0; i < n; i++) {
        idx[i] = i;
        e.nd[i].role = roles[i];
        up[i] = 1e6 * (1 + 9 * avg_rnd01(&e));
        down[i] = 1e6 * (1 + 9 * avg_rnd01(&e));
        avg_set_bw(&e, i, up[i], down[i]);
    }
    uint8_t gid[32];
    memset(gid, (int)seed, sizeof gid);
    ap_allreduce_opts_t o = {.chunk_elems = chunk};
    avg_start(&e, idx, n, gid, up, down, &o);
    assert_true(avg_run_until(&e, avg_all_done, &e, 600000000ull));
    double *ref = malloc(elems * sizeof *ref);
    avg_reference(&e, idx, n, NULL, ref);
    /* the part sizes are the LP's rounded split */
    ap_avg_bw_t bw[64];
    double shares[64];
    uint64_t counts[64];
    for (int i = 0; i < n; i++) bw[i] = (ap_avg_bw_t){roles[i], up[i], down[i]};
    assert_ok(ap_avg_balance(bw, (size_t)n, NULL, shares, NULL));
    assert_ok(ap_avg_round_counts(shares, (size_t)n, elems, counts));
    for (int i = 0; i < n; i++) {
        avg_node_t *d = &e.nd[i];
        assert_int_equal(d->res.status, 0);
        assert_int_equal(d->res.my_part_elems, counts[i]);
        assert_int_equal(d->res.parts_failed, 0);
        assert_int_equal(d->res.senders_dropped, 0);
        assert_true(d->res.averaged_fraction == 1.0);
        if (d->role == AP_AVG_AUX) continue;
        assert_int_equal(d->res.elems_averaged, elems);
        for (uint64_t k = 0; k < elems; k++)
            if (!close_rel(d->data[k], ref[k], 1e-6))
                fail_msg("peer %d elem %llu: %.9g want %.9g", i, (unsigned long long)k, d->data[k],
                         ref[k]);
    }
    free(ref);
    avg_env_free(&e);
}

static void test_role_mixes(void **state)
{
    (void)state;
    const ap_avg_role_t N = AP_AVG_NORMAL, C = AP_AVG_CLIENT, X = AP_AVG_AUX;
    const struct {
        int n;
        ap_avg_role_t r[8];
    } mixes[] = {
        {2, {N, N}},
        {4, {N, N, N, N}},
        {5, {N, C, N, C, N}},
        {4, {N, N, X, N}},
        {6, {C, N, X, N, C, X}},
        {3, {N, C, C}},    /* one acceptor reduces everything */
        {4, {C, X, C, C}}, /* an auxiliary reduces for clients only */
        {3, {X, N, X}},    /* one sender with two auxiliaries */
        {8, {N, N, C, X, N, C, N, N}},
    };
    uint64_t seed = ap_test_seed(61);
    for (size_t m = 0; m < sizeof mixes / sizeof mixes[0]; m++) {
        run_mix(mixes[m].r, mixes[m].n, 10007, 1000, seed + m); /* uneven last chunk */
        run_mix(mixes[m].r, mixes[m].n, 37, 8, seed + 100 + m);
    }
}

/* ---- compressed chunks ------------------------------------------------------------ */

/* With a lossy codec the result is the weighted mean within twice the
 * codec's error bound (data quantised once on the way in, the mean once on
 * the way back), every receiver gets the same values, and fewer bytes move. */
static void test_codecs(void **state)
{
    (void)state;
    const struct {
        uint8_t codec;
        double tol; /* absolute, for data uniform in [-100, 100] */
    } cases[] = {
        {AP_AVG_CODEC_FP16, 2 * 100 * 0x1p-11},
        {AP_AVG_CODEC_BF16, 2 * 100 * 0x1p-8},
        {AP_AVG_CODEC_BLOCKWISE8, 2 * 0.00785 * 100 + 1e-3},
        {AP_AVG_CODEC_UNIFORM8, 2 * 12 * 57.8 / 256 + 1e-3},
    };
    const uint64_t elems = 20000;
    uint64_t raw_bytes = 0;
    for (int c = -1; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        avg_env_t e;
        avg_env_init(&e, 4, elems, ap_test_seed(64));
        int idx[4] = {0, 1, 2, 3};
        e.nd[3].role = AP_AVG_CLIENT;
        uint8_t gid[32] = {(uint8_t)(c + 2)};
        ap_allreduce_opts_t o = {.chunk_elems = 4096, .codec = c < 0 ? 0 : cases[c].codec};
        avg_start(&e, idx, 4, gid, NULL, NULL, &o);
        assert_true(avg_run_until(&e, avg_all_done, &e, 600000000ull));
        double *ref = malloc(elems * sizeof *ref);
        avg_reference(&e, idx, 4, NULL, ref);
        double tol = c < 0 ? 1e-4 : cases[c].tol, worst = 0;
        uint64_t bytes = 0;
        for (int i = 0; i < 4; i++) {
            assert_int_equal(e.nd[i].res.status, 0);
            assert_true(e.nd[i].res.averaged_fraction == 1.0);
            bytes += e.nd[i].res.bytes_sent;
            for (uint64_t k = 0; k < elems; k++) {
                double d = fabs(e.nd[i].data[k] - ref[k]);
                if (d > worst) worst = d;
                if (e.nd[i].data[k] != e.nd[0].data[k]) /* everyone holds the same values */
                    fail_msg("codec %d: peers 0 and %d differ at %llu", o.codec, i,
                             (unsigned long long)k);
            }
        }
        printf("codec %d: worst error %.4g (bound %.4g), bytes %llu\n", o.codec, worst, tol,
               (unsigned long long)bytes);
        assert_true(worst <= tol);
        if (c < 0)
            raw_bytes = bytes;
        else
            assert_true(bytes < raw_bytes * 0.6);
        free(ref);
        avg_env_free(&e);
    }
}

/* ---- bad input ---------------------------------------------------------------- */

typedef struct rogue {
    ap_stream_t *s;
    int closed_status;
    bool closed;
} rogue_t;

static void rg_msg(ap_stream_t *s, void *a, const uint8_t *d, size_t n)
{
    (void)s, (void)a, (void)d, (void)n;
}
static void rg_ev(ap_stream_t *s, void *a)
{
    (void)s, (void)a;
}
static void rg_close(ap_stream_t *s, void *a, int st)
{
    (void)s;
    rogue_t *r = a;
    r->closed = true;
    r->closed_status = st;
}
static const ap_stream_cbs_t rg_cbs = {rg_msg, rg_ev, rg_ev, rg_close};

static void rogue_open(avg_env_t *e, int from, int to, const ap__avg_hello_t *h, rogue_t *r)
{
    uint8_t hb[AP__AVG_HELLO_MAX];
    size_t hl = ap__avg_hello_encode(h, hb);
    memset(r, 0, sizeof *r);
    ap_rt_t *rt = avg_rt(e, from);
    assert_ok(ap_rt_stream_open(rt, ap_rt_self(avg_rt(e, to)), AP_AVG_PROTO, hb, hl, NULL, &rg_cbs,
                                r, &r->s));
}

static void rogue_send_chunk(rogue_t *r, uint32_t index, const float *x, uint32_t n)
{
    uint8_t buf[AP__AVG_FRAME_HDR + 4 * 64];
    ap__avg_frame_header(buf, AP__AVG_FRAME_DATA, 0, index, n);
    memcpy(buf + AP__AVG_FRAME_HDR, x, 4 * n);
    assert_ok(ap_stream_send(r->s, buf, AP__AVG_FRAME_HDR + 4 * n));
}

static void test_bad_input(void **state)
{
    (void)state;
    /* nodes 0..2 honest NORMAL, node 3 a CLIENT member driven by the test,
     * node 4 an outsider */
    avg_env_t e;
    const uint64_t elems = 48;
    avg_env_init(&e, 5, elems, ap_test_seed(62));
    e.nd[3].role = AP_AVG_CLIENT;
    uint8_t gid[32];
    memset(gid, 0x5a, sizeof gid);
    ap_allreduce_opts_t o = {.chunk_elems = 16};
    /* honest peers start; node 3 does not run the protocol itself */
    ap_avg_member_t mem[4];
    for (int k = 0; k < 4; k++) {
        mem[k] = (ap_avg_member_t){*ap_rt_self(avg_rt(&e, k)), e.nd[k].role, 125e6, 125e6};
    }
    ap_avg_group_t g = {.members = mem, .n = 4};
    memcpy(g.id, gid, 32);
    for (int k = 0; k < 3; k++) {
        e.nd[k].in_round = true;
        assert_ok(ap_allreduce_start(e.nd[k].svc, &g, e.nd[k].data, elems, e.nd[k].weight, &o,
                                     avg_on_done, &e.nd[k], &e.nd[k].ar));
    }
    /* the split every member computes: 16 elements each for 0, 1, 2 */
    ap__avg_hello_t h = {0};
    memcpy(h.group_id, gid, 32);
    h.sender = 3;
    h.total = elems;
    h.chunk_elems = 16;
    h.weight = 2.0;
    rogue_t r_nan, r_dup1, r_dup2, r_size, r_gid, r_who;
    float good[16], nan16[16];
    for (int k = 0; k < 16; k++) {
        good[k] = (float)k;
        nan16[k] = k == 5 ? NAN : 1.0f;
    }
    /* to reducer 0: NaN in the chunk -> dropped, not folded in */
    h.reducer = 0, h.offset = 0, h.count = 16;
    rogue_open(&e, 3, 0, &h, &r_nan);
    rogue_send_chunk(&r_nan, 0, nan16, 16);
    /* to reducer 1: joins twice; the first is valid and delivers */
    h.reducer = 1, h.offset = 16, h.count = 16;
    rogue_open(&e, 3, 1, &h, &r_dup1);
    rogue_send_chunk(&r_dup1, 0, good, 16);
    ap_stream_close(r_dup1.s);
    rogue_open(&e, 3, 1, &h, &r_dup2);
    /* to reducer 2: a part of the wrong size, refused; then never sends */
    h.reducer = 2, h.offset = 32, h.count = 17;
    rogue_open(&e, 3, 2, &h, &r_size);
    /* an outsider claiming to be sender 3 */
    h.count = 16;
    rogue_open(&e, 4, 2, &h, &r_who);
    /* then the real sender 3, valid, that never closes its direction: the
     * round must still end (reset after the grace) with its data */
    rogue_t r_open;
    rogue_open(&e, 3, 2, &h, &r_open);
    rogue_send_chunk(&r_open, 0, good, 16);
    /* a stream with an unknown group id, from the outsider */
    ap__avg_hello_t hx = h;
    hx.group_id[0] ^= 1;
    hx.sender = 0;
    rogue_open(&e, 4, 1, &hx, &r_gid);

    assert_true(avg_run_until(&e, avg_all_done, &e, 60000000ull));
    assert_true(r_nan.closed && r_nan.closed_status != 0);
    assert_true(r_dup2.closed && r_dup2.closed_status != 0);
    assert_true(r_size.closed && r_size.closed_status != 0);
    assert_true(r_who.closed && r_who.closed_status != 0);
    avg_run_for(&e, 12000000ull); /* parked streams expire after 10 s */
    assert_true(r_gid.closed && r_gid.closed_status != 0);
    assert_true(r_dup1.closed);
    assert_true(r_open.closed);

    /* part 0: honest peers only (NaN sender dropped); part 1: the rogue's
     * valid data once, with its weight; part 2: its valid data too */
    for (int k = 0; k < 3; k++) {
        avg_node_t *d = &e.nd[k];
        assert_int_equal(d->res.status, 0);
        assert_true(d->res.averaged_fraction == 1.0);
        for (uint64_t x = 0; x < elems; x++) {
            double s = 0, w = 0;
            for (int j = 0; j < 3; j++) {
                s += e.nd[j].weight * e.nd[j].orig[x];
                w += e.nd[j].weight;
            }
            if (x >= 16) { /* parts 1 and 2 have the rogue's valid data */
                s += 2.0 * good[x % 16];
                w += 2.0;
            }
            if (!close_rel(d->data[x], s / w, 1e-6))
                fail_msg("peer %d elem %llu: %.9g want %.9g", k, (unsigned long long)x, d->data[x],
                         s / w);
        }
    }
    assert_int_equal(e.nd[0].res.senders_dropped, 1); /* NaN */
    assert_int_equal(e.nd[1].res.senders_dropped, 0);
    assert_int_equal(e.nd[2].res.senders_dropped, 0);
    /* the half-open stream is reset after the grace (stall_min, 1 s), not at
     * the deadline (connect grace 2 s + slack 2 s + 4 T_lp) */
    assert_true(e.nd[2].res.elapsed_us < 3000000);
    avg_env_free(&e);
}

/* ---- weight 0 ------------------------------------------------------------------------ */

/* One round of n peers with the given roles and weights on equal links;
 * returns its (virtual) duration, checks every receiver against want (the
 * weighted mean, or the plain mean when every weight is 0). */
static uint64_t run_weights(const ap_avg_role_t *roles, const double *w, int n, uint64_t elems,
                            uint64_t seed)
{
    avg_env_t e;
    avg_env_init(&e, n, elems, seed);
    int idx[16];
    double wsum = 0;
    for (int i = 0; i < n; i++) {
        idx[i] = i;
        e.nd[i].role = roles[i];
        e.nd[i].weight = w[i];
        avg_set_bw(&e, i, 10e6, 10e6);
        if (roles[i] != AP_AVG_AUX) wsum += w[i];
    }
    uint8_t gid[32];
    memset(gid, (int)seed + 1, sizeof gid);
    ap_allreduce_opts_t o = {.chunk_elems = 1000};
    uint64_t t0 = ap_sim_now_us(e.sim);
    avg_start(&e, idx, n, gid, NULL, NULL, &o);
    assert_true(avg_run_until(&e, avg_all_done, &e, 600000000ull));
    uint64_t took = ap_sim_now_us(e.sim) - t0;
    for (uint64_t k = 0; k < elems; k++) {
        double sx = 0, sw = 0;
        for (int j = 0; j < n; j++) {
            if (roles[j] == AP_AVG_AUX) continue;
            double wj = wsum > 0 ? w[j] : 1.0;
            sx += wj * e.nd[j].orig[k];
            sw += wj;
        }
        for (int i = 0; i < n; i++) {
            if (roles[i] == AP_AVG_AUX) continue;
            if (!close_rel(e.nd[i].data[k], sx / sw, 1e-6))
                fail_msg("peer %d elem %llu: %.9g want %.9g", i, (unsigned long long)k,
                         e.nd[i].data[k], sx / sw);
        }
    }
    for (int i = 0; i < n; i++) {
        avg_node_t *d = &e.nd[i];
        assert_int_equal(d->res.status, 0);
        assert_int_equal(d->res.parts_failed, 0);
        assert_int_equal(d->res.senders_dropped, 0);
        assert_true(d->res.averaged_fraction == 1.0);
        if (roles[i] != AP_AVG_AUX) assert_int_equal(d->res.elems_averaged, elems);
    }
    avg_env_free(&e);
    return took;
}

/* A sender of weight 0 (a trainer without samples) is a full member: the
 * round ends as fast as with weight 1, nobody is dropped, its values add
 * nothing to the mean and it gets the mean back. If all weights are 0 the
 * result is the plain mean. */
static void test_zero_weight(void **state)
{
    (void)state;
    const ap_avg_role_t N = AP_AVG_NORMAL, C = AP_AVG_CLIENT, X = AP_AVG_AUX;
    uint64_t seed = ap_test_seed(71);
    const ap_avg_role_t r4[] = {N, N, N, N};
    const double ones[] = {1, 1, 1, 1};
    const double one_zero[] = {1, 0, 2, 1};
    uint64_t base = run_weights(r4, ones, 4, 100000, seed);
    uint64_t zero = run_weights(r4, one_zero, 4, 100000, seed);
    /* same links, same bytes: the same virtual time within a margin, far
     * below the 2 s a member that never connects is waited for */
    if (zero > base + base / 2 || zero >= 2000000)
        fail_msg("weight-0 round took %llu us, weight-1 round %llu us", (unsigned long long)zero,
                 (unsigned long long)base);
    /* zero-weight client and normal peers, with an auxiliary */
    const ap_avg_role_t r5[] = {N, C, X, N, C};
    const double w5[] = {0, 0, 0, 3, 1};
    run_weights(r5, w5, 5, 10007, seed + 1);
    /* every weight 0: the plain mean */
    const double zeros[] = {0, 0, 0, 0};
    run_weights(r4, zeros, 4, 10007, seed + 2);
    const ap_avg_role_t r3[] = {N, X, C};
    const double z3[] = {0, 0, 0};
    run_weights(r3, z3, 3, 37, seed + 3);
}

static void test_bad_args(void **state)
{
    (void)state;
    avg_env_t e;
    avg_env_init(&e, 2, 8, 3);
    ap_avg_member_t mem[2];
    for (int k = 0; k < 2; k++)
        mem[k] = (ap_avg_member_t){*ap_rt_self(avg_rt(&e, k)), AP_AVG_NORMAL, 1e6, 1e6};
    ap_avg_group_t g = {.members = mem, .n = 2};
    float x[8] = {0};
    /* weight must be finite and >= 0 for a sender */
    assert_int_equal(
        ap_allreduce_start(e.nd[0].svc, &g, x, 8, -1, NULL, avg_on_done, &e.nd[0], NULL),
        AP_EINVAL);
    assert_int_equal(
        ap_allreduce_start(e.nd[0].svc, &g, x, 8, NAN, NULL, avg_on_done, &e.nd[0], NULL),
        AP_EINVAL);
    /* NaN in the local data */
    x[3] = NAN;
    assert_int_equal(
        ap_allreduce_start(e.nd[0].svc, &g, x, 8, 1, NULL, avg_on_done, &e.nd[0], NULL),
        AP_ENONFINITE);
    x[3] = 0;
    /* not a member */
    mem[0].id = mem[1].id;
    assert_int_equal(
        ap_allreduce_start(e.nd[0].svc, &g, x, 8, 1, NULL, avg_on_done, &e.nd[0], NULL), AP_EINVAL);
    avg_env_free(&e);
}

int main(void)
{
    ap_log_set_level(AP_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_role_mixes), cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_bad_args),   cmocka_unit_test(test_zero_weight),
        cmocka_unit_test(test_codecs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
