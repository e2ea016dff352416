#!/usr/bin/env python3
"""Baseline for `apiary bench allreduce`: PyTorch gloo's all_reduce of a float32
vector across P processes on 127.0.0.1 (TCP, no encryption), then the division
by P that makes it a mean. Prints one JSON line:
  {"round_s": median seconds of a measured round (slowest rank),
   "cpu_s": median CPU seconds of a round summed over the ranks, "peers", "elems"}
Used only for measurement; needs python3-torch (Debian) with gloo."""
import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.peers)
    x = torch.empty(args.elems, dtype=torch.float32)
    times, cpus = [], []
    for r in range(args.warmup + args.rounds):
        x.fill_(float(rank + 1))
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        x.div_(args.peers)
        t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        # the round takes as long as its slowest rank; CPU is summed
        tmax = t.clone()
        dist.all_reduce(tmax[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(t[1:], op=dist.ReduceOp.SUM)
        want = (args.peers + 1) / 2.0
        if abs(float(x[0]) - want) > 1e-6 or abs(float(x[-1]) - want) > 1e-6:
            raise SystemExit(f"rank {rank}: wrong mean {float(x[0])} (want {want})")
        if r >= args.warmup:
            times.append(float(tmax[0]))
            cpus.append(float(t[1]))
    if rank == 0:
        q.put({"round_s": statistics.median(times), "cpu_s": statistics.median(cpus),
               "peers": args.peers, "elems": args.elems, "rounds": times})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--elems", type=int, default=1 << 24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(args.peers)]
    for p in procs:
        p.start()
    out = q.get(timeout=1200)
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
