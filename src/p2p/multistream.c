/* multistream-select 1.0 (see multistream.h). */
#include "p2p/multistream.h"
#include "apiary/error.h"
#include "base/varint.h"

#include <string.h>

#define HEADER_LEN (sizeof AP_MSS_HEADER - 1)

/* A line's text: not empty, no '\n' or NUL inside. */
static bool clean(const char *s, size_t n)
{
    return n > 0 && memchr(s, '\n', n) == NULL && memchr(s, 0, n) == NULL;
}

static bool valid_id(const char *s, size_t n)
{
    return n <= AP_MSS_PROTO_MAX && clean(s, n);
}

int ap__mss_put_line(uint8_t *out, size_t cap, const char *s, size_t len)
{
    uint8_t v[AP_UVARINT_MAX];
    size_t k = ap__uvarint_put(v, len + 1);
    if (k + len + 1 > cap) return AP_EMSGSIZE;
    memcpy(out, v, k);
    memcpy(out + k, s, len);
    out[k + len] = '\n';
    return (int)(k + len + 1);
}

/* Queues one line; AP_EAGAIN when the output has no room (the caller sends
 * what is queued first). */
static int queue_line(ap_mss_t *m, const char *s, size_t len)
{
    int n = ap__mss_put_line(m->out + m->out_len, sizeof m->out - m->out_len, s, len);
    if (n < 0) return AP_EAGAIN;
    m->out_len += (size_t)n;
    return 0;
}

/* The ls answer: one message whose body is a line per protocol and a final
 * '\n'; it lists what fits in AP_MSS_LINE_MAX. */
static int queue_ls(ap_mss_t *m)
{
    uint8_t body[AP_MSS_LINE_MAX];
    size_t bl = 0;
    for (size_t i = 0; i < m->nprotos; i++) {
        size_t pl = strlen(m->protos[i]);
        if (ap__uvarint_len(pl + 1) + pl + 1 + 1 > sizeof body - bl) break;
        bl += (size_t)ap__mss_put_line(body + bl, sizeof body - bl, m->protos[i], pl);
    }
    body[bl++] = '\n';
    size_t k = ap__uvarint_len(bl);
    if (k + bl > sizeof m->out - m->out_len) return AP_EAGAIN;
    m->out_len += ap__uvarint_put(m->out + m->out_len, bl);
    memcpy(m->out + m->out_len, body, bl);
    m->out_len += bl;
    return 0;
}

static int fail(ap_mss_t *m, int err)
{
    m->state = AP_MSS_FAILED;
    m->err = err;
    return err;
}

int ap__mss_init(ap_mss_t *m, bool initiator, const char *const *protos, size_t nprotos)
{
    memset(m, 0, sizeof *m);
    if ((nprotos && !protos) || nprotos > AP_MSS_PROTOS_MAX || (initiator && nprotos == 0))
        return AP_EINVAL;
    for (size_t i = 0; i < nprotos; i++)
        if (!protos[i] || !valid_id(protos[i], strlen(protos[i]))) return AP_EINVAL;
    m->initiator = initiator;
    m->protos = protos;
    m->nprotos = nprotos;
    m->selected = -1;
    /* the output is empty: the header and one proposal always fit */
    (void)queue_line(m, AP_MSS_HEADER, HEADER_LEN);
    if (initiator) (void)queue_line(m, protos[0], strlen(protos[0]));
    return 0;
}

static bool line_is(const uint8_t *s, size_t n, const char *want)
{
    return n == strlen(want) && memcmp(s, want, n) == 0;
}

/* Acts on one complete line s[0..n) (without its '\n'). AP_EAGAIN: no room
 * for the answer, try again after the output is sent. */
static int handle(ap_mss_t *m, const uint8_t *s, size_t n)
{
    if (!m->got_header) {
        if (!line_is(s, n, AP_MSS_HEADER)) return AP_EPROTO;
        m->got_header = true;
        return 0;
    }
    if (m->initiator) {
        if (line_is(s, n, m->protos[m->next])) {
            m->selected = (int)m->next;
            m->state = AP_MSS_DONE;
            return 0;
        }
        if (!line_is(s, n, "na")) return AP_EPROTO;
        if (m->next + 1 == m->nprotos) return AP_ENOPROTO;
        const char *p = m->protos[m->next + 1];
        int rc = queue_line(m, p, strlen(p));
        if (rc == 0) m->next++;
        return rc;
    }
    if (line_is(s, n, "ls")) return queue_ls(m);
    for (size_t i = 0; i < m->nprotos; i++) {
        if (!line_is(s, n, m->protos[i])) continue;
        int rc = queue_line(m, m->protos[i], n);
        if (rc != 0) return rc;
        m->selected = (int)i;
        m->state = AP_MSS_DONE;
        return 0;
    }
    if (m->accept && n <= AP_MSS_PROTO_MAX) {
        memcpy(m->dyn, s, n);
        m->dyn[n] = 0;
        if (m->accept(m->accept_arg, m->dyn)) {
            int rc = queue_line(m, m->dyn, n);
            if (rc != 0) return rc;
            m->selected = -1;
            m->state = AP_MSS_DONE;
            return 0;
        }
    }
    if (m->tries >= AP_MSS_TRIES_MAX) return AP_ENOPROTO;
    int rc = queue_line(m, "na", 2);
    if (rc == 0) m->tries++;
    return rc;
}

/* If m->in holds one whole message, its body: returns 1 and sets *body and
 * *n (the '\n' included); 0 if more bytes are needed; < 0 on a bad prefix. */
static int complete(const ap_mss_t *m, const uint8_t **body, size_t *n, size_t *need)
{
    uint64_t len;
    int k = ap__mf_uvarint_get(m->in, m->in_len, &len);
    if (k == AP_EAGAIN) {
        *need = 1;
        return 0;
    }
    if (k < 0) return AP_EPROTO;
    if (len > AP_MSS_LINE_MAX) return AP_EMSGSIZE;
    if (len == 0) return AP_EPROTO;
    if (m->in_len < (size_t)k + len) {
        *need = (size_t)k + (size_t)len - m->in_len;
        return 0;
    }
    *body = m->in + k;
    *n = (size_t)len;
    return 1;
}

int ap__mss_feed(ap_mss_t *m, const uint8_t *in, size_t len, size_t *used)
{
    size_t off = 0;
    *used = 0;
    if (m->state == AP_MSS_FAILED) return m->err;
    while (m->state == AP_MSS_RUNNING) {
        const uint8_t *body;
        size_t n, need = 0;
        int c = m->in_len ? complete(m, &body, &n, &need) : 0;
        if (c < 0) return fail(m, c);
        if (c == 1) {
            if (body[n - 1] != '\n' || !clean((const char *)body, n - 1)) {
                *used = off;
                return fail(m, AP_EPROTO);
            }
            int rc = handle(m, body, n - 1);
            if (rc == AP_EAGAIN) break; /* output full: kept, retried on the next feed */
            if (rc < 0) {
                *used = off;
                return fail(m, rc);
            }
            m->in_len = 0;
            continue;
        }
        if (off == len) break;
        if (m->in_len == 0) need = 1;
        size_t take = len - off < need ? len - off : need;
        memcpy(m->in + m->in_len, in + off, take);
        m->in_len += take;
        off += take;
    }
    *used = off;
    return 0;
}

const uint8_t *ap__mss_output(const ap_mss_t *m, size_t *len)
{
    *len = m->out_len;
    return m->out;
}

void ap__mss_output_done(ap_mss_t *m)
{
    m->out_len = 0;
}

const char *ap__mss_selected(const ap_mss_t *m)
{
    if (m->state != AP_MSS_DONE) return NULL;
    return m->selected < 0 ? m->dyn : m->protos[m->selected];
}

void ap__mss_set_accept(ap_mss_t *m, bool (*fn)(void *arg, const char *proto), void *arg)
{
    m->accept = fn;
    m->accept_arg = arg;
}
