/* Helpers of the libp2p tests over real sockets (tests/net): a loop runner,
 * fixed identities and a dialler that records its connection's fate. */
#ifndef AP_TEST_P2PTEST_H
#define AP_TEST_P2PTEST_H

#include "aptest.h"

#include "apiary/identity.h"
#include "p2p/p2p_conn.h"

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

/* Runs loop one iteration at a time until cond holds (at most 200,000
 * iterations), then asserts it. */
#define AP_TEST_RUN_UNTIL(loop, cond)                                                              \
    do {                                                                                           \
        for (int ap__i = 0; !(cond) && ap__i < 200000; ap__i++) uv_run(loop, UV_RUN_ONCE);         \
        assert_true(cond);                                                                         \
    } while (0)

/* The identity whose seed is 32 bytes of b. */
ap_identity_t ap_test_ident(uint8_t b);

/* A dial's outcome, filled by ap_test_dialer_cbs (arg: the dialer). */
typedef struct ap_test_dialer {
    bool ready, closed;
    int status;       /* the close status */
    ap_p2p_conn_t *c; /* while ready and not closed */
} ap_test_dialer_t;

extern const ap_p2p_conn_cbs_t ap_test_dialer_cbs;

#endif
