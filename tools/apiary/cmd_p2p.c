/* `apiary ping MULTIADDR` and `apiary identify MULTIADDR`: libp2p's ping
 * and identify against any libp2p node (TCP, Noise, yamux). */
#include "cli.h"

#include "apiary/error.h"
#include "apiary/identity.h"
#include "apiary/multiaddr.h"
#include "p2p/identify.h"
#include "p2p/p2p_conn.h"
#include "net/secure.h"

#include <getopt.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <uv.h>

typedef struct job {
    uv_loop_t loop;
    uv_timer_t timer;
    ap_p2p_host_t *host;
    ap_p2p_conn_t *conn;
    ap_multiaddr_t ma;
    bool json, done;
    int status;
    /* ping */
    long count, round, ok;
    uint8_t sent[AP_PING_LEN], got[AP_PING_LEN];
    size_t have;
    uint64_t t0;
    /* identify */
    uint8_t buf[AP_IDENTIFY_MSG_MAX + 16];
    size_t blen;
} job_t;

static void finish(job_t *j, int status)
{
    if (j->done) return;
    j->done = true;
    j->status = status;
    uv_timer_stop(&j->timer);
    if (j->conn) ap__p2p_conn_close(j->conn);
}

static void timed_out(uv_timer_t *t)
{
    job_t *j = t->data;
    fprintf(stderr, "apiary: no answer in time\n");
    finish(j, AP_ETIMEDOUT);
}

/* ---- ping ------------------------------------------------------------------ */

static void ping_send(ap_p2p_stream_t *s)
{
    job_t *j = ap__p2p_stream_udata(s);
    randombytes_buf(j->sent, sizeof j->sent);
    j->have = 0;
    j->t0 = uv_hrtime();
    uv_timer_start(&j->timer, timed_out, 10000, 0);
    if (ap__p2p_stream_write(s, j->sent, sizeof j->sent) != 0) finish(j, AP_ECLOSED);
}

static void ping_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    job_t *j = ap__p2p_stream_udata(s);
    while (n && !j->done) {
        size_t k = AP_PING_LEN - j->have < n ? AP_PING_LEN - j->have : n;
        memcpy(j->got + j->have, p, k);
        j->have += k;
        p += k;
        n -= k;
        if (j->have < AP_PING_LEN) return;
        double ms = (double)(uv_hrtime() - j->t0) / 1e6;
        bool same = memcmp(j->got, j->sent, AP_PING_LEN) == 0;
        char id[AP_PEER_ID_STR_MAX];
        ap_peer_id_str(ap__p2p_conn_peer(ap__p2p_stream_conn(s)), id);
        if (same) {
            j->ok++;
            printf("%ld: %d bytes from %s: time=%.3f ms\n", j->round + 1, AP_PING_LEN, id, ms);
        } else {
            printf("%ld: %s answered with different bytes\n", j->round + 1, id);
        }
        fflush(stdout);
        if (++j->round == j->count) {
            finish(j, j->ok == j->count ? 0 : AP_ECORRUPT);
            ap__p2p_stream_close(s);
            return;
        }
        ping_send(s);
    }
}

static void ping_close(ap_p2p_stream_t *s, int st)
{
    job_t *j = ap__p2p_stream_udata(s);
    if (!j->done) {
        fprintf(stderr, "apiary ping: the stream ended: %s\n", ap_strerror(st ? st : AP_ECLOSED));
        finish(j, st ? st : AP_ECLOSED);
    }
}

static const ap_p2p_proto_t ping_cli = {AP_PING_PROTO, ping_send, ping_data, NULL, ping_close};

/* ---- identify ------------------------------------------------------------------ */

static void id_data(ap_p2p_stream_t *s, const uint8_t *p, size_t n)
{
    job_t *j = ap__p2p_stream_udata(s);
    if (n > sizeof j->buf - j->blen) {
        fprintf(stderr, "apiary identify: the answer is larger than %d bytes\n",
                AP_IDENTIFY_MSG_MAX);
        ap__p2p_stream_reset(s);
        finish(j, AP_EMSGSIZE);
        return;
    }
    memcpy(j->buf + j->blen, p, n);
    j->blen += n;
}

static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

/* Where an address leads: "loopback", "link-local", "private" (RFC 1918,
 * IPv6 ULA), "shared" (carrier-grade NAT, RFC 6598), else "public". */
static const char *addr_scope(const ap_multiaddr_t *a)
{
    const uint8_t *ip = a->ip;
    if (a->host == AP_MA_HOST_IP4) {
        if (ip[0] == 127) return "loopback";
        if (ip[0] == 169 && ip[1] == 254) return "link-local";
        if (ip[0] == 10 || (ip[0] == 172 && (ip[1] & 0xf0) == 16) || (ip[0] == 192 && ip[1] == 168))
            return "private";
        if (ip[0] == 100 && (ip[1] & 0xc0) == 64) return "shared";
        return "public";
    }
    if (a->host == AP_MA_HOST_IP6) {
        static const uint8_t one[16] = {[15] = 1};
        if (!memcmp(ip, one, 16)) return "loopback";
        if (ip[0] == 0xfe && (ip[1] & 0xc0) == 0x80) return "link-local";
        if ((ip[0] & 0xfe) == 0xfc) return "private";
        return "public";
    }
    return "public"; /* a DNS name */
}

/* How the peer is reached, from what it announces: public if one of its
 * listen addresses is; private (behind a NAT or a firewall: only its own
 * connections reach it) otherwise. A node advertises a mapped address only
 * once AutoNAT confirmed it (docs/nat.md). */
static const char *reachability(const ap_identify_t *info)
{
    for (size_t i = 0; i < info->nlisten; i++)
        if (!strcmp(addr_scope(&info->listen[i]), "public")) return "public";
    return "private";
}

static void print_identify(job_t *j, const ap_identify_t *info, const ap_peer_id_t *peer)
{
    char id[AP_PEER_ID_STR_MAX], ma[AP_MA_TEXT_MAX], at[AP_MA_TEXT_MAX];
    ap_peer_id_str(peer, id);
    ap_multiaddr_t dialled = j->ma;
    dialled.has_peer = false;
    if (ap_multiaddr_print(&dialled, at, sizeof at) < 0) at[0] = 0;
    const char *kt = info->has_key ? ap__secure_key_type_name(info->key_type) : "none";
    if (!j->json) {
        printf("peer              %s\n", id);
        printf("agent version     %s\n", info->agent_version);
        printf("protocol version  %s\n", info->protocol_version);
        printf("public key        %s%s\n", kt,
               info->has_id && ap_peer_id_eq(&info->id, peer) ? " (matches the peer)" : "");
        printf("reached at        %s (direct TCP)\n", at);
        printf("reachability      %s (%s)\n", reachability(info),
               !strcmp(reachability(info), "public") ? "it announces a public address"
               : info->nlisten ? "it announces no public address: behind a NAT or a firewall"
                               : "it announces no address");
        for (size_t i = 0; i < info->nlisten; i++) {
            ap_multiaddr_print(&info->listen[i], ma, sizeof ma);
            printf("listen address    %s (%s)\n", ma, addr_scope(&info->listen[i]));
        }
        if (info->addrs_other)
            printf("listen address    (%zu of other transports)\n", info->addrs_other);
        if (info->has_observed) {
            ap_multiaddr_print(&info->observed, ma, sizeof ma);
            printf("observed address  %s\n", ma);
        }
        for (size_t i = 0; i < info->nprotocols; i++)
            printf("protocol          %s\n", info->protocols[i]);
        return;
    }
    printf("{\"peer\":\"%s\",\"agent_version\":", id);
    json_str(info->agent_version);
    printf(",\"protocol_version\":");
    json_str(info->protocol_version);
    printf(",\"key_type\":\"%s\",\"key_matches_peer\":%s,\"listen_addrs\":[", kt,
           info->has_id && ap_peer_id_eq(&info->id, peer) ? "true" : "false");
    for (size_t i = 0; i < info->nlisten; i++) {
        ap_multiaddr_print(&info->listen[i], ma, sizeof ma);
        printf("%s\"%s\"", i ? "," : "", ma);
    }
    printf("],\"other_listen_addrs\":%zu,\"observed_addr\":", info->addrs_other);
    if (info->has_observed) {
        ap_multiaddr_print(&info->observed, ma, sizeof ma);
        printf("\"%s\"", ma);
    } else {
        printf("null");
    }
    printf(",\"protocols\":[");
    for (size_t i = 0; i < info->nprotocols; i++) {
        if (i) putchar(',');
        json_str(info->protocols[i]);
    }
    printf("],\"reached_at\":\"%s\",\"reachability\":\"%s\"}\n", at, reachability(info));
}

static void id_fin(ap_p2p_stream_t *s)
{
    job_t *j = ap__p2p_stream_udata(s);
    size_t hl, bl;
    static ap_identify_t info;
    int rc = ap__identify_frame(j->buf, j->blen, &hl, &bl);
    if (rc == 1 && hl + bl != j->blen) rc = AP_ECORRUPT;
    if (rc == 1)
        rc = ap__identify_decode(j->buf + hl, bl, &info);
    else if (rc == 0)
        rc = AP_ECORRUPT;
    if (rc != 0) {
        fprintf(stderr, "apiary identify: the answer is not an identify message: %s\n",
                ap_strerror(rc));
        finish(j, rc);
        return;
    }
    print_identify(j, &info, ap__p2p_conn_peer(ap__p2p_stream_conn(s)));
    finish(j, 0); /* first: closing completes the stream (on_close) */
    ap__p2p_stream_close(s);
}

static void id_close(ap_p2p_stream_t *s, int st)
{
    job_t *j = ap__p2p_stream_udata(s);
    if (!j->done) {
        fprintf(stderr, "apiary identify: the stream ended: %s\n",
                ap_strerror(st ? st : AP_ECLOSED));
        finish(j, st ? st : AP_ECLOSED);
    }
}

static const ap_p2p_proto_t id_cli = {AP_IDENTIFY_PROTO, NULL, id_data, id_fin, id_close};

/* ---- connection ------------------------------------------------------------ */

static const ap_p2p_proto_t *want;

static void ready(ap_p2p_conn_t *c, void *arg)
{
    job_t *j = arg;
    int rc = ap__p2p_stream_open(c, want, j, NULL);
    if (rc) finish(j, rc);
}

static void closed(ap_p2p_conn_t *c, void *arg, int status)
{
    job_t *j = arg;
    j->conn = NULL;
    if (!j->done) {
        fprintf(stderr, "apiary: connection failed: %s\n",
                ap_strerror(status ? status : AP_ECLOSED));
        finish(j, status ? status : AP_ECLOSED);
    }
}

static void usage(FILE *f, const char *cmd)
{
    if (strcmp(cmd, "ping") == 0)
        fprintf(f, "usage: apiary ping MULTIADDR [--count N] [--log-level LEVEL]\n\n"
                   "libp2p ping (/ipfs/ping/1.0.0) over TCP + Noise + yamux: one line per round\n"
                   "trip; exit status 0 when all N (default 4) succeeded, 1 otherwise.\n"
                   "MULTIADDR: /ip4|ip6/ADDR/tcp/PORT[/p2p/PEERID] (a PeerID is verified).\n");
    else
        fprintf(f, "usage: apiary identify MULTIADDR [--json] [--log-level LEVEL]\n\n"
                   "libp2p identify (/ipfs/id/1.0.0): prints what the remote announces\n"
                   "(agent and protocol version, key, listen and observed addresses,\n"
                   "protocols); --json prints one JSON object.\n"
                   "MULTIADDR: /ip4|ip6/ADDR/tcp/PORT[/p2p/PEERID] (a PeerID is verified).\n");
}

static int run(int argc, char **argv, bool is_ping)
{
    static job_t j;
    memset(&j, 0, sizeof j);
    j.count = 4;
    static const struct option opts[] = {{"count", required_argument, NULL, 'c'},
                                         {"json", no_argument, NULL, 'j'},
                                         {"log-level", required_argument, NULL, 'l'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "c:jl:h", opts, NULL)) != -1) {
        long long v;
        switch (c) {
        case 'c':
            if (!is_ping || !ap_cli_int("--count", optarg, 1, 1000000, &v)) return 2;
            j.count = (long)v;
            break;
        case 'j':
            if (is_ping) {
                usage(stderr, argv[0]);
                return 2;
            }
            j.json = true;
            break;
        case 'l':
            if (!ap_cli_set_log_level(optarg)) return 2;
            break;
        case 'h':
            usage(stdout, argv[0]);
            return 0;
        default:
            usage(stderr, argv[0]);
            return 2;
        }
    }
    if (optind + 1 != argc) {
        usage(stderr, argv[0]);
        return 2;
    }
    if (ap_multiaddr_parse(&j.ma, argv[optind]) != 0 || !j.ma.has_tcp ||
        (j.ma.host != AP_MA_HOST_IP4 && j.ma.host != AP_MA_HOST_IP6) || j.ma.circuit) {
        fprintf(stderr,
                "apiary %s: '%s' is not a TCP multiaddr (e.g. /ip4/127.0.0.1/tcp/4001 or "
                ".../p2p/12D3KooW...)\n",
                argv[0], argv[optind]);
        return 2;
    }
    ap_identity_t id;
    if (ap_identity_generate(&id) != 0) return 1; /* a throwaway identity, as libp2p tools use */
    uv_loop_init(&j.loop);
    uv_timer_init(&j.loop, &j.timer);
    j.timer.data = &j;
    j.host = ap__p2p_host_new(&j.loop, &id,
                              "apiary/"
                              "0.1.0");
    ap_identity_wipe(&id);
    if (!j.host) return 1;
    want = is_ping ? &ping_cli : &id_cli;
    static const ap_p2p_conn_cbs_t cbs = {ready, closed};
    uv_timer_start(&j.timer, timed_out, 15000, 0);
    int rc = ap__p2p_dial(j.host, &j.ma, &cbs, &j, &j.conn);
    if (rc) {
        fprintf(stderr, "apiary %s: cannot dial: %s\n", argv[0], ap_strerror(rc));
        finish(&j, rc);
    }
    while (!j.done || j.conn) uv_run(&j.loop, UV_RUN_ONCE);
    ap__p2p_host_free(j.host);
    uv_close((uv_handle_t *)&j.timer, NULL);
    uv_run(&j.loop, UV_RUN_DEFAULT);
    uv_loop_close(&j.loop);
    return j.status == 0 ? 0 : 1;
}

static int ping_main(int argc, char **argv)
{
    return run(argc, argv, true);
}

static int identify_main(int argc, char **argv)
{
    return run(argc, argv, false);
}

AP_CLI_COMMAND(cmd_ping, "ping", ping_main, "libp2p ping a peer (/ipfs/ping/1.0.0)")
AP_CLI_COMMAND(cmd_identify, "identify", identify_main,
               "show what a libp2p peer announces (/ipfs/id/1.0.0)")
