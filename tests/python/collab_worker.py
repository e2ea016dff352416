"""One peer of a collaborative run, for the Optimizer tests (a child process).

usage: collab_worker.py JSON   with keys: index, peers, batch, steps, out, initial_peers,
mode ("exact": max_local_samples = batch; "free"; "delayed"), run_id, matchmaking.
Prints "ADDR <multiaddr>" once its DHT runs, "EPOCH <e>" after every step, "DONE" at the
end; saves the flat parameters to out (torch.save)."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python"))
import torch  # noqa: E402

import apiary  # noqa: E402
from model import make_model, global_batch  # noqa: E402


def main():
    a = json.loads(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = make_model()
    dht = apiary.DHT(initial_peers=a.get("initial_peers") or None,
                     host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print("ADDR", dht.get_visible_maddrs()[0], flush=True)
    n, b, i = a["peers"], a["batch"], a["index"]
    mode = a.get("mode", "exact")
    opt = apiary.Optimizer(dht=dht, run_id=a.get("run_id", "test"), target_batch_size=n * b,
                           batch_size_per_step=b,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           params=model.parameters(), matchmaking_time=a.get("matchmaking", 0.3),
                           average_state_every=0, delay_optimizer_step=(mode == "delayed"),
                           max_local_samples=b if mode == "exact" else None,
                           averaging_timeout=10.0)
    print("START", opt.local_epoch, flush=True)
    # without the exact cap a lone first peer would make whole epochs by itself
    deadline = time.monotonic() + 120
    while mode != "exact" and a["steps"] and opt.stats()["peers"] < n and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    step = 0
    while opt.local_epoch < a["steps"]:
        e = opt.local_epoch if mode == "exact" else step
        x, y = global_batch(e, n * b)
        x, y = x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        print("EPOCH", opt.local_epoch, "LOSS", float(loss), flush=True)
    torch.save(opt.flat_parameters.clone(), a["out"])
    print("DONE", flush=True)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
