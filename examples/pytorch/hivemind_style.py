"""A training script written for hivemind; the only change is its first import line.

    PYTHONPATH=python /usr/bin/python3 examples/pytorch/hivemind_style.py [--initial-peers MADDR ...]

Kept as a test (tests/python/test_examples.py): the covered API runs unchanged."""
import apiary as hivemind  # was: import hivemind

import argparse
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--target-batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       start=True)
    print("To join the training, use initial_peers =",
          [str(addr) for addr in dht.get_visible_maddrs()])

    opt = hivemind.Optimizer(
        dht=dht,                          # use a DHT that is connected with other peers
        run_id="my_cifar_run",            # unique identifier of this collaborative run
        batch_size_per_step=16,           # each call to opt.step adds this many samples
        target_batch_size=args.target_batch_size,  # after peers collectively process this
        optimizer=opt,                    # wrap the SGD optimizer defined above
        scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=4, gamma=0.5),  # per epoch
        use_local_updates=False,          # average gradients, then step
        matchmaking_time=0.5,             # when averaging parameters, gather peers in background
        averaging_timeout=10.0,           # give up on averaging if not successful in this many s
        grad_compression=hivemind.Float16Compression(),
        verbose=True,
    )

    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    first = last = None
    for step in range(args.steps):
        x = torch.randn(16, 16, generator=g)
        y = (x @ w).argmax(dim=1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        first = float(loss) if first is None else first
        last = float(loss)
    print("epochs", opt.local_epoch, "loss", first, "->", last)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
