/* Multiaddr text/binary forms and name resolution (see apiary/multiaddr.h). */
#include "apiary/multiaddr.h"
#include "apiary/error.h"
#include "base/varint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <uv.h>

enum {
    CODE_IP4 = 4,
    CODE_TCP = 6,
    CODE_IP6 = 41,
    CODE_DNS4 = 54,
    CODE_DNS6 = 55,
    CODE_CIRCUIT = 290,
    CODE_P2P = 421,
};

/* ---- validation helpers ------------------------------------------------- */

static bool valid_dns(const char *s, size_t n)
{
    if (n == 0 || n > AP_MA_DNS_MAX) return false;
    size_t label = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '.') {
            if (label == 0) return false; /* empty label: "..", leading "." */
            label = 0;
            continue;
        }
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '-' || c == '_';
        if (!ok || ++label > 63) return false;
    }
    return label > 0; /* no trailing dot */
}

static bool parse_port(const char *s, size_t n, uint16_t *out)
{
    if (n == 0 || n > 5) return false;
    if (n > 1 && s[0] == '0') return false; /* canonical: no leading zeros */
    uint32_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        v = v * 10 + (uint32_t)(s[i] - '0');
    }
    if (v > 65535) return false;
    *out = (uint16_t)v;
    return true;
}

/* Copies component [s, s+n) into a NUL-terminated buffer. */
static bool component(char *dst, size_t cap, const char *s, size_t n)
{
    if (n == 0 || n >= cap) return false;
    memcpy(dst, s, n);
    dst[n] = 0;
    return true;
}

/* ---- text ----------------------------------------------------------------- */

/* Splits off the next "/part"; returns false at the end of the string. */
static bool next_part(const char **p, const char **part, size_t *len)
{
    const char *s = *p;
    if (*s == 0) return false;
    if (*s != '/') {
        *part = NULL; /* signals a syntax error */
        return true;
    }
    s++;
    const char *e = strchr(s, '/');
    size_t n = e ? (size_t)(e - s) : strlen(s);
    *part = s;
    *len = n;
    *p = s + n;
    return true;
}

static bool part_is(const char *part, size_t n, const char *name)
{
    return n == strlen(name) && memcmp(part, name, n) == 0;
}

int ap_multiaddr_parse(ap_multiaddr_t *out, const char *text)
{
    if (!out || !text) return AP_EADDR;
    if (strnlen(text, AP_MA_TEXT_MAX) >= AP_MA_TEXT_MAX) return AP_EADDR;
    ap_multiaddr_t ma;
    memset(&ma, 0, sizeof ma);
    const char *p = text;
    const char *part;
    size_t n;
    enum { S_HOST, S_TCP, S_P2P, S_END, S_CIRCUIT, S_DST_END } st = S_HOST;
    char tmp[AP_MA_TEXT_MAX];
    if (*p == 0) return AP_EADDR;
    while (next_part(&p, &part, &n)) {
        if (!part || n == 0) return AP_EADDR;
        if (part_is(part, n, "p2p-circuit")) { /* the one component without a value */
            if (st == S_CIRCUIT || st == S_DST_END) return AP_EADDR;
            ma.circuit = true;
            st = S_CIRCUIT;
            continue;
        }
        const char *val;
        size_t vn;
        if (!next_part(&p, &val, &vn) || !val || vn == 0) return AP_EADDR;
        if (st == S_CIRCUIT && (part_is(part, n, "p2p") || part_is(part, n, "ipfs"))) {
            if (!component(tmp, sizeof tmp, val, vn)) return AP_EADDR;
            if (ap_peer_id_parse(&ma.dst, tmp) != 0) return AP_EADDR;
            ma.has_dst = true;
            st = S_DST_END;
        } else if (st == S_HOST && (part_is(part, n, "ip4") || part_is(part, n, "ip6"))) {
            bool v6 = part[2] == '6';
            if (!component(tmp, sizeof tmp, val, vn)) return AP_EADDR;
            if (inet_pton(v6 ? AF_INET6 : AF_INET, tmp, ma.ip) != 1) return AP_EADDR;
            ma.host = v6 ? AP_MA_HOST_IP6 : AP_MA_HOST_IP4;
            st = S_TCP;
        } else if (st == S_HOST && (part_is(part, n, "dns4") || part_is(part, n, "dns6"))) {
            if (!valid_dns(val, vn)) return AP_EADDR;
            memcpy(ma.dns, val, vn);
            ma.dns[vn] = 0;
            ma.host = part[3] == '6' ? AP_MA_HOST_DNS6 : AP_MA_HOST_DNS4;
            st = S_TCP;
        } else if (st == S_TCP && part_is(part, n, "tcp")) {
            if (!parse_port(val, vn, &ma.port)) return AP_EADDR;
            ma.has_tcp = true;
            st = S_P2P;
        } else if (st <= S_P2P && (part_is(part, n, "p2p") || part_is(part, n, "ipfs"))) {
            if (!component(tmp, sizeof tmp, val, vn)) return AP_EADDR;
            if (ap_peer_id_parse(&ma.peer, tmp) != 0) return AP_EADDR;
            ma.has_peer = true;
            st = S_END;
        } else {
            return AP_EADDR;
        }
    }
    if (ma.host == AP_MA_HOST_NONE && !ma.has_peer && !ma.circuit) return AP_EADDR;
    *out = ma;
    return 0;
}

int ap_multiaddr_print(const ap_multiaddr_t *ma, char *buf, size_t cap)
{
    char host[INET6_ADDRSTRLEN + 1];
    size_t len = 0;
    int n;
    if (cap == 0) return AP_ERANGE;
    buf[0] = 0;
#define APPEND(...)                                                                                \
    do {                                                                                           \
        n = snprintf(buf + len, cap - len, __VA_ARGS__);                                           \
        if (n < 0 || (size_t)n >= cap - len) return AP_ERANGE;                                     \
        len += (size_t)n;                                                                          \
    } while (0)
    switch (ma->host) {
    case AP_MA_HOST_IP4:
    case AP_MA_HOST_IP6: {
        bool v6 = ma->host == AP_MA_HOST_IP6;
        if (!inet_ntop(v6 ? AF_INET6 : AF_INET, ma->ip, host, sizeof host)) return AP_EADDR;
        APPEND("/%s/%s", v6 ? "ip6" : "ip4", host);
        break;
    }
    case AP_MA_HOST_DNS4:
    case AP_MA_HOST_DNS6:
        APPEND("/%s/%s", ma->host == AP_MA_HOST_DNS6 ? "dns6" : "dns4", ma->dns);
        break;
    case AP_MA_HOST_NONE:
        break;
    default:
        return AP_EADDR;
    }
    if (ma->has_tcp) APPEND("/tcp/%u", (unsigned)ma->port);
    if (ma->has_peer) {
        char id[AP_PEER_ID_STR_MAX];
        APPEND("/p2p/%s", ap_peer_id_str(&ma->peer, id));
    }
    if (ma->circuit) APPEND("/p2p-circuit");
    if (ma->circuit && ma->has_dst) {
        char id[AP_PEER_ID_STR_MAX];
        APPEND("/p2p/%s", ap_peer_id_str(&ma->dst, id));
    }
#undef APPEND
    return (int)len;
}

/* ---- binary --------------------------------------------------------------- */

int ap_multiaddr_encode(const ap_multiaddr_t *ma, uint8_t *out, size_t cap)
{
    uint8_t tmp[AP_MA_BINARY_MAX];
    size_t n = 0;
    switch (ma->host) {
    case AP_MA_HOST_IP4:
        n += ap__uvarint_put(tmp + n, CODE_IP4);
        memcpy(tmp + n, ma->ip, 4);
        n += 4;
        break;
    case AP_MA_HOST_IP6:
        n += ap__uvarint_put(tmp + n, CODE_IP6);
        memcpy(tmp + n, ma->ip, 16);
        n += 16;
        break;
    case AP_MA_HOST_DNS4:
    case AP_MA_HOST_DNS6: {
        size_t dl = strnlen(ma->dns, sizeof ma->dns);
        if (!valid_dns(ma->dns, dl)) return AP_EADDR;
        n += ap__uvarint_put(tmp + n, ma->host == AP_MA_HOST_DNS4 ? CODE_DNS4 : CODE_DNS6);
        n += ap__uvarint_put(tmp + n, dl);
        memcpy(tmp + n, ma->dns, dl);
        n += dl;
        break;
    }
    case AP_MA_HOST_NONE:
        if (!ma->has_peer && !ma->circuit) return AP_EADDR;
        break;
    default:
        return AP_EADDR;
    }
    if (ma->has_tcp) {
        n += ap__uvarint_put(tmp + n, CODE_TCP);
        tmp[n++] = (uint8_t)(ma->port >> 8);
        tmp[n++] = (uint8_t)ma->port;
    }
    if (ma->has_peer) {
        n += ap__uvarint_put(tmp + n, CODE_P2P);
        n += ap__uvarint_put(tmp + n, AP_PEER_ID_LEN);
        memcpy(tmp + n, ma->peer.b, AP_PEER_ID_LEN);
        n += AP_PEER_ID_LEN;
    }
    if (ma->circuit) n += ap__uvarint_put(tmp + n, CODE_CIRCUIT);
    if (ma->circuit && ma->has_dst) {
        n += ap__uvarint_put(tmp + n, CODE_P2P);
        n += ap__uvarint_put(tmp + n, AP_PEER_ID_LEN);
        memcpy(tmp + n, ma->dst.b, AP_PEER_ID_LEN);
        n += AP_PEER_ID_LEN;
    }
    if (n > cap) return AP_ERANGE;
    memcpy(out, tmp, n);
    return (int)n;
}

int ap_multiaddr_decode(ap_multiaddr_t *out, const uint8_t *data, size_t len)
{
    if (!out || (!data && len)) return AP_EADDR;
    if (len == 0 || len > AP_MA_BINARY_MAX) return AP_EADDR;
    ap_multiaddr_t ma;
    memset(&ma, 0, sizeof ma);
    enum { S_HOST, S_TCP, S_P2P, S_END, S_CIRCUIT, S_DST_END } st = S_HOST;
    size_t off = 0;
    while (off < len) {
        uint64_t code, vlen;
        int k = ap__uvarint_get(data + off, len - off, &code);
        if (k < 0) return AP_EADDR;
        off += (size_t)k;
        if (code == CODE_CIRCUIT) {
            if (st == S_CIRCUIT || st == S_DST_END) return AP_EADDR;
            ma.circuit = true;
            st = S_CIRCUIT;
        } else if (st == S_CIRCUIT && code == CODE_P2P) {
            k = ap__uvarint_get(data + off, len - off, &vlen);
            if (k < 0) return AP_EADDR;
            off += (size_t)k;
            if (vlen > len - off) return AP_EADDR;
            if (ap_peer_id_from_bytes(&ma.dst, data + off, (size_t)vlen) != 0) return AP_EADDR;
            off += (size_t)vlen;
            ma.has_dst = true;
            st = S_DST_END;
        } else if (st == S_HOST && (code == CODE_IP4 || code == CODE_IP6)) {
            size_t w = code == CODE_IP4 ? 4 : 16;
            if (len - off < w) return AP_EADDR;
            memcpy(ma.ip, data + off, w);
            off += w;
            ma.host = code == CODE_IP4 ? AP_MA_HOST_IP4 : AP_MA_HOST_IP6;
            st = S_TCP;
        } else if (st == S_HOST && (code == CODE_DNS4 || code == CODE_DNS6)) {
            k = ap__uvarint_get(data + off, len - off, &vlen);
            if (k < 0) return AP_EADDR;
            off += (size_t)k;
            if (vlen > len - off || !valid_dns((const char *)data + off, (size_t)vlen))
                return AP_EADDR;
            memcpy(ma.dns, data + off, (size_t)vlen);
            ma.dns[vlen] = 0;
            off += (size_t)vlen;
            ma.host = code == CODE_DNS4 ? AP_MA_HOST_DNS4 : AP_MA_HOST_DNS6;
            st = S_TCP;
        } else if (st == S_TCP && code == CODE_TCP) {
            if (len - off < 2) return AP_EADDR;
            ma.port = (uint16_t)((data[off] << 8) | data[off + 1]);
            off += 2;
            ma.has_tcp = true;
            st = S_P2P;
        } else if (st <= S_P2P && code == CODE_P2P) {
            k = ap__uvarint_get(data + off, len - off, &vlen);
            if (k < 0) return AP_EADDR;
            off += (size_t)k;
            if (vlen > len - off) return AP_EADDR;
            if (ap_peer_id_from_bytes(&ma.peer, data + off, (size_t)vlen) != 0) return AP_EADDR;
            off += (size_t)vlen;
            ma.has_peer = true;
            st = S_END;
        } else {
            return AP_EADDR;
        }
    }
    if (ma.host == AP_MA_HOST_NONE && !ma.has_peer && !ma.circuit) return AP_EADDR;
    *out = ma;
    return 0;
}

bool ap_multiaddr_eq(const ap_multiaddr_t *a, const ap_multiaddr_t *b)
{
    if (a->host != b->host || a->has_tcp != b->has_tcp || a->has_peer != b->has_peer) return false;
    if (a->has_tcp && a->port != b->port) return false;
    if (a->has_peer && !ap_peer_id_eq(&a->peer, &b->peer)) return false;
    if (a->circuit != b->circuit || (a->circuit && a->has_dst != b->has_dst)) return false;
    if (a->circuit && a->has_dst && !ap_peer_id_eq(&a->dst, &b->dst)) return false;
    switch (a->host) {
    case AP_MA_HOST_IP4:
        return memcmp(a->ip, b->ip, 4) == 0;
    case AP_MA_HOST_IP6:
        return memcmp(a->ip, b->ip, 16) == 0;
    case AP_MA_HOST_DNS4:
    case AP_MA_HOST_DNS6:
        return strcmp(a->dns, b->dns) == 0;
    default:
        return true;
    }
}

/* ---- sockaddr --------------------------------------------------------------- */

int ap_multiaddr_to_sockaddr(const ap_multiaddr_t *ma, void *ss, size_t ss_len)
{
    if (!ma->has_tcp || ma->circuit) return AP_EADDR;
    if (ma->host == AP_MA_HOST_IP4) {
        if (ss_len < sizeof(struct sockaddr_in)) return AP_EINVAL;
        struct sockaddr_in *sin = ss;
        memset(sin, 0, sizeof *sin);
        sin->sin_family = AF_INET;
        sin->sin_port = htons(ma->port);
        memcpy(&sin->sin_addr, ma->ip, 4);
        return 0;
    }
    if (ma->host == AP_MA_HOST_IP6) {
        if (ss_len < sizeof(struct sockaddr_in6)) return AP_EINVAL;
        struct sockaddr_in6 *sin6 = ss;
        memset(sin6, 0, sizeof *sin6);
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons(ma->port);
        memcpy(&sin6->sin6_addr, ma->ip, 16);
        return 0;
    }
    return AP_EADDR;
}

int ap_multiaddr_from_sockaddr(ap_multiaddr_t *out, const void *sa)
{
    const struct sockaddr *s = sa;
    memset(out, 0, sizeof *out);
    if (s->sa_family == AF_INET) {
        const struct sockaddr_in *sin = sa;
        out->host = AP_MA_HOST_IP4;
        memcpy(out->ip, &sin->sin_addr, 4);
        out->port = ntohs(sin->sin_port);
    } else if (s->sa_family == AF_INET6) {
        const struct sockaddr_in6 *sin6 = sa;
        out->host = AP_MA_HOST_IP6;
        memcpy(out->ip, &sin6->sin6_addr, 16);
        out->port = ntohs(sin6->sin6_port);
    } else {
        return AP_EADDR;
    }
    out->has_tcp = true;
    return 0;
}

/* ---- resolution ----------------------------------------------------------- */

#define RESOLVE_MAX 8

struct ap_ma_resolve {
    uv_getaddrinfo_t req;
    ap_multiaddr_t in;
    ap_ma_resolve_fn cb;
    void *arg;
    bool canceled;
};

static void resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    ap_ma_resolve_t *r = req->data;
    ap_multiaddr_t out[RESOLVE_MAX];
    size_t n = 0;
    int rc = 0;
    if (r->canceled || status == UV_EAI_CANCELED) {
        rc = AP_ECANCELED;
    } else if (status != 0) {
        rc = (status == UV_EAI_NONAME || status == UV_EAI_NODATA || status == UV_EAI_FAMILY ||
              status == UV_EAI_ADDRFAMILY)
                 ? AP_ENOTFOUND
                 : AP_EUNREACH;
    } else {
        for (struct addrinfo *ai = res; ai && n < RESOLVE_MAX; ai = ai->ai_next) {
            if (!ai->ai_addr) continue;
            if (ap_multiaddr_from_sockaddr(&out[n], ai->ai_addr) != 0) continue;
            bool dup = false;
            out[n].port = r->in.port;
            out[n].has_tcp = r->in.has_tcp;
            out[n].has_peer = r->in.has_peer;
            out[n].peer = r->in.peer;
            for (size_t i = 0; i < n; i++) dup = dup || ap_multiaddr_eq(&out[i], &out[n]);
            if (!dup) n++;
        }
        if (n == 0) rc = AP_ENOTFOUND;
    }
    if (res) uv_freeaddrinfo(res);
    r->cb(r->arg, rc, rc == 0 ? out : NULL, rc == 0 ? n : 0);
    free(r);
}

int ap_multiaddr_resolve(ap_uv_loop_t *loop, const ap_multiaddr_t *ma, ap_ma_resolve_fn cb,
                         void *arg, ap_ma_resolve_t **out)
{
    if (!loop || !ma || !cb || ma->host == AP_MA_HOST_NONE || ma->circuit) return AP_EADDR;
    ap_ma_resolve_t *r = calloc(1, sizeof *r);
    if (!r) return AP_ENOMEM;
    r->in = *ma;
    r->cb = cb;
    r->arg = arg;
    r->req.data = r;
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_protocol = IPPROTO_TCP;
    char node[AP_MA_TEXT_MAX];
    switch (ma->host) {
    case AP_MA_HOST_IP4:
    case AP_MA_HOST_IP6:
        /* Numeric host: getaddrinfo answers without DNS, and the callback
         * still comes from the loop, never inside this call. */
        hints.ai_family = ma->host == AP_MA_HOST_IP4 ? AF_INET : AF_INET6;
        hints.ai_flags = AI_NUMERICHOST;
        inet_ntop(hints.ai_family, ma->ip, node, sizeof node);
        break;
    default:
        hints.ai_family = ma->host == AP_MA_HOST_DNS4 ? AF_INET : AF_INET6;
        snprintf(node, sizeof node, "%s", ma->dns);
        break;
    }
    int rc = uv_getaddrinfo((uv_loop_t *)loop, &r->req, resolved, node, NULL, &hints);
    if (rc != 0) {
        free(r);
        return ap_err_from_errno(rc);
    }
    if (out) *out = r;
    return 0;
}

void ap_multiaddr_resolve_cancel(ap_ma_resolve_t *r)
{
    if (!r) return;
    r->canceled = true;
    uv_cancel((uv_req_t *)&r->req);
}
