/* Apiary — logging.
 *
 * One line per event: "<time> <LEVEL> <module>: <message>". Silent below WARN
 * by default; APIARY_LOG=debug|info|warn|error|off in the environment, or
 * ap_log_set_level(), changes that. Messages involving a peer name it by its
 * short id. Thread-safe: each line is written with one call. */
#ifndef APIARY_LOG_H
#define APIARY_LOG_H

#include "apiary/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ap_log_level {
    AP_LOG_DEBUG = 0,
    AP_LOG_INFO = 1,
    AP_LOG_WARN = 2,
    AP_LOG_ERROR = 3,
    AP_LOG_OFF = 4,
} ap_log_level_t;

/* Sink: receives the level, the module tag and the formatted message (no
 * trailing newline). Called on whatever thread logged. */
typedef void (*ap_log_sink_fn)(void *arg, ap_log_level_t level, const char *module,
                               const char *msg);

AP_EXPORT void ap_log_set_level(ap_log_level_t level);
AP_EXPORT ap_log_level_t ap_log_get_level(void);
/* Parses "debug", "info", "warn", "error", "off"; returns AP_EINVAL otherwise. */
AP_EXPORT int ap_log_parse_level(const char *s, ap_log_level_t *out);
/* Replace the sink (NULL restores stderr). */
AP_EXPORT void ap_log_set_sink(ap_log_sink_fn fn, void *arg);
AP_EXPORT void ap_log(ap_log_level_t level, const char *module, const char *fmt, ...)
    AP_PRINTF(3, 4);

/* Rate limit for lines a remote party can trigger at will (bad input from
 * unauthenticated connections): at most `burst` lines per `window_ms`; the
 * rest are counted, and the next line that passes says how many were
 * suppressed ("... (+123 similar suppressed in the last 10 s)"). One static
 * ap_log_limit_t per call site, zero-initialised; thread-safe. */
typedef struct ap_log_limit {
    int64_t window_start_ms;
    uint32_t burst, window_ms; /* 0 = 5 lines per 10,000 ms */
    uint32_t in_window;
    uint64_t suppressed;
} ap_log_limit_t;

AP_EXPORT void ap_log_limited(ap_log_limit_t *lim, ap_log_level_t level, const char *module,
                              const char *fmt, ...) AP_PRINTF(4, 5);

#define AP_LOG_ENABLED(lvl) ((lvl) >= ap_log_get_level())
#define ap_debug(mod, ...)                                                                         \
    do {                                                                                           \
        if (AP_LOG_ENABLED(AP_LOG_DEBUG)) ap_log(AP_LOG_DEBUG, mod, __VA_ARGS__);                  \
    } while (0)
#define ap_info(mod, ...)                                                                          \
    do {                                                                                           \
        if (AP_LOG_ENABLED(AP_LOG_INFO)) ap_log(AP_LOG_INFO, mod, __VA_ARGS__);                    \
    } while (0)
#define ap_warn(mod, ...)  ap_log(AP_LOG_WARN, mod, __VA_ARGS__)
#define ap_error(mod, ...) ap_log(AP_LOG_ERROR, mod, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
