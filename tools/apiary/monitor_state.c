/* The run monitor's model: progress records in, JSON and Prometheus text out
 * (monitor.h, docs/monitor.md). */
#include "monitor.h"

#include "apiary/log.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "monitor"

typedef struct sb {
    char *p;
    size_t len, cap;
    bool oom;
} sb_t;

static void sb_printf(sb_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sb_t *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + (size_t)n + 1) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
}

static char *sb_finish(sb_t *b, size_t *len)
{
    if (b->oom) {
        free(b->p);
        return NULL;
    }
    if (!b->p) sb_printf(b, "%s", "");
    if (b->oom) return NULL;
    *len = b->len;
    return b->p;
}

int mon_state_init(mon_state_t *m, const char *run_id)
{
    memset(m, 0, sizeof *m);
    snprintf(m->run_id, sizeof m->run_id, "%s", run_id);
    m->peers = calloc(MON_PEERS_MAX, sizeof *m->peers);
    m->eta_s = INFINITY;
    return m->peers ? 0 : AP_ENOMEM;
}

void mon_state_free(mon_state_t *m)
{
    free(m->peers);
    m->peers = NULL;
}

static const char *role_name(ap_avg_role_t r)
{
    return r == AP_AVG_CLIENT ? "client" : r == AP_AVG_AUX ? "aux" : "trainer";
}

static const char *reach_name(ap_avg_role_t r)
{
    return r == AP_AVG_CLIENT ? "dials out (client mode)" : "listens (reachable)";
}

static void short_id(const char *id, char out[16])
{
    size_t n = strlen(id), k = n > 8 ? 8 : n;
    memcpy(out, id + n - k, k);
    out[k] = 0;
}

/* Monitor fields are not checked by ap_progress_decode (training ignores
 * them): bring absurd values back to something the page can show. */
static bool clamp(ap_progress_t *p)
{
    bool c = false;
    if (!isfinite(p->loss) || p->loss < 0 || p->loss > 1e9f)
        p->loss = 0, p->has_loss = false, c = true;
    if (!p->has_loss) p->loss = 0;
    if (!isfinite(p->last_fraction) || p->last_fraction < 0 || p->last_fraction > 1)
        p->last_fraction = isfinite(p->last_fraction) && p->last_fraction > 1 ? 1 : 0, c = true;
    if (p->last_group > 1u << 16) p->last_group = 1u << 16, c = true;
    if (p->last_round_ms > 86400000u) p->last_round_ms = 86400000u, c = true;
    if (p->rounds_failed > p->rounds) p->rounds_failed = p->rounds, c = true;
    if (p->bytes_sent > (1ull << 60)) p->bytes_sent = 1ull << 60, c = true;
    if (p->bytes_received > (1ull << 60)) p->bytes_received = 1ull << 60, c = true;
    if (p->epoch > (1ull << 48)) p->epoch = 1ull << 48, c = true;
    return c;
}

static void note_round(mon_state_t *m, const mon_peer_t *old, const ap_progress_t *p,
                       const char *id)
{
    if (!old || p->rounds <= old->p.rounds) return;
    mon_round_t *r = &m->rounds[m->rounds_next];
    m->rounds_next = (m->rounds_next + 1) % MON_ROUNDS_MAX;
    if (m->nrounds < MON_ROUNDS_MAX) m->nrounds++;
    r->epoch = p->epoch ? p->epoch - 1 : 0; /* the round that led to this epoch */
    short_id(id, r->peer);
    r->group = p->last_group;
    r->ms = p->last_round_ms;
    r->fraction = p->last_fraction;
    r->failed = p->rounds_failed > old->p.rounds_failed;
}

void mon_state_put(mon_state_t *m, const char *peer_id, const ap_progress_t *in)
{
    ap_progress_t p = *in;
    mon_peer_t *slot = NULL;
    for (size_t i = 0; i < m->npeers; i++)
        if (strcmp(m->peers[i].id, peer_id) == 0) slot = &m->peers[i];
    bool clamped = clamp(&p);
    if (clamped) m->records_clamped++;
    if (slot && p.time_ms < slot->p.time_ms) return; /* older than what we have */
    if (!slot) {
        if (m->npeers >= MON_PEERS_MAX) {
            if (m->records_dropped++ == 0)
                ap_warn(MOD, "run %s: more than %d peers' records; the others are not shown",
                        m->run_id, MON_PEERS_MAX);
            return;
        }
        slot = &m->peers[m->npeers++];
        memset(slot, 0, sizeof *slot);
        snprintf(slot->id, sizeof slot->id, "%s", peer_id);
        slot->first_seen_ms = m->now_ms;
    } else {
        note_round(m, slot, &p, peer_id);
    }
    if (clamped && !slot->clamped_logged) {
        char sh[16];
        short_id(peer_id, sh);
        ap_warn(MOD, "peer %s: progress record with absurd monitor values; clamped", sh);
        slot->clamped_logged = true;
    }
    slot->p = p;
}

void mon_state_absorb(mon_state_t *m, const ap_dht_result_t *res, int64_t now_ms)
{
    m->now_ms = now_ms;
    m->refreshes++;
    for (size_t i = 0; res && res->found && res->is_dict && i < res->nrecords; i++) {
        const ap_dht_record_t *r = &res->records[i];
        char idtxt[AP_PEER_ID_STR_MAX];
        if (r->subkey_len < 9 || r->subkey_len - 8 >= sizeof idtxt ||
            memcmp(r->subkey, "[owner:", 7) != 0 || r->subkey[r->subkey_len - 1] != ']')
            continue;
        memcpy(idtxt, r->subkey + 7, r->subkey_len - 8);
        idtxt[r->subkey_len - 8] = 0;
        ap_progress_t p;
        memset(&p, 0, sizeof p);
        if (ap_peer_id_parse(&p.peer, idtxt) != 0) continue;
        ap_peer_id_t who = p.peer;
        m->records_seen++;
        int rc = ap_progress_decode(r->value, r->value_len, now_ms, 30000, &p);
        if (rc) {
            char sh[16];
            short_id(idtxt, sh);
            m->records_refused++;
            ap_warn(MOD, "refused progress record of %s: %s", sh, ap_strerror(rc));
            continue;
        }
        p.peer = who;
        if (p.refused) continue;
        mon_state_put(m, idtxt, &p);
    }
    mon_state_update(m);
}

static void push(mon_point_t *a, size_t *n, double x, double y, bool replace_same_x)
{
    if (replace_same_x && *n && a[*n - 1].x == x) {
        a[*n - 1].y = y;
        return;
    }
    if (*n == MON_HISTORY) {
        memmove(a, a + 1, (MON_HISTORY - 1) * sizeof *a);
        (*n)--;
    }
    a[(*n)++] = (mon_point_t){x, y};
}

static bool fresh(const mon_state_t *m, const mon_peer_t *p)
{
    return p->p.time_ms >= m->now_ms - MON_STALE_MS;
}

void mon_state_update(mon_state_t *m)
{
    if (!m->started_ms) m->started_ms = m->now_ms;
    uint64_t epoch = 0;
    double sps = 0, global = 0, loss = 0;
    int nloss = 0;
    for (size_t i = 0; i < m->npeers; i++) {
        const mon_peer_t *p = &m->peers[i];
        if (!fresh(m, p)) continue;
        if (p->p.has_config && p->p.config.target_batch_size)
            m->target_batch = p->p.config.target_batch_size;
        if (p->p.role == AP_AVG_AUX) continue;
        if (p->p.epoch > epoch) epoch = p->p.epoch;
        sps += p->p.samples_per_s;
    }
    for (size_t i = 0; i < m->npeers; i++) {
        const mon_peer_t *p = &m->peers[i];
        if (!fresh(m, p) || p->p.role == AP_AVG_AUX || p->p.epoch != epoch) continue;
        double ahead = (double)(m->now_ms > p->p.time_ms ? m->now_ms - p->p.time_ms : 0) / 1e3;
        global += (double)p->p.samples + p->p.samples_per_s * ahead;
        if (p->p.has_loss) loss += p->p.loss, nloss++; /* 0 is a loss too */
    }
    if (m->target_batch && global > (double)m->target_batch) global = (double)m->target_batch;
    m->epoch = epoch;
    m->global_sps = sps;
    m->global_samples = global;
    double left = (double)m->target_batch - global;
    m->eta_s = !m->target_batch ? INFINITY : left <= 0 ? 0 : sps > 0 ? left / sps : INFINITY;
    if (nloss) push(m->loss, &m->nloss, (double)epoch, loss / nloss, true);
    push(m->sps, &m->nsps, (double)(m->now_ms - m->started_ms) / 1e3, sps, false);
}

static void json_num(sb_t *b, double v)
{
    if (isfinite(v))
        sb_printf(b, "%.6g", v);
    else
        sb_printf(b, "null");
}

char *mon_render_json(const mon_state_t *m, size_t *len)
{
    sb_t b = {0};
    sb_printf(&b, "{\"run_id\":\"");
    for (const char *s = m->run_id; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            sb_printf(&b, "\\%c", ch);
        else if (ch < 0x20 || ch > 0x7e)
            sb_printf(&b, "\\u%04x", ch);
        else
            sb_printf(&b, "%c", ch);
    }
    double progress = m->target_batch ? m->global_samples / (double)m->target_batch : 0;
    sb_printf(&b, "\",\"now_ms\":%lld,\"epoch\":%llu,\"target_batch\":%llu,\"global_samples\":",
              (long long)m->now_ms, (unsigned long long)m->epoch,
              (unsigned long long)m->target_batch);
    json_num(&b, m->global_samples);
    sb_printf(&b, ",\"progress\":");
    json_num(&b, progress);
    sb_printf(&b, ",\"samples_per_s\":");
    json_num(&b, m->global_sps);
    sb_printf(&b, ",\"eta_s\":");
    json_num(&b, m->eta_s);
    sb_printf(&b, ",\"peers\":[");
    bool first = true;
    for (size_t i = 0; i < m->npeers; i++) {
        const mon_peer_t *p = &m->peers[i];
        char sh[16];
        short_id(p->id, sh);
        sb_printf(&b,
                  "%s{\"id\":\"%s\",\"short\":\"%s\",\"role\":\"%s\",\"reach\":\"%s\","
                  "\"fresh\":%s,\"epoch\":%llu,\"samples\":%lld,\"samples_per_s\":",
                  first ? "" : ",", p->id, sh, role_name(p->p.role), reach_name(p->p.role),
                  fresh(m, p) ? "true" : "false", (unsigned long long)p->p.epoch,
                  (long long)p->p.samples);
        first = false;
        json_num(&b, p->p.samples_per_s);
        sb_printf(&b, ",\"loss\":");
        json_num(&b, p->p.has_loss ? p->p.loss : NAN); /* null: none yet */
        sb_printf(&b, ",\"up\":");
        json_num(&b, p->p.up);
        sb_printf(&b, ",\"down\":");
        json_num(&b, p->p.down);
        sb_printf(&b,
                  ",\"bytes_sent\":%llu,\"bytes_received\":%llu,\"rounds\":%llu,"
                  "\"rounds_failed\":%llu,\"donor\":%s,\"last_seen_ms\":%lld}",
                  (unsigned long long)p->p.bytes_sent, (unsigned long long)p->p.bytes_received,
                  (unsigned long long)p->p.rounds, (unsigned long long)p->p.rounds_failed,
                  p->p.donor ? "true" : "false", (long long)p->p.time_ms);
    }
    sb_printf(&b, "],\"loss\":[");
    for (size_t i = 0; i < m->nloss; i++) {
        sb_printf(&b, "%s[%.0f,", i ? "," : "", m->loss[i].x);
        json_num(&b, m->loss[i].y);
        sb_printf(&b, "]");
    }
    sb_printf(&b, "],\"samples_per_s_history\":[");
    for (size_t i = 0; i < m->nsps; i++) {
        sb_printf(&b, "%s[%.3f,", i ? "," : "", m->sps[i].x);
        json_num(&b, m->sps[i].y);
        sb_printf(&b, "]");
    }
    sb_printf(&b, "],\"rounds\":[");
    for (size_t k = 0; k < m->nrounds; k++) {
        /* newest first */
        size_t i = (m->rounds_next + MON_ROUNDS_MAX - 1 - k) % MON_ROUNDS_MAX;
        const mon_round_t *r = &m->rounds[i];
        sb_printf(&b,
                  "%s{\"epoch\":%llu,\"peer\":\"%s\",\"group\":%u,\"ms\":%u,\"fraction\":%.4f,"
                  "\"failed\":%s}",
                  k ? "," : "", (unsigned long long)r->epoch, r->peer, r->group, r->ms, r->fraction,
                  r->failed ? "true" : "false");
    }
    sb_printf(&b,
              "],\"records\":{\"seen\":%llu,\"refused\":%llu,\"clamped\":%llu,\"dropped\":%llu},"
              "\"refreshes\":%llu,\"refresh_failures\":%llu}",
              (unsigned long long)m->records_seen, (unsigned long long)m->records_refused,
              (unsigned long long)m->records_clamped, (unsigned long long)m->records_dropped,
              (unsigned long long)m->refreshes, (unsigned long long)m->refresh_failures);
    return sb_finish(&b, len);
}

static void metric(sb_t *b, const char *name, const char *type, const char *help)
{
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void prom_num(sb_t *b, double v)
{
    if (isnan(v))
        sb_printf(b, "NaN\n");
    else if (isinf(v))
        sb_printf(b, v > 0 ? "+Inf\n" : "-Inf\n");
    else
        sb_printf(b, "%.17g\n", v);
}

char *mon_render_metrics(const mon_state_t *m, const char *extra, size_t *len)
{
    sb_t b = {0};
    uint32_t roles[3] = {0};
    double loss = 0, sent = 0, recv = 0, ok = 0, bad = 0;
    int nloss = 0;
    for (size_t i = 0; i < m->npeers; i++) {
        const mon_peer_t *p = &m->peers[i];
        sent += (double)p->p.bytes_sent;
        recv += (double)p->p.bytes_received;
        ok += (double)(p->p.rounds - p->p.rounds_failed);
        bad += (double)p->p.rounds_failed;
        if (!fresh(m, p)) continue;
        roles[p->p.role <= AP_AVG_AUX ? p->p.role : 0]++;
        if (p->p.epoch == m->epoch && p->p.has_loss) loss += p->p.loss, nloss++;
    }
    metric(&b, "apiary_epoch", "gauge", "Global epoch of the run (highest among fresh trainers).");
    sb_printf(&b, "apiary_epoch %llu\n", (unsigned long long)m->epoch);
    metric(&b, "apiary_target_batch_size", "gauge", "Samples per global epoch.");
    sb_printf(&b, "apiary_target_batch_size %llu\n", (unsigned long long)m->target_batch);
    metric(&b, "apiary_epoch_samples", "gauge", "Estimated samples accumulated in this epoch.");
    sb_printf(&b, "apiary_epoch_samples ");
    prom_num(&b, m->global_samples);
    metric(&b, "apiary_samples_per_second", "gauge", "Sum of the fresh trainers' speeds.");
    sb_printf(&b, "apiary_samples_per_second ");
    prom_num(&b, m->global_sps);
    metric(&b, "apiary_eta_seconds", "gauge", "Estimated seconds until the epoch is due.");
    sb_printf(&b, "apiary_eta_seconds ");
    prom_num(&b, m->eta_s);
    metric(&b, "apiary_loss", "gauge", "Mean of the last loss the peers of this epoch reported.");
    sb_printf(&b, "apiary_loss ");
    prom_num(&b, nloss ? loss / nloss : NAN);
    metric(&b, "apiary_peers", "gauge", "Peers with a fresh progress record, by role.");
    static const char *rn[3] = {"trainer", "client", "aux"};
    for (int r = 0; r < 3; r++) sb_printf(&b, "apiary_peers{role=\"%s\"} %u\n", rn[r], roles[r]);
    metric(&b, "apiary_bytes_sent_total", "counter",
           "Averaging payload bytes the peers report having sent.");
    sb_printf(&b, "apiary_bytes_sent_total ");
    prom_num(&b, sent);
    metric(&b, "apiary_bytes_received_total", "counter",
           "Averaging payload bytes the peers report having received.");
    sb_printf(&b, "apiary_bytes_received_total ");
    prom_num(&b, recv);
    metric(&b, "apiary_averaging_rounds_total", "counter",
           "Gradient averaging rounds the peers report, by outcome.");
    sb_printf(&b, "apiary_averaging_rounds_total{outcome=\"complete\"} ");
    prom_num(&b, ok);
    sb_printf(&b, "apiary_averaging_rounds_total{outcome=\"incomplete\"} ");
    prom_num(&b, bad);
    metric(&b, "apiary_progress_records_total", "counter",
           "Progress records read from the DHT, by what the monitor did with them.");
    sb_printf(&b, "apiary_progress_records_total{result=\"read\"} %llu\n",
              (unsigned long long)m->records_seen);
    sb_printf(&b, "apiary_progress_records_total{result=\"refused\"} %llu\n",
              (unsigned long long)m->records_refused);
    sb_printf(&b, "apiary_progress_records_total{result=\"clamped\"} %llu\n",
              (unsigned long long)m->records_clamped);
    sb_printf(&b, "apiary_progress_records_total{result=\"dropped\"} %llu\n",
              (unsigned long long)m->records_dropped);
    metric(&b, "apiary_dht_progress_records", "gauge",
           "Peers' progress records the monitor holds (fresh or not).");
    sb_printf(&b, "apiary_dht_progress_records %zu\n", m->npeers);
    metric(&b, "apiary_monitor_refreshes_total", "counter", "DHT reads of the run's records.");
    sb_printf(&b, "apiary_monitor_refreshes_total %llu\n", (unsigned long long)m->refreshes);
    metric(&b, "apiary_monitor_refresh_failures_total", "counter", "DHT reads that failed.");
    sb_printf(&b, "apiary_monitor_refresh_failures_total %llu\n",
              (unsigned long long)m->refresh_failures);
    metric(&b, "apiary_peer_epoch", "gauge", "Epoch of each fresh peer.");
    for (size_t i = 0; i < m->npeers; i++)
        if (fresh(m, &m->peers[i]))
            sb_printf(&b, "apiary_peer_epoch{peer=\"%s\"} %llu\n", m->peers[i].id,
                      (unsigned long long)m->peers[i].p.epoch);
    metric(&b, "apiary_peer_samples_per_second", "gauge", "Speed of each fresh peer.");
    for (size_t i = 0; i < m->npeers; i++)
        if (fresh(m, &m->peers[i])) {
            sb_printf(&b, "apiary_peer_samples_per_second{peer=\"%s\"} ", m->peers[i].id);
            prom_num(&b, m->peers[i].p.samples_per_s);
        }
    if (extra) sb_printf(&b, "%s", extra);
    return sb_finish(&b, len);
}
