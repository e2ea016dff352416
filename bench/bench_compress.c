/* `apiary bench compress`: per codec on 16M N(0,1) floats (1M with --quick):
 * single-core encode and decode bandwidth (input float bytes per second of
 * the calling thread's CPU time) and their ratio to memcpy measured the same
 * way in the same run, compression ratio,
 * relative RMS error; plus multi-threaded (all chunks on the worker pool)
 * encode/decode and the scalar reference's encode speed. */
#include "bench.h"

#include "apiary/compress.h"
#include "base/arena.h"
#include "base/pool.h"
#include "compress/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t bs = 12345;
static double bunif(void)
{
    uint64_t z = (bs += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) / 9007199254740992.0;
}

typedef struct bctx {
    const ap_codec_cfg_t *cfg;
    const float *x;
    float *y;
    size_t n, chunk, slot, nc;
    uint8_t *out;
    size_t *lens;
    const uint8_t **msgs;
} bctx_t;

static int enc_serial(bctx_t *b)
{
    for (size_t i = 0; i < b->nc; i++) {
        size_t o = i * b->chunk, cnt = b->n - o < b->chunk ? b->n - o : b->chunk;
        int rc = ap_compress_encode(b->cfg, b->x + o, cnt, o, b->out + i * b->slot, b->slot,
                                    &b->lens[i]);
        if (rc) return rc;
    }
    return 0;
}

static int dec_serial(bctx_t *b)
{
    for (size_t i = 0; i < b->nc; i++) {
        int rc = ap_compress_decode(b->msgs[i], b->lens[i], b->y, b->n, NULL);
        if (rc) return rc;
    }
    return 0;
}

/* CPU time of the calling thread: single-threaded timings are then robust to
 * other processes sharing the cores (DESIGN.md section 7); multi-threaded
 * runs use wall time (TIME_BEST_WALL). */
static double thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* best of reps, seconds */
#define TIME_BEST_CLK(clk, reps, expr, out)                                                        \
    do {                                                                                           \
        double best_ = 1e30;                                                                       \
        for (int r_ = 0; r_ < (reps); r_++) {                                                      \
            double t0_ = clk();                                                                    \
            int rc_ = (expr);                                                                      \
            double t_ = clk() - t0_;                                                               \
            if (rc_) return rc_;                                                                   \
            if (t_ < best_) best_ = t_;                                                            \
        }                                                                                          \
        (out) = best_;                                                                             \
    } while (0)
#define TIME_BEST(reps, expr, out)      TIME_BEST_CLK(thread_cpu, reps, expr, out)
#define TIME_BEST_WALL(reps, expr, out) TIME_BEST_CLK(ap_bench_now, reps, expr, out)

static int do_memcpy(void *d, const void *s, size_t n)
{
    memcpy(d, s, n);
    return 0;
}

static int run(ap_bench_ctx_t *ctx, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    size_t n = ctx->quick ? (1u << 20) : (16u << 20), chunk = AP_COMPRESS_CHUNK_DEFAULT;
    int reps = ctx->quick ? 2 : 5;
    size_t bytes = n * sizeof(float);
    float *x = ap__big_alloc(bytes), *y = ap__big_alloc(bytes);
    size_t outcap = 2 * bytes + 64 * 1024 * ((n + chunk - 1) / chunk);
    uint8_t *out = ap__big_alloc(outcap);
    size_t nc = ap_compress_nchunks(n, chunk);
    size_t *lens = calloc(nc, sizeof *lens);
    const uint8_t **msgs = calloc(nc, sizeof *msgs);
    if (!x || !y || !out || !lens || !msgs) return 1;
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(sqrt(-2 * log(bunif())) * cos(6.283185307179586 * bunif()));

    double t;
    TIME_BEST(reps, do_memcpy(y, x, bytes), t);
    double memcpy_mbps = bytes / t / 1e6;
    ap_bench_report(ctx, "memcpy_MBps", memcpy_mbps, "MB/s", NULL);
    const ap__kernels_t *K = ap__kernels();
    if (!ctx->json)
        printf("kernels: %s, %d pool threads\n", K->name, ap__pool_size(ap__pool_global()));

    for (int id = 0; id < AP_CODEC__COUNT; id++) {
        ap_codec_cfg_t cfg = {.id = (ap_codec_id_t)id, .fraction = 0.01, .seed = 7};
        bctx_t b = {.cfg = &cfg,
                    .x = x,
                    .y = y,
                    .n = n,
                    .chunk = chunk,
                    .nc = nc,
                    .out = out,
                    .lens = lens,
                    .msgs = msgs,
                    .slot = ap_compress_size(&cfg, chunk)};
        if (b.slot * nc > outcap) return 1;
        char fields[96];
        snprintf(fields, sizeof fields, "\"codec\":\"%s\"", ap_codec_name(cfg.id));
        double te, td;
        TIME_BEST(reps, enc_serial(&b), te);
        size_t total = 0;
        for (size_t i = 0; i < nc; i++) {
            msgs[i] = out + i * b.slot;
            total += lens[i];
        }
        TIME_BEST(reps, dec_serial(&b), td);
        double se = 0, sx = 0;
        for (size_t i = 0; i < n; i++) {
            double d = (double)y[i] - x[i];
            se += d * d;
            sx += (double)x[i] * x[i];
        }
        ap_bench_report_vs(ctx, "encode_MBps", bytes / te / 1e6, "MB/s", memcpy_mbps, fields);
        ap_bench_report_vs(ctx, "decode_MBps", bytes / td / 1e6, "MB/s", memcpy_mbps, fields);
        ap_bench_report(ctx, "ratio", (double)bytes / (double)total, "x", fields);
        ap_bench_report(ctx, "rel_rms_error", sqrt(se / sx), "", fields);
        /* all cores over chunks */
        double tm, tdm;
        TIME_BEST_WALL(reps, ap_compress_encode_tensor(&cfg, x, n, chunk, out, outcap, lens), tm);
        TIME_BEST_WALL(reps, ap_compress_decode_tensor(msgs, lens, nc, y, n), tdm);
        ap_bench_report_vs(ctx, "encode_mt_MBps", bytes / tm / 1e6, "MB/s", memcpy_mbps, fields);
        ap_bench_report_vs(ctx, "decode_mt_MBps", bytes / tdm / 1e6, "MB/s", memcpy_mbps, fields);
        if (K != &ap__kernels_scalar && id >= AP_CODEC_FP16 && id <= AP_CODEC_BLOCKWISE8) {
            double ts;
            ap__compress_force_scalar(true);
            TIME_BEST(ctx->quick ? 1 : 2, enc_serial(&b), ts);
            ap__compress_force_scalar(false);
            ap_bench_report_vs(ctx, "encode_scalar_MBps", bytes / ts / 1e6, "MB/s", memcpy_mbps,
                               fields);
        }
    }
    ap__big_free(x, bytes);
    ap__big_free(y, bytes);
    ap__big_free(out, outcap);
    free(lens);
    free(msgs);
    return 0;
}

AP_BENCH(bench_compress, "compress", run,
         "codec encode/decode MB/s vs memcpy, ratio, relative RMS error")
