/* The runtime conformance suite on the libuv driver (in-process transport). */
#include "conformance.h"

int main(void)
{
    return ap_conformance_run(&ap_testbed_uv);
}
