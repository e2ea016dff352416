"""Compression classes named as hivemind.compression's, mapped to libapiary's codecs
(apiary/averager.h, ap_avg_codec_t; docs/compression.md)."""


class CompressionBase:
    """A codec of the averaging rounds. codec is the ap_avg_codec_t number."""

    codec = None

    def __repr__(self):
        return "%s()" % type(self).__name__

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


class NoCompression(CompressionBase):
    """float32, exact (AP_AVG_CODEC_F32)."""
    codec = 0


class Float16Compression(CompressionBase):
    """IEEE half (AP_AVG_CODEC_FP16)."""
    codec = 1


class ScaledFloat16Compression(Float16Compression):
    """hivemind scales by the std before fp16; Apiary's fp16 codec saturates instead
    (AP_AVG_CODEC_FP16)."""
    codec = 1


class BFloat16Compression(CompressionBase):
    """bfloat16 (AP_AVG_CODEC_BF16; not in hivemind)."""
    codec = 2


class Uniform8BitQuantization(CompressionBase):
    """8-bit uniform bins over mean ± 6 std (AP_AVG_CODEC_UNIFORM8)."""
    codec = 4


class BlockwiseQuantization(CompressionBase):
    """8-bit blockwise dynamic codebook (AP_AVG_CODEC_BLOCKWISE8)."""
    codec = 6


def codec_of(compression, what):
    if compression is None:
        return 0
    if isinstance(compression, type) and issubclass(compression, CompressionBase):
        compression = compression()
    if not isinstance(compression, CompressionBase):
        raise TypeError("%s must be an apiary compression (NoCompression(), Float16Compression(), "
                        "Uniform8BitQuantization(), BlockwiseQuantization(), ...), not %r"
                        % (what, compression))
    return compression.codec
