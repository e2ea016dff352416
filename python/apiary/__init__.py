"""apiary: decentralized deep learning over libapiary, with hivemind's API.

    import apiary as hivemind        # or: from apiary import DHT, Optimizer
    dht = apiary.DHT(initial_peers=[...], start=True)

See docs/python.md for what is covered and every difference from hivemind.
"""
from .dht import DHT, PeerID, ValueWithExpiration, get_dht_time
from ._lib import ApiaryError

__all__ = ["DHT", "PeerID", "ValueWithExpiration", "get_dht_time", "ApiaryError"]
__version__ = "0.1.0"
