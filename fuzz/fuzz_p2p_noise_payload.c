/* libFuzzer target: the libp2p Noise handshake payload decoder (identity
 * key as a libp2p PublicKey, signature, NoiseExtensions with the early
 * stream-muxer negotiation).
 *
 * Input: one mode byte, then bytes.
 *   bit 0 clear  the bytes are a whole payload, checked against a fixed
 *                remote static key.
 *   bit 0 set    the bytes are the body of the extensions field, appended
 *                to a validly signed identity, so the fuzzer reaches the
 *                muxer negotiation.
 *   bit 1        we are the initiator (else the responder).
 * Invariants: no crash, no leak; success names a PeerID and an agreed muxer
 * that is one of ours (or none); a key type is reported on AP_ENOTSUP. */
#include "apiary/error.h"
#include "base/varint.h"
#include "net/secure.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

static ap_secure_creds_t c;
static const char *const ours[] = {"/apiary/mux/2", "/yamux/1.0.0"};

static void init_once(void)
{
    static int done;
    if (done) return;
    done = 1;
    uint8_t seed[32], s[32];
    ap_identity_t id;
    memset(seed, 0x11, 32);
    memset(s, 0x22, 32);
    if (sodium_init() < 0 || ap_identity_from_seed(&id, seed) ||
        ap__secure_creds_init(&c, &id, AP_NOISE_SHA256, s))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    init_once();
    if (size < 1) return 0;
    int mode = data[0];
    data++;
    size--;
    static uint8_t buf[2 * AP_SECURE_PAYLOAD_MAX + 64]; /* identity + extensions + prefix */
    const uint8_t *p = data;
    size_t n = size;
    if (mode & 1) {
        if (size > AP_SECURE_PAYLOAD_MAX) return 0;
        memcpy(buf, c.payload, c.payload_len);
        n = c.payload_len;
        buf[n++] = 0x22; /* field 4, length-delimited */
        n += ap__uvarint_put(buf + n, size);
        memcpy(buf + n, data, size);
        n += size;
        p = buf;
    }
    ap_secure_remote_t info;
    int rc = ap__secure_check_payload_ex(p, n, c.s_pub, ours, 2, (mode & 2) != 0, &info);
    if (rc == 0) {
        if (!ap_peer_id_eq(&info.id, &c.id.id) && (mode & 1)) abort();
        if (info.muxer < -1 || info.muxer > 1) abort();
        if (info.muxer >= 0 && !info.has_muxers) abort();
    } else if (rc == AP_ENOTSUP) {
        if (info.key_type == AP_KEY_ED25519 || info.key_type < 0) abort();
    } else if (rc != AP_ECORRUPT && rc != AP_EAUTH && rc != AP_ENOPROTO) {
        abort();
    }
    return 0;
}
