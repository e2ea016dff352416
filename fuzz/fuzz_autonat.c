/* libFuzzer target: the AutoNAT v1 message decoder, its length prefix and
 * the server's policy on whatever decodes. Invariants: no crash, no leak;
 * counts within their caps; the status text NUL-terminated within its cap;
 * a decoded DIAL encodes again and decodes to the same fields; the policy
 * only ever dials the requester's own IP, at most AP_AUTONAT_DIAL_MAX
 * addresses, each with the requester's PeerID. */
#include "apiary/error.h"
#include "p2p/autonat.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static ap_autonat_msg_t a, b;
    static ap_autonat_srv_t srv;
    static uint8_t buf[AP_AUTONAT_MSG_MAX + 16];
    size_t hl, bl;
    int f = ap__autonat_frame(data, size, &hl, &bl);
    if (f == 1 && (bl > AP_AUTONAT_MSG_MAX || hl > 9)) abort();
    if (ap__autonat_decode(data, size, &a) != 0) return 0;
    if (a.naddrs > AP_AUTONAT_ADDRS_MAX || strlen(a.text) > AP_AUTONAT_TEXT_MAX) abort();
    if (a.has_dial) {
        int n =
            ap__autonat_encode_dial(a.has_id ? &a.id : NULL, a.addrs, a.naddrs, buf, sizeof buf);
        if (n > 0) {
            if (ap__autonat_frame(buf, (size_t)n, &hl, &bl) != 1) abort();
            if (ap__autonat_decode(buf + hl, bl, &b) != 0) abort();
            if (b.naddrs != a.naddrs || b.has_id != a.has_id) abort();
            for (size_t i = 0; i < a.naddrs; i++)
                if (!ap_multiaddr_eq(&a.addrs[i], &b.addrs[i])) abort();
        }
        ap_peer_id_t from = a.id;
        ap_multiaddr_t remote = a.naddrs ? a.addrs[0] : (ap_multiaddr_t){0};
        ap_multiaddr_t dial[AP_AUTONAT_DIAL_MAX];
        size_t nd = 0;
        char why[160];
        int st = ap__autonat_srv_check(&srv, &a, &from, &remote, false, size, dial, &nd, why,
                                       sizeof why);
        if (st != AP_AUTONAT_OK && nd != 0) abort();
        if (nd > AP_AUTONAT_DIAL_MAX) abort();
        for (size_t i = 0; i < nd; i++)
            if (dial[i].host != remote.host || memcmp(dial[i].ip, remote.ip, 16) != 0 ||
                !dial[i].has_peer || !ap_peer_id_eq(&dial[i].peer, &from))
                abort();
    }
    if (a.has_response) {
        int n = ap__autonat_encode_response(a.status, a.text, a.has_addr ? &a.addr : NULL, buf,
                                            sizeof buf);
        if (n > 0) {
            if (ap__autonat_frame(buf, (size_t)n, &hl, &bl) != 1) abort();
            if (ap__autonat_decode(buf + hl, bl, &b) != 0) abort();
            if (strcmp(a.text, b.text) != 0 || b.has_addr != a.has_addr) abort();
        }
    }
    return 0;
}
