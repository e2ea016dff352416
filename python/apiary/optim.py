"""apiary.Optimizer: collaborative training (DeDLOC) over libapiary's ap_collab, with
hivemind.Optimizer's API.

Zero copy: the parameters are re-pointed into one flat float32 buffer and their .grad
tensors are views of a second one. libapiary reads the gradients from the flat buffer
(ap_collab_submit copies them into its accumulator), averages them with the peers and
then the user's torch optimizer makes the step (ap_collab_new_custom; _torchstep.py) on
tensors viewing libapiary's buffers: the parameters, the averaged gradient and the
optimizer state. With native_step=True libapiary's own SGD/Adam/AdamW makes the step
instead (settings read from the torch optimizer). Python copies nothing per step.
"""
import atexit
import ctypes
import hashlib
import threading
import weakref

import torch

from . import _lib as C
from ._torchstep import TorchStep
from .compression import NoCompression, codec_of
from .dht import DHT

_OPT_KINDS = {torch.optim.SGD: C.AP_NN_SGD, torch.optim.Adam: C.AP_NN_ADAM,
              torch.optim.AdamW: C.AP_NN_ADAMW}


def _positive(v, what, kind=(int, float), allow_none=True):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        raise TypeError("%s must be a number, not %s" % (what, type(v).__name__))
    if not v > 0:
        raise ValueError("%s must be > 0, got %r" % (what, v))
    return v


def _flatten_params(params):
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors (e.g. model.parameters()), "
                        "not one tensor")
    try:
        items = list(params)
    except TypeError:
        raise TypeError("params must be an iterable of tensors, not %s" %
                        type(params).__name__) from None
    out = []
    for it in items:
        if isinstance(it, dict):
            out.extend(it["params"])
        else:
            out.append(it)
    if not out:
        raise ValueError("params is empty")
    seen = set()
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError("params[%d] is a %s, not a tensor" % (i, type(p).__name__))
        if p.device.type != "cpu":
            raise ValueError("params[%d] is on %s: Apiary averages CPU float32 tensors"
                             % (i, p.device))
        if p.dtype != torch.float32:
            raise TypeError("params[%d] is %s: Apiary trains float32 parameters" % (i, p.dtype))
        if p.is_sparse:
            raise ValueError("params[%d] is sparse" % i)
        if id(p) in seen:
            raise ValueError("params[%d] is given twice" % i)
        seen.add(id(p))
    return out


def _optim_config(opt, native=True):
    kind = None
    for cls, k in _OPT_KINDS.items():
        if type(opt) is cls:
            kind = k
    if kind is None and not native:
        # The torch optimizer makes the step: libapiary's solver settings only name the
        # run's configuration (the optimizer's class is in the model description).
        cfg = C.NnSolverConfig()
        cfg.kind = C.AP_NN_SGD
        return cfg, float(opt.param_groups[0].get("lr", 0.0) or 0.0)
    if kind is None:
        raise TypeError("optimizer %s is not supported: libapiary makes the step with SGD, "
                        "Adam or AdamW (torch.optim.SGD/Adam/AdamW or a factory of one)"
                        % type(opt).__name__)
    groups = opt.param_groups
    g = groups[0]
    keys = [k for k in g if k != "params"]
    for other in groups[1:]:
        for k in keys:
            if other.get(k) != g.get(k):
                if native:
                    raise ValueError("param groups differ in %r: one set of hyperparameters "
                                     "is supported with native_step=True" % k)
    cfg = C.NnSolverConfig()
    cfg.kind = kind
    cfg.weight_decay = float(g.get("weight_decay", 0.0))
    if kind == C.AP_NN_SGD:
        if g.get("dampening", 0) and native:
            raise ValueError("SGD dampening is not supported with native_step=True")
        cfg.momentum = float(g.get("momentum", 0.0))
        cfg.nesterov = bool(g.get("nesterov", False))
    else:
        if g.get("amsgrad") and native:
            raise ValueError("amsgrad is not supported with native_step=True")
        cfg.beta1, cfg.beta2 = (float(b) for b in g["betas"])
        cfg.eps = float(g["eps"])
    if g.get("maximize") and native:
        raise ValueError("maximize is not supported with native_step=True")
    return cfg, float(g["lr"])


class Optimizer(torch.optim.Optimizer):
    """A collaborative optimizer: see hivemind.Optimizer and docs/python.md."""

    def __init__(self, *, dht, run_id, target_batch_size, batch_size_per_step=None, optimizer,
                 params=None, scheduler=None, matchmaking_time=None, averaging_timeout=None,
                 load_state_timeout=None, delay_optimizer_step=False, average_state_every=1,
                 client_mode=None, auxiliary=False, grad_compression=NoCompression(),
                 state_averaging_compression=NoCompression(), verbose=False,
                 max_local_samples=None, native_step=False, dht_matchmaking=True, **kwargs):
        for k in kwargs:
            if k not in ("allreduce_timeout", "next_chunk_timeout", "reuse_grad_buffers",
                         "offload_optimizer", "delay_grad_averaging", "delay_state_averaging",
                         "use_local_updates", "load_state_compression", "average_opt_statistics",
                         "extra_tensors", "averager_opts", "tracker_opts",
                         "performance_ema_alpha", "shutdown_timeout"):
                raise TypeError("Optimizer() got an unexpected keyword argument %r" % k)
        if not isinstance(dht, DHT):
            raise TypeError("dht must be an apiary.DHT, not %s" % type(dht).__name__)
        if not isinstance(run_id, str) or not 1 <= len(run_id.encode()) <= 128:
            raise (TypeError if not isinstance(run_id, str) else ValueError)(
                "run_id must be a str of 1..128 bytes")
        if isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int):
            raise TypeError("target_batch_size must be an int")
        if target_batch_size <= 0:
            raise ValueError("target_batch_size must be > 0")
        if batch_size_per_step is not None:
            if isinstance(batch_size_per_step, bool) or not isinstance(batch_size_per_step, int):
                raise TypeError("batch_size_per_step must be an int")
            if batch_size_per_step <= 0:
                raise ValueError("batch_size_per_step must be > 0")
        self.native_step = bool(native_step)
        if scheduler is not None and self.native_step:
            raise TypeError("scheduler is not supported with native_step=True (libapiary's "
                            "solver uses a constant learning rate; docs/python.md)")
        if scheduler is not None and not callable(scheduler) and \
                not hasattr(scheduler, "step"):
            raise TypeError("scheduler must be a callable(optimizer) making an LR scheduler, "
                            "or one, not %s" % type(scheduler).__name__)
        for name, v in (("matchmaking_time", matchmaking_time),
                        ("averaging_timeout", averaging_timeout),
                        ("load_state_timeout", load_state_timeout)):
            _positive(v, name)
        if isinstance(average_state_every, bool) or not isinstance(average_state_every, int) \
                or average_state_every < 0:
            raise ValueError("average_state_every must be an int >= 0")
        if not isinstance(dht_matchmaking, bool):
            raise TypeError("dht_matchmaking must be a bool")
        if max_local_samples is not None:
            _positive(max_local_samples, "max_local_samples", int, False)
        self.dht = dht
        self.run_id = run_id
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.auxiliary = bool(auxiliary)
        self.client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self.delay_optimizer_step = bool(delay_optimizer_step)
        self.verbose = verbose

        if isinstance(optimizer, torch.optim.Optimizer):
            if params is not None:
                raise ValueError("give params only with an optimizer factory, not with an "
                                 "optimizer instance")
            plist = _flatten_params(optimizer.param_groups)
            opt = optimizer
        elif callable(optimizer):
            if params is None:
                raise ValueError("params is required with an optimizer factory")
            params = list(params)
            plist = _flatten_params(params)
            opt = optimizer(params)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError("optimizer factory returned %s, not a torch.optim.Optimizer"
                                % type(opt).__name__)
        else:
            raise TypeError("optimizer must be a torch optimizer or a callable(params) making "
                            "one, not %s" % type(optimizer).__name__)
        self.opt = opt
        ocfg, lr = _optim_config(opt, self.native_step)

        # One flat buffer for the parameters and one for the gradients.
        n = sum(p.numel() for p in plist)
        self._flat = torch.empty(n, dtype=torch.float32)
        self._grad = torch.zeros(n, dtype=torch.float32)
        shapes = []
        off = 0
        with torch.no_grad():
            for p in plist:
                k = p.numel()
                self._flat[off:off + k].copy_(p.reshape(-1))
                p.data = self._flat[off:off + k].view_as(p)
                p.grad = self._grad[off:off + k].view_as(p)
                shapes.append(tuple(p.shape))
                off += k
        self._plist = plist
        self._gptr = ctypes.cast(self._grad.data_ptr(), C.P(C.c_float))
        self._gviews = [p.grad for p in plist]  # what step() checks
        self._gptrs = [g.data_ptr() for g in self._gviews]
        what = repr(shapes) if self.native_step else repr((shapes, type(opt).__name__))
        digest = hashlib.blake2b(what.encode(), digest_size=6).hexdigest()
        self._model_desc = ("torch %d tensors %s" % (len(plist), digest)).encode()

        L = C.lib()
        C.collab_protos(L)
        # A guard band, as in _stats: a mirror that fell behind ap_collab_config_t fails
        # here with a clear error instead of handing the library a shifted structure.
        size = ctypes.sizeof(C.CollabConfig)
        guard = (ctypes.c_uint8 * (size + 64))(*([0xA5] * (size + 64)))
        L.ap_collab_config_default(ctypes.cast(guard, ctypes.POINTER(C.CollabConfig)))
        if bytes(guard[size:]) != b"\xa5" * 64:
            raise RuntimeError("libapiary's ap_collab_config_t is larger than "
                               "apiary._lib.CollabConfig: the package and the library do not match")
        cfg = C.CollabConfig.from_buffer_copy(bytes(guard[:size]))
        self._run_id_b = run_id.encode()
        cfg.run_id = self._run_id_b
        cfg.target_batch_size = target_batch_size
        cfg.role = C.AP_AVG_AUX if self.auxiliary else (
            C.AP_AVG_CLIENT if self.client_mode else C.AP_AVG_NORMAL)
        cfg.solver = ocfg
        cfg.lr.kind = 0
        cfg.lr.base = lr
        cfg.lr.min = lr
        cfg.average_state_every = average_state_every
        cfg.codec = codec_of(grad_compression, "grad_compression")
        cfg.state_codec = codec_of(state_averaging_compression, "state_averaging_compression")
        if matchmaking_time:
            cfg.matchmaking_window_us = int(matchmaking_time * 1e6)
        if averaging_timeout:
            cfg.averaging_timeout_us = int(averaging_timeout * 1e6)
        if load_state_timeout:
            cfg.download_timeout_us = int(load_state_timeout * 1e6)
        cfg.delayed_updates = self.delay_optimizer_step
        cfg.max_local_samples = max_local_samples or 0
        cfg.dht_matchmaking = bool(dht_matchmaking)
        cfg.model_desc = self._model_desc
        self._cfg = cfg
        self._submit = L.ap_collab_submit_sync
        self._lock = threading.Lock()
        self._closed = False
        self._c = None
        self._svc = None
        self._host, self._rt, self._dht = dht._c_handles()
        self._svc = dht._avg_service()
        dht._dependents.append(self)
        self._ts = None
        self.scheduler = None
        if not self.native_step:
            self._ts = TorchStep(opt, plist, self._flat)
            if scheduler is not None:
                sched = scheduler if hasattr(scheduler, "step") and \
                    hasattr(scheduler, "last_epoch") else scheduler(opt)
                if not (hasattr(sched, "step") and hasattr(sched, "last_epoch")):
                    raise TypeError("scheduler factory returned %s, not an LR scheduler"
                                    % type(sched).__name__)
                if getattr(sched, "optimizer", opt) is not opt:
                    raise ValueError("scheduler must be bound to this Optimizer's torch "
                                     "optimizer")
                self.scheduler = sched
                self._ts.scheduler = sched
        defaults = dict(opt.defaults)
        super().__init__(plist, defaults)
        _live.add(self)
        self._open_and_start()

    # ---- internals ------------------------------------------------------------------------
    def _open_and_start(self):
        L = C.lib()
        c = C.c_void_p()
        pptr = ctypes.cast(self._flat.data_ptr(), C.P(C.c_float))
        if self._ts is None:
            rc = L.ap_collab_new_sync(self._rt, self._dht, self._svc, ctypes.byref(self._cfg),
                                      pptr, self._flat.numel(), None, 0, ctypes.byref(c))
        else:
            rc = L.ap_collab_new_custom_sync(self._rt, self._dht, self._svc,
                                             ctypes.byref(self._cfg), pptr, self._flat.numel(),
                                             self._ts.state_count,
                                             ctypes.cast(self._ts.fn, C.c_void_p), None,
                                             ctypes.byref(c))
        if rc:
            self.shutdown()
            C.check(rc, "creating the collaborative optimizer (one per DHT)")
        self._c = c
        if self._ts is not None:
            shadow, grad, state = C.c_void_p(), C.c_void_p(), C.c_void_p()
            count = C.c_size_t()
            L.ap_collab_buffers(c, ctypes.byref(shadow), ctypes.byref(grad),
                                ctypes.byref(state), ctypes.byref(count))
            self._ts.bind(self._flat.data_ptr(), shadow.value, grad.value, state.value,
                          count.value, int(L.ap_collab_optim_step(c)))
        rc = L.ap_collab_start_sync(c)
        if self._ts is not None:
            # a download at the start brought the step counter and the epoch
            self._ts.set_step(int(L.ap_collab_optim_step(c)))
            self._ts.catch_up_scheduler(int(self._stats().epoch))
        self._raise_refusal(rc)
        if rc and C.err_name(rc) not in ("EUNREACH", "ETIMEDOUT", "ENOENT"):
            C.check(rc, "joining the run")

    def _raise_refusal(self, rc):
        if rc < 0 and C.err_name(rc) == "ECONFIG":
            why = C.lib().ap_collab_refusal(self._c)
            raise ValueError("the run %r refused this peer: %s" %
                             (self.run_id, why.decode() if why else "configuration differs"))

    def _handle(self):
        if self._closed or not self._c:
            raise RuntimeError("Optimizer is shut down")
        return self._c

    def _stats(self):
        # The C side writes into a buffer with a guard band: a mirror that fell behind
        # ap_collab_stats_t fails here with a clear error instead of corrupting the heap.
        size = ctypes.sizeof(C.CollabStats)
        buf = (ctypes.c_uint8 * (size + 64))(*([0xA5] * (size + 64)))
        C.check(C.lib().ap_collab_get_stats_sync(self._handle(),
                                                 ctypes.cast(buf, ctypes.POINTER(C.CollabStats))),
                "stats")
        if bytes(buf[size:]) != b"\xa5" * 64:
            raise RuntimeError("libapiary's ap_collab_stats_t is larger than apiary._lib.CollabStats:"
                               " the package and the library do not match")
        return C.CollabStats.from_buffer_copy(bytes(buf[:size]))

    # ---- hivemind's API ------------------------------------------------------------------------
    @property
    def local_epoch(self):
        """The global epoch this peer is in (steps of the collaboration so far)."""
        return int(self._stats().epoch)

    @property
    def flat_parameters(self):
        """The flat float32 buffer every parameter is a view of."""
        return self._flat

    @property
    def flat_gradients(self):
        """The flat float32 buffer every parameter's .grad is a view of."""
        return self._grad

    def stats(self):
        """libapiary's ap_collab_stats_t as a dict."""
        st = self._stats()
        return {name: getattr(st, name) for name, _ in C.CollabStats._fields_}

    def is_synchronized_with_peers(self):
        """False while this peer is behind the others (it then downloads their state at its
        next step)."""
        st = self._stats()
        return not st.refused

    def step(self, closure=None, batch_size=None, grad_scaler=None):
        """Adds this peer's batch (the gradients in the parameters' .grad) to the epoch; when
        the global batch is complete, averages with the peers and steps (in place)."""
        c = self._handle()
        if grad_scaler is not None:
            raise TypeError("grad_scaler is not supported (float32 training)")
        if self.auxiliary:
            raise RuntimeError("an auxiliary peer does not train: it averages by itself")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        b = self.batch_size_per_step if batch_size is None else batch_size
        if b is None:
            raise ValueError("batch_size is required when batch_size_per_step is not set")
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError("batch_size must be an int")
        if not 0 < b < 2 ** 32:
            raise ValueError("batch_size must be in 1..2^32-1")
        # the .grad views given out must still be there (identity: data_ptr() costs
        # microseconds per tensor; a replaced .grad at the same address is accepted)
        gv = self._gviews
        for i, p in enumerate(self._plist):
            g = p.grad
            if g is not gv[i] and (g is None or g.data_ptr() != self._gptrs[i]):
                raise RuntimeError("params[%d].grad was replaced (set_to_none?): call "
                                   "opt.zero_grad() of this Optimizer, which zeroes in place" % i)
        lv = float(loss) if loss is not None else 0.0
        rc = self._submit(c, self._gptr, b, lv)
        ts = self._ts
        if ts is not None and ts.error is not None:
            err, ts.error = ts.error, None
            raise RuntimeError("the torch optimizer's step failed: %r" % (err,)) from err
        self._raise_refusal(rc)
        if rc < 0 and C.err_name(rc) != "ECANCELED":
            C.check(rc, "step")
        return loss

    def zero_grad(self, set_to_none=False):
        """Zeroes the flat gradient buffer in place (never sets .grad to None)."""
        self._handle()
        self._grad.zero_()

    def load_state_from_peers(self, **kwargs):
        """Downloads parameters, optimizer state and epoch from the run's donors now."""
        with self._lock:
            L = C.lib()
            c = self._handle()
            if self._ts is not None:
                self._ts.detach()  # while libapiary's buffers are still there
            L.ap_collab_free_sync(self._rt, c)
            self._c = None
            self._cfg.load_state_on_start = True
            self._open_and_start()

    def state_dict(self):
        """The run's state as this peer has it: epoch, parameters, the torch optimizer's
        state (copied), the optimizer's step counter and the scheduler's state."""
        c = self._handle()
        sd = {"local_epoch": self.local_epoch, "parameters": self._flat.clone(),
              "run_id": self.run_id,
              "optim_step": int(C.lib().ap_collab_optim_step(c))}
        if self._ts is not None:
            osd = self.opt.state_dict()
            osd["state"] = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                for k, v in st.items()} for i, st in osd["state"].items()}
            sd["optimizer"] = osd
            if self.scheduler is not None:
                sd["scheduler"] = self.scheduler.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        """Resumes from state_dict(): parameters, epoch, optimizer state and step counter,
        scheduler (what the dictionary has)."""
        if not isinstance(state_dict, dict) or "parameters" not in state_dict:
            raise TypeError("state_dict must be a dict from Optimizer.state_dict()")
        p = state_dict["parameters"]
        if not isinstance(p, torch.Tensor) or p.shape != self._flat.shape:
            raise ValueError("state_dict parameters have shape %s, this model %s" %
                             (getattr(p, "shape", None), tuple(self._flat.shape)))
        epoch = state_dict.get("local_epoch")
        step = state_dict.get("optim_step")
        for name, v in (("local_epoch", epoch), ("optim_step", step)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError("state_dict %s must be an int >= 0, got %r" % (name, v))
        if "optimizer" in state_dict and self._ts is None:
            raise ValueError("state_dict has a torch optimizer state: load it into an "
                             "Optimizer with native_step=False")
        c = self._handle()
        if self._ts is not None and "optimizer" in state_dict:
            self.opt.load_state_dict(state_dict["optimizer"])
            self._ts.after_load()
        if self.scheduler is not None and "scheduler" in state_dict:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        with torch.no_grad():
            self._flat.copy_(p)
        if epoch is not None:
            L = C.lib()
            cur = int(L.ap_collab_optim_step(c))
            C.check(L.ap_collab_resume_sync(c, epoch, cur if step is None else step),
                    "resuming (a step is pending?)")
            if self._ts is not None:
                self._ts.set_step(cur if step is None else step)

    def shutdown(self):
        """Leaves the run; later calls raise RuntimeError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        L = C.lib()
        if self._c:
            if self._ts is not None:
                self._ts.detach()  # while libapiary's buffers are still there
            L.ap_collab_free_sync(self._rt, self._c)
            self._c = None
        self._svc = None  # the DHT's, freed with it
        try:
            self.dht._dependents.remove(self)
        except ValueError:
            pass

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    def __repr__(self):
        return "apiary.Optimizer(run_id=%r, %s)" % (self.run_id, type(self.opt).__name__)


# libapiary calls the torch optimizer's step on its own thread: an Optimizer still
# running when the interpreter exits is shut down first (no call into a finalizing
# interpreter).
_live = weakref.WeakSet()


@atexit.register
def _shutdown_all():
    for o in list(_live):
        try:
            o.shutdown()
        except Exception:
            pass


# torch.optim.Optimizer wraps a subclass's step() in a profiler record_function (tens of
# microseconds per call); this step is a C call, so it is marked as wrapped already.
Optimizer.step.hooked = True
