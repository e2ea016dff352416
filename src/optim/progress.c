/* Progress records and the run's configuration: encoding, digest and
 * validation of untrusted records. */
#include "apiary/avg.h"
#include "apiary/log.h"
#include "apiary/progress.h"
#include "apiary/run_config.h"
#include "optim/collab_impl.h"

#include "optim.pb-c.h"

#include <math.h>
#include <sodium.h>
#include <string.h>

#define CONFIG_PACKED_MAX 512 /* a packed RunConfig: model < 64 bytes + 18 scalars */

void ap__run_config_to_pb(const ap_run_config_t *rc, Apiary__Optim__RunConfig *m)
{
    apiary__optim__run_config__init(m);
    m->model = (char *)rc->model;
    m->n_params = rc->n_params;
    m->state_count = rc->state_count;
    m->codec = rc->codec;
    m->target_batch = rc->target_batch_size;
    m->optim = rc->solver;
    m->lr = rc->lr;
    m->lr_kind = rc->lr_kind;
    m->warmup = rc->warmup;
    m->lr_total = rc->lr_total;
    m->lr_min = rc->lr_min;
    m->weight_decay = rc->weight_decay;
    m->clip = rc->clip;
    m->state_every = rc->state_every;
    m->exact = rc->exact;
    m->dht_matchmaking = rc->dht_matchmaking;
    m->byzantine_tolerant = rc->byzantine_tolerant;
    m->btard_tau = rc->btard_tau;
    m->state_codec = rc->state_codec;
    m->btard_validators = rc->btard_validators;
}

int ap__run_config_from_pb(const Apiary__Optim__RunConfig *m, ap_run_config_t *rc)
{
    memset(rc, 0, sizeof *rc);
    size_t ml = m->model ? strlen(m->model) : 0;
    if (ml >= AP_RUN_CONFIG_MODEL_MAX) return AP_ECORRUPT;
    for (size_t i = 0; i < ml; i++)
        if ((unsigned char)m->model[i] < 0x20 || (unsigned char)m->model[i] > 0x7e)
            return AP_ECORRUPT; /* printed in the log */
    if (ml) memcpy(rc->model, m->model, ml);
    if (!isfinite(m->lr) || !isfinite(m->lr_min) || !isfinite(m->weight_decay) ||
        !isfinite(m->clip))
        return AP_ERANGE;
    rc->n_params = m->n_params;
    rc->state_count = m->state_count;
    rc->codec = m->codec;
    rc->target_batch_size = m->target_batch;
    rc->solver = m->optim;
    rc->lr = m->lr;
    rc->lr_kind = m->lr_kind;
    rc->warmup = m->warmup;
    rc->lr_total = m->lr_total;
    rc->lr_min = m->lr_min;
    rc->weight_decay = m->weight_decay;
    rc->clip = m->clip;
    rc->state_every = m->state_every;
    rc->exact = m->exact;
    rc->dht_matchmaking = m->dht_matchmaking;
    rc->byzantine_tolerant = m->byzantine_tolerant;
    rc->btard_tau = isfinite(m->btard_tau) ? m->btard_tau : -1;
    rc->state_codec = m->state_codec;
    rc->btard_validators = m->btard_validators;
    return 0;
}

void ap_run_config_digest(const ap_run_config_t *rc, uint8_t out[AP_RUN_CONFIG_DIGEST_LEN])
{
    Apiary__Optim__RunConfig m;
    ap_run_config_t t = *rc;
    t.model[AP_RUN_CONFIG_MODEL_MAX - 1] = 0;
    ap__run_config_to_pb(&t, &m);
    uint8_t buf[CONFIG_PACKED_MAX];
    size_t len = apiary__optim__run_config__get_packed_size(&m);
    if (len > sizeof buf) len = 0; /* cannot happen: bounded fields */
    if (len) apiary__optim__run_config__pack(&m, buf);
    crypto_generichash(out, AP_RUN_CONFIG_DIGEST_LEN, buf, len, NULL, 0);
}

int ap_progress_encode(const ap_progress_t *p, uint8_t *buf, size_t cap)
{
    Apiary__Optim__Progress m = APIARY__OPTIM__PROGRESS__INIT;
    m.epoch = p->epoch;
    m.samples = p->samples;
    m.samples_per_s = p->samples_per_s;
    m.time_ms = p->time_ms;
    m.epoch_start_ms = p->epoch_start_ms;
    m.role = (uint32_t)p->role;
    m.up = p->up;
    m.down = p->down;
    m.donor = p->donor;
    m.ready_ms = p->ready_ms;
    m.refused = p->refused;
    m.loss = p->loss;
    m.has_loss = p->has_loss;
    m.bytes_sent = p->bytes_sent;
    m.bytes_received = p->bytes_received;
    m.rounds = p->rounds;
    m.rounds_failed = p->rounds_failed;
    m.last_group = p->last_group;
    m.last_round_ms = p->last_round_ms;
    m.last_fraction = p->last_fraction;
    m.report_ms = p->report_ms;
    uint8_t tok[AP_RUN_TOKEN_MAX];
    if (p->has_token) {
        int tl = ap_run_token_pack(&p->token, tok, sizeof tok);
        if (tl < 0) return tl;
        m.token.data = tok;
        m.token.len = (size_t)tl;
    }
    Apiary__Optim__RunConfig rc;
    ap_run_config_t cfg;
    if (p->has_config) {
        cfg = p->config;
        cfg.model[AP_RUN_CONFIG_MODEL_MAX - 1] = 0;
        ap__run_config_to_pb(&cfg, &rc);
        m.config = &rc;
    }
    ProtobufCBinaryData left[AP_PROGRESS_LEFT_OUT_MAX];
    uint8_t left_b[AP_PROGRESS_LEFT_OUT_MAX][AP_PEER_ID_LEN];
    if (p->nleft_out > AP_PROGRESS_LEFT_OUT_MAX) return AP_EINVAL;
    for (uint32_t i = 0; i < p->nleft_out; i++) {
        memcpy(left_b[i], p->left_out[i].b, AP_PEER_ID_LEN);
        left[i].data = left_b[i];
        left[i].len = AP_PEER_ID_LEN;
    }
    m.n_left_out = p->nleft_out;
    m.left_out = p->nleft_out ? left : NULL;
    size_t len = apiary__optim__progress__get_packed_size(&m);
    if (len > cap) return AP_EMSGSIZE;
    apiary__optim__progress__pack(&m, buf);
    return (int)len;
}

int ap_progress_decode(const uint8_t *buf, size_t len, int64_t now_ms, int64_t max_skew_ms,
                       ap_progress_t *out)
{
    if (len > 1024) return AP_ECORRUPT;
    Apiary__Optim__Progress *m = apiary__optim__progress__unpack(NULL, len, buf);
    if (!m) return AP_ECORRUPT;
    ap_progress_t p;
    memset(&p, 0, sizeof p);
    p.epoch = m->epoch;
    p.samples = m->samples;
    p.samples_per_s = m->samples_per_s;
    p.time_ms = m->time_ms;
    p.epoch_start_ms = m->epoch_start_ms;
    p.role = (ap_avg_role_t)m->role;
    p.up = m->up;
    p.down = m->down;
    p.donor = m->donor;
    p.ready_ms = m->ready_ms;
    p.refused = m->refused;
    p.loss = m->loss;
    p.has_loss = m->has_loss || m->loss != 0; /* older writers: 0 meant none */
    p.bytes_sent = m->bytes_sent;
    p.bytes_received = m->bytes_received;
    p.rounds = m->rounds;
    p.rounds_failed = m->rounds_failed;
    p.last_group = m->last_group;
    p.last_round_ms = m->last_round_ms;
    p.last_fraction = m->last_fraction;
    p.report_ms = m->report_ms;
    uint32_t role = m->role;
    int crc = 0;
    if (m->config) {
        crc = ap__run_config_from_pb(m->config, &p.config);
        if (!crc) ap_run_config_digest(&p.config, p.config_digest);
        p.has_config = crc == 0;
    }
    if (!crc && m->token.len) {
        crc = ap_run_token_unpack(m->token.data, m->token.len, &p.token);
        p.has_token = crc == 0;
    }
    if (!crc && m->n_left_out > AP_PROGRESS_LEFT_OUT_MAX) crc = AP_ECORRUPT;
    for (size_t i = 0; !crc && i < m->n_left_out; i++)
        if (ap_peer_id_from_bytes(&p.left_out[i], m->left_out[i].data, m->left_out[i].len) != 0)
            crc = AP_ECORRUPT;
    if (!crc) p.nleft_out = (uint32_t)m->n_left_out;
    apiary__optim__progress__free_unpacked(m, NULL);
    if (crc) return crc;

    if (p.samples < 0 || !isfinite(p.samples_per_s) || p.samples_per_s < 0 ||
        p.samples_per_s > AP_PROGRESS_MAX_SPS || role > AP_AVG_AUX || !isfinite(p.up) ||
        !isfinite(p.down) || p.up < 0 || p.down < 0)
        return AP_ERANGE;
    if (p.time_ms > now_ms + max_skew_ms || p.epoch_start_ms > p.time_ms) return AP_ERANGE;
    if (p.ready_ms != 0 && (p.ready_ms < p.epoch_start_ms || p.ready_ms > p.time_ms))
        return AP_ERANGE;
    /* An honest peer's samples are its speed times the time it has been in
     * this epoch; allow a factor of two and one second of slack for the
     * speed estimate's smoothing. */
    double elapsed_s = (double)(p.time_ms - p.epoch_start_ms) / 1000.0;
    if ((double)p.samples > 2.0 * p.samples_per_s * (elapsed_s + 1.0) + 1.0) return AP_ELIMIT;
    *out = p;
    return 0;
}
