/* libFuzzer target: the identify message decoder (and its length prefix).
 * Invariants: no crash, no leak; counts within their caps; every protocol
 * id NUL-terminated inside the message's text; a decoded message encodes
 * again and decodes to the same fields. */
#include "apiary/error.h"
#include "p2p/identify.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static ap_identify_t a, b;
    static uint8_t buf[AP_IDENTIFY_MSG_MAX + 16];
    size_t hl, bl;
    int f = ap__identify_frame(data, size, &hl, &bl);
    if (f == 1 && (bl > AP_IDENTIFY_MSG_MAX || hl > 9)) abort();
    if (ap__identify_decode(data, size, &a) != 0) return 0;
    if (a.nlisten > AP_IDENTIFY_ADDRS_MAX || a.nprotocols > AP_IDENTIFY_PROTOS_MAX) abort();
    for (size_t i = 0; i < a.nprotocols; i++) {
        if (a.protocols[i] < a.text || a.protocols[i] >= a.text + sizeof a.text) abort();
        if (strlen(a.protocols[i]) > AP_IDENTIFY_STR_MAX) abort();
    }
    uint8_t pk[AP_ED25519_PK_LEN] = {0};
    int n = ap__identify_encode(&a, pk, buf, sizeof buf);
    if (n < 0) return 0; /* re-encoding may exceed the cap (our key is added) */
    if (ap__identify_frame(buf, (size_t)n, &hl, &bl) != 1) abort();
    if (ap__identify_decode(buf + hl, bl, &b) != 0) abort();
    if (b.nlisten != a.nlisten || b.nprotocols != a.nprotocols ||
        strcmp(a.agent_version, b.agent_version) != 0 ||
        strcmp(a.protocol_version, b.protocol_version) != 0 || b.has_observed != a.has_observed)
        abort();
    for (size_t i = 0; i < a.nlisten; i++)
        if (!ap_multiaddr_eq(&a.listen[i], &b.listen[i])) abort();
    for (size_t i = 0; i < a.nprotocols; i++)
        if (strcmp(a.protocols[i], b.protocols[i]) != 0) abort();
    return 0;
}
