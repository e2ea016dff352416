/* The runtime conformance suite on the libuv driver over libp2p
 * connections on 127.0.0.1 (the native mux agreed as "/apiary/mux/2" in the libp2p upgrade). */
#include "conformance.h"

int main(void)
{
    return ap_conformance_run(&ap_testbed_uv_libp2p);
}
