/* multistream-select 1.0 ("/multistream/1.0.0"): how two libp2p peers agree
 * on the protocol of a connection or a stream. Internal, sans-I/O.
 *
 * Every message is a line: a multiformats unsigned-varint length, then that
 * many bytes, the last of which is '\n' (counted in the length). Both sides
 * first send the header line "/multistream/1.0.0\n". The initiator then
 * proposes protocols one at a time; the responder echoes a proposal it speaks
 * (negotiation done, the bytes that follow belong to that protocol), answers
 * "na\n" to one it does not, and answers "ls\n" with the list of what it
 * speaks: one message whose body is, for each protocol, its own length-
 * prefixed line, then a final "\n".
 *
 * The initiator pipelines: the header and its first proposal leave together,
 * and it sends the next proposal as soon as the previous one is refused.
 *
 * Bounds: a line longer than AP_MSS_LINE_MAX bytes, a varint longer than
 * needed, a line without its '\n', a protocol id with a NUL or '\n' inside,
 * a wrong header, or more than AP_MSS_TRIES_MAX refused proposals end the
 * negotiation with an error (the caller closes that stream or connection and
 * logs one line naming the peer). Nothing here allocates.
 *
 * Use: init, send what ap__mss_output returns (then ap__mss_output_done),
 * feed every received byte to ap__mss_feed until ap__mss_state is no longer
 * AP_MSS_RUNNING; once DONE, the bytes feed did not consume (and everything
 * received later) belong to the selected protocol. Send the output once more
 * after DONE: a responder's echo is queued by the same feed that finishes. */
#ifndef AP_P2P_MULTISTREAM_H
#define AP_P2P_MULTISTREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_MSS_HEADER     "/multistream/1.0.0"
#define AP_MSS_PROTO_MAX  256  /* longest protocol id, bytes without '\n' */
#define AP_MSS_LINE_MAX   1024 /* longest message we read, '\n' included */
#define AP_MSS_TRIES_MAX  32   /* refused proposals before a responder gives up */
#define AP_MSS_OUT_MAX    2048 /* queued output; an ls answer lists what fits */
#define AP_MSS_PROTOS_MAX 64   /* protocols one side may list */

typedef enum ap_mss_state { AP_MSS_RUNNING = 0, AP_MSS_DONE = 1, AP_MSS_FAILED = 2 } ap_mss_state_t;

typedef struct ap_mss {
    bool initiator;
    const char *const *protos; /* borrowed, must outlive the negotiation */
    size_t nprotos;
    ap_mss_state_t state;
    int err; /* the error once FAILED */
    bool got_header;
    size_t next;  /* initiator: index of the proposal awaiting its answer */
    size_t tries; /* responder: proposals refused so far */
    int selected; /* index into protos once DONE; -1: accepted by accept */
    /* responder: asked about a proposal none of protos names (may be NULL) */
    bool (*accept)(void *arg, const char *proto);
    void *accept_arg;
    char dyn[AP_MSS_PROTO_MAX + 1]; /* the proposal accept agreed to */
    uint8_t in[AP_MSS_LINE_MAX + 2];
    size_t in_len;
    uint8_t out[AP_MSS_OUT_MAX];
    size_t out_len;
} ap_mss_t;

/* initiator: protos are the proposals in order of preference; responder: the
 * protocols it speaks. AP_EINVAL if a protocol id is empty, longer than
 * AP_MSS_PROTO_MAX, holds '\n' or NUL, or there are more than
 * AP_MSS_PROTOS_MAX (an initiator needs at least one). Queues the header (and
 * an initiator's first proposal). */
int ap__mss_init(ap_mss_t *m, bool initiator, const char *const *protos, size_t nprotos);

/* Feeds received bytes (untrusted). Consumes up to the end of the
 * negotiation and stores how many bytes it took in *used. Returns 0 while
 * running or once done; a negative error when the negotiation failed (also
 * sticky in m->err):
 *   AP_EMSGSIZE   a line longer than AP_MSS_LINE_MAX
 *   AP_EPROTO     a malformed line, a wrong header, an answer that is
 *                 neither the echo nor "na"
 *   AP_ENOPROTO   initiator: every proposal refused; responder: more than
 *                 AP_MSS_TRIES_MAX proposals refused */
int ap__mss_feed(ap_mss_t *m, const uint8_t *in, size_t len, size_t *used);

/* Bytes to send now (valid until the next call on m). */
const uint8_t *ap__mss_output(const ap_mss_t *m, size_t *len);
/* The caller sent (or copied) everything ap__mss_output returned. */
void ap__mss_output_done(ap_mss_t *m);

static inline ap_mss_state_t ap__mss_state(const ap_mss_t *m)
{
    return m->state;
}
/* The agreed protocol (an entry of protos, or the name accept agreed to)
 * once DONE, else NULL. */
const char *ap__mss_selected(const ap_mss_t *m);
/* Responder: proposals not in protos are put to fn (a NUL-terminated id of
 * at most AP_MSS_PROTO_MAX bytes, no NUL or newline inside); true selects
 * it. Call right after ap__mss_init. For protocols served by name lookup
 * (a node's handlers) rather than a fixed list. */
void ap__mss_set_accept(ap_mss_t *m, bool (*fn)(void *arg, const char *proto), void *arg);

/* Writes one message (varint length, s, '\n') into out (cap bytes). Returns
 * its length or AP_EMSGSIZE. For callers that pipeline a proposal. */
int ap__mss_put_line(uint8_t *out, size_t cap, const char *s, size_t len);

#endif
