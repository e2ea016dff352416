"""apiary.DHT: a Kademlia DHT node of libapiary, with hivemind.DHT's API.

The node runs on a libuv thread inside this process (hivemind runs a child
process with a Go daemon); every method blocks the calling thread only, with
the GIL released, and may be called from any thread.
"""
import ctypes
import threading
import time

from . import _lib as C

try:
    import msgpack
except ImportError:  # values are then bytes only
    msgpack = None


def get_dht_time():
    """The DHT's clock: wall-clock seconds since the Unix epoch (as hivemind.get_dht_time)."""
    return time.time()


class PeerID:
    """A peer's id (base58 text as libp2p prints it)."""

    def __init__(self, text):
        self._text = text

    def to_base58(self):
        return self._text

    def to_string(self):
        return self._text

    def __str__(self):
        return self._text

    def __repr__(self):
        return "<PeerID %s>" % self._text

    def __eq__(self, other):
        return isinstance(other, PeerID) and other._text == self._text

    def __hash__(self):
        return hash(self._text)


class ValueWithExpiration(tuple):
    """(value, expiration_time), as hivemind returns from DHT.get."""

    __slots__ = ()

    def __new__(cls, value, expiration_time):
        return tuple.__new__(cls, (value, expiration_time))

    @property
    def value(self):
        return self[0]

    @property
    def expiration_time(self):
        return self[1]

    def __repr__(self):
        return "ValueWithExpiration(value=%r, expiration_time=%r)" % (self[0], self[1])


def _key_bytes(key, what):
    if isinstance(key, bytes):
        b = key
    elif isinstance(key, str):
        b = key.encode("utf-8")
    elif isinstance(key, (int, float, tuple, list)) and not isinstance(key, bool):
        if msgpack is None:
            raise TypeError("%s: %r needs python3-msgpack (use str or bytes)" % (what, key))
        b = msgpack.packb(key, use_bin_type=True)
    else:
        raise TypeError("%s must be str, bytes, a number or a tuple, not %s" %
                        (what, type(key).__name__))
    return b


def _encode_value(value):
    if isinstance(value, (bytes, bytearray, memoryview)) and msgpack is None:
        return bytes(value)
    if msgpack is None:
        raise TypeError("storing a %s needs python3-msgpack (or store bytes)" %
                        type(value).__name__)
    try:
        return msgpack.packb(bytes(value) if isinstance(value, (bytearray, memoryview)) else value,
                             use_bin_type=True)
    except TypeError as e:
        raise TypeError("value is not msgpack-serialisable: %s" % e) from None


def _decode_value(b):
    if msgpack is None:
        return b
    try:
        return msgpack.unpackb(b, raw=False, strict_map_key=False)
    except Exception:  # not msgpack: raw bytes, e.g. from `apiary dht store`
        return b


def _decode_subkey(b):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return b


def _str_list(v, what):
    if v is None:
        return []
    if isinstance(v, (str, bytes)):
        v = [v]
    try:
        out = [str(x) if not isinstance(x, bytes) else x.decode() for x in v]
    except TypeError:
        raise TypeError("%s must be a list of multiaddr strings, not %s" %
                        (what, type(v).__name__)) from None
    for x in out:
        if not x.startswith("/"):
            raise ValueError("%s: %r is not a multiaddr (e.g. /ip4/127.0.0.1/tcp/4001/p2p/12D3...)"
                             % (what, x))
    return out


class DHT:
    """A DHT node. Arguments as hivemind.DHT's (see docs/python.md for the differences)."""

    def __init__(self, initial_peers=None, *, start=True, host_maddrs=None, announce_maddrs=None,
                 client_mode=False, identity_path=None, num_replicas=None, await_ready=True,
                 **kwargs):
        for k in kwargs:
            if k not in ("num_workers", "daemon", "use_ipfs", "use_relay", "use_auto_relay",
                         "startup_timeout", "ensure_bootstrap_success", "record_validators",
                         "shutdown_timeout", "parallel_rpc", "max_workers"):
                raise TypeError("DHT() got an unexpected keyword argument %r" % k)
        self._initial_peers = _str_list(initial_peers, "initial_peers")
        self._host_maddrs = _str_list(host_maddrs, "host_maddrs")
        self._announce = _str_list(announce_maddrs, "announce_maddrs")
        if len(self._announce) > C.AP_NODE_MAX_ANNOUNCE:
            raise ValueError("announce_maddrs: at most %d addresses" % C.AP_NODE_MAX_ANNOUNCE)
        if not isinstance(client_mode, bool):
            raise TypeError("client_mode must be a bool")
        if identity_path is not None and not isinstance(identity_path, str):
            raise TypeError("identity_path must be a str path")
        if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
            raise ValueError("num_replicas must be a positive int")
        self.client_mode = client_mode
        self._identity_path = identity_path
        self._num_replicas = num_replicas
        self._host = None
        self._rt = None
        self._dht = None
        self._lock = threading.RLock()
        self._closed = False
        self._peer_id = None
        self._max_ttl_s = 86400
        self._dependents = []  # Optimizers / averagers on this node: shut down first
        self._svc = None  # the node's averaging service and matchmaker, made on first use
        self._mm = None
        if start:
            self.run_in_background(await_ready=await_ready)

    # ---- life cycle -------------------------------------------------------------------
    def run_in_background(self, await_ready=True, timeout=None):
        """Starts the node (DHT(start=False) defers this); joins through initial_peers."""
        with self._lock:
            if self._closed:
                raise RuntimeError("DHT is shut down")
            if self._dht:
                return
            self._start()

    def _start(self):
        L = C.lib()
        sk = None
        if self._identity_path:
            ident = C.IdentityC()
            created = C.c_bool(False)
            rc = L.ap_identity_load_or_create(ctypes.byref(ident), self._identity_path.encode(),
                                              ctypes.byref(created))
            if rc:
                msg = (L.ap_identity_last_error() or b"").decode() or C.err_text(rc)
                raise ValueError("identity_path %s: %s" % (self._identity_path, msg))
            sk = (C.c_u8 * 64)(*ident.sk)
            L.ap_identity_wipe(ctypes.byref(ident))
        host = L.ap_host_new()
        if not host:
            raise MemoryError("apiary: cannot create the host")
        rc = L.ap_host_start(host)
        if rc:
            L.ap_host_free(host)
            C.check(rc, "starting the host")
        opts = C.NodeOpts()
        if sk is not None:
            opts.ed25519_sk = ctypes.cast(sk, C.P(C.c_u8))
        if self.client_mode and not self._host_maddrs:
            opts.dial_only = True
        else:
            listen = self._host_maddrs[0] if self._host_maddrs else "/ip4/0.0.0.0/tcp/0"
            opts.listen = listen.encode()
        ann = (C.c_char_p * max(1, len(self._announce)))(*[a.encode() for a in self._announce])
        if self._announce:
            opts.announce = ann
            opts.nannounce = len(self._announce)
        rt = C.c_void_p()
        rc = L.ap_node_new(host, ctypes.byref(opts), ctypes.byref(rt))
        if sk is not None:
            ctypes.memset(sk, 0, 64)
        if rc:
            L.ap_host_free(host)
            if C.err_name(rc) in ("EADDR", "EINVAL"):
                raise ValueError("host_maddrs/announce_maddrs: %s" % C.err_text(rc))
            C.check(rc, "starting the node on %s" % (opts.listen or b"(dial only)").decode())
        cfg = C.DhtConfig()
        L.ap_dht_config_default(ctypes.byref(cfg))
        cfg.client_mode = self.client_mode
        self._max_ttl_s = cfg.max_ttl_ms // 1000
        if self._num_replicas:
            cfg.num_replicas = self._num_replicas
        d = C.c_void_p()
        rc = L.ap_dht_new_sync(rt, ctypes.byref(cfg), ctypes.byref(d))
        if rc:
            L.ap_host_free(host)
            C.check(rc, "starting the DHT")
        self._host, self._rt, self._dht = host, rt, d
        buf = ctypes.create_string_buffer(C.AP_PEER_ID_STR_MAX)
        L.ap_peer_id_str(L.ap_rt_self(rt), buf)
        self._peer_id = PeerID(buf.value.decode())
        if self._initial_peers:
            arr = (C.c_char_p * len(self._initial_peers))(*[a.encode() for a in self._initial_peers])
            rc = L.ap_dht_bootstrap_sync(d, arr, len(self._initial_peers))
            if rc:
                self.shutdown()
                raise C.ApiaryError("none of the %d initial peers answered (they need "
                                    "/p2p/<PeerID>)" % len(self._initial_peers), rc)

    def shutdown(self):
        """Stops the node; later calls raise RuntimeError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for dep in list(self._dependents):
                dep.shutdown()
            self._closed = True
            L = C.lib()
            if self._mm:
                L.ap_avg_matchmaker_free_sync(self._rt, self._mm)
                self._mm = None
            if self._svc:
                L.ap_avg_service_free_sync(self._rt, self._svc)
                self._svc = None
            if self._dht:
                L.ap_dht_free_sync(self._dht)
            if self._host:
                L.ap_host_free(self._host)
            self._host = self._rt = self._dht = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _handle(self):
        if self._closed:
            raise RuntimeError("DHT is shut down")
        if not self._dht:
            raise RuntimeError("DHT is not started (call run_in_background())")
        return self._dht

    def is_alive(self):
        return bool(self._dht) and not self._closed

    # ---- identity and addresses ---------------------------------------------------------
    @property
    def peer_id(self):
        self._handle()
        return self._peer_id

    def get_visible_maddrs(self, latest=False):
        """The multiaddrs (with /p2p/<PeerID>) other peers can use as initial_peers."""
        self._handle()
        L = C.lib()
        arr = ((ctypes.c_char * C.AP_RT_ADDR_MAX) * 8)()
        n = C.check(L.ap_node_listen_addrs_sync(self._rt, arr, 8, True), "listen addresses")
        return [arr[i].value.decode() for i in range(min(n, 8))]

    # ---- records -------------------------------------------------------------------------
    def store(self, key, value, expiration_time, subkey=None, return_future=False, **kwargs):
        """Stores value under key (or one subkey of key's dictionary) until expiration_time
        (get_dht_time() seconds). Returns True if at least one node accepted it."""
        kb = _key_bytes(key, "key")
        if not 1 <= len(kb) <= C.AP_DHT_KEY_MAX:
            raise ValueError("key must be 1..%d bytes, got %d" % (C.AP_DHT_KEY_MAX, len(kb)))
        sb = b"" if subkey is None else _key_bytes(subkey, "subkey")
        if len(sb) > C.AP_DHT_SUBKEY_MAX:
            raise ValueError("subkey must be at most %d bytes" % C.AP_DHT_SUBKEY_MAX)
        if isinstance(expiration_time, bool) or not isinstance(expiration_time, (int, float)):
            raise TypeError("expiration_time must be a number (get_dht_time() + seconds), not %s"
                            % type(expiration_time).__name__)
        if expiration_time != expiration_time or expiration_time in (float("inf"), float("-inf")):
            raise ValueError("expiration_time must be finite")
        if expiration_time > get_dht_time() + self._max_ttl_s:
            raise ValueError("expiration_time is beyond the nodes' maximum record lifetime "
                             "(%d s from now)" % self._max_ttl_s)
        vb = _encode_value(value)
        if len(vb) > C.AP_DHT_VALUE_MAX:
            raise ValueError("value is %d bytes serialised, over the %d-byte limit" %
                             (len(vb), C.AP_DHT_VALUE_MAX))
        d = self._handle()
        kbuf, sbuf, vbuf = C.u8buf(kb), C.u8buf(sb), C.u8buf(vb)
        rec = C.DhtRecord(ctypes.cast(kbuf, C.P(C.c_u8)), len(kb),
                          ctypes.cast(sbuf, C.P(C.c_u8)) if sb else None, len(sb),
                          ctypes.cast(vbuf, C.P(C.c_u8)), len(vb), int(expiration_time * 1000))
        nstored = C.c_int(0)
        rc = C.lib().ap_dht_store_sync(d, ctypes.byref(rec), ctypes.byref(nstored))
        if rc < 0 and C.err_name(rc) in ("ESHUTDOWN", "ESTATE"):
            C.check(rc, "store")
        if rc < 0 and C.err_name(rc) in ("ERANGE",):
            raise ValueError("expiration_time is beyond the nodes' maximum record lifetime")
        if rc < 0 and C.err_name(rc) in ("EMSGSIZE",):
            raise ValueError("record is over the size limits")
        return rc == 0

    def get(self, key, latest=False, return_future=False, **kwargs):
        """The value of key as ValueWithExpiration(value, expiration_time), or None. A key
        holding a dictionary returns ValueWithExpiration({subkey: ValueWithExpiration}, max
        expiration). latest=True asks the k nearest nodes for the newest value."""
        kb = _key_bytes(key, "key")
        if not 1 <= len(kb) <= C.AP_DHT_KEY_MAX:
            raise ValueError("key must be 1..%d bytes, got %d" % (C.AP_DHT_KEY_MAX, len(kb)))
        if not isinstance(latest, bool):
            raise TypeError("latest must be a bool")
        d = self._handle()
        kbuf = C.u8buf(kb)
        out = C.P(C.DhtResult)()
        rc = C.lib().ap_dht_get_sync(d, ctypes.cast(kbuf, C.P(C.c_u8)), len(kb), latest,
                                     ctypes.byref(out))
        C.check(rc, "get")
        try:
            res = out.contents
            if not res.found or res.nrecords == 0:
                return None
            recs = [res.records[i] for i in range(res.nrecords)]
            if not res.is_dict:
                r = recs[0]
                return ValueWithExpiration(_decode_value(ctypes.string_at(r.value, r.value_len)),
                                           r.expiration_ms / 1000.0)
            d = {}
            for r in recs:
                sk = _decode_subkey(ctypes.string_at(r.subkey, r.subkey_len))
                d[sk] = ValueWithExpiration(_decode_value(ctypes.string_at(r.value, r.value_len)),
                                            r.expiration_ms / 1000.0)
            return ValueWithExpiration(d, max(v.expiration_time for v in d.values()))
        finally:
            C.lib().ap_dht_result_free(out)

    # internal handles for Optimizer / DecentralizedAverager
    def _c_handles(self):
        self._handle()
        return self._host, self._rt, self._dht

    def _avg_service(self):
        """The node's averaging service (one per node), made on first use."""
        with self._lock:
            self._handle()
            if not self._svc:
                L = C.lib()
                C.collab_protos(L)
                svc = ctypes.c_void_p()
                C.check(L.ap_avg_service_new_sync(self._rt, ctypes.byref(svc)),
                        "averaging service")
                self._svc = svc
            return self._svc

    def _matchmaker(self):
        """The node's DHT matchmaker (one per node), made on first use."""
        with self._lock:
            svc = self._avg_service()
            if not self._mm:
                L = C.lib()
                C.averager_protos(L)
                mm = ctypes.c_void_p()
                C.check(L.ap_avg_matchmaker_new_sync(self._rt, svc, self._dht, ctypes.byref(mm)),
                        "matchmaker")
                self._mm = mm
            return self._mm
