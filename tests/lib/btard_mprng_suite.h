/* MPRNG rounds over a runtime testbed (src/btard/mprng_net.c): the same
 * cases on the simulator and over TCP. */
#ifndef AP_BTARD_MPRNG_SUITE_H
#define AP_BTARD_MPRNG_SUITE_H

#include "testbed.h"

int ap_btard_mprng_suite_run(const ap_testbed_ops_t *ops);

#endif
