/* Byzantine-tolerant training in the collaborative optimizer: every
 * gradient round is a ButterflyClip round with the recording reducer, then
 * checked by the verified step (apiary/btard.h) before it is applied;
 * convicted peers go into the ban list (the DHT's and this peer's own),
 * which matchmaking and the group of the READY window leave out. Sans-I/O. */
#include "collab_impl.h"

#include "apiary/log.h"
#include "base/buf.h"

#include <stdlib.h>
#include <string.h>

#define BAN_TTL_MS (7 * 24 * 3600 * 1000LL)

int ap__btard_collab_init(ap_collab_t *c)
{
    if (!c->cfg.byzantine_tolerant) return 0;
    c->vclip.clip.cfg = ap_btard_clip_cfg_default();
    c->vclip.clip.cfg.tau = c->cfg.btard_tau;
    c->vclip.clip.cfg.max_iter = (int)c->cfg.btard_max_iter;
    c->vclip.clip.ws = ap_btard_clip_ws_new();
    c->vclip.shift = c->cfg.btard_attack_shift;
    c->banlist = ap_btard_banlist_new();
    c->bsent = c->cfg.role != AP_AVG_AUX ? malloc(c->n * sizeof(float)) : NULL;
    if (!c->vclip.clip.ws || !c->banlist || (c->cfg.role != AP_AVG_AUX && !c->bsent))
        return AP_ENOMEM;
    int rc = ap_btard_svc_new(c->rt, &c->bmprng);
    if (rc == 0) rc = ap_btard_step_svc_new(c->rt, c->bmprng, &c->bstep);
    if (rc) {
        ap_warn(OPT_MOD, "byzantine-tolerant: the check services could not start: %s",
                ap_strerror(rc));
        return rc;
    }
    if (c->dht) (void)ap_dht_add_validator(c->dht, ap_btard_ban_validator, NULL);
    return 0;
}

/* On ap_collab_free: the running check ends (its callback sees c->dead). */
void ap__btard_collab_stop(ap_collab_t *c)
{
    ap_btard_step_svc_free(c->bstep);
    c->bstep = NULL;
    ap_btard_svc_free(c->bmprng);
    c->bmprng = NULL;
}

void ap__btard_collab_release(ap_collab_t *c)
{
    ap_btard_clip_ws_free(c->vclip.clip.ws);
    ap_btard_vclip_close(&c->vclip);
    ap_btard_banlist_free(c->banlist);
    free(c->bsent);
}

bool ap__btard_banned(const ap_collab_t *c, const ap_peer_id_t *peer)
{
    return c->banlist && ap_btard_banlist_has(c->banlist, peer);
}

bool ap_collab_banned(const ap_collab_t *c, const ap_peer_id_t *peer)
{
    return c && peer && ap__btard_banned(c, peer);
}

/* Epochs a member that did not deliver stays named in this peer's records:
 * it is left out meanwhile, so no new round can clear it; then it is tried
 * again. */
#define NAMED_EPOCHS 4

void ap__btard_name_faults(ap_collab_t *c, const ap_allreduce_result_t *res)
{
    if (!res->member_faults || c->cfg.role == AP_AVG_AUX || res->status == AP_ECANCELED) return;
    for (size_t j = 0; j < c->nmembers; j++) {
        if (!res->member_faults[j]) continue; /* 0 for this peer */
        size_t k = 0;
        while (k < c->nshun && !ap_peer_id_eq(&c->shun[k].peer, &c->members[j].id)) k++;
        if (k == c->nshun) {
            if (c->nshun < AP_PROGRESS_LEFT_OUT_MAX)
                c->nshun++;
            else /* full: the entry that expires first goes */
                for (size_t q = k = 0; q < c->nshun; q++)
                    if (c->shun[q].until < c->shun[k].until) k = q;
        }
        c->shun[k].peer = c->members[j].id;
        c->shun[k].until = c->epoch + 1 + NAMED_EPOCHS;
        c->st.btard_named++;
        char sh[AP_PEER_SHORT_LEN];
        ap_info(OPT_MOD, "epoch %llu: %s did not deliver (%s): named in this peer's records",
                (unsigned long long)c->epoch, ap_peer_id_short(&c->members[j].id, sh),
                res->member_faults[j] & AP_ALLREDUCE_PART_FAILED ? "its part failed"
                                                                 : "dropped as a sender");
    }
}

static bool named_here(const ap_collab_t *c, const ap_peer_id_t *peer)
{
    for (size_t i = 0; i < c->nshun; i++)
        if (c->shun[i].until > c->epoch && ap_peer_id_eq(&c->shun[i].peer, peer)) return true;
    return false;
}

bool ap__btard_exclude(void *arg, const ap_peer_id_t *peer)
{
    ap_collab_t *c = arg;
    if (ap__btard_banned(c, peer)) return true;
    /* the DHT matchmaker's group is the leader's: this peer's own word */
    if (c->cfg.byzantine_tolerant && named_here(c, peer)) return true;
    return c->closed && ap__closed_exclude(arg, peer);
}

static void ban_add(ap_collab_t *c, const ap_peer_id_t *p, const char *how)
{
    if (ap_btard_banlist_add(c->banlist, p) == 1) {
        char s[AP_PEER_SHORT_LEN];
        c->st.peers_banned++;
        ap_warn(OPT_MOD, "peer %s banned (%s)", ap_peer_id_short(p, s), how);
    }
}

static void published(ap_dht_t *dht, void *arg, int status, int n_stored)
{
    (void)dht, (void)n_stored;
    ap_collab_t *c = arg;
    if (status && !c->dead)
        ap_info(OPT_MOD, "byzantine-tolerant: a ban could not be stored: %s", ap_strerror(status));
    ap__collab_unref(c);
}

static void bans_fetched(void *arg, int status, const ap_peer_id_t *banned, size_t n)
{
    ap_collab_t *c = arg;
    c->bans_fetching = false;
    if (!c->dead && status == 0)
        for (size_t i = 0; i < n; i++) ban_add(c, &banned[i], "ban record in the DHT");
    ap__collab_unref(c);
}

/* Reads the run's bans from the DHT (newcomers learn them; async). */
void ap__btard_fetch_bans(ap_collab_t *c)
{
    if (!c->cfg.byzantine_tolerant || !c->dht || c->bans_fetching) return;
    c->refs++;
    c->bans_fetching = true;
    if (ap_btard_bans_fetch(c->dht, c->run_hash, bans_fetched, c) != 0) {
        c->bans_fetching = false;
        c->refs--;
    }
}

/* The gradient check's minibatch seed of peer at this epoch (collab.h). */
static void grad_seed(const ap_collab_t *c, const ap_peer_id_t *peer, uint8_t seed[32])
{
    static const char tag[] = "apiary/btard/grad";
    uint8_t le[8];
    ap__put_le64(le, c->epoch);
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, 32);
    crypto_generichash_update(&h, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&h, c->run_hash, 32);
    crypto_generichash_update(&h, le, sizeof le);
    crypto_generichash_update(&h, peer->b, sizeof peer->b);
    crypto_generichash_final(&h, seed, 32);
}

static int grad_of(ap_collab_t *c, const ap_peer_id_t *peer, float *out)
{
    uint8_t seed[32];
    grad_seed(c, peer, seed);
    return c->cfg.btard_grad(c->cfg.btard_grad_arg, c->params, c->n, c->epoch, seed, out);
}

/* The verified step's grad hook: member's vector recomputed. */
static int member_grad(void *arg, uint32_t member, float *out)
{
    ap_collab_t *c = arg;
    if (member >= c->nmembers) return AP_EINVAL;
    return grad_of(c, &c->members[member].id, out);
}

/* Before a gradient round: with the gradient check, what this peer sends is
 * its gradient on its seeded minibatch (so that validators recompute the
 * same bits); keep what it sends. */
void ap__btard_before_round(ap_collab_t *c, float *data)
{
    ap_btard_vclip_reset(&c->vclip);
    if (data && c->cfg.btard_validators) {
        int rc = grad_of(c, ap_rt_self(c->rt), c->bsent);
        if (rc == 0)
            memcpy(data, c->bsent, c->n * sizeof(float));
        else
            ap_warn(OPT_MOD,
                    "epoch %llu: the gradient on the seeded minibatch failed (%s): sending the "
                    "mean of the submitted ones",
                    (unsigned long long)c->epoch, ap_strerror(rc));
    }
    if (c->bsent && data) memcpy(c->bsent, data, c->n * sizeof(float));
}

static void verdict(void *arg, const ap_btard_verdict_t *v)
{
    ap_collab_t *c = arg;
    c->verifying = false;
    if (c->dead) {
        ap__collab_unref(c);
        return;
    }
    ap__collab_unref(c);
    int64_t exp = ap_rt_wall_ms(c->rt) + BAN_TTL_MS;
    for (size_t i = 0; i < v->nconvicted; i++) {
        ban_add(c, &v->bans[i].peer, ap_btard_fault_name(v->bans[i].fault));
        if (!c->dht) continue;
        c->refs++;
        if (ap_btard_ban_publish(c->dht, &v->bans[i], exp, published, c) != 0) c->refs--;
    }
    for (size_t i = 0; i < v->nexcluded; i++) {
        char sh[AP_PEER_SHORT_LEN];
        ap_info(OPT_MOD,
                "epoch %llu: %s missed a deadline of the round's check: left out, not banned",
                (unsigned long long)c->epoch, ap_peer_id_short(&v->excluded[i], sh));
    }
    if (v->out_of_sync) {
        c->resync = true;
        c->nresync = 0;
        for (size_t i = 0; i < v->nin_sync && c->nresync < AP_BTARD_STEP_MAX_PEERS; i++)
            if (!ap__collab_is_self(c, &v->in_sync[i]))
                c->resync_from[c->nresync++] = v->in_sync[i];
        ap_warn(OPT_MOD,
                "epoch %llu: this peer's parameters are not the group's (%zu of %zu members "
                "hold another state): reloading them from those members",
                (unsigned long long)c->epoch, v->nin_sync, c->nmembers);
    }
    if (!v->apply) {
        c->st.btard_steps_dropped++;
        ap_warn(OPT_MOD,
                "epoch %llu: the round's check failed (%s; %u of %u parts passed): the step is "
                "dropped",
                (unsigned long long)c->epoch, v->status ? ap_strerror(v->status) : "verdict",
                v->parts_ok, v->parts_ok + v->parts_failed);
    }
    ap__collab_grad_finish(c, v->apply);
}

bool ap__btard_verify(ap_collab_t *c, const ap_allreduce_result_t *res)
{
    if (!c->cfg.byzantine_tolerant || !c->bstep || c->cfg.role == AP_AVG_AUX || res->status != 0 ||
        res->averaged_fraction < 1.0 || c->nmembers < 2 || c->nmembers > AP_BTARD_STEP_MAX_PEERS)
        return false;
    uint64_t *counts = malloc(c->nmembers * sizeof *counts);
    ap_peer_id_t *ids = malloc(c->nmembers * sizeof *ids);
    int rc = counts && ids ? ap_btard_split(c->members, c->nmembers, c->n, counts) : AP_ENOMEM;
    if (rc == 0) {
        for (size_t i = 0; i < c->nmembers; i++) ids[i] = c->members[i].id;
        ap_btard_step_cfg_t s = {.step = c->epoch,
                                 .peers = ids,
                                 .n = c->nmembers,
                                 .counts = counts,
                                 .sent = c->bsent,
                                 .result = c->buf,
                                 .weight = (double)c->local_samples,
                                 .vclip = &c->vclip,
                                 .tau = c->cfg.btard_tau,
                                 .done = verdict,
                                 .arg = c,
                                 .validators = c->cfg.btard_validators,
                                 .grad = c->cfg.btard_validators ? member_grad : NULL,
                                 .grad_arg = c,
                                 .attack = c->cfg.btard_attack_step};
        memcpy(s.run, c->run_hash, AP_BTARD_HASH_LEN);
        /* the public state the gradients were computed on: members that
         * hold other parameters are found out (and reload theirs) */
        uint8_t state[AP_BTARD_HASH_LEN];
        ap_btard_hash_floats(c->params, c->n, state);
        s.state = state;
        c->refs++;
        c->verifying = true;
        rc = ap_btard_step_start(c->bstep, &s);
        if (rc) {
            c->refs--;
            c->verifying = false;
        }
    }
    free(counts);
    free(ids);
    if (rc) {
        ap_warn(OPT_MOD, "epoch %llu: the round's check could not start (%s): the step is dropped",
                (unsigned long long)c->epoch, ap_strerror(rc));
        c->st.btard_steps_dropped++;
        ap__collab_grad_finish(c, false);
    }
    return true;
}
