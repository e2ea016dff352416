/* MASHA1 / MASHA2 / extragradient: problem, worker and server state
 * machines, in-process solver. See include/apiary/masha.h and
 * docs/compression.md. */
#include "apiary/masha.h"
#include "apiary/log.h"
#include "base/varint.h"
#include "compress/masha_core.h"
#include "compress/wire.h"
#include "runtime/rt_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- problem ------------------------------------------------------------------- */

struct ap_masha_problem {
    int n, M;
    size_t d;
    double lambda;
    double *A;     /* M blocks of n*n, row-major */
    double *b, *c; /* M blocks of n */
    double *zstar; /* d */
    double zstar2; /* |z0 - z*|^2 with z0 = 0 */
};

static double gauss(uint64_t s[4])
{
    double u1 = ((double)(ap__rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = ((double)(ap__rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

/* Solves K x = r in place (K is n x n row-major, destroyed); partial
 * pivoting. Returns false if singular. */
static bool gauss_solve(double *K, double *r, int n)
{
    for (int col = 0; col < n; col++) {
        int piv = col;
        for (int i = col + 1; i < n; i++)
            if (fabs(K[(size_t)i * n + col]) > fabs(K[(size_t)piv * n + col])) piv = i;
        if (fabs(K[(size_t)piv * n + col]) < 1e-300) return false;
        if (piv != col) {
            for (int j = 0; j < n; j++) {
                double t = K[(size_t)col * n + j];
                K[(size_t)col * n + j] = K[(size_t)piv * n + j];
                K[(size_t)piv * n + j] = t;
            }
            double t = r[col];
            r[col] = r[piv];
            r[piv] = t;
        }
        for (int i = col + 1; i < n; i++) {
            double f = K[(size_t)i * n + col] / K[(size_t)col * n + col];
            if (f == 0) continue;
            for (int j = col; j < n; j++) K[(size_t)i * n + j] -= f * K[(size_t)col * n + j];
            r[i] -= f * r[col];
        }
    }
    for (int i = n - 1; i >= 0; i--) {
        double s = r[i];
        for (int j = i + 1; j < n; j++) s -= K[(size_t)i * n + j] * r[j];
        r[i] = s / K[(size_t)i * n + i];
    }
    return true;
}

ap_masha_problem_t *ap_masha_bilinear_new(const ap_masha_bilinear_cfg_t *cfg)
{
    if (!cfg || cfg->n < 1 || cfg->n > 4096 || cfg->workers < 1 || cfg->workers > 4096) return NULL;
    ap_masha_problem_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    int n = cfg->n, M = cfg->workers;
    size_t nn = (size_t)n * n, d = 2 * (size_t)n;
    p->n = n;
    p->M = M;
    p->d = d;
    p->lambda = cfg->lambda;
    p->A = calloc(nn * M, sizeof(double));
    p->b = calloc((size_t)n * M, sizeof(double));
    p->c = calloc((size_t)n * M, sizeof(double));
    p->zstar = calloc(d, sizeof(double));
    double *Abar = calloc(nn, sizeof(double)), *K = calloc(d * d, sizeof(double));
    if (!p->A || !p->b || !p->c || !p->zstar || !Abar || !K) goto fail;
    uint64_t s[4];
    ap__rng_seed(s, cfg->seed);
    double sd = 1 / sqrt((double)n);
    for (int m = 0; m < M; m++) {
        double *A = p->A + nn * m;
        for (size_t i = 0; i < nn; i++) {
            A[i] = sd * gauss(s);
            Abar[i] += A[i] / M;
        }
        for (int i = 0; i < n; i++) p->b[(size_t)m * n + i] = gauss(s);
        for (int i = 0; i < n; i++) p->c[(size_t)m * n + i] = gauss(s);
    }
    for (int m = 0; m < M; m++) {
        double *A = p->A + nn * m;
        for (size_t i = 0; i < nn; i++) A[i] = Abar[i] + cfg->h * (A[i] - Abar[i]);
    }
    /* F(z) = K z + r with K = [[lambda I, Abar], [-Abar', lambda I]] (the
     * mean of the A_m is Abar for any h), r = [bbar; -cbar]. */
    for (int i = 0; i < n; i++) {
        K[(size_t)i * d + i] = cfg->lambda;
        K[(size_t)(n + i) * d + n + i] = cfg->lambda;
        for (int j = 0; j < n; j++) {
            K[(size_t)i * d + n + j] = Abar[(size_t)i * n + j];
            K[(size_t)(n + i) * d + j] = -Abar[(size_t)j * n + i];
        }
        double bb = 0, cc = 0;
        for (int m = 0; m < M; m++) {
            bb += p->b[(size_t)m * n + i] / M;
            cc += p->c[(size_t)m * n + i] / M;
        }
        p->zstar[i] = -bb;
        p->zstar[n + i] = cc;
    }
    if (!gauss_solve(K, p->zstar, (int)d)) goto fail;
    for (size_t i = 0; i < d; i++) p->zstar2 += p->zstar[i] * p->zstar[i];
    free(Abar);
    free(K);
    return p;
fail:
    free(Abar);
    free(K);
    ap_masha_problem_free(p);
    return NULL;
}

void ap_masha_problem_free(ap_masha_problem_t *p)
{
    if (!p) return;
    free(p->A);
    free(p->b);
    free(p->c);
    free(p->zstar);
    free(p);
}

size_t ap_masha_dim(const ap_masha_problem_t *p)
{
    return p->d;
}
int ap_masha_workers(const ap_masha_problem_t *p)
{
    return p->M;
}
const double *ap_masha_solution(const ap_masha_problem_t *p)
{
    return p->zstar;
}

void ap_masha_operator(const ap_masha_problem_t *p, int m, const double *z, double *out)
{
    int n = p->n;
    const double *A = p->A + (size_t)n * n * m, *b = p->b + (size_t)n * m,
                 *c = p->c + (size_t)n * m;
    const double *x = z, *y = z + n;
    double *ox = out, *oy = out + n;
    for (int i = 0; i < n; i++) {
        double s = 0;
        const double *row = A + (size_t)i * n;
        for (int j = 0; j < n; j++) s += row[j] * y[j];
        ox[i] = s + b[i] + p->lambda * x[i];
        oy[i] = -c[i] + p->lambda * y[i];
    }
    for (int i = 0; i < n; i++) { /* oy -= A' x */
        const double *row = A + (size_t)i * n;
        double xi = x[i];
        for (int j = 0; j < n; j++) oy[j] -= row[j] * xi;
    }
}

double ap_masha_rel_dist2(const ap_masha_problem_t *p, const double *z)
{
    double s = 0;
    for (size_t i = 0; i < p->d; i++) s += (z[i] - p->zstar[i]) * (z[i] - p->zstar[i]);
    return p->zstar2 > 0 ? s / p->zstar2 : s;
}

/* ---- shared helpers ------------------------------------------------------------- */

static uint64_t mix3(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t s[4];
    ap__rng_seed(s, a ^ (b * 0x9e3779b97f4a7c15ull) ^ (c * 0xc2b2ae3d27d4eb4full));
    return ap__rng_next(s);
}

static uint32_t k_of(const ap_masha_opts_t *o, size_t d, double fraction)
{
    double f = fraction > 0 && fraction <= 1 ? fraction : 0.01;
    long k = lround(f * (double)d);
    if (k < 1) k = 1;
    if ((size_t)k > d) k = (long)d;
    (void)o;
    return (uint32_t)k;
}

static double tau_of(const ap_masha_opts_t *o, size_t d)
{
    if (o->tau > 0 && o->tau < 1) return o->tau;
    return 1.0 - (double)k_of(o, d, o->fraction) / (double)d;
}

static ap_codec_cfg_t worker_codec(const ap_masha_opts_t *o, size_t d)
{
    ap_codec_cfg_t c = {.id = AP_CODEC_NONE};
    if (o->method == AP_MASHA_1)
        c = (ap_codec_cfg_t){.id = AP_CODEC_RANDK, .k = k_of(o, d, o->fraction)};
    if (o->method == AP_MASHA_2)
        c = (ap_codec_cfg_t){.id = AP_CODEC_TOPK, .k = k_of(o, d, o->fraction)};
    return c;
}

static int wire_of(const ap_masha_opts_t *o)
{
    return o->wire >= 1 && o->wire <= AP__MASHA_V3 ? o->wire : AP__MASHA_V3;
}

/* Chunk flags of a wire version: version 2 sends compact chunks without the
 * rand-k seed (every receiver derives it), version 3 bare chunks (the phase
 * and the run's options imply every header field). */
static unsigned chunk_flags(int wire)
{
    if (wire == 1) return 0;
    return (wire == 2 ? AP_COMPRESS_COMPACT : AP_COMPRESS_BARE) | AP_COMPRESS_NO_SEED;
}

/* The codec of the server's reply to a phase of iteration iter. */
static ap_codec_cfg_t server_codec(const ap_masha_opts_t *o, size_t d, int phase, uint64_t iter)
{
    ap_codec_cfg_t c = {.id = AP_CODEC_NONE};
    if (phase == AP__MP_DIFF && o->server_fraction > 0) {
        c.k = k_of(o, d, o->server_fraction);
        c.id = o->method == AP_MASHA_1 ? AP_CODEC_RANDK : AP_CODEC_TOPK;
        c.seed = mix3(o->seed, iter, 0);
    }
    return c;
}

/* The iteration check a header of `version` carries. */
static uint32_t iter_tag(int version, bool reply, uint64_t iter)
{
    if (version == 1) return (uint32_t)iter;
    if (version == 2) return (uint32_t)(iter & 0xff);
    return (uint32_t)(iter & (reply ? 0x0f : 0x1f));
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) v >>= 7, n++;
    return n;
}

/* Bytes of a request of worker m carrying a chunk of d elements under c. */
static uint64_t req_bytes(int wire, const ap_codec_cfg_t *c, size_t d, unsigned m)
{
    size_t hdr = wire == 1 ? AP__MASHA_HDR : (wire == 2 ? 2 : 1) + varint_len(m);
    return hdr + ap_compress_size_ex(c, d, 0, chunk_flags(wire));
}

uint64_t ap_masha_upload_bytes(const ap_masha_problem_t *p, const ap_masha_opts_t *o,
                               uint64_t iters, uint64_t refreshes)
{
    size_t d = p->d;
    int wire = wire_of(o);
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE}, wc = worker_codec(o, d);
    uint64_t full = req_bytes(wire, &none, d, 0);
    if (o->method == AP_MASHA_EXTRAGRADIENT) return iters * 2 * full;
    return (1 + refreshes) * full + iters * req_bytes(wire, &wc, d, 0);
}

int ap__masha_hdr_parse(const uint8_t *b, size_t len, bool is_reply, ap__masha_hdr_t *h)
{
    if (!b || len < 1) return AP_EPROTO;
    memset(h, 0, sizeof *h);
    if (b[0] == AP__MASHA_VERSION) {
        if (len < AP__MASHA_HDR) return AP_EPROTO;
        h->version = 1;
        h->phase = b[1];
        memcpy(&h->iter, b + 4, 4);
        if (is_reply) {
            if (b[2] > 1 || b[3] != 0) return AP_EPROTO;
            h->refresh = b[2] != 0;
        } else
            h->worker = (unsigned)b[2] | ((unsigned)b[3] << 8);
        h->hdr_len = AP__MASHA_HDR;
    } else if (b[0] >> 4 == AP__MASHA_V2 || (b[0] & 0x80)) {
        size_t at;
        if (b[0] & 0x80) { /* version 3: one byte */
            h->version = 3;
            h->phase = (uint8_t)((b[0] & 3) + 1);
            h->refresh = is_reply && (b[0] & 4);
            h->iter = is_reply ? (b[0] >> 3) & 0x0f : (b[0] >> 2) & 0x1f;
            at = 1;
        } else {
            if (len < 2) return AP_EPROTO;
            h->version = 2;
            h->phase = b[0] & 7;
            h->iter = b[1];
            h->refresh = is_reply && (b[0] & 8);
            if (!is_reply && (b[0] & 8)) return AP_EPROTO;
            at = 2;
        }
        if (!is_reply) { /* varint worker index < 2^16, shortest form */
            uint32_t v = 0;
            for (int i = 0;; i++) {
                if (i == 3 || at >= len) return AP_EPROTO;
                uint8_t c = b[at++];
                v |= (uint32_t)(c & 0x7f) << (7 * i);
                if (!(c & 0x80)) {
                    if (i > 0 && c == 0) return AP_EPROTO;
                    break;
                }
            }
            if (v > 65535) return AP_EPROTO;
            h->worker = v;
        }
        h->hdr_len = at;
    } else
        return AP_EVERSION;
    if (h->phase < AP__MP_FULL || h->phase > AP__MP_EG_B) return AP_EPROTO;
    return 0;
}

/* ---- worker ------------------------------------------------------------------------ */

struct ap__masha_worker {
    const ap_masha_problem_t *p;
    ap_masha_opts_t o;
    int m;
    size_t d;
    double tau;
    ap_codec_cfg_t codec;
    double *z, *w, *zh, *Fw, *Fmw, *tmp;
    float *fbuf, *g;
    ap_compress_ef_t *ef;
    uint8_t *msg;
    size_t msg_len, msg_cap;
    ap__masha_phase_t phase;
    uint64_t iter;
    ap_codec_cfg_t msg_cfg; /* codec of the pending request */
    int wire;               /* 1, 2 or 3 */
    bool wire_fixed;        /* a reply in this version was accepted */
    ap_masha_result_t counts;
    bool stopped;
};

ap__masha_worker_t *ap__masha_worker_new(const ap_masha_problem_t *p, const ap_masha_opts_t *o,
                                         int m)
{
    if (!p || !o || m < 0 || m >= p->M || m > 65535) return NULL;
    ap__masha_worker_t *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    size_t d = p->d;
    w->p = p;
    w->o = *o;
    if (!(w->o.target > 0)) w->o.target = 1e-6;
    w->m = m;
    w->d = d;
    w->tau = tau_of(o, d);
    w->codec = worker_codec(o, d);
    w->wire = wire_of(o);
    w->z = calloc(d, sizeof(double));
    w->w = calloc(d, sizeof(double));
    w->zh = calloc(d, sizeof(double));
    w->Fw = calloc(d, sizeof(double));
    w->Fmw = calloc(d, sizeof(double));
    w->tmp = calloc(d, sizeof(double));
    w->fbuf = calloc(d, sizeof(float));
    w->g = calloc(d, sizeof(float));
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    w->msg_cap = AP__MASHA_HDR + ap_compress_size(&none, d);
    w->msg = malloc(w->msg_cap);
    if (o->method == AP_MASHA_2) w->ef = ap_compress_ef_new(d);
    if (!w->z || !w->w || !w->zh || !w->Fw || !w->Fmw || !w->tmp || !w->fbuf || !w->g || !w->msg ||
        (o->method == AP_MASHA_2 && !w->ef)) {
        ap__masha_worker_free(w);
        return NULL;
    }
    return w;
}

void ap__masha_worker_free(ap__masha_worker_t *w)
{
    if (!w) return;
    free(w->z);
    free(w->w);
    free(w->zh);
    free(w->Fw);
    free(w->Fmw);
    free(w->tmp);
    free(w->fbuf);
    free(w->g);
    free(w->msg);
    ap_compress_ef_free(w->ef);
    free(w);
}

/* Encodes fbuf with cfg (through the residual if ef) as the next request. */
static int build_msg(ap__masha_worker_t *w, ap__masha_phase_t ph, const ap_codec_cfg_t *cfg,
                     bool ef, uint64_t nvalues)
{
    uint8_t *h = w->msg;
    size_t hl;
    if (w->wire == 1) {
        h[0] = AP__MASHA_VERSION;
        h[1] = (uint8_t)ph;
        h[2] = (uint8_t)(w->m & 0xff);
        h[3] = (uint8_t)(w->m >> 8);
        uint32_t it = (uint32_t)w->iter;
        memcpy(h + 4, &it, 4);
        hl = AP__MASHA_HDR;
    } else if (w->wire == 2) {
        h[0] = (uint8_t)(AP__MASHA_V2 << 4 | ph);
        h[1] = (uint8_t)w->iter;
        hl = 2 + ap__uvarint_put(h + 2, (uint64_t)w->m);
    } else {
        h[0] = (uint8_t)(0x80 | iter_tag(3, false, w->iter) << 2 | (ph - 1));
        hl = 1 + ap__uvarint_put(h + 1, (uint64_t)w->m);
    }
    size_t len;
    unsigned fl = chunk_flags(w->wire);
    int rc = ef ? ap_compress_ef_encode_ex(w->ef, cfg, w->fbuf, w->d, 0, fl, h + hl,
                                           w->msg_cap - hl, &len)
                : ap_compress_encode_ex(cfg, w->fbuf, w->d, 0, fl, h + hl, w->msg_cap - hl, &len);
    if (rc) return rc;
    w->msg_len = hl + len;
    w->msg_cfg = *cfg;
    w->phase = ph;
    w->counts.bytes_up += w->msg_len;
    w->counts.floats_up += nvalues;
    return 0;
}

static void to_float(float *dst, const double *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = (float)src[i];
}

static int build_full(ap__masha_worker_t *w)
{
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    to_float(w->fbuf, w->Fmw, w->d);
    return build_msg(w, AP__MP_FULL, &none, false, w->d);
}

static int build_diff(ap__masha_worker_t *w)
{
    size_t d = w->d;
    for (size_t i = 0; i < d; i++)
        w->zh[i] = w->tau * w->z[i] + (1 - w->tau) * w->w[i] - w->o.gamma * w->Fw[i];
    ap_masha_operator(w->p, w->m, w->zh, w->tmp);
    double sc = w->o.method == AP_MASHA_2 ? w->o.gamma : 1.0;
    for (size_t i = 0; i < d; i++) w->fbuf[i] = (float)(sc * (w->tmp[i] - w->Fmw[i]));
    ap_codec_cfg_t c = w->codec;
    c.seed = mix3(w->o.seed, w->iter, (uint64_t)w->m + 1);
    return build_msg(w, AP__MP_DIFF, &c, w->o.method == AP_MASHA_2, c.k);
}

static int build_eg(ap__masha_worker_t *w, ap__masha_phase_t ph)
{
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    ap_masha_operator(w->p, w->m, ph == AP__MP_EG_A ? w->z : w->zh, w->tmp);
    to_float(w->fbuf, w->tmp, w->d);
    return build_msg(w, ph, &none, false, w->d);
}

int ap__masha_worker_start(ap__masha_worker_t *w)
{
    if (w->o.method == AP_MASHA_EXTRAGRADIENT) return build_eg(w, AP__MP_EG_A);
    ap_masha_operator(w->p, w->m, w->w, w->Fmw); /* w = z = 0 */
    return build_full(w);
}

int ap__masha_worker_wire(const ap__masha_worker_t *w)
{
    return w->wire;
}

/* Version 3 -> 2: the bare chunk gets its compact header. */
static int downgrade_to2(ap__masha_worker_t *w, const ap__masha_hdr_t *h, uint8_t *out)
{
    const ap_codec_cfg_t *c = &w->msg_cfg;
    size_t pl = w->msg_len - h->hdr_len;
    out[0] = (uint8_t)(AP__MASHA_V2 << 4 | w->phase);
    out[1] = (uint8_t)w->iter;
    size_t hl = 2 + ap__uvarint_put(out + 2, (uint64_t)w->m);
    hl += ap__cw_hdr_write(out + hl, c->id, (uint32_t)w->d, 0, (uint32_t)pl, ap_compress_k(c, w->d),
                           chunk_flags(2));
    if (hl + pl > w->msg_cap) return AP_EMSGSIZE;
    memcpy(out + hl, w->msg + h->hdr_len, pl);
    return (int)(hl + pl);
}

/* Version 2 -> 1: the chunk re-framed with its seed. */
static int downgrade_to1(ap__masha_worker_t *w, const ap__masha_hdr_t *h, uint8_t *out)
{
    size_t len = 0;
    int rc =
        ap_compress_reframe(w->msg + h->hdr_len, w->msg_len - h->hdr_len, true, w->msg_cfg.seed, 0,
                            out + AP__MASHA_HDR, w->msg_cap - AP__MASHA_HDR, &len);
    if (rc) return rc;
    out[0] = AP__MASHA_VERSION;
    out[1] = (uint8_t)w->phase;
    out[2] = (uint8_t)(w->m & 0xff);
    out[3] = (uint8_t)(w->m >> 8);
    uint32_t it = (uint32_t)w->iter;
    memcpy(out + 4, &it, 4);
    return (int)(AP__MASHA_HDR + len);
}

int ap__masha_worker_downgrade(ap__masha_worker_t *w)
{
    if (w->wire == 1) return 0;
    if (w->wire_fixed) return AP_ESTATE;
    ap__masha_hdr_t h;
    int rc = ap__masha_hdr_parse(w->msg, w->msg_len, false, &h);
    if (rc) return rc;
    uint8_t *out = malloc(w->msg_cap);
    if (!out) return AP_ENOMEM;
    rc = w->wire == 3 ? downgrade_to2(w, &h, out) : downgrade_to1(w, &h, out);
    if (rc < 0) {
        free(out);
        return rc;
    }
    w->counts.bytes_up += (uint64_t)rc - w->msg_len;
    free(w->msg);
    w->msg = out;
    w->msg_len = (size_t)rc;
    w->wire--;
    return 0;
}

const uint8_t *ap__masha_worker_msg(const ap__masha_worker_t *w, size_t *len)
{
    *len = w->stopped ? 0 : w->msg_len;
    return w->stopped ? NULL : w->msg;
}

const double *ap__masha_worker_z(const ap__masha_worker_t *w)
{
    return w->z;
}
uint64_t ap__masha_worker_iter(const ap__masha_worker_t *w)
{
    return w->iter;
}
void ap__masha_worker_counts(const ap__masha_worker_t *w, ap_masha_result_t *r)
{
    *r = w->counts;
    r->iters = w->iter;
    r->rel_dist2 = ap_masha_rel_dist2(w->p, w->z);
    r->converged = r->rel_dist2 <= w->o.target;
}

/* Stop on the target, on max_iters, or on divergence (distance grew 1e8x). */
static bool should_stop(const ap__masha_worker_t *w)
{
    double r = ap_masha_rel_dist2(w->p, w->z);
    return r <= w->o.target || w->iter >= w->o.max_iters || !(r < 1e8);
}

int ap__masha_worker_on_reply(ap__masha_worker_t *w, const uint8_t *rep, size_t len,
                              bool *iter_done)
{
    *iter_done = false;
    if (w->stopped) return AP_ESTATE;
    ap__masha_hdr_t mh;
    int rc = ap__masha_hdr_parse(rep, len, true, &mh);
    if (rc) return rc;
    if (mh.version != w->wire || mh.phase != (uint8_t)w->phase ||
        mh.iter != iter_tag(w->wire, true, w->iter))
        return AP_EPROTO;
    if (mh.refresh && w->phase != AP__MP_DIFF) return AP_EPROTO;
    bool bit = mh.refresh;
    const uint8_t *ch = rep + mh.hdr_len;
    size_t chl = len - mh.hdr_len;
    ap_codec_cfg_t scfg = server_codec(&w->o, w->d, w->phase, w->iter);
    if (w->wire == 3)
        rc = ap_compress_decode_bare(&scfg, w->d, 0, chunk_flags(3), ch, chl, w->g, w->d);
    else {
        ap_compress_hdr_t h;
        rc = ap_compress_parse(ch, chl, &h);
        if (rc) return rc;
        if (h.version != w->wire || h.offset != 0 || h.count != w->d) return AP_EPROTO;
        rc = ap_compress_decode_seeded(ch, chl, scfg.seed, w->g, w->d, NULL);
    }
    if (rc) return rc;
    w->wire_fixed = true;
    w->counts.bytes_down += len;
    size_t d = w->d;
    switch (w->phase) {
    case AP__MP_FULL:
        for (size_t i = 0; i < d; i++) w->Fw[i] = w->g[i];
        return build_diff(w);
    case AP__MP_DIFF: {
        double sc = w->o.method == AP_MASHA_2 ? 1.0 : w->o.gamma;
        for (size_t i = 0; i < d; i++) w->z[i] = w->zh[i] - sc * w->g[i];
        w->iter++;
        *iter_done = true;
        if (should_stop(w)) {
            w->stopped = true;
            return 0;
        }
        if (bit) {
            memcpy(w->w, w->z, d * sizeof(double));
            ap_masha_operator(w->p, w->m, w->w, w->Fmw);
            w->counts.refreshes++;
            return build_full(w);
        }
        return build_diff(w);
    }
    case AP__MP_EG_A:
        for (size_t i = 0; i < d; i++) w->zh[i] = w->z[i] - w->o.gamma * w->g[i];
        return build_eg(w, AP__MP_EG_B);
    case AP__MP_EG_B:
        for (size_t i = 0; i < d; i++) w->z[i] -= w->o.gamma * w->g[i];
        w->iter++;
        *iter_done = true;
        if (should_stop(w)) {
            w->stopped = true;
            return 0;
        }
        return build_eg(w, AP__MP_EG_A);
    }
    return AP_EPROTO;
}

/* ---- server ------------------------------------------------------------------------- */

struct ap__masha_server {
    ap_masha_opts_t o;
    size_t d;
    int M;
    double tau;
    float *agg;
    float *scratch; /* check(): validation decode */
    uint8_t *seen;
    int count;
    uint8_t phase; /* the phase and iteration the next requests must carry */
    uint64_t iter;
    uint64_t rng[4];
    ap_compress_ef_t *ef; /* server-side error feedback (MASHA2 + server top-k) */
    uint8_t *rep[3];      /* reply in wire version 1, 2 and 3 */
    size_t rep_len[3], rep_cap;
};

ap__masha_server_t *ap__masha_server_new(size_t d, int workers, const ap_masha_opts_t *o)
{
    if (!o || d == 0 || d > AP_COMPRESS_MAX_COUNT / 4 || workers < 1 || workers > 65536)
        return NULL;
    ap__masha_server_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->o = *o;
    s->d = d;
    s->M = workers;
    s->tau = tau_of(o, d);
    s->phase = o->method == AP_MASHA_EXTRAGRADIENT ? AP__MP_EG_A : AP__MP_FULL;
    s->agg = calloc(d, sizeof(float));
    s->scratch = calloc(d, sizeof(float));
    s->seen = calloc((size_t)workers, 1);
    ap_codec_cfg_t none = {.id = AP_CODEC_NONE};
    s->rep_cap = AP__MASHA_HDR + ap_compress_size(&none, d);
    s->rep[0] = malloc(s->rep_cap);
    s->rep[1] = malloc(s->rep_cap);
    s->rep[2] = malloc(s->rep_cap);
    if (o->method == AP_MASHA_2 && o->server_fraction > 0) s->ef = ap_compress_ef_new(d);
    ap__rng_seed(s->rng, o->seed ^ 0x5e5e5e5e5e5e5e5eull);
    if (!s->agg || !s->scratch || !s->seen || !s->rep[0] || !s->rep[1] || !s->rep[2] ||
        (o->method == AP_MASHA_2 && o->server_fraction > 0 && !s->ef)) {
        ap__masha_server_free(s);
        return NULL;
    }
    return s;
}

void ap__masha_server_free(ap__masha_server_t *s)
{
    if (!s) return;
    free(s->agg);
    free(s->scratch);
    free(s->seen);
    free(s->rep[0]);
    free(s->rep[1]);
    free(s->rep[2]);
    ap_compress_ef_free(s->ef);
    free(s);
}

/* Validates a request's header and phase against the run; sets *mh. */
static int server_admit(ap__masha_server_t *s, const uint8_t *req, size_t len, ap__masha_hdr_t *mh)
{
    int rc = ap__masha_hdr_parse(req, len, false, mh);
    if (rc) return rc;
    if (mh->worker >= (unsigned)s->M || mh->phase != s->phase ||
        mh->iter != iter_tag(mh->version, false, s->iter) || s->seen[mh->worker])
        return AP_EPROTO;
    if (mh->version == 3) return 0; /* a bare chunk: its size is checked by the decode */
    ap_compress_hdr_t h;
    rc = ap_compress_parse(req + mh->hdr_len, len - mh->hdr_len, &h);
    if (rc) return rc;
    if (h.version != mh->version || h.offset != 0 || h.count != s->d) return AP_EPROTO;
    return 0;
}

/* The codec seed of worker m's request in the current phase. */
static uint64_t req_seed(const ap__masha_server_t *s, unsigned m)
{
    return mix3(s->o.seed, s->iter, (uint64_t)m + 1);
}

/* The codec of worker m's request in the current phase (what a bare chunk
 * must be). */
static ap_codec_cfg_t req_codec(const ap__masha_server_t *s, unsigned m)
{
    ap_codec_cfg_t c = {.id = AP_CODEC_NONE};
    if (s->phase == AP__MP_DIFF) c = worker_codec(&s->o, s->d);
    c.seed = req_seed(s, m);
    return c;
}

/* All M requests are in agg: builds the replies, moves to the next phase. */
static int server_reply_build(ap__masha_server_t *s)
{
    ap_codec_cfg_t c = server_codec(&s->o, s->d, s->phase, s->iter);
    bool ef = c.id != AP_CODEC_NONE && s->ef != NULL, bit = false;
    if (s->phase == AP__MP_DIFF) {
        double u = (double)(ap__rng_next(s->rng) >> 11) / 9007199254740992.0;
        bit = u < 1 - s->tau;
    }
    /* version 2 first (the residual moves once), version 1 re-framed from it */
    uint8_t *r2 = s->rep[1], *r1 = s->rep[0];
    r2[0] = (uint8_t)(AP__MASHA_V2 << 4 | (bit ? 8 : 0) | s->phase);
    r2[1] = (uint8_t)s->iter;
    size_t l, fl = chunk_flags(2);
    int rc =
        ef ? ap_compress_ef_encode_ex(s->ef, &c, s->agg, s->d, 0, (unsigned)fl, r2 + 2,
                                      s->rep_cap - 2, &l)
           : ap_compress_encode_ex(&c, s->agg, s->d, 0, (unsigned)fl, r2 + 2, s->rep_cap - 2, &l);
    if (rc) return rc;
    s->rep_len[1] = 2 + l;
    /* version 3: the same payload without the chunk header */
    size_t chl = ap__cw_hdr_size(c.id, (uint32_t)s->d, 0, ap_compress_k(&c, s->d), (unsigned)fl);
    uint8_t *r3 = s->rep[2];
    r3[0] = (uint8_t)(0x80 | iter_tag(3, true, s->iter) << 3 | (bit ? 4 : 0) | (s->phase - 1));
    memcpy(r3 + 1, r2 + 2 + chl, l - chl);
    s->rep_len[2] = 1 + l - chl;
    r1[0] = AP__MASHA_VERSION;
    r1[1] = s->phase;
    r1[2] = bit ? 1 : 0;
    r1[3] = 0;
    uint32_t it = (uint32_t)s->iter;
    memcpy(r1 + 4, &it, 4);
    rc = ap_compress_reframe(r2 + 2, l, true, c.seed, 0, r1 + AP__MASHA_HDR,
                             s->rep_cap - AP__MASHA_HDR, &l);
    if (rc) return rc;
    s->rep_len[0] = AP__MASHA_HDR + l;
    s->count = 0;
    memset(s->seen, 0, (size_t)s->M);
    switch (s->phase) { /* the next phase every worker sends */
    case AP__MP_FULL:
        s->phase = AP__MP_DIFF;
        break;
    case AP__MP_DIFF:
        s->iter++;
        s->phase = bit ? AP__MP_FULL : AP__MP_DIFF;
        break;
    case AP__MP_EG_A:
        s->phase = AP__MP_EG_B;
        break;
    default:
        s->iter++;
        s->phase = AP__MP_EG_A;
    }
    return 1;
}

static int server_decode(ap__masha_server_t *s, const uint8_t *req, size_t len,
                         const ap__masha_hdr_t *mh, bool add)
{
    const uint8_t *ch = req + mh->hdr_len;
    size_t chl = len - mh->hdr_len;
    if (mh->version == 3) {
        ap_codec_cfg_t c = req_codec(s, mh->worker);
        unsigned fl = chunk_flags(3);
        return add ? ap_compress_decode_add_bare(&c, s->d, 0, fl, ch, chl, 1.0f / (float)s->M,
                                                 s->agg, s->d)
                   : ap_compress_decode_bare(&c, s->d, 0, fl, ch, chl, s->scratch, s->d);
    }
    uint64_t seed = req_seed(s, mh->worker);
    return add ? ap_compress_decode_add_seeded(ch, chl, seed, 1.0f / (float)s->M, s->agg, s->d,
                                               NULL)
               : ap_compress_decode_seeded(ch, chl, seed, s->scratch, s->d, NULL);
}

int ap__masha_server_add(ap__masha_server_t *s, const uint8_t *req, size_t len)
{
    ap__masha_hdr_t mh;
    int rc = server_admit(s, req, len, &mh);
    if (rc) return rc;
    if (s->count == 0) memset(s->agg, 0, s->d * sizeof(float));
    rc = server_decode(s, req, len, &mh, true);
    if (rc) return rc;
    s->seen[mh.worker] = 1;
    s->count++;
    if (s->count < s->M) return 0;
    return server_reply_build(s);
}

int ap__masha_server_check(ap__masha_server_t *s, const uint8_t *req, size_t len)
{
    ap__masha_hdr_t mh;
    int rc = server_admit(s, req, len, &mh);
    if (rc) return rc;
    rc = server_decode(s, req, len, &mh, false);
    if (rc) return rc;
    s->seen[mh.worker] = 1;
    s->count++;
    return s->count < s->M ? 0 : 1;
}

int ap__masha_server_complete(ap__masha_server_t *s, const uint8_t *const *reqs, const size_t *lens)
{
    if (s->count != s->M) return AP_ESTATE;
    memset(s->agg, 0, s->d * sizeof(float));
    for (int m = 0; m < s->M; m++) {
        ap__masha_hdr_t mh;
        int rc = ap__masha_hdr_parse(reqs[m], lens[m], false, &mh);
        if (!rc && mh.worker != (unsigned)m) rc = AP_EPROTO;
        if (!rc) rc = server_decode(s, reqs[m], lens[m], &mh, true);
        if (rc) return rc; /* cannot happen: check() decoded it */
    }
    return server_reply_build(s);
}

const uint8_t *ap__masha_server_reply(ap__masha_server_t *s, int version, size_t *len)
{
    if (version < 1 || version > AP__MASHA_V3) version = wire_of(&s->o);
    int i = version - 1;
    *len = s->rep_len[i];
    return s->rep[i];
}

/* ---- in-process solver ------------------------------------------------------------- */

int ap_masha_run(const ap_masha_problem_t *p, const ap_masha_opts_t *o, ap_masha_result_t *r)
{
    if (!p || !o || !r || !(o->gamma > 0)) return AP_EINVAL;
    int M = p->M, rc = 0;
    ap__masha_worker_t **ws = calloc((size_t)M, sizeof *ws);
    ap__masha_server_t *s = ap__masha_server_new(p->d, M, o);
    if (!ws || !s) {
        rc = AP_ENOMEM;
        goto out;
    }
    for (int m = 0; m < M; m++) {
        ws[m] = ap__masha_worker_new(p, o, m);
        if (!ws[m]) {
            rc = AP_ENOMEM;
            goto out;
        }
        if ((rc = ap__masha_worker_start(ws[m]))) goto out;
    }
    for (;;) {
        size_t len;
        const uint8_t *msg = ap__masha_worker_msg(ws[0], &len);
        if (!msg) break; /* worker 0 stopped; all stop together */
        int done = 0;
        for (int m = 0; m < M; m++) {
            msg = ap__masha_worker_msg(ws[m], &len);
            if (!msg) {
                rc = AP_ESTATE;
                goto out;
            }
            done = ap__masha_server_add(s, msg, len);
            if (done < 0) {
                rc = done;
                goto out;
            }
        }
        if (done != 1) {
            rc = AP_ESTATE;
            goto out;
        }
        const uint8_t *rep = ap__masha_server_reply(s, 0, &len);
        bool it_done = false;
        for (int m = 0; m < M; m++)
            if ((rc = ap__masha_worker_on_reply(ws[m], rep, len, &it_done))) goto out;
        if (it_done && o->trace) {
            ap_masha_result_t c;
            ap__masha_worker_counts(ws[0], &c);
            o->trace(o->trace_arg, c.iters, c.floats_up, c.bytes_up, c.rel_dist2);
        }
    }
    ap__masha_worker_counts(ws[0], r);
out:
    if (ws)
        for (int m = 0; m < M; m++) ap__masha_worker_free(ws[m]);
    free(ws);
    ap__masha_server_free(s);
    return rc;
}
