"""apiary.DecentralizedAverager: averages a fixed set of tensors with peers found through
the DHT (libapiary's averager and DHT matchmaker, apiary/averager.h), with
hivemind.averaging.DecentralizedAverager's API.

The tensors live in the averager's own buffer (allocated by libapiary); get_tensors()
yields torch views of it (no copies), as hivemind's get_tensors() yields its shared
buffers."""
import concurrent.futures
import contextlib
import ctypes
import enum
import math
import threading
import time

import msgpack
import torch

from . import _lib as C
from .compression import NoCompression, codec_of
from .dht import DHT, PeerID

# A search shorter than this cannot meet anyone (the DHT round trips of matchmaking).
_MIN_LOOK_S = 0.1


def _ungather(b):
    """A member's gathered bytes as the object it gave (None when it gave nothing, or
    gave bytes that are not msgpack: a peer of another implementation)."""
    if not b:
        return None
    try:
        return msgpack.unpackb(b, raw=False)
    except Exception:  # noqa: BLE001 - another peer's bytes; never fail the step for them
        return None


class AveragingStage(enum.Enum):
    """Where a step is (hivemind.averaging.control.AveragingStage)."""
    IDLE = 0
    LOOKING_FOR_GROUP = 1
    AWAITING_TRIGGER = 2
    RUNNING_ALLREDUCE = 3
    FINISHED = 4


class StepControl(concurrent.futures.Future):
    """A step running in the background (DecentralizedAverager.step(wait=False)), as
    hivemind's StepControl: result() is the step's return value (the group, or None when
    it failed); cancel() ends it at the end of the running attempt (a search of at most
    min_matchmaking_time, or its round); with require_trigger=True the step begins once
    allow_allreduce() is called."""

    def __init__(self, scheduled_time, deadline, allow_retries, weight, require_trigger):
        super().__init__()
        self._scheduled_time = float(scheduled_time)
        self._deadline = float(deadline)
        self._allow_retries = bool(allow_retries)
        self._weight = float(weight)
        self._trigger = threading.Event()
        if not require_trigger:
            self._trigger.set()
        self._stage = AveragingStage.IDLE
        self._began = False

    @property
    def scheduled_time(self):
        return self._scheduled_time

    @scheduled_time.setter
    def scheduled_time(self, t):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise TypeError("scheduled_time must be a finite number (DHT time)")
        self._scheduled_time = float(t)

    @property
    def deadline(self):
        return self._deadline

    def get_timeout(self):
        return max(0.0, self._deadline - time.time())

    @property
    def allow_retries(self):
        return self._allow_retries

    @property
    def weight(self):
        return self._weight

    @weight.setter
    def weight(self, w):
        self._weight = _check_weight(w)

    @property
    def stage(self):
        return self._stage

    @property
    def began_allreduce(self):
        return self._began

    @property
    def triggered(self):
        return self._trigger.is_set()

    def allow_allreduce(self):
        """Lets a step made with require_trigger=True begin."""
        self._trigger.set()

    def cancel(self):
        if self.done():
            return False
        self._trigger.set()  # a step waiting for its trigger sees the cancel at once
        return concurrent.futures.Future.cancel(self)


def _check_weight(w):
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise TypeError("weight must be a number, not %s" % type(w).__name__)
    if not (w >= 0 and math.isfinite(w)):
        raise ValueError("weight must be finite and >= 0, got %r" % (w,))
    return float(w)


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
        if min_group_size is None:
            min_group_size = 2
        if target_group_size is not None and target_group_size < min_group_size:
            raise ValueError("target_group_size is below min_group_size")
        if isinstance(min_matchmaking_time, bool) or \
                not isinstance(min_matchmaking_time, (int, float)):
            raise TypeError("min_matchmaking_time must be a number")
        if not min_matchmaking_time > 0 or not math.isfinite(min_matchmaking_time):
            raise ValueError("min_matchmaking_time must be finite and > 0")
        if allreduce_timeout is not None:
            if isinstance(allreduce_timeout, bool) or \
                    not isinstance(allreduce_timeout, (int, float)):
                raise TypeError("allreduce_timeout must be a number")
            if not allreduce_timeout > 0:
                raise ValueError("allreduce_timeout must be > 0")
        if not isinstance(start, bool):
            raise TypeError("start must be a bool")
        codec = codec_of(compression, "compression")
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
        self.allreduce_timeout = allreduce_timeout
        self.compression = compression
        self.client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self.auxiliary = bool(auxiliary)
        if self.auxiliary and client_mode:
            raise ValueError("an auxiliary averager cannot be in client mode")
        self._closed = False
        self._av = None
        self._lock = threading.Lock()
        self._steps = set()  # background steps (StepControl) still running
        L = C.lib()
        C.averager_protos(L)
        self._rt = dht._c_handles()[1]
        self._svc = dht._avg_service()
        self._mm = dht._matchmaker()
        o = C.AveragerOpts()
        o.role = C.AP_AVG_AUX if self.auxiliary else (
            C.AP_AVG_CLIENT if self.client_mode else C.AP_AVG_NORMAL)
        o.round.codec = codec
        self._opts = o
        sizes = (C.c_size_t * len(tensors))(*[t.numel() for t in tensors])
        av = C.c_void_p()
        C.check(L.ap_averager_new_sync(self._rt, self._svc, sizes, len(tensors),
                                       ctypes.byref(o), ctypes.byref(av)), "creating the averager")
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

    @property
    def peer_id(self):
        return self.dht.peer_id

    @property
    def mode(self):
        """"aux", "client" or "node" (hivemind's AveragingMode names, lower case)."""
        return "aux" if self.auxiliary else ("client" if self.client_mode else "node")

    @contextlib.contextmanager
    def get_tensors(self):
        """The averaged tensors (views of the averager's buffer): read and write them here,
        not while a step runs (this waits for a running step's attempt to end)."""
        with self._lock:
            self._check()
            yield self._views

    def _check(self):
        if self._closed:
            raise RuntimeError("DecentralizedAverager is shut down")

    def step(self, gather=None, scheduled_time=None, weight=None, timeout=None,
             allow_retries=True, require_trigger=False, wait=True):
        """Looks for a group and averages the tensors with it, in place (hivemind's
        semantics: the search runs until scheduled_time, by default min_matchmaking_time
        from now; a failed attempt is retried while allow_retries and timeout allow it,
        for ever with timeout=None).

        Returns {PeerID: gathered} with one entry per group member (this peer included): what
        each member gave as gather (msgpack-serialisable, at most 512 bytes serialised), or
        None when the step failed (no group within timeout, or allow_retries=False and the
        attempt failed). wait=False returns a StepControl (a concurrent.futures.Future)
        at once; its result() is that value."""
        self._check()
        try:
            gathered = msgpack.packb(gather, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError("gather must be msgpack-serialisable: %s" % e) from None
        if len(gathered) > C.AVG_GATHER_MAX:
            raise ValueError("gather takes %d bytes serialised, more than the %d a group "
                             "member may give" % (len(gathered), C.AVG_GATHER_MAX))
        for name, v in (("allow_retries", allow_retries), ("require_trigger", require_trigger),
                        ("wait", wait)):
            if not isinstance(v, bool):
                raise TypeError("%s must be a bool" % name)
        if require_trigger and wait:
            raise ValueError("require_trigger=True needs wait=False (the step waits for "
                             "allow_allreduce() of the StepControl it returns)")
        if weight is None:
            weight = 0.0 if self.auxiliary else 1.0
        weight = _check_weight(weight)
        now = time.time()
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError("timeout must be a number")
            if not timeout > 0 or timeout != timeout:
                raise ValueError("timeout must be > 0")
        deadline = now + timeout if timeout is not None else math.inf
        if scheduled_time is None:
            scheduled_time = now + self.min_matchmaking_time
            if scheduled_time > deadline:
                scheduled_time = deadline
        else:
            if isinstance(scheduled_time, bool) or not isinstance(scheduled_time, (int, float)) \
                    or not math.isfinite(scheduled_time):
                raise TypeError("scheduled_time must be a finite number (DHT time, "
                                "apiary.get_dht_time())")
            if scheduled_time > deadline:
                raise ValueError("scheduled_time is after the deadline (now + timeout)")
        ctl = StepControl(scheduled_time, deadline, allow_retries, weight, require_trigger)
        ctl._gather = gathered
        if wait:
            self._run(ctl)
            return ctl.result()
        with self._lock:
            self._check()
            self._steps.add(ctl)
        threading.Thread(target=self._run, args=(ctl,), daemon=True,
                         name="apiary-averager-step").start()
        return ctl

    def _attempt(self, look_s, weight, gathered=b""):
        """One search of look_s seconds and, if a group formed, its round: {PeerID: what
        that member gave as gather}, in the group's order, or None."""
        L = C.lib()
        kbuf = C.u8buf(self._key)
        m = C.AvgMatch()
        m.key = ctypes.cast(kbuf, C.P(C.c_u8))
        m.key_len = len(self._key)
        m.target_group_size = self.target_group_size
        m.min_group_size = self.min_group_size
        gbuf = C.u8buf(gathered) if gathered else None
        if gbuf is not None:
            m.gather = ctypes.cast(gbuf, C.P(C.c_u8))
            m.gather_len = len(gathered)
        gsize = C.c_size_t(0)
        with self._lock:
            self._check()
            rc = L.ap_averager_step_sync(self._rt, self._av, self._mm, ctypes.byref(m),
                                         max(1, int(look_s * 1e6)), weight, None,
                                         ctypes.byref(gsize))
            members = None
            if rc == 0:
                n = int(L.ap_averager_last_group(self._av, None, 0))
                arr = (C.AvgMember * max(n, 1))()
                n = min(n, int(L.ap_averager_last_group(self._av, arr, n)))
                buf = ctypes.create_string_buffer(C.AP_PEER_ID_STR_MAX)
                gb = (C.c_u8 * C.AVG_GATHER_MAX)()
                members = {}
                for i in range(n):
                    L.ap_peer_id_str(ctypes.byref(arr[i].id), buf)
                    gl = int(L.ap_averager_last_gather(self._av, i, gb, C.AVG_GATHER_MAX))
                    members[PeerID(buf.value.decode())] = _ungather(bytes(gb[:gl]) if gl > 0
                                                                    else b"")
        if rc < 0 and C.err_name(rc) == "ESHUTDOWN":
            C.check(rc, "step")
        return members

    def _run(self, ctl):
        try:
            while not ctl.cancelled():
                if not ctl.triggered:
                    ctl._stage = AveragingStage.AWAITING_TRIGGER
                    while not ctl._trigger.wait(0.1):
                        if self._closed:
                            break
                    continue
                if self._closed:
                    raise RuntimeError("DecentralizedAverager is shut down")
                now = time.time()
                if now >= ctl.deadline:
                    break
                look = max(min(ctl.scheduled_time, ctl.deadline) - now, _MIN_LOOK_S)
                ctl._stage = AveragingStage.LOOKING_FOR_GROUP
                members = self._attempt(look, ctl.weight, ctl._gather)
                if members is not None:
                    ctl._began = True
                    ctl._stage = AveragingStage.FINISHED
                    if not ctl.cancelled():
                        ctl.set_result(members)
                    return
                if not ctl.allow_retries:
                    break
                ctl._scheduled_time = time.time() + self.min_matchmaking_time
            ctl._stage = AveragingStage.FINISHED
            if not ctl.done():
                ctl.set_result(None)
        except BaseException as e:
            ctl._stage = AveragingStage.FINISHED
            if not ctl.done():
                ctl.set_exception(e)
            if not isinstance(e, Exception):
                raise
        finally:
            self._steps.discard(ctl)

    def shutdown(self):
        """Stops the averager: background steps end (a running attempt first finishes);
        later calls raise RuntimeError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ctl in list(self._steps):
            ctl.cancel()
        with self._lock:  # waits for a running attempt
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
