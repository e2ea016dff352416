/* Fuzz target: the BTARD verified-step message decoder (StepCommit, AggCheck,
 * StepReport in the Signed envelope), the aggregation check's sum on a
 * decoded AggCheck, and the ban checker on the input taken as a Ban. */
#include "apiary/btard.h"
#include "btard/step_wire.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ap__step_msg_t *m = malloc(sizeof *m);
    if (!m) return 0;
    if (ap__step_msg_decode(data, size, m) == 0) {
        if (m->kind < AP__BTARD_STEP_COMMIT || m->kind > AP__BTARD_STEP_REPORT) abort();
        if (m->kind == AP__BTARD_AGG_CHECK) {
            if (m->u.check.n > AP_BTARD_STEP_MAX_PEERS) abort();
            bool fails = ap_btard_agg_fails(m->u.check.e, m->u.check.n, m->u.check.tau);
            (void)fails;
        }
        if (m->kind == AP__BTARD_STEP_REPORT &&
            (m->u.report.nacc > AP_BTARD_STEP_MAX_PEERS || m->u.report.n > AP_BTARD_STEP_MAX_PEERS))
            abort();
        for (uint32_t i = 0; m->kind == AP__BTARD_STEP_REPORT && i < m->u.report.nacc; i++)
            if (m->u.report.acc_target[i] >= AP_BTARD_STEP_MAX_PEERS ||
                m->u.report.acc_part[i] >= AP_BTARD_STEP_MAX_PEERS)
                abort();
        if (m->kind == AP__BTARD_STEP_COMMIT &&
            (m->u.commit.n == 0 || m->u.commit.n > AP_BTARD_STEP_MAX_PEERS))
            abort();
    }
    free(m);
    ap_btard_ban_t b;
    ap_peer_id_t p;
    memset(&p, 0, sizeof p);
    int rc = ap_btard_ban_check(data, size, &p, NULL, &b);
    (void)rc;
    return 0;
}
