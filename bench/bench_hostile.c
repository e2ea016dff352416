/* `apiary bench hostile`: scripted, bounded attacks on a real node.
 *
 * Each attack starts its own `apiary dht` process on 127.0.0.1 (the target),
 * measures its resident memory before (baseline_rss_mb), during
 * (peak_rss_mb) and 3 s after the attack (rss_after_mb), and runs a
 * legitimate client all along: a fresh identity every 100 ms that joins
 * through the target and gets a record stored before the attack. The share
 * of those gets answered within the client's 2 s RPC deadline while the
 * attack runs is served_during_attack; crashed says whether the target
 * died. The attackers use the library's own node, DHT and Noise code (one
 * libuv host in this process), or plain sockets where the attack is to
 * speak less than the protocol:
 *   sigpipe            a 14 x 64,000-byte dictionary stored, 8 FINDs for it,
 *                      the connection dropped before the answers (x rounds)
 *   store_eviction     one identity stores 2,000 records of 60 KB with a 23 h
 *                      TTL; the legitimate record (1 h TTL, stored first) must
 *                      still be found after (legit_record_found)
 *   stalled_handshakes 300 connections from 8 other loopback addresses that send
 *                      half a handshake message and stall, reopened as they are
 *                      closed
 *   held_connections   1,100 authenticated, idle connections from fresh
 *                      identities
 *   zero_window        3 connections, each opening 1,000 FIND RPCs with a receive
 *                      window of 0 for a ~900 KB answer (raw mux frames on the
 *                      library's own authenticated connection)
 *   partial_requests   12 connections, each sending 64 requests that declare
 *                      1 MiB and carry 1 MiB - 1 byte, never finished
 *   handover           60 fresh server-mode identities join through a target
 *                      holding 256 records of 60 KB (stored by 4 writers before
 *                      the baseline is taken), then leave
 *   exact_mode_kill    3 `apiary train` peers in exact mode (one batch per peer
 *                      per epoch); one is SIGKILLed after epoch 2, the others
 *                      get SIGTERM 5 s later: served is the share of survivors
 *                      that stop within 10 s with their summary line, the
 *                      memory figures are the first survivor's
 *   p2p_slowloris, yamux_streams, yamux_window, p2p_oversized, p2p_no_read
 *                      on the libp2p listener (bench_hostile_p2p.c)
 * --quick: smaller counts (the ctest smoke form). All traffic goes to
 * 127.0.0.1; every loop is bounded in count and time.
 * Options: --attack NAME (only this one), --quick. */
#include "bench.h"
#include "hostile.h"
#include "proc.h"

#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/log.h"
#include "apiary/node.h"
#include "apiary/sync.h"

#include "dht.pb-c.h"
#include "dht/wire.h"
#include "runtime/uv/frame.h"
#include "runtime/uv/mux_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LEGIT_KEY "hostile-legit-record"

void hostile_sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static uint64_t rss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    uint64_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kb = strtoull(line + 6, NULL, 10);
    fclose(f);
    return kb;
}

bool hostile_target_alive(target_t *t)
{
    if (t->dead) return false;
    int st;
    if (waitpid(t->pid, &st, WNOHANG) == t->pid) {
        t->dead = true;
        t->status = st;
        return false;
    }
    return true;
}

static int target_start(target_t *t, const char *log)
{
    memset(t, 0, sizeof *t);
    int fds[2];
    if (pipe(fds)) return -1;
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return -1;
    exe[n] = 0;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        dup2(fds[1], 1);
        int lf = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (lf >= 0) dup2(lf, 2);
        close(fds[0]);
        close(fds[1]);
        execl(exe, exe, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "warn",
              (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    t->pid = pid;
    FILE *f = fdopen(fds[0], "r");
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *s = strstr(line, "/ip4/");
        if (s && strstr(s, "/p2p/")) {
            s[strcspn(s, "\r\n")] = 0;
            snprintf(t->addr, sizeof t->addr, "%s", s);
            char *p = strstr(s, "/tcp/");
            if (p) t->port = atoi(p + 5);
            break;
        }
    }
    fclose(f);
    return t->addr[0] && t->port ? 0 : -1;
}

static void target_stop(target_t *t)
{
    if (!t->pid || !hostile_target_alive(t)) return;
    kill(t->pid, SIGTERM);
    for (int i = 0; i < 100 && hostile_target_alive(t); i++) hostile_sleep_s(0.05);
    if (hostile_target_alive(t)) {
        kill(t->pid, SIGKILL);
        waitpid(t->pid, NULL, 0);
    }
}

/* ---- a DHT client on a host ---------------------------------------------------- */

typedef struct client {
    ap_rt_t *rt;
    ap_dht_t *dht;
} client_t;

static int client_open(client_t *c, ap_host_t *h, const char *addr, bool server)
{
    memset(c, 0, sizeof *c);
    ap_node_opts_t no = {.dial_only = !server, .listen = server ? "/ip4/127.0.0.1/tcp/0" : NULL};
    int rc = ap_node_new(h, &no, &c->rt);
    if (rc) return rc;
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    cfg.client_mode = !server;
    cfg.rpc_timeout_us = 2000000;
    rc = ap_dht_new_sync(c->rt, &cfg, &c->dht);
    if (!rc) rc = ap_dht_bootstrap_sync(c->dht, &addr, 1);
    return rc;
}

static void client_close(client_t *c)
{
    if (c->dht) ap_dht_free_sync(c->dht);
    if (c->rt) ap_node_free(c->rt);
    memset(c, 0, sizeof *c);
}

static int store_rec(client_t *c, const char *key, const char *sub, const uint8_t *v, size_t n,
                     int64_t ttl_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    ap_dht_record_t r = {.key = (const uint8_t *)key,
                         .key_len = strlen(key),
                         .subkey = (const uint8_t *)sub,
                         .subkey_len = sub ? strlen(sub) : 0,
                         .value = v,
                         .value_len = n,
                         .expiration_ms = now + ttl_ms};
    return ap_dht_store_sync(c->dht, &r, NULL);
}

static bool legit_get(ap_host_t *h, const char *addr)
{
    client_t c;
    bool ok = false;
    if (client_open(&c, h, addr, false) == 0) {
        ap_dht_result_t *res = NULL;
        if (ap_dht_get_sync(c.dht, (const uint8_t *)LEGIT_KEY, strlen(LEGIT_KEY), false, &res) ==
                0 &&
            res->found)
            ok = true;
        ap_dht_result_free(res);
    }
    client_close(&c);
    return ok;
}

static void *legit_main(void *arg)
{
    hctx_t *cx = arg;
    ap_host_t *h = ap_host_new();
    if (!h || ap_host_start(h)) return NULL;
    while (!atomic_load(&cx->legit_quit)) {
        bool m = atomic_load(&cx->measuring);
        bool ok = legit_get(h, cx->t.addr);
        if (m && atomic_load(&cx->measuring)) {
            atomic_fetch_add(&cx->probes, 1);
            if (ok) atomic_fetch_add(&cx->served, 1);
        }
        hostile_sleep_s(0.1);
    }
    ap_host_free(h);
    return NULL;
}

static void *sampler_main(void *arg)
{
    hctx_t *cx = arg;
    while (!atomic_load(&cx->sampler_quit)) {
        uint64_t kb = rss_kb(cx->t.pid);
        if (kb > atomic_load(&cx->peak_kb)) atomic_store(&cx->peak_kb, kb);
        hostile_sleep_s(0.05);
    }
    return NULL;
}

/* ---- attacks ------------------------------------------------------------------- */

typedef struct find_burst {
    ap_peer_id_t peer;
    const char *key;
    int n;
} find_burst_t;

static void ignore_done(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                        const char *errmsg)
{
    (void)rt, (void)arg, (void)status, (void)resp, (void)len, (void)errmsg;
}

/* n FIND RPCs for key, sent without waiting (loop thread). */
static void send_finds(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    find_burst_t *fb = arg;
    uint8_t kid[AP_DHT_ID_LEN];
    ap_dht_key_id((const uint8_t *)fb->key, strlen(fb->key), kid);
    ProtobufCBinaryData ids[1] = {{AP_DHT_ID_LEN, kid}};
    Apiary__Dht__FindRequest f = APIARY__DHT__FIND_REQUEST__INIT;
    f.key_ids = ids;
    f.n_key_ids = 1;
    Apiary__Dht__Request r = APIARY__DHT__REQUEST__INIT;
    r.body_case = APIARY__DHT__REQUEST__BODY_FIND;
    r.find = &f;
    uint8_t buf[256];
    size_t len = apiary__dht__request__pack(&r, buf);
    for (int i = 0; i < fb->n; i++)
        ap_rt_rpc_call(rt, &fb->peer, AP_DHT_PROTO, buf, len, NULL, ignore_done, NULL);
    ap_sync_complete(done, 0);
}

/* Raw mux frames on the library's own connection to the target: streams
 * this side's mux never opened (their ids are taken from its counter, so
 * whatever the target answers on them is ignored here as stale). */
typedef struct inject {
    ap_peer_id_t peer;
    bool partial; /* else zero-window FINDs */
    int n;        /* streams to open */
    const uint8_t *req;
    size_t req_len; /* zero window: the FIND request */
    int sent;
} inject_t;

static void inject_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    inject_t *in = arg;
    ap_node_t *n = (ap_node_t *)rt;
    ap_mconn_t *c = n->conns;
    while (c && !(c->state == MC_UP && ap_peer_id_eq(&c->peer, &in->peer))) c = c->next;
    if (!c) {
        ap_sync_complete(done, AP_EUNREACH);
        return;
    }
    static uint8_t chunk[AP_MUX_FRAG];
    for (int i = 0; i < in->n && c->nstreams + 2 < AP_MUX_MAX_STREAMS; i++) {
        uint32_t sid = c->next_sid;
        c->next_sid += 2;
        if (!in->partial) {
            ap__frame_put_open(&c->obuf, sid, true, 0, AP_DHT_PROTO);
            ap__frame_put_data(&c->obuf, sid, true, (uint32_t)in->req_len, in->req, in->req_len);
        } else {
            const uint32_t total = 1u << 20;
            ap__frame_put_open(&c->obuf, sid, true, 1u << 20, AP_DHT_PROTO);
            uint32_t sentb = 0;
            while (sentb < total - 1) {
                uint32_t k = total - 1 - sentb < AP_MUX_FRAG ? total - 1 - sentb : AP_MUX_FRAG;
                ap__frame_put_data(&c->obuf, sid, sentb == 0, total, chunk, k);
                sentb += k;
            }
        }
        in->sent++;
    }
    ap__mconn_want_flush(c);
    ap_sync_complete(done, 0);
}

static size_t find_request(const char *key, uint8_t *buf, size_t cap)
{
    uint8_t kid[AP_DHT_ID_LEN];
    ap_dht_key_id((const uint8_t *)key, strlen(key), kid);
    ProtobufCBinaryData ids[1] = {{AP_DHT_ID_LEN, kid}};
    Apiary__Dht__FindRequest f = APIARY__DHT__FIND_REQUEST__INIT;
    f.key_ids = ids;
    f.n_key_ids = 1;
    Apiary__Dht__Request r = APIARY__DHT__REQUEST__INIT;
    r.body_case = APIARY__DHT__REQUEST__BODY_FIND;
    r.find = &f;
    if (apiary__dht__request__get_packed_size(&r) > cap) return 0;
    return apiary__dht__request__pack(&r, buf);
}

static int store_big_dict(hctx_t *cx)
{
    client_t c;
    int rc = client_open(&c, cx->host, cx->t.addr, false);
    if (rc) return rc;
    static uint8_t v[64000];
    memset(v, 'p', sizeof v);
    char sub[16];
    for (int i = 0; i < 14; i++) {
        snprintf(sub, sizeof sub, "s%d", i);
        store_rec(&c, "hostile-big-dict", sub, v, sizeof v, 600000);
    }
    client_close(&c);
    return 0;
}

static int raw_attack(hctx_t *cx, bool partial, int nconns, int per_conn, int batch, double hold_s)
{
    const char *p2p = strstr(cx->t.addr, "/p2p/");
    inject_t in = {.partial = partial};
    if (!p2p || ap_peer_id_parse(&in.peer, p2p + 5)) return AP_EINVAL;
    uint8_t req[256];
    in.req = req;
    in.req_len = find_request("hostile-big-dict", req, sizeof req);
    client_t *cs = calloc((size_t)nconns, sizeof *cs);
    if (!cs) return AP_ENOMEM;
    int sent = 0;
    double t0 = ap_bench_now();
    for (int k = 0; k < nconns && hostile_target_alive(&cx->t); k++) {
        if (client_open(&cs[k], cx->host, cx->t.addr, false)) continue;
        for (int done = 0;
             done < per_conn && hostile_target_alive(&cx->t) && ap_bench_now() - t0 < 60;) {
            in.n = per_conn - done < batch ? per_conn - done : batch;
            in.sent = 0;
            if (ap_node_call_sync(cs[k].rt, inject_fn, &in)) break;
            done += in.n;
            sent += in.sent;
            hostile_sleep_s(partial ? 0.05 : 0.01); /* let the frames drain */
        }
    }
    hostile_sleep_s(hold_s); /* nothing read, nothing finished */
    for (int k = 0; k < nconns; k++) client_close(&cs[k]);
    free(cs);
    char f[64];
    snprintf(f, sizeof f, "\"attack\":\"%s\"", partial ? "partial_requests" : "zero_window");
    ap_bench_report(cx->b, "streams_opened", sent, "streams", f);
    return 0;
}

static int attack_zero_window(hctx_t *cx)
{
    int rc = store_big_dict(cx);
    if (rc) return rc;
    return raw_attack(cx, false, 3, cx->quick ? 200 : 1000, 50, cx->quick ? 2 : 5);
}

static int attack_partial_requests(hctx_t *cx)
{
    return raw_attack(cx, true, cx->quick ? 3 : 12, cx->quick ? 16 : 64, 4, cx->quick ? 2 : 5);
}

static int attack_sigpipe(hctx_t *cx)
{
    client_t c;
    int rc = client_open(&c, cx->host, cx->t.addr, false);
    if (rc) return rc;
    static uint8_t v[64000];
    memset(v, 'p', sizeof v);
    char sub[16];
    for (int i = 0; i < 14; i++) {
        snprintf(sub, sizeof sub, "s%d", i);
        store_rec(&c, "hostile-big-dict", sub, v, sizeof v, 600000);
    }
    client_close(&c);
    const char *p2p = strstr(cx->t.addr, "/p2p/");
    find_burst_t fb = {.key = "hostile-big-dict", .n = 8};
    if (!p2p || ap_peer_id_parse(&fb.peer, p2p + 5)) return AP_EINVAL;
    int rounds = cx->quick ? 5 : 30;
    for (int i = 0; i < rounds && hostile_target_alive(&cx->t); i++) {
        if (client_open(&c, cx->host, cx->t.addr, false) == 0)
            ap_node_call_sync(c.rt, send_finds, &fb);
        client_close(&c); /* drops the connection before the answers */
        hostile_sleep_s(0.05);
    }
    return 0;
}

static int attack_store_eviction(hctx_t *cx)
{
    client_t c;
    int rc = client_open(&c, cx->host, cx->t.addr, false);
    if (rc) return rc;
    static uint8_t v[60000];
    memset(v, 'e', sizeof v);
    int n = cx->quick ? 400 : 2000, refused = 0;
    char key[48];
    double t0 = ap_bench_now();
    for (int i = 0; i < n && hostile_target_alive(&cx->t) && ap_bench_now() - t0 < 60; i++) {
        snprintf(key, sizeof key, "hostile-flood-%d", i);
        if (store_rec(&c, key, NULL, v, sizeof v, 23ll * 3600 * 1000)) refused++;
    }
    client_close(&c);
    char f[64];
    snprintf(f, sizeof f, "\"attack\":\"store_eviction\"");
    ap_bench_report(cx->b, "flood_records_refused", refused, "records", f);
    return 0;
}

/* A connection to the target from attacker address 127.0.0.(2 + src % 8):
 * the attackers come from other addresses than the legitimate client, as
 * they would on the Internet (all of them are loopback). */
int hostile_tcp_open(int port, int src)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    struct sockaddr_in from = {.sin_family = AF_INET};
    from.sin_addr.s_addr = htonl(INADDR_LOOPBACK + 2 + (uint32_t)(src % 8));
    if (bind(fd, (struct sockaddr *)&from, sizeof from) != 0) {
        close(fd);
        return -1;
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

static int attack_stalled_handshakes(hctx_t *cx)
{
    enum { N = 300 };
    int fds[N];
    bool sent[N];
    for (int i = 0; i < N; i++) {
        fds[i] = hostile_tcp_open(cx->t.port, i);
        sent[i] = false;
    }
    double t0 = ap_bench_now(), dur = cx->quick ? 4 : 15;
    int reopened = 0, max_reopen = cx->quick ? 1000 : 5000;
    /* a frame header announcing a 32-byte message 1, and 10 of its bytes */
    static const uint8_t half[12] = {0, 32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    while (ap_bench_now() - t0 < dur && hostile_target_alive(&cx->t)) {
        struct pollfd p[N];
        for (int i = 0; i < N; i++) {
            p[i].fd = fds[i];
            p[i].events = POLLIN | (sent[i] ? 0 : POLLOUT);
        }
        poll(p, N, 100);
        for (int i = 0; i < N; i++) {
            if (fds[i] < 0 || (p[i].revents & (POLLHUP | POLLERR))) {
                if (fds[i] >= 0) close(fds[i]);
                fds[i] = reopened < max_reopen ? hostile_tcp_open(cx->t.port, i) : -1;
                sent[i] = false;
                reopened++;
                continue;
            }
            if ((p[i].revents & POLLOUT) && !sent[i]) {
                if (send(fds[i], half, sizeof half, MSG_NOSIGNAL) > 0) sent[i] = true;
            }
            if (p[i].revents & POLLIN) {
                char junk[256];
                if (recv(fds[i], junk, sizeof junk, 0) == 0) {
                    close(fds[i]);
                    fds[i] = reopened < max_reopen ? hostile_tcp_open(cx->t.port, i) : -1;
                    sent[i] = false;
                    reopened++;
                }
            }
        }
    }
    for (int i = 0; i < N; i++)
        if (fds[i] >= 0) close(fds[i]);
    return 0;
}

static int attack_held_connections(hctx_t *cx)
{
    int n = cx->quick ? 200 : 1100;
    client_t *cs = calloc((size_t)n, sizeof *cs);
    if (!cs) return AP_ENOMEM;
    double t0 = ap_bench_now();
    int opened = 0;
    for (int i = 0; i < n && hostile_target_alive(&cx->t) && ap_bench_now() - t0 < 60; i++)
        if (client_open(&cs[i], cx->host, cx->t.addr, false) == 0) opened++;
    hostile_sleep_s(cx->quick ? 2
                              : 10); /* held, idle, while the legitimate client comes and goes */
    for (int i = 0; i < n; i++) client_close(&cs[i]);
    free(cs);
    char f[64];
    snprintf(f, sizeof f, "\"attack\":\"held_connections\"");
    ap_bench_report(cx->b, "held_connections_opened", opened, "connections", f);
    return 0;
}

/* Set-up of the hand-over attack (before the baseline): the records the
 * target holds and would hand over, from several writers (each peer's
 * quota is a 32nd of the store, 2 MiB: 32 records of 60 KB each). Legitimate
 * state, not the attack's. */
static int setup_handover(hctx_t *cx)
{
    static uint8_t v[60000];
    memset(v, 'h', sizeof v);
    char key[48];
    for (int w = 0; w < 8; w++) {
        client_t c;
        int rc = client_open(&c, cx->host, cx->t.addr, false);
        if (rc) return rc;
        for (int i = w * 32; i < (w + 1) * 32 && hostile_target_alive(&cx->t); i++) {
            snprintf(key, sizeof key, "hostile-held-%d", i);
            store_rec(&c, key, NULL, v, sizeof v, 3600 * 1000);
        }
        client_close(&c);
    }
    return 0;
}

static int attack_handover(hctx_t *cx)
{
    int n = cx->quick ? 20 : 60;
    for (int i = 0; i < n && hostile_target_alive(&cx->t); i++) {
        client_t s;
        client_open(&s, cx->host, cx->t.addr, true); /* joins: the target hands over */
        hostile_sleep_s(0.05);
        client_close(&s);
    }
    return 0;
}

static bool file_has(const char *path, const char *what)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[1024];
    bool hit = false;
    while (!hit && fgets(line, sizeof line, f)) hit = strstr(line, what) != NULL;
    fclose(f);
    return hit;
}

static bool wait_exit(pid_t pid, double timeout_s, int *status)
{
    double t0 = ap_bench_now();
    while (ap_bench_now() - t0 < timeout_s) {
        if (waitpid(pid, status, WNOHANG) == pid) return true;
        hostile_sleep_s(0.05);
    }
    return false;
}

/* Runs apart from the DHT target: its own processes, its own figures. */
static int exact_mode_kill(ap_bench_ctx_t *b, bool quick)
{
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return 1;
    exe[n] = 0;
    target_t boot;
    char blog[128], logs[3][128];
    snprintf(blog, sizeof blog, "/tmp/apiary-hostile-%d-exact-boot.log", (int)getpid());
    if (target_start(&boot, blog)) return 1;
    pid_t pids[3];
    for (int i = 0; i < 3; i++) {
        snprintf(logs[i], sizeof logs[i], "/tmp/apiary-hostile-%d-exact-%d.log", (int)getpid(), i);
        char seed[8];
        snprintf(seed, sizeof seed, "%d", i + 1);
        char *av[] = {exe,
                      "train",
                      "--run-id",
                      "hostile-exact",
                      "--initial-peers",
                      boot.addr,
                      "--listen",
                      "/ip4/127.0.0.1/tcp/0",
                      "--model",
                      "mlp",
                      "--target-batch-size",
                      "24",
                      "--batch-size",
                      "8",
                      "--max-local-batches-per-epoch",
                      "1",
                      "--duration",
                      quick ? "120" : "600",
                      "--seed",
                      seed,
                      "--matchmaking-window",
                      "0.3",
                      NULL};
        pids[i] = ap_proc_spawn_log(exe, av, logs[i]);
    }
    bool setup = false;
    for (int w = 0; w < 600 && !setup; w++) {
        hostile_sleep_s(0.1);
        setup = file_has(logs[0], "epoch 2 ");
    }
    uint64_t base_kb = rss_kb(pids[0]), peak_kb = base_kb;
    kill(pids[2], SIGKILL);
    waitpid(pids[2], NULL, 0);
    for (int i = 0; i < 50; i++) { /* the survivors now wait for a batch that never comes */
        hostile_sleep_s(0.1);
        uint64_t kb = rss_kb(pids[0]);
        if (kb > peak_kb) peak_kb = kb;
    }
    uint64_t after_kb = rss_kb(pids[0]);
    double t0 = ap_bench_now();
    kill(pids[0], SIGTERM);
    kill(pids[1], SIGTERM);
    int stopped = 0, crashed = 0;
    for (int i = 0; i < 2; i++) {
        int st = 0;
        if (!wait_exit(pids[i], 10, &st)) {
            kill(pids[i], SIGKILL);
            waitpid(pids[i], NULL, 0);
            crashed = 1;
            continue;
        }
        if (WIFSIGNALED(st)) crashed = 1;
        if (file_has(logs[i], "summary:")) stopped++;
    }
    double stop_s = ap_bench_now() - t0;
    target_stop(&boot);
    char f[512];
    snprintf(f, sizeof f,
             "\"attack\":\"exact_mode_kill\",\"served_during_attack\":%.4f,\"probes\":2,"
             "\"peak_rss_mb\":%.1f,\"rss_after_mb\":%.1f,\"baseline_rss_mb\":%.1f,"
             "\"crashed\":%d,\"legit_record_found\":1,\"stop_s\":%.1f,\"setup_ok\":%d",
             stopped / 2.0, peak_kb / 1024.0, after_kb / 1024.0, base_kb / 1024.0, crashed, stop_s,
             setup ? 1 : 0);
    ap_bench_report(b, "served_during_attack", stopped / 2.0, "fraction", f);
    if (!crashed && setup) {
        unlink(blog);
        for (int i = 0; i < 3; i++) unlink(logs[i]);
    }
    return 0;
}

typedef struct attack {
    const char *name;
    int (*run)(hctx_t *cx);
    int (*setup)(hctx_t *cx); /* before the baseline, may be NULL */
} attack_t;

static const attack_t attacks[] = {
    {"sigpipe", attack_sigpipe, NULL},
    {"store_eviction", attack_store_eviction, NULL},
    {"stalled_handshakes", attack_stalled_handshakes, NULL},
    {"held_connections", attack_held_connections, NULL},
    {"zero_window", attack_zero_window, NULL},
    {"partial_requests", attack_partial_requests, NULL},
    {"handover", attack_handover, setup_handover},
    {"p2p_slowloris", hostile_p2p_slowloris, NULL},
    {"yamux_streams", hostile_yamux_streams, NULL},
    {"yamux_window", hostile_yamux_window, NULL},
    {"p2p_oversized", hostile_p2p_oversized, NULL},
    {"p2p_no_read", hostile_p2p_no_read, NULL},
};

int hostile_log_count(const char *path, const char *what)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f)) n += strstr(line, what) != NULL;
    fclose(f);
    return n;
}

static int run_attack(ap_bench_ctx_t *b, const attack_t *a, bool quick)
{
    hctx_t *cx = calloc(1, sizeof *cx);
    if (!cx) return 1;
    cx->b = b;
    cx->quick = quick;
    char log[128];
    snprintf(log, sizeof log, "/tmp/apiary-hostile-%d-%s.log", (int)getpid(), a->name);
    snprintf(cx->log, sizeof cx->log, "%s", log);
    if (target_start(&cx->t, log)) {
        fprintf(stderr, "bench hostile: cannot start the target node\n");
        free(cx);
        return 1;
    }
    cx->host = ap_host_new();
    ap_host_start(cx->host);
    /* the legitimate record, stored before anything else happens */
    client_t c;
    bool stored = client_open(&c, cx->host, cx->t.addr, false) == 0 &&
                  store_rec(&c, LEGIT_KEY, NULL, (const uint8_t *)"legit", 5, 3600 * 1000) == 0;
    client_close(&c);
    int setup_rc = a->setup ? a->setup(cx) : 0;
    hostile_sleep_s(a->setup ? 2 : 1); /* the set-up's buffers released (host.c) */
    uint64_t base_kb = rss_kb(cx->t.pid);
    atomic_store(&cx->peak_kb, base_kb);
    pthread_create(&cx->legit, NULL, legit_main, cx);
    pthread_create(&cx->sampler, NULL, sampler_main, cx);
    atomic_store(&cx->measuring, true);
    double t0 = ap_bench_now();
    int rc = a->run(cx);
    double dt = ap_bench_now() - t0;
    atomic_store(&cx->measuring, false);
    atomic_store(&cx->legit_quit, true);
    pthread_join(cx->legit, NULL);
    hostile_sleep_s(3);
    atomic_store(&cx->sampler_quit, true);
    pthread_join(cx->sampler, NULL);
    bool alive = hostile_target_alive(&cx->t);
    uint64_t after_kb = alive ? rss_kb(cx->t.pid) : 0;
    bool found = alive && legit_get(cx->host, cx->t.addr);
    int probes = atomic_load(&cx->probes), served = atomic_load(&cx->served);
    double frac = probes ? (double)served / probes : 0;
    /* the target's WARN lines (rate-limited: "(+N similar lines suppressed)" not counted) */
    int warns = hostile_log_count(log, " WARN ");
    char f[600];
    snprintf(f, sizeof f,
             "\"attack\":\"%s\",\"served_during_attack\":%.4f,\"probes\":%d,"
             "\"peak_rss_mb\":%.1f,\"rss_after_mb\":%.1f,\"baseline_rss_mb\":%.1f,"
             "\"crashed\":%d,\"exit_status\":%d,\"legit_record_found\":%d,\"attack_s\":%.1f,"
             "\"attack_rc\":%d,\"setup_ok\":%d,\"target_warn_lines\":%d",
             a->name, frac, probes, atomic_load(&cx->peak_kb) / 1024.0, after_kb / 1024.0,
             base_kb / 1024.0, alive ? 0 : 1, alive ? 0 : cx->t.status, found ? 1 : 0, dt, rc,
             stored && setup_rc == 0 ? 1 : 0, warns);
    ap_bench_report(b, "served_during_attack", frac, "fraction", f);
    ap_host_free(cx->host);
    target_stop(&cx->t);
    if (alive) unlink(log);
    free(cx);
    return 0;
}

static int bench_hostile(ap_bench_ctx_t *b, int argc, char **argv)
{
    const char *only = NULL;
    static const struct option lopts[] = {{"attack", required_argument, NULL, 'a'},
                                          {"quick", no_argument, NULL, 'q'},
                                          {NULL, 0, NULL, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        if (ch == 'a')
            only = optarg;
        else if (ch == 'q')
            b->quick = true;
        else
            return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    ap_log_set_level(AP_LOG_ERROR);
    int rc = 0, ran = 0;
    for (size_t i = 0; i < sizeof attacks / sizeof attacks[0]; i++) {
        if (only && strcmp(only, attacks[i].name)) continue;
        rc |= run_attack(b, &attacks[i], b->quick);
        ran++;
    }
    if (!only || !strcmp(only, "exact_mode_kill")) {
        rc |= exact_mode_kill(b, b->quick);
        ran++;
    }
    if (!ran) {
        fprintf(stderr, "bench hostile: unknown attack '%s'\n", only);
        return 2;
    }
    return rc;
}

AP_BENCH(bench_hostile_def, "hostile", bench_hostile,
         "attacks on a real node: served fraction, RSS, crashes (--attack NAME, --quick)")
