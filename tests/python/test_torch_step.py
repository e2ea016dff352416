"""The torch optimizer makes the step (ap_collab_new_custom): equivalence with plain torch
(Adam, a user-defined optimizer), the scheduler stepping per global epoch, the optimizer's
state viewing libapiary's buffer, state_dict()/load_state_dict() with the optimizer state,
a joining peer downloading the torch optimizer's state."""
import ctypes
import functools

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

import apiary  # noqa: E402
from apiary import _lib as C  # noqa: E402
from model import make_model, global_batch  # noqa: E402

LOOP = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def dht():
    d = apiary.DHT(host_maddrs=LOOP)
    yield d
    d.shutdown()


def flat_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(opt, model, epochs, first=0):
    for e in range(first, first + epochs):
        x, y = global_batch(e, 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def reference(make_opt, epochs):
    model = make_model()
    opt = make_opt(model.parameters())
    train(opt, model, epochs)
    return model, opt


def reference_sched(make_opt, make_sched, epochs):
    model = make_model()
    opt = make_opt(model.parameters())
    sched = make_sched(opt)
    for e in range(epochs):
        x, y = global_batch(e, 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model, opt, sched


class SignMomentum(torch.optim.Optimizer):
    """A user-defined optimizer (not known to libapiary): its state must still be shared."""

    def __init__(self, params, lr=0.01, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "avg" not in st:
                    st["avg"] = torch.zeros_like(p)
                    st["count"] = torch.zeros(1)
                st["avg"].mul_(g["beta"]).add_(p.grad, alpha=1 - g["beta"])
                st["count"] += 1
                p.add_(st["avg"].sign(), alpha=-g["lr"])


def state_buffer(opt):
    L = C.lib()
    state, count = C.c_void_p(), C.c_size_t()
    L.ap_collab_buffers(opt._c, None, None, ctypes.byref(state), ctypes.byref(count))
    return state.value, count.value


@pytest.mark.parametrize("make_opt", [
    functools.partial(torch.optim.Adam, lr=0.01),
    functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1, amsgrad=True),
    functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
    functools.partial(torch.optim.RMSprop, lr=0.01, centered=True),
    functools.partial(SignMomentum, lr=0.01),
], ids=["adam", "adamw-amsgrad", "sgd-nesterov", "rmsprop", "user-defined"])
def test_the_torch_optimizer_makes_the_step(dht, make_opt):
    model = make_model()
    opt = apiary.Optimizer(dht=dht, run_id="ts", target_batch_size=4, batch_size_per_step=4,
                           optimizer=make_opt, params=model.parameters(),
                           matchmaking_time=0.1)
    assert opt.opt.__class__ is make_opt.func
    ref_model, ref_opt = reference(make_opt, 4)
    train(opt, model, 4)
    assert opt.local_epoch == 4
    assert torch.allclose(flat_of(model), flat_of(ref_model), atol=1e-6, rtol=0)
    # the optimizer's shared state views libapiary's state buffer
    sptr, count = state_buffer(opt)
    views = [v for st in opt.opt.state.values() for k, v in st.items()
             if isinstance(v, torch.Tensor) and v.dim() > 0 and k != "step"]
    assert sum(v.numel() for v in views) == count
    for v in views:
        assert sptr <= v.data_ptr() < sptr + 4 * count
    # and equals the reference optimizer's state
    for q, p in zip(opt._ts.q, ref_model.parameters()):
        for k, v in ref_opt.state[p].items():
            mine = opt.opt.state[q][k]
            if isinstance(v, torch.Tensor):
                assert torch.allclose(mine, v, atol=1e-6, rtol=0), k
    opt.shutdown()


def test_scheduler_steps_per_global_epoch(dht):
    make_opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5)
    make_sched = functools.partial(torch.optim.lr_scheduler.LambdaLR,
                                   lr_lambda=lambda e: 0.5 ** e)
    model = make_model()
    opt = apiary.Optimizer(dht=dht, run_id="sched", target_batch_size=4,
                           batch_size_per_step=4, optimizer=make_opt, params=model.parameters(),
                           scheduler=make_sched, matchmaking_time=0.1)
    ref_model, ref_opt, ref_sched = reference_sched(make_opt, make_sched, 3)
    train(opt, model, 3)
    assert opt.local_epoch == 3
    assert opt.scheduler.last_epoch == 3
    assert opt.opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert torch.allclose(flat_of(model), flat_of(ref_model), atol=1e-6, rtol=0)
    opt.shutdown()


def test_state_dict_carries_the_optimizer_state(dht):
    make_opt = functools.partial(torch.optim.Adam, lr=0.01)
    make_sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    model = make_model()
    opt = apiary.Optimizer(dht=dht, run_id="sd", target_batch_size=4, batch_size_per_step=4,
                           optimizer=make_opt, params=model.parameters(), scheduler=make_sched,
                           matchmaking_time=0.1)
    train(opt, model, 3)
    sd = opt.state_dict()
    assert sd["local_epoch"] == 3 and sd["optim_step"] == 3
    assert sd["scheduler"]["last_epoch"] == 3
    st0 = sd["optimizer"]["state"][0]
    assert int(st0["step"]) == 3 and st0["exp_avg"].abs().sum() > 0
    # a copy, not the live views
    sptr, count = state_buffer(opt)
    assert not sptr <= st0["exp_avg"].data_ptr() < sptr + 4 * count
    opt.shutdown()

    # a fresh peer resumes from it and goes on as the uninterrupted reference
    other = apiary.DHT(host_maddrs=LOOP)
    try:
        m2 = make_model()
        o2 = apiary.Optimizer(dht=other, run_id="sd", target_batch_size=4,
                              batch_size_per_step=4, optimizer=make_opt,
                              params=m2.parameters(), scheduler=make_sched,
                              matchmaking_time=0.1)
        o2.load_state_dict(sd)
        assert o2.local_epoch == 3
        # the loaded state lives in libapiary's buffer again
        sptr, count = state_buffer(o2)
        q0 = o2._ts.q[0]
        assert sptr <= o2.opt.state[q0]["exp_avg"].data_ptr() < sptr + 4 * count
        train(o2, m2, 2, first=3)
        ref_model, _, _ = reference_sched(make_opt, make_sched, 5)
        assert torch.allclose(flat_of(m2), flat_of(ref_model), atol=1e-6, rtol=0)
        assert o2.scheduler.last_epoch == 5
        with pytest.raises(ValueError, match="local_epoch"):
            o2.load_state_dict(dict(sd, local_epoch=-1))
        o2.shutdown()
    finally:
        other.shutdown()


def test_joining_peer_downloads_the_torch_state(dht):
    make_opt = functools.partial(torch.optim.Adam, lr=0.01)
    model = make_model()
    a = apiary.Optimizer(dht=dht, run_id="join", target_batch_size=4, batch_size_per_step=4,
                         optimizer=make_opt, params=model.parameters(), matchmaking_time=0.1)
    train(a, model, 3)
    other = apiary.DHT(initial_peers=dht.get_visible_maddrs(), host_maddrs=LOOP)
    try:
        torch.manual_seed(123)
        m2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                 torch.nn.Linear(16, 2))  # other initial values
        b = apiary.Optimizer(dht=other, run_id="join", target_batch_size=4,
                             batch_size_per_step=4, optimizer=make_opt,
                             params=m2.parameters(), matchmaking_time=0.1,
                             scheduler=functools.partial(torch.optim.lr_scheduler.StepLR,
                                                         step_size=1, gamma=0.5))
        assert b.local_epoch == 3
        assert b.scheduler.last_epoch == 3  # caught up with the downloaded epoch
        assert b.opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 3)
        assert b.stats()["state_loads"] == 1
        assert torch.equal(flat_of(m2), flat_of(model))
        for qa, qb in zip(a._ts.q, b._ts.q):
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(a.opt.state[qa][k], b.opt.state[qb][k])
        assert b.state_dict()["optim_step"] == 3
        assert int(b.state_dict()["optimizer"]["state"][0]["step"]) == 3
        b.shutdown()
    finally:
        other.shutdown()
        a.shutdown()


def test_native_step_keeps_libapiary_solver(dht):
    model = make_model()
    opt = apiary.Optimizer(dht=dht, run_id="native", target_batch_size=4,
                           batch_size_per_step=4,
                           optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           params=model.parameters(), matchmaking_time=0.1, native_step=True)
    ref_model, _ = reference(functools.partial(torch.optim.SGD, lr=0.1), 3)
    train(opt, model, 3)
    assert opt._ts is None
    assert torch.allclose(flat_of(model), flat_of(ref_model), atol=1e-6, rtol=0)
    opt.shutdown()


def test_a_failing_step_is_reported(dht):
    class Broken(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Broken.calls += 1
            if Broken.calls > 1:  # the first call initialises the state
                raise ValueError("boom")
            return super().step(closure)

    model = make_model()
    opt = apiary.Optimizer(dht=dht, run_id="broken", target_batch_size=4,
                           batch_size_per_step=4,
                           optimizer=lambda p: Broken(p, lr=0.1, momentum=0.9),
                           params=model.parameters(), matchmaking_time=0.1)
    before = opt.flat_parameters.clone()
    with pytest.raises(RuntimeError, match="boom"):
        train(opt, model, 1)
    assert torch.equal(before, opt.flat_parameters)
    opt.shutdown()
