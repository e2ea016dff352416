/* Port mapping: the blocking UPnP IGD and NAT-PMP calls (see portmap.h). */
#include "p2p/portmap.h"

#include "apiary/error.h"
#include "apiary/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <miniupnpc/miniupnpc.h>
#include <miniupnpc/upnpcommands.h>
#include <miniupnpc/upnperrors.h>
#include <natpmp.h>
#include <stdio.h>
#include <string.h>
#include <sys/select.h>
#include <sys/time.h>

/* UPnP errors of AddPortMapping (UPnP IGD WANIPConnection:1, 2.4.16) */
#define UPNP_CONFLICT       718 /* ConflictInMappingEntry */
#define UPNP_ONLY_PERMANENT 725 /* OnlyPermanentLeasesSupported */

const char *ap__portmap_via_name(ap_portmap_via_t via)
{
    switch (via) {
    case AP_PORTMAP_UPNP:
        return "UPnP";
    case AP_PORTMAP_NATPMP:
        return "NAT-PMP";
    }
    return "?";
}

static bool public_ipv4(const char *s)
{
    struct in_addr a;
    return s && inet_pton(AF_INET, s, &a) == 1 && a.s_addr != 0;
}

/* ---- UPnP IGD --------------------------------------------------------------------- */

static int upnp_map(const char *ctrl, const char *st, const char *lan, uint16_t port,
                    uint32_t lifetime_s, uint32_t *granted, char *why, size_t wn)
{
    char p[8], life[16];
    snprintf(p, sizeof p, "%u", (unsigned)port);
    snprintf(life, sizeof life, "%u", (unsigned)lifetime_s);
    int r = UPNP_AddPortMapping(ctrl, st, p, p, lan, "apiary", "TCP", NULL, life);
    *granted = lifetime_s;
    if (r == UPNP_ONLY_PERMANENT) {
        r = UPNP_AddPortMapping(ctrl, st, p, p, lan, "apiary", "TCP", NULL, "0");
        *granted = 0;
    }
    if (r == UPNPCOMMAND_SUCCESS) return 0;
    snprintf(why, wn, "UPnP AddPortMapping TCP %u -> %s: %d %s", (unsigned)port, lan, r,
             strupnperror(r) ? strupnperror(r) : "");
    return r == UPNP_CONFLICT ? AP_EEXIST : r == 606 ? AP_EPERM : AP_EIO; /* 606: not authorized */
}

static int upnp_add(uint16_t port, uint32_t lifetime_s, int timeout_ms, ap_portmap_lease_t *l,
                    char *why, size_t wn)
{
    if (l->control_url[0]) { /* a renewal: straight to the known service */
        return upnp_map(l->control_url, l->service_type, l->internal_ip, port, lifetime_s,
                        &l->lifetime_s, why, wn);
    }
    int err = 0;
    int delay = timeout_ms / 2 > 100 ? timeout_ms / 2 : 100;
    struct UPNPDev *devs = upnpDiscover(delay, NULL, NULL, UPNP_LOCAL_PORT_ANY, 0, 2, &err);
    if (!devs) {
        snprintf(why, wn, "UPnP: no gateway answered the discovery (%d)", err);
        return AP_ENOTFOUND;
    }
    struct UPNPUrls urls;
    struct IGDdatas data;
    char lan[64] = "";
    memset(&urls, 0, sizeof urls);
    memset(&data, 0, sizeof data);
    int igd = UPNP_GetValidIGD(devs, &urls, &data, lan, sizeof lan);
    freeUPNPDevlist(devs);
    if (igd != 1) {
        snprintf(why, wn, "UPnP: %s",
                 igd == 0   ? "no Internet gateway device found"
                 : igd == 2 ? "the gateway reports it is not connected"
                            : "the device found is not a gateway");
        if (igd) FreeUPNPUrls(&urls);
        return AP_ENOTFOUND;
    }
    int rc = 0;
    char ext[64] = "";
    if (!urls.controlURL || strlen(urls.controlURL) >= sizeof l->control_url ||
        strlen(data.first.servicetype) >= sizeof l->service_type || !lan[0]) {
        snprintf(why, wn, "UPnP: unusable gateway description");
        rc = AP_EIO;
    } else if (UPNP_GetExternalIPAddress(urls.controlURL, data.first.servicetype, ext) !=
                   UPNPCOMMAND_SUCCESS ||
               !public_ipv4(ext)) {
        snprintf(why, wn, "UPnP: the gateway has no external address");
        rc = AP_EIO;
    } else {
        rc = upnp_map(urls.controlURL, data.first.servicetype, lan, port, lifetime_s,
                      &l->lifetime_s, why, wn);
    }
    if (rc == 0) {
        l->via = AP_PORTMAP_UPNP;
        l->internal_port = l->external_port = port;
        snprintf(l->external_ip, sizeof l->external_ip, "%s", ext);
        snprintf(l->internal_ip, sizeof l->internal_ip, "%s", lan);
        snprintf(l->control_url, sizeof l->control_url, "%s", urls.controlURL);
        snprintf(l->service_type, sizeof l->service_type, "%s", data.first.servicetype);
    }
    FreeUPNPUrls(&urls);
    return rc;
}

static int upnp_del(const ap_portmap_lease_t *l, char *why, size_t wn)
{
    char p[8];
    snprintf(p, sizeof p, "%u", (unsigned)l->external_port);
    int r = UPNP_DeletePortMapping(l->control_url, l->service_type, p, "TCP", NULL);
    if (r == UPNPCOMMAND_SUCCESS) return 0;
    snprintf(why, wn, "UPnP DeletePortMapping TCP %s: %d", p, r);
    return AP_EIO;
}

/* ---- NAT-PMP ------------------------------------------------------------------------- */

/* Waits for the answer to the pending request until deadline (libnatpmp
 * retransmits on its own schedule; we stop at ours). */
static int natpmp_wait(natpmp_t *n, const struct timeval *deadline, natpmpresp_t *resp)
{
    for (;;) {
        struct timeval tv, now;
        if (getnatpmprequesttimeout(n, &tv) < 0) return NATPMP_ERR_NOPENDINGREQ;
        gettimeofday(&now, NULL);
        if (!timercmp(&now, deadline, <)) return NATPMP_TRYAGAIN;
        struct timeval left;
        timersub(deadline, &now, &left);
        if (timercmp(&left, &tv, <)) tv = left;
        fd_set fds;
        FD_ZERO(&fds);
        FD_SET(n->s, &fds);
        int s = select(n->s + 1, &fds, NULL, NULL, &tv);
        if (s < 0 && errno != EINTR) return NATPMP_ERR_RECVFROM;
        int r = readnatpmpresponseorretry(n, resp);
        if (r != NATPMP_TRYAGAIN) return r;
    }
}

static int natpmp_call(uint16_t port, uint16_t public_port, uint32_t lifetime_s, int timeout_ms,
                       ap_portmap_lease_t *l, char *why, size_t wn)
{
    natpmp_t n;
    int r = initnatpmp(&n, 0, 0);
    if (r < 0) {
        snprintf(why, wn, "NAT-PMP: no default gateway (%d)", r);
        return AP_ENOTFOUND;
    }
    struct timeval now, span = {timeout_ms / 1000, (timeout_ms % 1000) * 1000}, deadline;
    gettimeofday(&now, NULL);
    timeradd(&now, &span, &deadline);
    natpmpresp_t resp;
    memset(&resp, 0, sizeof resp);
    bool del = lifetime_s == 0;
    int rc = 0;
    if (!del) {
        r = sendpublicaddressrequest(&n);
        if (r >= 0) r = natpmp_wait(&n, &deadline, &resp);
        if (r < 0) {
            snprintf(why, wn, "NAT-PMP: %s (%d)",
                     r == NATPMP_TRYAGAIN ? "the gateway did not answer" : "public address request",
                     r);
            rc = r == NATPMP_TRYAGAIN ? AP_ENOTFOUND : AP_EIO;
        } else {
            inet_ntop(AF_INET, &resp.pnu.publicaddress.addr, l->external_ip, sizeof l->external_ip);
            if (!public_ipv4(l->external_ip)) {
                snprintf(why, wn, "NAT-PMP: the gateway has no external address");
                rc = AP_EIO;
            }
        }
    }
    if (rc == 0) {
        r = sendnewportmappingrequest(&n, NATPMP_PROTOCOL_TCP, port, public_port, lifetime_s);
        if (r >= 0) r = natpmp_wait(&n, &deadline, &resp);
        if (r < 0) {
            snprintf(why, wn, "NAT-PMP: %s TCP %u: %s (%d)", del ? "removing" : "mapping",
                     (unsigned)port,
                     r == NATPMP_TRYAGAIN            ? "no answer"
                     : r == NATPMP_ERR_NOTAUTHORIZED ? "refused"
                                                     : "failed",
                     r);
            rc = r == NATPMP_ERR_NOTAUTHORIZED ? AP_EPERM
                 : r == NATPMP_TRYAGAIN        ? AP_ENOTFOUND
                                               : AP_EIO;
        } else if (!del) {
            l->via = AP_PORTMAP_NATPMP;
            l->internal_port = port;
            l->external_port = resp.pnu.newportmapping.mappedpublicport;
            l->lifetime_s = resp.pnu.newportmapping.lifetime;
            l->internal_ip[0] = 0;
            l->control_url[0] = l->service_type[0] = 0;
        }
    }
    closenatpmp(&n);
    return rc;
}

/* ---- both ------------------------------------------------------------------------------- */

int ap__portmap_add(unsigned protos, uint16_t port, uint32_t lifetime_s, int timeout_ms,
                    ap_portmap_lease_t *out, char *why, size_t wn)
{
    char w1[256] = "", w2[256] = "";
    if (!out || port == 0 || lifetime_s == 0 || !(protos & AP_PORTMAP_ANY)) {
        snprintf(why, wn, "bad arguments");
        return AP_EINVAL;
    }
    bool renew = out->via != 0 && out->internal_port == port;
    if (!renew) memset(out, 0, sizeof *out);
    int rc = AP_ENOTFOUND;
    if ((protos & AP_PORTMAP_UPNP) && (!renew || out->via == AP_PORTMAP_UPNP)) {
        rc = upnp_add(port, lifetime_s, timeout_ms, out, w1, sizeof w1);
        if (rc == 0) return 0;
    }
    if ((protos & AP_PORTMAP_NATPMP) && (!renew || out->via == AP_PORTMAP_NATPMP)) {
        uint16_t ext = renew ? out->external_port : port;
        rc = natpmp_call(port, ext, lifetime_s, timeout_ms, out, w2, sizeof w2);
        if (rc == 0) return 0;
    }
    snprintf(why, wn, "%s%s%s", w1, w1[0] && w2[0] ? "; " : "", w2);
    return rc;
}

int ap__portmap_del(const ap_portmap_lease_t *l, int timeout_ms, char *why, size_t wn)
{
    if (!l) return AP_EINVAL;
    if (l->via == AP_PORTMAP_UPNP) return upnp_del(l, why, wn);
    if (l->via == AP_PORTMAP_NATPMP) {
        ap_portmap_lease_t tmp = *l;
        return natpmp_call(l->internal_port, 0, 0, timeout_ms, &tmp, why, wn);
    }
    return AP_EINVAL;
}
