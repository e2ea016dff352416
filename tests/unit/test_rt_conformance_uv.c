/* The runtime conformance suite on the libuv driver (in-process transport). */
#include "conformance.h"

extern const ap_testbed_ops_t ap_testbed_uv;

int main(void)
{
    return ap_conformance_run(&ap_testbed_uv);
}
