/* Chunk headers: version 1 (24 bytes, fixed fields), version 2 (compact:
 * varints, implied payload length, defaults omitted, optional rand-k seed)
 * and bare chunks (no header: every field implied by the protocol).
 * Both are specified byte for byte in docs/compression.md. */
#include "compress/wire.h"
#include "base/varint.h"

#include <string.h>

/* ---- sizes ----------------------------------------------------------------------- */

bool ap__cw_payload_size(ap_codec_id_t id, uint64_t count, uint64_t param, bool seed, uint64_t *out)
{
    if (count > AP_COMPRESS_MAX_COUNT) return false;
    if (seed && id != AP_CODEC_RANDK) return false;
    switch (id) {
    case AP_CODEC_NONE:
        *out = 4 * count;
        return param == 0;
    case AP_CODEC_FP16:
    case AP_CODEC_BF16:
        *out = 2 * count;
        return param == 0;
    case AP_CODEC_MEANSTD16:
        *out = 8 + 2 * count;
        return param == 0;
    case AP_CODEC_UNIFORM8:
    case AP_CODEC_QUANTILE8:
        *out = 1024 + count;
        return param == 0;
    case AP_CODEC_BLOCKWISE8:
        if (param < 1 || param > (1u << 20)) return false;
        *out = 4 * ((count + param - 1) / param) + count;
        return true;
    case AP_CODEC_TOPK:
        if (param > count) return false;
        *out = 8 * param;
        return true;
    case AP_CODEC_RANDK:
        if (param > count) return false;
        *out = (seed ? 8 : 0) + 4 * param;
        return true;
    default:
        return false;
    }
}

bool ap__cw_flags_ok(unsigned flags)
{
    if (flags & ~(AP_COMPRESS_COMPACT | AP_COMPRESS_NO_SEED | AP_COMPRESS_BARE)) return false;
    if ((flags & AP_COMPRESS_COMPACT) && (flags & AP_COMPRESS_BARE)) return false;
    return !(flags & AP_COMPRESS_NO_SEED) || (flags & (AP_COMPRESS_COMPACT | AP_COMPRESS_BARE));
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* Reads a canonical (shortest) varint of at most max_bytes from p[*at..len). */
static bool varint_get(const uint8_t *p, size_t len, size_t *at, unsigned max_bytes, uint64_t *out)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < max_bytes; i++) {
        if (*at >= len) return false;
        uint8_t b = p[(*at)++];
        if (i == 9 && b > 1) return false; /* beyond 64 bits */
        v |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            if (i > 0 && b == 0) return false; /* overlong */
            *out = v;
            return true;
        }
    }
    return false;
}

static bool sparse(ap_codec_id_t id)
{
    return id == AP_CODEC_TOPK || id == AP_CODEC_RANDK;
}

/* The version 2 fields a chunk carries. */
static unsigned v2_bits(ap_codec_id_t id, uint64_t offset, uint32_t param, unsigned flags)
{
    unsigned b = (unsigned)id;
    if (offset) b |= AP__CW_OFFSET;
    if (id == AP_CODEC_BLOCKWISE8 && param != AP_COMPRESS_BLOCK) b |= AP__CW_BLOCK;
    if (id == AP_CODEC_RANDK && !(flags & AP_COMPRESS_NO_SEED)) b |= AP__CW_SEED;
    return b;
}

size_t ap__cw_hdr_size(ap_codec_id_t id, uint32_t count, uint64_t offset, uint32_t param,
                       unsigned flags)
{
    if (flags & AP_COMPRESS_BARE) return 0;
    if (!(flags & AP_COMPRESS_COMPACT)) return AP_COMPRESS_HDR_LEN;
    unsigned b = v2_bits(id, offset, param, flags);
    size_t n = 2 + varint_len(count);
    if (b & AP__CW_OFFSET) n += varint_len(offset);
    if (sparse(id) || (b & AP__CW_BLOCK)) n += varint_len(param);
    return n;
}

size_t ap__cw_hdr_write(uint8_t *out, ap_codec_id_t id, uint32_t count, uint64_t offset,
                        uint32_t payload_len, uint32_t param, unsigned flags)
{
    if (flags & AP_COMPRESS_BARE) return 0;
    if (!(flags & AP_COMPRESS_COMPACT)) {
        out[0] = AP_COMPRESS_MAGIC;
        out[1] = AP_COMPRESS_VERSION;
        out[2] = (uint8_t)id;
        out[3] = 0;
        memcpy(out + 4, &count, 4);
        memcpy(out + 8, &offset, 8);
        memcpy(out + 16, &payload_len, 4);
        memcpy(out + 20, &param, 4);
        return AP_COMPRESS_HDR_LEN;
    }
    unsigned b = v2_bits(id, offset, param, flags);
    size_t n = 0;
    out[n++] = AP_COMPRESS_V2_TAG;
    out[n++] = (uint8_t)b;
    n += ap__uvarint_put(out + n, count);
    if (b & AP__CW_OFFSET) n += ap__uvarint_put(out + n, offset);
    if (sparse(id) || (b & AP__CW_BLOCK)) n += ap__uvarint_put(out + n, param);
    return n;
}

/* ---- parsing ----------------------------------------------------------------------- */

static int parse_v1(const uint8_t *in, size_t len, ap_compress_hdr_t *h)
{
    if (len < AP_COMPRESS_HDR_LEN) return AP_ECORRUPT;
    if (in[1] != AP_COMPRESS_VERSION) return AP_EVERSION;
    if (in[2] >= AP_CODEC__COUNT) return AP_ENOTSUP;
    if (in[3] != 0) return AP_ECORRUPT;
    h->codec = (ap_codec_id_t)in[2];
    memcpy(&h->count, in + 4, 4);
    memcpy(&h->offset, in + 8, 8);
    memcpy(&h->payload_len, in + 16, 4);
    memcpy(&h->param, in + 20, 4);
    h->version = 1;
    h->hdr_len = AP_COMPRESS_HDR_LEN;
    h->has_seed = h->codec == AP_CODEC_RANDK;
    uint64_t want;
    if (!ap__cw_payload_size(h->codec, h->count, h->param, h->has_seed, &want)) return AP_ECORRUPT;
    if (want != h->payload_len || len - AP_COMPRESS_HDR_LEN != want) return AP_ECORRUPT;
    return 0;
}

static int parse_v2(const uint8_t *in, size_t len, ap_compress_hdr_t *h)
{
    if (len < 3) return AP_ECORRUPT;
    unsigned b = in[1];
    if (b & 0x80) return AP_ECORRUPT; /* reserved */
    if ((b & 0x0f) >= AP_CODEC__COUNT) return AP_ENOTSUP;
    ap_codec_id_t id = (ap_codec_id_t)(b & 0x0f);
    if ((b & AP__CW_BLOCK) && id != AP_CODEC_BLOCKWISE8) return AP_ECORRUPT;
    if ((b & AP__CW_SEED) && id != AP_CODEC_RANDK) return AP_ECORRUPT;
    size_t at = 2;
    uint64_t count, offset = 0, param = 0;
    if (!varint_get(in, len, &at, 5, &count) || count > AP_COMPRESS_MAX_COUNT) return AP_ECORRUPT;
    if (b & AP__CW_OFFSET) {
        if (!varint_get(in, len, &at, 10, &offset) || offset == 0) return AP_ECORRUPT;
    }
    if (sparse(id) || (b & AP__CW_BLOCK)) {
        if (!varint_get(in, len, &at, 5, &param) || param > UINT32_MAX) return AP_ECORRUPT;
        if ((b & AP__CW_BLOCK) && param == AP_COMPRESS_BLOCK) return AP_ECORRUPT; /* default */
    } else if (id == AP_CODEC_BLOCKWISE8)
        param = AP_COMPRESS_BLOCK;
    bool seed = (b & AP__CW_SEED) != 0;
    uint64_t want;
    if (!ap__cw_payload_size(id, count, param, seed, &want)) return AP_ECORRUPT;
    if (len - at != want) return AP_ECORRUPT;
    *h = (ap_compress_hdr_t){.codec = id,
                             .count = (uint32_t)count,
                             .offset = offset,
                             .payload_len = (uint32_t)want,
                             .param = (uint32_t)param,
                             .version = 2,
                             .hdr_len = (uint8_t)at,
                             .has_seed = seed};
    return 0;
}

int ap_compress_parse(const uint8_t *in, size_t len, ap_compress_hdr_t *hdr)
{
    if (!in || len < 1) return AP_ECORRUPT;
    ap_compress_hdr_t h;
    int rc;
    if (in[0] == AP_COMPRESS_MAGIC)
        rc = parse_v1(in, len, &h);
    else if (in[0] == AP_COMPRESS_V2_TAG)
        rc = parse_v2(in, len, &h);
    else if (in[0] > AP_COMPRESS_V2_TAG && in[0] <= 0xAF)
        return AP_EVERSION; /* tags of later compact versions */
    else
        return AP_ECORRUPT;
    if (rc) return rc;
    if (h.offset > UINT64_MAX - h.count) return AP_ECORRUPT;
    if (hdr) *hdr = h;
    return 0;
}

/* ---- re-framing ---------------------------------------------------------------------- */

int ap_compress_reframe(const uint8_t *in, size_t len, bool seed_known, uint64_t seed,
                        unsigned flags, uint8_t *out, size_t cap, size_t *out_len)
{
    if (!out || !ap__cw_flags_ok(flags)) return AP_EINVAL;
    ap_compress_hdr_t h;
    int rc = ap_compress_parse(in, len, &h);
    if (rc) return rc;
    const uint8_t *p = in + h.hdr_len;
    size_t body = h.payload_len;
    bool want_seed = h.codec == AP_CODEC_RANDK && !(flags & AP_COMPRESS_NO_SEED);
    uint8_t sb[8];
    bool add_seed = false;
    if (h.codec == AP_CODEC_RANDK) {
        if (h.has_seed) { /* the values follow the seed */
            memcpy(sb, p, 8);
            p += 8;
            body -= 8;
        } else if (want_seed) {
            if (!seed_known) return AP_EPROTO;
            uint64_t cs = ap__cw_chunk_seed(seed, h.offset);
            memcpy(sb, &cs, 8);
        }
        add_seed = want_seed;
    }
    size_t pl = body + (add_seed ? 8 : 0);
    size_t hl = ap__cw_hdr_size(h.codec, h.count, h.offset, h.param, flags);
    if (cap < hl + pl) return AP_EMSGSIZE;
    /* in and out may not overlap: the payload is copied after the header */
    ap__cw_hdr_write(out, h.codec, h.count, h.offset, (uint32_t)pl, h.param, flags);
    if (add_seed) memcpy(out + hl, sb, 8);
    memcpy(out + hl + (add_seed ? 8 : 0), p, body);
    if (out_len) *out_len = hl + pl;
    return 0;
}
