/* Matchmaking over the DHT (docs/averaging.md, "Matchmaking").
 *
 * A search declares this peer in the DHT dictionary of the group key, polls
 * that dictionary, and asks the earliest declared peer that comes before it
 * in the (expiration, PeerID) order to lead it. Requests only ever go from a
 * later peer to an earlier one, so no cycle of peers waiting for each other
 * can form. A leader holds accepted requests and answers them all with the
 * group when it begins. Sans-I/O: runtime.h and the DHT only. */
#include "averaging/matchmaking.h"

#include "apiary/log.h"
#include "averaging/allreduce.h"
#include "base/codec.h"

#include "matchmaking.pb-c.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD          "avg.mm"
#define DEF_TARGET   16
#define DEF_MIN      2
#define DEF_POLL_US  200000ull
#define DEF_GRACE_US 2000000ull
#define DHT_PREFIX   "/apiary/mm/1/"
#define TRIED_MAX    64

/* ---- wire ------------------------------------------------------------------ */

int ap__mm_order(int64_t a_exp, const ap_peer_id_t *a, int64_t b_exp, const ap_peer_id_t *b)
{
    if (a_exp != b_exp) return a_exp < b_exp ? -1 : 1;
    return ap_peer_id_cmp(a, b);
}

static void member_to_pb(const ap__mm_member_t *m, bool with_id, Apiary__Mm__Member *pb,
                         char **addrs)
{
    apiary__mm__member__init(pb);
    if (with_id) {
        pb->peer.data = (uint8_t *)m->id.b;
        pb->peer.len = AP_PEER_ID_LEN;
    }
    pb->role = (uint32_t)m->role;
    pb->up = m->up;
    pb->down = m->down;
    pb->expiration_ms = m->exp_ms;
    pb->closed = m->closed;
    for (int i = 0; i < m->naddrs; i++) addrs[i] = (char *)m->addrs[i];
    pb->n_addrs = (size_t)m->naddrs;
    pb->addrs = addrs;
    if (with_id && m->gather_len) {
        pb->gather.data = (uint8_t *)m->gather;
        pb->gather.len = m->gather_len;
    }
}

static int member_from_pb(const Apiary__Mm__Member *pb, bool with_id, ap__mm_member_t *m)
{
    memset(m, 0, sizeof *m);
    if (!pb) return AP_ECORRUPT;
    if (with_id) {
        if (ap_peer_id_from_bytes(&m->id, pb->peer.data, pb->peer.len)) return AP_ECORRUPT;
    } else if (pb->peer.len) {
        return AP_ECORRUPT;
    }
    if (pb->role > AP_AVG_AUX) return AP_ECORRUPT;
    if (!isfinite(pb->up) || !isfinite(pb->down) || !(pb->up > 0) || !(pb->down > 0))
        return AP_ECORRUPT;
    if (pb->n_addrs > AP__MM_ADDRS_MAX) return AP_ECORRUPT;
    for (size_t i = 0; i < pb->n_addrs; i++) {
        size_t n = strlen(pb->addrs[i]);
        if (n == 0 || n >= AP_RT_ADDR_MAX) return AP_ECORRUPT;
        memcpy(m->addrs[i], pb->addrs[i], n + 1);
    }
    m->naddrs = (int)pb->n_addrs;
    if (pb->gather.len > AP__MM_GATHER_MAX || (!with_id && pb->gather.len)) return AP_ECORRUPT;
    if (pb->gather.len) memcpy(m->gather, pb->gather.data, pb->gather.len);
    m->gather_len = pb->gather.len;
    m->role = (ap_avg_role_t)pb->role;
    m->up = pb->up;
    m->down = pb->down;
    m->exp_ms = pb->expiration_ms;
    m->closed = pb->closed;
    return 0;
}

static int pack_out(size_t need, uint8_t **out, size_t *len)
{
    if (need > AP__MM_MSG_MAX) return AP_EMSGSIZE;
    *out = malloc(need ? need : 1);
    if (!*out) return AP_ENOMEM;
    *len = need;
    return 0;
}

int ap__mm_decl_encode(const ap__mm_member_t *m, uint8_t **out, size_t *len)
{
    Apiary__Mm__Member pb;
    char *addrs[AP__MM_ADDRS_MAX];
    member_to_pb(m, false, &pb, addrs);
    int rc = pack_out(apiary__mm__member__get_packed_size(&pb), out, len);
    if (rc) return rc;
    apiary__mm__member__pack(&pb, *out);
    return 0;
}

int ap__mm_decl_decode(const uint8_t *b, size_t len, ap__mm_member_t *out)
{
    if (len > AP__MM_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Mm__Member *pb = apiary__mm__member__unpack(NULL, len, b);
    if (!pb) return AP_ECORRUPT;
    int rc = member_from_pb(pb, false, out);
    apiary__mm__member__free_unpacked(pb, NULL);
    return rc;
}

int ap__mm_req_encode(const uint8_t *key, size_t key_len, const ap__mm_member_t *self, bool leave,
                      uint8_t **out, size_t *len)
{
    if (key_len == 0 || key_len > AP__MM_KEY_MAX) return AP_EINVAL;
    Apiary__Mm__JoinRequest pb = APIARY__MM__JOIN_REQUEST__INIT;
    Apiary__Mm__Member me;
    char *addrs[AP__MM_ADDRS_MAX];
    member_to_pb(self, true, &me, addrs);
    pb.group_key.data = (uint8_t *)key;
    pb.group_key.len = key_len;
    pb.self = &me;
    pb.leave = leave;
    int rc = pack_out(apiary__mm__join_request__get_packed_size(&pb), out, len);
    if (rc) return rc;
    apiary__mm__join_request__pack(&pb, *out);
    return 0;
}

int ap__mm_req_decode(const uint8_t *b, size_t len, uint8_t *key_out, size_t *key_len,
                      ap__mm_member_t *self, bool *leave)
{
    if (len > AP__MM_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Mm__JoinRequest *pb = apiary__mm__join_request__unpack(NULL, len, b);
    if (!pb) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    if (pb->group_key.len == 0 || pb->group_key.len > AP__MM_KEY_MAX) goto out;
    if ((rc = member_from_pb(pb->self, true, self))) goto out;
    if (self->closed) {
        rc = AP_ECORRUPT;
        goto out;
    }
    memcpy(key_out, pb->group_key.data, pb->group_key.len);
    *key_len = pb->group_key.len;
    *leave = pb->leave;
out:
    apiary__mm__join_request__free_unpacked(pb, NULL);
    return rc;
}

int ap__mm_resp_encode(const ap__mm_resp_t *r, uint8_t **out, size_t *len)
{
    if (r->n > AP__MM_GROUP_MAX) return AP_EINVAL;
    Apiary__Mm__JoinResponse pb = APIARY__MM__JOIN_RESPONSE__INIT;
    Apiary__Mm__Member red;
    char *red_addrs[AP__MM_ADDRS_MAX];
    Apiary__Mm__Member *mem = calloc(r->n ? r->n : 1, sizeof *mem);
    Apiary__Mm__Member **memp = calloc(r->n ? r->n : 1, sizeof *memp);
    char **addrs = calloc((r->n ? r->n : 1) * AP__MM_ADDRS_MAX, sizeof *addrs);
    int rc = AP_ENOMEM;
    if (!mem || !memp || !addrs) goto out;
    pb.code = r->code;
    pb.reason = (char *)r->reason;
    if (r->code == AP__MM_REDIRECT) {
        member_to_pb(&r->redirect, true, &red, red_addrs);
        pb.redirect = &red;
    }
    if (r->code == AP__MM_BEGIN) {
        pb.group_id.data = (uint8_t *)r->group_id;
        pb.group_id.len = AP_AVG_GROUP_ID_LEN;
        for (size_t i = 0; i < r->n; i++) {
            member_to_pb(&r->members[i], true, &mem[i], addrs + i * AP__MM_ADDRS_MAX);
            memp[i] = &mem[i];
        }
        pb.members = memp;
        pb.n_members = r->n;
    }
    rc = pack_out(apiary__mm__join_response__get_packed_size(&pb), out, len);
    if (rc == 0) apiary__mm__join_response__pack(&pb, *out);
out:
    free(mem);
    free(memp);
    free(addrs);
    return rc;
}

int ap__mm_resp_decode(const uint8_t *b, size_t len, ap__mm_resp_t *out)
{
    memset(out, 0, sizeof *out);
    if (len > AP__MM_MSG_MAX) return AP_EMSGSIZE;
    Apiary__Mm__JoinResponse *pb = apiary__mm__join_response__unpack(NULL, len, b);
    if (!pb) return AP_ECORRUPT;
    int rc = AP_ECORRUPT;
    out->code = pb->code;
    size_t rl = pb->reason ? strlen(pb->reason) : 0;
    if (rl >= AP__MM_REASON_MAX) goto out;
    if (rl) memcpy(out->reason, pb->reason, rl + 1);
    switch (pb->code) {
    case AP__MM_BEGIN:
        if (pb->group_id.len != AP_AVG_GROUP_ID_LEN) goto out;
        if (pb->n_members < 2 || pb->n_members > AP__MM_GROUP_MAX) goto out;
        memcpy(out->group_id, pb->group_id.data, AP_AVG_GROUP_ID_LEN);
        out->members = calloc(pb->n_members, sizeof *out->members);
        if (!out->members) {
            rc = AP_ENOMEM;
            goto out;
        }
        out->n = pb->n_members;
        for (size_t i = 0; i < pb->n_members; i++) {
            if (member_from_pb(pb->members[i], true, &out->members[i])) goto bad;
            for (size_t j = 0; j < i; j++) /* a peer listed twice */
                if (ap_peer_id_eq(&out->members[j].id, &out->members[i].id)) goto bad;
        }
        break;
    case AP__MM_REDIRECT:
        if (member_from_pb(pb->redirect, true, &out->redirect)) goto out;
        break;
    case AP__MM_REJECTED:
    case AP__MM_FULL:
        break;
    default:
        goto out;
    }
    rc = 0;
    goto out;
bad:
    free(out->members);
    out->members = NULL;
    out->n = 0;
out:
    apiary__mm__join_response__free_unpacked(pb, NULL);
    return rc;
}

/* ---- searches ----------------------------------------------------------------- */

typedef struct follower {
    ap__mm_member_t m;
    ap_rpc_req_t *req;
} follower_t;

struct ap_avg_search {
    ap_avg_matchmaker_t *mm;
    ap_avg_search_t *next;
    uint8_t key[AP__MM_KEY_MAX];
    size_t key_len;
    char dht_key[sizeof DHT_PREFIX + 2 * AP__MM_KEY_MAX];
    char subkey[AP_PEER_ID_STR_MAX + 16];
    ap__mm_member_t self;
    uint32_t target, min;
    uint64_t deadline_us, poll_us, grace_us;
    ap_avg_match_fn cb;
    void *arg;
    bool (*exclude)(void *arg, const ap_peer_id_t *peer);
    void *exclude_arg;
    /* state */
    bool following; /* a join call is pending */
    ap__mm_member_t leader;
    uint64_t call_id;
    bool expired; /* own deadline passed */
    follower_t *fol;
    size_t nfol, capfol;
    struct {
        ap_peer_id_t id;
        uint64_t until_us; /* skip this peer until then (UINT64_MAX = for good) */
    } tried[TRIED_MAX];
    size_t ntried, tried_at;
    ap__mm_member_t *cand; /* last DHT view: earlier peers, sorted */
    size_t ncand;
    uint64_t poll_timer, deadline_timer;
    int dht_ops;   /* DHT gets/stores in flight (they hold the object) */
    bool finished; /* cb ran (or abandoned): free once dht_ops == 0 */
};

struct ap_avg_matchmaker {
    ap_rt_t *rt;
    ap_dht_t *dht;
    ap_avg_search_t *searches;
    bool abandoned;
};

static ap_avg_search_t *find_search(ap_avg_matchmaker_t *mm, const uint8_t *key, size_t len)
{
    for (ap_avg_search_t *s = mm->searches; s; s = s->next)
        if (!s->finished && s->key_len == len && memcmp(s->key, key, len) == 0) return s;
    return NULL;
}

static void unlink_search(ap_avg_search_t *s)
{
    ap_avg_matchmaker_t *mm = s->mm;
    for (ap_avg_search_t **p = &mm->searches; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            return;
        }
}

static void maybe_free(ap_avg_search_t *s)
{
    if (s->finished && s->dht_ops == 0) {
        free(s->fol);
        free(s->cand);
        free(s);
    }
}

static void respond(ap_rpc_req_t *req, const ap__mm_resp_t *r)
{
    uint8_t *b;
    size_t n;
    int rc = ap__mm_resp_encode(r, &b, &n);
    if (rc) {
        ap_rpc_respond_error(req, rc, "matchmaking: cannot encode");
        return;
    }
    ap_rpc_respond(req, b, n);
    free(b);
}

static void respond_code(ap_rpc_req_t *req, uint32_t code, const char *reason,
                         const ap__mm_member_t *redirect)
{
    ap__mm_resp_t r;
    memset(&r, 0, sizeof r);
    r.code = code;
    if (reason) snprintf(r.reason, sizeof r.reason, "%s", reason);
    if (redirect) r.redirect = *redirect;
    respond(req, &r);
}

static void add_addrs(ap_rt_t *rt, const ap__mm_member_t *m)
{
    for (int i = 0; i < m->naddrs; i++) ap_rt_add_addr(rt, &m->id, m->addrs[i]);
}

static void leave_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                       const char *errmsg)
{
    (void)rt, (void)arg, (void)resp, (void)len;
    if (status)
        ap_log(AP_LOG_DEBUG, MOD, "leave not delivered: %s%s%s", ap_err_name(status),
               errmsg ? ": " : "", errmsg ? errmsg : "");
}

/* LEAVE: this follower gives up the join its leader holds, so the leader
 * drops it at once (it would otherwise begin a group with a member that is
 * gone, and the round would wait connect_grace_us for it). Fire and forget:
 * the answer is only logged. */
static void send_leave(ap_avg_search_t *s)
{
    uint8_t *b;
    size_t n;
    if (ap__mm_req_encode(s->key, s->key_len, &s->self, true, &b, &n)) return;
    ap_rpc_opts_t o = {.timeout_us = s->grace_us, .max_resp = AP__MM_MSG_MAX};
    if (!ap_rt_rpc_call(s->mm->rt, &s->leader.id, AP_AVG_MATCH_PROTO, b, n, &o, leave_done, NULL))
        ap_log(AP_LOG_DEBUG, MOD, "cannot send leave");
    free(b);
}

/* Ends the search: held followers get "rejected" (unless the group began and
 * they were answered), timers and the call stop, cb runs. */
static void finish(ap_avg_search_t *s, int status, const ap_avg_group_t *g)
{
    if (s->finished) return;
    ap_rt_t *rt = s->mm->rt;
    s->finished = true;
    unlink_search(s);
    if (s->poll_timer) ap_rt_timer_stop(rt, s->poll_timer);
    if (s->deadline_timer) ap_rt_timer_stop(rt, s->deadline_timer);
    s->poll_timer = s->deadline_timer = 0;
    uint64_t call = s->call_id;
    s->call_id = 0;
    if (call) {
        ap_rt_rpc_cancel(rt, call); /* its done sees finished and returns */
        send_leave(s);
    }
    for (size_t i = 0; i < s->nfol; i++)
        respond_code(s->fol[i].req, AP__MM_REJECTED,
                     status == AP_ECANCELED ? "leader canceled" : "leader found no group", NULL);
    s->nfol = 0;
    s->cb(rt, s->arg, status, g);
    maybe_free(s);
}

static int fol_cmp(const void *a, const void *b)
{
    const follower_t *x = a, *y = b;
    return ap__mm_order(x->m.exp_ms, &x->m.id, y->m.exp_ms, &y->m.id);
}

static void to_avg_member(const ap__mm_member_t *m, ap_avg_member_t *out)
{
    memset(out, 0, sizeof *out);
    out->id = m->id;
    out->role = m->role;
    out->up = m->up;
    out->down = m->down;
}

/* The group handed to the callback: members and their gathered bytes, both
 * pointing into mm (valid while mm is). */
static int to_avg_group(const ap__mm_member_t *mm, size_t n, const uint8_t id[AP_AVG_GROUP_ID_LEN],
                        ap_avg_group_t *g)
{
    ap_avg_member_t *am = calloc(n, sizeof *am);
    ap_avg_gather_t *ga = calloc(n, sizeof *ga);
    if (!am || !ga) {
        free(am);
        free(ga);
        return AP_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        to_avg_member(&mm[i], &am[i]);
        ga[i].data = mm[i].gather_len ? mm[i].gather : NULL;
        ga[i].len = mm[i].gather_len;
    }
    memset(g, 0, sizeof *g);
    memcpy(g->id, id, AP_AVG_GROUP_ID_LEN);
    g->members = am;
    g->n = n;
    g->gather = ga;
    return 0;
}

static void free_avg_group(ap_avg_group_t *g)
{
    free((void *)g->members);
    free((void *)g->gather);
}

static void closed_stored(ap_dht_t *dht, void *arg, int status, int nstored)
{
    (void)dht, (void)status, (void)nstored;
    ap_avg_search_t *s = arg;
    s->dht_ops--;
    maybe_free(s);
}

/* Marks the declaration closed (a later-expiring copy with closed = true) so
 * that searchers stop asking this peer. Best effort. */
static void declare_closed(ap_avg_search_t *s)
{
    ap__mm_member_t d = s->self;
    d.closed = true;
    d.gather_len = 0;
    uint8_t *b;
    size_t n;
    if (ap__mm_decl_encode(&d, &b, &n)) return;
    ap_dht_record_t rec = {.key = (const uint8_t *)s->dht_key,
                           .key_len = strlen(s->dht_key),
                           .subkey = (const uint8_t *)s->subkey,
                           .subkey_len = strlen(s->subkey),
                           .value = b,
                           .value_len = n,
                           .expiration_ms = s->self.exp_ms + 1};
    if (ap_dht_store(s->mm->dht, &rec, closed_stored, s) == 0) s->dht_ops++;
    free(b);
}

/* The leader begins: itself first, then its followers in search order. */
static void begin(ap_avg_search_t *s)
{
    ap_rt_t *rt = s->mm->rt;
    size_t n = 1 + s->nfol;
    ap__mm_resp_t r;
    memset(&r, 0, sizeof r);
    r.code = AP__MM_BEGIN;
    ap_rt_rand_bytes(rt, r.group_id, sizeof r.group_id);
    qsort(s->fol, s->nfol, sizeof *s->fol, fol_cmp);
    r.members = calloc(n, sizeof *r.members);
    if (!r.members) {
        finish(s, AP_ENOMEM, NULL);
        return;
    }
    r.n = n;
    r.members[0] = s->self;
    for (size_t i = 0; i < s->nfol; i++) r.members[1 + i] = s->fol[i].m;
    ap_avg_group_t g;
    if (to_avg_group(r.members, n, r.group_id, &g)) {
        free(r.members);
        finish(s, AP_ENOMEM, NULL);
        return;
    }
    uint8_t *b;
    size_t len;
    int rc = ap__mm_resp_encode(&r, &b, &len);
    for (size_t i = 0; i < s->nfol; i++) {
        if (rc == 0)
            ap_rpc_respond(s->fol[i].req, b, len);
        else
            ap_rpc_respond_error(s->fol[i].req, rc, "matchmaking: cannot encode");
    }
    s->nfol = 0;
    if (rc == 0) free(b);
    char sid[AP_PEER_SHORT_LEN];
    ap_log(AP_LOG_DEBUG, MOD, "leader %s begins a group of %zu", ap_peer_id_short(&s->self.id, sid),
           n);
    declare_closed(s);
    finish(s, rc, rc ? NULL : &g);
    free_avg_group(&g);
    free(r.members);
}

static bool was_tried(const ap_avg_search_t *s, const ap_peer_id_t *id)
{
    uint64_t now = ap_rt_now_us(s->mm->rt);
    size_t n = s->ntried < TRIED_MAX ? s->ntried : TRIED_MAX;
    for (size_t i = 0; i < n; i++)
        if (ap_peer_id_eq(&s->tried[i].id, id)) return s->tried[i].until_us > now;
    return false;
}

/* Skips a peer for good (it refused, is full, failed) or, for one that was
 * following someone itself (it answered "redirect" to a leader this peer
 * cannot use), until the next poll: it may lead once its own join fails. */
static void mark_tried(ap_avg_search_t *s, const ap_peer_id_t *id, bool for_good)
{
    uint64_t until = for_good ? UINT64_MAX : ap_rt_now_us(s->mm->rt) + s->poll_us;
    size_t n = s->ntried < TRIED_MAX ? s->ntried : TRIED_MAX;
    for (size_t i = 0; i < n; i++)
        if (ap_peer_id_eq(&s->tried[i].id, id)) {
            if (s->tried[i].until_us != UINT64_MAX) s->tried[i].until_us = until;
            return;
        }
    s->tried[s->tried_at].id = *id;
    s->tried[s->tried_at].until_us = until;
    s->tried_at = (s->tried_at + 1) % TRIED_MAX;
    s->ntried++;
}

static void join(ap_avg_search_t *s, const ap__mm_member_t *leader);

/* Past its own deadline a peer that is not following ends: it begins if it
 * leads enough followers, else fails. */
static void at_deadline(ap_avg_search_t *s)
{
    if (s->following || s->finished) return;
    if (1 + s->nfol >= s->min)
        begin(s);
    else
        finish(s, AP_ETIMEDOUT, NULL);
}

/* Asks the earliest untried candidate, if any. */
static void try_next(ap_avg_search_t *s)
{
    if (s->finished || s->following) return;
    /* past the deadline no new join starts: waiting stays bounded by
     * deadline + answer grace */
    if (s->expired) {
        at_deadline(s);
        return;
    }
    for (size_t i = 0; i < s->ncand; i++) {
        if (was_tried(s, &s->cand[i].id)) continue;
        join(s, &s->cand[i]);
        return;
    }
}

static void join_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                      const char *errmsg)
{
    ap_avg_search_t *s = arg;
    if (s->finished) return;
    s->call_id = 0;
    s->following = false;
    char sl[AP_PEER_SHORT_LEN];
    ap_peer_id_short(&s->leader.id, sl);
    if (status) {
        mark_tried(s, &s->leader.id, true);
        ap_log(AP_LOG_DEBUG, MOD, "join %s failed: %s%s%s", sl, ap_err_name(status),
               errmsg ? ": " : "", errmsg ? errmsg : "");
        if (status != AP_ECANCELED) try_next(s);
        return;
    }
    ap__mm_resp_t r;
    int rc = ap__mm_resp_decode(resp, len, &r);
    mark_tried(s, &s->leader.id, rc || r.code != AP__MM_REDIRECT);
    if (rc) {
        ap_log(AP_LOG_WARN, MOD, "bad join response from %s: %s", sl, ap_err_name(rc));
        try_next(s);
        return;
    }
    if (r.code == AP__MM_BEGIN) {
        /* the leader first, this peer in it, and every member's declaration */
        bool ok = ap_peer_id_eq(&r.members[0].id, &s->leader.id);
        size_t me = r.n;
        for (size_t i = 0; i < r.n; i++)
            if (ap_peer_id_eq(&r.members[i].id, &s->self.id)) me = i;
        ok = ok && me < r.n;
        if (!ok) {
            ap_log(AP_LOG_WARN, MOD, "group from %s lacks its leader or this peer: refused", sl);
            free(r.members);
            try_next(s);
            return;
        }
        ap_avg_group_t g;
        if (to_avg_group(r.members, r.n, r.group_id, &g)) {
            free(r.members);
            finish(s, AP_ENOMEM, NULL);
            return;
        }
        for (size_t i = 0; i < r.n; i++)
            if (i != me) add_addrs(rt, &r.members[i]);
        declare_closed(s);
        finish(s, 0, &g);
        free_avg_group(&g);
        free(r.members);
        return;
    }
    if (r.code == AP__MM_REDIRECT) {
        /* only ever towards an earlier peer: the order stays strict */
        if (ap__mm_order(r.redirect.exp_ms, &r.redirect.id, s->self.exp_ms, &s->self.id) < 0 &&
            !was_tried(s, &r.redirect.id) && !s->expired) {
            ap_log(AP_LOG_DEBUG, MOD, "%s redirects", sl);
            join(s, &r.redirect);
            return;
        }
        ap_log(AP_LOG_DEBUG, MOD, "redirect from %s ignored (not earlier or tried)", sl);
    } else {
        ap_log(AP_LOG_DEBUG, MOD, "%s: %s (%s)", sl, r.code == AP__MM_FULL ? "full" : "rejected",
               r.reason);
    }
    try_next(s);
}

static void join(ap_avg_search_t *s, const ap__mm_member_t *leader)
{
    ap_rt_t *rt = s->mm->rt;
    /* a peer that follows redirects its own waiting followers to its leader */
    for (size_t i = 0; i < s->nfol; i++) respond_code(s->fol[i].req, AP__MM_REDIRECT, NULL, leader);
    s->nfol = 0;
    uint8_t *b;
    size_t n;
    int rc = ap__mm_req_encode(s->key, s->key_len, &s->self, false, &b, &n);
    if (rc) {
        finish(s, rc, NULL);
        return;
    }
    s->leader = *leader;
    add_addrs(rt, leader);
    uint64_t now = ap_rt_now_us(rt);
    uint64_t left = s->deadline_us > now ? s->deadline_us - now : 0;
    ap_rpc_opts_t o = {.timeout_us = left + s->grace_us, .max_resp = AP__MM_MSG_MAX};
    s->following = true;
    s->call_id = ap_rt_rpc_call(rt, &leader->id, AP_AVG_MATCH_PROTO, b, n, &o, join_done, s);
    free(b);
    if (!s->call_id) {
        s->following = false;
        mark_tried(s, &leader->id, true);
        if (s->expired) at_deadline(s);
    }
}

static int cand_cmp(const void *a, const void *b)
{
    const ap__mm_member_t *x = a, *y = b;
    return ap__mm_order(x->exp_ms, &x->id, y->exp_ms, &y->id);
}

static void poll_dht(ap_avg_search_t *s);

static void poll_timer_fn(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_avg_search_t *s = arg;
    s->poll_timer = 0;
    poll_dht(s);
}

static void got_view(ap_dht_t *dht, void *arg, int status, const ap_dht_result_t *res)
{
    (void)dht;
    ap_avg_search_t *s = arg;
    if (s->finished || status == AP_ECANCELED) {
        s->dht_ops--;
        maybe_free(s);
        return;
    }
    ap_rt_t *rt = s->mm->rt;
    if (status == 0 && res->found && res->is_dict) {
        ap__mm_member_t *c = calloc(res->nrecords ? res->nrecords : 1, sizeof *c);
        size_t nc = 0;
        for (size_t i = 0; c && i < res->nrecords; i++) {
            const ap_dht_record_t *r = &res->records[i];
            /* subkey "[owner:<id>]": the DHT checked the owner's signature */
            char sk[AP_PEER_ID_STR_MAX + 16];
            if (r->subkey_len < 9 || r->subkey_len >= sizeof sk) continue;
            memcpy(sk, r->subkey, r->subkey_len);
            sk[r->subkey_len] = 0;
            if (memcmp(sk, "[owner:", 7) || sk[r->subkey_len - 1] != ']') continue;
            sk[r->subkey_len - 1] = 0;
            ap__mm_member_t m;
            if (ap__mm_decl_decode(r->value, r->value_len, &m)) continue;
            if (ap_peer_id_parse(&m.id, sk + 7)) continue;
            if (m.closed || m.exp_ms != r->expiration_ms) continue;
            if (ap__mm_order(m.exp_ms, &m.id, s->self.exp_ms, &s->self.id) >= 0) continue;
            if (s->exclude && s->exclude(s->exclude_arg, &m.id)) continue;
            c[nc++] = m;
        }
        qsort(c, nc, sizeof *c, cand_cmp);
        free(s->cand);
        s->cand = c;
        s->ncand = c ? nc : 0;
    }
    /* this get still holds s (dht_ops): try_next may finish the search */
    if (!s->following) try_next(s);
    if (!s->finished && !s->expired)
        s->poll_timer = ap_rt_timer_start(rt, s->poll_us, 0, poll_timer_fn, s);
    s->dht_ops--;
    maybe_free(s);
}

static void poll_dht(ap_avg_search_t *s)
{
    if (s->finished || s->expired) return;
    int rc =
        ap_dht_get(s->mm->dht, (const uint8_t *)s->dht_key, strlen(s->dht_key), true, got_view, s);
    if (rc == 0)
        s->dht_ops++;
    else
        s->poll_timer = ap_rt_timer_start(s->mm->rt, s->poll_us, 0, poll_timer_fn, s);
}

static void declared(ap_dht_t *dht, void *arg, int status, int nstored)
{
    (void)dht, (void)nstored;
    ap_avg_search_t *s = arg;
    s->dht_ops--;
    if (!s->finished && status)
        ap_log(AP_LOG_WARN, MOD, "declaration not stored: %s", ap_err_name(status));
    maybe_free(s);
}

static void deadline_fn(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_avg_search_t *s = arg;
    s->deadline_timer = 0;
    s->expired = true;
    if (s->poll_timer) ap_rt_timer_stop(s->mm->rt, s->poll_timer);
    s->poll_timer = 0;
    at_deadline(s);
}

/* ---- incoming joins ---------------------------------------------------------- */

static void on_join(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    ap_avg_matchmaker_t *mm = arg;
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    uint8_t key[AP__MM_KEY_MAX];
    size_t key_len;
    ap__mm_member_t q;
    bool leave = false;
    char sq[AP_PEER_SHORT_LEN];
    ap_peer_id_short(ap_rpc_req_peer(req), sq);
    int rc = ap__mm_req_decode(data, len, key, &key_len, &q, &leave);
    if (rc) {
        ap_log(AP_LOG_WARN, MOD, "bad join request from %s: %s", sq, ap_err_name(rc));
        ap_rpc_respond_error(req, AP_EPROTO, "bad join request");
        return;
    }
    if (!ap_peer_id_eq(&q.id, ap_rpc_req_peer(req))) {
        ap_log(AP_LOG_WARN, MOD, "join from %s names another peer: refused", sq);
        respond_code(req, AP__MM_REJECTED, "peer id is not the caller's", NULL);
        return;
    }
    ap_avg_search_t *s = find_search(mm, key, key_len);
    if (leave) { /* drop its held join at once; both calls are answered "rejected" */
        for (size_t i = 0; s && i < s->nfol; i++) {
            if (!ap_peer_id_eq(&s->fol[i].m.id, &q.id)) continue;
            ap_log(AP_LOG_DEBUG, MOD, "%s left", sq);
            respond_code(s->fol[i].req, AP__MM_REJECTED, "left", NULL);
            memmove(&s->fol[i], &s->fol[i + 1], (s->nfol - i - 1) * sizeof *s->fol);
            s->nfol--;
            respond_code(req, AP__MM_REJECTED, "left", NULL);
            return;
        }
        respond_code(req, AP__MM_REJECTED, "not held here", NULL);
        return;
    }
    if (!s) {
        respond_code(req, AP__MM_REJECTED, "not looking for this group", NULL);
        return;
    }
    if (s->exclude && s->exclude(s->exclude_arg, &q.id)) {
        ap_log(AP_LOG_DEBUG, MOD, "join from excluded %s: rejected", sq);
        respond_code(req, AP__MM_REJECTED, "excluded", NULL);
        return;
    }
    if (ap__mm_order(s->self.exp_ms, &s->self.id, q.exp_ms, &q.id) >= 0) {
        /* joins only go to earlier peers: this keeps the wait-for graph acyclic */
        respond_code(req, AP__MM_REJECTED, "leader does not expire earlier", NULL);
        return;
    }
    if (s->following) {
        respond_code(req, AP__MM_REDIRECT, NULL, &s->leader);
        return;
    }
    for (size_t i = 0; i < s->nfol; i++)
        if (ap_peer_id_eq(&s->fol[i].m.id, &q.id)) {
            ap_log(AP_LOG_WARN, MOD, "%s joined twice: refused", sq);
            respond_code(req, AP__MM_REJECTED, "already joined", NULL);
            return;
        }
    if (1 + s->nfol >= s->target) {
        respond_code(req, AP__MM_FULL, "group full", NULL);
        return;
    }
    if (s->nfol == s->capfol) {
        size_t cap = s->capfol ? 2 * s->capfol : 8;
        follower_t *f = realloc(s->fol, cap * sizeof *f);
        if (!f) {
            ap_rpc_respond_error(req, AP_ENOMEM, NULL);
            return;
        }
        s->fol = f;
        s->capfol = cap;
    }
    s->fol[s->nfol].m = q;
    s->fol[s->nfol].req = req;
    s->nfol++;
    add_addrs(rt, &q);
    if (1 + s->nfol >= s->target) begin(s);
}

/* ---- public ------------------------------------------------------------------ */

int ap_avg_matchmaker_new(ap_avg_service_t *svc, ap_dht_t *dht, ap_avg_matchmaker_t **out)
{
    if (!svc || !dht || !out) return AP_EINVAL;
    ap_rt_t *rt = ap__avg_service_rt(svc);
    if (ap_dht_runtime(dht) != rt) return AP_EINVAL;
    ap_avg_matchmaker_t *mm = calloc(1, sizeof *mm);
    if (!mm) return AP_ENOMEM;
    mm->rt = rt;
    mm->dht = dht;
    int rc = ap_rt_rpc_register(rt, AP_AVG_MATCH_PROTO, AP__MM_MSG_MAX, on_join, mm);
    if (rc) {
        free(mm);
        return rc;
    }
    *out = mm;
    return 0;
}

int ap_avg_matchmaker_free(ap_avg_matchmaker_t *mm)
{
    if (!mm) return 0;
    if (mm->searches) return AP_EBUSY;
    ap_rt_rpc_unregister(mm->rt, AP_AVG_MATCH_PROTO);
    free(mm);
    return 0;
}

void ap__avg_matchmaker_abandon(ap_avg_matchmaker_t *mm)
{
    if (!mm) return;
    while (mm->searches) {
        ap_avg_search_t *s = mm->searches;
        mm->searches = s->next;
        s->finished = true;
        s->dht_ops = 0; /* the DHT was freed first: no callback is pending */
        maybe_free(s);
    }
    free(mm);
}

static void start_cb(ap_rt_t *rt, void *arg)
{
    (void)rt;
    ap_avg_search_t *s = arg;
    s->poll_timer = 0;
    poll_dht(s);
}

int ap_avg_match_start(ap_avg_matchmaker_t *mm, const ap_avg_match_t *m,
                       const ap_avg_member_t *self, ap_avg_match_fn cb, void *arg,
                       ap_avg_search_t **out)
{
    if (!mm || !m || !self || !cb || !m->key) return AP_EINVAL;
    if (m->key_len == 0 || m->key_len > AP__MM_KEY_MAX) return AP_EINVAL;
    if (!ap_peer_id_eq(&self->id, ap_rt_self(mm->rt))) return AP_EINVAL;
    if (self->role > AP_AVG_AUX || !isfinite(self->up) || !isfinite(self->down) ||
        !(self->up > 0) || !(self->down > 0))
        return AP_EINVAL;
    uint32_t target = m->target_group_size ? m->target_group_size : DEF_TARGET;
    uint32_t min = m->min_group_size ? m->min_group_size : DEF_MIN;
    if (target > AP__MM_GROUP_MAX || min < 2 || min > target) return AP_EINVAL;
    uint64_t now = ap_rt_now_us(mm->rt);
    if (m->deadline_at_us <= now) return AP_EINVAL;
    if (m->gather_len > AP_AVG_GATHER_MAX || (m->gather_len && !m->gather)) return AP_EINVAL;
    if (find_search(mm, m->key, m->key_len)) return AP_EBUSY;
    ap_avg_search_t *s = calloc(1, sizeof *s);
    if (!s) return AP_ENOMEM;
    s->mm = mm;
    memcpy(s->key, m->key, m->key_len);
    s->key_len = m->key_len;
    memcpy(s->dht_key, DHT_PREFIX, sizeof DHT_PREFIX - 1);
    ap__hex_encode(s->dht_key + sizeof DHT_PREFIX - 1, m->key, m->key_len);
    char pid[AP_PEER_ID_STR_MAX];
    snprintf(s->subkey, sizeof s->subkey, "[owner:%s]", ap_peer_id_str(&self->id, pid));
    s->self.id = self->id;
    s->self.role = self->role;
    s->self.up = self->up;
    s->self.down = self->down;
    s->self.exp_ms = ap_rt_wall_ms(mm->rt) + (int64_t)((m->deadline_at_us - now) / 1000);
    if (m->gather_len) memcpy(s->self.gather, m->gather, m->gather_len);
    s->self.gather_len = m->gather_len;
    char(*addrs)[AP_RT_ADDR_MAX] = s->self.addrs;
    int na = ap_rt_listen_addrs(mm->rt, addrs, AP__MM_ADDRS_MAX, false);
    s->self.naddrs = na < 0 ? 0 : na > AP__MM_ADDRS_MAX ? AP__MM_ADDRS_MAX : na;
    s->target = target;
    s->min = min;
    s->deadline_us = m->deadline_at_us;
    s->poll_us = m->poll_us ? m->poll_us : DEF_POLL_US;
    s->grace_us = m->answer_grace_us ? m->answer_grace_us : DEF_GRACE_US;
    s->cb = cb;
    s->arg = arg;
    s->exclude = m->exclude;
    s->exclude_arg = m->exclude_arg;
    /* declare */
    uint8_t *b;
    size_t n;
    int rc = ap__mm_decl_encode(&s->self, &b, &n);
    if (rc) {
        free(s);
        return rc;
    }
    ap_dht_record_t rec = {.key = (const uint8_t *)s->dht_key,
                           .key_len = strlen(s->dht_key),
                           .subkey = (const uint8_t *)s->subkey,
                           .subkey_len = strlen(s->subkey),
                           .value = b,
                           .value_len = n,
                           .expiration_ms = s->self.exp_ms};
    rc = ap_dht_store(mm->dht, &rec, declared, s);
    free(b);
    if (rc) {
        free(s);
        return rc;
    }
    s->dht_ops++;
    s->deadline_timer = ap_rt_timer_start(mm->rt, m->deadline_at_us - now, 0, deadline_fn, s);
    s->poll_timer = ap_rt_timer_start(mm->rt, 0, 0, start_cb, s);
    s->next = mm->searches;
    mm->searches = s;
    if (out) *out = s;
    return 0;
}

void ap_avg_match_cancel(ap_avg_search_t *s)
{
    if (s) finish(s, AP_ECANCELED, NULL);
}
