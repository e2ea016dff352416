/* Shared helpers for Apiary's cmocka tests. */
#ifndef AP_TEST_H
#define AP_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "apiary/error.h"
#include "apiary/runtime.h"

/* Asserts an AP_E* result is 0, printing the error name otherwise. */
#define assert_ok(expr)                                                                            \
    do {                                                                                           \
        int ap__rc = (expr);                                                                       \
        if (ap__rc != 0) fail_msg("%s = %d (%s)", #expr, ap__rc, ap_err_name(ap__rc));             \
    } while (0)

/* Path of a file under the checkout's tests/data/ (test vectors etc.):
 * $APIARY_TEST_DATA/rel, else the tree's tests/data/rel; a static buffer. */
const char *ap_test_data_path(const char *rel);
/* Reads a whole file; returns malloc'd bytes (NUL-terminated) or NULL. */
char *ap_test_read_file(const char *path, size_t *len);
/* Seed for randomised tests: APIARY_TEST_SEED or the given default. */
uint64_t ap_test_seed(uint64_t dflt);
/* True when running under sanitizers (sizes may be scaled down). */
int ap_test_sanitized(void);

/* An RPC handler that answers every request with its own bytes. */
void ap_test_rpc_echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req);

#endif
