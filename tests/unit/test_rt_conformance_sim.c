/* The runtime conformance suite on the simulator driver. */
#include "conformance.h"

extern const ap_testbed_ops_t ap_testbed_sim;

int main(void)
{
    return ap_conformance_run(&ap_testbed_sim);
}
