"""`apiary bench python`: the cost of the Python package's training step.

python_step_overhead: seconds per Optimizer.step() of apiary.Optimizer (the Python
layer: argument checks, the gradient-pointer check, the ctypes call) over the same
libapiary step called directly (ap_collab_submit_sync on the same flat gradient
buffer), for a ~1M-parameter torch MLP; the epoch never completes, so both time the
accumulation libapiary does per local batch. Forward and backward are torch's and
the same either way, so they are left out of both.

usage: python_bench.py [--json] [--quick]
"""
import ctypes
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402

import apiary  # noqa: E402
from apiary import _lib as C  # noqa: E402


def emit(js, metric, value, unit, baseline=None, **fields):
    if js:
        d = {"bench": "python", "metric": metric, "value": float("%.6g" % value), "unit": unit}
        if baseline is not None:
            d["baseline"] = float("%.6g" % baseline)
            d["ratio"] = round(value / baseline, 4) if baseline else 0.0
        d.update(fields)
        print(json.dumps(d, separators=(",", ":")))
    else:
        line = "%-28s %14.4g %-8s" % (metric, value, unit)
        if baseline is not None:
            line += " baseline %.4g ratio %.3f" % (baseline, value / baseline if baseline else 0)
        if fields:
            line += "  " + " ".join("%s=%s" % kv for kv in fields.items())
        print(line)
    sys.stdout.flush()


def main():
    js = "--json" in sys.argv
    quick = "--quick" in sys.argv
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512))
    n = sum(p.numel() for p in model.parameters())
    dht = apiary.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    opt = apiary.Optimizer(dht=dht, run_id="bench_python", target_batch_size=1 << 40,
                           batch_size_per_step=1, optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                           params=model.parameters())
    x = torch.randn(8, 512)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    L = C.lib()
    c = opt._c
    gptr = ctypes.cast(opt.flat_gradients.data_ptr(), C.P(C.c_float))
    steps = 50 if quick else 400
    rounds = 3 if quick else 7
    t_py, t_c = [], []
    for _ in range(rounds):  # interleaved so load changes hit both alike
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        t_py.append((time.perf_counter() - t0) / steps)
        t0 = time.perf_counter()
        for _ in range(steps):
            L.ap_collab_submit_sync(c, gptr, 1, 0.0)
        t_c.append((time.perf_counter() - t0) / steps)
    py, cc = sorted(t_py)[len(t_py) // 2], sorted(t_c)[len(t_c) // 2]
    emit(js, "python_step_overhead", py / cc, "ratio", params=n, python_step_s=py,
         c_step_s=cc)
    emit(js, "python_step_s", py, "s", baseline=cc, params=n)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
