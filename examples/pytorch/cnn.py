"""A small CNN trained by several processes with apiary.Optimizer, on a synthetic image set
(shapes on a noisy background, generated from a fixed seed: every peer has the same data).

    # first peer
    PYTHONPATH=python /usr/bin/python3 examples/pytorch/cnn.py
    # others: the address the first one printed
    PYTHONPATH=python /usr/bin/python3 examples/pytorch/cnn.py --initial-peers /ip4/.../p2p/12D3...
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import apiary


def synthetic_batch(g, n):
    """n 16x16 images of 4 classes: a bright square, a cross, a horizontal or vertical bar."""
    x = torch.randn(n, 1, 16, 16, generator=g) * 0.3
    y = torch.randint(0, 4, (n,), generator=g)
    for i in range(n):
        r, c = torch.randint(3, 12, (2,), generator=g).tolist()
        k = int(y[i])
        if k == 0:
            x[i, 0, r - 2:r + 2, c - 2:c + 2] += 1.0
        elif k == 1:
            x[i, 0, r, c - 3:c + 4] += 1.0
            x[i, 0, r - 3:r + 4, c] += 1.0
        elif k == 2:
            x[i, 0, r, 1:15] += 1.0
        else:
            x[i, 0, 1:15, c] += 1.0
    return x, y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    p.add_argument("--run-id", default="cnn")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--target-batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30, help="global epochs to train")
    p.add_argument("--seed", type=int, default=None, help="data seed (default: random)")
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    args = p.parse_args()

    torch.manual_seed(0)  # the same initialisation on every first peer
    model = Net()
    dht = apiary.DHT(initial_peers=args.initial_peers, host_maddrs=[args.listen], start=True)
    print("to join: --initial-peers", " ".join(dht.get_visible_maddrs()), flush=True)
    opt = apiary.Optimizer(dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
                           batch_size_per_step=args.batch_size,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                           params=model.parameters(), matchmaking_time=args.matchmaking_time)
    g = torch.Generator().manual_seed(args.seed if args.seed is not None else
                                      int(time.time() * 1000) % 2**31)
    xt, yt = synthetic_batch(torch.Generator().manual_seed(12345), 256)
    last = -1
    while opt.local_epoch < args.epochs:
        x, y = synthetic_batch(g, args.batch_size)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if opt.local_epoch != last:
            last = opt.local_epoch
            with torch.no_grad():
                acc = (model(xt).argmax(1) == yt).float().mean().item()
            print("epoch %d loss %.4f test accuracy %.3f" % (last, float(loss), acc), flush=True)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
