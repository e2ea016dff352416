/* Apiary — multiaddrs: self-describing network addresses.
 *
 * Supported text forms (libp2p multiaddr, the subset Apiary dials):
 *     HOST [/tcp/PORT] [/p2p/PEERID]      or      /p2p/PEERID
 * where HOST is /ip4/A.B.C.D, /ip6/ADDR, /dns4/NAME or /dns6/NAME.
 * Examples: "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...", "/dns4/example.org/tcp/4001".
 * "/ipfs/" is accepted as the old spelling of "/p2p/" and printed as "/p2p/".
 *
 * Relayed (circuit relay v2) addresses: any of the above, or nothing, then
 *     /p2p-circuit [/p2p/TARGET]
 * e.g. "/ip4/1.2.3.4/tcp/4001/p2p/RELAY/p2p-circuit/p2p/TARGET" (reach TARGET
 * through RELAY) or "/p2p-circuit" (listen through any relay). They are
 * parsed, printed and encoded; ap_multiaddr_to_sockaddr refuses them (a
 * circuit is not dialled directly).
 *
 * The binary form is the multiaddr one: for each component a uvarint
 * protocol code (ip4 4, tcp 6, ip6 41, dns4 54, dns6 55, p2p-circuit 290,
 * p2p 421) then its value: ip4 4 bytes, ip6 16 bytes, tcp 2 bytes big-endian,
 * p2p-circuit nothing, dns4/dns6/p2p a uvarint length then the bytes (p2p:
 * the PeerID multihash).
 *
 * Parsing is strict (canonical decimal ports, valid IP text, DNS names of
 * letters, digits, '-', '_' and '.', ids that are Ed25519 PeerIDs) and
 * bounded; both parsers are fuzzed (fuzz/fuzz_multiaddr.c). A parsed address
 * prints back to a canonical text that parses to the same value.
 *
 * THREADING. Parse/print are reentrant. ap_multiaddr_resolve runs on the
 * libuv loop passed to it. */
#ifndef APIARY_MULTIADDR_H
#define APIARY_MULTIADDR_H

#include "apiary/common.h"
#include "apiary/peer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AP_MA_DNS_MAX    253 /* longest DNS name */
#define AP_MA_TEXT_MAX   448 /* text form incl. NUL always fits */
#define AP_MA_BINARY_MAX 384 /* binary form always fits */

typedef enum ap_ma_host {
    AP_MA_HOST_NONE = 0, /* "/p2p/ID" only */
    AP_MA_HOST_IP4 = 4,
    AP_MA_HOST_IP6 = 41,
    AP_MA_HOST_DNS4 = 54,
    AP_MA_HOST_DNS6 = 55,
} ap_ma_host_t;

typedef struct ap_multiaddr {
    ap_ma_host_t host;
    uint8_t ip[16];              /* ip4: first 4 bytes; network order */
    char dns[AP_MA_DNS_MAX + 1]; /* dns4/dns6: NUL-terminated name */
    bool has_tcp;
    uint16_t port; /* valid if has_tcp; 0 allowed (listen) */
    bool has_peer;
    ap_peer_id_t peer; /* valid if has_peer (for a circuit: the relay) */
    bool circuit;      /* "/p2p-circuit" follows the parts above */
    bool has_dst;
    ap_peer_id_t dst; /* circuit only: "/p2p/TARGET" after "/p2p-circuit" */
} ap_multiaddr_t;

/* Parses the text form. AP_EADDR (with no log line: callers log) on anything
 * not described above. */
AP_EXPORT int ap_multiaddr_parse(ap_multiaddr_t *out, const char *text);
/* Prints the canonical text form into buf (cap bytes, AP_MA_TEXT_MAX always
 * suffices). Returns the length, or AP_ERANGE if it does not fit. */
AP_EXPORT int ap_multiaddr_print(const ap_multiaddr_t *ma, char *buf, size_t cap);

/* Encodes the binary form into out (cap bytes; AP_MA_BINARY_MAX suffices).
 * Returns the length or AP_ERANGE. */
AP_EXPORT int ap_multiaddr_encode(const ap_multiaddr_t *ma, uint8_t *out, size_t cap);
/* Decodes the binary form (untrusted bytes). AP_EADDR on anything invalid. */
AP_EXPORT AP_NODISCARD int ap_multiaddr_decode(ap_multiaddr_t *out, const uint8_t *data,
                                               size_t len);

AP_EXPORT bool ap_multiaddr_eq(const ap_multiaddr_t *a, const ap_multiaddr_t *b);

/* Fills a sockaddr_in/sockaddr_in6 (in *ss, a struct sockaddr_storage) for an
 * ip4/ip6 address with a /tcp port. AP_EADDR if the address has a DNS host,
 * no host, no /tcp, or is a circuit. */
AP_EXPORT int ap_multiaddr_to_sockaddr(const ap_multiaddr_t *ma, void *ss, size_t ss_len);
/* Builds "/ip4|ip6/.../tcp/PORT" from a sockaddr_in/sockaddr_in6. */
AP_EXPORT int ap_multiaddr_from_sockaddr(ap_multiaddr_t *out, const void *sa);

/* ---- asynchronous name resolution (libuv) -------------------------------- */

typedef struct uv_loop_s ap_uv_loop_t; /* = uv_loop_t */
typedef struct ap_ma_resolve ap_ma_resolve_t;

/* Result: status 0 and n >= 1 ip4/ip6 multiaddrs (same port and peer as the
 * input), or an AP_E* error (AP_ENOTFOUND when the name has no address of the
 * wanted family, AP_ECANCELED after ap_multiaddr_resolve_cancel). addrs is
 * valid only during the callback. */
typedef void (*ap_ma_resolve_fn)(void *arg, int status, const ap_multiaddr_t *addrs, size_t n);

/* Resolves ma on loop: ip4/ip6 complete on the next loop iteration with the
 * address itself; dns4/dns6 go through uv_getaddrinfo (AF_INET/AF_INET6, at
 * most 8 results). cb runs exactly once, on the loop thread, never inside this
 * call. *out (may be NULL) receives a handle for cancellation, valid until cb
 * runs. */
AP_EXPORT int ap_multiaddr_resolve(ap_uv_loop_t *loop, const ap_multiaddr_t *ma,
                                   ap_ma_resolve_fn cb, void *arg, ap_ma_resolve_t **out);
/* Cancels: cb still runs once, later, with AP_ECANCELED (unless it already
 * had a result queued). */
AP_EXPORT void ap_multiaddr_resolve_cancel(ap_ma_resolve_t *r);

#ifdef __cplusplus
}
#endif
#endif
