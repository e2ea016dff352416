/* The monitor's HTTP server: libuv TCP + libhttp-parser, read-only, bounded
 * (http.h). */
#include "http/http.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "http"

typedef struct conn conn_t;

struct ap_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    uv_timer_t sweep;
    ap_http_limits_t lim;
    ap_http_handler_fn fn;
    void *arg;
    conn_t *conns; /* doubly linked */
    ap_http_stats_t st;
    int port;
    int open_handles; /* listener + sweep + connections not yet closed */
    bool closing;
    char rbuf[65536]; /* read buffer shared by all connections (loop thread) */
    bool rbuf_busy;
};

struct conn {
    uv_tcp_t tcp;
    ap_http_server_t *s;
    conn_t *prev, *next;
    http_parser parser;
    char url[AP_HTTP_URL_MAX];
    size_t url_len;
    size_t hdr_bytes;
    uint32_t nheaders;
    bool in_request; /* bytes of a request arrived, not complete yet */
    bool stream;     /* an open event stream */
    bool closing;
    bool close_after; /* close once queued writes are done */
    int reject;       /* status to answer instead (431, 413, ...) */
    uint64_t deadline_ms;
    size_t queued; /* bytes in pending writes */
};

typedef struct wreq {
    uv_write_t w;
    conn_t *c;
    size_t len;
    char data[];
} wreq_t;

static void on_handle_closed(uv_handle_t *h);

static void server_maybe_free(ap_http_server_t *s)
{
    if (s->closing && s->open_handles == 0) free(s);
}

static void on_handle_closed(uv_handle_t *h)
{
    ap_http_server_t *s = h->data;
    s->open_handles--;
    server_maybe_free(s);
}

static void on_conn_closed(uv_handle_t *h)
{
    conn_t *c = h->data;
    ap_http_server_t *s = c->s;
    free(c);
    s->open_handles--;
    server_maybe_free(s);
}

static void conn_close(conn_t *c)
{
    if (c->closing) return;
    c->closing = true;
    ap_http_server_t *s = c->s;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->st.conns--;
    if (c->stream) s->st.streams--;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

static void on_written(uv_write_t *w, int status)
{
    wreq_t *r = (wreq_t *)w;
    conn_t *c = r->c;
    c->queued -= r->len;
    free(r);
    if (c->closing) return;
    if (status < 0 || (c->close_after && c->queued == 0)) conn_close(c);
}

/* Queues bytes; closes the connection when its queue would pass the cap. */
static void conn_write(conn_t *c, const char *a, size_t alen, const char *b, size_t blen)
{
    if (c->closing) return;
    if (c->queued + alen + blen > c->s->lim.max_queued) {
        c->s->st.slow_closed++;
        ap_info(MOD, "closing a client that does not read (%zu bytes queued)", c->queued);
        conn_close(c);
        return;
    }
    wreq_t *r = malloc(sizeof *r + alen + blen);
    if (!r) {
        conn_close(c);
        return;
    }
    memcpy(r->data, a, alen);
    if (blen) memcpy(r->data + alen, b, blen);
    r->c = c;
    r->len = alen + blen;
    uv_buf_t buf = uv_buf_init(r->data, (unsigned)r->len);
    int rc = uv_write(&r->w, (uv_stream_t *)&c->tcp, &buf, 1, on_written);
    if (rc) {
        free(r);
        conn_close(c);
        return;
    }
    c->queued += r->len;
}

static const char *reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 413:
        return "Content Too Large";
    case 414:
        return "URI Too Long";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 503:
        return "Service Unavailable";
    default:
        return "Unknown";
    }
}

static void respond(conn_t *c, int status, const char *type, const char *body, size_t len,
                    bool head, bool keep)
{
    char hdr[512];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                     "Connection: %s\r\n\r\n",
                     status, reason(status), type, len, keep ? "keep-alive" : "close");
    conn_write(c, hdr, (size_t)n, body, head ? 0 : len);
    if (!keep) {
        c->close_after = true;
        if (!c->closing && c->queued == 0) conn_close(c);
    }
}

/* An error answer, then close. */
static void refuse(conn_t *c, int status, const char *why)
{
    char body[160];
    int n = snprintf(body, sizeof body, "%d %s: %s\n", status, reason(status), why);
    respond(c, status, "text/plain; charset=utf-8", body, (size_t)n, false, false);
}

static int on_message_begin(http_parser *p)
{
    conn_t *c = p->data;
    c->url_len = 0;
    c->hdr_bytes = 0;
    c->nheaders = 0;
    c->reject = 0;
    return 0;
}

static int count_header(conn_t *c, size_t len)
{
    c->hdr_bytes += len;
    if (c->hdr_bytes > c->s->lim.max_header_bytes) {
        c->reject = 431;
        return 1;
    }
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (c->url_len + len >= sizeof c->url) {
        c->reject = 414;
        return 1;
    }
    memcpy(c->url + c->url_len, at, len);
    c->url_len += len;
    return count_header(c, len);
}

static int on_header_field(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    (void)at;
    /* a field split across reads counts twice: the cap only gets stricter */
    if (++c->nheaders > c->s->lim.max_headers) {
        c->reject = 431;
        return 1;
    }
    return count_header(c, len + 4);
}

static int on_header_value(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    (void)at;
    return count_header(c, len);
}

static int on_headers_complete(http_parser *p)
{
    conn_t *c = p->data;
    if (p->method != HTTP_GET && p->method != HTTP_HEAD) {
        c->reject = 405;
        return -1; /* 1 would mean "skip the body" here */
    }
    if ((p->flags & F_CHUNKED) || (p->content_length > 0 && p->content_length != ULLONG_MAX)) {
        c->reject = 413;
        return -1;
    }
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    (void)at;
    (void)len;
    c->reject = 413;
    return 1;
}

static int on_message_complete(http_parser *p)
{
    conn_t *c = p->data;
    ap_http_server_t *s = c->s;
    c->in_request = false;
    c->deadline_ms = uv_now(s->loop) + s->lim.idle_ms;
    s->st.requests++;
    c->url[c->url_len] = 0;
    struct http_parser_url u;
    http_parser_url_init(&u);
    if (http_parser_parse_url(c->url, c->url_len, 0, &u) != 0 || !(u.field_set & (1 << UF_PATH))) {
        s->st.bad_requests++;
        refuse(c, 400, "bad request target");
        return 1;
    }
    char path[AP_HTTP_URL_MAX];
    memcpy(path, c->url + u.field_data[UF_PATH].off, u.field_data[UF_PATH].len);
    path[u.field_data[UF_PATH].len] = 0;
    bool head = p->method == HTTP_HEAD;
    bool keep = http_should_keep_alive(p) != 0;
    ap_http_resp_t r = {.status = 200, .type = "text/plain; charset=utf-8"};
    s->fn(s->arg, path, &r);
    if (r.stream) {
        if (s->st.streams >= s->lim.max_streams) {
            free(r.body);
            refuse(c, 503, "too many event streams");
            return 1;
        }
        const char *hdr = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          "Cache-Control: no-store\r\nConnection: keep-alive\r\n\r\n";
        conn_write(c, hdr, strlen(hdr), NULL, 0);
        c->stream = true;
        s->st.streams++;
        if (r.body && r.len) {
            conn_write(c, "data: ", 6, NULL, 0);
            conn_write(c, r.body, r.len, "\n\n", 2);
        }
        free(r.body);
        http_parser_pause(p, 1); /* nothing more is read from a stream */
        return 0;
    }
    respond(c, r.status, r.type, r.body ? r.body : "", r.len, head, keep);
    free(r.body);
    return c->close_after ? 1 : 0;
}

static const http_parser_settings settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    conn_t *c = h->data;
    (void)hint;
    if (c->s->rbuf_busy) {
        *buf = uv_buf_init(NULL, 0);
        return;
    }
    c->s->rbuf_busy = true;
    *buf = uv_buf_init(c->s->rbuf, sizeof c->s->rbuf);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    conn_t *c = st->data;
    ap_http_server_t *s = c->s;
    if (buf->base == s->rbuf) s->rbuf_busy = false;
    if (nread == 0 || c->closing) return;
    if (nread < 0) {
        conn_close(c);
        return;
    }
    if (c->stream || c->close_after) return; /* ignore what follows */
    if (!c->in_request) {
        c->in_request = true;
        c->deadline_ms = uv_now(s->loop) + s->lim.request_ms;
    }
    size_t n = http_parser_execute(&c->parser, &settings, buf->base, (size_t)nread);
    if (c->closing || c->close_after || c->stream) return;
    enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
    if (c->reject) {
        s->st.bad_requests++;
        refuse(c, c->reject,
               c->reject == 431   ? "request headers too large"
               : c->reject == 414 ? "request target too long"
               : c->reject == 405 ? "this server is read-only: GET and HEAD only"
                                  : "requests carry no body here");
        return;
    }
    if (e != HPE_OK || n != (size_t)nread) {
        s->st.bad_requests++;
        ap_info(MOD, "malformed request: %s", http_errno_name(e));
        refuse(c, 400, http_errno_description(e));
        return;
    }
    if (c->parser.upgrade) refuse(c, 400, "no protocol upgrades here");
}

static void on_connection(uv_stream_t *ls, int status)
{
    ap_http_server_t *s = ls->data;
    if (status < 0 || s->closing) return;
    conn_t *c = calloc(1, sizeof *c);
    if (!c) return;
    c->s = s;
    if (uv_tcp_init(s->loop, &c->tcp) != 0) {
        free(c);
        return;
    }
    c->tcp.data = c;
    s->open_handles++;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->st.conns++;
    if (uv_accept(ls, (uv_stream_t *)&c->tcp) != 0) {
        conn_close(c);
        return;
    }
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    c->deadline_ms = uv_now(s->loop) + s->lim.idle_ms;
    if (s->st.conns > s->lim.max_conns) {
        s->st.refused_conns++;
        refuse(c, 503, "too many connections");
        return;
    }
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) conn_close(c);
}

static void on_sweep(uv_timer_t *t)
{
    ap_http_server_t *s = t->data;
    uint64_t now = uv_now(s->loop);
    conn_t *next;
    for (conn_t *c = s->conns; c; c = next) {
        next = c->next;
        if (c->stream || c->closing || c->close_after || now < c->deadline_ms) continue;
        if (c->in_request) {
            s->st.timeouts++;
            refuse(c, 408, "the request did not arrive in time");
        } else {
            conn_close(c);
        }
    }
}

static int parse_addr(const char *addr, struct sockaddr_storage *ss)
{
    char host[64];
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr) return AP_EINVAL;
    size_t hl = (size_t)(colon - addr);
    if (hl >= sizeof host) return AP_EINVAL;
    memcpy(host, addr, hl);
    host[hl] = 0;
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end || end == colon + 1 || port < 0 || port > 65535) return AP_EINVAL;
    if (host[0] == '[') {
        if (hl < 3 || host[hl - 1] != ']') return AP_EINVAL;
        host[hl - 1] = 0;
        return uv_ip6_addr(host + 1, (int)port, (struct sockaddr_in6 *)ss) ? AP_EINVAL : 0;
    }
    if (strcmp(host, "localhost") == 0) snprintf(host, sizeof host, "127.0.0.1");
    return uv_ip4_addr(host, (int)port, (struct sockaddr_in *)ss) ? AP_EINVAL : 0;
}

int ap__http_start(uv_loop_t *loop, const char *addr, const ap_http_limits_t *lim,
                   ap_http_handler_fn fn, void *arg, ap_http_server_t **out)
{
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    if (!loop || !addr || !fn || !out || parse_addr(addr, &ss)) return AP_EINVAL;
    ap_http_server_t *s = calloc(1, sizeof *s);
    if (!s) return AP_ENOMEM;
    s->loop = loop;
    s->fn = fn;
    s->arg = arg;
    if (lim) s->lim = *lim;
    if (!s->lim.max_header_bytes) s->lim.max_header_bytes = 8192;
    if (!s->lim.max_headers) s->lim.max_headers = 64;
    if (!s->lim.max_conns) s->lim.max_conns = 256;
    if (!s->lim.max_streams) s->lim.max_streams = 32;
    if (!s->lim.request_ms) s->lim.request_ms = 10000;
    if (!s->lim.idle_ms) s->lim.idle_ms = 15000;
    if (!s->lim.max_queued) s->lim.max_queued = 4u << 20;
    int rc = uv_tcp_init(loop, &s->listener);
    if (rc) {
        free(s);
        return AP_ESYS;
    }
    s->listener.data = s;
    s->open_handles = 1;
    uv_timer_init(loop, &s->sweep);
    s->sweep.data = s;
    s->open_handles++;
    rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&ss, 0);
    if (!rc) rc = uv_listen((uv_stream_t *)&s->listener, 511, on_connection);
    if (rc) {
        ap_warn(MOD, "cannot listen on %s: %s", addr, uv_strerror(rc));
        ap__http_close(s);
        return rc == UV_EADDRINUSE ? AP_EBUSY : AP_EADDR;
    }
    struct sockaddr_storage b;
    int blen = sizeof b;
    uv_tcp_getsockname(&s->listener, (struct sockaddr *)&b, &blen);
    s->port = ntohs(b.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&b)->sin6_port
                                            : ((struct sockaddr_in *)&b)->sin_port);
    uint32_t period = s->lim.request_ms < s->lim.idle_ms ? s->lim.request_ms : s->lim.idle_ms;
    period = period / 4 ? period / 4 : 1;
    uv_timer_start(&s->sweep, on_sweep, period, period);
    uv_unref((uv_handle_t *)&s->sweep);
    *out = s;
    return 0;
}

int ap__http_port(const ap_http_server_t *s)
{
    return s->port;
}

void ap__http_broadcast(ap_http_server_t *s, const char *data, size_t len)
{
    conn_t *next;
    for (conn_t *c = s->conns; c; c = next) {
        next = c->next;
        if (!c->stream || c->closing) continue;
        conn_write(c, "data: ", 6, NULL, 0);
        conn_write(c, data, len, "\n\n", 2);
    }
}

void ap__http_stats(const ap_http_server_t *s, ap_http_stats_t *out)
{
    *out = s->st;
}

void ap__http_close(ap_http_server_t *s)
{
    if (!s || s->closing) return;
    s->closing = true;
    while (s->conns) conn_close(s->conns);
    uv_close((uv_handle_t *)&s->listener, on_handle_closed);
    uv_close((uv_handle_t *)&s->sweep, on_handle_closed);
}
