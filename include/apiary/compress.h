/* Apiary — tensor compression on the wire.
 *
 * Codecs turn a float32 buffer (one chunk of a tensor) into a self-describing
 * byte string: a wire header (codec id, element count, offset of the chunk in
 * its tensor, codec parameter) followed by the codec's payload. Two header
 * versions, both always decoded: version 1 (24 bytes, fixed fields) and the
 * compact version 2 (3..22 bytes: varints, the payload length implied by the
 * codec, the offset and the block size only when not the default, the
 * rand-k seed optional because a receiver can often derive it). A protocol
 * whose receiver knows every header field may send bare chunks (the
 * payload alone, AP_COMPRESS_BARE, ap_compress_decode_bare). The wire
 * format is specified byte for byte in docs/compression.md.
 *
 * OWNERSHIP. Every function reads the caller's input and writes into the
 * caller's output buffer; nothing is retained after the call returns. No
 * function allocates except ap_compress_ef_new / ap_compress_policy_*.
 *
 * THREADS. All functions are reentrant: any thread may call them at any time
 * on distinct output buffers. ap_compress_encode_tensor / _decode_tensor use
 * the process worker pool (src/base/pool.h) and must not be called from a
 * pool task. An ap_compress_ef_t must be used by one thread at a time.
 *
 * UNTRUSTED INPUT. Decoders treat the input as untrusted: the header is
 * checked (magic, version, known codec, count <= AP_COMPRESS_MAX_COUNT,
 * payload_len == exact size for count and param, chunk inside the
 * destination), payload values are checked where the format requires it
 * (finite scales and codebooks, sparse indices in range and strictly
 * increasing). Any violation returns AP_ECORRUPT (or AP_EVERSION / AP_ENOTSUP
 * / AP_ERANGE as stated) and writes nothing to dst.
 *
 * ERROR BOUNDS (x = input, y = decoded; per element unless stated):
 *   NONE       y == x bit for bit (NaN and Inf travel unchanged).
 *   FP16       round-to-nearest-even to IEEE half. Finite |x| > 65504 and
 *              +-Inf are clamped to +-65504; NaN stays NaN. For
 *              |x| >= 2^-14: |y-x| <= 2^-11 |x|; below: |y-x| <= 2^-25.
 *   BF16       round-to-nearest-even to bfloat16: |y-x| <= 2^-8 |x| (2^-134
 *              below 2^-126, where bfloat16 is subnormal); Inf and
 *              NaN preserved; finite values that would round to Inf are
 *              clamped to the largest finite bfloat16.
 *   MEANSTD16  z = (x-mean)/std sent as FP16: |y-x| <= 2^-11 |x-mean| +
 *              2^-25 std + 2^-22 (|x|+|mean|) (rounding of the float ops).
 *              A chunk whose std is below ~2^-126 (1/std overflows) is sent
 *              as its mean alone (std field 0): |y-x| = |x-mean|.
 *   UNIFORM8   256 uniform bins over [mean-6 std, mean+6 std], each decoded
 *              to the mean of a sample of its members (clamped to the bin):
 *              |y-x| <= w + dist(x, range), w = 12 std / 256. If 1/w
 *              overflows (std below ~2^-122), every element goes to bin 0,
 *              decoded as the sample mean: |y-x| <= max - min.
 *   QUANTILE8  boundaries at the 255 inner quantiles of a strided sample
 *              (<= 4096 elements), snapped to a 4096-cell grid over the
 *              inner range; each bin decodes to the sample mean of its
 *              members (clamped to the bin); the outer bins reach the
 *              chunk's min and max: |y-x| <= width of x's bin.
 *   BLOCKWISE8 blocks of 4096 elements; per-block absmax a; code = sign +
 *              7-bit index of the nearest magnitude in the dynamic codebook
 *              m_j = (j/127)^2: |y-x| <= 0.00785 a + 2^-22 |x|.
 *   TOPK       keeps the k largest |x| (ties: lower index first), zero
 *              elsewhere: ||y-x||^2 <= (1-k/n) ||x||^2. Biased.
 *   RANDK      keeps k elements chosen from a seed (only the seed travels,
 *              not the indices), scaled by n/k: E[y] = x and
 *              E||y||^2 = (n/k)||x||^2. Unbiased.
 *   The lossy codecs MEANSTD16, UNIFORM8, QUANTILE8, BLOCKWISE8 and TOPK
 *   refuse input containing NaN or Inf with AP_ENONFINITE (a non-finite
 *   gradient is a bug to report, not a value to smear over a codebook);
 *   RANDK refuses a non-finite *selected* value. */
#ifndef APIARY_COMPRESS_H
#define APIARY_COMPRESS_H

#include "apiary/common.h"
#include "apiary/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Codec ids as they travel on the wire: never renumber. */
typedef enum ap_codec_id {
    AP_CODEC_NONE = 0,
    AP_CODEC_FP16 = 1,
    AP_CODEC_BF16 = 2,
    AP_CODEC_MEANSTD16 = 3,
    AP_CODEC_UNIFORM8 = 4,
    AP_CODEC_QUANTILE8 = 5,
    AP_CODEC_BLOCKWISE8 = 6,
    AP_CODEC_TOPK = 7,
    AP_CODEC_RANDK = 8,
    AP_CODEC__COUNT = 9
} ap_codec_id_t;

#define AP_COMPRESS_MAGIC      0xA5 /* first byte of a version 1 chunk */
#define AP_COMPRESS_VERSION    1
#define AP_COMPRESS_HDR_LEN    24   /* version 1 header */
#define AP_COMPRESS_V2_TAG     0xA6 /* first byte of a version 2 (compact) chunk */
#define AP_COMPRESS_V2_HDR_MAX 22   /* longest version 2 header */

/* Encoder flags (the *_ex functions). 0 = version 1, as ap_compress_encode. */
#define AP_COMPRESS_COMPACT 1u /* version 2 header */
#define AP_COMPRESS_NO_SEED                                                                        \
    2u /* with COMPACT, RANDK only: leave the seed out; the receiver                               \
          derives cfg->seed itself and passes it to                                                \
          ap_compress_decode_seeded */
#define AP_COMPRESS_BARE                                                                           \
    4u /* no header at all: the payload alone (with NO_SEED: randk without                         \
          its seed), for a protocol whose receiver knows every header field                        \
          (codec, k, count, offset); decode with ap_compress_decode_bare.                          \
          Not with COMPACT */
#define AP_COMPRESS_MAX_COUNT     (1u << 28) /* elements per chunk */
#define AP_COMPRESS_CHUNK_DEFAULT (1u << 20) /* elements per chunk for tensors */
#define AP_COMPRESS_BLOCK         4096       /* BLOCKWISE8 block size */
#define AP_COMPRESS_Q8_SAMPLE     4096       /* QUANTILE8 sample size */

/* What to encode with. k / fraction only matter for TOPK and RANDK: k > 0 is
 * the count per chunk (clamped to the chunk's count); else fraction in (0,1]
 * of the chunk, rounded, at least 1. seed only matters for RANDK: the
 * indices of chunk at element offset o are derived from (seed, o, count, k),
 * so give each message a fresh seed (both sides may derive it from a shared
 * round number). */
typedef struct ap_codec_cfg {
    ap_codec_id_t id;
    uint32_t k;
    double fraction;
    uint64_t seed;
} ap_codec_cfg_t;

/* A parsed, validated wire header. */
typedef struct ap_compress_hdr {
    ap_codec_id_t codec;
    uint32_t count;       /* elements in this chunk */
    uint64_t offset;      /* element offset of the chunk in its tensor */
    uint32_t payload_len; /* bytes after the header */
    uint32_t param;       /* k (TOPK, RANDK), block size (BLOCKWISE8), else 0 */
    uint8_t version;      /* 1 or 2 */
    uint8_t hdr_len;      /* header bytes (24 for version 1) */
    bool has_seed;        /* RANDK: the seed travels in the payload (always in version 1) */
} ap_compress_hdr_t;

/* "fp16", "topk", ...; NULL for an unknown id. Static string. */
AP_EXPORT const char *ap_codec_name(ap_codec_id_t id);
/* Parses a codec name. AP_EINVAL if unknown. */
AP_EXPORT int ap_codec_parse(const char *name, ap_codec_id_t *out);
/* Whether the codec is biased (needs error feedback to converge): TOPK and the
 * quantizers are; NONE and RANDK are not. */
AP_EXPORT bool ap_codec_is_biased(ap_codec_id_t id);

/* The k a TOPK/RANDK chunk of count elements will use under cfg (0 for other
 * codecs). */
AP_EXPORT uint32_t ap_compress_k(const ap_codec_cfg_t *cfg, size_t count);

/* Exact encoded size (header included) of a chunk of count elements under
 * cfg; 0 if cfg is invalid or count > AP_COMPRESS_MAX_COUNT. Use it to size
 * the output buffer. */
AP_EXPORT size_t ap_compress_size(const ap_codec_cfg_t *cfg, size_t count);

/* Encodes src[0..count) as the chunk at element offset `offset` of its tensor
 * into out[0..cap). *out_len receives the bytes written (== ap_compress_size).
 * AP_EMSGSIZE if cap is too small, AP_EINVAL for a bad cfg or count,
 * AP_ENONFINITE as documented above. Single-threaded. */
AP_EXPORT int ap_compress_encode(const ap_codec_cfg_t *cfg, const float *src, size_t count,
                                 uint64_t offset, uint8_t *out, size_t cap, size_t *out_len);

/* Exact encoded size of the chunk at element offset `offset` under cfg with
 * encoder flags (AP_COMPRESS_COMPACT, AP_COMPRESS_NO_SEED); a version 2 header
 * depends on the offset. 0 as ap_compress_size, or for unknown flags. */
AP_EXPORT size_t ap_compress_size_ex(const ap_codec_cfg_t *cfg, size_t count, uint64_t offset,
                                     unsigned flags);
/* ap_compress_encode with encoder flags. AP_EINVAL for unknown flags or
 * NO_SEED without COMPACT. */
AP_EXPORT int ap_compress_encode_ex(const ap_codec_cfg_t *cfg, const float *src, size_t count,
                                    uint64_t offset, unsigned flags, uint8_t *out, size_t cap,
                                    size_t *out_len);

/* Parses and validates the header of in[0..len) (either version), including
 * that len is exactly header + payload_len and payload_len is the exact size
 * for the codec, count and param. A version 2 header must be canonical
 * (shortest varints, no field that equals its default): anything else is
 * AP_ECORRUPT. An unknown version is AP_EVERSION, an unknown codec
 * AP_ENOTSUP. */
AP_EXPORT int ap_compress_parse(const uint8_t *in, size_t len, ap_compress_hdr_t *hdr);

/* Decodes one chunk into dst[offset .. offset+count) of a tensor of dst_count
 * elements (AP_ERANGE if it does not fit). Sparse codecs write zeros to the
 * unsent elements of the chunk. hdr (may be NULL) receives the header. A
 * RANDK chunk without its seed (AP_COMPRESS_NO_SEED) is AP_EPROTO here: use
 * ap_compress_decode_seeded. */
AP_EXPORT AP_NODISCARD int ap_compress_decode(const uint8_t *in, size_t len, float *dst,
                                              size_t dst_count, ap_compress_hdr_t *hdr);
/* Same, but adds alpha * decoded to dst instead of overwriting (sparse codecs
 * touch only the sent elements). For aggregating peers' contributions. */
AP_EXPORT AP_NODISCARD int ap_compress_decode_add(const uint8_t *in, size_t len, float alpha,
                                                  float *dst, size_t dst_count,
                                                  ap_compress_hdr_t *hdr);
/* The same for a receiver that derives the rand-k seed: seed is the cfg->seed
 * the sender encoded with (the chunk seed then follows from it and the
 * chunk's offset, as for a chunk that carries it). A chunk that carries its
 * seed decodes from its own seed; other codecs ignore seed. */
AP_EXPORT AP_NODISCARD int ap_compress_decode_seeded(const uint8_t *in, size_t len, uint64_t seed,
                                                     float *dst, size_t dst_count,
                                                     ap_compress_hdr_t *hdr);
AP_EXPORT AP_NODISCARD int ap_compress_decode_add_seeded(const uint8_t *in, size_t len,
                                                         uint64_t seed, float alpha, float *dst,
                                                         size_t dst_count, ap_compress_hdr_t *hdr);

/* Decodes a bare chunk (AP_COMPRESS_BARE): nothing in it says what it is,
 * so the receiver states what the sender encoded — cfg (codec, k or
 * fraction, and for a seedless randk chunk the sender's cfg->seed), count,
 * offset and the encoder flags — and in[0..len) must be exactly the payload
 * those imply (else AP_ECORRUPT). AP_EINVAL for a bad cfg, count or flags
 * without BARE; then as ap_compress_decode (range, payload checks). The
 * _add variant adds alpha * decoded. */
AP_EXPORT AP_NODISCARD int ap_compress_decode_bare(const ap_codec_cfg_t *cfg, size_t count,
                                                   uint64_t offset, unsigned flags,
                                                   const uint8_t *in, size_t len, float *dst,
                                                   size_t dst_count);
AP_EXPORT AP_NODISCARD int ap_compress_decode_add_bare(const ap_codec_cfg_t *cfg, size_t count,
                                                       uint64_t offset, unsigned flags,
                                                       const uint8_t *in, size_t len, float alpha,
                                                       float *dst, size_t dst_count);

/* Re-frames a valid chunk under other encoder flags without re-encoding its
 * values (the payload is the same bytes; a RANDK seed is added or dropped):
 * e.g. a version 2 chunk for a version 1 peer. seed is the cfg->seed of the
 * sender, needed only when in has no seed and the output wants one. Errors
 * as ap_compress_parse, AP_EPROTO for a seedless chunk that needs its seed
 * and got none (seed_known false), AP_EMSGSIZE if cap is too small. in and
 * out must not overlap. */
AP_EXPORT int ap_compress_reframe(const uint8_t *in, size_t len, bool seed_known, uint64_t seed,
                                  unsigned flags, uint8_t *out, size_t cap, size_t *out_len);

/* ---- whole tensors, chunked and multi-threaded ---------------------------
 * A tensor of n elements is cut into ceil(n / chunk) chunks (chunk 0 =
 * AP_COMPRESS_CHUNK_DEFAULT); chunk i covers [i*chunk, min(n,(i+1)*chunk)) and
 * is an independent wire message, so a sender can stream chunks as they are
 * ready and a receiver can decode them in any order. */

AP_EXPORT size_t ap_compress_nchunks(size_t n, size_t chunk);
/* Encodes every chunk in parallel on the worker pool. Chunk i is written at
 * out + i * ap_compress_size(cfg, chunk) and its length stored in lens[i]
 * (lens has ap_compress_nchunks entries). cap is the size of out. For RANDK
 * the chunk seeds derive from cfg->seed and the chunk offset. Returns the
 * first error of any chunk. */
AP_EXPORT int ap_compress_encode_tensor(const ap_codec_cfg_t *cfg, const float *src, size_t n,
                                        size_t chunk, uint8_t *out, size_t cap, size_t *lens);
/* Decodes nchunks messages (msgs[i], lens[i]) into dst[0..n) in parallel.
 * Returns the first error; dst is then partially written. */
AP_EXPORT AP_NODISCARD int ap_compress_decode_tensor(const uint8_t *const *msgs, const size_t *lens,
                                                     size_t nchunks, float *dst, size_t n);

/* ---- error feedback ------------------------------------------------------
 * Keeps a residual e per tensor: each encode sends C(x + e) and sets
 * e = x + e - D(C(x + e)), so what was not sent is sent later and the running
 * sum of sent (decoded) values tracks the running sum of inputs within |e|. */

typedef struct ap_compress_ef ap_compress_ef_t;
/* Residual for a tensor of n elements (zeroed). NULL if out of memory. */
AP_EXPORT ap_compress_ef_t *ap_compress_ef_new(size_t n);
AP_EXPORT void ap_compress_ef_free(ap_compress_ef_t *ef);
AP_EXPORT void ap_compress_ef_reset(ap_compress_ef_t *ef);
/* The residual (n floats), owned by ef. */
AP_EXPORT const float *ap_compress_ef_residual(const ap_compress_ef_t *ef);
/* Encodes src[0..count) (the chunk at element offset `offset`) with the
 * residual of that range added, and updates the residual. */
AP_EXPORT int ap_compress_ef_encode(ap_compress_ef_t *ef, const ap_codec_cfg_t *cfg,
                                    const float *src, size_t count, uint64_t offset, uint8_t *out,
                                    size_t cap, size_t *out_len);
/* The same with encoder flags (ap_compress_encode_ex). */
AP_EXPORT int ap_compress_ef_encode_ex(ap_compress_ef_t *ef, const ap_codec_cfg_t *cfg,
                                       const float *src, size_t count, uint64_t offset,
                                       unsigned flags, uint8_t *out, size_t cap, size_t *out_len);

/* ---- policies ------------------------------------------------------------
 * Which codec a tensor travels with: a per-tensor override by name wins;
 * else tensors smaller than small_below elements travel uncompressed (the
 * header and codebooks would cost more than they save); else the codec of
 * the tensor's role. */

typedef enum ap_tensor_role {
    AP_ROLE_GRADIENT = 0,
    AP_ROLE_PARAMETER = 1,
    AP_ROLE_OPTIMIZER_STATE = 2,
    AP_ROLE_ACTIVATION = 3,
    AP_ROLE__COUNT = 4
} ap_tensor_role_t;

typedef struct ap_compress_policy ap_compress_policy_t;
/* Defaults: gradient BLOCKWISE8 with error feedback, parameter FP16,
 * optimizer state BLOCKWISE8, activation FP16, small_below 4096. NULL on OOM. */
AP_EXPORT ap_compress_policy_t *ap_compress_policy_new(void);
AP_EXPORT void ap_compress_policy_free(ap_compress_policy_t *p);
AP_EXPORT void ap_compress_policy_set_role(ap_compress_policy_t *p, ap_tensor_role_t role,
                                           const ap_codec_cfg_t *cfg, bool error_feedback);
AP_EXPORT void ap_compress_policy_set_small(ap_compress_policy_t *p, size_t small_below);
/* Per-tensor override (name copied, at most 127 bytes). */
AP_EXPORT int ap_compress_policy_set_tensor(ap_compress_policy_t *p, const char *name,
                                            const ap_codec_cfg_t *cfg, bool error_feedback);
/* The codec for a tensor; *error_feedback (may be NULL) says whether to keep
 * a residual for it. name may be NULL. */
AP_EXPORT ap_codec_cfg_t ap_compress_policy_pick(const ap_compress_policy_t *p, const char *name,
                                                 ap_tensor_role_t role, size_t n,
                                                 bool *error_feedback);

#ifdef __cplusplus
}
#endif
#endif
