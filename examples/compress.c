/* Compressing a gradient for the wire: an 8-bit blockwise chunk, decoded
 * back within its error bound, and top-k with error feedback, whose residual
 * keeps what was not sent for the next round. */
#include <apiary/compress.h>
#include <apiary/error.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define N 100000

int main(void)
{
    float *grad = malloc(N * sizeof *grad), *out = malloc(N * sizeof *out);
    if (!grad || !out) return 1;
    for (size_t i = 0; i < N; i++) grad[i] = sinf((float)i * 0.01f);

    ap_codec_cfg_t cfg = {.id = AP_CODEC_BLOCKWISE8};
    size_t cap = ap_compress_size(&cfg, N), len; /* exact encoded size */
    uint8_t *buf = malloc(cap);
    int rc = buf ? ap_compress_encode(&cfg, grad, N, 0, buf, cap, &len) : AP_ENOMEM;
    if (rc == 0) rc = ap_compress_decode(buf, len, out, N, NULL); /* untrusted input: checked */
    double err = 0;
    for (size_t i = 0; rc == 0 && i < N; i++) err = fmax(err, fabs(out[i] - grad[i]));
    printf("blockwise8: %zu bytes for %zu floats (%.2f bits each), max error %.4f\n", len,
           (size_t)N, 8.0 * (double)len / N, err);

    ap_compress_ef_t *ef = ap_compress_ef_new(N); /* error feedback for top-k */
    ap_codec_cfg_t topk = {.id = AP_CODEC_TOPK, .fraction = 0.01};
    size_t cap2 = ap_compress_size(&topk, N), len2 = 0;
    uint8_t *buf2 = malloc(cap2);
    if (rc == 0)
        rc = ef && buf2 ? ap_compress_ef_encode(ef, &topk, grad, N, 0, buf2, cap2, &len2)
                        : AP_ENOMEM;
    if (rc == 0) printf("top-k 1%%: %zu bytes; the residual keeps the rest\n", len2);

    ap_compress_ef_free(ef);
    free(buf2);
    free(buf);
    free(out);
    free(grad);
    /* blockwise8's documented bound: 0.00785 of the block's absmax (here 1) */
    return rc == 0 && err <= 0.00785 + 1e-6 && len2 > 0 && len2 < cap ? 0 : 1;
}
