/* libFuzzer target: the Noise XX handshake and transport decryption, fed
 * untrusted messages.
 *
 * Input: one mode byte, then frames [u16 big-endian length][bytes]...
 *   mode % 3 == 0  responder: frame 1 = message 1, (we write message 2),
 *                  frame 2 = message 3, then transport messages.
 *   mode % 3 == 1  initiator: (we write message 1), frame 1 = message 2,
 *                  (we write message 3), then transport messages.
 *   mode % 3 == 2  the identity payload decoder directly on the rest.
 * All keys (static and ephemeral) are fixed, so a recorded valid transcript
 * in the corpus stays valid and the fuzzer reaches the post-handshake code.
 * Invariants: no crash, no leak; success implies a known remote identity. */
#include "apiary/error.h"
#include "net/secure.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

static ap_secure_creds_t ci, cr;
static uint8_t ei[32], er[32];

static void init_once(void)
{
    static int done;
    if (done) return;
    done = 1;
    if (sodium_init() < 0) abort();
    uint8_t seed[32], s[32];
    ap_identity_t id;
    memset(seed, 0x11, 32);
    memset(s, 0x22, 32);
    if (ap_identity_from_seed(&id, seed) || ap__secure_creds_init(&ci, &id, AP_NOISE_BLAKE2B, s))
        abort();
    memset(seed, 0x33, 32);
    memset(s, 0x44, 32);
    if (ap_identity_from_seed(&id, seed) || ap__secure_creds_init(&cr, &id, AP_NOISE_BLAKE2B, s))
        abort();
    memset(ei, 0x55, 32);
    memset(er, 0x66, 32);
}

static bool next_frame(const uint8_t **p, size_t *left, const uint8_t **f, size_t *flen)
{
    if (*left < 2) return false;
    size_t n = ((size_t)(*p)[0] << 8) | (*p)[1];
    if (n > *left - 2) n = *left - 2; /* a short last frame: use what is there */
    *f = *p + 2;
    *flen = n;
    *p += 2 + n;
    *left -= 2 + n;
    return true;
}

static void transport(ap_noise_cs_t *recv, const uint8_t *p, size_t left)
{
    static uint8_t out[AP_NOISE_MSG_MAX];
    const uint8_t *f;
    size_t fl;
    while (next_frame(&p, &left, &f, &fl))
        if (ap__noise_cs_decrypt(recv, NULL, 0, f, fl, out) != 0) break;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    init_once();
    if (size < 1) return 0;
    int mode = data[0] % 3;
    const uint8_t *p = data + 1, *f;
    size_t left = size - 1, fl, ml;
    static uint8_t m[AP_NOISE_MSG_MAX];
    ap_secure_hs_t hs;
    ap_noise_cs_t send, recv;
    if (mode == 2) {
        ap_peer_id_t id;
        (void)ap__secure_check_payload(p, left, ci.s_pub, &id);
        return 0;
    }
    if (mode == 0) {
        if (ap__secure_init(&hs, &cr, false, NULL, er)) abort();
        if (!next_frame(&p, &left, &f, &fl) || ap__secure_read(&hs, f, fl) != 0) goto out;
        /* after a well-formed message 1 the only possible failure is a DH
         * with a low-order ephemeral key, which must be refused */
        int rc = ap__secure_write(&hs, m, sizeof m, &ml);
        if (rc == AP_EAUTH) goto out;
        if (rc != 0) abort();
        if (!next_frame(&p, &left, &f, &fl) || ap__secure_read(&hs, f, fl) != 0) goto out;
    } else {
        if (ap__secure_init(&hs, &ci, true, &cr.id.id, ei)) abort();
        if (ap__secure_write(&hs, m, sizeof m, &ml) != 0) abort();
        if (!next_frame(&p, &left, &f, &fl) || ap__secure_read(&hs, f, fl) != 0) goto out;
        if (ap__secure_write(&hs, m, sizeof m, &ml) != 0) abort();
    }
    if (!ap__secure_done(&hs) || !ap__secure_remote(&hs)) abort();
    if (ap__secure_split(&hs, &send, &recv) != 0) abort();
    transport(&recv, p, left);
    ap__noise_cs_clear(&send);
    ap__noise_cs_clear(&recv);
out:
    ap__secure_clear(&hs);
    return 0;
}
