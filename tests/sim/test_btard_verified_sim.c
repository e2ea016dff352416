/* Verified training steps on the simulator (tests/lib/btard_verified_suite.c). */
#include "btard_verified_suite.h"

int main(void)
{
    return ap_btard_verified_suite_run(&ap_testbed_sim);
}
