/* The echo client (p2p_echo.h). */
#include "p2p_echo.h"

#include "apiary/error.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK (64u << 10)
#define TAB   (64u << 10)

/* tab[r] = (r ^ r >> 8) & 0xff: byte i of stream k is tab[i % 64 Ki] ^
 * ((i >> 16 ^ 37k) & 0xff) */
static uint8_t tab[TAB];
static pthread_once_t tab_once = PTHREAD_ONCE_INIT;

static void tab_init(void)
{
    for (uint32_t r = 0; r < TAB; r++) tab[r] = (uint8_t)((r ^ (r >> 8)) & 0xff);
}

void ap_echo_fill(uint32_t k, uint64_t off, uint8_t *out, size_t n)
{
    pthread_once(&tab_once, tab_init);
    while (n) {
        size_t r = (size_t)(off % TAB), m = TAB - r < n ? TAB - r : n, j = 0;
        uint8_t c = (uint8_t)(((off >> 16) ^ (k * 37u)) & 0xff);
        uint64_t c8 = c * 0x0101010101010101ull, w;
        for (; j + 8 <= m; j += 8) {
            memcpy(&w, tab + r + j, 8);
            w ^= c8;
            memcpy(out + j, &w, 8);
        }
        for (; j < m; j++) out[j] = tab[r + j] ^ c;
        out += m;
        off += m;
        n -= m;
    }
}

bool ap_echo_check(uint32_t k, uint64_t off, const uint8_t *p, size_t n)
{
    uint8_t want[4096];
    while (n) {
        size_t m = n < sizeof want ? n : sizeof want;
        ap_echo_fill(k, off, want, m);
        if (memcmp(want, p, m) != 0) return false;
        p += m;
        off += m;
        n -= m;
    }
    return true;
}

typedef struct ap_echo_stream {
    ap_echo_run_t *r;
    uint32_t k;
    uint64_t sent, back;
    bool bad, closing;
} es_t;

static void pump(ap_p2p_stream_t *s)
{
    es_t *e = ap__p2p_stream_udata(s);
    static uint8_t buf[CHUNK];
    size_t size = e->r->size;
    while (e->sent < size) {
        size_t n = size - e->sent < CHUNK ? size - e->sent : CHUNK;
        ap_echo_fill(e->k, e->sent, buf, n);
        int rc = ap__p2p_stream_write(s, buf, n);
        if (rc == AP_EAGAIN) return; /* on_writable follows */
        if (rc) {
            ap__p2p_stream_reset(s);
            return;
        }
        e->sent += n;
        size_t q = ap__p2p_stream_queued(s);
        if (q > e->r->max_queued) e->r->max_queued = q;
    }
    if (!e->closing) {
        e->closing = true;
        ap__p2p_stream_close(s);
    }
}

static void on_open(ap_p2p_stream_t *s)
{
    ap__p2p_stream_set_flow(s, pump, false);
    pump(s);
}

static void on_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    es_t *e = ap__p2p_stream_udata(s);
    if (!e->bad) e->bad = !ap_echo_check(e->k, e->back, p, n);
    e->back += n;
    e->r->bytes_back += n;
}

static void on_close(ap_p2p_stream_t *s, int st)
{
    es_t *e = ap__p2p_stream_udata(s);
    ap_echo_run_t *r = e->r;
    r->closed++;
    if (st == 0 && !e->bad && e->back == r->size && e->sent == r->size)
        r->ok++;
    else if (!r->first_error)
        r->first_error = st ? st : AP_ECORRUPT;
}

static const ap_p2p_proto_t echo_c = {AP_P2P_ECHO_PROTO, on_open, on_data, NULL, on_close};

int ap_echo_start(ap_p2p_conn_t *c, ap_echo_run_t *r, int nstreams, size_t size)
{
    memset(r, 0, sizeof *r);
    r->streams = calloc((size_t)nstreams, sizeof *r->streams);
    if (!r->streams) return AP_ENOMEM;
    r->size = size;
    for (int k = 0; k < nstreams; k++) {
        es_t *e = &r->streams[k];
        e->r = r;
        e->k = (uint32_t)k;
        int rc = ap__p2p_stream_open(c, &echo_c, e, NULL);
        if (rc) {
            r->first_error = rc;
            r->nstreams = k;
            return k ? 0 : rc;
        }
        r->nstreams = k + 1;
    }
    return 0;
}

void ap_echo_free(ap_echo_run_t *r)
{
    free(r->streams);
    r->streams = NULL;
}
