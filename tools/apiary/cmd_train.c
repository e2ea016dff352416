/* `apiary train`: one peer of a collaborative training run (DeDLOC) over TCP.
 * The node (DHT, averaging service, collaborative optimizer) runs on a libuv
 * host thread; this thread computes batches of the model kit's GPT (or MLP)
 * and hands them to the optimizer with the blocking wrappers. */
#include "cli.h"
#include "monitor.h"
#include "train_btard.h"
#include "train_watch.h"

#include "apiary/avg.h"
#include "apiary/btard.h"
#include "apiary/collab.h"
#include "apiary/compress.h"
#include "apiary/dht.h"
#include "apiary/error.h"
#include "apiary/host.h"
#include "apiary/identity.h"
#include "apiary/run_token.h"
#include "apiary/log.h"
#include "apiary/multiaddr.h"
#include "apiary/nn.h"
#include "apiary/node.h"
#include "apiary/run_config.h"
#include "apiary/sync.h"
#include "averaging/avg_codec.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_PEERS  16
#define RSQRT_FROM 10 /* default epoch where the rsqrt decay starts */

static void usage(void)
{
    printf(
        "usage: apiary train [options]\n"
        "Train one model together with other peers: every --target-batch-size samples\n"
        "(from all peers) make one global step, as if it were one big-batch run.\n"
        "  --run-id ID               name of the collaboration (default apiary)\n"
        "  --initial-peers A,B       multiaddrs of running peers or DHT nodes (/p2p/ needed)\n"
        "  --http ADDR               also serve the run monitor there (docs/monitor.md)\n"
        "  --listen MULTIADDR        listen address (default /ip4/0.0.0.0/tcp/0: every\n"
        "                            interface, advertised as the host's addresses)\n"
        "  --announce MULTIADDR      address peers should dial instead, e.g. a port\n"
        "                            forward /ip4/203.0.113.7/tcp/4001 (repeatable, <= 4)\n"
        "  --identity PATH           Ed25519 key file, created (mode 0600) if missing\n"
        "  --relay-service           relay for peers behind NAT (circuit relay v2, limits\n"
        "                            sized for control traffic; docs/nat.md)\n"
        "  --relays MADDR[,MADDR...] behind a NAT: hold a reservation on these relays (with\n"
        "                            /p2p/<PeerID>; <= 8), advertise the circuits through\n"
        "                            them, hole-punch (DCUtR) to peers that come that way\n"
        "  --relay-bulk              also send averaging and state over relayed connections\n"
        "  --no-hole-punch           keep relayed connections (no DCUtR)\n"
        "  --target-batch-size N     samples per global epoch (default 256)\n"
        "  --batch-size N            local batch (default 8)\n"
        "  --model gpt|mlp           the model kit's tiny GPT on --data, or an MLP on\n"
        "                            synthetic clusters (default gpt)\n"
        "  --data PATH               text file (default: the shipped corpus)\n"
        "  --client                  cannot accept connections (client-only peer); without it\n"
        "                            the peer checks whether others can reach it (AutoNAT)\n"
        "                            and is client-only while they cannot (docs/nat.md)\n"
        "  --no-port-map             do not ask the home router (UPnP IGD, NAT-PMP) to\n"
        "                            forward the listen port\n"
        "  --auxiliary               help averaging, train nothing\n"
        "  --bandwidth MBIT[:MBIT]   declared upload[:download] bandwidth in Mbit/s\n"
        "  --compression CODEC       gradient averaging codec: none (float32, default), fp16,\n"
        "                            bf16, uniform8, blockwise8 (same on every peer)\n"
        "  --state-compression CODEC state averaging codec (--average-state-every), the\n"
        "                            same names (default none; same on every peer)\n"
        "  --checkpoint-dir DIR      save every epoch, resume from it at start; a checkpoint\n"
        "                            that cannot be loaded stops the peer (file untouched)\n"
        "  --fresh                   with --checkpoint-dir: move a checkpoint that cannot be\n"
        "                            loaded aside (renamed PATH.refused-<UTC time>) and start\n"
        "                            fresh\n"
        "  --layers N, --embd C, --heads H, --ctx T, --share-layers\n"
        "                            the GPT's shape (default 2 blocks, width 128, 4 heads,\n"
        "                            context 64; the same on every peer)\n"
        "  --optim NAME              lamb (default), adamw, adam or sgd (same on every peer)\n"
        "  --lr X                    peak learning rate (default: lamb 5e-2, adam/adamw 2e-3,\n"
        "                            sgd 0.1)\n"
        "  --warmup N                global epochs of linear warm-up to --lr (default 3)\n"
        "  --schedule NAME           after warm-up: rsqrt (default: --lr until --decay-epochs,\n"
        "                            then --lr * sqrt(decay-epochs / epoch), never below\n"
        "                            --lr/10), constant, or linear or cosine decay to --lr/10\n"
        "                            at --decay-epochs\n"
        "  --decay-epochs N          rsqrt: epoch where the decay starts (default 10);\n"
        "                            linear/cosine: epoch where they reach the minimum\n"
        "                            (default: --max-epochs)\n"
        "  --clip X                  clip the averaged gradient's global norm to X (default\n"
        "                            1.0; 0 = off)\n"
        "  --average-state-every N   epochs between state averaging (default 5; 0, off, with\n"
        "                            --byzantine-tolerant: its rounds are a plain mean)\n"
        "  --max-epochs N            stop at this global epoch (default: never)\n"
        "  --duration S              stop after S seconds (default: never)\n"
        "  --slowdown X              sleep X times the batch's compute time after each batch\n"
        "                            (its CPU time if less than its wall time, so that other\n"
        "                            load on the machine does not lengthen the sleep)\n"
        "  --seed N                  data order seed (default: derived from this peer's PeerID,\n"
        "                            so every peer sees other batches; with --data-shard, 1);\n"
        "                            the same N on a peer gives the same batches again\n"
        "  --matchmaking-window S    seconds to gather peers for a round (default 0.5)\n"
        "  --delayed-updates         average and step in the background while the next\n"
        "                            batches are computed (one optimizer step stale)\n"
        "  --max-local-batches-per-epoch N\n"
        "                            contribute at most N batches to an epoch, then wait for\n"
        "                            its round (with N = 1 and target = peers x batch, each\n"
        "                            peer adds exactly one batch per epoch: exact mode)\n"
        "  --byzantine-tolerant      average gradients with CenteredClip per part\n"
        "                            (ButterflyClip) instead of the mean, check every round\n"
        "                            and ban aggregators caught cheating (same on every peer;\n"
        "                            docs/btard.md)\n"
        "  --btard-tau X             CenteredClip radius over one part (default 1.0)\n"
        "  --btard-validators N      with --byzantine-tolerant: N validators per step recompute\n"
        "                            another member's gradient and accuse it on a mismatch\n"
        "                            (0 = off, the default; at most 64; same on every peer).\n"
        "                            Each peer then sends its gradient on a --batch-size\n"
        "                            minibatch drawn from the step's seed for it\n"
        "  --attack NAME             experiments (with --btard-validators every gradient\n"
        "                            it computes carries a gradient or label attack):\n"
        "                            sign-flip (the gradient times -1000), random-direction\n"
        "                            (1000 x its norm along a direction from the epoch),\n"
        "                            ipm (-0.5 x the gradient), label-flip (labels y ->\n"
        "                            C-1-y), bad-aggregator (add 0.1 to the part it\n"
        "                            aggregates), false-accuser (accuse the next member\n"
        "                            every step), withhold-reveal (withhold its reveal)\n"
        "  --dht-matchmaking        form averaging groups with the DHT matchmaker of the\n"
        "                            averaging module (default: READY window over progress)\n"
        "  --data-shard I/P          MLP: this peer's k-th batch is batch k*P+I of the\n"
        "                            synthetic stream (P peers split one big batch)\n"
        "  --run-owner PEERID        the run is closed: only peers with a token signed by\n"
        "                            PEERID's key take part (docs/closed_runs.md)\n"
        "  --token T                 this peer's token for a closed run (apiary run-token)\n"
        "  --log-level LEVEL         debug, info, warn (default), error, off\n"
        "Stop with Ctrl-C (SIGINT) or SIGTERM: prints a summary line and exits.\n");
}

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig)
{
    stop_flag = sig;
}

typedef struct topts {
    const char *run_id, *listen, *identity, *model, *data, *ckdir, *http;
    const char *run_owner, *token;
    const char *announce[AP_NODE_MAX_ANNOUNCE];
    int nannounce;
    char *peers[MAX_PEERS];
    int npeers;
    uint64_t target, max_epochs;
    int batch;
    bool client, aux, delayed, dhtmm, fresh, seed_set, byz, no_port_map;
    ap_train_attack_t attack; /* --attack (experiments) */
    bool state_every_set;     /* --average-state-every given */
    bool relay_service;
    ap_cli_relays_t relays;
    double btard_tau;
    uint32_t btard_validators;
    double up, down, lr, slowdown, duration, mm_window, clip;
    int layers, embd, heads, ctx, warmup;
    bool share;
    ap_nn_solver_kind_t optim;
    ap_nn_lr_kind_t sched;
    uint64_t decay_epochs;
    uint8_t codec, state_codec;
    uint32_t state_every;
    uint64_t seed;
    uint64_t max_local_batches;
    uint32_t shard, nshards;
} topts_t;

/* --compression / --state-compression: a codec the averaging module carries. */
static bool parse_codec(const char *opt, const char *arg, uint8_t *out)
{
    ap_codec_id_t id;
    if (ap_codec_parse(arg, &id) == 0 && ap__avg_codec_get((uint32_t)id)) {
        *out = (uint8_t)id;
        return true;
    }
    fprintf(stderr,
            "apiary train: %s %s: use none, fp16, bf16, uniform8 or blockwise8 (the codecs "
            "the averaging module carries)\n",
            opt, arg);
    return false;
}

static void rtstats_fn(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_rt_get_stats(rt, arg);
    ap_sync_complete(done, 0);
}

/* Writes a checkpoint consistent with one epoch: encoded on the loop thread
 * from the optimizer's buffers (the freshest parameters, also while a
 * delayed update runs in the background), written here. */
static int save_checkpoint(const char *path, ap_collab_t *c, ap_nn_model_t *m, uint64_t *epoch)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = ap_collab_checkpoint_encode_sync(c, m, &buf, &len, epoch);
    if (!rc) rc = ap_nn_checkpoint_write(path, buf, len);
    free(buf);
    return rc;
}

static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void human_bytes(uint64_t b, char *out, size_t n)
{
    if (b >= (1u << 30))
        snprintf(out, n, "%.2f GiB", b / 1073741824.0);
    else if (b >= (1u << 20))
        snprintf(out, n, "%.1f MiB", b / 1048576.0);
    else
        snprintf(out, n, "%.1f KiB", b / 1024.0);
}

/* A peer's multiaddr as --initial-peers needs it; prints what is expected. */
static bool peer_addr_ok(const char *a)
{
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, a) == 0 && ma.has_tcp && ma.has_peer && ma.host != AP_MA_HOST_NONE)
        return true;
    fprintf(stderr,
            "apiary train: --initial-peers: '%s' is not a peer's multiaddr: expected "
            "/ip4/ADDRESS/tcp/PORT/p2p/PEERID (or /ip6/..., /dns4/NAME/...), as a running peer "
            "prints it on its 'listening on' line\n",
            a);
    return false;
}

/* Why listening on `addr` failed: malformed, in use, or not this host's. */
static void explain_listen(const char *addr, int rc)
{
    ap_multiaddr_t ma;
    if (ap_multiaddr_parse(&ma, addr) != 0 || !ma.has_tcp ||
        (ma.host != AP_MA_HOST_IP4 && ma.host != AP_MA_HOST_IP6)) {
        fprintf(stderr,
                "apiary train: --listen '%s' is not a listen multiaddr: expected "
                "/ip4/ADDRESS/tcp/PORT or /ip6/ADDRESS/tcp/PORT (e.g. /ip4/0.0.0.0/tcp/31337; "
                "port 0 picks a free one)\n",
                addr);
        return;
    }
    /* ask the system what is wrong with that address */
    struct sockaddr_storage ss;
    int err = 0;
    if (ap_multiaddr_to_sockaddr(&ma, &ss, sizeof ss) == 0) {
        int fd = socket(ss.ss_family, SOCK_STREAM, 0);
        if (fd >= 0) {
            socklen_t sl =
                ss.ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
            if (bind(fd, (struct sockaddr *)&ss, sl) != 0) err = errno;
            close(fd);
        }
    }
    if (err == EADDRINUSE)
        fprintf(stderr,
                "apiary train: cannot listen on %s: address already in use (another process "
                "listens on port %u); pick another port, or port 0 for a free one\n",
                addr, ma.port);
    else if (err == EADDRNOTAVAIL)
        fprintf(stderr,
                "apiary train: cannot listen on %s: not an address of this host; use one of its "
                "interface addresses or 0.0.0.0\n",
                addr);
    else if (err == EACCES)
        fprintf(stderr,
                "apiary train: cannot listen on %s: permission denied (ports below 1024 need "
                "privileges); pick a port from 1024\n",
                addr);
    else
        fprintf(stderr, "apiary train: cannot listen on %s: %s\n", addr, ap_strerror(rc));
}

/* The data order's default seed: a hash of the PeerID (FNV-1a), so peers
 * that are not given --seed see different batches. */
static uint64_t peer_seed(const ap_peer_id_t *id)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof id->b; i++) h = (h ^ id->b[i]) * 1099511628211ull;
    return h & 0x7fffffffffffffffull;
}

/* Moves a refused checkpoint aside (never deletes it): PATH.refused-<UTC>. */
static int move_aside(const char *path, char *moved, size_t cap)
{
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    char ts[32];
    strftime(ts, sizeof ts, "%Y%m%dT%H%M%SZ", &tm);
    for (int k = 0; k < 100; k++) {
        if (k)
            snprintf(moved, cap, "%s.refused-%s-%d", path, ts, k);
        else
            snprintf(moved, cap, "%s.refused-%s", path, ts);
        if (access(moved, F_OK) != 0) return rename(path, moved) == 0 ? 0 : -1;
    }
    return -1;
}

static const char *ckpt_reason(int rc)
{
    switch (rc) {
    case AP_ECORRUPT:
        return "corrupt or truncated file (checksum, magic or size)";
    case AP_EVERSION:
        return "another checkpoint format version";
    case AP_EINVAL:
        return "another model or optimizer (shape, kind or size differs)";
    case AP_ENONFINITE:
        return "non-finite numbers in it";
    default:
        return ap_strerror(rc);
    }
}

static int parse_peers(topts_t *o, const char *list)
{
    char *copy = strdup(list);
    for (char *save = NULL, *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->npeers == MAX_PEERS) {
            fprintf(stderr, "apiary train: at most %d initial peers\n", MAX_PEERS);
            free(copy);
            return -1;
        }
        if (!peer_addr_ok(t)) {
            free(copy);
            return -1;
        }
        o->peers[o->npeers++] = strdup(t);
    }
    free(copy);
    return 0;
}

static int run(const topts_t *o)
{
    /* a peer closing a TCP connection must not kill us with SIGPIPE */
    signal(SIGPIPE, SIG_IGN);
    /* the model and its data */
    ap_nn_model_t *m = NULL;
    ap_nn_text_t *text = NULL;
    int T = o->ctx, rc;
    bool gpt = strcmp(o->model, "gpt") == 0;
    char model_desc[AP_RUN_CONFIG_MODEL_MAX] = "";
    if (gpt) {
        ap_nn_gpt_config_t gc = ap_nn_gpt_config_default(T, o->layers, o->heads, o->embd, o->batch);
        gc.share_layers = o->share;
        snprintf(model_desc, sizeof model_desc, "gpt layers %d heads %d embd %d ctx %d%s",
                 gc.n_layer, gc.n_head, gc.n_embd, gc.ctx, gc.share_layers ? " shared" : "");
        rc = ap_nn_gpt_new(&gc, &m);
        if (rc)
            fprintf(stderr,
                    "apiary train: cannot build the GPT (%d blocks, width %d, %d heads, "
                    "context %d): %s\n",
                    o->layers, o->embd, o->heads, o->ctx, ap_strerror(rc));
        if (!rc) {
            const char *path = o->data ? o->data : ap_nn_default_corpus();
            rc = ap_nn_text_open(path, &text);
            if (rc) fprintf(stderr, "apiary train: cannot read %s: %s\n", path, ap_strerror(rc));
        }
    } else {
        ap_nn_mlp_config_t mc = {
            .in_dim = 16, .n_hidden = 1, .hidden = {64}, .n_classes = 4, .max_batch = o->batch};
        snprintf(model_desc, sizeof model_desc, "mlp %d-%d-%d", mc.in_dim, mc.hidden[0],
                 mc.n_classes);
        rc = ap_nn_mlp_new(&mc, &m);
    }
    if (rc) {
        ap_nn_model_free(m);
        return 1;
    }
    ap_nn_model_init(m, 42); /* every first peer starts from the same point */
    ap_nn_params_t *pr = ap_nn_model_params(m);

    /* the node */
    ap_identity_t id;
    bool have_id = false;
    if (o->identity) {
        bool created = false;
        rc = ap_identity_load_or_create(&id, o->identity, &created);
        if (rc) {
            fprintf(stderr, "apiary train: cannot use identity file %s: %s\n", o->identity,
                    *ap_identity_last_error() ? ap_identity_last_error() : ap_strerror(rc));
            ap_nn_model_free(m);
            ap_nn_text_free(text);
            return 1;
        }
        have_id = true;
    }
    ap_host_t *host = ap_host_new();
    rc = host ? ap_host_start(host) : AP_ENOMEM;
    ap_rt_t *rt = NULL;
    ap_node_opts_t no = {.ed25519_sk = have_id ? id.sk : NULL,
                         .listen = o->listen   ? o->listen
                                   : o->client ? "/ip4/127.0.0.1/tcp/0"
                                               : "/ip4/0.0.0.0/tcp/0",
                         .announce = o->announce,
                         .nannounce = o->client ? 0 : o->nannounce,
                         .relay_service = o->relay_service && !o->client};
    if (!o->client) ap_cli_relays_apply(&o->relays, &no);
    if (!rc) rc = ap_node_new(host, &no, &rt);
    if (have_id) ap_identity_wipe(&id);
    if (rc) {
        explain_listen(no.listen, rc);
        if (host) ap_host_free(host);
        ap_nn_model_free(m);
        ap_nn_text_free(text);
        return 1;
    }
    char addrs[AP_NODE_MAX_ANNOUNCE][AP_RT_ADDR_MAX];
    int na = ap_node_listen_addrs_sync(rt, addrs, AP_NODE_MAX_ANNOUNCE, true);
    if (na > AP_NODE_MAX_ANNOUNCE) na = AP_NODE_MAX_ANNOUNCE;
    if (!o->client && !ap_cli_check_reachable("train", addrs, na, o->peers, o->npeers)) {
        ap_host_free(host);
        ap_nn_model_free(m);
        ap_nn_text_free(text);
        return 1;
    }
    ap_dht_config_t dc;
    ap_dht_config_default(&dc);
    dc.client_mode = o->client;
    ap_dht_t *dht = NULL;
    ap_avg_service_t *svc = NULL;
    ap_collab_t *c = NULL;
    rc = ap_dht_new_sync(rt, &dc, &dht);
    if (!rc && o->npeers) {
        rc = ap_dht_bootstrap_sync(dht, (const char *const *)o->peers, (size_t)o->npeers);
        if (rc)
            fprintf(stderr,
                    "apiary train: none of the %d initial peers answered (%s); check the "
                    "addresses (they need /p2p/<PeerID>) and that those nodes run\n",
                    o->npeers, ap_strerror(rc));
    }
    mon_server_t *mon = NULL;
    if (!rc && o->http) {
        rc = mon_server_start(rt, dht, o->run_id, o->http, &mon);
        if (rc)
            fprintf(stderr, "apiary train: cannot serve the monitor on %s: %s\n", o->http,
                    ap_strerror(rc));
        else
            fprintf(stderr, "apiary train: monitor at %s\n", mon_server_url(mon));
    }
    if (!rc) rc = ap_avg_service_new_sync(rt, &svc);
    ap_collab_config_t cfg;
    ap_collab_config_default(&cfg);
    cfg.run_id = o->run_id;
    cfg.target_batch_size = o->target;
    cfg.role = o->aux ? AP_AVG_AUX : o->client ? AP_AVG_CLIENT : AP_AVG_NORMAL;
    cfg.solver = ap_nn_solver_defaults(o->optim);
    cfg.lr = (ap_nn_lr_schedule_t){.kind = o->sched,
                                   .base = (float)o->lr,
                                   .min = o->sched == AP_NN_LR_CONSTANT ? (float)o->lr
                                                                        : (float)(o->lr / 10),
                                   .warmup = (uint64_t)o->warmup,
                                   .total = o->decay_epochs              ? o->decay_epochs
                                            : o->sched == AP_NN_LR_RSQRT ? RSQRT_FROM
                                                                         : o->max_epochs};
    cfg.max_grad_norm = o->clip;
    cfg.model_kind = (uint32_t)ap_nn_model_kind(m);
    ap_nn_model_shape(m, cfg.model_shape);
    cfg.average_state_every = o->state_every;
    cfg.up = o->up;
    cfg.down = o->down;
    cfg.averaging_timeout_us = 20000000;
    cfg.matchmaking_window_us = (uint64_t)(o->mm_window * 1e6);
    cfg.codec = o->codec;
    cfg.state_codec = o->state_codec;
    cfg.delayed_updates = o->delayed;
    cfg.max_local_samples = o->max_local_batches * (uint64_t)o->batch;
    cfg.dht_matchmaking = o->dhtmm;
    cfg.byzantine_tolerant = o->byz;
    cfg.btard_tau = o->btard_tau;
    cfg.btard_attack_shift = o->attack == AP_TRAIN_BAD_AGGREGATOR ? 0.1f : 0.0f;
    cfg.btard_attack_step = o->attack == AP_TRAIN_FALSE_ACCUSER     ? AP_BTARD_STEP_FALSE_ACCUSE
                            : o->attack == AP_TRAIN_WITHHOLD_REVEAL ? AP_BTARD_STEP_WITHHOLD_REVEAL
                                                                    : AP_BTARD_STEP_HONEST;
    ap_train_grad_t *tgrad = NULL;
    if (o->btard_validators) {
        /* the data seed is the run's (1), so that any peer recomputes it */
        tgrad = ap_train_grad_new(m, text, 1, o->batch, o->attack);
        if (!tgrad && !rc) {
            fprintf(stderr, "apiary train: --btard-validators: out of memory\n");
            rc = AP_ENOMEM;
        }
        cfg.btard_validators = o->btard_validators;
        cfg.btard_grad = ap_train_grad;
        cfg.btard_grad_arg = tgrad;
    }
    cfg.model_desc = model_desc;
    cfg.run_owner = o->run_owner;
    cfg.token = o->token;
    if (!rc) {
        rc = ap_collab_new_sync(rt, dht, svc, &cfg, pr->data, pr->count, pr->views, pr->nviews, &c);
        if (rc) fprintf(stderr, "apiary train: bad configuration: %s\n", ap_strerror(rc));
    }
    char ckpath[1024] = "";
    bool fatal = false;   /* stop before training, exit 1 */
    bool resumed = false; /* the parameters came from ckpath */
    if (!rc && o->ckdir && !o->aux) {
        mkdir(o->ckdir, 0700);
        snprintf(ckpath, sizeof ckpath, "%s/%s.ckpt", o->ckdir, o->run_id);
        uint64_t step = 0;
        if (access(ckpath, R_OK) == 0) {
            int lr = ap_nn_checkpoint_load(ckpath, m, ap_collab_solver_mut(c), &step);
            if (lr == 0) {
                ap_collab_set_epoch(c, step);
                resumed = true;
                printf("resumed from %s at epoch %llu\n", ckpath, (unsigned long long)step);
            } else if (!o->fresh) {
                /* never overwrite what was refused: stop, file untouched */
                fprintf(stderr,
                        "apiary train: checkpoint %s cannot be loaded: %s. It is left as it is; "
                        "pass --fresh to move it aside and start without it, or use another "
                        "--checkpoint-dir\n",
                        ckpath, ckpt_reason(lr));
                ckpath[0] = 0;
                fatal = true;
            } else {
                char moved[1100];
                if (move_aside(ckpath, moved, sizeof moved) != 0) {
                    fprintf(stderr, "apiary train: cannot move %s aside: %s; stopping\n", ckpath,
                            strerror(errno));
                    ckpath[0] = 0;
                    fatal = true;
                } else {
                    /* the model and optimizer were left untouched by the refused load */
                    printf("checkpoint %s cannot be loaded (%s): moved to %s; starting fresh\n",
                           ckpath, ckpt_reason(lr), moved);
                }
            }
        }
    }
    ap_cli_nat_t nat = {.cmd = "train",
                        .client = o->client,
                        .no_port_map = o->no_port_map,
                        .relays = o->relays.n > 0,
                        .dht = dht,
                        .collab = &c};
    if (!rc && !fatal) ap_cli_nat_start(rt, no.listen, &nat);
    char pid[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(ap_rt_self(rt), pid);
    uint64_t seed = o->seed_set ? o->seed : o->nshards > 1 ? 1 : peer_seed(ap_rt_self(rt));
    if (!rc && !fatal) {
        printf("peer %s (%s) in run '%s': %zu parameters, target %llu samples per epoch\n", pid,
               o->aux      ? "auxiliary"
               : o->client ? "client-only"
                           : "normal",
               o->run_id, pr->count, (unsigned long long)o->target);
        printf("  optimizer %s, lr %g, warm-up %d epochs, schedule %s",
               ap_nn_solver_kind_name(o->optim), o->lr, o->warmup, ap_nn_lr_kind_name(o->sched));
        if (o->sched == AP_NN_LR_RSQRT)
            printf(" from epoch %llu (at least %g)", (unsigned long long)cfg.lr.total, o->lr / 10);
        else if (o->sched != AP_NN_LR_CONSTANT)
            printf(" to %g at epoch %llu", o->lr / 10, (unsigned long long)cfg.lr.total);
        printf(", clip %g\n", o->clip);
        if (o->byz)
            printf("  byzantine-tolerant: tau %g, %u validators per step%s\n",
                   o->btard_tau > 0 ? o->btard_tau : 1.0, o->btard_validators,
                   o->btard_validators ? "" : " (no gradient check)");
        for (int i = 0; i < na && !o->client; i++) printf("  listening on %s\n", addrs[i]);
        fflush(stdout);
        printf("data order: seed %llu (%s)\n", (unsigned long long)seed,
               o->seed_set      ? "--seed"
               : o->nshards > 1 ? "shared by the shards"
                                : "from the PeerID; --seed N fixes it");
        fflush(stdout);
        rc = ap_collab_start_sync(c);
        if (rc == AP_EPERM) { /* a closed run: no valid token, or revoked */
            fprintf(stderr, "apiary train: %s\n", ap_collab_refusal(c));
            fatal = true;
        } else if (rc == AP_ECONFIG) {
            fprintf(stderr, "apiary train: refused by the run '%s': %s\n", o->run_id,
                    ap_collab_refusal(c));
            fatal = true;
        } else if (rc) {
            fprintf(stderr, "apiary train: could not load the state from peers (%s); training on\n",
                    ap_strerror(rc));
        }
        ap_collab_stats_t st0;
        ap_collab_get_stats_sync(c, &st0);
        if (st0.state_loads)
            printf("caught up: loaded epoch %llu (parameters + optimizer state) from peers\n",
                   (unsigned long long)st0.epoch);
        fflush(stdout);
        rc = 0;
    }

    struct sigaction sig;
    memset(&sig, 0, sizeof sig);
    sig.sa_handler = on_signal;
    sigaction(SIGINT, &sig, NULL);
    sigaction(SIGTERM, &sig, NULL);

    ap_train_watch_t *watch =
        c && !o->aux ? ap_train_watch_start(c, &stop_flag, o->duration, o->target) : NULL;
    bool tty = isatty(STDOUT_FILENO);
    int32_t *in = malloc(sizeof(int32_t) * (size_t)o->batch * (size_t)T);
    int32_t *tg = malloc(sizeof(int32_t) * (size_t)o->batch * (size_t)T);
    float *x = malloc(sizeof(float) * (size_t)o->batch * 16);
    uint64_t cursor = 0, sample = 0, local_samples = 0;
    double t0 = now_s(), last_status = 0;
    uint64_t last_epoch = c ? ap_collab_epoch(c) : 0, loads = 0;
    if (c) {
        ap_collab_stats_t st0;
        ap_collab_get_stats_sync(c, &st0);
        loads = st0.state_loads;
    }
    /* the printed loss: the mean over this peer's batches of the epoch */
    double loss_sum = 0;
    uint64_t loss_n = 0;
    /* where the time goes: computing batches (with --slowdown's sleep) and
     * the epochs' overshoot (samples averaged past the target) */
    double compute_s = 0, overshoot_sum = 0;
    /* the printed global rate: samples the last epoch's step averaged over
     * the epoch's wall time (a dead peer adds nothing from its death on) */
    double epoch_t = t0, global_rate = 0, stepped_samples = 0, first_step_t = 0, last_step_t = 0;
    uint64_t overshoot_n = 0;
    if (fatal) ckpath[0] = 0; /* nothing is written by a peer that was stopped */
    while (!rc && !fatal && !stop_flag) {
        if (o->duration > 0 && now_s() - t0 >= o->duration) break;
        if (o->max_epochs && ap_collab_epoch(c) >= o->max_epochs) break;
        float loss = 0;
        if (!o->aux) {
            double tb = now_s(), cb = cpu_s();
            ap_nn_model_zero_grad(m);
            int r;
            if (gpt) {
                r = ap_nn_text_batch(text, seed, &cursor, o->batch, T, in, tg);
                ap_train_attack_labels(o->attack, tg, (size_t)o->batch * (size_t)T, 256);
                if (!r) r = ap_nn_gpt_loss(m, in, tg, o->batch, T, &loss);
                if (!r) r = ap_nn_gpt_backward(m, NULL, NULL);
            } else {
                /* batch k of this shard: batch k*P+I of the stream */
                uint64_t first = (sample * o->nshards + o->shard) * (uint64_t)o->batch;
                ap_nn_synth_classify(7, seed, first, o->batch, 16, 4, x, tg);
                ap_train_attack_labels(o->attack, tg, (size_t)o->batch, 4);
                sample++;
                r = ap_nn_mlp_forward(m, x, tg, o->batch, &loss);
                if (!r) r = ap_nn_mlp_backward(m);
            }
            if (r == AP_ENONFINITE) {
                /* nothing non-finite is saved: the checkpoint on disk (if
                 * any) is the last good state, or the one to look at */
                float big = 0;
                for (size_t k = 0; k < pr->count; k++) big = fmaxf(big, fabsf(pr->data[k]));
                if (resumed && local_samples == 0)
                    fprintf(stderr,
                            "apiary train: the parameters resumed from %s give a non-finite loss "
                            "on the first batch (largest |parameter| %g): it is left as it is; "
                            "move it aside or use another --checkpoint-dir\n",
                            ckpath, (double)big);
                else
                    fprintf(stderr,
                            "apiary train: the loss is not finite at epoch %llu (largest "
                            "|parameter| %g): training diverged; stopping without saving%s\n",
                            (unsigned long long)ap_collab_epoch(c), (double)big,
                            ckpath[0] ? " (the last checkpoint is kept)" : "");
                ckpath[0] = 0;
                rc = r;
                break;
            }
            if (r) {
                fprintf(stderr, "apiary train: batch failed: %s\n", ap_strerror(r));
                rc = r;
                break;
            }
            if (o->slowdown > 0) {
                /* a slower accelerator: X times the work, not X times the
                 * time other processes held the cores meanwhile */
                double wall = now_s() - tb, cpu = cpu_s() - cb;
                double dt = (cpu > 0 && cpu < wall ? cpu : wall) * o->slowdown;
                struct timespec ts = {(time_t)dt, (long)((dt - (time_t)dt) * 1e9)};
                nanosleep(&ts, NULL);
            }
            compute_s += now_s() - tb;
            ap_train_watch_submit(watch, true);
            /* an attacker for experiments */
            ap_train_attack_grad(o->attack, ap_collab_epoch(c), pr->grad, pr->count);
            r = ap_collab_submit_sync(c, pr->grad, (uint32_t)o->batch, loss);
            ap_train_watch_submit(watch, false);
            if (r == AP_EPERM) { /* the owner revoked this peer */
                fprintf(stderr, "apiary train: %s\n", ap_collab_refusal(c));
                fatal = true;
                ckpath[0] = 0;
                break;
            }
            if (r == AP_ECONFIG) {
                fprintf(stderr, "apiary train: refused by the run '%s': %s\n", o->run_id,
                        ap_collab_refusal(c));
                fatal = true;
                ckpath[0] = 0;
                break;
            }
            if (r && r != AP_ECANCELED) {
                fprintf(stderr, "apiary train: submit failed: %s\n", ap_strerror(r));
                rc = r;
                break;
            }
            local_samples += (uint64_t)o->batch;
            loss_sum += loss;
            loss_n++;
        } else {
            struct timespec ts = {0, 200 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        ap_collab_stats_t st;
        ap_collab_get_stats_sync(c, &st);
        if (st.shut_out && !fatal) { /* an auxiliary peer of a closed run, revoked */
            fprintf(stderr, "apiary train: %s\n", ap_collab_refusal(c));
            fatal = true;
            ckpath[0] = 0;
            break;
        }
        if (st.refused) { /* an auxiliary peer learns it here */
            fprintf(stderr, "apiary train: refused by the run '%s': %s\n", o->run_id,
                    ap_collab_refusal(c));
            fatal = true;
            ckpath[0] = 0;
            break;
        }
        double now = now_s();
        if (st.epoch != last_epoch) {
            ap_rt_stats_t rs;
            ap_node_call_sync(rt, rtstats_fn, &rs);
            char sent[32];
            human_bytes(rs.bytes_sent, sent, sizeof sent);
            if (st.epoch == last_epoch + 1 && st.last_epoch_samples > 0 &&
                st.state_loads == loads) {
                overshoot_sum += (double)st.last_epoch_samples / (double)o->target - 1.0;
                overshoot_n++;
                if (now > epoch_t) global_rate = (double)st.last_epoch_samples / (now - epoch_t);
                if (!first_step_t)
                    first_step_t = now;
                else
                    stepped_samples += (double)st.last_epoch_samples;
                last_step_t = now;
            }
            epoch_t = now;
            loads = st.state_loads;
            char lossbuf[32] = "-";
            if (loss_n) snprintf(lossbuf, sizeof lossbuf, "%.4f", loss_sum / (double)loss_n);
            loss_sum = 0;
            loss_n = 0;
            if (tty) printf("\r\033[K");
            printf("epoch %llu | loss %s | global %.0f samples/s | peers %u | group %u%s | "
                   "sent %s | t %.0fs\n",
                   (unsigned long long)st.epoch, lossbuf, global_rate, st.peers, st.last_group_size,
                   st.last_averaged_fraction < 1 ? " (partial)" : "", sent, now - t0);
            fflush(stdout);
            last_epoch = st.epoch;
            if (ckpath[0]) {
                uint64_t ce = 0;
                int r = save_checkpoint(ckpath, c, m, &ce);
                if (r)
                    fprintf(stderr, "apiary train: checkpoint failed: %s\n", ap_strerror(r));
                else
                    printf("checkpoint: epoch %llu saved to %s\n", (unsigned long long)ce, ckpath);
            }
        } else if (tty && now - last_status > 0.25) {
            printf("\r\033[Kepoch %llu | %.0f/%llu samples | peers' speed %.0f samples/s | loss "
                   "%.4f | peers %u "
                   "| eta %.1fs",
                   (unsigned long long)st.epoch, st.global_samples, (unsigned long long)o->target,
                   st.global_sps, loss_n ? loss_sum / (double)loss_n : 0.0, st.peers,
                   isfinite(st.eta_s) ? st.eta_s : -1.0);
            fflush(stdout);
            last_status = now;
        }
    }
    ap_train_watch_stop(watch);
    bool idle = !rc && c && !o->aux && local_samples == 0;
    if (c && ckpath[0]) {
        /* the last state (with delayed updates: also a step finished in the
         * background and not yet copied into the model) */
        uint64_t ce = 0;
        int r = save_checkpoint(ckpath, c, m, &ce);
        if (r)
            fprintf(stderr, "apiary train: checkpoint failed: %s\n", ap_strerror(r));
        else
            printf("checkpoint: epoch %llu saved to %s (at exit)\n", (unsigned long long)ce,
                   ckpath);
    }
    if (c) {
        ap_collab_stats_t st;
        ap_rt_stats_t rs;
        ap_collab_get_stats_sync(c, &st);
        ap_node_call_sync(rt, rtstats_fn, &rs);
        double el = now_s() - t0;
        if (tty) printf("\r\033[K");
        printf("summary: epochs %llu | local %.1f samples/s | global %.0f samples/s | bytes sent "
               "%llu | received %llu | state loads %llu | partial epochs %llu | served %llu | "
               "refused records %llu | computed during rounds %llu | dropped late %llu | %.0fs\n",
               (unsigned long long)st.epoch, el > 0 ? local_samples / el : 0.0,
               last_step_t > first_step_t ? stepped_samples / (last_step_t - first_step_t)
                                          : global_rate,
               (unsigned long long)rs.bytes_sent, (unsigned long long)rs.bytes_received,
               (unsigned long long)st.state_loads, (unsigned long long)st.epochs_failed,
               (unsigned long long)st.bytes_served, (unsigned long long)st.records_refused,
               (unsigned long long)st.samples_during_rounds, (unsigned long long)st.samples_dropped,
               el);
        if (o->byz)
            printf("byzantine-tolerant: peers banned %llu | rounds dropped by the check %llu\n",
                   (unsigned long long)st.peers_banned, (unsigned long long)st.btard_steps_dropped);
        /* the shares of this peer's wall time (apiary bench train reads them) */
        if (el > 0) {
            double g = st.group_wait_us / 1e6, a = st.averaging_us / 1e6, d = st.download_us / 1e6;
            double rest = el - compute_s - g - a - d;
            printf("time: compute %.3f | group %.3f | averaging %.3f | download %.3f | idle %.3f "
                   "| overshoot %.3f | epochs %llu\n",
                   compute_s / el, g / el, a / el, d / el, rest > 0 ? rest / el : 0.0,
                   overshoot_n ? overshoot_sum / (double)overshoot_n : 0.0,
                   (unsigned long long)overshoot_n);
        }
        fflush(stdout);
        ap_cli_relays_report("train", rt);
        ap_cli_nat_detach(rt, &nat);
        ap_collab_free_sync(rt, c);
    }
    ap_cli_nat_detach(rt, &nat);
    if (svc) ap_avg_service_free_sync(rt, svc);
    mon_server_stop(mon);
    if (dht) ap_dht_free_sync(dht);
    ap_host_free(host);
    ap_train_grad_free(tgrad);
    ap_nn_model_free(m);
    ap_nn_text_free(text);
    free(in);
    free(tg);
    free(x);
    if (fatal) return 1; /* said why */
    if (idle) {
        fprintf(stderr, "apiary train: trained nothing (no batch was submitted)\n");
        return 1;
    }
    return rc ? 1 : 0;
}

static int train_main(int argc, char **argv)
{
    topts_t o = {.run_id = "apiary",
                 .model = "gpt",
                 .target = 256,
                 .batch = 8,
                 .lr = 0,
                 .clip = 1.0,
                 .layers = 2,
                 .embd = 128,
                 .heads = 4,
                 .ctx = 64,
                 .warmup = 3,
                 .optim = AP_NN_LAMB,
                 .sched = AP_NN_LR_RSQRT,
                 .state_every = 5,
                 .seed = 1,
                 .mm_window = 0.5,
                 .nshards = 1};
    enum {
        O_LAYERS = 256,
        O_EMBD,
        O_HEADS,
        O_CTX,
        O_SHARE,
        O_OPTIM,
        O_WARMUP,
        O_SCHED,
        O_DECAY,
        O_CLIP,
        O_HTTP,
        O_BYZ,
        O_TAU,
        O_VALIDATORS,
        O_ATTACK,
        O_OWNER,
        O_TOKEN,
        O_STATE_CODEC
    };
    static const struct option lopts[] = {
        {"run-id", required_argument, NULL, 'r'},
        {"initial-peers", required_argument, NULL, 'p'},
        {"listen", required_argument, NULL, 'L'},
        {"announce", required_argument, NULL, 'A'},
        {"identity", required_argument, NULL, 'i'},
        {"target-batch-size", required_argument, NULL, 't'},
        {"batch-size", required_argument, NULL, 'b'},
        {"model", required_argument, NULL, 'm'},
        {"data", required_argument, NULL, 'd'},
        {"client", no_argument, NULL, 'c'},
        {"no-port-map", no_argument, NULL, 0x4e50},
        {"relay-service", no_argument, NULL, 0x5253},
        {"relays", required_argument, NULL, 0x524c},
        {"relay-bulk", no_argument, NULL, 0x5242},
        {"no-hole-punch", no_argument, NULL, 0x4e48},
        {"auxiliary", no_argument, NULL, 'a'},
        {"bandwidth", required_argument, NULL, 'B'},
        {"compression", required_argument, NULL, 'C'},
        {"state-compression", required_argument, NULL, O_STATE_CODEC},
        {"checkpoint-dir", required_argument, NULL, 'k'},
        {"lr", required_argument, NULL, 'l'},
        {"average-state-every", required_argument, NULL, 's'},
        {"max-epochs", required_argument, NULL, 'E'},
        {"duration", required_argument, NULL, 'D'},
        {"slowdown", required_argument, NULL, 'S'},
        {"seed", required_argument, NULL, 'e'},
        {"matchmaking-window", required_argument, NULL, 'W'},
        {"log-level", required_argument, NULL, 'v'},
        {"delayed-updates", no_argument, NULL, 'U'},
        {"max-local-batches-per-epoch", required_argument, NULL, 'X'},
        {"data-shard", required_argument, NULL, 'H'},
        {"dht-matchmaking", no_argument, NULL, 'M'},
        {"fresh", no_argument, NULL, 'F'},
        {"layers", required_argument, NULL, O_LAYERS},
        {"embd", required_argument, NULL, O_EMBD},
        {"heads", required_argument, NULL, O_HEADS},
        {"ctx", required_argument, NULL, O_CTX},
        {"share-layers", no_argument, NULL, O_SHARE},
        {"optim", required_argument, NULL, O_OPTIM},
        {"warmup", required_argument, NULL, O_WARMUP},
        {"schedule", required_argument, NULL, O_SCHED},
        {"decay-epochs", required_argument, NULL, O_DECAY},
        {"clip", required_argument, NULL, O_CLIP},
        {"http", required_argument, NULL, O_HTTP},
        {"byzantine-tolerant", no_argument, NULL, O_BYZ},
        {"btard-tau", required_argument, NULL, O_TAU},
        {"btard-validators", required_argument, NULL, O_VALIDATORS},
        {"attack", required_argument, NULL, O_ATTACK},
        {"run-owner", required_argument, NULL, O_OWNER},
        {"token", required_argument, NULL, O_TOKEN},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", lopts, NULL)) != -1) {
        switch (ch) {
        case 'r':
            o.run_id = optarg;
            break;
        case O_HTTP:
            o.http = optarg;
            break;
        case 'p':
            if (parse_peers(&o, optarg)) return 2;
            break;
        case 'L':
            o.listen = optarg;
            break;
        case 'A':
            if (!ap_cli_announce(optarg, o.announce, &o.nannounce)) return 2;
            break;
        case 'i':
            o.identity = optarg;
            break;
        case 't': {
            long long v_;
            if (!ap_cli_int("--target-batch-size", optarg, 1, 0x7fffffffffffffffLL, &v_)) return 2;
            o.target = (uint64_t)v_;
        } break;
        case 'b': {
            long long v_;
            if (!ap_cli_int("--batch-size", optarg, 1, 1024, &v_)) return 2;
            o.batch = (int)v_;
        } break;
        case 'm':
            if (strcmp(optarg, "gpt") != 0 && strcmp(optarg, "mlp") != 0) {
                fprintf(stderr,
                        "apiary train: --model %s: unknown model; the choices are gpt (the model "
                        "kit's tiny GPT on --data) and mlp (an MLP on synthetic clusters)\n",
                        optarg);
                return 2;
            }
            o.model = optarg;
            break;
        case 'd':
            o.data = optarg;
            break;
        case 'c':
            o.client = true;
            break;
        case 0x4e50:
            o.no_port_map = true;
            break;
        case 0x5253:
            o.relay_service = true;
            break;
        case 0x524c:
            if (!ap_cli_relays_add("train", optarg, &o.relays)) return 2;
            break;
        case 0x5242:
            o.relays.bulk = true;
            break;
        case 0x4e48:
            o.relays.no_punch = true;
            break;
        case 'a':
            o.aux = true;
            break;
        case 'B': {
            char *end;
            double up = strtod(optarg, &end), down = up;
            if (*end == ':') down = strtod(end + 1, &end);
            if (*end || !(up > 0) || !(down > 0)) {
                fprintf(stderr, "apiary train: --bandwidth wants MBIT or UP:DOWN in Mbit/s\n");
                return 2;
            }
            o.up = up * 1e6 / 8;
            o.down = down * 1e6 / 8;
            break;
        }
        case 'C':
            if (!parse_codec("--compression", optarg, &o.codec)) return 2;
            break;
        case O_STATE_CODEC:
            if (!parse_codec("--state-compression", optarg, &o.state_codec)) return 2;
            break;
        case 'k':
            o.ckdir = optarg;
            break;
        case 'l':
            if (!ap_cli_num("--lr", optarg, 1e-9, 10, &o.lr)) return 2;
            break;
        case 's': {
            long long v_;
            if (!ap_cli_int("--average-state-every", optarg, 0, 1000000000, &v_)) return 2;
            o.state_every = (uint32_t)v_;
            o.state_every_set = true;
        } break;
        case 'E': {
            long long v_;
            if (!ap_cli_int("--max-epochs", optarg, 0, 0x7fffffffffffffffLL, &v_)) return 2;
            o.max_epochs = (uint64_t)v_;
        } break;
        case 'D':
            if (!ap_cli_num("--duration", optarg, 0, 1e9, &o.duration)) return 2;
            break;
        case 'S':
            if (!ap_cli_num("--slowdown", optarg, 0, 1e6, &o.slowdown)) return 2;
            break;
        case 'e': {
            long long v_;
            if (!ap_cli_int("--seed", optarg, 0, 0x7fffffffffffffffLL, &v_)) return 2;
            o.seed = (uint64_t)v_;
            o.seed_set = true;
        } break;
        case 'W':
            if (!ap_cli_num("--matchmaking-window", optarg, 1e-3, 3600, &o.mm_window)) return 2;
            break;
        case 'U':
            o.delayed = true;
            break;
        case 'M':
            o.dhtmm = true;
            break;
        case 'F':
            o.fresh = true;
            break;
        case 'X': {
            long long v_;
            if (!ap_cli_int("--max-local-batches-per-epoch", optarg, 1, 0x7fffffffffffffffLL, &v_))
                return 2;
            o.max_local_batches = (uint64_t)v_;
        }
            if (o.max_local_batches == 0) {
                fprintf(stderr, "apiary train: --max-local-batches-per-epoch wants N >= 1\n");
                return 2;
            }
            break;
        case 'H':
            if (sscanf(optarg, "%u/%u", &o.shard, &o.nshards) != 2 || o.nshards == 0 ||
                o.nshards > 4096 || o.shard >= o.nshards) {
                fprintf(stderr, "apiary train: --data-shard wants I/P with 0 <= I < P <= 4096\n");
                return 2;
            }
            break;
        case 'v':
            if (!ap_cli_set_log_level(optarg)) return 2;
            break;
        case O_LAYERS:
        case O_EMBD:
        case O_HEADS:
        case O_CTX: {
            static const char *const names[] = {"--layers", "--embd", "--heads", "--ctx"};
            static const long long maxv[] = {64, 4096, 64, 4096};
            int k = ch - O_LAYERS;
            long long v_;
            if (!ap_cli_int(names[k], optarg, 1, maxv[k], &v_)) return 2;
            int *dst[] = {&o.layers, &o.embd, &o.heads, &o.ctx};
            *dst[k] = (int)v_;
        } break;
        case O_SHARE:
            o.share = true;
            break;
        case O_OPTIM:
            if (ap_nn_solver_kind_from_name(optarg, &o.optim)) {
                fprintf(stderr, "apiary train: --optim %s: use lamb, adamw, adam or sgd\n", optarg);
                return 2;
            }
            break;
        case O_SCHED:
            if (ap_nn_lr_kind_from_name(optarg, &o.sched)) {
                fprintf(stderr,
                        "apiary train: --schedule %s: use rsqrt, constant, linear or cosine\n",
                        optarg);
                return 2;
            }
            break;
        case O_WARMUP: {
            long long v_;
            if (!ap_cli_int("--warmup", optarg, 0, 1000000000, &v_)) return 2;
            o.warmup = (int)v_;
        } break;
        case O_DECAY: {
            long long v_;
            if (!ap_cli_int("--decay-epochs", optarg, 1, 0x7fffffffffffffffLL, &v_)) return 2;
            o.decay_epochs = (uint64_t)v_;
        } break;
        case O_CLIP:
            if (!ap_cli_num("--clip", optarg, 0, 1e6, &o.clip)) return 2;
            break;
        case O_BYZ:
            o.byz = true;
            break;
        case O_TAU:
            if (!ap_cli_num("--btard-tau", optarg, 1e-12, 1e30, &o.btard_tau)) return 2;
            break;
        case O_VALIDATORS: {
            long long v_;
            if (!ap_cli_int("--btard-validators", optarg, 0, AP_BTARD_STEP_MAX_PEERS, &v_))
                return 2;
            o.btard_validators = (uint32_t)v_;
        } break;
        case O_ATTACK: {
            int a_ = ap_train_attack_parse(optarg);
            if (a_ < 0) {
                fprintf(stderr, "apiary train: --attack %s: the attacks are %s\n", optarg,
                        ap_train_attack_names());
                return 2;
            }
            o.attack = (ap_train_attack_t)a_;
        } break;
        case O_OWNER: {
            ap_peer_id_t p_;
            if (ap_peer_id_parse(&p_, optarg) != 0) {
                fprintf(stderr, "apiary train: --run-owner %s is not a PeerID (12D3KooW...)\n",
                        optarg);
                return 2;
            }
            o.run_owner = optarg;
        } break;
        case O_TOKEN: {
            ap_run_token_t t_;
            if (ap_run_token_parse(optarg, &t_) != 0) {
                fprintf(stderr, "apiary train: --token: not a run token (apiary run-token "
                                "prints one)\n");
                return 2;
            }
            o.token = optarg;
        } break;
        case 'h':
            usage();
            return 0;
        default:
            usage();
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr,
                "apiary train: unexpected argument '%s' (options start with --; see "
                "apiary train --help)\n",
                argv[optind]);
        return 2;
    }
    if (o.client && o.aux) {
        fprintf(stderr, "apiary train: --client and --auxiliary exclude each other (an auxiliary "
                        "peer must accept connections)\n");
        return 2;
    }
    if (o.nshards > 1 && strcmp(o.model, "mlp") != 0) {
        fprintf(stderr, "apiary train: --data-shard is for --model mlp (the synthetic stream)\n");
        return 2;
    }
    if (o.lr == 0) o.lr = o.optim == AP_NN_LAMB ? 5e-2 : o.optim == AP_NN_SGD ? 0.1 : 2e-3;
    if (o.embd % o.heads) {
        fprintf(stderr, "apiary train: --embd %d is not a multiple of --heads %d\n", o.embd,
                o.heads);
        return 2;
    }
    if (o.sched == AP_NN_LR_LINEAR || o.sched == AP_NN_LR_COSINE) {
        uint64_t total = o.decay_epochs ? o.decay_epochs : o.max_epochs;
        if (!total) {
            fprintf(stderr,
                    "apiary train: --schedule %s decays to its minimum at an epoch: give "
                    "--decay-epochs N or --max-epochs N\n",
                    ap_nn_lr_kind_name(o.sched));
            return 2;
        }
        if (total <= (uint64_t)o.warmup) {
            fprintf(stderr,
                    "apiary train: the decay ends at epoch %llu, within the %d warm-up epochs: "
                    "give more --decay-epochs or fewer --warmup\n",
                    (unsigned long long)total, o.warmup);
            return 2;
        }
    }
    if (!(o.lr > 0) || !(o.mm_window > 0)) {
        fprintf(stderr, "apiary train: --lr and --matchmaking-window must be > 0\n");
        return 2;
    }
    if (o.attack >= AP_TRAIN_BAD_AGGREGATOR && !o.byz) {
        fprintf(stderr,
                "apiary train: --attack %s needs --byzantine-tolerant (it attacks the "
                "verified step's check)\n",
                ap_train_attack_name(o.attack));
        return 2;
    }
    if (o.btard_validators && !o.byz) {
        fprintf(stderr, "apiary train: --btard-validators needs --byzantine-tolerant (the "
                        "validators check the verified step's rounds)\n");
        return 2;
    }
    /* State averaging rounds are a plain mean, which one Byzantine peer can
     * poison, and they leave every peer with other parameters, so the
     * gradient check could not recompute anyone's gradient: off by default
     * in a Byzantine-tolerant run, refused with validators. */
    if (o.byz && !o.state_every_set) o.state_every = 0;
    if (o.btard_validators && o.state_every) {
        fprintf(stderr, "apiary train: --btard-validators needs --average-state-every 0 (state "
                        "averaging leaves the peers with different parameters; a validator "
                        "recomputes a gradient on the parameters every member holds)\n");
        return 2;
    }
    if (o.btard_validators && o.delayed) {
        fprintf(stderr, "apiary train: --btard-validators and --delayed-updates exclude each "
                        "other (a validator recomputes a gradient on the epoch's parameters)\n");
        return 2;
    }
    if (o.fresh && !o.ckdir) {
        fprintf(stderr, "apiary train: --fresh needs --checkpoint-dir (it moves a checkpoint "
                        "there aside)\n");
        return 2;
    }
    int rc = run(&o);
    for (int i = 0; i < o.npeers; i++) free(o.peers[i]);
    return rc;
}

AP_CLI_COMMAND(cmd_train, "train", train_main,
               "train a model collaboratively with other peers (apiary train --help)")
