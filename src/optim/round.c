/* Groups and averaging: the epoch decision after a fresh view, the group of
 * an epoch (READY window over the progress records, or the averaging
 * module's matchmaker), the gradient and state rounds, and delayed updates'
 * background rounds. Sans-I/O: runtime.h and the averaging service only. */
#include "collab_impl.h"

#include "apiary/log.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_member(const void *a, const void *b)
{
    return ap_peer_id_cmp(&((const ap_avg_member_t *)a)->id, &((const ap_avg_member_t *)b)->id);
}

/* byzantine_tolerant: a member that more than half of the other members'
 * records name as not delivering (progress.left_out) is left out of the
 * epoch's group. Every member reads the same records, so every member
 * leaves out the same peers; one peer's word leaves nobody out. */
static void leave_out_named(ap_collab_t *c, const ap_progress_t *const *rec)
{
    bool out[AP_AVG_MAX_PEERS] = {false};
    size_t n = c->nmembers, kept = 0;
    for (size_t x = 0; x < n; x++) {
        size_t named = 0;
        for (size_t m = 0; m < n; m++) {
            const ap_progress_t *r = m == x ? NULL : rec[m];
            for (uint32_t q = 0; r && q < r->nleft_out && q < AP_PROGRESS_LEFT_OUT_MAX; q++)
                if (ap_peer_id_eq(&r->left_out[q], &c->members[x].id)) {
                    named++;
                    break;
                }
        }
        out[x] = n > 2 && 2 * named > n - 1;
    }
    bool self_out = false;
    for (size_t x = 0; x < n; x++) {
        if (!out[x]) {
            c->members[kept++] = c->members[x];
            continue;
        }
        char sh[AP_PEER_SHORT_LEN];
        c->st.btard_left_out++;
        if (ap__collab_is_self(c, &c->members[x].id)) self_out = true;
        ap_warn(OPT_MOD,
                "epoch %llu: %s left out of the group: most members named it as not delivering "
                "in their last rounds",
                (unsigned long long)c->epoch,
                ap__collab_is_self(c, &c->members[x].id) ? "this peer"
                                                         : ap_peer_id_short(&c->members[x].id, sh));
    }
    c->nmembers = self_out ? 0 : kept;
}

/* The group of this epoch: fresh records in this epoch, ordered by PeerID. */
static void form_group(ap_collab_t *c, ap_avg_group_t *g, const char *what, bool collect)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    uint64_t samples = 0;
    const ap_progress_t *rec[AP_AVG_MAX_PEERS]; /* each member's record */
    if (collect) c->nmembers = 0;
    for (size_t i = 0; collect && i < c->nview && c->nmembers < AP_AVG_MAX_PEERS; i++) {
        const ap_progress_t *p = &c->view[i];
        if (p->epoch != c->epoch || !ap__collab_fresh(c, i, now)) continue;
        if (p->ready_ms <= 0 || p->ready_ms > c->cutoff_ms) continue; /* not in this round */
        if (ap__btard_banned(c, &p->peer)) continue;
        rec[c->nmembers] = p;
        ap_avg_member_t *m = &c->members[c->nmembers++];
        m->id = p->peer;
        m->role = p->role;
        m->up = p->up > 0 ? p->up : 1e6;
        m->down = p->down > 0 ? p->down : 1e6;
        if (p->role != AP_AVG_AUX) samples += (uint64_t)p->samples;
    }
    if (collect && c->cfg.byzantine_tolerant) leave_out_named(c, rec);
    if (collect) {
        qsort(c->members, c->nmembers, sizeof *c->members, cmp_member);
        c->round_samples = samples;
    }
    crypto_generichash_state hs;
    crypto_generichash_init(&hs, NULL, 0, AP_AVG_GROUP_ID_LEN);
    crypto_generichash_update(&hs, c->run_hash, 32);
    uint8_t e8[8];
    for (int i = 0; i < 8; i++) e8[i] = (uint8_t)(c->epoch >> (8 * i));
    crypto_generichash_update(&hs, e8, 8);
    crypto_generichash_update(&hs, (const uint8_t *)what, strlen(what));
    for (size_t i = 0; i < c->nmembers; i++) {
        crypto_generichash_update(&hs, c->members[i].id.b, AP_PEER_ID_LEN);
        uint8_t r = (uint8_t)c->members[i].role;
        crypto_generichash_update(&hs, &r, 1);
    }
    crypto_generichash_final(&hs, g->id, AP_AVG_GROUP_ID_LEN);
    g->members = c->members;
    g->n = c->nmembers;
}

static void round_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res);

static int start_round(ap_collab_t *c, const char *what, float *data, double weight)
{
    ap_avg_group_t g;
    form_group(c, &g, what, false);
    ap_allreduce_opts_t o = {0};
    o.chunk_elems = c->cfg.chunk_elems;
    o.codec = strcmp(what, "grad") == 0 ? c->cfg.codec : c->cfg.state_codec;
    if (c->cfg.byzantine_tolerant) o.codec = AP_AVG_CODEC_F32; /* the check hashes exact floats */
    o.deadline_at_us = ap_rt_now_us(c->rt) + c->cfg.averaging_timeout_us;
    uint64_t elems = strcmp(what, "grad") == 0 ? c->n : c->total;
    if (c->cfg.byzantine_tolerant && strcmp(what, "grad") == 0) {
        o.reduce = ap_btard_verified_clip; /* ButterflyClip, recorded for the check */
        o.reduce_arg = &c->vclip;
        ap__btard_before_round(c, data);
    }
    int rc = ap_allreduce_start(c->svc, &g, data, elems, weight, &o, round_done, c, &c->ar);
    if (rc == 0) c->refs++;
    return rc;
}

static void begin_state_round(ap_collab_t *c)
{
    c->phase = PH_STATE_AVG;
    float *data = NULL;
    double w = 0;
    if (c->cfg.role != AP_AVG_AUX) {
        memcpy(c->buf, c->bg ? c->shadow : c->params, c->n * sizeof(float));
        if (c->opt->state_count)
            memcpy(c->buf + c->n, c->opt->state, c->opt->state_count * sizeof(float));
        data = c->buf;
        w = 1.0;
    }
    int rc = start_round(c, "state", data, w);
    if (rc) {
        ap_warn(OPT_MOD, "epoch %llu: state averaging could not start: %s",
                (unsigned long long)c->epoch, ap_strerror(rc));
        ap__collab_after_epoch(c);
    }
}

void ap__collab_grad_finish(ap_collab_t *c, bool apply)
{
    if (apply && c->cfg.role != AP_AVG_AUX) ap__collab_apply_step(c, c->buf);
    ap__collab_enter_epoch(c, AP__EPOCH_STEPPED, c->epoch + 1, 0);
    ap_info(OPT_MOD, "epoch %llu reached (%zu peers, %llu samples)", (unsigned long long)c->epoch,
            c->nmembers, (unsigned long long)c->st.last_epoch_samples);
    ap__btard_fetch_bans(c);
    if (c->cfg.average_state_every && c->epoch % c->cfg.average_state_every == 0 &&
        c->nmembers > 1) {
        begin_state_round(c); /* same members, new group id */
        return;
    }
    ap__collab_after_epoch(c);
}

static void round_done(ap_rt_t *rt, void *arg, const ap_allreduce_result_t *res)
{
    ap_collab_t *c = arg;
    c->ar = NULL;
    if (c->dead) {
        ap__collab_unref(c);
        return;
    }
    ap__collab_unref(c);
    /* every round kind, whatever its outcome */
    c->st.bytes_sent += res->bytes_sent;
    c->st.bytes_received += res->bytes_received;
    if (c->phase == PH_AVERAGING) {
        double frac = c->cfg.role == AP_AVG_AUX ? 1.0 : res->averaged_fraction;
        c->st.last_group_size = (uint32_t)c->nmembers;
        c->st.last_averaged_fraction = frac;
        c->st.rounds++;
        c->st.last_round_ms = (uint32_t)(res->elapsed_us / 1000);
        if (res->status != 0 || frac < 1.0) {
            c->st.epochs_failed++;
            ap_warn(OPT_MOD,
                    "epoch %llu: averaging with %zu peers incomplete (%s, %.0f%% averaged): "
                    "stepping on local gradients for the rest",
                    (unsigned long long)c->epoch, c->nmembers,
                    res->status ? ap_strerror(res->status) : "parts failed", 100.0 * frac);
        }
        if (c->cfg.byzantine_tolerant) ap__btard_name_faults(c, res);
        if (ap__btard_verify(c, res)) return; /* byzantine_tolerant: checked first */
        if (c->cfg.byzantine_tolerant && c->cfg.role != AP_AVG_AUX && c->nmembers > 1) {
            /* a step that cannot be checked is not taken: stepping on local
             * gradients would leave this peer's parameters apart from the
             * others' (and its next gradients uncheckable) */
            c->st.btard_steps_dropped++;
            ap_warn(OPT_MOD, "epoch %llu: byzantine-tolerant: an unchecked step is dropped",
                    (unsigned long long)c->epoch);
            ap__collab_grad_finish(c, false);
            return;
        }
        ap__collab_grad_finish(c, true);
        return;
    }
    if (c->phase == PH_STATE_AVG) {
        if (res->status == 0 && res->averaged_fraction >= 1.0)
            c->st.state_rounds++;
        else
            ap_warn(OPT_MOD, "epoch %llu: state averaging incomplete (%s, %.0f%%)",
                    (unsigned long long)c->epoch,
                    res->status ? ap_strerror(res->status) : "parts failed",
                    100.0 * res->averaged_fraction);
        if (c->cfg.role != AP_AVG_AUX && res->elems_averaged > 0) {
            memcpy(c->bg ? c->shadow : c->params, c->buf, c->n * sizeof(float));
            if (c->opt->state_count)
                memcpy(c->opt->state, c->buf + c->n, c->opt->state_count * sizeof(float));
        }
        ap__collab_after_epoch(c);
    }
}

void ap__collab_after_epoch(ap_collab_t *c)
{
    c->aux_in_round = false;
    if (c->cb && c->mark_round_us) c->st.averaging_us += ap_rt_now_us(c->rt) - c->mark_round_us;
    c->mark_round_us = 0;
    ap__collab_report(c, NULL);
    ap__collab_update_stats(c);
    ap__collab_schedule_refresh(c);
    ap__collab_finish_user(c, 0);
}

/* Whether other (non-aux) peers with fresh records are in this epoch or later. */
static bool others_active(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (!ap__collab_is_self(c, &p->peer) && p->role != AP_AVG_AUX &&
            ap__collab_fresh(c, i, now) && p->epoch >= c->epoch)
            return true;
    }
    return false;
}

/* The gradient round with the members found (c->members, round_samples). */
static void round_with_members(ap_collab_t *c)
{
    c->phase = PH_AVERAGING;
    uint64_t now = ap_rt_now_us(c->rt);
    if (c->cb && c->mark_ready_us) c->st.group_wait_us += now - c->mark_ready_us;
    c->mark_ready_us = 0;
    c->mark_round_us = now;
    float *data = NULL;
    double w = 0;
    if (c->cfg.role != AP_AVG_AUX) {
        double inv = c->local_samples ? 1.0 / (double)c->local_samples : 0.0;
        for (size_t i = 0; i < c->n; i++) c->buf[i] = (float)(c->acc[i] * inv);
        data = c->buf;
        w = (double)c->local_samples;
    }
    if (c->nmembers <= 1 && others_active(c)) {
        /* others train in this run but none gathered with us: stepping
         * alone would fork the model. Wait for their next epoch and load
         * their state instead. */
        ap_info(OPT_MOD, "epoch %llu: no group formed with the other peers; waiting to load state",
                (unsigned long long)c->epoch);
        c->ready_ms = 0;
        ap__collab_report(c, NULL);
        ap__collab_schedule_refresh(c);
        ap__collab_finish_user(c, 0);
        return;
    }
    if (c->nmembers <= 1) {
        /* alone in the run: the local gradient is the global one */
        c->st.last_group_size = 1;
        c->st.last_averaged_fraction = 1.0;
        if (c->cfg.role != AP_AVG_AUX) ap__collab_apply_step(c, c->buf);
        ap__collab_enter_epoch(c, AP__EPOCH_STEPPED, c->epoch + 1, 0);
        ap__collab_after_epoch(c);
        return;
    }
    int rc = start_round(c, "grad", data, w);
    if (rc) {
        c->st.epochs_failed++;
        /* byzantine-tolerant: no unchecked step (it would set this peer's
         * parameters apart from the group's) */
        bool step = c->cfg.role != AP_AVG_AUX && !c->cfg.byzantine_tolerant;
        ap_warn(OPT_MOD, "epoch %llu: averaging could not start (%s): %s",
                (unsigned long long)c->epoch, ap_strerror(rc),
                step ? "stepping on local gradients" : "the step is dropped");
        if (step) ap__collab_apply_step(c, c->buf);
        ap__collab_enter_epoch(c, AP__EPOCH_STEPPED, c->epoch + 1, 0);
        ap__collab_after_epoch(c);
    }
}

static void run_round(ap_collab_t *c)
{
    ap_avg_group_t g;
    form_group(c, &g, "grad", true);
    round_with_members(c);
}

/* dht_matchmaking: the samples of the members' records (READY records: what
 * each averages), for stats.last_epoch_samples. */
static void member_samples(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    uint64_t samples = 0;
    for (size_t k = 0; k < c->nmembers; k++) {
        if (c->members[k].role == AP_AVG_AUX) continue;
        if (ap__collab_is_self(c, &c->members[k].id)) {
            samples += c->local_samples;
            continue;
        }
        for (size_t i = 0; i < c->nview; i++) {
            const ap_progress_t *p = &c->view[i];
            if (ap_peer_id_eq(&p->peer, &c->members[k].id) && p->epoch == c->epoch &&
                ap__collab_fresh(c, i, now)) {
                samples += (uint64_t)p->samples;
                break;
            }
        }
    }
    c->round_samples = samples;
}

static void matched_fetched(ap_collab_t *c)
{
    member_samples(c);
    round_with_members(c);
}

static void matched(ap_rt_t *rt, void *arg, int status, const ap_avg_group_t *g)
{
    ap_collab_t *c = arg;
    c->search = NULL;
    if (c->dead) {
        ap__collab_unref(c);
        return;
    }
    ap__collab_unref(c);
    if (status == 0 && g && g->n > 1) {
        size_t n = g->n < AP_AVG_MAX_PEERS ? g->n : AP_AVG_MAX_PEERS;
        memcpy(c->members, g->members, n * sizeof *c->members);
        c->nmembers = n;
        ap__collab_fetch(c, matched_fetched); /* the members' READY records, for the stats */
        return;
    }
    if (status && status != AP_ETIMEDOUT)
        ap_info(OPT_MOD, "epoch %llu: matchmaking failed: %s", (unsigned long long)c->epoch,
                ap_strerror(status));
    /* no group: alone in the run (step alone) or others elsewhere (load) */
    c->nmembers = 1;
    c->members[0].id = *ap_rt_self(c->rt);
    c->members[0].role = c->cfg.role;
    c->round_samples = c->cfg.role == AP_AVG_AUX ? 0 : c->local_samples;
    round_with_members(c);
}

/* Became ready after this epoch's group closed: the others step without
 * us; we load their state once they report the next epoch. */
static void missed_group(ap_collab_t *c)
{
    ap_info(OPT_MOD, "epoch %llu: missed the averaging group (ready %lld ms after it closed)",
            (unsigned long long)c->epoch, (long long)(c->ready_ms - c->cutoff_ms));
    ap__collab_drop_epoch_samples(c, "missed the round");
    c->ready_ms = 0;
    ap__collab_report(c, NULL);
    ap__collab_schedule_refresh(c);
    ap__collab_finish_user(c, 0);
}

static void mm_decide(ap_collab_t *c)
{
    int64_t first = ap__collab_first_ready(c);
    int64_t win = (int64_t)(c->cfg.matchmaking_window_us / 1000);
    if (!first || first > c->ready_ms) first = c->ready_ms;
    c->cutoff_ms = first + win;
    if (c->ready_ms > c->cutoff_ms) {
        missed_group(c);
        return;
    }
    run_round(c);
}

/* dht_matchmaking: look for this epoch's group with the averaging module's
 * matchmaker. Returns false if the peer is late (handled). */
static void start_search(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    uint32_t want = 0;
    for (size_t i = 0; i < c->nview; i++)
        if (c->view[i].epoch == c->epoch && ap__collab_fresh(c, i, now)) want++;
    if (want < 2) want = 2;
    if (want > AP_AVG_MAX_PEERS) want = AP_AVG_MAX_PEERS;
    /* the configuration's digest in the key: joins only reach peers of the
     * same configuration */
    int kl = snprintf(c->mm_key, sizeof c->mm_key, "%s_grad_%llu_%s", c->run_id,
                      (unsigned long long)c->epoch, c->cfg_hex);
    ap_avg_match_t m = {.key = (const uint8_t *)c->mm_key,
                        .key_len = (size_t)kl,
                        .target_group_size = want,
                        .min_group_size = 2,
                        .deadline_at_us = ap_rt_now_us(c->rt) + c->cfg.matchmaking_window_us,
                        /* closed run: joins only from peers of admitted records */
                        .exclude = c->closed || c->banlist ? ap__btard_exclude : NULL,
                        .exclude_arg = c};
    ap_avg_member_t me = {.id = *ap_rt_self(c->rt),
                          .role = c->cfg.role,
                          .up = c->cfg.up > 0 ? c->cfg.up : 1e6,
                          .down = c->cfg.down > 0 ? c->cfg.down : 1e6};
    c->refs++;
    int rc = ap_avg_match_start(c->mm, &m, &me, matched, c, &c->search);
    if (rc) {
        c->search = NULL;
        ap_warn(OPT_MOD, "epoch %llu: matchmaking could not start: %s",
                (unsigned long long)c->epoch, ap_strerror(rc));
        matched(c->rt, c, rc, NULL); /* drops the reference */
    }
}

static void mm_tick(ap_rt_t *rt, void *arg)
{
    ap_collab_t *c = arg;
    c->mm_timer = 0;
    ap__collab_fetch(c, mm_decide);
}

/* No other peer of the run has had a fresh record (any role, any epoch)
 * since this peer started, or since the last one was seen, for as long as a
 * silent peer takes to count as gone (a peer starting with us has reported
 * by then): no group can form, so there is no window to wait. A peer that
 * joins later reads our record at its start and downloads; once we read its
 * record, epochs wait for groups again. */
static bool alone_in_run(ap_collab_t *c)
{
    if (c->cfg.role == AP_AVG_AUX || c->others_seen_us) return false;
    uint64_t since = c->alone_since_us > c->started_us ? c->alone_since_us : c->started_us;
    uint64_t grace = (uint64_t)(AP__REPORT_MISSED * c->report_ms + AP__REPORT_SLACK_MS) * 1000;
    return ap_rt_now_us(c->rt) - since >= grace;
}

/* The epoch is due (or others are ap__collab_gathering): mark READY and wait the
 * matchmaking window (plus half of it for the others' stores to land); alone
 * in the run, step at once. */
void ap__collab_begin_averaging(ap_collab_t *c)
{
    if (alone_in_run(c)) {
        c->st.lone_epochs++;
        c->mark_ready_us = 0;
        c->nmembers = 1;
        c->members[0].id = *ap_rt_self(c->rt);
        c->members[0].role = c->cfg.role;
        c->round_samples = c->local_samples;
        round_with_members(c); /* steps alone (the view was read just now) */
        return;
    }
    c->phase = PH_AVERAGING;
    c->mark_ready_us = ap_rt_now_us(c->rt);
    int64_t now = ap_rt_wall_ms(c->rt);
    c->ready_ms = now > c->epoch_start_ms ? now : c->epoch_start_ms;
    c->ready_sps = c->sps; /* as in the READY record (the background cap's share) */
    ap__collab_report(c, NULL);
    int64_t first = ap__collab_first_ready(c);
    int64_t win = (int64_t)(c->cfg.matchmaking_window_us / 1000);
    if (c->mm) {
        /* the epoch's window (from the first READY record) closed before
         * we were ready: late, as in the READY-window scheme */
        c->cutoff_ms = (first && first < c->ready_ms ? first : c->ready_ms) + win;
        bool bg = c->shadow && c->cb;
        if (bg) {
            memcpy(c->shadow, c->params, c->acc_bytes);
            c->bg = true;
            c->bg_start_ms = now;
            c->bg_stepped = false;
        }
        if (c->ready_ms > c->cutoff_ms) {
            missed_group(c);
            return;
        }
        start_search(c);
        if (bg && c->cb && c->phase == PH_AVERAGING) ap__collab_release_user(c, 0);
        return;
    }
    uint64_t wait = c->cfg.matchmaking_window_us + c->cfg.matchmaking_window_us / 2;
    if (first && first < c->ready_ms) {
        int64_t left = first + win - c->ready_ms; /* the group closes at first + window */
        wait = (uint64_t)(left > 0 ? left : 0) * 1000 + c->cfg.matchmaking_window_us / 2;
    }
    c->mm_timer = ap_rt_timer_start(c->rt, wait, 0, mm_tick, c);
    if (c->shadow && c->cb) {
        /* delayed updates: the caller computes the next batches while the
         * group gathers and averages; the step goes to shadow */
        memcpy(c->shadow, c->params, c->acc_bytes);
        c->bg = true;
        c->bg_start_ms = now;
        c->bg_stepped = false;
        ap__collab_release_user(c, 0);
    }
}

static void wait_tick(ap_rt_t *rt, void *arg);

/* Delayed updates: the most this peer accumulates for the next epoch while a
 * background round runs: its share of the target by speed, among the records
 * of this epoch and the next (frozen during the round: READY records), and
 * at most max_local_samples. */
uint64_t ap__collab_bg_cap(ap_collab_t *c)
{
    int64_t now = ap_rt_wall_ms(c->rt);
    double mine = c->ready_sps > 0 ? c->ready_sps : c->sps > 0 ? c->sps : 1.0, sum = mine;
    for (size_t i = 0; i < c->nview; i++) {
        const ap_progress_t *p = &c->view[i];
        if (ap__collab_is_self(c, &p->peer) || !ap__collab_fresh(c, i, now) ||
            p->role == AP_AVG_AUX)
            continue;
        if (p->epoch != c->epoch && p->epoch != c->epoch + 1) continue;
        sum += p->samples_per_s > 0 ? p->samples_per_s : mine;
    }
    double share = ceil((double)c->cfg.target_batch_size * mine / sum);
    uint64_t cap = share < 1 ? 1 : (uint64_t)share;
    if (c->cfg.max_local_samples && c->cfg.max_local_samples < cap) cap = c->cfg.max_local_samples;
    return cap;
}

/* An out-of-sync peer's download ended. */
static void resync_done(ap_collab_t *c, int status, uint64_t epoch, uint64_t optim_step)
{
    if (status == 0) {
        c->resync = false;
        ap_info(OPT_MOD, "back in sync: the group's parameters of epoch %llu loaded",
                (unsigned long long)epoch);
    }
    ap__collab_load_done(c, status, epoch, optim_step);
}

/* After a fresh view: behind -> download; due -> average; else go on. */
void ap__collab_decide(ap_collab_t *c)
{
    if (c->refused || c->shut_out) {
        ap__collab_finish_user(c, c->refused ? AP_ECONFIG : AP_EPERM);
        return;
    }
    /* out of sync (byzantine-tolerant check): the group's parameters from
     * a member in sync as soon as one's record is at this epoch */
    if (c->resync && ap__state_donors(c, c->epoch) > 0) {
        collab_phase_t phase = c->phase;
        ap__collab_drop_epoch_samples(c, "this peer's parameters were not the group's");
        c->phase = PH_DOWNLOADING;
        c->mark_dl_us = ap_rt_now_us(c->rt);
        if (ap__state_download(c, c->buf, c->epoch, resync_done) == 0) return;
        c->phase = phase;
        c->mark_dl_us = 0;
    }
    ap__estimate_t e;
    ap__collab_estimate(c, &e);
    ap__collab_update_stats(c);
    int avail = e.max_epoch > c->epoch ? ap__state_donors(c, c->epoch + 1) : 0;
    if (e.max_epoch > c->epoch && avail != AP_EAGAIN) {
        ap_info(OPT_MOD, "behind: epoch %llu, peers at %llu; downloading state",
                (unsigned long long)c->epoch, (unsigned long long)e.max_epoch);
        ap__collab_drop_epoch_samples(c, "the others are in a later epoch");
        c->phase = PH_DOWNLOADING;
        c->mark_dl_us = ap_rt_now_us(c->rt);
        if (avail > 0 && ap__state_download(c, c->buf, c->epoch + 1, ap__collab_load_done) == 0)
            return;
        /* no donor: adopt the epoch, keep the parameters */
        ap_warn(OPT_MOD, "behind but no donor answers; jumping to epoch %llu with local state",
                (unsigned long long)e.max_epoch);
        ap__collab_enter_epoch(c, AP__EPOCH_JUMPED, e.max_epoch, 0);
        ap__collab_load_done(c, AP_ENOTFOUND, 0, 0);
        return;
    }
    /* behind, but every donor ahead failed recently (back-off): train on in
     * this epoch meanwhile */
    if (e.reported >= c->cfg.target_batch_size || ap__collab_gathering(c)) {
        ap__collab_begin_averaging(c);
        return;
    }
    if (ap__collab_at_local_cap(c)) {
        /* max_local_samples: wait (callback held) until the epoch is due */
        if (c->phase != PH_WAITING) c->st.submits_held++;
        c->phase = PH_WAITING;
        uint64_t p = c->cfg.matchmaking_window_us / 4;
        if (p > c->cfg.min_refresh_us) p = c->cfg.min_refresh_us;
        if (p < 10000) p = 10000;
        c->wait_timer = ap_rt_timer_start(c->rt, p, 0, wait_tick, c);
        return;
    }
    ap__collab_finish_user(c, 0);
}

void ap__collab_fetch_decide(ap_collab_t *c)
{
    ap__collab_fetch(c, ap__collab_decide);
}

static void wait_tick(ap_rt_t *rt, void *arg)
{
    ap_collab_t *c = arg;
    c->wait_timer = 0;
    if (c->phase != PH_WAITING) return;
    /* keep our record fresh while we wait */
    if (ap_rt_now_us(rt) - c->last_report_us > (uint64_t)c->cfg.stale_ms * 1000 / 3)
        ap__collab_report(c, NULL);
    ap__collab_fetch(c, ap__collab_decide);
}
