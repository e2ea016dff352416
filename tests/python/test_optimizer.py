"""apiary.Optimizer: equivalence with one process at the global batch, zero copy, a peer
killed mid-run, a late peer loading the state, delayed updates, bad arguments."""
import json
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

import apiary  # noqa: E402
from model import make_model, global_batch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LOOP = ["/ip4/127.0.0.1/tcp/0"]


class Worker:
    def __init__(self, **args):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "collab_worker.py"),
                                      json.dumps(args)], stdout=subprocess.PIPE, text=True)
        self.lines = []

    def wait_for(self, prefix, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("worker exited (%s) before %r; output: %s" %
                                     (self.proc.wait(), prefix, self.lines[-5:]))
            self.lines.append(line.strip())
            if line.startswith(prefix):
                return line.split()
        raise AssertionError("no %r within %d s" % (prefix, timeout))

    def finish(self, timeout=180):
        self.wait_for("DONE", timeout)
        assert self.proc.wait(60) == 0

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_peers(tmp_path, n, steps, mode="exact", b=4):
    ws = []
    try:
        first = Worker(index=0, peers=n, batch=b, steps=steps, mode=mode,
                       out=str(tmp_path / "p0.pt"))
        ws.append(first)
        addr = first.wait_for("ADDR")[1]
        for i in range(1, n):
            ws.append(Worker(index=i, peers=n, batch=b, steps=steps, mode=mode,
                             out=str(tmp_path / ("p%d.pt" % i)), initial_peers=[addr]))
        for w in ws:
            w.finish()
        return [torch.load(tmp_path / ("p%d.pt" % i)) for i in range(n)], ws
    finally:
        for w in ws:
            w.kill()


def reference(n, b, steps):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for e in range(steps):
        x, y = global_batch(e, n * b)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("n", [2, 4])
def test_peers_equal_one_process_at_the_global_batch(tmp_path, n):
    steps = 3
    got, _ = run_peers(tmp_path, n, steps)
    ref = reference(n, 4, steps)
    for p in got:
        assert torch.allclose(p, ref, atol=1e-5, rtol=0), (p - ref).abs().max()


def test_delayed_updates_train(tmp_path):
    got, ws = run_peers(tmp_path, 2, 6, mode="delayed")
    losses = [float(line.split()[3]) for line in ws[0].lines if line.startswith("EPOCH")]
    assert len(losses) >= 6
    assert min(losses[-3:]) < losses[0]


def test_peer_killed_mid_run(tmp_path):
    ws = []
    try:
        a = Worker(index=0, peers=3, batch=4, steps=10, mode="free", out=str(tmp_path / "a.pt"))
        ws.append(a)
        addr = a.wait_for("ADDR")[1]
        for i in (1, 2):
            ws.append(Worker(index=i, peers=3, batch=4, steps=10, mode="free",
                             out=str(tmp_path / ("w%d.pt" % i)), initial_peers=[addr]))
        # train together for an epoch or two, then kill one peer
        while True:
            e = int(ws[2].wait_for("EPOCH")[1])
            if e >= 2:
                break
        ws[2].kill()
        ws[0].finish(240)
        ws[1].finish(240)
        p0, p1 = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "w1.pt")
        assert torch.isfinite(p0).all() and torch.isfinite(p1).all()
    finally:
        for w in ws:
            w.kill()


def test_late_peer_loads_the_state(tmp_path):
    ws = []
    try:
        a = Worker(index=0, peers=2, batch=4, steps=1000, mode="free",
                   out=str(tmp_path / "a.pt"))
        ws.append(a)
        addr = a.wait_for("ADDR")[1]
        ws.append(Worker(index=1, peers=2, batch=4, steps=1000, mode="free",
                         out=str(tmp_path / "b.pt"), initial_peers=[addr]))
        while int(a.wait_for("EPOCH")[1]) < 3:
            pass
        late = Worker(index=1, peers=2, batch=4, steps=0, mode="free",
                      out=str(tmp_path / "late.pt"), initial_peers=[addr])
        ws.append(late)
        start_epoch = int(late.wait_for("START")[1])
        assert start_epoch >= 3
    finally:
        for w in ws:
            w.kill()


@pytest.fixture
def dht():
    d = apiary.DHT(host_maddrs=LOOP)
    yield d
    d.shutdown()


def sgd(p):
    return torch.optim.SGD(p, lr=0.1)


def test_zero_copy_buffers(dht):
    model = make_model()
    opt = apiary.Optimizer(dht=dht, run_id="zc", target_batch_size=4, batch_size_per_step=4,
                           optimizer=sgd, params=model.parameters(), matchmaking_time=0.1)
    flat, grad = opt.flat_parameters, opt.flat_gradients
    ptrs = [(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()]
    off = 0
    for p, (pp, gp) in zip(model.parameters(), ptrs):
        assert pp == flat.data_ptr() + 4 * off and gp == grad.data_ptr() + 4 * off
        off += p.numel()
    before = flat.clone()
    for e in range(3):
        x, y = global_batch(e, 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.local_epoch == 3
    assert not torch.equal(before, flat)  # the C side stepped in place
    assert [(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()] == ptrs
    assert opt.flat_parameters.data_ptr() == flat.data_ptr()
    # one process alone equals torch's SGD at the same batch
    assert torch.allclose(flat, reference(1, 4, 3), atol=1e-6, rtol=0)
    opt.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        opt.step()
    with pytest.raises(RuntimeError, match="shut down"):
        opt.local_epoch


def test_bad_arguments(dht):
    m = make_model()
    ok = dict(dht=dht, run_id="bad", target_batch_size=8, batch_size_per_step=4, optimizer=sgd,
              params=m.parameters())
    cases = [
        (TypeError, "dht", dict(dht="x")),
        (TypeError, "run_id", dict(run_id=5)),
        (ValueError, "run_id", dict(run_id="")),
        (TypeError, "target_batch_size", dict(target_batch_size=1.5)),
        (ValueError, "target_batch_size", dict(target_batch_size=0)),
        (ValueError, "batch_size_per_step", dict(batch_size_per_step=-1)),
        (TypeError, "optimizer", dict(optimizer=3)),
        (TypeError, "not supported", dict(optimizer=lambda p: torch.optim.Adagrad(p),
                                          native_step=True)),
        (TypeError, "scheduler", dict(scheduler=lambda o: None, native_step=True)),
        (TypeError, "scheduler", dict(scheduler=3)),
        (ValueError, "params is required", dict(params=None)),
        (TypeError, "float32", dict(params=[torch.nn.Parameter(torch.zeros(3,
                                                                              dtype=torch.float64))])),
        (TypeError, "not a tensor", dict(params=[1, 2])),
        (ValueError, "empty", dict(params=[])),
        (TypeError, "grad_compression", dict(grad_compression="fp16")),
        (TypeError, "unexpected keyword", dict(bogus=1)),
        (TypeError, "scheduler", dict(scheduler=lambda o: None)),
        (ValueError, "matchmaking_time", dict(matchmaking_time=-1)),
        (TypeError, "dht_matchmaking", dict(dht_matchmaking=1)),
    ]
    for exc, match, over in cases:
        args = dict(ok)
        args.update(over)
        if "params" not in over:
            args["params"] = make_model().parameters()
        with pytest.raises(exc, match=match):
            apiary.Optimizer(**args)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            apiary.Optimizer(**dict(ok, params=[torch.zeros(3, device="cuda")]))
    with pytest.raises(ValueError, match="on meta"):
        apiary.Optimizer(**dict(ok, params=[torch.zeros(3, device="meta")]))
    opt = apiary.Optimizer(**dict(ok, params=m.parameters()))
    for bad, exc in (("4", TypeError), (0, ValueError), (True, TypeError)):
        with pytest.raises(exc, match="batch_size"):
            opt.step(batch_size=bad)
    for p in m.parameters():
        p.grad = None
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()
    opt.shutdown()


def test_lone_peer_does_not_wait_for_a_group(dht):
    # alone in its run (no other record for the first seconds either), a peer steps as
    # soon as its epoch is due: no matchmaking window per epoch, with either way of
    # forming groups
    for mm in (True, False):
        m = make_model()
        opt = apiary.Optimizer(dht=dht, run_id="lone_%d" % mm, target_batch_size=4,
                               batch_size_per_step=4, optimizer=sgd, params=m.parameters(),
                               matchmaking_time=3.0, dht_matchmaking=mm)
        assert opt._cfg.dht_matchmaking is mm
        x = torch.randn(4, 8)
        waited = None
        for k in range(12):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
            st = opt.stats()
            if st["lone_epochs"] and waited is None:
                waited = st["group_wait_us"]
        assert opt.local_epoch == 12
        assert st["lone_epochs"] >= 8, st
        assert st["group_wait_us"] == waited  # none since the first lone epoch
        assert st["last_group_size"] == 1
        opt.shutdown()


def test_parameter_list_mismatch_is_refused(dht):
    a = apiary.Optimizer(dht=dht, run_id="mm", target_batch_size=8, batch_size_per_step=4,
                         optimizer=sgd, params=make_model().parameters(), matchmaking_time=0.1)
    try:
        other = apiary.DHT(initial_peers=dht.get_visible_maddrs(), host_maddrs=LOOP)
        try:
            big = torch.nn.Linear(8, 3)
            with pytest.raises(ValueError, match="refused"):
                b = apiary.Optimizer(dht=other, run_id="mm", target_batch_size=8,
                                     batch_size_per_step=4, optimizer=sgd,
                                     params=big.parameters(), matchmaking_time=0.1)
                x = torch.randn(4, 8)
                for _ in range(3):
                    b.zero_grad()
                    big(x).sum().backward()
                    b.step()
        finally:
            other.shutdown()
    finally:
        a.shutdown()


def test_state_averaging_compression_is_the_runs(dht):
    # the state rounds' codec is part of the run's configuration: a peer with another one
    # is refused, the difference named
    m = make_model()
    a = apiary.Optimizer(dht=dht, run_id="sac", target_batch_size=8, batch_size_per_step=4,
                         optimizer=sgd, params=m.parameters(), matchmaking_time=0.1,
                         state_averaging_compression=apiary.Float16Compression())
    assert a._cfg.state_codec == apiary.Float16Compression.codec
    assert a._cfg.codec == apiary.NoCompression.codec
    try:
        other = apiary.DHT(initial_peers=dht.get_visible_maddrs(), host_maddrs=LOOP)
        try:
            m2 = make_model()
            with pytest.raises(ValueError, match="state compression: none"):
                b = apiary.Optimizer(dht=other, run_id="sac", target_batch_size=8,
                                     batch_size_per_step=4, optimizer=sgd,
                                     params=m2.parameters(), matchmaking_time=0.1)
                x = torch.randn(4, 8)
                for _ in range(3):
                    b.zero_grad()
                    m2(x).sum().backward()
                    b.step()
        finally:
            other.shutdown()
    finally:
        a.shutdown()
    with pytest.raises(TypeError, match="state_averaging_compression"):
        apiary.Optimizer(dht=dht, run_id="sac2", target_batch_size=8, batch_size_per_step=4,
                         optimizer=sgd, params=make_model().parameters(),
                         state_averaging_compression="fp16")
