/* A transport connection for mux unit tests: it records what the mux writes
 * (up to 64 KiB; more is dropped) and whether the mux closed it. Nothing is
 * ever delivered back: the test feeds frames with ap__mux_feed itself. */
#ifndef AP_TEST_FAKE_CONN_H
#define AP_TEST_FAKE_CONN_H

#include "runtime/uv/uv_impl.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ap_test_fake_conn {
    ap_conn_t conn; /* first: the mux sees this */
    uint8_t out[65536];
    size_t len;
    bool closed;
} ap_test_fake_conn_t;

/* Zeroes f and points its connection at the recording vtable. */
void ap_test_fake_conn_init(ap_test_fake_conn_t *f);

#endif
