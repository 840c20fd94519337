"""What a checkpoint costs: seconds to write one (Federation.state_dict + an atomic torch.save),
to read one back (load + load_state_dict), its size, and those against one round, side by side.

    python benchmarks/checkpoint.py [--models simple-cnn cnn resnet20] [--n 10] [--device cpu cuda]

The round is the engine's default path (FBN, f = 3 of n: ALIE on the gradients, SF on the BN
means, nnm+median on every channel, worker momentum 0.9). `every K for 1%` is the checkpoint
interval (rounds) at which writing checkpoints costs 1% of the run; the default of one
checkpoint every 2 minutes costs write / 120 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from robustbn.checkpoint import Checkpointer  # noqa: E402
from robustbn.data import DataError, load_dataset, partition  # noqa: E402
from robustbn.engine import Federation  # noqa: E402
from robustbn.scenario import Scenario  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["simple-cnn", "cnn", "resnet20"])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--f", type=int, default=3)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    args = ap.parse_args()

    print(f"# torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    for dev in map(torch.device, args.device):
        try:
            data = load_dataset("fashion-mnist", device=dev)
        except DataError:
            data = load_dataset("synthetic-images", device=dev)
        print(f"\n## {dev.type}, {data.name}, n={args.n} (f={args.f}), batch {args.batch}, FBN; "
              f"median of {args.repeats}\n")
        print("| model | round (s) | write (s) | read (s) | size (MB) | write / round | every K for 1% |")
        print("|---|---|---|---|---|---|---|")
        for model in args.models:
            sc = Scenario.from_dict(dict(
                dataset=data.name, model=model, norm="fbn", n=args.n, f=args.f, batch_size=args.batch,
                momentum=0.9, rounds=10**6, grad_attack="alie", bn_mean_attack="sf", bn_var_attack="honest",
                grad_agg="nnm+median", bn_agg="nnm+median", device=str(dev)))
            parts = partition(data.y_train.cpu().numpy(), sc.honest, "iid", seed=0)
            fed = Federation(sc, data, parts)
            for _ in range(2):
                fed.step()
            with tempfile.TemporaryDirectory() as folder:
                ck = Checkpointer(Path(folder) / "run.pt", "run", every=1)
                write = lambda: ck.save({"round": fed.t, "federation": fed.state_dict(), "history": []})
                fresh = Federation(sc, data, parts)
                read = lambda: fresh.load_state_dict(ck.load()["federation"])
                round_s = median_seconds(fed.step, dev, args.repeats)
                write_s = median_seconds(write, dev, args.repeats)
                read_s = median_seconds(read, dev, args.repeats)
                size = ck.path.stat().st_size / 2**20
            print(f"| {model} | {round_s:.4f} | {write_s:.4f} | {read_s:.4f} | {size:.1f} | {write_s / round_s:.2f} | "
                  f"{max(1, round(100 * write_s / round_s))} |", flush=True)


if __name__ == "__main__":
    main()
