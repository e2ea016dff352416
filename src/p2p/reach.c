/* Observed addresses and reachability: see reach.h. */
#include "p2p/reach.h"

#include "apiary/error.h"
#include "p2p/autonat.h"

#include <string.h>

void ap__obs_init(ap_obs_t *o)
{
    memset(o, 0, sizeof *o);
}

static bool fresh(uint64_t at, uint64_t now)
{
    return at != 0 && (now < at || now - at < AP_OBS_TTL_US);
}

static bool same_addr(const ap_multiaddr_t *a, const ap_multiaddr_t *b)
{
    return a->host == b->host && a->port == b->port &&
           memcmp(a->ip, b->ip, a->host == AP_MA_HOST_IP4 ? 4 : 16) == 0;
}

static size_t observers(const ap_obs_t *o, size_t i, uint64_t now)
{
    size_t n = 0;
    for (size_t k = 0; k < AP_OBS_OBSERVERS; k++) n += fresh(o->e[i].at[k], now);
    return n;
}

static void drop_observer(ap_obs_t *o, const ap_peer_id_t *by)
{
    for (size_t i = 0; i < AP_OBS_ADDRS; i++)
        for (size_t k = 0; k < AP_OBS_OBSERVERS; k++)
            if (o->e[i].used && o->e[i].at[k] && ap_peer_id_eq(&o->e[i].by[k], by))
                o->e[i].at[k] = 0;
}

int ap__obs_add(ap_obs_t *o, const ap_peer_id_t *by, const ap_multiaddr_t *seen, uint64_t now_us)
{
    if (!seen || seen->circuit || !seen->has_tcp || seen->port == 0 ||
        (seen->host != AP_MA_HOST_IP4 && seen->host != AP_MA_HOST_IP6))
        return AP_EINVAL;
    if (now_us == 0) now_us = 1;
    ap_multiaddr_t a = {0};
    a.host = seen->host;
    memcpy(a.ip, seen->ip, sizeof a.ip);
    a.has_tcp = true;
    a.port = seen->port;
    drop_observer(o, by);
    size_t slot = AP_OBS_ADDRS, victim = 0, victim_n = SIZE_MAX;
    uint64_t victim_t = UINT64_MAX;
    for (size_t i = 0; i < AP_OBS_ADDRS; i++) {
        if (o->e[i].used && same_addr(&o->e[i].addr, &a)) {
            slot = i;
            break;
        }
        size_t n = o->e[i].used ? observers(o, i, now_us) : 0;
        uint64_t newest = 0;
        for (size_t k = 0; k < AP_OBS_OBSERVERS; k++)
            if (o->e[i].at[k] > newest) newest = o->e[i].at[k];
        if (n < victim_n || (n == victim_n && newest < victim_t)) {
            victim = i;
            victim_n = n;
            victim_t = newest;
        }
    }
    if (slot == AP_OBS_ADDRS) {
        slot = victim;
        memset(&o->e[slot], 0, sizeof o->e[slot]);
        o->e[slot].used = true;
        o->e[slot].addr = a;
    }
    size_t k = 0, oldest = 0;
    for (; k < AP_OBS_OBSERVERS; k++) {
        if (!fresh(o->e[slot].at[k], now_us)) break;
        if (o->e[slot].at[k] < o->e[slot].at[oldest]) oldest = k;
    }
    if (k == AP_OBS_OBSERVERS) k = oldest;
    o->e[slot].by[k] = *by;
    o->e[slot].at[k] = now_us;
    return 0;
}

size_t ap__obs_count(const ap_obs_t *o, const ap_multiaddr_t *addr, uint64_t now_us)
{
    for (size_t i = 0; i < AP_OBS_ADDRS; i++)
        if (o->e[i].used && same_addr(&o->e[i].addr, addr)) return observers(o, i, now_us);
    return 0;
}

size_t ap__obs_believed(const ap_obs_t *o, uint64_t now_us, ap_multiaddr_t *out, size_t max)
{
    size_t idx[AP_OBS_ADDRS], cnt[AP_OBS_ADDRS], n = 0;
    for (size_t i = 0; i < AP_OBS_ADDRS; i++) {
        if (!o->e[i].used) continue;
        size_t c = observers(o, i, now_us);
        if (c < AP_OBS_BELIEVE) continue;
        size_t j = n++;
        while (j > 0 && cnt[j - 1] < c) {
            idx[j] = idx[j - 1];
            cnt[j] = cnt[j - 1];
            j--;
        }
        idx[j] = i;
        cnt[j] = c;
    }
    if (n > max) n = max;
    for (size_t i = 0; i < n; i++) out[i] = o->e[idx[i]].addr;
    return n;
}

static bool same_ip(const ap_multiaddr_t *a, const ap_multiaddr_t *b)
{
    return a->host == b->host && memcmp(a->ip, b->ip, a->host == AP_MA_HOST_IP4 ? 4 : 16) == 0;
}

size_t ap__obs_believed_ips(const ap_obs_t *o, uint64_t now_us, ap_multiaddr_t *out, size_t max)
{
    ap_multiaddr_t ips[AP_OBS_ADDRS];
    size_t cnt[AP_OBS_ADDRS], n = 0;
    for (size_t i = 0; i < AP_OBS_ADDRS; i++) {
        if (!o->e[i].used) continue;
        size_t c = observers(o, i, now_us), k = 0;
        while (k < n && !same_ip(&ips[k], &o->e[i].addr)) k++;
        if (k == n) {
            ips[n] = (ap_multiaddr_t){0};
            ips[n].host = o->e[i].addr.host;
            memcpy(ips[n].ip, o->e[i].addr.ip, sizeof ips[n].ip);
            cnt[n++] = 0;
        }
        cnt[k] += c;
    }
    size_t m = 0;
    for (size_t pass = 0; pass < n && m < max; pass++) {
        size_t best = n;
        for (size_t k = 0; k < n; k++)
            if (cnt[k] >= AP_OBS_BELIEVE && (best == n || cnt[k] > cnt[best])) best = k;
        if (best == n) break;
        out[m++] = ips[best];
        cnt[best] = 0;
    }
    return m;
}

/* ---- reachability ------------------------------------------------------------- */

const char *ap__reach_name(ap_reach_state_t s)
{
    switch (s) {
    case AP_REACH_UNKNOWN:
        return "unknown";
    case AP_REACH_PUBLIC:
        return "public";
    case AP_REACH_PRIVATE:
        return "private";
    }
    return "?";
}

void ap__reach_init(ap_reach_t *r, uint64_t now_us, uint64_t retry_us, uint64_t recheck_us)
{
    memset(r, 0, sizeof *r);
    r->retry_us = retry_us;
    r->recheck_us = recheck_us;
    r->next_probe_us = now_us;
}

bool ap__reach_answer(ap_reach_t *r, const ap_peer_id_t *server, int status,
                      const ap_multiaddr_t *addr, uint64_t now_us)
{
    ap_reach_state_t v;
    if (status == AP_AUTONAT_OK)
        v = AP_REACH_PUBLIC;
    else if (status == AP_AUTONAT_E_DIAL_ERROR)
        v = AP_REACH_PRIVATE;
    else
        return false;
    for (size_t i = 0; i < r->nvotes; i++)
        if (ap_peer_id_eq(&r->voter[i], server)) {
            memmove(&r->voter[i], &r->voter[i + 1], (r->nvotes - i - 1) * sizeof r->voter[0]);
            memmove(&r->vote[i], &r->vote[i + 1], (r->nvotes - i - 1) * sizeof r->vote[0]);
            r->nvotes--;
            break;
        }
    if (r->nvotes == AP_REACH_AGREE) {
        memmove(&r->voter[0], &r->voter[1], (AP_REACH_AGREE - 1) * sizeof r->voter[0]);
        memmove(&r->vote[0], &r->vote[1], (AP_REACH_AGREE - 1) * sizeof r->vote[0]);
        r->nvotes--;
    }
    r->voter[r->nvotes] = *server;
    r->vote[r->nvotes++] = v;
    if (v == AP_REACH_PUBLIC && addr) {
        r->has_addr = true;
        r->addr = *addr;
    }
    bool agree = r->nvotes == AP_REACH_AGREE;
    for (size_t i = 0; i < r->nvotes && agree; i++) agree = r->vote[i] == v;
    if (v != r->state && !agree) {
        /* contrary evidence: look again soon */
        if (r->next_probe_us > now_us + r->retry_us) r->next_probe_us = now_us + r->retry_us;
        return false;
    }
    if (!agree || v == r->state) return false;
    r->state = v;
    r->changes++;
    if (v == AP_REACH_PRIVATE) r->has_addr = false;
    r->next_probe_us = now_us + r->recheck_us;
    return true;
}

bool ap__reach_due(const ap_reach_t *r, uint64_t now_us)
{
    return now_us >= r->next_probe_us;
}

void ap__reach_probed(ap_reach_t *r, uint64_t now_us)
{
    r->next_probe_us = now_us + (r->state == AP_REACH_UNKNOWN ? r->retry_us : r->recheck_us);
}
