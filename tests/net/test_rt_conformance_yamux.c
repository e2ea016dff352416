/* The runtime conformance suite on the libuv driver over libp2p
 * connections on 127.0.0.1 (yamux forced: every RPC and stream is a yamux stream negotiated by its
 * protocol name). */
#include "conformance.h"

int main(void)
{
    return ap_conformance_run(&ap_testbed_uv_yamux);
}
