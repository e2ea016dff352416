"""A character-level transformer on data/corpus.txt, trained by several processes with
apiary.Optimizer (AdamW).

    PYTHONPATH=python /usr/bin/python3 examples/pytorch/char_transformer.py
    PYTHONPATH=python /usr/bin/python3 examples/pytorch/char_transformer.py \\
        --initial-peers /ip4/.../p2p/12D3...
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import apiary

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class CharTransformer(nn.Module):
    def __init__(self, vocab, ctx=64, dim=128, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t))
        return self.head(self.blocks(h, mask=self.mask[:t, :t]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    p.add_argument("--run-id", default="chars")
    p.add_argument("--corpus", default=os.path.join(ROOT, "data", "corpus.txt"))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--target-batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=50)
    args = p.parse_args()

    text = open(args.corpus, encoding="utf-8").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(0)
    model = CharTransformer(len(chars), ctx=args.context)
    dht = apiary.DHT(initial_peers=args.initial_peers, host_maddrs=[args.listen], start=True)
    print("to join: --initial-peers", " ".join(dht.get_visible_maddrs()), flush=True)
    opt = apiary.Optimizer(dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
                           batch_size_per_step=args.batch_size,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
                           params=model.parameters(), matchmaking_time=1.0,
                           delay_optimizer_step=True)
    g = torch.Generator().manual_seed(int(time.time() * 1000) % 2**31)
    last = -1
    while opt.local_epoch < args.epochs:
        ix = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=g)
        x = torch.stack([data[i:i + args.context] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + args.context] for i in ix])
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
        loss.backward()
        opt.step()
        if opt.local_epoch != last:
            last = opt.local_epoch
            print("epoch %d loss %.4f (bits/char %.3f)" % (last, float(loss),
                                                          float(loss) / 0.6931), flush=True)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
