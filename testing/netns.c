/* Shaped links in network namespaces: see netns.h. */
#include "netns.h"

#include "apiary/error.h"
#include "nscmd.h"
#include "nsguard.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NAME_MAX_ 48
#define PATH_MAX_ (sizeof AP_NSCMD_DIR + NAME_MAX_ + 2)
#define BRIDGE    "br0"
#define HOST_DEV  "eth0"
#define MTU_FRAME 1514.0

typedef struct ns_entry {
    char name[NAME_MAX_];
    char path[PATH_MAX_];
    char ip[16];
    bool made;
} ns_entry_t;

struct ap_netns {
    size_t n;
    pid_t owner;
    ns_entry_t *e; /* n hosts, then the hub at index n */
    ap_netns_link_t *links;
};

/* ---- clean-up on exit and on signals (nsguard.h) ------------------------- */

/* Async-signal-safe: what `ip netns del` does (lazy unmount of the bind
 * mount that keeps the namespace, then the file). */
static void unmount_all(ap_netns_t *ns)
{
    for (size_t i = 0; i <= ns->n; i++)
        if (ns->e[i].made) {
            umount2(ns->e[i].path, MNT_DETACH);
            unlink(ns->e[i].path);
            ns->e[i].made = false;
        }
}

static void unmount_cb(void *arg)
{
    unmount_all(arg);
}

/* ---- running ip and tc -------------------------------------------------------- */

static int ns_add(ns_entry_t *e, char *why, size_t wn)
{
    int rc = ap_nscmd_add(e->name, false, why, wn);
    if (rc == 0) e->made = true;
    return rc;
}

static void ns_del(ns_entry_t *e)
{
    if (!e->made) return;
    ap_nscmd_del(e->name, e->path);
    e->made = false;
}

/* ---- shaping ------------------------------------------------------------------ */

/* htb on dev in namespace ns at rate bits/s (0 = no qdisc). burst: 2 ms at
 * the rate, at least 16 KiB (htb under-shoots with a burst below a few
 * frames per timer tick); leaf pfifo of ~20 ms at the rate, at least 64
 * frames (a short queue keeps the RTT, and so the streams' flow-control
 * windows, from limiting the rate). */
static int shape_dev(const char *ns, const char *dev, double bps, char *why, size_t wn)
{
    if (bps <= 0) {
        ap_nscmd_runv(NULL, 0, "tc", "-n", ns, "qdisc", "del", "dev", dev, "root", (char *)NULL);
        return 0;
    }
    double Bps = bps / 8;
    unsigned burst = (unsigned)(Bps * 0.002);
    if (burst < 16384) burst = 16384;
    unsigned limit = (unsigned)(Bps * 0.02 / MTU_FRAME);
    if (limit < 64) limit = 64;
    if (limit > 10000) limit = 10000;
    char rate[32], bs[32], lim[32];
    snprintf(rate, sizeof rate, "%.0fbit", bps);
    snprintf(bs, sizeof bs, "%u", burst);
    snprintf(lim, sizeof lim, "%u", limit);
    int rc = ap_nscmd_runv(why, wn, "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root",
                           "handle", "1:", "htb", "default", "1", (char *)NULL);
    if (!rc)
        rc = ap_nscmd_runv(why, wn, "tc", "-n", ns, "class", "replace", "dev", dev, "parent",
                           "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate, "burst", bs,
                           "cburst", bs, "quantum", "60000", (char *)NULL);
    if (!rc)
        rc = ap_nscmd_runv(why, wn, "tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", "1:1",
                           "handle", "10:", "pfifo", "limit", lim, (char *)NULL);
    return rc;
}

int ap_netns_shape(ap_netns_t *ns, size_t i, const ap_netns_link_t *l, char *why, size_t wn)
{
    if (!ns || i >= ns->n || !l || !(l->up_bps >= 0) || !(l->down_bps >= 0)) return AP_EINVAL;
    char hdev[24];
    snprintf(hdev, sizeof hdev, "h%zu", i);
    int rc = shape_dev(ns->e[i].name, HOST_DEV, l->up_bps, why, wn);
    if (!rc) rc = shape_dev(ns->e[ns->n].name, hdev, l->down_bps, why, wn);
    if (!rc) ns->links[i] = *l;
    return rc;
}

/* ---- topology ----------------------------------------------------------------- */

static void set_entry(ns_entry_t *e, const char *name, const char *ip)
{
    snprintf(e->name, sizeof e->name, "%s", name);
    snprintf(e->path, sizeof e->path, "%s/%s", AP_NSCMD_DIR, name);
    snprintf(e->ip, sizeof e->ip, "%s", ip);
}

int ap_netns_new(size_t n, const ap_netns_link_t *links, ap_netns_t **out, char *why, size_t wn)
{
    *out = NULL;
    if (n == 0 || n > AP_NETNS_MAX_HOSTS) {
        snprintf(why, wn, "host count %zu outside 1..%d", n, AP_NETNS_MAX_HOSTS);
        return AP_EINVAL;
    }
    if (geteuid() != 0) {
        snprintf(why, wn, "network namespaces need root (euid %d)", (int)geteuid());
        return AP_EPERM;
    }
    ap_nscmd_sweep("apiary");
    ap_netns_t *ns = calloc(1, sizeof *ns);
    if (!ns) return AP_ENOMEM;
    ns->n = n;
    ns->owner = getpid();
    ns->e = calloc(n + 1, sizeof *ns->e);
    ns->links = calloc(n, sizeof *ns->links);
    if (!ns->e || !ns->links) {
        free(ns->e);
        free(ns->links);
        free(ns);
        return AP_ENOMEM;
    }
    /* A per-process sequence number keeps two sets of one process apart. */
    static unsigned seq;
    unsigned s = seq++;
    char name[NAME_MAX_], ip[16];
    for (size_t i = 0; i < n; i++) {
        snprintf(name, sizeof name, "apiary-%d-%u-%zu", (int)getpid(), s, i);
        snprintf(ip, sizeof ip, "10.77.0.%zu", i + 1);
        set_entry(&ns->e[i], name, ip);
    }
    snprintf(name, sizeof name, "apiary-%d-%u-hub", (int)getpid(), s);
    set_entry(&ns->e[n], name, AP_NETNS_HUB_IP);
    ap_nsguard_add(unmount_cb, ns); /* when full: not removed on a signal */

    const char *hub = ns->e[n].name;
    int rc = ns_add(&ns->e[n], why, wn);
    if (!rc) rc = ap_nscmd_runv(why, wn, "ip", "-n", hub, "link", "set", "lo", "up", (char *)NULL);
    if (!rc)
        rc = ap_nscmd_runv(why, wn, "ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge",
                           (char *)NULL);
    if (!rc)
        rc = ap_nscmd_runv(why, wn, "ip", "-n", hub, "addr", "add", AP_NETNS_HUB_IP "/24", "dev",
                           BRIDGE, (char *)NULL);
    if (!rc)
        rc = ap_nscmd_runv(why, wn, "ip", "-n", hub, "link", "set", BRIDGE, "up", (char *)NULL);
    for (size_t i = 0; i < n && !rc; i++) {
        const char *h = ns->e[i].name;
        char hdev[24], cidr[24];
        snprintf(hdev, sizeof hdev, "h%zu", i);
        snprintf(cidr, sizeof cidr, "%s/24", ns->e[i].ip);
        rc = ns_add(&ns->e[i], why, wn);
        if (!rc)
            rc =
                ap_nscmd_runv(why, wn, "ip", "-n", hub, "link", "add", hdev, "master", BRIDGE, "up",
                              "type", "veth", "peer", "name", HOST_DEV, "netns", h, (char *)NULL);
        if (!rc)
            rc = ap_nscmd_runv(why, wn, "ip", "-n", h, "link", "set", "lo", "up", (char *)NULL);
        if (!rc)
            rc = ap_nscmd_runv(why, wn, "ip", "-n", h, "addr", "add", cidr, "dev", HOST_DEV,
                               (char *)NULL);
        if (!rc)
            rc = ap_nscmd_runv(why, wn, "ip", "-n", h, "link", "set", HOST_DEV, "up", (char *)NULL);
        if (!rc && links) rc = ap_netns_shape(ns, i, &links[i], why, wn);
    }
    if (rc) {
        ap_netns_free(ns);
        return rc;
    }
    *out = ns;
    return 0;
}

void ap_netns_free(ap_netns_t *ns)
{
    if (!ns) return;
    if (ns->owner == getpid()) {
        for (size_t i = 0; i < ns->n; i++) ns_del(&ns->e[i]);
        ns_del(&ns->e[ns->n]);
    }
    ap_nsguard_remove(ns);
    free(ns->e);
    free(ns->links);
    free(ns);
}

size_t ap_netns_count(const ap_netns_t *ns)
{
    return ns->n;
}

const char *ap_netns_name(const ap_netns_t *ns, size_t i)
{
    return i <= ns->n ? ns->e[i].name : NULL;
}

const char *ap_netns_ip(const ap_netns_t *ns, size_t i)
{
    return i <= ns->n ? ns->e[i].ip : NULL;
}

ap_netns_link_t ap_netns_link(const ap_netns_t *ns, size_t i)
{
    ap_netns_link_t z = {0, 0};
    return i < ns->n ? ns->links[i] : z;
}

int ap_netns_enter(const ap_netns_t *ns, size_t i)
{
    if (!ns || i > ns->n) return AP_EINVAL;
    int fd = open(ns->e[i].path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return AP_ESYS;
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    return rc ? AP_ESYS : 0;
}

int ap_netns_probe(char *why, size_t n)
{
    if (geteuid() != 0) {
        snprintf(why, n, "network namespaces need root (euid %d)", (int)geteuid());
        return AP_EPERM;
    }
    struct stat st;
    if (stat("/proc/self/ns/net", &st)) {
        snprintf(why, n, "this kernel has no network namespaces (/proc/self/ns/net)");
        return AP_ENOTSUP;
    }
    ap_netns_link_t l = {10e6, 10e6};
    ap_netns_t *ns;
    int rc = ap_netns_new(1, &l, &ns, why, n);
    if (rc) return rc == AP_ENOMEM ? rc : AP_ENOTSUP;
    ap_netns_free(ns);
    return 0;
}

/* ---- measuring a plain TCP stream ---------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

bool ap_netns_write_full(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    int type;
    socklen_t tl = sizeof type;
    bool sock = getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) == 0;
    while (n) {
        ssize_t w = sock ? send(fd, b, n, MSG_NOSIGNAL) : write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        b += w;
        n -= (size_t)w;
    }
    return true;
}

bool ap_netns_read_full(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n) {
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        b += r;
        n -= (size_t)r;
    }
    return true;
}

/* Sends for `seconds`. */
static bool send_for(int fd, double seconds)
{
    static uint8_t buf[1 << 16];
    double end = now_s() + seconds;
    while (now_s() < end)
        if (!ap_netns_write_full(fd, buf, sizeof buf)) return false;
    return true;
}

/* Reads until EOF; payload bytes/s after the first `skip` seconds, or -1. */
static double recv_rate(int fd, double skip)
{
    static __thread uint8_t buf[1 << 16];
    double t0 = -1, tw = -1, tl = -1;
    uint64_t n = 0, nw = 0;
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        double t = now_s();
        if (t0 < 0) t0 = t;
        if (tw < 0 && t - t0 >= skip) {
            tw = t;
            nw = n;
        }
        n += (uint64_t)r;
        tl = t;
    }
    if (tw < 0 || tl <= tw) return -1;
    return (double)(n - nw) / (tl - tw);
}

static void set_timeouts(int fd, double s)
{
    struct timeval tv = {.tv_sec = (time_t)s, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

typedef struct conn_arg {
    int fd;
    double seconds;
} conn_arg_t;

static void *hub_conn(void *p)
{
    conn_arg_t *a = p;
    uint8_t cmd;
    if (ap_netns_read_full(a->fd, &cmd, 1)) {
        if (cmd == 'U') {
            double r = recv_rate(a->fd, 0.2 * a->seconds);
            ap_netns_write_full(a->fd, &r, sizeof r);
        } else if (cmd == 'D') {
            send_for(a->fd, a->seconds);
        }
    }
    close(a->fd);
    return NULL;
}

/* The hub's side: accepts 2·n connections, one thread each. */
static int hub_main(int lfd, size_t n, double seconds)
{
    size_t m = 2 * n;
    pthread_t *th = calloc(m, sizeof *th);
    conn_arg_t *args = calloc(m, sizeof *args);
    if (!th || !args) return 1;
    size_t started = 0;
    for (; started < m; started++) {
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) break;
        set_timeouts(fd, seconds + 10);
        args[started] = (conn_arg_t){fd, seconds};
        if (pthread_create(&th[started], NULL, hub_conn, &args[started])) {
            close(fd);
            break;
        }
    }
    for (size_t k = 0; k < started; k++) pthread_join(th[k], NULL);
    free(th);
    free(args);
    return started == m ? 0 : 1;
}

static int dial(const char *ip, uint16_t port, double seconds)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, ip, &sa.sin_addr);
    set_timeouts(fd, seconds + 10);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A host's side: upload then download; writes {up, down} (bytes/s, -1 on
 * failure) to out. */
static int host_main(uint16_t port, double seconds, int out)
{
    double r[2] = {-1, -1};
    int fd = dial(AP_NETNS_HUB_IP, port, seconds);
    if (fd >= 0) {
        uint8_t c = 'U';
        if (ap_netns_write_full(fd, &c, 1) && send_for(fd, seconds) && shutdown(fd, SHUT_WR) == 0)
            ap_netns_read_full(fd, &r[0], sizeof r[0]);
        close(fd);
    }
    fd = dial(AP_NETNS_HUB_IP, port, seconds);
    if (fd >= 0) {
        uint8_t c = 'D';
        if (ap_netns_write_full(fd, &c, 1)) r[1] = recv_rate(fd, 0.2 * seconds);
        close(fd);
    }
    return ap_netns_write_full(out, r, sizeof r) ? 0 : 1;
}

int ap_netns_measure(ap_netns_t *ns, double seconds, double *up, double *down, char *why, size_t wn)
{
    if (!ns || !(seconds > 0.1) || seconds > 600) return AP_EINVAL;
    size_t n = ns->n;
    int pp[2], rc = 0;
    if (pipe2(pp, O_CLOEXEC)) return AP_ESYS;
    fflush(NULL);
    pid_t hub = fork();
    if (hub < 0) {
        close(pp[0]);
        close(pp[1]);
        return AP_ESYS;
    }
    if (hub == 0) {
        close(pp[0]);
        uint16_t port = 0;
        int lfd = -1;
        if (ap_netns_enter(ns, n) == 0) lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET};
        inet_pton(AF_INET, AP_NETNS_HUB_IP, &sa.sin_addr);
        socklen_t sl = sizeof sa;
        if (lfd >= 0) set_timeouts(lfd, seconds + 10);
        if (lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
            listen(lfd, (int)(2 * n + 8)) == 0 &&
            getsockname(lfd, (struct sockaddr *)&sa, &sl) == 0)
            port = ntohs(sa.sin_port);
        ap_netns_write_full(pp[1], &port, sizeof port);
        close(pp[1]);
        _exit(port ? hub_main(lfd, n, seconds) : 1);
    }
    close(pp[1]);
    uint16_t port = 0;
    if (!ap_netns_read_full(pp[0], &port, sizeof port) || port == 0) {
        close(pp[0]);
        waitpid(hub, NULL, 0);
        snprintf(why, wn, "the hub's TCP sink did not start");
        return AP_ESYS;
    }
    close(pp[0]);
    pid_t *pids = calloc(n, sizeof *pids);
    int(*res)[2] = calloc(n, sizeof *res);
    if (!pids || !res) {
        free(pids);
        free(res);
        kill(hub, SIGKILL);
        waitpid(hub, NULL, 0);
        return AP_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        res[i][0] = res[i][1] = -1;
        pids[i] = -1;
        if (pipe2(res[i], O_CLOEXEC)) continue;
        pids[i] = fork();
        if (pids[i] == 0) {
            close(res[i][0]);
            _exit(ap_netns_enter(ns, i) ? 1 : host_main(port, seconds, res[i][1]));
        }
        close(res[i][1]);
        res[i][1] = -1;
    }
    for (size_t i = 0; i < n; i++) {
        double r[2] = {-1, -1};
        if (res[i][0] >= 0) {
            if (pids[i] > 0 && !ap_netns_read_full(res[i][0], r, sizeof r)) r[0] = r[1] = -1;
            close(res[i][0]);
        }
        if (pids[i] > 0) waitpid(pids[i], NULL, 0);
        up[i] = r[0];
        down[i] = r[1];
        if (!(r[0] > 0 && r[1] > 0) && !rc) {
            snprintf(why, wn, "TCP through host %zu's link failed (up %.0f, down %.0f B/s)", i,
                     r[0], r[1]);
            rc = AP_EIO;
        }
    }
    if (rc) kill(hub, SIGKILL);
    waitpid(hub, NULL, 0);
    free(pids);
    free(res);
    return rc;
}
