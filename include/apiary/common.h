/* Apiary — common definitions shared by every public header. MIT licence. */
#ifndef APIARY_COMMON_H
#define APIARY_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* AP_EXPORT marks the public API; everything else is hidden in libapiary.so.
 * AP_NODISCARD: the result must be checked (verify and decode functions:
 * ignoring it would use bytes that were not checked). */
#if defined(__GNUC__)
#define AP_EXPORT       __attribute__((visibility("default")))
#define AP_NODISCARD    __attribute__((warn_unused_result))
#define AP_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define AP_EXPORT
#define AP_NODISCARD
#define AP_PRINTF(f, a)
#endif

#define AP_VERSION_MAJOR  0
#define AP_VERSION_MINOR  1
#define AP_VERSION_PATCH  0
#define AP_VERSION_STRING "0.1.0"

/* Returns AP_VERSION_STRING of the library actually linked. */
AP_EXPORT const char *ap_version(void);

#ifdef __cplusplus
}
#endif
#endif
