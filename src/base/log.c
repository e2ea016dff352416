#include "apiary/log.h"
#include "apiary/error.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static ap_log_level_t g_level = AP_LOG_WARN;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static ap_log_sink_fn g_sink;
static void *g_sink_arg;

static const char *level_names[] = {"DEBUG", "INFO", "WARN", "ERROR", "OFF"};
_Static_assert(sizeof level_names / sizeof level_names[0] == AP_LOG_OFF + 1,
               "one name per ap_log_level_t");

int ap_log_parse_level(const char *s, ap_log_level_t *out)
{
    static const char *names[] = {"debug", "info", "warn", "error", "off"};
    _Static_assert(sizeof names / sizeof names[0] == AP_LOG_OFF + 1, "one name per level");
    if (!s) return AP_EINVAL;
    for (int i = 0; i <= AP_LOG_OFF; i++) {
        if (strcasecmp(s, names[i]) == 0) {
            *out = (ap_log_level_t)i;
            return 0;
        }
    }
    if (strcasecmp(s, "warning") == 0) {
        *out = AP_LOG_WARN;
        return 0;
    }
    return AP_EINVAL;
}

static void init_from_env(void)
{
    ap_log_level_t lvl;
    const char *e = getenv("APIARY_LOG");
    if (e && ap_log_parse_level(e, &lvl) == 0) g_level = lvl;
}

void ap_log_set_level(ap_log_level_t level)
{
    pthread_once(&g_once, init_from_env);
    if (level >= AP_LOG_DEBUG && level <= AP_LOG_OFF) g_level = level;
}

ap_log_level_t ap_log_get_level(void)
{
    pthread_once(&g_once, init_from_env);
    return g_level;
}

void ap_log_set_sink(ap_log_sink_fn fn, void *arg)
{
    g_sink = fn;
    g_sink_arg = arg;
}

void ap_log(ap_log_level_t level, const char *module, const char *fmt, ...)
{
    if (level < ap_log_get_level() || level >= AP_LOG_OFF) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* Untrusted text (peer-sent error messages) may reach a log line: never
     * let it inject newlines or terminal control sequences. */
    for (char *c = msg; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    if (g_sink) {
        g_sink(g_sink_arg, level, module ? module : "-", msg);
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char line[1200];
    int n =
        snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %-5s %s: %s\n", tm.tm_hour, tm.tm_min,
                 tm.tm_sec, ts.tv_nsec / 1000000, level_names[level], module ? module : "-", msg);
    if (n > (int)sizeof line - 1) {
        n = (int)sizeof line - 1;
        line[n - 1] = '\n';
    }
    fwrite(line, 1, (size_t)n, stderr);
}

static pthread_mutex_t limit_mu = PTHREAD_MUTEX_INITIALIZER;

void ap_log_limited(ap_log_limit_t *lim, ap_log_level_t level, const char *module, const char *fmt,
                    ...)
{
    if (level < ap_log_get_level() || level >= AP_LOG_OFF) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    uint64_t suppressed = 0;
    pthread_mutex_lock(&limit_mu);
    uint32_t burst = lim->burst ? lim->burst : 5;
    uint32_t window = lim->window_ms ? lim->window_ms : 10000;
    if (lim->in_window == 0 || now - lim->window_start_ms >= (int64_t)window) {
        lim->window_start_ms = now;
        lim->in_window = 0;
    }
    bool pass = lim->in_window < burst;
    if (pass) {
        lim->in_window++;
        suppressed = lim->suppressed;
        lim->suppressed = 0;
    } else {
        lim->suppressed++;
    }
    pthread_mutex_unlock(&limit_mu);
    if (!pass) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (suppressed)
        ap_log(level, module, "%s (+%llu similar lines suppressed)", msg,
               (unsigned long long)suppressed);
    else
        ap_log(level, module, "%s", msg);
}
