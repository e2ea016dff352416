/* Training steps checked by the verified step (src/btard/step.c and
 * step_grad.c) over a runtime testbed: the same cases on the simulator and
 * over TCP. */
#ifndef AP_BTARD_VERIFIED_SUITE_H
#define AP_BTARD_VERIFIED_SUITE_H

#include "testbed.h"

int ap_btard_verified_suite_run(const ap_testbed_ops_t *ops);

#endif
