/* Verified training steps between nodes over TCP + Noise on 127.0.0.1
 * (tests/lib/btard_verified_suite.c). */
#include "btard_verified_suite.h"

int main(void)
{
    return ap_btard_verified_suite_run(&ap_testbed_uv_tcp);
}
