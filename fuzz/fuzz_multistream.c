/* libFuzzer target: multistream-select fed untrusted bytes.
 *
 * Input: one mode byte (bit 0: initiator or responder; bits 1-3: the size
 * of the reads, 1..8 bytes or all at once; bit 4: the responder also
 * accepts by name lookup, every id starting "/apiary/"), then the peer's
 * bytes.
 * Invariants: no crash; feed never claims more bytes than it was given and
 * takes nothing once finished; a finished negotiation selected one of our
 * protocols or a name the lookup accepted; queued output stays within its
 * buffer. */
#include "apiary/error.h"
#include "p2p/multistream.h"

#include <stdlib.h>
#include <string.h>

static const char *const protos[] = {"/yamux/1.0.0", "/apiary/mux/2", "/noise", "/ipfs/ping/1.0.0"};

static bool lookup(void *arg, const char *proto)
{
    (void)arg;
    if (strlen(proto) > AP_MSS_PROTO_MAX || memchr(proto, '\n', strlen(proto))) abort();
    return strncmp(proto, "/apiary/", 8) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    bool initiator = data[0] & 1;
    size_t chunk = (data[0] >> 1) & 7;
    bool by_name = (data[0] >> 4) & 1;
    data++;
    size--;
    static ap_mss_t m;
    if (ap__mss_init(&m, initiator, protos, 4) != 0) abort();
    if (by_name) ap__mss_set_accept(&m, lookup, NULL);
    size_t off = 0;
    while (off < size) {
        size_t step = chunk ? (chunk < size - off ? chunk : size - off) : size - off, used = 0;
        int rc = ap__mss_feed(&m, data + off, step, &used);
        if (used > step) abort();
        size_t n;
        ap__mss_output(&m, &n);
        if (n > AP_MSS_OUT_MAX) abort();
        ap__mss_output_done(&m);
        off += used;
        if (rc < 0) {
            if (ap__mss_state(&m) != AP_MSS_FAILED || m.err != rc) abort();
            break;
        }
        if (ap__mss_state(&m) == AP_MSS_DONE) {
            const char *sel = ap__mss_selected(&m);
            bool ok = false;
            for (size_t i = 0; i < 4; i++) ok = ok || sel == protos[i];
            ok = ok || (by_name && !initiator && lookup(NULL, sel));
            if (!ok) abort();
            if (ap__mss_feed(&m, data + off, size - off, &used) != 0 || used != 0) abort();
            break;
        }
        if (used == 0 && m.in_len == 0) abort(); /* no progress */
    }
    return 0;
}
