/* Apiary — error codes.
 *
 * Every fallible function returns an int: 0 on success, a negative AP_E* code
 * on failure. Codes, names and messages come from one X-macro table so they
 * cannot drift apart. Codes are stable: they travel on the wire in RPC error
 * frames, so never renumber an entry; append new ones at the end. */
#ifndef APIARY_ERROR_H
#define APIARY_ERROR_H

#include "apiary/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* XX(NAME, number, "message") */
#define AP_ERRNO_MAP(XX)                                                                           \
    XX(EINVAL, 1, "invalid argument")                                                              \
    XX(ENOMEM, 2, "out of memory")                                                                 \
    XX(ETIMEDOUT, 3, "deadline exceeded")                                                          \
    XX(ECANCELED, 4, "operation canceled")                                                         \
    XX(EPROTO, 5, "protocol violation")                                                            \
    XX(EMSGSIZE, 6, "message too large")                                                           \
    XX(ENOTFOUND, 7, "not found")                                                                  \
    XX(EEXIST, 8, "already exists")                                                                \
    XX(EUNREACH, 9, "peer unreachable")                                                            \
    XX(ECLOSED, 10, "connection or stream closed")                                                 \
    XX(ERESET, 11, "stream reset by peer")                                                         \
    XX(EAGAIN, 12, "resource temporarily unavailable")                                             \
    XX(EIO, 13, "input/output error")                                                              \
    XX(ECORRUPT, 14, "corrupt data")                                                               \
    XX(EVERSION, 15, "unsupported version")                                                        \
    XX(EAUTH, 16, "authentication failed")                                                         \
    XX(EPERM, 17, "permission denied")                                                             \
    XX(ELIMIT, 18, "limit exceeded")                                                               \
    XX(ENOPROTO, 19, "no handler for protocol")                                                    \
    XX(EHANDLER, 20, "remote handler failed")                                                      \
    XX(ESHUTDOWN, 21, "shutting down")                                                             \
    XX(ERANGE, 22, "value out of range")                                                           \
    XX(ENOTSUP, 23, "operation not supported")                                                     \
    XX(EADDR, 24, "bad address")                                                                   \
    XX(ESTATE, 25, "wrong state for this operation")                                               \
    XX(ENONFINITE, 26, "non-finite value")                                                         \
    XX(EEXPIRED, 27, "record expired")                                                             \
    XX(ESTALE, 28, "newer value already stored")                                                   \
    XX(EBUSY, 29, "resource busy")                                                                 \
    XX(ESYS, 30, "system error")                                                                   \
    XX(EQUOTA, 31, "per-peer quota exceeded")                                                      \
    XX(EFULL, 32, "storage full")                                                                  \
    XX(ERATE, 33, "rate limit exceeded")                                                           \
    XX(ECONFIG, 34, "configuration differs from the run's")

enum ap_errno {
    AP_OK = 0,
#define AP__ERR_ENUM(name, num, msg) AP_##name = -(num),
    AP_ERRNO_MAP(AP__ERR_ENUM)
#undef AP__ERR_ENUM
};

/* Human-readable message for an error code ("unknown error" if unknown). The
 * string is static. */
AP_EXPORT const char *ap_strerror(int err);

/* The code's name without prefix ("ETIMEDOUT"), or "UNKNOWN". Static string. */
AP_EXPORT const char *ap_err_name(int err);

/* Maps a negative errno (or libuv error, which is the same on Unix) to the
 * nearest AP_E* code. */
AP_EXPORT int ap_err_from_errno(int neg_errno);

#ifdef __cplusplus
}
#endif
#endif
