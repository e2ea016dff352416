/* The exact optimum of SWARM's rebalancing problem, for the rebalancing test
 * and `apiary bench swarm`: the best max-min stage total over every
 * assignment of servers with integer throughputs to `stages` stages. */
#ifndef APIARY_TESTING_SWARM_OPTIMUM_H
#define APIARY_TESTING_SWARM_OPTIMUM_H

#include "apiary/swarm.h"

#include <stddef.h>

#define AP_TEST_SWARM_MAX_STAGES 8

/* Dynamic programme over servers on the tuple of stage totals capped at
 * floor(total / stages) (the minimum never exceeds that cap, so capping loses
 * nothing); (cap + 1)^stages states. Returns the optimum, or -1 when stages is
 * 0 or over AP_TEST_SWARM_MAX_STAGES or the states do not fit in memory. */
int ap_test_swarm_optimum(const ap_swarm_member_t *m, size_t n, int stages);

#endif
