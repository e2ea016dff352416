/* A small read-only HTTP/1.1 server on a libuv loop, for the run monitor
 * (docs/monitor.md). Requests are parsed by libhttp-parser; the server only
 * answers GET and HEAD, and bounds everything a client can make it hold:
 * header bytes, connections, the time a request may take, idle keep-alive
 * connections, queued response bytes and server-sent-event streams.
 *
 * Every function runs on the loop's thread. */
#ifndef AP_HTTP_H
#define AP_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#define AP_HTTP_URL_MAX 2048 /* bytes of a request target */

typedef struct ap_http_limits {
    size_t max_header_bytes; /* request line + headers (0 = 8 KiB); over it: 431 */
    uint32_t max_headers;    /* header lines (0 = 64); over it: 431 */
    uint32_t max_conns;      /* open connections (0 = 256); over it: 503 and close */
    uint32_t max_streams;    /* open /api/events streams (0 = 32); over it: 503 */
    uint32_t request_ms;     /* a request must arrive whole within this (0 = 10 s): 408 */
    uint32_t idle_ms;        /* keep-alive connection without a request (0 = 15 s): closed */
    size_t max_queued;       /* response bytes queued per connection (0 = 4 MiB): closed */
} ap_http_limits_t;

typedef struct ap_http_resp {
    int status;       /* default 200 */
    const char *type; /* Content-Type (static string); default text/plain */
    char *body;       /* malloc'd; the server frees it */
    size_t len;
    bool stream;          /* open a server-sent-event stream instead (body = first event) */
    const char *location; /* optional static header value */
} ap_http_resp_t;

/* Called for each complete GET/HEAD request. path is the target without the
 * query string (NUL-terminated, borrowed for the call). Fill resp. */
typedef void (*ap_http_handler_fn)(void *arg, const char *path, ap_http_resp_t *resp);

typedef struct ap_http_stats {
    uint32_t conns, streams;
    uint64_t requests, refused_conns, bad_requests, timeouts, slow_closed;
} ap_http_stats_t;

typedef struct ap_http_server ap_http_server_t;

/* Listens on addr ("127.0.0.1:8080", "[::1]:0"; port 0 = any). lim may be
 * NULL. AP_EINVAL on a bad address, a uv error mapped to AP_E* otherwise. */
int ap__http_start(uv_loop_t *loop, const char *addr, const ap_http_limits_t *lim,
                   ap_http_handler_fn fn, void *arg, ap_http_server_t **out);
/* The bound port. */
int ap__http_port(const ap_http_server_t *s);
/* Sends one server-sent event (data is one line of text, copied) to every
 * open stream; a stream whose queue is full is closed. */
void ap__http_broadcast(ap_http_server_t *s, const char *data, size_t len);
void ap__http_stats(const ap_http_server_t *s, ap_http_stats_t *out);
/* Closes the listener and every connection; the memory is freed once libuv
 * has closed the handles (run the loop). NULL is a no-op. */
void ap__http_close(ap_http_server_t *s);

#endif
