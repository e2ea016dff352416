/* Fuzz target: the collaborative optimizer's decoders of untrusted bytes.
 * First byte selects:
 *   even (not 2): a progress record (ap_progress_decode): accepted records must obey
 *         the documented invariants (also of the run configuration they
 *         carry) and survive a re-encode round trip;
 *   2:    a state request to a started peer (fuzz_serve): the rest of the
 *         input is the stream's hello (a StateRequest with its RunConfig);
 *   odd:  a state download from a fuzzed donor on the simulator: the rest of
 *         the input is a sequence of [u16 length][bytes] stream messages the
 *         donor sends (header, chunks, checksum). Whatever it sends, the
 *         newcomer must end the download (refusing or accepting it) without
 *         crashing, and params stay finite. */
#include "apiary/avg.h"
#include "apiary/collab.h"
#include "apiary/dht.h"
#include "apiary/nn.h"
#include "apiary/progress.h"
#include "apiary/run_config.h"
#include "apiary/sim.h"
#include "optim/collab_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NPAR 40

typedef struct fz {
    const uint8_t *d;
    size_t n;
    bool done;
} fz_t;

static void ev_close(ap_stream_t *s, void *arg, int status) {}
static const ap_stream_cbs_t ev_cbs = {.on_close = ev_close};

static int ev_accept(ap_rt_t *rt, void *arg, ap_stream_t *s, const ap_peer_id_t *peer,
                     const uint8_t *hello, size_t len)
{
    fz_t *f = arg;
    ap_stream_set_cbs(s, &ev_cbs, NULL);
    size_t i = 0;
    while (i + 2 <= f->n) {
        size_t l = (size_t)f->d[i] | ((size_t)f->d[i + 1] << 8);
        i += 2;
        if (l > f->n - i) l = f->n - i;
        ap_stream_send(s, f->d + i, l);
        i += l;
    }
    ap_stream_close(s);
    return 0;
}

static fz_t *g_fz;

static void dl_done(ap_collab_t *c, int status, uint64_t epoch, uint64_t optim_step)
{
    g_fz->done = true;
}

static bool is_done(void *arg)
{
    return ((fz_t *)arg)->done;
}

static void fuzz_download(const uint8_t *d, size_t n)
{
    ap_sim_t *sim = ap_sim_new(1);
    ap_sim_add_node(sim, NULL);
    ap_sim_add_node(sim, NULL);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1);
    ap_dht_t *dht = NULL;
    ap_avg_service_t *svc = NULL;
    ap_dht_new(a, NULL, &dht);
    ap_avg_service_new(a, &svc);
    float params[NPAR] = {0};
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "fuzz";
    cfg.target_batch_size = 8;
    cfg.solver = ap_nn_solver_defaults(AP_NN_SGD);
    cfg.download_timeout_us = 5000000;
    ap_collab_t *c = NULL;
    fz_t f = {d, n, false};
    if (ap_collab_new(a, dht, svc, &cfg, params, NPAR, NULL, 0, &c) == 0) {
        ap_rt_stream_listen(b, AP_COLLAB_STATE_PROTO, NULL, ev_accept, &f);
        ap_progress_t p = {.peer = *ap_rt_self(b), .donor = true, .role = AP_AVG_NORMAL};
        p.time_ms = p.epoch_start_ms = ap_rt_wall_ms(a);
        c->view[0] = p;
        c->nview = 1;
        g_fz = &f;
        if (ap__state_download(c, c->buf, 0, dl_done) == 0)
            ap_sim_run_until(sim, is_done, &f, ap_sim_now_us(sim) + 10000000);
        for (int i = 0; i < NPAR; i++)
            if (!isfinite(params[i])) abort();
        ap_collab_free(c);
    }
    ap_dht_free(dht);
    ap_avg_service_free(svc);
    ap_sim_free(sim);
}

/* A state request (the hello of /apiary/optim/state/1) to a started peer:
 * refused or served, never a crash; the peer's parameters stay as they were. */
static void sr_close(ap_stream_t *s, void *arg, int status)
{
    *(bool *)arg = true;
}
static void sr_end(ap_stream_t *s, void *arg)
{
    ap_stream_close(s);
}
static const ap_stream_cbs_t sr_cbs = {.on_end = sr_end, .on_close = sr_close};

static bool flag_set(void *arg)
{
    return *(bool *)arg;
}

static void fuzz_serve(const uint8_t *d, size_t n)
{
    ap_sim_t *sim = ap_sim_new(1);
    ap_sim_add_node(sim, NULL);
    ap_sim_add_node(sim, NULL);
    ap_rt_t *a = ap_sim_node(sim, 0), *b = ap_sim_node(sim, 1);
    ap_dht_t *dht = NULL;
    ap_avg_service_t *svc = NULL;
    ap_dht_new(a, NULL, &dht);
    ap_avg_service_new(a, &svc);
    float params[NPAR];
    for (int i = 0; i < NPAR; i++) params[i] = (float)i;
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = "fuzz";
    cfg.target_batch_size = 8;
    cfg.solver = ap_nn_solver_defaults(AP_NN_SGD);
    ap_collab_t *c = NULL;
    if (ap_collab_new(a, dht, svc, &cfg, params, NPAR, NULL, 0, &c) == 0) {
        c->started = true; /* serves state */
        bool closed = false;
        ap_stream_t *s = NULL;
        if (ap_rt_stream_open(b, ap_rt_self(a), AP_COLLAB_STATE_PROTO, d, n, NULL, &sr_cbs, &closed,
                              &s) == 0)
            ap_sim_run_until(sim, flag_set, &closed, ap_sim_now_us(sim) + 10000000);
        for (int i = 0; i < NPAR; i++)
            if (params[i] != (float)i) abort();
        ap_collab_free(c);
    }
    ap_dht_free(dht);
    ap_avg_service_free(svc);
    ap_sim_free(sim);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] == 2) {
        fuzz_serve(data + 1, size - 1);
        return 0;
    }
    if (data[0] % 2 == 0) {
        ap_progress_t p;
        int64_t now = 1700000000000;
        if (ap_progress_decode(data + 1, size - 1, now, 5000, &p) == 0) {
            if (p.samples < 0 || !(p.samples_per_s >= 0) || p.samples_per_s > AP_PROGRESS_MAX_SPS ||
                p.time_ms > now + 5000 || p.epoch_start_ms > p.time_ms || p.role > AP_AVG_AUX)
                abort();
            uint8_t buf[AP__PROGRESS_MAX];
            int len = ap_progress_encode(&p, buf, sizeof buf);
            ap_progress_t q;
            if (len < 0 || ap_progress_decode(buf, (size_t)len, now, 5000, &q) != 0) abort();
            if (q.epoch != p.epoch || q.samples != p.samples || q.time_ms != p.time_ms ||
                q.report_ms != p.report_ms)
                abort();
            if (p.nleft_out > AP_PROGRESS_LEFT_OUT_MAX || q.nleft_out != p.nleft_out) abort();
            for (uint32_t i = 0; i < p.nleft_out; i++)
                if (!ap_peer_id_eq(&q.left_out[i], &p.left_out[i])) abort();
            /* the run configuration: printable bounded model, finite
             * numbers, the digest of the fields, all kept */
            if (q.has_config != p.has_config || q.refused != p.refused) abort();
            if (p.has_config) {
                uint8_t d[AP_RUN_CONFIG_DIGEST_LEN];
                char why[AP_RUN_CONFIG_MSG_MAX];
                ap_run_config_digest(&p.config, d);
                if (memcmp(d, p.config_digest, sizeof d) ||
                    memcmp(q.config_digest, p.config_digest, sizeof d) ||
                    ap_run_config_diff(&p.config, "a", &q.config, "b", why, sizeof why) != 0 ||
                    strlen(p.config.model) >= AP_RUN_CONFIG_MODEL_MAX || !isfinite(p.config.lr) ||
                    !isfinite(p.config.clip))
                    abort();
            }
        }
    } else {
        fuzz_download(data + 1, size - 1);
    }
    return 0;
}
