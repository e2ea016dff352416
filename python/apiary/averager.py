"""apiary.DecentralizedAverager: averages a fixed set of tensors with peers found through
the DHT (libapiary's averager and DHT matchmaker, apiary/averager.h), with
hivemind.averaging.DecentralizedAverager's API.

The tensors live in the averager's own buffer (allocated by libapiary); get_tensors()
yields torch views of it (no copies), as hivemind's get_tensors() yields its shared
buffers."""
import contextlib
import ctypes
import threading

import torch

from . import _lib as C
from .compression import NoCompression, codec_of
from .dht import DHT


class DecentralizedAverager:
    def __init__(self, averaged_tensors, dht, *, start=True, prefix, target_group_size=None,
                 min_group_size=2, min_matchmaking_time=5.0, allreduce_timeout=None,
                 compression=NoCompression(), client_mode=None, auxiliary=False, **kwargs):
        for k in kwargs:
            if k not in ("initial_group_bits", "request_timeout", "averaging_alpha",
                         "part_size_bytes", "next_chunk_timeout", "sender_timeout",
                         "reducer_timeout", "state_compression", "tensor_infos", "bandwidth",
                         "min_vector_size", "allow_state_sharing", "declare_state_period",
                         "daemon", "shutdown_timeout"):
                raise TypeError("DecentralizedAverager() got an unexpected keyword argument %r"
                                % k)
        if not isinstance(dht, DHT):
            raise TypeError("dht must be an apiary.DHT, not %s" % type(dht).__name__)
        if not isinstance(prefix, str) or not 1 <= len(prefix.encode()) <= 200:
            raise (TypeError if not isinstance(prefix, str) else ValueError)(
                "prefix must be a str of 1..200 bytes")
        for name, v, lo in (("target_group_size", target_group_size, 2),
                            ("min_group_size", min_group_size, 2)):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError("%s must be an int" % name)
            if not lo <= v <= 256:
                raise ValueError("%s must be in %d..256, got %d" % (name, lo, v))
        if target_group_size is not None and target_group_size < min_group_size:
            raise ValueError("target_group_size is below min_group_size")
        if isinstance(min_matchmaking_time, bool) or \
                not isinstance(min_matchmaking_time, (int, float)) or not min_matchmaking_time > 0:
            raise ValueError("min_matchmaking_time must be a number > 0")
        codec_of(compression, "compression")
        if compression is not None and codec_of(compression, "compression") != 0:
            raise ValueError("the averager averages float32 only (NoCompression)")
        try:
            tensors = list(averaged_tensors)
        except TypeError:
            raise TypeError("averaged_tensors must be a sequence of tensors") from None
        if not tensors:
            raise ValueError("averaged_tensors is empty")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError("averaged_tensors[%d] is a %s, not a tensor" %
                                (i, type(t).__name__))
            if t.device.type != "cpu":
                raise ValueError("averaged_tensors[%d] is on %s: CPU tensors only" % (i, t.device))
            if not t.is_floating_point():
                raise TypeError("averaged_tensors[%d] is %s: floating point only" % (i, t.dtype))
            if t.numel() == 0:
                raise ValueError("averaged_tensors[%d] is empty" % i)
        self.dht = dht
        self.prefix = prefix
        self._key = (prefix + "_group").encode()
        self.target_group_size = target_group_size or 0
        self.min_group_size = min_group_size
        self.min_matchmaking_time = float(min_matchmaking_time)
        self.client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self.auxiliary = bool(auxiliary)
        self._closed = False
        self._av = None
        self._lock = threading.Lock()
        L = C.lib()
        C.averager_protos(L)
        self._rt = dht._c_handles()[1]
        self._svc = dht._avg_service()
        self._mm = dht._matchmaker()
        sizes = (C.c_size_t * len(tensors))(*[t.numel() for t in tensors])
        av = C.c_void_p()
        C.check(L.ap_averager_new_sync(self._rt, self._svc, sizes, len(tensors), None,
                                       ctypes.byref(av)), "creating the averager")
        self._av = av
        self._views = []
        for i, t in enumerate(tensors):
            n = C.c_size_t(0)
            ptr = L.ap_averager_tensor(av, i, ctypes.byref(n))
            arr = (ctypes.c_float * n.value).from_address(ctypes.addressof(ptr.contents))
            view = torch.frombuffer(arr, dtype=torch.float32).view(t.shape)
            with torch.no_grad():
                view.copy_(t.detach())
            self._views.append(view)
        dht._dependents.append(self)

    @contextlib.contextmanager
    def get_tensors(self):
        """The averaged tensors (views of the averager's buffer): read and write them here,
        not while a step runs."""
        with self._lock:
            self._check()
            yield self._views

    def _check(self):
        if self._closed:
            raise RuntimeError("DecentralizedAverager is shut down")

    def step(self, gather=None, weight=None, timeout=None, allow_retries=True, wait=True,
             **kwargs):
        """Finds a group (within min_matchmaking_time) and averages the tensors with it,
        in place. Returns a dict {peer index: None} of the group's members, or None when no
        group formed or the round failed (the tensors then keep their local values, partly
        averaged if the round failed midway)."""
        self._check()
        if not wait:
            raise ValueError("wait=False is not supported: step blocks (the GIL is released)")
        if weight is None:
            weight = 1.0
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError("weight must be a number")
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise ValueError("weight must be finite and > 0")
        look = self.min_matchmaking_time if timeout is None else float(timeout)
        if not look > 0:
            raise ValueError("timeout must be > 0")
        L = C.lib()
        kbuf = C.u8buf(self._key)
        m = C.AvgMatch()
        m.key = ctypes.cast(kbuf, C.P(C.c_u8))
        m.key_len = len(self._key)
        m.target_group_size = self.target_group_size
        m.min_group_size = self.min_group_size
        gsize = C.c_size_t(0)
        with self._lock:
            self._check()
            rc = L.ap_averager_step_sync(self._rt, self._av, self._mm, ctypes.byref(m),
                                         int(look * 1e6), float(weight), None,
                                         ctypes.byref(gsize))
        if rc < 0:
            if C.err_name(rc) in ("ESHUTDOWN",):
                C.check(rc, "step")
            return None
        return {i: None for i in range(gsize.value)}

    def shutdown(self):
        if self._closed:
            return
        self._closed = True
        if self._av:
            C.lib().ap_averager_free_sync(self._rt, self._av)
            self._av = None
        self._views = []
        try:
            self.dht._dependents.remove(self)
        except ValueError:
            pass

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
