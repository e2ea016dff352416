/* Data: a byte-level text data set with deterministic shuffling, and a
 * synthetic classification task. */
#include "nn/nn_impl.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct ap_nn_text {
    uint8_t *bytes;
    size_t len;
};

int ap_nn_text_from_memory(const uint8_t *bytes, size_t len, ap_nn_text_t **out)
{
    *out = NULL;
    if (len < 2) {
        ap_warn(NN_LOG, "text: %zu bytes is too short for a data set", len);
        return AP_EINVAL;
    }
    if (len > AP_NN_TEXT_MAX_BYTES) return AP_ELIMIT;
    ap_nn_text_t *d = malloc(sizeof *d);
    uint8_t *b = malloc(len);
    if (!d || !b) {
        free(d);
        free(b);
        return AP_ENOMEM;
    }
    memcpy(b, bytes, len);
    d->bytes = b;
    d->len = len;
    *out = d;
    return 0;
}

int ap_nn_text_open(const char *path, ap_nn_text_t **out)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        ap_warn(NN_LOG, "text: cannot open %s: %s", path, strerror(e));
        return e == ENOENT ? AP_ENOTFOUND : AP_EIO;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        ap_warn(NN_LOG, "text: %s is not a regular file", path);
        fclose(f);
        return AP_EIO;
    }
    size_t len = (size_t)st.st_size;
    if (len > AP_NN_TEXT_MAX_BYTES) {
        ap_warn(NN_LOG, "text: %s is %zu bytes, over the %zu limit", path, len,
                AP_NN_TEXT_MAX_BYTES);
        fclose(f);
        return AP_ELIMIT;
    }
    if (len < 2) {
        ap_warn(NN_LOG, "text: %s is empty (%zu bytes); a data set needs text", path, len);
        fclose(f);
        return AP_EINVAL;
    }
    ap_nn_text_t *d = malloc(sizeof *d);
    uint8_t *b = malloc(len);
    if (!d || !b) {
        free(d);
        free(b);
        fclose(f);
        return AP_ENOMEM;
    }
    size_t got = fread(b, 1, len, f);
    int err = ferror(f);
    fclose(f);
    if (got != len || err) {
        ap_warn(NN_LOG, "text: short read on %s (%zu of %zu bytes)", path, got, len);
        free(d);
        free(b);
        return AP_EIO;
    }
    d->bytes = b;
    d->len = len;
    *out = d;
    return 0;
}

void ap_nn_text_free(ap_nn_text_t *d)
{
    if (!d) return;
    free(d->bytes);
    free(d);
}

size_t ap_nn_text_size(const ap_nn_text_t *d)
{
    return d->len;
}
const uint8_t *ap_nn_text_bytes(const ap_nn_text_t *d)
{
    return d->bytes;
}

size_t ap_nn_text_windows(const ap_nn_text_t *d, int T)
{
    if (T < 1) return 0;
    return (d->len - 1) / (size_t)T >= 1 ? (d->len - 1) / (size_t)T : 0;
}

/* Window index at position k of the permutation of epoch e: a bijection on
 * [0,n) built from a 4-round Feistel network on the next power of two with
 * cycle walking, so no permutation table is stored. */
static uint64_t permute(uint64_t k, uint64_t n, uint64_t key)
{
    int bits = 2;
    while ((1ull << bits) < n) bits++;
    if (bits & 1) bits++;
    int half = bits / 2;
    uint64_t mask = (1ull << half) - 1;
    do {
        uint64_t l = k >> half, r = k & mask;
        for (int round = 0; round < 4; round++) {
            uint64_t f = ap__nn_mix64(r ^ key ^ ((uint64_t)round << 56)) & mask;
            uint64_t nl = r;
            r = l ^ f;
            l = nl;
        }
        k = (l << half) | r;
    } while (k >= n);
    return k;
}

int ap_nn_text_batch(const ap_nn_text_t *d, uint64_t seed, uint64_t *cursor, int B, int T,
                     int32_t *inputs, int32_t *targets)
{
    if (!d || !cursor || B < 1 || T < 1 || !inputs || !targets) return AP_EINVAL;
    size_t nw = ap_nn_text_windows(d, T);
    if (nw == 0) {
        ap_warn(NN_LOG, "text: %zu bytes hold no window of %d+1 bytes", d->len, T);
        return AP_EINVAL;
    }
    for (int b = 0; b < B; b++) {
        uint64_t c = (*cursor)++;
        uint64_t epoch = c / nw, k = c % nw;
        uint64_t key = ap__nn_mix64(seed ^ ap__nn_mix64(epoch + 1));
        uint64_t w = permute(k, nw, key);
        const uint8_t *src = d->bytes + w * (uint64_t)T;
        for (int t = 0; t < T; t++) {
            inputs[(size_t)b * T + t] = src[t];
            targets[(size_t)b * T + t] = src[t + 1];
        }
    }
    return 0;
}

void ap_nn_synth_classify(uint64_t task_seed, uint64_t sample_seed, uint64_t first, int n, int dim,
                          int classes, float *x, int32_t *y)
{
    for (int i = 0; i < n; i++) {
        ap__nn_rng_t r = {ap__nn_mix64(task_seed * 31 + 7) ^ ap__nn_mix64(sample_seed) ^
                          ap__nn_mix64(first + (uint64_t)i + 0x51ed)};
        int cls = (int)(ap__nn_rng_u64(&r) % (uint64_t)classes);
        /* centre of class cls: N(0, 2^2) per coordinate, from task_seed only */
        ap__nn_rng_t cr = {ap__nn_mix64(task_seed) ^ ap__nn_mix64((uint64_t)cls + 1)};
        for (int j = 0; j < dim; j++) {
            float centre = 2.0f * ap__nn_rng_normal(&cr);
            x[(size_t)i * dim + j] = centre + ap__nn_rng_normal(&r);
        }
        y[i] = cls;
    }
}

const char *ap_nn_default_corpus(void)
{
    static _Thread_local char buf[4096];
    const char *dir = getenv("APIARY_DATA");
    if (dir && *dir) {
        snprintf(buf, sizeof buf, "%s/corpus.txt", dir);
        return buf;
    }
    /* The source tree's data/ directory, from this file's compile-time path
     * (CMake compiles with absolute paths); "data/corpus.txt" otherwise. */
    const char *self = __FILE__, *tail = "src/nn/data.c";
    size_t n = strlen(self), k = strlen(tail);
    if (n >= k && self[0] == '/' && strcmp(self + n - k, tail) == 0 && n - k < sizeof buf - 32)
        snprintf(buf, sizeof buf, "%.*sdata/corpus.txt", (int)(n - k), self);
    else
        snprintf(buf, sizeof buf, "data/corpus.txt");
    return buf;
}
