/* Circuit addresses of peers behind NAT, kept beside the routing table
 * (whose contacts hold one short direct address each) and passed on in FIND
 * answers, so that a peer looking up a NATed peer learns how to reach it
 * through its relay. */
#include "dht_impl.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool is_circuit(const char *a)
{
    return a && strstr(a, "/p2p-circuit") != NULL && strlen(a) < AP_RT_ADDR_MAX;
}

static ptrdiff_t find(const ap_dht_t *dht, const ap_peer_id_t *peer)
{
    for (size_t i = 0; i < dht->ncirc; i++)
        if (ap_peer_id_eq(&dht->circ[i].peer, peer)) return (ptrdiff_t)i;
    return -1;
}

void ap__dht_circuit_note(ap_dht_t *dht, const ap_peer_id_t *peer, char **addrs, size_t n)
{
    const char *a = NULL;
    for (size_t i = 0; i < n && !a; i++)
        if (is_circuit(addrs[i])) a = addrs[i];
    ptrdiff_t at = find(dht, peer);
    if (!a) {
        if (at >= 0) dht->circ[at] = dht->circ[--dht->ncirc];
        return;
    }
    const uint64_t now = ap_rt_now_us(dht->rt);
    if (at < 0) {
        if (dht->ncirc == AP__DHT_CIRCUITS_MAX) { /* the least recently seen goes */
            size_t old = 0;
            for (size_t i = 1; i < dht->ncirc; i++)
                if (dht->circ[i].seen_us < dht->circ[old].seen_us) old = i;
            at = (ptrdiff_t)old;
        } else {
            if (dht->ncirc == dht->cap_circ) {
                size_t cap = dht->cap_circ ? dht->cap_circ * 2 : 8;
                if (cap > AP__DHT_CIRCUITS_MAX) cap = AP__DHT_CIRCUITS_MAX;
                ap__dht_circuit_t *nc = realloc(dht->circ, cap * sizeof *nc);
                if (!nc) return; /* not kept: the peer is still reached directly if it can be */
                dht->circ = nc;
                dht->cap_circ = cap;
            }
            at = (ptrdiff_t)dht->ncirc++;
        }
        dht->circ[at].peer = *peer;
    }
    dht->circ[at].seen_us = now;
    snprintf(dht->circ[at].addr, sizeof dht->circ[at].addr, "%s", a);
}

const char *ap__dht_circuit_of(const ap_dht_t *dht, const ap_peer_id_t *peer)
{
    ptrdiff_t at = find(dht, peer);
    return at < 0 ? NULL : dht->circ[at].addr;
}

void ap__dht_circuits_free(ap_dht_t *dht)
{
    free(dht->circ);
    dht->circ = NULL;
    dht->ncirc = dht->cap_circ = 0;
}
