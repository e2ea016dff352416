/* libFuzzer target: multiaddr text and binary decoders.
 * Invariants: no crash; whatever parses prints to a canonical text that
 * parses back to the same value, and encodes to a binary form that decodes
 * back to the same value. */
#include "apiary/multiaddr.h"

#include <stdlib.h>
#include <string.h>

static void check_roundtrip(const ap_multiaddr_t *ma)
{
    char text[AP_MA_TEXT_MAX];
    ap_multiaddr_t back;
    int n = ap_multiaddr_print(ma, text, sizeof text);
    if (n <= 0 || ap_multiaddr_parse(&back, text) != 0 || !ap_multiaddr_eq(ma, &back)) abort();
    uint8_t bin[AP_MA_BINARY_MAX];
    n = ap_multiaddr_encode(ma, bin, sizeof bin);
    if (n <= 0 || ap_multiaddr_decode(&back, bin, (size_t)n) != 0 || !ap_multiaddr_eq(ma, &back))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap_multiaddr_t ma;
    if (ap_multiaddr_decode(&ma, data, size) == 0) check_roundtrip(&ma);
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    if (ap_multiaddr_parse(&ma, text) == 0) check_roundtrip(&ma);
    free(text);
    return 0;
}
