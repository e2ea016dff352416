/* `apiary run-token`: the owner of a closed run signs join tokens, and
 * revokes them with records in the DHT (docs/closed_runs.md). */
#include "cli.h"

#include "apiary/collab.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/identity.h"
#include "apiary/node.h"
#include "apiary/run_token.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PEERS 64
#define DAY_MS    86400000LL

static void usage(FILE *f)
{
    fprintf(f, "usage: apiary run-token --owner-key K --run-id R --peer PEERID [--expires 7d]\n"
               "       apiary run-token --owner-key K --run-id R --revoke PEERID\n"
               "                        --initial-peers MADDR[,MADDR...] [--expires 1d]\n\n"
               "The owner of a closed run (apiary train --run-owner <owner's PeerID>) admits a\n"
               "peer by giving it a token (printed on stdout; the peer passes it with --token),\n"
               "or revokes a peer with a record signed by the owner key in the run's DHT.\n"
               "  --owner-key PATH        the owner's Ed25519 key file (apiary identity)\n"
               "  --run-id R              the run the token admits to\n"
               "  --peer PEERID           the peer the token admits\n"
               "  --expires D             lifetime: N[smhd] (default 7d for a token; a\n"
               "                          revocation lives at most 1d in the DHT: store it again\n"
               "                          while the token it revokes is valid)\n"
               "  --revoke PEERID         store the owner's revocation of PEERID\n"
               "  --initial-peers A,B     DHT peers of the run (with --revoke)\n"
               "  --log-level LEVEL       debug, info, warn (default), error, off\n");
}

/* "7d", "12h", "30m", "90s" or plain seconds -> ms (> 0). */
static bool parse_duration(const char *t, int64_t *out)
{
    char *end = NULL;
    double v = strtod(t, &end);
    if (!end || end == t || !(v > 0)) return false;
    double mul = 1000;
    if (*end == 'd')
        mul = 86400e3, end++;
    else if (*end == 'h')
        mul = 3600e3, end++;
    else if (*end == 'm')
        mul = 60e3, end++;
    else if (*end == 's')
        end++;
    if (*end || v * mul > 3650.0 * 86400e3) return false;
    *out = (int64_t)(v * mul);
    return *out > 0;
}

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

typedef struct revoke_args {
    ap_dht_t *dht;
    const char *run_id;
    ap_peer_id_t peer;
    int64_t exp;
    ap_sync_t *done;
} revoke_args_t;

static void revoke_stored(ap_dht_t *dht, void *arg, int status, int nstored)
{
    revoke_args_t *a = arg;
    ap_sync_complete(a->done, status ? status : nstored > 0 ? 0 : AP_EUNREACH);
}

static void do_revoke(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    revoke_args_t *a = arg;
    a->done = done;
    int rc = ap_run_token_revoke(a->dht, a->run_id, &a->peer, a->exp, revoke_stored, a);
    if (rc) ap_sync_complete(done, rc);
}

static int revoke(const ap_identity_t *owner, const char *run_id, const ap_peer_id_t *peer,
                  int64_t exp, char **peers, int npeers)
{
    ap_host_t *host = ap_host_new();
    ap_rt_t *rt = NULL;
    ap_dht_t *dht = NULL;
    ap_node_opts_t no = {.dial_only = true, .ed25519_sk = owner->sk};
    int e = host ? ap_host_start(host) : AP_ENOMEM;
    if (!e) e = ap_node_new(host, &no, &rt);
    ap_dht_config_t cfg;
    ap_dht_config_default(&cfg);
    cfg.client_mode = true;
    if (!e) e = ap_dht_new_sync(rt, &cfg, &dht);
    if (!e) {
        e = ap_dht_bootstrap_sync(dht, (const char *const *)peers, (size_t)npeers);
        if (e) fprintf(stderr, "apiary run-token: no initial peer answered (%s)\n", ap_strerror(e));
    }
    if (!e) {
        revoke_args_t a = {.dht = dht, .run_id = run_id, .peer = *peer, .exp = exp};
        e = ap_node_call_sync(rt, do_revoke, &a);
        if (e)
            fprintf(stderr, "apiary run-token: storing the revocation failed: %s\n",
                    ap_strerror(e));
    }
    if (dht) ap_dht_free_sync(dht);
    if (host) ap_host_free(host);
    return e;
}

static int token_main(int argc, char **argv)
{
    const char *key = NULL, *run_id = NULL, *peer_s = NULL, *revoke_s = NULL, *exp_s = NULL;
    char *peers[MAX_PEERS];
    int npeers = 0, rc = 2;
    enum { O_KEY = 1, O_RUN, O_PEER, O_EXP, O_REVOKE, O_PEERS, O_LOG };
    static const struct option lo[] = {{"owner-key", required_argument, 0, O_KEY},
                                       {"run-id", required_argument, 0, O_RUN},
                                       {"peer", required_argument, 0, O_PEER},
                                       {"expires", required_argument, 0, O_EXP},
                                       {"revoke", required_argument, 0, O_REVOKE},
                                       {"initial-peers", required_argument, 0, O_PEERS},
                                       {"log-level", required_argument, 0, O_LOG},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case O_KEY:
            key = optarg;
            break;
        case O_RUN:
            run_id = optarg;
            break;
        case O_PEER:
            peer_s = optarg;
            break;
        case O_EXP:
            exp_s = optarg;
            break;
        case O_REVOKE:
            revoke_s = optarg;
            break;
        case O_LOG:
            if (!ap_cli_set_log_level(optarg)) goto out;
            break;
        case O_PEERS:
            if (!ap_cli_peer_list("run-token", optarg, peers, &npeers, MAX_PEERS)) goto out;
            break;
        case 'h':
            usage(stdout);
            rc = 0;
            goto out;
        default:
            usage(stderr);
            goto out;
        }
    }
    if (optind != argc || !key || !run_id || !*run_id || strlen(run_id) > AP_COLLAB_RUN_ID_MAX ||
        !peer_s == !revoke_s || (revoke_s && !npeers)) {
        fprintf(stderr,
                "apiary run-token: needs --owner-key, --run-id (1..%d bytes) and either "
                "--peer, or --revoke with --initial-peers\n",
                AP_COLLAB_RUN_ID_MAX);
        usage(stderr);
        goto out;
    }
    ap_peer_id_t peer;
    const char *ps = peer_s ? peer_s : revoke_s;
    if (ap_peer_id_parse(&peer, ps) != 0) {
        fprintf(stderr, "apiary run-token: %s is not a PeerID (12D3KooW...)\n", ps);
        goto out;
    }
    int64_t life = revoke_s ? DAY_MS : 7 * DAY_MS;
    if (exp_s && !parse_duration(exp_s, &life)) {
        fprintf(stderr, "apiary run-token: --expires %s: use N[smhd], e.g. 7d or 12h\n", exp_s);
        goto out;
    }
    if (revoke_s && life > DAY_MS) {
        fprintf(stderr, "apiary run-token: a revocation lives at most 1d in the DHT (--expires "
                        "1d); store it again before then\n");
        goto out;
    }
    ap_identity_t id;
    int e = ap_identity_load(&id, key);
    if (e) {
        fprintf(stderr, "apiary run-token: cannot use the owner key %s: %s\n", key,
                *ap_identity_last_error() ? ap_identity_last_error() : ap_strerror(e));
        rc = 1;
        goto out;
    }
    int64_t exp = wall_ms() + life;
    char until[32] = "?";
    time_t t = (time_t)(exp / 1000);
    struct tm tm;
    if (gmtime_r(&t, &tm)) strftime(until, sizeof until, "%Y-%m-%d %H:%M:%S UTC", &tm);
    if (peer_s) {
        ap_run_token_t tok;
        char text[AP_RUN_TOKEN_TEXT_MAX];
        e = ap_run_token_issue(&id, run_id, &peer, exp, &tok);
        if (!e) e = ap_run_token_format(&tok, text, sizeof text) < 0 ? AP_EINVAL : 0;
        ap_identity_wipe(&id);
        if (e) {
            fprintf(stderr, "apiary run-token: %s\n", ap_strerror(e));
            rc = 1;
            goto out;
        }
        printf("%s\n", text);
        fprintf(stderr, "token for %s in run '%s', valid until %s\n", peer_s, run_id, until);
        rc = 0;
        goto out;
    }
    e = revoke(&id, run_id, &peer, exp, peers, npeers);
    ap_identity_wipe(&id);
    if (e) {
        rc = 1;
        goto out;
    }
    printf("revoked %s in run '%s' (record stored until %s)\n", revoke_s, run_id, until);
    rc = 0;
out:
    for (int i = 0; i < npeers; i++) free(peers[i]);
    return rc;
}

AP_CLI_COMMAND(run_token_cmd, "run-token", token_main,
               "closed runs: sign a peer's join token, or revoke a peer")
