/* The all-reduce on real processes: group file, spawn and collect
 * (allreduce_procs.h). */
#include "allreduce_procs.h"

#include "apiary/error.h"
#include "apiary/identity.h"
#include "apiary/multiaddr.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- names ------------------------------------------------------------------ */

const char *ap_arp_role_name(ap_avg_role_t r)
{
    return r == AP_AVG_CLIENT ? "client" : r == AP_AVG_AUX ? "aux" : "normal";
}

int ap_arp_role_parse(const char *s, ap_avg_role_t *out)
{
    if (!strcmp(s, "normal"))
        *out = AP_AVG_NORMAL;
    else if (!strcmp(s, "client"))
        *out = AP_AVG_CLIENT;
    else if (!strcmp(s, "aux"))
        *out = AP_AVG_AUX;
    else
        return AP_EINVAL;
    return 0;
}

static const struct {
    const char *name;
    uint8_t id;
} codec_names[] = {{"none", AP_AVG_CODEC_F32},
                   {"f32", AP_AVG_CODEC_F32},
                   {"float32", AP_AVG_CODEC_F32},
                   {"fp16", AP_AVG_CODEC_FP16},
                   {"bf16", AP_AVG_CODEC_BF16},
                   {"uniform8", AP_AVG_CODEC_UNIFORM8},
                   {"blockwise8", AP_AVG_CODEC_BLOCKWISE8}};

int ap_arp_codec_parse(const char *s, uint8_t *out)
{
    for (size_t i = 0; i < sizeof codec_names / sizeof codec_names[0]; i++)
        if (!strcmp(s, codec_names[i].name)) {
            *out = codec_names[i].id;
            return 0;
        }
    return AP_EINVAL;
}

const char *ap_arp_codec_name(uint8_t codec)
{
    for (size_t i = 0; i < sizeof codec_names / sizeof codec_names[0]; i++)
        if (codec_names[i].id == codec) return codec_names[i].name;
    return "?";
}

bool ap_arp_lead_parse(const char *s, uint32_t *out)
{
    if (!strcmp(s, "auto")) return *out = 0, true;
    if (!strcmp(s, "off")) return *out = AP_ALLREDUCE_LEAD_OFF, true;
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v == 0 || v >= AP_ALLREDUCE_LEAD_OFF)
        return false;
    *out = (uint32_t)v;
    return true;
}

const char *ap_arp_lead_name(uint32_t lead, char buf[16])
{
    if (lead == 0) return "auto";
    if (lead == AP_ALLREDUCE_LEAD_OFF) return "off";
    snprintf(buf, 16, "%u", lead);
    return buf;
}

void ap_arp_group_id(uint64_t round, uint8_t out[AP_AVG_GROUP_ID_LEN])
{
    memset(out, 0, AP_AVG_GROUP_ID_LEN);
    memcpy(out, "apiary/bench/ar", 15);
    for (int i = 0; i < 8; i++) out[16 + i] = (uint8_t)(round >> (56 - 8 * i));
}

/* ---- group file ------------------------------------------------------------- */

int ap_arp_group_write(const char *path, const ap_arp_member_t *m, size_t n)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return AP_EINVAL;
    FILE *f = fopen(tmp, "w");
    if (!f) return AP_EIO;
    fprintf(f, "# apiary all-reduce group: member MULTIADDR ROLE UP_Bps DOWN_Bps WEIGHT\n");
    for (size_t i = 0; i < n; i++)
        fprintf(f, "member %s %s %.17g %.17g %.17g\n", m[i].addr, ap_arp_role_name(m[i].role),
                m[i].up, m[i].down, m[i].weight);
    bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return AP_EIO;
    }
    return 0;
}

static int gerr(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (err && len) vsnprintf(err, len, fmt, ap);
    va_end(ap);
    return AP_ECORRUPT;
}

static bool parse_pos(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || !(v > 0)) return false;
    *out = v;
    return true;
}

int ap_arp_group_read(const char *path, ap_arp_member_t *m, size_t max, size_t *n, char *err,
                      size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        if (err && errlen) snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return AP_EIO;
    }
    char line[1024];
    size_t cnt = 0;
    int lineno = 0, rc = 0;
    ap_peer_id_t ids[AP_ARP_MAX_PEERS];
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t ll = strlen(line);
        if (ll == sizeof line - 1 && line[ll - 1] != '\n') {
            rc = gerr(err, errlen, "%s:%d: line too long", path, lineno);
            break;
        }
        line[strcspn(line, "\r\n")] = 0;
        char *save = NULL, *tok[8];
        int nt = 0;
        for (char *t = strtok_r(line, " \t", &save); t; t = strtok_r(NULL, " \t", &save)) {
            if (nt == 8) {
                nt = 9;
                break;
            }
            tok[nt++] = t;
        }
        if (nt == 0 || tok[0][0] == '#') continue;
        if (strcmp(tok[0], "member") != 0 || nt < 5 || nt > 6) {
            rc = gerr(err, errlen, "%s:%d: expected 'member MULTIADDR ROLE UP DOWN [WEIGHT]'", path,
                      lineno);
            break;
        }
        if (cnt >= max || cnt >= AP_ARP_MAX_PEERS) {
            rc = gerr(err, errlen, "%s:%d: more than %zu members", path, lineno,
                      max < AP_ARP_MAX_PEERS ? max : (size_t)AP_ARP_MAX_PEERS);
            break;
        }
        ap_arp_member_t *e = &m[cnt];
        memset(e, 0, sizeof *e);
        ap_multiaddr_t ma;
        if (strlen(tok[1]) >= sizeof e->addr || ap_multiaddr_parse(&ma, tok[1]) || !ma.has_peer) {
            rc = gerr(err, errlen, "%s:%d: '%s' is not a multiaddr with /p2p/<PeerID>", path,
                      lineno, tok[1]);
            break;
        }
        if (ap_arp_role_parse(tok[2], &e->role)) {
            rc = gerr(err, errlen, "%s:%d: role '%s' is not normal, client or aux", path, lineno,
                      tok[2]);
            break;
        }
        if (e->role == AP_AVG_CLIENT ? ma.host != AP_MA_HOST_NONE
                                     : (ma.host == AP_MA_HOST_NONE || !ma.has_tcp)) {
            rc = gerr(err, errlen,
                      "%s:%d: a client's address is /p2p/<PeerID> only; others need "
                      "HOST/tcp/PORT/p2p/<PeerID>",
                      path, lineno);
            break;
        }
        if (!parse_pos(tok[3], &e->up) || !parse_pos(tok[4], &e->down)) {
            rc = gerr(err, errlen, "%s:%d: bandwidths must be finite bytes/s > 0", path, lineno);
            break;
        }
        e->weight = 1.0;
        if (nt == 6 && !parse_pos(tok[5], &e->weight)) {
            rc = gerr(err, errlen, "%s:%d: weight must be finite and > 0", path, lineno);
            break;
        }
        for (size_t j = 0; j < cnt; j++)
            if (ap_peer_id_eq(&ids[j], &ma.peer)) {
                rc = gerr(err, errlen, "%s:%d: PeerID listed twice", path, lineno);
                break;
            }
        if (rc) break;
        ids[cnt] = ma.peer;
        snprintf(e->addr, sizeof e->addr, "%s", tok[1]);
        cnt++;
    }
    if (!rc && ferror(f)) rc = gerr(err, errlen, "%s: read error", path);
    fclose(f);
    if (!rc && cnt == 0) rc = gerr(err, errlen, "%s: no member", path);
    if (!rc) *n = cnt;
    return rc;
}

/* ---- parent ------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Picks n free TCP ports on 127.0.0.1 (all bound at once so they differ). */
static int pick_ports(int n, int *ports)
{
    int fds[AP_ARP_MAX_PEERS];
    int rc = 0, k;
    for (k = 0; k < n; k++) {
        fds[k] = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t sl = sizeof sa;
        if (fds[k] < 0 || bind(fds[k], (struct sockaddr *)&sa, sizeof sa) ||
            getsockname(fds[k], (struct sockaddr *)&sa, &sl)) {
            rc = AP_EIO;
            if (fds[k] >= 0) close(fds[k]);
            break;
        }
        ports[k] = ntohs(sa.sin_port);
    }
    for (int j = 0; j < k; j++) close(fds[j]);
    return rc;
}

typedef struct wk {
    pid_t pid;
    int in_fd, out_fd; /* parent's ends: worker stdin (write), stdout (read) */
    char buf[8192];
    size_t len;
    bool eof, done;
    int ready;   /* barriers it waits (or waited) at: two per round, start and check */
    int reports; /* round lines received */
    int checks;  /* check lines received */
    ap_avg_role_t role;
} wk_t;

static bool jnum(const char *line, const char *key, double *out)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (!p) return false;
    p += strlen(pat);
    if (!strncmp(p, "true", 4)) {
        *out = 1;
        return true;
    }
    if (!strncmp(p, "false", 5)) {
        *out = 0;
        return true;
    }
    char *end;
    double v = strtod(p, &end);
    if (end == p) return false;
    *out = v;
    return true;
}

static bool jstr(const char *line, const char *key, char *out, size_t n)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":\"", key);
    const char *p = strstr(line, pat);
    if (!p) return false;
    p += strlen(pat);
    const char *q = strchr(p, '"');
    if (!q || (size_t)(q - p) >= n) return false;
    memcpy(out, p, (size_t)(q - p));
    out[q - p] = 0;
    return true;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(const double *v, int n)
{
    if (n <= 0) return 0;
    double s[AP_ARP_MAX_ROUNDS];
    memcpy(s, v, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

static void set_why(ap_arp_result_t *res, const char *fmt, ...)
{
    if (res->why[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(res->why, sizeof res->why, fmt, ap);
    va_end(ap);
}

typedef struct round_acc {
    ap_arp_round_t r;
    char digest[40];
    bool have_digest;
    double last_s; /* when the last worker's line for it arrived */
} round_acc_t;

/* Takes one complete line from worker i. */
static void on_line(const ap_arp_cfg_t *cfg, wk_t *w, int i, const char *line, double t,
                    round_acc_t *acc, int total_rounds, ap_arp_result_t *res)
{
    char ev[32];
    if (!jstr(line, "event", ev, sizeof ev)) return; /* not ours: ignore */
    if (!strcmp(ev, "ready")) {
        w->ready++;
    } else if (!strcmp(ev, "done")) {
        w->done = true;
    } else if (!strcmp(ev, "round")) {
        double v, rr = -1;
        jnum(line, "round", &rr);
        if ((int)rr != w->reports || w->reports >= total_rounds) {
            set_why(res, "worker %d reported round %g out of turn", i, rr);
            return;
        }
        round_acc_t *a = &acc[w->reports];
        ap_arp_round_t *r = &a->r;
        w->reports++;
        if (t > a->last_s) a->last_s = t;
        if (jnum(line, "status", &v) && v != 0 && !r->status) {
            r->status = (int)v;
            set_why(res, "worker %d: round %d ended with %s", i, (int)rr, ap_err_name((int)v));
        }
        if (jnum(line, "round_s", &v) && v > r->max_worker_s) r->max_worker_s = v;
        if (jnum(line, "cpu_s", &v)) r->cpu_s += v;
        if (jnum(line, "bytes_sent", &v)) r->bytes_sent += (uint64_t)v;
        if (w->role != AP_AVG_AUX && jnum(line, "averaged_fraction", &v) && v < r->min_fraction)
            r->min_fraction = v;
    } else if (!strcmp(ev, "check")) {
        double v, rr = -1;
        jnum(line, "round", &rr);
        if ((int)rr != w->checks || w->checks >= total_rounds) {
            set_why(res, "worker %d reported the check of round %g out of turn", i, rr);
            return;
        }
        round_acc_t *a = &acc[w->checks];
        ap_arp_round_t *r = &a->r;
        w->checks++;
        if (w->role == AP_AVG_AUX) return;
        if (jnum(line, "checked", &v)) r->checked += (uint64_t)v;
        if (jnum(line, "bad", &v)) r->bad += (uint64_t)v;
        if (jnum(line, "max_err", &v) && v > r->max_err) r->max_err = v;
        if (jnum(line, "tol", &v) && v > r->tol) r->tol = v;
        char d[40];
        if (jstr(line, "digest", d, sizeof d)) {
            if (!a->have_digest) {
                snprintf(a->digest, sizeof a->digest, "%s", d);
                a->have_digest = true;
            } else if (strcmp(a->digest, d) != 0) {
                r->digests_equal = false;
            }
        }
    }
    (void)cfg;
}

static void kill_all(wk_t *w, int n)
{
    for (int i = 0; i < n; i++)
        if (w[i].pid > 0) kill(w[i].pid, SIGKILL);
}

int ap_arp_run(const ap_arp_cfg_t *cfg, ap_arp_result_t *res)
{
    memset(res, 0, sizeof *res);
    int P = cfg->peers;
    int total = cfg->warmup + cfg->rounds;
    if (P < 1 || P > AP_ARP_MAX_PEERS || cfg->rounds < 1 || cfg->warmup < 0 ||
        total > AP_ARP_MAX_ROUNDS || !cfg->dir || !cfg->elems) {
        set_why(res, "bad configuration");
        return AP_EINVAL;
    }
    char exe[1024];
    if (cfg->exe) {
        snprintf(exe, sizeof exe, "%s", cfg->exe);
    } else {
        ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (el <= 0) return AP_EIO;
        exe[el] = 0;
    }
    /* identities, addresses, group file */
    ap_arp_member_t m[AP_ARP_MAX_PEERS];
    char keys[AP_ARP_MAX_PEERS][600], listen[AP_ARP_MAX_PEERS][AP_ARP_ADDR_MAX];
    int ports[AP_ARP_MAX_PEERS];
    if (pick_ports(P, ports)) {
        set_why(res, "cannot pick free ports on 127.0.0.1");
        return AP_EIO;
    }
    for (int i = 0; i < P; i++) {
        ap_identity_t id;
        snprintf(keys[i], sizeof keys[i], "%s/key-%d", cfg->dir, i);
        unlink(keys[i]);
        if (ap_identity_generate(&id) || ap_identity_save(&id, keys[i])) {
            set_why(res, "cannot create %s", keys[i]);
            return AP_EIO;
        }
        char ids[AP_PEER_ID_STR_MAX];
        ap_peer_id_str(&id.id, ids);
        ap_identity_wipe(&id);
        m[i].role = cfg->roles ? cfg->roles[i] : AP_AVG_NORMAL;
        m[i].up = cfg->up ? cfg->up[i] : 1e9;
        m[i].down = cfg->down ? cfg->down[i] : 1e9;
        m[i].weight = 1.0 + i;
        if (cfg->listen && cfg->listen[i])
            snprintf(listen[i], sizeof listen[i], "%s", cfg->listen[i]);
        else
            snprintf(listen[i], sizeof listen[i], "/ip4/127.0.0.1/tcp/%d", ports[i]);
        if (m[i].role == AP_AVG_CLIENT)
            snprintf(m[i].addr, sizeof m[i].addr, "/p2p/%s", ids);
        else
            snprintf(m[i].addr, sizeof m[i].addr, "%s/p2p/%s", listen[i], ids);
    }
    char group[600];
    snprintf(group, sizeof group, "%s/group.txt", cfg->dir);
    if (ap_arp_group_write(group, m, (size_t)P)) {
        set_why(res, "cannot write %s", group);
        return AP_EIO;
    }
    /* spawn */
    wk_t w[AP_ARP_MAX_PEERS];
    memset(w, 0, sizeof w);
    char elems[32], rounds[16], warm[16], seed[16], chunk[16], dump[AP_ARP_MAX_PEERS][700];
    snprintf(elems, sizeof elems, "%llu", (unsigned long long)cfg->elems);
    snprintf(rounds, sizeof rounds, "%d", cfg->rounds);
    snprintf(warm, sizeof warm, "%d", cfg->warmup);
    snprintf(seed, sizeof seed, "%u", cfg->seed);
    snprintf(chunk, sizeof chunk, "%u", cfg->chunk_elems);
    int rc = 0;
    fflush(stdout);
    fflush(stderr);
    for (int i = 0; i < P; i++) {
        const char *argv[96];
        int na = 0;
        if (cfg->wrap) {
            int k = cfg->wrap(cfg->wrap_arg, i, argv, 32);
            if (k < 0) {
                set_why(res, "the wrap hook failed for worker %d", i);
                rc = AP_EINVAL;
                break;
            }
            na = k;
        }
        argv[na++] = exe;
        argv[na++] = "avg-worker";
        argv[na++] = "--group";
        argv[na++] = group;
        argv[na++] = "--key";
        argv[na++] = keys[i];
        if (m[i].role != AP_AVG_CLIENT) {
            argv[na++] = "--listen";
            argv[na++] = listen[i];
        }
        argv[na++] = "--elems";
        argv[na++] = elems;
        argv[na++] = "--codec";
        argv[na++] = ap_arp_codec_name(cfg->codec);
        argv[na++] = "--rounds";
        argv[na++] = rounds;
        argv[na++] = "--warmup";
        argv[na++] = warm;
        argv[na++] = "--seed";
        argv[na++] = seed;
        if (cfg->chunk_elems) {
            argv[na++] = "--chunk-elems";
            argv[na++] = chunk;
        }
        if (cfg->dump_dir) {
            snprintf(dump[i], sizeof dump[i], "%s/result-%d.f32", cfg->dump_dir, i);
            argv[na++] = "--dump";
            argv[na++] = dump[i];
        }
        for (int k = 0; cfg->extra_args && cfg->extra_args[k] && na < 94; k++)
            argv[na++] = cfg->extra_args[k];
        argv[na] = NULL;
        int pin[2], pout[2];
        if (pipe(pin) || pipe(pout)) {
            set_why(res, "pipe: %s", strerror(errno));
            rc = AP_EIO;
            break;
        }
        char logp[700];
        snprintf(logp, sizeof logp, "%s/worker-%d.log", cfg->dir, i);
        pid_t pid = fork();
        if (pid < 0) {
            set_why(res, "fork: %s", strerror(errno));
            rc = AP_EIO;
            close(pin[0]), close(pin[1]), close(pout[0]), close(pout[1]);
            break;
        }
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            int lf = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            dup2(pin[0], STDIN_FILENO);
            dup2(pout[1], STDOUT_FILENO);
            if (lf >= 0) dup2(lf, STDERR_FILENO);
            /* only the three standard descriptors survive into the worker */
            for (int fd = 3; fd < 1024; fd++) close(fd);
            execvp(argv[0], (char *const *)argv);
            _exit(127);
        }
        close(pin[0]);
        close(pout[1]);
        fcntl(pout[0], F_SETFL, O_NONBLOCK);
        fcntl(pin[1], F_SETFD, FD_CLOEXEC);
        fcntl(pout[0], F_SETFD, FD_CLOEXEC);
        w[i].pid = pid;
        w[i].in_fd = pin[1];
        w[i].out_fd = pout[0];
        w[i].role = m[i].role;
    }
    /* collect */
    round_acc_t acc[AP_ARP_MAX_ROUNDS];
    memset(acc, 0, sizeof acc);
    for (int r = 0; r < total; r++) {
        acc[r].r.min_fraction = 1.0;
        acc[r].r.digests_equal = true;
    }
    double t_end = now_s() + (cfg->timeout_s > 0 ? cfg->timeout_s : 600);
    int released = 0; /* barriers released */
    double go_s[AP_ARP_MAX_ROUNDS] = {0};
    void (*old_pipe)(int) = signal(SIGPIPE, SIG_IGN);
    while (!rc) {
        /* release the next barrier once every worker waits at it; barrier
         * 2r starts round r, 2r + 1 lets the workers check round r */
        bool all_ready = released < 2 * total;
        for (int i = 0; i < P && all_ready; i++) all_ready = w[i].ready > released;
        if (all_ready) {
            if (released % 2 == 0) go_s[released / 2] = now_s();
            for (int i = 0; i < P; i++)
                if (write(w[i].in_fd, "go\n", 3) != 3) {
                    set_why(res, "worker %d: cannot release the barrier", i);
                    rc = AP_EIO;
                }
            released++;
            continue;
        }
        bool finished = true;
        for (int i = 0; i < P; i++) finished &= w[i].eof;
        if (finished) break;
        double left = t_end - now_s();
        if (left <= 0) {
            set_why(res, "timed out (logs in %s)", cfg->dir);
            rc = AP_ETIMEDOUT;
            break;
        }
        struct pollfd pf[AP_ARP_MAX_PEERS];
        for (int i = 0; i < P; i++) {
            pf[i].fd = w[i].eof ? -1 : w[i].out_fd;
            pf[i].events = POLLIN;
            pf[i].revents = 0;
        }
        int pr = poll(pf, (nfds_t)P, left > 1 ? 1000 : (int)(left * 1000) + 1);
        if (pr < 0 && errno != EINTR) {
            rc = AP_EIO;
            break;
        }
        double t = now_s();
        for (int i = 0; i < P; i++) {
            if (!pf[i].revents) continue;
            ssize_t k = read(w[i].out_fd, w[i].buf + w[i].len, sizeof w[i].buf - 1 - w[i].len);
            if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (k <= 0) {
                w[i].eof = true;
                if (!w[i].done) {
                    set_why(res, "worker %d exited early (see %s/worker-%d.log)", i, cfg->dir, i);
                    rc = AP_ECLOSED;
                }
                continue;
            }
            w[i].len += (size_t)k;
            w[i].buf[w[i].len] = 0;
            char *s = w[i].buf, *nl;
            while ((nl = strchr(s, '\n'))) {
                *nl = 0;
                on_line(cfg, &w[i], i, s, t, acc, total, res);
                s = nl + 1;
            }
            w[i].len = strlen(s);
            memmove(w[i].buf, s, w[i].len + 1);
            if (w[i].len >= sizeof w[i].buf - 1) { /* a line that long is not ours */
                set_why(res, "worker %d wrote an over-long line", i);
                rc = AP_EPROTO;
            }
        }
    }
    if (rc) kill_all(w, P);
    for (int i = 0; i < P; i++) {
        if (w[i].in_fd > 0) close(w[i].in_fd);
        if (w[i].out_fd > 0) close(w[i].out_fd);
        int ws = 0;
        if (w[i].pid > 0 && waitpid(w[i].pid, &ws, 0) == w[i].pid && !rc &&
            (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)) {
            set_why(res, "worker %d exited with status %d", i,
                    WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws));
            rc = AP_EIO;
        }
    }
    signal(SIGPIPE, old_pipe);
    /* aggregate */
    res->verified = !rc;
    double wall[AP_ARP_MAX_ROUNDS], cpu[AP_ARP_MAX_ROUNDS], wsec[AP_ARP_MAX_ROUNDS];
    for (int r = 0; r < total; r++) {
        ap_arp_round_t *x = &acc[r].r;
        /* wall time: release of the round's barrier to the last worker's line */
        x->wall_s = acc[r].last_s > go_s[r] ? acc[r].last_s - go_s[r] : 0;
        if (x->status || x->min_fraction < 1.0 || x->bad || !x->checked || !x->digests_equal) {
            res->verified = false;
            set_why(res,
                    "round %d: status %d, averaged fraction %g, %llu of %llu elements off "
                    "(max error %g, tolerance %g), digests %s",
                    r, x->status, x->min_fraction, (unsigned long long)x->bad,
                    (unsigned long long)x->checked, x->max_err, x->tol,
                    x->digests_equal ? "equal" : "differ");
        }
    }
    res->nrounds = 0;
    for (int r = cfg->warmup; r < total && !rc; r++) {
        ap_arp_round_t *x = &acc[r].r;
        res->r[res->nrounds] = *x;
        wall[res->nrounds] = x->wall_s;
        cpu[res->nrounds] = x->cpu_s;
        wsec[res->nrounds] = x->max_worker_s;
        res->nrounds++;
    }
    res->median_wall_s = median(wall, res->nrounds);
    res->median_cpu_s = median(cpu, res->nrounds);
    res->median_worker_s = median(wsec, res->nrounds);
    return rc;
}
