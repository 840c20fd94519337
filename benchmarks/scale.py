"""Scaling in the number of clients: seconds per round and peak memory for n = 10, 100, 1000
clients (batch 32 each, Simple-CNN, FBN, f = n/10 Byzantine sending ALIE on the gradients and
SF on the BN statistics, nnm+median on every channel), DSGD and FedAvg (one local step, so
both see n x 32 samples a round), side by side with the time per 1000 samples.

    python benchmarks/scale.py [--n 10 100 1000] [--algorithms dsgd fedavg] [--device cuda] [--client-chunk 256]

Each configuration runs in a fresh process, so its peak memory is its own (CUDA: the peak of
allocated tensors; CPU: the process's peak resident set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402


def one(n: int, algorithm: str, device: str, batch: int, chunk: int | None, repeats: int) -> dict:
    from robustbn.data import DataError, load_dataset, partition
    from robustbn.engine import Federation
    from robustbn.scenario import Scenario

    try:
        data = load_dataset("fashion-mnist", device=device)
    except DataError:
        data = load_dataset("synthetic-images", device=device)
    f = max(1, n // 10)
    sc = Scenario.from_dict(dict(
        dataset=data.name, model="simple-cnn", norm="fbn", algorithm=algorithm, n=n, f=f, batch_size=batch,
        local_steps=1, momentum=0.9, rounds=10**6, grad_attack="alie", bn_attack="sf", grad_agg="nnm+median",
        bn_agg="nnm+median", partition="iid", device=device))
    parts = partition(data.y_train.cpu().numpy(), sc.honest, "iid", seed=0)
    fed = Federation(sc, data, parts, client_chunk=chunk)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fed.step()  # warm-up
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fed.step()
        sync()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"seconds": statistics.median(times), "peak_bytes": peak, "samples": (n - f) * batch,
            "path": "vmap" if fed.vectorized else "loop"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--algorithms", nargs="+", default=["dsgd", "fedavg"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--client-chunk", type=int, default=None, help="vmap over at most this many clients at once")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", nargs=2, metavar=("N", "ALGORITHM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.device, args.batch, args.client_chunk, args.repeats)))
        return
    print(f"# torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    print(f"\n## {args.device}, Simple-CNN, FBN, batch {args.batch} per client, f = n/10, nnm+median on every channel"
          f"{f', client chunk {args.client_chunk}' if args.client_chunk else ''}; median of {args.repeats} rounds\n")
    print("| algorithm | n | path | samples / round | s / round | s per 1000 samples | vs n = "
          f"{args.n[0]} (per sample) | peak memory (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for algorithm in args.algorithms:
        base = None
        for n in args.n:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), algorithm, "--device", args.device,
                   "--batch", str(args.batch), "--repeats", str(args.repeats)]
            if args.client_chunk:
                cmd += ["--client-chunk", str(args.client_chunk)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"| {algorithm} | {n} | failed: {done.stderr.strip().splitlines()[-1]} | | | | | |", flush=True)
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            per_k = r["seconds"] / r["samples"] * 1000
            base = base or per_k
            print(f"| {algorithm} | {n} | {r['path']} | {r['samples']} | {r['seconds']:.3f} | {per_k:.3f} | "
                  f"{per_k / base:.2f} | {r['peak_bytes'] / 2**30:.2f} |", flush=True)


if __name__ == "__main__":
    main()
