"""apiary: decentralized deep learning over libapiary, with hivemind's API.

    import apiary as hivemind        # or: from apiary import DHT, Optimizer
    dht = apiary.DHT(initial_peers=[...], start=True)

See docs/python.md for what is covered and every difference from hivemind.
"""
from .dht import DHT, PeerID, ValueWithExpiration, get_dht_time
from ._lib import ApiaryError
from .compression import (BFloat16Compression, BlockwiseQuantization, CompressionBase,
                          Float16Compression, NoCompression, ScaledFloat16Compression,
                          Uniform8BitQuantization)

try:  # torch is optional: the DHT works without it
    from .optim import Optimizer
    from .averager import AveragingStage, DecentralizedAverager, StepControl
except ImportError as _e:  # pragma: no cover
    _torch_error = _e

    class Optimizer:  # noqa: D401
        def __init__(self, *a, **k):
            raise ImportError("apiary.Optimizer needs torch (python3-torch): %s" % _torch_error)

    DecentralizedAverager = StepControl = AveragingStage = Optimizer

__all__ = ["DHT", "PeerID", "ValueWithExpiration", "get_dht_time", "ApiaryError", "Optimizer", "DecentralizedAverager",
           "StepControl", "AveragingStage",
           "CompressionBase", "NoCompression", "Float16Compression", "ScaledFloat16Compression",
           "BFloat16Compression", "Uniform8BitQuantization", "BlockwiseQuantization"]
__version__ = "0.1.0"
