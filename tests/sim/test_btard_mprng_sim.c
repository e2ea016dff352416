/* MPRNG rounds on the simulator (tests/lib/btard_mprng_suite.c). */
#include "btard_mprng_suite.h"

int main(void)
{
    return ap_btard_mprng_suite_run(&ap_testbed_sim);
}
