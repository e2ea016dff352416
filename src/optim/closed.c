/* Closed runs: who may take part (include/apiary/run_token.h). A peer of a
 * closed run admits a progress record, a state request or a group join only
 * from the owner or a peer with a valid unexpired token that the owner has
 * not revoked. Sans-I/O: runtime.h and the DHT only. */
#include "collab_impl.h"

#include "apiary/log.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

int ap__closed_init(ap_collab_t *c)
{
    const ap_collab_config_t *cfg = &c->cfg;
    if (cfg->token) {
        if (ap_run_token_parse(cfg->token, &c->token) != 0) {
            ap_warn(OPT_MOD, "collab: the token given is not a run token (apiary run-token)");
            return AP_EINVAL;
        }
        c->has_token = true;
    }
    if (!cfg->run_owner) return 0;
    if (ap_peer_id_parse(&c->owner, cfg->run_owner) != 0) {
        ap_warn(OPT_MOD, "collab: the run owner \"%.64s\" is not a PeerID", cfg->run_owner);
        return AP_EINVAL;
    }
    int kl = ap_run_token_revoked_key(c->run_id, c->revoked_key, sizeof c->revoked_key);
    if (kl < 0) return kl;
    c->revoked_key_len = (size_t)kl;
    c->revoked = calloc(AP__REVOKED_MAX, sizeof *c->revoked);
    if (!c->revoked) return AP_ENOMEM;
    c->closed = true;
    return 0;
}

void ap__closed_free(ap_collab_t *c)
{
    free(c->revoked);
    c->revoked = NULL;
}

static bool is_revoked(const ap_collab_t *c, const ap_peer_id_t *peer)
{
    for (size_t i = 0; i < c->nrevoked; i++)
        if (ap_peer_id_eq(&c->revoked[i], peer)) return true;
    return false;
}

int ap__closed_check(ap_collab_t *c, const ap_peer_id_t *peer, const ap_run_token_t *tok)
{
    if (!c->closed || ap_peer_id_eq(peer, &c->owner)) return 0;
    if (is_revoked(c, peer)) return AP_ESTALE;
    if (!tok) return AP_ENOTFOUND;
    return ap_run_token_verify(tok, &c->owner, c->run_id, peer, ap_rt_wall_ms(c->rt));
}

void ap__closed_note(ap_collab_t *c, const ap_peer_id_t *peer, int why, const char *what)
{
    for (int i = 0; i < c->nunauth_log; i++)
        if (ap_peer_id_eq(&c->unauth_log[i].id, peer) && c->unauth_log[i].why == why) return;
    int k =
        c->nunauth_log < AP__REFUSED_LOG ? c->nunauth_log++ : c->unauth_next++ % AP__REFUSED_LOG;
    c->unauth_log[k].id = *peer;
    c->unauth_log[k].why = why;
    char sh[AP_PEER_SHORT_LEN];
    ap_warn(OPT_MOD, "run %s is closed: ignoring %s of peer %s (%s)", c->run_id, what,
            ap_peer_id_short(peer, sh), ap_run_token_why(why));
}

static void shut_out(ap_collab_t *c, int why)
{
    c->shut_out = true;
    c->st.shut_out = true;
    if (why == AP_ENOTFOUND)
        snprintf(c->refusal, sizeof c->refusal, "run %s is closed: ask its owner for a token",
                 c->run_id);
    else if (why == AP_EEXPIRED) {
        char when[32] = "?";
        time_t t = (time_t)(c->token.expires_ms / 1000);
        struct tm tm;
        if (gmtime_r(&t, &tm)) strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
        snprintf(c->refusal, sizeof c->refusal,
                 "run %s is closed: this peer's token expired at %s; ask its owner for a new one",
                 c->run_id, when);
    } else if (why == AP_ESTALE)
        snprintf(c->refusal, sizeof c->refusal,
                 "run %s is closed: its owner revoked this peer's token", c->run_id);
    else
        snprintf(c->refusal, sizeof c->refusal,
                 "run %s is closed: this peer's token is not valid here (%s); ask its owner "
                 "for a token",
                 c->run_id, ap_run_token_why(why));
    ap_info(OPT_MOD, "%s", c->refusal); /* the caller reports it (ap_collab_refusal) */
}

int ap__closed_self_check(ap_collab_t *c)
{
    if (c->shut_out) return AP_EPERM;
    int why = ap__closed_check(c, ap_rt_self(c->rt), c->has_token ? &c->token : NULL);
    if (!why) return 0;
    shut_out(c, why);
    return AP_EPERM;
}

void ap__closed_absorb_revoked(ap_collab_t *c, const ap_dht_result_t *res)
{
    if (!c->closed || !res || !res->found || !res->is_dict) return;
    for (size_t i = 0; i < res->nrecords; i++) {
        const ap_dht_record_t *r = &res->records[i];
        ap_peer_id_t p;
        /* only the owner's subkeys (the DHT checked the owner's signature) */
        if (ap_run_token_revoked_peer(&c->owner, r->subkey, r->subkey_len, &p) != 0) continue;
        if (is_revoked(c, &p) || c->nrevoked >= AP__REVOKED_MAX) continue;
        c->revoked[c->nrevoked++] = p;
        char sh[AP_PEER_SHORT_LEN];
        ap_info(OPT_MOD, "run %s: the owner revoked peer %s", c->run_id, ap_peer_id_short(&p, sh));
    }
    if (!c->shut_out && is_revoked(c, ap_rt_self(c->rt))) shut_out(c, AP_ESTALE);
}

bool ap__closed_exclude(void *arg, const ap_peer_id_t *peer)
{
    ap_collab_t *c = arg;
    if (ap__collab_is_self(c, peer)) return false;
    for (size_t i = 0; i < c->nview; i++)
        if (ap_peer_id_eq(&c->view[i].peer, peer)) return false; /* admitted record */
    char sh[AP_PEER_SHORT_LEN];
    c->st.unauthorized_requests++;
    ap_debug(OPT_MOD, "run %s is closed: group join of %s refused (no admitted record)", c->run_id,
             ap_peer_id_short(peer, sh));
    return true;
}
