/* The runtime conformance suite on the libuv driver over real TCP on
 * 127.0.0.1: every RPC and stream goes through Noise XX (src/net/tcp*.c). */
#include "conformance.h"

extern const ap_testbed_ops_t ap_testbed_uv_tcp;

int main(void)
{
    return ap_conformance_run(&ap_testbed_uv_tcp);
}
