/* libFuzzer target: the circuit relay v2 decoders (HopMessage, StopMessage)
 * and their length prefix, then the relay's bookkeeping driven by what
 * decodes. Invariants: no crash, no leak; counts within their caps; a
 * decoded message encodes again and decodes to the same fields; the relay
 * never holds more reservations or circuits than its limits. */
#include "apiary/error.h"
#include "p2p/relay.h"

#include <stdlib.h>
#include <string.h>

static void check_roundtrip(const ap_relay_msg_t *a)
{
    static ap_relay_msg_t b;
    static uint8_t buf[AP_RELAY_MSG_MAX + 16];
    int n = ap__relay_encode(a, buf, sizeof buf);
    if (n < 0) return;
    size_t hl, bl;
    if (ap__relay_frame(buf, (size_t)n, &hl, &bl) != 1) abort();
    if (ap__relay_decode(a->stop, buf + hl, bl, &b) != 0) abort();
    if (b.type != a->type || b.naddrs != a->naddrs || b.nraddrs != a->nraddrs ||
        b.has_status != a->has_status || (a->has_status && b.status != a->status) ||
        b.has_limit != a->has_limit || b.data != a->data || b.duration != a->duration)
        abort();
    for (size_t i = 0; i < a->naddrs; i++)
        if (!ap_multiaddr_eq(&a->addrs[i], &b.addrs[i])) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static ap_relay_msg_t m;
    static ap_relay_t relay;
    static bool init;
    if (!init) {
        ap_relay_limits_t lim;
        ap__relay_limits_default(&lim);
        lim.max_reservations = 8;
        lim.max_circuits = 8;
        lim.circuits_per_peer = 2;
        if (ap__relay_init(&relay, &lim) != 0) abort();
        init = true;
    }
    size_t hl, bl;
    int f = ap__relay_frame(data, size, &hl, &bl);
    if (f == 1 && (bl > AP_RELAY_MSG_MAX || hl > 9)) abort();
    for (int stop = 0; stop < 2; stop++) {
        if (ap__relay_decode(stop, data, size, &m) != 0) continue;
        if (m.naddrs > AP_RELAY_ADDRS_MAX || m.nraddrs > AP_RELAY_ADDRS_MAX ||
            m.voucher_len > AP_RELAY_VOUCHER_MAX)
            abort();
        check_roundtrip(&m);
        if (!m.has_peer || m.peer_other) continue;
        char why[128];
        uint64_t x;
        ap_multiaddr_t ip = m.naddrs ? m.addrs[0] : (ap_multiaddr_t){0};
        ap_peer_id_t src = m.peer;
        src.b[AP_PEER_ID_LEN - 1] ^= 1;
        if (m.type == AP_RELAY_HOP_RESERVE)
            ap__relay_reserve(&relay, &m.peer, &ip, size, &x, why, sizeof why);
        else if (m.type == AP_RELAY_HOP_CONNECT &&
                 ap__relay_connect(&relay, &src, &m.peer, size, &x, why, sizeof why) ==
                     AP_RELAY_OK &&
                 ap__relay_account(&relay, x, m.data, size) != 0)
            ap__relay_circuit_end(&relay, x);
        if (relay.nresv > 8 || ap__relay_circuits(&relay) > 8) abort();
    }
    return 0;
}
