/* The runtime conformance suite on the simulator driver. */
#include "conformance.h"

int main(void)
{
    return ap_conformance_run(&ap_testbed_sim);
}
