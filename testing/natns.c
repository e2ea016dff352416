/* Home networks behind NAT routers in network namespaces: see natns.h. */
#include "natns.h"

#include "apiary/error.h"
#include "nscmd.h"
#include "nsguard.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define NAME_MAX_ 64
#define PATH_MAX_ (sizeof AP_NSCMD_DIR + NAME_MAX_ + 2)
#define NET_IP    "198.18.0.254"

typedef struct ns_entry {
    char name[NAME_MAX_];
    char path[PATH_MAX_];
    char ip[32];  /* the address peers reach it at (public node, home host, router wan0) */
    char lan[32]; /* router only: lan0 */
    bool made;
    pid_t upnpd;        /* AP_NAT_UPNP router: its miniupnpd, else 0 */
    char upnp_log[80];  /* its log file */
    char upnp_conf[80]; /* its config file */
} ns_entry_t;

struct ap_natns {
    size_t np, nh;
    pid_t owner;
    /* [0] the internet, [1..np] public nodes, then nh routers, then nh homes */
    ns_entry_t *e;
    ap_nat_kind_t *kinds;
};

static size_t n_entries(const ap_natns_t *ns)
{
    return 1 + ns->np + 2 * ns->nh;
}

/* ---- clean-up on exit and on signals (nsguard.h) ------------------------- */

/* Async-signal-safe: what `ip netns del` does. */
static void unmount_all(ap_natns_t *ns)
{
    size_t n = n_entries(ns);
    for (size_t i = 0; i < n; i++)
        if (ns->e[i].upnpd > 0) kill(ns->e[i].upnpd, SIGKILL);
    for (size_t i = 0; i < n; i++)
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

/* ---- running commands ------------------------------------------------------------ */

static int ns_add(ns_entry_t *e, char *why, size_t wn)
{
    int rc = ap_nscmd_add(e->name, true, why, wn);
    if (rc == 0) e->made = true;
    return rc;
}

static void ns_del(ns_entry_t *e)
{
    if (!e->made) return;
    ap_nscmd_del(e->name, e->path);
    e->made = false;
}

static bool log_has(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[512];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

/* ---- the NAT rules ------------------------------------------------------------- */

const char *ap_nat_kind_name(ap_nat_kind_t k)
{
    switch (k) {
    case AP_NAT_DROP:
        return "drop";
    case AP_NAT_RST:
        return "rst";
    case AP_NAT_SYMMETRIC:
        return "symmetric";
    case AP_NAT_UPNP:
        return "upnp";
    }
    return "?";
}

/* The router's ruleset: masquerade on wan0; forward lan -> wan and replies;
 * the router itself answers only its LAN and replies. */
static int write_rules(ap_nat_kind_t kind, char *path, size_t pn, char *why, size_t wn)
{
    snprintf(path, pn, "/tmp/apnat-%d-rules-XXXXXX", (int)getpid());
    int fd = mkstemp(path);
    if (fd < 0) {
        snprintf(why, wn, "mkstemp %s: %s", path, strerror(errno));
        return AP_ESYS;
    }
    const char *rst =
        kind == AP_NAT_RST
            ? "    iifname \"wan0\" tcp flags & (syn | ack) == syn reject with tcp reset\n"
            : "";
    char buf[2048];
    int n;
    if (kind == AP_NAT_UPNP) /* miniupnpd fills the three empty chains */
        n = snprintf(buf, sizeof buf,
                     "table inet apnat {\n"
                     "  chain prerouting_miniupnpd {\n  }\n"
                     "  chain postrouting_miniupnpd {\n  }\n"
                     "  chain miniupnpd {\n  }\n"
                     "  chain nat_in {\n"
                     "    type nat hook prerouting priority dstnat; policy accept;\n"
                     "    jump prerouting_miniupnpd\n"
                     "  }\n"
                     "  chain nat_out {\n"
                     "    type nat hook postrouting priority srcnat; policy accept;\n"
                     "    jump postrouting_miniupnpd\n"
                     "    oifname \"wan0\" masquerade\n"
                     "  }\n"
                     "  chain through {\n"
                     "    type filter hook forward priority filter; policy drop;\n"
                     "    ct state established,related accept\n"
                     "    iifname \"lan0\" oifname \"wan0\" accept\n"
                     "    jump miniupnpd\n"
                     "  }\n"
                     "  chain to_router {\n"
                     "    type filter hook input priority filter; policy drop;\n"
                     "    ct state established,related accept\n"
                     "    iifname \"lo\" accept\n"
                     "    iifname \"lan0\" accept\n"
                     "  }\n"
                     "}\n");
    else
        n = snprintf(buf, sizeof buf,
                     "table ip apnat {\n"
                     "  chain nat_out {\n"
                     "    type nat hook postrouting priority srcnat; policy accept;\n"
                     "    oifname \"wan0\" masquerade%s\n"
                     "  }\n"
                     "  chain through {\n"
                     "    type filter hook forward priority filter; policy drop;\n"
                     "    ct state established,related accept\n"
                     "    iifname \"lan0\" oifname \"wan0\" accept\n"
                     "%s"
                     "  }\n"
                     "  chain to_router {\n"
                     "    type filter hook input priority filter; policy drop;\n"
                     "    ct state established,related accept\n"
                     "    iifname \"lo\" accept\n"
                     "    iifname \"lan0\" accept\n"
                     "%s"
                     "  }\n"
                     "}\n",
                     kind == AP_NAT_SYMMETRIC ? " fully-random" : "", rst, rst);
    bool ok = n > 0 && (size_t)n < sizeof buf && write(fd, buf, (size_t)n) == n;
    close(fd);
    if (!ok) {
        unlink(path);
        snprintf(why, wn, "writing %s failed", path);
        return AP_ESYS;
    }
    return 0;
}

/* miniupnpd on an AP_NAT_UPNP router: UPnP IGD and NAT-PMP for lan0, its
 * forwards in the chains of write_rules' inet table; secure mode (a host
 * maps ports to itself only), unprivileged ports only. */
static int start_upnpd(ns_entry_t *r, size_t k, char *why, size_t wn)
{
    snprintf(r->upnp_conf, sizeof r->upnp_conf, "/tmp/%s-upnpd.conf", r->name);
    snprintf(r->upnp_log, sizeof r->upnp_log, "/tmp/%s-upnpd.log", r->name);
    char pidf[96];
    snprintf(pidf, sizeof pidf, "/tmp/%s-upnpd.pid", r->name);
    FILE *f = fopen(r->upnp_conf, "w");
    if (!f) {
        snprintf(why, wn, "cannot write %s: %s", r->upnp_conf, strerror(errno));
        return AP_ESYS;
    }
    fprintf(f,
            "ext_ifname=wan0\nlistening_ip=lan0\nport=0\n"
            "enable_upnp=yes\nenable_natpmp=yes\nsecure_mode=yes\nsystem_uptime=no\n"
            "upnp_table_name=apnat\nupnp_nat_table_name=apnat\n"
            "upnp_forward_chain=miniupnpd\nupnp_nat_chain=prerouting_miniupnpd\n"
            "upnp_nat_postrouting_chain=postrouting_miniupnpd\n"
            "uuid=3b3b7b0a-0000-4000-8000-%012zx\n"
            "allow 1024-65535 10.0.0.0/8 1024-65535\ndeny 0-65535 0.0.0.0/0 0-65535\n",
            k + 1);
    if (fclose(f)) {
        snprintf(why, wn, "cannot write %s", r->upnp_conf);
        return AP_ESYS;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, r->upnp_log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    char *argv[] = {"ip", "netns",      "exec", r->name, "miniupnpd", "-d",
                    "-f", r->upnp_conf, "-P",   pidf,    NULL};
    pid_t pid;
    int rc = posix_spawnp(&pid, "ip", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc) {
        snprintf(why, wn, "cannot start miniupnpd: %s", strerror(rc));
        return AP_ESYS;
    }
    r->upnpd = pid; /* `ip netns exec` execs miniupnpd in this process */
    for (int i = 0; i < 100; i++) {
        if (log_has(r->upnp_log, "Listening for NAT-PMP")) return 0;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            r->upnpd = 0;
            snprintf(why, wn, "miniupnpd exited (status %d), see %s", st, r->upnp_log);
            return AP_ESYS;
        }
        usleep(50000);
    }
    snprintf(why, wn, "miniupnpd did not start within 5 s, see %s", r->upnp_log);
    return AP_ETIMEDOUT;
}

static void stop_upnpd(ns_entry_t *r)
{
    if (r->upnpd > 0) {
        kill(r->upnpd, SIGTERM); /* it removes its forwards on the way out */
        int st;
        for (int i = 0; i < 40 && waitpid(r->upnpd, &st, WNOHANG) == 0; i++) usleep(50000);
        if (kill(r->upnpd, SIGKILL) == 0) waitpid(r->upnpd, &st, 0);
        r->upnpd = 0;
    }
    if (r->upnp_conf[0]) unlink(r->upnp_conf);
    if (r->upnp_log[0]) unlink(r->upnp_log);
    char pidf[96];
    snprintf(pidf, sizeof pidf, "/tmp/%s-upnpd.pid", r->name);
    unlink(pidf);
    r->upnp_conf[0] = r->upnp_log[0] = 0;
}

static int setup_router(ns_entry_t *r, size_t k, ap_nat_kind_t kind, char *why, size_t wn)
{
    int rc = ap_nscmd_runv(why, wn, "ip", "netns", "exec", r->name, "sysctl", "-qw",
                           "net.ipv4.ip_forward=1", (char *)NULL);
    char path[64];
    if (!rc) rc = write_rules(kind, path, sizeof path, why, wn);
    if (rc) return rc;
    char *argv[] = {"ip", "netns", "exec", (char *)r->name, "nft", "-f", path, NULL};
    rc = ap_nscmd_run(argv, NULL, why, wn, NULL, 0);
    unlink(path);
    if (!rc && kind == AP_NAT_UPNP) rc = start_upnpd(r, k, why, wn);
    return rc;
}

/* ---- topology ----------------------------------------------------------------- */

static void set_entry(ns_entry_t *e, const char *name, const char *ip)
{
    snprintf(e->name, sizeof e->name, "%s", name);
    snprintf(e->path, sizeof e->path, "%s/%s", AP_NSCMD_DIR, name);
    snprintf(e->ip, sizeof e->ip, "%s", ip);
}

static ns_entry_t *pub(const ap_natns_t *ns, size_t i)
{
    return &ns->e[1 + i];
}
static ns_entry_t *rtr(const ap_natns_t *ns, size_t k)
{
    return &ns->e[1 + ns->np + k];
}
static ns_entry_t *home(const ap_natns_t *ns, size_t k)
{
    return &ns->e[1 + ns->np + ns->nh + k];
}

/* A veth pair: dev_a in a (on the bridge when master), dev_b in b. */
static int link_to_net(const ns_entry_t *net, const ns_entry_t *b, const char *port,
                       const char *dev, char *why, size_t wn)
{
    return ap_nscmd_runv(why, wn, "ip", "-n", net->name, "link", "add", port, "master", "br0", "up",
                         "type", "veth", "peer", "name", dev, "netns", b->name, (char *)NULL);
}

static int addr_up(const ns_entry_t *e, const char *dev, const char *ip, char *why, size_t wn)
{
    char cidr[24];
    snprintf(cidr, sizeof cidr, "%s/24", ip);
    int rc =
        ap_nscmd_runv(why, wn, "ip", "-n", e->name, "addr", "add", cidr, "dev", dev, (char *)NULL);
    if (!rc)
        rc = ap_nscmd_runv(why, wn, "ip", "-n", e->name, "link", "set", dev, "up", (char *)NULL);
    return rc;
}

#define UPNP_CIDR AP_NATNS_UPNP_NET ".0/24"

/* A route to another /24 on the same bridge (the UPnP routers' wan0). */
static int onlink(const ns_entry_t *e, const char *dev, const char *cidr, char *why, size_t wn)
{
    return ap_nscmd_runv(why, wn, "ip", "-n", e->name, "route", "add", cidr, "dev", dev,
                         (char *)NULL);
}

static int build(ap_natns_t *ns, char *why, size_t wn)
{
    const ns_entry_t *net = &ns->e[0];
    int rc = ns_add(&ns->e[0], why, wn);
    if (!rc)
        rc = ap_nscmd_runv(why, wn, "ip", "-n", net->name, "link", "add", "br0", "type", "bridge",
                           (char *)NULL);
    if (!rc) rc = addr_up(net, "br0", NET_IP, why, wn);
    char port[24];
    for (size_t i = 0; i < ns->np && !rc; i++) {
        ns_entry_t *p = pub(ns, i);
        snprintf(port, sizeof port, "p%u", (unsigned)i);
        rc = ns_add(p, why, wn);
        if (!rc) rc = link_to_net(net, p, port, "eth0", why, wn);
        if (!rc) rc = addr_up(p, "eth0", p->ip, why, wn);
        if (!rc) rc = onlink(p, "eth0", UPNP_CIDR, why, wn);
    }
    for (size_t k = 0; k < ns->nh && !rc; k++) {
        ns_entry_t *r = rtr(ns, k), *h = home(ns, k);
        snprintf(port, sizeof port, "r%u", (unsigned)k);
        rc = ns_add(r, why, wn);
        if (!rc) rc = ns_add(h, why, wn);
        if (!rc) rc = link_to_net(net, r, port, "wan0", why, wn);
        if (!rc) rc = addr_up(r, "wan0", r->ip, why, wn);
        if (!rc)
            rc = onlink(r, "wan0", ns->kinds[k] == AP_NAT_UPNP ? "198.18.0.0/24" : UPNP_CIDR, why,
                        wn);
        if (!rc)
            rc = ap_nscmd_runv(why, wn, "ip", "-n", r->name, "link", "add", "lan0", "type", "veth",
                               "peer", "name", "eth0", "netns", h->name, (char *)NULL);
        if (!rc) rc = addr_up(r, "lan0", r->lan, why, wn);
        if (!rc) rc = addr_up(h, "eth0", h->ip, why, wn);
        if (!rc)
            rc = ap_nscmd_runv(why, wn, "ip", "-n", h->name, "route", "add", "default", "via",
                               r->lan, (char *)NULL);
        if (!rc) rc = setup_router(r, k, ns->kinds[k], why, wn);
    }
    return rc;
}

int ap_natns_new(size_t npublic, size_t nhomes, const ap_nat_kind_t *kinds, ap_natns_t **out,
                 char *why, size_t wn)
{
    *out = NULL;
    if (npublic > AP_NATNS_MAX_PUBLIC || nhomes > AP_NATNS_MAX_HOMES || (nhomes && !kinds)) {
        snprintf(why, wn, "at most %d public nodes and %d homes", AP_NATNS_MAX_PUBLIC,
                 AP_NATNS_MAX_HOMES);
        return AP_EINVAL;
    }
    for (size_t k = 0; k < nhomes; k++)
        if ((unsigned)kinds[k] > AP_NAT_UPNP) {
            snprintf(why, wn, "home %zu: unknown NAT kind %d", k, (int)kinds[k]);
            return AP_EINVAL;
        }
    if (geteuid() != 0) {
        snprintf(why, wn, "network namespaces need root (euid %d)", (int)geteuid());
        return AP_EPERM;
    }
    ap_nscmd_sweep("apnat");
    ap_natns_t *ns = calloc(1, sizeof *ns);
    if (!ns) return AP_ENOMEM;
    ns->np = npublic;
    ns->nh = nhomes;
    ns->owner = getpid();
    ns->e = calloc(n_entries(ns), sizeof *ns->e);
    ns->kinds = calloc(nhomes ? nhomes : 1, sizeof *ns->kinds);
    if (!ns->e || !ns->kinds) {
        free(ns->e);
        free(ns->kinds);
        free(ns);
        return AP_ENOMEM;
    }
    if (nhomes) memcpy(ns->kinds, kinds, nhomes * sizeof *kinds);
    static unsigned seq; /* keeps two sets of one process apart */
    unsigned s = seq++;
    char name[NAME_MAX_], ip[32];
    int pid = (int)getpid();
    snprintf(name, sizeof name, "apnat-%d-%u-net", pid, s);
    set_entry(&ns->e[0], name, NET_IP);
    for (size_t i = 0; i < npublic; i++) {
        snprintf(name, sizeof name, "apnat-%d-%u-p%zu", pid, s, i);
        snprintf(ip, sizeof ip, "198.18.0.%u", (unsigned)(1 + i));
        set_entry(pub(ns, i), name, ip);
    }
    for (size_t k = 0; k < nhomes; k++) {
        snprintf(name, sizeof name, "apnat-%d-%u-r%zu", pid, s, k);
        snprintf(ip, sizeof ip, "%s.%u", kinds[k] == AP_NAT_UPNP ? AP_NATNS_UPNP_NET : "198.18.0",
                 (unsigned)(101 + k));
        set_entry(rtr(ns, k), name, ip);
        snprintf(rtr(ns, k)->lan, sizeof rtr(ns, k)->lan, "10.%u.0.1", (unsigned)(90 + k));
        snprintf(name, sizeof name, "apnat-%d-%u-h%zu", pid, s, k);
        snprintf(ip, sizeof ip, "10.%u.0.2", (unsigned)(90 + k));
        set_entry(home(ns, k), name, ip);
    }
    ap_nsguard_add(unmount_cb, ns); /* when full: not removed on a signal */
    int rc = build(ns, why, wn);
    if (rc) {
        ap_natns_free(ns);
        return rc;
    }
    *out = ns;
    return 0;
}

void ap_natns_free(ap_natns_t *ns)
{
    if (!ns) return;
    if (ns->owner == getpid()) {
        for (size_t k = 0; k < ns->nh; k++) stop_upnpd(rtr(ns, k));
        size_t n = n_entries(ns);
        for (size_t i = n; i-- > 0;) ns_del(&ns->e[i]);
    }
    ap_nsguard_remove(ns);
    free(ns->e);
    free(ns->kinds);
    free(ns);
}

int ap_natns_probe(char *why, size_t wn)
{
    if (geteuid() != 0) {
        snprintf(why, wn, "network namespaces need root (euid %d)", (int)geteuid());
        return AP_EPERM;
    }
    struct stat st;
    if (stat("/proc/self/ns/net", &st)) {
        snprintf(why, wn, "this kernel has no network namespaces (/proc/self/ns/net)");
        return AP_ENOTSUP;
    }
    ap_nat_kind_t k = AP_NAT_SYMMETRIC;
    ap_natns_t *ns;
    int rc = ap_natns_new(0, 1, &k, &ns, why, wn);
    if (rc) return rc == AP_ENOMEM ? rc : AP_ENOTSUP;
    ap_natns_free(ns);
    return 0;
}

size_t ap_natns_npublic(const ap_natns_t *ns)
{
    return ns->np;
}
size_t ap_natns_nhomes(const ap_natns_t *ns)
{
    return ns->nh;
}
ap_nat_kind_t ap_natns_kind(const ap_natns_t *ns, size_t k)
{
    return k < ns->nh ? ns->kinds[k] : AP_NAT_DROP;
}

const char *ap_natns_public_ip(const ap_natns_t *ns, size_t i)
{
    return i < ns->np ? pub(ns, i)->ip : NULL;
}
const char *ap_natns_home_ip(const ap_natns_t *ns, size_t k)
{
    return k < ns->nh ? home(ns, k)->ip : NULL;
}
const char *ap_natns_router_ip(const ap_natns_t *ns, size_t k)
{
    return k < ns->nh ? rtr(ns, k)->ip : NULL;
}
const char *ap_natns_public_name(const ap_natns_t *ns, size_t i)
{
    return i < ns->np ? pub(ns, i)->name : NULL;
}
const char *ap_natns_home_name(const ap_natns_t *ns, size_t k)
{
    return k < ns->nh ? home(ns, k)->name : NULL;
}
const char *ap_natns_router_name(const ap_natns_t *ns, size_t k)
{
    return k < ns->nh ? rtr(ns, k)->name : NULL;
}

static int enter(const ns_entry_t *e)
{
    int fd = open(e->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return AP_ESYS;
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    return rc ? AP_ESYS : 0;
}

int ap_natns_enter_public(const ap_natns_t *ns, size_t i)
{
    return ns && i < ns->np ? enter(pub(ns, i)) : AP_EINVAL;
}
int ap_natns_enter_home(const ap_natns_t *ns, size_t k)
{
    return ns && k < ns->nh ? enter(home(ns, k)) : AP_EINVAL;
}
int ap_natns_enter_router(const ap_natns_t *ns, size_t k)
{
    return ns && k < ns->nh ? enter(rtr(ns, k)) : AP_EINVAL;
}

int ap_natns_set_delay(ap_natns_t *ns, size_t k, unsigned ms, char *why, size_t wn)
{
    if (!ns || k >= ns->nh || ms > 10000) return AP_EINVAL;
    const char *devs[2] = {"wan0", "lan0"};
    char delay[24];
    snprintf(delay, sizeof delay, "%ums", ms);
    for (size_t d = 0; d < 2; d++) {
        const char *r = rtr(ns, k)->name;
        if (ms == 0) {
            ap_nscmd_runv(NULL, 0, "tc", "-n", r, "qdisc", "del", "dev", devs[d], "root",
                          (char *)NULL);
            continue;
        }
        /* a limit well above what a test keeps in flight at these delays */
        int rc = ap_nscmd_runv(why, wn, "tc", "-n", r, "qdisc", "replace", "dev", devs[d], "root",
                               "netem", "delay", delay, "limit", "10000", (char *)NULL);
        if (rc) return rc == AP_ESYS ? AP_ENOTSUP : rc;
    }
    return 0;
}

int ap_natns_upnp_mappings(const ap_natns_t *ns, size_t k)
{
    if (!ns || k >= ns->nh || ns->kinds[k] != AP_NAT_UPNP) return AP_EINVAL;
    char out[2048];
    char *argv[] = {"ip",    "netns", "exec",  (char *)rtr(ns, k)->name, "nft", "list",
                    "chain", "inet",  "apnat", "prerouting_miniupnpd",   NULL};
    if (ap_nscmd_run(argv, NULL, NULL, 0, out, sizeof out)) return AP_ESYS;
    int n = 0;
    for (const char *p = out; (p = strstr(p, " dnat ")); p++) n++;
    return n;
}

bool ap_natns_upnp_log_has(const ap_natns_t *ns, size_t k, const char *needle)
{
    if (!ns || k >= ns->nh || !rtr(ns, k)->upnp_log[0]) return false;
    return log_has(rtr(ns, k)->upnp_log, needle);
}

bool ap_natns_read_within(int fd, void *p, size_t n, int ms)
{
    size_t got = 0;
    while (got < n) {
        struct pollfd q = {.fd = fd, .events = POLLIN};
        if (poll(&q, 1, ms) != 1) return false;
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0) return false;
        got += (size_t)r;
    }
    return true;
}

void ap_natns_kill_all(pid_t *pids, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (pids[i] > 0) {
            kill(pids[i], SIGKILL);
            waitpid(pids[i], NULL, 0);
            pids[i] = 0;
        }
}
