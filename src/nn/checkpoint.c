/* Checkpoints: model parameters + optimizer state + step, with a versioned
 * header and a BLAKE2b-256 checksum. The decoder treats its input as
 * untrusted: every field is checked against the target model before any
 * payload byte is used, and the model is written only after the checksum
 * has been verified. Format: apiary/nn.h and docs/nn.md. */
#include "apiary/nn.h"

#include "apiary/error.h"
#include "apiary/log.h"
#include "nn/nn_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint payloads are little-endian float32; add byte swapping for this host"
#endif

#define MAGIC "APNNCKPT"
#define HDR   AP_NN_CKPT_HEADER
#define SUM   32

typedef struct hdr {
    uint32_t version, hsize, kind, words[16];
    uint64_t nparams;
    uint32_t okind, oflags;
    uint64_t ostate, ostep;
    float ocfg[5];
    uint64_t step;
} hdr_t;

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void hdr_write(uint8_t *b, const hdr_t *h)
{
    memset(b, 0, HDR);
    memcpy(b, MAGIC, 8);
    put32(b + 8, h->version);
    put32(b + 12, h->hsize);
    put32(b + 16, h->kind);
    for (int i = 0; i < 16; i++) put32(b + 20 + 4 * i, h->words[i]);
    put64(b + 84, h->nparams);
    put32(b + 92, h->okind);
    put32(b + 96, h->oflags);
    put64(b + 100, h->ostate);
    put64(b + 108, h->ostep);
    for (int i = 0; i < 5; i++) {
        uint32_t u;
        memcpy(&u, &h->ocfg[i], 4);
        put32(b + 116 + 4 * i, u);
    }
    put64(b + 136, h->step);
}

/* Parses and checks the fixed part; AP_ECORRUPT / AP_EVERSION. */
static int hdr_read(const uint8_t *b, size_t len, hdr_t *h)
{
    if (len < HDR || memcmp(b, MAGIC, 8) != 0) {
        ap_warn(NN_LOG, "checkpoint: not an apiary checkpoint (bad magic or %zu bytes)", len);
        return AP_ECORRUPT;
    }
    h->version = get32(b + 8);
    h->hsize = get32(b + 12);
    if (h->version != AP_NN_CKPT_VERSION) {
        ap_warn(NN_LOG, "checkpoint: version %u, this build reads version %d", h->version,
                AP_NN_CKPT_VERSION);
        return AP_EVERSION;
    }
    if (h->hsize != HDR) {
        ap_warn(NN_LOG, "checkpoint: header size %u, expected %d", h->hsize, HDR);
        return AP_ECORRUPT;
    }
    for (int i = 144; i < HDR; i++)
        if (b[i]) {
            ap_warn(NN_LOG, "checkpoint: reserved header bytes are not zero");
            return AP_ECORRUPT;
        }
    h->kind = get32(b + 16);
    for (int i = 0; i < 16; i++) h->words[i] = get32(b + 20 + 4 * i);
    h->nparams = get64(b + 84);
    h->okind = get32(b + 92);
    h->oflags = get32(b + 96);
    h->ostate = get64(b + 100);
    h->ostep = get64(b + 108);
    for (int i = 0; i < 5; i++) {
        uint32_t u = get32(b + 116 + 4 * i);
        memcpy(&h->ocfg[i], &u, 4);
    }
    h->step = get64(b + 136);
    return 0;
}

static const char *kind_name(uint32_t k)
{
    return k == AP_NN_GPT ? "gpt" : k == AP_NN_MLP ? "mlp" : "unknown";
}

/* Checks the header against the target model/optimizer; sets *total to the
 * exact file size it implies. */
static int hdr_check(const hdr_t *h, ap_nn_model_t *m, const ap_nn_solver_t *o, size_t *total)
{
    if (h->kind != (uint32_t)m->kind) {
        ap_warn(NN_LOG, "checkpoint: holds a %s model, this model is a %s", kind_name(h->kind),
                kind_name((uint32_t)m->kind));
        return AP_EINVAL;
    }
    uint32_t w[16];
    ap__nn_config_words(m, w);
    for (int i = 0; i < 16; i++)
        if (w[i] != h->words[i]) {
            ap_warn(NN_LOG,
                    "checkpoint: model shape differs (config word %d: file %u, model %u); "
                    "it was saved from another model configuration",
                    i, h->words[i], w[i]);
            return AP_EINVAL;
        }
    if (h->nparams != m->params.count) {
        ap_warn(NN_LOG, "checkpoint: %llu parameters, model has %zu",
                (unsigned long long)h->nparams, m->params.count);
        return AP_EINVAL;
    }
    if (h->okind > AP_NN_LAMB ||
        (h->okind == 0 ? h->ostate != 0
                       : h->ostate != (h->okind == AP_NN_SGD ? 1u : 2u) * h->nparams)) {
        ap_warn(NN_LOG, "checkpoint: optimizer kind %u with %llu state floats is inconsistent",
                h->okind, (unsigned long long)h->ostate);
        return AP_ECORRUPT;
    }
    if (o) {
        if (h->okind == 0) {
            ap_warn(NN_LOG, "checkpoint: holds no optimizer state, but one was asked for");
            return AP_EINVAL;
        }
        if (h->okind != (uint32_t)o->cfg.kind || h->ostate != o->state_count) {
            ap_warn(NN_LOG, "checkpoint: optimizer kind %u (%llu floats), expected kind %d (%zu)",
                    h->okind, (unsigned long long)h->ostate, (int)o->cfg.kind, o->state_count);
            return AP_EINVAL;
        }
    }
    *total = HDR + 4 * (size_t)(h->nparams + h->ostate) + SUM;
    return 0;
}

static bool all_finite(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        if (!isfinite(f)) return false;
    }
    return true;
}

int ap_nn_checkpoint_encode(ap_nn_model_t *m, const ap_nn_solver_t *o, uint64_t step, uint8_t **buf,
                            size_t *len)
{
    return ap_nn_checkpoint_encode_flat(m, m->params.data, o, step, buf, len);
}

int ap_nn_checkpoint_encode_flat(ap_nn_model_t *m, const float *params, const ap_nn_solver_t *o,
                                 uint64_t step, uint8_t **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    if (o && o->n != m->params.count) return AP_EINVAL;
    if (sodium_init() < 0) return AP_ESYS;
    hdr_t h = {.version = AP_NN_CKPT_VERSION, .hsize = HDR, .kind = (uint32_t)m->kind};
    ap__nn_config_words(m, h.words);
    h.nparams = m->params.count;
    h.step = step;
    if (o) {
        h.okind = (uint32_t)o->cfg.kind;
        h.oflags = o->cfg.nesterov ? 1u : 0u;
        h.ostate = o->state_count;
        h.ostep = o->step;
        float c[5] = {o->cfg.momentum, o->cfg.beta1, o->cfg.beta2, o->cfg.eps, o->cfg.weight_decay};
        memcpy(h.ocfg, c, sizeof c);
    }
    size_t total = HDR + 4 * (size_t)(h.nparams + h.ostate) + SUM;
    uint8_t *b = malloc(total);
    if (!b) return AP_ENOMEM;
    hdr_write(b, &h);
    memcpy(b + HDR, params, 4 * h.nparams);
    if (o) memcpy(b + HDR + 4 * h.nparams, o->state, 4 * h.ostate);
    crypto_generichash(b + total - SUM, SUM, b, total - SUM, NULL, 0);
    *buf = b;
    *len = total;
    return 0;
}

int ap_nn_checkpoint_decode(const uint8_t *buf, size_t len, ap_nn_model_t *m, ap_nn_solver_t *o,
                            uint64_t *step)
{
    if (!buf || !m) return AP_EINVAL;
    if (sodium_init() < 0) return AP_ESYS;
    hdr_t h;
    size_t total;
    int rc = hdr_read(buf, len, &h);
    if (rc || (rc = hdr_check(&h, m, o, &total))) return rc;
    if (len != total) {
        ap_warn(NN_LOG, "checkpoint: %zu bytes, its header implies %zu (truncated or padded)", len,
                total);
        return AP_ECORRUPT;
    }
    uint8_t sum[SUM];
    crypto_generichash(sum, SUM, buf, len - SUM, NULL, 0);
    if (sodium_memcmp(sum, buf + len - SUM, SUM) != 0) {
        ap_warn(NN_LOG, "checkpoint: checksum mismatch (file corrupted)");
        return AP_ECORRUPT;
    }
    const uint8_t *pp = buf + HDR, *sp = pp + 4 * h.nparams;
    if (!all_finite(pp, h.nparams) || (o && !all_finite(sp, h.ostate))) {
        ap_warn(NN_LOG, "checkpoint: contains NaN or infinite values");
        return AP_ENONFINITE;
    }
    memcpy(m->params.data, pp, 4 * h.nparams);
    if (o) {
        memcpy(o->state, sp, 4 * h.ostate);
        o->step = h.ostep;
    }
    if (step) *step = h.step;
    return 0;
}

int ap_nn_checkpoint_save(const char *path, ap_nn_model_t *m, const ap_nn_solver_t *o,
                          uint64_t step)
{
    uint8_t *b;
    size_t len;
    int rc = ap_nn_checkpoint_encode(m, o, step, &b, &len);
    if (rc) return rc;
    rc = ap_nn_checkpoint_write(path, b, len);
    free(b);
    return rc;
}

int ap_nn_checkpoint_write(const char *path, const uint8_t *b, size_t len)
{
    int rc;
    size_t pl = strlen(path);
    char *tmp = malloc(pl + 16);
    if (!tmp) return AP_ENOMEM;
    snprintf(tmp, pl + 16, "%s.tmp%d", path, (int)getpid());
    rc = AP_EIO;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
        size_t off = 0;
        while (off < len) {
            ssize_t w = write(fd, b + off, len - off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            off += (size_t)w;
        }
        bool ok = off == len && fsync(fd) == 0;
        ok = close(fd) == 0 && ok;
        if (ok && rename(tmp, path) == 0) rc = 0;
        if (rc) unlink(tmp);
    }
    if (rc) ap_warn(NN_LOG, "checkpoint: cannot write %s: %s", path, strerror(errno));
    free(tmp);
    return rc;
}

int ap_nn_checkpoint_load(const char *path, ap_nn_model_t *m, ap_nn_solver_t *o, uint64_t *step)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        ap_warn(NN_LOG, "checkpoint: cannot open %s: %s", path, strerror(e));
        return e == ENOENT ? AP_ENOTFOUND : AP_EIO;
    }
    struct stat st;
    uint8_t hb[HDR];
    hdr_t h;
    size_t total = 0;
    int rc = 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ap_warn(NN_LOG, "checkpoint: %s is not a regular file", path);
        rc = AP_EIO;
    } else if (pread(fd, hb, HDR, 0) != HDR) {
        ap_warn(NN_LOG, "checkpoint: %s is too short (%lld bytes)", path, (long long)st.st_size);
        rc = AP_ECORRUPT;
    } else if (!(rc = hdr_read(hb, HDR, &h)) && !(rc = hdr_check(&h, m, o, &total)) &&
               (size_t)st.st_size != total) {
        ap_warn(NN_LOG, "checkpoint: %s is %lld bytes, its header implies %zu (truncated?)", path,
                (long long)st.st_size, total);
        rc = AP_ECORRUPT;
    }
    uint8_t *b = NULL;
    if (!rc) {
        /* the size is now bounded by the model's own size */
        b = malloc(total);
        size_t off = 0;
        while (b && off < total) {
            ssize_t r = pread(fd, b + off, total - off, (off_t)off);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            off += (size_t)r;
        }
        if (!b)
            rc = AP_ENOMEM;
        else if (off != total)
            rc = AP_EIO;
        else
            rc = ap_nn_checkpoint_decode(b, total, m, o, step);
    }
    if (rc) ap_warn(NN_LOG, "checkpoint: %s not loaded: %s", path, ap_strerror(rc));
    free(b);
    close(fd);
    return rc;
}
