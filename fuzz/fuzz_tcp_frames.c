/* libFuzzer target: the encrypted transport's receive loop after the
 * handshake (src/net/tcp_io.c: 2-byte length prefix, partial-frame reassembly,
 * ChaCha20-Poly1305 open with the implicit nonce, keepalives) and the
 * hand-off of the plaintext to the node's stream multiplexer through
 * runtime/uv's TCP seam (tcp_conn.c -> mux_frame.c).
 *
 * The fuzzer cannot forge ciphertexts, so the input is a script the harness
 * turns into the peer's byte stream with the peer's real sending key:
 *   byte 0: read split step (frames straddle reads)
 *   records: op u8, len u16 LE, len bytes
 *     op % 5 == 0: seal the bytes as one transport message (valid)
 *     op % 5 == 1: raw bytes on the wire (garbage, bad length prefixes)
 *     op % 5 == 2: seal, then flip one bit (altered message)
 *     op % 5 == 3: replay the previous sealed message
 *     op % 5 == 4: a valid message whose nonce skips one (reordered)
 * The plaintext is the mux's byte stream, so valid records reach every mux
 * frame type; the node listens on a stream protocol and an RPC protocol.
 * One TCP node lives across inputs; each input gets a fresh injected
 * connection (no socket: ap__tcp_conn_inject), closed at the end. */
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "net/tcp.h"
#include "fuzz_peer.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

static void on_rpc(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    fuzz_answer(req, d, n);
}

static ap_host_t *host;
static ap_rt_t *rt;
static ap_tcp_t *tcp;

#define OUT_MAX (1u << 20)
static uint8_t out[OUT_MAX];

static void put_sealed(ap_noise_cs_t *cs, const uint8_t *p, size_t n, size_t *olen, size_t *last,
                       size_t *last_len)
{
    if (n > AP_NOISE_PLAIN_MAX) n = AP_NOISE_PLAIN_MAX;
    if (*olen + 2 + n + AP_NOISE_TAGLEN > OUT_MAX) return;
    uint8_t *h = out + *olen;
    if (ap__noise_cs_encrypt(cs, NULL, 0, p, n, h + 2) != 0) abort();
    ap__put_be16(h, (uint16_t)(n + AP_NOISE_TAGLEN));
    *last = *olen;
    *last_len = 2 + n + AP_NOISE_TAGLEN;
    *olen += *last_len;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!host) {
        ap_log_set_level(AP_LOG_OFF);
        if (sodium_init() < 0) abort();
        host = ap_host_new();
        static const uint8_t seed[32] = {7};
        ap_node_opts_t o = {.ed25519_seed = seed, .rng_seed = 1, .listen = "/ip4/127.0.0.1/tcp/0"};
        if (!host || ap_node_new(host, &o, &rt) < 0) abort();
        ap_stream_opts_t so = {.window = 4096, .max_msg = 100000};
        ap_rt_stream_listen(rt, "/s", &so, fuzz_on_accept, NULL);
        ap_rt_rpc_register(rt, "/r", 50000, on_rpc, NULL);
        tcp = ap__tcpc_transport((ap_node_t *)rt);
        if (!tcp) abort();
    }
    if (size < 1) return 0;
    ap_noise_cs_t to_us = {.has_key = true}, from_us = {.has_key = true};
    memset(to_us.k, 0x11, sizeof to_us.k);
    memset(from_us.k, 0x22, sizeof from_us.k);
    ap_noise_cs_t peer_send = to_us;
    static const uint8_t pk[32] = {9};
    ap_peer_id_t peer;
    ap_peer_id_from_ed25519(&peer, pk);
    ap_tcp_conn_t *c;
    if (ap__tcp_conn_inject(tcp, &peer, &from_us, &to_us, false, &c) != 0) abort();

    /* the script -> the peer's byte stream */
    size_t step = (size_t)data[0] * 7 + 1;
    size_t olen = 0, last = 0, last_len = 0;
    size_t i = 1;
    while (i + 3 <= size && olen < OUT_MAX - 64) {
        uint8_t op = data[i] % 5;
        size_t len = (size_t)data[i + 1] | (size_t)data[i + 2] << 8;
        i += 3;
        if (len > size - i) len = size - i;
        const uint8_t *p = data + i;
        i += len;
        switch (op) {
        case 0:
            put_sealed(&peer_send, p, len, &olen, &last, &last_len);
            break;
        case 1:
            if (olen + len <= OUT_MAX) {
                memcpy(out + olen, p, len);
                olen += len;
            }
            break;
        case 2: {
            size_t at = olen;
            put_sealed(&peer_send, p, len, &olen, &last, &last_len);
            if (olen > at + 2) {
                size_t k = len ? (size_t)p[0] % (olen - at - 2) : 0;
                out[at + 2 + k] ^= (uint8_t)(1u << (len > 1 ? p[1] % 8 : 0));
            }
            break;
        }
        case 3:
            if (last_len && olen + last_len <= OUT_MAX) {
                memmove(out + olen, out + last, last_len);
                last = olen;
                olen += last_len;
            }
            break;
        case 4:
            peer_send.n++;
            put_sealed(&peer_send, p, len, &olen, &last, &last_len);
            break;
        }
    }

    /* c is freed by the loop once closed (by the transport or by the mux):
     * look it up again after every loop run */
    for (size_t off = 0; off < olen; off += step) {
        size_t n = olen - off < step ? olen - off : step;
        ap__tcp_conn_feed(c, out + off, n);
        bool open = ap__tcp_conn_is_open(c);
        ap_host_run_once(host, 0);
        if (!open || ap__tcp_find(tcp, &peer) != c) break;
    }
    if ((c = ap__tcp_find(tcp, &peer)) != NULL) ap__tcp_conn_abort(c, AP_ECLOSED);
    for (int k = 0; k < 4; k++) ap_host_run_once(host, 0);
    if (ap__tcp_find(tcp, &peer)) abort(); /* the connection is gone */
    return 0;
}
