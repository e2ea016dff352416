/* MASHA on the paper's bilinear problem: z* solves F(z*) = 0; extragradient,
 * MASHA1 and MASHA2 converge linearly; MASHA1 rand-k 2% needs at most half
 * the uploaded floats of extragradient at h = 0.1; byte counters equal the
 * analytic count; the server refuses malformed or duplicate requests. */
#include "aptest.h"

#include "apiary/masha.h"
#include "compress/masha_core.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static ap_masha_problem_t *make(double h)
{
    ap_masha_bilinear_cfg_t pc = {.n = 50, .workers = 10, .lambda = 0.05, .h = h, .seed = 2021};
    ap_masha_problem_t *p = ap_masha_bilinear_new(&pc);
    assert_non_null(p);
    return p;
}

static void test_solution(void **state)
{
    (void)state;
    ap_masha_problem_t *p = make(1.0);
    size_t d = ap_masha_dim(p);
    assert_int_equal(d, 100);
    double *F = calloc(d, sizeof *F), *Fm = calloc(d, sizeof *Fm);
    for (int m = 0; m < ap_masha_workers(p); m++) {
        ap_masha_operator(p, m, ap_masha_solution(p), Fm);
        for (size_t i = 0; i < d; i++) F[i] += Fm[i] / ap_masha_workers(p);
    }
    double r = 0, zs = 0;
    for (size_t i = 0; i < d; i++) {
        r += F[i] * F[i];
        zs += ap_masha_solution(p)[i] * ap_masha_solution(p)[i];
    }
    assert_true(sqrt(r) < 1e-9);
    assert_true(zs > 1); /* non-trivial solution */
    /* operator is strongly monotone with modulus lambda: <F(z)-F(z*), z-z*> = lambda |z-z*|^2 */
    double *z = calloc(d, sizeof *z);
    for (size_t i = 0; i < d; i++) z[i] = sin((double)i);
    memset(F, 0, d * sizeof *F);
    for (int m = 0; m < ap_masha_workers(p); m++) {
        ap_masha_operator(p, m, z, Fm);
        for (size_t i = 0; i < d; i++) F[i] += Fm[i] / ap_masha_workers(p);
    }
    double ip = 0, dz = 0;
    for (size_t i = 0; i < d; i++) {
        double e = z[i] - ap_masha_solution(p)[i];
        ip += F[i] * e;
        dz += e * e;
    }
    assert_true(fabs(ip - 0.05 * dz) < 1e-9 * dz);
    free(z);
    free(F);
    free(Fm);
    ap_masha_problem_free(p);
}

typedef struct rates {
    double rel[200001];
    uint64_t last;
} rates_t;

static void rec(void *arg, uint64_t it, uint64_t f, uint64_t b, double rel2)
{
    (void)f;
    (void)b;
    rates_t *r = arg;
    if (it <= 200000) r->rel[it] = rel2;
    r->last = it;
}

/* Linear convergence: reaches 1e-6 and log(rel) falls at a steady rate: the
 * distance at a quarter, half and three quarters of the run is within a
 * factor 30 of the geometric interpolation. */
static void check_linear(const ap_masha_problem_t *p, const ap_masha_opts_t *o0,
                         ap_masha_result_t *out)
{
    static rates_t tr;
    memset(&tr, 0, sizeof tr);
    ap_masha_opts_t o = *o0;
    o.trace = rec;
    o.trace_arg = &tr;
    ap_masha_result_t r;
    assert_ok(ap_masha_run(p, &o, &r));
    assert_true(r.converged);
    assert_true(r.rel_dist2 <= 1e-6);
    assert_int_equal(tr.last, r.iters);
    for (int q = 1; q <= 3; q++) {
        uint64_t t = r.iters * (uint64_t)q / 4;
        double expect = pow(1e-6, (double)q / 4);
        assert_true(tr.rel[t] < 30 * expect);
        assert_true(tr.rel[t] > expect / 30);
    }
    /* analytic byte count */
    assert_int_equal(r.bytes_up, ap_masha_upload_bytes(p, &o, r.iters, r.refreshes));
    *out = r;
}

static void test_convergence_and_target(void **state)
{
    (void)state;
    for (int hi = 0; hi < 2; hi++) {
        ap_masha_problem_t *p = make(hi ? 1.0 : 0.1);
        ap_masha_result_t eg, m1, m2;
        ap_masha_opts_t o = {.method = AP_MASHA_EXTRAGRADIENT,
                             .gamma = 1.8,
                             .seed = 77,
                             .target = 1e-6,
                             .max_iters = 100000};
        check_linear(p, &o, &eg);
        assert_int_equal(eg.floats_up, eg.iters * 200);
        /* MASHA2 (top-k 2%, error feedback) converges linearly at both h */
        o = (ap_masha_opts_t){.method = AP_MASHA_2,
                              .gamma = 0.09,
                              .fraction = 0.02,
                              .seed = 77,
                              .target = 1e-6,
                              .max_iters = 100000};
        check_linear(p, &o, &m2);
        assert_true(m2.refreshes > 0);
        if (hi == 0) {
            /* MASHA1 rand-k 2%: at most half the floats of extragradient */
            o = (ap_masha_opts_t){.method = AP_MASHA_1,
                                  .gamma = 0.177,
                                  .fraction = 0.02,
                                  .seed = 77,
                                  .target = 1e-6,
                                  .max_iters = 100000};
            check_linear(p, &o, &m1);
            print_message("h=0.1: extragradient %llu floats, MASHA1 rand-k 2%% %llu (ratio %.3f)\n",
                          (unsigned long long)eg.floats_up, (unsigned long long)m1.floats_up,
                          (double)m1.floats_up / eg.floats_up);
            assert_true(m1.floats_up <= eg.floats_up / 2);
        }
        ap_masha_problem_free(p);
    }
}

static void test_server_compression(void **state)
{
    (void)state;
    ap_masha_problem_t *p = make(0.1);
    /* bidirectional compression: MASHA1 with rand-k at the server too, and
     * MASHA2 with top-k + server error feedback; both still converge */
    ap_masha_opts_t o = {.method = AP_MASHA_1,
                         .gamma = 0.1,
                         .fraction = 0.1,
                         .server_fraction = 0.5,
                         .seed = 3,
                         .target = 1e-6,
                         .max_iters = 200000};
    ap_masha_result_t r;
    assert_ok(ap_masha_run(p, &o, &r));
    assert_true(r.converged);
    ap_masha_opts_t o2 = {.method = AP_MASHA_2,
                          .gamma = 0.2,
                          .fraction = 0.1,
                          .server_fraction = 0.5,
                          .seed = 3,
                          .target = 1e-6,
                          .max_iters = 200000};
    ap_masha_result_t r2;
    assert_ok(ap_masha_run(p, &o2, &r2));
    assert_true(r2.converged);
    /* replies are compressed: fewer download bytes per iteration than dense
     * (rand-k 50 % sends half the values; top-k 50 % values + indices would
     * be as large as the dense reply) */
    ap_masha_opts_t o3 = o;
    o3.server_fraction = 0;
    ap_masha_result_t r3;
    assert_ok(ap_masha_run(p, &o3, &r3));
    assert_true((double)r.bytes_down / r.iters < (double)r3.bytes_down / r3.iters);
    ap_masha_problem_free(p);
}

/* A MASHA1 server for `workers` workers and workers 0 and 1, started, with
 * their first requests (m0, m1), speaking wire version `wire` (0: the
 * newest). */
typedef struct rejects {
    ap_masha_problem_t *p;
    ap__masha_server_t *s;
    ap__masha_worker_t *w0, *w1;
    const uint8_t *m0, *m1;
    size_t l0, l1;
} rejects_t;

static rejects_t rejects_setup(uint32_t workers, uint32_t wire)
{
    rejects_t r;
    r.p = make(0.1);
    ap_masha_opts_t o = {.method = AP_MASHA_1,
                         .gamma = 0.1,
                         .fraction = 0.1,
                         .seed = 3,
                         .target = 1e-6,
                         .max_iters = 10,
                         .wire = wire};
    r.s = ap__masha_server_new(ap_masha_dim(r.p), workers, &o);
    r.w0 = ap__masha_worker_new(r.p, &o, 0);
    r.w1 = ap__masha_worker_new(r.p, &o, 1);
    assert_ok(ap__masha_worker_start(r.w0));
    assert_ok(ap__masha_worker_start(r.w1));
    r.m0 = ap__masha_worker_msg(r.w0, &r.l0);
    r.m1 = ap__masha_worker_msg(r.w1, &r.l1);
    return r;
}

static void test_server_rejects(void **state)
{
    (void)state;
    rejects_t r = rejects_setup(10, 2);
    assert_int_equal(ap__masha_server_add(r.s, r.m0, r.l0), 0);
    assert_int_equal(ap__masha_server_add(r.s, r.m0, r.l0), AP_EPROTO); /* duplicate */
    uint8_t bad[1024];
    assert_true(r.l1 <= sizeof bad);
    memcpy(bad, r.m1, r.l1);
    bad[0] = (uint8_t)((bad[0] & 0xf8) | AP__MP_DIFF); /* other phase */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    memcpy(bad, r.m1, r.l1);
    bad[1] = 1; /* other iteration */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    memcpy(bad, r.m1, r.l1);
    bad[0] = 0x31; /* unknown version */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EVERSION);
    memcpy(bad, r.m1, r.l1);
    bad[0] |= 8; /* a request has no refresh bit */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    memcpy(bad, r.m1, r.l1);
    bad[2] = 0x81; /* overlong worker varint */
    bad[3] = 0x00;
    assert_true(ap__masha_server_add(r.s, bad, r.l1) < 0);
    /* a version 2 message must carry a version 2 chunk */
    {
        ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
        float zero[100] = {0};
        uint8_t v1c[3 + 24 + 400] = {0x21, 0, 1};
        size_t cl;
        assert_ok(ap_compress_encode(&none, zero, 100, 0, v1c + 3, sizeof v1c - 3, &cl));
        assert_int_equal(ap__masha_server_add(r.s, v1c, 3 + cl), AP_EPROTO);
    }
    memcpy(bad, r.m1, r.l1);
    bad[2] = 99; /* worker index out of range */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    for (size_t cut = 0; cut < r.l1; cut += 7)
        assert_true(ap__masha_server_add(r.s, r.m1, cut) < 0);
    assert_int_equal(ap__masha_server_add(r.s, r.m1, r.l1), 0);
    /* worker rejects a reply for another phase/iteration */
    bool done;
    uint8_t rep[16] = {1, 9, 0, 0, 0, 0, 0, 0};
    assert_int_equal(ap__masha_worker_on_reply(r.w0, rep, sizeof rep, &done), AP_EPROTO);
    uint8_t rep2[2] = {0x21, 0};
    assert_true(ap__masha_worker_on_reply(r.w0, rep2, 1, &done) < 0);           /* truncated */
    assert_true(ap__masha_worker_on_reply(r.w0, rep2, sizeof rep2, &done) < 0); /* no chunk */
    ap__masha_worker_free(r.w0);
    ap__masha_worker_free(r.w1);
    ap__masha_server_free(r.s);
    ap_masha_problem_free(r.p);
}

/* Version 3 (one header byte, bare chunks): the header byte's phase and
 * iteration bits, the worker varint (truncated, overlong, out of range) and
 * the exact payload size implied by the phase are all checked. */
static void test_server_rejects_v3(void **state)
{
    (void)state;
    rejects_t r = rejects_setup(2, 0);
    assert_int_equal(r.l1, 1 + 1 + 400); /* header byte, worker 1, 100 floats */
    assert_int_equal(r.m1[0], 0x80);     /* iteration 0, phase FULL */
    assert_int_equal(r.m1[1], 1);
    assert_int_equal(ap__masha_server_add(r.s, r.m0, r.l0), 0);
    uint8_t bad[1024];
    memcpy(bad, r.m1, r.l1);
    bad[0] = 0x81; /* other phase */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    bad[0] = 0x84; /* other iteration */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    bad[0] = 0x80;
    bad[1] = 2; /* worker index out of range */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    bad[1] = 0; /* worker 0 again */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    bad[1] = 0x81; /* overlong varint (1 in two bytes) */
    bad[2] = 0x00;
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    memset(bad + 1, 0xff, 3); /* varint beyond 3 bytes */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1), AP_EPROTO);
    memcpy(bad, r.m1, r.l1); /* one byte more or less than the phase implies */
    assert_int_equal(ap__masha_server_add(r.s, bad, r.l1 + 1), AP_ECORRUPT);
    for (size_t cut = 0; cut < r.l1; cut += 13)
        assert_true(ap__masha_server_add(r.s, r.m1, cut) < 0);
    /* a version 3 header in front of a compact chunk is not a bare chunk */
    {
        ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
        float zero[100] = {0};
        uint8_t v2c[2 + 3 + 400] = {0x80, 1};
        size_t cl;
        assert_ok(
            ap_compress_encode_ex(&none, zero, 100, 0, AP_COMPRESS_COMPACT, v2c + 2, 403, &cl));
        assert_int_equal(ap__masha_server_add(r.s, v2c, 2 + cl), AP_ECORRUPT);
    }
    assert_int_equal(ap__masha_server_add(r.s, r.m1, r.l1), 1);
    /* replies: one byte, then exactly the dense average */
    size_t rl;
    const uint8_t *rep = ap__masha_server_reply(r.s, 3, &rl);
    assert_int_equal(rl, 1 + 400);
    assert_int_equal(rep[0], 0x80);
    uint8_t br[512];
    bool done;
    memcpy(br, rep, rl);
    br[0] = 0x88; /* other iteration */
    assert_int_equal(ap__masha_worker_on_reply(r.w0, br, rl, &done), AP_EPROTO);
    br[0] = 0x84; /* a refresh bit on a FULL reply */
    assert_int_equal(ap__masha_worker_on_reply(r.w0, br, rl, &done), AP_EPROTO);
    br[0] = 0x80;
    assert_int_equal(ap__masha_worker_on_reply(r.w0, br, rl - 1, &done), AP_ECORRUPT);
    assert_true(ap__masha_worker_on_reply(r.w0, br, 1, &done) < 0);
    assert_true(ap__masha_worker_on_reply(r.w0, br, 0, &done) < 0);
    assert_ok(ap__masha_worker_on_reply(r.w0, rep, rl, &done));
    /* the next request is a DIFF: 1 + 1 + 4k bytes (k = 10), no chunk header */
    assert_ok(ap__masha_worker_on_reply(r.w1, rep, rl, &done));
    r.m1 = ap__masha_worker_msg(r.w1, &r.l1);
    assert_int_equal(r.l1, 1 + 1 + 40);
    assert_int_equal(r.m1[0], 0x80 | (AP__MP_DIFF - 1));
    ap__masha_worker_free(r.w0);
    ap__masha_worker_free(r.w1);
    ap__masha_server_free(r.s);
    ap_masha_problem_free(r.p);
}

/* The protocol server's two-step path (check in any arrival order, then
 * complete) gives bit-identical replies to add() in worker-index order (the
 * in-process solver), while add() in arrival order would not: float sums
 * are not associative, and a flipped last bit changes top-k picks. */
static void test_server_order_independent(void **state)
{
    (void)state;
    enum { M = 10 };
    ap_masha_problem_t *p = make(0.1);
    ap_masha_opts_t o = {.method = AP_MASHA_2,
                         .gamma = 0.2,
                         .fraction = 0.1,
                         .server_fraction = 0.5,
                         .seed = ap_test_seed(5),
                         .target = 1e-6,
                         .max_iters = 150};
    size_t d = ap_masha_dim(p);
    ap__masha_server_t *ref = ap__masha_server_new(d, M, &o), *two = ap__masha_server_new(d, M, &o),
                       *naive = ap__masha_server_new(d, M, &o);
    ap__masha_worker_t *w[M];
    for (int m = 0; m < M; m++) {
        w[m] = ap__masha_worker_new(p, &o, m);
        assert_non_null(w[m]);
        assert_ok(ap__masha_worker_start(w[m]));
    }
    uint64_t rng = ap_test_seed(5) | 1;
    int phases = 0, naive_differs = 0;
    for (;;) {
        size_t len[M];
        const uint8_t *msg[M];
        for (int m = 0; m < M; m++) msg[m] = ap__masha_worker_msg(w[m], &len[m]);
        if (!msg[0]) break;
        int perm[M];
        for (int m = 0; m < M; m++) perm[m] = m;
        for (int m = M - 1; m > 0; m--) { /* xorshift Fisher-Yates */
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            int j = (int)(rng % (uint64_t)(m + 1)), t = perm[m];
            perm[m] = perm[j];
            perm[j] = t;
        }
        int rc = 0, rn = 0, rt = 0;
        for (int m = 0; m < M; m++) {
            rc = ap__masha_server_add(ref, msg[m], len[m]);
            rt = ap__masha_server_check(two, msg[perm[m]], len[perm[m]]);
            rn = ap__masha_server_add(naive, msg[perm[m]], len[perm[m]]);
            assert_true(rc >= 0 && rt >= 0 && rn >= 0);
        }
        assert_int_equal(rc, 1);
        assert_int_equal(rt, 1);
        assert_int_equal(rn, 1);
        assert_int_equal(ap__masha_server_complete(two, msg, len), 1);
        size_t l1, l2, l3;
        const uint8_t *r1 = ap__masha_server_reply(ref, 0, &l1),
                      *r2 = ap__masha_server_reply(two, 0, &l2),
                      *r3 = ap__masha_server_reply(naive, 0, &l3);
        assert_int_equal(l1, l2);
        assert_memory_equal(r1, r2, l1);
        if (l1 != l3 || memcmp(r1, r3, l1)) naive_differs++;
        bool it_done;
        for (int m = 0; m < M; m++) assert_ok(ap__masha_worker_on_reply(w[m], r1, l1, &it_done));
        phases++;
    }
    print_message("%d phases, arrival-order sum differs in %d\n", phases, naive_differs);
    assert_true(phases > 100);
    assert_true(naive_differs > 0); /* the hazard is real */
    for (int m = 0; m < M; m++) ap__masha_worker_free(w[m]);
    ap__masha_server_free(ref);
    ap__masha_server_free(two);
    ap__masha_server_free(naive);
    ap_masha_problem_free(p);
}

/* Mixed wire versions: worker m speaks version 1 + m mod 3, to one server
 * that answers each in its version. The run is the in-process
 * run of either version (same values, same seeds: only the framing
 * differs), and each worker's bytes are the analytic count of its version.
 * With rand-k at the workers and at the server (MASHA1) and top-k with
 * server error feedback (MASHA2), so derived seeds are checked both ways. */
static void run_mixed(const ap_masha_opts_t *o)
{
    enum { M = 10 };
    ap_masha_problem_t *p = make(0.1);
    size_t d = ap_masha_dim(p);
    ap__masha_server_t *s = ap__masha_server_new(d, M, o);
    ap__masha_worker_t *w[M];
    for (int m = 0; m < M; m++) {
        ap_masha_opts_t wo = *o;
        wo.wire = 1 + m % 3;
        w[m] = ap__masha_worker_new(p, &wo, m);
        assert_non_null(w[m]);
        assert_int_equal(ap__masha_worker_wire(w[m]), wo.wire);
        assert_ok(ap__masha_worker_start(w[m]));
    }
    for (;;) {
        size_t len;
        const uint8_t *msg = ap__masha_worker_msg(w[0], &len);
        if (!msg) break;
        int rc = 0;
        for (int m = 0; m < M; m++) {
            msg = ap__masha_worker_msg(w[m], &len);
            assert_non_null(msg);
            assert_int_equal(msg[0] & 0x80 ? 3 : msg[0] >> 4 == 2 ? 2 : 1, 1 + m % 3);
            rc = ap__masha_server_add(s, msg, len);
            assert_true(rc >= 0);
        }
        assert_int_equal(rc, 1);
        bool it_done;
        for (int m = 0; m < M; m++) {
            const uint8_t *rep = ap__masha_server_reply(s, 1 + m % 3, &len);
            assert_ok(ap__masha_worker_on_reply(w[m], rep, len, &it_done));
            /* the other versions' replies are refused */
            for (int v = 1; v <= 3 && ap__masha_worker_msg(w[m], &len); v++) {
                if (v == 1 + m % 3) continue;
                const uint8_t *other = ap__masha_server_reply(s, v, &len);
                assert_int_equal(ap__masha_worker_on_reply(w[m], other, len, &it_done), AP_EPROTO);
            }
        }
    }
    ap_masha_result_t ref, r;
    assert_ok(ap_masha_run(p, o, &ref));
    assert_true(ref.converged);
    ap_masha_opts_t o1 = *o, o2 = *o;
    o1.wire = 1;
    o2.wire = 2;
    ap_masha_result_t ref1, ref2;
    assert_ok(ap_masha_run(p, &o1, &ref1));
    assert_ok(ap_masha_run(p, &o2, &ref2));
    assert_int_equal(ref1.iters, ref.iters);
    assert_int_equal(ref2.iters, ref.iters);
    assert_true(ref1.rel_dist2 == ref.rel_dist2);
    assert_true(ref2.rel_dist2 == ref.rel_dist2);
    const ap_masha_result_t *refs[3] = {&ref1, &ref2, &ref};
    const ap_masha_opts_t *opts[3] = {&o1, &o2, o};
    for (int m = 0; m < M; m++) {
        ap__masha_worker_counts(w[m], &r);
        assert_int_equal(r.iters, ref.iters);
        assert_int_equal(r.refreshes, ref.refreshes);
        assert_int_equal(r.floats_up, ref.floats_up);
        assert_true(r.rel_dist2 == ref.rel_dist2);
        const ap_masha_result_t *same = refs[m % 3];
        assert_int_equal(r.bytes_up, same->bytes_up);
        assert_int_equal(r.bytes_down, same->bytes_down);
        assert_int_equal(r.bytes_up, ap_masha_upload_bytes(p, opts[m % 3], r.iters, r.refreshes));
    }
    print_message("method %d: %llu iterations, bytes up per worker v1 %llu, v2 %llu, v3 %llu\n",
                  (int)o->method, (unsigned long long)ref.iters, (unsigned long long)ref1.bytes_up,
                  (unsigned long long)ref2.bytes_up, (unsigned long long)ref.bytes_up);
    assert_true(ref.bytes_up < ref2.bytes_up);
    assert_true(ref2.bytes_up < ref1.bytes_up);
    assert_true(ref.bytes_down < ref2.bytes_down);
    for (int m = 0; m < M; m++) ap__masha_worker_free(w[m]);
    ap__masha_server_free(s);
    ap_masha_problem_free(p);
}

static void test_mixed_versions(void **state)
{
    (void)state;
    ap_masha_opts_t o = {.method = AP_MASHA_1,
                         .gamma = 0.1,
                         .fraction = 0.1,
                         .server_fraction = 0.5,
                         .seed = 3,
                         .target = 1e-6,
                         .max_iters = 200000};
    run_mixed(&o);
    o = (ap_masha_opts_t){.method = AP_MASHA_2,
                          .gamma = 0.2,
                          .fraction = 0.1,
                          .server_fraction = 0.5,
                          .seed = 3,
                          .target = 1e-6,
                          .max_iters = 200000};
    run_mixed(&o);
    o = (ap_masha_opts_t){.method = AP_MASHA_EXTRAGRADIENT,
                          .gamma = 1.8,
                          .seed = 3,
                          .target = 1e-6,
                          .max_iters = 1000};
    run_mixed(&o);
}

/* A worker whose server lacks its version re-frames its pending request
 * one version down (same values) and the run goes on in that version: a
 * version 3 worker against a server of version 2 (one step) and of version
 * 1 (two steps). */
static void run_downgrade(int server_wire)
{
    enum { M = 10 };
    ap_masha_problem_t *p = make(0.1);
    ap_masha_opts_t o = {.method = AP_MASHA_2,
                         .gamma = 0.2,
                         .fraction = 0.1,
                         .server_fraction = 0.5,
                         .seed = 4,
                         .target = 1e-6,
                         .max_iters = 200000};
    ap_masha_opts_t o1 = o;
    o1.wire = server_wire;
    ap__masha_server_t *s = ap__masha_server_new(ap_masha_dim(p), M, &o1);
    ap__masha_worker_t *w[M];
    for (int m = 0; m < M; m++) {
        w[m] = ap__masha_worker_new(p, &o, m);
        assert_ok(ap__masha_worker_start(w[m]));
        for (int v = 3; v > server_wire; v--) {
            assert_int_equal(ap__masha_worker_wire(w[m]), v);
            assert_ok(ap__masha_worker_downgrade(w[m]));
        }
        assert_int_equal(ap__masha_worker_wire(w[m]), server_wire);
    }
    int phases = 0;
    for (;;) {
        size_t len;
        if (!ap__masha_worker_msg(w[0], &len)) break;
        for (int m = 0; m < M; m++) {
            const uint8_t *msg = ap__masha_worker_msg(w[m], &len);
            assert_int_equal(server_wire == 1 ? msg[0] : msg[0] >> 4, server_wire);
            assert_true(ap__masha_server_add(s, msg, len) >= 0);
        }
        const uint8_t *rep = ap__masha_server_reply(s, 0, &len);
        bool it_done;
        for (int m = 0; m < M; m++) assert_ok(ap__masha_worker_on_reply(w[m], rep, len, &it_done));
        if (phases++ == 0 && server_wire == 1)
            assert_int_equal(ap__masha_worker_downgrade(w[0]), 0); /* no-op */
    }
    ap_masha_result_t ref, r;
    assert_ok(ap_masha_run(p, &o1, &ref));
    ap__masha_worker_counts(w[3], &r);
    assert_int_equal(r.iters, ref.iters);
    assert_int_equal(r.bytes_up, ref.bytes_up);
    assert_true(r.rel_dist2 == ref.rel_dist2);
    for (int m = 0; m < M; m++) ap__masha_worker_free(w[m]);
    ap__masha_server_free(s);
    ap_masha_problem_free(p);
}

static void test_downgrade(void **state)
{
    (void)state;
    run_downgrade(2);
    run_downgrade(1);
    /* once a reply was accepted there is no way back */
    ap_masha_problem_t *p = make(0.1);
    ap_masha_opts_t o = {.method = AP_MASHA_1, .gamma = 0.2, .fraction = 0.1, .seed = 4};
    ap__masha_worker_t *w2 = ap__masha_worker_new(p, &o, 0);
    ap__masha_server_t *s2 = ap__masha_server_new(ap_masha_dim(p), 1, &o);
    assert_ok(ap__masha_worker_start(w2));
    size_t len;
    const uint8_t *msg = ap__masha_worker_msg(w2, &len);
    assert_int_equal(ap__masha_server_add(s2, msg, len), 1);
    const uint8_t *rep = ap__masha_server_reply(s2, 3, &len);
    bool it_done;
    assert_ok(ap__masha_worker_on_reply(w2, rep, len, &it_done));
    assert_int_equal(ap__masha_worker_downgrade(w2), AP_ESTATE);
    ap__masha_worker_free(w2);
    ap__masha_server_free(s2);
    ap_masha_problem_free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_solution),           cmocka_unit_test(test_convergence_and_target),
        cmocka_unit_test(test_server_compression), cmocka_unit_test(test_server_rejects),
        cmocka_unit_test(test_server_rejects_v3),  cmocka_unit_test(test_server_order_independent),
        cmocka_unit_test(test_mixed_versions),     cmocka_unit_test(test_downgrade),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
