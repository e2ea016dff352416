/* MPRNG rounds between nodes over TCP + Noise on 127.0.0.1
 * (tests/lib/btard_mprng_suite.c). */
#include "btard_mprng_suite.h"

extern const ap_testbed_ops_t ap_testbed_uv_tcp;

int main(void)
{
    return ap_btard_mprng_suite_run(&ap_testbed_uv_tcp);
}
