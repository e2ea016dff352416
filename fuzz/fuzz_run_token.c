/* Fuzz target: closed-run tokens and revocation subkeys (untrusted: tokens
 * arrive in progress records, state requests and on command lines). The
 * first byte picks the decoder: 0 the binary form (a token that decodes must
 * re-encode to a token that decodes to the same value, and one that verifies
 * for a run must not for another), 1 the text form, 2 a revocation subkey. */
#include "apiary/identity.h"
#include "apiary/run_token.h"

#include <stdlib.h>
#include <string.h>

static ap_identity_t owner;
static bool have_owner;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!have_owner) {
        uint8_t seed[AP_IDENTITY_SEED_LEN] = {7};
        if (ap_identity_from_seed(&owner, seed) != 0) abort();
        have_owner = true;
    }
    if (size == 0) return 0; /* data may be NULL when empty */
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    ap_run_token_t t, back;
    switch (data[0] % 3) {
    case 0:
        if (ap_run_token_unpack(p, n, &t) == 0) {
            uint8_t buf[AP_RUN_TOKEN_MAX];
            int len = ap_run_token_pack(&t, buf, sizeof buf);
            if (len <= 0 || ap_run_token_unpack(buf, (size_t)len, &back) != 0 ||
                memcmp(&back, &t, sizeof t) != 0)
                abort();
            /* a token is bound to its run: one run's never opens another */
            int ok = ap_run_token_verify(&t, &owner.id, "fuzz", &t.peer, 0);
            if (ok == 0 && ap_run_token_verify(&t, &owner.id, "fuzz2", &t.peer, 0) == 0) abort();
        }
        break;
    case 1: {
        char *s = malloc(n + 1);
        if (!s) return 0;
        if (n) memcpy(s, p, n);
        s[n] = 0;
        if (ap_run_token_parse(s, &t) == 0) {
            char text[AP_RUN_TOKEN_TEXT_MAX];
            if (ap_run_token_format(&t, text, sizeof text) <= 0 ||
                ap_run_token_parse(text, &back) != 0 || memcmp(&back, &t, sizeof t) != 0)
                abort();
        }
        free(s);
    } break;
    default: {
        ap_peer_id_t who;
        if (ap_run_token_revoked_peer(&owner.id, p, n, &who) == 0) {
            char sub[2 * AP_PEER_ID_STR_MAX + 16];
            int sl = ap_run_token_revoked_subkey(&owner.id, &who, sub, sizeof sub);
            if (sl <= 0 || (size_t)sl != n || memcmp(sub, p, n) != 0) abort();
        }
    } break;
    }
    return 0;
}
