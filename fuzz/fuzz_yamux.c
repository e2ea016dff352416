/* libFuzzer target: a yamux session fed untrusted frames.
 *
 * Input: one mode byte (bit 0: we are the client; bit 1: the reader consumes
 * what it gets; bit 2: we answer every new stream with data and a FIN; bits
 * 3-5: read size 1..7 bytes or all at once), then the peer's bytes.
 * Invariants: no crash, no leak; the stream count stays within the limit;
 * on_close runs once per stream; a failed session stays failed. */
#include "apiary/error.h"
#include "p2p/yamux.h"

#include <stdlib.h>
#include <string.h>

#define MAXS 16

static ap_yamux_t y;
static int mode;
static size_t live, written;

static void w(void *arg, const uint8_t hdr[AP_YAMUX_HDR_LEN], const uint8_t *p, size_t n)
{
    written += AP_YAMUX_HDR_LEN + n;
}
static int on_open(void *arg, uint32_t id)
{
    live++;
    if (mode & 4) {
        ap__yamux_send(&y, id, (const uint8_t *)"pong", 4);
        ap__yamux_close(&y, id);
    }
    return 0;
}
static void on_data(void *arg, uint32_t id, const uint8_t *p, size_t n)
{
    if (mode & 2) ap__yamux_consume(&y, id, n);
    if (n && p[0] == 'R') ap__yamux_reset(&y, id), live--;
}
static void on_close(void *arg, uint32_t id, int st)
{
    if (live == 0) abort();
    live--;
}

static const ap_yamux_cbs_t cbs = {w, on_open, on_data, NULL, NULL, on_close, NULL, NULL};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    mode = data[0];
    size_t chunk = (mode >> 3) & 7;
    data++;
    size--;
    live = written = 0;
    ap__yamux_init(&y, mode & 1, &cbs, NULL, MAXS);
    uint32_t mine;
    if (ap__yamux_open(&y, &mine) == 0) live++;
    int err = 0;
    for (size_t off = 0; off < size;) {
        size_t n = chunk && chunk < size - off ? chunk : size - off;
        int rc = ap__yamux_feed(&y, data + off, n);
        off += n;
        if (err && rc != err) abort();
        err = rc;
        if (ap__yamux_nstreams(&y) > MAXS || ap__yamux_nstreams(&y) != live) abort();
    }
    ap__yamux_free(&y, AP_ECLOSED);
    if (live != 0) abort();
    return 0;
}
