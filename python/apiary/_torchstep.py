"""The torch optimizer's step on libapiary's buffers (ap_collab_new_custom).

The user's torch optimizer is re-pointed at a second set of parameter tensors (one per
parameter, same shapes) that view the buffer libapiary steps on: the parameters
themselves, or with delayed updates libapiary's own copy of them. Their .grad tensors view
libapiary's averaged-gradient buffer and the optimizer's state tensors (exp_avg,
momentum_buffer, ...) view libapiary's state buffer, so state averaging and state
downloads carry the torch optimizer's state without a copy. libapiary calls `step` on its
loop thread once per global epoch.
"""
import ctypes
import sys
import threading
import warnings
from collections import defaultdict

import torch

STEP_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_uint64, ctypes.c_uint64)

_AP_EINVAL = -22  # any negative value: libapiary logs the step as failed


def _view(ptr, n):
    """A float32 tensor over n floats of C memory at ptr (kept alive by the tensor)."""
    arr = (ctypes.c_float * n).from_address(ptr)
    t = torch.frombuffer(arr, dtype=torch.float32)
    return t


def _is_shared_state(key, v):
    return key != "step" and isinstance(v, torch.Tensor) and v.dim() > 0 and \
        v.dtype == torch.float32 and not v.is_sparse


class TorchStep:
    """Owns the optimizer's parameter tensors and the views of one collab's buffers."""

    def __init__(self, opt, plist, flat, scheduler=None):
        self.opt = opt
        self.flat = flat
        self.state_views = []
        self.bound = False
        self.plist = plist
        self.n = flat.numel()
        self.shapes = [p.shape for p in plist]
        self.offs = []
        off = 0
        for p in plist:
            self.offs.append(off)
            off += p.numel()
        # The optimizer's own parameter objects (same memory as the model's parameters
        # until libapiary's buffers are bound).
        self.q = []
        with torch.no_grad():
            for i, p in enumerate(plist):
                t = torch.empty(0, dtype=torch.float32)
                t.data = self._slice(flat, i)
                self.q.append(t)
        qmap = {id(p): q for p, q in zip(plist, self.q)}
        for g in opt.param_groups:
            g["params"] = [qmap[id(p)] for p in g["params"]]
        old = opt.state
        opt.state = defaultdict(dict)
        for p, st in old.items():
            if id(p) in qmap:
                opt.state[qmap[id(p)]] = st
        self.scheduler = scheduler
        self.error = None
        self.calls = 0
        self._target = flat.data_ptr()
        self._init_state(flat)
        self.layout = []  # (param index, key, numel)
        for i, q in enumerate(self.q):
            st = opt.state.get(q, {})
            for k in sorted(st):
                if _is_shared_state(k, st[k]):
                    self.layout.append((i, k, st[k].numel()))
        self.state_count = sum(k for _, _, k in self.layout)
        self.fn = STEP_FN(self._step)
        self._lock = threading.Lock()

    def _slice(self, buf, i):
        k = 1
        for s in self.shapes[i]:
            k *= s
        return buf[self.offs[i]:self.offs[i] + k].view(self.shapes[i])

    def _init_state(self, flat):
        """hivemind's way: one step with zero gradients makes the optimizer create its
        state; the parameters are restored and the state zeroed (a fresh optimizer)."""
        if all(self.opt.state.get(q) for q in self.q):
            return  # an optimizer instance that already has its state: kept
        saved = flat.clone()
        lrs = [g.get("lr") for g in self.opt.param_groups]
        with torch.no_grad():
            for q in self.q:
                q.grad = torch.zeros_like(q)
            self.opt.step()
            flat.copy_(saved)
            for q in self.q:
                for k, v in self.opt.state.get(q, {}).items():
                    if isinstance(v, torch.Tensor):
                        v.zero_()
                    elif k == "step":
                        self.opt.state[q][k] = 0
        for g, lr in zip(self.opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr

    def bind(self, params_ptr, shadow_ptr, grad_ptr, state_ptr, state_count, step0):
        """Points the optimizer's tensors at a (new) collab's buffers; the current state
        values are copied into its state buffer first."""
        if state_count != self.state_count:
            raise RuntimeError("libapiary's state buffer has %d floats, expected %d"
                               % (state_count, self.state_count))
        self.params_buf = _view(params_ptr, self.n)
        self.shadow_buf = _view(shadow_ptr, self.n) if shadow_ptr else None
        self.grad_buf = _view(grad_ptr, self.n)
        self.grad_ptr = grad_ptr
        self.state_buf = _view(state_ptr, state_count) if state_count else None
        with torch.no_grad():
            for i, q in enumerate(self.q):
                q.data = self._slice(self.params_buf, i)
                q.grad = self._slice(self.grad_buf, i)
            self._target = params_ptr
            off = 0
            self.state_views = []
            for i, k, cnt in self.layout:
                st = self.opt.state[self.q[i]]
                v = self.state_buf[off:off + cnt].view(st[k].shape)
                v.copy_(st[k])
                st[k] = v
                self.state_views.append(v)
                off += cnt
        self.set_step(step0)
        self.bound = True

    def set_step(self, step):
        for q in self.q:
            st = self.opt.state.get(q)
            if st and "step" in st:
                if isinstance(st["step"], torch.Tensor):
                    st["step"].fill_(step)
                else:
                    st["step"] = step

    def catch_up_scheduler(self, epoch):
        s = self.scheduler
        if s is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while s.last_epoch < epoch:
                s.step()

    def _repoint(self, ptr):
        buf = self.params_buf if ptr == self.params_buf.data_ptr() else self.shadow_buf
        if buf is None or buf.data_ptr() != ptr:
            raise RuntimeError("libapiary asked for a step on an unknown buffer")
        for i, q in enumerate(self.q):
            q.data = self._slice(buf, i)
        self._target = ptr

    def _step(self, arg, params, grad, epoch, step):
        if not self.bound:
            return _AP_EINVAL  # shutting down: the buffers are about to go
        try:
            with torch.no_grad():
                if grad != self.grad_ptr:
                    raise RuntimeError("libapiary's averaged gradient is not in its buffer")
                if params != self._target:
                    self._repoint(params)
                self.catch_up_scheduler(epoch)
                self.set_step(step)
                self.opt.step()
                self._keep_state_views()
                # hivemind: the scheduler steps once per global epoch, after the step
                self.catch_up_scheduler(epoch + 1)
            self.calls += 1
            return 0
        except BaseException as e:  # noqa: B902 - reported to the training thread
            self.error = e
            try:
                sys.stderr.write("apiary.Optimizer: the torch optimizer's step failed: %r\n" % e)
            except Exception:
                pass
            return _AP_EINVAL

    def _keep_state_views(self):
        """An optimizer that replaced a state tensor instead of updating it in place: its
        values go back into libapiary's buffer and the view is restored."""
        for (i, k, _), v in zip(self.layout, self.state_views):
            st = self.opt.state[self.q[i]]
            cur = st.get(k)
            if cur is not v:
                if isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    v.copy_(cur)
                st[k] = v

    def detach(self):
        """Before the collab's buffers are freed: the state becomes ordinary tensors, the
        optimizer's parameters view the model's parameters again, no gradient."""
        self.bound = False
        with torch.no_grad():
            for (i, k, _), v in zip(self.layout, self.state_views):
                st = self.opt.state[self.q[i]]
                st[k] = st[k].clone() if st.get(k) is not None else v.clone()
            self.state_views = []
            for i, q in enumerate(self.q):
                q.data = self._slice(self.flat, i)
                q.grad = None
            self._target = self.flat.data_ptr()

    def after_load(self):
        """opt.load_state_dict replaced the state tensors: copy them into the buffer."""
        with torch.no_grad():
            self._keep_state_views()
