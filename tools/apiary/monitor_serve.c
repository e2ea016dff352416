/* The run monitor next to a node: a reader thread polls the run's progress
 * records, the HTTP server (src/http) answers on the node's loop. */
#include "monitor.h"

#include "apiary/log.h"
#include "http/http.h"
#include "runtime/uv/uv_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#define MOD       "monitor"
#define PERIOD_MS 1000

struct mon_server {
    ap_host_t *host;
    ap_dht_t *dht;
    ap_http_server_t *http;
    char addr[128];
    char url[160];
    int rc;
    uv_mutex_t mu; /* guards st */
    mon_state_t st;
    uv_thread_t thread;
    bool thread_started;
    uv_mutex_t stop_mu;
    uv_cond_t stop_cv;
    bool stop;
    char *event; /* JSON to broadcast, handed to the loop */
    size_t event_len;
};

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static char *dup_text(const char *s, size_t n)
{
    char *p = malloc(n + 1);
    if (p) memcpy(p, s, n), p[n] = 0;
    return p;
}

static void handle(void *arg, const char *path, ap_http_resp_t *r)
{
    mon_server_t *s = arg;
    if (strcmp(path, "/") == 0 || strcmp(path, "/index.html") == 0) {
        r->type = "text/html; charset=utf-8";
        r->body = dup_text(ap_web_monitor_html, ap_web_monitor_html_len);
        r->len = r->body ? ap_web_monitor_html_len : 0;
        if (!r->body) r->status = 500;
        return;
    }
    if (strcmp(path, "/api/state") == 0 || strcmp(path, "/api/events") == 0) {
        uv_mutex_lock(&s->mu);
        r->body = mon_render_json(&s->st, &r->len);
        uv_mutex_unlock(&s->mu);
        if (!r->body) r->status = 500;
        r->type = "application/json";
        r->stream = strcmp(path, "/api/events") == 0;
        return;
    }
    if (strcmp(path, "/metrics") == 0) {
        ap_http_stats_t hs;
        ap__http_stats(s->http, &hs);
        char extra[1024];
        snprintf(extra, sizeof extra,
                 "# HELP apiary_http_connections Open connections to the monitor.\n"
                 "# TYPE apiary_http_connections gauge\napiary_http_connections %u\n"
                 "# HELP apiary_http_requests_total Requests the monitor answered.\n"
                 "# TYPE apiary_http_requests_total counter\napiary_http_requests_total %llu\n"
                 "# HELP apiary_http_refused_total Requests and connections refused, by why.\n"
                 "# TYPE apiary_http_refused_total counter\n"
                 "apiary_http_refused_total{why=\"bad_request\"} %llu\n"
                 "apiary_http_refused_total{why=\"too_many_connections\"} %llu\n"
                 "apiary_http_refused_total{why=\"timeout\"} %llu\n"
                 "apiary_http_refused_total{why=\"slow_reader\"} %llu\n",
                 hs.conns, (unsigned long long)hs.requests, (unsigned long long)hs.bad_requests,
                 (unsigned long long)hs.refused_conns, (unsigned long long)hs.timeouts,
                 (unsigned long long)hs.slow_closed);
        uv_mutex_lock(&s->mu);
        r->body = mon_render_metrics(&s->st, extra, &r->len);
        uv_mutex_unlock(&s->mu);
        if (!r->body) r->status = 500;
        r->type = "text/plain; version=0.0.4; charset=utf-8";
        return;
    }
    r->status = 404;
    static const char nf[] = "404 Not Found: try /, /api/state, /api/events or /metrics\n";
    r->body = dup_text(nf, sizeof nf - 1);
    r->len = r->body ? sizeof nf - 1 : 0;
}

static void start_on_loop(void *arg)
{
    mon_server_t *s = arg;
    s->rc = ap__http_start(&s->host->loop, s->addr, NULL, handle, s, &s->http);
}

static void broadcast_on_loop(void *arg)
{
    mon_server_t *s = arg;
    if (s->http && s->event) ap__http_broadcast(s->http, s->event, s->event_len);
}

static void close_on_loop(void *arg)
{
    mon_server_t *s = arg;
    ap__http_close(s->http);
    s->http = NULL;
}

static void reader(void *arg)
{
    mon_server_t *s = arg;
    char key[AP_COLLAB_RUN_ID_MAX + 16];
    int kl = snprintf(key, sizeof key, "%s_progress", s->st.run_id);
    for (;;) {
        ap_dht_result_t *res = NULL;
        int rc = ap_dht_get_sync(s->dht, (const uint8_t *)key, (size_t)kl, true, &res);
        uv_mutex_lock(&s->mu);
        if (rc && rc != AP_ENOTFOUND) {
            if (s->st.refresh_failures++ == 0)
                ap_warn(MOD, "reading the progress records of run %s failed: %s", s->st.run_id,
                        ap_strerror(rc));
        }
        mon_state_absorb(&s->st, rc ? NULL : res, wall_ms());
        s->event = mon_render_json(&s->st, &s->event_len);
        uv_mutex_unlock(&s->mu);
        ap_dht_result_free(res);
        if (s->event) ap__host_on_loop(s->host, broadcast_on_loop, s);
        free(s->event);
        s->event = NULL;
        uv_mutex_lock(&s->stop_mu);
        if (!s->stop) uv_cond_timedwait(&s->stop_cv, &s->stop_mu, (uint64_t)PERIOD_MS * 1000000u);
        bool stop = s->stop;
        uv_mutex_unlock(&s->stop_mu);
        if (stop) break;
    }
}

int mon_server_start(ap_rt_t *rt, ap_dht_t *dht, const char *run_id, const char *http_addr,
                     mon_server_t **out)
{
    mon_server_t *s = calloc(1, sizeof *s);
    if (!s) return AP_ENOMEM;
    if (strlen(http_addr) >= sizeof s->addr || mon_state_init(&s->st, run_id)) {
        mon_state_free(&s->st);
        free(s);
        return AP_EINVAL;
    }
    snprintf(s->addr, sizeof s->addr, "%s", http_addr);
    s->host = ap_node_host(rt);
    s->dht = dht;
    uv_mutex_init(&s->mu);
    uv_mutex_init(&s->stop_mu);
    uv_cond_init(&s->stop_cv);
    int rc = ap__host_on_loop(s->host, start_on_loop, s);
    if (!rc) rc = s->rc;
    if (rc) {
        mon_server_stop(s);
        return rc;
    }
    int port = ap__http_port(s->http);
    const char *colon = strrchr(s->addr, ':');
    snprintf(s->url, sizeof s->url, "http://%.*s:%d/", (int)(colon - s->addr), s->addr, port);
    if (uv_thread_create(&s->thread, reader, s) == 0) s->thread_started = true;
    *out = s;
    return 0;
}

const char *mon_server_url(const mon_server_t *s)
{
    return s->url;
}

void mon_server_stop(mon_server_t *s)
{
    if (!s) return;
    if (s->thread_started) {
        uv_mutex_lock(&s->stop_mu);
        s->stop = true;
        uv_cond_signal(&s->stop_cv);
        uv_mutex_unlock(&s->stop_mu);
        uv_thread_join(&s->thread);
    }
    if (s->http) ap__host_on_loop(s->host, close_on_loop, s);
    uv_cond_destroy(&s->stop_cv);
    uv_mutex_destroy(&s->stop_mu);
    uv_mutex_destroy(&s->mu);
    mon_state_free(&s->st);
    free(s);
}
