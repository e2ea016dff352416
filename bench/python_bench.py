"""`apiary bench python`: the cost of the Python package's training step.

python_step_overhead: seconds per Optimizer.step() of apiary.Optimizer (the Python
layer: argument checks, the gradient-pointer check, the ctypes call) over the same
libapiary step called directly (ap_collab_submit_sync on the same flat gradient
buffer), for a ~1M-parameter torch MLP; the epoch never completes, so both time the
accumulation libapiary does per local batch. Forward and backward are torch's and
the same either way, so they are left out of both.

scaling_efficiency (field peers: 2, 4): global samples/s of N Python peer processes
(apiary.Optimizer with torch's Adam making the step, delayed updates, a ~260k-parameter
torch MLP, batch 32, target_batch_size 16384 x N: epochs of ~3 s, as `apiary bench
train`'s last seconds) over N times the samples/s of one peer measured in the same run,
on loopback. As `apiary bench train`, every peer sleeps 3x the CPU time of each batch
after it (a slower accelerator), so that four peers need about one of the machine's
cores. Each run follows a control: N processes of the same loop with no collaboration
(torch's Adam stepping every 16384 samples); alone_ceiling is the control's own scaling
(what contention among N torch processes leaves on this machine) and scaling_over_alone
the collaboration's samples/s over the control's. time_efficiency: the peers' mean share
of wall time spent in forward/backward + that sleep, over the single peer's (the wall
time the collaboration costs them, independent of how much CPU other load leaves).
--quick: 15 s windows and 4096 samples per peer per epoch.

usage: python_bench.py [--json] [--quick] [--no-scaling]
       python_bench.py --peer JSON   (one peer of the scaling run; internal)
"""
import ctypes
import json
import os
import subprocess
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


def peer(a):
    """One peer of the scaling run: trains from a["t0"] (wall clock) until a["t1"] and
    prints its samples and time shares in the window as JSON."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    b = 32
    alone = a.get("alone", False)
    if alone:
        # the control: the same loop with no collaboration, torch's Adam stepping every
        # per_peer_target samples (the ceiling the machine allows N such processes)
        dht = None
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        print("ADDR -", flush=True)
    else:
        dht = apiary.DHT(initial_peers=a.get("initial_peers") or None,
                         host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        print("ADDR", dht.get_visible_maddrs()[0], flush=True)
        opt = apiary.Optimizer(dht=dht, run_id="bench_scaling_%d" % a["n"],
                               target_batch_size=a["per_peer_target"] * a["n"],
                               batch_size_per_step=b,
                               optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                               params=model.parameters(), delay_optimizer_step=True,
                               matchmaking_time=0.5, average_state_every=0)
    g = torch.Generator().manual_seed(a["index"])
    x = torch.randn(b, 256, generator=g)
    y = torch.randn(b, 256, generator=g)
    samples, busy, in_step, epoch0, acc, local_epoch = 0, 0.0, 0.0, None, 0, 0
    t0, t1 = a["t0"], a["t1"]
    while not alone and time.time() < t0 - 2 and opt.stats()["peers"] < a["n"]:
        time.sleep(0.05)
    while True:
        now = time.time()
        if now >= t1:
            break
        c0 = time.thread_time()
        w0 = time.perf_counter()
        opt.zero_grad(set_to_none=False) if alone else opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        cpu = time.thread_time() - c0
        time.sleep(3 * cpu)  # a slower accelerator
        work = time.perf_counter() - w0
        s0 = time.perf_counter()
        if alone:
            acc += b
            if acc >= a["per_peer_target"]:
                opt.step()
                acc, local_epoch = 0, local_epoch + 1
        else:
            opt.step()
        if now >= t0:
            if epoch0 is None:
                epoch0 = local_epoch if alone else opt.local_epoch
            samples += b
            busy += work
            in_step += time.perf_counter() - s0
    if alone:
        print("RESULT", json.dumps({"samples": samples, "busy": busy, "window": t1 - t0,
                                    "in_step": in_step, "epoch": local_epoch,
                                    "epochs_in_window": local_epoch - (epoch0 or 0),
                                    "held": 0, "group_wait_s": 0.0}), flush=True)
        return
    st = opt.stats()
    print("RESULT", json.dumps({"samples": samples, "busy": busy, "window": t1 - t0,
                                "in_step": in_step, "epoch": st["epoch"],
                                "epochs_in_window": st["epoch"] - (epoch0 or 0),
                                "dropped": st["samples_dropped"], "held": st["submits_held"],
                                "group_wait_s": st["group_wait_us"] / 1e6,
                                "averaging_s": st["averaging_us"] / 1e6}), flush=True)
    opt.shutdown()
    dht.shutdown()


# samples per peer per epoch: ~3 s of one peer's training, as `apiary bench train`'s
# epochs last seconds (512 samples per peer at its ~93 samples/s); with 256 an epoch took
# 50 ms and the bench measured an all-reduce every 50 ms rather than the training
PER_PEER_TARGET = 16384
PER_PEER_TARGET_QUICK = 4096  # --quick: windows of 15 s still hold several epochs


def run_scaling(n, dur, warm, target, alone=False):
    procs = []
    try:
        t0 = time.time() + warm + 3 * n
        t1 = t0 + dur
        addrs = []  # every earlier peer is an initial peer: one busy peer does not stop a join
        for i in range(n):
            a = {"index": i, "n": n, "t0": t0, "t1": t1, "per_peer_target": target,
                 "alone": alone, "initial_peers": list(addrs) or None}
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--peer",
                                  json.dumps(a)], stdout=subprocess.PIPE, text=True)
            procs.append(p)
            line = p.stdout.readline().split()
            if not line or line[0] != "ADDR":
                raise RuntimeError("scaling peer %d did not start" % i)
            if not alone:
                addrs.append(line[1])
        res = []
        for p in procs:
            out = p.communicate(timeout=dur + warm + 3 * n + 120)[0]
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    res.append(json.loads(line[7:]))
        if len(res) != n:
            raise RuntimeError("%d of %d scaling peers reported (exit codes %s)" %
                               (len(res), n, [p.returncode for p in procs]))
        sps = sum(r["samples"] for r in res) / dur
        share = sum(r["busy"] / r["window"] for r in res) / n
        return sps, share, res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--peer":
        peer(json.loads(sys.argv[2]))
        return
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
    # Paired single steps, order alternating: each pair is one Optimizer.step() and one
    # direct call, back to back (a few milliseconds apart), so a change of load hits both
    # sides of a pair alike; the figure is the median of the pairs' ratios. An A/A figure
    # (the direct call against itself, paired the same way) gives the method's own spread.
    # CPU time of the process (every thread: the Python layer's work plus libapiary's) is
    # reported alongside: it does not count waiting for a CPU that other jobs hold.
    pairs = 200 if quick else 1000
    submit = L.ap_collab_submit_sync
    clock, cpu = time.perf_counter, time.process_time

    def one(fn):
        c0, t0 = cpu(), clock()
        fn()
        return clock() - t0, cpu() - c0

    def py_step():
        opt.step()

    def c_step():
        submit(c, gptr, 1, 0.0)

    for _ in range(20):  # warm both paths
        py_step()
        c_step()
    ratios, aa, t_py, t_c, cp_sum, cc_sum = [], [], [], [], 0.0, 0.0
    for r in range(pairs):
        if r % 2:
            (wc, cc), (wp, cp) = one(c_step), one(py_step)
        else:
            (wp, cp), (wc, cc) = one(py_step), one(c_step)
        (wa, _), (wb, _) = one(c_step), one(c_step)
        ratios.append(wp / wc)
        aa.append(wa / wb if r % 2 else wb / wa)
        t_py.append(wp)
        t_c.append(wc)
        cp_sum += cp
        cc_sum += cc

    def med(v):
        return sorted(v)[len(v) // 2]

    py, cc = med(t_py), med(t_c)
    emit(js, "python_step_overhead", med(ratios), "ratio", params=n, python_step_s=py,
         c_step_s=cc, cpu_ratio=round(cp_sum / cc_sum if cc_sum > 0 else 1.0, 4),
         aa_ratio=round(med(aa), 4), pairs=pairs)
    emit(js, "python_step_s", py, "s", baseline=cc, params=n)
    # The Python layer alone: Optimizer.step() with the C call replaced by a no-op (best
    # of 5 runs of 2,000 steps), and the overhead it implies on the C step measured above.
    # Under load the paired figure above swings by several percent either way (an A/A
    # run, the direct call against itself, gives the same spread); this one does not.
    opt._submit = lambda *a: 0
    layer = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            opt.step()
        layer.append((time.perf_counter() - t0) / 2000)
    opt._submit = submit
    emit(js, "python_layer_s", min(layer), "s", params=n)
    emit(js, "python_layer_overhead", (cc + min(layer)) / cc, "ratio", params=n,
         python_layer_s=min(layer), c_step_s=cc)
    opt.shutdown()
    dht.shutdown()
    if "--no-scaling" in sys.argv:
        return
    dur, warm = (15, 5) if quick else (45, 10)
    target = PER_PEER_TARGET_QUICK if quick else PER_PEER_TARGET
    def split(res):
        # where the peers' wall time went besides computing: inside Optimizer.step() (of
        # it, libapiary's held submits waiting for a group: group_wait_s per peer)
        k = len(res)
        return dict(step_share=round(sum(r["in_step"] / r["window"] for r in res) / k, 3),
                    group_wait_s=round(sum(r["group_wait_s"] for r in res) / k, 2),
                    submits_held=sum(r["held"] for r in res))

    # each collaboration of N peers runs right after N processes of the same loop with
    # no collaboration (the control), so both see the same machine: the control's
    # scaling is the ceiling that CPU contention among N processes leaves
    f = dict(slowdown=3, delayed_updates=True)
    alone1, _, _ = run_scaling(1, dur, warm, target, alone=True)
    sps1, share1, res1 = run_scaling(1, dur, warm, target)
    emit(js, "samples_per_s", sps1, "samples/s", peers=1, busy_share=round(share1, 3),
         alone_samples_per_s=round(alone1, 1), **split(res1), **f)
    for n in (2, 4):
        alone, _, _ = run_scaling(n, dur, warm, target, alone=True)
        sps, share, res = run_scaling(n, dur, warm, target)
        emit(js, "samples_per_s", sps, "samples/s", peers=n, busy_share=round(share, 3),
             alone_samples_per_s=round(alone, 1), **split(res), **f)
        ew = sum(r["epochs_in_window"] for r in res) / len(res)
        ceiling = alone / (n * alone1) if alone1 else 0.0
        emit(js, "scaling_efficiency", sps / (n * sps1) if sps1 else 0.0, "ratio", peers=n,
             single_peer_samples_per_s=round(sps1, 1), alone_ceiling=round(ceiling, 3),
             epoch_s=round(dur / ew, 2) if ew else None, **f)
        emit(js, "scaling_over_alone", sps / alone if alone else 0.0, "ratio", peers=n,
             alone_samples_per_s=round(alone, 1), **f)
        emit(js, "time_efficiency", share / share1 if share1 else 0.0, "ratio", peers=n,
             single_peer_busy_share=round(share1, 3), epochs=max(r["epoch"] for r in res),
             **f)

if __name__ == "__main__":
    main()
