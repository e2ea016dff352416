/* The runtime conformance suite: the same cmocka tests of runtime.h's
 * contract on every driver (timers, post, work, RPC success / deadline /
 * cancel / handler error / caps, stream order and flow control, refusal,
 * peer crash mid-call and mid-stream, restart, peer events).
 *
 * A driver's test program is one line:
 *     int main(void) { return ap_conformance_run(&ap_testbed_sim); }
 */
#ifndef AP_CONFORMANCE_H
#define AP_CONFORMANCE_H

#include "testbed.h"

int ap_conformance_run(const ap_testbed_ops_t *ops);

#endif
