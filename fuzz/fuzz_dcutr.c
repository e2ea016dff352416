/* libFuzzer target: the DCUtR HolePunch decoder and the stream reader
 * around it. Invariants: no crash, no leak; the address count within its
 * cap; a decoded message encodes again and decodes to the same fields; the
 * reader never takes more bytes than it was given. */
#include "apiary/error.h"
#include "p2p/dcutr.h"

#include <stdlib.h>
#include <string.h>

static void check_roundtrip(const ap_dcutr_msg_t *a)
{
    static ap_dcutr_msg_t b;
    static uint8_t buf[AP_DCUTR_MSG_MAX + 16];
    static ap_dcutr_rd_t rd;
    int n = ap__dcutr_encode(a, buf, sizeof buf);
    if (n < 0) return;
    size_t used;
    rd.len = 0;
    if (ap__dcutr_rd_feed(&rd, buf, (size_t)n, &b, &used) != 1 || used != (size_t)n) abort();
    if (b.type != a->type || b.naddrs != a->naddrs) abort();
    for (size_t i = 0; i < a->naddrs; i++)
        if (!ap_multiaddr_eq(&a->addrs[i], &b.addrs[i])) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static ap_dcutr_msg_t m;
    static ap_dcutr_rd_t rd;
    if (size == 0) return 0;
    if (ap__dcutr_decode(data, size, &m) == 0) {
        if (m.naddrs > AP_DCUTR_ADDRS_MAX) abort();
        check_roundtrip(&m);
    }
    /* the same bytes as a stream, in two pieces */
    rd.len = 0;
    size_t cut = size / 2, used = 0;
    int rc = ap__dcutr_rd_feed(&rd, data, cut, &m, &used);
    if (rc == 0 && used != cut) abort();
    if (rc == 0) rc = ap__dcutr_rd_feed(&rd, data + cut, size - cut, &m, &used);
    if (used > size) abort();
    if (rc == 1 && m.naddrs > AP_DCUTR_ADDRS_MAX) abort();
    return 0;
}
